"""Replicas that span two device types: the slower type takes fewer layers.

A replica whose first ``k_a`` stages sit on sub-meshes of one group and its last ``k_b`` on
another's carries the model at a pace both set: with per-layer seconds ``r_a`` and ``r_b`` (a
stage type's mean over the model's layers), the stage times ``n_a r_a / k_a`` and ``n_b r_b /
k_b`` are equal when ``n_a = n (k_a / r_a) / (k_a / r_a + k_b / r_b)``. :func:`two_type_shapes`
builds, for every ordered pair of (group, sub-mesh size) on different groups and stage counts
on a geometric grid, the replicas with ``n_a`` rounded down and up (each part's layers split
as evenly as they go, the shorter stages first), each evaluated exactly by
:func:`~shardplan.solver.stages.shapes.shape_of`, for the pairs of the two parts' remats,
fastest first, until one holds every microbatch its schedule keeps in flight (those before
it that fit with fewer are kept too; a split with a stage that cannot hold one microbatch,
counted as the search counts it, is skipped before it is evaluated).

These are the mixed replicas the exact search (:mod:`shardplan.solver.stages.search`) also
builds, found in a fraction of its time: a search cut by its budget on a large cluster still
gets replicas that put the slower type to work. A replica would cut a scanned stack into
runs of unequal length on unlike stages where the runtime cannot hold its rows
(:func:`~shardplan.solver.stages.pipeline.stack_violations`): such replicas are left out.
"""

from __future__ import annotations

import itertools
import math
from typing import cast

from shardplan.solver.stages.pipeline import (
    PipelineProblem,
    Remat,
    Schedule,
    StagePlacement,
    stack_violations,
)
from shardplan.solver.stages.shapes import UNLIMITED, Budget, Shape, _Types, shape_of

__all__ = ["stage_counts", "two_type_shapes"]


def stage_counts(most: int) -> list[int]:
    """The stage counts tried per part: 1, 2, 3, then about half as many again each time, up
    to ``most`` (always included).

    Example:
        >>> stage_counts(20)
        [1, 2, 3, 4, 6, 9, 13, 19, 20]
    """
    out, k = [], 1
    while k < most:
        out.append(k)
        k = max(k + 1, math.floor(k * 3 / 2))
    return [*out, most] if most >= 1 else []


def _split(layers: range, k: int) -> list[tuple[int, ...]]:
    """``layers`` in ``k`` contiguous runs of ``floor`` or ``ceil`` of ``len / k``, the
    shorter first."""
    q, extra = divmod(len(layers), k)
    out, at = [], layers.start
    for i in range(k):
        size = q + (i >= k - extra)
        out.append(tuple(range(at, at + size)))
        at += size
    return out


def two_type_shapes(problem: PipelineProblem, mb: int, schedule: Schedule, v: int,
                    types: _Types, budget: Budget = UNLIMITED) -> list[Shape]:
    """Replica shapes over two groups (the module docstring), until ``budget`` is spent (one
    unit per shape evaluated); none for interleaved schedules."""
    if schedule == "interleaved" and v > 1:
        return []
    n = len(problem.layers)
    # per (group, devices): its stage types with their mean seconds per layer, fastest remat
    # first (types some layer has no option of are left out)
    kinds: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for ti, (g, d, _) in enumerate(types.types):
        if any(x is None for x in types.per_layer[ti]):
            continue
        rate = sum(x[0] for x in types.per_layer[ti] if x is not None) / n
        kinds.setdefault((g, d), []).append((ti, rate))
    for opts in kinds.values():
        opts.sort(key=lambda x: x[1])
    out: list[Shape] = []
    for (ga, da), (gb, db) in itertools.permutations(sorted(kinds), 2):
        if ga == gb:
            continue
        most_a = min(n - 1, problem.groups[ga].count // da, problem.max_stages or n)
        most_b = min(n - 1, problem.groups[gb].count // db, problem.max_stages or n)
        for ka, kb in itertools.product(stage_counts(most_a), stage_counts(most_b)):
            if (problem.max_stages and ka + kb > problem.max_stages) or ka + kb > n:
                continue
            # the remats of the two parts, fastest first, until one pair holds all the
            # microbatches in flight that its schedule keeps
            for (ta, rate_a), (tb, rate_b) in itertools.product(kinds[ga, da], kinds[gb, db]):
                shape = _pair(problem, mb, schedule, v, types, (ta, ka, rate_a),
                              (tb, kb, rate_b), out, budget)
                if budget.over():
                    return out
                if shape is not None and shape.cap >= problem.batch // mb:
                    break
    return out


def _pair(problem: PipelineProblem, mb: int, schedule: Schedule, v: int, types: _Types,
          a: tuple[int, int, float], b: tuple[int, int, float],
          out: list[Shape], budget: Budget) -> Shape | None:
    """The replicas of ``k_a`` stages of type ``t_a`` then ``k_b`` of ``t_b`` with the layers
    split as the module docstring says (appended to ``out``); the first found, or ``None``
    when none holds its layers."""
    (ta, ka, rate_a), (tb, kb, rate_b) = a, b
    n = len(problem.layers)
    pace_a, pace_b = ka / rate_a, kb / rate_b
    ideal = n * pace_a / (pace_a + pace_b)
    found = None
    for na in sorted({min(max(x, ka), n - kb) for x in (math.floor(ideal), math.ceil(ideal))}):
        front, back = _split(range(na), ka), _split(range(na, n), kb)
        # (a stage that cannot hold one microbatch: skipped before it is evaluated)
        if not (_holds(types, ta, front) and _holds(types, tb, back)):
            continue
        (ga, da, ra), (gb, db, rb) = types.types[ta], types.types[tb]
        stages = ([StagePlacement(ga, da, part, cast(Remat, ra)) for part in front]
                  + [StagePlacement(gb, db, part, cast(Remat, rb)) for part in back])
        if problem.stacks and stack_violations(problem.stacks, stages):
            continue
        budget.spend(1)
        shape = shape_of(problem, mb, schedule, v, stages, types)
        if shape is not None:
            out.append(shape)
            found = found or shape
    return found


def _holds(types: _Types, ti: int, parts: list[tuple[int, ...]]) -> bool:
    """Whether stages of type ``ti`` hold these runs of layers with one microbatch in flight
    (:meth:`~shardplan.solver.stages.shapes._Types.longest`)."""
    longest = types.longest(ti)
    return all(longest[p[0]] >= len(p) for p in parts)
