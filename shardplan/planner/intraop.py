"""The intra-op sharding problem of one mesh: an OpGraph as a solver Problem, and back.

Nodes are the graph's inputs (parameters, optimizer state, batch), whose strategies are their
possible shardings, and its ops, whose strategies come from
:func:`shardplan.cost.strategies.enumerate_strategies`. A node's compute cost is its op's roofline
time on the local shard (fused values cost no memory traffic); its communication cost is the
all-reduce of its result when the strategy contracts a sharded dimension (paid once, however
many ops read the result; a reduce-scatter into a sharded consumer is not yet priced lower). An
edge per operand use carries the time of the collectives that turn the producer's result into
the sharding the consumer's strategy needs; an edge from each new-state result back to its input
makes the state keep one sharding across steps. Optimizer state follows its parameter.

Blocks with equal fingerprints share nodes (:func:`tie_layers`). Memory is a hard constraint
per device: the arguments always, and each :class:`MemoryCut` (the values live where a
previous plan's memory peaked, in the shardings this problem picks, plus what no node
decides).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping

from shardplan.cluster import Cluster
from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.collectives import mesh_collective_time_s
from shardplan.cost.compute import (
    compute_dtype,
    op_class,
    op_time_s,
    parameter_tensors,
    with_materialized_bytes,
)
from shardplan.cost.memory import buffer_tensors
from shardplan.cost.rules import Factor, OpRule, op_rule
from shardplan.cost.sharding import (
    ReshardStep,
    Spec,
    reduce_steps,
    reshard_steps,
)
from shardplan.cost.strategies import OpStrategy, enumerate_strategies, factor_specs
from shardplan.errors import ClusterError, ConfigError, format_error
from shardplan.planner.fold import BoundaryUses, Fold, costed_ops, expand
from shardplan.planner.memory import MemoryPeak, memory_cut
from shardplan.solver import Edge, Follower, Node, Problem
from shardplan.trace.graph import OpGraph, Parameter

__all__ = ["IntraOpProblem", "Use", "build_intraop_problem", "operand_uses", "tie_layers"]

# (Past 600 lines: the builder, the follower derivation and the operand-use walk that
# planner/layout.py shares are one unit; folding loop blocks added the use counts and carries.
# Issue 20's "one builder" step moves layout.py's mirrored node walk here and splits both.)

INPUT_BYTE_TIEBREAK_S = 1e-15
"""Seconds charged per byte an input holds on one device. Far below any real cost, it breaks
ties toward sharded inputs: a batch that is only sliced by the ops that read it (slicing is
free) is then placed sharded instead of replicated, which is what its host-to-device copy and
its memory want."""


@dataclasses.dataclass(frozen=True)
class IntraOpProblem:
    """A solver problem with the map back to the graph.

    Attributes:
      problem: the solver input.
      mesh: the mesh it shards over.
      input_nodes: ``{input tensor id: node index}``.
      op_nodes: ``{op id: node index}``.
      strategies: per node, its strategies.
      free_tensors: values built from constants alone, which every consumer regenerates in
        the sharding it reads (no node decides their sharding).
    """

    problem: Problem
    mesh: LogicalMesh
    input_nodes: Mapping[int, int]
    op_nodes: Mapping[int, int]
    strategies: tuple[tuple[OpStrategy, ...], ...]
    free_tensors: frozenset[int] = frozenset()


def _tensor_rule(shape: tuple[int, ...]) -> OpRule:
    """A rule whose strategies are the shardings of a tensor of ``shape``."""
    factors: list[Factor] = []
    dims: list[tuple[int, ...]] = []
    for d in shape:
        if d > 1:
            factors.append(Factor(d, "pass"))
            dims.append((len(factors) - 1,))
        else:
            dims.append(())
    return OpRule(tuple(factors), (), (tuple(dims),))


class _CommTimes:
    """Collective times on one mesh, memoised: the same (kind, axes, bytes) recurs across
    thousands of edge matrix entries, and each evaluation walks every device group's links."""

    def __init__(self, mesh: LogicalMesh, cluster: Cluster) -> None:
        self.mesh = mesh
        self.cluster = cluster
        self._collective: dict[tuple[str, tuple[str, ...], float], float] = {}
        self._steps: dict[tuple[tuple[ReshardStep, ...], int], float] = {}
        self._reshard: dict[tuple[Spec, Spec, int], float] = {}

    def collective(self, kind: str, axes: tuple[str, ...], nbytes: float) -> float:
        key = (kind, axes, nbytes)
        t = self._collective.get(key)
        if t is None:
            t = mesh_collective_time_s(kind, nbytes, self.mesh, axes,  # type: ignore[arg-type]
                                       self.cluster)
            self._collective[key] = t
        return t

    def steps(self, steps: tuple[ReshardStep, ...], nbytes: int) -> float:
        key = (steps, nbytes)
        t = self._steps.get(key)
        if t is None:
            t = 0.0
            for step in steps:
                shards = math.prod(self.mesh.size(axes) for axes in step.result_spec if axes)
                t += self.collective(step.kind, step.axes, nbytes / shards)
            self._steps[key] = t
        return t

    def reshard(self, have: Spec, want: Spec, nbytes: int) -> float:
        key = (have, want, nbytes)
        t = self._reshard.get(key)
        if t is None:
            t = self.steps(reshard_steps(have, want), nbytes)
            self._reshard[key] = t
        return t


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
    device = cluster.group_of(mesh.device_ids[0]).device
    buffers = buffer_tensors(graph)
    comm_times = _CommTimes(mesh, cluster)
    free = _regenerable(graph, {p.tensor for p in graph.parameters})
    follow_cache: dict = {}
    params = parameter_tensors(graph)
    canon_op, canon_in = tie_layers(graph, tie_period) if tie_period else ({}, {})
    compute: list[list[float]] = []
    comm: list[list[float]] = []
    memory: list[tuple[float, ...]] = []
    names: list[str] = []
    strategies: list[tuple[OpStrategy, ...]] = []
    input_nodes: dict[int, int] = {}
    op_nodes: dict[int, int] = {}

    def node_for(key: int, table: dict[int, int], canon: Mapping[int, int], name: str,
                 strats_of) -> int:
        target = canon.get(key)
        if target is not None and target in table:
            table[key] = table[target]
            return table[key]
        strats = strats_of()
        table[key] = len(strategies)
        strategies.append(strats)
        compute.append([0.0] * len(strats))
        comm.append([0.0] * len(strats))
        memory.append(tuple(0.0 for _ in strats))
        names.append(name)
        return table[key]

    weights = fold.leaf_weights if fold is not None else {}
    for p in graph.parameters:
        n = node_for(p.tensor, input_nodes, canon_in, f"in:{p.arg_index}/{p.path}",
                     lambda p=p: enumerate_strategies(_tensor_rule(p.shape), mesh))
        # A leaf of the folded graph holds those of the members folded into it (planner.fold).
        nbytes = graph.tensors[p.tensor].nbytes * weights.get(p.tensor, 1)
        local = [nbytes / s.shards for s in strategies[n]]
        compute[n] = [c + b * INPUT_BYTE_TIEBREAK_S for c, b in zip(compute[n], local,
                                                                   strict=True)]
        # Tied parameters share a node: their bytes add up.
        memory[n] = tuple(m + b for m, b in zip(memory[n], local, strict=True))
    for p, n in _annotated(full, fold, input_nodes, fixed_specs):
        assert fixed_specs is not None
        compute[n] = _fixed(compute[n], strategies[n], fixed_specs[p.path], p.path, mesh)
    followers: list[Follower] = []
    for op in graph.ops:
        lead = _follow_target(graph, op, input_nodes, op_nodes, free) if follow else None
        if lead is not None and op.id not in canon_op:
            leader, j, position = lead
            derived = _follow_strategies(graph, op, mesh, strategies[leader], j, position,
                                         follow_cache)
        else:
            derived = None
        label = fold.source_ids[op.id] if fold is not None else op.id
        n = node_for(op.id, op_nodes, canon_op, f"op:{label}:{op.primitive}",
                     (lambda d=derived: d) if derived is not None else
                     (lambda op=op: enumerate_strategies(op_rule(graph, op), mesh)))
        if derived is not None and lead is not None and op_nodes[op.id] == len(strategies) - 1:
            followers.append(Follower(node=n, leader=lead[0]))
        charged = (fold.charged[op.id] if fold is not None and op.id in fold.charged
                   else (with_materialized_bytes(op, graph, lambda t: buffers[t]),))
        for k, s in enumerate(strategies[n]):
            # A partial result is all-reduced once, by its producer, however many ops read it.
            if s.partial_axes:
                comm[n][k] += sum(
                    comm_times.steps(reduce_steps(spec, spec, s.partial_axes,
                                                  reduce_scatter=False),
                                     graph.tensors[t].nbytes) * op.count
                    for t, spec in zip(op.outputs, s.result_specs, strict=True))
            if op.structural or op.attrs.get("folded"):
                continue
            # Only values that live in memory cost memory traffic (fused ones do not).
            for fused in charged:
                t = op_time_s(fused, device, dtype=compute_dtype(op, graph),
                              flops_divisor=s.shards, bytes_divisor=s.shards,
                              kind=op_class(op, params))
                compute[n][k] += t.time_s * fused.count
    root = {f.node: f.leader for f in followers}
    edges, diagonals = _edges(graph, comm_times, strategies, input_nodes, op_nodes, free,
                              lambda n: _root(root, n),
                              fold.boundary if fold is not None else None)
    for n, diagonal in diagonals:
        compute[n] = [c + d for c, d in zip(compute[n], diagonal, strict=True)]
    # Tied layers make some edges run from a node to itself: their diagonal is a node cost.
    kept: list[Edge] = []
    for e in edges:
        if e.src != e.dst:
            kept.append(e)
            continue
        k = len(strategies[e.src])
        compute[e.src] = [c + e.cost[i * k + i] for i, c in enumerate(compute[e.src])]
    arguments = tuple(sorted(set(input_nodes.values())))
    # Memory peaks are the full graph's (its estimate's buffers and op positions).
    full_ops = op_nodes if fold is None else {o: op_nodes[f] for o, f in enumerate(fold.op_of)}
    full_inputs = input_nodes if fold is None else fold.full_inputs(input_nodes)
    cuts = tuple(memory_cut(full, mesh, peak, arguments, memory, full_inputs, full_ops,
                            strategies, name=f"memory peak {k}")
                 for k, peak in enumerate(memory_peaks if memory_budget_bytes else ()))
    nodes = tuple(Node(name=names[i], compute_cost=tuple(compute[i]),
                       communication_cost=tuple(comm[i]), memory_bytes=memory[i])
                  for i in range(len(strategies)))
    followers += _optimizer_followers(graph, input_nodes, strategies)
    problem = Problem(
        nodes,
        tuple(kept),
        followers=tuple(followers),
        liveness=(arguments,) if memory_budget_bytes else (),
        memory_cuts=cuts,
        memory_budget_bytes=memory_budget_bytes,
        memory_mode="hard",
        time_limit_s=time_limit_s,
        relative_gap=relative_gap,
        name=f"intraop:{graph.name}",
    )
    built = IntraOpProblem(
        problem=problem,
        mesh=mesh,
        input_nodes=input_nodes,
        op_nodes=op_nodes,
        strategies=tuple(strategies),
        free_tensors=free,
    )
    return built if fold is None else expand(fold, built)


