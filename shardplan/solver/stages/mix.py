"""Mixing replicas: which replica shapes, how many of each, and how many microbatches each.

For a pipeline-time bound ``tau``, a shape ``s`` can run any multiple of ``s.step`` microbatches
up to ``c_s(tau)``, the most with ``s.time_s(m) <= tau`` that its memory holds. Whether some
multiset of replicas fits the groups and splits the ``M`` microbatches within ``tau`` is a
knapsack: ``_Mixer.states`` builds, per replica count and set of groups used, the Pareto set
of ``(devices per group, reachable microbatch totals, largest sigma, largest update, price)``;
the totals are a bitmask, the reachable sums of the chosen replicas' microbatch counts. A
plan's objective is ``tau' + sync + update`` (times its price under the cost objective) with
``tau' <= tau`` its real pipeline time, so :func:`best_mix` sweeps ``tau`` over the breakpoints
``s.time_s(m)`` upwards, jumping by bisection to the next breakpoint where a state appears
that could beat the best plan so far and whose replicas, with the fluid capacity of the
devices left (:mod:`shardplan.solver.stages.bound`), can still place every microbatch (rules K, B,
F and T in :mod:`shardplan.solver.stages.search`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from shardplan.solver.stages.bound import PlanBound
from shardplan.solver.stages.pipeline import Link, PipelineProblem
from shardplan.solver.stages.shapes import UNLIMITED, Budget, Shape, _usage_le

__all__ = ["Mix", "best_mix", "sync_seconds"]

# A state: (usage, reach bitmask, sigma, update, price, parent state, shape index).
State = tuple


@dataclass(frozen=True)
class Mix:
    """The best replicas for one (microbatch size, schedule, chunks).

    Attributes:
      value: the objective (seconds, or dollars per step).
      replicas: ``(shape, microbatches)`` per replica.
      states: knapsack states built (search statistics).
    """

    value: float
    replicas: tuple[tuple[Shape, int], ...]
    states: int


def sync_seconds(replicas: int, link: Link, sigma: float) -> float:
    """:func:`~shardplan.solver.stages.pipeline.sync_s` from its parts."""
    if replicas <= 1:
        return 0.0
    return (2 * (replicas - 1) / replicas * sigma / link.bandwidth_bytes_per_s
            + 2 * (replicas - 1) * link.latency_s)


def _sumset(reach: int, step: int, count: int, mask: int) -> int:
    """``{a + j step : a in reach, 1 <= j <= count}``, as bitmasks, cut to ``mask``."""
    out, shift, block, width = 0, 0, reach, 1
    while count:
        if count & 1:
            out |= block << shift
            shift += width * step
        count >>= 1
        if count:
            block |= block << (width * step)
            width *= 2
    return (out << step) & mask


class _Mixer:
    """The knapsack over one configuration's shapes, evaluated at pipeline-time bounds."""

    def __init__(self, problem: PipelineProblem, shapes: list[Shape], bound: PlanBound,
                 budget: Budget, need: int = 0) -> None:
        self.problem, self.shapes, self.bound, self.budget = problem, shapes, bound, budget
        self.need = need  # a bitmask of groups every final state uses
        self.total = bound.total
        self.mask = (1 << (self.total + 1)) - 1
        self.counts = [g.count for g in problem.groups]
        self.prices = [bound.price(s.usage) for s in shapes]
        self.supports = [sum(1 << g for g, u in enumerate(s.usage) if u) for s in shapes]
        self.states_built = 0

    def capacity(self, s: Shape, tau: float) -> int:
        """The most microbatches (a multiple of ``s.step``) ``s`` runs within ``tau``."""
        return s.capacity(tau)

    def score(self, tau: float, r: int, st: State) -> tuple[float, float]:
        """``(objective, step seconds)`` of a final state at ``tau``."""
        step = tau + sync_seconds(r, self.bound.link(st[0]), st[2]) + st[3]
        return self.bound.value(step, st[4]), step

    def promising(self, tau_lo: float, r: int, st: State, best: float) -> bool:
        """Whether a state with ``r`` replicas (more may join) could beat ``best`` at
        ``tau_lo``."""
        step = tau_lo + self.bound.sync_floor(r, st[2], st[0]) + st[3]
        price = st[4]
        return not self.bound.too_slow(step) and self.bound.value(step, price) < best

    def states(self, tau: float, tau_lo: float, best: float) -> dict[int, dict[int, list]]:
        """The Pareto knapsack states at ``tau`` of the states that could beat ``best``."""
        safe, counts, total = self.bound.safe, self.counts, self.total
        levels: dict[int, dict[int, list[State]]] = {
            0: {0: [((0,) * len(counts), 1, 0.0, 0.0, 0.0, None, None)]}}

        def better(a: State, b: State) -> bool:
            return ((a[1] | b[1]) == a[1] and a[2] <= b[2] and a[3] <= b[3] and a[4] <= b[4]
                    and (a[0] == b[0] or _usage_le(a[0], b[0], safe)))

        built = 0
        for idx, s in enumerate(self.shapes):
            c = self.capacity(s, tau)
            if c < s.step:
                continue
            q = c // s.step
            for r in range(1, total + 1):
                below = levels.get(r - 1)
                if not below:
                    break
                here = levels.setdefault(r, {})
                for supp in list(below):
                    for st in list(below[supp]):
                        built += 1
                        if not built & 255:
                            self.budget.check(256)
                        usage = tuple(map(operator.add, st[0], s.usage))
                        if not all(map(operator.le, usage, counts)):
                            continue
                        reach = _sumset(st[1], s.step, q, self.mask)
                        if not reach:
                            continue
                        sigma, update = max(st[2], s.sigma), max(st[3], s.update_s)
                        price = st[4] + self.prices[idx]
                        new = (usage, reach, sigma, update, price, st, idx)
                        if not self.promising(tau_lo, r, new, best) or self.bound.crowded(
                                tau, reach.bit_length() - 1, usage, r):
                            continue
                        bucket = here.setdefault(supp | self.supports[idx], [])
                        if any(better(o, new) for o in bucket):
                            continue
                        bucket[:] = [o for o in bucket if not better(new, o)]
                        bucket.append(new)
                        self.states_built += 1
        return levels

    def finals(self, tau: float, tau_lo: float, best: float
               ) -> list[tuple[float, float, float, int, State]]:
        """Final states (every microbatch placed) at ``tau`` that could beat ``best`` at
        ``tau_lo``: ``(objective at tau, sync + update, price, replicas, state)``, in a
        deterministic order."""
        out = []
        bit = 1 << self.total
        for r, by_supp in sorted(self.states(tau, tau_lo, best).items()):
            if r == 0:
                continue
            for supp in sorted(by_supp):
                if supp & self.need != self.need:
                    continue
                for st in by_supp[supp]:
                    if not st[1] & bit:
                        continue
                    extra = sync_seconds(r, self.bound.link(st[0]), st[2])
                    step = tau_lo + extra + st[3]
                    if not self.bound.too_slow(step) and self.bound.value(step, st[4]) < best:
                        out.append((self.score(tau, r, st)[0], extra + st[3], st[4], r, st))
        return out

    def split(self, picks: list[int], tau: float) -> list[int]:
        """Microbatches per picked shape within ``tau`` adding up to the total."""
        shapes = [self.shapes[i] for i in picks]
        caps = [self.capacity(s, tau) for s in shapes]
        suffix = [1] * (len(shapes) + 1)
        for i in range(len(shapes) - 1, -1, -1):
            suffix[i] = _sumset(suffix[i + 1], shapes[i].step, caps[i] // shapes[i].step,
                                self.mask)
        left, out = self.total, []
        for i, s in enumerate(shapes):
            m = caps[i] - caps[i] % s.step
            while not (left - m >= 0 and (suffix[i + 1] >> (left - m)) & 1):
                m -= s.step
            out.append(m)
            left -= m
        return out


