"""The stage planner: the exact best pipeline plan of a :class:`PipelineProblem`.

:func:`solve_pipeline` returns the plan that minimises
:func:`~shardplan.solver.pipeline.evaluate_pipeline`'s step time (``objective="time"``) or
its cost per step subject to the throughput floor (``"cost"``), over every plan
:func:`~shardplan.solver.pipeline.check_pipeline` accepts: replicas that differ in stages,
sub-meshes and groups, uneven microbatch counts, stages of different lengths, one remat per
stage, and every candidate microbatch size, schedule and chunk count. The search is exact: it
drops a candidate only by one of the rules below, each of which keeps an optimal plan.

Algorithm
---------
Per configuration (microbatch size ``mb``, schedule, chunks ``v``; ``M = batch / mb``):

1. **Replica shapes** (:mod:`shardplan.solver._shapes`). A replica without its microbatch count
   is a *shape*; the plan sees its devices per group ``u``, its pipeline time
   ``T(m) = A + (m - 1) B`` (``A = (sum t + sum c) / v``, ``B = max(max t, max c)``), the most
   microbatches its memory holds ``cap``, the granularity ``step`` (``k`` when interleaved),
   ``sigma = sum_layers gradient_bytes / devices`` and ``U``, its slowest stage's update. A
   dynamic program builds shapes from the last stage backwards (a stage's 1F1B in-flight
   count depends on its distance ``p`` from the end); interleaved shapes, whose stages hold
   fixed chunks, from the first stage forwards. Labels are pruned by rules L, I and B; the
   finished shapes by rule S.
2. **Mixing** (:mod:`shardplan.solver._mix`). For a pipeline-time bound ``tau`` a shape runs
   any multiple of its step up to ``c(tau)``, the most with ``T(m) <= tau`` that its memory
   holds. A knapsack over shapes builds, per replica count ``r`` and set of groups used, the
   states ``(u, reachable microbatch totals as a bitmask, max sigma, max U, price)``, pruned
   by rules K and B; a state that reaches ``M`` is a plan whose objective at ``tau`` is
   ``tau + sync(r, link(u), sigma) + U`` (times its price under ``cost``). Rule T sweeps ``tau``
   over the breakpoints ``T(m)`` of all shapes.

Phase 1 does this with *uniform* shapes only (one stage type, even layers) for every
configuration: a quick first plan. Phase 2 runs the full search for every configuration, the
most promising first, each bounded by the best plan so far (rule B), and keeps a plan only if
strictly better (ties keep the earlier one: same inputs, same plan).

Why each rule keeps an optimal plan
-----------------------------------
A plan's objective is non-decreasing in each replica's ``T``, in ``max sigma`` and
``max U`` (``sync`` grows with ``sigma`` and with the replica count ``R``), in the price, and
in the link of the synchronisation where that link gets slower; floating-point ``+``, ``*``,
``/`` by positives and ``max`` are monotone, so "``a <= b`` implies ``a + c <= b + c``" holds
for the doubles compared. A group is *safe* when its intra-node link is no slower than its
inter-node one (bandwidth ``>=``, latency ``<=``): then using fewer of its devices never slows
the synchronisation (the link is chosen by the plan's groups and device total,
:func:`~shardplan.solver.pipeline.sync_link`). Prices must be ``>= 0`` under ``cost``.

* **S (shape dominance).** Shape ``a`` replaces ``b`` in any plan, with ``b``'s microbatch
  count ``m``, without a worse objective when ``A, B, sigma, U`` are ``<=``, ``cap >=``,
  ``step(a)`` divides ``step(b)`` (so ``m`` stays legal and fits ``a``'s memory), and ``u(a)
  <= u(b)`` with the same groups used and equality on unsafe groups (the devices still fit, the
  link is the same or a safe faster one, the price is no higher). Keeping only undominated
  shapes therefore keeps an optimal plan.
* **L (labels of the backward program).** Two partial shapes (suffixes) with the same first
  layer and the same group and sub-mesh size of their first stage meet every prefix through
  the same hop. If ``a`` has ``sum t + sum c``, ``B``, ``sigma``, ``U`` ``<=``, ``cap >=``,
  devices as in S and (1F1B, interleaving with one chunk, or ``max_stages``) no more stages,
  then prefix + ``a`` dominates prefix + ``b`` by S: the prefix's stages sit no farther from
  the end, so their in-flight counts ``min(m, p)`` are no higher, and the stage count is no
  higher. GPipe memory does not depend on ``p``.
* **I (labels of the interleaved program).** For a fixed stage count ``k`` and stage index,
  labels with the same first and previous (group, sub-mesh size) meet every completion through
  the same hops (the last stage's wrap-around hops go to the first stage); the rest is as L.
* **B (bound from the best plan so far).** As stages are added, ``A, B, sigma, U`` and the
  devices only grow and ``cap`` only shrinks. A plan that contains the shape either runs it
  alone (``R = 1``: step ``>= A + (M - 1) B + U``, only if ``cap >= M``) or with others (step
  ``>= A + sync(2, link, sigma) + U``, ``link`` the fastest a plan using these groups and
  devices can have: ``between_groups`` once two groups are used, not intra-node once past a
  node). If neither beats the best objective (at no less than this price), or the step misses
  the throughput floor, no completion can: the label goes. In the knapsack the same bound with
  ``r`` replicas (more may join) prunes states, with ``tau`` the current sweep point. In the
  backward program a stage that is hopeless, does not fit or lacks an option stays so when
  extended by one more layer (every sum grows), so the loop over its first layer stops there.
* **K (knapsack states).** States with the same replica count and groups used: one with
  ``u`` as in S, reachable totals ``a superset``, ``sigma``, ``U`` and price ``<=`` meets every
  completion at least as well.
* **T (the sweep over tau).** A plan's pipeline time is some breakpoint ``T(m)``, and at every
  ``tau`` at or above it the knapsack holds a state no worse (K), whose objective at ``tau``
  bounds that of a real plan (its replicas' times are ``<= tau``). Starting from the lowest
  breakpoint ``tau_lo``: once the objective of ``tau_lo`` plus the least possible update (at
  the least price) cannot beat the best, no later breakpoint can. Otherwise bisection finds
  the first breakpoint with a *fresh* final state: one that could beat the best at ``tau_lo``
  and is not matched in (``sync + U``, price) by a final state of the previous visited
  breakpoint (such a state costs at least as much later as its match did there). Every final
  state met on the way is a plan, so the best only improves, which keeps "nothing fresh
  below" true. Breakpoints whose objective floor cannot beat the best are never visited.

Floating point: memory and the throughput floor are checked with
:func:`~shardplan.solver.pipeline.evaluate_pipeline`'s own expressions (stage sums in layer
order, the same in-flight formula), so feasibility agrees exactly. Objectives are compared on
sums accumulated in another order (stages backwards, ``sigma`` per stage), so two plans equal
to the last bit in one order can differ by an ulp in the other: the returned evaluation is
``evaluate_pipeline``'s, equal to any other optimum's within ``1e-12`` relative.

Cost: exponential in the worst case (the number of undominated shapes grows with the layers,
devices and sub-mesh sizes); the bounds make problems of tens of layers and devices take
seconds (``tests/test_stage_planner.py`` checks the search against a brute force).

Example:
    >>> from shardplan.solver.pipeline import (DeviceGroup, LayerKind, LayerOption, Link,
    ...     PipelineProblem)
    >>> link = Link(1e9, 0.0)
    >>> o = LayerOption(1, (0.0, 1.0), (0.0, 2.0), {"none": (0.0, 0.0)}, {"none": 1.0}, 0.0,
    ...                 0.0)
    >>> kind = LayerKind("block", {0: (o,)}, 0.0, 0.0)
    >>> problem = PipelineProblem((kind,), (0, 0), (DeviceGroup("d", 2, 2, 1e9, 1.0, link,
    ...     link),), link, batch=4, microbatch_sizes=(1,), schedules=("1f1b",),
    ...     remats=("none",))
    >>> solution = solve_pipeline(problem)
    >>> solution.evaluation.step_time_s  # two 1-device replicas, 2 microbatches of 6 s each
    12.0
    >>> [r.microbatches for r in solution.plan.replicas]
    [2, 2]
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from shardplan.errors import ConfigError, InfeasibleError, SolverError, format_error
from shardplan.solver._mix import Mix, best_mix
from shardplan.solver._shapes import PlanBound, replica_shapes, uniform_shapes
from shardplan.solver.pipeline import (
    PipelineEvaluation,
    PipelinePlan,
    PipelineProblem,
    Replica,
    Schedule,
    evaluate_pipeline,
)

__all__ = [
    "InfeasibilityReport",
    "PipelineInfeasibleError",
    "PipelineSolution",
    "SolveStats",
    "infeasibility_report",
    "solve_pipeline",
]


@dataclass(frozen=True)
class SolveStats:
    """What the search did.

    Attributes:
      configs: (microbatch size, schedule, chunks) combinations searched.
      labels: partial replica shapes the dynamic programs kept (before later pruning).
      shapes: replica shapes left after dominance, summed over configurations.
      states: knapsack states built while mixing replicas.
      solve_time_s: wall time.
    """

    configs: int
    labels: int
    shapes: int
    states: int
    solve_time_s: float


@dataclass(frozen=True)
class PipelineSolution:
    """The best plan, its closed-form figures and the search statistics."""

    plan: PipelinePlan
    evaluation: PipelineEvaluation
    stats: SolveStats


@dataclass(frozen=True)
class InfeasibilityReport:
    """Why no plan exists, in numbers.

    Attributes:
      memory_floor_bytes: per group, the bytes per device the most demanding layer needs at
        least (alone on the group's largest sub-mesh, cheapest remat, smallest microbatch,
        one microbatch in flight); ``inf`` when some layer has no option there.
      memory_bytes: per group, the usable bytes per device.
      min_devices: per group, the fewest devices of that type alone that hold one replica
        (same floors), or ``None`` when none would.
      devices: per group, the devices there are.
      reason: a sentence.
    """

    memory_floor_bytes: tuple[float, ...]
    memory_bytes: tuple[float, ...]
    min_devices: tuple[int | None, ...]
    devices: tuple[int, ...]
    reason: str

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
            where="PipelineProblem: " + "; ".join(lines),
            remedy="add devices or memory, allow remat or smaller microbatches, more stages, "
                   "or (cost objective) a lower min_throughput")


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
    for g in range(len(problem.groups)):
        need = 0.0
        for k in problem.layers:
            best = math.inf
            for o in problem.kinds[k].options.get(g, ()):
                for r in problem.remats:
                    best = min(best, o.state_bytes + 1.0 * mb * o.activation_bytes[r])
            need = max(need, best)
        floors.append(need)
        minimum.append(_min_devices(problem, g, mb))
    fits = any(m is not None and m <= grp.count for m, grp in zip(minimum, problem.groups,
                                                                   strict=True))
    if not sizes:
        reason = (f"no candidate microbatch size in {problem.microbatch_sizes} divides the "
                  f"batch {problem.batch}")
    elif not fits:
        reason = "no group holds one replica of the model in memory"
    else:
        reason = ("one replica fits in memory, but no plan meets every constraint together "
                  "(schedule memory, interleaving divisibility, max_stages, devices"
                  + (", min_throughput)" if problem.objective == "cost" else ")"))
    return InfeasibilityReport(tuple(floors), tuple(g.memory_bytes for g in problem.groups),
                               tuple(minimum), tuple(g.count for g in problem.groups), reason)


def _min_devices(problem: PipelineProblem, g: int, mb: int) -> int | None:
    """The fewest devices of group ``g`` whose stages hold all layers with one microbatch in
    flight (within ``max_stages`` stages when set)."""
    n, group = len(problem.layers), problem.groups[g]
    sizes = sorted({o.devices for k in problem.kinds for o in k.options.get(g, ())})
    # reach[i]: (devices, first layer after) of every stage that starts at layer i and fits
    reach: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for i in range(n):
        for d in sizes:
            for r in problem.remats:
                state = act = 0.0
                for j in range(i, n):
                    o = problem.kinds[problem.layers[j]].option(g, d)
                    if o is None:
                        break
                    state += o.state_bytes
                    act += o.activation_bytes[r]
                    if state + 1.0 * mb * act > group.memory_bytes:
                        break
                    reach[i].append((d, j + 1))
    # fewest[j]: fewest devices covering layers [0, j), one list entry per stage count
    fewest = [math.inf] * (n + 1)
    fewest[0] = 0
    found = math.inf
    for _ in range(problem.max_stages or n):
        step = [math.inf] * (n + 1)
        for i in range(n):
            if fewest[i] < math.inf:
                for d, j in reach[i]:
                    step[j] = min(step[j], fewest[i] + d)
        fewest = step
        found = min(found, fewest[n])
    return None if found == math.inf or n == 0 else int(found)


def _configs(problem: PipelineProblem) -> list[tuple[int, Schedule, int]]:
    out = []
    for mb in sorted(set(problem.microbatch_sizes)):
        if mb <= 0 or problem.batch % mb:
            continue
        for schedule in problem.schedules:
            for v in (sorted(set(problem.chunks)) if schedule == "interleaved" else [1]):
                if v >= 1:
                    out.append((mb, schedule, v))
    return out


def solve_pipeline(problem: PipelineProblem, /) -> PipelineSolution:
    """The plan minimising :func:`~shardplan.solver.pipeline.evaluate_pipeline`'s step time
    (``objective="time"``) or cost per step subject to the throughput floor (``"cost"``).

    Args:
      problem: the layer cost tables, device groups and candidates.

    Returns:
      The plan, its evaluation and search statistics.

    Raises:
      PipelineInfeasibleError: no plan is feasible (an :class:`InfeasibleError` carrying an
        :class:`InfeasibilityReport`).
      ConfigError: a negative device price under the cost objective.
    """
    start = time.perf_counter()
    bound_for = _bounds(problem)
    configs = _configs(problem)
    best_value = math.inf
    best: tuple[Mix, int, Schedule, int] | None = None
    labels = n_shapes = n_states = 0
    # Phase 1: uniform replicas only, a quick plan for every configuration.
    quick = []
    for mb, schedule, v in configs:
        bound = bound_for(mb, best_value)
        shapes = uniform_shapes(problem, mb, schedule, v, bound.safe)
        mix = best_mix(problem, shapes, bound) if shapes else None
        quick.append(mix.value if mix is not None else math.inf)
        if mix is not None:
            n_states += mix.states
            if mix.value < best_value:
                best_value, best = mix.value, (mix, mb, schedule, v)
    # Phase 2: every replica shape, the most promising configuration first.
    for i in sorted(range(len(configs)), key=lambda i: (quick[i], i)):
        mb, schedule, v = configs[i]
        bound = bound_for(mb, best_value)
        shapes, kept = replica_shapes(problem, mb, schedule, v, bound)
        labels, n_shapes = labels + kept, n_shapes + len(shapes)
        mix = best_mix(problem, shapes, bound) if shapes else None
        if mix is not None:
            n_states += mix.states
            if mix.value < best_value:
                best_value, best = mix.value, (mix, mb, schedule, v)
    if best is None:
        raise PipelineInfeasibleError(infeasibility_report(problem),
                                      tuple(g.name for g in problem.groups))
    mix, mb, schedule, v = best
    plan = PipelinePlan(tuple(Replica(shape.stages, m) for shape, m in mix.replicas), mb,
                        schedule, v if schedule == "interleaved" else 1)
    evaluation = evaluate_pipeline(problem, plan)
    if not evaluation.feasible:  # the search and the evaluator disagree: a bug, not the input
        raise SolverError(format_error(
            "The stage planner built a plan its own evaluator rejects.", where="solve_pipeline",
            value=evaluation.violations, remedy="report this with the problem"))
    stats = SolveStats(len(configs), labels, n_shapes, n_states, time.perf_counter() - start)
    return PipelineSolution(plan, evaluation, stats)


def _bounds(problem: PipelineProblem) -> Callable[[int, float], PlanBound]:
    """A factory of :class:`PlanBound` for a microbatch size and the best objective so far."""
    if problem.objective == "cost":
        for g in problem.groups:
            if g.price_per_hour < 0:
                raise ConfigError(format_error(
                    "A device price is negative.", where=f"groups[{g.name!r}].price_per_hour",
                    value=g.price_per_hour, remedy="use a price of 0 or more per device-hour"))
    safe = tuple(g.intra_node.bandwidth_bytes_per_s >= g.inter_node.bandwidth_bytes_per_s
                 and g.intra_node.latency_s <= g.inter_node.latency_s for g in problem.groups)

    def bound_for(mb: int, best_value: float) -> PlanBound:
        return PlanBound(
            best_value, problem.objective == "cost", problem.batch,
            problem.min_throughput if problem.objective == "cost" else 0.0,
            problem.batch // mb, len(problem.layers), problem.between_groups,
            tuple(g.intra_node for g in problem.groups),
            tuple(g.inter_node for g in problem.groups),
            tuple(g.devices_per_node for g in problem.groups),
            tuple(g.price_per_hour for g in problem.groups), safe)

    return bound_for
