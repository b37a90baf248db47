"""make_plan with the stage planner: multi-stage plans on mixed clusters, their checks, their
determinism and the infeasibility report."""

from __future__ import annotations

import json

import pytest
from test_planner_intraop import mlp_step

import shardplan as sp
from shardplan.errors import ConfigError, InfeasibleError, PipelineError, PlanMismatchError
from shardplan.plan.plan import Layout, MeshSpec, Predicted, ReplicaSpec, Stage
from shardplan.planner.multi import allocate_devices, batch_size, microbatch_candidates

MIXED = {"a100-80g": 4, "v100-32g": 4}


@pytest.fixture(scope="module")
def mixed_plan():
    # A batch large enough that the V100s pay for the gradient all-reduce over their slower
    # link to the A100s: the planner uses both types.
    step, state, x = mlp_step(1024, 8192, learning_rate=1e-3)
    cluster = sp.Cluster.local(types=MIXED)
    # A generous limit: the exact search ends in seconds, proven optimal, however loaded the
    # machine (the plan must not depend on when a deadline falls).
    config = sp.PlanConfig(stage_time_limit_s=120.0)
    plan = sp.make_plan(step, state, x, cluster=cluster, config=config)
    return step, state, x, cluster, config, plan


def test_a_mixed_cluster_gets_stages_on_both_device_types(mixed_plan) -> None:
    _, _, x, cluster, _, plan = mixed_plan
    assert {s.device_type for s in plan.stages} == {"a100-80g", "v100-32g"}
    for stage in plan.stages:  # every stage's devices are of its type
        assert {cluster.group_of(d).device.name for d in stage.mesh.device_ids} == {
            stage.device_type}
    used = [d for s in plan.stages for d in s.mesh.device_ids]
    assert len(used) == len(set(used)) <= 8
    # Replicas cover the batch with one microbatch size; each covers every layer in order.
    assert plan.microbatch_size * plan.microbatches == x.shape[0]
    names = [layer for layer in plan.stages[plan.replicas[0].stages[0]].layers
             if layer != "shared"]
    for replica in plan.replicas:
        layers = [n for s in replica.stages for n in plan.stages[s].layers if n != "shared"]
        assert layers[0] == names[0] and layers[-1] == "post" and len(set(layers)) == len(layers)
    # Memory: every device within the device's memory less the default 10 % headroom.
    for stage in plan.stages:
        device = cluster.group_of(stage.mesh.device_ids[0]).device
        for d in stage.mesh.device_ids:
            assert plan.predicted.memory_bytes[d] <= 0.9 * device.memory_bytes
    assert plan.solver["status"] == "optimal"
    sim = plan.solver["simulated_step_s"]
    # The event simulator, independent of the closed form, agrees within 2 %.
    assert isinstance(sim, float) and abs(sim / plan.predicted.step_time_s - 1) <= 0.02


def test_the_plan_round_trips_and_summarises_per_device_type(mixed_plan) -> None:
    *_, plan = mixed_plan
    assert sp.Plan.from_json(plan.to_json()) == plan
    text = plan.summary()
    assert all(len(line) <= 100 for line in text.splitlines())
    assert "Device types" in text and "a100-80g:" in text and "v100-32g:" in text
    assert "Replicas" in text and "planning took" in text
    assert "candidates, predicted / simulated step:" in text and "(chosen)" in text
    assert plan.solver["chosen"] in plan.solver["candidates"]
    for stage in plan.stages:  # each layout's specs use its stages' mesh axes
        layout = plan.layouts[stage.layout]
        for spec in layout.param_specs.values():
            assert {a for dim in spec for a in dim} <= set(stage.mesh.axis_names)


def test_same_inputs_give_a_byte_identical_plan_file(mixed_plan) -> None:
    step, state, x, cluster, config, plan = mixed_plan
    again = sp.make_plan(step, state, x, cluster=cluster, config=config)
    assert again.to_json() == plan.to_json()
    assert again.timings and "timings" not in json.loads(plan.to_json())


def test_a_model_that_fits_nowhere_names_the_floor_and_the_devices_per_type() -> None:
    step, state, x = mlp_step(256, 32, learning_rate=1e-3)
    cluster = sp.Cluster.local(types=MIXED)
    with pytest.raises(InfeasibleError) as info:
        sp.make_plan(step, state, x, cluster=cluster,
                     config=sp.PlanConfig(memory_budget_bytes=100_000))
    text = str(info.value)
    # The state alone exceeds the 8 devices' 800 kB: refused before any solving, with the
    # per-device lower bound and, per device type, the devices the state needs (4.7 MB of
    # parameters and Adam moments at 100 kB each: 48). The stage planner's own report (a
    # state that fits the cluster but no stage split) is tested in test_stage_planner.
    assert "per-device lower bound" in text
    assert "a100-80g: at least 48 devices" in text and "v100-32g: at least 48 devices" in text


