"""What XLA compiled: collectives, FLOPs, memory and shardings of a ``jax.stages.Compiled``.

:func:`read_compiled` summarises a compiled program for plan verification, cost-model tests
and reports; :func:`read_hlo_text` does the HLO part alone on a module's text.

**Collectives.** Every all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute,
collective-broadcast and ragged-all-to-all is one :class:`Collective`, also in their async
forms: ``all-reduce-start`` / ``all-gather-start`` / ``collective-permute-start`` count once
(their ``-done`` is skipped), and ``async-start(...), calls=%comp`` wrapping a collective
counts once, as the wrapped collective, in the wrapper's computation (the op inside ``%comp``
is not counted again). ``count`` is the execution multiplier of the computation it runs in
(see :class:`~shardplan.xla.hlo.HloModule`), so a psum in a 5-step ``lax.scan`` counts 5.
``bytes`` is the size of the result *on one device* for one execution:

* synchronous ops and ``all-reduce-start``: all arrays of the result shape (a combined
  ``(f32[256,256], f32[])`` all-reduce is 262,148 bytes);
* ``all-gather-start`` / ``collective-permute-start``, whose result is the tuple
  ``(operands, outputs[, u32[] context...])``: tuple element 1, the outputs, only;
* ``async-start``: the result of the wrapped collective (the root of ``%comp``).

**FLOPs.** :func:`hlo_flops` counts like XLA's ``HloCostAnalysis`` (which
``compiled.cost_analysis()`` runs): a dot is ``2 × elements(result) × Π(lhs contracting
dims)``, a convolution ``2 × FMAs over valid window positions``; elementwise ops (add,
multiply, compare, select, convert, ...) one flop per result element; transcendental ops
(exp, log, tanh, sqrt, rsqrt, power, ...) none (XLA counts them apart as transcendentals);
reduce ``(elements(input) − elements(output)) × flops(to_apply)``; an all-reduce one flop per
result element; fusions, calls and async ops the flops of what they call; a conditional its
most expensive branch; a while loop its body plus condition **once**. Custom calls count 0
(XLA adds −1 for "unknown"). With ``scale_loops=True`` a while loop with a known trip count
``n`` instead counts ``n × (body + condition)``, nested loops multiplying through; the
difference is the loop correction that :attr:`CompiledReport.flops_loop_corrected` adds to
XLA's figure.

Verified on jax 0.10.2, CPU: the count equals ``cost_analysis()["flops"]`` exactly on
loop-free programs (dots, batched dots, convolutions with strides, dilations, feature groups
and their gradients, reductions, argmax, sort, cumsum, scatter, gather, FFT, pooling and its
gradient, a dp×tp MLP train step), on while loops (counted once) and on nested scans. It
differs only by XLA's −1 per custom call (LAPACK cholesky / triangular solve on CPU) and by
XLA summing in float32 (counts above 2**24 round). For a ``lax.scan`` of a
``f32[16,128] @ f32[128,128]`` matmul and a psum, XLA reports 526,336 / 526,338 / 526,338
flops for 1 / 5 / 10 steps and the corrected figure is 526,336 / 2,631,690 / 5,263,380
(one matmul is 524,288).

Example:
    >>> import jax, jax.numpy as jnp
    >>> compiled = jax.jit(lambda a: a @ a).lower(jnp.ones((4, 4))).compile()
    >>> report = read_compiled(compiled)
    >>> report.flops, report.flops_loop_corrected   # 2·4·4·4
    (128.0, 128.0)
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from shardplan.xla.hlo import (
    ArrayShape,
    Computation,
    HloModule,
    Instruction,
    Loop,
    Shape,
    TupleShape,
    parse_hlo,
    parse_int_list,
    parse_replica_groups,
    parse_source_target_pairs,
)

if TYPE_CHECKING:
    import jax

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "Collectives",
    "CompiledReport",
    "HloReport",
    "MemoryReport",
    "find_collectives",
    "hlo_flops",
    "read_compiled",
    "read_hlo_text",
]

COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
)
"""The collective opcodes, without their ``-start`` / ``-done`` suffixes."""

# Async ops whose result is ``(operands, outputs, context...)``: the outputs are element 1.
_OUTPUT_IN_ELEMENT_1 = frozenset({"all-gather-start", "collective-permute-start"})


# --------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    Attributes:
      kind: the collective, one of :data:`COLLECTIVE_KINDS` (``all-reduce`` also for
        ``all-reduce-start`` and for an ``async-start`` wrapping an all-reduce).
      opcode: the opcode as printed: ``all-reduce``, ``all-gather-start``, ``async-start``...
      name: the instruction's name (the ``async-start``'s for a wrapped collective).
      computation: the computation it runs in.
      module: the module's name.
      count: executions per program execution (its computation's multiplier; one in a
        conditional branch counts as if the branch always ran).
      bytes: result bytes on one device for one execution (see the module docstring).
      shapes: the result arrays counted in ``bytes``.
      replica_groups: the device groups, expanded to explicit ids (logical ids: positions in
        the executable's device assignment); ``()`` for collective-permute.
      source_target_pairs: ``(source, target)`` device pairs of a collective-permute.
      channel_id: ``channel_id=``, or None.
      use_global_device_ids: ``use_global_device_ids=true``.
      op_name: ``metadata={op_name=...}``, the JAX name stack, for attribution to layers.
      source: ``file:line`` from the metadata, when present.
      trip_count_known: False when an enclosing loop's trip count is unknown (then ``count``
        counts that loop once).
    """

    kind: str
    opcode: str
    name: str
    computation: str
    module: str
    count: int
    bytes: int
    shapes: tuple[ArrayShape, ...]
    replica_groups: tuple[tuple[int, ...], ...] = ()
    source_target_pairs: tuple[tuple[int, int], ...] = ()
    channel_id: int | None = None
    use_global_device_ids: bool = False
    op_name: str | None = None
    source: str | None = None
    trip_count_known: bool = True

    @property
    def total_bytes(self) -> int:
        """``bytes × count``: bytes on one device over one program execution."""
        return self.bytes * self.count

    @property
    def is_scalar(self) -> bool:
        """Whether every result array is a scalar (e.g. a loss-mean all-reduce of ``f32[]``)."""
        return bool(self.shapes) and all(s.rank == 0 for s in self.shapes)

    @property
    def dtype(self) -> str | None:
        """The element type of the result, or None when the arrays' types differ."""
        dtypes = {s.dtype for s in self.shapes}
        return dtypes.pop() if len(dtypes) == 1 else None

    @property
    def shape(self) -> ArrayShape | None:
        """The result array when there is exactly one, else None (see ``shapes``)."""
        return self.shapes[0] if len(self.shapes) == 1 else None

    @property
    def group_size(self) -> int:
        """Devices per replica group (2 for a collective-permute, 0 if unknown)."""
        if self.replica_groups:
            return len(self.replica_groups[0])
        return 2 if self.source_target_pairs else 0


