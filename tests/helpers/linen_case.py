"""The Linen train step the runtime tests share: an MLP with flax's ``TrainState`` (its
``apply_gradients`` runs ``clip_by_global_norm`` + AdamW), a mean cross-entropy loss and an
accuracy metric."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state


class MLP(nn.Module):
    widths: tuple[int, ...]
    classes: int = 4

    @nn.compact
    def __call__(self, x: Any) -> Any:
        for i, width in enumerate(self.widths):
            x = nn.relu(nn.Dense(width, name=f"hidden_{i}")(x))
        return nn.Dense(self.classes, name="head")(x)


def linen_case(widths: Sequence[int], *, batch: int = 16, features: int = 8,
               ) -> tuple[Any, Callable[..., Any], Callable[[int], Any]]:
    """``(state, step, batch_of)``: the initial ``TrainState``, the train step and
    ``batch_of(i)``, the ``i``-th batch."""
    model = MLP(tuple(widths))

    def batch_of(i: int) -> dict[str, jax.Array]:
        return {"x": jax.random.normal(jax.random.key(10 + i), (batch, features)),
                "y": jax.random.randint(jax.random.key(20 + i), (batch,), 0, model.classes)}

    state = train_state.TrainState.create(
        apply_fn=model.apply,
        params=model.init(jax.random.key(2), batch_of(0)["x"][:1])["params"],
        tx=optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)))

    def step(state: Any, batch: Any) -> Any:
        def loss(params: Any) -> Any:
            logits = state.apply_fn({"params": params}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["y"]).mean(), logits
        (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
        return state.apply_gradients(grads=grads), {"loss": value, "accuracy": accuracy}

    return state, step, batch_of