def _fixed(costs: list[float], strategies: tuple[OpStrategy, ...], spec: Spec, path: str,
           mesh: LogicalMesh) -> list[float]:
    """``costs`` with every strategy whose sharding is not ``spec`` forbidden (axes of size 1
    shard nothing and are dropped from ``spec``, as strategies never use them)."""
    spec = tuple(tuple(a for a in dim if mesh.size(a) > 1) for dim in spec)
    if not any(s.result_specs[0] == spec for s in strategies):
        raise ConfigError(format_error(
            "No sharding of the leaf on this mesh matches its annotation (a dimension split "
            "over several axes must list them in the mesh's axis order).",
            where=path, value={"annotation": spec, "mesh": mesh.shape},
            remedy=f"annotate with the mesh axes in the order {mesh.axis_names}"))
    return [c if s.result_specs[0] == spec else math.inf
            for c, s in zip(costs, strategies, strict=True)]


_FOLLOWERS = frozenset({
    "add", "add_any", "sub", "mul", "div", "max", "min", "neg", "abs", "sign", "exp", "log",
    "tanh", "logistic", "sqrt", "rsqrt", "integer_pow", "square", "select_n", "convert_element_type",
    "erf", "log1p", "expm1", "pow", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    "clamp", "floor", "ceil", "round", "is_finite", "reduce_precision", "stop_gradient",
})
"""Elementwise primitives that follow the producer of their full-size operand."""

