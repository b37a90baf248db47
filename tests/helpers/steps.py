"""Small train steps the planner and runtime tests share."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def mlp_step(width: int, batch: int, layers: int = 6, learning_rate: float = 1e-2):
    """Alpa's test MLP: Dense layers with bias and ReLU, MSE against ones, Adam (lr 1e-2)."""
    params = [{"kernel": jax.ShapeDtypeStruct((width, width), jnp.float32),
               "bias": jax.ShapeDtypeStruct((width,), jnp.float32)} for _ in range(layers)]
    tx = optax.adam(learning_rate)
    opt = jax.eval_shape(tx.init, params)

    def step(state, x):
        params, opt_state = state

        def loss(p):
            h = x
            for i, layer in enumerate(p):
                h = h @ layer["kernel"] + layer["bias"]
                if i < len(p) - 1:
                    h = jax.nn.relu(h)
            return jnp.mean((h - 1.0) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    return step, (params, opt), jax.ShapeDtypeStruct((batch, width), jnp.float32)
