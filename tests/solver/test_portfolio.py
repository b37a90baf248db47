"""The stage planner as make_plan runs it (``shardplan.solver.stages.portfolio``): seeded with the
baselines, the final pick checked in the simulator."""

from __future__ import annotations

import dataclasses
import random

import pytest
from helpers.pipeline_bruteforce import count_plans, random_problem

from shardplan.errors import InfeasibleError
from shardplan.solver.stages.baselines import data_parallel_only, megatron_grid
from shardplan.solver.stages.pipeline import evaluate_pipeline
from shardplan.solver.stages.portfolio import compute_tasks, plan_pipeline
from shardplan.solver.stages.simulate import simulate


def _value(problem, ev_or_sim, plan) -> float:
    step = ev_or_sim.step_time_s
    if problem.objective == "time":
        return step
    price = sum(problem.groups[s.group].price_per_hour * s.devices
                for r in plan.replicas for s in r.stages)
    return step * price / 3600.0


def test_never_worse_than_the_baselines_in_the_simulator_nor_the_closed_form() -> None:
    rng = random.Random("portfolio")
    checked = 0
    while checked < 40:
        problem = random_problem(rng)
        if count_plans(problem, 3000) > 3000:
            continue
        try:
            choice = plan_pipeline(problem)
        except InfeasibleError:
            continue
        checked += 1
        per_type = {f"megatron on {g.name}": megatron_grid(problem, groups=(i,))
                    for i, g in enumerate(problem.groups)} if len(problem.groups) > 1 else {}
        assert choice.candidates[0].name in ("search", "data-parallel", "megatron", *per_type)
        names = [c.name for c in choice.candidates]
        assert len(names) == len(set(names))
        for base in (data_parallel_only(problem), megatron_grid(problem), *per_type.values()):
            if base is None:
                continue
            ev = evaluate_pipeline(problem, base)
            # by the closed form, the search's plan is never worse than a seed
            assert (_value(problem, choice.candidates[0].evaluation, choice.candidates[0].plan)
                    <= _value(problem, ev, base) * (1 + 1e-9))
            # by the simulator, the pick is never worse than a baseline (equal to its floor)
            sim = simulate(problem, base)
            if problem.objective == "time" or problem.batch / sim.step_time_s >= (
                    problem.min_throughput):
                assert (_value(problem, choice.simulation, choice.plan)
                        <= _value(problem, sim, base) * (1 + 1e-9))
        assert choice.simulation == simulate(problem, choice.plan)
        assert choice.evaluation == evaluate_pipeline(problem, choice.plan)


def test_too_large_to_simulate_leaves_the_pick_to_the_closed_form() -> None:
    rng = random.Random("portfolio-large")
    while True:
        problem = random_problem(rng)
        if count_plans(problem, 3000) <= 3000 and problem.objective == "time":
            try:
                choice = plan_pipeline(problem, simulate_tasks=0)
                break
            except InfeasibleError:
                continue
    assert choice.simulation is None and choice.source == choice.candidates[0].name
    assert all(c.simulation is None for c in choice.candidates)
    assert compute_tasks(choice.plan) > 0
    assert set(choice.timings) == {"baselines_s", "search_s", "simulate_s"}


def test_the_simulator_overturns_an_interleaved_plan_on_unequal_chunks() -> None:
    # Two devices holding two layers each, four layers heavy at both ends of the virtual
    # pipeline (interleaved: stage 0 runs layers 0 and 2, stage 1 layers 1 and 3; heavy 1 s
    # forward + 3 s backward per microbatch, light 0.1 + 0.3). Interleaving's closed form
    # assumes equal chunks: it promises 8.8 / 2 + (2 - 1/2) 4.4 = 11 s for two microbatches,
    # the simulation takes 16.4 s; 1F1B on layers {0, 1}, {2, 3} takes 4.4 +
    # 4.4 + 4.4 = 13.2 s both ways. The search goes round again without interleaving and the
    # simulator picks the 1F1B plan.
    from shardplan.solver.stages.pipeline import (
        DeviceGroup,
        LayerKind,
        LayerOption,
        Link,
        PipelineProblem,
    )

    def option(f: float) -> LayerOption:  # 1 byte of state, 2.5 bytes per device
        return LayerOption(1, (0.0, f), (0.0, 3 * f), {"none": (0.0, 0.0)}, {"none": 0.0},
                           1.0, 0.0)

    free = Link(1e12, 0.0)
    heavy = LayerKind("heavy", {0: (option(1.0),)}, 0.0, 0.0)
    light = LayerKind("light", {0: (option(0.1),)}, 0.0, 0.0)
    problem = PipelineProblem(
        (heavy, light), (0, 1, 1, 0), (DeviceGroup("d", 2, 2, 2.5, 1.0, free, free),), free,
        batch=2, microbatch_sizes=(1,), schedules=("1f1b", "interleaved"), remats=("none",),
        chunks=(2,))
    choice = plan_pipeline(problem)
    first = choice.candidates[0]
    assert first.plan.schedule == "interleaved"
    assert first.evaluation.step_time_s == pytest.approx(11.0)
    assert first.simulation is not None and first.simulation.step_time_s == pytest.approx(16.4)
    assert choice.plan.schedule == "1f1b" and choice.source.endswith("without interleaving")
    assert choice.simulation is not None
    assert choice.simulation.step_time_s == pytest.approx(13.2)
    assert choice.evaluation.step_time_s == pytest.approx(13.2)


@pytest.mark.parametrize("objective", ["time", "cost"])
def test_ties_keep_the_search(objective: str) -> None:
    rng = random.Random(f"ties-{objective}")
    while True:
        problem = random_problem(rng)
        if count_plans(problem, 2000) > 2000:
            continue
        problem = dataclasses.replace(problem, objective=objective, min_throughput=0.0)
        try:
            choice = plan_pipeline(problem)
        except InfeasibleError:
            continue
        break
    values = [_value(problem, c.simulation, c.plan) for c in choice.candidates]
    assert choice.source == choice.candidates[values.index(min(values))].name
