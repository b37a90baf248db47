"""Uniform replica shapes of a model whose layers are all one kind, built fast.

When every layer is the same kind, a stage's figures depend only on its type (group, sub-mesh
size, remat) and its layer count, so the sums over ``L = 0 .. n`` layers are computed once per
type (:class:`_Stages`, added one layer at a time as
:func:`~shardplan.solver.stages.pipeline.evaluate_pipeline` adds them) and a replica is a few runs of
equal stages. :class:`Family` enumerates the uniform shapes the quick plan
(:mod:`shardplan.solver.stages.quick`) mixes: thousands of them, without building their stages until
a plan uses them.
"""

from __future__ import annotations

import dataclasses

from shardplan.solver.stages.pipeline import PipelineProblem, Schedule, StagePlacement, stage_work
from shardplan.solver.stages.shapes import Shape, _Types, shape_timing, stage_cap

__all__ = ["Family"]

NO_LIMIT = 1 << 40
"""In-flight microbatches a stage without activations holds."""


class _Stages:
    """Exact figures of stages of ``L`` identical layers: the sums (added one layer at a time
    from 0, as :func:`~shardplan.solver.stages.pipeline.evaluate_pipeline` adds them) and the most
    microbatches in flight that fit (``-1``: not even the state)."""

    def __init__(self, problem: PipelineProblem, types: _Types, ti: int) -> None:
        n, mb = len(problem.layers), types.mb
        row = types.per_layer[ti][0]
        assert row is not None
        memory = problem.groups[types.types[ti][0]].memory_bytes
        t = st = ac = up = sg = rc = wk = 0.0
        self.sums = [(0.0, 0.0, 0.0, 0.0, 0.0)]
        self.most = [NO_LIMIT]
        for _ in range(n):
            t, st, ac, up, sg = t + row[0], st + row[1], ac + row[2], up + row[3], sg + row[4]
            rc, wk = rc + row[5], max(wk, row[6])
            held = st + mb * stage_work(rc, wk)  # the state and one backward's work
            self.sums.append((t, held, ac, up, sg))
            self.most.append(_most_in_flight(held, ac, mb, memory))
        # longest[f]: the most layers that fit with f microbatches in flight (``most`` only
        # falls as layers are added)
        self.longest = [0] * (n + 2)
        length = n
        for f in range(n + 2):
            while length > 0 and self.most[length] < f:
                length -= 1
            self.longest[f] = length

    def cap(self, schedule: Schedule, length: int, i: int, k: int, v: int, total: int,
            memory: float, mb: int) -> int:
        """:func:`~shardplan.solver.stages.shapes.stage_cap` of a stage of ``length`` layers."""
        most = self.most[length]
        if schedule == "gpipe":
            return max(0, min(total, most))
        if schedule == "1f1b":
            return total if min(total, k - i) <= most else max(0, most)
        _, st, ac, _, _ = self.sums[length]
        return stage_cap(schedule, st, ac, mb, memory, total, i, k, v)


def _most_in_flight(state: float, activation: float, mb: int, memory: float) -> int:
    """The largest ``f`` with ``state + float(f) * mb * activation <= memory`` (``state``:
    the stage's state and one backward's working bytes)."""
    if state > memory:
        return -1
    if activation <= 0:
        return NO_LIMIT
    f = min(NO_LIMIT, int((memory - state) / (mb * activation)))
    while f < NO_LIMIT and state + float(f + 1) * mb * activation <= memory:
        f += 1
    while f >= 0 and state + float(f) * mb * activation > memory:
        f -= 1
    return f


