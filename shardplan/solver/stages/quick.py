"""The quick plan: a good first plan for every configuration, fast at any scale.

:func:`quick_mix` mixes replicas that each use one group: the *uniform* shapes of
:class:`~shardplan.solver.stages.uniform.Family` (every stage of a replica on one sub-mesh size,
the layers split as evenly as memory allows, one remat or the fastest that fits each stage) or
of :func:`~shardplan.solver.stages.shapes.uniform_shapes`. For a pipeline-time bound ``tau`` a plan of
such replicas splits into one knapsack per group: the most microbatches ``R_g`` replicas run
on at most ``D`` devices of group ``g`` (a dynamic program over the device count, in numpy),
combined over the groups' replica counts. The sweep finds the least ``tau`` at which some
replica counts place every microbatch, ranks the replica counts that become feasible over a
grid of larger ``tau`` by their objective there (fewer replicas synchronise faster), refines
the best to their least ``tau`` and splits their replicas' microbatches exactly (least
pipeline time). Under the cost objective it also looks for the fewest dollars per hour at each
``tau``. Rounds with tighter limits on the largest gradient bytes per device (``sigma``, which
sets the synchronisation) and on the largest update repeat the sweep. The result is a
feasible plan, not necessarily the best one: the exact search (:mod:`shardplan.solver.stages.search`)
starts from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from shardplan.solver.stages.bound import Fluid, PlanBound
from shardplan.solver.stages.mix import Mix, _sumset, sync_seconds
from shardplan.solver.stages.pipeline import PipelineProblem
from shardplan.solver.stages.shapes import Budget, Shape, shape_dominates

__all__ = ["quick_mix"]

GRID_POINTS = 10
"""Pipeline-time bounds tried above the least feasible one."""
REFINE_STEPS = 12
"""Bisection steps that place a pipeline-time bound."""
REPICKS = 3
"""Times a candidate's replicas are picked again at the pipeline time of their split."""
SLACK = 0.02
"""A configuration whose first plans trail the best by more than this gets no more rounds."""
MOST_COUNTS = 4096
"""Replica counts per group considered at one bound (many groups could give millions)."""
CANDIDATES = 4
"""Replica counts per sweep whose replicas are split exactly and scored."""
ROUNDS = 6
"""Sweeps, each with its limits on the largest gradient bytes per device and update."""


