"""The relaxation of a family of problems (``shardplan.solver.intraop.family``): one structure, many
cost vectors, each member's optimum equal to ``ilp.solve``'s."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from shardplan.solver import Edge, Follower, Node, Problem, evaluate, solve
from shardplan.solver.intraop.family import ProblemFamily


def _family(problem: Problem, labels=None) -> ProblemFamily:
    counts = [n.num_strategies for n in problem.nodes]
    return ProblemFamily(
        names=[n.name for n in problem.nodes], counts=counts,
        followers=[(f.node, f.leader) for f in problem.followers],
        edges=[(e.src, e.dst) for e in problem.edges],
        labels=labels or [np.arange(len(e.cost)) for e in problem.edges],
        node_cost=_node_cost(problem), edge_costs=[np.asarray(e.cost) for e in problem.edges])


def _node_cost(problem: Problem) -> np.ndarray:
    return np.asarray([c + m for n in problem.nodes
                       for c, m in zip(n.compute_cost, n.communication_cost, strict=True)])


def _solve(family: ProblemFamily, problem: Problem):
    compute = np.asarray([c for n in problem.nodes for c in n.compute_cost])
    comm = np.asarray([c for n in problem.nodes for c in n.communication_cost])
    return family.solve(compute, comm, [np.asarray(e.cost) for e in problem.edges])


def test_a_chain_picks_the_cheapest_path_worked_out_by_hand() -> None:
    # a -> b -> c, two strategies each (0: replicated, 1: sharded). Node costs: a (4, 1),
    # b (2, 3), c (5, 1); both edges cost 0 on the diagonal, 3 off it.
    # All sharded: 1 + 3 + 1 = 5; all replicated: 4 + 2 + 5 = 11; (1, 0, 1): 1 + 2 + 1 + 6 = 10.
    switch = (0.0, 3.0, 3.0, 0.0)
    problem = Problem(
        (Node("a", (4.0, 1.0), (0.0, 0.0), (0.0, 0.0)),
         Node("b", (2.0, 3.0), (0.0, 0.0), (0.0, 0.0)),
         Node("c", (5.0, 1.0), (0.0, 0.0), (0.0, 0.0))),
        (Edge(0, 1, switch), Edge(1, 2, switch)))
    family = _family(problem)
    got = _solve(family, problem)
    assert got is not None and got.integral
    assert got.assignment == (1, 1, 1)
    assert got.objective == 5.0 == evaluate(problem, got.assignment).cost.total


def _random_problem(rng: random.Random, n: int, scale: float = 1.0) -> Problem:
    counts = [rng.choice((2, 3, 4)) for _ in range(n)]
    nodes = tuple(Node(f"n{i}", tuple(rng.uniform(0, 10) * scale for _ in range(k)),
                       tuple(rng.choice((0.0, rng.uniform(0, 2))) * scale for _ in range(k)),
                       tuple(0.0 for _ in range(k)))
                  for i, k in enumerate(counts))
    edges = []
    for dst in range(1, n):
        for src in rng.sample(range(dst), min(dst, rng.choice((1, 2)))):
            cost = [rng.choice((0.0, rng.uniform(0, 5) * scale))
                    for _ in range(counts[src] * counts[dst])]
            edges.append(Edge(src, dst, tuple(cost)))
    followers = []
    for i in range(1, n):
        if counts[i] == counts[i - 1] and rng.random() < 0.2:
            followers.append(Follower(node=i, leader=i - 1))
    return Problem(nodes, tuple(edges), followers=tuple(followers), time_limit_s=10)


@pytest.mark.parametrize("seed", range(30))
def test_members_equal_ilp_solve_warm_or_cold(seed: int) -> None:
    rng = random.Random(seed)
    problem = _random_problem(rng, rng.randint(3, 9))
    family = _family(problem)
    # Re-solving from the previous basis: every member (costs rescaled and perturbed, the
    # structure and the inf pattern kept) has the optimum ilp.solve finds.
    for member in range(4):
        if member:
            factor = rng.uniform(0.2, 5.0)
            problem = Problem(
                tuple(Node(n.name, tuple(c * factor * rng.uniform(0.5, 2) for c in n.compute_cost),
                           n.communication_cost, n.memory_bytes) for n in problem.nodes),
                tuple(Edge(e.src, e.dst, tuple(c * rng.uniform(0.5, 2) for c in e.cost))
                      for e in problem.edges),
                followers=problem.followers, time_limit_s=10)
        got = _solve(family, problem)
        want = solve(problem)
        assert got is not None
        if got.integral:
            assert got.objective == pytest.approx(want.objective, rel=1e-9, abs=1e-12)
            assert got.objective == pytest.approx(
                evaluate(problem, got.assignment).cost.total, rel=1e-12)
        for f in problem.followers:
            assert got.assignment[f.node] == got.assignment[f.leader]


def test_equal_labels_merge_pair_variables_and_keep_the_optimum() -> None:
    # Edge entries labelled alike (the same resharding) share pair variables; an edge whose
    # rows are all alike depends on its consumer only and becomes a node cost.
    rng = random.Random(7)
    for _ in range(10):
        problem = _random_problem(rng, 6)
        labels, edges = [], []
        for e in problem.edges:
            n_dst = problem.nodes[e.dst].num_strategies
            if rng.random() < 0.5:  # M[i, j] = c_j: one row class
                row = [rng.uniform(0, 5) for _ in range(n_dst)]
                cost = tuple(row[k % n_dst] for k in range(len(e.cost)))
                label = np.asarray([k % n_dst for k in range(len(e.cost))])
            else:  # two values, labelled by value
                values = (0.0, rng.uniform(0, 5))
                pick = [rng.randrange(2) for _ in e.cost]
                cost = tuple(values[p] for p in pick)
                label = np.asarray(pick)
            edges.append(Edge(e.src, e.dst, cost))
            labels.append(label)
        problem = Problem(problem.nodes, tuple(edges), followers=problem.followers,
                          time_limit_s=10)
        family = _family(problem, labels)
        got = _solve(family, problem)
        assert got is not None
        if got.integral:
            assert got.objective == pytest.approx(solve(problem).objective, rel=1e-9,
                                                  abs=1e-12)
        assert len(family.y_vars) < sum(len(e.cost) for e in problem.edges)


def test_a_member_with_another_inf_pattern_is_refused() -> None:
    problem = Problem(
        (Node("a", (1.0, 2.0), (0.0, 0.0), (0.0, 0.0)),
         Node("b", (1.0, 2.0), (0.0, 0.0), (0.0, 0.0))),
        (Edge(0, 1, (0.0, 1.0, math.inf, 0.0)),))
    family = _family(problem)
    assert _solve(family, problem) is not None
    other = Problem(problem.nodes, (Edge(0, 1, (0.0, math.inf, 1.0, 0.0)),))
    assert _solve(family, other) is None


def test_one_strategy_per_group_needs_no_solve() -> None:
    problem = Problem(
        (Node("a", (3.0,), (1.0,), (0.0,)), Node("b", (2.0,), (0.0,), (0.0,))),
        (Edge(0, 1, (4.0,)),))
    family = _family(problem)
    got = _solve(family, problem)
    assert family.trivial and got is not None and got.iterations == 0
    assert got.assignment == (0, 0) and got.objective == 10.0
