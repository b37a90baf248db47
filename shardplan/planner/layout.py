"""An intra-op problem laid out once and priced per mesh and device type.

The intra-op problem of a traced step on a mesh (:mod:`shardplan.planner.nodes`: its nodes,
strategies, followers and operand uses) depends only on the mesh's axis names and on which
factor sizes its axes divide; its prices (roofline times, collective times) depend on the axis
sizes, the device type and the links. The layer cost tables solve the same step on up to seven
sub-mesh sizes of up to three device types, so the problem is laid out once per *layout
signature* (:func:`layout_signature`) and priced per (mesh, device type) with numpy.

:class:`IntraOpLayout` is the structure; :meth:`IntraOpLayout.price` gives the costs as flat
arrays (one entry per node strategy, one per edge strategy pair) and
:meth:`IntraOpLayout.problem` the :class:`~shardplan.solver.Problem`. This is the one builder
of the intra-op problem: :func:`~shardplan.planner.intraop.build_intraop_problem` (the
single-mesh planner, folded blocks) adds the memory budget and the user's annotations to it,
and :class:`~shardplan.planner.mesh.MeshSearch` (the layer tables) prices it per mesh.

Costs. A node's compute cost is its op's roofline time on the local shard (fused values cost
no memory traffic; an input's is :data:`~shardplan.planner.nodes.INPUT_BYTE_TIEBREAK_S` per
byte it holds); its communication cost is the all-reduce of its result when the strategy
contracts a sharded dimension (paid once, however many ops read the result; a reduce-scatter
into a sharded consumer is not yet priced lower). An edge per operand use carries the time of
the collectives that turn the producer's result into the sharding the consumer's strategy
needs (``inf`` for a value read in place that would move). An edge inside a follower group
can only take its diagonal (both ends pick the same index), and an edge that tied layers make
run from a node to itself likewise: both are costs of their consumer's node instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from shardplan.cluster import Cluster, DeviceSpec
from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.collectives import collective_time_s, mesh_collective_time_s
from shardplan.cost.combine import combinable_ops, startup_share
from shardplan.cost.compute import (
    OpClass,
    compute_dtype,
    fp32_rate,
    op_class,
    parameter_tensors,
    with_materialized_bytes,
)
from shardplan.cost.memory import in_memory_tensors
from shardplan.cost.rules import OpRule, op_rule
from shardplan.cost.sharding import ReshardStep, Spec, reduce_steps, reshard_steps
from shardplan.cost.strategies import OpStrategy
from shardplan.errors import ClusterError, format_error
from shardplan.planner.fold import BoundaryUses, Fold
from shardplan.planner.nodes import (
    INPUT_BYTE_TIEBREAK_S,
    IntraOpProblem,
    Use,
    operand_uses,
    problem_nodes,
    regenerable,
    tie_layers,
)
from shardplan.solver import Edge, Follower, Node, Problem
from shardplan.trace.graph import Op, OpGraph

__all__ = ["IntraOpCosts", "IntraOpLayout", "MeshCollectives", "RooflineTable", "StepFacts",
           "factor_sizes_of", "intraop_layout", "layout_signature", "step_facts"]

# (Past 600 lines: the layout and its pricing recipe (_Recipe, built from the layout's node
# and edge bookkeeping) are one unit; the two vectorised price tables it uses, MeshCollectives
# and RooflineTable, which layer_costs imports from here too, are the next module to split.)


def layout_signature(graph: OpGraph, mesh: LogicalMesh, *,
                     factor_sizes: Sequence[int] | None = None) -> Hashable:
    """What the layout of ``graph`` on ``mesh`` depends on: the axis names, which axes have
    more than one device (axes of size 1 are ignored), and, for every factor size of the
    graph's op rules and argument shapes (``factor_sizes``, default :func:`factor_sizes_of`),
    which products of axes divide it. Meshes with equal signatures have the same strategies,
    followers and edges (only ``shards`` differs)."""
    axes = [a for a, n in zip(mesh.axis_names, mesh.axis_sizes, strict=True) if n > 1]
    subsets = [s for k in range(1, len(axes) + 1) for s in itertools.combinations(axes, k)]
    sizes = factor_sizes if factor_sizes is not None else factor_sizes_of(graph)
    return (mesh.axis_names, tuple(n > 1 for n in mesh.axis_sizes),
            tuple(tuple(f % mesh.size(s) == 0 for s in subsets) for f in sizes))


def factor_sizes_of(graph: OpGraph, rules: Sequence[OpRule] | None = None) -> tuple[int, ...]:
    """The sizes (above 1) of every factor of the graph's op rules (``rules``: ``op_rule`` of
    every op, if known) and argument shapes."""
    sizes = {d for p in graph.parameters for d in p.shape if d > 1}
    for op in graph.ops:
        rule = rules[op.id] if rules is not None else op_rule(graph, op)
        sizes.update(f.size for f in rule.factors if f.size > 1)
    return tuple(sorted(sizes))


class _Adds:
    """Additions to a flat per-(node, strategy) array in a fixed order: ``rounds[r]`` holds
    the positions (into the value array) of the r-th addition to each entry it touches, so an
    entry sees its additions in the order they were recorded."""

    def __init__(self, events: Sequence[tuple[int, Sequence[int]]]) -> None:
        """``events``: (node, flat entries) in order; one value per entry, in the same order."""
        seen: dict[int, int] = {}
        rounds: list[list[int]] = []
        entries: list[int] = []
        for node, flat in events:
            r = seen.get(node, 0)
            seen[node] = r + 1
            while len(rounds) <= r:
                rounds.append([])
            rounds[r].extend(range(len(entries), len(entries) + len(flat)))
            entries.extend(flat)
        self.size = len(entries)
        self.entry = np.asarray(entries, dtype=np.int64)
        self.rounds = [np.asarray(r, dtype=np.int64) for r in rounds]

    def apply(self, target: np.ndarray, values: np.ndarray) -> None:
        for positions in self.rounds:
            target[self.entry[positions]] += values[positions]


@dataclasses.dataclass(frozen=True)
class IntraOpCosts:
    """The prices of a layout on one mesh of one device type (flat arrays, seconds).

    Attributes:
      mesh: the mesh.
      compute: per node strategy (``layout.base[n] + k``), the node's compute cost.
      communication: per node strategy, its communication cost.
      memory: per node strategy, the bytes the node keeps on one device.
      edges: per kept edge (``layout.edges``), its flattened cost matrix.
    """

    mesh: LogicalMesh
    compute: np.ndarray
    communication: np.ndarray
    memory: np.ndarray
    edges: tuple[np.ndarray, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class IntraOpLayout:
    """The structure of an intra-op problem on every mesh with one layout signature.

    Attributes:
      graph: the traced step.
      signature: :func:`layout_signature` of the meshes it serves.
      names: per node, its name.
      strategies: per node, its strategies (``shards`` as on the mesh it was laid out on).
      input_nodes, op_nodes, free_tensors: as in :class:`IntraOpProblem`.
      followers: the problem's followers (ops, then optimizer state).
      base: flat index of each node's first strategy; ``base[-1]`` is the total.
      edges: per kept edge, ``(src, dst)``.
      factor_sizes: :func:`factor_sizes_of` the graph.
    """

    graph: OpGraph
    signature: Hashable
    names: tuple[str, ...]
    strategies: tuple[tuple[OpStrategy, ...], ...]
    input_nodes: Mapping[int, int]
    op_nodes: Mapping[int, int]
    free_tensors: frozenset[int]
    followers: tuple[Follower, ...]
    base: np.ndarray
    edges: tuple[tuple[int, int], ...]
    factor_sizes: tuple[int, ...]
    _recipe: _Recipe

    def serves(self, mesh: LogicalMesh) -> bool:
        """Whether ``mesh`` has this layout's signature."""
        return layout_signature(self.graph, mesh, factor_sizes=self.factor_sizes) == \
            self.signature

    def edge_labels(self) -> tuple[np.ndarray, ...]:
        """Per kept edge, one label per entry: entries with equal labels cost the same on
        every mesh and device type (the same resharding of the same bytes)."""
        return self._recipe.edge_labels()

    def price(self, mesh: LogicalMesh, cluster: Cluster, *,
              collective_cache: dict[tuple, float] | None = None) -> IntraOpCosts:
        """The costs on ``mesh`` (same signature) of the device type its devices have.

        ``collective_cache``: collective times to reuse and extend, for prices of several
        meshes of ``cluster`` (keyed by kind, bytes and the class of group, see
        ``MeshCollectives``).
        """
        if not self.serves(mesh):
            raise ValueError(f"mesh {mesh.axis_names}={mesh.axis_sizes} does not have this "
                             "layout's signature")
        return self._recipe.price(mesh, cluster, collective_cache)

    def problem(self, mesh: LogicalMesh, cluster: Cluster, *, costs: IntraOpCosts | None = None,
                time_limit_s: float = 30.0, relative_gap: float = 0.0) -> IntraOpProblem:
        """The :class:`~shardplan.planner.nodes.IntraOpProblem` on ``mesh`` (same signature),
        without a memory budget or annotations (``build_intraop_problem`` adds those).

        Raises:
          ClusterError: the mesh spans several device types.
          ValueError: ``mesh`` does not have this layout's signature.
        """
        costs = costs if costs is not None else self.price(mesh, cluster)
        compute, comm, memory = (a.tolist() for a in (costs.compute, costs.communication,
                                                      costs.memory))
        base = self.base.tolist()
        nodes = tuple(Node(name=self.names[n], compute_cost=tuple(compute[a:b]),
                           communication_cost=tuple(comm[a:b]), memory_bytes=tuple(memory[a:b]))
                      for n, (a, b) in enumerate(itertools.pairwise(base)))
        edges = tuple(Edge(src=s, dst=d, cost=tuple(c.tolist()))
                      for (s, d), c in zip(self.edges, costs.edges, strict=True))
        problem = Problem(nodes, edges, followers=self.followers, memory_mode="hard",
                          time_limit_s=time_limit_s, relative_gap=relative_gap,
                          name=f"intraop:{self.graph.name}")
        return IntraOpProblem(problem=problem, mesh=mesh, input_nodes=self.input_nodes,
                              op_nodes=self.op_nodes,
                              strategies=self.resized_strategies(mesh),
                              free_tensors=self.free_tensors)

    def resized_strategies(self, mesh: LogicalMesh) -> tuple[tuple[OpStrategy, ...], ...]:
        """The strategies with ``shards`` counted on ``mesh``."""
        def resize(s: OpStrategy) -> OpStrategy:
            shards = mesh.size(tuple(a for axes in s.factors.values() for a in axes))
            return s if shards == s.shards else dataclasses.replace(s, shards=shards)

        return tuple(tuple(resize(s) for s in strats) for strats in self.strategies)


