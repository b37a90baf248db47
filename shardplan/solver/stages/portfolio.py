"""The stage planner as :func:`~shardplan.planner.multi.make_plan` runs it: started from the
baselines' plans, the final pick checked in the event simulator.

:func:`plan_pipeline`

1. builds the best data-parallel-only and Megatron-style plans
   (:func:`~shardplan.solver.stages.baselines.data_parallel_only`,
   :func:`~shardplan.solver.stages.baselines.megatron_grid` on all devices and, on a mixed
   cluster, on each device type alone; each exact for its family by the closed form, cheap
   next to the search);
2. runs :func:`~shardplan.solver.stages.search.solve_pipeline` with them as seeds: they bound the
   search from its first step, and its plan is never worse than theirs by the closed form,
   even when the search stops at its budget;
3. plays the search's plan and every distinct seed out in the simulator
   (:func:`~shardplan.solver.stages.simulate.simulate`) when each has at most ``simulate_tasks``
   compute tasks, and returns the best by the simulated objective (step time, or dollars per
   step for ``objective="cost"`` among the candidates that keep the throughput floor in the
   simulation too; ties keep the search's plan). The closed form and the simulator differ by
   well under 1 % on 1F1B plans (:mod:`shardplan.solver.stages.simulate`), so the pick rarely
   changes; it makes "never worse than the baselines" hold in the simulator as well. When some
   candidate is too large to simulate, the closed form decides alone;
4. when an interleaved candidate simulates more than ``INTERLEAVED_SLACK`` slower than its
   closed form (interleaving on unequal chunks, which the closed form does not model), runs
   steps 1-2 again without interleaving and adds those plans to the candidates.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

from shardplan.solver.stages.baselines import data_parallel_only, megatron_grid
from shardplan.solver.stages.pipeline import (
    PipelineEvaluation,
    PipelinePlan,
    PipelineProblem,
    evaluate_pipeline,
)
from shardplan.solver.stages.search import SolveStats, solve_pipeline
from shardplan.solver.stages.simulate import Simulation, simulate

__all__ = ["SIMULATE_TASKS", "Candidate", "PipelineChoice", "compute_tasks", "plan_pipeline"]

INTERLEAVED_SLACK = 0.02
"""An interleaved candidate whose simulation exceeds its closed form by more than this
fraction sends the search round again without interleaving."""

TIE_RELATIVE = 1e-9
"""A later candidate replaces the pick only when its simulated objective is lower by more than
this fraction (sums in another order differ in the last bits)."""

SIMULATE_TASKS = 20_000
"""Plans with at most this many compute tasks (two per stage per microbatch, equal replicas
counted once; about a second of simulation) are simulated; larger ones are judged by the
closed form alone."""


@dataclass(frozen=True)
class Candidate:
    """One plan the final pick considered.

    Attributes:
      name: ``search`` (the stage planner's), ``data-parallel`` or ``megatron`` (a seed that
        the search did not beat).
      plan: the plan.
      evaluation: its closed-form figures.
      simulation: its simulation, or ``None`` when too large to simulate.
    """

    name: str
    plan: PipelinePlan
    evaluation: PipelineEvaluation
    simulation: Simulation | None


@dataclass(frozen=True)
class PipelineChoice:
    """The plan returned and how it was chosen.

    Attributes:
      plan: the plan.
      evaluation: its closed-form figures.
      simulation: its simulation (``None`` when too large).
      stats: the stage planner's search statistics.
      source: the name of the chosen :class:`Candidate`.
      candidates: every candidate, the search's first.
      timings: wall-clock seconds of the baselines (``baselines_s``), the search
        (``search_s``) and the simulations (``simulate_s``).
    """

    plan: PipelinePlan
    evaluation: PipelineEvaluation
    simulation: Simulation | None
    stats: SolveStats
    source: str
    candidates: tuple[Candidate, ...]
    timings: dict[str, float]


def compute_tasks(plan: PipelinePlan) -> int:
    """The compute tasks the simulator plays for ``plan``: two per stage per microbatch (per
    chunk when interleaved), equal replicas once."""
    v = plan.chunks if plan.schedule == "interleaved" else 1
    return sum(2 * v * len(r.stages) * r.microbatches for r in set(plan.replicas))


def _objective(problem: PipelineProblem, plan: PipelinePlan, sim: Simulation) -> float | None:
    """The simulated objective, or ``None`` when the simulation misses the throughput floor."""
    if problem.objective == "time":
        return sim.step_time_s
    if problem.batch / sim.step_time_s < problem.min_throughput:
        return None
    price = sum(problem.groups[s.group].price_per_hour * s.devices
                for r in plan.replicas for s in r.stages)
    return sim.step_time_s * price / 3600.0


def plan_pipeline(problem: PipelineProblem, /, *,
                  simulate_tasks: int = SIMULATE_TASKS) -> PipelineChoice:
    """The stage planner's plan of ``problem``, seeded with the baselines and checked in the
    simulator (the module docstring).

    Raises:
      PipelineInfeasibleError: no plan is feasible.
      SolverError: the budget passed before any plan was found.
    """
    start = time.perf_counter()
    clock = {"baselines_s": 0.0, "search_s": 0.0}
    plans, stats = _search(problem, "", clock)
    candidates = _score(problem, plans, simulate_tasks, [])
    linear = tuple(s for s in problem.schedules if s != "interleaved")
    if linear and any(c.plan.schedule == "interleaved" and c.simulation is not None
                      and c.simulation.step_time_s
                      > c.evaluation.step_time_s * (1 + INTERLEAVED_SLACK)
                      for c in candidates):
        # The closed form missed an interleaved plan by more than the slack (unequal
        # chunks): search again without interleaving, and let the simulator pick.
        narrowed = dataclasses.replace(problem, schedules=linear)
        more, _ = _search(narrowed, " without interleaving", clock)
        candidates = _score(problem, more, simulate_tasks, candidates)
    simulated = time.perf_counter()
    simulate_all = all(c.simulation is not None for c in candidates)
    chosen = candidates[0]
    if simulate_all:
        best = None
        for c in candidates:
            assert c.simulation is not None
            value = _objective(problem, c.plan, c.simulation)
            # strictly better beyond rounding: equal plans found twice keep the first
            if value is not None and (best is None or value < best * (1 - TIE_RELATIVE)):
                best, chosen = value, c
    timings = {**clock, "simulate_s": simulated - start - sum(clock.values())}
    return PipelineChoice(chosen.plan, chosen.evaluation, chosen.simulation, stats,
                          chosen.name, tuple(candidates), timings)


def _search(problem: PipelineProblem, suffix: str, clock: dict[str, float]
            ) -> tuple[list[tuple[str, PipelinePlan]], SolveStats]:
    """The search's plan and the distinct seeds it did not beat, named, the search's first."""
    start = time.perf_counter()
    seeds: dict[str, PipelinePlan] = {}
    builds: list[tuple[str, Callable[[PipelineProblem], PipelinePlan | None]]] = [
        ("data-parallel", data_parallel_only), ("megatron", megatron_grid)]
    if len(problem.groups) > 1:  # and Megatron on each type alone (its fastest type's grid)
        builds += [(f"megatron on {group.name}",
                    functools.partial(megatron_grid, groups=(g,)))
                   for g, group in enumerate(problem.groups)]
    for name, build in builds:
        plan = build(problem)
        # (a baseline cuts the layers evenly: where that splits a scanned stack unevenly it
        # is no plan of this problem)
        if plan is not None and evaluate_pipeline(problem, plan).feasible:
            seeds[name + suffix] = plan
    names = list(seeds)
    seeded = time.perf_counter()
    solution = solve_pipeline(problem, seeds=list(seeds.values()))
    clock["baselines_s"] += seeded - start
    clock["search_s"] += time.perf_counter() - seeded
    first = names[solution.stats.seed] if solution.stats.seed >= 0 else "search" + suffix
    plans = [(first, solution.plan)] + [(n, p) for n, p in seeds.items()
                                        if n != first and p != solution.plan]
    return plans, solution.stats


def _score(problem: PipelineProblem, plans: list[tuple[str, PipelinePlan]],
           simulate_tasks: int, known: list[Candidate]) -> list[Candidate]:
    """``known`` and the plans not among them, each evaluated and (when small enough)
    simulated."""
    out = list(known)
    for name, plan in plans:
        if any(c.plan == plan for c in out):
            continue
        sim = simulate(problem, plan) if compute_tasks(plan) <= simulate_tasks else None
        out.append(Candidate(name, plan, evaluate_pipeline(problem, plan), sim))
    return out
