"""The intra-op sharding problem and its solution, as plain data that dumps to JSON for replay.

This restates the request of XLA's auto-sharding solver (``AutoShardingSolverRequest`` in
``xla/hlo/experimental/auto_sharding``): every node (an op or a value) has a list of candidate
sharding *strategies*, each with a compute cost, a communication cost, a memory footprint and a
"departure" cost; every edge carries a resharding cost for each pair of producer/consumer
strategies. The solver picks one strategy per node.

Costs are in whatever unit the cost model uses (seconds, or XLA's abstract units); memory is in
bytes. ``math.inf`` marks a strategy (or an edge's strategy pair) that must not be chosen; JSON
writes it as the string ``"inf"``.

Example:
    >>> p = Problem((Node("a", (1.0, 2.0), (0.0, 0.0), (8.0, 4.0)),), ())
    >>> Problem.from_json(p.to_json()) == p
    True
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Literal

from shardplan.errors import SolverError, format_error

__all__ = [
    "SCHEMA_VERSION",
    "Alias",
    "Edge",
    "Follower",
    "MemoryCut",
    "MemoryMode",
    "Node",
    "Problem",
    "Solution",
    "SolutionStatus",
]

SCHEMA_VERSION = 1
"""Version of the JSON layout written by :meth:`Problem.to_json` and :meth:`Solution.to_json`."""

MemoryMode = Literal["soft", "hard"]
SolutionStatus = Literal["optimal", "feasible", "infeasible", "timeout_no_solution"]

_MEMORY_MODES = ("soft", "hard")
_STATUSES = ("optimal", "feasible", "infeasible", "timeout_no_solution")


def _invalid(what: str, *, where: str, value: object = None, remedy: str) -> SolverError:
    return SolverError(format_error(what, where=where, value=value, remedy=remedy))


def _floats(values: Iterable[float], *, where: str, allow_inf: bool) -> tuple[float, ...]:
    """Converts ``values`` to a tuple of floats, rejecting NaN, negatives and (maybe) infinity."""
    out = tuple(float(v) for v in values)
    for i, v in enumerate(out):
        bad = math.isnan(v) or v < 0.0 or (math.isinf(v) and not allow_inf)
        if bad:
            allowed = (
                "a non-negative number or inf" if allow_inf else "a finite non-negative number"
            )
            raise _invalid(
                f"entry {i} is {v!r}; it must be {allowed}",
                where=where,
                remedy="fix the cost model that produced this problem",
            )
    return out


@dataclass(frozen=True)
class Node:
    """One op (or value) and its candidate strategies; every tuple has one entry per strategy.

    Attributes:
      name: a stable, unique name (the tie-breaking salt is derived from it).
      compute_cost: compute cost of each strategy (``inf`` = forbidden).
      communication_cost: communication cost of each strategy (``inf`` = forbidden).
      memory_bytes: bytes the node keeps live under each strategy.
      departure_cost: cost counted against ``Problem.max_departures`` (XLA: 1 for a strategy
        that departs from a default sharding, else 0); ``None`` means all zero.
    """

    name: str
    compute_cost: tuple[float, ...]
    communication_cost: tuple[float, ...]
    memory_bytes: tuple[float, ...]
    departure_cost: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        where = f"Node {self.name!r}"
        set_ = object.__setattr__
        set_(
            self,
            "compute_cost",
            _floats(self.compute_cost, where=f"{where}.compute_cost", allow_inf=True),
        )
        set_(
            self,
            "communication_cost",
            _floats(self.communication_cost, where=f"{where}.communication_cost", allow_inf=True),
        )
        set_(
            self,
            "memory_bytes",
            _floats(self.memory_bytes, where=f"{where}.memory_bytes", allow_inf=False),
        )
        if self.departure_cost is not None:
            set_(
                self,
                "departure_cost",
                _floats(self.departure_cost, where=f"{where}.departure_cost", allow_inf=False),
            )
        n = len(self.compute_cost)
        lengths = {
            "communication_cost": len(self.communication_cost),
            "memory_bytes": len(self.memory_bytes),
        }
        if self.departure_cost is not None:
            lengths["departure_cost"] = len(self.departure_cost)
        if n == 0:
            raise _invalid(
                "a node needs at least one strategy",
                where=f"{where}.compute_cost",
                remedy="give every node at least one candidate sharding",
            )
        for key, length in lengths.items():
            if length != n:
                raise _invalid(
                    f"{key} has {length} entries but compute_cost has {n}",
                    where=f"{where}.{key}",
                    remedy="give one entry per strategy",
                )

    @property
    def num_strategies(self) -> int:
        """Number of candidate strategies."""
        return len(self.compute_cost)


@dataclass(frozen=True)
class Edge:
    """A resharding cost between a producer ``src`` and a consumer ``dst`` (node indices).

    Attributes:
      src: index of the producing node.
      dst: index of the consuming node.
      cost: the ``|S_src| x |S_dst|`` matrix flattened row-major: the cost of ``src`` picking
        ``i`` and ``dst`` picking ``j`` is ``cost[i * n_dst + j]`` (``inf`` = forbidden pair).
    """

    src: int
    dst: int
    cost: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "src", int(self.src))
        object.__setattr__(self, "dst", int(self.dst))
        object.__setattr__(
            self,
            "cost",
            _floats(self.cost, where=f"Edge({self.src}->{self.dst}).cost", allow_inf=True),
        )


@dataclass(frozen=True)
class Follower:
    """``node`` must pick the same strategy index as ``leader`` (equal strategy counts)."""

    node: int
    leader: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "node", int(self.node))
        object.__setattr__(self, "leader", int(self.leader))


@dataclass(frozen=True)
class Alias:
    """Two nodes whose strategy pairs are restricted (e.g. a buffer and the value aliasing it).

    Attributes:
      a: index of the first node.
      b: index of the second node.
      allowed: an ``|S_a| x |S_b|`` 0/1 matrix flattened row-major; 0 forbids the pair.
    """

    a: int
    b: int
    allowed: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "a", int(self.a))
        object.__setattr__(self, "b", int(self.b))
        object.__setattr__(
            self,
            "allowed",
            _floats(self.allowed, where=f"Alias({self.a}~{self.b}).allowed", allow_inf=False),
        )


@dataclass(frozen=True)
class MemoryCut:
    """One more time step, whose live memory is a function of the choice:
    ``fixed_bytes + sum(terms) + sum(copies)`` must fit the budget.

    A term ``(node, coefficients)`` counts its chosen strategy's coefficient. A copy
    ``(reader, needed, holder, held)`` is a buffer that exists only for some pairs of choices:
    the reader's chosen strategy needs ``needed[s]`` bytes of a value that the holder's holds
    as ``held[t]`` bytes; a reader needing more than is held gathers a copy of ``needed[s]``
    bytes (an all-gathered weight), otherwise it reads the value in place (0 bytes).

    Attributes:
      terms: ``(node index, one coefficient per strategy)`` pairs; a node may appear in
        several.
      fixed_bytes: bytes live whatever the choice.
      name: a label for violations.
      copies: ``(reader node, needed bytes per strategy, holder node, held bytes per
        strategy)``.
    """

    terms: tuple[tuple[int, tuple[float, ...]], ...]
    fixed_bytes: float = 0.0
    name: str = ""
    copies: tuple[tuple[int, tuple[float, ...], int, tuple[float, ...]], ...] = ()

    def __post_init__(self) -> None:
        where = f"MemoryCut({self.name!r})"
        object.__setattr__(self, "terms", _terms(self.terms, where=f"{where}.terms"))
        copies = []
        for reader, needed, holder, held in self.copies:
            ((r, a), (h, b)) = _terms(((reader, needed), (holder, held)),
                                      where=f"{where}.copies")
            copies.append((r, a, h, b))
        object.__setattr__(self, "copies", tuple(copies))
        object.__setattr__(self, "fixed_bytes", float(self.fixed_bytes))

    def all_terms(self) -> tuple[tuple[int, tuple[float, ...]], ...]:
        """The terms, and the reader and holder of each copy."""
        return self.terms + tuple(t for r, a, h, b in self.copies for t in ((r, a), (h, b)))

    def value(self, chosen: Sequence[int]) -> float:
        """Live bytes under ``chosen`` (one strategy index per node)."""
        return math.fsum([self.fixed_bytes, *(c[chosen[i]] for i, c in self.terms),
                          *(a[chosen[r]] for r, a, h, b in self.copies
                            if a[chosen[r]] > b[chosen[h]])])


def _terms(terms: Iterable[tuple[int, Iterable[float]]], *, where: str
           ) -> tuple[tuple[int, tuple[float, ...]], ...]:
    out = []
    for i, coefficients in terms:
        values = tuple(float(c) for c in coefficients)
        if not all(math.isfinite(c) for c in values):
            raise _invalid("memory coefficients must be finite", where=where, value=values,
                           remedy="give one finite byte count per strategy")
        out.append((int(i), values))
    return tuple(out)


@dataclass(frozen=True)
class Problem:
    """One intra-op sharding problem: pick one strategy per node at minimum total cost.

    The objective is ``sum(compute + communication of chosen strategies) + sum(resharding on
    edges) + memory penalty``; the memory penalty (soft mode only) is
    ``overbudget_coeff * max(0, max_t(live_t) - memory_budget_bytes)``: one penalty on the
    largest excess over time steps, as XLA does.

    Attributes:
      nodes: the nodes, indexed by position.
      edges: resharding costs between nodes.
      liveness: for each time step, the indices of the nodes live at it (a node listed twice
        counts twice).
      memory_cuts: further time steps as linear functions of the choice (:class:`MemoryCut`).
      memory_budget_bytes: per-device memory budget; ``None`` disables memory accounting.
      memory_mode: ``"hard"`` (live memory <= budget at every step) or ``"soft"`` (penalty).
      overbudget_coeff: soft mode: penalty per byte of the peak excess over the budget.
      max_departures: at most this much departure cost in total; ``None`` = unlimited.
      max_cost: the objective must not exceed this, else the problem is infeasible.
      followers: strategy-equality constraints.
      aliases: forbidden strategy pairs.
      hints: a starting assignment handed to the solver (does not change the optimum).
      time_limit_s: wall-clock limit of one solve.
      relative_gap: accept a solution whose cost is within this fraction of the proven lower
        bound (0: prove optimality); the LP relaxation's rounding or CP-SAT stops there.
      seed: random seed of the solver.
      workers: solver threads; 1 (the default) is deterministic.
      name: a label for logs and JSON files.
    """

    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    _: KW_ONLY
    liveness: tuple[tuple[int, ...], ...] = ()
    memory_cuts: tuple[MemoryCut, ...] = ()
    memory_budget_bytes: float | None = None
    memory_mode: MemoryMode = "hard"
    overbudget_coeff: float = 1e6
    max_departures: int | None = None
    max_cost: float | None = None
    followers: tuple[Follower, ...] = ()
    aliases: tuple[Alias, ...] = ()
    hints: tuple[int, ...] | None = None
    time_limit_s: float = 60.0
    relative_gap: float = 0.0
    seed: int = 0
    workers: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "nodes", tuple(self.nodes))
        set_(self, "edges", tuple(self.edges))
        set_(self, "liveness", tuple(tuple(int(i) for i in step) for step in self.liveness))
        set_(self, "memory_cuts", tuple(self.memory_cuts))
        set_(self, "followers", tuple(self.followers))
        set_(self, "aliases", tuple(self.aliases))
        if self.hints is not None:
            set_(self, "hints", tuple(int(h) for h in self.hints))
        if self.memory_budget_bytes is not None:
            set_(self, "memory_budget_bytes", float(self.memory_budget_bytes))
        if self.max_cost is not None:
            set_(self, "max_cost", float(self.max_cost))
        set_(self, "overbudget_coeff", float(self.overbudget_coeff))
        set_(self, "time_limit_s", float(self.time_limit_s))
        set_(self, "relative_gap", float(self.relative_gap))
        set_(self, "seed", int(self.seed))
        set_(self, "workers", int(self.workers))
        _validate(self)

    def memory_steps(self) -> tuple[MemoryCut, ...]:
        """Every time step as a :class:`MemoryCut`: the liveness steps (each node's
        ``memory_bytes``), then the cuts (named ``cut k`` where they have no name)."""
        steps = tuple(MemoryCut(tuple((i, self.nodes[i].memory_bytes) for i in step),
                                name=f"time step {t}") for t, step in enumerate(self.liveness))
        return steps + tuple(c if c.name else dataclasses.replace(c, name=f"cut {k}")
                             for k, c in enumerate(self.memory_cuts))

    def strategy_counts(self) -> tuple[int, ...]:
        """Number of strategies of each node."""
        return tuple(n.num_strategies for n in self.nodes)

    def to_json(self, *, indent: int | None = None) -> str:
        """Serialises the problem (``"inf"`` for infinite costs), with ``schema_version``."""
        from shardplan.solver.intraop.problem_json import problem_to_dict

        return json.dumps(problem_to_dict(self), indent=indent)

    @classmethod
    def from_json(cls, text: str, /) -> Problem:
        """Reads a problem written by :meth:`to_json`.

        Raises:
          SolverError: the schema version is unknown or a key is missing or unexpected.
        """
        from shardplan.solver.intraop.problem_json import problem_from_dict

        return problem_from_dict(_load_versioned(text, "Problem"))


@dataclass(frozen=True)
class Solution:
    """What :func:`shardplan.solver.solve` returns.

    Attributes:
      status: ``"optimal"`` (proven for the solver's model: integer costs with the tie-breaking
        salt), ``"feasible"`` (time limit hit with an incumbent), ``"infeasible"`` (proven), or
        ``"timeout_no_solution"``.
      assignment: the chosen strategy index of each node, or ``None`` without a solution.
      objective: the assignment's exact objective in the problem's own units (recomputed by the
        evaluator, not taken from the scaled solver value).
      best_bound: ``objective * (1 - gap)``: the objective scaled by the solver's proven ratio.
      gap: the solver's relative gap ``(incumbent - bound) / incumbent`` in its integer model;
        0 when optimal.
      solve_time_s: wall-clock time of the whole call.
      stats: model size and solver facts (``variables``, ``constraints``, ``cost_scale``,
        ``cost_resolution``, ...), and on infeasibility ``infeasible_because`` (a list of
        constraint families) and ``infeasible_detail``. Values are JSON-native.
    """

    status: SolutionStatus
    assignment: tuple[int, ...] | None
    objective: float | None
    best_bound: float | None
    gap: float | None
    solve_time_s: float
    stats: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self, *, indent: int | None = None) -> str:
        """Serialises the solution with ``schema_version``."""
        payload = {
            "schema_version": SCHEMA_VERSION,
            "status": self.status,
            "assignment": None if self.assignment is None else list(self.assignment),
            "objective": _encode_float(self.objective),
            "best_bound": _encode_float(self.best_bound),
            "gap": _encode_float(self.gap),
            "solve_time_s": self.solve_time_s,
            "stats": dict(self.stats),
        }
        return json.dumps(payload, indent=indent)

    @classmethod
    def from_json(cls, text: str, /) -> Solution:
        """Reads a solution written by :meth:`to_json`."""
        data = _load_versioned(text, "Solution")
        _check_keys(
            data,
            {"status", "assignment", "objective", "best_bound", "gap", "solve_time_s", "stats"},
            where="Solution",
        )
        if data["status"] not in _STATUSES:
            raise _invalid(
                "unknown status",
                where="Solution.status",
                value=data["status"],
                remedy=f"use one of {_STATUSES}",
            )
        assignment = data["assignment"]
        return cls(
            status=data["status"],
            assignment=None if assignment is None else tuple(int(s) for s in assignment),
            objective=_decode_float(data["objective"]),
            best_bound=_decode_float(data["best_bound"]),
            gap=_decode_float(data["gap"]),
            solve_time_s=float(data["solve_time_s"]),
            stats=dict(data["stats"]),
        )


# --------------------------------------------------------------------------- validation


def _validate(problem: Problem) -> None:
    """Checks indices, matrix sizes and options; raises :class:`SolverError` naming the field."""
    counts = problem.strategy_counts()
    n = len(counts)

    def index(i: int, where: str) -> None:
        if not 0 <= i < n:
            raise _invalid(
                f"node index {i} is out of range (the problem has {n} nodes)",
                where=where,
                remedy="index nodes by their position in Problem.nodes",
            )

    for k, e in enumerate(problem.edges):
        where = f"Problem.edges[{k}]"
        index(e.src, f"{where}.src")
        index(e.dst, f"{where}.dst")
        if len(e.cost) != counts[e.src] * counts[e.dst]:
            raise _invalid(
                f"cost has {len(e.cost)} entries, expected {counts[e.src]} x {counts[e.dst]}",
                where=f"{where}.cost",
                remedy="flatten the matrix row-major: cost[i * n_dst + j]",
            )
    for k, f in enumerate(problem.followers):
        where = f"Problem.followers[{k}]"
        index(f.node, f"{where}.node")
        index(f.leader, f"{where}.leader")
        if counts[f.node] != counts[f.leader]:
            raise _invalid(
                f"follower {problem.nodes[f.node].name!r} has {counts[f.node]} strategies but "
                f"its leader {problem.nodes[f.leader].name!r} has {counts[f.leader]}",
                where=where,
                remedy="a follower must have exactly its leader's strategies",
            )
    for k, a in enumerate(problem.aliases):
        where = f"Problem.aliases[{k}]"
        index(a.a, f"{where}.a")
        index(a.b, f"{where}.b")
        if len(a.allowed) != counts[a.a] * counts[a.b]:
            raise _invalid(
                f"allowed has {len(a.allowed)} entries, expected {counts[a.a]} x {counts[a.b]}",
                where=f"{where}.allowed",
                remedy="flatten the 0/1 matrix row-major",
            )
    for t, step in enumerate(problem.liveness):
        for i in step:
            index(i, f"Problem.liveness[{t}]")
    for k, cut in enumerate(problem.memory_cuts):
        for i, coefficients in cut.all_terms():
            index(i, f"Problem.memory_cuts[{k}]")
            if len(coefficients) != counts[i]:
                raise _invalid(
                    f"a term of node {i} has {len(coefficients)} coefficients for "
                    f"{counts[i]} strategies", where=f"Problem.memory_cuts[{k}]",
                    remedy="give one coefficient per strategy")
    _validate_hints(problem, counts)
    _validate_options(problem)


def _validate_hints(problem: Problem, counts: Sequence[int]) -> None:
    n = len(counts)
    if problem.hints is not None:
        if len(problem.hints) != n:
            raise _invalid(
                f"hints has {len(problem.hints)} entries for {n} nodes",
                where="Problem.hints",
                remedy="give one strategy index per node",
            )
        for i, h in enumerate(problem.hints):
            if not 0 <= h < counts[i]:
                raise _invalid(
                    f"hint {h} is out of range for a node with {counts[i]} strategies",
                    where=f"Problem.hints[{i}]",
                    remedy="use a valid strategy index",
                )


def _validate_options(problem: Problem) -> None:
    if problem.memory_mode not in _MEMORY_MODES:
        raise _invalid(
            "unknown memory mode",
            where="Problem.memory_mode",
            value=problem.memory_mode,
            remedy="use 'hard' or 'soft'",
        )
    checks = [
        ("memory_budget_bytes", problem.memory_budget_bytes, True),
        ("max_cost", problem.max_cost, True),
        ("max_departures", problem.max_departures, True),
        ("overbudget_coeff", problem.overbudget_coeff, False),
        ("time_limit_s", problem.time_limit_s, False),
        ("relative_gap", problem.relative_gap, False),
    ]
    for key, value, optional in checks:
        if value is None and optional:
            continue
        if value is None or math.isnan(value) or value < 0 or math.isinf(value):
            raise _invalid(
                "must be a finite non-negative number",
                where=f"Problem.{key}",
                value=value,
                remedy="fix the option",
            )
    if problem.workers < 1:
        raise _invalid(
            "at least one worker is needed",
            where="Problem.workers",
            value=problem.workers,
            remedy="use workers=1 for deterministic solves",
        )


# --------------------------------------------------------------------------- JSON


def _encode_float(x: float | None) -> float | str | None:
    if x is None:
        return None
    return "inf" if math.isinf(x) and x > 0 else x


def _decode_float(x: float | str | None) -> float | None:
    if x is None:
        return None
    if x == "inf":
        return math.inf
    return float(x)


def _encode_floats(xs: Sequence[float]) -> list[float | str]:
    return ["inf" if math.isinf(x) else x for x in xs]


def _decode_floats(xs: Sequence[float | str]) -> tuple[float, ...]:
    return tuple(math.inf if x == "inf" else float(x) for x in xs)


def _check_keys(data: Mapping[str, Any], expected: set[str], *, where: str) -> None:
    missing = expected - set(data)
    unknown = set(data) - expected
    if missing or unknown:
        raise _invalid(
            f"missing keys {sorted(missing)}, unknown keys {sorted(unknown)}",
            where=where,
            remedy="write the file with to_json() of this version",
        )


def _load_versioned(text: str, kind: str) -> dict[str, Any]:
    data = json.loads(text)
    if not isinstance(data, dict):
        raise _invalid("expected a JSON object", where=kind, remedy="pass to_json() output")
    version = data.pop("schema_version", None)
    if version != SCHEMA_VERSION:
        raise _invalid(
            f"unsupported schema_version (this code reads {SCHEMA_VERSION})",
            where=f"{kind}.schema_version",
            value=version,
            remedy="re-create the file with this version of shardplan",
        )
    return data
