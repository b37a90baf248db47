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

The problem reduction (follower groups, merged and folded edges, the greedy start) lives in
:mod:`shardplan.solver.intraop.reduce`; CP-SAT needs integer coefficients and
:mod:`shardplan.solver.intraop.scaling` documents the conversion. This module builds the model, solves
it and diagnoses infeasibility. The returned objective is recomputed exactly from the
assignment by :func:`shardplan.solver.intraop.evaluate`.

:data:`SALTIPLIER`, :func:`salt` and the scaling limits are re-exported here from the modules
that define them.

Example:
    >>> from shardplan.solver.intraop.problem import Node, Problem
    >>> p = Problem((Node("a", (3.0, 1.0), (0.0, 0.0), (0.0, 0.0)),), (), time_limit_s=5)
    >>> solve(p).assignment
    (1,)
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from ortools.linear_solver import pywraplp
from ortools.sat.python import cp_model

from shardplan.errors import SolverError, format_error
from shardplan.solver.intraop.evaluate import evaluate
from shardplan.solver.intraop.problem import Problem, Solution, SolutionStatus
from shardplan.solver.intraop.reduce import (
    SALTIPLIER,
    Reduced,
    hint_assignment,
    reduce_problem,
    salt,
)
from shardplan.solver.intraop.rounding import Rounded, round_relaxation
from shardplan.solver.intraop.scaling import (
    COST_INT_LIMIT,
    MEMORY_UNITS_LIMIT,
    OBJECTIVE_INT_LIMIT,
    XLA_MAX_COST,
    Scaling,
    choose_scaling,
)

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

DEPARTURE_RESOLUTION = 10**6
"""Departure costs are counted in millionths (exact for XLA's 0/1 departure costs)."""

_FAMILIES = ("infinite_cost", "follower", "alias", "memory", "max_departures", "max_cost")


# --------------------------------------------------------------------------- model


@dataclass
class _Model:
    """A built CP-SAT model and the variables needed to read a solution back."""

    model: cp_model.CpModel
    x: dict[int, list[Any]]
    stats: dict[str, Any]
    exact_objective: dict[int, float]
    """Objective coefficient per variable index in problem units before integer rounding (the
    LP relaxation uses these: rounding creates exact ties, and ties fractional optima)."""


def _build(
    problem: Problem,
    red: Reduced,
    scaling: Scaling,
    *,
    families: frozenset[str],
    with_objective: bool = True,
    hint: Mapping[int, int] | None = None,
) -> _Model:
    """Builds the CP-SAT model with the constraint ``families`` given."""
    model = cp_model.CpModel()
    terms = _Terms([], [], [], {})
    x: dict[int, list[Any]] = {}
    for r in red.members:
        x[r] = [model.new_bool_var(f"x{r}_{s}") for s in range(len(red.cost[r]))]
        model.add_exactly_one(x[r])
        for s, var in enumerate(x[r]):
            if red.forbidden_by[r][s]:
                model.add(var == 0)
            else:
                terms.add(var, scaling.to_int(red.cost[r][s]), red.cost[r][s],
                          scaling.to_int(red.plain[r][s]))
    edge_vars = 0
    for (u, v), m in red.edges.items():
        edge_vars += _add_edge(model, red, scaling, x, terms, u, v, m)
    if "alias" in families:
        for ra, i, rb, j in red.alias_pairs:
            model.add_bool_or([x[ra][i].Not(), x[rb][j].Not()])
    if "max_departures" in families and problem.max_departures is not None:
        _add_departures(problem, red, model, x)
    excess = _add_memory(problem, red, scaling, model, x, families)
    constant = scaling.to_int(red.constant)
    if "max_cost" in families and problem.max_cost is not None:
        _add_cost_cap(problem, scaling, model, terms.obj_vars, terms.cap_coefs, constant, excess)
    exact = terms.exact
    if with_objective:
        obj_terms, coefs = list(terms.obj_vars), list(terms.obj_coefs)
        if excess is not None and scaling.penalty_int:
            obj_terms.append(excess)
            coefs.append(scaling.penalty_int)
            exact[excess.index] = scaling.penalty_int / (scaling.cost_scale * scaling.int_per_unit)
        model.minimize(cp_model.LinearExpr.weighted_sum(obj_terms, coefs) + constant)
    if hint is not None:
        for r, var_list in x.items():
            for s, var in enumerate(var_list):
                model.add_hint(var, s == hint[r])
    stats = {"node_variables": sum(len(v) for v in x.values()), "edge_variables": edge_vars}
    return _Model(model, x, stats, exact)


