"""Memory per device: arguments, results, and the peak of the intermediate buffers.

The estimate mirrors what XLA's buffer assignment reports in ``memory_analysis()``; its peak
(:attr:`MemoryEstimate.peak_bytes`) is arguments + outputs + temp − alias:

* **arguments**: every input leaf's local shard (parameters, optimizer state, batch);
* **outputs**: every result's local shard (new state, metrics), minus those written in place
  into donated arguments (``alias``);
* **temp**: the peak, over the program order, of the intermediate buffers that do not fit in
  a result's allocation.

Which values are buffers follows XLA's fusion (:func:`buffer_tensors`): elementwise ops,
broadcasts, reshapes and reductions fuse into the ops that read them and are recomputed there,
so a value is a buffer when a non-fusing op writes it (a matmul, a gather, a reduction's
result) or reads it, when it is an expensive elementwise value (exp, tanh, divide ...) the
backward pass reads, or when several fusions read an expensive value or one that reads two
full-size operands (duplicating it would read more than it writes). On one device's shapes,
XLA:CPU's YNNPACK library fusions grow from each reduction through the elementwise ops only it
reads; what they read from outside is a buffer, while loop fusions still recompute it
(:func:`_library_fusions`). Some buffers are no value of the traced program: a broadcast the
forward and backward pass share, a dot operand transposed into the order a dot needs, an
all-gathered weight. Scatters and elementwise ops write in place into an operand they read
last.

Each buffer lives from the op that writes it to the last op that reads it, directly or through
values recomputed downstream, in program order. XLA then assigns buffers, largest first, to
the smallest result allocation whose contents they do not overlap in time (results are written
at the end of the step); the rest share one heap, whose size is the peak of the live bytes.

Measured against ``memory_analysis()`` of compiled train steps on 8 CPU devices
(``benchmarks/cost_fidelity.py``, ``tests/test_cost_sharding.py``): GPT under data 8, tensor
8, FSDP 8 and data 2 × tensor 4, Llama (2-D, FSDP 8) and MoE (data 8, 2-D), batch 32 to 256:
peak within −2.3 % / +1.1 %, temp within −2.3 % / +2.4 %; GPT with a scanned layer stack
within −3.6 %. Not modelled: XLA's scheduler runs ops in another order where that frees memory
sooner (a lone attention gradient reads +32 % temp, a lone expert MLP −12 %), and other
backends than XLA:CPU (jax 0.10.2) fuse differently.

Remat policies (``none``, ``selective``, ``full``) change which forward values the backward
pass keeps; see :func:`saved_activation_bytes`.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Literal

from shardplan.trace.graph import Op, OpGraph

if TYPE_CHECKING:
    from shardplan.cost.sharding import PredictedCollective

__all__ = [
    "YNN_MIN_ELEMENTS",
    "ActivationFacts",
    "MemoryEstimate",
    "RematPolicy",
    "activation_facts",
    "buffer_tensors",
    "estimate_memory",
    "saved_activation_bytes",
    "saved_activation_bytes_by_layer",
]

RematPolicy = Literal["none", "selective", "full"]

_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                         "reduce_or", "argmax", "argmin"})

_ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "neg", "max", "min", "abs", "sign", "floor",
    "ceil", "round", "clamp", "select_n", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    "xor", "square", "sqrt", "rsqrt", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic",
    "erf", "erf_inv", "sin", "cos", "pow", "integer_pow", "is_finite", "convert_element_type",
    "reduce_precision", "stop_gradient", "copy", "copy_p",
})

_FUSIBLE = _ELEMENTWISE | _REDUCTIONS | {
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "iota", "transpose", "slice", "pad",
    "concatenate", "dynamic_slice", "rev", "sharding_constraint", "optimization_barrier",
}
"""Ops XLA fuses with their producers (loop and input fusion)."""

_EXPENSIVE = frozenset({"div", "rem", "sqrt", "rsqrt", "exp", "exp2", "log", "log1p", "expm1",
                        "tanh", "logistic", "erf", "erf_inv", "sin", "cos", "pow"})
"""Elementwise ops XLA's fusion treats as expensive (``HloInstruction::IsElementwise`` ops that
``InstructionFusion::IsExpensive`` flags): not duplicated into several consumers."""

_RELAYOUT = frozenset({"reshape", "squeeze", "expand_dims", "convert_element_type", "copy",
                       "copy_p"})

_SCATTERS = frozenset({"scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul",
                       "scatter-min", "scatter-max", "dynamic_update_slice"})
"""Ops that write their result into their first operand's buffer."""

YNN_MIN_ELEMENTS = 4096
"""Elements an op needs, in its result or an operand, for XLA:CPU to hand it to YNNPACK
(``kMinElements`` of ``IsInstructionPreferredByYnn`` in ``xla/backends/cpu/ynn_support.cc``).
The per-row values of a norm or a softmax (``[batch · seq]``) reach it once a device holds 4096
rows; from there one library fusion computes a norm's whole backward pass (measured: the
memory of GPT tensor 8 jumps between batch 124 and 128)."""

_YNN_COMPUTE = frozenset({
    "add", "add_any", "sub", "mul", "div", "max", "min", "pow", "integer_pow", "square", "neg",
    "exp", "expm1", "log", "log1p", "tanh", "logistic", "rsqrt", "sqrt", "abs", "sign", "floor",
    "ceil", "round", "erf", "sin", "cos", "convert_element_type", "reduce_sum", "reduce_max",
    "reduce_min",
})
"""Ops with a YNNPACK unary, binary or reduce operator (``GetYnnUnaryOpMap`` ...)."""

_YNN_RELAYOUT = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims",
                           "transpose", "iota"})
"""Data movement YNNPACK fusions take whatever its size."""