class _Group:
    """One group's shapes as arrays, less those another shape of the same usage dominates
    (rule S: it runs at least as many microbatches by every bound within every limit)."""

    def __init__(self, shapes: list[Shape], g: int, n_dev: int) -> None:
        buckets: dict[int, list[Shape]] = {}
        same = [False] * len(shapes[0].usage) if shapes else []  # usages equal in a bucket
        for s in shapes:
            bucket = buckets.setdefault(s.usage[g], [])
            if not any(shape_dominates(o, s, same) for o in bucket):
                bucket[:] = [o for o in bucket if not shape_dominates(s, o, same)]
                bucket.append(s)
        shapes = [s for u in sorted(buckets) for s in buckets[u]]
        self.shapes, self.g, self.n_dev = shapes, g, n_dev
        self.usage = np.array([s.usage[g] for s in shapes], dtype=np.int64)
        self.fill = np.array([s.fill_s for s in shapes])
        self.bott = np.array([s.bottleneck_s for s in shapes])
        self.cap = np.array([s.cap for s in shapes], dtype=np.int64)
        self.step = np.array([s.step for s in shapes], dtype=np.int64)
        self.sigma = np.array([s.sigma for s in shapes])
        self.update = np.array([s.update_s for s in shapes])

    def capacity(self, tau: float) -> np.ndarray:
        """Each shape's microbatches within ``tau`` (a multiple of its step; the exact count
        is checked when a plan is split)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            m = np.where(self.bott > 0, np.floor((tau - self.fill) / self.bott) + 1, self.cap)
        m = np.where(self.fill > tau, 0, np.clip(m, 0, self.cap)).astype(np.int64)
        return m - m % self.step


class _Table:
    """One group's knapsack at ``tau`` over the shapes within ``limits`` (largest sigma,
    largest update): per replica count ``R``, the most microbatches ``R`` replicas run on at
    most ``D`` devices (``-1``: none), for every ``D``. Among shapes of equal usage only the
    one of most capacity (then least update) takes part."""

    def __init__(self, group: _Group, tau: float, limits: tuple[float, float],
                 most: int) -> None:
        self.group, n_dev = group, group.n_dev
        caps = group.capacity(tau)
        ok = np.nonzero((caps >= group.step) & (group.sigma <= limits[0])
                        & (group.update <= limits[1]))[0]
        span = np.arange(n_dev + 1)
        self.levels = [np.zeros(n_dev + 1, dtype=np.int64)]
        self.choices = [np.full(n_dev + 1, -1, dtype=np.int64)]
        self.keep = np.zeros(0, dtype=np.int64)
        if not len(ok):
            return
        order = np.lexsort((group.update[ok], -caps[ok], group.usage[ok]))
        ok = ok[order]
        _, first = np.unique(group.usage[ok], return_index=True)
        ok = ok[first]
        # a shape no better than one on fewer devices never helps (at most D devices)
        better = caps[ok] > np.concatenate(([-1], np.maximum.accumulate(caps[ok])[:-1]))
        self.keep = ok[better]
        usage, kc = group.usage[self.keep], caps[self.keep]
        idx = span[None, :] - usage[:, None]
        idx[idx < 0] = n_dev + 1  # a sentinel "none" past the end
        for _ in range(min(most, n_dev // int(usage.min()))):
            prev = np.append(self.levels[-1], -1)[idx]  # [shapes, devices]
            vals = np.where(prev >= 0, prev + kc[:, None], -1)
            pick = vals.argmax(axis=0)
            here = vals[pick, span]
            if here.max() < 0:
                break
            running = np.maximum.accumulate(here)
            earlier = np.concatenate(([-2], running[:-1]))
            pos = np.maximum.accumulate(np.where(here > earlier, span, 0))
            self.levels.append(running)
            self.choices.append(pick[pos] * (n_dev + 1) + pos)

    def picks(self, count: int, devices: int) -> list[Shape]:
        """The shapes of the best ``count`` replicas on at most ``devices`` devices."""
        out, d, n = [], devices, self.group.n_dev + 1
        for r in range(count, 0, -1):
            s, at = divmod(int(self.choices[r][d]), n)
            shape = int(self.keep[s])
            out.append(self.group.shapes[shape])
            d = at - int(self.group.usage[shape])
        return out


def _capacity(s: Shape, tau: float) -> int:
    """The most microbatches (a multiple of ``s.step``) ``s`` runs within ``tau``, exactly."""
    return s.capacity(tau)


def _reach(shapes: Sequence[Shape], total: int, tau: float) -> list[int] | None:
    """An exact split of ``total`` microbatches within ``tau`` (multiples of each shape's
    step, within its cap), the larger counts to the earlier shapes; ``None`` if none."""
    caps = [_capacity(s, tau) for s in shapes]
    if any(c < s.step for c, s in zip(caps, shapes, strict=True)) or sum(caps) < total:
        return None
    if all(s.step == 1 for s in shapes):
        if len(shapes) > total:
            return None
        left, out = total - len(shapes), []
        for c in caps:
            extra = min(c - 1, left)
            out.append(1 + extra)
            left -= extra
        return out
    mask = (1 << (total + 1)) - 1
    suffix = [1] * (len(shapes) + 1)
    for i in range(len(shapes) - 1, -1, -1):
        suffix[i] = _sumset(suffix[i + 1], shapes[i].step, caps[i] // shapes[i].step, mask)
    if not (suffix[0] >> total) & 1:
        return None
    left, out = total, []
    for i, s in enumerate(shapes):
        m = caps[i]
        while not (left - m >= 0 and (suffix[i + 1] >> (left - m)) & 1):
            m -= s.step
        out.append(m)
        left -= m
    return out


def _split(shapes: Sequence[Shape], total: int) -> tuple[float, list[int]] | None:
    """The least pipeline time over exact splits of ``total`` microbatches, and the split."""
    hi = max(s.time_s(s.cap) for s in shapes)
    if _reach(shapes, total, hi) is None:
        return None
    lo = 0.0
    for _ in range(64):
        mid = (lo + hi) / 2
        if mid <= lo or mid >= hi:
            break
        if _reach(shapes, total, mid) is None:
            lo = mid
        else:
            hi = mid
    split = _reach(shapes, total, hi)
    assert split is not None
    return max(s.time_s(m) for s, m in zip(shapes, split, strict=True)), split


class _Sweep:
    """The knapsacks of all groups at pipeline-time bounds, and the plans they give."""

    def __init__(self, problem: PipelineProblem, shapes: list[Shape], bound: PlanBound,
                 fluid: Fluid, budget: Budget, materialize: Callable[[Shape], Shape],
                 need: int = 0) -> None:
        self.problem, self.bound, self.fluid, self.budget = problem, bound, fluid, budget
        self.need = [g for g in range(len(problem.groups)) if need >> g & 1]
        self.materialize = materialize
        self.total = bound.total
        counts = [g.count for g in problem.groups]
        by_group: list[list[Shape]] = [[] for _ in counts]
        for s in shapes:
            by_group[next(g for g, u in enumerate(s.usage) if u)].append(s)
        self.groups = [_Group(ss, g, counts[g]) for g, ss in enumerate(by_group)]
        self.most = min(fluid.most_replicas, self.total)
        self.best = bound.best
        self.found: tuple[float, list[Shape], list[int]] | None = None
        self.tried: set[tuple[int, ...]] = set()
        self.cache: dict[tuple[float, tuple[float, float]], list[_Table]] = {}
        # (value, synchronisation, largest sigma, largest update) of each plan split
        self.scored: list[tuple[float, float, float, float]] = []

    def tables(self, tau: float, limits: tuple[float, float]) -> list[_Table]:
        key = (tau, limits)
        if key not in self.cache:
            if len(self.cache) > 8:
                self.cache.pop(next(iter(self.cache)))
            self.cache[key] = [_Table(group, tau, limits, self.most) for group in self.groups]
        return self.cache[key]

    def feasible(self, tau: float, limits: tuple[float, float],
                 tables: list[_Table] | None = None) -> set[tuple[int, ...]]:
        """The replica counts per group whose best capacities place every microbatch."""
        per_group = [[int(level[t.group.n_dev]) for level in t.levels]
                     for t in tables or self.tables(tau, limits)]
        # the most the groups from g on can add (levels only grow with the replica count)
        rest = [0] * (len(per_group) + 1)
        for g in range(len(per_group) - 1, -1, -1):
            rest[g] = rest[g + 1] + max(per_group[g])
        out: set[tuple[int, ...]] = set()

        def walk(g: int, combo: tuple[int, ...], have: int) -> None:
            if len(out) >= MOST_COUNTS or have + rest[g] < self.total:
                return
            if g == len(per_group):
                if sum(combo) and all(combo[n] for n in self.need):
                    out.add(combo)
                return
            for r, c in enumerate(per_group[g]):
                walk(g + 1, (*combo, r), have + c)

        walk(0, (), 0)
        return out

    def score(self, picks: list[Shape]) -> float | None:
        """Splits ``picks`` exactly and keeps the plan if it beats the best; the pipeline
        time of the split (``None``: tried before, or no split)."""
        key = tuple(sorted(id(s) for s in picks))
        if not picks or key in self.tried or not all(any(s.usage[g] for s in picks)
                                                      for g in self.need):
            return None
        self.tried.add(key)
        result = _split(picks, self.total)
        if result is None:
            return None
        tau, split = result
        bound = self.bound
        usage = [sum(col) for col in zip(*(s.usage for s in picks), strict=True)]
        sig, update = max(s.sigma for s in picks), max(s.update_s for s in picks)
        sync = sync_seconds(len(picks), bound.link(usage), sig)
        step = tau + sync + update
        if bound.too_slow(step):
            return tau
        value = bound.value(step, bound.price(usage))
        self.scored.append((value, sync, sig, update))
        if value < self.best:
            self.best, self.found = value, (value, picks, split)
        return tau

    def mix(self) -> Mix | None:
        """The best plan found, its shapes with their stages."""
        if self.found is None:
            return None
        value, picks, split = self.found
        built = [self.materialize(s) for s in picks]
        order = sorted(range(len(built)), key=lambda i: _order(built[i]))
        return Mix(value, tuple((built[i], split[i]) for i in order), 0)

    def least_tau(self, lo: float, hi: float, limits: tuple[float, float],
                  reps: tuple[int, ...] | None = None) -> float:
        """The least bound in ``(lo, hi]`` (``hi`` feasible) at which ``reps`` (or any replica
        counts) place every microbatch, to ``REFINE_STEPS`` bisections."""
        steps = 0
        while steps < REFINE_STEPS:
            # geometric steps while the bracket spans more than 10 %, then halves
            geometric = lo > 0 and hi > 1.1 * lo
            mid = math.sqrt(lo * hi) if geometric else (lo + hi) / 2
            steps += not geometric
            found = self.feasible(mid, limits)
            if (reps in found) if reps is not None else bool(found):
                hi = mid
            else:
                lo = mid
        return hi

    def estimate(self, tau: float, reps: tuple[int, ...], tables: list[_Table]) -> float:
        """The objective of ``reps``' best replicas at ``tau`` if they take all of it."""
        picks: list[Shape] = []
        for g, table in enumerate(tables):
            if reps[g]:
                picks += table.picks(reps[g], table.group.n_dev)
        usage = [sum(col) for col in zip(*(s.usage for s in picks), strict=True)]
        step = tau + sync_seconds(len(picks), self.bound.link(usage),
                                  max(s.sigma for s in picks)) + max(s.update_s for s in picks)
        return self.bound.value(step, self.bound.price(usage))

    def picks(self, tau: float, limits: tuple[float, float], reps: tuple[int, ...],
              devices: Sequence[int] | None = None) -> list[Shape]:
        out: list[Shape] = []
        for g, table in enumerate(self.tables(tau, limits)):
            if reps[g]:
                out += table.picks(reps[g], devices[g] if devices else table.group.n_dev)
        return out


