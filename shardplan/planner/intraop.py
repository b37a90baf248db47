"""The intra-op sharding problem of one mesh: an OpGraph as a solver Problem, and back.

The problem is the layout's (:mod:`shardplan.planner.layout`, one builder for the single-mesh
planner, the layer cost tables and folded loop blocks): its nodes, strategies, followers and
edges are :mod:`shardplan.planner.nodes`', priced on the mesh. :func:`build_intraop_problem`
adds what only a plan's own problem has:

* the user's annotations: a state leaf with a fixed spec may take no other sharding;
* memory, a hard constraint per device: the arguments always, and each :class:`MemoryCut`
  (the values live where a previous plan's memory peaked, in the shardings this problem
  picks, plus what no node decides);
* with a fold, the problem on the full graph's ids (:func:`shardplan.planner.fold.expand`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from shardplan.cluster import Cluster
from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.sharding import Spec
from shardplan.cost.strategies import OpStrategy
from shardplan.errors import ClusterError, ConfigError, format_error
from shardplan.planner.fold import Fold, expand
from shardplan.planner.layout import intraop_layout, step_facts
from shardplan.planner.memory import MemoryPeak, memory_cut
from shardplan.planner.nodes import IntraOpProblem
from shardplan.trace.graph import OpGraph, Parameter

__all__ = ["build_intraop_problem"]


def build_intraop_problem(
    graph: OpGraph,
    mesh: LogicalMesh,
    cluster: Cluster,
    *,
    time_limit_s: float = 30.0,
    relative_gap: float = 0.0,
    tie_period: int = 1,
    follow: bool = True,
    memory_budget_bytes: float | None = None,
    memory_peaks: tuple[MemoryPeak, ...] = (),
    fixed_specs: Mapping[str, Spec] | None = None,
    fold: Fold | None = None,
) -> IntraOpProblem:
    """Builds the intra-op problem of ``graph`` on ``mesh`` (see the module docstring).

    Args:
      graph: the traced step.
      mesh: a mesh over device ids of one type in ``cluster``.
      cluster: device figures and links.
      time_limit_s: the solver's time limit.
      relative_gap: the solver stops within this fraction of the proven optimum.
      tie_period: give blocks with equal fingerprints one set of variables per residue of their
        position modulo this period (their costs add); 0 ties nothing.
      follow: elementwise ops follow the producer of their full-size operand (XLA's followers:
        one strategy per producer strategy, chosen together), which removes most edges.
      memory_budget_bytes: per-device bytes the arguments (parameters, optimizer state, batch)
        may take, and at each of ``memory_peaks``; a hard constraint.
      memory_peaks: points of the step whose live bytes must fit the budget too.
      fixed_specs: ``{state key path: spec}``: those state leaves may only take that sharding
        (the user's annotations, :mod:`shardplan.planner.annotations`); every other strategy
        of theirs costs ``inf``.
      fold: ``graph``'s loop blocks folded with period ``tie_period``
        (:func:`shardplan.planner.fold.fold_blocks`): the problem is built on ``fold.graph``
        (its ops charged as ``graph`` charges them, the operand uses that differ from the ops'
        counts priced as such, plus its carries) and returned on ``graph``'s ids: every op of
        a folded block takes its representative's node, and memory cuts are ``graph``'s.

    Raises:
      ClusterError: the mesh spans several device types.
      ConfigError: no sharding of an annotated leaf on ``mesh`` matches its fixed spec.
      ValueError: ``fold`` is not a fold of ``graph`` with period ``tie_period``.
    """
    full = graph
    if fold is not None:
        if fold.source is not graph or fold.period != tie_period:
            raise ValueError("fold must be fold_blocks(graph, tie_period)")
        graph = fold.graph
    types = {cluster.group_of(d).device.name for d in mesh.device_ids}
    if len(types) != 1:
        raise ClusterError(
            format_error(
                "An intra-op problem is solved on devices of one type.",
                where="mesh",
                value=sorted(types),
                remedy="plan one mesh per device group",
            )
        )
    facts = step_facts(graph, tie_period=tie_period, fold=fold)
    layout = intraop_layout(graph, mesh, tie_period=tie_period, follow=follow, facts=facts)
    built = layout.problem(mesh, cluster, time_limit_s=time_limit_s, relative_gap=relative_gap)
    nodes = list(built.problem.nodes)
    for p, n in _annotated(full, fold, built.input_nodes, fixed_specs):
        assert fixed_specs is not None
        nodes[n] = dataclasses.replace(nodes[n], compute_cost=_fixed(
            nodes[n].compute_cost, built.strategies[n], fixed_specs[p.path], p.path, mesh))
    arguments = tuple(sorted(set(built.input_nodes.values())))
    # Memory peaks are the full graph's (its estimate's buffers and op positions).
    full_ops = (built.op_nodes if fold is None
                else {o: built.op_nodes[f] for o, f in enumerate(fold.op_of)})
    full_inputs = built.input_nodes if fold is None else fold.full_inputs(built.input_nodes)
    memory = [node.memory_bytes for node in nodes]
    cuts = tuple(memory_cut(full, mesh, peak, arguments, memory, full_inputs, full_ops,
                            list(built.strategies), name=f"memory peak {k}")
                 for k, peak in enumerate(memory_peaks if memory_budget_bytes else ()))
    problem = dataclasses.replace(
        built.problem,
        nodes=tuple(nodes),
        liveness=(arguments,) if memory_budget_bytes else (),
        memory_cuts=cuts,
        memory_budget_bytes=memory_budget_bytes,
    )
    built = dataclasses.replace(built, problem=problem)
    return built if fold is None else expand(fold, built)


def _fixed(costs: tuple[float, ...], strategies: tuple[OpStrategy, ...], spec: Spec, path: str,
           mesh: LogicalMesh) -> tuple[float, ...]:
    """``costs`` with every strategy whose sharding is not ``spec`` forbidden (axes of size 1
    shard nothing and are dropped from ``spec``, as strategies never use them)."""
    spec = tuple(tuple(a for a in dim if mesh.size(a) > 1) for dim in spec)
    if not any(s.result_specs[0] == spec for s in strategies):
        raise ConfigError(format_error(
            "No sharding of the leaf on this mesh matches its annotation (a dimension split "
            "over several axes must list them in the mesh's axis order).",
            where=path, value={"annotation": spec, "mesh": mesh.shape},
            remedy=f"annotate with the mesh axes in the order {mesh.axis_names}"))
    return tuple(c if s.result_specs[0] == spec else math.inf
                 for c, s in zip(costs, strategies, strict=True))


def _annotated(graph: OpGraph, fold: Fold | None, input_nodes: Mapping[int, int],
               fixed_specs: Mapping[str, Spec] | None) -> list[tuple[Parameter, int]]:
    """The state leaves of ``graph`` with a fixed spec and their nodes (a leaf ``fold``
    dropped: its representative's)."""
    if not fixed_specs:
        return []
    nodes = input_nodes if fold is None else fold.full_inputs(input_nodes)
    return [(p, nodes[p.tensor]) for p in graph.parameters
            if p.arg_index == 0 and p.path in fixed_specs]
