"""Why a pipeline problem has no plan, in numbers: the report the stage planner's
:class:`PipelineInfeasibleError` carries (:func:`~shardplan.solver.stages.search.solve_pipeline`
raises it when its search proves that no plan exists).

Per device group, the least bytes per device the most demanding layer needs and the fewest of
the group's devices that hold one replica alone, each stage's memory counted as the search
counts it (:class:`~shardplan.solver.stages.shapes._Types`); and the reason, with a remedy
where the reason has a specific one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from shardplan.errors import InfeasibleError, format_error
from shardplan.solver.stages.pipeline import PipelineProblem
from shardplan.solver.stages.shapes import _Types

__all__ = ["InfeasibilityReport", "PipelineInfeasibleError", "infeasibility_report"]


@dataclass(frozen=True)
class InfeasibilityReport:
    """Why no plan exists, in numbers.

    Attributes:
      memory_floor_bytes: per group, the bytes per device the most demanding layer needs at
        least (alone on a stage of its cheapest sub-mesh and remat, smallest microbatch, one
        microbatch in flight, with the stage's working bytes); ``inf`` when some layer has no
        option there.
      memory_bytes: per group, the usable bytes per device.
      min_devices: per group, the fewest devices of that type alone that hold one replica
        (same floors), or ``None`` when none would.
      devices: per group, the devices there are.
      reason: a sentence.
      remedy: what to change, where the reason has a specific one (else the general list).
    """

    memory_floor_bytes: tuple[float, ...]
    memory_bytes: tuple[float, ...]
    min_devices: tuple[int | None, ...]
    devices: tuple[int, ...]
    reason: str
    remedy: str | None = None

    def message(self, names: tuple[str, ...]) -> str:
        lines = []
        for g, name in enumerate(names):
            need = self.memory_floor_bytes[g]
            fits = self.min_devices[g]
            lines.append(
                f"{name}: needs >= {need:,.0f} bytes per device (has "
                f"{self.memory_bytes[g]:,.0f}); "
                + (f"the model fits on {fits} x {name} alone (there are {self.devices[g]})"
                   if fits is not None else f"no number of {name} alone holds the model"))
        return format_error(
            f"No pipeline plan is feasible: {self.reason}",
            where="per device type: " + "; ".join(lines),
            remedy=self.remedy or "add devices or memory (PlanConfig.memory_budget_bytes), "
                   "allow remat (PlanConfig.remats) or smaller microbatches "
                   "(PlanConfig.microbatch_sizes), more stages (PlanConfig.max_stages), or "
                   "(cost objective) a lower PlanConfig.min_throughput")


class PipelineInfeasibleError(InfeasibleError):
    """No pipeline plan is feasible; :attr:`report` holds the figures."""

    def __init__(self, report: InfeasibilityReport, names: tuple[str, ...]) -> None:
        super().__init__(report.message(names))
        self.report = report


def infeasibility_report(problem: PipelineProblem, /) -> InfeasibilityReport:
    """The memory floors and per-group device minimums of ``problem`` (see
    :class:`InfeasibilityReport`)."""
    sizes = [mb for mb in problem.microbatch_sizes if mb > 0 and problem.batch % mb == 0]
    mb = min(sizes) if sizes else min(problem.microbatch_sizes, default=1)
    floors, minimum = [], []
    # every sub-mesh size, also those larger than a group (how many devices would do)
    types = _Types(dataclasses.replace(problem, groups=tuple(
        dataclasses.replace(grp, count=max([grp.count] + [o.devices for k in problem.kinds
                                                          for o in k.options.get(g, ())]))
        for g, grp in enumerate(problem.groups))), mb)
    for g in range(len(problem.groups)):
        floors.append(_memory_floor(problem, g, mb, types))
        minimum.append(_min_devices(problem, g, mb, types))
    fits = any(m is not None and m <= grp.count for m, grp in zip(minimum, problem.groups,
                                                                   strict=True))
    remedy = None
    n = len(problem.layers)
    cuts = [(k, v) for v in problem.chunks for k in range(1, n // v + 1)
            if n % (k * v) == 0 and not (problem.max_stages and k > problem.max_stages)]
    if not sizes:
        reason = (f"no candidate microbatch size in {problem.microbatch_sizes} "
                  f"(PlanConfig.microbatch_sizes) divides the batch {problem.batch}")
        remedy = (f"give PlanConfig.microbatch_sizes that divide the batch {problem.batch}, "
                  "or leave it empty (the powers of two that divide the batch)")
    elif set(problem.schedules) == {"interleaved"} and not cuts:
        reason, remedy = _interleaving_reason(problem)
    elif not fits:
        reason = "no group holds one replica of the model in memory" + (
            ", nor does a pipeline over several groups (its stages holding the microbatches "
            "their schedule keeps in flight)" if len(problem.groups) > 1 else "")
    elif problem.stacks:
        reason, remedy = _stack_reason(problem)
    else:
        reason = ("one replica fits in memory, but no plan meets every constraint together "
                  "(schedule memory, interleaving divisibility, PlanConfig.max_stages, devices"
                  + (", PlanConfig.min_throughput)" if problem.objective == "cost" else ")"))
    return InfeasibilityReport(tuple(floors), tuple(g.memory_bytes for g in problem.groups),
                               tuple(minimum), tuple(g.count for g in problem.groups), reason,
                               remedy)


def _memory_floor(problem: PipelineProblem, g: int, mb: int, types: _Types) -> float:
    """The least bytes per device of group ``g`` the most demanding layer needs.

    Alone on a stage of its cheapest option and remat, ``mb`` samples, one microbatch in
    flight, counted as every stage's memory is (:func:`~shardplan.solver.stages.pipeline.
    stage_held`: its state, one backward program's working bytes, the saved activations).
    """
    need = 0.0
    for x in range(len(problem.layers)):
        best = math.inf
        for ti, (gg, _, _) in enumerate(types.types):
            if gg == g and (agg := types.sums(ti, (x,))) is not None:
                best = min(best, agg[1] + 1.0 * mb * agg[2])
        need = max(need, best)
    return need


def _interleaving_reason(problem: PipelineProblem) -> tuple[str, str]:
    """Reason and remedy: interleaving, the only schedule allowed, cuts no equal chunks."""
    n = len(problem.layers)
    # Interleaving cuts the layers into stages x chunks equal parts (rule I).
    why = ("every requested chunk count exceeds the layers" if min(problem.chunks) > n
           else f"no (stages x chunks) divides {n}")
    reason = (f"the interleaved schedule (the only one allowed) cuts the model's {n} "
              f"pipeline layers into (stages x chunks) equal parts, and with "
              f"PlanConfig.chunks {list(problem.chunks)}"
              + (f" and PlanConfig.max_stages {problem.max_stages}"
                 if problem.max_stages else "")
              + f" no stage count does: {why}")
    divisors = [v for v in range(2, n + 1) if n % v == 0]
    remedy = ("allow the 1f1b or gpipe schedule (PlanConfig.schedules), or ask for "
              + (f"PlanConfig.chunks that divide {n}: {divisors}" if divisors
                 else "a model with more layers"))
    return reason, remedy


def _stack_reason(problem: PipelineProblem) -> tuple[str, str]:
    """Reason and remedy: a replica fits, but its scanned stack is not cut into equal runs."""
    a, b = max(problem.stacks, key=lambda ab: ab[1] - ab[0])
    rows = b - a
    reason = ("one replica fits in memory, but not with its scanned stack (pipeline "
              f"layers {a}..{b - 1}, {rows} rows of stacked leaves) cut into runs of equal "
              "length on alike stages, as the runtime holds them, together with every "
              "other constraint (schedule memory, interleaving divisibility, "
              "PlanConfig.max_stages, devices"
              + (", PlanConfig.min_throughput)" if problem.objective == "cost" else ")"))
    remedy = ("allow a stage count whose runs divide the stack's rows (runs of "
              f"{[rows // q for q in range(1, rows + 1) if rows % q == 0]} rows; "
              "PlanConfig.max_stages), more memory (PlanConfig.memory_budget_bytes) or "
              "remat (PlanConfig.remats), or write the blocks as a Python loop (each block "
              "its own parameters, cut anywhere)")
    return reason, remedy


def _min_devices(problem: PipelineProblem, g: int, mb: int, types: _Types) -> int | None:
    """The fewest devices of group ``g`` whose stages hold all layers with one microbatch in
    flight (within ``max_stages`` stages when set), each stage's memory counted as the search
    counts it (:meth:`~shardplan.solver.stages.shapes._Types.runs`)."""
    n = len(problem.layers)
    # longest[i]: per sub-mesh size, the most layers a stage from layer i holds (any fewer
    # fit too: memory only grows with layers)
    longest: list[dict[int, int]] = [{} for _ in range(n)]
    for ti, (gg, d, _) in enumerate(types.types):
        if gg != g:
            continue
        for i, most in enumerate(types.longest(ti)):
            if most:
                longest[i][d] = max(longest[i].get(d, 0), most)

    def extend(fewest: list[float], into: list[float]) -> None:
        for i in range(n):
            if fewest[i] < math.inf:
                for d, most in longest[i].items():
                    for j in range(i + 1, i + most + 1):
                        into[j] = min(into[j], fewest[i] + d)

    # fewest[j]: fewest devices covering layers [0, j)
    fewest = [math.inf] * (n + 1)
    fewest[0] = 0
    if not problem.max_stages:  # in layer order: fewest[i] is final once i is reached
        extend(fewest, fewest)
        found = fewest[n]
    else:  # one round per stage count
        found = math.inf
        for _ in range(problem.max_stages):
            step = [math.inf] * (n + 1)
            extend(fewest, step)
            fewest = step
            found = min(found, fewest[n])
    return None if found == math.inf or n == 0 else int(found)
