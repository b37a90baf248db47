"""The intra-op ILP: one sharding strategy per node at minimum cost, solved with OR-Tools CP-SAT.

The formulation is XLA's (``auto_sharding_solver.cc``), restated for CP-SAT:

* one boolean ``x[n][s]`` per node and strategy, exactly one true per node; a follower shares
  its leader's booleans (follower groups are merged before the model is built);
* one boolean ``y[e][i, j]`` per edge and finite-cost strategy pair, with the marginal
  constraints ``sum_j y[i, j] = x_src[i]`` and ``sum_i y[i, j] = x_dst[j]`` (tight on trees);
  edges between the same two groups are summed into one, an edge inside a group keeps its
  diagonal, and an edge whose matrix is additively separable (``M[i, j] = r_i + c_j``, e.g. all
  zero) is folded into the node costs;
* ``inf`` costs are not big numbers: the strategy (pair) gets no variable or is fixed to 0;
* memory: ``live_t <= budget`` (hard), or one excess variable ``E >= live_t - budget`` for every
  step with ``overbudget_coeff * E`` in the objective (soft: the penalty is on the *maximum*
  excess over time steps, as XLA's);
* departures, the cost cap and aliases are linear constraints / binary clauses.

CP-SAT needs integer coefficients; :class:`_Scaling` documents the conversion. The returned
objective is recomputed exactly from the assignment by :func:`shardplan.solver.evaluate`.

Example:
    >>> from shardplan.solver.problem import Node, Problem
    >>> p = Problem((Node("a", (3.0, 1.0), (0.0, 0.0), (0.0, 0.0)),), (), time_limit_s=5)
    >>> solve(p).assignment
    (1,)
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ortools.sat.python import cp_model

from shardplan.errors import SolverError, format_error
from shardplan.solver.evaluate import evaluate
from shardplan.solver.problem import Problem, Solution, SolutionStatus

__all__ = [
    "COST_INT_LIMIT",
    "DEPARTURE_RESOLUTION",
    "MEMORY_UNITS_LIMIT",
    "OBJECTIVE_INT_LIMIT",
    "SALTIPLIER",
    "XLA_MAX_COST",
    "salt",
    "solve",
]

SALTIPLIER = 1e-3
"""Tie-breaking "saltiplier" (XLA's ``saltiplier``, same value): each node's per-strategy cost
is multiplied by ``1 + SALTIPLIER * salt(name, strategy)`` with ``salt`` in ``[0, 1)``, so equal
costs differ by a reproducible ≤ 0.1 % and the solver's choice among ties does not depend on
its seed or search order (zero costs stay zero, as in XLA: ties between them are left to the
solver, which is still deterministic for a fixed seed and one worker). A plan is therefore
optimal within 0.1 % of the node costs; the reported objective is the exact, unsalted one."""

XLA_MAX_COST = 1e7
"""XLA's rule: when the largest finite cost of the request (a compute, communication or
resharding entry) exceeds this, every cost is scaled down by ``XLA_MAX_COST / largest`` (ratios
kept); requests already in range are left alone."""

COST_INT_LIMIT = 10**9
"""Integer resolution: after XLA's rule the costs are multiplied by the largest power of ten
that keeps the largest coefficient ≤ this, then rounded half-to-even (Python's ``round``, the
same on every platform). Costs with few decimals convert exactly; otherwise each coefficient
has a relative rounding error ≤ 5e-10 of the largest."""

OBJECTIVE_INT_LIMIT = 10**18
"""The worst-case integer objective must stay below this (CP-SAT's int64 arithmetic); the
power of ten of :data:`COST_INT_LIMIT` is lowered until it does."""

MEMORY_UNITS_LIMIT = 2**30
"""Memory is counted in units of ``2**k`` bytes, the smallest that keeps every time step's
largest possible live memory ≤ this many units (1 byte for all but >1 GiB steps). Strategy
memory is rounded up and the budget down, so a plan the solver accepts fits for certain."""

DEPARTURE_RESOLUTION = 10**6
"""Departure costs are counted in millionths (exact for XLA's 0/1 departure costs)."""

_FAMILIES = ("infinite_cost", "follower", "alias", "memory", "max_departures", "max_cost")


def salt(name: str, strategy: int, /) -> float:
    """The reproducible tie-breaking salt in ``[0, 1)`` of ``(node name, strategy index)``.

    A BLAKE2b hash, not Python's ``hash`` (which is randomised per process for strings).
    """
    digest = hashlib.blake2b(f"{name}\x00{strategy}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


# --------------------------------------------------------------------------- reduction


@dataclass(frozen=True)
class _Reduced:
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


def _reduce(problem: Problem) -> _Reduced:
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
    return _Reduced(
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


# --------------------------------------------------------------------------- scaling


@dataclass(frozen=True)
class _Scaling:
    """How costs and bytes become CP-SAT integers.

    Attributes:
      cost_scale: XLA's factor (≤ 1) applied to every cost.
      int_per_unit: integer units per scaled cost unit (a power of ten).
      memory_quantum_bytes: bytes per memory unit (a power of two).
      penalty_int: soft mode: integer objective per memory unit of peak excess.
      penalty_exact_int: the same without the cap (used by the cost-cap constraint).
      penalty_capped: the penalty was capped just above the whole cost span, which makes soft
        memory lexicographic (excess first) exactly when the true coefficient is that large.
    """

    cost_scale: float
    int_per_unit: float
    memory_quantum_bytes: int
    penalty_int: int
    penalty_exact_int: int
    penalty_capped: bool

    def to_int(self, cost: float) -> int:
        """A cost in problem units as an integer coefficient."""
        return round(cost * self.cost_scale * self.int_per_unit)

    @property
    def resolution(self) -> float:
        """Problem cost units per integer unit."""
        return 1.0 / (self.cost_scale * self.int_per_unit)


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if not math.isinf(v)]


def _memory_bounds(problem: Problem) -> tuple[int, int]:
    """The memory quantum and the largest possible excess in memory units."""
    if problem.memory_budget_bytes is None or not problem.liveness:
        return 1, 0
    nodes = problem.nodes
    worst = max(sum(max(nodes[i].memory_bytes) for i in step) for step in problem.liveness)
    quantum = 1
    while worst / quantum > MEMORY_UNITS_LIMIT:
        quantum *= 2
    worst_units = max(
        sum(math.ceil(max(nodes[i].memory_bytes) / quantum) for i in step)
        for step in problem.liveness
    )
    return quantum, max(0, worst_units - math.floor(problem.memory_budget_bytes / quantum))


def _scaling(problem: Problem, red: _Reduced) -> _Scaling:
    raw = [c for n in problem.nodes for c in (*n.compute_cost, *n.communication_cost)]
    raw += [c for e in problem.edges for c in e.cost]
    largest_raw = max(_finite(raw), default=0.0)
    cost_scale = XLA_MAX_COST / largest_raw if largest_raw > XLA_MAX_COST else 1.0
    coefficients = [c for costs in red.cost.values() for c in _finite(costs)]
    coefficients += [c for m in red.edges.values() for row in m for c in _finite(row)]
    largest = max(coefficients, default=0.0)
    k = 0 if largest == 0.0 else math.floor(math.log10(COST_INT_LIMIT / (largest * cost_scale)))
    k = min(k, 300)  # costs below 1e-291 are zero for every practical purpose
    while largest * cost_scale * 10.0**k > COST_INT_LIMIT:
        k -= 1
    quantum, excess_units = _memory_bounds(problem)
    soft = problem.memory_mode == "soft" and problem.memory_budget_bytes is not None
    while True:
        per_unit = 10.0**k
        ints = [
            [round(c * cost_scale * per_unit) for c in _finite(costs)]
            for costs in red.cost.values()
        ]
        ints += [
            [round(c * cost_scale * per_unit) for row in m for c in _finite(row)]
            for m in red.edges.values()
        ]
        # CP-SAT bounds a linear expression by the sum of all its coefficients' magnitudes.
        worst = sum(sum(g) for g in ints) + abs(round(red.constant * cost_scale * per_unit))
        span = sum(max(g, default=0) - min(g, default=0) for g in ints)
        exact = round(problem.overbudget_coeff * cost_scale * per_unit * quantum) if soft else 0
        penalty = min(exact, span + 1)
        if worst + penalty * excess_units <= OBJECTIVE_INT_LIMIT or k < -300:
            return _Scaling(cost_scale, per_unit, quantum, penalty, exact, penalty < exact)
        k -= 1


# --------------------------------------------------------------------------- model


@dataclass
class _Model:
    """A built CP-SAT model and the variables needed to read a solution back."""

    model: cp_model.CpModel
    x: dict[int, list[Any]]
    stats: dict[str, Any]


def _build(
    problem: Problem,
    red: _Reduced,
    scaling: _Scaling,
    *,
    families: frozenset[str],
    with_objective: bool = True,
    hint: Mapping[int, int] | None = None,
) -> _Model:
    """Builds the CP-SAT model with the constraint ``families`` given.

    Kept as one function (longer than the usual ~60 lines) because the variables, the objective
    terms and the cost-cap expression are built side by side from the same loops; splitting it
    would pass half a dozen accumulators between helpers.
    """
    model = cp_model.CpModel()
    x: dict[int, list[Any]] = {}
    obj_vars: list[Any] = []
    obj_coefs: list[int] = []
    cap_coefs: list[int] = []
    for r in red.members:
        x[r] = [model.new_bool_var(f"x{r}_{s}") for s in range(len(red.cost[r]))]
        model.add_exactly_one(x[r])
        for s, var in enumerate(x[r]):
            if red.forbidden_by[r][s]:
                model.add(var == 0)
            else:
                obj_vars.append(var)
                obj_coefs.append(scaling.to_int(red.cost[r][s]))
                cap_coefs.append(scaling.to_int(red.plain[r][s]))
    edge_vars = 0
    for (u, v), m in red.edges.items():
        row_terms: dict[int, list[Any]] = {i: [] for i in red.allowed(u)}
        col_terms: dict[int, list[Any]] = {j: [] for j in red.allowed(v)}
        for i in row_terms:
            for j in col_terms:
                if math.isinf(m[i][j]):
                    continue
                y = model.new_bool_var(f"y{u}_{i}_{v}_{j}")
                row_terms[i].append(y)
                col_terms[j].append(y)
                obj_vars.append(y)
                obj_coefs.append(scaling.to_int(m[i][j]))
                cap_coefs.append(obj_coefs[-1])
                edge_vars += 1
        for lhs, marginals in ((x[u], row_terms), (x[v], col_terms)):
            for k, terms in marginals.items():
                model.add(cp_model.LinearExpr.sum(terms) == lhs[k])
    if "alias" in families:
        for ra, i, rb, j in red.alias_pairs:
            model.add_bool_or([x[ra][i].Not(), x[rb][j].Not()])
    if "max_departures" in families and problem.max_departures is not None:
        _add_departures(problem, red, model, x)
    excess = _add_memory(problem, red, scaling, model, x, families)
    constant = scaling.to_int(red.constant)
    if "max_cost" in families and problem.max_cost is not None:
        _add_cost_cap(problem, scaling, model, obj_vars, cap_coefs, constant, excess)
    if with_objective:
        terms, coefs = list(obj_vars), list(obj_coefs)
        if excess is not None and scaling.penalty_int:
            terms.append(excess)
            coefs.append(scaling.penalty_int)
        model.minimize(cp_model.LinearExpr.weighted_sum(terms, coefs) + constant)
    if hint is not None:
        for r, var_list in x.items():
            for s, var in enumerate(var_list):
                model.add_hint(var, s == hint[r])
    stats = {"node_variables": sum(len(v) for v in x.values()), "edge_variables": edge_vars}
    return _Model(model, x, stats)


def _add_departures(
    problem: Problem, red: _Reduced, model: cp_model.CpModel, x: Mapping[int, list[Any]]
) -> None:
    terms, coefs = [], []
    per_node = [n.departure_cost for n in problem.nodes]
    for r, group in red.members.items():
        for s, var in enumerate(x[r]):
            d = math.fsum(dep[s] for i in group if (dep := per_node[i]) is not None)
            if d:
                terms.append(var)
                coefs.append(round(d * DEPARTURE_RESOLUTION))
    limit = round(float(problem.max_departures or 0) * DEPARTURE_RESOLUTION)
    model.add(cp_model.LinearExpr.weighted_sum(terms, coefs) <= limit)


def _add_memory(
    problem: Problem,
    red: _Reduced,
    scaling: _Scaling,
    model: cp_model.CpModel,
    x: Mapping[int, list[Any]],
    families: frozenset[str],
) -> Any:
    """Adds the memory constraints; returns the soft-mode excess variable (or ``None``)."""
    budget_bytes = problem.memory_budget_bytes
    soft = problem.memory_mode == "soft"
    if budget_bytes is None or not problem.liveness or (not soft and "memory" not in families):
        return None
    q = scaling.memory_quantum_bytes
    budget = math.floor(budget_bytes / q)
    steps = []
    for step in problem.liveness:
        per_var: dict[Any, int] = {}
        for i in step:
            r = red.root[i]
            for s, m in enumerate(problem.nodes[i].memory_bytes):
                units = math.ceil(m / q)
                if units and not red.forbidden_by[r][s]:
                    per_var[x[r][s]] = per_var.get(x[r][s], 0) + units
        worst = sum(max(math.ceil(m / q) for m in problem.nodes[i].memory_bytes) for i in step)
        if worst > budget:
            steps.append(cp_model.LinearExpr.weighted_sum(list(per_var), list(per_var.values())))
    if not soft:
        for live in steps:
            model.add(live <= budget)
        return None
    upper = (
        max(
            (
                sum(max(math.ceil(m / q) for m in problem.nodes[i].memory_bytes) for i in st)
                for st in problem.liveness
            ),
            default=0,
        )
        - budget
    )
    excess = model.new_int_var(0, max(0, upper), "memory_excess")
    for live in steps:
        model.add(excess >= live - budget)
    return excess


def _add_cost_cap(
    problem: Problem,
    scaling: _Scaling,
    model: cp_model.CpModel,
    terms: list[Any],
    coefs: list[int],
    constant: int,
    excess: Any,
) -> None:
    """Adds ``unsalted objective <= max_cost`` (skipped when no assignment can exceed it)."""
    cap = math.floor((problem.max_cost or 0.0) * scaling.cost_scale * scaling.int_per_unit)
    terms, coefs = list(terms), list(coefs)
    if excess is not None and scaling.penalty_exact_int:
        if scaling.penalty_exact_int > cap:
            model.add(excess == 0)
        else:
            # P * E <= cap is implied by the cap (other terms are >= 0); bounding E first keeps
            # the constraint's activity inside int64.
            model.add(excess <= cap // scaling.penalty_exact_int)
            terms.append(excess)
            coefs.append(scaling.penalty_exact_int)
    if cap >= OBJECTIVE_INT_LIMIT:
        return
    model.add(cp_model.LinearExpr.weighted_sum(terms, coefs) + constant <= cap)


def _hint(problem: Problem, red: _Reduced) -> dict[int, int]:
    """The user's hint, else a greedy assignment, per follower group.

    Hints only seed the search (CP-SAT repairs or drops an infeasible one) and never change the
    optimum; the hint is also the fallback incumbent when the solver finds none in time.
    """
    if problem.hints is not None:
        return {r: problem.hints[r] for r in red.members}
    return _greedy_assignment(red)


def _greedy_assignment(red: _Reduced) -> dict[int, int]:
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


# --------------------------------------------------------------------------- solving


def _run(built: _Model, problem: Problem, time_limit_s: float) -> tuple[Any, cp_model.CpSolver]:
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.max_time_in_seconds = max(time_limit_s, 1e-3)
    params.random_seed = problem.seed
    params.num_workers = problem.workers
    params.interleave_search = False
    params.log_search_progress = False
    # With one worker CP-SAT's default LP holds only part of the marginal constraints; the full
    # relaxation is integral on chains and trees, and measured on 300-node random chains it
    # turns "feasible, 31 % gap after 5 s" into "optimal in ~2 s".
    params.linearization_level = 2
    status = solver.solve(built.model)
    if status == cp_model.MODEL_INVALID:
        raise SolverError(
            format_error(
                "CP-SAT rejected the model: " + built.model.validate(),
                where=f"Problem {problem.name!r}",
                remedy="report this as a shardplan bug",
            )
        )
    return status, solver


def _decode(
    problem: Problem, red: _Reduced, built: _Model, solver: cp_model.CpSolver
) -> tuple[int, ...]:
    choice = {
        r: next(s for s, v in enumerate(vs) if solver.boolean_value(v)) for r, vs in built.x.items()
    }
    return tuple(choice[red.root[i]] for i in range(len(problem.nodes)))


def _dead_group(problem: Problem, red: _Reduced) -> dict[str, Any] | None:
    """Finds a follower group with no allowed strategy: infeasible without any solve."""
    for r, group in red.members.items():
        if red.allowed(r):
            continue
        reasons = set().union(*red.forbidden_by[r])
        names = ", ".join(repr(problem.nodes[i].name) for i in group)
        if len(group) > 1:
            reasons.add("follower")
        return {
            "infeasible_because": [f for f in _FAMILIES if f in reasons],
            "infeasible_detail": f"no strategy is allowed for nodes {names} "
            f"(forbidden by {', '.join(sorted(reasons))})",
        }
    return None


def _diagnose(
    problem: Problem, red: _Reduced, scaling: _Scaling, deadline: float
) -> dict[str, Any]:
    """Names the constraint families that make the problem infeasible, by cheap re-solves."""
    optional = [
        f
        for f, on in (
            ("memory", problem.memory_mode == "hard" and problem.memory_budget_bytes is not None),
            ("max_departures", problem.max_departures is not None),
            ("max_cost", problem.max_cost is not None),
        )
        if on
    ]
    solves = 2 + len(optional)

    def infeasible(families: frozenset[str]) -> bool | None:
        nonlocal solves
        budget = max(0.05, (deadline - time.perf_counter()) / max(solves, 1))
        solves -= 1
        built = _build(problem, red, scaling, families=families, with_objective=False)
        status, _ = _run(built, problem, budget)
        return None if status == cp_model.UNKNOWN else status == cp_model.INFEASIBLE

    base: frozenset[str] = frozenset()
    if infeasible(base):
        return {
            "infeasible_because": ["infinite_cost"] + (["follower"] if problem.followers else []),
            "infeasible_detail": "the forbidden (infinite-cost) strategies and pairs leave "
            "no assignment",
        }
    if red.alias_pairs and infeasible(base | {"alias"}):
        return {
            "infeasible_because": ["alias"],
            "infeasible_detail": "the aliases forbid every assignment the finite costs allow",
        }
    base |= {"alias"}
    culprits = [f for f in optional if infeasible(base | {f})]
    because = culprits or optional
    detail = [_memory_detail(problem)] if "memory" in because else []
    if "max_cost" in because:
        detail.append(f"max_cost {problem.max_cost:,.6g} is below every allowed plan's cost")
    if "max_departures" in because:
        detail.append(f"max_departures {problem.max_departures} is too few")
    if not culprits:
        detail.append("no single family is infeasible alone; their combination is")
    return {"infeasible_because": because, "infeasible_detail": "; ".join(detail)}


def _memory_detail(problem: Problem) -> str:
    budget = problem.memory_budget_bytes or 0.0
    for t, step in enumerate(problem.liveness):
        least = sum(min(problem.nodes[i].memory_bytes) for i in step)
        if least > budget:
            return (
                f"time step {t} needs at least {least:,.0f} bytes > budget {budget:,.0f} "
                f"bytes even with the smallest strategies"
            )
    return f"no allowed plan keeps every time step within {budget:,.0f} bytes"


_STATUS: dict[Any, SolutionStatus] = {
    cp_model.OPTIMAL: "optimal",
    cp_model.FEASIBLE: "feasible",
    cp_model.INFEASIBLE: "infeasible",
    cp_model.UNKNOWN: "timeout_no_solution",
}


def solve(problem: Problem, /) -> Solution:
    """Solves the intra-op sharding problem with CP-SAT (a pure function of ``problem``).

    Args:
      problem: the problem; ``time_limit_s``, ``seed`` and ``workers`` configure the solver.

    Returns:
      The solution. ``objective`` is the exact cost of the assignment in the problem's units;
      ``stats["infeasible_because"]`` names the constraint families at fault when infeasible.

    Raises:
      SolverError: CP-SAT rejected the model (a bug in this module).
    """
    start = time.perf_counter()
    red = _reduce(problem)
    dead = _dead_group(problem, red)
    if dead is not None:
        stats = {"solver": "cp-sat", **dead}
        return _no_plan("infeasible", time.perf_counter() - start, stats)
    scaling = _scaling(problem, red)
    hint = _hint(problem, red)
    built = _build(problem, red, scaling, families=frozenset(_FAMILIES), hint=hint)
    stats = _model_stats(red, scaling, built)
    status, solver = _run(built, problem, problem.time_limit_s)
    stats.update(
        cp_sat_status=solver.status_name(status),
        branches=solver.num_branches,
        conflicts=solver.num_conflicts,
        deterministic_time=solver.deterministic_time,
    )
    result = _STATUS[status]
    if result == "infeasible":
        stats.update(_diagnose(problem, red, scaling, start + problem.time_limit_s))
    if result == "timeout_no_solution":
        return _hint_or_nothing(problem, red, hint, start, stats)
    if result == "infeasible":
        return _no_plan(result, time.perf_counter() - start, stats)
    assignment = _decode(problem, red, built, solver)
    evaluation = evaluate(problem, assignment)
    if evaluation.violations:  # only integer rounding at the cost cap can cause this
        stats["evaluator_violations"] = [v.detail for v in evaluation.violations]
    obj_int, bound_int = solver.objective_value, solver.best_objective_bound
    gap = 0.0 if result == "optimal" else max(0.0, (obj_int - bound_int) / max(abs(obj_int), 1.0))
    stats.update(objective_int=int(obj_int), bound_int=int(bound_int))
    objective = evaluation.cost.total
    return Solution(
        status=result,
        assignment=assignment,
        objective=objective,
        best_bound=objective * (1.0 - gap),
        gap=gap,
        solve_time_s=time.perf_counter() - start,
        stats=stats,
    )


def _no_plan(status: SolutionStatus, solve_time_s: float, stats: dict[str, Any]) -> Solution:
    return Solution(status, None, None, None, None, solve_time_s, stats)


def _hint_or_nothing(
    problem: Problem, red: _Reduced, hint: Mapping[int, int], start: float, stats: dict[str, Any]
) -> Solution:
    """On a time-out without a solver incumbent, returns the hint if the evaluator accepts it.

    Its gap comes from the evaluator's assignment-independent lower bound (exact, in problem
    units), as the solver proved no bound of its own.
    """
    assignment = tuple(hint[red.root[i]] for i in range(len(problem.nodes)))
    evaluation = evaluate(problem, assignment)
    if not evaluation.feasible:
        return _no_plan("timeout_no_solution", time.perf_counter() - start, stats)
    objective, bound = (
        evaluation.cost.total,
        min(evaluation.lower_bound.total, evaluation.cost.total),
    )
    gap = (objective - bound) / objective if objective > 0 else 0.0
    stats["incumbent"] = "hint" if problem.hints is not None else "greedy"
    return Solution(
        status="feasible",
        assignment=assignment,
        objective=objective,
        best_bound=bound,
        gap=gap,
        solve_time_s=time.perf_counter() - start,
        stats=stats,
    )


def _model_stats(red: _Reduced, scaling: _Scaling, built: _Model) -> dict[str, Any]:
    """Model size and the integer conversion, JSON-native."""
    proto = built.model.proto
    return {
        "solver": "cp-sat",
        "variables": len(proto.variables),
        "constraints": len(proto.constraints),
        **built.stats,
        "merged_edges": len(red.edges),
        "folded_edges": red.folded_edges,
        "cost_scale": scaling.cost_scale,
        "cost_resolution": scaling.resolution,
        "memory_quantum_bytes": scaling.memory_quantum_bytes,
        "penalty_capped": scaling.penalty_capped,
    }