@dataclasses.dataclass(frozen=True, eq=False)
class StepFacts:
    """What every layout of one traced step shares, computed once (:func:`step_facts`).

    Attributes:
      rules: per op, ``op_rule``.
      factor_sizes: :func:`factor_sizes_of` the graph.
      tie_period: the layer-tying period the canonical maps are for.
      canon_op, canon_in: :func:`~shardplan.planner.nodes.tie_layers`.
      free: values regenerated from constants.
      fused: per costed op (not structural, not folded), the op charged for the bytes that
        live in memory only, its compute dtype and its class.
      boundary, source_ids: a fold's (``build_intraop_problem``'s ``fold``), else None.
      leaf_weights: a fold's :attr:`~shardplan.planner.fold.Fold.leaf_weights` (the leaves
        each folded-graph leaf stands for, whose bytes it holds), else empty.
      combinable: ops whose partial-sum all-reduces XLA's combiner merges with others
        (:func:`~shardplan.cost.combine.combinable_ops`): they pay a share of a call's
        start-up.
    """

    rules: tuple[OpRule, ...]
    factor_sizes: tuple[int, ...]
    tie_period: int
    canon_op: Mapping[int, int]
    canon_in: Mapping[int, int]
    free: frozenset[int]
    fused: Mapping[int, tuple[tuple[Op, ...], str, OpClass]]
    boundary: BoundaryUses | None = None
    source_ids: tuple[int, ...] | None = None
    leaf_weights: Mapping[int, int] = dataclasses.field(default_factory=dict)
    combinable: frozenset[int] = frozenset()


