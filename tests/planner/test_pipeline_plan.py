"""make_plan with the stage planner: multi-stage plans on mixed clusters, their checks, their
determinism and the infeasibility report."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter
from typing import Any

import pytest
from helpers.steps import mlp_step

import shardplan as sp
from shardplan.errors import ConfigError, InfeasibleError, PipelineError, PlanMismatchError
from shardplan.plan import TimelineEvent, timeline_events
from shardplan.plan.plan import Layout, MeshSpec, Predicted, ReplicaSpec, Stage
from shardplan.planner.multi import (
    allocate_devices,
    batch_size,
    microbatch_candidates,
    pipeline_timeline,
)
from shardplan.solver.stages.pipeline import (
    DeviceGroup,
    LayerKind,
    LayerOption,
    Link,
    PipelinePlan,
    PipelineProblem,
    Replica,
    Schedule,
    StagePlacement,
)
from shardplan.solver.stages.simulate import simulate

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


def test_a_layout_carries_its_kernel_calls_specs() -> None:
    kernels = {"23/35": (((("model",), ()),), ((("model",), ()), ((), ("model",))))}
    plan = _plan(layouts={"a": Layout({"0/w": ((), ("model",))}, {"x": ((), ())}, kernels)})
    again = sp.Plan.from_json(plan.to_json())
    assert again == plan and dict(again.layouts["a"].kernel_specs) == kernels
    with pytest.raises(PlanMismatchError, match=r"(?s)'data'.*kernel_specs\['23/35'\] "
                                                r"operands\[1\]"):
        _plan(layouts={"a": Layout({}, {}, {"23/35": ((), ((), ((), ("data",))))})})
    with pytest.raises(sp.ConfigError, match="equation indices joined by '/'"):
        Layout({}, {}, {"attention": ((), ())})


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


# --------------------------------------------------------------------------- the timeline


def _check_timeline(plan: sp.Plan, events: list[TimelineEvent]) -> None:
    """What the visualizer relies on: per replica, every stage runs a forward and a backward of
    every microbatch (per chunk; of the window's microbatches when there is one), one compute
    task at a time; transfers go to the next / previous stage of the replica, after the
    sender's task and before the receiver's."""
    chunks = plan.chunks if plan.schedule == "interleaved" else 1
    raw: Any = plan.solver["timeline"]
    w = raw["window"]
    compute = [e for e in events if e.to_stage is None]
    assert {e.kind for e in compute} <= {"forward", "backward"}
    kept = {r: [j for j in range(replica.microbatches)
                if w is None or j < w or j >= replica.microbatches - w]
            for r, replica in enumerate(plan.replicas)}
    for r, replica in enumerate(plan.replicas):
        want = Counter((s, kind, j, c) for s in replica.stages for kind in ("forward", "backward")
                       for j in kept[r] for c in range(chunks))
        assert Counter((e.stage, e.kind, e.microbatch, e.chunk) for e in compute
                       if e.replica == r) == want
    for stage in plan.stages:
        mine = sorted((e.start_s, e.end_s) for e in compute if e.stage == stage.index)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(mine))
    done: dict[tuple[int, str, int, int], TimelineEvent] = {
        (e.stage, e.kind, e.microbatch, e.chunk): e for e in compute}
    sends = [e for e in events if e.to_stage is not None]
    for e in sends:
        order = plan.replicas[e.replica].stages
        i, k = order.index(e.stage), len(order)
        step = 1 if e.kind == "send_forward" else -1
        assert e.to_stage == order[(i + step) % k] and (chunks > 1 or 0 <= i + step < k)
        kind = "forward" if step > 0 else "backward"
        assert done[e.stage, kind, e.microbatch, e.chunk].end_s <= e.start_s
        # the receiver's next task of this microbatch: its chunk, or the next one on a wrap
        c = e.chunk + (1 if step > 0 and i == k - 1 else -1 if step < 0 and i == 0 else 0)
        assert e.end_s <= done[e.to_stage, kind, e.microbatch, c].start_s
    hops = sum(len(kept[r]) * 2 * (len(replica.stages) * chunks - 1)
               for r, replica in enumerate(plan.replicas) if len(replica.stages) > 1)
    assert len(sends) == hops


def test_a_pipeline_plan_carries_the_simulated_timeline(mixed_plan) -> None:
    *_, plan = mixed_plan
    raw = plan.solver["timeline"]
    assert list(raw["columns"]) == ["replica", "stage", "kind", "microbatch", "chunk",
                                    "start_s", "end_s", "to_stage"]
    # small: every replica and microbatch listed
    assert list(raw["same_as"]) == list(range(len(plan.replicas))) and raw["window"] is None
    events = timeline_events(plan)
    assert events is not None and len(events) == len(raw["rows"])
    again = sp.Plan.from_json(plan.to_json())
    assert again.solver["timeline"] == raw and timeline_events(again) == events
    assert any(len(r.stages) > 1 for r in plan.replicas)  # there are transfers to check
    _check_timeline(plan, events)
    # The pipeline phase ends with the last task; the simulated step adds the gradient
    # all-reduce and the update, at most the closed form's sync_s + update_s (simulate.py).
    end = max(e.end_s for e in events)
    step, tail = plan.solver["simulated_step_s"], plan.solver["sync_s"] + plan.solver["update_s"]
    rounding = 5e-6 * end  # times are stored to 6 significant digits
    assert end - rounding <= step <= end + tail + rounding
    assert timeline_events(sp.plan.plan._example()) is None  # one stage: no timeline


def _toy(schedule: Schedule, chunks: int) -> tuple[PipelineProblem, PipelinePlan, list[list[int]],
                                             sp.Plan]:
    """Three replicas of two one-device stages over four layers: replicas 0 and 1 equal (four
    microbatches), replica 2 with two; transfers and updates take time. The Plan numbers the
    stages replica-interleaved ([[0, 3], [1, 4], [2, 5]]) so rows must be translated."""
    link = Link(1e3, 1e-3)  # a 500-byte boundary per sample: 0.501 s a hop; 1 s a layer
    option = LayerOption(1, (0.0, 1.0), (0.0, 2.0), {"none": (0.0, 0.0)}, {"none": 1.0}, 0.0,
                         0.25)
    kind = LayerKind("block", {0: (option,)}, 500.0, 1000.0)
    problem = PipelineProblem((kind,), (0, 0, 0, 0), (DeviceGroup("d", 6, 2, 1e9, 1.0, link,
                              link),), link, batch=10, microbatch_sizes=(1,),
                              schedules=(schedule,), remats=("none",), chunks=(2,))
    layers = [(0, 1), (2, 3)] if chunks == 1 else [(0, 2), (1, 3)]

    def replica(m: int) -> Replica:
        return Replica(tuple(StagePlacement(0, 1, x) for x in layers), m)

    pp = PipelinePlan((replica(4), replica(4), replica(2)), 1, schedule, chunks)
    index = [[0, 3], [1, 4], [2, 5]]
    owner = {s: r for r, row in enumerate(index) for s in row}
    stages = tuple(Stage(s, "a100-80g", MeshSpec(("data",), (1,), (s,)),
                         tuple(f"blocks.{x}" for x in layers[index[owner[s]].index(s)]),
                         replica=owner[s]) for s in range(6))
    plan = sp.Plan(shardplan_version="0", graph_fingerprint="g", cluster_hash="c",
                   config_hash="k", stages=stages, param_specs={"0/w": (0, ((),))},
                   batch_specs={}, microbatches=10, schedule=schedule, microbatch_size=1,
                   chunks=chunks, replicas=tuple(ReplicaSpec(tuple(row), rep.microbatches)
                                                 for row, rep in zip(index, pp.replicas,
                                                                     strict=True)),
                   predicted=Predicted(1.0, 0.5, 0.5, {d: 1 for d in range(6)}, {}),
                   solver={"status": "optimal"})
    return problem, pp, index, plan


@pytest.mark.parametrize("schedule,chunks", [("1f1b", 1), ("interleaved", 2)])
def test_the_timeline_is_the_simulators_on_the_plans_stages(schedule: Schedule,
                                                            chunks: int) -> None:
    problem, pp, index, plan = _toy(schedule, chunks)
    full = pipeline_timeline(problem, pp, index)
    assert full is not None and full["same_as"] == [0, 1, 2] and full["window"] is None
    sim = simulate(problem, pp, timeline=True)
    assert [(row[0], row[2], row[3], row[4]) for row in full["rows"]] == [
        (e.replica, e.kind, e.microbatch, e.chunk) for e in sim.events]
    assert all(row[1] == index[e.replica][e.stage] for row, e in zip(full["rows"], sim.events,
                                                                     strict=True))
    with_full = dataclasses.replace(plan, solver={"timeline": full})
    events = timeline_events(with_full)
    assert events is not None
    _check_timeline(with_full, events)
    # Each replica's last task ends its pipeline phase; the step adds the all-reduce and the
    # update after it (one all-reduce group here: every stage holds the same layers as its
    # twin in the other replicas).
    for r in range(3):
        assert max(e.end_s for e in events if e.replica == r) == float(
            f"{sim.replica_time_s[r]:.6g}")
    assert sim.step_time_s == pytest.approx(max(sim.replica_time_s) + sim.sync_s + sim.update_s,
                                            rel=1e-12)
    # Too many rows for every replica: the twin (replica 1) repeats replica 0's rows; the
    # reader gives the same events.
    compact = pipeline_timeline(problem, pp, index, max_events=len(full["rows"]) - 1)
    assert compact is not None and compact["same_as"] == [0, 0, 2]
    assert compact["rows"] == [row for row in full["rows"] if row[0] != 1]
    assert timeline_events(dataclasses.replace(plan, solver={"timeline": compact})) == events
    # Too many for the distinct replicas: the first and last microbatch of each (replica 0
    # keeps 0 and 3 of its 4; replica 2 both of its 2); fewer rows than that: no timeline.
    ends = pipeline_timeline(problem, pp, index, max_events=len(compact["rows"]) - 1)
    assert ends is not None and ends["same_as"] == [0, 0, 2] and ends["window"] == 1
    assert ends["rows"] == [row for row in compact["rows"] if row[0] == 2 or row[3] in (0, 3)]
    windowed = dataclasses.replace(plan, solver={"timeline": ends})
    kept = timeline_events(windowed)
    assert kept == [e for e in events if e.replica == 2 or e.microbatch in (0, 3)]
    assert kept is not None
    _check_timeline(windowed, kept)
    assert pipeline_timeline(problem, pp, index, max_events=len(ends["rows"]) - 1) is None


def _corrupt(plan: sp.Plan, edit) -> sp.Plan:
    raw = json.loads(plan.to_json())["solver"]  # plain, editable JSON
    edit(raw["timeline"])
    return dataclasses.replace(plan, solver=raw)


@pytest.mark.parametrize("edit,error,where", [
    (lambda t: t.update(columns=t["columns"][:-1]), ConfigError, "solver.timeline.columns"),
    (lambda t: t.update(extra=1), ConfigError, "plan.solver.timeline"),
    (lambda t: t["rows"][0].__setitem__(1, 1), PlanMismatchError, "timeline.rows[0].stage"),
    (lambda t: t["rows"][0].__setitem__(2, "idle"), ConfigError, "timeline.rows[0].kind"),
    (lambda t: t["rows"][0].__setitem__(3, 4), PlanMismatchError, "rows[0].microbatch"),
    (lambda t: t["rows"][0].__setitem__(6, -1.0), ConfigError, "timeline.rows[0].end_s"),
    (lambda t: t["rows"][0].__setitem__(7, 3), ConfigError, "timeline.rows[0].to_stage"),
    (lambda t: t.update(same_as=[0, 0, 0]), PlanMismatchError, "timeline.same_as[2]"),
    (lambda t: t.update(same_as=[0, 1]), PlanMismatchError, "timeline.same_as"),
    (lambda t: t.update(window=0), ConfigError, "timeline.window"),
    (lambda t: t.update(window=1), PlanMismatchError, "].microbatch"),  # replica 0's 1 and 2
    (lambda t: next(r for r in t["rows"] if r[2] == "send_forward").__setitem__(7, 0),
     PlanMismatchError, "to_stage"),
])
def test_a_malformed_timeline_is_named(edit, error, where: str) -> None:
    problem, pp, index, plan = _toy("1f1b", 1)
    plan = dataclasses.replace(plan, solver={"timeline": pipeline_timeline(problem, pp, index)})
    raw: Any = plan.solver["timeline"]
    assert raw["rows"][0][:3] == (0, 0, "forward")  # what the edits change
    with pytest.raises(error) as info:
        timeline_events(_corrupt(plan, edit))
    assert where in str(info.value)