def quick_mix(problem: PipelineProblem, shapes: list[Shape], bound: PlanBound, fluid: Fluid,
              budget: Budget, materialize: Callable[[Shape], Shape] | None = None,
              need: int = 0) -> Mix | None:
    """The best plan of one-group ``shapes`` the sweep finds (the module docstring), if its
    objective beats ``bound.best``; ``materialize`` gives a shape its stages
    (:meth:`~shardplan.solver.stages.uniform.Family.materialize`); ``need``: a bitmask of
    groups each with at least one replica."""
    if not shapes:
        return None
    sweep = _Sweep(problem, shapes, bound, fluid, budget, materialize or (lambda s: s), need)
    tau_top = max(s.time_s(s.cap) for s in shapes)
    tau_floor = fluid.least_tau(sweep.total - fluid.most_replicas) if fluid.usable else 0.0
    queue: list[tuple[float, float]] = [(math.inf, math.inf)]
    seen: set[tuple[float, float]] = set()
    # A round per limits (sigma, update): the least feasible bound, the replica counts ranked
    # over a grid above it and the best split exactly; then rounds that cut an overhead.
    while queue and len(seen) < ROUNDS:
        limits = queue.pop(0)
        if limits in seen:
            continue
        seen.add(limits)
        if budget.over(len(shapes)) or not sweep.feasible(tau_top, limits):
            continue
        lo = tau_floor
        if lo > 0 and sweep.feasible(lo, limits):
            lo = 0.0
        tau_first = sweep.least_tau(lo, tau_top, limits)
        sweep.scored = []
        ranked = _ranked(sweep, len(shapes), limits, tau_first, tau_top)
        _split_ranked(sweep, len(shapes), limits, ranked)
        if bound.cost:
            _cheaper(sweep, tau_first, tau_top, limits)
        queue += _overhead_cuts(sweep, shapes, limits)
    return sweep.mix()