def step_facts(graph: OpGraph, *, tie_period: int = 1, fold: Fold | None = None) -> StepFacts:
    """The :class:`StepFacts` of ``graph`` (``fold``: as in ``build_intraop_problem``)."""
    rules = tuple(op_rule(graph, op) for op in graph.ops)
    buffers = in_memory_tensors(graph)
    params = parameter_tensors(graph)
    canon_op, canon_in = tie_layers(graph, tie_period) if tie_period else ({}, {})
    charged = fold.charged if fold is not None else {}
    fused = {op.id: (charged[op.id] if op.id in charged
                     else (with_materialized_bytes(op, graph, lambda t: buffers[t]),),
                     compute_dtype(op, graph), op_class(op, params))
             for op in graph.ops if not (op.structural or op.attrs.get("folded"))}
    return StepFacts(rules=rules, factor_sizes=factor_sizes_of(graph, rules),
                     tie_period=tie_period, canon_op=canon_op, canon_in=canon_in,
                     free=regenerable(graph, {p.tensor for p in graph.parameters}),
                     fused=fused, boundary=fold.boundary if fold is not None else None,
                     source_ids=fold.source_ids if fold is not None else None,
                     leaf_weights=fold.leaf_weights if fold is not None else {},
                     combinable=combinable_ops(graph, rules))