@dataclass(frozen=True)
class _Terms:
    """The objective's terms as the model is built: integer, exact and cost-cap coefficients.

    ``exact`` becomes ``_Model.exact_objective``.
    """

    obj_vars: list[Any]
    obj_coefs: list[int]
    cap_coefs: list[int]
    exact: dict[int, float]

    def add(self, var: Any, coef: int, exact: float, cap_coef: int) -> None:
        """Adds ``var``'s term."""
        self.obj_vars.append(var)
        self.obj_coefs.append(coef)
        self.exact[var.index] = exact
        self.cap_coefs.append(cap_coef)


def _add_edge(model: cp_model.CpModel, red: Reduced, scaling: Scaling,
              x: Mapping[int, list[Any]], terms: _Terms, u: int, v: int,
              m: list[list[float]]) -> int:
    """Adds the pair variables of merged edge ``(u, v)`` and their marginals; how many.

    One variable per (row class, column class) of ``m`` with a finite cost.
    """
    rows, cols = _classes(m, red.allowed(u), red.allowed(v))
    row_terms: dict[int, list[Any]] = {a: [] for a in range(len(rows))}
    col_terms: dict[int, list[Any]] = {b: [] for b in range(len(cols))}
    added = 0
    for a, row in enumerate(rows):
        for b, col in enumerate(cols):
            c = m[row[0]][col[0]]
            if math.isinf(c):
                continue
            y = model.new_bool_var(f"y{u}_{a}_{v}_{b}")
            row_terms[a].append(y)
            col_terms[b].append(y)
            coef = scaling.to_int(c)
            terms.add(y, coef, c, coef)
            added += 1
    for lhs, classes, marginals in ((x[u], rows, row_terms), (x[v], cols, col_terms)):
        for k, class_terms in marginals.items():
            model.add(cp_model.LinearExpr.sum(class_terms)
                      == cp_model.LinearExpr.sum([lhs[i] for i in classes[k]]))
    return added


def _classes(m: list[list[float]], rows: list[int], cols: list[int]
             ) -> tuple[list[list[int]], list[list[int]]]:
    """Groups an edge matrix's allowed rows with equal entries, then its columns likewise.

    Pair variables are made per (row class, column class) with the marginals summed over each
    class: exact (one strategy per node picks one class on each side, and every pair in a class
    pair costs the same) and much smaller, since many strategies of a node produce or read the
    same sharding of the value on the edge.
    """
    by_row: dict[tuple[float, ...], list[int]] = {}
    for i in rows:
        by_row.setdefault(tuple(m[i][j] for j in cols), []).append(i)
    row_classes = list(by_row.values())
    by_col: dict[tuple[float, ...], list[int]] = {}
    for j in cols:
        by_col.setdefault(tuple(m[r[0]][j] for r in row_classes), []).append(j)
    return row_classes, list(by_col.values())


def _add_departures(
    problem: Problem, red: Reduced, model: cp_model.CpModel, x: Mapping[int, list[Any]]
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
    red: Reduced,
    scaling: Scaling,
    model: cp_model.CpModel,
    x: Mapping[int, list[Any]],
    families: frozenset[str],
) -> Any:
    """Adds the memory constraints; returns the soft-mode excess variable (or ``None``)."""
    budget_bytes = problem.memory_budget_bytes
    soft = problem.memory_mode == "soft"
    memory_steps = problem.memory_steps()
    if budget_bytes is None or not memory_steps or (not soft and "memory" not in families):
        return None
    q = scaling.memory_quantum_bytes
    budget = math.floor(budget_bytes / q)
    steps = []
    worst_steps = []

    def linear(terms: Any) -> tuple[dict[Any, int], int]:
        """The terms in memory units by variable, and their largest value."""
        per_var: dict[Any, int] = {}
        for i, coefficients in terms:
            r = red.root[i]
            for s, m in enumerate(coefficients):
                units = math.ceil(m / q)
                if units and not red.forbidden_by[r][s]:
                    per_var[x[r][s]] = per_var.get(x[r][s], 0) + units
        worst = sum(max(math.ceil(m / q) for m in c) for _, c in terms)
        return per_var, worst

    for c, cut in enumerate(memory_steps):
        per_var, worst = linear(cut.terms)
        fixed_units = math.ceil(cut.fixed_bytes / q)
        parts = []
        for p, (reader, needed, holder, held) in enumerate(cut.copies):
            rr, rh = red.root[reader], red.root[holder]
            units = [math.ceil(m / q) for m in needed]
            top = max(units)
            if top <= 0:
                continue
            # z >= needed[s] for the reader's s and the holder's t with needed[s] > held[t]:
            # for each t, z >= sum(needed[s] x[reader, s] over those s) - top (1 - x[holder, t]).
            z = model.new_int_var(0, top, f"memory_copy_{c}_{p}")
            for t, h in enumerate(held):
                if red.forbidden_by[rh][t]:
                    continue
                more = {s: u for s, u in enumerate(units)
                        if needed[s] > h and u and not red.forbidden_by[rr][s]}
                if more:
                    model.add(z >= cp_model.LinearExpr.weighted_sum(
                        [x[rr][s] for s in more], list(more.values())) - top
                        + top * x[rh][t])
            parts.append(z)
            worst += top
        worst += fixed_units
        worst_steps.append(worst)
        if worst > budget:
            steps.append(fixed_units + sum(parts) + cp_model.LinearExpr.weighted_sum(
                list(per_var), list(per_var.values())))
    if not soft:
        for live in steps:
            model.add(live <= budget)
        return None
    excess = model.new_int_var(0, max(0, max(worst_steps) - budget), "memory_excess")
    for live in steps:
        model.add(excess >= live - budget)
    return excess


