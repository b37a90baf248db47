"""The buffers of one device and their live ranges, before allocation.

The model that :mod:`shardplan.cost.memory` allocates into the results' allocations and the
heap, and that :mod:`shardplan.cost.activations` counts the saved activations on.

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
values recomputed downstream, in program order (:func:`_buffers`, :func:`_last_uses`).

:func:`buffer_tensors` and :data:`YNN_MIN_ELEMENTS` are re-exported by
:mod:`shardplan.cost.memory`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping, Sequence

from shardplan.trace.graph import Op, OpGraph

__all__ = ["YNN_MIN_ELEMENTS", "buffer_tensors", "in_memory_tensors"]

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


def in_memory_tensors(graph: OpGraph) -> list[bool]:
    """Per tensor id: whether reading or writing it moves bytes of device memory, which is
    what the roofline charges (:func:`~shardplan.cost.compute.with_materialized_bytes`): the
    buffers of :func:`buffer_tensors` and also the program's arguments and results. An
    argument lives in memory before the step (a fusion reading a parameter or an Adam moment
    reads it from there) and a result after it (the update's fusions write the new
    parameters and moments there), though neither is a buffer the step allocates."""
    in_memory = buffer_tensors(graph)
    for t in (*graph.inputs, *graph.outputs):
        if t is not None:
            in_memory[t] = True
    return in_memory


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


# ---------------------------------------------------------------------------------------------
# The buffers of one device and their live ranges
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