def _ranked(sweep: _Sweep, n_shapes: int, limits: tuple[float, float], tau_first: float,
            tau_top: float) -> dict[tuple[int, ...], tuple[float, float, float]]:
    """Replica counts as they become feasible over a grid of bounds from ``tau_first``.

    Each with its value at its grid point (less the grid step: what it may reach) and the
    bracket ``(lo, hi]`` of bounds it became feasible in.
    """
    bound, fluid, budget = sweep.bound, sweep.fluid, sweep.budget
    # (fewer replicas may synchronise faster at a longer pipeline time, hence the grid)
    # reps -> (value at the grid point less the grid step: what it may reach), lo, hi
    ranked: dict[tuple[int, ...], tuple[float, float, float]] = {}
    tables = sweep.tables(tau_first, limits)
    for reps in sweep.feasible(tau_first, limits, tables):
        ranked[reps] = (sweep.estimate(tau_first, reps, tables), tau_first, tau_first)
    top = tau_top
    if not bound.cost:
        top = min(tau_top, sweep.best, *(e for e, _, _ in ranked.values())
                  ) - fluid.update_floor
    prev = tau_first
    for i in range(1, GRID_POINTS + 1):
        if budget.over(n_shapes) or top <= tau_first:
            break
        tau = tau_first + (top - tau_first) * (i / GRID_POINTS) ** 2
        tables = sweep.tables(tau, limits)
        for reps in sweep.feasible(tau, limits, tables) - set(ranked):
            value = sweep.estimate(tau, reps, tables)
            ranked[reps] = (value - (tau - prev) if not bound.cost else value, prev, tau)
        prev = tau
    return ranked