_YNN_DTYPES = frozenset({"float32", "float64", "bfloat16", "int8", "uint8"})


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device holds.

    Attributes:
      argument_bytes: inputs (parameters, optimizer state, batch, other state).
      output_bytes: results.
      temp_bytes: peak of the intermediate buffers outside the results' allocations.
      alias_bytes: results written in place into donated arguments.
      by_role: input bytes per role (``parameter``, ``optimizer_state``, ``other``).
      gradient_bytes: gradients (backward results the update reads).
      saved_activation_bytes: forward values kept for the backward pass.
      peak_op: the op (program order) at which the intermediates peak (``temp_bytes``).
      peak_buffers: the intermediates live there, outside the results' allocations, as
        ``(tensor id, reader op, bytes)``: a value of the traced program (reader -1), the
        copy of a tensor all-gathered for an op (an FSDP weight), or another buffer (tensor
        and reader -1: a copy in another layout, a shared broadcast). Their bytes sum to
        ``temp_bytes``.
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    by_role: dict[str, int]
    gradient_bytes: int
    saved_activation_bytes: int
    peak_op: int = 0
    peak_buffers: tuple[tuple[int, int, int], ...] = ()
    heap: tuple[tuple[int, ...], ...] = dataclasses.field(default=(), repr=False)

    def buffers_at(self, op: int) -> tuple[tuple[int, int, int], ...]:
        """The intermediates outside the results' allocations live at ``op``, as
        :attr:`peak_buffers` describes them."""
        return _buffers_at(list(self.heap), op)

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs + temp − alias: the bytes XLA allocates for one step."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


def _fusible(op: Op) -> bool:
    return op.primitive in _FUSIBLE and not op.structural


def buffer_tensors(graph: OpGraph) -> list[bool]:
    """Per tensor id: whether XLA's loop fusion writes it to memory (the module docstring)."""
    consumers = graph.consumers
    is_buffer = [False] * len(graph.tensors)
    shared: list[int] = []  # buffers only because several ops read them
    for op in graph.ops:
        if op.structural:  # a loop's stacked results and sliced inputs are real buffers
            for t in op.outputs:
                is_buffer[t] = True
            continue
        for t in op.outputs:
            readers = [graph.ops[c] for c in consumers[t]]
            if (not _fusible(op) or op.primitive in _REDUCTIONS
                    or any(not _fusible(r) or r.structural for r in readers)):
                is_buffer[t] = True
            elif (op.primitive in _EXPENSIVE and op.phase == "forward"
                  and any(r.phase in ("backward", "recompute") for r in readers)):
                # XLA does not recompute an expensive op in the backward pass.
                is_buffer[t] = True
            elif len(readers) > 1 and (op.primitive in _EXPENSIVE or _widening(graph, op, t)):
                # XLA does not duplicate an expensive op into several consumers, nor one that
                # reads more bytes than it writes (``InstructionFusion::ComputeGloballyUnfusible``).
                is_buffer[t] = True
                shared.append(t)
    # ... unless its readers all end up in one fusion, which computes it once.
    fusion_root = [-1] * len(graph.tensors)  # the one buffer a value's readers write, or -2
    demote = set(shared)
    for op in reversed(graph.ops):
        for t in op.outputs:
            if t in demote and _one_fusion(graph, t, is_buffer, fusion_root) >= 0:
                is_buffer[t] = False
            fusion_root[t] = _one_fusion(graph, t, is_buffer, fusion_root)
    return is_buffer


def _one_fusion(graph: OpGraph, t: int, is_buffer: list[bool], fusion_root: list[int]) -> int:
    """The buffer that all fused readers of ``t`` write through fused values, if it is one
    (-2 when there are several, or a reader does not fuse)."""
    root = -1
    for c in graph.consumers[t]:
        op = graph.ops[c]
        if not _fusible(op):
            return -2
        for v in op.outputs:
            r = v if is_buffer[v] else fusion_root[v]
            if r == -2 or (root >= 0 and r >= 0 and r != root):
                return -2
            root = r if r >= 0 else root
    return root


def _widening(graph: OpGraph, op: Op, t: int) -> bool:
    """An elementwise op reading two full-size operands (``a + b``; not ``a * scale`` nor
    ``x - mean``, whose second operand is broadcast from a smaller value)."""
    if op.primitive not in _ELEMENTWISE:
        return False
    size = _elements(graph.tensors[t].shape)
    return sum(_elements(graph.tensors[u].shape) >= size for u in op.inputs) > 1


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def estimate_memory(graph: OpGraph, local_bytes: Callable[[int], int], *,
                    donated: bool = False,
                    collectives: Iterable[PredictedCollective] = ()) -> MemoryEstimate:
    """Estimates one device's memory for one call of the traced function.

    Args:
      graph: the traced step.
      local_bytes: bytes of a tensor held by one device (``ShardingAnalysis.local_bytes``).
      donated: the state arguments are donated, so results with the same key path reuse them.
      collectives: the sharded program's collectives (``ShardingAnalysis.collectives``). An
        all-gathered tensor (an FSDP weight) keeps its gathered copy from the first op that
        needs it to its last reader, the backward pass's included; without them, gathered
        copies are not counted.

    Returns:
      A :class:`MemoryEstimate`.

    Example:
        >>> import jax.numpy as jnp, shardplan as sp
        >>> graph = sp.trace(lambda x: jnp.tanh(x @ x).sum(), jnp.ones((64, 64)))
        >>> estimate_memory(graph, lambda t: graph.tensors[t].nbytes).temp_bytes
        16384
    """
    inputs = set(graph.inputs)
    outputs = {t for t in graph.outputs if t is not None}
    by_role: dict[str, int] = {}
    for p in graph.parameters:
        role = "other" if p.role == "unused" else p.role
        by_role[role] = by_role.get(role, 0) + local_bytes(p.tensor)
    argument = sum(by_role.values())
    output = sum(local_bytes(t) for t in outputs if t not in inputs)
    aliased: AbstractSet[int] = frozenset()
    if donated:
        in_paths = {f"{p.arg_index}/{p.path}" for p in graph.parameters}
        aliased = {t for t, path in zip(graph.outputs, graph.output_paths, strict=True)
                   if t is not None and t not in inputs and path in in_paths}
    alias = sum(local_bytes(t) for t in aliased)
    gathered: dict[int, tuple[int, int]] = {}
    for c in collectives:
        if c.kind == "all-gather" and c.tensor not in gathered:
            gathered[c.tensor] = (c.op, c.result_bytes)
    temps, loop_state, results = _live_buffers(graph, local_bytes, inputs, outputs, gathered,
                                               aliased)
    heap = _pack_into_results(temps, results) + loop_state
    temp, at = _peak(heap, len(graph.ops))
    peak_buffers = _buffers_at(heap, at)
    grads = sum(local_bytes(t) for t in _gradients(graph))
    saved = saved_activation_bytes(graph, local_bytes, "none")
    return MemoryEstimate(argument_bytes=argument, output_bytes=output, temp_bytes=temp,
                          alias_bytes=alias, by_role=by_role, gradient_bytes=grads,
                          saved_activation_bytes=saved, peak_op=at,
                          peak_buffers=peak_buffers if temp else (), heap=tuple(heap))


