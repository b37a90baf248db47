"""The stage planner: the best pipeline plan of a :class:`PipelineProblem`.

:func:`solve_pipeline` returns the plan that minimises
:func:`~shardplan.solver.stages.pipeline.evaluate_pipeline`'s step time (``objective="time"``) or
its cost per step subject to the throughput floor (``"cost"``), over every plan
:func:`~shardplan.solver.stages.pipeline.check_pipeline` accepts: replicas that differ in stages,
sub-meshes and groups, uneven microbatch counts, stages of different lengths, one remat per
stage, and every candidate microbatch size, schedule and chunk count. The search is exact: it
drops a candidate only by one of the rules below, each of which keeps an optimal plan. It is
also bounded in work (``PipelineProblem.work_limit``: labels, states and sweep steps, so a
search cut by it gives the same plan on every machine and load) and in wall-clock time
(``time_limit_s``, the safety net): past either it returns the best
plan found so far with ``stats.optimal = False`` and ``stats.lower_bound``, a proven floor
under every plan's objective (rule F).

Algorithm
---------
Per configuration (microbatch size ``mb``, schedule, chunks ``v``; ``M = batch / mb``):

1. **Replica shapes** (:mod:`shardplan.solver.stages.shapes`). A replica without its microbatch count
   is a *shape*; the plan sees its devices per group ``u``, its pipeline time
   ``T(m) = A + (m - 1) B`` (:func:`~shardplan.solver.stages.pipeline.replica_time`: ``A = sum t +
   sum c``, ``B`` the 1F1B period; interleaved ``A = sum t / v + sum c + (1 - 1/v) B``), the most
   microbatches its memory holds ``cap``, the granularity ``step`` (``k`` when interleaved),
   ``sigma``, the largest gradient bytes a device of one of its stages all-reduces
   (:func:`~shardplan.solver.stages.pipeline.sync_s`), and ``U``, its slowest stage's update. A
   dynamic program builds shapes from the last stage backwards (a stage's 1F1B in-flight
   count depends on its distance ``p`` from the end); interleaved shapes, whose stages hold
   fixed chunks, from the first stage forwards. Labels are pruned by rules L, I, B and F; the
   finished shapes by rule S.
2. **Mixing** (:mod:`shardplan.solver.stages.mix`). For a pipeline-time bound ``tau`` a shape runs
   any multiple of its step up to ``c(tau)``, the most with ``T(m) <= tau`` that its memory
   holds. A knapsack over shapes builds, per replica count ``r`` and set of groups used, the
   states ``(u, reachable microbatch totals as a bitmask, max sigma, max U, price)``, pruned
   by rules K, B and F; a state that reaches ``M`` is a plan whose objective at ``tau`` is
   ``tau + sync(r, link(u), sigma) + U`` (times its price under ``cost``). Rule T sweeps ``tau``
   over the breakpoints ``T(m)`` of all shapes.

Every configuration first gets its fluid floor (rule F, :mod:`shardplan.solver.stages.bound`).
Phase 1 builds a quick plan per configuration, least floor first, from *uniform* replicas
(every stage of a replica on one group and sub-mesh size; :mod:`shardplan.solver.stages.quick`, with
:mod:`shardplan.solver.stages.uniform` when all layers are one kind): a first plan to bound the
search, found in about a second for GPT-3 on a thousand GPUs. Phase 2 runs the full search
for every configuration whose floor is below the best plan, the most promising first, each
bounded by the best plan so far (rules B and F), and keeps a plan only if strictly better
(ties keep the earlier one: same inputs, same plan, as long as the search ends within its
time limit; a search cut by the limit stops where the clock says). A configuration cut by the
limit leaves its floor as the lower bound.

Why each rule keeps an optimal plan
-----------------------------------
A plan's objective is non-decreasing in each replica's ``T``, in ``max sigma`` and
``max U`` (``sync`` grows with ``sigma`` and with the replica count ``R``), in the price, and
in the link of the synchronisation where that link gets slower; floating-point ``+``, ``*``,
``/`` by positives and ``max`` are monotone, so "``a <= b`` implies ``a + c <= b + c``" holds
for the doubles compared. A group is *safe* when its intra-node link is no slower than its
inter-node one (bandwidth ``>=``, latency ``<=``): then using fewer of its devices never slows
the synchronisation (the link is chosen by the plan's groups and device total,
:func:`~shardplan.solver.stages.pipeline.sync_link`). A plan on several groups synchronises on the
least bandwidth and the largest latency among the links between its groups
(:func:`~shardplan.solver.stages.pipeline.slowest_link`), so using more groups never makes it
faster. Prices must be ``>= 0`` under ``cost``.

* **S (shape dominance).** Shape ``a`` replaces ``b`` in any plan, with ``b``'s microbatch
  count ``m``, without a worse objective when ``A, B, sigma, U`` are ``<=``, ``cap >=``,
  ``step(a)`` divides ``step(b)`` (so ``m`` stays legal and fits ``a``'s memory), and ``u(a)
  <= u(b)`` with the same groups used and equality on unsafe groups (the devices still fit, the
  link is the same or a safe faster one, the price is no higher). Keeping only undominated
  shapes therefore keeps an optimal plan.
* **L (labels of the backward program).** Two partial shapes (suffixes) with the same first
  layer and the same group and sub-mesh size of their first stage meet every prefix through
  the same hop. If ``a`` has ``sum t + sum c``, ``B``, ``sigma``, ``U`` ``<=``, ``cap >=``,
  devices as in S, windows no longer (a prefix's windows that end in ``a`` average no more
  than some window ending in ``b``: ``_shapes._windows_le``) and (1F1B, interleaving with one
  chunk, or ``max_stages``) no more stages,
  then prefix + ``a`` dominates prefix + ``b`` by S: the prefix's stages sit no farther from
  the end, so their in-flight counts ``min(m, p)`` are no higher, and the stage count is no
  higher. GPipe memory does not depend on ``p``. (``sigma`` and ``U`` are maxima over stages,
  so the prefix adds the same to both.)
* **I (labels of the interleaved program).** For a fixed stage count ``k`` and stage index,
  labels with the same first and previous (group, sub-mesh size) meet every completion through
  the same hops (the last stage's wrap-around hops go to the first stage); the rest is as L.
* **B (bound from the best plan so far).** As stages are added, ``A, B, sigma, U`` and the
  devices only grow and ``cap`` only shrinks. A plan that contains the shape either runs it
  alone (``R = 1``: step ``>= A + (M - 1) B + U``, only if ``cap >= M``) or with others (step
  ``>= A + sync(2, link, sigma) + U``, ``link`` the fastest a plan using these groups and
  devices can have: the slowest link between its groups once two are used; for one group its
  inter-node link, its links to the other groups, and the intra-node link while within a
  node). If neither beats the best objective (at no less than this price), or the step misses
  the throughput floor, no completion can: the label goes. In the knapsack the same bound with
  ``r`` replicas (more may join) prunes states, with ``tau`` the current sweep point. In the
  backward program a stage that is hopeless, does not fit or lacks an option stays so when
  extended by one more layer (every sum grows), so the loop over its first layer stops there.
* **G (GPipe under 1F1B).** GPipe and 1F1B have the same step time in the closed form and
  1F1B holds no more microbatches in flight (``min(m, k - i) <= m``), so every GPipe plan has
  a 1F1B twin, feasible, of equal objective: when both are allowed only 1F1B is searched.
* **F (the fluid floor).** Any plan of a configuration with ``R`` replicas and pipeline time
  ``tau`` has ``M - R <= F(tau)``, the groups' fluid capacity (the proof is in
  :mod:`shardplan.solver.stages.bound`); with the least synchronisation and update of ``R``
  replicas on the groups used, this floors every plan of the configuration, so a
  configuration whose floor is not below the best plan holds no better one. Applied to part of
  a plan (time objective): a suffix label whose replica, when it does not win alone, runs at
  most ``c`` microbatches by ``tau = best - sync - U`` (its fill counted with at least the
  fastest time of every layer still in front of it), and a knapsack state whose replicas run
  at most ``c`` by its ``tau``, cannot complete to a better plan when ``c`` plus the fluid
  capacity of the devices they leave plus the replicas that may still join is below ``M``.
  Every term only worsens as a label grows, so the loop over a stage's first layer still stops
  at the first hopeless length.
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
:func:`~shardplan.solver.stages.pipeline.evaluate_pipeline`'s own expressions (stage sums in layer
order, the same in-flight formula), so feasibility agrees exactly. Objectives are compared on
sums accumulated in another order (stages backwards, ``sigma`` per stage), so two plans equal
to the last bit in one order can differ by an ulp in the other: the returned evaluation is
``evaluate_pipeline``'s, equal to any other optimum's within ``1e-12`` relative. Rule F's
floors are taken ``1e-9`` relative below their real-arithmetic value.

Cost: exponential in the worst case (the number of undominated shapes grows with the layers,
devices and sub-mesh sizes); problems of tens of layers and devices take seconds
(``tests/solver/test_stage_planner.py`` checks the search against a brute force). GPT-3 on hundreds
of GPUs per type is out of the exact search's reach: there the quick plan and the fluid floor
come back at the time limit (``benchmarks/stage_scale.py``).

Example:
    >>> from shardplan.solver.stages.pipeline import (DeviceGroup, LayerKind, LayerOption, Link,
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

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shardplan.errors import ConfigError, InfeasibleError, SolverError, format_error
from shardplan.solver.stages.bound import Fluid, PlanBound
from shardplan.solver.stages.infeasible import (
    InfeasibilityReport,
    PipelineInfeasibleError,
    infeasibility_report,
)
from shardplan.solver.stages.mix import Mix, best_mix
from shardplan.solver.stages.pairs import two_type_shapes
from shardplan.solver.stages.pipeline import (
    PipelineEvaluation,
    PipelinePlan,
    PipelineProblem,
    Replica,
    Schedule,
    evaluate_pipeline,
    group_link,
)
from shardplan.solver.stages.quick import quick_mix
from shardplan.solver.stages.shapes import (
    Budget,
    SearchTimeout,
    Shape,
    _Types,
    _undominated,
    holds_a_replica,
    replica_shapes,
    uniform_shapes,
)
from shardplan.solver.stages.uniform import Family

__all__ = [
    "InfeasibilityReport",
    "PipelineInfeasibleError",
    "PipelineSolution",
    "SolveStats",
    "infeasibility_report",
    "solve_pipeline",
]

# (Just past 600 lines: the phases share one state, _Search, and its helpers; the report of a
# problem with no plan is in infeasible.py.)


PAIRS_SHARE = 0.2
"""Of the budget left after the quick plans, the most the two-group replicas of
:meth:`_Search.typed_phase` take."""
PAIRS_KEPT = 64
"""Two-group replica shapes per configuration the phase mixes (:func:`_most_efficient`)."""
TYPED_SHARE = 0.4
"""Of the budget left after them, the most the exact search on each group alone takes
(:meth:`_Search.typed_phase`); the full phase has the rest."""


@dataclass(frozen=True)
class SolveStats:
    """What the search did.

    Attributes:
      configs: (microbatch size, schedule, chunks) combinations searched.
      labels: partial replica shapes the dynamic programs kept (before later pruning).
      shapes: replica shapes left after dominance, summed over configurations.
      states: knapsack states built while mixing replicas.
      solve_time_s: wall time.
      optimal: whether the plan is proven optimal (the search ended within the time limit).
      lower_bound: no plan's objective is below this (the plan's own objective when
        ``optimal``; else the least floor of the configurations left unsearched, rule F).
      quick_s: wall time of phase 1 (the quick plans of every configuration).
      work: the work units the search spent (:attr:`PipelineProblem.work_limit`).
      seed: the index of the seed plan returned (no search result beat it), or -1.
    """

    configs: int
    labels: int
    shapes: int
    states: int
    solve_time_s: float
    optimal: bool = True
    lower_bound: float = 0.0
    quick_s: float = 0.0
    work: int = 0
    seed: int = -1


@dataclass(frozen=True)
class PipelineSolution:
    """The best plan, its closed-form figures and the search statistics."""

    plan: PipelinePlan
    evaluation: PipelineEvaluation
    stats: SolveStats


def _configs(problem: PipelineProblem) -> list[tuple[int, Schedule, int]]:
    """The (microbatch size, schedule, chunks) to search; GPipe only when 1F1B is not allowed
    (rule G)."""
    out = []
    schedules = [s for s in problem.schedules
                 if not (s == "gpipe" and "1f1b" in problem.schedules)]
    for mb in sorted(set(problem.microbatch_sizes)):
        if mb <= 0 or problem.batch % mb:
            continue
        for schedule in schedules:
            for v in (sorted(set(problem.chunks)) if schedule == "interleaved" else [1]):
                if v >= 1:
                    out.append((mb, schedule, v))
    return out


def solve_pipeline(problem: PipelineProblem, /, *, seeds: Sequence[PipelinePlan] = (),
                   using: int | None = None) -> PipelineSolution:
    """The plan minimising :func:`~shardplan.solver.stages.pipeline.evaluate_pipeline`'s step time
    (``objective="time"``) or cost per step subject to the throughput floor (``"cost"``).

    Exact when the search ends within ``problem.time_limit_s`` (``stats.optimal``); otherwise
    the best plan found, with ``stats.lower_bound`` below every plan's objective.

    Args:
      problem: the layer cost tables, device groups and candidates.
      seeds: plans to start from (say, the baselines' of :mod:`shardplan.solver.stages.baselines`):
        each feasible one bounds the search from the start, and the result is never worse
        than any of them (ties keep the seed). Infeasible seeds are ignored.
      using: a group index: the best plan with a stage on that group (what using it costs,
        :func:`shardplan.planner.alternatives.unused_types`). Every phase keeps only mixes
        that use it (the quick phase: at least one replica on it), and the floors are those
        of plans on sets of groups that hold it. Seeds that do not use it are ignored.

    Returns:
      The plan, its evaluation and search statistics (``stats.seed``: the index of the seed
      returned, or -1).

    Raises:
      PipelineInfeasibleError: no plan is feasible (an :class:`InfeasibleError` carrying an
        :class:`InfeasibilityReport`).
      SolverError: the work or time limit (``PlanConfig.stage_work_limit`` /
        ``stage_time_limit_s``) passed before any plan was found.
      ConfigError: a negative device price under the cost objective.
    """
    start = time.perf_counter()
    budget = Budget(problem.work_limit or math.inf, start + problem.time_limit_s)
    bound_for = _bounds(problem)
    configs = _configs(problem)
    fluids = [Fluid(problem, mb, schedule, v) for mb, schedule, v in configs]
    floors = [fluid.bound(using) for fluid in fluids]
    search = _Search(problem, budget, bound_for, configs, fluids, floors,
                     need=0 if using is None else 1 << using)
    search.offer_seeds(seeds)
    quick = search.quick_phase()
    for i, (mb, schedule, v) in enumerate(configs):
        # with no plan yet, perhaps no replica holds the model: then the configuration has
        # no plan (proven) and the later phases skip it (with a plan, their bounds prune;
        # the check would only take time from them)
        if (search.best is None and floors[i] < math.inf
                and not holds_a_replica(search.stage_types(mb), schedule, v)):
            floors[i] = math.inf
    quick_s = time.perf_counter() - start
    search.typed_phase(quick)
    labels, n_shapes, n_states, open_floors = search.full_phase(quick)
    optimal = not open_floors
    if search.best is None:
        raise _no_plan_error(problem, budget, optimal)
    plan = search.best
    evaluation = evaluate_pipeline(problem, plan)
    if not evaluation.feasible:  # the search and the evaluator disagree: a bug, not the input
        raise SolverError(format_error(
            "The stage planner built a plan its own evaluator rejects.", where="solve_pipeline",
            value=evaluation.violations, remedy="report this with the problem"))
    value = evaluation.step_time_s if problem.objective == "time" else evaluation.cost_per_step
    floor = value if optimal else min(value, *open_floors)
    stats = SolveStats(len(configs), labels, n_shapes, n_states, time.perf_counter() - start,
                       optimal, floor, quick_s, budget.spent, search.seed_index)
    return PipelineSolution(plan, evaluation, stats)


@dataclass
class _Search:
    """One search's state; mutable: the phases improve its best plan.

    The configurations with their fluid bounds and floors, the budget, the tables shared per
    microbatch size, and the best plan so far.
    """

    problem: PipelineProblem
    budget: Budget
    bound_for: Callable[..., PlanBound]
    configs: list[tuple[int, Schedule, int]]
    fluids: list[Fluid]
    floors: list[float]
    best_value: float = math.inf
    best: PipelinePlan | None = None
    seed_index: int = -1
    """The index of the seed ``best`` is, or -1 (found by the search)."""
    types: dict[tuple[int, int], _Types] = field(default_factory=dict)
    """Per (group, microbatch size), the stage types (group -1: every group), built once."""
    alone: dict[int, PipelineProblem] = field(default_factory=dict)
    """Per group, the problem with that group's options only (:func:`_only_group`)."""
    tables: dict[int, dict] = field(default_factory=dict)
    need: int = 0
    """A bitmask of groups every plan must use (``solve_pipeline``'s ``using``)."""

    def only(self, group: int) -> PipelineProblem:
        """The problem with ``group``'s options only, built once."""
        if group not in self.alone:
            self.alone[group] = _only_group(self.problem, group)
        return self.alone[group]

    def stage_types(self, mb: int, group: int = -1) -> _Types:
        """The stage types at ``mb`` (of ``group`` alone; -1: every group), built once."""
        if (group, mb) not in self.types:
            self.types[group, mb] = _Types(self.problem if group < 0 else self.only(group), mb)
        return self.types[group, mb]

    def offer_seeds(self, seeds: Sequence[PipelinePlan]) -> None:
        """Takes the best feasible seed as the best plan (ties: the earlier seed)."""
        problem = self.problem
        for i, seed in enumerate(seeds):
            if self.need and not all(any(s.group == g for r in seed.replicas for s in r.stages)
                                     for g in range(len(problem.groups)) if self.need >> g & 1):
                continue
            ev = evaluate_pipeline(problem, seed)
            value = ev.step_time_s if problem.objective == "time" else ev.cost_per_step
            if ev.feasible and value < self.best_value:
                self.best_value, self.best, self.seed_index = value, seed, i

    def quick_phase(self) -> list[float]:
        """Phase 1: the quick plan of each configuration; per configuration its value."""
        problem, configs, floors, budget = self.problem, self.configs, self.floors, self.budget
        # Uniform replicas only, a quick plan per configuration, the smallest microbatch first
        # (times are linear in its size, so the pipeline bubble grows with it), then the least
        # floor.
        quick = [math.inf] * len(configs)
        for i in sorted(range(len(configs)), key=lambda i: (configs[i][0], floors[i], i)):
            mb, schedule, v = configs[i]
            bounded = self.best is not None or self.need
            if floors[i] >= self.best_value or (bounded and budget.over(0)):
                continue  # (past the budget, only until there is a plan)
            # Until there is a plan the quick phase runs unbounded; its work still counts.
            # (Not for a plan that must use a group: what using it costs is worth its share
            # of the time, no more.)
            fence = budget if bounded else Budget()
            mix = _quick(problem, mb, schedule, v,
                         self.bound_for(mb, self.best_value, self.fluids[i]), self.fluids[i],
                         self.stage_types(mb), self.tables.setdefault(mb, {}), fence,
                         self.need)
            if fence is not budget:
                budget.spend(fence.spent)
            if mix is not None:
                quick[i] = mix.value
                if mix.value < self.best_value:
                    self.best_value, self.best, self.seed_index = (
                        mix.value, _plan(mix, mb, schedule, v), -1)
        return quick

    def typed_phase(self, quick: Sequence[float]) -> None:
        """Phase 1b: per configuration, within ``PAIRS_SHARE`` of the budget left, the
        replicas over two groups of :func:`~shardplan.solver.stages.pairs.two_type_shapes`
        (the slower type taking fewer layers) mixed with the uniform ones; then, within
        ``TYPED_SHARE`` of what is left, with the replicas the exact search finds on each
        group alone, mixed over all groups (uneven data parallelism across types).

        Each group's replica shapes are few next to all those that mix groups in one
        replica, so this finds in a fraction of the time plans the full phase would reach
        last: the best on each type alone, replicas that put a slower type to work beside a
        faster one, and any mix of them."""
        problem, configs, floors = self.problem, self.configs, self.floors
        used = [g for g in range(len(problem.groups))
                if any(g in k.options for k in problem.kinds)]
        if len(used) < 2:
            return  # the full phase's shapes are these
        order = sorted(range(len(configs)), key=lambda i: (quick[i], floors[i], i))
        pairs: dict[int, list[Shape]] = {}

        def two_types(i: int, sub: Budget) -> None:
            # the uniform replicas of each group and the two-group replicas, mixed
            mb, schedule, v = configs[i]
            bound = self.bound_for(mb, self.best_value, self.fluids[i])
            pairs[i] = _undominated(_most_efficient(
                [s for s in two_type_shapes(problem, mb, schedule, v, self.stage_types(mb), sub)
                 if not bound.hopeless(s.fill_s, s.bottleneck_s, s.cap, s.step, s.sigma,
                                       s.update_s, s.usage)]), bound.safe, sub)
            if pairs[i]:
                self._offer(i, pairs[i] + uniform_shapes(problem, mb, schedule, v,
                                                         bound.safe, sub), sub)

        def one_type(i: int, sub: Budget) -> None:
            # each group's exact shapes with them
            mb, schedule, v = configs[i]
            shapes = list(pairs.get(i, ()))
            for g in used:
                # Rule F with the group's own capacity: its shapes that win on it alone
                # (fast), not those that only win beside the other groups' replicas.
                fluid = Fluid(self.only(g), mb, schedule, v)
                shapes += replica_shapes(self.only(g), mb, schedule, v,
                                         self.bound_for(mb, self.best_value, fluid), sub,
                                         self.stage_types(mb, g))[0]
            self._offer(i, shapes, sub)

        self._each_config(order, PAIRS_SHARE, two_types)
        self._each_config(order, TYPED_SHARE, one_type)

    def _each_config(self, order: Sequence[int], share: float,
                     visit: Callable[[int, Budget], None]) -> None:
        """``visit`` each configuration of ``order`` whose floor is below the best plan,
        within ``share`` of the budget left (past it, the rest are skipped)."""
        budget = self.budget
        sub = _share(budget, share)
        try:
            for i in order:
                if self.floors[i] < self.best_value:
                    visit(i, sub)
        except SearchTimeout:
            pass  # the next phase goes on with the budget left
        finally:
            budget.spend(sub.spent - budget.spent)

    def _offer(self, i: int, shapes: list[Shape], budget: Budget) -> None:
        """The best mix of ``shapes`` for configuration ``i`` becomes the best plan if it is
        strictly better."""
        mb, schedule, v = self.configs[i]
        bound = self.bound_for(mb, self.best_value, self.fluids[i])
        mix = best_mix(self.problem, shapes, bound, budget, self.need) if shapes else None
        if mix is not None and mix.value < self.best_value:
            self.best_value, self.best, self.seed_index = (
                mix.value, _plan(mix, mb, schedule, v), -1)

    def full_phase(self, quick: Sequence[float]) -> tuple[int, int, int, list[float]]:
        """Phase 2: every replica shape; the labels, shapes and states, and the open floors.

        The most promising configuration first (rule F skips a configuration whose floor cannot
        beat the best); the open floors are those of the configurations the budget cut.
        """
        problem, configs, floors, budget = self.problem, self.configs, self.floors, self.budget
        labels = n_shapes = n_states = 0
        open_floors = []
        for i in sorted(range(len(configs)), key=lambda i: (quick[i], floors[i], i)):
            mb, schedule, v = configs[i]
            if floors[i] >= self.best_value:
                continue
            try:
                budget.check()
                bound = self.bound_for(mb, self.best_value, self.fluids[i])
                shapes, kept = replica_shapes(problem, mb, schedule, v, bound, budget,
                                              self.stage_types(mb))
                labels, n_shapes = labels + kept, n_shapes + len(shapes)
                mix = best_mix(problem, shapes, bound, budget, self.need) if shapes else None
            except SearchTimeout:
                open_floors.append(floors[i])
                continue
            if mix is not None:
                n_states += mix.states
                if mix.value < self.best_value:
                    self.best_value, self.best, self.seed_index = (
                        mix.value, _plan(mix, mb, schedule, v), -1)
        return labels, n_shapes, n_states, open_floors


def _no_plan_error(problem: PipelineProblem, budget: Budget, optimal: bool
                   ) -> InfeasibleError | SolverError:
    """Why the search returns no plan: none exists (``optimal``), or the budget ran out first."""
    if optimal:
        return PipelineInfeasibleError(infeasibility_report(problem),
                                       tuple(g.name for g in problem.groups))
    # PlanConfig.stage_work_limit / stage_time_limit_s become work_limit / time_limit_s.
    units = (f"{budget.spent:,} of {problem.work_limit:,} work units" if problem.work_limit
             else f"{budget.spent:,} work units, no work limit")
    return SolverError(format_error(
        f"The stage planner found no plan within its budget ({units}, time limit "
        f"{problem.time_limit_s:g} s) and could not prove that none exists.",
        where="PlanConfig.stage_work_limit, PlanConfig.stage_time_limit_s",
        value={"stage_work_limit": problem.work_limit,
               "stage_time_limit_s": problem.time_limit_s},
        remedy="raise PlanConfig.stage_work_limit (0: no limit) or "
               "PlanConfig.stage_time_limit_s, or narrow the search "
               "(PlanConfig.microbatch_sizes, .schedules, .remats, .chunks, .max_stages)"))


def _most_efficient(shapes: list[Shape], keep: int = PAIRS_KEPT) -> list[Shape]:
    """The ``keep`` shapes of fewest device-seconds per microbatch in steady state
    (bottleneck times devices; then the least fill), in that order: the knapsack over all of
    them (thousands on a cluster of a hundred GPUs) would take longer than the phase has."""
    return sorted(shapes, key=lambda s: (s.bottleneck_s * sum(s.usage), s.fill_s))[:keep]


def _share(budget: Budget, share: float) -> Budget:
    """A budget of ``share`` of what ``budget`` has left (work and time), counting on from
    its work spent (what it spends is added back with ``budget.spend``)."""
    left = budget.work - budget.spent
    sub = Budget(budget.spent + share * left if math.isfinite(left) else math.inf,
                 time.perf_counter() + share * max(0.0, budget.deadline - time.perf_counter()))
    sub.spent = budget.spent
    return sub


def _only_group(problem: PipelineProblem, group: int) -> PipelineProblem:
    """``problem`` with the options of ``group`` only (the group indices kept, so its shapes
    are shapes of ``problem``)."""
    kinds = tuple(dataclasses.replace(k, options={group: k.options[group]}
                                      if group in k.options else {})
                  for k in problem.kinds)
    return dataclasses.replace(problem, kinds=kinds)


def _plan(mix: Mix, mb: int, schedule: Schedule, v: int) -> PipelinePlan:
    return PipelinePlan(tuple(Replica(shape.stages, m) for shape, m in mix.replicas), mb,
                        schedule, v if schedule == "interleaved" else 1)


def _quick(problem: PipelineProblem, mb: int, schedule: Schedule, v: int, bound: PlanBound,
           fluid: Fluid, types: _Types, tables: dict, budget: Budget, need: int = 0
           ) -> Mix | None:
    """The quick plan of one configuration (:mod:`shardplan.solver.stages.quick`): uniform replicas
    of a problem of identical layers from :class:`~shardplan.solver.stages.quick.Family`, else
    :func:`~shardplan.solver.stages.shapes.uniform_shapes`."""
    if len(set(problem.layers)) == 1 and not problem.stacks:  # Family cuts stacks anywhere
        family = Family(problem, mb, schedule, v, types, tables)
        return quick_mix(problem, family.shapes, bound, fluid, budget, family.materialize,
                         need)
    shapes = uniform_shapes(problem, mb, schedule, v, bound.safe, budget)
    return quick_mix(problem, shapes, bound, fluid, budget, need=need)


def _bounds(problem: PipelineProblem) -> Callable[..., PlanBound]:
    """A factory of :class:`PlanBound` for a microbatch size, the best objective so far and,
    optionally, the configuration's fluid bound (rule F)."""
    if problem.objective == "cost":
        for g in problem.groups:
            if g.price_per_hour < 0:
                raise ConfigError(format_error(
                    "A device price is negative.",
                    where=f"device group {g.name!r}: price_per_hour_usd",
                    value=g.price_per_hour, remedy="use a price of 0 or more per device-hour"))
    safe = tuple(g.intra_node.bandwidth_bytes_per_s >= g.inter_node.bandwidth_bytes_per_s
                 and g.intra_node.latency_s <= g.inter_node.latency_s for g in problem.groups)
    pairs = {(a, b): group_link(problem, a, b)
             for a, b in itertools.combinations(range(len(problem.groups)), 2)}

    def bound_for(mb: int, best_value: float, fluid: Fluid | None = None) -> PlanBound:
        return PlanBound(
            best_value, problem.objective == "cost", problem.batch,
            problem.min_throughput if problem.objective == "cost" else 0.0,
            problem.batch // mb, pairs,
            tuple(g.intra_node for g in problem.groups),
            tuple(g.inter_node for g in problem.groups),
            tuple(g.devices_per_node for g in problem.groups),
            tuple(g.price_per_hour for g in problem.groups), safe, fluid,
            tuple(fluid.prefix_fill) if fluid is not None else ())

    return bound_for
