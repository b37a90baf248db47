"""Train steps written the way users write them, for the tests of how microbatches combine
(``tests/runtime/test_accumulation.py``): an NNX language model with its blocks in a Python loop,
``nnx.Dropout`` and the ``nnx.Rngs`` in its state, a token-weighted (padded-token) loss; and a
Linen ResNet with BatchNorm under flax's ``TrainState``."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state


class Block(nnx.Module):
    def __init__(self, width: int, dropout: float, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 2 * width, rngs=rngs)
        self.down = nnx.Linear(2 * width, width, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.drop(self.down(jax.nn.gelu(self.up(self.norm(x)))))


class TinyLM(nnx.Module):
    def __init__(self, vocab: int, width: int, depth: int, dropout: float,
                 rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, dropout, rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm(*, dropout: float = 0.0, weighted: bool = False, vocab: int = 32, width: int = 16,
       depth: int = 2) -> tuple[Any, Any, Any]:
    """``(step, state, batch_of)``: the NNX LM's step over ``nnx.split((model, optimizer))``
    (the ``nnx.Rngs`` in the state), its state, and ``batch_of(size, seed)``. Its loss is the
    mean cross-entropy, or with ``weighted`` the token-weighted ``sum(ce * w) / sum(w)``."""
    rngs = nnx.Rngs(0, dropout=1)
    model = TinyLM(vocab, width, depth, dropout, rngs)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state: Any, batch: dict[str, jax.Array]) -> tuple[Any, dict[str, jax.Array]]:
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model: TinyLM) -> jax.Array:
            logits = model(batch["tokens"])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            if weighted:
                return jnp.sum(ce * batch["weights"]) / jnp.sum(batch["weights"])
            return jnp.mean(ce)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), {"loss": loss}

    def batch_of(size: int, seed: int = 0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, vocab, (size, 8)).astype(np.int32)
        return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1),
                "weights": (rng.random((size, 8)) < 0.6).astype(np.float32)}

    return step, state, batch_of


class ResBlock(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        y = nn.Conv(self.channels, (3, 3), use_bias=False)(x)
        y = nn.BatchNorm(use_running_average=not train)(y)
        return nn.relu(x + y)


class ResNet(nn.Module):
    channels: int = 8
    depth: int = 2
    classes: int = 4

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = nn.relu(nn.Conv(self.channels, (3, 3))(x))
        for _ in range(self.depth):
            x = ResBlock(self.channels)(x, train)
        return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


class BNState(train_state.TrainState):
    batch_stats: Any


def resnet() -> tuple[Any, Any, Any]:
    """``(step, state, batch_of)``: a Linen ResNet with BatchNorm, flax's ``TrainState`` with
    its batch statistics, the usual ``mutable=["batch_stats"]`` step."""
    net = ResNet()
    variables = net.init(jax.random.key(0), jnp.zeros((2, 8, 8, 3)))
    state = BNState.create(apply_fn=net.apply, params=variables["params"],
                           batch_stats=variables["batch_stats"], tx=optax.adam(1e-2))

    def step(state: BNState, batch: dict[str, jax.Array]) -> tuple[BNState, dict[str, Any]]:
        def loss_fn(params: Any) -> tuple[jax.Array, Any]:
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats}, batch["images"],
                mutable=["batch_stats"])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
            return jnp.mean(ce), updates

        (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
        return state, {"loss": loss}

    def batch_of(size: int, seed: int = 0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {"images": rng.normal(size=(size, 8, 8, 3)).astype(np.float32),
                "labels": rng.integers(0, 4, size).astype(np.int32)}

    return step, state, batch_of
