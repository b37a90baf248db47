"""Replicas that span two device types: the slower type takes fewer layers.

A replica whose first ``k_a`` stages sit on sub-meshes of one group and its last ``k_b`` on
another's carries the model at a pace both set: with per-layer seconds ``r_a`` and ``r_b`` (a
stage type's mean over the model's layers), the stage times ``n_a r_a / k_a`` and ``n_b r_b /
k_b`` are equal when ``n_a = n (k_a / r_a) / (k_a / r_a + k_b / r_b)``. :func:`two_type_shapes`
builds, for every ordered pair of stage types on different groups and stage counts on a
geometric grid, the replicas with ``n_a`` rounded down and up (each part's layers split as
evenly as they go, the shorter stages first), each evaluated exactly by
:func:`~shardplan.solver.stages.shapes.shape_of`. The remat is one for both parts, or the
first part's with none on the second (the front of a 1F1B pipeline holds the most
microbatches in flight).

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
    """The stage counts tried per part: 1, 2, 3, then about a third more each time, up to
    ``most`` (always included).

    Example:
        >>> stage_counts(20)
        [1, 2, 3, 4, 5, 6, 8, 10, 13, 17, 20]
    """
    out, k = [], 1
    while k < most:
        out.append(k)
        k = max(k + 1, math.floor(k * 4 / 3))
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
    rate: dict[int, float] = {}  # stage type -> mean seconds per layer
    for ti in range(len(types.types)):
        row = types.per_layer[ti]
        if all(x is not None for x in row):
            rate[ti] = sum(x[0] for x in row if x is not None) / n
    out: list[Shape] = []
    for ta, tb in itertools.permutations(sorted(rate), 2):
        (ga, da, ra), (gb, db, rb) = types.types[ta], types.types[tb]
        if ga == gb or not (ra == rb or rb == "none"):
            continue
        most_a = min(n - 1, problem.groups[ga].count // da, problem.max_stages or n)
        most_b = min(n - 1, problem.groups[gb].count // db, problem.max_stages or n)
        for ka, kb in itertools.product(stage_counts(most_a), stage_counts(most_b)):
            if (problem.max_stages and ka + kb > problem.max_stages) or ka + kb > n:
                continue
            pace_a, pace_b = ka / rate[ta], kb / rate[tb]
            ideal = n * pace_a / (pace_a + pace_b)
            for na in sorted({math.floor(ideal), math.ceil(ideal)}):
                na = min(max(na, ka), n - kb)
                if budget.over():
                    return out
                stages = ([StagePlacement(ga, da, part, cast(Remat, ra))
                           for part in _split(range(na), ka)]
                          + [StagePlacement(gb, db, part, cast(Remat, rb))
                             for part in _split(range(na, n), kb)])
                if problem.stacks and stack_violations(problem.stacks, stages):
                    continue
                shape = shape_of(problem, mb, schedule, v, stages, types)
                if shape is not None:
                    out.append(shape)
    return out
