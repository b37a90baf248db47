"""An intra-op problem laid out once and priced per mesh (planner/layout.py), and the mesh
search that shares layouts and relaxations (planner/mesh.py ``MeshSearch``)."""

from __future__ import annotations

import pytest
from helpers.plans import TWO_TYPES
from helpers.steps import mlp_step

import shardplan as sp
from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.collectives import mesh_collective_time_s
from shardplan.cost.sharding import analyze_sharding, leaf_specs
from shardplan.planner.intraop import build_intraop_problem
from shardplan.planner.layout import (
    MeshCollectives,
    intraop_layout,
    layout_signature,
    step_facts,
)
from shardplan.planner.mesh import MeshSearch, best_mesh, candidate_meshes
from shardplan.solver import evaluate

# Two A100 nodes of 4 and one V100 node of 4: meshes inside a node and across the two.


@pytest.fixture(scope="module")
def graph():
    step, state, x = mlp_step(64, 32, layers=4)
    return sp.trace(step, state, x)


def _meshes():
    a100, v100 = TWO_TYPES.groups[0].device_ids, TWO_TYPES.groups[1].device_ids
    out = []
    for ids in (a100[:1], a100[:2], a100[:4], a100[:8], v100[:2], v100[:4]):
        out += candidate_meshes(ids, TWO_TYPES)
    return out


@pytest.mark.parametrize(("tie_period", "follow"), [(1, True), (2, True), (0, False)])
def test_a_layout_priced_on_each_mesh_is_the_problem_built_there(graph, tie_period: int,
                                                                 follow: bool) -> None:
    # Laid out once per signature on the first mesh that has it and priced on every mesh of
    # that signature (other sizes, the other device type), with the collective times shared
    # between meshes, the problem equals the one build_intraop_problem lays out on that mesh
    # itself, to the bit: the strategies, followers and edges do not depend on what the
    # signature leaves out, and shards and prices are the pricing mesh's.
    facts = step_facts(graph, tie_period=tie_period)
    layouts = {}
    cache: dict = {}
    meshes = _meshes()
    laid_on: dict = {}
    priced_elsewhere = 0  # meshes priced on a layout laid out on another mesh
    for mesh in meshes:
        key = layout_signature(graph, mesh, factor_sizes=facts.factor_sizes)
        if key not in layouts:
            layouts[key] = intraop_layout(graph, mesh, tie_period=tie_period, follow=follow,
                                          facts=facts)
        layout = layouts[key]
        priced_elsewhere += laid_on.setdefault(key, mesh) != mesh
        costs = layout.price(mesh, TWO_TYPES, collective_cache=cache)
        got = layout.problem(mesh, TWO_TYPES, costs=costs, relative_gap=0.01)
        want = build_intraop_problem(graph, mesh, TWO_TYPES, tie_period=tie_period,
                                     follow=follow, relative_gap=0.01)
        assert got.problem == want.problem, mesh
        assert got.strategies == want.strategies
        assert (got.input_nodes, got.op_nodes, got.free_tensors) == (
            want.input_nodes, want.op_nodes, want.free_tensors)
    # 1, 2 and 2 x 2 ... 2 x 4 (the MLP's sizes divide alike on both): three layouts.
    assert [m.axis_sizes for m in meshes] == [(1,), (2,), (2, 2), (2, 4), (2,), (2, 2)]
    assert len(layouts) == 3
    # A100 2 x 4 on A100 2 x 2's layout; V100 2 and 2 x 2 on A100 2's and 2 x 2's.
    assert priced_elsewhere == 3


def test_a_mesh_of_another_signature_is_refused(graph) -> None:
    two, four = candidate_meshes(range(2), TWO_TYPES)[0], candidate_meshes(range(4), TWO_TYPES)[0]
    layout = intraop_layout(graph, two)
    assert layout.serves(two) and not layout.serves(four)
    with pytest.raises(ValueError, match="signature"):
        layout.price(four, TWO_TYPES)


