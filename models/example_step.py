"""A user's own train step, as ``shardplan trace`` / ``shardplan plan`` take it.

A small language model in Flax NNX (an embedding, blocks of layer norm and MLP written as a
Python loop, a head), optax Adam, and a factory with no required arguments that returns
``(train_step, state, batch)``. Nothing here is written for shardplan: point the command line
at the factory.

.. code-block:: bash

    shardplan trace models/example_step.py:make_step
    shardplan plan models/example_step.py:make_step --types a100-80g=4,v100-32g=4

Example:
    >>> train_step, state, batch = make_step()
    >>> batch["inputs"].shape
    (8, 16)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

__all__ = ["TinyLM", "make_step"]

VOCAB, D_MODEL, D_FF, N_LAYERS = 256, 64, 256, 4
"""Tiny sizes: the model has 0.17 M parameters; tracing and planning take seconds on a CPU."""
BATCH, SEQ_LEN = 8, 16


class Block(nnx.Module):
    """Pre-norm residual MLP: ``x + down(gelu(up(norm(x))))``."""

    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, d_ff, rngs=rngs)
        self.down = nnx.Linear(d_ff, d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # [batch, seq, d_model]
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class TinyLM(nnx.Module):
    """Token embedding, ``n_layers`` :class:`Block`\\ s in a Python loop, a final norm and an
    output head."""

    def __init__(
        self, vocab: int, d_model: int, d_ff: int, n_layers: int, *, rngs: nnx.Rngs
    ) -> None:
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, d_ff, rngs=rngs) for _ in range(n_layers)])
        self.norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:  # [batch, seq] -> [batch, seq, vocab]
        x = self.embed(tokens)  # [batch, seq, d_model]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


Batch = dict[str, Any]
"""``{"inputs": int32[batch, seq], "targets": int32[batch, seq]}``."""


def make_step(*, abstract: bool = True) -> tuple[Callable[..., Any], nnx.State, Batch]:
    """The train step, its state and a batch.

    Args:
      abstract: state and batch as ``jax.ShapeDtypeStruct``\\ s (nothing allocated; all that
        planning needs); ``False`` initialises real arrays, so the step can run.

    Returns:
      ``(train_step, state, batch)``: ``train_step(state, batch) -> (state, metrics)`` over
      ``nnx.split((model, optimizer))``.
    """

    def build() -> tuple[TinyLM, nnx.Optimizer]:
        model = TinyLM(VOCAB, D_MODEL, D_FF, N_LAYERS, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    graphdef, state = nnx.split(nnx.eval_shape(build) if abstract else build())

    def train_step(state: nnx.State, batch: Batch) -> tuple[nnx.State, dict[str, jax.Array]]:
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model: TinyLM) -> jax.Array:
            logits = model(batch["inputs"])  # [batch, seq, vocab]
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), {"loss": loss}

    tokens = jax.ShapeDtypeStruct((BATCH, SEQ_LEN), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    if not abstract:
        batch = {k: jnp.zeros(v.shape, v.dtype) for k, v in batch.items()}
    return train_step, state, batch