# ---------------------------------------------------------------------------------------------
# The buffers of one device and their live ranges
# (Longer than ~600 lines: which values are buffers, when they live and where XLA allocates them
# are one model, measured and tuned together; the fusion part could move to its own module.)
# ---------------------------------------------------------------------------------------------

_Interval = tuple[int, ...]
"""``(first op, last op, bytes)`` of a buffer, both ops included; then, for the buffer of a
value of the traced program, its tensor id, or for a gathered copy the tensor and the op it is
gathered for."""


@dataclasses.dataclass(frozen=True)
class _Buffers:
    """The buffers of one device and their live ranges, before allocation.

    Attributes:
      spans: per root buffer (tensor id), ``[first op, last op, bytes]``; a value written in
        place into another's buffer extends its root's span.
      stacked: the roots that are a loop's stacked results (loop state).
      copies: per tensor, its copies in further dot layouts (:func:`_layout_copies`).
      broadcasts: broadcasts written out for a library fusion, keyed by the broadcast tensor
        and shape (:func:`_shared_broadcasts`).
      last: per tensor, the last op that reads it, directly or through fused values.
    """

    spans: dict[int, list[int]]
    stacked: set[int]
    copies: dict[int, list[_Interval]]
    broadcasts: dict[tuple[int, tuple[int, ...]], _Interval]
    last: list[int]


def _buffers(graph: OpGraph, local_bytes: Callable[[int], int], inputs: set[int],
             outputs: set[int], gathered: Mapping[int, tuple[int, int]],
             fused: Sequence[bool] | None = None) -> _Buffers:
    """Which values are buffers (fusion, library fusions, in-place writes) and when each lives;
    shared by the memory estimate and the saved activations. ``fused``: ``buffer_tensors``
    of the graph, when already known."""
    is_buffer = buffer_tensors(graph) if fused is None else list(fused)
    for op in graph.ops:
        if op.primitive == "scan_slice":
            # An iteration's slice of a stacked input (a ``dynamic-slice``) fuses into the
            # elementwise ops that read it; a dot or a reduction reads it from memory.
            for t in op.outputs:
                is_buffer[t] = t in outputs or any(
                    not _fusible(graph.ops[c]) or graph.ops[c].primitive in _REDUCTIONS
                    for c in graph.consumers[t])
    fusion_of = _library_fusions(graph, local_bytes)
    loop_buffer = list(is_buffer)
    _apply_library_fusions(graph, fusion_of, is_buffer, outputs)
    # A value written out only for a library fusion is still recomputed by the loop fusions
    # that read it (duplicating it is cheap), so its operands live on for them.
    recomputed = [is_buffer[t] and not loop_buffer[t] and tensor.producer not in fusion_of
                  for t, tensor in enumerate(graph.tensors)]
    owner = _scatter_in_place(graph, is_buffer)
    last = _last_uses(graph, [b and not r for b, r in zip(is_buffer, recomputed, strict=True)])
    fusion_end: dict[int, int] = {}
    for o, fusion in fusion_of.items():
        fusion_end[fusion] = max(fusion_end.get(fusion, o), o)
    for t in (t for t, r in enumerate(recomputed) if r):  # the buffer serves the fusions only
        last[t] = max(fusion_end[fusion_of[c]] for c in graph.consumers[t] if c in fusion_of)
    copies = _layout_copies(graph, local_bytes)
    owner = _share_buffers(graph, is_buffer, local_bytes, last, owner, set(copies))
    # One span per buffer; values written in place into another's buffer extend its span.
    span: dict[int, list[int]] = {}
    stacked: set[int] = set()
    for t, tensor in enumerate(graph.tensors):
        if not is_buffer[t] or tensor.producer is None or t in outputs or t in inputs:
            continue
        root = t
        while root in owner:
            root = owner[root]
        producer = graph.ops[tensor.producer]
        # A buffer computed from constants alone (the zeros a scatter adds into) depends on
        # nothing, and XLA's scheduler places it at the start of the program.
        start = tensor.producer if producer.inputs else 0
        if producer.primitive == "scan_stack":
            stacked.add(root)
        elif producer.primitive == "scan_slice" and graph.consumers[t]:
            start = min(graph.consumers[t])  # sliced where an iteration reads it
        s = span.setdefault(root, [start, last[t], 0])
        s[0], s[1], s[2] = min(s[0], start), max(s[1], last[t]), max(s[2], local_bytes(t))
    broadcasts = _shared_broadcasts(graph, local_bytes, fusion_of, gathered)
    return _Buffers(spans=span, stacked=stacked, copies=copies, broadcasts=broadcasts,
                    last=last)


