"""Problem reduction for the intra-op ILP: follower groups, merged and folded edges, a greedy start.

Before any CP-SAT model is built, :func:`reduce_problem` rewrites a :class:`Problem` into a
smaller equivalent over follower groups:

* a follower shares its leader's strategy, so each follower group (union-find over
  ``problem.followers``, represented by its smallest node index) becomes one decision with the
  summed, salted node costs of its members;
* edges between the same two groups are summed into one matrix; an edge inside a group keeps
  only its diagonal (both ends pick the same index), added to the group's node cost;
* an edge whose matrix is additively separable over the allowed pairs (``M[i, j] = r_i + c_j``,
  e.g. all zero) is folded into the two groups' node costs plus an assignment-independent
  constant, and needs no pair variables at all;
* ``inf`` costs and aliases inside a group mark strategies as forbidden (with the constraint
  family that forbids them); aliases across groups become forbidden strategy pairs.

:func:`hint_assignment` gives the search its start: the user's hints, else
:func:`greedy_assignment`; it is also the fallback incumbent when CP-SAT finds none in time.
:data:`SALTIPLIER` and :func:`salt` are the reproducible tie-breaking applied to node costs.

Example:
    >>> from shardplan.solver.intraop.problem import Node, Problem
    >>> p = Problem((Node("a", (3.0, 1.0), (0.0, 0.0), (0.0, 0.0)),), (), time_limit_s=5)
    >>> red = reduce_problem(p)
    >>> red.allowed(0), greedy_assignment(red)
    ([0, 1], {0: 1})
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shardplan.solver.intraop.problem import Problem

__all__ = [
    "SALTIPLIER",
    "Reduced",
    "greedy_assignment",
    "hint_assignment",
    "reduce_problem",
    "salt",
]

SALTIPLIER = 1e-3
"""Tie-breaking "saltiplier" (XLA's ``saltiplier``, same value): each node's per-strategy cost
is multiplied by ``1 + SALTIPLIER * salt(name, strategy)`` with ``salt`` in ``[0, 1)``, so equal
costs differ by a reproducible ≤ 0.1 % and the solver's choice among ties does not depend on
its seed or search order (zero costs stay zero, as in XLA: ties between them are left to the
solver, which is still deterministic for a fixed seed and one worker). A plan is therefore
optimal within 0.1 % of the node costs; the reported objective is the exact, unsalted one."""


def salt(name: str, strategy: int, /) -> float:
    """The reproducible tie-breaking salt in ``[0, 1)`` of ``(node name, strategy index)``.

    A BLAKE2b hash, not Python's ``hash`` (which is randomised per process for strings).
    """
    digest = hashlib.blake2b(f"{name}\x00{strategy}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


@dataclass(frozen=True)
class Reduced:
    """The problem after merging follower groups and edges, in the problem's cost units.

    Attributes:
      root: the follower-group representative (smallest index) of each node.
      members: root -> the nodes of its group.
      cost: root -> salted objective cost per strategy (``inf`` = forbidden), folded edges in.
      plain: root -> the same without salt (for the cost cap).
      forbidden_by: root -> per strategy, the constraint families that forbid it.
      edges: (root u, root v), u < v -> matrix ``[i][j]`` of summed resharding costs.
      alias_pairs: forbidden ``(root a, i, root b, j)`` pairs across groups.
      constant: cost of folded edges that does not depend on the assignment.
      folded_edges: number of merged edges folded into node costs.
    """

    root: tuple[int, ...]
    members: Mapping[int, tuple[int, ...]]
    cost: Mapping[int, list[float]]
    plain: Mapping[int, list[float]]
    forbidden_by: Mapping[int, list[set[str]]]
    edges: Mapping[tuple[int, int], list[list[float]]]
    alias_pairs: tuple[tuple[int, int, int, int], ...]
    constant: float
    folded_edges: int

    def allowed(self, r: int) -> list[int]:
        """Strategies of group ``r`` that no constraint forbids outright."""
        return [s for s, why in enumerate(self.forbidden_by[r]) if not why]


def _follower_roots(problem: Problem) -> tuple[int, ...]:
    """The smallest node index of each node's follower group (union-find with path halving)."""
    parent = list(range(len(problem.nodes)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for f in problem.followers:
        a, b = find(f.node), find(f.leader)
        parent[max(a, b)] = min(a, b)
    return tuple(find(i) for i in range(len(problem.nodes)))


def reduce_problem(problem: Problem, /) -> Reduced:
    """Merges follower groups and edges, marks forbidden strategies, folds separable edges.

    Args:
      problem: the problem to reduce (not modified).

    Returns:
      The equivalent problem over follower groups, in the problem's cost units.
    """
    root = _follower_roots(problem)
    members: dict[int, list[int]] = {}
    for i, r in enumerate(root):
        members.setdefault(r, []).append(i)
    cost: dict[int, list[float]] = {}
    plain: dict[int, list[float]] = {}
    why: dict[int, list[set[str]]] = {}
    for r, group in members.items():
        n_s = problem.nodes[r].num_strategies
        cost[r], plain[r], why[r] = [0.0] * n_s, [0.0] * n_s, [set() for _ in range(n_s)]
        for i in group:
            node = problem.nodes[i]
            for s in range(n_s):
                c = node.compute_cost[s] + node.communication_cost[s]
                if math.isinf(c):
                    why[r][s].add("infinite_cost")
                else:
                    cost[r][s] += c * (1.0 + SALTIPLIER * salt(node.name, s))
                    plain[r][s] += c
    edges: dict[tuple[int, int], list[list[float]]] = {}
    for e in problem.edges:
        _merge_edge(problem, root, e.src, e.dst, e.cost, edges, cost, plain, why)
    alias_pairs = []
    for alias in problem.aliases:
        ra, rb, n_b = root[alias.a], root[alias.b], problem.nodes[alias.b].num_strategies
        for k, ok in enumerate(alias.allowed):
            i, j = divmod(k, n_b)
            if ok != 0:
                continue
            if ra != rb:
                alias_pairs.append((ra, i, rb, j))
            elif i == j:
                why[ra][i].add("alias")
    for r in members:
        for s, reasons in enumerate(why[r]):
            if reasons:
                cost[r][s] = plain[r][s] = math.inf
    constant, folded = _fold_separable_edges(edges, cost, plain, why)
    return Reduced(
        root,
        {r: tuple(g) for r, g in members.items()},
        cost,
        plain,
        why,
        edges,
        tuple(alias_pairs),
        constant,
        folded,
    )


def _merge_edge(
    problem: Problem,
    root: Sequence[int],
    src: int,
    dst: int,
    flat: Sequence[float],
    edges: dict[tuple[int, int], list[list[float]]],
    cost: dict[int, list[float]],
    plain: dict[int, list[float]],
    why: dict[int, list[set[str]]],
) -> None:
    """Adds one edge to the merged edge of its two groups (or to the diagonal of one group)."""
    n_src, n_dst = problem.nodes[src].num_strategies, problem.nodes[dst].num_strategies
    u, v = root[src], root[dst]
    if u == v:  # both ends pick the same index: only the diagonal can occur
        for s in range(n_src):
            c = flat[s * n_dst + s]
            if math.isinf(c):
                why[u][s].add("infinite_cost")
            else:
                cost[u][s] += c
                plain[u][s] += c
        return
    key = (min(u, v), max(u, v))
    rows, cols = (n_src, n_dst) if u < v else (n_dst, n_src)
    matrix = edges.setdefault(key, [[0.0] * cols for _ in range(rows)])
    for i in range(n_src):
        for j in range(n_dst):
            a, b = (i, j) if u < v else (j, i)
            matrix[a][b] += flat[i * n_dst + j]


def _fold_separable_edges(
    edges: dict[tuple[int, int], list[list[float]]],
    cost: dict[int, list[float]],
    plain: dict[int, list[float]],
    why: Mapping[int, list[set[str]]],
) -> tuple[float, int]:
    """Folds every edge with ``M[i][j] = r_i + c_j`` over allowed pairs into node costs.

    Returns:
      The constant part of the folded edges and how many were folded.
    """
    constant, folded = 0.0, 0
    for (u, v), m in list(edges.items()):
        rows = [i for i, w in enumerate(why[u]) if not w]
        cols = [j for j, w in enumerate(why[v]) if not w]
        if not rows or not cols:
            continue  # a dead group: reported before any model is built
        i0, j0 = rows[0], cols[0]
        r = {i: m[i][j0] for i in rows}
        c = {j: m[i0][j] - m[i0][j0] for j in cols}
        separable = all(
            not math.isinf(m[i][j]) and math.isclose(m[i][j], r[i] + c[j], rel_tol=1e-12)
            for i in rows
            for j in cols
        )
        if not separable:
            continue
        base = min(r.values())  # keep node costs non-negative: the constant takes the minimum
        constant += base
        for i in rows:
            cost[u][i] += r[i] - base
            plain[u][i] += r[i] - base
        c_min = min(c.values())
        constant += c_min
        for j in cols:
            cost[v][j] += c[j] - c_min
            plain[v][j] += c[j] - c_min
        del edges[(u, v)]
        folded += 1
    return constant, folded


def hint_assignment(problem: Problem, red: Reduced) -> dict[int, int]:
    """The user's hint, else a greedy assignment, per follower group.

    Hints only seed the search (CP-SAT repairs or drops an infeasible one) and never change the
    optimum; the hint is also the fallback incumbent when the solver finds none in time.
    """
    if problem.hints is not None:
        return {r: problem.hints[r] for r in red.members}
    return greedy_assignment(red)


def greedy_assignment(red: Reduced) -> dict[int, int]:
    """Picks, group by group in index order, the strategy cheapest given the groups before it.

    Node costs plus resharding and alias conflicts with already chosen neighbours; memory,
    departures and the cost cap are ignored (the solver repairs the hint if it breaks them).
    """
    neighbours: dict[int, list[tuple[int, list[list[float]], bool]]] = {r: [] for r in red.cost}
    for (u, v), m in red.edges.items():
        neighbours[v].append((u, m, True))  # v's strategy indexes the columns
        neighbours[u].append((v, m, False))
    forbidden_pairs: dict[int, set[tuple[int, int, int]]] = {r: set() for r in red.cost}
    for ra, i, rb, j in red.alias_pairs:
        forbidden_pairs[rb].add((ra, i, j))
        forbidden_pairs[ra].add((rb, j, i))
    chosen: dict[int, int] = {}
    for r in sorted(red.cost):
        allowed = red.allowed(r) or [0]

        def total(s: int, r: int = r) -> float:
            cost = red.cost[r][s]
            for other, m, columns in neighbours[r]:
                if other in chosen:
                    cost += m[chosen[other]][s] if columns else m[s][chosen[other]]
            if any(chosen.get(o) == i for o, i, mine in forbidden_pairs[r] if mine == s):
                return math.inf
            return cost

        chosen[r] = min(allowed, key=lambda s: (total(s), red.cost[r][s], s))
    return chosen