@pytest.mark.parametrize("field,value", [("memory_headroom", 1.0), ("objective", "speed"),
                                         ("schedules", ("zb-v",)), ("chunks", (1,)),
                                         ("microbatch_sizes", (0,)), ("max_stages", -1),
                                         ("stage_time_limit_s", 0.0),
                                         ("stage_work_limit", -5)])
def test_bad_plan_config_values_are_named(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"PlanConfig.{field}"):
        sp.PlanConfig(**{field: value})


def test_batch_leaves_must_share_their_leading_dimension() -> None:
    import jax
    import jax.numpy as jnp

    a = jax.ShapeDtypeStruct((8, 3), jnp.float32)
    assert batch_size({"x": a, "y": jax.ShapeDtypeStruct((8,), jnp.int32)}) == 8
    with pytest.raises(ConfigError, match="x and y"):
        batch_size({"x": a, "y": jax.ShapeDtypeStruct((4,), jnp.int32)})
    with pytest.raises(ConfigError, match="no batch dimension"):
        batch_size({"x": jax.ShapeDtypeStruct((), jnp.float32)})


def test_microbatch_candidates() -> None:
    assert microbatch_candidates(48) == (1, 2, 4, 8, 16, 48)
    assert microbatch_candidates(4096, 8) == (128, 256, 512, 1024, 2048, 4096)
    assert microbatch_candidates(6, most=2) == (1, 2)


def test_stages_are_packed_into_nodes() -> None:
    cluster = sp.Cluster.from_dict({
        "name": "two", "between_groups": {"bandwidth_GB_s": 10, "latency_us": 5},
        "groups": [{"device": "a100-80g", "nodes": 2, "devices_per_node": 8,
                    "intra_node": {"bandwidth_GB_s": 300, "latency_us": 2},
                    "inter_node": {"bandwidth_GB_s": 25, "latency_us": 5}},
                   {"device": "v100-32g", "nodes": 1, "devices_per_node": 4,
                    "intra_node": {"bandwidth_GB_s": 150, "latency_us": 2},
                    "inter_node": {"bandwidth_GB_s": 12.5, "latency_us": 5}}]})
    a = cluster.groups[0].device_ids
    got = allocate_devices(cluster, [(0, 2), (0, 4), (0, 2), (1, 4), (0, 8)])
    assert got[4] == a[:8]  # a whole node first
    assert got[0] + got[1] + got[2] == a[8:16]  # a replica's small stages share a node
    assert got[3] == cluster.groups[1].device_ids
    with pytest.raises(PipelineError, match="more devices than the group has"):
        allocate_devices(cluster, [(1, 4), (1, 2)])


def _plan(**changes):
    mesh = MeshSpec(("model",), (2,), (0, 1))
    stages = (Stage(0, "a100-80g", mesh, ("pre",), replica=0, layout="a"),
              Stage(1, "v100-32g", MeshSpec(("model",), (2,), (2, 3)), ("pre",), replica=1,
                    layout="a"))
    fields = dict(
        shardplan_version="0", graph_fingerprint="g", cluster_hash="c", config_hash="k",
        stages=stages, param_specs={"0/w": (0, ((), ("model",)))}, batch_specs={},
        microbatches=3, schedule="1f1b", microbatch_size=2,
        replicas=(ReplicaSpec((0,), 2), ReplicaSpec((1,), 1)),
        layouts={"a": Layout({"0/w": ((), ("model",))}, {"x": ((), ())})},
        predicted=Predicted(1.0, 0.5, 0.5, {0: 1, 1: 1, 2: 1, 3: 1}, {}),
        solver={"status": "optimal"})
    fields.update(changes)
    return sp.Plan(**fields)


def test_replicas_and_layouts_are_checked() -> None:
    plan = _plan()
    assert plan.replica_microbatches == (2, 1)
    assert sp.Plan.from_json(plan.to_json()) == plan
    with pytest.raises(PlanMismatchError, match="replicas run 3 microbatches"):
        _plan(microbatches=4)
    with pytest.raises(PlanMismatchError, match="not a stage of replica 0"):
        _plan(replicas=(ReplicaSpec((0, 1), 2), ReplicaSpec((), 1)))
    with pytest.raises(PlanMismatchError, match="layout 'b'"):
        _plan(stages=(Stage(0, "a100-80g", MeshSpec(("model",), (2,), (0, 1)), ("pre",),
                            layout="b"),), replicas=(), microbatches=1)
    bad = {"a": Layout({"0/w": ((), ("data",))}, {})}
    with pytest.raises(PlanMismatchError, match="'data'"):
        _plan(layouts=bad)


def test_a_schema_2_file_reads_as_a_one_replica_plan() -> None:
    from shardplan.plan.plan import _example

    data = json.loads(_example().to_json())
    for key in ("microbatch_size", "chunks", "replicas", "layouts"):
        del data[key]
    for stage in data["stages"]:
        del stage["replica"], stage["layout"]
    data["schema_version"] = 2
    plan = sp.Plan.from_json(json.dumps(data))
    assert plan.replica_microbatches == (1,) and plan.schema_version == 2