def _add_cost_cap(
    problem: Problem,
    scaling: Scaling,
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


# --------------------------------------------------------------------------- LP first
# (The module passes 600 lines with the memory cuts' copy terms; the LP-first path below, the
# relaxation and its rounding, is self-contained and is the piece to move to its own module.)

LP_INTEGRALITY_TOLERANCE = 1e-6
"""A strategy boolean whose relaxed value is within this of 0 or 1 counts as integral."""


def _bound(value: int, lp: pywraplp.Solver) -> float:
    """A CP-SAT domain end as an LP bound (its int64 extremes mean unbounded)."""
    if value <= cp_model.INT_MIN:
        return -lp.infinity()
    if value >= cp_model.INT_MAX:
        return lp.infinity()
    return float(value)


@dataclass(frozen=True)
class _Relaxed:
    """The LP relaxation's optimum.

    Attributes:
      marginals: root -> the relaxed value of each strategy.
      integral: whether every value is within :data:`LP_INTEGRALITY_TOLERANCE` of 0 or 1.
      bound: the optimum in problem units without the folded constant (a lower bound on
        every assignment's salted cost).
    """

    marginals: dict[int, list[float]]
    integral: bool
    bound: float

    def argmax(self) -> dict[int, int]:
        """Per root, the strategy of largest relaxed value (the lower index on ties)."""
        # (max over indices keeps the first of equal values: the lower index.)
        return {r: max(range(len(q)), key=q.__getitem__) for r, q in self.marginals.items()}


GLOP_PARAMETERS = "use_preprocessing: false use_dual_simplex: true"
"""As :data:`shardplan.solver.intraop.family.GLOP_PARAMETERS`: without presolve GLOP keeps its basis
across bound changes, so a dive's re-solve (:mod:`shardplan.solver.intraop.rounding`) takes tens of
pivots (~15 ms on a GPT block) instead of the first solve's ~1,600."""


class _Relaxation:
    """The model's LP relaxation in GLOP, re-solvable with groups fixed (from the last basis).

    Built by :func:`_lp_relaxation`.
    """

    def __init__(self, built: _Model, lp: pywraplp.Solver, variables: list[Any],
                 objective: Any) -> None:
        self._x = {r: [variables[x.index] for x in xs] for r, xs in built.x.items()}
        self._lp, self._objective = lp, objective
        self._fixed: list[Any] = []

    def solve(self, fixings: Mapping[int, int] | None = None) -> _Relaxed | None:
        """The relaxed optimum with ``{root: strategy}`` fixed (None: not optimal)."""
        for var in self._fixed:
            var.SetLb(0.0)
        self._fixed = [self._x[r][s] for r, s in (fixings or {}).items()]
        for var in self._fixed:
            var.SetLb(1.0)
        if self._lp.Solve() != pywraplp.Solver.OPTIMAL:
            return None
        marginals = {r: [var.solution_value() for var in xs] for r, xs in self._x.items()}
        integral = all(not LP_INTEGRALITY_TOLERANCE < q < 1 - LP_INTEGRALITY_TOLERANCE
                       for values in marginals.values() for q in values)
        return _Relaxed(marginals, integral, self._objective.Value())


def _lp_relaxation(built: _Model) -> _Relaxation | None:
    """The model's LP relaxation in GLOP, or None if it has a constraint this does not
    translate.

    The relaxation of the marginal formulation is integral on chains and trees and, measured on
    traced train steps (transformer blocks with residual and attention fan-out), integral on
    their DAGs too unless a memory budget binds (a knapsack) or symmetric strategies split
    (:mod:`shardplan.solver.intraop.rounding`). An integral relaxed optimum is an optimum of the ILP
    (its value bounds the ILP's from below and the point is feasible), so CP-SAT is only needed
    when the relaxation is fractional and its rounding is not within the problem's
    ``relative_gap``. GLOP is a deterministic simplex: the result does not depend on time
    limits or threads. The model's booleans become ``[0, 1]`` variables and every constraint
    (linear, exactly-one, a clause ``¬a ∨ ¬b``) its linear form; costs are the unrounded ones
    (integer rounding creates exact ties, and ties fractional optima).
    """
    proto = built.model.proto
    lp = pywraplp.Solver.CreateSolver("GLOP")
    if lp is None:  # pragma: no cover - GLOP ships in every ortools wheel
        return None
    lp.SetNumThreads(1)
    lp.SetSolverSpecificParametersAsString(GLOP_PARAMETERS)
    # (The proto's repeated fields do not support negative indexing: copy them to lists.)
    domains = [list(var.domain) for var in proto.variables]
    v = [lp.NumVar(float(d[0]), float(d[-1]), "") for d in domains]

    def literal(ref: int) -> tuple[Any, float, float]:  # (variable, coefficient, constant)
        return (v[ref], 1.0, 0.0) if ref >= 0 else (v[-ref - 1], -1.0, 1.0)

    for c in proto.constraints:
        if c.has_linear():
            domain = list(c.linear.domain)
            if len(domain) != 2:
                return None
            row = lp.Constraint(_bound(domain[0], lp), _bound(domain[1], lp))
            for ref, coef in zip(c.linear.vars, c.linear.coeffs, strict=True):
                row.SetCoefficient(v[ref], float(coef))
        elif c.has_exactly_one():
            row = lp.Constraint(1.0, 1.0)
            for ref in c.exactly_one.literals:
                row.SetCoefficient(v[ref], 1.0)
        elif c.has_bool_or():  # sum of literals >= 1
            terms = [literal(ref) for ref in c.bool_or.literals]
            row = lp.Constraint(1.0 - sum(k for _, _, k in terms), lp.infinity())
            for var, coef, _ in terms:
                row.SetCoefficient(var, coef)
        else:
            return None
    objective = lp.Objective()
    for ref, coef in built.exact_objective.items():
        objective.SetCoefficient(v[ref], coef)
    objective.SetMinimization()
    return _Relaxation(built, lp, v, objective)


def _from_relaxation(problem: Problem, red: Reduced, relaxation: _Relaxation,
                     relaxed: _Relaxed, stats: dict[str, Any],
                     start: float) -> Solution | dict[int, int] | None:
    """The relaxed optimum's rounding as the solution, when it is proven close enough.

    An integral optimum is optimal. A fractional one is rounded to the largest value per group
    and by :func:`~shardplan.solver.intraop.rounding.round_relaxation` (diving on ``relaxation`` when
    ``problem.relative_gap`` allows a rounding at all); the cheaper rounding the evaluator
    finds feasible is accepted when within ``problem.relative_gap`` of the relaxation's bound.
    Otherwise it is returned (per root) as CP-SAT's hint, or None when none is feasible.
    """
    # The relaxation bounds the salted objective; salt adds at most SALTIPLIER to costs.
    lower = (relaxed.bound + red.constant) / (1.0 + SALTIPLIER)
    candidates = [("argmax", relaxed.argmax())]
    if not relaxed.integral:
        rounded = _round(red, relaxation, relaxed, lower, problem.relative_gap)
        if rounded is not None:
            dives = (f", {rounded.dives} dives, {rounded.resolves} re-solves"
                     if rounded.resolves else "")
            candidates.append((f"{rounded.start} + local search{dives}",
                               dict(zip(red.members, rounded.assignment, strict=True))))
    best: tuple[str, dict[int, int], tuple[int, ...], float] | None = None
    for how, choice in candidates:
        assignment = tuple(choice[red.root[i]] for i in range(len(problem.nodes)))
        evaluation = evaluate(problem, assignment)
        if evaluation.feasible and (best is None or evaluation.cost.total < best[3]):
            best = (how, choice, assignment, evaluation.cost.total)
    if best is None:
        stats["lp_relaxation"] = "fractional, no rounding feasible"
        return None
    how, choice, assignment, exact = best
    gap = 0.0 if relaxed.integral or exact <= 0 else max(0.0, (exact - lower) / exact)
    stats["lp_relaxation"] = ("integral" if relaxed.integral
                              else f"fractional, rounded ({how}) gap {gap:.3g}")
    if not (relaxed.integral or gap <= problem.relative_gap):
        return choice
    return Solution(status="optimal" if relaxed.integral else "feasible",
                    assignment=assignment, objective=exact,
                    best_bound=exact if relaxed.integral else min(lower, exact), gap=gap,
                    solve_time_s=time.perf_counter() - start, stats=stats)


def _round(red: Reduced, relaxation: _Relaxation, relaxed: _Relaxed, lower: float,
           relative_gap: float) -> Rounded | None:
    """:func:`round_relaxation` on the reduced problem, diving on ``relaxation`` down to the
    cost ``relative_gap`` accepts (no diving when it accepts none)."""
    roots = list(red.members)

    def resolve(fixings: Mapping[int, int]) -> tuple[list[np.ndarray], float] | None:
        solved = relaxation.solve({roots[g]: s for g, s in fixings.items()})
        if solved is None:
            return None
        return [np.asarray(solved.marginals[r]) for r in roots], solved.bound

    # Rounding costs are salted (>= exact) and leave out the folded constant.
    target = (lower / (1.0 - relative_gap) if relative_gap < 1.0 else math.inf) - red.constant
    node_cost, edges = _rounding_inputs(red)
    return round_relaxation(node_cost, edges, [np.asarray(relaxed.marginals[r]) for r in roots],
                            resolve=resolve if relative_gap > 0 else None, target_cost=target)


def _rounding_inputs(red: Reduced) -> tuple[list[np.ndarray], list[tuple[int, int, np.ndarray]]]:
    """The reduced problem as :func:`round_relaxation`'s arrays, groups in ``red.members``
    order; salted costs (what the relaxation minimises), aliases as forbidden pairs."""
    index = {r: k for k, r in enumerate(red.members)}
    matrices = {key: np.array(m, dtype=np.float64) for key, m in red.edges.items()}
    for ra, i, rb, j in red.alias_pairs:
        (u, a), (v, b) = sorted(((ra, i), (rb, j)))
        shape = (len(red.cost[u]), len(red.cost[v]))
        matrices.setdefault((u, v), np.zeros(shape))[a, b] = math.inf
    node_cost = [np.asarray(red.cost[r], dtype=np.float64) for r in red.members]
    return node_cost, [(index[u], index[v], m) for (u, v), m in matrices.items()]


# --------------------------------------------------------------------------- solving


def _run(built: _Model, problem: Problem, time_limit_s: float) -> tuple[Any, cp_model.CpSolver]:
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.max_time_in_seconds = max(time_limit_s, 1e-3)
    params.relative_gap_limit = problem.relative_gap
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
    problem: Problem, red: Reduced, built: _Model, solver: cp_model.CpSolver
) -> tuple[int, ...]:
    choice = {
        r: next(s for s, v in enumerate(vs) if solver.boolean_value(v)) for r, vs in built.x.items()
    }
    return tuple(choice[red.root[i]] for i in range(len(problem.nodes)))