class Family:
    """Uniform replica shapes of a problem whose layers are all one kind: per group, sub-mesh
    size and stage count ``k``, the stages hold ``floor`` or ``ceil`` of ``n / k`` layers (the
    shorter ones first) or, under 1F1B when memory binds, as many as fit at each stage's
    in-flight count (the front holds more microbatches), with one remat or the fastest remat
    that fits each stage with every microbatch in flight.

    The shapes carry no stages (``stages == ()``) until :meth:`materialize` builds them, which
    keeps thousands of them cheap: a shape is a few runs of equal stages.

    Args:
      problem, mb, schedule, v: the configuration.
      types: the stage types at ``mb``.
      tables: per stage type, its :class:`_Stages` (shared by the schedules of one ``mb``).
    """

    def __init__(self, problem: PipelineProblem, mb: int, schedule: Schedule, v: int,
                 types: _Types, tables: dict[int, _Stages]) -> None:
        self.problem, self.types, self.schedule = problem, types, schedule
        self.v = v if schedule == "interleaved" and v > 1 else 1
        n, self.total = len(problem.layers), problem.batch // mb
        self.shapes: list[Shape] = []
        self.recipes: dict[int, tuple[int, int, tuple[tuple[int, int, int], ...]]] = {}
        for g, d in sorted({(g, d) for g, d, _ in types.types}):
            tis = [types.index[g, d, r] for r in problem.remats if (g, d, r) in types.index]
            if any(types.per_layer[ti][0] is None for ti in tis):
                continue
            for ti in tis:
                if ti not in tables:
                    tables[ti] = _Stages(problem, types, ti)
            stages = {ti: tables[ti] for ti in tis}
            hop = types.hop(g, d, types.hop_class[g, d], 0)
            choices = [[ti] for ti in tis] + ([tis] if len(tis) > 1 else [])
            # per choice, the most layers a stage holds with f microbatches in flight
            longest = [[max(stages[ti].longest[f] for ti in choice) for f in range(n + 2)]
                       for choice in choices]
            for k in range(1, min(n, problem.max_stages or n, problem.groups[g].count // d) + 1):
                if self.v > 1:
                    if n % (k * self.v):
                        continue
                    even = [(n // k, k)]
                else:
                    q, extra = divmod(n, k)
                    even = [run for run in ((q, k - extra), (q + 1, extra)) if run[1]]
                splits = [even]
                if schedule == "1f1b":
                    for most in longest:
                        if all(most[min(self.total, k - pos)] >= length
                               for pos, (length, _) in zip(_starts(even), even, strict=True)):
                            continue  # the even split fits: nothing to move
                        split = _memory_split(most, k, self.total, n)
                        if split is not None and split not in splits:
                            splits.append(split)
                for split in splits:
                    for choice in choices:
                        segments = self._assign(stages, g, k, split, choice)
                        if segments is not None:
                            self._add(stages, g, d, hop, k, segments)

    def _fits_all(self, stage: _Stages, g: int, length: int, i: int, k: int) -> bool:
        """Whether a stage at position ``i`` holds every microbatch the schedule sends."""
        return stage.cap(self.schedule, length, i, k, self.v, self.total,
                         self.problem.groups[g].memory_bytes, self.types.mb) >= self.total

    def _assign(self, stages: dict[int, _Stages], g: int, k: int,
                runs: list[tuple[int, int]], choice: list[int]
                ) -> list[tuple[int, int, int, int]] | None:
        """Runs ``(length, type, stages, cap)``, front first: with one type the runs as given;
        with several, per stage the fastest that holds every microbatch (a stage further back
        holds fewer, so each type fits from some position on)."""
        memory, mb, v, total = self.problem.groups[g].memory_bytes, self.types.mb, self.v, self.total
        out: list[tuple[int, int, int, int]] = []
        pos = 0
        for length, count in runs:
            if len(choice) == 1:
                ti = choice[0]
                # the front stage of a run holds the most microbatches of the run
                cap = stages[ti].cap(self.schedule, length, pos, k, v, total, memory, mb)
                if cap < 1:
                    return None
                out.append((length, ti, count, cap))
                pos += count
                continue
            starts = []
            for o in choice:
                lo, hi = pos, pos + count  # the first position in the run where o fits
                while lo < hi:
                    mid = (lo + hi) // 2
                    if self._fits_all(stages[o], g, length, mid, k):
                        hi = mid
                    else:
                        lo = mid + 1
                starts.append((lo, o))
            at, end = pos, pos + count
            while at < end:
                usable = [o for s, o in starts if s <= at]
                if not usable:
                    return None
                ti = min(usable, key=lambda o: (stages[o].sums[length][0], o))
                faster = [s for s, o in starts if s > at
                          and (stages[o].sums[length][0], o) < (stages[ti].sums[length][0], ti)]
                stop = min([end, *faster])
                out.append((length, ti, stop - at, total))
                at = stop
            pos = end
        return out

    def _add(self, stages: dict[int, _Stages], g: int, d: int, hop: float, k: int,
             segments: list[tuple[int, int, int, int]]) -> None:
        v, total = self.v, self.total
        cap = total
        sigma = update = 0.0
        times: list[float] = []
        for length, ti, count, scap in segments:
            t, _, _, up, sg = stages[ti].sums[length]
            cap = min(cap, scap)
            times += [t] * count
            sigma, update = max(sigma, sg), max(update, up)
        hops = [hop] * ((k * v - 1 if v > 1 else k - 1) if k > 1 else 0)
        fill, bott = shape_timing(times, hops, v)
        step = k if v > 1 else 1
        cap -= cap % step
        if cap < step:
            return
        usage = tuple(k * d if gg == g else 0 for gg in range(len(self.problem.groups)))
        shape = Shape((), usage, fill, bott, cap, step, sigma, update)
        self.shapes.append(shape)
        self.recipes[id(shape)] = (g, d, tuple((L, ti, c) for L, ti, c, _ in segments))

    def materialize(self, shape: Shape) -> Shape:
        """``shape`` with its stages."""
        g, d, segments = self.recipes[id(shape)]
        k = sum(count for _, _, count in segments)
        placed, first, i = [], 0, 0
        for length, ti, count in segments:
            remat = self.types.types[ti][2]
            for _ in range(count):
                if self.v > 1:
                    size = length // self.v
                    layers = tuple(j for c in range(self.v)
                                   for j in range((i + c * k) * size, (i + c * k + 1) * size))
                else:
                    layers = tuple(range(first, first + length))
                placed.append(StagePlacement(g, d, layers, remat))  # type: ignore[arg-type]
                first += length
                i += 1
        return dataclasses.replace(shape, stages=tuple(placed))


def _starts(runs: list[tuple[int, int]]) -> list[int]:
    """The position of each run's front stage."""
    out, pos = [], 0
    for _, count in runs:
        out.append(pos)
        pos += count
    return out


def _memory_split(longest: list[int], k: int, total: int, n: int
                  ) -> list[tuple[int, int]] | None:
    """1F1B: per stage, as many layers as fit with its in-flight count (``longest`` by
    count), capped at the least ``L`` that covers ``n`` layers; the front stages give up the
    excess. As runs ``(length, stages)``, front first."""
    most = [longest[min(total, k - i)] for i in range(k)]
    if sum(most) < n:
        return None
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(min(mid, m) for m in most) >= n:
            hi = mid
        else:
            lo = mid + 1
    split = [min(lo, m) for m in most]
    excess = sum(split) - n
    for i in range(k):
        cut = min(excess, split[i] - 1)
        split[i] -= cut
        excess -= cut
    if excess or min(split) < 1:
        return None
    runs: list[tuple[int, int]] = []
    for length in split:
        if runs and runs[-1][0] == length:
            runs[-1] = (length, runs[-1][1] + 1)
        else:
            runs.append((length, 1))
    return runs