def _split_ranked(sweep: _Sweep, n_shapes: int, limits: tuple[float, float],
                  ranked: dict[tuple[int, ...], tuple[float, float, float]]) -> None:
    """Refines the best :data:`CANDIDATES` of ``ranked`` and splits them exactly (``score``)."""
    for reps in sorted(ranked, key=lambda r: (ranked[r][0], r))[:CANDIDATES]:
        if sweep.budget.over(n_shapes):
            break
        _, lo, hi = ranked[reps]
        tau = sweep.least_tau(lo, hi, limits, reps) if hi > lo else hi
        for _ in range(REPICKS):  # the best replicas at the split's own time, again
            split_tau = sweep.score(sweep.picks(tau, limits, reps))
            if split_tau is None or split_tau >= tau or reps not in sweep.feasible(
                    split_tau, limits):
                break
            tau = split_tau


def _overhead_cuts(sweep: _Sweep, shapes: list[Shape], limits: tuple[float, float]
                   ) -> list[tuple[float, float]]:
    """The limits of the next rounds: each cuts an overhead of this round's best plans."""
    out: list[tuple[float, float]] = []
    # Cut an overhead of this round's best plans: allow only smaller gradient shares per
    # device (synchronisation) or shorter updates; not for a configuration that trails.
    if not sweep.scored or min(sweep.scored)[0] > (1 + SLACK) * min(sweep.bound.best,
                                                                    sweep.best):
        return out
    for _, _, sig, update in sorted(sweep.scored)[:2]:
        below = [s.sigma for s in shapes if s.sigma < sig]
        if below:
            out.append((max(below), limits[1]))
        below = [s.update_s for s in shapes if s.update_s < update]
        if below:
            out.append((limits[0], max(below)))
    return out


def _cheaper(sweep: _Sweep, tau_first: float, tau_top: float,
             limits: tuple[float, float]) -> None:
    """Cost objective: at bounds from the least feasible one up, the fewest dollars per hour
    whose devices place every microbatch (per group, the least devices that reach each
    capacity; combined over the groups), split and scored."""
    total, prices = sweep.total, [g.price_per_hour for g in sweep.problem.groups]
    need = np.arange(total + 1)
    for i in range(GRID_POINTS + 1):
        if sweep.budget.over():
            return
        tau = tau_first * (tau_top / tau_first) ** (i / GRID_POINTS) if tau_first > 0 else tau_top
        if sweep.bound.too_slow(tau):
            return
        combined = np.full(total + 1, np.inf)
        combined[0] = 0.0
        history = []
        for g, table in enumerate(sweep.tables(tau, limits)):
            # price[c]: the least price of group g's replicas running at least c microbatches
            price = np.full(total + 1, np.inf)
            price[0] = 0.0
            reps = np.zeros(total + 1, dtype=np.int64)
            devs = np.zeros(total + 1, dtype=np.int64)
            for r, level in enumerate(table.levels[1:], start=1):
                d = np.searchsorted(np.minimum(level, total), need)
                cand = np.where(d <= table.group.n_dev, d * prices[g], np.inf)
                better = cand < price
                price, reps, devs = (np.where(better, cand, price), np.where(better, r, reps),
                                     np.where(better, d, devs))
            ends = [c for c in range(total + 1)
                    if np.isfinite(price[c]) and (c == total or price[c + 1] != price[c])]
            new = np.full(total + 1, np.inf)
            pick = np.zeros(total + 1, dtype=np.int64)
            for c1 in ends:
                cand = np.full(total + 1, np.inf)
                cand[c1:] = combined[:total + 1 - c1] + price[c1]
                cand[:c1 + 1] = np.minimum(cand[:c1 + 1], price[c1])  # c1 alone covers c <= c1
                better = cand < new
                new = np.where(better, cand, new)
                pick[better] = c1
            history.append((pick, reps, devs))
            combined = new
        if not np.isfinite(combined[total]):
            continue
        n = len(history)
        chosen, devices, left = [0] * n, [0] * n, total
        for g in range(n - 1, -1, -1):
            pick, reps, devs = history[g]
            c1 = int(pick[left])
            chosen[g], devices[g] = int(reps[c1]), int(devs[c1])
            left = max(0, left - c1)
        sweep.score(sweep.picks(tau, limits, tuple(chosen), devices))


def _order(s: Shape) -> tuple:
    return (s.usage, s.fill_s, s.bottleneck_s, -s.cap, s.sigma, s.update_s,
            [(p.group, p.devices, p.remat, p.layers) for p in s.stages])