def _dead_group(problem: Problem, red: Reduced) -> dict[str, Any] | None:
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


def _diagnose(problem: Problem, red: Reduced, scaling: Scaling, deadline: float) -> dict[str, Any]:
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
    for cut in problem.memory_steps():
        least = cut.fixed_bytes + sum(min(c) for _, c in cut.terms)
        if least > budget:
            return (
                f"{cut.name} needs at least {least:,.0f} bytes > budget {budget:,.0f} "
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
    red = reduce_problem(problem)
    dead = _dead_group(problem, red)
    if dead is not None:
        stats = {"solver": "cp-sat", **dead}
        return _no_plan("infeasible", time.perf_counter() - start, stats)
    scaling = choose_scaling(problem, red)
    hint = hint_assignment(problem, red)
    built = _build(problem, red, scaling, families=frozenset(_FAMILIES), hint=hint)
    stats = _model_stats(red, scaling, built)
    relaxation = _lp_relaxation(built)
    relaxed = relaxation.solve() if relaxation is not None else None
    if relaxation is not None and relaxed is not None:
        accepted = _from_relaxation(problem, red, relaxation, relaxed, stats, start)
        if isinstance(accepted, Solution):
            return accepted
        if accepted is not None:  # the better feasible rounding seeds the search
            built = _build(problem, red, scaling, families=frozenset(_FAMILIES), hint=accepted)
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
    problem: Problem, red: Reduced, hint: Mapping[int, int], start: float, stats: dict[str, Any]
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


def _model_stats(red: Reduced, scaling: Scaling, built: _Model) -> dict[str, Any]:
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
