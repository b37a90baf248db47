"""Plans checked against what they are applied to, against XLA, and against the clock.

A plan applied to another model or batch names the leaf that differs; ``sp.check_plan`` also
names another layer count or cluster. Before the first step the planned programs are compiled
and XLA's figures recorded; a plan whose compiled memory exceeds its devices is refused before
anything runs; after the timed steps the measured step time is recorded;
``plan.report()`` shows predicted | compiled | measured.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.steps import mlp_step

import shardplan as sp

WIDTH, BATCH = 32, 16


@pytest.fixture(scope="module")
def cluster() -> sp.Cluster:
    return sp.Cluster.local(devices=jax.devices()[:4])


def _state(width: int = WIDTH, layers: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    params = [{"kernel": jnp.asarray(rng.normal(size=(width, width)) / 4, jnp.float32),
               "bias": jnp.asarray(rng.normal(size=(width,)) / 4, jnp.float32)}
              for _ in range(layers)]
    return params, optax.adam(1e-3).init(params)


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


@pytest.fixture(scope="module")
def planned(cluster):
    step, state, x = mlp_step(WIDTH, BATCH, layers=2, learning_rate=1e-3)
    plan = sp.make_plan(step, state, x, cluster=cluster, config=sp.PlanConfig(time_limit_s=5))
    return step, plan


def test_the_plan_records_what_it_was_made_for(planned, cluster) -> None:
    _, plan = planned
    assert plan.state_types["0/1/kernel"] == "float32[32,32]"
    assert plan.batch_types == {"": "float32[16,32]"}
    assert plan.cluster_info == {"name": cluster.name, "device_types": {
        "cpu": {"count": 4, "memory_bytes": cluster.groups[0].device.memory_bytes}}}
    assert sp.Plan.from_json(plan.to_json()) == plan


def test_a_plan_for_another_model_names_the_leaf_that_differs(planned) -> None:
    _, plan = planned
    wide, _, _ = mlp_step(2 * WIDTH, BATCH, layers=2)
    run = sp.apply_plan(wide, plan)
    state = _state(2 * WIDTH)
    with pytest.raises(sp.PlanMismatchError,
                       match=r"(?s)state/0/0/bias: the plan has float32\[32\], the step gets "
                             r"float32\[64\].*fix:"):
        run(state, jnp.ones((BATCH, 2 * WIDTH)))
    assert all(not leaf.is_deleted() for leaf in jax.tree.leaves(state))  # nothing consumed


def test_a_plan_for_another_batch_size_names_the_batch(planned) -> None:
    step, plan = planned
    with pytest.raises(sp.PlanMismatchError,
                       match=r"batch/: the plan has float32\[16,32\], the step gets "
                             r"float32\[8,32\]"):
        sp.apply_plan(step, plan)(_state(), jnp.ones((8, WIDTH)))


def test_check_plan_names_the_layers_no_stage_runs_and_another_cluster(planned, cluster) -> None:
    step, plan = planned
    sp.check_plan(step, plan, *_abstract((_state(), jnp.ones((BATCH, WIDTH)))), cluster=cluster)
    deeper, state, x = mlp_step(WIDTH, BATCH, layers=3)
    with pytest.raises(sp.PlanMismatchError, match=r"(?s)state/0/2/bias.*layers: the step's "
                                                   r".* run in no stage of the plan"):
        sp.check_plan(deeper, plan, state, x)
    other = sp.Cluster.local(types={"a100-80g": 2, "v100-32g": 2}, devices=jax.devices()[:4])
    with pytest.raises(sp.PlanMismatchError,
                       match=r"(?s)devices a100-80g: the plan's cluster has none, this one 2 "
                             r"of 80 GB.*devices cpu: the plan's cluster has 4 of"):
        sp.check_plan(step, plan, state, jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32),
                      cluster=other)


def test_the_compiled_plan_is_recorded_and_the_steps_timed(planned) -> None:
    step, plan = planned
    run = sp.apply_plan(step, plan, measure_steps=3)
    assert run.plan.compiled == {} and run.plan.measured == {}
    state, x = _state(), jnp.ones((BATCH, WIDTH))
    state, _ = run(state, x)
    (program,) = run.plan.compiled["programs"]
    assert program["stage"] == 0 and program["memory_bytes"] > 0
    assert program["flops"] == pytest.approx(plan.predicted.stage_flops[0], rel=0.1)
    assert run.plan.measured == {}
    for _ in range(3):
        state, _ = run(state, x)
    measured = run.plan.measured
    assert measured["steps"] == 3 and measured["step_time_s"] > 0
    assert measured["stage_time_s"] == {"0": measured["step_time_s"]}
    # Recorded figures travel with the plan file but are not part of its identity.
    again = sp.Plan.from_json(run.plan.to_json())
    assert again.measured == measured and again == plan
    assert again.content_hash == plan.content_hash
    report = again.report()
    assert "median of 3 steps" in report and max(map(len, report.splitlines())) <= 100


def test_a_compiled_plan_that_does_not_fit_is_refused_before_it_runs(planned) -> None:
    step, plan = planned
    # The same plan, said to be for devices of 4 KiB: XLA's figure exceeds them.
    small = dataclasses.replace(plan, cluster_info={"name": "small", "device_types": {
        "cpu": {"count": 4, "memory_bytes": 4096}}})
    state = _state()
    with pytest.raises(sp.InfeasibleError,
                       match=r"(?s)does not fit: program 'step' of stage 0 needs .* per "
                             r"device, more than one cpu's memory \(4.00 KiB.*stages\[0\].*"
                             r"memory_budget_bytes="):
        sp.apply_plan(step, small)(state, jnp.ones((BATCH, WIDTH)))
    assert all(not leaf.is_deleted() for leaf in jax.tree.leaves(state))  # the state survives


def test_a_compiled_program_over_the_budget_the_plan_was_made_for_is_refused(planned) -> None:
    step, plan = planned
    # The plan records the memory it was made for; a device of ample capacity does not
    # excuse a program over it.
    assert plan.solver["memory_budget_bytes"]["cpu"] > 0
    need = max(plan.predicted.memory_bytes.values())
    tight = dataclasses.replace(plan, solver={**plan.solver,
                                              "memory_budget_bytes": {"cpu": need // 2}})
    state = _state()
    with pytest.raises(sp.InfeasibleError,
                       match=r"(?s)does not fit: program 'step' of stage 0 .* more than the "
                             r"memory the plan was made for .*allowed_bytes.*"
                             r"memory_budget_bytes="):
        sp.apply_plan(step, tight)(state, jnp.ones((BATCH, WIDTH)))
    assert all(not leaf.is_deleted() for leaf in jax.tree.leaves(state))


def test_a_compiled_program_far_over_its_prediction_is_warned_about(planned) -> None:
    step, plan = planned
    # The same plan, as if it had predicted half of what XLA compiles.
    half = {d: m // 2 for d, m in plan.predicted.memory_bytes.items()}
    low = dataclasses.replace(plan, predicted=dataclasses.replace(plan.predicted,
                                                                  memory_bytes=half))
    with pytest.warns(sp.ShardplanWarning, match=r"(?s)compiled to .* 2\.\d\dx the stage's "
                                                 r"predicted peak.*stages\[0\]"):
        sp.apply_plan(step, low, measure_steps=0)(_state(), jnp.ones((BATCH, WIDTH)))


def test_verification_can_be_turned_off(planned) -> None:
    step, plan = planned
    run = sp.apply_plan(step, plan, verify=False, measure_steps=0)
    state, x = _state(), jnp.ones((BATCH, WIDTH))
    for _ in range(3):
        state, _ = run(state, x)
    assert run.plan.compiled == {} and run.plan.measured == {}
    assert "compiled: - (the plan has not run" in run.plan.report()


def test_a_state_the_call_places_is_copied_not_consumed(planned) -> None:
    # The state is donated; one that the call has to place (here: on one device, going to a
    # 4-device mesh) is copied first, so the caller's arrays stay readable.
    step, plan = planned
    state = jax.device_put(_state(), jax.devices()[0])
    sp.apply_plan(step, plan)(state, jnp.ones((BATCH, WIDTH)))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