class Collectives(tuple[Collective, ...]):
    """A tuple of :class:`Collective` with filters and a per-kind summary."""

    __slots__ = ()

    def non_scalar(self) -> Collectives:
        """The collectives with at least one non-scalar result array."""
        return Collectives(c for c in self if not c.is_scalar)

    def scalar(self) -> Collectives:
        """The collectives whose results are all scalars."""
        return Collectives(c for c in self if c.is_scalar)

    def of_kind(self, kind: str) -> Collectives:
        """The collectives of one kind (``all-reduce``, ...)."""
        return Collectives(c for c in self if c.kind == kind)

    def summary(self) -> dict[str, dict[str, int]]:
        """``{kind: {"count": Σ count, "bytes": Σ bytes × count}}`` over kinds present."""
        out: dict[str, dict[str, int]] = {}
        for c in self:
            entry = out.setdefault(c.kind, {"count": 0, "bytes": 0})
            entry["count"] += c.count
            entry["bytes"] += c.total_bytes
        return out


def _collective_kind(opcode: str) -> str | None:
    """The collective kind of an opcode (``all-gather-start`` → ``all-gather``), or None."""
    if opcode.endswith(("-done", "-update")):
        return None
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVE_KINDS else None


def _result_arrays(instr: Instruction) -> tuple[ArrayShape, ...]:
    """The result arrays a collective moves to this device (see the module docstring)."""
    shape: Shape = instr.shape
    is_pair = isinstance(shape, TupleShape) and len(shape.elements) >= 2
    if instr.opcode in _OUTPUT_IN_ELEMENT_1 and isinstance(shape, TupleShape) and is_pair:
        shape = shape.elements[1]
    return shape.leaves()