def _live_buffers(graph: OpGraph, local_bytes: Callable[[int], int], inputs: set[int],
                  outputs: set[int], gathered: Mapping[int, tuple[int, int]],
                  aliased: AbstractSet[int] = frozenset()
                  ) -> tuple[list[_Interval], list[_Interval], list[_Interval]]:
    """The intermediate buffers, the loops' stacked results, and the results that have their
    own allocation (not those written in place into a donated argument, whose allocation is
    the argument's and holds it from the start: no intermediate can share it).

    A loop's stacked results are part of the loop's state, which XLA allocates with the loop
    (a while loop's colocated buffers) rather than in a result's allocation.
    """
    buffers = _buffers(graph, local_bytes, inputs, outputs, gathered)
    span, stacked, last = buffers.spans, buffers.stacked, buffers.last
    temps: list[_Interval] = [(a, b, size, r) for r, (a, b, size) in span.items()
                              if r not in stacked]
    loop_state: list[_Interval] = [(a, b, size, r) for r, (a, b, size) in span.items()
                                   if r in stacked]
    # An all-gathered tensor is gathered once (XLA's CSE) for every op that reads it.
    temps += [(op, last[t], size, t, op) for t, (op, size) in gathered.items()]
    temps += list(buffers.broadcasts.values())
    temps += [c for tensor_copies in buffers.copies.values() for c in tensor_copies]
    n = len(graph.ops)
    results: list[_Interval] = [(p, n, local_bytes(t)) for t in outputs if t not in inputs and t not in aliased
               and (p := graph.tensors[t].producer) is not None]
    return temps, loop_state, results


def _last_uses(graph: OpGraph, read_from_memory: list[bool]) -> list[int]:
    """Per tensor, the last op that reads it directly or through values fused into their
    readers (a fused value is recomputed where it is read, so its buffered operands stay
    alive). A loop reads a slice of a stacked input in every iteration, so the input lives to
    the loop's end. One pass over the ops, last first.

    Args:
      graph: the traced step.
      read_from_memory: per tensor, whether its readers read it from a buffer (rather than
        recompute it).
    """
    loop_end: dict[int, int] = {}
    for op in graph.ops:
        for loop_id, _ in op.loop:
            loop_end[loop_id] = op.id
    reach = [-1] * len(graph.tensors)  # last op reading it, through non-buffered values
    for op in reversed(graph.ops):
        end = op.id
        if op.primitive == "scan_slice":
            end = max(end, loop_end.get(op.attrs.get("loop", -1), end))
        for v in op.outputs:
            if not read_from_memory[v]:
                end = max(end, reach[v])
        for t in op.inputs:
            reach[t] = max(reach[t], end)
    return [max(r, graph.tensors[t].producer or 0) for t, r in enumerate(reach)]


# ---------------------------------------------------------------------------------------------
# XLA:CPU's library (YNNPACK) fusions
# ---------------------------------------------------------------------------------------------


def _library_fusions(graph: OpGraph, local_bytes: Callable[[int], int]) -> dict[int, int]:
    """XLA:CPU's library fusions (``LibraryRewriter`` with ``YnnMatcher``), formed before its
    loop fusion: each reduction, latest first, starts a fusion that grows breadth first up into
    the producer of an operand all of whose readers are members, and down into the single
    reader of a member, through ops YNNPACK supports and prefers (:data:`YNN_MIN_ELEMENTS`).

    Returns:
      The fusion (its starting op) of each op in one.
    """
    consumers = graph.consumers

    def elements(t: int) -> int:  # on one device
        tensor = graph.tensors[t]
        return local_bytes(t) * _elements(tensor.shape) // max(tensor.nbytes, 1)

    def supported(op: Op) -> bool:
        if op.structural or len(op.outputs) != 1:
            return False
        if op.primitive in _YNN_RELAYOUT:
            return True
        tensors = (*op.inputs, *op.outputs)
        return (op.primitive in _YNN_COMPUTE
                and all(graph.tensors[t].dtype in _YNN_DTYPES for t in tensors)
                and any(elements(t) >= YNN_MIN_ELEMENTS for t in tensors))

    fusion_of: dict[int, int] = {}
    for start in reversed(graph.ops):
        if start.primitive not in _REDUCTIONS or start.id in fusion_of or not supported(start):
            continue
        fusion_of[start.id] = start.id
        frontier = collections.deque([start.id])
        while frontier:
            op = graph.ops[frontier.popleft()]
            for t in op.inputs:
                p = graph.tensors[t].producer
                if (p is not None and p not in fusion_of and supported(graph.ops[p])
                        and all(fusion_of.get(c) == start.id for c in consumers[t])):
                    fusion_of[p] = start.id
                    frontier.append(p)
            readers = consumers[op.outputs[0]]
            if (len(readers) == 1 and readers[0] not in fusion_of
                    and supported(graph.ops[readers[0]])):
                fusion_of[readers[0]] = start.id
                frontier.append(readers[0])
    return fusion_of


def _apply_library_fusions(graph: OpGraph, fusion_of: Mapping[int, int], is_buffer: list[bool],
                           outputs: set[int]) -> None:
    """Values inside a library fusion are not buffers; those crossing its border are."""
    consumers = graph.consumers
    for o, fusion in fusion_of.items():
        op = graph.ops[o]
        for t in op.outputs:
            is_buffer[t] = t in outputs or any(fusion_of.get(c) != fusion for c in consumers[t])
        for t in op.inputs:
            p = graph.tensors[t].producer
            if (p is not None and fusion_of.get(p) != fusion and graph.ops[p].inputs
                    and graph.ops[p].primitive not in _YNN_RELAYOUT):
                is_buffer[t] = True


