"""Plans and pipeline problems built by hand, for the plan, simulator and viewer tests."""

from __future__ import annotations

import shardplan as sp
from shardplan.plan.plan import MeshSpec, Plan, Predicted, ReplicaSpec, Stage
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


def two_stage_timeline() -> dict:
    """GPipe, 2 stages, 2 microbatches; forward 1 ms, backward 2 ms, transfers 0.5 ms:
    stage 0 runs F0 [0, 1], F1 [1, 2]; stage 1 runs F0 [1.5, 2.5], F1 [2.5, 3.5], B0
    [3.5, 5.5], B1 [5.5, 7.5]; stage 0 then B0 [6, 8] and B1 [8, 10] (after the gradients
    arrive at 6 and 8). Stage 1 idles [0, 1.5] and [7.5, 10]: the bubbles."""
    ms = 1e-3
    rows = [[0, 0, "forward", 0, 0, 0.0, 1 * ms, None],
            [0, 0, "send_forward", 0, 0, 1 * ms, 1.5 * ms, 1],
            [0, 0, "forward", 1, 0, 1 * ms, 2 * ms, None],
            [0, 1, "forward", 0, 0, 1.5 * ms, 2.5 * ms, None],
            [0, 0, "send_forward", 1, 0, 2 * ms, 2.5 * ms, 1],
            [0, 1, "forward", 1, 0, 2.5 * ms, 3.5 * ms, None],
            [0, 1, "backward", 0, 0, 3.5 * ms, 5.5 * ms, None],
            [0, 1, "send_backward", 0, 0, 5.5 * ms, 6 * ms, 0],
            [0, 1, "backward", 1, 0, 5.5 * ms, 7.5 * ms, None],
            [0, 0, "backward", 0, 0, 6 * ms, 8 * ms, None],
            [0, 1, "send_backward", 1, 0, 7.5 * ms, 8 * ms, 0],
            [0, 0, "backward", 1, 0, 8 * ms, 10 * ms, None]]
    columns = ["replica", "stage", "kind", "microbatch", "chunk", "start_s", "end_s",
               "to_stage"]
    return {"columns": columns, "rows": rows, "same_as": [0], "window": None}


def two_stage_plan(*, timeline: bool = True, extra: dict[str, str] | None = None) -> Plan:
    """Two stages on two device types; ``extra``: more ``{path: type}`` leaves on stage 0,
    replicated."""
    a100 = MeshSpec(("data", "model"), (2, 2), (0, 1, 2, 3))
    v100 = MeshSpec(("x", "y", "z"), (2, 1, 2), (4, 5, 6, 7))
    types = {"0/blocks/0/w": "float32[64,32]", "0/blocks/1/w": "float32[64,32]",
             "0/blocks/0/w3": "bfloat16[8,16,4]", "1/count": "int32[]",
             "1/mu/blocks/0/w": "float32[64,32]", **(extra or {})}
    specs = {"0/blocks/0/w": (0, (("data",), ())), "0/blocks/1/w": (1, ((), ("x", "z"))),
             "0/blocks/0/w3": (0, (("data",), (), ("model",))), "1/count": (0, ()),
             "1/mu/blocks/0/w": (0, (("data",), ()))}
    specs.update({k: (0, ((),) * (v.count(",") + 1)) for k, v in (extra or {}).items()})
    return Plan(
        shardplan_version="0.1.0", graph_fingerprint="g", cluster_hash="c", config_hash="k",
        stages=(Stage(0, "a100-80g", a100, ("pre", "blocks.0")),
                Stage(1, "v100-32g", v100, ("blocks.1", "post"), remat="full")),
        param_specs=specs, batch_specs={"x": ((), ())}, microbatches=2, schedule="gpipe",
        replicas=(ReplicaSpec((0, 1), 2),),
        predicted=Predicted(0.01, 0.009, 0.001, {d: 2**20 for d in range(8)}, {}),
        solver={"status": "optimal", **({"timeline": two_stage_timeline()} if timeline else {}),
                "runner_ups": [{"config": "1 x [a100-80g 8]", "step_time_s": 0.015,
                                "memory_bytes": 2**21, "reason": "slower by 50 %"}]},
        state_types=types, batch_types={"x": "float32[16,64]"},
        cluster_info={"name": "mixed-test", "device_types": {
            "a100-80g": {"count": 4, "memory_bytes": 80 * 2**30},
            "v100-32g": {"count": 6, "memory_bytes": 32 * 2**30}}})


BYTE_PER_S = Link(1.0, 0.0)


NO_REMAT = {"none": (0.0, 0.0), "selective": (0.0, 0.0), "full": (0.0, 0.0)}


def flat_option(forward_s: float, backward_s: float, *, activation: float = 1.0,
            devices: int = 1) -> LayerOption:
    return LayerOption(devices, (forward_s, 0.0), (backward_s, 0.0), NO_REMAT,
                       {"none": activation, "selective": activation, "full": activation},
                       0.0, 0.0)


def chain_problem(forward_s: list[float], backward_s: list[float], hop_s: list[float], m: int,
           schedule: Schedule = "1f1b", v: int = 1,
           activation: list[float] | None = None) -> tuple[PipelineProblem, PipelinePlan]:
    """One layer per model chunk (``k v`` layers, chunk ``g`` on stage ``g mod k``), each its
    own kind; the hop after layer ``g`` takes ``hop_s[g]`` seconds each way."""
    n = len(forward_s)
    k = n // v
    acts = activation or [1.0] * n
    kinds = tuple(LayerKind(f"layer{g}", {0: (flat_option(forward_s[g], backward_s[g],
                                                      activation=acts[g]),)},
                            boundary_bytes=hop_s[g] if g < n - 1 else 0.0, gradient_bytes=0.0)
                  for g in range(n))
    group = DeviceGroup("dev", n, n, 1e18, 1.0, BYTE_PER_S, BYTE_PER_S)
    problem = PipelineProblem(kinds, tuple(range(n)), (group,), BYTE_PER_S, m, (1,),
                              remats=("none",), chunks=(max(v, 2),))
    stages = tuple(StagePlacement(0, 1, tuple(c * k + i for c in range(v))) for i in range(k))
    return problem, PipelinePlan((Replica(stages, m),), 1, schedule, v)


def balanced_problem(k: int, m: int, schedule: Schedule, v: int = 1, f: float = 1.0,
              b: float = 2.0) -> tuple[PipelineProblem, PipelinePlan]:
    n = k * v
    return chain_problem([f / v] * n, [b / v] * n, [0.0] * n, m, schedule, v)


TWO_TYPES = sp.Cluster.from_dict({"name": "two-types", "groups": [
    {"name": "a100", "device": "a100-80g", "nodes": 2, "devices_per_node": 4,
     "intra_node": {"bandwidth_GB_s": 300.0, "latency_us": 2.0},
     "inter_node": {"bandwidth_GB_s": 25.0, "latency_us": 5.0}},
    {"name": "v100", "device": "v100-32g", "nodes": 1, "devices_per_node": 4,
     "intra_node": {"bandwidth_GB_s": 150.0, "latency_us": 2.0}}],
    "between_groups": {"bandwidth_GB_s": 12.5, "latency_us": 5.0}})