def _group_participants(module: HloModule, instr: Instruction) -> int:
    """How many devices ``replica_groups={}`` means for ``instr`` (XLA's group modes)."""
    if instr.attr("use_global_device_ids") == "true":
        return module.replica_count * module.num_partitions
    if instr.attr("channel_id") is not None and module.num_partitions > 1:
        return module.num_partitions
    return module.replica_count


def _make_collective(
    module: HloModule, op: Instruction, wrapper: Instruction, kind: str
) -> Collective:
    """Builds the record of collective ``op``, executed by ``wrapper`` (``op`` itself unless
    it is wrapped by an ``async-start``)."""
    arrays = _result_arrays(op)
    channel = op.attr("channel_id")
    return Collective(
        kind=kind,
        opcode=wrapper.opcode,
        name=wrapper.name,
        computation=wrapper.computation,
        module=module.name,
        count=module.multiplier(wrapper.computation),
        bytes=sum(a.byte_size for a in arrays),
        shapes=arrays,
        replica_groups=parse_replica_groups(
            op.attr("replica_groups"), num_devices=_group_participants(module, op)
        )
        if op.attr("replica_groups") is not None
        else (),
        source_target_pairs=parse_source_target_pairs(op.attr("source_target_pairs")),
        channel_id=int(channel) if channel and channel.isdigit() else None,
        use_global_device_ids=op.attr("use_global_device_ids") == "true",
        op_name=op.op_name or wrapper.op_name,
        source=op.source or wrapper.source,
        trip_count_known=module.trip_count_known.get(wrapper.computation, True),
    )


def find_collectives(module: HloModule) -> Collectives:
    """All collectives a module executes, in text order (see the module docstring).

    Args:
      module: a parsed module.

    Returns:
      One record per collective instruction in a computation the entry reaches.
    """
    async_calls: dict[tuple[str, str], list[str]] = {}
    for site in module.call_sites:
        if site.opcode == "async-start":
            async_calls.setdefault((site.caller, site.instruction), []).append(site.callee)
    wrapped = {callee for callees in async_calls.values() for callee in callees}
    records: list[Collective] = []
    for computation in module.computations.values():
        if computation.name in wrapped or module.multiplier(computation.name) == 0:
            continue
        for instr in computation.instructions:
            kind = _collective_kind(instr.opcode)
            if kind is not None:
                records.append(_make_collective(module, instr, instr, kind))
            for callee in async_calls.get((computation.name, instr.name), ()):
                records.extend(_wrapped_collectives(module, instr, callee))
    return Collectives(records)


def _wrapped_collectives(module: HloModule, wrapper: Instruction, callee: str) -> list[Collective]:
    """The collectives inside ``callee``, the computation an ``async-start`` runs."""
    records: list[Collective] = []
    for op in module.computations[callee].instructions:
        kind = _collective_kind(op.opcode)
        if kind is not None:
            records.append(_make_collective(module, op, wrapper, kind))
    return records


# --------------------------------------------------------------------------------------------
# FLOPs, as XLA's HloCostAnalysis counts them
# --------------------------------------------------------------------------------------------

_FMA_FLOPS = 2
"""FLOPs per fused multiply-add (``kFmaFlops`` in ``hlo_cost_analysis.h``)."""

_ELEMENTWISE_OPCODES = frozenset(
    {
        "abs",
        "add",
        "and",
        "bitcast-convert",
        "ceil",
        "clamp",
        "compare",
        "complex",
        "convert",
        "count-leading-zeros",
        "divide",
        "floor",
        "imag",
        "is-finite",
        "maximum",
        "minimum",
        "multiply",
        "negate",
        "not",
        "or",
        "popcnt",
        "real",
        "reduce-precision",
        "remainder",
        "round-nearest-afz",
        "round-nearest-even",
        "select",
        "shift-left",
        "shift-right-arithmetic",
        "shift-right-logical",
        "sign",
        "stochastic-convert",
        "subtract",
        "xor",
    }
)
"""Ops costing one flop per result element. The transcendental ones (``exponential``,
``log``, ``tanh``, ``sqrt``, ``rsqrt``, ``power``, ``sine``, ``logistic``, ...) cost none: XLA
counts them as ``transcendentals``."""


