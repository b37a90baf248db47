"""Cost scaling for the intra-op ILP: how float costs and bytes become CP-SAT integers.

CP-SAT takes integer coefficients only. :func:`choose_scaling` picks, for one reduced problem:

* XLA's cost scale (``auto_sharding_solver.cc``): when the largest finite cost exceeds
  :data:`XLA_MAX_COST`, every cost is scaled down by ``XLA_MAX_COST / largest``;
* an integer resolution, the largest power of ten that keeps every coefficient within
  :data:`COST_INT_LIMIT` and the worst-case objective within :data:`OBJECTIVE_INT_LIMIT`;
* a memory quantum, the smallest power of two of bytes that keeps each time step's live memory
  within :data:`MEMORY_UNITS_LIMIT` units;
* the soft-memory penalty per memory unit of excess, capped just above the whole cost span.

Example:
    >>> from shardplan.solver.intraop.problem import Node, Problem
    >>> from shardplan.solver.intraop.reduce import reduce_problem
    >>> p = Problem((Node("a", (3.0, 1.0), (0.0, 0.0), (0.0, 0.0)),), (), time_limit_s=5)
    >>> scaling = choose_scaling(p, reduce_problem(p))  # largest salted cost ~3.0 -> 1e8 / unit
    >>> scaling.cost_scale, scaling.to_int(1.0)
    (1.0, 100000000)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardplan.solver.intraop.problem import Problem
from shardplan.solver.intraop.reduce import Reduced

__all__ = [
    "COST_INT_LIMIT",
    "MEMORY_UNITS_LIMIT",
    "OBJECTIVE_INT_LIMIT",
    "XLA_MAX_COST",
    "Scaling",
    "choose_scaling",
]

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


@dataclass(frozen=True)
class Scaling:
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
    """The values that are not infinite (forbidden)."""
    return [v for v in values if not math.isinf(v)]


def _memory_bounds(problem: Problem) -> tuple[int, int]:
    """The memory quantum and the largest possible excess in memory units."""
    steps = problem.memory_steps()
    if problem.memory_budget_bytes is None or not steps:
        return 1, 0
    worst = max(c.fixed_bytes + sum(max(0.0, *k) for _, k in c.all_terms()) for c in steps)
    quantum = 1
    while worst / quantum > MEMORY_UNITS_LIMIT:
        quantum *= 2
    worst_units = max(
        math.ceil(c.fixed_bytes / quantum)
        + sum(math.ceil(max(0.0, *k) / quantum) for _, k in c.all_terms())
        for c in steps
    )
    return quantum, max(0, worst_units - math.floor(problem.memory_budget_bytes / quantum))


def choose_scaling(problem: Problem, red: Reduced, /) -> Scaling:
    """Picks the cost scale, integer resolution, memory quantum and soft-memory penalty.

    Args:
      problem: the original problem (its raw costs decide XLA's scale; its memory, the quantum).
      red: its reduction (its merged coefficients decide the integer resolution).

    Returns:
      The conversion; the resolution is lowered until the worst-case objective fits int64.
    """
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
            return Scaling(cost_scale, per_unit, quantum, penalty, exact, penalty < exact)
        k -= 1