_UNARY_FOLLOWERS = frozenset({
    "reshape", "squeeze", "expand_dims", "transpose", "broadcast_in_dim", "reduce_sum",
    "reduce_max", "reduce_min", "reduce_prod", "scan_slice", "scan_stack", "copy", "copy_p",
    "cumsum", "cummax", "cummin", "cumprod", "cumlogsumexp",
})
"""Data-movement and reduction primitives that follow the producer of their first operand:
their sharding is a function of the operand's (a sharded reduced dimension leaves a partial
sum), so a separate choice could only reshard the operand first, which never costs less."""


_REGENERABLE = _FOLLOWERS | {"iota", "broadcast_in_dim", "reshape", "transpose", "squeeze",
                             "expand_dims"}


def _regenerable(graph: OpGraph, inputs: Collection[int]) -> frozenset[int]:
    """Tensors computed from constants alone (an ``iota``, a broadcast literal, a causal mask
    built from them): every consumer regenerates its own shard in the sharding it reads, as XLA
    does when it fuses them, so reading them never costs communication."""
    free: set[int] = set()
    for op in graph.ops:
        if op.primitive not in _REGENERABLE and not op.attrs.get("folded"):
            continue
        if all(t in free or (graph.tensors[t].producer is None and t not in inputs)
               for t in op.inputs):
            free.update(op.outputs)
    return frozenset(free)