# ---------------------------------------------------------------------------------------------
# Buffers written in place
# ---------------------------------------------------------------------------------------------


def _scatter_in_place(graph: OpGraph, is_buffer: list[bool]) -> dict[int, int]:
    """XLA's algebraic simplifier turns ``x + scatter_add(zeros, i, u)`` (the gradient of a
    gather added to another gradient) into ``scatter_add(x, i, u)``, in place in ``x``: the
    zeros disappear and ``x`` is the buffer.

    Updates ``is_buffer``; returns the tensors written into another's buffer.
    """
    consumers = graph.consumers
    owner: dict[int, int] = {}
    for op in graph.ops:
        if op.primitive not in _SCATTERS or not op.inputs or len(op.outputs) != 1:
            continue
        (out,) = op.outputs
        base, readers = op.inputs[0], consumers[op.outputs[0]]
        producer = graph.tensors[base].producer
        if (producer is None or graph.ops[producer].primitive != "broadcast_in_dim"
                or graph.ops[producer].inputs or len(consumers[base]) != 1
                or len(readers) != 1):
            continue
        add = graph.ops[readers[0]]
        if add.primitive not in ("add", "add_any") or len(add.inputs) != 2:
            continue
        other = add.inputs[0] if add.inputs[1] == out else add.inputs[1]
        if graph.tensors[other].shape == graph.tensors[out].shape:
            is_buffer[base] = False
            is_buffer[other] = is_buffer[out] = is_buffer[add.outputs[0]] = True
            owner[out] = owner[add.outputs[0]] = other
    return owner


def _share_buffers(graph: OpGraph, is_buffer: list[bool], local_bytes: Callable[[int], int],
                   last: list[int], owner: dict[int, int], copied: set[int]) -> dict[int, int]:
    """In-place reuse (XLA's buffer sharing with an operand): a scatter updates the operand it
    reads last, and a fused elementwise computation writes its result into the buffer of an
    operand of the same size that it reads for the last time. A result also written in another
    layout (``copied``) is computed twice from its operands, so neither can take their place.

    Returns:
      ``owner`` extended: each tensor written into another's buffer.
    """
    consumers = graph.consumers
    owner = dict(owner)

    def root(t: int) -> int:
        while t in owner:
            t = owner[t]
        return t

    for t, tensor in enumerate(graph.tensors):
        readers = consumers[t]
        if not is_buffer[t] or tensor.producer is None or not readers:
            continue
        final = last[t]  # the op that reads it last, directly or through fused values
        op = graph.ops[final]
        if op.primitive in _SCATTERS and readers == (final,) and op.inputs[0] == t:
            if op.outputs[0] not in owner and root(op.outputs[0]) != root(t):
                owner[op.outputs[0]] = root(t)
            continue
        if not _fusible(op) or not all(_fusible(graph.ops[r]) for r in readers):
            continue
        # The fusion of the last reader writes its result over the buffer.
        size = local_bytes(t)
        for u in op.outputs:
            if (is_buffer[u] and u not in owner and u not in copied and root(u) != root(t)
                    and local_bytes(u) == size):
                owner[u] = root(t)
                break
    return owner


# ---------------------------------------------------------------------------------------------
# Buffers that are no value of the traced program
# ---------------------------------------------------------------------------------------------


def _shared_broadcasts(graph: OpGraph, local_bytes: Callable[[int], int],
                       fusion_of: Mapping[int, int],
                       gathered: Mapping[int, tuple[int, int]]
                       ) -> dict[tuple[int, tuple[int, ...]], _Interval]:
    """Broadcasts a library fusion multiplies by and shares with an op outside it, written out
    between them, keyed by the broadcast tensor and shape.

    XLA's common-subexpression elimination merges equal broadcasts into one instruction at the
    first use: a norm's ``rsqrt`` and ``scale``, broadcast in the forward pass and again where
    the backward pass reduces the gradient of the scale. A loop fusion takes a copy of a
    broadcast, but a library fusion takes no operand with other users, so the broadcast is
    written out at full size and lives until the fusion reads it. A broadcast divisor (a
    softmax's sum) is not: the algebraic simplifier turns ``x / broadcast(d)`` into
    ``x · broadcast(1 / d)``, and each fusion computes its own reciprocal (measured).
    """
    consumers = graph.consumers
    out: dict[tuple[int, tuple[int, ...]], _Interval] = {}
    for o, fusion in fusion_of.items():
        op = graph.ops[o]
        if op.primitive != "mul":
            continue
        (r,) = op.outputs
        shape, size = graph.tensors[r].shape, local_bytes(r)
        for t in op.inputs:
            if (local_bytes(t) >= size or (t, shape) in out or t in gathered
                    or _source(graph, t) in gathered):
                # A sharded value (an FSDP norm scale) is all-gathered again where the backward
                # pass reads it: the two broadcasts are of different values.
                continue
            elsewhere = [c for c in consumers[t] if c < o and fusion_of.get(c) != fusion
                         and any(graph.tensors[u].shape == shape for u in graph.ops[c].outputs)]
            if elsewhere:
                # Broadcasting an argument (a norm's scale) depends on nothing computed: the
                # scheduler places it at the start of the program.
                argument = graph.tensors[_source(graph, t)].producer is None
                out[(t, shape)] = (0 if argument else min(elsewhere), o, size)
    return out


