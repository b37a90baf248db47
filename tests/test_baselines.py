"""Baseline plan families (``shardplan.solver.baselines``).

Layers: (a) on random small problems every baseline plan is structurally valid and feasible,
and the stage planner's objective is no worse than any baseline's (the families are subsets of
its search space); (b) hand-made problems whose best plan of each family is worked out in a
comment; (c) the ideal gain of a real cluster file.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

from pipeline_bruteforce import count_plans, random_problem

import shardplan as sp
from shardplan.errors import InfeasibleError
from shardplan.planner.multi import effective_matmul_flops_per_s
from shardplan.solver.baselines import (
    data_parallel_only,
    homogeneous_only,
    ideal_gain,
    megatron_grid,
)
from shardplan.solver.pipeline import (
    DeviceGroup,
    LayerKind,
    LayerOption,
    Link,
    PipelinePlan,
    PipelineProblem,
    check_pipeline,
    evaluate_pipeline,
)
from shardplan.solver.stages import solve_pipeline

FREE = Link(1.0, 0.0)  # transfers of 0 bytes cost nothing on it
CLUSTERS = Path(__file__).resolve().parent.parent / "configs" / "clusters"


def _option(devices: int, seconds: float, *, state: float = 0.0,
            activation: float = 0.0) -> LayerOption:
    """Forward ``seconds / 3`` and backward ``2 seconds / 3`` per sample."""
    return LayerOption(devices, (0.0, seconds / 3), (0.0, 2 * seconds / 3),
                       {"none": (0.0, 0.0)}, {"none": activation}, state, 0.0)


def _group(name: str, count: int, *, memory: float = 100.0,
           per_node: int | None = None) -> DeviceGroup:
    return DeviceGroup(name, count, per_node or count, memory, 1.0, FREE, FREE)


def _solve(problem: PipelineProblem) -> PipelinePlan:
    return solve_pipeline(problem).plan


def _objective(problem: PipelineProblem, plan: PipelinePlan) -> float:
    ev = evaluate_pipeline(problem, plan)
    assert ev.feasible, ev.violations
    return ev.step_time_s if problem.objective == "time" else ev.cost_per_step


def test_the_planner_is_never_worse_than_a_baseline_on_random_problems() -> None:
    rng = random.Random(5)
    seen: Counter[str] = Counter()
    while seen["problems"] < 80:
        problem = random_problem(rng)
        if count_plans(problem, 2000) > 2000:
            continue
        seen["problems"] += 1
        try:
            best = _objective(problem, solve_pipeline(problem).plan)
        except InfeasibleError:
            best = math.inf
        fastest = max(range(len(problem.groups)), key=lambda g: problem.groups[g].count)
        plans = {"dp": data_parallel_only(problem), "megatron": megatron_grid(problem),
                 "homogeneous": homogeneous_only(problem, _solve, group=fastest)}
        for name, plan in plans.items():
            if plan is None:
                continue
            seen[name] += 1
            assert check_pipeline(problem, plan) == [], (name, seen["problems"])
            value = _objective(problem, plan)
            assert best <= value * (1 + 1e-12), (name, seen["problems"], best, value)
            seen[f"{name} loses"] += best < value * (1 - 1e-9)
    # The draws must give every family plans, and the planner must beat them on some.
    for what, least in (("dp", 20), ("megatron", 15), ("homogeneous", 30), ("dp loses", 5),
                        ("megatron loses", 5)):
        assert seen[what] >= least, (what, seen)


def test_data_parallel_only_splits_evenly_over_every_group() -> None:
    # Two layers; 2 fast devices (3 s per sample per layer: 6 s per microbatch) and 1 slow
    # one (12 s). Six microbatches over three 1-device replicas, 2 each: the slow replica
    # takes 2 * 12 = 24 s (mb 2, one each, gives the same 24 s; the earlier mb is kept).
    # The planner gives the slow replica fewer: (3, 2, 1) microbatches -> max(18, 12, 12) =
    # 18 s, or better.
    kind = LayerKind("block", {0: (_option(1, 3.0),), 1: (_option(1, 6.0),)}, 0.0, 0.0)
    problem = PipelineProblem((kind,), (0, 0), (_group("fast", 2), _group("slow", 1)), FREE,
                              batch=6, microbatch_sizes=(1, 2), schedules=("1f1b",),
                              remats=("none",))
    plan = data_parallel_only(problem)
    assert plan is not None
    assert [(r.stages[0].group, len(r.stages), r.microbatches) for r in plan.replicas] == [
        (0, 1, 2), (0, 1, 2), (1, 1, 2)]
    assert plan.microbatch_size == 1
    assert evaluate_pipeline(problem, plan).step_time_s == 24.0
    assert solve_pipeline(problem).evaluation.step_time_s <= 18.0


def test_data_parallel_only_shards_a_replica_that_does_not_fit_one_device() -> None:
    # One device holds 2 x 10 bytes of state > 15: each replica takes a 2-device sub-mesh
    # (state 5 per layer) and the 4 devices hold two replicas of 2 microbatches: 2 * 2 * 2 =
    # 8 s (two 2 s layers per microbatch at 2 devices).
    kind = LayerKind("block", {0: (_option(1, 3.0, state=10.0), _option(2, 2.0, state=5.0))},
                     0.0, 0.0)
    problem = PipelineProblem((kind,), (0, 0), (_group("d", 4, memory=15.0),), FREE, batch=4,
                              microbatch_sizes=(1,), schedules=("1f1b",), remats=("none",))
    plan = data_parallel_only(problem)
    assert plan is not None
    assert [(r.stages[0].devices, r.microbatches) for r in plan.replicas] == [(2, 2), (2, 2)]
    assert evaluate_pipeline(problem, plan).step_time_s == 8.0


def test_megatron_grid_picks_tensor_size_stages_and_rank_order() -> None:
    # Four identical layers, 4 devices in nodes of 2, 1F1B, 4 microbatches of 1 sample, state
    # 10 bytes per layer on 1 device, 5 on 2, memory 25, activation 1 byte per sample:
    # * d = 1 (3 s per layer): a stage holds at most 2 layers. k = 2: 2 replicas of 2
    #   microbatches, stage time 6 s: 12 + 1 * 6 = 18 s. k = 4: one replica, 12 + 3 * 3 = 21 s.
    # * d = 2 (1.8 s per layer): k = 1 holds 4 x 5 + 1 * 4 = 24 bytes: 2 replicas of 2
    #   microbatches, 7.2 s each: 14.4 s. k = 2: one replica, 7.2 + 3 * 3.6 = 18 s.
    kind = LayerKind("block", {0: (_option(1, 3.0, state=10.0, activation=1.0),
                                   _option(2, 1.8, state=5.0, activation=1.0))}, 0.0, 0.0)
    problem = PipelineProblem((kind,), (0, 0, 0, 0), (_group("d", 4, memory=25.0, per_node=2),),
                              FREE, batch=4, microbatch_sizes=(1,), schedules=("1f1b",),
                              remats=("none",))
    plan = megatron_grid(problem)
    assert plan is not None
    assert [[(s.devices, s.layers) for s in r.stages] for r in plan.replicas] == [
        [(2, (0, 1, 2, 3))], [(2, (0, 1, 2, 3))]]
    assert math.isclose(evaluate_pipeline(problem, plan).step_time_s, 14.4, rel_tol=1e-12)


def test_megatron_grid_treats_mixed_devices_alike() -> None:
    # Two layers; 2 fast devices (1 s per layer per microbatch) then 2 slow ones (2 s); a
    # device holds one layer (state 10 of 15), so k = 2 and 2 replicas of 2 microbatches.
    # Slots in cluster order [fast, fast, slow, slow]. Pipeline outermost: both replicas run
    # stage 0 fast, stage 1 slow: 3 + 1 * 2 = 5 s. Replicas outermost: (fast, fast) 2 + 1 =
    # 3 s and (slow, slow) 4 + 2 = 6 s: the step waits for 6 s. The grid keeps 5 s.
    kind = LayerKind("block", {0: (_option(1, 1.0, state=10.0, activation=1.0),),
                               1: (_option(1, 2.0, state=10.0, activation=1.0),)}, 0.0, 0.0)
    problem = PipelineProblem((kind,), (0, 0), (_group("fast", 2, memory=15.0),
                                                _group("slow", 2, memory=15.0)), FREE,
                              batch=4, microbatch_sizes=(1,), schedules=("1f1b",),
                              remats=("none",))
    plan = megatron_grid(problem)
    assert plan is not None
    assert [[s.group for s in r.stages] for r in plan.replicas] == [[0, 1], [0, 1]]
    assert [r.microbatches for r in plan.replicas] == [2, 2]
    assert evaluate_pipeline(problem, plan).step_time_s == 5.0
    # The single-type variant on the fast pair: one replica (fast, fast), 2 + 3 * 1 = 5 s.
    single = megatron_grid(problem, groups=(0,))
    assert single is not None
    assert [[s.group for s in r.stages] for r in single.replicas] == [[0, 0]]
    assert evaluate_pipeline(problem, single).step_time_s == 5.0


def test_homogeneous_only_maps_the_plan_back_to_its_group() -> None:
    # The problem above on the slow pair alone: one replica of two 2 s stages, 4 + 3 * 2 =
    # 10 s; its stages name group 1 of the full problem.
    kind = LayerKind("block", {0: (_option(1, 1.0, state=10.0, activation=1.0),),
                               1: (_option(1, 2.0, state=10.0, activation=1.0),)}, 0.0, 0.0)
    problem = PipelineProblem((kind,), (0, 0), (_group("fast", 2, memory=15.0),
                                                _group("slow", 2, memory=15.0)), FREE,
                              batch=4, microbatch_sizes=(1,), schedules=("1f1b",),
                              remats=("none",))
    plan = homogeneous_only(problem, _solve, group=1)
    assert plan is not None
    assert {s.group for r in plan.replicas for s in r.stages} == {1}
    assert evaluate_pipeline(problem, plan).step_time_s == 10.0
    # A group that cannot hold the model gives None.
    small = PipelineProblem(problem.kinds, problem.layers,
                            (problem.groups[0], _group("slow", 1, memory=15.0)), FREE,
                            batch=4, microbatch_sizes=(1,), schedules=("1f1b",),
                            remats=("none",))
    assert homogeneous_only(small, _solve, group=1) is None


def test_ideal_gain_of_a100_and_v100() -> None:
    # 8 x A100 at 312 TFLOP/s bf16 x 0.75 = 1872 TFLOP/s; 8 x V100 (no bf16: fp16 125) x 0.70
    # = 700 TFLOP/s: (1872 + 700) / 1872 = 1.374.
    cluster = sp.Cluster.from_yaml(CLUSTERS / "a100x8_v100x8.yaml")
    flops = [effective_matmul_flops_per_s(g.device, len(g.device_ids)) for g in cluster.groups]
    assert math.isclose(flops[0], 1872e12, rel_tol=1e-12)
    assert math.isclose(flops[1], 700e12, rel_tol=1e-12)
    assert math.isclose(ideal_gain(flops), 2572 / 1872, rel_tol=1e-12)