def intraop_layout(graph: OpGraph, mesh: LogicalMesh, *, tie_period: int = 1,
                   follow: bool = True, facts: StepFacts | None = None) -> IntraOpLayout:
    """Lays out the intra-op problem of ``graph`` on ``mesh`` (and every mesh with the same
    :func:`layout_signature`).

    Args:
      graph: the traced step (with a fold: ``fold.graph``, and ``facts`` of the fold).
      mesh: the mesh it is laid out on.
      tie_period: :func:`~shardplan.planner.nodes.tie_layers`'s period (0 ties nothing).
      follow: whether ops follow the producer of an operand
        (:func:`~shardplan.planner.nodes.follow_target`).
      facts: the step's :class:`StepFacts` for ``tie_period``, if already known.
    """
    if facts is None or facts.tie_period != tie_period:
        facts = step_facts(graph, tie_period=tie_period)
    nodes = problem_nodes(graph, mesh, rules=facts.rules, canon_op=facts.canon_op,
                          canon_in=facts.canon_in, free=facts.free, follow=follow,
                          source_ids=facts.source_ids)
    input_nodes, op_nodes = nodes.input_nodes, nodes.op_nodes
    # (node, bytes it holds) per parameter, (node, op id) per op: the order costs add up in.
    param_events = [(input_nodes[p.tensor],
                     graph.tensors[p.tensor].nbytes * facts.leaf_weights.get(p.tensor, 1))
                    for p in graph.parameters]
    op_events = [(op_nodes[op.id], op.id) for op in graph.ops]
    strategies = list(nodes.strategies)
    base = np.concatenate([[0], np.cumsum([len(s) for s in strategies])]).astype(np.int64)
    recipe = _Recipe(graph, strategies, base, facts, param_events, op_events,
                     operand_uses(graph, input_nodes, op_nodes, facts.free, facts.boundary),
                     nodes.group_of)
    sizes = facts.factor_sizes
    return IntraOpLayout(graph=graph,
                         signature=layout_signature(graph, mesh, factor_sizes=sizes),
                         names=nodes.names, strategies=nodes.strategies,
                         input_nodes=input_nodes, op_nodes=op_nodes, free_tensors=facts.free,
                         followers=nodes.followers, base=base, edges=recipe.kept,
                         factor_sizes=sizes, _recipe=recipe)


class _Keys:
    """Interns hashable keys as consecutive integers."""

    def __init__(self) -> None:
        self.ids: dict[Hashable, int] = {}
        self.keys: list = []

    def __call__(self, key: Hashable) -> int:
        i = self.ids.get(key)
        if i is None:
            i = self.ids[key] = len(self.keys)
            self.keys.append(key)
        return i


