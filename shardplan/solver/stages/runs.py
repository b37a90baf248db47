"""The closed-form objective of a plan given as runs of equal replicas, without building it.

The baselines (:mod:`shardplan.solver.stages.baselines`) score hundreds of candidate plans, each of
hundreds of replicas that fall into a few runs of equal ones (every data-parallel replica of
one group and sub-mesh size is the same single stage). :class:`RunObjective` gives each the
objective :func:`~shardplan.solver.stages.pipeline.evaluate_pipeline` would, bit for bit: the same
per-replica figures (computed by the function ``evaluate_pipeline`` itself uses), and the
synchronisation, update and price summed over the same values in the same order, so a plan
scored here and the same plan evaluated in full compare equal. Only structurally valid plans
(:func:`~shardplan.solver.stages.pipeline.check_pipeline` finds nothing) may be scored; the
baselines build no others, and ``tests/solver/test_baselines.py`` checks every candidate of random
problems against the full evaluation.

Example:
    >>> from shardplan.solver.stages.pipeline import (DeviceGroup, LayerKind, LayerOption, Link,
    ...     PipelineProblem, StagePlacement)
    >>> link = Link(1e9, 0.0)
    >>> o = LayerOption(1, (0.0, 1.0), (0.0, 2.0), {"none": (0.0, 0.0)}, {"none": 1.0}, 0.0,
    ...                 0.0)
    >>> problem = PipelineProblem((LayerKind("block", {0: (o,)}, 0.0, 0.0),), (0, 0),
    ...     (DeviceGroup("d", 2, 2, 1e9, 1.0, link, link),), link, batch=4,
    ...     microbatch_sizes=(1,), remats=("none",))
    >>> stage = StagePlacement(0, 1, (0, 1))
    >>> RunObjective(problem).objective([((stage,), 2, 2)], 1, "1f1b", 1)  # 2 x 6 s
    12.0
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from shardplan.solver.stages.pipeline import (
    Link,
    PipelineProblem,
    Schedule,
    StagePlacement,
    _replica_figures,
    _ReplicaFigures,
    _StageSums,
    group_link,
    slowest_link,
    stage_sigma,
)

__all__ = ["Run", "RunObjective"]

Run = tuple[tuple[StagePlacement, ...], int, int]
"""Consecutive equal replicas of a plan: (their stages, how many, microbatches each)."""


class RunObjective:
    """:func:`~shardplan.solver.stages.pipeline.evaluate_pipeline`'s objective of structurally valid
    plans given as runs (the module docstring), with the figures that candidates share cached
    across calls.

    Args:
      problem: the pipeline problem.
    """

    def __init__(self, problem: PipelineProblem) -> None:
        self.problem = problem
        self._sums: dict[tuple[StagePlacement, int], _StageSums] = {}
        self._replicas: dict[tuple[tuple[StagePlacement, ...], int, int, str, int],
                             _ReplicaFigures] = {}
        self._sigma: dict[StagePlacement, float] = {}
        self._price: dict[tuple[tuple[tuple[tuple[int, int], ...], int], ...], float] = {}

    def objective(self, runs: Sequence[Run], microbatch_size: int, schedule: Schedule,
                  chunks: int) -> float:
        """The step time (``objective="time"``) or the cost per step of the plan whose
        replicas are ``runs`` in order (none empty), ``math.inf`` where infeasible.

        Args:
          runs: the plan's replicas as runs.
          microbatch_size: the plan's microbatch size.
          schedule: the plan's schedule.
          chunks: ``v`` under interleaving, else 1.
        """
        p, mb = self.problem, microbatch_size
        times = []
        update = 0.0
        for stages, _, m in runs:
            key = (stages, m, mb, schedule, chunks)
            figures = self._replicas.get(key)
            if figures is None:
                figures = _replica_figures(p, stages, m, mb, schedule, chunks, self._sums)
                self._replicas[key] = figures
            if figures.over:
                return math.inf
            times.append(figures.time_s)
            # the update is a max over stages: over runs it is the same as over replicas
            update = max(update, figures.update_s)
        step = max(times) + self._sync_s(runs) + update
        if p.objective == "time":
            return step
        throughput = p.batch / step if step > 0 else math.inf
        if throughput < p.min_throughput:
            return math.inf
        return step * self._price_per_hour(runs) / 3600.0

    def _sync_s(self, runs: Sequence[Run]) -> float:
        """:func:`~shardplan.solver.stages.pipeline.sync_s` of the plan."""
        r = sum(count for _, count, _ in runs)
        if r == 1:
            return 0.0
        sigma = max(self._stage_sigma(s) for stages, _, _ in runs for s in stages)
        link = self._sync_link(runs)
        return 2 * (r - 1) / r * sigma / link.bandwidth_bytes_per_s + 2 * (r - 1) * link.latency_s

    def _stage_sigma(self, stage: StagePlacement) -> float:
        if stage not in self._sigma:
            self._sigma[stage] = stage_sigma(self.problem, stage)
        return self._sigma[stage]

    def _sync_link(self, runs: Sequence[Run]) -> Link:
        """:func:`~shardplan.solver.stages.pipeline.sync_link` of the plan."""
        holders = [(s, count) for stages, count, _ in runs for s in stages if s.layers]
        groups = sorted({s.group for s, _ in holders})
        if len(groups) > 1:
            return slowest_link(group_link(self.problem, a, b)
                                for a, b in itertools.combinations(groups, 2))
        g = self.problem.groups[holders[0][0].group]
        total = sum(s.devices * count for s, count in holders)
        return g.intra_node if total <= g.devices_per_node else g.inter_node

    def _price_per_hour(self, runs: Sequence[Run]) -> float:
        """The plan's price per hour, summed replica by replica and stage by stage as
        :func:`~shardplan.solver.stages.pipeline.evaluate_pipeline` sums it (float sums depend on
        the order)."""
        key = tuple((tuple((s.group, s.devices) for s in stages), count)
                    for stages, count, _ in runs)
        if key not in self._price:
            groups = self.problem.groups
            self._price[key] = sum(groups[g].price_per_hour * d for places, count in key
                                   for _ in range(count) for g, d in places)
        return self._price[key]
