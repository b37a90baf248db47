"""Alpa's MLP-MP case end to end (§A1.1 of the external cases): plan, compile, count, run.

Six Flax ``Dense`` layers 256 -> 256 with bias and ReLU between them, an MSE loss against a
ones target, Adam (lr 1e-2), a batch of 32, on 4 local CPU devices. Alpa expects Megatron
column/row pairs (Dense_0/2/4 column-split 4-way, Dense_1/3/5 row-split) and exactly
layers - 1 = 5 all-reduces of one ``[32, 256]`` f32 activation (32 * 256 * 4 = 32,768 bytes
each, 163,840 in all), nothing else. Alpa's meshes for it, (4, 1) and (1, 4), have one axis
of 4 (an axis of size 1 is no axis), so the case is planned with ``max_mesh_axes=1``.

On the default two-axis search the 4 devices are the 2 x 2 mesh, which holds the Megatron
plan (the 4-way split over both axes) and also 2-D tensor-parallel plans a single axis
cannot express; the tests check that the Megatron plan moved onto 2 x 2 compiles to the same
5 all-reduces (the premise of :func:`shardplan.planner.mesh.candidate_meshes`: a coarser
mesh's plans are its refinement's plans, for the cost model and for XLA), and that whatever
the default search picks costs no more than the Megatron plan, compiles to the collectives it
predicts and to no more than Megatron's: at most 5 non-scalar all-reduces and 163,840 bytes.
A 2-D tensor-parallel plan of 10 two-device all-reduces of 16 KiB and an all-gather moves
about the same bytes in twice the calls; the cost model's per-call start-up
(:mod:`shardplan.cost.collectives`) prices those calls, so it is not chosen.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardplan as sp
from shardplan.plan import MeshSpec
from shardplan.xla import read_compiled

WIDTH, BATCH, LAYERS = 256, 32, 6
ACTIVATION_BYTES = BATCH * WIDTH * 4  # one [32, 256] f32 activation: 32,768 bytes
COLUMN, ROW = ((), ("inner",)), (("inner",), ())
ADAM = optax.adam(1e-2, eps=1e-6)
"""Alpa's Adam (lr 1e-2) with ``eps`` 1e-6 for 1e-8: ReLU leaves some kernel entries a
gradient that is only round-off (layer 0's [9, 188] is -2.4e-10 where the median is 2e-4),
and Adam moves such an entry by ``lr * g / (|g| + eps)``, 2.4e-4 at eps 1e-8: more than the
1e-4 tolerance, and set by the order of the sum, which sharding changes. At eps 1e-6 it
moves 2.4e-6; the shardings and collectives do not depend on eps (an elementwise op)."""


class MLP(nnx.Module):
    """Alpa's test MLP: ``LAYERS`` Dense layers with bias, ReLU between them."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(LAYERS)])

    def __call__(self, x: jax.Array) -> jax.Array:  # [batch, width] -> [batch, width]
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < LAYERS - 1:
                x = jax.nn.relu(x)
        return x


@pytest.fixture(scope="module")
def case():
    """``(step, state, batch, cluster)``: the user's NNX train step, unmodified."""
    model = MLP(nnx.Rngs(0))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, ADAM, wrt=nnx.Param)))

    def step(state, x):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - 1.0) ** 2))(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), {"loss": loss}

    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH), jnp.float32)
    return step, state, x, sp.Cluster.local(devices=jax.devices()[:4])


def _kernel_specs(plan: sp.Plan) -> list[object]:
    return [plan.param_specs[f"0/layers/{i}/kernel/value"][1] for i in range(LAYERS)]


def _collectives(step, plan: sp.Plan, state, x):
    """The compiled program's collectives, every one (scalar ones included)."""
    (compiled,) = sp.apply_plan(step, plan).compiled(state, x)
    return read_compiled(compiled).collectives


def _assert_runs_like_the_unsharded_step(step, plan: sp.Plan, state, x) -> None:
    run = sp.apply_plan(step, plan)
    ref, got = state, jax.tree.map(jnp.copy, state)
    for _ in range(3):
        ref, ref_metrics = jax.jit(step)(ref, x)
        got, metrics = run(got, x)
        np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-4, atol=1e-4)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def megatron(case) -> sp.Plan:
    step, state, x, cluster = case
    return sp.make_plan(step, state, x, cluster=cluster, config=sp.PlanConfig(max_mesh_axes=1))