@dataclass(frozen=True)
class _WindowDim:
    """One dimension of a ``window={...}`` attribute."""

    size: int = 1
    stride: int = 1
    pad_low: int = 0
    pad_high: int = 0
    base_dilation: int = 1
    window_dilation: int = 1


def _parse_window(text: str | None) -> list[_WindowDim]:
    """Parses ``{size=3x3 stride=2x2 pad=1_1x1_1 lhs_dilate=1x1 rhs_dilate=1x1}``."""
    fields = dict(re.findall(r"(\w+)=([-\d_x]+)", text or ""))
    sizes = [int(x) for x in fields.get("size", "").split("x") if x]

    def per_dim(key: str) -> list[int]:
        values = [int(x) for x in fields.get(key, "").split("x") if x]
        return values or [1] * len(sizes)

    pads = [p.split("_") for p in fields.get("pad", "").split("x") if p]
    pads = pads or [["0", "0"]] * len(sizes)
    strides, lhs, rhs = per_dim("stride"), per_dim("lhs_dilate"), per_dim("rhs_dilate")
    return [
        _WindowDim(sizes[i], strides[i], int(pads[i][0]), int(pads[i][1]), lhs[i], rhs[i])
        for i in range(len(sizes))
    ]


def _elements(shape: Shape | None) -> int:
    return shape.num_elements if shape is not None else 0


def _first_array(shape: Shape | None) -> ArrayShape | None:
    leaves = shape.leaves() if shape is not None else ()
    return leaves[0] if leaves else None


class _FlopCounter:
    """Counts a module's flops computation by computation, memoised."""

    def __init__(self, module: HloModule, *, scale_loops: bool) -> None:
        self.module = module
        self.scale_loops = scale_loops
        self.memo: dict[str, float] = {}
        self.active: set[str] = set()

    def computation(self, name: str) -> float:
        """Flops of one execution of computation ``name`` (0 if unknown or recursive)."""
        if name in self.memo:
            return self.memo[name]
        computation = self.module.computations.get(name)
        if computation is None or name in self.active:
            return 0.0
        self.active.add(name)
        total = sum(self.instruction(computation, i) for i in computation.instructions)
        self.active.discard(name)
        self.memo[name] = total
        return total

    def callee(self, instr: Instruction, key: str) -> float:
        """Flops of the computation that attribute ``key`` of ``instr`` names."""
        value = instr.attr(key)
        return self.computation(value.strip().removeprefix("%")) if value else 0.0

    def instruction(self, comp: Computation, instr: Instruction) -> float:
        """Flops of one execution of ``instr`` (including what it calls)."""
        if instr.opcode in _ELEMENTWISE_OPCODES:
            return float(instr.shape.num_elements)
        handler = _HANDLERS.get(instr.opcode)
        if handler is None:
            return 0.0
        try:
            return float(handler(self, comp, instr))
        except (ValueError, IndexError, KeyError):  # malformed attributes: count nothing
            return 0.0


def _dot_flops(_: _FlopCounter, comp: Computation, instr: Instruction) -> float:
    lhs = _first_array(comp.operand_shapes(instr)[0] if instr.operands else None)
    if lhs is None:
        return 0.0
    contracting = parse_int_list(instr.attr("lhs_contracting_dims"))
    width = math.prod(lhs.dims[d] for d in contracting if d < lhs.rank)
    return _FMA_FLOPS * instr.shape.num_elements * width


def _ragged_dot_flops(counter: _FlopCounter, comp: Computation, instr: Instruction) -> float:
    # XLA deletes result dimension i for the i-th rhs group dimension (sic) before counting.
    result = _first_array(instr.shape)
    if result is None:
        return 0.0
    dims = list(result.dims)
    for i in range(len(parse_int_list(instr.attr("rhs_group_dims")))):
        if i < len(dims):
            dims.pop(i)
    reduced = Instruction(
        instr.name,
        "dot",
        ArrayShape(result.dtype, tuple(dims)),
        instr.operands,
        instr.attributes,
        instr.computation,
    )
    return _dot_flops(counter, comp, reduced)


