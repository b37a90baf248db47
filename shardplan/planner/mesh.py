"""Mesh-shape search: lay N devices of one type out as 1–3 logical axes and keep the best.

Devices are ordered by (node, position in node), and meshes are row-major, so the innermost
axis stays inside a node (the fastest link) and outer axes span nodes. Each factorisation of N
into at most three factors greater than one is a candidate; the intra-op problem is solved on
each, and the cheapest plan wins (ties: fewer axes, then the order of enumeration).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from shardplan.cluster import Cluster
from shardplan.cluster.mesh import LogicalMesh
from shardplan.errors import InfeasibleError, format_error
from shardplan.planner.intraop import IntraOpProblem, build_intraop_problem
from shardplan.solver import Solution, solve
from shardplan.trace.graph import OpGraph

__all__ = ["MeshChoice", "best_mesh", "candidate_meshes"]

AXIS_NAMES = ("outer", "middle", "inner")
"""Axis names by position; a 2-axis mesh uses ``outer`` and ``inner``."""


def _factorisations(n: int, max_axes: int) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []

    def rec(rest: int, prefix: tuple[int, ...]) -> None:
        if rest == 1:
            if prefix:
                out.append(prefix)
            return
        if len(prefix) == max_axes:
            return
        for f in range(2, rest + 1):
            if rest % f == 0:
                rec(rest // f, (*prefix, f))

    rec(n, ())
    return out or [(1,)]


def candidate_meshes(device_ids: Sequence[int], cluster: Cluster, *,
                     max_axes: int = 3) -> list[LogicalMesh]:
    """The logical meshes over ``device_ids``, fewest axes first."""
    ids = sorted(device_ids, key=lambda d: (cluster.node_of(d), d))
    shapes = sorted(_factorisations(len(ids), max_axes), key=lambda s: (len(s), s))
    meshes = []
    for shape in shapes:
        names = {1: ("inner",), 2: ("outer", "inner"), 3: AXIS_NAMES}[len(shape)]
        meshes.append(LogicalMesh(names, shape, tuple(ids)))
    return meshes


@dataclasses.dataclass(frozen=True)
class MeshChoice:
    """The best mesh and its solved intra-op problem, with every candidate's objective."""

    mesh: LogicalMesh
    problem: IntraOpProblem
    solution: Solution
    candidates: tuple[tuple[tuple[int, ...], float | None], ...]


def best_mesh(graph: OpGraph, device_ids: Sequence[int], cluster: Cluster, *,
              max_axes: int = 3, **build_options: object) -> MeshChoice:
    """Solves the intra-op problem on every candidate mesh and keeps the cheapest.

    Raises:
      InfeasibleError: no candidate mesh has a solution.
    """
    best: tuple[float, LogicalMesh, IntraOpProblem, Solution] | None = None
    seen: list[tuple[tuple[int, ...], float | None]] = []
    for mesh in candidate_meshes(device_ids, cluster, max_axes=max_axes):
        ip = build_intraop_problem(graph, mesh, cluster, **build_options)  # type: ignore[arg-type]
        solution = solve(ip.problem)
        seen.append((mesh.axis_sizes, solution.objective))
        if solution.objective is None:
            continue
        if best is None or solution.objective < best[0]:
            best = (solution.objective, mesh, ip, solution)
    if best is None:
        raise InfeasibleError(format_error(
            "No mesh over these devices gives a feasible sharding.",
            where=f"devices {list(device_ids)}", value=seen,
            remedy="add devices or raise the memory budget"))
    _, mesh, ip, solution = best
    return MeshChoice(mesh=mesh, problem=ip, solution=solution, candidates=tuple(seen))
