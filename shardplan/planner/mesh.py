"""Mesh-shape search: lay N devices of one type out as 1–3 logical axes and keep the best.

Devices are ordered by (node, position in node) and meshes are row-major, so inner axes stay
inside a node (the fastest link) and outer axes span nodes. Candidates follow the topology:

* **aligned**: every axis lies inside a node or runs across nodes at one position per node. An
  axis straddling both (16 over 8 nodes of 8) is the merge of an across-nodes axis and an
  inside-node axis, whose collectives are the same hierarchical ones; it is not tried (16 × 4 on
  8 nodes of 8 needs ``max_axes=3``, where its refinement 8 × 2 × 4 is a candidate).
* **one per symmetry class**: links are uniform at each level, so the order of the axes within
  a level changes nothing (2 × 4 inside a node costs what 4 × 2 does); one order is kept.
* **the finest**: a factor may take several adjacent axes, so every strategy on a mesh is a
  strategy on any refinement of it (split axes) at the same cost; a candidate that another
  candidate refines can only tie with it and is not solved. 8 devices in one node with two axes
  give the single candidate 2 × 4 (which also holds the 8-way and 4 × 2 plans). XLA agrees:
  a dimension split over adjacent axes compiles to the collectives of one axis of their
  product (Alpa's Megatron MLP on 2 × 2 is 5 all-reduces over all 4 devices, as on an axis
  of 4: ``tests/planner/test_alpa_mlp.py``). The refinement also has plans no coarser mesh has (2-D
  tensor parallelism: kernels split over ``outer`` × ``inner``, then ``inner`` × ``outer``),
  and these win where the cost model prices them cheaper.

The intra-op problem is solved on each remaining candidate and the cheapest plan wins (ties: the
order of enumeration). Two axes are the default: a third multiplies the strategies of a rank-4
tensor by five, and measured on GPT-3 175B over 8 nodes of 8 the ILP grows from 26,739 to
447,429 variables (solved in ~1 s vs ~90 s) for the same optimum.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Hashable, Sequence

from shardplan.cluster import Cluster
from shardplan.cluster.mesh import LogicalMesh
from shardplan.errors import InfeasibleError, format_error
from shardplan.planner.fold import Fold
from shardplan.planner.intraop import build_intraop_problem
from shardplan.planner.layout import (
    IntraOpCosts,
    IntraOpLayout,
    intraop_layout,
    layout_signature,
    step_facts,
)
from shardplan.planner.nodes import IntraOpProblem
from shardplan.solver import Solution, solve
from shardplan.solver.intraop.family import ProblemFamily
from shardplan.trace.graph import OpGraph

__all__ = ["MeshChoice", "MeshSearch", "best_mesh", "candidate_meshes", "coarser_meshes"]

AXIS_NAMES = ("outer", "middle", "inner")
"""Axis names by position; a 2-axis mesh uses ``outer`` and ``inner``."""


def _factorisations(n: int, max_axes: int) -> list[tuple[int, ...]]:
    """Ordered factorisations of ``n`` into at most ``max_axes`` factors greater than one."""
    out: list[tuple[int, ...]] = []

    def rec(rest: int, prefix: tuple[int, ...]) -> None:
        if rest == 1:
            out.append(prefix)
            return
        if len(prefix) == max_axes:
            return
        for f in range(2, rest + 1):
            if rest % f == 0:
                rec(rest // f, (*prefix, f))

    rec(n, ())
    return out


def _refines(fine: tuple[int, ...], coarse: tuple[int, ...]) -> bool:
    """Whether merging runs of adjacent factors of ``fine`` can give ``coarse``."""
    if not coarse:
        return not fine
    product = 1
    for k, f in enumerate(fine):
        product *= f
        if product == coarse[0]:
            return _refines(fine[k + 1:], coarse[1:])
        if product > coarse[0]:
            return False
    return False


def _shapes(nodes: int, per_node: int, max_axes: int) -> list[tuple[int, ...]]:
    """Aligned mesh shapes (across-node factors, then inside-node factors), one per symmetry
    class, without those another candidate refines."""
    levels: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for across in _factorisations(nodes, max_axes):
        for inside in _factorisations(per_node, max_axes - len(across)):
            key = (tuple(sorted(across)), tuple(sorted(inside)))
            if key not in levels:
                levels.append(key)
    finest = [
        (a, b) for a, b in levels
        if not any((a2, b2) != (a, b) and _refines(a2, a) and _refines(b2, b) for a2, b2 in levels)
    ]
    return [a + b or (1,) for a, b in finest]


def candidate_meshes(device_ids: Sequence[int], cluster: Cluster, *,
                     max_axes: int = 2) -> list[LogicalMesh]:
    """The logical meshes over ``device_ids`` worth solving (see the module docstring), fewest
    axes first.

    Devices spread unevenly over nodes have no aligned layout; every factorisation is then a
    candidate.
    """
    ids = sorted(device_ids, key=lambda d: (cluster.node_of(d), d))
    per: dict[int, int] = {}
    for d in ids:
        per[cluster.node_of(d)] = per.get(cluster.node_of(d), 0) + 1
    if len(set(per.values())) == 1:
        shapes = _shapes(len(per), next(iter(per.values())), max_axes)
    else:
        shapes = [f for f in _factorisations(len(ids), max_axes) if f] or [(1,)]
    shapes.sort(key=lambda shape: (len(shape), shape))
    meshes = []
    for shape in shapes:
        names = {1: ("inner",), 2: ("outer", "inner"), 3: AXIS_NAMES}[len(shape)]
        meshes.append(LogicalMesh(names, shape, tuple(ids)))
    return meshes


def coarser_meshes(device_ids: Sequence[int], cluster: Cluster, *,
                   max_axes: int = 2) -> list[LogicalMesh]:
    """The aligned meshes :func:`candidate_meshes` leaves out because a candidate refines
    them (8 devices in one node: the 1-axis mesh of 8, which 2 x 4 refines), fewest axes first.

    No plan on them can beat the best plan on their refinement, so they are never solved to
    choose a plan; they are solved for the runner-ups :meth:`shardplan.Plan.explain` shows (the
    best plan on a simpler mesh, and what the finer mesh gains over it).
    """
    ids = sorted(device_ids, key=lambda d: (cluster.node_of(d), d))
    per: dict[int, int] = {}
    for d in ids:
        per[cluster.node_of(d)] = per.get(cluster.node_of(d), 0) + 1
    if len(set(per.values())) != 1:
        return []
    nodes, per_node = len(per), next(iter(per.values()))
    chosen = set(_shapes(nodes, per_node, max_axes))
    shapes: list[tuple[int, ...]] = []
    for across in _factorisations(nodes, max_axes):
        for inside in _factorisations(per_node, max_axes - len(across)):
            shape = (tuple(sorted(across)) + tuple(sorted(inside))) or (1,)
            if shape not in chosen and shape not in shapes:
                shapes.append(shape)
    if len(ids) > 1 and (len(ids),) not in chosen | set(shapes):
        shapes.append((len(ids),))  # one axis over every node: the simplest mesh there is
    shapes.sort(key=lambda shape: (len(shape), shape))
    names = {1: ("inner",), 2: ("outer", "inner"), 3: AXIS_NAMES}
    return [LogicalMesh(names[len(shape)], shape, tuple(ids)) for shape in shapes]


@dataclasses.dataclass(frozen=True)
class MeshChoice:
    """The best mesh and its solved intra-op problem, with every candidate's objective.

    ``problem`` is built on first use where the search solved without it (:class:`MeshSearch`).
    ``others`` keeps the other candidates :func:`best_mesh` solved (their mesh, solution and
    problem), so the plan can report its runner-ups without solving again.
    """

    mesh: LogicalMesh
    solution: Solution
    candidates: tuple[tuple[tuple[int, ...], float | None], ...]
    build: Callable[[], IntraOpProblem] = dataclasses.field(repr=False, compare=False)
    others: tuple[tuple[LogicalMesh, Solution, IntraOpProblem], ...] = dataclasses.field(
        default=(), repr=False, compare=False)

    @functools.cached_property
    def problem(self) -> IntraOpProblem:
        """The solved intra-op problem."""
        return self.build()


def best_mesh(graph: OpGraph, device_ids: Sequence[int], cluster: Cluster, *,
              max_axes: int = 2, meshes: Sequence[LogicalMesh] | None = None,
              **build_options: object) -> MeshChoice:
    """Solves the intra-op problem on every candidate mesh and keeps the cheapest.

    ``meshes`` replaces :func:`candidate_meshes` (e.g. meshes with the user's axis names,
    :func:`shardplan.planner.annotations.annotated_meshes`).

    Raises:
      InfeasibleError: no candidate mesh has a solution.
    """
    best: tuple[float, LogicalMesh, IntraOpProblem, Solution] | None = None
    seen: list[tuple[tuple[int, ...], float | None]] = []
    solved: list[tuple[LogicalMesh, Solution, IntraOpProblem]] = []
    if meshes is None:
        meshes = candidate_meshes(device_ids, cluster, max_axes=max_axes)
    for mesh in meshes:
        ip = build_intraop_problem(graph, mesh, cluster, **build_options)  # type: ignore[arg-type]
        solution = solve(ip.problem)
        seen.append((mesh.axis_sizes, solution.objective))
        solved.append((mesh, solution, ip))
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
    return MeshChoice(mesh=mesh, solution=solution, candidates=tuple(seen),
                      build=lambda: ip, others=tuple(o for o in solved if o[0] is not mesh))


class MeshSearch:
    """:func:`best_mesh` for many device sets of one graph (the layer cost tables: every
    sub-mesh size of every device group), with the work shared between them.

    * The problem is laid out once per layout signature (:mod:`shardplan.planner.layout`):
      meshes of one shape on different device types, and shapes whose axes divide the same
      factor sizes (2 x 2 ... 4 x 8 for GPT-3), share it; each mesh only prices it.
    * Its relaxation is built once per layout (:class:`~shardplan.solver.intraop.family.ProblemFamily`)
      and re-solved per priced mesh from the previous basis. An integral relaxed optimum is an
      optimal sharding; otherwise the priced problem is solved by :func:`~shardplan.solver.solve`
      exactly as :func:`best_mesh` solves it.

    The solver problem of a choice is only built when asked for (``MeshChoice.problem``).
    """

    def __init__(self, graph: OpGraph, cluster: Cluster, *, max_axes: int = 2,
                 tie_period: int = 1, time_limit_s: float = 30.0,
                 relative_gap: float = 0.0, fold: Fold | None = None) -> None:
        self.graph = graph
        self.cluster = cluster
        self.max_axes = max_axes
        self.tie_period = tie_period
        self.time_limit_s = time_limit_s
        self.relative_gap = relative_gap
        self.timings: dict[str, float] = {"layout_s": 0.0, "relaxation_build_s": 0.0,
                                          "price_s": 0.0, "solve_s": 0.0}
        start = time.perf_counter()
        # With ``fold``, ``graph`` is ``fold.graph``: the layouts are the folded graph's.
        self.facts = step_facts(graph, tie_period=tie_period, fold=fold)
        self.timings["facts_s"] = time.perf_counter() - start
        self._layouts: dict[Hashable, IntraOpLayout] = {}
        self._families: dict[Hashable, ProblemFamily] = {}
        # Collective times shared by every mesh (layout.MeshCollectives).
        self.collective_cache: dict[tuple, float] = {}
        self._salts: dict[tuple[str, int], float] = {}
        self.fallbacks = 0

    def layout(self, mesh: LogicalMesh) -> IntraOpLayout:
        """The layout serving ``mesh``."""
        key = layout_signature(self.graph, mesh, factor_sizes=self.facts.factor_sizes)
        if key not in self._layouts:
            start = time.perf_counter()
            self._layouts[key] = intraop_layout(self.graph, mesh, tie_period=self.tie_period,
                                                facts=self.facts)
            self.timings["layout_s"] += time.perf_counter() - start
        return self._layouts[key]

    def best(self, device_ids: Sequence[int]) -> MeshChoice:
        """As :func:`best_mesh` over ``device_ids``.

        Raises:
          InfeasibleError: no candidate mesh has a solution.
        """
        best: tuple[float, LogicalMesh, Solution, Callable[[], IntraOpProblem]] | None = None
        seen: list[tuple[tuple[int, ...], float | None]] = []
        for mesh in candidate_meshes(device_ids, self.cluster, max_axes=self.max_axes):
            solution, build = self._solve(mesh)
            seen.append((mesh.axis_sizes, solution.objective))
            if solution.objective is None:
                continue
            if best is None or solution.objective < best[0]:
                best = (solution.objective, mesh, solution, build)
        if best is None:
            raise InfeasibleError(format_error(
                "No mesh over these devices gives a feasible sharding.",
                where=f"devices {list(device_ids)}", value=seen,
                remedy="add devices or raise the memory budget"))
        _, mesh, solution, build = best
        return MeshChoice(mesh=mesh, solution=solution, candidates=tuple(seen), build=build)

    def _solve(self, mesh: LogicalMesh) -> tuple[Solution, Callable[[], IntraOpProblem]]:
        layout = self.layout(mesh)
        start = time.perf_counter()
        costs = layout.price(mesh, self.cluster, collective_cache=self.collective_cache)
        priced = time.perf_counter()
        self.timings["price_s"] += priced - start

        def build(costs: IntraOpCosts | None = None) -> IntraOpProblem:
            return layout.problem(mesh, self.cluster, costs=costs,
                                  time_limit_s=self.time_limit_s, relative_gap=self.relative_gap)

        family = self._family(layout, costs)
        relaxed = family.solve(costs.compute, costs.communication, costs.edges,
                               relative_gap=self.relative_gap)
        if relaxed is not None and relaxed.integral:
            self.timings["solve_s"] += time.perf_counter() - priced
            solution = Solution(status="optimal", assignment=relaxed.assignment,
                                objective=relaxed.objective, best_bound=relaxed.objective,
                                gap=0.0, solve_time_s=relaxed.solve_time_s,
                                stats={"solver": "glop-family", "lp_relaxation": "integral",
                                       "iterations": relaxed.iterations})
            return solution, build
        if relaxed is not None and relaxed.gap <= self.relative_gap:
            # A rounding proven within the accepted gap of the relaxation's bound (the family
            # has no memory constraints: nothing else to check).
            self.timings["solve_s"] += time.perf_counter() - priced
            solution = Solution(status="feasible", assignment=relaxed.assignment,
                                objective=relaxed.objective,
                                best_bound=min(relaxed.lower_bound, relaxed.objective),
                                gap=relaxed.gap, solve_time_s=relaxed.solve_time_s,
                                stats={"solver": "glop-family",
                                       "lp_relaxation": f"fractional, rounded "
                                                        f"({relaxed.rounding}) gap "
                                                        f"{relaxed.gap:.3g}",
                                       "iterations": relaxed.iterations})
            return solution, build
        # Fractional beyond the gap, or refused: the exact path of best_mesh.
        self.fallbacks += 1
        ip = build(costs)
        solution = solve(ip.problem)
        self.timings["solve_s"] += time.perf_counter() - priced
        return solution, lambda: ip

    def _family(self, layout: IntraOpLayout, costs: IntraOpCosts) -> ProblemFamily:
        key = layout.signature
        if key not in self._families:
            start = time.perf_counter()
            self._families[key] = ProblemFamily(
                names=layout.names, counts=[len(s) for s in layout.strategies],
                followers=[(f.node, f.leader) for f in layout.followers], edges=layout.edges,
                labels=layout.edge_labels(), node_cost=costs.compute + costs.communication,
                edge_costs=costs.edges, salts=self._salts, time_limit_s=self.time_limit_s)
            self.timings["relaxation_build_s"] += time.perf_counter() - start
        return self._families[key]
