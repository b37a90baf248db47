"""Plan.explain() and sp.diff(): the runner-ups and per-leaf alternatives a plan records, and
what changed between two plans.

Planned abstractly (``ShapeDtypeStruct``s): a 3-layer MLP on the 32 A100s of
``configs/clusters/cloud-ethernet.yaml`` (4 nodes of 8) with three mesh axes, where the mesh
search solves two candidate meshes, 2 x 2 x 8 and 4 x 2 x 4, so one is the runner-up; and on 4
and 8 local devices (one candidate mesh each), re-solved for the evaluator and diffed.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import pytest
from helpers.steps import mlp_step

import shardplan as sp
from shardplan._format import format_spec, key_pattern, starred_values
from shardplan.planner.alternatives import LocalCosts, alternative, unused_types
from shardplan.planner.multi import memory_budget
from shardplan.planner.single import _search
from shardplan.solver.intraop.evaluate import evaluate
from shardplan.solver.stages.pipeline import (
    DeviceGroup,
    LayerKind,
    LayerOption,
    Link,
    PipelineProblem,
)
from shardplan.solver.stages.portfolio import plan_pipeline

CONFIG = sp.PlanConfig(max_mesh_axes=3, relative_gap=0.0)
SMALL = sp.PlanConfig(relative_gap=0.0)


@pytest.fixture(scope="module")
def planned():
    step, state, x = mlp_step(256, 32, layers=3)
    cluster = sp.Cluster.from_yaml("configs/clusters/cloud-ethernet.yaml")
    plan = sp.make_plan(step, state, x, cluster=cluster, config=CONFIG)
    return step, state, x, cluster, plan


@pytest.fixture(scope="module")
def small():
    """The MLP on 4 local devices (one 2 x 2 mesh): a smaller problem to re-solve."""
    step, state, x = mlp_step(256, 32, layers=3)
    cluster = sp.Cluster.local(devices=jax.devices()[:4])
    plan = sp.make_plan(step, state, x, cluster=cluster, config=SMALL)
    return step, state, x, cluster, plan


def _lines_ok(text: str) -> None:
    assert "\x1b" not in text
    for line in text.splitlines():
        assert len(line) <= 100, line


def test_runner_ups_are_other_meshes_and_none_is_predicted_faster(planned) -> None:
    *_, plan = planned
    assert plan.solver["status"] == "optimal"
    chosen = plan.stages[0].mesh
    rows = plan.solver["runner_ups"]
    # The other candidate mesh, and the simplest mesh (one axis), solved for the runner-ups.
    assert len(rows) == 2 and [4 * 8] in [list(r["mesh"]["axis_sizes"]) for r in rows]
    for row in rows:
        mesh = row["mesh"]
        assert (tuple(mesh["axis_names"]), tuple(mesh["axis_sizes"])) != (
            chosen.axis_names, chosen.axis_sizes)
        assert math.prod(mesh["axis_sizes"]) == chosen.num_devices
        # The search is optimal with no gap: no runner-up has a lower objective, nor (priced
        # as the plan is) a lower predicted step time.
        assert row["objective_s"] >= plan.solver["objective_s"]
        assert row["step_time_s"] >= plan.predicted.step_time_s
        assert row["memory_bytes"] > 0 and row["reason"]


def test_a_single_candidate_mesh_still_has_a_simpler_runner_up(small) -> None:
    *_, plan = small
    assert [list(shape) for shape, _ in plan.solver["mesh_candidates"]] == [[2, 2]]
    (row,) = plan.solver["runner_ups"]
    assert list(row["mesh"]["axis_sizes"]) == [4] and row["step_time_s"] >= (
        plan.predicted.step_time_s)
    assert "4" in plan.explain().split("runner")[-1]


def test_each_alternative_is_the_evaluators_objective_difference(small) -> None:
    step, state, x, cluster, plan = small
    record = plan.solver["alternatives"]
    # The same search again, and the evaluator on each alternative's assignment.
    graph = sp.trace(step, state, x)
    budget = memory_budget(SMALL, cluster.groups[0].device.memory_bytes)
    choice = _search(graph, cluster, SMALL, budget, ())
    ip, chosen = choice.problem, choice.solution.assignment
    assert chosen is not None
    base = evaluate(ip.problem, chosen)
    local = LocalCosts(ip.problem)
    checked = 0
    for path in ("0/1/kernel", "0/2/bias", "1/0/mu/1/kernel"):
        param = next(p for p in graph.parameters if p.arg_index == 0 and p.path == path)
        node = ip.input_nodes[param.tensor]
        group = record["groups"][record["leaves"][path] if isinstance(
            record["leaves"].get(path), int) else _group(record, path)]
        assert _spec(group["chosen"]) == plan.param_specs[path][1]
        recorded = {_spec(spec): (delta, memory, ok) for spec, delta, memory, ok
                    in group["options"]}
        assert len(recorded) == len(ip.strategies[node]) - 1
        for k, strategy in enumerate(ip.strategies[node]):
            if k == chosen[node]:
                continue
            after = alternative(local, chosen, node, k)
            assert after[node] == k
            ev = evaluate(ip.problem, after)
            assert "follower" not in ev.kinds()
            delta, memory, ok = recorded[strategy.result_specs[0]]
            assert ok == ev.feasible
            if ev.feasible:
                assert delta == pytest.approx(ev.cost.total - base.cost.total, rel=1e-9,
                                              abs=1e-15)
                assert memory == round(ev.peak_memory_bytes - base.peak_memory_bytes)
                checked += 1
    assert checked > 5
    # Stored sorted: feasible ones by their change of step time.
    for group in record["groups"]:
        deltas = [d for _, d, _, ok in group["options"] if ok]
        assert deltas == sorted(deltas)


def _group(record, path: str) -> int:
    entry = record["leaves"][key_pattern(path)]
    if isinstance(entry, int):
        return entry
    wanted = ",".join(starred_values(path))
    return next(g for g, members in entry if wanted in members)


def _spec(value) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(dim) for dim in value)


def test_explain_lists_the_runner_ups_and_a_leafs_alternatives(planned) -> None:
    *_, plan = planned
    text = plan.explain()
    _lines_ok(text)
    assert "chosen" in text and plan.stages[0].mesh.describe() in text
    runner = plan.solver["runner_ups"][0]["mesh"]
    assert ", ".join(f"{n}={s}" for n, s in zip(runner["axis_names"], runner["axis_sizes"],
                                                strict=True)) in text
    leaf = plan.explain(tensor="0/1/kernel")
    _lines_ok(leaf)
    spec = format_spec(plan.param_specs["0/1/kernel"][1])
    assert f"0/1/kernel: chosen {spec}" in leaf
    rows = [line for line in leaf.splitlines() if re.search(r"[+-]\d[\d.,]* ms", line)]
    deltas = [float(re.search(r"([+-][\d.,]+) ms", r).group(1).replace(",", "")) for r in rows]
    assert len(rows) >= 10 and deltas == sorted(deltas)


def test_an_unknown_tensor_is_named_with_a_did_you_mean(planned) -> None:
    *_, plan = planned
    with pytest.raises(sp.ConfigError, match=r"(?s)'0/1/kernl'.*did you mean '0/1/kernel'"):
        plan.explain(tensor="0/1/kernl")


def test_a_plan_without_records_says_so(planned) -> None:
    *_, plan = planned
    old = dataclasses.replace(plan, solver={"status": "optimal"})
    text = old.explain()
    _lines_ok(text)
    assert "records no runner-ups" in text and "records no per-tensor alternatives" in text
    assert "records no per-tensor alternatives" in old.explain(tensor="0/1/kernel")


def test_json_round_trip_keeps_runner_ups_and_alternatives(planned) -> None:
    *_, plan = planned
    again = sp.Plan.from_json(plan.to_json())
    assert again.solver["runner_ups"] == plan.solver["runner_ups"]
    assert again.solver["alternatives"] == plan.solver["alternatives"]
    assert again.explain() == plan.explain()
    assert again.explain(tensor="1/0/mu/1/kernel") == plan.explain(tensor="1/0/mu/1/kernel")


def test_diff_of_a_plan_with_itself_is_empty(planned) -> None:
    *_, plan = planned
    same = sp.diff(plan, sp.Plan.from_json(plan.to_json()))
    assert not same and len(same) == 0
    assert str(same).endswith("no differences")


def test_diff_of_plans_on_different_meshes_names_the_changed_specs(small) -> None:
    step, state, x, _, a = small
    b = sp.make_plan(step, state, x, cluster=sp.Cluster.local(devices=jax.devices()[:8]),
                     config=SMALL)
    d = sp.diff(a, b)
    assert d and isinstance(d, sp.PlanDiff)
    text = str(d)
    _lines_ok(text)
    assert {c.field for c in d.inputs} == {"cluster_hash"}
    assert any(c.field == "stage 0 mesh" and c.before == a.stages[0].mesh.describe()
               and c.after == b.stages[0].mesh.describe() for c in d.stages)
    changed = {k for k, (_, spec) in a.param_specs.items() if b.param_specs[k][1] != spec}
    assert changed
    assert sum(s.leaves for s in d.param_specs) == len(changed)
    for change in d.param_specs:
        assert change.pattern in text
    assert "step time" in {c.field for c in d.predicted}


def test_an_unused_type_whose_search_runs_out_says_so_and_how_to_give_it_more() -> None:
    # Two groups, the faster one alone is best; with a work limit of one unit the search for a
    # plan that uses the slower group finds none and names the limits that would give it more.
    fast = LayerOption(1, (0.0, 1.0), (0.0, 1.0), {"none": (0.0, 0.0)}, {"none": 0.0}, 0.0,
                       0.0)
    slow = dataclasses.replace(fast, forward_s=(0.0, 4.0), backward_s=(0.0, 4.0))
    link = Link(1e9, 0.0)
    problem = PipelineProblem(
        (LayerKind("block", {0: (fast,), 1: (slow,)}, 0.0, 1.0),), (0, 0),
        (DeviceGroup("a", 2, 2, 1e9, 1.0, link, link),
         DeviceGroup("b", 1, 1, 1e9, 1.0, link, link)), Link(1.0, 1.0), batch=8,
        microbatch_sizes=(1,), schedules=("1f1b",), remats=("none",))
    choice = plan_pipeline(problem)
    assert {s.group for r in choice.plan.replicas for s in r.stages} == {0}
    # (the candidates that use group b would seed the search: left out)
    alone = dataclasses.replace(choice, candidates=tuple(
        c for c in choice.candidates
        if all(s.group == 0 for r in c.plan.replicas for s in r.stages)))
    (row,) = unused_types(alone, dataclasses.replace(problem, work_limit=1)).values()
    assert "none_found" in row and "best_step_s" not in row
    assert "1 work units" in row["none_found"] and "stage_work_limit" in row["none_found"]
    # with no limit the search finds the best plan that uses it
    (row,) = unused_types(alone, problem).values()
    assert row["optimal"] is True and row["slower_by"] > 0


def test_a_multi_stage_plan_records_the_stage_planners_other_candidates() -> None:
    step, state, x = mlp_step(256, 256, layers=4, learning_rate=1e-3)
    cluster = sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
    plan = sp.make_plan(step, state, x, cluster=cluster,
                        config=sp.PlanConfig(pipeline=True, stage_time_limit_s=60.0))
    rows = plan.solver["runner_ups"]
    assert rows and plan.solver["status"] == "optimal"
    candidates = plan.solver["candidates"]
    for row in rows:
        assert row["name"] in candidates and row["name"] != plan.solver["chosen"]
        assert row["step_time_s"] == candidates[row["name"]]["step_s"]
        # Lost by the closed form, or by the simulator that made the final pick.
        assert (row["step_time_s"] > plan.predicted.step_time_s
                or row["simulated_step_s"] > plan.solver["simulated_step_s"]), row
        assert row["memory_bytes"] > 0 and row["config"]
    assert set(plan.solver["alternatives"]["layouts"]) == set(plan.layouts)
    text = plan.explain()
    _lines_ok(text)
    assert all(row["reason"] in text for row in rows)
    # The V100s stay unused: the best plan that uses them (searched again, proven best here),
    # no slower than any candidate that uses them, and why it loses.
    assert {s.device_type for s in plan.stages} == {"a100-80g"}
    (name, unused), = plan.solver["unused_types"].items()
    users = [r for r in rows if "v100-32g" in r["config"]]
    assert name == "v100-32g" and unused["optimal"] is True
    assert plan.predicted.step_time_s < unused["best_step_s"] <= min(
        r["step_time_s"] for r in users)
    assert "v100-32g" in unused["config"]
    assert unused["slower_by"] == pytest.approx(
        unused["best_step_s"] / plan.predicted.step_time_s - 1)
    assert unused["limit_extra_s"] > 0 and unused["alone"] == {"devices_needed": 1,
                                                                "devices": 4}
    assert ("Device types this plan leaves unused" in text
            and "v100-32g: the best plan that uses it" in text)
    assert "why device types stay unused (v100-32g): plan.explain()" in plan.summary()
    _lines_ok(plan.explain(tensor="0/1/kernel"))
    again = sp.Plan.from_json(plan.to_json())
    assert again.explain() == text