def _follow_target(graph: OpGraph, op, input_nodes: Mapping[int, int],
                   op_nodes: Mapping[int, int], free: frozenset[int] = frozenset(),
                   ) -> tuple[int, int, int] | None:
    """(leader node, leader result index, operand position) for an op that follows the
    producer of one operand: an elementwise op the operand of its own shape, a data-movement
    or reduction op its first operand."""
    if op.structural and op.primitive not in ("scan_slice", "scan_stack"):
        return None
    if len(op.outputs) != 1 or not op.inputs:
        return None
    shape = graph.tensors[op.outputs[0]].shape
    if op.primitive in _UNARY_FOLLOWERS:
        positions = [0] if graph.tensors[op.inputs[0]].shape else []
    elif op.primitive in _FOLLOWERS and shape:
        positions = [i for i, t in enumerate(op.inputs) if graph.tensors[t].shape == shape]
    else:
        return None
    if op.phase == "update":
        # The update follows the state it reads in place (see _edges), never the gradient:
        # the gradient is resharded into the state's sharding on the edge between them.
        positions = [i for i in positions
                     if _read_in_place(graph, op, op.inputs[i], input_nodes)]
    for position in positions:
        if op.inputs[position] in free:
            continue
        src = _producer(graph, op.inputs[position], input_nodes, op_nodes)
        if src is not None:
            return src[0], src[1], position
    return None