def test_one_axis_plan_is_megatron_with_five_activation_all_reduces(case, megatron) -> None:
    step, state, x, _ = case
    assert megatron.stages[0].mesh.axis_sizes == (4,)
    assert _kernel_specs(megatron) == [COLUMN, ROW] * 3
    # Exactly layers - 1 all-reduces, each of one [32, 256] f32 activation over all 4
    # devices, and nothing else (no scalar all-reduce either: the row-split output is whole).
    collectives = _collectives(step, megatron, state, x)
    assert [(c.kind, c.bytes, c.replica_groups) for c in collectives] == [
        ("all-reduce", ACTIVATION_BYTES, ((0, 1, 2, 3),))] * (LAYERS - 1)
    assert sum(c.bytes for c in collectives) == 163_840
    # The cost model predicted these collectives, kind by kind, count and bytes.
    assert {k: dict(v) for k, v in megatron.predicted.collectives.items() if v["count"]} == {
        "all-reduce": {"count": LAYERS - 1, "bytes": 163_840}}
    _assert_runs_like_the_unsharded_step(step, megatron, state, x)


def _refined(plan: sp.Plan) -> sp.Plan:
    """``plan`` with its one axis of 4 (``inner``) spelled as both axes of a 2 x 2 mesh."""

    def refine(value: object) -> object:
        if isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
            return tuple(a for v in value for a in (("outer", "inner") if v == "inner" else (v,)))
        return tuple(refine(v) for v in value) if isinstance(value, tuple) else value

    (stage,) = plan.stages
    mesh = MeshSpec(("outer", "inner"), (2, 2), stage.mesh.device_ids)
    return dataclasses.replace(
        plan, stages=(dataclasses.replace(stage, mesh=mesh),),
        param_specs={k: refine(v) for k, v in plan.param_specs.items()},
        batch_specs={k: refine(v) for k, v in plan.batch_specs.items()},
        constraints={k: refine(v) for k, v in plan.constraints.items()})


def test_megatron_on_the_refined_2x2_mesh_compiles_to_the_same_all_reduces(case,
                                                                           megatron) -> None:
    # candidate_meshes solves only the finest meshes because a coarse mesh's plan is a plan
    # of its refinement (a factor takes adjacent axes): XLA compiles a split over
    # ("outer", "inner") into the same collectives as one over a single axis of 4.
    step, state, x, _ = case
    fine = _refined(megatron)
    assert _kernel_specs(fine)[:2] == [((), ("outer", "inner")), (("outer", "inner"), ())]
    want = [(c.kind, c.bytes, c.replica_groups) for c in _collectives(step, megatron, state, x)]
    got = [(c.kind, c.bytes, c.replica_groups) for c in _collectives(step, fine, state, x)]
    assert got == want


def test_default_two_axis_plan_costs_no_more_and_compiles_to_its_prediction(case,
                                                                            megatron) -> None:
    step, state, x, cluster = case
    plan = sp.make_plan(step, state, x, cluster=cluster)
    assert plan.stages[0].mesh.axis_sizes == (2, 2)
    # The 2 x 2 mesh holds the Megatron plan, so its optimum is no worse (the solver stops
    # within relative_gap of its bound).
    gap = sp.PlanConfig().relative_gap
    assert plan.solver["objective_s"] <= megatron.solver["objective_s"] * (1 + gap)
    # Whatever it chose moves the bytes the cost model predicts, kind by kind; XLA may
    # combine the scalar loss all-reduce into another, never add one.
    compiled = read_compiled(sp.apply_plan(step, plan).compiled(state, x)[0])
    summary = compiled.collective_summary()
    predicted = {k: v for k, v in plan.predicted.collectives.items() if v["count"]}
    assert set(summary) == set(predicted)
    for kind, entry in summary.items():
        assert entry["bytes"] == predicted[kind]["bytes"], kind
        assert entry["count"] <= predicted[kind]["count"], kind
    # No more collectives than Megatron's (issue 20): at most layers - 1 = 5 non-scalar
    # all-reduces, and no more non-scalar bytes than its 5 x 32,768 = 163,840.
    # (Counts are executions, bytes x count: a collective in a loop counts every trip.)
    non_scalar = compiled.collective_summary(include_scalar=False)
    assert non_scalar.get("all-reduce", {"count": 0})["count"] <= LAYERS - 1
    assert sum(entry["bytes"] for entry in non_scalar.values()) <= 163_840
    _assert_runs_like_the_unsharded_step(step, plan, state, x)
