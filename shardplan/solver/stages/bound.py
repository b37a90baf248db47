"""A lower bound on every plan of one configuration (rule F in :mod:`shardplan.solver.stages.search`).

For a microbatch size ``mb``, schedule and chunk count ``v`` (``M = batch / mb``), any plan with
``R`` replicas and pipeline time ``tau`` satisfies ``M - R <= F(tau) = sum_g N_g rho_g(tau)``:
the *fluid* capacity of the groups, where ``N_g`` is group ``g``'s device count and

    rho_g(tau) = max(0, max over layers l and options o of group g of
                     (tau q_l - a_lo) / w_lo),

with ``a_lo = t_lo / v`` and ``w_lo = d_o t_lo`` for ``t_lo`` layer ``l``'s seconds per
microbatch under option ``o`` (forward, backward and the recomputation of the fastest remat
whose single layer holds one microbatch), and ``q_l`` weights that add up to 1 (``1 / n`` for
identical layers). Interleaved, every stage of a ``k``-stage replica holds ``n / k`` layers
and, as ``m >= k``, at least ``((v - 1) k + 1) / v`` stages' activations
(:func:`~shardplan.solver.stages.pipeline.in_flight`): with identical layers a remat takes part only
if such a stage fits for some allowed ``k``.

Proof. A stage ``s`` of replica ``r`` (``m_r`` microbatches) takes ``t_s <= B_r``, so ``tau >=
T_r = A_r + (m_r - 1) B_r`` gives ``(m_r - 1) d_s t_s <= (tau - A_r) d_s``; summed over the
stages on group ``g``: ``(m_r - 1) W_rg <= (tau - A_r) D_rg`` (``W_rg`` the device-seconds per
microbatch of the replica's stages on ``g``, ``D_rg`` their devices). Divide by ``tau - A_r``
(positive when ``m_r >= 2``), multiply by ``rho_g >= 0`` and add over replicas and groups:
``sum_r (m_r - 1) sum_g rho_g W_rg / (tau - A_r) <= sum_g rho_g N_g``. Each replica's factor
``sum_g rho_g W_rg / (tau - A_r)`` is at least 1, because ``A_r >= sum_l a_l`` (the fill holds
every layer's time once, divided by ``v``) and, by the choice of ``rho``, ``a_lo + rho_g w_lo
>= tau q_l`` for every option a layer can take, so ``sum_l (a_l + rho w_l) >= tau``. Hence
``sum_r (m_r - 1) = M - R <= F(tau)``. (Hops only add to ``A_r`` and ``B_r``.)

``F`` is non-decreasing and piecewise linear, so ``tau`` is at least the root ``tau_R`` of
``F(tau) = M - R``. The bound is taken per set ``S`` of groups the plan's stages use (devices
of other groups do not count):

* ``U >= max_l min_o update_lo`` over the options of ``S`` (every layer sits on some stage);
* with ``R >= 2`` the synchronisation runs on the slowest link between the groups of ``S`` (one
  group: the faster of its two links) and some replica has at most ``N_S / R`` devices, whose
  stages hold the replica's ``G`` gradient bytes, so ``sigma >= R G / N_S``;
* with ``R = 1`` the one replica covers the ``n`` layers with stages of at most ``B`` seconds:
  a stage on ``d`` devices of option ``o`` holds at most ``floor(B / t_o)`` layers (and what its
  memory holds), so ``sum_g N_g max_o L_o(B) / d_o >= n`` bounds ``B`` from below, and
  ``T >= sum_l min a_l + (M - 1) B``;
* ``R`` is at most ``sum_g N_g memory_g / S_state`` (the least total state bytes of one replica)
  and ``M``;
* whatever ``R``, every replica runs at least one microbatch through every layer, and some
  replica has at most ``N_S / R`` devices, so ``tau >= T_r >= A_r >= sum_l min a_lo`` over
  the options of at most ``N_S / R`` devices (its fill): with ``R`` near ``M`` the fluid
  term ``M - R <= F(tau)`` alone says little.

Under the cost objective, ``step * price >= sum_r (m_r - 1) sum_g price_g W_rg >= (M - R)
sum_l min_o price_g w_lo`` by the same inequality.

Example:
    >>> from shardplan.solver.stages.pipeline import (DeviceGroup, LayerKind, LayerOption, Link,
    ...     PipelineProblem)
    >>> link = Link(1e9, 0.0)
    >>> o = LayerOption(1, (0.0, 1.0), (0.0, 2.0), {"none": (0.0, 0.0)}, {"none": 1.0}, 0.0,
    ...                 0.0)
    >>> problem = PipelineProblem((LayerKind("block", {0: (o,)}, 0.0, 0.0),), (0, 0),
    ...     (DeviceGroup("d", 2, 2, 1e9, 1.0, link, link),), link, batch=4,
    ...     microbatch_sizes=(1,), schedules=("1f1b",), remats=("none",))
    >>> round(config_bound(problem, 1, "1f1b", 1), 6)  # two 1-device replicas: 2 x 6 s
    12.0
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from shardplan.solver.stages.pipeline import (
    Link,
    PipelineProblem,
    Schedule,
    group_link,
    slowest_link,
)

__all__ = ["Fluid", "PlanBound", "config_bound"]

SAFETY = 1e-9
"""Relative margin taken off every bound: the reasoning is in real arithmetic, the plans'
figures are sums of doubles."""
MOST_SUBSETS = 6
"""Groups up to which the bound is taken per set of groups used (else over all at once)."""

# One option of one layer as the bound sees it: (group, seconds per microbatch, devices,
# total state bytes, update seconds, total bytes of layer memory with one microbatch).
_Option = tuple[int, float, int, float, float]


def _kind_options(problem: PipelineProblem, mb: int, schedule: Schedule, v: int
                  ) -> dict[int, list[_Option]]:
    """Per layer kind, the options the bound sees, each with its fastest fitting remat's time.

    An option counts where some remat holds one microbatch of ``mb`` samples.
    """
    by_kind: dict[int, list[_Option]] = {}
    n = len(problem.layers)
    # Interleaved stages of identical layers hold n / k layers each and at least
    # ((v - 1) k + 1) / v stages' activations (m >= k), so an option fits only at some k.
    stage_counts = ([k for k in range(1, n // v + 1) if n % (k * v) == 0
                     and (not problem.max_stages or k <= problem.max_stages)]
                    if schedule == "interleaved" and v > 1 and len(set(problem.layers)) == 1
                    else [])
    for k in sorted(set(problem.layers)):
        opts: list[_Option] = []
        for g, group in enumerate(problem.groups):
            for o in problem.kinds[k].options.get(g, ()):
                fits = [r for r in problem.remats if o.devices <= group.count
                        and o.state_bytes + 1.0 * mb * o.activation_bytes[r]
                        <= group.memory_bytes
                        and (not stage_counts or any(
                            n / ks * (o.state_bytes + ((v - 1) * ks + 1) / v * mb
                                      * o.activation_bytes[r])
                            <= group.memory_bytes * (1 + SAFETY) for ks in stage_counts))]
                if fits:
                    t = min(o.forward_s[0] + o.forward_s[1] * mb + o.backward_s[0]
                            + o.backward_s[1] * mb + o.recompute_s[r][0]
                            + o.recompute_s[r][1] * mb for r in fits)
                    opts.append((g, t, o.devices, o.state_bytes * o.devices, o.update_s))
        by_kind[k] = opts
    return by_kind


class Fluid:
    """The fluid capacity ``F(tau)`` of one configuration and the bounds built on it.

    Attributes:
      usable: whether the bound applies (every layer has an option holding one microbatch and
        every option takes time).
      total: ``M``.
      most_replicas: the largest replica count memory allows.
      update_floor: the least update any plan has.
      prefix_fill: per ``j``, the least fill layers ``0 .. j - 1`` add to a replica.
    """

    def __init__(self, problem: PipelineProblem, mb: int, schedule: Schedule, v: int) -> None:
        self.problem, self.total, self.v, self.mb = problem, problem.batch // mb, v, mb
        n_groups = len(problem.groups)
        self.counts = np.array([g.count for g in problem.groups], dtype=float)
        by_kind = _kind_options(problem, mb, schedule, v)
        # per distinct kind, its options and how many layers have it
        self.kind_layers = [(by_kind[k], problem.layers.count(k)) for k in sorted(by_kind)]
        # A layer without an option that holds one microbatch fits no stage: no plan of
        # this configuration exists (its floor is infinite).
        self.empty = any(not opts for opts, _ in self.kind_layers)
        self.usable = bool(self.kind_layers) and all(
            opts and all(t > 0 for _, t, _, _, _ in opts) for opts, _ in self.kind_layers)
        self.kinds = [problem.kinds[k] for k in problem.layers]
        self.prefix_fill = []
        if not self.usable:
            self.most_replicas, self.update_floor = 1, 0.0
            return
        # prefix_fill[j]: the least fill of layers 0..j-1 (each on its fastest option)
        fastest = {k: min(t for _, t, _, _, _ in opts) / v for k, opts in by_kind.items()}
        self.prefix_fill = [0.0]
        for k in problem.layers:
            self.prefix_fill.append(self.prefix_fill[-1] + fastest[k] * (1 - SAFETY))
        self._set_lines(n_groups, v)
        groups = range(n_groups)
        self.most_replicas = max(self._most_replicas(tuple(groups)), 1)
        self.update_floor = self._update_floor(tuple(groups))

    def _set_lines(self, n_groups: int, v: int) -> None:
        """The capacity's lines per group (``rho_g``), their breakpoints and the values there."""
        least_work = [min(d * t for _, t, d, _, _ in opts) for opts, _ in self.kind_layers]
        work = sum(lw * count for lw, (_, count) in zip(least_work, self.kind_layers,
                                                        strict=True))
        # per group, the lines (tau q - a) / w = slope * tau - offset
        lines: list[list[tuple[float, float]]] = [[] for _ in range(n_groups)]
        for (opts, _), lw in zip(self.kind_layers, least_work, strict=True):
            q = lw / work
            for g, t, d, _, _ in opts:
                lines[g].append((q / (d * t), t / v / (d * t)))
        lines = [sorted(set(ls)) for ls in lines]
        self.lines = lines
        self._rho_at: dict[float, tuple[float, ...]] = {}
        self.slopes = [np.array([s for s, _ in ls]) for ls in lines]
        self.offsets = [np.array([c for _, c in ls]) for ls in lines]
        points = {0.0}
        for ls in lines:
            for s, c in ls:
                points.add(c / s)
            for (s1, c1), (s2, c2) in itertools.combinations(ls, 2):
                if s1 != s2 and (c1 - c2) / (s1 - s2) > 0:
                    points.add((c1 - c2) / (s1 - s2))
        self.points = np.array(sorted(points))
        self.rho_points = np.stack([self._rho(g, self.points) for g in range(n_groups)])
        self.tail = np.array([s.max() if len(s) else 0.0 for s in self.slopes])

    def _rho(self, g: int, tau: np.ndarray) -> np.ndarray:
        if not len(self.slopes[g]):
            return np.zeros_like(tau)
        vals = self.slopes[g][:, None] * tau[None, :] - self.offsets[g][:, None]
        return np.maximum(vals.max(axis=0), 0.0)

    def rho(self, tau: float) -> tuple[float, ...]:
        """``rho_g(tau)`` per group (``F(tau) = sum_g N_g rho_g(tau)``)."""
        if tau not in self._rho_at:
            if len(self._rho_at) > 64:
                self._rho_at.clear()
            self._rho_at[tau] = tuple(
                max(0.0, max((s * tau - c for s, c in lines), default=0.0))
                for lines in self.lines)
        return self._rho_at[tau]

    def capacity(self, tau: float, counts: Sequence[float] | np.ndarray | None = None
                 ) -> float:
        """``F(tau)`` with ``counts`` devices per group (default: all)."""
        if not self.usable:
            return math.inf
        n = self.counts if counts is None else counts
        return float(sum(c * r for c, r in zip(n, self.rho(tau), strict=True) if c > 0))

    def least_tau(self, need: float, counts: Sequence[float] | np.ndarray | None = None
                  ) -> float:
        """A ``tau`` no larger than any ``tau'`` with ``F(tau') >= need`` (0 when
        ``need <= 0``)."""
        if need <= 0 or not self.usable:
            return 0.0
        n = self.counts if counts is None else np.asarray(counts, dtype=float)
        values = n @ self.rho_points
        j = int(np.searchsorted(values, need))  # the first point reaching need
        if j == 0:
            return 0.0
        if j == len(values):
            slope = float(n @ self.tail)
            if slope <= 0:
                return math.inf
            tau = self.points[-1] + (need - values[-1]) / slope
        else:
            a, b = self.points[j - 1], self.points[j]
            tau = a + (need - values[j - 1]) * (b - a) / (values[j] - values[j - 1])
        return float(tau) * (1 - SAFETY)

    def _most_replicas(self, groups: tuple[int, ...]) -> int:
        state = sum(count * min((s for g, _, _, s, _ in opts if g in groups), default=math.inf)
                    for opts, count in self.kind_layers)
        memory = sum(self.problem.groups[g].count * self.problem.groups[g].memory_bytes
                     for g in groups)
        devices = int(sum(self.counts[g] for g in groups))
        by_memory = int(memory // state) if state > 0 else devices
        return min(self.total, by_memory, devices)

    def _update_floor(self, groups: tuple[int, ...]) -> float:
        return max(min((u for g, _, _, _, u in opts if g in groups), default=math.inf)
                   for opts, _ in self.kind_layers)

    def _sync_link(self, groups: tuple[int, ...]) -> Link:
        """The fastest link a plan on exactly ``groups`` synchronises on."""
        problem = self.problem
        if len(groups) > 1:
            return slowest_link(group_link(problem, a, b)
                                for a, b in itertools.combinations(groups, 2))
        g = problem.groups[groups[0]]
        return Link(max(g.intra_node.bandwidth_bytes_per_s, g.inter_node.bandwidth_bytes_per_s),
                    min(g.intra_node.latency_s, g.inter_node.latency_s))

    def _single_replica(self, groups: tuple[int, ...]) -> float:
        """The least pipeline time of one replica on ``groups`` (its stages' granularity)."""
        n, total = len(self.problem.layers), self.total
        per_group: dict[int, list[tuple[float, int, int]]] = {g: [] for g in groups}
        for g in groups:
            group = self.problem.groups[g]
            by_devices: dict[int, tuple[float, float]] = {}
            for opts, _ in self.kind_layers:
                for gg, t, d, s, _ in opts:
                    if gg == g:
                        tt, ss = by_devices.get(d, (math.inf, math.inf))
                        by_devices[d] = (min(tt, t), min(ss, s / d))
            for d, (t, s) in by_devices.items():
                most = int(group.memory_bytes // s) if s > 0 else n
                per_group[g].append((t, d, max(most, 0)))

        def layers(beta: float) -> float:
            return sum(self.counts[g] * max((min(math.floor(beta / t), most) / d
                                             for t, d, most in per_group[g]), default=0.0)
                       for g in groups)

        lo, hi = 0.0, max(t for opts, _ in self.kind_layers for _, t, _, _, _ in opts) * n
        if layers(hi) < n:
            return math.inf
        for _ in range(60):
            mid = (lo + hi) / 2
            if layers(mid) >= n:
                hi = mid
            else:
                lo = mid
        fill = sum(count * min(t for g, t, _, _, _ in opts if g in groups)
                   for opts, count in self.kind_layers)
        return (fill / self.v + (total - 1) * lo) * (1 - SAFETY)

    def bound(self, using: int | None = None) -> float:
        """The least objective of any plan of this configuration (infinite when some layer
        fits no stage at this microbatch size); with ``using``, of any plan with a stage on
        that group."""
        if self.empty:
            return math.inf
        if not self.usable:
            return 0.0
        n_groups = len(self.problem.groups)
        if n_groups <= MOST_SUBSETS:
            subsets = [s for r in range(1, n_groups + 1)
                       for s in itertools.combinations(range(n_groups), r)
                       if using is None or using in s]
        else:
            subsets = [tuple(range(n_groups))]
        return min(self._bound(s, exact=n_groups <= MOST_SUBSETS) for s in subsets)

    def _bound(self, groups: tuple[int, ...], *, exact: bool) -> float:
        """The least objective of a plan on exactly ``groups`` (``exact``) or on any of them."""
        if any(not any(g in groups for g, _, _, _, _ in opts) for opts, _ in self.kind_layers):
            return math.inf  # some layer has no option there
        counts = np.array([self.counts[g] if g in groups else 0.0
                           for g in range(len(self.counts))])
        most = max(self._most_replicas(groups), 1)
        update = self._update_floor(groups) * (1 - SAFETY)
        if self.problem.objective == "cost":
            work = sum(count * min(self.problem.groups[g].price_per_hour * d * t
                                   for g, t, d, _, _ in opts if g in groups)
                       for opts, count in self.kind_layers)
            return max(0.0, (self.total - most) * work / 3600.0 * (1 - SAFETY))
        if exact:
            link = self._sync_link(groups)
        else:
            links = [li for g in self.problem.groups for li in (g.intra_node, g.inter_node)]
            links += [self.problem.between_groups, *self.problem.group_links.values()]
            link = Link(max(li.bandwidth_bytes_per_s for li in links),
                        min(li.latency_s for li in links))
        gradients = sum(k.gradient_bytes for k in self.kinds)
        devices = float(counts.sum())
        best = max(self.least_tau(self.total - 1, counts),
                   self._single_replica(groups) if exact else 0.0) + update
        for r in range(2, most + 1):
            sigma = r * gradients / devices
            sync = (2 * (r - 1) / r * sigma / link.bandwidth_bytes_per_s
                    + 2 * (r - 1) * link.latency_s) * (1 - SAFETY)
            if sync >= best:
                break  # the synchronisation floor only grows with r
            # every replica runs some microbatch through every layer, and one of them has at
            # most N / r devices: T_r >= A_r >= its fill on stages that small
            tau = max(self.least_tau(self.total - r, counts),
                      self.fill_within(int(devices) // r, groups))
            if tau == math.inf:
                break  # no replica of so few devices holds every layer: nor of fewer
            best = min(best, tau + sync + update)
        return best

    def fill_within(self, devices: int, groups: tuple[int, ...]) -> float:
        """The least fill (every layer once, on its fastest option of at most ``devices``
        devices on ``groups``, divided by ``v``) of a replica of at most ``devices`` devices;
        ``inf`` when some layer has no such option."""
        total = 0.0
        for opts, count in self.kind_layers:
            fastest = min((t for g, t, d, _, _ in opts if d <= devices and g in groups),
                          default=math.inf)
            total += count * fastest
        return total / self.v * (1 - SAFETY)

    def sync_floor(self, replicas: int) -> float:
        """The least synchronisation of a plan with ``replicas`` replicas (on any groups)."""
        if replicas <= 1 or not self.usable:
            return 0.0
        links = [li for g in self.problem.groups for li in (g.intra_node, g.inter_node)]
        links += [self.problem.between_groups, *self.problem.group_links.values()]
        sigma = replicas * sum(k.gradient_bytes for k in self.kinds) / float(self.counts.sum())
        return (2 * (replicas - 1) / replicas * sigma
                / max(li.bandwidth_bytes_per_s for li in links)
                + 2 * (replicas - 1) * min(li.latency_s for li in links)) * (1 - SAFETY)


def config_bound(problem: PipelineProblem, mb: int, schedule: Schedule, v: int) -> float:
    """The least objective of any plan with this microbatch size, schedule and chunk count
    (the module docstring)."""
    return Fluid(problem, mb, schedule, v).bound()


@dataclass(frozen=True)
class PlanBound:
    """What a useful shape must beat: the best plan so far (rules B and F in
    :mod:`shardplan.solver.stages.search`).

    Attributes:
      best: the best objective so far (``inf``: none yet).
      cost: whether the objective is dollars per step (else seconds).
      batch: the global batch.
      min_throughput: the cost objective's floor (0: none).
      total: microbatches ``M``.
      pairs: per pair of groups ``(a, b)``, ``a < b``, the link between them.
      intra: per group, its intra-node link.
      inter: per group, its inter-node link.
      per_node: per group, devices per node.
      prices: per group, price per device-hour.
      safe: per group, whether using fewer of its devices can never make the gradient
        synchronisation slower (its intra-node link is no slower than its inter-node one).
    """

    best: float
    cost: bool
    batch: int
    min_throughput: float
    total: int
    pairs: Mapping[tuple[int, int], Link]
    intra: tuple[Link, ...]
    inter: tuple[Link, ...]
    per_node: tuple[int, ...]
    prices: tuple[float, ...]
    safe: tuple[bool, ...]

    fluid: Fluid | None = field(default=None, compare=False)
    floor_fill: tuple[float, ...] = ()
    _links: dict = field(default_factory=dict, compare=False, repr=False)

    def link(self, usage: Sequence[int]) -> Link:
        """The synchronisation link of a plan using ``usage`` devices per group
        (:func:`~shardplan.solver.stages.pipeline.sync_link`)."""
        used = tuple(g for g, u in enumerate(usage) if u)
        if len(used) > 1:
            if used not in self._links:
                self._links[used] = slowest_link(self.pairs[p]
                                                 for p in itertools.combinations(used, 2))
            return self._links[used]
        g = used[0]
        return self.intra[g] if usage[g] <= self.per_node[g] else self.inter[g]

    def sync_floor(self, replicas: int, sigma: float, usage: Sequence[int]) -> float:
        """The least gradient synchronisation of a plan with at least ``replicas`` replicas,
        largest sigma at least ``sigma`` and at least ``usage`` devices per group: a plan
        spanning groups stays on the link between them, and one past a node stays off the
        intra-node link."""
        if replicas <= 1:
            return 0.0
        used = tuple(g for g, u in enumerate(usage) if u)
        key = (used, len(used) == 1 and usage[used[0]] <= self.per_node[used[0]])
        links = self._links.get(key)
        if links is not None and len(links) == 1:
            link = links[0]
            return (2 * (replicas - 1) / replicas * sigma / link.bandwidth_bytes_per_s
                    + 2 * (replicas - 1) * link.latency_s)
        if links is None:
            if len(used) > 1:  # more groups only slow the link down (slowest_link)
                links = [self.link(usage)]
            elif used:  # one more group at least, or more of this one
                g = used[0]
                links = [self.inter[g], *(link for p, link in self.pairs.items() if g in p)]
                if key[1]:
                    links.append(self.intra[g])
            else:
                links = [*self.pairs.values(), *self.intra, *self.inter]
            self._links[key] = links
        return min(2 * (replicas - 1) / replicas * sigma / link.bandwidth_bytes_per_s
                   + 2 * (replicas - 1) * link.latency_s for link in links)

    def crowded(self, tau: float, runs: int, usage: Sequence[int], replicas: int) -> bool:
        """Rule F for part of a plan: whether ``replicas`` replicas on ``usage`` devices that
        run at most ``runs`` microbatches within ``tau`` leave more microbatches than the other
        devices' fluid capacity (:mod:`shardplan.solver.stages.bound`) and the replicas that may
        still join can take."""
        fluid = self.fluid
        if fluid is None or not fluid.usable:
            return False
        more = max(fluid.most_replicas - replicas, 0)
        rest = sum((n - u) * r for n, u, r in zip(fluid.counts, usage,
                                                  fluid.rho(tau * (1 + 1e-9)), strict=True))
        return runs + rest + more < self.total

    def too_slow(self, step_s: float) -> bool:
        """Whether a step this long misses the throughput floor."""
        return self.min_throughput > 0 and step_s > 0 and self.batch / step_s < self.min_throughput

    def price(self, usage: Sequence[int]) -> float:
        """Dollars per hour of ``usage`` devices per group."""
        return sum(u * p for u, p in zip(usage, self.prices, strict=True))

    def value(self, step_s: float, price_per_hour: float) -> float:
        """The objective of a step this long at this price."""
        return step_s * price_per_hour / 3600.0 if self.cost else step_s

    def hopeless(self, fill_s: float, bottleneck_s: float, cap: int, step: int, sigma: float,
                 update_s: float, usage: Sequence[int], first_layer: int = 0) -> bool:
        """Whether no plan with a replica at least this slow, memory-bound, synchronisation-
        and update-heavy and large (every figure can only grow as stages are added) beats
        :attr:`best`: alone (``R = 1``) it runs all ``M`` microbatches; with others the
        synchronisation of two replicas on the fastest link is the least it adds, and (rule
        F, time objective) the others' fluid capacity must take what this replica cannot run
        by then. ``first_layer``: the layers before it are still to be placed (their fill is
        at least :attr:`floor_fill`)."""
        if first_layer and self.floor_fill:
            fill_s += self.floor_fill[first_layer]
        alone = (fill_s + (self.total - 1) * bottleneck_s
                 if cap >= self.total and self.total % step == 0 else math.inf)
        sync = self.sync_floor(2, sigma, usage)
        shared = fill_s + sync if self.total >= 2 else math.inf
        step_s = min(alone, shared) + update_s
        if step_s == math.inf or self.too_slow(step_s):
            return True
        if self.value(step_s, self.price(usage)) >= self.best:
            return True
        if (self.cost or self.best == math.inf
                or (alone < math.inf and alone + update_s < self.best)):
            return False
        tau = self.best - sync - update_s  # a shared plan's pipeline time is below this
        runs = cap if bottleneck_s <= 0 else min(cap, int((tau - fill_s) / bottleneck_s) + 2)
        return self.crowded(tau, runs, usage, 1)