def _read_in_place(graph: OpGraph, op, t: int, input_nodes: Mapping[int, int]) -> bool:
    """Whether ``op`` must read ``t`` in the sharding it has: an update op reading the state or
    a value the update computed (the reason is in :func:`_edges`)."""
    if op.phase != "update":
        return False
    producer = graph.tensors[t].producer
    return t in input_nodes or (producer is not None and graph.ops[producer].phase == "update")


def _follow_strategies(graph: OpGraph, op, mesh: LogicalMesh,
                       leader: tuple[OpStrategy, ...], j: int, position: int,
                       cache: dict | None = None) -> tuple[OpStrategy, ...] | None:
    """One strategy per leader strategy: the op's operand ``position`` sharded as the leader's
    result ``j``. ``None`` when some leader sharding does not carry over (a sharded dimension
    that maps onto no factor, onto a factor that must stay replicated, or onto a factor whose
    size the axes do not divide). ``cache`` memoises by (rule, position, leader shardings):
    the ops of repeated blocks ask the same question."""
    rule = op_rule(graph, op)
    if cache is None:
        return _derive(rule, mesh, leader, j, position)
    key = (rule, position, tuple(s.result_specs[j] for s in leader))
    if key not in cache:
        cache[key] = _derive(rule, mesh, leader, j, position)
    return cache[key]


def _derive(rule: OpRule, mesh: LogicalMesh, leader: tuple[OpStrategy, ...], j: int,
            position: int) -> tuple[OpStrategy, ...] | None:
    dims = rule.operands[position]
    out: list[OpStrategy] = []
    for s in leader:
        spec = s.result_specs[j]
        factors: dict[int, tuple[str, ...]] = {}
        for d, axes in enumerate(spec):
            if not axes:
                continue
            if d >= len(dims) or not dims[d]:
                return None
            f = dims[d][0]  # a dimension split by a reshape is sharded on its major factor
            if rule.factors[f].kind == "fixed" or rule.factors[f].size % mesh.size(axes):
                return None
            factors[f] = axes
        operand_specs = factor_specs(rule.operands, factors)
        result_specs = factor_specs(rule.results, factors)
        partial = tuple(a for f, axes in sorted(factors.items())
                        if rule.factors[f].kind == "reduce" for a in axes)
        used = tuple(a for axes in factors.values() for a in axes)
        out.append(OpStrategy(factors=factors, operand_specs=operand_specs,
                              result_specs=result_specs, partial_axes=partial,
                              shards=mesh.size(used)))
    return tuple(out)


def _annotated(graph: OpGraph, fold: Fold | None, input_nodes: Mapping[int, int],
               fixed_specs: Mapping[str, Spec] | None) -> list[tuple[Parameter, int]]:
    """The state leaves of ``graph`` with a fixed spec and their nodes (a leaf ``fold``
    dropped: its representative's)."""
    if not fixed_specs:
        return []
    nodes = input_nodes if fold is None else fold.full_inputs(input_nodes)
    return [(p, nodes[p.tensor]) for p in graph.parameters
            if p.arg_index == 0 and p.path in fixed_specs]