def _layout_copies(graph: OpGraph, local_bytes: Callable[[int], int]
                   ) -> dict[int, list[_Interval]]:
    """Copies of a dot operand in the further layouts its dots need.

    XLA's ``DotDecomposer`` rewrites an operand whose batch dimensions do not lead, or which
    has several contracted or several free dimensions, into ``[batch, free, contracted]`` (left)
    or ``[batch, contracted, free]`` (right): when that reorders dimensions, a transposed copy,
    fused into the op that writes the operand. An operand its dots need in two orders (a
    gradient read by the dots of the weight gradient and of the input gradient) is written
    twice; an argument's copies depend on nothing computed, so they are made at the start.
    """
    consumers = graph.consumers
    copies: dict[int, list[_Interval]] = {}
    for t, tensor in enumerate(graph.tensors):
        natural = _layout(tensor.shape, tuple(range(len(tensor.shape))))
        needs: dict[tuple[int, ...], int] = {}  # layout -> last dot that needs it
        for c in consumers[t]:
            op = graph.ops[c]
            if op.primitive == "dot_general":
                for side, operand in enumerate(op.inputs[:2]):
                    if operand == t:
                        needs[_dot_layout(graph, op, side)] = c
        if not needs or (len(needs) == 1 and natural in needs):
            continue
        # The natural layout exists anyway for an argument, or when a non-fusing op writes or
        # reads the tensor.
        producer = tensor.producer
        natural_too = (natural in needs or producer is None
                       or not _fusible(graph.ops[producer]) or any(
                           not _fusible(graph.ops[c]) and graph.ops[c].primitive != "dot_general"
                           for c in consumers[t]))
        others = sorted(end for layout, end in needs.items() if layout != natural)
        if not natural_too:
            others.pop()  # the tensor's own buffer holds the longest-lived layout
        copies[t] = [(producer or 0, end, local_bytes(t)) for end in others]
    return copies


def _dot_layout(graph: OpGraph, op: Op, side: int) -> tuple[int, ...]:
    """The dimension order a dot reads its operand ``side`` (0: left, 1: right) in."""
    shape = graph.tensors[op.inputs[side]].shape
    prefix = "lhs" if side == 0 else "rhs"
    batch = tuple(op.attrs.get(f"{prefix}_batch", ()))
    contract = tuple(op.attrs.get(f"{prefix}_contract", ()))
    free = tuple(d for d in range(len(shape)) if d not in batch and d not in contract)
    natural = _layout(shape, tuple(range(len(shape))))
    if (_layout(shape, batch) == natural[:len(_layout(shape, batch))]
            and len(_layout(shape, contract)) <= 1 and len(_layout(shape, free)) <= 1):
        return natural  # canonical already: the kernel takes either order of the other two
    return _layout(shape, batch + (free + contract if side == 0 else contract + free))


