"""Rounding a fractional LP relaxation (``shardplan.solver.intraop.rounding``), alone and inside
``ilp.solve`` and ``ProblemFamily.solve``, checked against brute force."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import pytest

from shardplan.solver import Alias, Edge, Follower, Node, Problem, evaluate, solve
from shardplan.solver.intraop.family import ProblemFamily
from shardplan.solver.intraop.rounding import assignment_cost, round_relaxation

INF = math.inf
# Anti-ferromagnetic: an edge costs 4 when both ends pick the same strategy, else 0. On an odd
# cycle no assignment makes every edge differ, but the relaxation can (half and half on every
# node, the pair marginals on the off-diagonal): it is fractional, and its argmax (a tie, the
# lower index) puts every node on strategy 0.
SAME_COSTS_4 = np.array([[4.0, 0.0], [0.0, 4.0]])


def _brute_force(node_cost: Sequence[np.ndarray], edges: Sequence[tuple[int, int, np.ndarray]]
                 ) -> float:
    return min(assignment_cost(node_cost, edges, a)
               for a in itertools.product(*(range(len(c)) for c in node_cost)))


def _triangle() -> tuple[list[np.ndarray], list[tuple[int, int, np.ndarray]]]:
    return ([np.array([1.0, 2.0])] * 3,
            [(0, 1, SAME_COSTS_4), (1, 2, SAME_COSTS_4), (0, 2, SAME_COSTS_4)])


def test_a_frustrated_triangle_rounds_to_the_optimum_worked_out_by_hand() -> None:
    # Node costs (1, 2) each. Two nodes must agree somewhere: (0, 0, 1) costs
    # 1 + 1 + 2 nodes + 4 on edge (0, 1) = 8, the optimum; all on 0 (the argmax) costs
    # 3 + 3 * 4 = 15. The relaxation: half/half costs 3 * 1.5 = 4.5.
    node_cost, edges = _triangle()
    half = [np.array([0.5, 0.5])] * 3
    rounded = round_relaxation(node_cost, edges, half)
    assert rounded is not None
    assert rounded.cost == 8.0 == _brute_force(node_cost, edges)
    assert rounded.cost == assignment_cost(node_cost, edges, rounded.assignment)
    assert sorted(rounded.assignment) == [0, 0, 1]
    # Deterministic: the same inputs give the same assignment.
    assert round_relaxation(node_cost, edges, half) == rounded


def test_forbidden_strategies_and_pairs_are_never_picked() -> None:
    # A 5-cycle of three-strategy groups. Strategy 0 of group 1 is forbidden, and so is the
    # pair (2, 2) on edge (3, 4); the marginals point straight at both (certainty 1), and at
    # strategy 0 (the cheapest) elsewhere.
    rng = random.Random(3)
    node_cost = [np.array([1.0, 3.0, 2.0]) for _ in range(5)]
    node_cost[1] = np.array([INF, 3.0, 2.0])
    edges = []
    for u in range(5):
        m = np.array([[rng.choice((0.0, 5.0)) for _ in range(3)] for _ in range(3)])
        edges.append((u, (u + 1) % 5, m))
    edges[3][2][2, 2] = INF
    marginals = [np.array([1.0, 0.0, 0.0]) for _ in range(5)]
    marginals[3] = marginals[4] = np.array([0.0, 0.0, 1.0])
    rounded = round_relaxation(node_cost, edges, marginals)
    assert rounded is not None and math.isfinite(rounded.cost)
    a = rounded.assignment
    assert a[1] != 0 and (a[3], a[4]) != (2, 2)
    assert rounded.cost == _brute_force(node_cost, edges)


def test_no_finite_assignment_gives_none() -> None:
    # Both strategies of group 0 are compatible with no strategy of group 1.
    node_cost = [np.array([1.0, 1.0]), np.array([1.0, 1.0])]
    edges = [(0, 1, np.full((2, 2), INF))]
    assert round_relaxation(node_cost, edges, [np.array([0.5, 0.5])] * 2) is None


def test_mismatched_inputs_are_refused() -> None:
    node_cost, edges = _triangle()
    with pytest.raises(ValueError, match="marginals"):
        round_relaxation(node_cost, edges, [np.array([1.0])] * 3)
    with pytest.raises(ValueError, match="shape"):
        round_relaxation(node_cost, [(0, 1, np.zeros((3, 2)))], [np.array([0.5, 0.5])] * 3)


def test_diving_fixes_the_hub_to_its_best_relaxed_strategy() -> None:
    # A wheel: hub 0 joined to a 4-cycle 1-2-3-4, every edge SAME_COSTS_4, the hub's
    # strategies cost (3, 1). The stand-in relaxation answers each fixing with the best
    # completion (integral marginals, its cost as the value), as an exact relaxation would.
    # Diving tries both strategies of the hub (the fractional group with most neighbours),
    # keeps the cheaper re-solve and rounds it: the optimum (here stage 1 found it too).
    node_cost = [np.array([3.0, 1.0])] + [np.array([1.0, 1.5])] * 4
    edges = [(0, k, SAME_COSTS_4) for k in range(1, 5)]
    edges += [(k, k % 4 + 1, SAME_COSTS_4) for k in range(1, 5)]
    calls: list[dict[int, int]] = []

    def resolve(fixings: Mapping[int, int]) -> tuple[list[np.ndarray], float]:
        calls.append(dict(fixings))
        best = min((a for a in itertools.product(range(2), repeat=5)
                    if all(a[g] == s for g, s in fixings.items())),
                   key=lambda a: assignment_cost(node_cost, edges, a))
        return ([np.eye(2)[s] for s in best], assignment_cost(node_cost, edges, best))

    rounded = round_relaxation(node_cost, edges, [np.array([0.5, 0.5])] * 5, resolve=resolve)
    assert calls == [{0: 0}, {0: 1}]
    assert rounded is not None and rounded.resolves == 2
    # Hub on 1 (cost 1), the cycle alternating 0/1 (2 * 1 + 2 * 1.5 = 5) with the two
    # cycle nodes on 1 agreeing with the hub (2 * 4 = 8): 14, the optimum.
    assert rounded.cost == 14.0 == _brute_force(node_cost, edges)
    # A target stage 1 already meets needs no dive.
    calls.clear()
    quick = round_relaxation(node_cost, edges, [np.array([0.5, 0.5])] * 5, resolve=resolve,
                             target_cost=math.inf)
    assert quick is not None and quick.dives == 0 and not calls


# --------------------------------------------------------------------------- in ilp.solve


def _triangle_problem(relative_gap: float) -> Problem:
    nodes = tuple(Node(f"n{k}", (1.0, 2.0), (0.0, 0.0), (0.0, 0.0)) for k in range(3))
    edges = tuple(Edge(u, v, tuple(SAME_COSTS_4.ravel())) for u, v in ((0, 1), (1, 2), (0, 2)))
    return Problem(nodes, edges, relative_gap=relative_gap, time_limit_s=10.0)


def test_solve_accepts_a_rounding_within_the_gap_without_cp_sat() -> None:
    # The triangle above: relaxation 4.5 (salted at most 0.1 % more), optimum 8, so the
    # rounding's gap is (8 - 4.5 / (1 + salt)) / 8 ~ 0.44. The argmax (15, gap 0.70) is
    # outside a 0.5 gap; the rounding is inside.
    solution = solve(_triangle_problem(0.5))
    assert "cp_sat_status" not in solution.stats
    assert solution.stats["lp_relaxation"].startswith("fractional, rounded (")
    assert solution.status == "feasible" and solution.objective == 8.0
    assert solution.best_bound is not None and solution.gap is not None
    assert 4.5 / 1.001 <= solution.best_bound <= 4.5
    assert solution.gap == pytest.approx((8.0 - solution.best_bound) / 8.0, rel=1e-12)
    assert solution.gap <= 0.5
    assert solve(_triangle_problem(0.5)).assignment == solution.assignment  # deterministic
    # A tighter gap than the rounding proves: CP-SAT, from the rounding, proves 8 optimal.
    exact = solve(_triangle_problem(0.1))
    assert exact.stats["cp_sat_status"] == "OPTIMAL" and exact.objective == 8.0


def _random_problem(rng: random.Random) -> Problem:
    """Up to 6 nodes of 2-3 strategies joined into cycles, with inf costs, a follower and
    an alias sometimes. Most edges cost more when both ends pick the same index, so odd
    cycles are frustrated and the relaxation is often fractional (about half of them)."""
    n = rng.randint(3, 6)
    counts = [rng.choice((2, 2, 2, 3)) for _ in range(n)]
    nodes = []
    for i, k in enumerate(counts):
        compute = [rng.uniform(0, 1) for _ in range(k)]
        if k == 3 and rng.random() < 0.3:  # (a forbidden one of two leaves no choice)
            compute[rng.randrange(k)] = INF
        nodes.append(Node(f"n{i}", tuple(compute), (0.0,) * k, (0.0,) * k))
    pairs = {(i, i + 1) for i in range(n - 1)} | {(0, n - 1)}
    pairs |= {tuple(sorted(rng.sample(range(n), 2))) for _ in range(rng.randint(0, 3))}
    edges = []
    for u, v in sorted(pairs):
        same = rng.uniform(2, 8) if rng.random() < 0.95 else 0.0
        cost = [(same if i == j else 0.0) + rng.choice((0.0, 0.0, rng.uniform(0, 1)))
                for i in range(counts[u]) for j in range(counts[v])]
        if rng.random() < 0.2:
            cost[rng.randrange(len(cost))] = INF
        edges.append(Edge(u, v, tuple(cost)))
    followers = tuple(Follower(i, i - 1) for i in range(1, n)
                      if counts[i] == counts[i - 1] and rng.random() < 0.15)
    aliases = ()
    if rng.random() < 0.3:
        a, b = rng.sample(range(n), 2)
        allowed = [1.0] * (counts[a] * counts[b])
        allowed[rng.randrange(len(allowed))] = 0.0
        aliases = (Alias(a, b, tuple(allowed)),)
    return Problem(tuple(nodes), tuple(edges), followers=followers, aliases=aliases,
                   relative_gap=1.0, time_limit_s=10.0)


def _optimum(problem: Problem) -> float:
    return min((ev.cost.total for a in itertools.product(*map(range, problem.strategy_counts()))
                if (ev := evaluate(problem, a)).feasible), default=INF)


def test_the_random_problems_exercise_the_rounding() -> None:
    fractional = sum(solve(_random_problem(random.Random(seed))).stats.get(
        "lp_relaxation", "").startswith("fractional, rounded") for seed in range(40))
    assert fractional >= 8


@pytest.mark.parametrize("relative_gap", [1.0, 0.01])
@pytest.mark.parametrize("seed", range(40))
def test_solve_with_a_gap_reports_a_valid_bound_against_brute_force(
        seed: int, relative_gap: float) -> None:
    problem = replace(_random_problem(random.Random(seed)), relative_gap=relative_gap)
    optimum = _optimum(problem)
    solution = solve(problem)
    if math.isinf(optimum):
        assert solution.assignment is None
        return
    assert solution.assignment is not None and solution.objective is not None
    ev = evaluate(problem, solution.assignment)
    assert ev.feasible and ev.cost.total == solution.objective
    assert solution.best_bound is not None and solution.gap is not None
    # Never below the optimum; the bound never above it; the gap their distance.
    assert solution.objective >= optimum * (1 - 1e-12)
    assert solution.best_bound <= optimum * (1 + 1e-12)
    if solution.objective > 0:
        assert solution.gap == pytest.approx(
            (solution.objective - solution.best_bound) / solution.objective, abs=1e-9)
    # Accepted within the gap of a bound below the optimum: within the gap of the optimum.
    assert solution.gap <= relative_gap
    if relative_gap < 1:
        assert solution.objective <= optimum / (1 - relative_gap) * (1 + 1e-12)


# --------------------------------------------------------------------------- in the family


def _family_solve(problem: Problem, relative_gap: float, family: ProblemFamily | None = None):
    compute = np.asarray([c for n in problem.nodes for c in n.compute_cost])
    comm = np.asarray([c for n in problem.nodes for c in n.communication_cost])
    edges = [np.asarray(e.cost) for e in problem.edges]
    if family is None:
        family = ProblemFamily(
            names=[n.name for n in problem.nodes],
            counts=list(problem.strategy_counts()),
            followers=[(f.node, f.leader) for f in problem.followers],
            edges=[(e.src, e.dst) for e in problem.edges],
            labels=[np.arange(len(e.cost)) for e in problem.edges],
            node_cost=compute + comm, edge_costs=edges)
    return family, family.solve(compute, comm, edges, relative_gap=relative_gap)


def test_the_family_rounds_the_triangle_and_restores_its_relaxation() -> None:
    problem = _triangle_problem(0.0)
    family, plain = _family_solve(problem, 0.0)
    assert plain is not None and not plain.integral and plain.rounding == "argmax"
    assert plain.objective == 15.0  # all on strategy 0
    _, rounded = _family_solve(problem, 0.5, family)
    assert rounded is not None and not rounded.integral
    assert rounded.objective == 8.0 == evaluate(problem, rounded.assignment).cost.total
    assert "local search" in rounded.rounding
    assert rounded.lower_bound <= 4.5 <= rounded.lp_objective
    assert rounded.gap == pytest.approx((8.0 - rounded.lower_bound) / 8.0, rel=1e-12)
    # The dive's fixings are undone: the next member sees the unfixed relaxation.
    _, again = _family_solve(problem, 0.0, family)
    assert again is not None and again.lp_objective == pytest.approx(plain.lp_objective,
                                                                      rel=1e-12)


@pytest.mark.parametrize("seed", range(30))
def test_family_roundings_are_never_below_brute_force(seed: int) -> None:
    rng = random.Random(1000 + seed)
    problem = _random_problem(rng)
    # The family has no aliases and forbids no pairs on separable edges: keep finite edges.
    edges = tuple(Edge(e.src, e.dst, tuple(0.0 if math.isinf(c) else c for c in e.cost))
                  for e in problem.edges)
    problem = Problem(problem.nodes, edges, followers=problem.followers)
    optimum = _optimum(problem)
    _, got = _family_solve(problem, 1.0)
    if got is None or math.isinf(optimum):
        return  # GLOP finds the member infeasible: the caller's exact solve reports it
    assert got.objective == pytest.approx(evaluate(problem, got.assignment).cost.total,
                                          rel=1e-12)
    assert got.objective >= optimum * (1 - 1e-12)
    assert got.lower_bound <= optimum * (1 + 1e-12)
    for f in problem.followers:
        assert got.assignment[f.node] == got.assignment[f.leader]