def _conv_flops(_: _FlopCounter, comp: Computation, instr: Instruction) -> float:
    """``HloCostAnalysis::GetConvolutionFlops``: FMAs over the valid window positions."""
    shapes = comp.operand_shapes(instr)
    lhs = _first_array(shapes[0]) if shapes else None
    rhs = _first_array(shapes[1]) if len(shapes) > 1 else None
    out = _first_array(instr.shape)
    labels = re.match(r"(\w+)_(\w+)->(\w+)", instr.attr("dim_labels") or "")
    if lhs is None or rhs is None or out is None or labels is None:
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    window = _parse_window(instr.attr("window"))
    limits = (
        [(1, 1, 1)]
        if not window
        else [
            (
                lhs.dims[lhs_l.index(str(k))],
                rhs.dims[rhs_l.index(str(k))],
                out.dims[out_l.index(str(k))],
            )
            for k in range(len(window))
        ]
    )
    window = window or [_WindowDim()]
    positions = math.prod(_valid_positions(w, *lim) for w, lim in zip(window, limits, strict=True))
    feature_groups = int(instr.attr("feature_group_count") or 1)
    batch_groups = int(instr.attr("batch_group_count") or 1)
    fmas = (lhs.dims[lhs_l.index("f")] // feature_groups) * out.dims[out_l.index("f")]
    fmas *= (lhs.dims[lhs_l.index("b")] // batch_groups) * positions
    return _FMA_FLOPS * fmas


def _valid_positions(w: _WindowDim, input_size: int, kernel: int, output: int) -> int:
    """Kernel × output positions of one spatial dimension that read a real input element."""
    if (
        input_size == output == kernel
        and input_size == w.base_dilation
        and w.window_dilation == 1
        and max(1, input_size - 1) == w.stride
        and w.pad_low == 0
        and w.pad_high == 0
    ):
        return input_size
    if (
        input_size == 1
        and kernel == output
        and w.window_dilation == 1
        and w.base_dilation == 1
        and w.stride == 1
        and w.pad_high == output - 1
        and w.pad_low == output - 1
    ):
        return output
    count = 0
    for k in range(kernel):
        if w.stride == 1 and w.base_dilation == 1:
            base = w.pad_low - k * w.window_dilation
            count += max(min(input_size + base, output) - max(base, 0), 0)
            continue
        for o in range(output):
            undilated = o * w.stride - w.pad_low + k * w.window_dilation
            index = undilated // w.base_dilation if w.base_dilation > 1 else undilated
            if undilated == index * w.base_dilation and 0 <= index < input_size:
                count += 1
    return count


def _reduce_flops(counter: _FlopCounter, comp: Computation, instr: Instruction) -> float:
    operand = _first_array(comp.operand_shapes(instr)[0] if instr.operands else None)
    out = _first_array(instr.shape)
    if operand is None or out is None:
        return 0.0
    return (operand.num_elements - out.num_elements) * counter.callee(instr, "to_apply")


def _reduce_window_flops(counter: _FlopCounter, _: Computation, instr: Instruction) -> float:
    window = _parse_window(instr.attr("window"))
    out = _first_array(instr.shape)
    if out is None:
        return 0.0
    window_elements = math.prod(w.size for w in window)
    count = (window_elements - 1) * out.num_elements
    # XLA's special case: a reduce-window that is a reduce then a broadcast along one dim.
    reduced = [i for i, w in enumerate(window) if w.size != 1]
    padded = [w for w in window if w.pad_low != 0 or w.pad_high != 0]
    if len(reduced) == 1 and len(padded) == 1 and isinstance(instr.shape, ArrayShape):
        w, size = window[reduced[0]], out.dims[reduced[0]]
        if (
            w.pad_low != 0
            and w.pad_low == w.pad_high
            and w.size == 2 * w.pad_low + 1
            and w.pad_low == size - 1
        ):
            count = out.num_elements // size + size - 1
    return count * counter.callee(instr, "to_apply")


def _select_and_scatter_flops(
    counter: _FlopCounter, comp: Computation, instr: Instruction
) -> float:
    shapes = comp.operand_shapes(instr)
    source = _elements(shapes[1]) if len(shapes) > 1 else 0
    window_elements = math.prod(w.size for w in _parse_window(instr.attr("window")))
    return source * (window_elements - 1) * counter.callee(
        instr, "select"
    ) + source * counter.callee(instr, "scatter")


def _scatter_flops(counter: _FlopCounter, comp: Computation, instr: Instruction) -> float:
    shapes = comp.operand_shapes(instr)
    num_inputs = (len(shapes) - 1) // 2
    updates = _elements(shapes[num_inputs + 1]) if len(shapes) > num_inputs + 1 else 0
    return updates * counter.callee(instr, "to_apply")


def _sort_flops(_: _FlopCounter, comp: Computation, instr: Instruction) -> float:
    n = _elements(_first_array(comp.operand_shapes(instr)[0])) if instr.operands else 0
    return float(n * (n - 1).bit_length()) if n > 0 else 0.0


def _fft_flops(_: _FlopCounter, comp: Computation, instr: Instruction) -> float:
    n = _elements(_first_array(comp.operand_shapes(instr)[0])) if instr.operands else 0
    lengths = parse_int_list(instr.attr("fft_length"))
    log_factors = math.prod(max(d.bit_length() - 1, 0) for d in lengths)  # Log2Floor
    return float(_FMA_FLOPS * 4 * log_factors * n)


def _triangular_solve_flops(_: _FlopCounter, comp: Computation, instr: Instruction) -> float:
    shapes = comp.operand_shapes(instr)
    a = _first_array(shapes[0]) if shapes else None
    b = shapes[1] if len(shapes) > 1 else None
    return float(_FMA_FLOPS * a.dims[-1] * _elements(b)) if a and a.rank else 0.0


def _cholesky_flops(_: _FlopCounter, comp: Computation, instr: Instruction) -> float:
    a = _first_array(comp.operand_shapes(instr)[0]) if instr.operands else None
    return float(a.dims[-1] * a.num_elements // 3) if a and a.rank else 0.0


def _fusion_flops(counter: _FlopCounter, _: Computation, instr: Instruction) -> float:
    fused = counter.module.computations.get((instr.attr("calls") or "").removeprefix("%"))
    if fused is None:
        return 0.0
    if instr.attr("kind") == "kCustom":
        # XLA costs a custom fusion holding a gather or scatter as that op alone.
        for inner in fused.instructions:
            if inner.opcode == "gather":
                return 0.0
            if inner.opcode == "scatter":
                return _scatter_flops(counter, fused, inner)
    return counter.computation(fused.name)


def _while_flops(counter: _FlopCounter, _: Computation, instr: Instruction) -> float:
    once = counter.callee(instr, "body") + counter.callee(instr, "condition")
    trips = instr.trip_count
    return once * trips if counter.scale_loops and trips is not None else once


def _conditional_flops(counter: _FlopCounter, _: Computation, instr: Instruction) -> float:
    names = re.findall(r"[\w.\-]+", instr.attr("branch_computations") or "")
    names += [
        (instr.attr(k) or "").removeprefix("%")
        for k in ("true_computation", "false_computation")
        if instr.attr(k)
    ]
    return max((counter.computation(n) for n in names), default=0.0)


def _all_reduce_flops(_: _FlopCounter, __: Computation, instr: Instruction) -> float:
    return float(instr.shape.num_elements)  # XLA assumes two participants: 1 add / element


_Handler = Callable[[_FlopCounter, Computation, Instruction], float]
_HANDLERS: Mapping[str, _Handler] = MappingProxyType(
    {
        "dot": _dot_flops,
        "scaled-dot": _dot_flops,
        "ragged-dot": _ragged_dot_flops,
        "convolution": _conv_flops,
        "reduce": _reduce_flops,
        "reduce-window": _reduce_window_flops,
        "select-and-scatter": _select_and_scatter_flops,
        "scatter": _scatter_flops,
        "map": lambda c, _, i: i.shape.num_elements * c.callee(i, "to_apply"),
        "sort": _sort_flops,
        "fft": _fft_flops,
        "triangular-solve": _triangular_solve_flops,
        "cholesky": _cholesky_flops,
        "all-reduce": _all_reduce_flops,
        "all-reduce-start": _all_reduce_flops,
        "fusion": _fusion_flops,
        "call": lambda c, _, i: c.callee(i, "to_apply"),
        "async-start": lambda c, _, i: c.callee(i, "calls"),
        "while": _while_flops,
        "conditional": _conditional_flops,
    }
)


def hlo_flops(module: HloModule, *, scale_loops: bool = False) -> float:
    """Flops of one execution of a module's entry computation, per device.

    Args:
      module: a parsed module.
      scale_loops: multiply while loops with a known trip count by it (nested loops multiply
        through); False counts each loop once, as ``compiled.cost_analysis()`` does.

    Returns:
      The flop count, by the convention in the module docstring.
    """
    counter = _FlopCounter(module, scale_loops=scale_loops)
    if module.entry is not None:
        return counter.computation(module.entry)
    called = {s.callee for s in module.call_sites}
    return sum(counter.computation(c) for c in module.computations if c not in called)


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HloReport:
    """What the HLO text of a program says: collectives, loops and flops.

    Attributes:
      modules: the parsed modules.
      collectives: every collective, in module and text order.
      loops: every while loop reachable from an entry computation.
      flops: flops counted with loops once (XLA's ``cost_analysis()`` convention).
      flops_loop_corrected: flops with loops multiplied by their known trip counts.
    """

    modules: tuple[HloModule, ...] = field(repr=False)
    collectives: Collectives
    loops: tuple[Loop, ...]
    flops: float
    flops_loop_corrected: float

    @property
    def loop_flops_correction(self) -> float:
        """``Σ (n − 1) × flops(body + condition)`` over loops with known trip count ``n``."""
        return self.flops_loop_corrected - self.flops

    def collective_summary(self, *, include_scalar: bool = True) -> dict[str, dict[str, int]]:
        """``{kind: {"count", "bytes"}}``; see :meth:`Collectives.summary`."""
        chosen = self.collectives if include_scalar else self.collectives.non_scalar()
        return chosen.summary()


def read_hlo_text(text: str | Sequence[str]) -> HloReport:
    """Parses HLO module text and summarises its collectives, loops and flops.

    Args:
      text: ``compiled.as_text()``, several modules' text, or a sequence of module texts.

    Returns:
      The report over all modules.

    Example:
        >>> report = read_hlo_text('''
        ... HloModule m, num_partitions=2
        ... %add (a: f32[], b: f32[]) -> f32[] {
        ...   %a = f32[] parameter(0)
        ...   %b = f32[] parameter(1)
        ...   ROOT %s = f32[] add(%a, %b)
        ... }
        ... ENTRY %main (p: f32[8]) -> f32[8] {
        ...   %p = f32[8]{0} parameter(0)
        ...   ROOT %r = f32[8]{0} all-reduce(%p), replica_groups=[1,2]<=[2], to_apply=%add
        ... }''')
        >>> report.collective_summary()
        {'all-reduce': {'count': 1, 'bytes': 32}}
        >>> report.collectives[0].replica_groups
        ((0, 1),)
    """
    modules = parse_hlo(text)
    return HloReport(
        modules=modules,
        collectives=Collectives(c for m in modules for c in find_collectives(m)),
        loops=tuple(loop for m in modules for loop in m.loops),
        flops=sum(hlo_flops(m) for m in modules),
        flops_loop_corrected=sum(hlo_flops(m, scale_loops=True) for m in modules),
    )


@dataclass(frozen=True)
class MemoryReport:
    """``compiled.memory_analysis()`` per device, in bytes.

    Attributes:
      argument_bytes: parameters.
      output_bytes: results.
      temp_bytes: temporaries (XLA's buffer assignment).
      alias_bytes: outputs that alias (donated) arguments.
      generated_code_bytes: the executable's code.
      peak_bytes: XLA's ``peak_memory_in_bytes`` (its heap simulation) when it reports a
        positive value; otherwise ``argument + output + temp − alias``.
      peak_from_xla: whether ``peak_bytes`` is XLA's own figure.
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    peak_bytes: int
    peak_from_xla: bool

    @classmethod
    def from_stats(cls, stats: Any) -> MemoryReport:
        """Builds the report from a ``CompiledMemoryStats`` (or any object with its fields)."""

        def get(name: str) -> int:
            value = getattr(stats, name, 0)
            return int(value) if value is not None else 0

        argument, output = get("argument_size_in_bytes"), get("output_size_in_bytes")
        temp, alias = get("temp_size_in_bytes"), get("alias_size_in_bytes")
        peak = get("peak_memory_in_bytes")
        return cls(
            argument_bytes=argument,
            output_bytes=output,
            temp_bytes=temp,
            alias_bytes=alias,
            generated_code_bytes=get("generated_code_size_in_bytes"),
            peak_bytes=peak if peak > 0 else argument + output + temp - alias,
            peak_from_xla=peak > 0,
        )


@dataclass(frozen=True)
class CompiledReport:
    """What XLA made of a jitted program, per device.

    Attributes:
      flops: ``cost_analysis()["flops"]``, which counts each while loop once (the HLO count
        when XLA gives no cost analysis).
      flops_loop_corrected: ``flops`` plus ``Σ (n − 1) × flops(loop body + condition)`` over
        loops with known trip count ``n`` (nested loops multiply through).
      transcendentals: ``cost_analysis()["transcendentals"]`` (loops once).
      bytes_accessed: ``cost_analysis()["bytes accessed"]`` (loops once).
      memory: ``memory_analysis()``, or None when the backend gives none.
      collectives: every collective (see :class:`Collective`).
      loops: every while loop with its trip count.
      input_shardings: ``compiled.input_shardings`` (``(args, kwargs)`` of shardings).
      output_shardings: ``compiled.output_shardings``.
      hlo: the HLO-level report the fields above come from.
      cost_analysis: the raw ``cost_analysis()`` dict.
    """

    flops: float
    flops_loop_corrected: float
    transcendentals: float
    bytes_accessed: float
    memory: MemoryReport | None
    collectives: Collectives
    loops: tuple[Loop, ...]
    input_shardings: Any = field(repr=False)
    output_shardings: Any = field(repr=False)
    hlo: HloReport = field(repr=False)
    cost_analysis: Mapping[str, float] = field(repr=False, compare=False, hash=False)

    def collective_summary(self, *, include_scalar: bool = True) -> dict[str, dict[str, int]]:
        """``{kind: {"count": int, "bytes": int}}``, bytes per device over one execution.

        Args:
          include_scalar: keep collectives of scalars (e.g. the loss-mean all-reduce).
        """
        return self.hlo.collective_summary(include_scalar=include_scalar)


def _cost_dict(compiled: jax.stages.Compiled) -> dict[str, float]:
    """``compiled.cost_analysis()`` as one dict (older jax returned a list of dicts)."""
    cost: Any = compiled.cost_analysis()
    if isinstance(cost, Mapping):
        return {str(k): float(v) for k, v in cost.items()}
    if isinstance(cost, Iterable):
        merged: dict[str, float] = {}
        for part in cost:
            for k, v in dict(part).items():
                merged[str(k)] = merged.get(str(k), 0.0) + float(v)
        return merged
    return {}


def read_compiled(compiled: jax.stages.Compiled, /) -> CompiledReport:
    """Summarises a compiled program: flops, memory, collectives, loops and shardings.

    Args:
      compiled: ``jax.jit(f).lower(*args).compile()``.

    Returns:
      The report; every figure is per device.
    """
    hlo = read_hlo_text(compiled.as_text() or "")
    cost = _cost_dict(compiled)
    flops = cost.get("flops", 0.0) if cost else hlo.flops
    stats = compiled.memory_analysis()
    return CompiledReport(
        flops=flops,
        flops_loop_corrected=flops + hlo.loop_flops_correction,
        transcendentals=cost.get("transcendentals", 0.0),
        bytes_accessed=cost.get("bytes accessed", 0.0),
        memory=MemoryReport.from_stats(stats) if stats is not None else None,
        collectives=hlo.collectives,
        loops=hlo.loops,
        input_shardings=compiled.input_shardings,
        output_shardings=compiled.output_shardings,
        hlo=hlo,
        cost_analysis=MappingProxyType(cost),
    )