def tie_layers(graph: OpGraph, period: int) -> tuple[dict[int, int], dict[int, int]]:
    """Maps the ops and parameters of blocks to those of a representative block with the same
    fingerprint, position by position, so repeated layers share one set of variables.

    With ``period`` p, the k-th block of a fingerprint is tied to the (k mod p)-th: p = 1 ties
    every transformer block to the first; p = 2 lets consecutive identical layers alternate
    (the column/row pairs of a Megatron MLP). A block whose ops do not line up with its
    representative's is left untied; a block folded into its representative
    (:func:`shardplan.planner.fold.fold_blocks`, no ops of its own) ties its parameters.
    """
    canon_op: dict[int, int] = {}
    canon_in: dict[int, int] = {}
    seen: dict[str, list[int]] = {}
    by_path = graph.param_by_path
    for layer in graph.blocks:
        if layer.op_share != 1.0:  # a scanned stack already shares its body ops
            continue
        members = seen.setdefault(layer.fingerprint, [])
        members.append(layer.index)
        if len(members) <= period:
            continue
        ref = graph.layers[members[(len(members) - 1) % period]]
        ops, ref_ops = costed_ops(graph, layer.ops), costed_ops(graph, ref.ops)
        if not ops:  # folded into its representative (planner.fold): only parameters to tie
            ref_ops = []
        if len(ops) != len(ref_ops) or any(graph.ops[a].primitive != graph.ops[b].primitive
                                           for a, b in zip(ops, ref_ops, strict=True)):
            continue
        if len(layer.params) != len(ref.params):
            continue
        pairs = [(by_path[a].tensor, by_path[b].tensor)
                 for a, b in zip(layer.params, ref.params, strict=True)]
        if any(graph.tensors[a].shape != graph.tensors[b].shape for a, b in pairs):
            continue
        canon_op.update(zip(ops, ref_ops, strict=True))
        canon_in.update(pairs)
    return canon_op, canon_in


def _producer(
    graph: OpGraph, t: int, input_nodes: Mapping[int, int], op_nodes: Mapping[int, int]
) -> tuple[int, int] | None:
    """(node, result index) producing tensor ``t``."""
    if t in input_nodes:
        return input_nodes[t], 0
    producer = graph.tensors[t].producer
    if producer is None:
        return None
    return op_nodes[producer], graph.ops[producer].outputs.index(t)


def _root(leader: Mapping[int, int], n: int) -> int:
    while n in leader:
        n = leader[n]
    return n


def _edge_matrix(src: tuple[OpStrategy, ...], j: int, dst_specs: list[Spec], nbytes: int,
                 count: int, comm: _CommTimes) -> tuple[float, ...]:
    # The producer already reduced any partial sum (its node's communication cost), so an
    # edge only reshards. A backend with reduce-scatter could reduce straight into a sharded
    # consumer for less; that refinement is not priced yet.
    return tuple(comm.reshard(s.result_specs[j], want, nbytes) * count
                 for s in src for want in dst_specs)


def _edges(
    graph: OpGraph,
    comm: _CommTimes,
    strategies: list[tuple[OpStrategy, ...]],
    input_nodes: Mapping[int, int],
    op_nodes: Mapping[int, int],
    free: frozenset[int],
    group_of: Callable[[int], int],
    boundary: BoundaryUses | None = None,
) -> tuple[list[Edge], list[tuple[int, list[float]]]]:
    """One edge per operand use (the producer's result resharded into what the consumer's
    strategy reads), and one from each new state leaf back to its input (resharded into the
    input's sharding for the next step). An edge inside a follower group (both ends take the
    same strategy index) is returned as a per-strategy cost of its consumer instead."""
    # A use is (tensor, dst node, operand position or -1 for a state edge, count, whether it
    # must read the value in place). Tied layers repeat the same use between the same two
    # nodes: such uses are priced once, multiplied.
    # The update reads the state (parameters, optimizer state) and its own values where they
    # are: an update computed in another sharding than the state it writes gathers the state
    # for it, and XLA hoists those gathers (of ``b1 * mu`` ...) into the backward pass, where
    # they sit on top of the peak (measured: +7 MB over the memory model on a 4-layer MLP).
    # The gradient moves to the state instead, as ZeRO does.
    uses = operand_uses(graph, input_nodes, op_nodes, free, boundary)
    edges: list[Edge] = []
    node_costs: list[tuple[int, list[float]]] = []
    for (node, j, dst, i, nbytes, count, in_place), times in uses.items():
        want = [s.result_specs[0] if i < 0 else s.operand_specs[i] for s in strategies[dst]]
        if group_of(node) == group_of(dst) and node != dst:
            # Same follower group: both take the same strategy index, only the diagonal occurs.
            diagonal = [comm.reshard(strategies[node][k].result_specs[j], w, nbytes)
                        * count * times for k, w in enumerate(want)]
            node_costs.append((dst, [math.inf if in_place and c > 0 else c for c in diagonal]))
            continue
        cost = _edge_matrix(strategies[node], j, want, nbytes, count * times, comm)
        if in_place:
            cost = tuple(math.inf if c > 0 else c for c in cost)
        edges.append(Edge(src=node, dst=dst, cost=cost))
    return edges, node_costs