def best_mix(problem: PipelineProblem, shapes: list[Shape], bound: PlanBound,
             budget: Budget = UNLIMITED, need: int = 0) -> Mix | None:
    """The best multiset of ``shapes`` with a microbatch split, if its objective is below
    ``bound.best``; with ``need`` (a bitmask of groups), the best whose replicas use at least
    those groups.

    States are kept per set of groups used (rule K never compares a state with one on other
    groups) and every bound is a floor on any completion, so filtering the final states keeps
    the best plan of the restricted family.

    Raises:
      SearchTimeout: past the ``budget``.
    """
    mixer = _Mixer(problem, shapes, bound, budget, need)
    best = bound.best
    floor_su = min((s.update_s for s in shapes), default=0.0)
    floor_price = min(mixer.prices, default=0.0)

    def hopeless(tau: float) -> bool:  # no plan with pipeline time tau or more beats best
        return bound.too_slow(tau + floor_su) or bound.value(tau + floor_su, floor_price) >= best

    points = sorted({t for s in shapes for m in range(s.step, s.cap + 1, s.step)
                     if not hopeless(t := s.time_s(m))})
    found: tuple[float, float, int, State] | None = None
    # (sync + update, price) of the finals seen at the last breakpoint visited: a later
    # breakpoint can only help with a final that beats all of them (rule T).
    seen: list[tuple[float, float]] = []

    def fresh(tau: float, tau_lo: float) -> list:
        """Finals at ``tau`` not beaten by ``seen``; each is a plan, so the best so far
        improves on the way."""
        nonlocal best, found
        out = [f for f in mixer.finals(tau, tau_lo, best)
               if not any(g <= f[1] and p <= f[2] for g, p in seen)]
        for value, _, _, r, st in out:
            if value < best and not bound.too_slow(mixer.score(tau, r, st)[1]):
                best, found = value, (value, tau, r, st)
        return out

    lo = 0
    while lo < len(points) and not hopeless(points[lo]):
        tau_lo = points[lo]
        if not fresh(points[-1], tau_lo):
            break
        # Bisect for the first breakpoint with something fresh. The bound only tightens on
        # the way, which keeps "nothing fresh below a" true.
        a, b = lo, len(points) - 1
        while a < b:
            mid = (a + b) // 2
            if fresh(points[mid], tau_lo):
                b = mid
            else:
                a = mid + 1
        for _, g, price, _, _ in fresh(points[b], tau_lo):
            if not any(g0 <= g and p0 <= price for g0, p0 in seen):
                seen = [(g0, p0) for g0, p0 in seen if not (g <= g0 and price <= p0)]
                seen.append((g, price))
        lo = b + 1
    if found is None:
        return None
    _, tau, _, st = found
    picks = []
    node = st
    while node[6] is not None:
        picks.append(node[6])
        node = node[5]
    picks.sort()
    ms = mixer.split(picks, tau)
    return Mix(found[0], tuple((shapes[i], m) for i, m in zip(picks, ms, strict=True)),
               mixer.states_built)
