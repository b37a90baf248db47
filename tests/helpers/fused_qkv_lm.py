"""A GPT-2-style NNX language model as users write one: a Python loop over blocks, one fused
``q, k, v`` projection split three ways (as HuggingFace's GPT-2 does), 25 heads of 64, a
causal ``where`` mask and tied input / output embeddings. Built abstractly: nothing is
allocated. GPT-2 XL's width (d_model 1600, context 1024) with 2 blocks and a small vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

D_MODEL, HEADS, SEQ, BLOCKS, VOCAB = 1600, 25, 1024, 2, 1024


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.qkv = nnx.Linear(D_MODEL, 3 * D_MODEL, rngs=rngs)
        self.proj = nnx.Linear(D_MODEL, D_MODEL, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.fc = nnx.Linear(D_MODEL, 4 * D_MODEL, rngs=rngs)
        self.out = nnx.Linear(4 * D_MODEL, D_MODEL, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        q, k, v = (t.reshape(b, s, HEADS, D_MODEL // HEADS) for t in (q, k, v))
        w = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (D_MODEL // HEADS) ** 0.5
        w = jnp.where(jnp.tril(jnp.ones((s, s), bool)), w, -1e9)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(w, -1), v).reshape(b, s, D_MODEL)
        x = x + self.proj(a)
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


class LM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, D_MODEL, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(BLOCKS)])
        self.ln = nnx.LayerNorm(D_MODEL, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.ln(x))


def abstract_case(batch: int):
    """``(step, state, ids)``: the user's train step (AdamW), the abstract state and batch."""

    def build():
        model = LM(nnx.Rngs(0))
        return nnx.split((model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)))

    graphdef, _ = nnx.eval_shape(build)
    state = jax.eval_shape(lambda: build()[1])

    def step(state, ids):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(m):
            logits = m(ids)[:, :-1]
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), {"loss": loss}

    return step, state, jax.ShapeDtypeStruct((batch, SEQ), jnp.int32)
