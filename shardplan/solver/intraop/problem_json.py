"""JSON layout of :class:`~shardplan.solver.intraop.problem.Problem` (``Problem.to_json`` /
``Problem.from_json``)."""

from __future__ import annotations

from typing import Any

from shardplan.solver.intraop.problem import (
    SCHEMA_VERSION,
    Alias,
    Edge,
    Follower,
    MemoryCut,
    Node,
    Problem,
    _check_keys,
    _decode_floats,
    _encode_floats,
)

__all__ = ["problem_from_dict", "problem_to_dict"]

_PROBLEM_KEYS = {
    "name",
    "nodes",
    "edges",
    "liveness",
    "memory_cuts",
    "memory_budget_bytes",
    "memory_mode",
    "overbudget_coeff",
    "max_departures",
    "max_cost",
    "followers",
    "aliases",
    "hints",
    "time_limit_s",
    "relative_gap",
    "seed",
    "workers",
}


def problem_to_dict(p: Problem) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "name": p.name,
        "nodes": [
            {
                "name": n.name,
                "compute_cost": _encode_floats(n.compute_cost),
                "communication_cost": _encode_floats(n.communication_cost),
                "memory_bytes": list(n.memory_bytes),
                "departure_cost": None if n.departure_cost is None else list(n.departure_cost),
            }
            for n in p.nodes
        ],
        "edges": [{"src": e.src, "dst": e.dst, "cost": _encode_floats(e.cost)} for e in p.edges],
        "liveness": [list(step) for step in p.liveness],
        "memory_cuts": [{"terms": [[i, list(c)] for i, c in cut.terms],
                         "fixed_bytes": cut.fixed_bytes, "name": cut.name,
                         "copies": [[r, list(a), h, list(b)] for r, a, h, b in cut.copies]}
                        for cut in p.memory_cuts],
        "memory_budget_bytes": p.memory_budget_bytes,
        "memory_mode": p.memory_mode,
        "overbudget_coeff": p.overbudget_coeff,
        "max_departures": p.max_departures,
        "max_cost": p.max_cost,
        "followers": [{"node": f.node, "leader": f.leader} for f in p.followers],
        "aliases": [{"a": a.a, "b": a.b, "allowed": list(a.allowed)} for a in p.aliases],
        "hints": None if p.hints is None else list(p.hints),
        "time_limit_s": p.time_limit_s,
        "relative_gap": p.relative_gap,
        "seed": p.seed,
        "workers": p.workers,
    }


def problem_from_dict(d: dict[str, Any]) -> Problem:
    d = {"relative_gap": 0.0, "memory_cuts": [], **d}  # absent from earlier dumps
    _check_keys(d, _PROBLEM_KEYS, where="Problem")
    nodes = tuple(
        Node(
            name=n["name"],
            compute_cost=_decode_floats(n["compute_cost"]),
            communication_cost=_decode_floats(n["communication_cost"]),
            memory_bytes=tuple(n["memory_bytes"]),
            departure_cost=None if n["departure_cost"] is None else tuple(n["departure_cost"]),
        )
        for n in d["nodes"]
    )
    edges = tuple(Edge(e["src"], e["dst"], _decode_floats(e["cost"])) for e in d["edges"])
    return Problem(
        nodes,
        edges,
        liveness=tuple(tuple(step) for step in d["liveness"]),
        memory_cuts=tuple(MemoryCut(cut["terms"], cut["fixed_bytes"], cut["name"],
                                    tuple(cut["copies"])) for cut in d["memory_cuts"]),
        memory_budget_bytes=d["memory_budget_bytes"],
        memory_mode=d["memory_mode"],
        overbudget_coeff=d["overbudget_coeff"],
        max_departures=d["max_departures"],
        max_cost=d["max_cost"],
        followers=tuple(Follower(f["node"], f["leader"]) for f in d["followers"]),
        aliases=tuple(Alias(a["a"], a["b"], tuple(a["allowed"])) for a in d["aliases"]),
        hints=None if d["hints"] is None else tuple(d["hints"]),
        time_limit_s=d["time_limit_s"],
        relative_gap=d["relative_gap"],
        seed=d["seed"],
        workers=d["workers"],
        name=d["name"],
    )
