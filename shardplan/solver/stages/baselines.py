"""Baseline plan families that the stage planner is measured against (issue 5, item 5).

Each function returns the best :class:`~shardplan.solver.stages.pipeline.PipelinePlan` of one family
by :func:`~shardplan.solver.stages.pipeline.evaluate_pipeline` (the problem's objective: step time, or
cost per step under the throughput floor), or ``None`` when no plan of the family is feasible.
Every plan is also a plan of the stage planner's search space, so
:func:`~shardplan.solver.stages.search.solve_pipeline` is never worse by the closed form when its
search completes (``stats.optimal``); past its time limit it may be. Like the planner, the
families are optimised by the closed form; the benchmark (``benchmarks/plan_quality.py``)
scores all of them with the event simulator too.

The families
------------
* :func:`data_parallel_only` -- what DDP / FSDP / ZeRO users run: no pipelining. Every replica
  is **one stage holding every layer** on a sub-mesh of ``d`` devices of one group. Inside the
  stage the layers run as their :class:`~shardplan.solver.stages.pipeline.LayerOption` on ``d``
  devices says, i.e. the intra-op planner's sharding on that sub-mesh: ``d = 1`` is plain DDP
  (each device holds the whole model), ``d > 1`` is FSDP / ZeRO-3 or hybrid sharding (HSDP)
  inside the sub-mesh, and whatever tensor sharding the intra-op solution picked there.
  Gradient accumulation over ``m`` microbatches, holding one microbatch's activations
  (``1f1b`` with one stage; ``gpipe`` only when the problem offers no ``1f1b``). Every group
  that can hold a replica at all (one microbatch in flight) is used, all of its devices
  (``count // d`` replicas); a group that cannot is left out. The batch is split as evenly as
  the microbatch counts allow (plain data parallelism splits it evenly): each replica runs
  ``M // R`` or ``M // R + 1`` microbatches, the extra ones on the fastest replicas. Chosen
  per group: the sub-mesh size ``d`` and the remat policy; for the plan: the microbatch size.
  This is more freedom than one DDP launch has (one config on every node), so the baseline
  is, if anything, flattered.
* :func:`megatron_grid` -- Megatron-LM's 3-D parallelism, best over a grid: intra-op
  ("tensor") parallelism ``d`` inside a node (a sub-mesh size every used group offers for every
  layer, at most one node of every used group), ``k`` stages holding equally many layers (or
  as evenly as possible, larger stages first; also Megatron's own split: the embedding / head
  layers, when their kinds differ from the blocks', ride on the first / last stage and the
  blocks are split evenly), data parallelism over the rest, every replica identical (one
  ``d``, ``k``, split and remat), the batch split evenly as above, 1F1B or interleaved 1F1B
  (interleaved only with ``k >= 2`` stages, as Megatron allows it; GPipe only where the
  problem offers neither).
  All devices are treated alike, as Megatron does on mixed GPUs: the ``d``-device slots are
  numbered group after group in the cluster's order and ranks are assigned in one of the two
  orders Megatron's ``initialize_model_parallel(order=...)`` gives (pipeline outermost, its
  default ``tp-dp-pp``, or data parallelism outermost, ``tp-pp-dp``); the step waits for the
  slowest replica. ``R = slots // k`` replicas; leftover slots idle.
* :func:`homogeneous_only` -- the planner itself on one group (the fastest type) alone.
* :func:`ideal_gain` -- what using every group could at best give over the fastest alone: the
  effective matmul FLOP/s of all of them over that of the fastest group.

The search
----------
The grids are enumerated with a lower bound on each candidate's objective: the pipeline time
without transfers, ``(sum t) / v + (m - 1) max t`` per replica (exact for one stage), plus the
slowest stage's update, both from prefix sums over the layers (the closed form's transfers and
gradient synchronisation are ``>= 0``). Candidates whose memory (the closed form's in-flight
rule) clearly exceeds a device are dropped; the rest are scored by
:func:`~shardplan.solver.stages.pipeline.evaluate_pipeline`'s closed form in order of their bound until
the bound reaches the best objective found, so the result is the family's exact optimum by the
closed form (ties keep the first candidate in a fixed order: same inputs, same plan). A
candidate's replicas fall into a few runs of equal ones (all single-stage replicas of one group
and sub-mesh size are the same), so the microbatch split, the bound and the score are computed
per run: the score by :class:`~shardplan.solver.stages.runs.RunObjective`, the same figures as
``evaluate_pipeline`` gives the built plan, bit for bit, and only the winner is built.

Example:
    >>> from shardplan.solver.stages.pipeline import (DeviceGroup, LayerKind, LayerOption, Link,
    ...     PipelineProblem)
    >>> link = Link(1e9, 0.0)
    >>> o = LayerOption(1, (0.0, 1.0), (0.0, 2.0), {"none": (0.0, 0.0)}, {"none": 1.0}, 0.0,
    ...                 0.0)
    >>> kind = LayerKind("block", {0: (o,)}, 0.0, 0.0)
    >>> problem = PipelineProblem((kind,), (0, 0), (DeviceGroup("d", 2, 2, 1e9, 1.0, link,
    ...     link),), link, batch=4, microbatch_sizes=(1,), remats=("none",))
    >>> plan = data_parallel_only(problem)
    >>> [(r.stages[0].devices, r.microbatches) for r in plan.replicas]  # 2 replicas x 2 x 6 s
    [(1, 2), (1, 2)]
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from shardplan.errors import InfeasibleError
from shardplan.solver.stages.pipeline import (
    LayerKind,
    PipelinePlan,
    PipelineProblem,
    Remat,
    Replica,
    Schedule,
    StagePlacement,
    check_pipeline,
    in_flight,
    looped_work,
    stage_held,
    stage_work,
)
from shardplan.solver.stages.runs import RunObjective

__all__ = [
    "data_parallel_only",
    "homogeneous_only",
    "ideal_gain",
    "megatron_grid",
]

# (Past 600 lines: the data-parallel and Megatron-style baselines share the per-group layer
# tables, the split over runs of replicas and the pick; each baseline alone is short.)

BOUND_SLACK = 1e-9
"""Relative slack on the lower bounds and the memory pre-check: they are sums in another order
than :func:`evaluate_pipeline`'s, so they may differ from its figures by a few ulps; the
slack keeps a candidate whose true figure ties or fits from being dropped for that."""

MEGATRON_ORDERS = ("pp-outer", "dp-outer")
"""Rank orders of the Megatron grid: pipeline stages outermost (Megatron's default
``tp-dp-pp``: stage ``i`` of every replica on consecutive slots) or replicas outermost
(``tp-pp-dp``: each replica's stages on consecutive slots)."""

MEGATRON_SMALL_K = 16
"""The Megatron grid tries every stage count up to this, and beyond it the divisors of the
layer and block counts and the powers of two (what practitioners pick)."""


# --------------------------------------------------------------------------------------------
# Stage costs from prefix sums


@dataclass(frozen=True)
class _Prefix:
    """Prefix sums over the layers of one (group, devices, remat): ``x[j]`` sums layers
    ``[0, j)``. ``missing[j]`` counts layers without an option."""

    fixed_s: tuple[float, ...]
    per_sample_s: tuple[float, ...]
    state_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    update_s: tuple[float, ...]
    missing: tuple[int, ...]
    recompute_bytes: tuple[float, ...] = ()
    layer_work_bytes: tuple[float, ...] = ()
    """Per layer (not a prefix sum): its ``work_bytes``."""

    def ok(self, a: int, b: int) -> bool:
        return self.missing[b] == self.missing[a]

    def seconds(self, a: int, b: int, mb: int) -> float:
        return (self.fixed_s[b] - self.fixed_s[a]
                + (self.per_sample_s[b] - self.per_sample_s[a]) * mb)

    def state(self, a: int, b: int) -> float:
        return self.state_bytes[b] - self.state_bytes[a]

    def activation(self, a: int, b: int) -> float:
        return self.activation_bytes[b] - self.activation_bytes[a]

    stacks: tuple[tuple[int, int], ...] = ()
    """The problem's scanned stacks (:func:`looped_work`)."""

    def looped(self, a: int, b: int) -> float:
        """:func:`looped_work` of the layers ``[a, b)``."""
        return looped_work(self.stacks, range(a, b), self.layer_work_bytes[a:b])

    def work(self, a: int, b: int) -> float:
        """One backward program's working bytes per sample (:func:`stage_work`)."""
        return stage_work(self.recompute_bytes[b] - self.recompute_bytes[a],
                          max(self.layer_work_bytes[a:b], default=0.0), self.looped(a, b))

    def held(self, a: int, b: int, mb: int, flight: float) -> float:
        """Bytes per device of one stage holding ``flight`` microbatches of ``mb``."""
        return stage_held(self.state(a, b), self.activation(a, b), self.work(a, b), mb, flight)

    def update(self, a: int, b: int) -> float:
        return self.update_s[b] - self.update_s[a]


class _Tables:
    """Prefix sums per (group, devices, remat), built on first use."""

    def __init__(self, problem: PipelineProblem) -> None:
        self.problem = problem
        self._cache: dict[tuple[int, int, str], _Prefix] = {}

    def __call__(self, group: int, devices: int, remat: str) -> _Prefix:
        key = (group, devices, remat)
        if key not in self._cache:
            p = self.problem
            sums = [[0.0] for _ in range(6)]
            missing = [0]
            work = []
            for k in p.layers:
                o = p.kinds[k].option(group, devices)
                if o is None:
                    values = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
                else:
                    values = (o.forward_s[0] + o.backward_s[0] + o.recompute_s[remat][0],
                              o.forward_s[1] + o.backward_s[1] + o.recompute_s[remat][1],
                              o.state_bytes, o.activation_bytes[remat], o.update_s,
                              o.recompute_bytes.get(remat, 0.0))
                for s, x in zip(sums, values, strict=True):
                    s.append(s[-1] + x)
                missing.append(missing[-1] + (o is None))
                work.append(o.work_bytes.get(remat, 0.0) if o is not None else 0.0)
            fixed, per_sample, state, activation, update, recompute = (tuple(s) for s in sums)
            self._cache[key] = _Prefix(fixed, per_sample, state, activation, update,
                                       tuple(missing), recompute, tuple(work), p.stacks)
        return self._cache[key]


def _sizes(problem: PipelineProblem, group: int) -> list[int]:
    """Sub-mesh sizes of ``group`` that every layer kind in use offers, at most its count."""
    used = sorted(set(problem.layers))
    common: set[int] | None = None
    for k in used:
        sizes = {o.devices for o in problem.kinds[k].options.get(group, ())}
        common = sizes if common is None else common & sizes
    count = problem.groups[group].count
    return sorted(d for d in (common or set()) if 1 <= d <= count)


def _microbatch_sizes(problem: PipelineProblem) -> list[int]:
    return sorted({mb for mb in problem.microbatch_sizes if mb > 0 and problem.batch % mb == 0})


def _even_split(total: int, times: Sequence[float], counts: Sequence[int],
                step: int) -> tuple[int, list[int]] | None:
    """``total`` microbatches over the replicas, in units of ``step``, as evenly as possible:
    the units left over go one each to the fastest replicas (ties by index). The replicas come
    in runs of equal ones: run ``j`` is ``counts[j] >= 1`` replicas in a row taking
    ``times[j]`` seconds per microbatch.

    Returns:
      ``(base, extra)``: every replica runs ``base`` microbatches, the first ``extra[j]`` of
      run ``j`` ``base + step``; ``None`` when some replica would get none.
    """
    if total % step:
        return None
    units = total // step
    r = sum(counts)
    if units < r:
        return None
    base, left = divmod(units, r)
    # Replica by replica, the fastest first and ties by index: the runs in order of (time,
    # first index), since a run's replicas are equal and consecutive.
    starts = list(itertools.accumulate(counts, initial=0))
    extra = [0] * len(counts)
    for j in sorted(range(len(counts)), key=lambda j: (times[j], starts[j])):
        extra[j] = min(left, counts[j])
        left -= extra[j]
    return base * step, extra


def _runs(keys: Sequence[Any], counts: Sequence[int], extra: Sequence[int], base: int,
          step: int) -> list[tuple[Any, int, int]]:
    """The (key, replicas, microbatches each) runs of an :func:`_even_split`, in replica
    order, none empty."""
    out = []
    for key, count, more in zip(keys, counts, extra, strict=True):
        if more:
            out.append((key, more, base + step))
        if count > more:
            out.append((key, count - more, base))
    return out


# --------------------------------------------------------------------------------------------
# Candidates, lower bounds and the exact pick


@dataclass(frozen=True)
class _Candidate:
    """A plan of a family: a lower bound on its objective, the objective itself (by
    :func:`evaluate_pipeline`'s closed form, ``math.inf`` where infeasible) and the plan."""

    bound: float
    value: Callable[[], float]
    build: Callable[[], PipelinePlan]


def _price(problem: PipelineProblem, devices_per_group: Sequence[int]) -> float:
    return sum(problem.groups[g].price_per_hour * n for g, n in enumerate(devices_per_group))


def _bound(problem: PipelineProblem, time_s: float, devices_per_group: Sequence[int]) -> float:
    if problem.objective == "time":
        return time_s
    return time_s * _price(problem, devices_per_group) / 3600.0


def _pick(problem: PipelineProblem, candidates: Iterator[_Candidate]) -> PipelinePlan | None:
    """The candidate with the least objective among those :func:`check_pipeline` accepts,
    visiting them in order of their lower bounds (ties: generation order) until the bound
    reaches the best. (A family's grid point may break a structural constraint of the problem:
    a scanned stack cut into unequal runs, or over stages of different groups.)"""
    ordered = sorted(enumerate(candidates), key=lambda ic: (ic[1].bound, ic[0]))
    best_value, best = math.inf, None
    for _, candidate in ordered:
        if candidate.bound * (1 - BOUND_SLACK) >= best_value:
            break
        value = candidate.value()
        if value < best_value:
            plan = candidate.build()
            if not check_pipeline(problem, plan):
                best_value, best = value, plan
    return best


def _fits(held: float, memory_bytes: float) -> bool:
    return held <= memory_bytes * (1 + BOUND_SLACK)


# --------------------------------------------------------------------------------------------
# Data parallel only


def data_parallel_only(problem: PipelineProblem, /, *,
                       groups: Sequence[int] | None = None) -> PipelinePlan | None:
    """The best plan without pipelining: single-stage replicas (the module docstring).

    Args:
      problem: the pipeline problem.
      groups: the groups that may hold replicas (default all); each of them that can hold a
        replica is used with all its devices.

    Returns:
      The best plan of the family, or ``None`` when no group holds a replica.
    """
    return _pick(problem, _dp_candidates(problem, groups))


_Fastest = Callable[[int, int, int, float], tuple[Remat, float] | None]
"""(group, devices, microbatch size, microbatches in flight) -> the fastest remat whose
one-stage replica holds them, with its seconds per microbatch (ties: the problem's order)."""


def _dp_candidates(problem: PipelineProblem,
                   groups: Sequence[int] | None) -> Iterator[_Candidate]:
    """Every candidate of :func:`data_parallel_only`, in a fixed order."""
    n = len(problem.layers)
    if problem.max_stages < 0:
        return  # no stage count is allowed: evaluate_pipeline refuses every plan
    allowed = range(len(problem.groups)) if groups is None else sorted(set(groups))
    schedules: list[Schedule] = ["1f1b"] if "1f1b" in problem.schedules else (
        ["gpipe"] if "gpipe" in problem.schedules else [])
    tables = _Tables(problem)
    objective = RunObjective(problem)
    cache: dict[tuple[int, int, int, float], tuple[Remat, float] | None] = {}

    def fastest(g: int, d: int, mb: int, flight: float) -> tuple[Remat, float] | None:
        key = (g, d, mb, flight)
        if key not in cache:
            # The layers' options do not depend on the remat, so `ok` holds for all or none.
            options = [(tables(g, d, r).seconds(0, n, mb), i, r)
                       for i, r in enumerate(problem.remats)
                       if tables(g, d, r).ok(0, n) and _fits(
                           tables(g, d, r).held(0, n, mb, flight), problem.groups[g].memory_bytes)]
            if options:
                seconds, _, remat = min(options)
                cache[key] = (remat, seconds)
            else:
                cache[key] = None
        return cache[key]

    for mb, schedule in itertools.product(_microbatch_sizes(problem), schedules):
        total = problem.batch // mb
        # Per group, the sub-mesh sizes that hold one replica with one microbatch in flight.
        per_group = [fit for fit in ([(g, d) for d in _sizes(problem, g)
                                      if fastest(g, d, mb, 1.0) is not None] for g in allowed)
                     if fit]
        if not per_group:
            continue
        for combo in itertools.product(*per_group):
            yield from _dp_candidate(problem, tables, objective, fastest, combo, mb, schedule,
                                     total)


def _dp_candidate(problem: PipelineProblem, tables: _Tables, objective: RunObjective,
                  fastest: _Fastest, combo: Sequence[tuple[int, int]], mb: int,
                  schedule: Schedule, total: int) -> Iterator[_Candidate]:
    """The candidate of one sub-mesh size per group (``combo``: (group, devices)), each group's
    remat the fastest that fits its replicas' microbatches."""
    n = len(problem.layers)
    counts = [problem.groups[g].count // d for g, d in combo]
    # The split needs each replica's speed, which needs its remat; the fastest remat that fits
    # one microbatch decides the speed ranking (the in-flight count only grows under GPipe).
    times = []
    for g, d in combo:
        speed = fastest(g, d, mb, 1.0)
        assert speed is not None, "combo holds only sizes that fit"
        times.append(speed[1])
    split = _even_split(total, times, counts, 1)
    if split is None:
        return
    base, extra = split
    # Under GPipe a replica holds all its microbatches: pick, per group, the fastest remat that
    # fits its largest count (1F1B with one stage holds one).
    remats: list[Remat] = []
    for (g, d), more in zip(combo, extra, strict=True):
        chosen = fastest(g, d, mb, in_flight(schedule, 0, 1, base + 1 if more else base))
        if chosen is None:
            return
        remats.append(chosen[0])
    runs = _runs(list(zip(combo, remats, strict=True)), counts, extra, base, 1)
    pipe = max(m * tables(g, d, r).seconds(0, n, mb) for ((g, d), r), _, m in runs)
    update = max(tables(g, d, r).update(0, n) for (g, d), r in zip(combo, remats, strict=True))
    used = [0] * len(problem.groups)
    for (g, d), count in zip(combo, counts, strict=True):
        used[g] += count * d
    layers = tuple(range(n))

    def stages(g: int, d: int, r: Remat) -> tuple[StagePlacement, ...]:
        return (StagePlacement(g, d, layers, r),)

    def value() -> float:
        return objective.objective([(stages(g, d, r), count, m) for ((g, d), r), count, m in runs],
                                   mb, schedule, 1)

    def build() -> PipelinePlan:
        return PipelinePlan(tuple(Replica(stages(g, d, r), m) for ((g, d), r), count, m in runs
                                  for _ in range(count)), mb, schedule, 1)

    yield _Candidate(_bound(problem, pipe + update, used), value, build)


# --------------------------------------------------------------------------------------------
# Megatron-style grid


def _splits(problem: PipelineProblem, k: int) -> list[tuple[tuple[int, int], ...]]:
    """Layer ranges of ``k`` stages: as even as possible over all layers (larger stages first),
    and Megatron's (embedding / head layers of their own kinds ride on the first / last stage,
    the blocks are split evenly)."""
    n = len(problem.layers)
    out = []

    def even(a: int, b: int, parts: int) -> list[int]:
        q, r = divmod(b - a, parts)
        return [q + (1 if i < r else 0) for i in range(parts)]

    for head, tail in ((0, 0), _attachments(problem.layers)):
        if n - head - tail < k:
            continue
        sizes = even(head, n - tail, k)
        sizes[0] += head
        sizes[-1] += tail
        bounds = list(itertools.accumulate(sizes, initial=0))
        split = tuple(itertools.pairwise(bounds))
        if split not in out and all(b > a for a, b in split):
            out.append(split)
    return out


def _attachments(layers: Sequence[int]) -> tuple[int, int]:
    """Leading and trailing layers whose kinds occur once (Megatron's embedding and head)."""
    n = len(layers)
    if n < 3:
        return 0, 0
    once = {k for k in layers if layers.count(k) == 1}
    head = 1 if layers[0] in once else 0
    tail = 1 if layers[-1] in once and n - 1 > head else 0
    return head, tail


def _stage_counts(problem: PipelineProblem, most: int) -> list[int]:
    n = len(problem.layers)
    head, tail = _attachments(problem.layers)
    blocks = n - head - tail
    ks = set(range(1, min(MEGATRON_SMALL_K, most) + 1))
    ks |= {k for k in range(1, most + 1) if n % k == 0 or (blocks and blocks % k == 0)}
    ks |= {2 ** e for e in range(most.bit_length()) if 2 ** e <= most}
    return sorted(k for k in ks if k <= most)


def _tensor_sizes(problem: PipelineProblem, groups: Sequence[int]) -> list[int]:
    common: set[int] | None = None
    for g in groups:
        fit = {d for d in _sizes(problem, g) if d <= problem.groups[g].devices_per_node}
        common = fit if common is None else common & fit
    return sorted(common or set())


def megatron_grid(problem: PipelineProblem, /, *,
                  groups: Sequence[int] | None = None) -> PipelinePlan | None:
    """The best Megatron-style plan over the grid of (tensor size ``d``, stages ``k``, layer
    split, rank order, microbatch size, remat, schedule, chunks) (the module docstring).

    Args:
      problem: the pipeline problem.
      groups: the groups whose devices the grid runs on, in the problem's group order
        (default all; one group gives the single-type variant).

    Returns:
      The best plan of the family, or ``None`` when no grid point is feasible.
    """
    return _pick(problem, _megatron_grid_candidates(problem, groups))


def _megatron_grid_candidates(problem: PipelineProblem,
                              groups: Sequence[int] | None) -> Iterator[_Candidate]:
    """Every candidate of :func:`megatron_grid`, in a fixed order."""
    used = sorted(set(range(len(problem.groups)) if groups is None else groups))
    n = len(problem.layers)
    schedules: list[Schedule] = [s for s in problem.schedules if s in ("1f1b", "interleaved")]
    if not schedules:
        schedules = list(problem.schedules)
    grid = _Grid(problem, _Tables(problem), RunObjective(problem), {}, {})
    for d in _tensor_sizes(problem, used):
        slots = [g for g in used for _ in range(problem.groups[g].count // d)]
        most = min(n, len(slots), problem.max_stages or n)
        for k in _stage_counts(problem, most):
            r_count = len(slots) // k
            for order in MEGATRON_ORDERS:
                if k == 1 and order == "dp-outer":
                    continue  # one stage: both orders place the same replicas
                if order == "pp-outer":
                    layout = [tuple(slots[i * r_count + r] for i in range(k))
                              for r in range(r_count)]
                else:
                    layout = [tuple(slots[r * k + i] for i in range(k)) for r in range(r_count)]
                # Runs of consecutive replicas with equal signatures.
                runs = [(sig, len(list(same))) for sig, same in itertools.groupby(layout)]
                yield from _megatron_candidates(grid, d, k, runs, schedules)


@dataclass(frozen=True)
class _Grid:
    """What the Megatron grid's points share: the problem, its prefix tables, the run
    objective, the per-signature figures (:func:`_signature_figures`) and the per-stage sums
    they are made of, by key."""

    problem: PipelineProblem
    tables: _Tables
    objective: RunObjective
    memo: dict[tuple[Any, ...], _StageFigures | None]
    stage_memo: dict[tuple[Any, ...], tuple[float, float, float, float, float, float] | None]


def _megatron_candidates(grid: _Grid, d: int, k: int, runs: list[tuple[tuple[int, ...], int]],
                         schedules: Sequence[Schedule]) -> Iterator[_Candidate]:
    """The grid points of one (``d``, ``k``, rank order): ``runs`` gives the replicas'
    signatures (their group per stage), as (signature, replicas in a row)."""
    problem = grid.problem
    n = len(problem.layers)
    signatures = sorted({sig for sig, _ in runs})
    used = [0] * len(problem.groups)
    for sig, count in runs:
        for g in sig:
            used[g] += count * d
    linear_splits = _splits(problem, k)
    for mb, remat, schedule in itertools.product(_microbatch_sizes(problem), problem.remats,
                                                 schedules):
        total = problem.batch // mb
        # Megatron interleaves only a real pipeline (k >= 2; older releases asked k > 2).
        chunk_counts = sorted({v for v in problem.chunks if v >= 2}) if (
            schedule == "interleaved") else [1]
        if schedule == "interleaved" and k < 2:
            continue
        for v in chunk_counts:
            if v > 1:
                if n % (k * v):
                    continue
                size = n // (k * v)
                splits = [tuple((i * size, (i + 1) * size) for i in range(k))]  # chunk 0 per stage
            else:
                splits = linear_splits
            for split in splits:
                yield from _megatron_point(grid, d, k, runs, signatures, used, mb, remat,
                                           schedule, v, split, total)


@dataclass(frozen=True)
class _StageFigures:
    """Per stage of one replica signature: seconds per microbatch as ``fixed + per_sample *
    mb``, state and activation bytes; and the slowest stage's update."""

    fixed_s: tuple[float, ...]
    per_sample_s: tuple[float, ...]
    state_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    update_s: float
    work_bytes: tuple[float, ...] = ()


def _megatron_point(grid: _Grid, d: int, k: int, runs: list[tuple[tuple[int, ...], int]],
                    signatures: list[tuple[int, ...]], used: list[int], mb: int, remat: Remat,
                    schedule: Schedule, v: int, split: tuple[tuple[int, int], ...],
                    total: int) -> Iterator[_Candidate]:
    """The grid point's candidate, if its stages have options, split the batch and fit."""
    problem = grid.problem
    n = len(problem.layers)
    size = n // (k * v) if v > 1 else 0
    figures = _point_figures(grid, signatures, d, remat, k, v, size, split)
    if figures is None:
        return
    # Per signature: the stages' seconds per microbatch, their sum and the slowest.
    cost: dict[tuple[int, ...], tuple[float, float]] = {}
    for sig, x in figures.items():
        seconds = [f + p * mb for f, p in zip(x.fixed_s, x.per_sample_s, strict=True)]
        cost[sig] = (sum(seconds), max(seconds))
    step = k if v > 1 else 1
    split_m = _even_split(total, [cost[sig][1] for sig, _ in runs],
                          [count for _, count in runs], step)
    if split_m is None:
        return
    rows = _runs([sig for sig, _ in runs], [count for _, count in runs], split_m[1],
                 split_m[0], step)
    if not _rows_fit(problem, figures, rows, mb, schedule, k, v):
        return
    pipe = max(cost[sig][0] / v + (m - 1) * cost[sig][1] for sig, _, m in rows)
    update = max(figures[sig].update_s for sig in signatures)
    stage_layers = [tuple(j for a, b in _stage_ranges(split, i, k, v, size) for j in range(a, b))
                    for i in range(k)]

    def stages(sig: tuple[int, ...]) -> tuple[StagePlacement, ...]:
        return tuple(StagePlacement(g, d, stage_layers[i], remat) for i, g in enumerate(sig))

    def value() -> float:
        return grid.objective.objective([(stages(sig), count, m) for sig, count, m in rows],
                                        mb, schedule, v)

    def build() -> PipelinePlan:
        return PipelinePlan(tuple(Replica(stages(sig), m) for sig, count, m in rows
                                  for _ in range(count)), mb, schedule, v)

    yield _Candidate(_bound(problem, pipe + update, used), value, build)


def _stage_ranges(split: tuple[tuple[int, int], ...], i: int, k: int, v: int, size: int
                  ) -> list[tuple[int, int]]:
    """Stage ``i``'s layer ranges (its chunks of ``size`` layers when interleaved)."""
    if v == 1:
        return [split[i]]
    return [((i + c * k) * size, (i + c * k + 1) * size) for c in range(v)]


def _point_figures(grid: _Grid, signatures: list[tuple[int, ...]], d: int, remat: Remat,
                   k: int, v: int, size: int, split: tuple[tuple[int, int], ...]
                   ) -> dict[tuple[int, ...], _StageFigures] | None:
    """Per signature, its :class:`_StageFigures` (memoised); ``None`` if a stage has none."""
    # Per signature: stage seconds, feasibility of options (independent of the microbatch size
    # and schedule: computed once per signature, sub-mesh, remat and split).
    figures: dict[tuple[int, ...], _StageFigures] = {}
    for sig in signatures:
        key = (d, remat, v, split, sig)
        if key not in grid.memo:
            grid.memo[key] = _signature_figures(
                grid, sig, d, remat,
                [tuple(_stage_ranges(split, i, k, v, size)) for i in range(k)])
        found = grid.memo[key]
        if found is None:
            return None
        figures[sig] = found
    return figures


def _rows_fit(problem: PipelineProblem, figures: dict[tuple[int, ...], _StageFigures],
              rows: list[tuple[tuple[int, ...], int, int]], mb: int, schedule: Schedule,
              k: int, v: int) -> bool:
    """Whether each signature's stages hold their memory under its largest microbatch count."""
    most: dict[tuple[int, ...], int] = {}
    for sig, _, m in rows:
        most[sig] = max(most.get(sig, 0), m)
    for sig, m in most.items():
        x = figures[sig]
        for i, g in enumerate(sig):
            flight = in_flight(schedule, i, k, m, v)
            held = stage_held(x.state_bytes[i], x.activation_bytes[i], x.work_bytes[i], mb,
                              flight)
            if not _fits(held, problem.groups[g].memory_bytes):
                return False
    return True


def _signature_figures(grid: _Grid, sig: tuple[int, ...], d: int, remat: Remat,
                       stage_ranges: list[tuple[tuple[int, int], ...]]) -> _StageFigures | None:
    """The :class:`_StageFigures` of one replica signature (its group per stage; stage ``i``
    holds the layer ranges ``stage_ranges[i]``), or ``None`` when some stage lacks an option."""
    fixed, per, state, act, work = [], [], [], [], []
    upd = 0.0
    for g, ranges in zip(sig, stage_ranges, strict=True):
        key = (g, d, remat, ranges)
        if key not in grid.stage_memo:
            pre = grid.tables(g, d, remat)
            grid.stage_memo[key] = (
                sum(pre.fixed_s[b] - pre.fixed_s[a] for a, b in ranges),
                sum(pre.per_sample_s[b] - pre.per_sample_s[a] for a, b in ranges),
                sum(pre.state(a, b) for a, b in ranges),
                sum(pre.activation(a, b) for a, b in ranges),
                sum(pre.update(a, b) for a, b in ranges),
                stage_work(sum(pre.recompute_bytes[b] - pre.recompute_bytes[a]
                               for a, b in ranges),
                           max(max(pre.layer_work_bytes[a:b], default=0.0) for a, b in ranges),
                           max(pre.looped(a, b) for a, b in ranges)),
            ) if all(pre.ok(a, b) for a, b in ranges) else None
        sums = grid.stage_memo[key]
        if sums is None:
            return None
        fixed.append(sums[0])
        per.append(sums[1])
        state.append(sums[2])
        act.append(sums[3])
        upd = max(upd, sums[4])
        work.append(sums[5])
    return _StageFigures(tuple(fixed), tuple(per), tuple(state), tuple(act), upd, tuple(work))


# --------------------------------------------------------------------------------------------
# Homogeneous only


def homogeneous_only(problem: PipelineProblem, solve: Callable[[PipelineProblem], PipelinePlan],
                     /, *, group: int) -> PipelinePlan | None:
    """The best plan on ``group``'s devices alone: ``solve`` (the stage planner) on the
    sub-problem holding only that group, mapped back to ``problem``'s group indices.

    Args:
      problem: the pipeline problem.
      solve: the planner, e.g. ``lambda p: solve_pipeline(p).plan``; it may raise
        :class:`~shardplan.errors.InfeasibleError`.
      group: the group (the caller picks the fastest, e.g. by
        :func:`shardplan.planner.multi.effective_matmul_flops_per_s`).

    Returns:
      The plan, or ``None`` when the group alone cannot hold the model.
    """
    sub = _restrict(problem, group)
    try:
        plan = solve(sub)
    except InfeasibleError:
        return None
    return dataclasses.replace(plan, replicas=tuple(
        dataclasses.replace(r, stages=tuple(dataclasses.replace(s, group=group)
                                            for s in r.stages))
        for r in plan.replicas))


def _restrict(problem: PipelineProblem, group: int) -> PipelineProblem:
    """``problem`` with ``group`` as its only group (index 0)."""
    kinds = tuple(LayerKind(k.name, {0: k.options[group]} if group in k.options else {},
                            k.boundary_bytes, k.gradient_bytes) for k in problem.kinds)
    changes: dict[str, Any] = {"kinds": kinds, "groups": (problem.groups[group],)}
    if any(f.name == "group_links" for f in dataclasses.fields(problem)):
        changes["group_links"] = {}  # one group: no pairs
    return dataclasses.replace(problem, **changes)


# --------------------------------------------------------------------------------------------
# Ideal gain


def ideal_gain(flops_per_s: Sequence[float], /) -> float:
    """All groups' effective FLOP/s over the fastest group's alone: the most a plan using every
    group can gain over one using the fastest only (per group figures, e.g.
    :func:`shardplan.planner.multi.effective_matmul_flops_per_s`).

    Example:
        >>> round(ideal_gain([1872e12, 700e12]), 3)  # 8 x A100 + 8 x V100
        1.374
    """
    return sum(flops_per_s) / max(flops_per_s)