Use = tuple[int, int, int, int, int, int, bool]
"""(producer node, result index, consumer node, operand position or -1 for a state edge,
tensor bytes, executions, read in place)."""


def operand_uses(graph: OpGraph, input_nodes: Mapping[int, int], op_nodes: Mapping[int, int],
                 free: frozenset[int], boundary: BoundaryUses | None = None) -> dict[Use, int]:
    """Every operand use (and each new state leaf's edge back to its input), with how often it
    repeats, in program order. Tied layers repeat the same use between the same two nodes:
    such uses are priced once, multiplied. ``boundary``: the uses of folded loop blocks
    (:class:`~shardplan.planner.fold.BoundaryUses`) that read their operand in fewer
    executions than the op's count, and the carries that read the rest."""
    uses: dict[Use, int] = {}

    def add(src: tuple[int, int], dst: int, i: int, t: int, count: int, in_place: bool) -> None:
        key = (src[0], src[1], dst, i, graph.tensors[t].nbytes, count, in_place)
        uses[key] = uses.get(key, 0) + 1

    for op in graph.ops:
        dst = op_nodes[op.id]
        for i, t in enumerate(op.inputs):
            src = _producer(graph, t, input_nodes, op_nodes)
            if src is None or t in free:
                continue
            count = boundary.count(op, i) if boundary is not None else op.count
            add(src, dst, i, t, count, _read_in_place(graph, op, t, input_nodes))
    for carry in boundary.carries if boundary is not None else ():
        src = _producer(graph, carry.tensor, input_nodes, op_nodes)
        if src is None or carry.tensor in free:
            continue
        op = graph.ops[carry.op]
        add(src, op_nodes[op.id], carry.position, carry.tensor, carry.executions,
            _read_in_place(graph, op, carry.tensor, input_nodes))
    by_path = {(f"{p.arg_index}/{p.path}", p.shape): p.tensor for p in graph.parameters}
    for out, path in zip(graph.outputs, graph.output_paths, strict=True):
        if out is None or out in input_nodes:
            continue
        target = by_path.get((path, graph.tensors[out].shape))
        src = _producer(graph, out, input_nodes, op_nodes)
        if target is not None and src is not None:
            key = (src[0], src[1], input_nodes[target], -1, graph.tensors[out].nbytes, 1,
                   False)
            uses[key] = uses.get(key, 0) + 1
    return uses


def _optimizer_followers(
    graph: OpGraph, input_nodes: Mapping[int, int], strategies: list[tuple[OpStrategy, ...]]
) -> list[Follower]:
    params = graph.param_by_path
    out: list[Follower] = []
    for p in graph.parameters:
        if p.role != "optimizer_state" or p.param_path is None:
            continue
        leader = params.get(p.param_path)
        if leader is None or leader.shape != p.shape:
            continue
        a, b = input_nodes[p.tensor], input_nodes[leader.tensor]
        if len(strategies[a]) == len(strategies[b]):
            out.append(Follower(node=a, leader=b))
    return out