def test_the_search_finds_the_optimum_best_mesh_finds(graph) -> None:
    search = MeshSearch(graph, TWO_TYPES, tie_period=1, relative_gap=0.01)
    for mesh in _meshes():
        ids = mesh.device_ids
        got = search.best(ids)
        want = best_mesh(graph, ids, TWO_TYPES, tie_period=1, relative_gap=0.01)
        assert got.mesh == want.mesh
        assert got.solution.objective == pytest.approx(want.solution.objective, rel=1e-7)
        # The problem is built on demand, equal to the one best_mesh solved.
        assert got.problem.problem == want.problem.problem
        assert evaluate(got.problem.problem, got.solution.assignment).cost.total == \
            pytest.approx(got.solution.objective, rel=1e-12)
    assert search.fallbacks == 0
    assert set(search.timings) >= {"facts_s", "layout_s", "relaxation_build_s", "price_s",
                                   "solve_s"}


def test_the_analysis_with_the_rules_given_is_the_same(graph) -> None:
    mesh = candidate_meshes(range(4), TWO_TYPES)[0]
    ins, outs = leaf_specs(graph, mesh, lambda p: ("outer",) if p.arg_index == 1 else None)
    a = analyze_sharding(graph, mesh, ins, outs)
    b = analyze_sharding(graph, mesh, ins, outs, rules=step_facts(graph).rules)
    assert (a.specs, a.op_axes, a.collectives) == (b.specs, b.op_axes, b.collectives)


def test_a_member_the_relaxation_does_not_settle_is_solved_as_best_mesh_does(
        graph, monkeypatch) -> None:
    from shardplan.solver.intraop.family import ProblemFamily

    monkeypatch.setattr(ProblemFamily, "solve", lambda self, *costs, **options: None)
    search = MeshSearch(graph, TWO_TYPES, tie_period=1, relative_gap=0.01)
    ids = TWO_TYPES.groups[0].device_ids[:4]
    got = search.best(ids)
    want = best_mesh(graph, ids, TWO_TYPES, tie_period=1, relative_gap=0.01)
    assert search.fallbacks == 1
    a, b = got.solution, want.solution
    assert (a.status, a.assignment, a.objective) == (b.status, b.assignment, b.objective)
    assert got.problem.problem == want.problem.problem


def test_mesh_collectives_time_as_the_slowest_of_all_groups() -> None:
    # MeshCollectives times one group per class of alike groups (same device group, size and
    # spread over nodes); the maximum over all groups must be the same to the bit: on meshes
    # inside a node, across the two A100 nodes (groups of one node and of two) and across the
    # two device groups (a class per group).
    a100, v100 = TWO_TYPES.groups[0].device_ids, TWO_TYPES.groups[1].device_ids
    meshes = [m for ids in (a100[:4], a100[:8]) for m in candidate_meshes(ids, TWO_TYPES)]
    meshes += [LogicalMesh(("outer", "inner"), (2, 4), tuple(a100[4:8]) + tuple(v100)),
               LogicalMesh(("outer", "inner"), (4, 2), tuple(a100[2:6]) + tuple(v100))]
    shared: dict = {}
    checked = 0
    for mesh in meshes:
        times = MeshCollectives(mesh, TWO_TYPES, shared)
        subsets = [(a,) for a in mesh.axis_names]
        if len(mesh.axis_names) > 1:
            subsets.append(mesh.axis_names)
        for axes in subsets:
            for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                         "collective-permute"):
                for nbytes in (0.0, 4096.0, 3e7):
                    want = mesh_collective_time_s(kind, nbytes, mesh, axes, TWO_TYPES)
                    assert times.collective(kind, axes, nbytes) == want, (mesh, axes, kind)
                    checked += 1
    assert checked == 15 * sum(2 * len(m.axis_names) - 1 for m in meshes)
