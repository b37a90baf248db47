"""The pipeline event simulator (``shardplan.solver.stages.simulate``) against the planner's closed form
(``shardplan.solver.stages.pipeline``).

Three layers: textbook cases worked out by hand; exact agreement with ``evaluate_pipeline``
where its formula is exact; and, on random plans, every difference the simulator's module
docstring documents, each checked against the formula that explains it. Hops run on a
1 byte/s link without latency at ``mb = 1``, so a hop's ``boundary_bytes`` is its one-way
seconds.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import defaultdict

import pytest
from helpers.plans import BYTE_PER_S, NO_REMAT, balanced_problem, chain_problem, flat_option

from shardplan.errors import PipelineError
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
    evaluate_pipeline,
    in_flight,
    stage_link,
)
from shardplan.solver.stages.simulate import Event, device_order, simulate

# --- Random plans ------------------------------------------------------------------------------


def _random_problem(rng: random.Random, n_layers: int, *, kinds: int, groups: int,
                    transfers: bool, latency_s: float = 0.05) -> PipelineProblem:
    """Layer kinds with different backward/forward ratios and activations per group and
    sub-mesh size; groups with their own links."""
    remat_seconds = {"none": (0.0, 0.0)}
    out_kinds = []
    for kind in range(kinds):
        options = {}
        for g in range(groups):
            speed, ratio = rng.uniform(0.5, 2.0), rng.uniform(1.5, 3.0)
            opts = []
            for d in (1, 2, 4):
                f = rng.uniform(0.5, 1.5) * speed / d ** 0.8
                opts.append(LayerOption(
                    d, (0.1 * f, f), (0.1 * f * ratio, f * ratio),
                    {**remat_seconds, "selective": (0.0, 0.3 * f), "full": (0.05 * f, f)},
                    {"none": 100.0 * (kind + 1), "selective": 40.0 * (kind + 1), "full": 5.0},
                    1000.0 / d, 0.01 * f))
            options[g] = tuple(opts)
        out_kinds.append(LayerKind(f"kind{kind}", options,
                                   boundary_bytes=rng.uniform(0.2, 2.0) if transfers else 0.0,
                                   gradient_bytes=rng.uniform(1.0, 10.0)))
    lat = latency_s if transfers else 0.0
    out_groups = tuple(
        DeviceGroup(f"group{g}", 64, 8, 1e18, 1.0, Link(rng.uniform(2, 8), lat),
                    Link(rng.uniform(0.5, 2), 2 * lat)) for g in range(groups))
    return PipelineProblem(tuple(out_kinds), tuple(rng.randrange(kinds) for _ in range(n_layers)),
                           out_groups, Link(rng.uniform(0.3, 1.0), lat), batch=1,
                           microbatch_sizes=(1,))


def _random_case(rng: random.Random, schedule: Schedule, *, balanced: bool,
                 transfers: bool) -> tuple[PipelineProblem, PipelinePlan]:
    """A random valid plan: 1-3 replicas of 2-5 stages (unbalanced: 1-5 stages, replicas differ
    in stage count, cuts, groups, sub-mesh sizes and remat), 1-24 microbatches (interleaved: a
    multiple of the stages up to 6 k), mb 1, 2 or 4."""
    v = rng.choice((2, 3, 4)) if schedule == "interleaved" else 1
    k = rng.randint(2, 5)
    n = k * v * rng.randint(1, 3) if schedule == "interleaved" or balanced else rng.randint(k, 16)
    kinds, groups = (1, 1) if balanced else (2, 2)
    problem = _random_problem(rng, n, kinds=kinds, groups=groups, transfers=transfers)
    replicas = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        if schedule == "interleaved":
            size = n // (k * v)
            layers = [tuple(x for c in range(v) for x in range((i + c * k) * size,
                                                                (i + c * k + 1) * size))
                      for i in range(k)]
        elif balanced:
            layers = [tuple(range(i * n // k, (i + 1) * n // k)) for i in range(k)]
        else:
            cuts = [0, *sorted(rng.sample(range(1, n), min(rng.randint(1, 5), n) - 1)), n]
            layers = [tuple(range(a, b)) for a, b in itertools.pairwise(cuts)]
        stages = tuple(
            StagePlacement(0, 1, ls) if balanced else
            StagePlacement(rng.randrange(groups), rng.choice((1, 2, 4)), ls,
                           rng.choice(("none", "selective", "full"))) for ls in layers)
        m = len(stages) * rng.randint(1, 6) if schedule == "interleaved" else rng.randint(1, 24)
        replicas.append(Replica(stages, m))
    mb = rng.choice((1, 2, 4))
    batch = sum(r.microbatches for r in replicas) * mb
    problem = PipelineProblem(problem.kinds, problem.layers, problem.groups,
                              problem.between_groups, batch, (mb,), chunks=(max(v, 2),))
    return problem, PipelinePlan(tuple(replicas), mb, schedule, v)


def _stage_seconds(problem: PipelineProblem, plan: PipelinePlan, r: int
                   ) -> tuple[list[float], list[float], dict[tuple[int, int], list[float]]]:
    """Per stage forward / backward seconds and per hop one-way seconds, from the option data
    (an independent re-derivation for the reference formulas)."""
    mb, rep = plan.microbatch_size, plan.replicas[r]
    v = plan.chunks if plan.schedule == "interleaved" else 1
    f: list[float] = []
    b: list[float] = []
    for s in rep.stages:
        opts = [o for x in s.layers
                if (o := problem.kinds[problem.layers[x]].option(s.group, s.devices))]
        f.append(sum(o.forward_s[0] + o.forward_s[1] * mb for o in opts))
        b.append(sum(o.backward_s[0] + o.backward_s[1] * mb + o.recompute_s[s.remat][0]
                     + o.recompute_s[s.remat][1] * mb for o in opts))
    order = [x for c in range(v) for s in rep.stages
             for x in s.layers[c * len(s.layers) // v:(c + 1) * len(s.layers) // v]]
    stage_of = {x: i for i, s in enumerate(rep.stages) for x in s.layers}
    hops: dict[tuple[int, int], list[float]] = defaultdict(list)
    for a, nxt in itertools.pairwise(order):
        if stage_of[a] != stage_of[nxt]:
            link = stage_link(problem, rep.stages[stage_of[a]], rep.stages[stage_of[nxt]])
            hops[stage_of[a], stage_of[nxt]].append(
                link.time_s(problem.kinds[problem.layers[a]].boundary_bytes * mb))
    return f, b, hops


def _rel(a: float, b: float) -> float:
    return abs(a - b) / b


# --- Textbook cases ----------------------------------------------------------------------------


@pytest.mark.parametrize(("k", "m"), [(2, 4), (4, 4), (4, 12), (8, 3)])
def test_gpipe_bubble_is_textbook(k: int, m: int) -> None:
    # Equal stages t = 1 + 2 s, no transfers: GPipe takes (m + k - 1) t, bubble (k-1)/(m+k-1)
    # (Huang et al. 2019, Sec. 2.3).
    sim = simulate(*balanced_problem(k, m, "gpipe"))
    assert sim.step_time_s == pytest.approx((m + k - 1) * 3.0, rel=1e-12)
    assert sim.bubble_fraction == pytest.approx((k - 1) / (m + k - 1), rel=1e-12)
    assert sim.peak_in_flight[0] == (float(m),) * k


@pytest.mark.parametrize(("k", "m"), [(2, 4), (4, 4), (4, 12), (8, 3)])
def test_1f1b_takes_gpipe_time_with_less_memory(k: int, m: int) -> None:
    gpipe, one = simulate(*balanced_problem(k, m, "gpipe")), simulate(*balanced_problem(k, m, "1f1b"))
    assert one.step_time_s == pytest.approx(gpipe.step_time_s, rel=1e-12)
    assert one.bubble_fraction == pytest.approx(gpipe.bubble_fraction, rel=1e-12)
    assert one.peak_in_flight[0] == tuple(float(min(m, k - i)) for i in range(k))
    assert all(a <= b for a, b in zip(one.peak_memory_bytes[0], gpipe.peak_memory_bytes[0],
                                      strict=True))
    assert sum(one.peak_memory_bytes[0]) < sum(gpipe.peak_memory_bytes[0])


@pytest.mark.parametrize(("k", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 8, 4), (3, 12, 3)])
def test_interleaving_cuts_the_bubble_v_fold(k: int, m: int, v: int) -> None:
    # Narayanan et al. 2021, Sec. 2.2: the bubble shrinks from (k-1) t to (k-1) t / v, so the
    # step is m t + (k - 1) t / v and every device idles (k - 1) t / v.
    t = 3.0
    one, inter = simulate(*balanced_problem(k, m, "1f1b")), simulate(*balanced_problem(k, m, "interleaved", v))
    assert inter.step_time_s == pytest.approx(m * t + (k - 1) * t / v, rel=1e-12)
    idle_one = one.bubble_fraction * one.step_time_s
    idle_inter = inter.bubble_fraction * inter.step_time_s
    assert idle_one / idle_inter == pytest.approx(v, rel=1e-12)


def test_interleaved_timeline_worked_by_hand() -> None:
    # k = 2, v = 2, m = 2, chunks F 1 s, B 2 s. Stage 0 warms up min(4, 2 + 2) = 4 forwards
    # (all), stage 1 warms up 2: F(c0,j0) F(c0,j1) | F(c1,j0) B(c1,j0) F(c1,j1) B(c1,j1) |
    # B(c0,j0) B(c0,j1). Stage 1: F 1-2, 2-3, F(c1,j0) 3-4 (after stage 0's F(c1,j0) 2-3),
    # B 4-6, F(c1,j1) 6-7, B 7-9, B(c0,j0) 9-11 (stage 0's B(c1,j0) 6-8), B(c0,j1) 11-13
    # (stage 0's B(c1,j1) 9-11); stage 0's B(c0,j0) 11-13, B(c0,j1) 13-15: m t + t / v = 15.
    sim = simulate(*chain_problem([1.0] * 4, [2.0] * 4, [0.0] * 4, 2, "interleaved", 2), timeline=True)
    stage1 = [(e.kind, e.chunk, e.microbatch, e.start_s, e.end_s)
              for e in sim.events if e.stage == 1 and e.to_stage is None]
    assert stage1 == [("forward", 0, 0, 1, 2), ("forward", 0, 1, 2, 3), ("forward", 1, 0, 3, 4),
                      ("backward", 1, 0, 4, 6), ("forward", 1, 1, 6, 7),
                      ("backward", 1, 1, 7, 9), ("backward", 0, 0, 9, 11),
                      ("backward", 0, 1, 11, 13)]
    assert sim.step_time_s == 15.0
    assert sim.peak_chunks[0] == (4, 3)


def test_device_order_follows_megatron() -> None:
    # k = 4, v = 2, stage 0: W = 2 (k - 1) + (v - 1) k = 10 of the 16 chunk-forwards first;
    # forward step s runs chunk (s mod 8) // 4 of microbatch (s // 8) 4 + s mod 4.
    order = device_order("interleaved", 0, 4, 8, 2)
    assert [c for kind, _, c in order[:10]] == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    assert order[10:12] == [("forward", 6, 0), ("backward", 0, 1)]
    assert len(order) == 32 and order[-1] == ("backward", 7, 0)
    assert device_order("gpipe", 1, 2, 2) == [("forward", 0, 0), ("forward", 1, 0),
                                              ("backward", 0, 0), ("backward", 1, 0)]


# --- Where the closed form is exact ----------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_closed_form_exact_on_balanced_plans(schedule: Schedule) -> None:
    # Balanced stages without transfers, 1-3 replicas (sync and update included): the
    # closed form is the simulation, well inside the 2 %.
    rng = random.Random(f"balanced-{schedule}")
    for _ in range(60):
        problem, plan = _random_case(rng, schedule, balanced=True, transfers=False)
        sim, ev = simulate(problem, plan), evaluate_pipeline(problem, plan)
        assert sim.step_time_s == pytest.approx(ev.step_time_s, rel=1e-9)
        assert sim.sync_s == pytest.approx(ev.sync_s, rel=1e-12)
        assert sim.update_s == pytest.approx(ev.update_s, rel=1e-12)


def test_sync_worked_by_hand() -> None:
    # Two replicas of one stage (layers 0, 1 on 1 device) in one node: one bucket of 16 bytes
    # per device, ring all-reduced in 2 (R - 1) = 2 steps of 0.5 s + 8 bytes / 4 bytes/s:
    # 5 s. Pipeline 2 microbatches x 6 s; update 0.25 s per layer, 0.5 per stage.
    option = LayerOption(1, (1.0, 0.0), (2.0, 0.0), NO_REMAT, {"none": 1.0}, 0.0, 0.25)
    kind = LayerKind("block", {0: (option,)}, boundary_bytes=0.0, gradient_bytes=8.0)
    link = Link(4.0, 0.5)
    problem = PipelineProblem((kind,), (0, 0), (DeviceGroup("dev", 2, 2, 1e18, 1.0, link, link),),
                              link, batch=4, microbatch_sizes=(1,), remats=("none",))
    stage = StagePlacement(0, 1, (0, 1))
    plan = PipelinePlan((Replica((stage,), 2), Replica((stage,), 2)), 1, "1f1b")
    sim = simulate(problem, plan)
    assert (sim.replica_time_s, sim.sync_s, sim.update_s) == ((12.0, 12.0), 5.0, 0.5)
    assert sim.step_time_s == 17.5 == evaluate_pipeline(problem, plan).step_time_s


def test_each_stage_updates_after_its_own_all_reduce() -> None:
    # Two replicas cut alike: stage 0 holds layer 0 (16 bytes of gradient, update 0 s), stage 1
    # layer 1 (4 bytes, update 2 s); 0-latency 4 bytes/s link, R = 2. Stage 0's group
    # all-reduces 2 * 1/2 * 16 / 4 = 4 s, stage 1's 1 s, then updates 2 s: done at 4 and 3 s.
    # The closed form charges max sync + max update = 4 + 2 = 6 s; the simulator 4 s.
    # Cut differently (replica 1 one stage of both layers), all four stages form one group
    # that ends with replica 1's 20-byte bucket at 5 s: the closed form's sync (max sigma 20)
    # is then the simulator's, and stage 1 of replica 0 updates from 5 to 7 s.
    link = Link(4.0, 0.0)
    options = [LayerOption(1, (1.0, 0.0), (1.0, 0.0), NO_REMAT, {"none": 0.0}, 0.0, u)
               for u in (0.0, 2.0)]
    kinds = tuple(LayerKind(f"k{i}", {0: (o,)}, 0.0, g)
                  for i, (o, g) in enumerate(zip(options, (16.0, 4.0), strict=True)))
    group = DeviceGroup("dev", 4, 4, 1e18, 1.0, link, link)
    problem = PipelineProblem(kinds, (0, 1), (group,), link, batch=2, microbatch_sizes=(1,),
                              remats=("none",))
    cut = (StagePlacement(0, 1, (0,)), StagePlacement(0, 1, (1,)))
    plan = PipelinePlan((Replica(cut, 1), Replica(cut, 1)), 1, "1f1b")
    sim, ev = simulate(problem, plan), evaluate_pipeline(problem, plan)
    assert (sim.sync_s, sim.update_s, ev.sync_s, ev.update_s) == (4.0, 2.0, 4.0, 2.0)
    assert (sim.step_time_s - max(sim.replica_time_s), ev.step_time_s - max(ev.replica_time_s)
            ) == (4.0, 6.0)
    plan = PipelinePlan((Replica(cut, 1), Replica((StagePlacement(0, 1, (0, 1)),), 1)), 1,
                        "1f1b")
    sim, ev = simulate(problem, plan), evaluate_pipeline(problem, plan)
    assert (sim.sync_s, ev.sync_s) == (5.0, 5.0)
    assert sim.step_time_s - max(sim.replica_time_s) == 7.0


# --- Where it is not: each difference against the formula that explains it --------------------


def _gpipe_reference(problem: PipelineProblem, plan: PipelinePlan,
                     r: int) -> tuple[float, float, float]:
    """(``sum f' + sum b'``, ``max f' + max b'``, the closed form's ``max(max t, max c)``)."""
    f, b, hops = _stage_seconds(problem, plan, r)
    one_way = [x for xs in hops.values() for x in xs]
    fp, bp = f + one_way, b + one_way
    closed = max([x + y for x, y in zip(f, b, strict=True)] + [2 * x for x in one_way])
    return sum(fp) + sum(bp), max(fp) + max(bp), closed


def test_gpipe_pays_both_bottlenecks_worked_by_hand() -> None:
    # Stage 0 F 1 B 3, stage 1 F 2 B 1, m = 4. Forwards: stage 1 runs 1-3, 3-5, 5-7, 7-9;
    # backwards 9-10 .. 12-13; stage 0's backwards follow each 10-13, 13-16, 16-19, 19-22.
    # 22 = sum f + sum b + (m-1)(max f + max b); the closed form charges (m-1) max t: 7 + 12.
    problem, plan = chain_problem([1.0, 2.0], [3.0, 1.0], [0.0, 0.0], 4, "gpipe")
    assert simulate(problem, plan).step_time_s == 22.0
    assert evaluate_pipeline(problem, plan).step_time_s == 19.0


def _window_reference(problem: PipelineProblem, plan: PipelinePlan, r: int) -> float:
    """1F1B's closed form re-derived: ``sum t + sum c + (m - 1) P`` with ``P`` the most of
    ``max t``, ``max c / 2`` and every window average, by plain loops."""
    f, b, hops = _stage_seconds(problem, plan, r)
    k, m = len(f), plan.replicas[r].microbatches
    t = [x + y for x, y in zip(f, b, strict=True)]
    c = [2 * hops[i, i + 1][0] for i in range(k - 1)]
    period = max([*t, *(x / 2 for x in c)])
    for i in range(k):
        for j in range(i + 1, k):
            period = max(period, (sum(t[i:j + 1]) + sum(c[i:j])) / (j - i + 1))
    return sum(t) + sum(c) + (m - 1) * period


def test_gpipe_is_exactly_the_split_bottleneck_formula() -> None:
    # Unbalanced stages (remat, mixed kinds and groups) with transfers, 1-3 replicas: the
    # simulation is sum f' + sum b' + (m - 1)(max f' + max b'); the closed form is 1F1B's (rule
    # G of the stage planner), which the split bottleneck exceeds when the forward and the
    # backward bottleneck sit on different stages.
    rng = random.Random("gpipe-split")
    differ = 0
    for _ in range(120):
        problem, plan = _random_case(rng, "gpipe", balanced=False, transfers=True)
        sim, ev = simulate(problem, plan), evaluate_pipeline(problem, plan)
        for r, replica in enumerate(plan.replicas):
            total, split, _ = _gpipe_reference(problem, plan, r)
            m = replica.microbatches
            assert sim.replica_time_s[r] == pytest.approx(total + (m - 1) * split, rel=1e-9)
            assert ev.replica_time_s[r] == pytest.approx(_window_reference(problem, plan, r),
                                                         rel=1e-9)
            differ += sim.replica_time_s[r] > ev.replica_time_s[r] * (1 + 1e-9)
    assert differ > 0  # the sample does exercise the difference


def test_1f1b_closed_form_never_undershoots() -> None:
    # The window formula is an upper bound of the simulation on unbalanced random plans with
    # and without transfers, and exact on balanced plans without transfers.
    rng = random.Random("1f1b-upper")
    over = []
    for balanced, transfers in itertools.product((True, False), (False, True)):
        for _ in range(60):
            problem, plan = _random_case(rng, "1f1b", balanced=balanced, transfers=transfers)
            sim, ev = simulate(problem, plan), evaluate_pipeline(problem, plan)
            for r in range(len(plan.replicas)):
                assert ev.replica_time_s[r] == pytest.approx(
                    _window_reference(problem, plan, r), rel=1e-9)
                assert ev.replica_time_s[r] >= sim.replica_time_s[r] * (1 - 1e-9)
                if balanced and not transfers:
                    assert ev.replica_time_s[r] == pytest.approx(sim.replica_time_s[r],
                                                                 rel=1e-9)
                over.append(ev.replica_time_s[r] / sim.replica_time_s[r] - 1)
    assert sorted(over)[len(over) // 2] < 0.01  # the median plan is within 1 %


def test_1f1b_hides_the_round_trip_below_a_bottleneck() -> None:
    # Stage 0 F 2 B 4 (t 6), stage 1 F 1 B 1, m = 4. Stage 0 runs F0 0-2, F1 2-4, B0 4-8 (the
    # round trip 2-4 hid under F1), F2 8-10, B1 10-14, F3 14-16, B2 16-20, B3 20-24: never
    # idle, 24 = m t_0. The closed form charges sum t + (m-1) max t = 8 + 18 = 26.
    problem, plan = chain_problem([2.0, 1.0], [4.0, 1.0], [0.0, 0.0], 4)
    assert simulate(problem, plan).step_time_s == 24.0
    assert evaluate_pipeline(problem, plan).step_time_s == 26.0


def test_1f1b_lower_bounds_per_stage() -> None:
    # Stage i alone needs sum_{l<i}(t_l + c_l) + max(m t_i, f_i + R_i + m b_i + (m - w_i) f_i)
    # (R_i the round trip below it, w_i = min(m, k - i) its warm-up): the simulation never
    # beats it, while the closed form, which charges all of R_i, can overshoot the simulation.
    rng = random.Random("1f1b-bounds")
    overshoot = 0.0
    for transfers in (False, True):
        for _ in range(60):
            problem, plan = _random_case(rng, "1f1b", balanced=False, transfers=transfers)
            sim, ev = simulate(problem, plan), evaluate_pipeline(problem, plan)
            for r, replica in enumerate(plan.replicas):
                f, b, hops = _stage_seconds(problem, plan, r)
                k, m = len(f), replica.microbatches
                t = [x + y for x, y in zip(f, b, strict=True)]
                c = [2 * hops[i, i + 1][0] if (i, i + 1) in hops else 0.0 for i in range(k)]
                for i in range(k):
                    w = min(m, k - i)
                    bound = sum(t[:i]) + sum(c[:i]) + max(
                        m * t[i], f[i] + sum(t[i + 1:]) + sum(c[i:]) + m * b[i] + (m - w) * f[i])
                    assert sim.replica_time_s[r] >= bound * (1 - 1e-12)
                overshoot = max(overshoot, ev.replica_time_s[r] / sim.replica_time_s[r] - 1)
    assert overshoot > 0.02


def test_1f1b_transfers_lengthen_the_steady_state() -> None:
    # Balanced k = 4, t = 3, every hop 1 s each way (c = 2). Stage 0 holds at most k = 4
    # microbatches and one round trip takes sum t + sum c = 12 + 6 = 18 s, so 4 more
    # microbatches cost 18 s (period 4.5, the window of all four stages), not 4 max(t, c) =
    # 12 s. The closed form charges the same period (from the second microbatch on, where the
    # simulation's first microbatches still flow faster: 0.5 s over at every m).
    steps = [simulate(*chain_problem([1.0] * 4, [2.0] * 4, [1.0] * 4, m)).step_time_s
             for m in (4, 8, 12, 16)]
    assert [b - a for a, b in itertools.pairwise(steps)] == [18.0, 18.0, 18.0]
    closed = [evaluate_pipeline(*chain_problem([1.0] * 4, [2.0] * 4, [1.0] * 4, m)).step_time_s
              for m in (4, 8, 12, 16)]
    assert [c - s for c, s in zip(closed, steps, strict=True)] == [0.5] * 4


def test_1f1b_window_sets_the_period() -> None:
    # t = (3, 6, 3), a slow first hop c_0 = 10 (5 s each way), c_1 = 1. Stages 0..1 hold one
    # microbatch fewer per stage down the pipe, so two microbatches take S_01 = t_0 + c_0 + t_1
    # = 19 s: stage 0's forwards settle into gaps 6, 13 (period 9.5 > max t = 6 > c_0 / 2).
    # The closed form's period is that window, 9.5 (the duplex link alone allows c_0 / 2 = 5);
    # it charges the full 9.5 from the second microbatch on, the simulation settles after the
    # fourth: 203.5 against 200.
    problem, plan = chain_problem([1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [5.0, 0.5, 0.0], 20)
    sim = simulate(problem, plan, timeline=True)
    starts = [e.start_s for e in sim.events if e.stage == 0 and e.kind == "forward"]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps[3:] == [6.0, 13.0] * 8
    assert sim.step_time_s == 200.0
    assert evaluate_pipeline(problem, plan).step_time_s == 3 + 6 + 3 + 10 + 1 + 19 * 9.5


def _interleaved_reference(problem: PipelineProblem, plan: PipelinePlan, r: int) -> float:
    """``sum t / v + sum c + (m v - 1) / v * max t``."""
    f, b, hops = _stage_seconds(problem, plan, r)
    v, m = plan.chunks, plan.replicas[r].microbatches
    t = [x + y for x, y in zip(f, b, strict=True)]
    hop_total = 2 * sum(sum(xs) for xs in hops.values())
    return sum(t) / v + hop_total + (m * v - 1) / v * max(t)


def test_interleaved_closed_form_is_exact_on_balanced_stages() -> None:
    # Balanced, no transfers: the simulation is m t + (k - 1) t / v = sum t / v + (m - 1/v) t
    # (Narayanan et al. 2021, Sec. 2.2: bubble (k - 1) t / v), and so is the closed form.
    rng = random.Random("interleaved-balanced")
    for _ in range(40):
        problem, plan = _random_case(rng, "interleaved", balanced=True, transfers=False)
        sim, ev = simulate(problem, plan), evaluate_pipeline(problem, plan)
        for r in range(len(plan.replicas)):
            assert sim.replica_time_s[r] == pytest.approx(_interleaved_reference(
                problem, plan, r), rel=1e-9)
            assert ev.replica_time_s[r] == pytest.approx(sim.replica_time_s[r], rel=1e-9)


def test_interleaved_pays_every_hop_in_full() -> None:
    # Balanced with transfers shorter than a chunk's forward and backward: the simulation is
    # sum t / v + sum c + (m v - 1) / v max t, as is the closed form.
    rng = random.Random("interleaved-transfers")
    checked = 0
    for _ in range(40):
        problem, plan = _random_case(rng, "interleaved", balanced=True, transfers=True)
        sim = simulate(problem, plan)
        for r in range(len(plan.replicas)):
            f, b, hops = _stage_seconds(problem, plan, r)
            if max(x for xs in hops.values() for x in xs) > min(f[0], b[0]) / plan.chunks:
                continue
            checked += 1
            assert sim.replica_time_s[r] == pytest.approx(_interleaved_reference(
                problem, plan, r), rel=1e-9)
            assert evaluate_pipeline(problem, plan).replica_time_s[r] == pytest.approx(
                sim.replica_time_s[r], rel=1e-9)
    assert checked >= 30


# --- Memory ------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_peak_memory_is_in_flight(schedule: Schedule) -> None:
    rng = random.Random(f"memory-{schedule}")
    for _ in range(50):
        problem, plan = _random_case(rng, schedule, balanced=False, transfers=True)
        sim, ev = simulate(problem, plan), evaluate_pipeline(problem, plan)
        for r, replica in enumerate(plan.replicas):
            k, m = len(replica.stages), replica.microbatches
            assert sim.peak_in_flight[r] == tuple(in_flight(schedule, i, k, m)
                                                  for i in range(k))
            assert sim.peak_memory_bytes[r] == pytest.approx(ev.memory_bytes[r], rel=1e-12)


def _interleaved_peak_bytes(problem: PipelineProblem, plan: PipelinePlan, r: int,
                            i: int) -> float:
    """The proposed closed form: state + mb max_x (sum_{s<=W+x} a[chunk of forward s]
    - sum_{s<x} a[chunk of backward s]) over the steady-state steps x, from Megatron's
    indices (not from device_order)."""
    replica = plan.replicas[r]
    stage, k, m, v = replica.stages[i], len(replica.stages), replica.microbatches, plan.chunks
    opts = [o for x in stage.layers
            if (o := problem.kinds[problem.layers[x]].option(stage.group, stage.devices))]
    size = len(opts) // v
    a = [plan.microbatch_size * sum(o.activation_bytes[stage.remat]
                                    for o in opts[c * size:(c + 1) * size]) for c in range(v)]
    warm = min(m * v, 2 * (k - i - 1) + (v - 1) * k)
    forward = [a[(s % (k * v)) // k] for s in range(m * v)]
    backward = [a[v - 1 - (s % (k * v)) // k] for s in range(m * v)]
    if warm == m * v:
        held = sum(forward)
    else:
        held = max(sum(forward[:warm + x + 1]) - sum(backward[:x]) for x in range(m * v - warm))
    return sum(o.state_bytes for o in opts) + held


def test_interleaved_memory_worked_by_hand() -> None:
    # k = 2, v = 2, m = 4; stage 0's chunks hold 3 and 1 bytes per microbatch. Warm-up W = 4:
    # chunks 0 0 1 1, then F(4) chunk 0 = 11 bytes held; step x = 1 adds F(5) chunk 0 (+3) and
    # frees B(0) chunk 1 (-1): 13, the peak. in_flight says min(8, 5) / 2 = 2.5 stages of 4 bytes
    # = 10: the same 5 chunks, but the warm-up holds more of the heavier chunk 0.
    problem, plan = chain_problem([1.0] * 4, [2.0] * 4, [0.0] * 4, 4, "interleaved", 2,
                           activation=[3.0, 1.0, 1.0, 1.0])
    sim, ev = simulate(problem, plan), evaluate_pipeline(problem, plan)
    assert sim.peak_chunks[0] == (5, 3)
    assert sim.peak_in_flight[0] == (in_flight("interleaved", 0, 2, 4, 2),
                                     in_flight("interleaved", 1, 2, 4, 2))
    assert (sim.peak_memory_bytes[0][0], ev.memory_bytes[0][0]) == (13.0, 10.0)
    assert sim.peak_memory_bytes[0][0] == _interleaved_peak_bytes(problem, plan, 0, 0)


def test_interleaved_memory_counts_match_bytes_follow_the_chunks() -> None:
    # The chunk count at the peak is always in_flight * v; the bytes equal in_flight's only
    # when the stage's chunks hold equal activations, otherwise the proposed formula.
    rng = random.Random("memory-interleaved")
    unequal = 0
    for _ in range(40):
        problem, plan = _random_case(rng, "interleaved", balanced=False, transfers=True)
        sim, ev = simulate(problem, plan), evaluate_pipeline(problem, plan)
        for r, replica in enumerate(plan.replicas):
            k, m = len(replica.stages), replica.microbatches
            for i in range(k):
                assert sim.peak_in_flight[r][i] == pytest.approx(
                    in_flight("interleaved", i, k, m, plan.chunks), rel=1e-12)
                assert sim.peak_memory_bytes[r][i] == pytest.approx(
                    _interleaved_peak_bytes(problem, plan, r, i), rel=1e-12)
                unequal += _rel(sim.peak_memory_bytes[r][i], ev.memory_bytes[r][i]) > 1e-9
    assert unequal > 0
    balanced = _random_case(random.Random(1), "interleaved", balanced=True, transfers=True)
    sim, ev = simulate(*balanced), evaluate_pipeline(*balanced)
    for got, want in zip(sim.peak_memory_bytes, ev.memory_bytes, strict=True):
        assert got == pytest.approx(want, rel=1e-12)


# --- The timeline ------------------------------------------------------------------------------


def _check_timeline(plan: PipelinePlan, events: tuple[Event, ...]) -> None:
    v = plan.chunks if plan.schedule == "interleaved" else 1
    by_resource: dict[tuple[int, int, int | None], list[Event]] = defaultdict(list)
    done: dict[tuple[int, str, int, int, int], float] = {}
    for e in events:
        by_resource[e.replica, e.stage, e.to_stage].append(e)
        done[e.replica, e.kind, e.stage, e.chunk, e.microbatch] = e.end_s
    for (r, i, to), tasks in by_resource.items():
        for a, b in itertools.pairwise(tasks):
            assert b.start_s >= a.end_s - 1e-9  # one task at a time per device / channel
        if to is None:
            k, m = len(plan.replicas[r].stages), plan.replicas[r].microbatches
            assert [(e.kind, e.microbatch, e.chunk) for e in tasks] == device_order(
                plan.schedule, i, k, m, v)
    for e in events:
        r, k = e.replica, len(plan.replicas[e.replica].stages)
        g = e.chunk * k + e.stage  # model chunk
        if e.kind == "forward" and g > 0:
            src, c = (g - 1) % k, (g - 1) // k
            ready = done.get((r, "send_forward", src, c, e.microbatch),
                             done[r, "forward", src, c, e.microbatch])
            assert e.start_s >= ready - 1e-9
        if e.kind == "backward" and g < k * v - 1:
            src, c = (g + 1) % k, (g + 1) // k
            ready = done.get((r, "send_backward", src, c, e.microbatch),
                             done[r, "backward", src, c, e.microbatch])
            assert e.start_s >= ready - 1e-9
            assert e.start_s >= done[r, "forward", e.stage, e.chunk, e.microbatch] - 1e-9


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_timeline_respects_devices_links_and_dependencies(schedule: Schedule) -> None:
    rng = random.Random(f"timeline-{schedule}")
    for _ in range(15):
        problem, plan = _random_case(rng, schedule, balanced=False, transfers=True)
        sim = simulate(problem, plan, timeline=True)
        v = plan.chunks if schedule == "interleaved" else 1
        compute = [e for e in sim.events if e.to_stage is None]
        assert len(compute) == sum(2 * r.microbatches * len(r.stages) * v for r in plan.replicas)
        assert max(e.end_s for e in compute) == max(sim.replica_time_s)
        _check_timeline(plan, sim.events)
        assert simulate(problem, plan, timeline=True) == sim  # deterministic
        assert simulate(problem, plan).events == ()


def test_bubble_fraction_weighs_devices() -> None:
    # Stage 0 (1 device) F 1 B 2, stage 1 (3 devices) F 0.5 B 0.5, m = 4, 1F1B: stage 0 runs
    # F0 F1 B0 F2 B1 F3 B2 B3 back to back (each round trip below it, 1.5 s, hides under the
    # next forward or backward), 12 s, never idle; stage 1 is busy 4 s of 12 on 3 devices:
    # idle 3 x 8 = 24 of 4 x 12 = 48 device-seconds.
    option_a = flat_option(1.0, 2.0)
    option_b = flat_option(0.5, 0.5, devices=3)
    kinds = (LayerKind("a", {0: (option_a,)}, 0.0, 0.0), LayerKind("b", {0: (option_b,)}, 0.0, 0.0))
    group = DeviceGroup("dev", 4, 4, 1e18, 1.0, BYTE_PER_S, BYTE_PER_S)
    problem = PipelineProblem(kinds, (0, 1), (group,), BYTE_PER_S, 4, (1,), remats=("none",))
    plan = PipelinePlan((Replica((StagePlacement(0, 1, (0,)), StagePlacement(0, 3, (1,))), 4),),
                        1, "1f1b")
    sim = simulate(problem, plan)
    assert (sim.step_time_s, sim.bubble_fraction, sim.replica_bubble_fraction) == (
        12.0, 0.5, (0.5,))


def test_rejects_an_invalid_plan() -> None:
    problem, plan = balanced_problem(2, 4, "1f1b")
    bad = PipelinePlan((Replica(plan.replicas[0].stages, 3),), 1, "1f1b")
    with pytest.raises(PipelineError, match="microbatches x 1 do not add up to batch 4"):
        simulate(problem, bad)


def test_equal_replicas_play_alike() -> None:
    # Equal replicas are played once; the timeline still lists every replica's tasks, the
    # same times for each.
    problem, plan = chain_problem([1.0, 2.0], [2.0, 3.0], [0.5, 0.0], 3)
    one = simulate(problem, plan, timeline=True)
    twice = dataclasses.replace(plan, replicas=plan.replicas * 2)
    group = dataclasses.replace(problem.groups[0], count=2 * problem.groups[0].count)
    problem2 = dataclasses.replace(problem, batch=2 * problem.batch, groups=(group,))
    both = simulate(problem2, twice, timeline=True)
    assert both.replica_time_s == one.replica_time_s * 2
    assert both.peak_memory_bytes == one.peak_memory_bytes * 2
    for r in (0, 1):
        mine = [dataclasses.replace(e, replica=0) for e in both.events if e.replica == r]
        assert mine == list(one.events)