class MeshCollectives:
    """Collective times on one mesh, memoised (the same (kind, axes, bytes) recurs across
    thousands of edge matrix entries), each timed on one group of each class of alike groups
    instead of on every group. ``mesh_collective_time_s`` takes the slowest group; groups of
    one device group with the same size and the same spread over nodes take the same links and
    the same steps, so they time alike to the bit and the maximum is unchanged (tested).

    Args:
      mesh: the mesh.
      cluster: its cluster.
      shared: times per (kind, bytes, class of group) to reuse and extend: they hold for any
        mesh of ``cluster``.
    """

    def __init__(self, mesh: LogicalMesh, cluster: Cluster,
                 shared: dict[tuple, float] | None = None) -> None:
        self.mesh = mesh
        self.cluster = cluster
        self._collective: dict[tuple[str, tuple[str, ...], float, float], float] = {}
        self._steps: dict[tuple[tuple[ReshardStep, ...], int, bool], float] = {}
        self._device = cluster.group_of(mesh.device_ids[0]).device
        self._groups: dict[tuple[str, ...], list[tuple[tuple, tuple[int, ...]]]] = {}
        # Times per (kind, bytes, class of group), valid for any mesh of this cluster.
        self._shared = shared if shared is not None else {}

    def collective(self, kind: str, axes: tuple[str, ...], nbytes: float, *,
                   combinable: bool = False) -> float:
        """``mesh_collective_time_s(kind, nbytes, mesh, axes, cluster)``; an all-reduce that
        XLA combines with others (``combinable``) pays its
        :func:`~shardplan.cost.combine.startup_share` of the call's start-up."""
        share = (startup_share(nbytes, self._device) if combinable and kind == "all-reduce"
                 else 1.0)
        key = (kind, axes, nbytes, share)
        t = self._collective.get(key)
        if t is None:
            if kind == "collective-permute":  # its hops depend on the order, not the spread
                t = mesh_collective_time_s(kind, nbytes, self.mesh, axes,  # type: ignore[arg-type]
                                           self.cluster)
            else:
                times = []
                for alike, g in self._representatives(axes):
                    shared_key = (kind, nbytes, share, alike)
                    if shared_key not in self._shared:
                        self._shared[shared_key] = collective_time_s(
                            kind, nbytes, g, self.cluster,  # type: ignore[arg-type]
                            startup_share=share)
                    times.append(self._shared[shared_key])
                t = max(times)
            self._collective[key] = t
        return t

    def steps(self, steps: tuple[ReshardStep, ...], nbytes: int, *,
              combinable: bool = False) -> float:
        """The time of the collectives ``steps`` on a tensor of ``nbytes`` (each step's bytes
        per device: its result's shard); ``combinable``: as in :meth:`collective`."""
        key = (steps, nbytes, combinable)
        t = self._steps.get(key)
        if t is None:
            t = 0.0
            for step in steps:
                shards = math.prod(self.mesh.size(axes) for axes in step.result_spec if axes)
                t += self.collective(step.kind, step.axes, nbytes / shards,
                                     combinable=combinable)
            self._steps[key] = t
        return t

    def _representatives(self, axes: tuple[str, ...]) -> list[tuple[tuple, tuple[int, ...]]]:
        """One group per class of alike groups, with its class: (device group, size, devices
        per node); a group spanning device groups is a class of its own."""
        if axes not in self._groups:
            cluster = self.cluster
            seen: dict[tuple, tuple[int, ...]] = {}
            for g in self.mesh.groups(axes):
                owners = {cluster.group_of(d).name for d in g}
                if len(owners) > 1:  # across device groups: the ring's links depend on the ids
                    seen[("ids", g)] = g
                    continue
                per_node: dict[int, int] = {}
                for d in g:
                    per_node[cluster.node_of(d)] = per_node.get(cluster.node_of(d), 0) + 1
                seen.setdefault((owners.pop(), len(g), tuple(sorted(per_node.values()))), g)
            self._groups[axes] = list(seen.items())
        return self._groups[axes]


class _Reshards:
    """Interns the reshardings ``(have spec, want spec, bytes)`` of edge entries; a call maps
    the entries of one edge (all pairs, or the diagonal) to their resharding ids, hashing
    each distinct pair of specs once."""

    _BITS = 24

    def __init__(self) -> None:
        self.specs = _Keys()
        self.pairs = _Keys()

    def ids(self, specs: Sequence[Spec]) -> np.ndarray:
        """The interned ids of ``specs``."""
        return np.asarray([self.specs(x) for x in specs], dtype=np.int64)

    def __call__(self, h: np.ndarray, w: np.ndarray, nbytes: int, *,
                 outer: bool) -> np.ndarray:
        """The resharding ids of the pairs of spec ids ``h`` x ``w`` (``outer``: every pair,
        row-major; else ``h[k]`` with ``w[k]``)."""
        code = ((h[:, None] << self._BITS) | w[None, :]).ravel() if outer \
            else (h << self._BITS) | w
        unique, inverse = np.unique(code, return_inverse=True)
        mask = (1 << self._BITS) - 1
        ids = np.asarray([self.pairs((c >> self._BITS, c & mask, nbytes))
                          for c in unique.tolist()], dtype=np.int64)
        return ids[inverse.ravel()]

    def __iter__(self):
        """``(have, want, bytes)`` per resharding id."""
        specs = self.specs.keys
        return ((specs[h], specs[w], nbytes) for h, w, nbytes in self.pairs.keys)


