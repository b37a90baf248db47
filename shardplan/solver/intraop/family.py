"""The LP relaxation of a family of problems that share their structure and differ in costs.

The layer cost tables solve one traced step on every sub-mesh size of every device type: the
same nodes, strategies, followers and edges, priced differently. :class:`ProblemFamily` builds
the relaxation of :mod:`shardplan.solver.intraop.ilp` once for the family and re-solves it per cost
vector from the previous optimal basis (GLOP without presolve keeps its basis across objective
changes: a few hundred pivots instead of a few thousand from scratch).

The model is the one ``ilp.solve`` relaxes, with the reductions it makes from the costs
replaced by ones that hold for *every* member of the family:

* follower groups as in :func:`~shardplan.solver.intraop.reduce.reduce_problem`, node costs salted
  the same way, edges inside a group as their diagonal;
* a strategy (pair) is forbidden where its cost is ``inf``; the family is built from one
  member's pattern and a member with another pattern is refused (``solve`` returns None);
* pair variables per class of equal rows and equal columns (as ``ilp._classes``), where
  "equal" means equal *labels*: the caller labels each edge entry so that equal labels have
  equal costs in every member (the resharding a pair needs), instead of equal values in one;
* a merged edge with a single row class (or column class) depends on one end only and is
  folded into that end's costs (the separable case of ``reduce``'s folding that holds for
  every member).

An integral relaxed optimum is an optimum of the ILP (see ``ilp._lp_relaxation``). A fractional
one is rounded by :func:`~shardplan.solver.intraop.rounding.round_relaxation` when the caller accepts a
gap (diving on the family's relaxation, whose bounds are restored after), and the rounding is
the caller's to accept; otherwise, or for a member the family refuses, the caller solves it
with :func:`~shardplan.solver.solve`.
The relaxation has the same optimum as ``ilp``'s; where several assignments tie exactly (zero
costs are not salted), the simplex may stop at another one of them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import linear_solver_pb2, pywraplp

from shardplan.solver.intraop.reduce import SALTIPLIER, salt
from shardplan.solver.intraop.rounding import Rounded, round_relaxation

__all__ = ["FamilySolution", "ProblemFamily"]

LP_INTEGRALITY_TOLERANCE = 1e-6
"""A relaxed strategy value within this of 0 or 1 counts as integral (as in ``ilp``)."""

GLOP_PARAMETERS = "use_preprocessing: false use_dual_simplex: true"
"""GLOP keeps its basis across objective changes only without presolve; from the previous
basis, the dual simplex needed about half the pivots of the primal on the GPT-3 175B tables
(7,861 vs 13,701 over 21 sub-meshes) and half the time."""


@dataclass(frozen=True)
class FamilySolution:
    """One member's relaxed optimum.

    Attributes:
      assignment: per node, its strategy: the relaxed optimum if integral, else the cheaper of
        its largest value per follower group and its rounding (when asked for).
      integral: whether the relaxed optimum was integral (then ``assignment`` is optimal).
      objective: the assignment's exact cost, summed as ``evaluate`` sums it.
      lp_objective: the relaxed optimum (salted).
      iterations: simplex iterations (of the first solve: a dive's re-solves not counted).
      solve_time_s: seconds of the whole call.
      rounding: how a fractional optimum was rounded (``"argmax"``, or the rounding's start
        and its dives and re-solves); ``""`` when integral.
    """

    assignment: tuple[int, ...]
    integral: bool
    objective: float
    lp_objective: float
    iterations: int
    solve_time_s: float
    rounding: str = ""

    @property
    def lower_bound(self) -> float:
        """A lower bound on every assignment's exact cost (salt adds at most SALTIPLIER)."""
        return self.lp_objective / (1.0 + SALTIPLIER)

    @property
    def gap(self) -> float:
        """``(objective - lower_bound) / objective``: 0 when integral."""
        if self.integral or self.objective <= 0:
            return 0.0
        return max(0.0, (self.objective - self.lower_bound) / self.objective)


def _roots(n: int, followers: Sequence[tuple[int, int]]) -> np.ndarray:
    """The smallest node of each node's follower group (as ``reduce._follower_roots``)."""
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for node, leader in followers:
        a, b = find(node), find(leader)
        parent[max(a, b)] = min(a, b)
    return np.asarray([find(i) for i in range(n)], dtype=np.int64)


class ProblemFamily:
    """The relaxation of every problem with one structure (see the module docstring).

    Args:
      names: per node, its name (the salt).
      counts: per node, its number of strategies.
      followers: ``(node, leader)`` pairs.
      edges: ``(src, dst)`` per edge.
      labels: per edge, one integer per entry of its flattened ``|S_src| x |S_dst|`` matrix;
        equal labels must mean equal costs in every member.
      node_cost: one member's node costs (compute + communication), flat per node strategy.
      edge_costs: the same member's edge costs; their ``inf`` pattern, and the node costs',
        is the family's.
      salts: ``salt(name, strategy)`` values to reuse and extend (families over nodes of the
        same names).
      time_limit_s: GLOP's limit per solve (a member it does not finish is the caller's).
    """

    def __init__(self, *, names: Sequence[str], counts: Sequence[int],
                 followers: Sequence[tuple[int, int]], edges: Sequence[tuple[int, int]],
                 labels: Sequence[np.ndarray], node_cost: np.ndarray,
                 edge_costs: Sequence[np.ndarray],
                 salts: dict[tuple[str, int], float] | None = None,
                 time_limit_s: float = 30.0) -> None:
        n = len(counts)
        self.base = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.counts = np.asarray(counts, dtype=np.int64)
        self.root = _roots(n, followers)
        if any(counts[i] != counts[r] for i, r in enumerate(self.root.tolist())):
            raise ValueError("a follower and its leader have different strategy counts")
        size = int(self.base[-1])
        strategy = np.arange(size) - np.repeat(self.base[:-1], counts)
        node = np.repeat(np.arange(n), counts)
        salts = salts if salts is not None else {}
        factors = []
        for i, k in zip(node.tolist(), strategy.tolist(), strict=True):
            key = (names[i], k)
            if key not in salts:
                salts[key] = 1.0 + SALTIPLIER * salt(names[i], k)
            factors.append(salts[key])
        self.salt = np.asarray(factors)
        # Every flat entry's root entry (same strategy index of its group's root).
        self.to_root = self.base[self.root[node]] + strategy
        self.node_inf = np.isinf(node_cost)
        self.edge_inf = [np.isinf(c) for c in edge_costs]
        self.flat_edge_inf = (np.concatenate(self.edge_inf) if self.edge_inf
                              else np.zeros(0, dtype=bool))
        self.edges = [(int(s), int(d)) for s, d in edges]
        forbidden = np.zeros(size, dtype=bool)
        np.logical_or.at(forbidden, self.to_root, self.node_inf)
        # Edges inside a follower group keep their diagonal (a node cost of the root).
        diagonal_src, diagonal_entry = [], []
        offsets = np.concatenate([[0], np.cumsum([len(c) for c in edge_costs])]).astype(np.int64)
        merged: dict[tuple[int, int], list[tuple[int, bool]]] = {}
        for e, (s, d) in enumerate(self.edges):
            u, v = int(self.root[s]), int(self.root[d])
            if u == v:
                k = int(counts[s])
                idx = np.arange(k) * k + np.arange(k)
                diagonal_src.append(offsets[e] + idx)
                diagonal_entry.append(self.base[u] + np.arange(k))
                forbidden[self.base[u] + np.arange(k)] |= self.edge_inf[e][idx]
                continue
            merged.setdefault((min(u, v), max(u, v)), []).append((e, u > v))
        self.diagonal_src = (np.concatenate(diagonal_src) if diagonal_src
                             else np.zeros(0, dtype=np.int64))
        self.diagonal_entry = (np.concatenate(diagonal_entry) if diagonal_entry
                               else np.zeros(0, dtype=np.int64))
        self.offsets = offsets
        self.forbidden = forbidden
        self._build_lp(merged, labels)
        self.lp.SetTimeLimit(max(1, round(time_limit_s * 1000)))

    # ------------------------------------------------------------------ the model
    def _build_lp(self, merged: dict[tuple[int, int], list[tuple[int, bool]]],
                  labels: Sequence[np.ndarray]) -> None:
        """Writes the relaxation as a proto, loads it into GLOP and keeps its variables."""
        # The model is written as a proto (variables and rows in bulk) and loaded once.
        proto = _Proto()
        x_entry = self._add_strategy_vars(proto)
        # Pair variables and the edges folded into one end.
        terms = _EdgeTerms([], [], [], [], [])
        for (u, v), members in merged.items():
            self._add_merged_edge(proto, u, v, members, labels, len(x_entry), terms)
        self._load(proto.model, len(x_entry))
        self.y_var = (np.concatenate(terms.y_var).astype(np.int64) if terms.y_var
                      else np.zeros(0, dtype=np.int64))
        self.y_src = (np.concatenate(terms.y_src).astype(np.int64) if terms.y_src
                      else np.zeros(0, dtype=np.int64))
        self.fold_entry = np.asarray(terms.fold_entry, dtype=np.int64)
        self.fold_src = np.asarray(terms.fold_src, dtype=np.int64)
        self.pair_edges = terms.pair_edges

    def _add_strategy_vars(self, proto: _Proto) -> list[int]:
        """Adds a variable per allowed root strategy (``self.x``); their root entries, in order."""
        roots = sorted(set(self.root.tolist()))
        self.x: dict[int, list[tuple[int, int]]] = {}  # root -> [(strategy, variable)]
        x_entry: list[int] = []
        for r in roots:
            b = int(self.base[r])
            allowed = [s for s in range(int(self.counts[r])) if not self.forbidden[b + s]]
            xs = list(zip(allowed, proto.new_vars(len(allowed)), strict=True))
            x_entry += [b + s for s in allowed]
            proto.row(1.0, 1.0, [var for _, var in xs], [1.0] * len(xs))
            self.x[r] = xs
        self.x_entry = np.asarray(x_entry, dtype=np.int64)
        return x_entry

    def _add_merged_edge(self, proto: _Proto, u: int, v: int, members: list[tuple[int, bool]],
                         labels: Sequence[np.ndarray], n_x: int, terms: _EdgeTerms) -> None:
        """Adds the merged edge of roots ``u < v``: folded into one end, or pair variables.

        An edge whose matrix depends on one end only is folded into that end's costs; others
        get a pair variable per (row class, column class).
        """
        ku, kv = int(self.counts[u]), int(self.counts[v])
        rows = [i for i in range(ku) if not self.forbidden[self.base[u] + i]]
        cols = [j for j in range(kv) if not self.forbidden[self.base[v] + j]]
        if not rows or not cols:
            return  # a dead group: every member is infeasible (the caller's solve says so)
        # Per member, the global index of entry (i, j) of the merged (u, v) matrix.
        grids = []
        for e, flipped in members:
            grid = np.arange(ku * kv).reshape(ku, kv)
            if flipped:  # the edge runs v -> u: its (j, i) is the merged (i, j)
                grid = np.arange(ku * kv).reshape(kv, ku).T
            grids.append((e, self.offsets[e] + grid))
        label = np.stack([labels[e][g - self.offsets[e]] for e, g in grids], axis=-1)
        inf = np.zeros((ku, kv), dtype=bool)
        for e, g in grids:
            inf |= self.edge_inf[e][g - self.offsets[e]]
        sub, sub_inf = label[np.ix_(rows, cols)], inf[np.ix_(rows, cols)]
        row_classes = _classes([(sub[a].tobytes(), sub_inf[a].tobytes())
                                for a in range(len(rows))], rows)
        reps = [rows.index(c[0]) for c in row_classes]
        col_classes = _classes([(sub[reps, b].tobytes(), sub_inf[reps, b].tobytes())
                                for b in range(len(cols))], cols)
        if len(row_classes) == 1 or len(col_classes) == 1:
            if inf[np.ix_(rows, cols)].any():
                raise ValueError("a separable edge forbids strategy pairs")
            if len(col_classes) == 1:  # M[i, j] = r_i: a cost of u's strategies
                j0 = cols[0]
                for i in rows:
                    for _, g in grids:
                        terms.fold_entry.append(int(self.base[u]) + i)
                        terms.fold_src.append(int(g[i, j0]))
            else:  # M[i, j] = c_j: a cost of v's strategies
                i0 = rows[0]
                for j in cols:
                    for _, g in grids:
                        terms.fold_entry.append(int(self.base[v]) + j)
                        terms.fold_src.append(int(g[i0, j]))
            return
        terms.pair_edges.append((u, v, [g for _, g in grids]))
        self._add_pair_vars(proto, u, v, [g for _, g in grids], inf, row_classes, col_classes,
                            n_x, terms)

    def _add_pair_vars(self, proto: _Proto, u: int, v: int, grids: list[np.ndarray],
                       inf: np.ndarray, row_classes: list[list[int]],
                       col_classes: list[list[int]], n_x: int, terms: _EdgeTerms) -> None:
        """Adds a pair variable per allowed (row class, column class), and its marginal rows.

        The variables' costs (the sum of the members' entries) go to ``terms``.
        """
        xu, xv = dict(self.x[u]), dict(self.x[v])
        i_rep = np.asarray([c[0] for c in row_classes])
        j_rep = np.asarray([c[0] for c in col_classes])
        a_idx, b_idx = np.nonzero(~inf[np.ix_(i_rep, j_rep)])
        pairs = proto.new_vars(len(a_idx))
        row_terms: list[list[int]] = [[] for _ in row_classes]
        col_terms: list[list[int]] = [[] for _ in col_classes]
        for a, b, var in zip(a_idx.tolist(), b_idx.tolist(), pairs, strict=True):
            row_terms[a].append(var)
            col_terms[b].append(var)
        for g in grids:  # the pair's cost: the sum of the members' entries
            terms.y_var.append(np.asarray(pairs, dtype=np.int64) - n_x)
            terms.y_src.append(g[i_rep[a_idx], j_rep[b_idx]])
        for classes, class_terms, ends in ((row_classes, row_terms, xu),
                                           (col_classes, col_terms, xv)):
            for members_of_class, pair_vars in zip(classes, class_terms, strict=True):
                proto.row(0.0, 0.0, pair_vars + [ends[s] for s in members_of_class],
                          [1.0] * len(pair_vars) + [-1.0] * len(members_of_class))

    def _load(self, model: linear_solver_pb2.MPModelProto, n_x: int) -> None:
        """Loads ``model`` into GLOP (``self.lp``); its first ``n_x`` variables are strategies."""
        lp = pywraplp.Solver.CreateSolver("GLOP")
        if lp is None:  # pragma: no cover - GLOP ships in every ortools wheel
            raise RuntimeError("OR-Tools has no GLOP")
        error = lp.LoadModelFromProto(model)
        if error:  # pragma: no cover - the model is built above
            raise RuntimeError(f"GLOP rejected the relaxation: {error}")
        lp.SetNumThreads(1)
        lp.SetSolverSpecificParametersAsString(GLOP_PARAMETERS)
        self.lp = lp
        variables = lp.variables()
        self.x_vars = variables[:n_x]
        y_vars = variables[n_x:]
        self._x_objects = {r: [(s, variables[var]) for s, var in xs] for r, xs in self.x.items()}
        self.y_vars = y_vars
        self.trivial = not y_vars and all(len(xs) == 1 for xs in self.x.values())
        group_index = {r: g for g, r in enumerate(self._x_objects)}
        self._group_of_node = np.asarray([group_index[r] for r in self.root.tolist()],
                                         dtype=np.int64)
        self._variables = [*self.x_vars, *y_vars]
        self._coefficients = np.zeros(len(self._variables))  # as the model starts

    # ------------------------------------------------------------------ solving
    def solve(self, compute: np.ndarray, communication: np.ndarray,
              edge_costs: Sequence[np.ndarray], *,
              relative_gap: float = 0.0) -> FamilySolution | None:
        """The relaxed optimum of the member with these costs, or None if its ``inf``
        pattern is not the family's or GLOP does not reach an optimum.

        A fractional optimum is rounded (:mod:`shardplan.solver.intraop.rounding`, diving until the
        rounding is within ``relative_gap`` of the bound) when ``relative_gap`` is positive;
        the returned assignment is then the cheaper of that and the largest values.
        """
        start = time.perf_counter()
        node_cost = compute + communication
        flat_edges = (np.concatenate(edge_costs) if edge_costs else np.zeros(0))
        if (len(flat_edges) != len(self.flat_edge_inf)
                or not np.array_equal(np.isinf(node_cost), self.node_inf)
                or not np.array_equal(np.isinf(flat_edges), self.flat_edge_inf)):
            return None
        size = len(node_cost)
        finite = np.where(self.node_inf, 0.0, node_cost)
        root_cost = np.bincount(self.to_root, weights=finite * self.salt, minlength=size)
        if len(self.diagonal_src):
            diagonal = np.where(np.isinf(flat_edges[self.diagonal_src]), 0.0,
                                flat_edges[self.diagonal_src])
            root_cost += np.bincount(self.diagonal_entry, weights=diagonal, minlength=size)
        if len(self.fold_src):
            root_cost += np.bincount(self.fold_entry, weights=flat_edges[self.fold_src],
                                     minlength=size)
        y_cost = np.bincount(self.y_var, weights=flat_edges[self.y_src],
                             minlength=len(self.y_vars))
        if self.trivial:  # one allowed strategy per group (a one-device mesh): no choice
            assignment = tuple(self.x[r][0][0] for r in self.root.tolist())
            cost = self.cost(assignment, compute, communication, edge_costs)
            return FamilySolution(assignment=assignment, integral=True, objective=cost,
                                  lp_objective=float(root_cost[self.x_entry].sum()),
                                  iterations=0, solve_time_s=time.perf_counter() - start)
        objective = self.lp.Objective()
        coefficients = np.concatenate([root_cost[self.x_entry], y_cost])
        # Only the coefficients that changed (zero resharding costs stay zero).
        changed = np.flatnonzero(coefficients != self._coefficients).tolist()
        variables = self._variables
        for i, c in zip(changed, coefficients[changed].tolist(), strict=True):
            objective.SetCoefficient(variables[i], c)
        self._coefficients = coefficients
        objective.SetMinimization()
        if self.lp.Solve() != pywraplp.Solver.OPTIMAL:
            return None
        marginals = self._marginals()
        integral = all(not LP_INTEGRALITY_TOLERANCE < q < 1 - LP_INTEGRALITY_TOLERANCE
                       for values in marginals.values() for q in values.tolist())
        # (argmax keeps the first of equal values: the lower strategy index.)
        chosen_root = {r: int(np.argmax(q)) for r, q in marginals.items()}
        assignment = tuple(chosen_root[r] for r in self.root.tolist())
        cost = self.cost(assignment, compute, communication, edge_costs)
        lp_objective, iterations = objective.Value(), self.lp.iterations()
        rounding = "" if integral else "argmax"
        if not integral and relative_gap > 0:
            lower = lp_objective / (1.0 + SALTIPLIER)
            target = lower / (1.0 - relative_gap) if relative_gap < 1.0 else math.inf
            rounded = self._round(root_cost, flat_edges, marginals, target)
            if rounded is not None:
                candidate = tuple(rounded.assignment[g] for g in self._group_of_node.tolist())
                candidate_cost = self.cost(candidate, compute, communication, edge_costs)
                if candidate_cost < cost:
                    assignment, cost = candidate, candidate_cost
                    rounding = (f"{rounded.start} + local search, {rounded.dives} dives, "
                                f"{rounded.resolves} re-solves")
        return FamilySolution(
            assignment=assignment, integral=integral, objective=cost,
            lp_objective=lp_objective, iterations=iterations,
            solve_time_s=time.perf_counter() - start, rounding=rounding)

    def _marginals(self) -> dict[int, np.ndarray]:
        """Per root, the relaxed value of each strategy (0 where forbidden)."""
        out = {}
        for r, xs in self._x_objects.items():
            q = np.zeros(int(self.counts[r]))
            q[[s for s, _ in xs]] = [var.solution_value() for _, var in xs]
            out[r] = q
        return out

    def _round(self, root_cost: np.ndarray, flat_edges: np.ndarray,
               marginals: dict[int, np.ndarray], target_cost: float) -> Rounded | None:
        """:func:`round_relaxation` over the groups (``self._x_objects`` order), diving on the
        family's relaxation; every bound it fixes is restored before returning."""
        roots = list(self._x_objects)
        node_cost = [np.where(self.forbidden[b:b + k], math.inf, root_cost[b:b + k])
                     for b, k in ((int(self.base[r]), int(self.counts[r])) for r in roots)]
        group = {r: g for g, r in enumerate(roots)}
        edges = [(group[u], group[v], sum(flat_edges[g] for g in grids))
                 for u, v, grids in self.pair_edges]
        by_strategy = [dict(self._x_objects[r]) for r in roots]
        fixed: list[pywraplp.Variable] = []

        def resolve(fixings: Mapping[int, int]) -> tuple[list[np.ndarray], float] | None:
            for var in fixed:
                var.SetLb(0.0)
            fixed[:] = [by_strategy[g][s] for g, s in fixings.items()]
            for var in fixed:
                var.SetLb(1.0)
            if self.lp.Solve() != pywraplp.Solver.OPTIMAL:
                return None
            solved = self._marginals()
            return [solved[r] for r in roots], self.lp.Objective().Value()

        try:
            return round_relaxation(node_cost, edges, [marginals[r] for r in roots],
                                    resolve=resolve, target_cost=target_cost)
        finally:
            for var in fixed:
                var.SetLb(0.0)

    def cost(self, assignment: Sequence[int], compute: np.ndarray, communication: np.ndarray,
             edge_costs: Sequence[np.ndarray]) -> float:
        """The exact cost of ``assignment``, summed as ``evaluate`` sums it."""
        chosen = self.base[:-1] + np.asarray(assignment, dtype=np.int64)
        total_compute = math.fsum(compute[chosen].tolist())
        total_comm = math.fsum(communication[chosen].tolist())
        resharding = math.fsum(
            float(c[assignment[s] * int(self.counts[d]) + assignment[d]])
            for (s, d), c in zip(self.edges, edge_costs, strict=True))
        return total_compute + total_comm + resharding + 0.0


class _Proto:
    """The relaxation being written as a proto: variables and rows added in bulk."""

    def __init__(self) -> None:
        self.model = linear_solver_pb2.MPModelProto()
        self._unit = linear_solver_pb2.MPVariableProto(lower_bound=0.0, upper_bound=1.0)

    def new_vars(self, k: int) -> list[int]:
        """``k`` new variables in ``[0, 1]``; their indices."""
        first = len(self.model.variable)
        self.model.variable.extend([self._unit] * k)
        return list(range(first, first + k))

    def row(self, lower: float, upper: float, index: list[int],
            coefficient: list[float]) -> None:
        """A new row ``lower <= sum coefficient[i] x[index[i]] <= upper``."""
        constraint = self.model.constraint.add(lower_bound=lower, upper_bound=upper)
        constraint.var_index.extend(index)
        constraint.coefficient.extend(coefficient)


@dataclass(frozen=True)
class _EdgeTerms:
    """What the merged edges add besides variables and rows, in order."""

    y_var: list[np.ndarray]
    """Per block of pair variables, their indices counted after the strategy variables."""
    y_src: list[np.ndarray]
    """Per block alike, the global edge entry whose cost each variable takes (summed)."""
    fold_entry: list[int]
    """Root entries that take an edge entry's cost (edges folded into one end)."""
    fold_src: list[int]
    """Per ``fold_entry``, the global edge entry whose cost it adds."""
    pair_edges: list[tuple[int, int, list[np.ndarray]]]
    """(root u, root v, per member edge its [|S_u|, |S_v|] global entries): for rounding."""


def _classes(keys: Sequence[Hashable], members: Sequence[int]) -> list[list[int]]:
    """``members`` grouped by equal ``keys``, in order of first appearance."""
    out: dict[Hashable, list[int]] = {}
    for key, m in zip(keys, members, strict=True):
        out.setdefault(key, []).append(m)
    return list(out.values())
