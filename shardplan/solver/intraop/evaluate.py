"""The independent evaluator: what an assignment costs and which constraints it breaks.

Written apart from the solver (it imports nothing from ``ilp.py``) so that tests and ``explain``
check the solver's answers with plain arithmetic, as XLA's ``Evaluate`` checks
``auto_sharding_solver.cc``.

Example:
    >>> from shardplan.solver.intraop.problem import Node, Problem
    >>> p = Problem((Node("a", (1.0, 2.0), (10.0, 0.0), (8.0, 4.0)),), ())
    >>> evaluate(p, (1,)).cost.total
    2.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from shardplan.errors import SolverError, format_error
from shardplan.solver.intraop.problem import Problem

__all__ = ["CostBreakdown", "Evaluation", "Violation", "ViolationKind", "evaluate"]

ViolationKind = Literal[
    "follower", "alias", "memory", "infinite_cost", "max_departures", "max_cost"
]


@dataclass(frozen=True)
class Violation:
    """One broken constraint.

    Attributes:
      kind: the constraint family.
      detail: which nodes / edge / time step, with the offending values.
    """

    kind: ViolationKind
    detail: str


@dataclass(frozen=True)
class CostBreakdown:
    """Objective terms, in the problem's cost units.

    Attributes:
      compute: sum of the chosen strategies' compute costs.
      communication: sum of their communication costs.
      resharding: sum of the edges' resharding costs for the chosen pairs.
      memory_penalty: soft mode: ``overbudget_coeff * max(0, peak - budget)``; else 0.
      total: the sum of the four.
    """

    compute: float
    communication: float
    resharding: float
    memory_penalty: float
    total: float


@dataclass(frozen=True)
class Evaluation:
    """The evaluator's report on one assignment.

    Attributes:
      cost: the assignment's objective, term by term.
      lower_bound: per-term lower bounds independent of the assignment (each node's cheapest
        finite strategy, each edge's cheapest finite pair, the penalty of ``lower_bound_peak``),
        as XLA's evaluator reports them.
      live_memory_bytes: live memory at each time step of ``Problem.liveness``, then of
        each of ``Problem.memory_cuts``.
      peak_memory_bytes: the maximum of ``live_memory_bytes`` (0 without time steps).
      peak_step: the first time step reaching the peak, or ``None`` without time steps.
      lower_bound_peak_bytes: the peak if every live node took its smallest strategy.
      departures: total departure cost of the chosen strategies.
      violations: every broken constraint, in the order follower, alias, memory,
        infinite_cost, max_departures, max_cost.
    """

    cost: CostBreakdown
    lower_bound: CostBreakdown
    live_memory_bytes: tuple[float, ...]
    peak_memory_bytes: float
    peak_step: int | None
    lower_bound_peak_bytes: float
    departures: float
    violations: tuple[Violation, ...]

    @property
    def feasible(self) -> bool:
        """True when no constraint is violated."""
        return not self.violations

    def kinds(self) -> tuple[ViolationKind, ...]:
        """The distinct violation kinds, in report order."""
        return tuple(dict.fromkeys(v.kind for v in self.violations))


def evaluate(problem: Problem, assignment: Sequence[int], /) -> Evaluation:
    """Computes the cost breakdown, live memory and violations of ``assignment``.

    Args:
      problem: the problem.
      assignment: one strategy index per node.

    Returns:
      The evaluation; an infinite cost term makes ``total`` infinite (and is reported as an
      ``infinite_cost`` violation).

    Raises:
      SolverError: the assignment has the wrong length or an index out of range.
    """
    chosen = _check_assignment(problem, assignment)
    nodes = problem.nodes
    steps = problem.memory_steps()
    live = tuple(cut.value(chosen) for cut in steps)
    peak = max(live, default=0.0)
    # (A copy is at least 0 bytes: the bound leaves them out.)
    lb_peak = max((math.fsum([c.fixed_bytes, *(min(k) for _, k in c.terms)]) for c in steps),
                  default=0.0)
    departures = math.fsum(
        n.departure_cost[s]
        for n, s in zip(nodes, chosen, strict=True)
        if n.departure_cost is not None
    )
    cost = _cost(problem, chosen, peak)
    violations = (
        *_follower_violations(problem, chosen),
        *_alias_violations(problem, chosen),
        *_memory_violations(problem, live),
        *_infinite_cost_violations(problem, chosen),
        *_limit_violations(problem, chosen, departures, cost.total),
    )
    return Evaluation(
        cost=cost,
        lower_bound=_lower_bound(problem, lb_peak),
        live_memory_bytes=live,
        peak_memory_bytes=peak,
        peak_step=live.index(peak) if live else None,
        lower_bound_peak_bytes=lb_peak,
        departures=departures,
        violations=violations,
    )


def _cost(problem: Problem, chosen: Sequence[int], peak_bytes: float) -> CostBreakdown:
    nodes = problem.nodes
    compute = math.fsum(n.compute_cost[s] for n, s in zip(nodes, chosen, strict=True))
    communication = math.fsum(n.communication_cost[s] for n, s in zip(nodes, chosen, strict=True))
    resharding = math.fsum(
        e.cost[chosen[e.src] * nodes[e.dst].num_strategies + chosen[e.dst]] for e in problem.edges
    )
    penalty = _memory_penalty(problem, peak_bytes)
    total = compute + communication + resharding + penalty
    return CostBreakdown(compute, communication, resharding, penalty, total)


def _limit_violations(
    problem: Problem, chosen: Sequence[int], departures: float, total: float
) -> list[Violation]:
    out = []
    if problem.max_departures is not None and departures > problem.max_departures:
        departing = ", ".join(
            n.name
            for n, s in zip(problem.nodes, chosen, strict=True)
            if n.departure_cost is not None and n.departure_cost[s] > 0
        )
        out.append(
            Violation(
                "max_departures",
                f"departures {departures:g} > max_departures {problem.max_departures} "
                f"(departing: {departing})",
            )
        )
    if problem.max_cost is not None and total > problem.max_cost:
        out.append(
            Violation("max_cost", f"objective {total:,.6g} > max_cost {problem.max_cost:,.6g}")
        )
    return out


def _check_assignment(problem: Problem, assignment: Sequence[int]) -> tuple[int, ...]:
    chosen = tuple(int(s) for s in assignment)
    if len(chosen) != len(problem.nodes):
        raise SolverError(
            format_error(
                f"the assignment has {len(chosen)} entries for {len(problem.nodes)} nodes",
                where="evaluate(assignment)",
                remedy="give one strategy index per node",
            )
        )
    for node, s in zip(problem.nodes, chosen, strict=True):
        if not 0 <= s < node.num_strategies:
            raise SolverError(
                format_error(
                    f"strategy {s} is out of range for node {node.name!r} "
                    f"({node.num_strategies} strategies)",
                    where="evaluate(assignment)",
                    remedy="use a valid strategy index",
                )
            )
    return chosen


def _memory_penalty(problem: Problem, peak_bytes: float) -> float:
    budget = problem.memory_budget_bytes
    if budget is None or problem.memory_mode != "soft" or peak_bytes <= budget:
        return 0.0
    return problem.overbudget_coeff * (peak_bytes - budget)


def _lower_bound(problem: Problem, lb_peak_bytes: float) -> CostBreakdown:
    """Assignment-independent lower bounds per term (minimum over finite entries)."""

    def finite_min(values: Sequence[float]) -> float:
        return min((v for v in values if not math.isinf(v)), default=math.inf)

    compute = math.fsum(finite_min(n.compute_cost) for n in problem.nodes)
    communication = math.fsum(finite_min(n.communication_cost) for n in problem.nodes)
    resharding = math.fsum(finite_min(e.cost) for e in problem.edges)
    penalty = _memory_penalty(problem, lb_peak_bytes)
    return CostBreakdown(
        compute, communication, resharding, penalty, compute + communication + resharding + penalty
    )


def _follower_violations(problem: Problem, chosen: Sequence[int]) -> list[Violation]:
    names = [n.name for n in problem.nodes]
    return [
        Violation(
            "follower",
            f"node {names[f.node]!r} picks strategy {chosen[f.node]} but follows "
            f"{names[f.leader]!r}, which picks {chosen[f.leader]}",
        )
        for f in problem.followers
        if chosen[f.node] != chosen[f.leader]
    ]


def _alias_violations(problem: Problem, chosen: Sequence[int]) -> list[Violation]:
    out = []
    for alias in problem.aliases:
        i, j = chosen[alias.a], chosen[alias.b]
        if alias.allowed[i * problem.nodes[alias.b].num_strategies + j] == 0:
            out.append(
                Violation(
                    "alias",
                    f"alias {problem.nodes[alias.a].name!r}~{problem.nodes[alias.b].name!r}:"
                    f" the strategy pair ({i}, {j}) is forbidden",
                )
            )
    return out


def _memory_violations(problem: Problem, live: Sequence[float]) -> list[Violation]:
    budget = problem.memory_budget_bytes
    if budget is None or problem.memory_mode != "hard":
        return []
    out = []
    for cut, live_bytes in zip(problem.memory_steps(), live, strict=True):
        if live_bytes > budget:
            label = cut.name
            names = ", ".join(dict.fromkeys(problem.nodes[i].name for i, _ in cut.all_terms()))
            out.append(
                Violation(
                    "memory",
                    f"{label}: live memory {live_bytes:,.0f} bytes > budget "
                    f"{budget:,.0f} bytes (live: {names})",
                )
            )
    return out


def _infinite_cost_violations(problem: Problem, chosen: Sequence[int]) -> list[Violation]:
    out = []
    for node, s in zip(problem.nodes, chosen, strict=True):
        for term, costs in (
            ("compute", node.compute_cost),
            ("communication", node.communication_cost),
        ):
            if math.isinf(costs[s]):
                out.append(
                    Violation(
                        "infinite_cost", f"node {node.name!r} strategy {s}: infinite {term} cost"
                    )
                )
    for k, e in enumerate(problem.edges):
        i, j = chosen[e.src], chosen[e.dst]
        if math.isinf(e.cost[i * problem.nodes[e.dst].num_strategies + j]):
            out.append(
                Violation(
                    "infinite_cost",
                    f"edge {k} {problem.nodes[e.src].name!r}->{problem.nodes[e.dst].name!r}: "
                    f"infinite resharding cost for the pair ({i}, {j})",
                )
            )
    return out
