"""Baseline plan families (``shardplan.solver.stages.baselines``).

Layers: (a) on random small problems every baseline plan is structurally valid and feasible,
and the stage planner's objective is no worse than any baseline's (the families are subsets of
its search space); every candidate's score per run of equal replicas is bit for bit
``evaluate_pipeline``'s of the built plan, and the split over runs is the replica-by-replica
one; (b) hand-made problems whose best plan of each family is worked out in a comment; (c) the
ideal gain of a real cluster file.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections import Counter
from pathlib import Path

from helpers.pipeline_bruteforce import count_plans, random_problem

import shardplan as sp
from shardplan.errors import InfeasibleError
from shardplan.planner.multi import effective_matmul_flops_per_s
from shardplan.solver.stages.baselines import (
    BOUND_SLACK,
    _dp_candidates,
    _even_split,
    _megatron_grid_candidates,
    data_parallel_only,
    homogeneous_only,
    ideal_gain,
    megatron_grid,
)
from shardplan.solver.stages.pipeline import (
    DeviceGroup,
    LayerKind,
    LayerOption,
    Link,
    PipelinePlan,
    PipelineProblem,
    Replica,
    StagePlacement,
    check_pipeline,
    evaluate_pipeline,
)
from shardplan.solver.stages.search import solve_pipeline

FREE = Link(1.0, 0.0)  # transfers of 0 bytes cost nothing on it
CLUSTERS = Path(__file__).resolve().parents[2] / "configs" / "clusters"


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


def _fast_and_slow(stacks: tuple[tuple[int, int], ...] = ()) -> PipelineProblem:
    """Two layers; 2 fast devices (1 s per layer per microbatch) then 2 slow ones (2 s); a
    device holds one layer (state 10 of 15); 4 microbatches of 1 sample, 1F1B."""
    kind = LayerKind("block", {0: (_option(1, 1.0, state=10.0, activation=1.0),),
                               1: (_option(1, 2.0, state=10.0, activation=1.0),)}, 0.0, 0.0)
    return PipelineProblem((kind,), (0, 0), (_group("fast", 2, memory=15.0),
                                             _group("slow", 2, memory=15.0)), FREE,
                           batch=4, microbatch_sizes=(1,), schedules=("1f1b",),
                           remats=("none",), stacks=stacks)


def test_megatron_grid_treats_mixed_devices_alike() -> None:
    # k = 2 and 2 replicas of 2 microbatches. Slots in cluster order [fast, fast, slow, slow].
    # Pipeline outermost: both replicas run stage 0 fast, stage 1 slow: 3 + 1 * 2 = 5 s.
    # Replicas outermost: (fast, fast) 2 + 1 = 3 s and (slow, slow) 4 + 2 = 6 s: the step
    # waits for 6 s. The grid keeps 5 s.
    problem = _fast_and_slow()
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


def test_megatron_grid_keeps_only_plans_that_cut_a_scanned_stack_as_the_runtime_can() -> None:
    # The problem above with its two layers one scanned stack: the 5 s grid point splits the
    # stack over a fast and a slow stage, which the runtime cannot hold (a stack's runs must be
    # equal, on stages of one group and sub-mesh size). The best point left: replicas
    # outermost, (fast, fast) and (slow, slow), 6 s.
    problem = _fast_and_slow(stacks=((0, 2),))
    plan = megatron_grid(problem)
    assert plan is not None and check_pipeline(problem, plan) == []
    assert sorted([s.group for s in r.stages] for r in plan.replicas) == [[0, 0], [1, 1]]
    assert evaluate_pipeline(problem, plan).step_time_s == 6.0


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


def _wide(rng: random.Random) -> PipelineProblem:
    """A random problem, often with many devices per group (hundreds of equal replicas in a
    few runs), a larger batch and roomier memory."""
    problem = random_problem(rng)
    if rng.random() < 0.6:
        scale = rng.choice((3, 8, 17, 40))
        groups = tuple(dataclasses.replace(g, count=g.count * scale) if rng.random() < 0.8
                       else g for g in problem.groups)
        problem = dataclasses.replace(problem, groups=groups,
                                      batch=problem.batch * rng.choice((1, 7, 16, 60)))
    if rng.random() < 0.5:
        factor = rng.choice((2, 5, 20))
        problem = dataclasses.replace(problem, groups=tuple(
            dataclasses.replace(g, memory_bytes=g.memory_bytes * factor)
            for g in problem.groups))
    return problem


def test_every_candidate_scores_as_the_full_evaluation_on_random_problems() -> None:
    # The families score their candidates per run of equal replicas, without building them;
    # the score must be evaluate_pipeline's objective of the built plan exactly (not within a
    # tolerance: equal plans must compare equal), the plan structurally valid, and the bound
    # below the score.
    rng = random.Random(11)
    seen: Counter[str] = Counter()
    for _ in range(400):
        problem = _wide(rng)
        groups = None if rng.random() < 0.7 else tuple(
            rng.sample(range(len(problem.groups)), rng.randint(1, len(problem.groups))))
        for name, candidates in (("dp", _dp_candidates(problem, groups)),
                                 ("megatron", _megatron_grid_candidates(problem, groups))):
            for candidate in candidates:
                plan = candidate.build()
                assert check_pipeline(problem, plan) == [], name
                ev = evaluate_pipeline(problem, plan)
                want = math.inf if not ev.feasible else (
                    ev.step_time_s if problem.objective == "time" else ev.cost_per_step)
                got = candidate.value()
                assert got == want, (name, got, want, ev.violations)
                assert candidate.bound * (1 - BOUND_SLACK) <= got, (name, candidate.bound, got)
                seen[name] += 1
                seen["feasible"] += got < math.inf
                seen["infeasible"] += got == math.inf
                seen["wide"] += len(plan.replicas) >= 20
                seen["uneven"] += len({r.microbatches for r in plan.replicas}) > 1
                seen["cost"] += problem.objective == "cost"
    for what, least in (("dp", 350), ("megatron", 1200), ("feasible", 1500), ("infeasible", 80),
                        ("wide", 220), ("uneven", 600), ("cost", 380)):
        assert seen[what] >= least, (what, seen)


def _split_replica_by_replica(total: int, times: list[float], step: int) -> list[int] | None:
    """The reference split: ``total`` microbatches in units of ``step``, the units left over
    one each to the fastest replicas, ties by index."""
    if total % step or total // step < len(times):
        return None
    base, extra = divmod(total // step, len(times))
    out = [base * step] * len(times)
    for i in sorted(range(len(times)), key=lambda i: (times[i], i))[:extra]:
        out[i] += step
    return out


def test_the_split_over_runs_is_the_replica_by_replica_split() -> None:
    # E.g. runs of 2 replicas at 3 s and 3 at 1 s, 12 microbatches: base 2, 2 left over go to
    # the first two 1 s replicas: [2, 2, 3, 3, 2].
    assert _even_split(12, [3.0, 1.0], [2, 3], 1) == (2, [0, 2])
    assert _split_replica_by_replica(12, [3.0, 3.0, 1.0, 1.0, 1.0], 1) == [2, 2, 3, 3, 2]
    rng = random.Random(3)
    for _ in range(2000):
        counts = [rng.randint(1, 6) for _ in range(rng.randint(1, 5))]
        times = [float(rng.choice((1, 2, 3))) for _ in counts]  # ties across runs
        step = rng.choice((1, 1, 2, 3))
        total = rng.randint(0, 60)
        got = _even_split(total, times, counts, step)
        want = _split_replica_by_replica(
            total, [t for t, c in zip(times, counts, strict=True) for _ in range(c)], step)
        if want is None:
            assert got is None
            continue
        assert got is not None
        base, extra = got
        assert [base + step * (i < more) for c, more in zip(counts, extra, strict=True)
                for i in range(c)] == want


def test_equal_replicas_each_report_their_violations() -> None:
    # evaluate_pipeline and check_pipeline work out each distinct replica once; every replica
    # must still report its own violations. Two equal replicas whose stage holds 2 layers x 10
    # bytes > 15 of memory, and a third with a remat the problem does not allow.
    kind = LayerKind("block", {0: (_option(1, 1.0, state=10.0),)}, 0.0, 0.0)
    problem = PipelineProblem((kind,), (0, 0), (_group("d", 3, memory=15.0),), FREE, batch=3,
                              microbatch_sizes=(1,), schedules=("1f1b",), remats=("none",))
    stage = StagePlacement(0, 1, (0, 1))
    plan = PipelinePlan((Replica((stage,), 1), Replica((stage,), 1)), 1, "1f1b")
    plan = dataclasses.replace(plan, replicas=(*plan.replicas, Replica(
        (dataclasses.replace(stage, remat="full"),), 1)))
    assert check_pipeline(problem, plan) == ["replica 2, stage 0: remat 'full' not allowed"]
    fixed = dataclasses.replace(plan, replicas=(*plan.replicas[:2], plan.replicas[0]))
    ev = evaluate_pipeline(problem, fixed)
    assert ev.violations == tuple(f"replica {r}, stage 0: 20 bytes per device > 15 on d"
                                  for r in range(3))
    assert ev.memory_bytes == ((20.0,), (20.0,), (20.0,))
    # 2 layers x 1 s per microbatch, one microbatch each; sync and update free: 2 s.
    assert ev.replica_time_s == (2.0, 2.0, 2.0)
    assert ev.step_time_s == 2.0
    assert list(itertools.chain.from_iterable(ev.stage_time_s)) == [2.0, 2.0, 2.0]
