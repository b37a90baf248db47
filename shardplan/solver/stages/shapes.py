"""Replica shapes: the stage lists one replica can take, reduced to the Pareto-optimal ones.

A *shape* is one replica's stages without its microbatch count. What the rest of the plan sees
of it is :class:`Shape`'s figures: the devices it uses per group, its pipeline time
``fill_s + (m - 1) * bottleneck_s`` for ``m`` microbatches, the most microbatches its memory
holds (``cap``), the microbatch granularity (``step``: ``k`` under interleaving), the largest
gradient bytes a device of one of its stages all-reduces (``sigma``,
:func:`~shardplan.solver.stages.pipeline.sync_s`) and its slowest stage's update. :func:`replica_shapes` enumerates shapes with a dynamic program over the layers
(backward, so that a stage knows its distance from the last stage, which sets its 1F1B
in-flight count) or, interleaved, over the stages, and keeps a label only when no other label
of the same state is at least as good in every figure and the label could still be part of a
plan better than the best so far (the rules are proved in :mod:`shardplan.solver.stages.search`).
Both programs stop with :class:`SearchTimeout` at the problem's time limit.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shardplan.solver.stages.bound import PlanBound
from shardplan.solver.stages.pipeline import (
    PipelineProblem,
    Schedule,
    StagePlacement,
    group_link,
    looped_work,
    period_1f1b,
    stack_violations,
    stage_link,
    stage_work,
)

__all__ = ["UNLIMITED", "Budget", "SearchTimeout", "Shape", "holds_a_replica", "replica_shapes",
           "shape_dominates", "shape_of", "stack_edges", "uniform_shapes"]

# (Past 600 lines: the backward and interleaved dynamic programs, the uniform shapes of the
# quick phase and the most even legal cut of a scanned stack all build shapes from one
# per-type table, _Types, whose sums must match the evaluator's bit for bit; they stay
# together.)


class SearchTimeout(Exception):
    """The search spent its budget (``PipelineProblem.work_limit`` or ``time_limit_s``)."""


class Budget:
    """What the search may still spend: work units (one per label built, shape compared,
    knapsack state mixed or quick-sweep step; the same count on every machine under every
    load, so a search cut by it returns the same plan every time) and a wall-clock deadline
    (``time.perf_counter()`` seconds), the safety net."""

    __slots__ = ("deadline", "spent", "work")

    def __init__(self, work: float = math.inf, deadline: float = math.inf) -> None:
        self.work, self.deadline, self.spent = work, deadline, 0

    def spend(self, units: int) -> None:
        """Spends ``units`` without checking (work that must finish)."""
        self.spent += units

    def over(self, units: int = 1) -> bool:
        """Spends ``units``; whether the budget is now exhausted."""
        self.spent += units
        return self.spent > self.work or time.perf_counter() > self.deadline

    def check(self, units: int = 1) -> None:
        """Spends ``units``; raises :class:`SearchTimeout` when the budget is exhausted."""
        if self.over(units):
            raise SearchTimeout


UNLIMITED = Budget()


# A label: (usage, seconds, bottleneck, cap, sigma, update, stages, parent, stage, windows).
# ``seconds`` is ``sum t + v sum c``; ``stage`` is ``(type index, layers)``. ``windows`` (1F1B
# labels, built backwards): per ``j``, ``sum t + sum c`` of the label's first ``j`` stages
# without the hop after the last of them (:func:`_windows_le`).
Label = tuple


@dataclass(frozen=True)
class Shape:
    """One replica's stages and the figures the plan search needs.

    Attributes:
      stages: the stages, pipeline order.
      usage: devices per group.
      fill_s: the pipeline time of one microbatch (:func:`fill_s`).
      bottleneck_s: the period ``P`` of each further microbatch
        (:func:`~shardplan.solver.stages.pipeline.replica_time`).
      cap: the most microbatches (at most the step's) every stage's memory holds.
      step: the microbatch count must be a multiple of this (stages under interleaving).
      sigma: the largest ``sigma_{r,s}`` of its stages (gradient bytes per device,
        :func:`~shardplan.solver.stages.pipeline.sync_s`).
      update_s: the slowest stage's optimizer update.
    """

    stages: tuple[StagePlacement, ...]
    usage: tuple[int, ...]
    fill_s: float
    bottleneck_s: float
    cap: int
    step: int
    sigma: float
    update_s: float

    def time_s(self, microbatches: int) -> float:
        """The closed-form pipeline time with ``microbatches`` microbatches."""
        return self.fill_s + (microbatches - 1) * self.bottleneck_s

    def capacity(self, tau: float) -> int:
        """The most microbatches (a multiple of ``step``, within ``cap``) whose pipeline time
        is at most ``tau``, exactly as :meth:`time_s` computes it."""
        if self.fill_s > tau:
            return 0
        if self.bottleneck_s > 0:
            m = min(self.cap, int((tau - self.fill_s) / self.bottleneck_s) + 1)
            while m > 1 and self.time_s(m) > tau:
                m -= 1
            while m < self.cap and self.time_s(m + 1) <= tau:
                m += 1
        else:
            m = self.cap
        return m - m % self.step


def _usage_le(a: Sequence[int], b: Sequence[int], safe: Sequence[bool]) -> bool:
    """Devices per group ``a`` can stand in for ``b`` (rule S): no more anywhere, the same
    groups used, and fewer only on safe groups."""
    for x, y, s in zip(a, b, safe, strict=True):
        if x > y or (x != y and not s) or (x == 0) != (y == 0):
            return False
    return True


def shape_dominates(a: Shape, b: Shape, safe: Sequence[bool]) -> bool:
    """Whether ``a`` can replace ``b`` in every plan without making it worse (rule S)."""
    return (a.fill_s <= b.fill_s and a.bottleneck_s <= b.bottleneck_s and a.cap >= b.cap
            and b.step % a.step == 0 and a.sigma <= b.sigma and a.update_s <= b.update_s
            and _usage_le(a.usage, b.usage, safe))


class _Types:
    """Stage types (group, devices, remat) and exact per-type sums over layer sequences."""

    def __init__(self, problem: PipelineProblem, mb: int) -> None:
        self.problem, self.mb = problem, mb
        self.types: list[tuple[int, int, str]] = []
        for g, group in enumerate(problem.groups):
            sizes = sorted({o.devices for k in problem.kinds for o in k.options.get(g, ())})
            self.types.extend((g, d, r) for d in sizes if d <= group.count
                              for r in problem.remats)
        self.index = {t: i for i, t in enumerate(self.types)}
        # A stage's hop class: for every sub-mesh size of its group, whether a neighbour of
        # that size shares a node with it (stage_link). Equal classes, equal hop costs.
        by_group = {g: sorted({d for gg, d, _ in self.types if gg == g})
                    for g in range(len(problem.groups))}
        self.position = {(g, d): i for g, ds in by_group.items() for i, d in enumerate(ds)}
        self.hop_class = {(g, d): (g, tuple(d + e <= problem.groups[g].devices_per_node
                                            for e in by_group[g]))
                          for g, ds in by_group.items() for d in ds}
        self._hops: dict[tuple, float] = {}
        self._longest: dict[tuple[int, float], list[int]] = {}
        # per layer, the scanned stack it is a row of (-1: none), for looped_work
        self.stack_at = [next((s for s, (a, b) in enumerate(problem.stacks) if a <= x < b), -1)
                         for x in range(len(problem.layers))]
        # per type, per layer: (seconds, state, activation, update, gradient / devices,
        # recomputed bytes, working bytes)
        self.per_layer: list[list[tuple[float, ...] | None]] = []
        for g, d, r in self.types:
            row: list[tuple[float, ...] | None] = []
            for k in problem.layers:
                kind = problem.kinds[k]
                o = kind.option(g, d)
                if o is None:
                    row.append(None)
                    continue
                t = (o.forward_s[0] + o.forward_s[1] * mb) + (o.backward_s[0] + o.backward_s[1]
                                                              * mb)
                t += o.recompute_s[r][0] + o.recompute_s[r][1] * mb
                row.append((t, o.state_bytes, o.activation_bytes[r], o.update_s,
                            kind.gradient_bytes / d, o.recompute_bytes.get(r, 0.0),
                            o.work_bytes.get(r, 0.0)))
            self.per_layer.append(row)

    def hop(self, g: int, d: int, cls: tuple, last: int) -> float:
        """Both transfers between a stage on ``d`` devices of group ``g`` and a neighbour of
        hop class ``cls`` after layer ``last`` (:func:`~shardplan.solver.stages.pipeline.stage_link`)."""
        key = (g, d, cls, last)
        if key not in self._hops:
            problem = self.problem
            if g != cls[0]:
                link = group_link(problem, g, cls[0])
            else:
                group = problem.groups[g]
                link = (group.intra_node if cls[1][self.position[g, d]] else group.inter_node)
            bytes_ = problem.kinds[problem.layers[last]].boundary_bytes * self.mb
            self._hops[key] = 2 * link.time_s(bytes_)
        return self._hops[key]

    def sums(self, ti: int, layers: Sequence[int]) -> tuple[float, ...] | None:
        """``(seconds, held, activation, update, sigma)`` of type ``ti`` over ``layers`` in
        order (the order :func:`~shardplan.solver.stages.pipeline.evaluate_pipeline` sums in);
        ``held`` is the state plus one backward program's working bytes
        (:func:`~shardplan.solver.stages.pipeline.stage_held` with no microbatch in flight)."""
        t = st = ac = up = sg = rc = wk = 0.0
        row = self.per_layer[ti]
        works = []
        for layer in layers:
            v = row[layer]
            if v is None:
                return None
            t += v[0]
            st += v[1]
            ac += v[2]
            up += v[3]
            sg += v[4]
            rc += v[5]
            wk = max(wk, v[6])
            works.append(v[6])
        looped = looped_work(self.problem.stacks, layers, works)
        return t, st + self.mb * stage_work(rc, wk, looped), ac, up, sg

    def longest(self, ti: int, flight: float = 1.0) -> list[int]:
        """Per first layer, the most layers a stage of type ``ti`` holds in its group's memory
        with ``flight`` microbatches in flight (any fewer fit too: memory only grows with
        layers); built once per type and count."""
        if (ti, flight) not in self._longest:
            mem = self.problem.groups[self.types[ti][0]].memory_bytes
            n = len(self.problem.layers)
            self._longest[ti, flight] = [len(r) for r in self.runs(ti, mem, flight)[:n]]
        return self._longest[ti, flight]

    def runs(self, ti: int, mem: float, flight: float = 1.0) -> list[list[tuple[float, ...]]]:
        """Per first layer ``i``, the sums of ``[i, i + L)`` for ``L = 1, 2, ...`` while the
        stage fits in memory with ``flight`` microbatches in flight (one: no schedule holds
        fewer)."""
        n = len(self.problem.layers)
        row, layers, mb = self.per_layer[ti], self.problem.layers, self.mb
        out: list[list[tuple[float, ...]]] = [[] for _ in range(n + 1)]
        for i in range(n - 1, -1, -1):
            nxt = out[i + 1]
            # Start i + 1 stopped at layer i + 1 + L; if the L + 1 kinds from i are those
            # from i + 1, start i has the same sums and stops at the same length.
            # (Not with scanned stacks: a stage's working bytes depend on where they lie.)
            size = len(nxt)
            if i + 1 < n and i + 1 + size < n and layers[i:i + size + 1] == layers[
                    i + 1:i + size + 2] and not self.problem.stacks:
                out[i] = nxt
                continue
            t = st = ac = up = sg = rc = wk = looped = run_best = 0.0
            run = 0
            acc: list[tuple[float, ...]] = []
            for j in range(i, n):
                v = row[j]
                if v is None:
                    break
                t += v[0]
                st += v[1]
                ac += v[2]
                up += v[3]
                sg += v[4]
                rc += v[5]
                wk = max(wk, v[6])
                stack = self.stack_at[j]  # the rows in a row, as looped_work counts them
                if stack >= 0 and j > i and self.stack_at[j - 1] == stack:
                    run, run_best = run + 1, max(run_best, v[6])
                else:
                    run, run_best = (1, v[6]) if stack >= 0 else (0, 0.0)
                if run >= 2:
                    looped = max(looped, run_best)
                held = st + mb * stage_work(rc, wk, looped)
                if held + flight * mb * ac > mem:
                    break
                acc.append((t, held, ac, up, sg))
            out[i] = acc
        return out


def holds_a_replica(types: _Types, schedule: Schedule, v: int) -> bool:
    """Whether some replica could hold every layer at this microbatch size; ``False`` proves
    that no plan of the configuration exists.

    Two necessary conditions on stages of contiguous layers (GPipe, 1F1B), each stage's memory
    counted as the search counts it (interleaved stages hold chunks apart: no proof, ``True``):

    * every replica covers the ``n`` layers, and a device of group ``g`` covers at most
      ``L / d`` of them, ``L`` the most layers one stage of ``d`` devices holds with one
      microbatch in flight: at most ``floor(sum_g N_g max L / d / n)`` replicas fit;
    * when that is one, the replica runs every microbatch, so its stage ``p``-th from the end
      holds ``min(M, p)`` of them in flight under 1F1B (all ``M`` under GPipe): a dynamic
      program over the stages from the end, per count of devices used per group, keeps the
      first layer of the longest suffix such stages hold (a stage holding some layers holds
      any fewer of them: memory only grows with layers).
    """
    if schedule == "interleaved" and v > 1:
        return True
    problem, mb = types.problem, types.mb
    n, total = len(problem.layers), problem.batch // mb
    counts = [g.count for g in problem.groups]
    starts: dict[tuple[int, float], list[int]] = {}

    def start(ti: int, flight: float) -> list[int]:
        """Per end ``j``, the first layer of the longest stage of type ``ti`` ending there."""
        if (ti, flight) not in starts:
            length = types.longest(ti, flight)
            first = list(range(n + 1))
            for i in range(n - 1, -1, -1):
                for j in range(i + 1, i + length[i] + 1):
                    first[j] = i
            starts[ti, flight] = first
        return starts[ti, flight]

    per_device = 0.0
    for g in range(len(counts)):
        per_device += counts[g] * max(
            (max(types.longest(ti), default=0) / d
             for ti, (gg, d, _) in enumerate(types.types) if gg == g), default=0.0)
    if per_device < n:
        return False
    if per_device >= 2 * n or math.prod(c + 1 for c in counts) > 100_000:
        return True  # two replicas may fit, or too many device splits to walk
    # first[u]: the first layer of the longest suffix stages on u devices per group hold
    first: dict[tuple[int, ...], int] = {(0,) * len(counts): n}
    for p in range(1, min(sum(counts), problem.max_stages or n) + 1):
        flight = float(total) if schedule == "gpipe" else float(min(total, p))
        step: dict[tuple[int, ...], int] = {}
        for u, j in first.items():
            for ti, (g, d, _) in enumerate(types.types):
                if u[g] + d <= counts[g] and (i := start(ti, flight)[j]) < j:
                    w = (*u[:g], u[g] + d, *u[g + 1:])
                    step[w] = min(step.get(w, n), i)
        if not step:
            break
        if min(step.values()) == 0:
            return True
        first = step
    return False


def _cap(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest ``m`` in ``[lo, hi]`` with ``fits(m)`` (``fits`` non-increasing), else
    ``lo - 1``."""
    if not fits(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def stage_cap(schedule: Schedule, state: float, activation: float, mb: int, memory: float,
              total: int, i: int, k: int, v: int) -> int:
    """The most microbatches (up to ``total``) stage ``i`` of ``k`` holds in memory, exactly as
    :func:`~shardplan.solver.stages.pipeline.evaluate_pipeline` checks it; 0 if not even one."""
    if schedule == "gpipe":
        return _cap(lambda m: state + float(m) * mb * activation <= memory, 1, total)
    if schedule == "1f1b":
        p = k - i

        def fits(m: int) -> bool:
            return state + float(min(m, p)) * mb * activation <= memory

        return total if fits(total) else _cap(fits, 1, min(total, p))
    x = 2 * (k - i - 1) + (v - 1) * k + 1
    return _cap(lambda m: state + min(m * v, x) / v * mb * activation <= memory, 1, total)


def _insert(bucket: list[Label], new: Label, better: Callable[[Label, Label], bool]) -> int:
    """Adds ``new`` to a Pareto bucket unless a label there is at least as good; 1 if added."""
    for old in bucket:
        if better(old, new):
            return 0
    bucket[:] = [old for old in bucket if not better(new, old)]
    bucket.append(new)
    return 1


def replica_shapes(problem: PipelineProblem, mb: int, schedule: Schedule, v: int,
                   bound: PlanBound, budget: Budget = UNLIMITED,
                   types: _Types | None = None) -> tuple[list[Shape], int]:
    """The undominated replica shapes for one microbatch size, schedule and chunk count that
    could beat ``bound.best``, and how many labels the dynamic program kept.

    Raises:
      SearchTimeout: past the ``budget``.
    """
    types = types or _Types(problem, mb)
    total = problem.batch // mb
    if schedule == "interleaved" and v > 1:
        shapes, labels = _interleaved(problem, types, schedule, v, total, bound, budget)
    else:  # GPipe, 1F1B, or interleaving with one chunk (contiguous stages, Megatron's count)
        shapes, labels = _linear(problem, types, schedule, total, bound, budget)
    return _undominated(shapes, bound.safe, budget), labels


def _undominated(shapes: list[Shape], safe: Sequence[bool],
                 budget: Budget = UNLIMITED) -> list[Shape]:
    """``shapes`` less every one another dominates (rule S), in a fixed order."""
    out: list[Shape] = []
    for s in sorted(shapes, key=_order):
        budget.check(1 + len(out))
        if not any(shape_dominates(o, s, safe) for o in out):
            out = [o for o in out if not shape_dominates(s, o, safe)]
            out.append(s)
    return out


def shape_of(problem: PipelineProblem, mb: int, schedule: Schedule, v: int,
             stages: Sequence[StagePlacement], types: _Types | None = None) -> Shape | None:
    """The figures of one replica's ``stages`` (``None`` if some stage lacks an option or does
    not hold one microbatch), computed as
    :func:`~shardplan.solver.stages.pipeline.evaluate_pipeline` does."""
    types = types or _Types(problem, mb)
    index = types.index
    total, k = problem.batch // mb, len(stages)
    usage = [0] * len(problem.groups)
    cap, sigma, update = total, 0.0, 0.0
    times: list[float] = []
    for i, st in enumerate(stages):
        ti = index.get((st.group, st.devices, st.remat))
        agg = types.sums(ti, st.layers) if ti is not None else None
        if agg is None:
            return None
        t, state, act, up, sg = agg
        usage[st.group] += st.devices
        cap = min(cap, stage_cap(schedule, state, act, mb, problem.groups[st.group].memory_bytes,
                                 total, i, k, v))
        times.append(t)
        sigma, update = max(sigma, sg), max(update, up)
    stage_of = {layer: i for i, st in enumerate(stages) for layer in st.layers}
    order = ([layer for st in stages for layer in st.layers] if v == 1 else
             [layer for c in range(v) for st in stages
              for layer in st.layers[c * len(st.layers) // v:(c + 1) * len(st.layers) // v]])
    hops = []
    for a, b in itertools.pairwise(order):
        if stage_of[a] != stage_of[b]:
            sa, sb = stages[stage_of[a]], stages[stage_of[b]]
            hops.append(_hop(problem, (sa.group, sa.devices), (sb.group, sb.devices), a, mb))
    fill, bott = shape_timing(times, hops, v)
    step = k if schedule == "interleaved" and v > 1 else 1
    cap -= cap % step
    if cap < step:
        return None
    return Shape(tuple(stages), tuple(usage), fill, bott, cap, step, sigma, update)


def shape_timing(times: Sequence[float], hops: Sequence[float], v: int) -> tuple[float, float]:
    """A whole replica's ``(fill_s, bottleneck_s)`` from its stage times and its round trips in
    the order a microbatch crosses them (:func:`~shardplan.solver.stages.pipeline.replica_time`)."""
    if v == 1:
        return sum(times) + sum(hops), period_1f1b(times, hops)
    bott = max(max(times), v * max(hops, default=0.0) / 2)
    return fill_s(sum(times) + v * sum(hops), bott, v), bott


def fill_s(seconds: float, bottleneck_s: float, v: int) -> float:
    """A shape's ``fill_s`` from its label sums: ``seconds = sum t + v sum c`` (``v`` chunks)
    and its bottleneck ``B``: ``seconds / v + (1 - 1 / v) B``, so that ``fill_s + (m - 1) B``
    is :func:`~shardplan.solver.stages.pipeline.replica_time` (``sum t + sum c + (m - 1) B`` without
    interleaving, ``sum t / v + sum c + (m - 1 / v) B`` with)."""
    return seconds if v == 1 else seconds / v + (1 - 1 / v) * bottleneck_s


def uniform_shapes(problem: PipelineProblem, mb: int, schedule: Schedule, v: int,
                   safe: Sequence[bool], budget: Budget = UNLIMITED) -> list[Shape]:
    """Replicas whose stages all share one (group, devices, remat) and split the layers as
    evenly as possible (the shorter stages first): a quick first plan to bound the search.
    Every shape is built (the quick plan needs them all); each spends its stage count from
    ``budget`` without checking it."""
    n = len(problem.layers)
    types = _Types(problem, mb)
    out: list[Shape] = []
    for g, d, r in types.types:
        for k in range(1, min(n, problem.max_stages or n, problem.groups[g].count // d) + 1):
            if schedule == "interleaved" and v > 1:
                if n % (k * v):
                    continue
                size = n // (k * v)
                parts = [tuple(j for c in range(v)
                               for j in range((i + c * k) * size, (i + c * k + 1) * size))
                         for i in range(k)]
            else:
                q, extra = divmod(n, k)
                edges = [0]
                for i in range(k):
                    edges.append(edges[-1] + q + (i >= k - extra))
                if problem.stacks and stack_violations(
                        problem.stacks, [StagePlacement(g, d, tuple(range(a, b)))
                                         for a, b in itertools.pairwise(edges)]):
                    edges = stack_edges(n, k, problem.stacks) or []
                parts = [tuple(range(a, b)) for a, b in itertools.pairwise(edges)]
            budget.spend(k)
            stages = [StagePlacement(g, d, part, r) for part in parts]  # type: ignore[arg-type]
            if not stages or stack_violations(problem.stacks, stages):
                continue  # (interleaved chunks that cut a stack unevenly)
            shape = shape_of(problem, mb, schedule, v, stages, types)
            if shape is not None:
                out.append(shape)
    return _undominated(out, safe)


@functools.lru_cache(maxsize=1024)
def stack_edges(n: int, k: int, stacks: tuple[tuple[int, int], ...]) -> list[int] | None:
    """The stage edges ``0 = e_0 < ... < e_k = n`` of ``k`` contiguous stages with the shortest
    longest stage among those that cut each scanned stack into equal runs
    (:func:`~shardplan.solver.stages.pipeline.stack_violations`; one group and sub-mesh size for all
    stages), ties to the first found; ``None`` when there are none.

    Per choice of the runs per stack (``q`` dividing its rows ``L``: cuts at every ``L / q``
    rows and nowhere else inside it), a dynamic program over the positions a stage may end at
    (outside the stacks, and those cuts)."""
    options: list[list[tuple[set[int], set[int]]]] = []  # per stack: (forced, forbidden)
    for a, b in stacks:
        rows = b - a
        options.append([({a + r * x for x in range(1, rows // r)},
                         set(range(a + 1, b)) - {a + r * x for x in range(1, rows // r)})
                        for r in (rows // q for q in range(1, rows + 1) if rows % q == 0)])
    best: tuple[int, list[int]] | None = None
    for choice in itertools.product(*options):
        forced = set().union(*(f for f, _ in choice))
        forbidden = set().union(*(x for _, x in choice))
        ends = [p for p in range(n + 1) if p not in forbidden]
        if len(ends) < k + 1:
            continue
        # most[c][p]: the shortest longest stage of c stages covering [0, p), with its edges
        most: list[dict[int, tuple[int, list[int]]]] = [{0: (0, [0])}]
        for _ in range(k):
            level: dict[int, tuple[int, list[int]]] = {}
            for p, (longest, edges) in most[-1].items():
                for q in ends:
                    if q <= p:
                        continue
                    if q > p + 1 and any(f in forced for f in range(p + 1, q)):
                        break  # a stage may not hold a forced cut inside it
                    value = (max(longest, q - p), [*edges, q])
                    if q not in level or value[0] < level[q][0]:
                        level[q] = value
            most.append(level)
        if n in most[k] and (best is None or most[k][n][0] < best[0]):
            best = most[k][n]
    return None if best is None else best[1]


def _order(s: Shape) -> tuple:
    return (sum(s.usage), s.usage, s.fill_s, s.bottleneck_s, -s.cap, s.sigma, s.update_s,
            len(s.stages), [(p.group, p.devices, p.remat, p.layers) for p in s.stages])


def _hop(problem: PipelineProblem, a: tuple[int, int], b: tuple[int, int], last: int,
         mb: int) -> float:
    link = stage_link(problem, StagePlacement(a[0], a[1], ()), StagePlacement(b[0], b[1], ()))
    return 2 * link.time_s(problem.kinds[problem.layers[last]].boundary_bytes * mb)


def _linear(problem: PipelineProblem, types: _Types, schedule: Schedule, total: int,
            bound: PlanBound, budget: Budget) -> tuple[list[Shape], int]:
    """GPipe / 1F1B: stages of contiguous layers, built from the last one backwards.

    A label whose front stage starts inside a scanned stack (``problem.stacks``) is keyed by
    that stage's group, sub-mesh size and rows of the stack as well: a stage put in front of
    it must match them (:func:`~shardplan.solver.stages.pipeline.stack_violations`), and labels of
    different keys are never compared, so the rules keep an optimal plan among the legal
    ones."""
    n, n_groups = len(problem.layers), len(problem.groups)
    inside = _stack_cuts(problem)
    mems = [problem.groups[g].memory_bytes for g, _, _ in types.types]
    runs = [types.runs(ti, mems[ti]) for ti in range(len(types.types))]
    counts = [g.count for g in problem.groups]
    better = _linear_better(schedule != "gpipe" or problem.max_stages > 0, bound.safe)
    kept = tried = 0
    # key (first layer, hop class of the front stage) -> labels of the stages from there on
    # and, where the front stage starts inside a scanned stack, its (group, devices, rows)
    buckets: dict[tuple, list[Label]] = {
        (n, None, None): [((0,) * n_groups, 0.0, 0.0, total, 0.0, 0.0, 0, None, None, ())]}
    for j in range(n, 0, -1):
        for key in sorted((k for k in buckets if k[0] == j), key=repr):
            front, need = key[1], key[2]
            for lab in buckets[key]:
                budget.check(1 + tried)
                tried = 0
                usage, sec, bott, cap, sig, upd, p = lab[:7]
                windows = lab[9]
                if problem.max_stages and p >= problem.max_stages:
                    continue
                for ti, (g, d, _r) in enumerate(types.types):
                    if usage[g] + d > counts[g] or (need is not None and need[:2] != (g, d)):
                        continue
                    c = types.hop(g, d, front, j - 1) if front is not None else 0.0
                    nu = (*usage[:g], usage[g] + d, *usage[g + 1:])
                    # Longer stages hold more bytes and take longer: stop at the first misfit.
                    for i in range(j - 1, -1, -1):
                        run = runs[ti][i]
                        if len(run) < j - i:
                            break
                        t, st, ac, up, sg = run[j - i - 1]
                        tried += 1
                        scap = stage_cap(schedule, st, ac, types.mb, mems[ti], total, 0,
                                         p + 1, 1)
                        if scap < 1:
                            break
                        nsec, ncap = sec + t + c, min(cap, scap)
                        nbott = max(bott, t, c / 2)
                        for w, x in enumerate(windows):
                            nbott = max(nbott, (t + c + x) / (w + 2))
                        nupd, nsig = max(upd, up), max(sig, sg)
                        if bound.hopeless(nsec, nbott, ncap, 1, nsig, nupd, nu, i):
                            break
                        if need is not None:  # the rows the stage behind holds, exactly
                            rows = j - max(i, inside[j][0])  # type: ignore[index]
                            if rows > need[2]:
                                break
                            if rows < need[2]:
                                continue
                        cut = inside[i]
                        here = None if cut is None else (g, d, min(j, cut[1]) - i)
                        new = (nu, nsec, nbott, ncap, nsig, nupd, p + 1, lab,
                               (ti, tuple(range(i, j))),
                               (t, *(t + c + x for x in windows)))
                        kept += _insert(
                            buckets.setdefault((i, types.hop_class[g, d], here), []),
                            new, better)
    return _linear_shapes(types, buckets), kept


def _stack_cuts(problem: PipelineProblem) -> list[tuple[int, int] | None]:
    """Per position ``0 .. n``, the scanned stack an edge there cuts inside, or ``None``."""
    inside: list[tuple[int, int] | None] = [None] * (len(problem.layers) + 1)
    for a, b in problem.stacks:
        for i in range(a + 1, b):
            inside[i] = (a, b)
    return inside


def _linear_better(by_position: bool, safe: Sequence[bool]) -> Callable[[Label, Label], bool]:
    """Rule L: whether suffix label ``a`` dominates ``b`` (stage counts if ``by_position``)."""

    def better(a: Label, b: Label) -> bool:
        return (a[1] <= b[1] and a[2] <= b[2] and a[3] >= b[3] and a[4] <= b[4]
                and a[5] <= b[5] and (not by_position or a[6] <= b[6])
                and _usage_le(a[0], b[0], safe) and _windows_le(a[9], b[9]))

    return better


def _linear_shapes(types: _Types, buckets: dict[tuple, list[Label]]) -> list[Shape]:
    """The shapes of the finished labels: those whose front stage starts at layer 0."""
    shapes: list[Shape] = []
    for key, labs in buckets.items():
        if key[0] == 0 and key[1] is not None:
            shapes.extend(_shape(types, lab, 1, 1) for lab in labs)
    return shapes


def _windows_le(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether suffix ``a`` meets every prefix with window averages no higher than ``b``.

    A prefix of ``q`` stages with ``X`` seconds (its stages and hops, the hop into the
    suffix included: equal for both, as their front stages share a hop class) makes the
    windows ``(X + a[j - 1]) / (q + j)``. Taking ``b``'s window ``j' = min(j, len(b))`` for
    ``a``'s ``j``: ``a[j - 1] <= b[j' - 1]`` and ``j >= j'`` give ``(X + a[j - 1]) / (q + j)
    <= (X + b[j' - 1]) / (q + j')``, so ``a``'s largest window is no larger than ``b``'s."""
    nb = len(b)
    return all(x <= b[min(j, nb - 1)] for j, x in enumerate(a)) if nb else not a


def _shape(types: _Types, lab: Label, v: int, step: int) -> Shape:
    stages = []
    node = lab
    while node[8] is not None:
        ti, layers = node[8]
        g, d, r = types.types[ti]
        stages.append(StagePlacement(g, d, layers, r))  # type: ignore[arg-type]
        node = node[7]
    # Linear shapes are built from the last stage backwards, so the chain runs front first.
    ordered = tuple(stages) if v == 1 else tuple(reversed(stages))
    return Shape(ordered, lab[0], fill_s(lab[1], lab[2], v), lab[2], lab[3], step, lab[4],
                 lab[5])


def _interleaved(problem: PipelineProblem, types: _Types, schedule: Schedule, v: int,
                 total: int, bound: PlanBound, budget: Budget) -> tuple[list[Shape], int]:
    """Interleaved: for each stage count ``k`` whose ``k v`` chunks cut the layers evenly, a
    dynamic program over the stages front to back (the state keeps the first stage's sub-mesh
    for the hops that wrap from the last stage to the first)."""
    n = len(problem.layers)
    better = _interleaved_better(bound.safe)
    shapes: list[Shape] = []
    kept = 0
    for k in range(1, n // v + 1):
        if n % (k * v) or (problem.max_stages and k > problem.max_stages):
            continue
        found, labels = _interleaved_k(problem, types, schedule, v, k, total, bound, budget,
                                       better)
        shapes += found
        kept += labels
    return shapes, kept


def _interleaved_better(safe: Sequence[bool]) -> Callable[[Label, Label], bool]:
    """Rule I: whether label ``a`` dominates ``b``."""

    def better(a: Label, b: Label) -> bool:
        return (a[1] <= b[1] and a[2] <= b[2] and a[3] >= b[3] and a[4] <= b[4]
                and a[5] <= b[5] and _usage_le(a[0], b[0], safe))

    return better


def _interleaved_k(problem: PipelineProblem, types: _Types, schedule: Schedule, v: int, k: int,
                   total: int, bound: PlanBound, budget: Budget,
                   better: Callable[[Label, Label], bool]) -> tuple[list[Shape], int]:
    """The interleaved shapes of ``k`` stages and the labels kept (a DP front to back)."""
    chunks = _interleaved_chunks(problem, types, v, k)
    if chunks is None:
        return [], 0
    size, layers_of, spans, sums = chunks
    counts = [g.count for g in problem.groups]
    mems = [problem.groups[g].memory_bytes for g, _, _ in types.types]
    # key (hop classes of the first and the previous stage) -> labels
    level: dict[tuple, list[Label]] = {
        (None, None, (None,) * len(spans)):
            [((0,) * len(problem.groups), 0.0, 0.0, total, 0.0, 0.0, 0, None, None, ())]}
    kept = 0
    for i in range(k):
        nxt: dict[tuple, list[Label]] = {}
        for key in sorted(level, key=repr):
            first, prev, hosts = key
            for lab in level[key]:
                budget.check(1 + len(types.types))
                usage, sec, bott, cap, sig, upd = lab[:6]
                for ti, (g, d, _r) in enumerate(types.types):
                    agg = sums[i][ti]
                    if agg is None or usage[g] + d > counts[g]:
                        continue
                    if any(i in held and hosts[x] not in (None, (g, d))
                           for x, held in enumerate(spans)):
                        continue
                    t, st, ac, up, sg = agg
                    scap = stage_cap(schedule, st, ac, types.mb, mems[ti], total, i, k, v)
                    if scap < k:
                        continue
                    nsec, nbott = sec + t, max(bott, t)
                    cls = types.hop_class[g, d]
                    if prev is not None:  # v hops from stage i - 1 to stage i
                        for c in range(v):
                            h = types.hop(g, d, prev, ((i - 1) + c * k + 1) * size - 1)
                            nsec += v * h
                            nbott = max(nbott, v * h / 2)
                    if i == k - 1 and k > 1:  # v - 1 hops wrapping to stage 0
                        f = first if first is not None else cls
                        for c in range(v - 1):
                            h = types.hop(g, d, f, ((k - 1) + c * k + 1) * size - 1)
                            nsec += v * h
                            nbott = max(nbott, v * h / 2)
                    nupd, ncap = max(upd, up), min(cap, scap)
                    nu = (*usage[:g], usage[g] + d, *usage[g + 1:])
                    nsig = max(sig, sg)
                    if bound.hopeless(fill_s(nsec, nbott, v), nbott, ncap - ncap % k, k,
                                      nsig, nupd, nu):
                        continue
                    new = (nu, nsec, nbott, ncap, nsig, nupd, i + 1, lab,
                           (ti, layers_of[i]), ())
                    nkey = (first if first is not None else cls, cls,
                            tuple((g, d) if i in held else hosts[x]
                                  for x, held in enumerate(spans)))
                    kept += _insert(nxt.setdefault(nkey, []), new, better)
        level = nxt
    return _interleaved_shapes(types, level, v, k), kept


def _interleaved_chunks(problem: PipelineProblem, types: _Types, v: int, k: int
                        ) -> tuple[int, list[tuple[int, ...]], list[list[int]],
                                   list[list[tuple[float, ...] | None]]] | None:
    """For ``k`` interleaved stages: chunk size, stages' layers, stack spans and layer sums.

    The spans: per scanned stack the chunks cut, the stages holding it; the sums: per stage
    and type, :meth:`_Types.sums`. ``None`` when the chunks cut a stack illegally.
    """
    n = len(problem.layers)
    size = n // (k * v)
    layers_of = [tuple(j for c in range(v) for j in range((i + c * k) * size,
                                                         (i + c * k + 1) * size))
                 for i in range(k)]
    # The scanned stacks these chunks cut: each must be legal whatever the stages' groups
    # (its runs of one length, on distinct stages); then its stages share a group and
    # sub-mesh size, which the labels' keys carry (``hosts``: per such stack, the first
    # (group, devices) seen on it).
    placements = [StagePlacement(0, 1, layers) for layers in layers_of]
    if stack_violations(problem.stacks, placements):
        return None
    spans = [[i for i, layers in enumerate(layers_of) if any(a <= x < b for x in layers)]
             for a, b in problem.stacks]
    spans = [held for held in spans if len(held) > 1]
    sums = [[types.sums(ti, layers_of[i]) for ti in range(len(types.types))]
            for i in range(k)]
    return size, layers_of, spans, sums


def _interleaved_shapes(types: _Types, level: dict[tuple, list[Label]], v: int, k: int
                        ) -> list[Shape]:
    """The shapes of the last level's labels, each cap a multiple of ``k`` (at least ``k``)."""
    shapes: list[Shape] = []
    for labs in level.values():
        for lab in labs:
            s = _shape(types, lab, v, k)
            cap = s.cap - s.cap % k
            if cap >= k:
                shapes.append(Shape(s.stages, s.usage, s.fill_s, s.bottleneck_s, cap, k,
                                    s.sigma, s.update_s))
    return shapes
