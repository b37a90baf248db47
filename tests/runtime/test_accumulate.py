"""Microbatching an unmodified train step (``shardplan.runtime.accumulate``): the gradient part
per microbatch, the update once; equal to the whole-batch step (fp32, 3 steps, 1e-4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import shardplan_models as models

from shardplan.errors import ConfigError, PipelineError
from shardplan.runtime.accumulate import microbatched, reduction_kinds, split_step

RTOL = ATOL = 1e-4


def _close(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(("name", "microbatches"), [("gpt-tiny", 2), ("gpt-tiny-scan", 4),
                                                    ("llama-tiny", 2)])
def test_three_steps_equal_the_whole_batch(name: str, microbatches: int) -> None:
    # The models' step: mean cross-entropy (+ the MoE aux loss), global-norm clipping and
    # AdamW; the clip sees the accumulated gradient, as in the whole-batch step.
    config = models.load_model_config(name)
    graphdef, state = models.init_train_state(config, seed=0)
    step = models.make_train_step(graphdef)
    run = microbatched(step, microbatches=microbatches)
    ref = state
    for i in range(3):
        batch = models.example_batch(config, 8, seed=i)
        state, metrics = run(state, batch)
        ref, ref_metrics = jax.jit(step)(ref, batch)
        _close(metrics, ref_metrics)
        _close(state, ref)


def test_a_moe_step_accumulates_its_gradients_as_means() -> None:
    # Token routing with a capacity and the load-balancing loss depend on the batch each
    # microbatch sees, so the microbatched step is gradient accumulation rather than the
    # whole-batch step; its gradients are still judged means (within MEAN_SUM_RTOL).
    config = models.load_model_config("moe-tiny")
    graphdef, state = models.init_train_state(config, seed=0)
    step = models.make_train_step(graphdef)
    batch = models.example_batch(config, 8, seed=0)
    first, second = (jax.tree.map(lambda a, j=j: a[4 * j:4 * j + 4], batch) for j in range(2))
    split = split_step(step, state, first)
    kinds = reduction_kinds(step, state, first, second, split)
    assert all(k == "mean" for k, b in zip(kinds, split.cut_backward, strict=True) if b)


def _linear_step(reduce):
    def step(w, batch):
        def loss(w):
            return reduce((batch["x"] @ w - batch["y"]) ** 2)
        value, grad = jax.value_and_grad(loss)(w)
        return w - 0.01 * grad, {"loss": value, "count": jnp.sum(batch["y"] * 0 + 1)}
    return step


def _batch(n: int = 8):
    x = jnp.arange(n * 3, dtype=jnp.float32).reshape(n, 3) / 10
    return {"x": x, "y": jnp.sin(jnp.arange(n, dtype=jnp.float32))}


def test_means_and_sums_are_told_apart() -> None:
    # A sum loss accumulates its gradient as a sum, a mean loss as a mean; the example count
    # is a sum either way.
    w = jnp.ones((3,))
    for reduce, kind in ((jnp.sum, "sum"), (jnp.mean, "mean")):
        step = _linear_step(reduce)
        first, second = (jax.tree.map(lambda a, j=j: a[2 * j:2 * j + 2], _batch())
                         for j in range(2))
        split = split_step(step, w, first)
        kinds = reduction_kinds(step, w, first, second, split)
        assert kind in kinds and "sum" in kinds
        new, metrics = microbatched(step, microbatches=4)(w, _batch())
        ref, ref_metrics = step(w, _batch())
        _close((new, metrics), (ref, ref_metrics))
        assert float(metrics["count"]) == 8.0


def test_a_maximum_over_the_batch_is_refused_by_name() -> None:
    def step(w, batch):
        grad = jax.grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(w)
        return w - grad, {"worst": jnp.max(batch["x"] @ w)}

    with pytest.raises(PipelineError, match="neither a mean nor a sum") as info:
        microbatched(step, microbatches=2)(jnp.ones((3,)), _batch())
    assert "cut value" in str(info.value)


def test_a_metric_from_the_batch_shape_alone_is_refused() -> None:
    # jnp.ones_like(y).sum() reads no batch value: the update part would compute the
    # microbatch's count. The cut at twice the batch tells.
    def step(w, batch):
        grad = jax.grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(w)
        return w - grad, {"count": jnp.sum(jnp.ones_like(batch["y"]))}

    with pytest.raises(PipelineError, match="batch's shape alone"):
        microbatched(step, microbatches=2)(jnp.ones((3,)), _batch())


def test_a_step_without_gradients_is_refused() -> None:
    def step(w, batch):
        return w, {"loss": jnp.mean(batch["x"] @ w)}

    with pytest.raises(PipelineError, match="no backward pass"):
        microbatched(step, microbatches=2)(jnp.ones((3,)), _batch())


@pytest.mark.parametrize("count", [0, 3, 2.0])
def test_bad_microbatch_counts_are_named(count) -> None:
    step = _linear_step(jnp.mean)
    with pytest.raises(ConfigError, match="microbatch"):
        microbatched(step, microbatches=count)(jnp.ones((3,)), _batch())


def test_the_cut_is_the_gradients_and_the_metrics() -> None:
    # An optax step: the update part holds the optimizer; the cut is one gradient per
    # parameter leaf plus the loss.
    params = {"a": jnp.ones((3,)), "b": jnp.zeros(())}
    tx = optax.adam(1e-2)
    state = (params, tx.init(params))

    def step(state, batch):
        params, opt = state

        def loss(p):
            return jnp.mean((batch["x"] @ p["a"] + p["b"] - batch["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), value

    split = split_step(step, state, jax.tree.map(lambda a: a[:4], _batch()))
    assert sorted(str(a) for a in split.cut_avals) == ["float32[3]", "float32[]", "float32[]"]
    assert sum(split.cut_backward) == 2  # the two gradients; the loss is the forward's
    assert split.gradient_eqns > 0 and split.update_eqns > 0
    new, loss = microbatched(step, microbatches=2)(state, _batch())
    ref, ref_loss = step(state, _batch())
    _close((new, loss), (ref, ref_loss))


def test_a_linen_train_state_step() -> None:
    # A Linen MLP with flax's TrainState and its apply_gradients (optax inside), a mean loss
    # and an accuracy metric: microbatched equals the whole batch over three steps.
    from helpers.linen_case import linen_case

    state, step, batch_of = linen_case([16])
    run = microbatched(step, microbatches=4)
    ref = state
    for i in range(3):
        state, metrics = run(state, batch_of(i))
        ref, ref_metrics = jax.jit(step)(ref, batch_of(i))
        _close((state.params, state.opt_state, metrics), (ref.params, ref.opt_state,
                                                          ref_metrics))
        assert int(state.step) == int(ref.step)
