"""The stage planner (``shardplan.solver.stages.search``): exact best pipeline plans.

Layers: (a) the planner's objective equals a brute force over every plan on 200+ random small
problems, infeasible ones included; (b) the same inputs give the same plan; (c) hand-made
problems whose optimum is worked out in a comment (uneven microbatches, memory forcing 1F1B
and remat, an interleaving win, the per-stage synchronisation, links between pairs of groups,
infeasibility figures); (d) the replica figures the search uses agree with
``evaluate_pipeline`` on random plans; (e) the fluid lower bound of each configuration is below
its best plan, and a search cut by its time limit returns a plan with a proven lower bound.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections import Counter

import pytest
from helpers.pipeline_bruteforce import all_plans, best, count_plans, objective, random_problem

from shardplan.errors import ConfigError, InfeasibleError
from shardplan.solver.stages.baselines import homogeneous_only
from shardplan.solver.stages.bound import config_bound
from shardplan.solver.stages.mix import best_mix
from shardplan.solver.stages.pairs import two_type_shapes
from shardplan.solver.stages.pipeline import (
    DeviceGroup,
    LayerKind,
    LayerOption,
    Link,
    PipelinePlan,
    PipelineProblem,
    Replica,
    StagePlacement,
    evaluate_pipeline,
    stack_violations,
    stage_link,
    sync_link,
)
from shardplan.solver.stages.search import (
    PipelineInfeasibleError,
    _bounds,
    _configs,
    solve_pipeline,
)
from shardplan.solver.stages.shapes import _Types, replica_shapes, shape_of, stack_edges

FREE = Link(1.0, 0.0)  # a link whose transfers of 0 bytes cost nothing
PLAN_LIMIT = 2000  # random problems with more plans are drawn again (keeps the brute force fast)


def _option(devices: int = 1, seconds: float = 1.0, *, activation: float = 0.0,
            state: float = 0.0, remat_s: float = 0.5, full_activation: float = 0.0,
            update_s: float = 0.0) -> LayerOption:
    """Forward + backward ``seconds`` per sample, split evenly; ``full`` remat adds
    ``remat_s`` per sample and keeps ``full_activation`` bytes per sample."""
    half = seconds / 2
    return LayerOption(devices, (0.0, half), (0.0, half),
                       {"none": (0.0, 0.0), "selective": (0.0, 0.0), "full": (0.0, remat_s)},
                       {"none": activation, "selective": activation, "full": full_activation},
                       state, update_s)


def _group(name: str, count: int, *, memory: float = 100.0, per_node: int | None = None,
           intra: Link = FREE, inter: Link = FREE) -> DeviceGroup:
    return DeviceGroup(name, count, per_node or count, memory, 1.0, intra, inter)


def _objective(problem: PipelineProblem) -> float:
    try:
        ev = solve_pipeline(problem).evaluation
    except InfeasibleError:
        return math.inf
    return ev.step_time_s if problem.objective == "time" else ev.cost_per_step


def test_matches_brute_force_on_random_problems() -> None:
    # Both sides are evaluate_pipeline on an optimal plan; when the two optima are different
    # plans of equal value, their sums run in different orders and may differ by an ulp, so
    # equality is exact or within 1e-12 relative.
    rng = random.Random(20240611)
    seen: Counter[str] = Counter()
    while seen["problems"] < 210:
        problem = random_problem(rng)
        if count_plans(problem, PLAN_LIMIT) > PLAN_LIMIT:
            continue
        seen["problems"] += 1
        expected, _ = best(problem)
        try:
            solution = solve_pipeline(problem)
        except InfeasibleError as err:
            assert isinstance(err, PipelineInfeasibleError)
            assert expected == math.inf, f"problem {seen['problems']}: planner found nothing"
            seen["infeasible"] += 1
            continue
        ev = solution.evaluation
        assert ev.feasible and ev == evaluate_pipeline(problem, solution.plan)
        got = ev.step_time_s if problem.objective == "time" else ev.cost_per_step
        assert got == expected or math.isclose(got, expected, rel_tol=1e-12, abs_tol=0.0), (
            f"problem {seen['problems']}: planner {got!r}, brute force {expected!r}")
        plan = solution.plan
        seen[plan.schedule] += 1
        seen["cost"] += problem.objective == "cost"
        seen["replicas"] += len(plan.replicas) > 1
        seen["pipelined"] += any(len(r.stages) > 1 for r in plan.replicas)
        seen["unlike replicas"] += len({r.stages for r in plan.replicas}) > 1
        seen["uneven"] += len({r.microbatches for r in plan.replicas}) > 1
        seen["remat"] += any(s.remat != "none" for r in plan.replicas for s in r.stages)
        seen["groups"] += len({s.group for r in plan.replicas for s in r.stages}) > 1
    # The draws must exercise what the planner decides, not only trivial plans.
    for what, least in (("infeasible", 20), ("gpipe", 10), ("1f1b", 10), ("interleaved", 10),
                        ("cost", 10), ("replicas", 30), ("pipelined", 10),
                        ("unlike replicas", 10), ("uneven", 5), ("remat", 20), ("groups", 10)):
        assert seen[what] >= least, (what, seen)


def test_using_a_group_matches_brute_force() -> None:
    # solve_pipeline(using=g): the best plan with a stage on group g, against the brute
    # force's best over those plans, on random problems of two or more groups.
    rng = random.Random(20261208)
    seen: Counter[str] = Counter()
    while seen["problems"] < 80:
        problem = random_problem(rng)
        if len(problem.groups) < 2 or count_plans(problem, PLAN_LIMIT) > PLAN_LIMIT:
            continue
        seen["problems"] += 1
        g = rng.randrange(len(problem.groups))
        expected = min((objective(problem, plan) for plan in all_plans(problem)
                        if any(s.group == g for r in plan.replicas for s in r.stages)),
                       default=math.inf)
        try:
            solution = solve_pipeline(problem, using=g)
        except InfeasibleError:
            assert expected == math.inf, f"problem {seen['problems']}: planner found nothing"
            seen["infeasible"] += 1
            continue
        assert any(s.group == g for r in solution.plan.replicas for s in r.stages)
        ev = solution.evaluation
        got = ev.step_time_s if problem.objective == "time" else ev.cost_per_step
        assert got == expected or math.isclose(got, expected, rel_tol=1e-12, abs_tol=0.0), (
            f"problem {seen['problems']}: planner {got!r}, brute force {expected!r}")
        seen["worse than free"] += got > best(problem)[0]
    assert seen["infeasible"] >= 5 and seen["worse than free"] >= 5, seen


def test_matches_brute_force_with_scanned_stacks() -> None:
    # A scanned stack's rows may only be cut into equal runs on alike stages (the runtime holds
    # them as one array split evenly over the stages' devices): the search keeps the optimum
    # among such plans, and it is one the brute force's checker accepts.
    rng = random.Random(20261204)
    seen: Counter[str] = Counter()
    while seen["problems"] < 250:
        problem = random_problem(rng)
        n = len(problem.layers)
        if n < 3:
            continue
        a = rng.randrange(0, n - 2)
        b = rng.randrange(a + 2, n + 1)
        # with working and recomputed bytes, so that a stage's loop over two or more rows
        # holds more than one row (looped_work)
        kinds = tuple(dataclasses.replace(kind, options={g: tuple(dataclasses.replace(
            o, recompute_bytes={r: rng.uniform(0.0, 1.0) / o.devices for r in problem.remats},
            work_bytes={r: rng.uniform(0.0, 1.5) / o.devices for r in problem.remats})
            for o in opts) for g, opts in kind.options.items()}) for kind in problem.kinds)
        problem = dataclasses.replace(problem, kinds=kinds)
        stacked = dataclasses.replace(problem, stacks=((a, b),))
        if count_plans(stacked, PLAN_LIMIT) > PLAN_LIMIT:
            continue
        seen["problems"] += 1
        expected, _ = best(stacked)
        free, _ = best(problem)
        seen["constrained"] += expected > free
        try:
            solution = solve_pipeline(stacked)
        except InfeasibleError:
            assert expected == math.inf, f"problem {seen['problems']}: planner found nothing"
            continue
        ev = solution.evaluation
        assert ev.feasible
        for replica in solution.plan.replicas:
            assert not stack_violations(stacked.stacks, replica.stages), solution.plan
            runs = {i for i, st in enumerate(replica.stages) for x in st.layers if a <= x < b}
            seen["cut"] += len(runs) > 1
            seen["looped"] += any(len([x for x in st.layers if a <= x < b]) > 1
                                  for st in replica.stages)
        got = ev.step_time_s if stacked.objective == "time" else ev.cost_per_step
        assert got == expected or math.isclose(got, expected, rel_tol=1e-12, abs_tol=0.0), (
            f"problem {seen['problems']}: planner {got!r}, brute force {expected!r}")
    assert seen["constrained"] >= 10 and seen["cut"] >= 10 and seen["looped"] >= 20, seen


def test_a_stack_cut_unevenly_is_a_violation() -> None:
    stages = (StagePlacement(0, 1, (0, 1)), StagePlacement(0, 1, (2, 3, 4)),
              StagePlacement(0, 1, (5,)))
    assert stack_violations(((1, 5),), stages) == [
        ", scanned stack of layers 1..4: cut into runs of unequal length [1, 3] (stages [0, 1])"]
    assert stack_violations(((1, 3),), stages) == []  # 1 + 1 rows on stages 0 and 1
    other = (StagePlacement(0, 1, (0, 1)), StagePlacement(1, 1, (2, 3, 4, 5)))
    assert stack_violations(((0, 4),), other) == [
        ", scanned stack of layers 0..3: its stages [0, 1] differ in group or sub-mesh size"]
    interleaved = (StagePlacement(0, 1, (0, 2)), StagePlacement(0, 1, (1, 3)))
    assert stack_violations(((0, 4),), interleaved) == [
        ", scanned stack of layers 0..3: its rows return to a stage (runs on stages "
        "[0, 1, 0, 1])"]
    assert stack_edges(6, 3, ((1, 5),)) == [0, 1, 3, 6]  # pre; 2 rows; 2 rows + post
    assert stack_edges(4, 3, ((0, 4),)) is None  # 4 rows on 3 stages: no equal runs


def test_same_inputs_same_plan() -> None:
    rng = random.Random(7)
    problems = [random_problem(rng) for _ in range(40)]
    for problem in problems:
        try:
            first = solve_pipeline(problem)
        except InfeasibleError:
            continue
        second = solve_pipeline(problem)
        assert first.plan == second.plan and first.evaluation == second.evaluation


def test_fast_group_takes_more_microbatches() -> None:
    # One layer; a fast device (1 s per microbatch) and a slow one (2 s). Six microbatches:
    # alone, 6 s or 12 s; together T = max(m_fast * 1, m_slow * 2) is 4 s at (4, 2). Gradients
    # are 0 bytes on a 0-latency link, so synchronising costs nothing.
    kind = LayerKind("block", {0: (_option(1, 1.0),), 1: (_option(1, 2.0),)}, 0.0, 0.0)
    problem = PipelineProblem((kind,), (0,), (_group("fast", 1), _group("slow", 1)), FREE,
                              batch=6, microbatch_sizes=(1,), schedules=("1f1b",),
                              remats=("none",))
    solution = solve_pipeline(problem)
    assert solution.evaluation.step_time_s == 4.0
    assert sorted((r.stages[0].group, r.microbatches) for r in solution.plan.replicas) == [
        (0, 4), (1, 2)]


def test_memory_forces_1f1b_over_gpipe() -> None:
    # Two 1 s layers, 1 byte of activation each per microbatch, 2 devices of 2 bytes, four
    # microbatches. GPipe holds all m microbatches: a 2-stage replica fits m <= 2, a 1-stage
    # one m <= 1, so no GPipe plan places four. 1F1B holds min(m, k - i): two 1-stage
    # replicas (1 in flight, 2 bytes) with 2 microbatches each take 2 + 1 * 2 = 4 s; one
    # 2-stage replica takes 2 + 3 * 1 = 5 s.
    kind = LayerKind("block", {0: (_option(1, 1.0, activation=1.0),)}, 0.0, 0.0)
    problem = PipelineProblem((kind,), (0, 0), (_group("d", 2, memory=2.0),), FREE, batch=4,
                              microbatch_sizes=(1,), schedules=("gpipe", "1f1b"),
                              remats=("none",))
    solution = solve_pipeline(problem)
    assert solution.plan.schedule == "1f1b"
    assert solution.evaluation.step_time_s == 4.0
    gpipe_only = PipelineProblem(problem.kinds, problem.layers, problem.groups, FREE, batch=4,
                                 microbatch_sizes=(1,), schedules=("gpipe",),
                                 remats=("none",))
    with pytest.raises(PipelineInfeasibleError):
        solve_pipeline(gpipe_only)


@pytest.mark.parametrize(("memory", "remat", "step"), [(5.0, "full", 1.5), (20.0, "none", 1.0)])
def test_memory_forces_remat(memory: float, remat: str, step: float) -> None:
    # One 1 s layer on one device, one microbatch. Without remat it keeps 10 bytes; full
    # remat keeps 1 byte and recomputes for 0.5 s. 5 bytes of memory force full remat
    # (1.5 s); 20 bytes do not (1.0 s).
    kind = LayerKind("block", {0: (_option(1, 1.0, activation=10.0, full_activation=1.0),)},
                     0.0, 0.0)
    problem = PipelineProblem((kind,), (0,), (_group("d", 1, memory=memory),), FREE, batch=1,
                              microbatch_sizes=(1,), schedules=("1f1b",),
                              remats=("none", "full"))
    solution = solve_pipeline(problem)
    assert solution.plan.replicas[0].stages[0].remat == remat
    assert solution.evaluation.step_time_s == step


def test_interleaving_wins() -> None:
    # Four 1 s layers, 2 devices, two microbatches; gradients 1 byte per layer on a 1 B/s
    # intra-node link. Two 1-device replicas (4 s each) pay sync 2 * 1/2 * 4 / 1 = 4 s: 8 s.
    # One replica: 1 stage 4 + 1 * 4 = 8 s; 2 stages of 2 layers 4 + 1 * 2 = 6 s (GPipe and
    # 1F1B alike); interleaved with 2 stages of chunks {0, 2} and {1, 3}, 4 / 2 + 0 +
    # (2 - 1/2) * 2 = 5 s (m t + (k - 1) t / v).
    kind = LayerKind("block", {0: (_option(1, 1.0),)}, 0.0, 1.0)
    problem = PipelineProblem((kind,), (0, 0, 0, 0), (_group("d", 2),), FREE, batch=2,
                              microbatch_sizes=(1,), schedules=("gpipe", "1f1b", "interleaved"),
                              remats=("none",), chunks=(2,))
    solution = solve_pipeline(problem)
    plan = solution.plan
    assert (plan.schedule, plan.chunks) == ("interleaved", 2)
    assert [s.layers for s in plan.replicas[0].stages] == [(0, 2), (1, 3)]
    assert solution.evaluation.step_time_s == 5.0


def test_sync_uses_the_busiest_stage_and_the_plan_link() -> None:
    # The contract's synchronisation (pipeline.sync_s), per stage: replica 0 holds both 4-byte
    # layers on 1 device (sigma = 4 + 4 = 8), replica 1 one per device (sigma 4 on each
    # stage; the old whole-replica sum would have charged it 8 too). The plan's 3 devices fit
    # one of the 4-device nodes: the intra-node link (2 B/s, 0.5 s latency), latency once per
    # bucket:
    # sync = 2 (2 - 1) / 2 * 8 / 2 + 2 (2 - 1) * 0.5 = 4 + 1 = 5 s.
    intra = Link(2.0, 0.5)
    kind = LayerKind("block", {0: (_option(1), _option(2))}, 0.0, 4.0)
    problem = PipelineProblem((kind,), (0, 0), (_group("d", 8, per_node=4, intra=intra,
                                                       inter=FREE),),
                              FREE, batch=2, microbatch_sizes=(1,), remats=("none",))
    plan = PipelinePlan((Replica((StagePlacement(0, 1, (0, 1)),), 1),
                         Replica((StagePlacement(0, 1, (0,)), StagePlacement(0, 1, (1,))), 1)),
                        1, "1f1b")
    assert sync_link(problem, plan) == intra
    assert evaluate_pipeline(problem, plan).sync_s == 5.0
    # Two stages of 2 devices each in replica 1 halve its figures; replica 0 still sets 8.
    plan2 = PipelinePlan((plan.replicas[0],
                          Replica((StagePlacement(0, 2, (0,)), StagePlacement(0, 2, (1,))), 1)),
                         1, "1f1b")
    assert sync_link(problem, plan2) == FREE  # 5 devices: past the node, the inter-node link
    assert evaluate_pipeline(problem, plan2).sync_s == 2 * 1 / 2 * 8 / 1.0


def test_group_links_set_hops_and_the_slowest_sync_link() -> None:
    # Three groups; groups 0 and 1 share a fast fabric (group_links), group 2 only the slow
    # default. A hop 0 -> 1 runs on the fast link, 1 -> 2 on the default; the all-reduce of a
    # plan on groups {0, 1} runs on the fast link, on {0, 1, 2} on the least bandwidth (1)
    # and the largest latency (0.5) of the three pairs.
    fast, slow = Link(10.0, 0.5), Link(1.0, 0.1)
    o = _option(1)
    kind = LayerKind("block", {0: (o,), 1: (o,), 2: (o,)}, 1.0, 4.0)
    problem = PipelineProblem((kind,), (0, 0), tuple(_group(f"g{g}", 2) for g in range(3)),
                              slow, batch=2, microbatch_sizes=(1,), remats=("none",),
                              group_links={(0, 1): fast})
    a, b, c = (StagePlacement(g, 1, (0,)) for g in range(3))
    assert stage_link(problem, a, b) == fast and stage_link(problem, b, c) == slow
    two = PipelinePlan((Replica((StagePlacement(0, 1, (0, 1)),), 1),
                        Replica((StagePlacement(1, 1, (0, 1)),), 1)), 1, "1f1b")
    assert sync_link(problem, two) == fast
    three = PipelinePlan((Replica((StagePlacement(0, 1, (0,)), StagePlacement(2, 1, (1,))), 1),
                          Replica((StagePlacement(1, 1, (0, 1)),), 1)), 1, "1f1b")
    assert sync_link(problem, three) == Link(1.0, 0.5)
    # sigma: replica 1's single stage, 8 bytes: 2 (1) / 2 * 8 / 1 + 2 * 0.5 = 9 s.
    assert evaluate_pipeline(problem, three).sync_s == 9.0
    # The search agrees with the brute force on such a problem.
    assert _objective(problem) == best(problem)[0]


def test_infeasible_reports_memory_and_device_figures() -> None:
    # One layer: 12 bytes of state on 1 device or 6 on 2, plus 1 byte of activation. Group a
    # (10 bytes per device) needs 2 devices and has 1; group b (3 bytes) cannot hold it.
    # Floors: a min(13, 7) = 7 bytes, b 13 bytes.
    kind = LayerKind("block", {0: (_option(1, activation=1.0, state=12.0),
                                   _option(2, activation=1.0, state=6.0)),
                               1: (_option(1, activation=1.0, state=12.0),)}, 0.0, 0.0)
    problem = PipelineProblem((kind,), (0,), (_group("a", 1, memory=10.0),
                                              _group("b", 1, memory=3.0)), FREE, batch=1,
                              microbatch_sizes=(1,), remats=("none",))
    with pytest.raises(PipelineInfeasibleError) as info:
        solve_pipeline(problem)
    report = info.value.report
    assert report.memory_floor_bytes == (7.0, 13.0)
    assert report.min_devices == (2, None)
    assert report.devices == (1, 1)
    message = str(info.value)
    assert "the model fits on 2 x a alone (there are 1)" in message
    assert "no number of b alone holds the model" in message
    assert "7 bytes per device" in message and "fix:" in message


def test_infeasible_report_counts_the_working_bytes() -> None:
    # Three layers of 2 bytes of state and 1 byte of activation under full remat, which
    # recomputes 3 bytes per layer at once in the backward (stage_held: state + summed
    # recomputed bytes + activation): one layer alone holds 2 + 3 + 1 = 6 bytes, two 4 + 6 +
    # 2 = 12. With 10 bytes per device a stage holds one layer: a replica needs 3 devices
    # (state and activation alone would put all three on one device: 6 + 3 = 9 bytes).
    o = dataclasses.replace(_option(1, state=2.0, full_activation=1.0),
                            recompute_bytes={"full": 3.0})
    kind = LayerKind("block", {0: (o,)}, 0.0, 0.0)
    problem = PipelineProblem((kind,), (0, 0, 0), (_group("a", 2, memory=10.0),), FREE,
                              batch=1, microbatch_sizes=(1,), remats=("full",))
    with pytest.raises(PipelineInfeasibleError) as info:
        solve_pipeline(problem)
    report = info.value.report
    assert report.memory_floor_bytes == (6.0,)
    assert report.min_devices == (3,)
    assert "the model fits on 3 x a alone (there are 2)" in str(info.value)


def test_a_replica_the_schedule_cannot_hold_is_proven_infeasible_without_search() -> None:
    # Five layers of 1 byte of state and 3 of activation per sample, 2 devices of 12 bytes,
    # five microbatches of one sample under 1F1B. With one microbatch in flight a stage holds
    # 3 layers (4 bytes each), so both devices together could hold 6 >= 5 and one replica
    # at most (6 < 10); but that replica runs all five microbatches, and its stage second
    # from the end holds two of them: 1 layer (7 bytes). 3 + 1 < 5: no plan, proven before
    # any search (a work limit of 1 unit would otherwise end it unproven).
    kind = LayerKind("block", {0: (_option(1, state=1.0, activation=3.0),)}, 0.0, 0.0)
    problem = PipelineProblem((kind,), (0,) * 5, (_group("a", 2, memory=12.0),), FREE,
                              batch=5, microbatch_sizes=(1,), schedules=("1f1b",),
                              remats=("none",), work_limit=1)
    with pytest.raises(PipelineInfeasibleError) as info:
        solve_pipeline(problem)
    assert info.value.report.min_devices == (2,)
    assert "no plan meets every constraint together" in str(info.value)
    # four layers fit (3 on the last stage, 1 on the one before): a plan, found
    assert solve_pipeline(dataclasses.replace(problem, layers=(0,) * 4,
                                              work_limit=0)).evaluation.feasible


def test_negative_price_is_rejected() -> None:
    kind = LayerKind("block", {0: (_option(1),)}, 0.0, 0.0)
    group = DeviceGroup("d", 1, 1, 10.0, -1.0, FREE, FREE)
    problem = PipelineProblem((kind,), (0,), (group,), FREE, batch=1, microbatch_sizes=(1,),
                              objective="cost")
    with pytest.raises(ConfigError, match="price"):
        solve_pipeline(problem)


def test_replica_figures_match_the_evaluator() -> None:
    # What the search compares (T(m), memory cap) is what evaluate_pipeline computes.
    rng = random.Random(3)
    checked = 0
    while checked < 300:
        problem = random_problem(rng)
        if count_plans(problem, PLAN_LIMIT) > PLAN_LIMIT:
            continue
        for plan in itertools.islice(all_plans(problem), 0, None, 7):
            ev = evaluate_pipeline(problem, plan)
            v = plan.chunks if plan.schedule == "interleaved" else 1
            for r, replica in enumerate(plan.replicas):
                shape = shape_of(problem, plan.microbatch_size, plan.schedule, v,
                                 replica.stages)
                fits = all(not vi.startswith(f"replica {r}, ") for vi in ev.violations)
                if shape is None:
                    assert not fits
                    continue
                assert (replica.microbatches <= shape.cap) == fits
                assert math.isclose(shape.time_s(replica.microbatches), ev.replica_time_s[r],
                                    rel_tol=1e-12)
                checked += 1


def _gpt_like() -> PipelineProblem:
    """An embedding, six identical blocks and a head on 6 fast and 4 slow devices (4 per
    node): TP-style options on 1-8 devices with a 10 % loss per doubling, three remats."""
    def options(speed: float, work: float, state: float, act: float) -> tuple[LayerOption, ...]:
        out = []
        for d in (1, 2, 4, 8):
            t = work / (speed * d * 0.9 ** (d.bit_length() - 1))
            out.append(LayerOption(
                d, (1e-3, t / 3), (2e-3, 2 * t / 3),
                {"none": (0.0, 0.0), "selective": (0.0, 0.1 * t), "full": (0.0, t / 3)},
                {"none": act / d, "selective": 0.4 * act / d, "full": 0.1 * act},
                state / d, 0.01 * state / d))
        return tuple(out)

    def kind(name: str, work: float, state: float, act: float, boundary: float,
             grads: float) -> LayerKind:
        return LayerKind(name, {0: options(3.0, work, state, act),
                                1: options(1.0, work, state, act)}, boundary, grads)

    groups = (DeviceGroup("fast", 6, 4, 40.0, 3.0, Link(100.0, 1e-5), Link(10.0, 1e-4)),
              DeviceGroup("slow", 4, 4, 25.0, 1.0, Link(100.0, 1e-5), Link(10.0, 1e-4)))
    kinds = (kind("block", 1.0, 20.0, 6.0, 2.0, 8.0), kind("embed", 0.2, 10.0, 1.0, 2.0, 4.0),
             kind("head", 0.5, 10.0, 3.0, 0.5, 4.0))
    return PipelineProblem(kinds, (1, 0, 0, 0, 0, 0, 0, 2), groups, Link(5.0, 1e-4), batch=16,
                           microbatch_sizes=(1, 2, 4), chunks=(2,))


def test_bounds_keep_the_optimum_on_a_larger_problem() -> None:
    # Beyond the brute force: the planner (quick first plan, configurations best first, every
    # bound from the best plan so far) against the same search with no bound at all.
    problem = _gpt_like()
    solution = solve_pipeline(problem)
    bound_for = _bounds(problem)
    unbounded = math.inf
    for mb, schedule, v in _configs(problem):
        bound = bound_for(mb, math.inf)
        shapes, _ = replica_shapes(problem, mb, schedule, v, bound)
        mix = best_mix(problem, shapes, bound) if shapes else None
        if mix is not None:
            unbounded = min(unbounded, mix.value)
    step = solution.evaluation.step_time_s
    assert step == unbounded or math.isclose(step, unbounded, rel_tol=1e-12)
    # The optimum pipelines the model over three 2-device sub-meshes of the fast group, with
    # stages of unequal lengths and remat only where memory is tight (the first stage).
    (replica,) = solution.plan.replicas
    assert [(s.group, s.devices, len(s.layers), s.remat) for s in replica.stages] == [
        (0, 2, 3, "selective"), (0, 2, 2, "none"), (0, 2, 3, "none")]
    assert solve_pipeline(problem).plan == solution.plan


def test_a_work_limit_cuts_the_search_the_same_way_every_time() -> None:
    # The work budget counts labels, states and sweep steps, not seconds: the same cut, the
    # same plan, however loaded the machine; the proven floor stays below it.
    problem = dataclasses.replace(_gpt_like(), work_limit=300, time_limit_s=600.0)
    first = solve_pipeline(problem)
    assert not first.stats.optimal and first.stats.work > 300
    assert first.stats.lower_bound <= first.evaluation.step_time_s
    for _ in range(2):
        again = solve_pipeline(problem)
        assert again.plan == first.plan and again.stats.work == first.stats.work
    full = solve_pipeline(_gpt_like())
    assert full.stats.optimal and full.stats.work > first.stats.work
    assert full.evaluation.step_time_s <= first.evaluation.step_time_s


def test_seeds_bound_the_search_and_are_never_beaten_for_worse() -> None:
    problem = _gpt_like()
    full = solve_pipeline(problem)
    # A search cut at once returns its best seed; an infeasible seed is ignored.
    bad = dataclasses.replace(full.plan, microbatch_size=3)
    cut = solve_pipeline(dataclasses.replace(problem, work_limit=1), seeds=[bad, full.plan])
    assert cut.plan == full.plan and cut.stats.seed == 1
    # A whole search from a worse seed still ends at the optimum.
    worse = solve_pipeline(dataclasses.replace(problem, work_limit=300))
    again = solve_pipeline(problem, seeds=[worse.plan])
    assert again.stats.optimal and again.plan == full.plan and again.stats.seed == -1


def test_fluid_bound_is_below_every_plan_of_its_configuration() -> None:
    # Rule F: per (microbatch size, schedule, chunks), no plan beats the fluid bound. Checked
    # against every plan of random small problems; the bound is also not vacuous.
    rng = random.Random(11)
    checked = tight = 0
    while checked < 80:
        problem = random_problem(rng)
        if count_plans(problem, PLAN_LIMIT) > PLAN_LIMIT:
            continue
        least: dict[tuple[int, str, int], float] = {}
        for plan in all_plans(problem):
            key = (plan.microbatch_size, plan.schedule, plan.chunks)
            least[key] = min(least.get(key, math.inf), objective(problem, plan))
        for (mb, schedule, v), value in least.items():
            floor = config_bound(problem, mb, schedule, v)  # type: ignore[arg-type]
            assert floor <= value, (checked, mb, schedule, v, floor, value)
            tight += value < math.inf and floor > 0.5 * value
        checked += 1
    assert tight > 20


def test_time_limit_returns_the_best_plan_found_and_a_lower_bound() -> None:
    # Past its time limit the search keeps the quick plan (uniform replicas) and proves a
    # lower bound: the least fluid bound of the configurations it did not finish.
    problem = _gpt_like()
    exact = solve_pipeline(problem)
    assert exact.stats.optimal and exact.stats.lower_bound == exact.evaluation.step_time_s
    cut = solve_pipeline(dataclasses.replace(problem, time_limit_s=0.0))
    assert not cut.stats.optimal
    assert cut.evaluation.feasible
    assert 0 < cut.stats.lower_bound <= exact.evaluation.step_time_s
    assert exact.evaluation.step_time_s <= cut.evaluation.step_time_s


def test_a_search_cut_by_its_budget_keeps_the_best_plan_on_each_type_alone() -> None:
    # The phase that searches each group alone (its shapes mixed over the groups) reaches
    # the best one-type plan in a fraction of the work the full search spends (14,434 units
    # here): cut at 5,000 units, the search returns what homogeneous_only finds with no
    # limit. Without that phase (TYPED_SHARE = 0) the same cut kept the quick plan, 27 %
    # slower (11.07 s), and still did at 10,000 units.
    problem = _gpt_like()
    alone = homogeneous_only(problem, lambda p: solve_pipeline(p).plan, group=0)
    assert alone is not None
    cut = solve_pipeline(dataclasses.replace(problem, work_limit=5000, time_limit_s=600.0))
    assert not cut.stats.optimal
    assert cut.evaluation.step_time_s <= evaluate_pipeline(problem, alone).step_time_s


def test_every_replica_pays_the_fill_in_the_floor() -> None:
    # With as many replicas as microbatches the fluid term (M - R <= F(tau)) bounds nothing;
    # each replica still runs a microbatch through both layers: 2 x 1 s.
    kind = LayerKind("block", {0: (_option(),)}, 0.0, 0.0)
    problem = PipelineProblem((kind,), (0, 0), (_group("d", 4),), FREE, batch=4,
                              microbatch_sizes=(1,), schedules=("1f1b",), remats=("none",))
    assert config_bound(problem, 1, "1f1b", 1) == pytest.approx(2.0, rel=1e-6)
    assert solve_pipeline(problem).evaluation.step_time_s == pytest.approx(2.0)


def test_a_microbatch_no_layer_option_holds_has_no_floor_below_infinity() -> None:
    # 3 bytes of activation per sample, 4 bytes of memory: two samples fit no stage.
    kind = LayerKind("block", {0: (_option(activation=3.0),)}, 0.0, 0.0)
    problem = PipelineProblem((kind,), (0, 0), (_group("d", 2, memory=4.0),), FREE,
                              batch=4, microbatch_sizes=(1, 2), schedules=("1f1b",),
                              remats=("none",))
    assert config_bound(problem, 2, "1f1b", 1) == math.inf
    assert config_bound(problem, 1, "1f1b", 1) < math.inf


def test_two_type_replicas_give_the_slower_type_fewer_layers() -> None:
    # Six blocks, 1 s per sample on the fast device and 2 s on the slow one; neither holds
    # the model alone (4 and 3 blocks of state). The one plan that uses both pipelines four
    # blocks on the fast device and two on the slow one: equal stage times, 4 s each.
    kind = LayerKind("block", {0: (_option(seconds=1.0, state=1.0),),
                               1: (_option(seconds=2.0, state=1.0),)}, 0.0, 0.0)
    groups = (_group("fast", 1, memory=4.5), _group("slow", 1, memory=3.5))
    problem = PipelineProblem((kind,), (0,) * 6, groups, FREE, batch=4, microbatch_sizes=(1,),
                              schedules=("1f1b",), remats=("none",))
    shapes = two_type_shapes(problem, 1, "1f1b", 1, _Types(problem, 1))
    layouts = {tuple((s.group, len(s.layers)) for s in shape.stages) for shape in shapes}
    assert ((0, 4), (1, 2)) in layouts
    best = solve_pipeline(problem)
    (replica,) = best.plan.replicas
    assert [(s.group, len(s.layers)) for s in replica.stages] == [(0, 4), (1, 2)]
    # Cut at 40 work units (the exact search needs 72; the quick plans find nothing, as each
    # type alone cannot hold the model), the two-type replicas still give it; without them
    # the search ends with no plan.
    cut = solve_pipeline(dataclasses.replace(problem, work_limit=40, time_limit_s=600.0))
    assert not cut.stats.optimal
    assert cut.evaluation.step_time_s == best.evaluation.step_time_s