def _layout(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """A dimension order without the dimensions of size 1 (they move no data)."""
    return tuple(d for d in order if shape[d] != 1)


def _source(graph: OpGraph, t: int) -> int:
    """``t``, or the tensor it is a reshape or conversion of."""
    while (p := graph.tensors[t].producer) is not None:
        op = graph.ops[p]
        if op.primitive not in _RELAYOUT or len(op.inputs) != 1:
            break
        t = op.inputs[0]
    return t


# ---------------------------------------------------------------------------------------------
# Allocation
# ---------------------------------------------------------------------------------------------


def _pack_into_results(temps: list[_Interval], results: list[_Interval]) -> list[_Interval]:
    """XLA's buffer assignment (``BufferAssigner``): buffers are taken largest first, results
    before intermediates of the same size, and each intermediate goes to the smallest existing
    allocation at least as large whose buffers it does not overlap in time
    (``MaybeAssignBuffer``). A result is written at the end of the step, so its allocation
    holds intermediates that die before. The rest share the heap.

    Returns:
      The buffers left for the heap.
    """
    # Allocations by size; within a size, by when their result is written (a buffer that dies
    # later than that cannot use the allocation, so those are skipped without a look).
    by_size: dict[int, list[tuple[int, list[tuple[int, int]]]]] = collections.defaultdict(list)
    for start, end, size in results:
        by_size[size].append((start, [(start, end)]))
    sizes = sorted(by_size)
    for size in sizes:
        by_size[size].sort(key=lambda a: a[0])
    written = {size: [a[0] for a in by_size[size]] for size in sizes}
    heap: list[_Interval] = []
    for buffer in sorted(temps, key=lambda b: -b[2]):
        if not _assign(buffer[0], buffer[1], buffer[2], sizes, by_size, written):
            heap.append(buffer)
    return heap


def _assign(start: int, end: int, size: int, sizes: list[int],
            by_size: Mapping[int, list[tuple[int, list[tuple[int, int]]]]],
            written: Mapping[int, list[int]]) -> bool:
    for alloc_size in sizes[bisect.bisect_left(sizes, size):]:
        allocations = by_size[alloc_size]
        for _, held in allocations[bisect.bisect_right(written[alloc_size], end):]:
            i = bisect.bisect_left(held, (start, start))
            if (i < len(held) and held[i][0] <= end) or (i > 0 and held[i - 1][1] >= start):
                continue
            held.insert(i, (start, end))
            return True
    return False


def _buffers_at(heap: list[_Interval], op: int) -> tuple[tuple[int, int, int], ...]:
    return tuple(sorted((*_what(b), b[2]) for b in heap if b[0] <= op <= b[1]))


def _what(buffer: _Interval) -> tuple[int, int]:
    """``(tensor id, reader op)`` of a buffer (see :attr:`MemoryEstimate.peak_buffers`)."""
    tensor, reader = (*buffer[3:], -1, -1)[:2]
    return tensor, reader


def _max_live(buffers: list[_Interval], n: int) -> int:
    """The peak, over ``n`` ops, of the bytes of the live buffers."""
    return _peak(buffers, n)[0]


def _peak(buffers: list[_Interval], n: int) -> tuple[int, int]:
    """The peak, over ``n`` ops, of the bytes of the live buffers, and the first op at it."""
    delta = [0] * (n + 2)
    for start, end, size, *_ in buffers:
        delta[start] += size
        delta[end + 1] -= size
    peak = live = at = 0
    for i, d in enumerate(delta):
        live += d
        if live > peak:
            peak, at = live, i
    return peak, at


# ---------------------------------------------------------------------------------------------
# Gradients and saved activations
# ---------------------------------------------------------------------------------------------


def _gradients(graph: OpGraph) -> set[int]:
    """Backward results read by the update."""
    consumers = graph.consumers
    grads: set[int] = set()
    for op in graph.ops:
        if op.phase not in ("backward", "recompute"):
            continue
        for t in op.outputs:
            if any(graph.ops[c].phase in ("update", "other") for c in consumers[t]):
                grads.add(t)
    return grads


def saved_activation_bytes(graph: OpGraph, local_bytes: Callable[[int], int],
                           policy: RematPolicy, *, layer: int | None = None) -> int:
    """Bytes of activations the forward pass leaves for the backward pass, under a remat policy.

    What XLA keeps, not what the jaxpr names: the buffers of the memory model (fusion, library
    fusions, in-place writes, dot layout copies; the module docstring) that a forward op writes
    and that live into the backward pass. A value the backward pass reads but XLA fuses into
    its reader (``2·x`` of a norm's variance, ``1 − tanh`` of a GELU) costs nothing of its own;
    its buffered operands stay alive instead. A loop's stacked results are kept whole: XLA
    fuses nothing across a loop's boundary. Only activations count, values that depend on the
    batch: a weight cast to the compute dtype or a mask built from ``iota`` is the same for any
    microbatch (a bf16 model's weight casts: 2 bytes per parameter, 3.6e9 per GPT-3 175B block).

    * ``none`` keeps all of them.
    * ``selective`` recomputes the attention core (Korthikanti et al. 2022, section 4.2): the
      ``[.., s, s]`` results of a dot with batch dimensions (the scores) and every value
      computed from them alone (mask, softmax, its row sums), up to the dot that contracts
      them with the values; it keeps the rest, q, k and v included. As
      ``jax.checkpoint`` of the core alone, or ``save_anything_except_these_names`` on its
      values.
    * ``full`` keeps only each layer's input: the activations that earlier layers hand to it
      (``jax.checkpoint`` of the whole layer), and recomputes the rest.

    Measured against ``memory_analysis()`` of GPT train steps on one CPU device, float32: the
    temp bytes one block more adds per sample (two layer counts, two batch sizes), remat applied
    by a ``custom_vjp`` that recomputes the block or the attention core once the cotangent is
    there (``jax.checkpoint``'s recomputation is scheduled into the forward pass by XLA:CPU:
    no bytes saved). Per block and sample, predicted / XLA:

    * gpt-tiny (s 32, h 64, 4 heads), a list of blocks: none 231,424 / 231,424, selective
      197,632 / 197,376; a scan: none 329,984 / 329,728, selective 296,192 / 295,936, full
      8,192 / 8,192 (``tests/test_cost_memory.py``);
    * gpt-small at s 256 (h 768, 12 heads), a scan: none 34.64e6 / 34.64e6, selective
      28.32e6 / 28.32e6; a list, batch 8 to 16: selective 22.04e6 / 22.03e6, none 28.3e6 /
      31.5e6: there XLA:CPU also writes out the softmax's broadcast divisor ``[b, a, s, s]``
      for the backward pass's library fusion, early, in the forward pass (not modelled, nor
      in the temp estimate, which is 6 % under XLA's on this step).

    Not measurable on CPU: bfloat16 (XLA:CPU computes and keeps bfloat16 values in float32),
    and full remat of a list of blocks (the peak is then elsewhere).

    Args:
      graph: the traced step (without remat: the policies are predicted from it).
      local_bytes: bytes of a tensor on one device.
      policy: the remat policy.
      layer: only the activations of this layer (default: all); a scanned stack's loop
        state is shared evenly by its layers.

    Example:
        >>> import models, shardplan as sp
        >>> config = models.load_model_config("gpt-tiny")
        >>> graphdef, state = models.abstract_train_state(config)
        >>> graph = sp.trace(models.make_train_step(graphdef), state,
        ...                  models.example_batch(config, 4, abstract=True))
        >>> [saved_activation_bytes(graph, lambda t: graph.tensors[t].nbytes, p, layer=1)
        ...  for p in ("none", "selective", "full")]
        [925696, 790528, 32768]
    """
    per_layer, total = _saved_activations(graph, local_bytes, activation_facts(graph))
    if layer is None:
        return total[policy]
    return per_layer.get(layer, {}).get(policy, 0)


def saved_activation_bytes_by_layer(graph: OpGraph, local_bytes: Callable[[int], int], *,
                                    facts: ActivationFacts | None = None
                                    ) -> dict[int, dict[RematPolicy, int]]:
    """Per layer index, :func:`saved_activation_bytes` of each policy, in one pass.

    Args:
      graph: the traced step.
      local_bytes: bytes of a tensor on one device.
      facts: ``activation_facts(graph)``, to share between shardings of one graph.
    """
    per_layer, _ = _saved_activations(graph, local_bytes, facts or activation_facts(graph))
    return {layer.index: dict(per_layer.get(layer.index, _no_activations()))
            for layer in graph.layers}


@dataclasses.dataclass(frozen=True)
class ActivationFacts:
    """What the saved activations of a graph are, whatever its sharding (per tensor id).

    Attributes:
      fused: ``buffer_tensors(graph)``: written to memory by XLA's loop fusion.
      varies: depends on the batch (an activation), not on parameters and constants alone.
      core: a value of an attention core, which selective remat recomputes.
      layer_inputs: per layer, the activations its forward ops read that ops outside it
        wrote (what full remat keeps).
    """

    fused: tuple[bool, ...]
    varies: tuple[bool, ...]
    core: tuple[bool, ...]
    layer_inputs: Mapping[int, frozenset[int]]


def activation_facts(graph: OpGraph) -> ActivationFacts:
    """The sharding-independent part of :func:`saved_activation_bytes` of ``graph``."""
    varies = _batch_dependent(graph)
    return ActivationFacts(
        fused=tuple(buffer_tensors(graph)), varies=tuple(varies),
        core=tuple(_attention_core(graph, varies)),
        layer_inputs={i: frozenset(ts) for i, ts in _layer_inputs(graph, varies).items()})


def _no_activations() -> dict[RematPolicy, int]:
    return {"none": 0, "selective": 0, "full": 0}


def _saved_activations(graph: OpGraph, local_bytes: Callable[[int], int],
                       facts: ActivationFacts
                       ) -> tuple[dict[int, dict[RematPolicy, int]], dict[RematPolicy, int]]:
    """Per layer and in all, the saved activation bytes of each policy."""
    local_bytes = [local_bytes(t) for t in range(len(graph.tensors))].__getitem__  # read often
    inputs = set(graph.inputs)
    outputs = {t for t in graph.outputs if t is not None}
    buffers = _buffers(graph, local_bytes, inputs, outputs, {}, facts.fused)
    varies, core = facts.varies, facts.core
    backward = [op.phase in ("backward", "recompute") for op in graph.ops]
    # Bytes by the layers that own them (a loop body's: all of the stack's), then by layer.
    owned: dict[tuple[int, ...], dict[RematPolicy, int]] = collections.defaultdict(
        _no_activations)

    def keep(layers: tuple[int, ...], nbytes: int, in_core: bool) -> None:
        owned[layers]["none"] += nbytes
        if not in_core:
            owned[layers]["selective"] += nbytes

    for root, (_, end, nbytes) in buffers.spans.items():
        producer = graph.ops[graph.tensors[root].producer or 0]
        if producer.phase == "forward" and backward[end] and varies[root]:
            keep(producer.layers, nbytes, core[root])
    for t, copies in buffers.copies.items():
        producer_id = graph.tensors[t].producer
        if producer_id is None or graph.ops[producer_id].phase != "forward" or not varies[t]:
            continue
        for _, end, nbytes, *_ in copies:
            if backward[end]:
                keep(graph.ops[producer_id].layers, nbytes, core[t])
    for (t, _), (start, end, nbytes, *_) in buffers.broadcasts.items():
        # Written out at the activation's shape even when the broadcast value is a
        # parameter (a norm's scale); it belongs to the layer whose backward pass reads it.
        if not backward[start] and backward[end]:
            keep(graph.ops[end].layers, nbytes, core[t])
    per_layer: dict[int, dict[RematPolicy, int]] = collections.defaultdict(_no_activations)
    total = _no_activations()
    for layers, kept in owned.items():
        for policy, nbytes in kept.items():
            total[policy] += nbytes
            for i in layers:  # a loop's state is shared by the layers of its body
                per_layer[i][policy] += nbytes // len(layers)
    # Full remat: each layer keeps what earlier layers hand to it.
    for i, received in facts.layer_inputs.items():
        nbytes = sum(local_bytes(t) for t in received)
        per_layer[i]["full"] += nbytes
        total["full"] += nbytes
    return per_layer, total


def _batch_dependent(graph: OpGraph) -> list[bool]:
    """Per tensor, whether it depends on an input other than parameters and optimizer state
    (the batch): activations, not weights cast to another dtype or masks built from iota."""
    fixed = {p.tensor for p in graph.parameters if p.role in ("parameter", "optimizer_state")}
    varies = [False] * len(graph.tensors)
    for t in graph.inputs:
        varies[t] = t not in fixed
    for op in graph.ops:  # in program order: operands first
        if any(varies[t] for t in op.inputs):
            for t in op.outputs:
                varies[t] = True
    return varies


def _attention_core(graph: OpGraph, varies: Sequence[bool]) -> list[bool]:
    """Per tensor, whether selective remat recomputes it: the ``[.., s, s]`` result of a dot
    with batch dimensions (attention scores), and forward values computed from such values
    and constants alone (masked scores, softmax, its row sums, their stacks in a loop)."""
    core = [False] * len(graph.tensors)
    for op in graph.ops:
        if op.phase != "forward":
            continue
        operands = [t for t in op.inputs if varies[t]]
        if op.primitive == "dot_general" and op.attrs.get("lhs_batch"):
            shape = graph.tensors[op.outputs[0]].shape
            scores = len(shape) >= 2 and shape[-1] == shape[-2] > 1
            if scores and not any(core[t] for t in operands):
                core[op.outputs[0]] = True
            continue  # the dot of the probabilities with v ends the core
        if operands and all(core[t] for t in operands):
            for t in op.outputs:
                core[t] = True
    return core


def _layer_inputs(graph: OpGraph, varies: Sequence[bool]) -> dict[int, set[int]]:
    """Per layer, the activations its forward ops read that ops outside it wrote (graph
    inputs, such as the batch, are arguments and not counted). A scanned stack's layers share
    its body: each receives what enters the stack, the size of the loop's carry."""
    out: dict[int, set[int]] = collections.defaultdict(set)
    for op in graph.ops:
        if op.phase != "forward" or op.structural or not op.layers:
            continue
        for t in op.inputs:
            producer = graph.tensors[t].producer
            if producer is None or not varies[t]:
                continue
            writer = graph.ops[producer].layers
            if writer == op.layers:  # within the layer (a loop body's: within each)
                continue
            for i in set(op.layers).difference(writer):
                out[i].add(t)
    return out
