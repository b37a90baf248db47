"""How microbatches of train steps users write combine (``trace/batch.py``,
``runtime/accumulate.py``): a token-weighted loss pipelined exactly; dropout and BatchNorm
planned as whole batches under exact accumulation, microbatched under gradient accumulation
semantics (``PlanConfig.accumulation="per_microbatch"``); each equal to its reference (fp32, 3
steps, 1e-4)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.pipelines import staged_plan
from helpers.user_steps import lm, resnet

import shardplan as sp
from shardplan.errors import PipelineError
from shardplan.runtime.accumulate import microbatched
from shardplan.trace.batch import batch_use

RTOL = ATOL = 1e-4
MIXED = {"a100-80g": 4, "v100-32g": 4}


def _shapes(state, batch_of, size):
    return jax.eval_shape(lambda: state), jax.eval_shape(lambda: batch_of(size))


def _one_stage(step, state, batch_of, size=16, **config):
    return sp.make_plan(step, *_shapes(state, batch_of, size),
                        cluster=sp.Cluster.local(types=MIXED),
                        config=sp.PlanConfig(max_stages=1, **config))


def _run(step, plan, state, batch_of, size=16, steps=3):
    run = sp.apply_plan(step, plan)
    outs = []
    for i in range(steps):
        state, metrics = run(state, batch_of(size, seed=i))
        outs.append(metrics)
    return run, state, outs


def _assert_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   rtol=RTOL, atol=ATOL)


def _reference(step, state, batch_of, size=16, steps=3):
    ref, outs = state, []
    for i in range(steps):
        ref, metrics = jax.jit(step)(ref, batch_of(size, seed=i))
        outs.append(metrics)
    return ref, outs


def test_a_token_weighted_loss_is_found_as_a_normaliser() -> None:
    step, state, batch_of = lm(weighted=True)
    use = batch_use(step, state, batch_of(4))
    assert len(use.normalisers) == 1 and not use.random and not use.statistics
    assert "user_steps.py:62 (" in use.normaliser_findings[0].where  # sum(weights)
    assert use.refusal("exact") is None


def test_a_token_weighted_loss_pipelined_equals_the_unsharded_step() -> None:
    # sum(ce * w) / sum(w) with random 0/1 weights over 2 stages and 2 replicas of 4 and 2
    # microbatches: each microbatch divides by the whole batch's sum(w), so their shares add
    # up to the whole-batch loss and gradients.
    step, state, batch_of = lm(weighted=True)
    plan = _one_stage(step, state, batch_of)
    piped = staged_plan(plan, [[("a100-80g", (0, 1), ("pre", "blocks.0")),
                              ("v100-32g", (4, 5), ("blocks.1", "post"))],
                             [("a100-80g", (2,), ("pre", "blocks.0")),
                              ("v100-32g", (6,), ("blocks.1", "post"))]], 2, [4, 4])
    run, new, metrics = _run(step, piped, state, batch_of)
    ref, ref_metrics = _reference(step, state, batch_of)
    _assert_close((new, metrics), (ref, ref_metrics))
    assert run._form is not None and run._ready.kinds == tuple("sum" for _ in run._ready.kinds)


def _resnet_stages(plan, counts, microbatch_size, accumulation="exact"):
    """``plan`` rewritten as 2 stages per replica (A100s: the stem and the first block;
    V100s: the second block and the head), one replica per count."""
    groups = [[("a100-80g", (0, 1), ("pre", "params.ResBlock_0")),
               ("v100-32g", (4, 5), ("params.ResBlock_1", "post"))],
              [("a100-80g", (2, 3), ("pre", "params.ResBlock_0")),
               ("v100-32g", (6, 7), ("params.ResBlock_1", "post"))]][:len(counts)]
    plan = dataclasses.replace(  # every leaf replicated, as staged_plan's layouts hold them
        plan, accumulation=accumulation,
        param_specs={k: (0, tuple(() for _ in spec)) for k, (_, spec) in plan.param_specs.items()})
    return staged_plan(plan, groups, microbatch_size, counts)


def test_batchnorm_is_planned_as_whole_batches_and_says_why() -> None:
    # Under exact accumulation the planner keeps the batch whole (one replica, one
    # microbatch): BatchNorm's statistics are the batch's, and the run equals the unsharded
    # step, statistics included.
    step, state, batch_of = resnet()
    plan = sp.make_plan(step, *_shapes(state, batch_of, 16),
                        cluster=sp.Cluster.local(types=MIXED))
    assert plan.microbatches == 1 and len(plan.replicas) <= 1
    summary = plan.summary()
    assert "Whole-batch stages" in summary and "batch normalisation" in summary
    assert "user_steps.py:" in summary and "ResBlock.__call__" in summary
    assert 'PlanConfig(accumulation="per_microbatch")' in summary
    _, new, metrics = _run(step, plan, state, batch_of)
    _assert_close((new, metrics), _reference(step, state, batch_of))
    # two stages on two device types, the whole batch through both: the same
    piped = _resnet_stages(_one_stage(step, state, batch_of), [1], 16)
    _, new, metrics = _run(step, piped, state, batch_of)
    _assert_close((new, metrics), _reference(step, state, batch_of))


def test_microbatching_batchnorm_is_refused_by_name_unless_per_microbatch() -> None:
    step, state, batch_of = resnet()
    plan = _one_stage(step, state, batch_of)
    with pytest.raises(PipelineError, match=r"(?s)batch normalisation.*ResBlock.__call__.*"
                                            r"accumulation=\"per_microbatch\""):
        _run(step, _resnet_stages(plan, [4], 4), state, batch_of, steps=1)
    with pytest.raises(PipelineError, match="microbatch_sizes"):
        sp.make_plan(step, *_shapes(state, batch_of, 16), cluster=sp.Cluster.local(types=MIXED),
                     config=sp.PlanConfig(microbatch_sizes=(4,)))


def _accumulated_reference(step, state, batch_of, microbatches, size=16, steps=3):
    """Gradient accumulation written out by hand for the ResNet's step: per microbatch its
    gradients and batch statistics, their means applied once."""
    def grads_of(state, mb):
        def loss_fn(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats}, mb["images"],
                mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, mb["labels"]).mean(), updates
        (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return loss, updates["batch_stats"], grads

    grads_of = jax.jit(grads_of)
    outs, each = [], size // microbatches
    for i in range(steps):
        batch = batch_of(size, seed=i)
        parts = [grads_of(state, jax.tree.map(lambda x, j=j: x[j * each:(j + 1) * each],
                                              batch)) for j in range(microbatches)]
        loss, stats, grads = jax.tree.map(lambda *xs: sum(xs) / microbatches, *parts)
        state = state.apply_gradients(grads=grads, batch_stats=stats)
        outs.append({"loss": loss})
    return state, outs


def test_batchnorm_per_microbatch_is_gradient_accumulation() -> None:
    # Opted in: 2 replicas of 2 stages, 2 microbatches each; every microbatch normalises by
    # its own statistics, the gradients and running statistics are their means.
    step, state, batch_of = resnet()
    plan = sp.make_plan(step, *_shapes(state, batch_of, 16),
                        cluster=sp.Cluster.local(types=MIXED),
                        config=sp.PlanConfig(accumulation="per_microbatch"))
    assert plan.accumulation == "per_microbatch"
    assert "gradient accumulation semantics" in plan.summary()
    piped = _resnet_stages(_one_stage(step, state, batch_of), [2, 2], 4, "per_microbatch")
    _, new, metrics = _run(step, piped, state, batch_of)
    _assert_close((new, metrics), _accumulated_reference(step, state, batch_of, 4))


def _lm_stages(plan, counts, microbatch_size, accumulation="exact"):
    """``plan`` rewritten as 2 stages per replica of the NNX LM (A100s: the embedding and the
    first block; V100s: the second block and the head), one replica per count."""
    groups = [[("a100-80g", (0, 1), ("pre", "blocks.0")),
               ("v100-32g", (4, 5), ("blocks.1", "post"))],
              [("a100-80g", (2, 3), ("pre", "blocks.0")),
               ("v100-32g", (6, 7), ("blocks.1", "post"))]][:len(counts)]
    return dataclasses.replace(staged_plan(plan, groups, microbatch_size, counts),
                               accumulation=accumulation)


def test_dropout_is_planned_as_whole_batches_and_equals_the_unsharded_step() -> None:
    # nnx.Dropout with the nnx.Rngs in the state: under exact accumulation the stages see
    # the whole batch, so each draws the very numbers the unsharded step draws.
    step, state, batch_of = lm(dropout=0.1)
    plan = sp.make_plan(step, *_shapes(state, batch_of, 16),
                        cluster=sp.Cluster.local(types=MIXED))
    assert plan.microbatches == 1 and len(plan.replicas) <= 1
    summary = plan.summary()
    assert "Whole-batch stages" in summary and "dropout" in summary
    assert "Block.__call__" in summary
    reference = _reference(step, state, batch_of)
    _, new, metrics = _run(step, plan, state, batch_of)
    _assert_close((new, metrics), reference)
    _, new, metrics = _run(step, _lm_stages(_one_stage(step, state, batch_of), [1], 16), state,
                           batch_of)
    _assert_close((new, metrics), reference)


def test_dropout_per_microbatch_is_deterministic_gradient_accumulation() -> None:
    # Opted in: 2 replicas of 2 stages, 2 microbatches each. Every microbatch folds its first
    # sample's index into the key of each draw, on whichever stage the draw runs: the run
    # equals the same accumulation on one device, and two runs are bit-identical.
    step, state, batch_of = lm(dropout=0.1)
    plan = sp.make_plan(step, *_shapes(state, batch_of, 16),
                        cluster=sp.Cluster.local(types=MIXED),
                        config=sp.PlanConfig(accumulation="per_microbatch",
                                             microbatch_sizes=(4,)))
    assert plan.microbatches == 4 and "gradient accumulation semantics" in plan.summary()
    piped = _lm_stages(_one_stage(step, state, batch_of), [2, 2], 4, "per_microbatch")
    _, first, first_metrics = _run(step, piped, state, batch_of)
    _, again, again_metrics = _run(step, piped, state, batch_of)
    for x, y in zip(jax.tree.leaves((first, first_metrics)),
                    jax.tree.leaves((again, again_metrics)), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    accumulated = microbatched(step, microbatches=4, accumulation="per_microbatch")
    ref, ref_metrics = state, []
    for i in range(3):
        ref, metrics = accumulated(ref, batch_of(16, seed=i))
        ref_metrics.append(metrics)
    _assert_close((first, first_metrics), (ref, ref_metrics))
    # the whole-batch step draws other masks: the run is not it
    whole, _ = _reference(step, state, batch_of)
    floats = [(x, y) for x, y in zip(jax.tree.leaves(first), jax.tree.leaves(whole), strict=True)
              if jax.dtypes.issubdtype(x.dtype, np.floating)]
    assert not all(np.allclose(x, y, rtol=RTOL, atol=ATOL) for x, y in floats)


def test_without_dropout_the_pipelined_step_equals_the_unsharded_step() -> None:
    step, state, batch_of = lm(dropout=0.0)
    piped = _lm_stages(_one_stage(step, state, batch_of), [2, 2], 4, "per_microbatch")
    _, new, metrics = _run(step, piped, state, batch_of)
    _assert_close((new, metrics), _reference(step, state, batch_of))


def test_a_draw_whose_key_is_made_inside_a_jit_cannot_be_folded() -> None:
    # The key exists only inside the jitted function: there is no typed key to fold with the
    # microbatch's index, and the refusal says where and what to pass instead.
    def step(state, x):
        w, raw = state

        @jax.jit
        def noisy(raw, x):
            return x * jax.random.bernoulli(jax.random.wrap_key_data(raw), 0.9, x.shape)

        loss, grad = jax.value_and_grad(lambda w: jnp.mean((noisy(raw, x) @ w) ** 2))(w)
        return (w - 0.1 * grad, raw), {"loss": loss}

    state = (jnp.ones((3, 2)), jax.random.key_data(jax.random.key(0)))
    x = jnp.arange(24.0).reshape(8, 3)
    with pytest.raises(PipelineError, match=r"(?s)no typed key.*test_accumulation.py.*"
                                            r"jax.random.key"):
        microbatched(step, microbatches=2, accumulation="per_microbatch")(state, x)
