"""FLOPs of an HLO module, counted as XLA's ``HloCostAnalysis`` counts them.

:func:`hlo_flops` counts what ``compiled.cost_analysis()`` reports as ``flops``: a dot is
``2 × elements(result) × Π(lhs contracting dims)``, a convolution ``2 × FMAs over valid window
positions``; elementwise ops (add, multiply, compare, select, convert, ...) one flop per result
element; transcendental ops (exp, log, tanh, sqrt, rsqrt, power, ...) none (XLA counts them
apart as transcendentals); reduce ``(elements(input) − elements(output)) × flops(to_apply)``;
an all-reduce one flop per result element; fusions, calls and async ops the flops of what they
call; a conditional its most expensive branch; a while loop its body plus condition **once**.
Custom calls count 0 (XLA adds −1 for "unknown"). With ``scale_loops=True`` a while loop with
a known trip count ``n`` instead counts ``n × (body + condition)``, nested loops multiplying
through; the difference is the loop correction that
:attr:`~shardplan.xla.report.CompiledReport.flops_loop_corrected` adds to XLA's figure.

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
    >>> from shardplan.xla.hlo import parse_hlo_module
    >>> module = parse_hlo_module('''
    ... HloModule m
    ... ENTRY %main (a: f32[4,4], b: f32[4,4]) -> f32[4,4] {
    ...   %a = f32[4,4]{1,0} parameter(0)
    ...   %b = f32[4,4]{1,0} parameter(1)
    ...   ROOT %d = f32[4,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ... }''')
    >>> hlo_flops(module)   # 2·4·4·4
    128.0
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from shardplan.xla.hlo import Computation, HloModule, Instruction
from shardplan.xla.shapes import ArrayShape, Shape
from shardplan.xla.text import parse_int_list

__all__ = ["hlo_flops"]

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
