"""Repeated blocks of a Python loop folded into one, so the intra-op problem is a block's size.

A model written as a Python loop over identical blocks traces to an unrolled graph: GPT-3 175B
has 96 copies of every block op (80k ops). Design decision 2 is to solve each distinct block
once and stamp the answer onto its copies, as a scanned stack (``nnx.scan``) is solved: its
body appears once with an execution count. :func:`fold_blocks` gives a loop graph that shape.

Folding. The blocks of one fingerprint (:attr:`Layer.fingerprint`, Python-loop blocks only) are
its *members*; with period ``p`` the first ``p`` members are the *representatives* and member
``k`` folds into representative ``k mod p`` (``p = 2`` lets identical layers alternate, as
Megatron MLP pairs do; ``planner.nodes.tie_layers`` uses the same rule). A member folds only
if its ops line up with its representative's position by position (primitive, operand and
result shapes and dtypes; scalar-only and constant-folded ops are not compared, and stay in the
folded graph as they are) and so do its parameters; a fingerprint with a member that does not
is left unfolded. The folded graph drops the folded members' ops and multiplies each
representative op's count by the members folded into it. It drops their parameter leaves too
(and their optimizer state, which follows a parameter's sharding): a member's leaf is its
representative's in every sharding, so the problem builders give the representative's node the
bytes of all the leaves it stands for (:attr:`Fold.leaf_weights`) and :func:`expand` gives each
dropped leaf that node. Folded members keep their layer entry with no ops and no parameters.

The boundary between blocks. Member ``k`` reads what member ``k - 1`` wrote (the residual
stream forward, its cotangent backward); folded, that is the representative reading its own
later result, a cycle no op graph can hold. Each representative operand therefore reads one
*primary* source in the folded graph: the one its members read that is computed before the op
(the value entering the stack: the embedding's output forward, the head's cotangent backward),
priced for the executions that really read it (:attr:`BoundaryUses.counts`); the members
reading the representative's own results instead are :attr:`BoundaryUses.carries`, extra
operand uses the problem builders add as edges (priced for ``n - 1`` executions). A stamped
plan whose block output differs from what the next block reads therefore pays the reshard,
``n - 1`` times, in the objective, and the solver chooses consistent shardings where they are
cheaper. :func:`expand` maps a problem solved on the folded graph back to the full graph's op
and tensor ids, so decoding, predictions and memory cuts run on the full graph as before.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from shardplan.cost.compute import materialized_bytes
from shardplan.cost.memory import in_memory_tensors
from shardplan.trace.graph import Layer, Op, OpGraph, Tensor

if TYPE_CHECKING:
    from shardplan.planner.nodes import IntraOpProblem

__all__ = ["BoundaryUses", "Carry", "Fold", "expand", "fold_blocks"]


@dataclasses.dataclass(frozen=True)
class Carry:
    """An operand use the folded graph cannot hold: op ``op`` reads ``tensor`` as operand
    ``position`` in ``executions`` of its executions (folded members reading a representative's
    later result: the value the previous block hands on)."""

    tensor: int
    op: int
    position: int
    executions: int


@dataclasses.dataclass(frozen=True)
class BoundaryUses:
    """How often folded ops read their operands, where that is not the op's ``count``.

    Attributes:
      counts: ``{(op id, operand position): executions}``: executions that read the operand as
        the folded graph wires it (the primary source).
      carries: the other sources of those operands.
    """

    counts: Mapping[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    carries: tuple[Carry, ...] = ()

    def count(self, op: Op, position: int) -> int:
        """Executions of ``op`` that read its operand ``position`` as wired."""
        return self.counts.get((op.id, position), op.count)


@dataclasses.dataclass(frozen=True, eq=False)
class Fold:
    """A graph with its repeated loop blocks folded (see the module docstring).

    Attributes:
      graph: the folded graph (ops renumbered, tensors and parameters as in ``source``).
      source: the full graph.
      op_of: per op of ``source``, the folded op that computes it (a folded member's op: its
        representative's).
      source_ids: per folded op, its id in ``source`` (solver nodes are named after it, so
        the solver's tie-breaking salt is the unfolded problem's).
      tensor_ids: per tensor of the folded graph, its id in ``source`` (the folded graph keeps
        the tensors its ops, parameters and results name, renumbered in order).
      tensor_of: per result of a folded member's op, the representative's corresponding result
        (ids of ``source``).
      boundary: the operand uses of the folded graph that differ from its ops' counts.
      members: per representative layer index, how many layers fold into it (itself included).
      period: the folding period.
      leaf_of: per parameter leaf of ``source`` the folded graph drops (a folded member's
        parameter or optimizer state), its representative's leaf (ids of ``source``).
      charged: per costed folded op (not structural, not constant-folded), the op as the cost
        model charges it (``cost.compute.with_materialized_bytes``), as the *full* graph's
        buffers have it (folding rewires readers, which would change what XLA keeps in
        memory): one variant per distinct charge among the members it stands for, each with
        their executions as its count (the counts add up to the folded op's).
    """

    graph: OpGraph
    source: OpGraph
    op_of: tuple[int, ...]
    source_ids: tuple[int, ...]
    tensor_ids: tuple[int, ...]
    tensor_of: Mapping[int, int]
    boundary: BoundaryUses
    members: Mapping[int, int]
    period: int
    charged: Mapping[int, tuple[Op, ...]] = dataclasses.field(default_factory=dict)
    leaf_of: Mapping[int, int] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def leaf_weights(self) -> Mapping[int, int]:
        """Per parameter leaf of the folded graph (its ids), how many leaves of ``source`` it
        stands for: itself and the dropped leaves of ``leaf_of`` (1 where none)."""
        folded = {old: new for new, old in enumerate(self.tensor_ids)}
        out = {p.tensor: 1 for p in self.graph.parameters}
        for rep in self.leaf_of.values():
            out[folded[rep]] += 1
        return out

    def full_inputs(self, input_nodes: Mapping[int, int]) -> dict[int, int]:
        """``input_nodes`` (the folded graph's leaves) on ``source``'s ids, the dropped leaves
        taking their representative's node."""
        ids = self.tensor_ids
        out = {ids[t]: n for t, n in input_nodes.items()}
        out.update((leaf, out[rep]) for leaf, rep in self.leaf_of.items())
        return out


def costed_ops(graph: OpGraph, ops: Sequence[int]) -> list[int]:
    """The ops that define a layer's fingerprint: not folded away, not scalar-only (a loop
    index bumped between blocks, a literal cast, sit where the tracer put them and differ
    between otherwise equal blocks)."""
    fingerprinted = graph.fingerprinted
    return [o for o in ops if fingerprinted[o]]


def _aligned(graph: OpGraph, ops: Sequence[int], ref_ops: Sequence[int], layer: Layer,
             ref: Layer, signatures: Sequence[int]) -> bool:
    """Whether ``ops`` (of ``layer``) compute what ``ref_ops`` (of ``ref``) do, op by op, and
    the two layers' parameters agree (``signatures``: :func:`_signatures` of the graph)."""
    if len(ops) != len(ref_ops) or len(layer.params) != len(ref.params):
        return False
    signature = signatures.__getitem__
    graph_ops = graph.ops
    for a, b in zip(ops, ref_ops, strict=True):
        x, y = graph_ops[a], graph_ops[b]
        if (x.primitive != y.primitive or x.count != y.count or x.phase != y.phase
                or len(x.inputs) != len(y.inputs) or len(x.outputs) != len(y.outputs)
                or any(map(int.__ne__, map(signature, x.inputs), map(signature, y.inputs)))
                or any(map(int.__ne__, map(signature, x.outputs), map(signature, y.outputs)))):
            return False
    by_path = graph.param_by_path
    return all(by_path[a].shape == by_path[b].shape and by_path[a].dtype == by_path[b].dtype
               for a, b in zip(layer.params, ref.params, strict=True))


def _signatures(graph: OpGraph) -> list[int]:
    """Per tensor, an id of its (shape, dtype): equal ids for equal pairs."""
    ids: dict[tuple[tuple[int, ...], str], int] = {}
    return [ids.setdefault((t.shape, t.dtype), len(ids)) for t in graph.tensors]


def _matched_constants(graph: OpGraph, layer: Layer, ref: Layer, costed: Sequence[int],
                       ref_costed: Sequence[int]) -> list[tuple[int, int]]:
    """The scalar-only and constant-folded ops of ``layer`` paired with ``ref``'s: the k-th op
    of each kind (primitive, phase, operand and result shapes) with the k-th of that kind.
    They cost nothing and hold no choice (a scalar is replicated; a constant is regenerated
    where it is read), so pairing them only keeps the folded graph small; ops of a kind
    one of the two layers has more of (a loop index bumped between blocks) stay as they are."""
    tensors = graph.tensors

    def kinds(ops: Sequence[int], skip: Sequence[int]) -> dict[tuple, list[int]]:
        out: dict[tuple, list[int]] = defaultdict(list)
        dropped = set(skip)
        for o in ops:
            if o in dropped:
                continue
            op = graph.ops[o]
            out[(op.primitive, op.phase, op.count, bool(op.attrs.get("folded")),
                 tuple(tensors[t].shape for t in op.inputs),
                 tuple(tensors[t].shape for t in op.outputs))].append(o)
        return out

    mine, theirs = kinds(layer.ops, costed), kinds(ref.ops, ref_costed)
    return [pair for key, ops in mine.items() if len(ops) == len(theirs.get(key, ()))
            for pair in zip(ops, theirs[key], strict=True)]


def _fold_map(graph: OpGraph, period: int
              ) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """``{folded member layer: representative layer}``, ``{member op: representative op}`` and
    ``{member parameter tensor: representative parameter tensor}``."""
    groups: dict[str, list[Layer]] = defaultdict(list)
    for layer in graph.blocks:
        if layer.op_share == 1.0 and layer.ops:  # a scanned stack is folded already
            groups[layer.fingerprint].append(layer)
    layer_of: dict[int, int] = {}
    op_rep: dict[int, int] = {}
    param_of: dict[int, int] = {}
    by_path = graph.param_by_path
    state_of: dict[str, list[int]] = defaultdict(list)  # parameter path -> its optimizer state
    for p in graph.parameters:
        if p.role == "optimizer_state" and p.param_path is not None:
            state_of[p.param_path].append(p.tensor)
    signatures = _signatures(graph) if groups else []
    for members in groups.values():
        if len(members) <= period:
            continue
        pairs = [(m, members[k % period]) for k, m in enumerate(members) if k >= period]
        ops = {layer.index: costed_ops(graph, layer.ops) for layer in members}
        if not all(_aligned(graph, ops[m.index], ops[ref.index], m, ref, signatures)
                   for m, ref in pairs):
            continue  # a member computes something else: the fingerprint stays unfolded
        for m, ref in pairs:
            layer_of[m.index] = ref.index
            op_rep.update(zip(ops[m.index], ops[ref.index], strict=True))
            op_rep.update(_matched_constants(graph, m, ref, ops[m.index], ops[ref.index]))
            for a, b in zip(m.params, ref.params, strict=True):
                param_of[by_path[a].tensor] = by_path[b].tensor
                # Its optimizer state (Adam's moments) follows a parameter's sharding: the
                # update reads the representative's in every member.
                tensors = graph.tensors
                if len(state_of[a]) == len(state_of[b]) and all(
                        (tensors[x].shape, tensors[x].dtype) == (tensors[y].shape, tensors[y].dtype)
                        for x, y in zip(state_of[a], state_of[b], strict=True)):
                    param_of.update(zip(state_of[a], state_of[b], strict=True))
    return layer_of, op_rep, param_of


def fold_blocks(graph: OpGraph, period: int = 1) -> Fold | None:
    """Folds the Python-loop blocks of ``graph`` with equal fingerprints (see the module
    docstring); None when nothing folds (no repetition, or a scanned stack)."""
    if period < 1:
        return None
    layer_of, op_rep, param_of = _fold_map(graph, period)
    if not op_rep:
        return None
    tensor_of: dict[int, int] = {}
    for member, rep in op_rep.items():
        tensor_of.update(zip(graph.ops[member].outputs, graph.ops[rep].outputs, strict=True))
    kept = _kept_ops(graph, op_rep, tensor_of, param_of)
    if kept is None:
        return None
    ops, new_id, reads = kept
    return _assemble(graph, ops, new_id, op_rep, tensor_of, layer_of,
                     _boundary_uses(ops, reads), period, _dropped_leaves(graph, ops, param_of))


def _kept_ops(graph: OpGraph, op_rep: dict[int, int], tensor_of: dict[int, int],
              param_of: Mapping[int, int]
              ) -> tuple[list[Op], dict[int, int], list[list[dict[int, int]]]] | None:
    """The folded graph's ops, their ids and their operands' sources; None if one cannot fold.

    Each kept op runs the executions of the members folded into it; per kept op and operand,
    ``{source: executions}``. None where an operand has no source that precedes its op. Ops
    that compute the same value outside the blocks merge, extending ``op_rep`` and
    ``tensor_of`` in place.
    """
    # Per kept op, the member ops folded into it (itself first).
    folded_into: dict[int, list[int]] = defaultdict(list)
    for member, rep in op_rep.items():
        folded_into[rep].append(member)
    new_id: dict[int, int] = {}
    ops: list[Op] = []
    reads: list[list[dict[int, int]]] = []  # per kept op and operand: {source: executions}
    seen: dict[tuple, int] = {}  # an op's computation -> the kept op computing it
    for op in graph.ops:
        if op.id in op_rep:
            continue
        executions = [op.id, *folded_into.get(op.id, ())]
        inputs, sources = [], []
        for i, own in enumerate(op.inputs):
            by_source = _operand_sources(graph, executions, i, tensor_of, param_of)
            primary = _primary(graph, op.id, tensor_of.get(own, own), by_source)
            if primary is None:
                return None  # no source precedes the op: refuse to fold
            inputs.append(primary)
            sources.append(by_source)
        key = (None if len(executions) > 1 or op.structural
               else _computation(graph, op, inputs, ops, new_id))
        if key is not None and key in seen:
            # What the members hand on outside the blocks is computed once per member, the same
            # way on the same (folded) operands: one op with their executions. (A global
            # gradient norm squares each block's gradient leaves, and sums them in a chain.)
            first = new_id[seen[key]]
            op_rep[op.id] = seen[key]
            tensor_of.update(zip(op.outputs, graph.ops[seen[key]].outputs, strict=True))
            ops[first] = dataclasses.replace(ops[first], count=ops[first].count + op.count)
            for i, t in enumerate(inputs):
                reads[first][i][t] = reads[first][i].get(t, 0) + op.count
            continue
        if key is not None:
            seen[key] = op.id
        new_id[op.id] = len(ops)
        reads.append(sources)
        count = sum(graph.ops[o].count for o in executions)
        ops.append(dataclasses.replace(op, id=new_id[op.id], inputs=tuple(inputs), count=count))
    return ops, new_id, reads


def _operand_sources(graph: OpGraph, executions: Sequence[int], i: int,
                     tensor_of: Mapping[int, int], param_of: Mapping[int, int]
                     ) -> dict[int, int]:
    """Operand ``i``'s sources across the member ops ``executions``, each with its executions.

    Sources are named as the folded graph names them.
    """
    by_source: dict[int, int] = {}
    for o in executions:
        t = graph.ops[o].inputs[i]
        t = tensor_of.get(t, param_of.get(t, t))
        by_source[t] = by_source.get(t, 0) + graph.ops[o].count
    return by_source


def _boundary_uses(ops: Sequence[Op], reads: Sequence[Sequence[dict[int, int]]]
                   ) -> BoundaryUses:
    """The :class:`BoundaryUses` of the operands the kept ops read from several sources.

    Per such operand, the executions of its primary source; the other sources as carries.
    """
    counts: dict[tuple[int, int], int] = {}
    carries: list[Carry] = []
    for o, (op, operands) in enumerate(zip(ops, reads, strict=True)):
        for i, by_source in enumerate(operands):
            if len(by_source) > 1:
                primary = op.inputs[i]
                counts[(o, i)] = by_source[primary]
                carries += [Carry(t, o, i, n) for t, n in by_source.items() if t != primary]
    return BoundaryUses(counts, tuple(carries))


def _dropped_leaves(graph: OpGraph, ops: Sequence[Op], param_of: Mapping[int, int]
                    ) -> dict[int, int]:
    """The leaves of ``param_of`` (folded members' parameters and optimizer state) the folded
    graph does without: those no kept op reads (the ops read the representative's instead)
    and the step does not return as they are."""
    kept = {t for t in graph.outputs if t is not None}
    for op in ops:
        kept.update(op.inputs)
    return {leaf: rep for leaf, rep in param_of.items() if leaf not in kept}


def _computation(graph: OpGraph, op: Op, inputs: Sequence[int], ops: Sequence[Op],
                 new_id: Mapping[int, int]) -> tuple:
    """What ``op`` computes, reading ``inputs``: equal for ops that compute the same value. For
    a scalar op, an operand written by an op of the same kind (primitive, layers, result
    shapes) counts as the chain's previous link, whichever link it is (a sum accumulated op
    after op): a scalar has one sharding, so the links lose no choice by sharing a node."""
    tensors = graph.tensors
    outputs = tuple((tensors[t].shape, tensors[t].dtype) for t in op.outputs)
    scalar = all(not shape for shape, _ in outputs)

    def operand(t: int) -> object:
        producer = tensors[t].producer
        if scalar and producer is not None and producer in new_id:
            p = ops[new_id[producer]]
            if (p.primitive == op.primitive and p.layers == op.layers
                    and tuple((tensors[u].shape, tensors[u].dtype) for u in p.outputs)
                    == outputs):
                return "chain"
        return t

    return (op.primitive, tuple(operand(t) for t in inputs), op.phase, op.layers, op.count,
            op.flops, op.transcendentals, op.bytes_read, op.bytes_written, outputs,
            repr(sorted(op.attrs.items())))


def _primary(graph: OpGraph, op: int, own: int, sources: Mapping[int, int]) -> int | None:
    """The source an op of the folded graph reads (computed before it: an argument, or an op
    earlier in program order); its own member's if that qualifies, else the most read one."""

    def before(t: int) -> bool:
        producer = graph.tensors[t].producer
        return producer is None or producer < op

    if before(own):
        return own
    earlier = [t for t in sources if before(t)]
    if not earlier:
        return None
    return max(earlier, key=lambda t: (sources[t], -t))


def _assemble(graph: OpGraph, ops: list[Op], new_id: Mapping[int, int],
              op_rep: Mapping[int, int], tensor_of: Mapping[int, int],
              layer_of: Mapping[int, int], boundary: BoundaryUses, period: int,
              leaf_of: Mapping[int, int]) -> Fold:
    """The :class:`Fold` of the folded ops: tensors, parameters, layers and outputs rewired,
    and the tensors renumbered to those the folded graph still names (the members' results
    are gone), in their order."""
    outputs_old = tuple(None if t is None else tensor_of.get(t, t) for t in graph.outputs)
    used = (set(graph.inputs) | {p.tensor for p in graph.parameters}) - leaf_of.keys()
    used.update(t for t in outputs_old if t is not None)
    used.update(c.tensor for c in boundary.carries)
    for op in ops:
        used.update(op.inputs)
        used.update(op.outputs)
    tensor_ids = tuple(sorted(used))  # per folded tensor, its id in the full graph
    tid = {old: new for new, old in enumerate(tensor_ids)}

    def rewired(t: Tensor, new: int) -> Tensor:
        producer = None if t.producer is None or t.producer in op_rep else new_id[t.producer]
        return dataclasses.replace(t, id=new, producer=producer)

    tensors = tuple(rewired(graph.tensors[old], new) for new, old in enumerate(tensor_ids))
    ops = [dataclasses.replace(op, inputs=tuple(tid[t] for t in op.inputs),
                               outputs=tuple(tid[t] for t in op.outputs)) for op in ops]
    boundary = BoundaryUses(boundary.counts, tuple(dataclasses.replace(c, tensor=tid[c.tensor])
                                                   for c in boundary.carries))
    op_of = tuple(new_id[op_rep.get(o.id, o.id)] for o in graph.ops)
    parameters = tuple(dataclasses.replace(
        p, tensor=tid[p.tensor], readers=tuple(sorted({op_of[r] for r in p.readers})))
        for p in graph.parameters if p.tensor not in leaf_of)
    members: dict[int, int] = defaultdict(lambda: 1)
    for rep in layer_of.values():
        members[rep] += 1
    dropped_paths = {p.path for p in graph.parameters if p.tensor in leaf_of}
    layers = tuple(dataclasses.replace(
        layer, ops=tuple(new_id[o] for o in layer.ops if o not in op_rep),
        params=tuple(path for path in layer.params if path not in dropped_paths))
        for layer in graph.layers)
    outputs = tuple(None if t is None else tid[t] for t in outputs_old)
    folded = dataclasses.replace(graph, ops=tuple(ops), tensors=tensors, parameters=parameters,
                                 layers=layers,
                                 inputs=tuple(tid[t] for t in graph.inputs if t not in leaf_of),
                                 outputs=outputs)
    charged = _charged(graph, ops, op_of)
    source_ids = tuple(sorted(new_id, key=new_id.__getitem__))
    return Fold(graph=folded, source=graph, op_of=op_of, source_ids=source_ids,
                tensor_ids=tensor_ids, tensor_of=dict(tensor_of),
                boundary=boundary, members=dict(members), period=period, charged=charged,
                leaf_of=dict(leaf_of))


def _charged(graph: OpGraph, ops: Sequence[Op], op_of: Sequence[int]
             ) -> dict[int, tuple[Op, ...]]:
    """Per costed folded op, a variant per distinct memory charge (:attr:`Fold.charged`)."""
    is_buffer = in_memory_tensors(graph).__getitem__
    executions: dict[int, list[int]] = defaultdict(list)
    for o, f in enumerate(op_of):
        executions[f].append(o)
    charged: dict[int, tuple[Op, ...]] = {}
    for op in ops:
        if op.structural or op.attrs.get("folded"):
            continue
        # Members differ only in which of their operands and results live in memory (block 0
        # reads the embedding's output fused, the others a residual sum in memory): one
        # variant per distinct charge, with the executions of its members.
        # Members line up (equal operand and result sizes), so which of them live in memory
        # decides the charge: worked out once per pattern.
        patterns: dict[tuple[tuple[bool, ...], tuple[bool, ...]], tuple[int, int]] = {}
        variants: dict[tuple[int, int], int] = {}
        for o in executions[op.id]:
            member = graph.ops[o]
            pattern = (tuple(map(is_buffer, member.inputs)), tuple(map(is_buffer, member.outputs)))
            charge = patterns.get(pattern)
            if charge is None:
                charge = patterns[pattern] = materialized_bytes(member, graph, is_buffer)
            variants[charge] = variants.get(charge, 0) + member.count
        charged[op.id] = tuple(
            dataclasses.replace(op, bytes_read=read, bytes_written=written, count=count)
            for (read, written), count in variants.items())
    return charged


def expand(fold: Fold, ip: IntraOpProblem) -> IntraOpProblem:
    """``ip`` (an intra-op problem of ``fold.graph``) on the full graph's op and tensor ids:
    every folded member's op (and dropped leaf) takes its representative's node, and a result of a folded op is
    regenerated from constants where its representative's is."""
    op_of, ids = fold.op_of, fold.tensor_ids
    op_nodes = {o: ip.op_nodes[op_of[o]] for o in range(len(op_of))}
    input_nodes = fold.full_inputs(ip.input_nodes)
    free_full = {ids[t] for t in ip.free_tensors}
    free = frozenset(t for t in range(len(fold.source.tensors))
                     if fold.tensor_of.get(t, t) in free_full)
    return dataclasses.replace(ip, input_nodes=input_nodes, op_nodes=op_nodes,
                               free_tensors=free)