class _Recipe:
    """How to price a layout: every cost of the problem as an array of keys
    (a roofline, a collective sequence, a resharding) and the order they add up in."""

    def __init__(self, graph: OpGraph, strategies: list[tuple[OpStrategy, ...]],
                 base: np.ndarray, facts: StepFacts, param_events: list[tuple[int, int]],
                 op_events: list[tuple[int, int]], uses: dict[Use, int], group_of) -> None:
        self.graph = graph
        self.strategies = strategies
        self.base = base
        axes_keys = _Keys()
        self.entry_axes = np.asarray(
            [axes_keys(tuple(sorted({a for axes in s.factors.values() for a in axes})))
             for strats in strategies for s in strats], dtype=np.int64)
        self.axes = axes_keys.keys
        self.size = int(base[-1])
        steps_keys = _Keys()  # (collective steps, bytes, combinable)
        self._arguments(param_events)
        self._ops(facts, op_events, steps_keys)
        reshards = self._uses(uses, group_of)
        # A resharding costs ``steps(reshard_steps(have, want), bytes)``: map each to the
        # (steps, bytes) it times, shared with the partial sums' (steps, bytes).
        self.reshard_steps = np.asarray(
            [steps_keys((reshard_steps(have, want), nbytes, False))
             for have, want, nbytes in reshards],
            dtype=np.int64)
        self.steps = steps_keys.keys

    def _flat(self, n: int) -> range:
        return range(int(self.base[n]), int(self.base[n + 1]))

    def _arguments(self, param_events: list[tuple[int, int]]) -> None:
        """The arguments' tie-breaking seconds per byte and memory."""
        flat = self._flat
        self.param_adds = _Adds([(n, flat(n)) for n, _ in param_events])
        self.param_bytes = np.asarray(
            [nbytes for n, nbytes in param_events for _ in flat(n)], dtype=np.float64)

    def _ops(self, facts: StepFacts, op_events: list[tuple[int, int]],
             steps_keys: _Keys) -> None:
        """Each op's roofline (compute) and partial-sum reductions (communication)."""
        graph, strategies, flat = self.graph, self.strategies, self._flat
        rooflines = _Keys()  # (op id, variant, dtype, class)
        compute_events: list[tuple[int, range]] = []
        entries: list[tuple[int, int]] = []
        reduce_events = []
        reduce_slots: list[list[int]] = []
        reduce_count: list[int] = []
        fused: dict[tuple[int, int], Op] = {}
        for n, o in op_events:
            op = graph.ops[o]
            combinable = o in facts.combinable
            partial = []
            for k, s in zip(flat(n), strategies[n], strict=True):
                if s.partial_axes:
                    partial.append(k)
                    reduce_count.append(op.count)
                    reduce_slots.append([
                        steps_keys((reduce_steps(spec, spec, s.partial_axes,
                                                 reduce_scatter=False),
                                    graph.tensors[t].nbytes, combinable))
                        for t, spec in zip(op.outputs, s.result_specs, strict=True)])
            if partial:
                reduce_events.append((n, partial))
            if op.structural or op.attrs.get("folded"):
                continue
            variants, dtype, kind = facts.fused[o]
            for v, charged in enumerate(variants):
                fused[(o, v)] = charged
                key = rooflines((o, v, dtype, kind))
                compute_events.append((n, flat(n)))
                entries.extend((key, k) for k in flat(n))
        self.compute_adds = _Adds(compute_events)
        self.roofline_table = RooflineTable([(fused[(o, v)], dtype, kind)
                                             for o, v, dtype, kind in rooflines.keys])
        self.compute_key = np.asarray([key for key, _ in entries], dtype=np.int64)
        self.compute_entry_axes = self.entry_axes[np.asarray([k for _, k in entries],
                                                             dtype=np.int64)]
        self.reduce_adds = _Adds(reduce_events)
        width = max((len(s) for s in reduce_slots), default=0)
        self.reduce_slots = np.full((len(reduce_slots), width), -1, dtype=np.int64)
        for i, slots in enumerate(reduce_slots):
            self.reduce_slots[i, :len(slots)] = slots
        self.reduce_count = np.asarray(reduce_count, dtype=np.float64)

    def _uses(self, uses: dict[Use, int], group_of) -> _Reshards:
        """Edges, the diagonals of edges inside a follower group, and self edges."""
        strategies, flat = self.strategies, self._flat
        reshards = _Reshards()
        diag_events, diag_keys, diag_count, diag_times, diag_in_place = [], [], [], [], []
        edge_list: list[tuple[int, int, np.ndarray, int, bool]] = []
        have_of: dict[tuple[int, int], np.ndarray] = {}
        want_of: dict[tuple[int, int], np.ndarray] = {}
        for (node, j, dst, i, nbytes, count, in_place), times in uses.items():
            if (node, j) not in have_of:
                have_of[(node, j)] = reshards.ids([s.result_specs[j] for s in strategies[node]])
            if (dst, i) not in want_of:
                want_of[(dst, i)] = reshards.ids([s.result_specs[0] if i < 0
                                                  else s.operand_specs[i]
                                                  for s in strategies[dst]])
            have, want = have_of[(node, j)], want_of[(dst, i)]
            if group_of(node) == group_of(dst) and node != dst:
                diag_events.append((dst, flat(dst)))
                diag_keys.append(reshards(have, want, nbytes, outer=False))
                diag_count += [count] * len(want)
                diag_times += [times] * len(want)
                diag_in_place += [in_place] * len(want)
                continue
            edge_list.append((node, dst, reshards(have, want, nbytes, outer=True),
                              count * times, in_place))
        self.diag_adds = _Adds(diag_events)
        self.diag_key = (np.concatenate(diag_keys) if diag_keys
                         else np.zeros(0, dtype=np.int64))
        self.diag_count = np.asarray(diag_count, dtype=np.float64)
        self.diag_times = np.asarray(diag_times, dtype=np.float64)
        self.diag_in_place = np.asarray(diag_in_place, dtype=bool)
        # Tied layers make some edges run from a node to itself: their diagonal is a node cost.
        self_events, self_positions = [], []
        offset = 0
        for src, dst, keys, _, _ in edge_list:
            if src == dst:
                k = len(strategies[src])
                self_events.append((src, flat(src)))
                self_positions += [offset + i * k + i for i in range(k)]
            offset += len(keys)
        self.kept = tuple((s, d) for s, d, *_ in edge_list if s != d)
        self.kept_index = [i for i, (s, d, *_) in enumerate(edge_list) if s != d]
        self.self_adds = _Adds(self_events)
        self.self_positions = np.asarray(self_positions, dtype=np.int64)
        lengths = [len(e[2]) for e in edge_list]
        self.edge_key = (np.concatenate([e[2] for e in edge_list]) if edge_list
                         else np.zeros(0, dtype=np.int64))
        self.edge_mult = np.repeat([float(e[3]) for e in edge_list], lengths)
        self.edge_in_place = np.repeat(np.asarray([e[4] for e in edge_list], dtype=bool),
                                       lengths)
        self.edge_bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        return reshards

    def edge_labels(self) -> tuple[np.ndarray, ...]:
        bounds = self.edge_bounds
        return tuple(self.edge_key[bounds[i]:bounds[i + 1]] for i in self.kept_index)

    # ------------------------------------------------------------------ pricing
    def price(self, mesh: LogicalMesh, cluster: Cluster,
              collective_cache: dict[tuple, float] | None = None) -> IntraOpCosts:
        types = {cluster.group_of(d).device.name for d in mesh.device_ids}
        if len(types) != 1:
            raise ClusterError(format_error(
                "An intra-op problem is solved on devices of one type.", where="mesh",
                value=sorted(types), remedy="plan one mesh per device group"))
        device = cluster.group_of(mesh.device_ids[0]).device
        comm = MeshCollectives(mesh, cluster, collective_cache)
        shards = np.asarray([float(mesh.size(axes)) for axes in self.axes])
        compute = np.zeros(self.size)
        communication = np.zeros(self.size)
        memory = np.zeros(self.size)
        # Arguments: ``local = nbytes / shards``; compute ``c + local * tiebreak``, memory
        # ``m + local``.
        param_shards = shards[self.entry_axes[self.param_adds.entry]]
        local = self.param_bytes / param_shards
        self.param_adds.apply(compute, local * INPUT_BYTE_TIEBREAK_S)
        self.param_adds.apply(memory, local)
        step_s = np.asarray([comm.steps(steps, nbytes, combinable=combinable)
                             for steps, nbytes, combinable in self.steps])
        # Partial sums: ``sum(steps(...) * count for each result)``, starting from 0.
        if len(self.reduce_slots):
            total = np.zeros(len(self.reduce_slots))
            for c in range(self.reduce_slots.shape[1]):
                slot = self.reduce_slots[:, c]
                total = total + np.where(slot >= 0, step_s[slot] * self.reduce_count, 0.0)
            self.reduce_adds.apply(communication, total)
        # Rooflines (cost.compute.op_time_s), times the op's count.
        if len(self.compute_key):
            self.compute_adds.apply(compute, self._rooflines(device, shards))
        # Edges: ``reshard * (count * times)``; diagonals ``reshard * count * times``; a
        # positive cost read in place is forbidden.
        reshard_s = step_s[self.reshard_steps] if len(self.reshard_steps) else np.zeros(0)
        if len(self.diag_key):
            diag = reshard_s[self.diag_key] * self.diag_count * self.diag_times
            diag[self.diag_in_place & (diag > 0)] = math.inf
            self.diag_adds.apply(compute, diag)
        edges = reshard_s[self.edge_key] * self.edge_mult if len(self.edge_key) else np.zeros(0)
        edges[self.edge_in_place & (edges > 0)] = math.inf
        if len(self.self_positions):
            self.self_adds.apply(compute, edges[self.self_positions])
        bounds = self.edge_bounds
        return IntraOpCosts(mesh=mesh, compute=compute, communication=communication,
                            memory=memory,
                            edges=tuple(edges[bounds[i]:bounds[i + 1]] for i in self.kept_index))

    def _rooflines(self, device: DeviceSpec, shards: np.ndarray) -> np.ndarray:
        """Per costed (op, strategy), its roofline times its count."""
        divisor = shards[self.compute_entry_axes]
        return self.roofline_table.times(device, self.compute_key, divisor)


class RooflineTable:
    """``op_time_s(op, device, dtype=..., flops_divisor=d, bytes_divisor=d, kind=...).time_s *
    op.count`` for many (op, divisor) pairs at once, with the same floating-point operations.

    Args:
      ops: per row, the op (charged as it should be: see ``with_materialized_bytes``), its
        compute dtype and its class.
    """

    def __init__(self, ops: Sequence[tuple[Op, str, OpClass]]) -> None:
        self.ops = list(ops)
        self.flops = np.asarray([op.flops for op, _, _ in self.ops], dtype=np.float64)
        self.transcendentals = np.asarray([op.transcendentals for op, _, _ in self.ops],
                                          dtype=np.float64)
        self.bytes = np.asarray([op.bytes_read + op.bytes_written for op, _, _ in self.ops],
                                dtype=np.float64)
        self.count = np.asarray([op.count for op, _, _ in self.ops], dtype=np.float64)
        self._rates: dict[str, tuple[np.ndarray, np.ndarray, float]] = {}

    def _device_rates(self, device: DeviceSpec) -> tuple[np.ndarray, np.ndarray, float]:
        if device.name not in self._rates:
            rate, trans_rate = np.zeros(len(self.ops)), np.ones(len(self.ops))
            for i, (op, dtype, kind) in enumerate(self.ops):
                ran = device.effective_dtype(dtype)
                class_eff = getattr(device.efficiency, kind)
                rate[i] = device.peak_flops_per_s[ran] * class_eff
                if op.transcendentals:
                    trans_rate[i] = fp32_rate(device, ran) * class_eff
            bandwidth = device.hbm_bandwidth_bytes_per_s * device.efficiency.memory_bound
            self._rates[device.name] = (rate, trans_rate, bandwidth)
        return self._rates[device.name]

    def times(self, device: DeviceSpec, rows: np.ndarray, divisor: np.ndarray) -> np.ndarray:
        """Per entry, the time of op ``rows[i]`` split over ``divisor[i]`` devices, times its
        count (``max(flops / d / rate (+ transcendentals), bytes / d / bandwidth) * count``)."""
        rate, trans_rate, bandwidth = self._device_rates(device)
        compute_s = self.flops[rows] / divisor / rate[rows]
        trans = self.transcendentals[rows]
        has = trans != 0
        compute_s[has] += trans[has] / divisor[has] / trans_rate[rows][has]
        memory_s = self.bytes[rows] / divisor / bandwidth
        return np.maximum(compute_s, memory_s) * self.count[rows]
