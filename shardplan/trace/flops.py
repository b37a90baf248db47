"""FLOP, transcendental and byte counts per jaxpr equation.

The conventions mirror XLA's ``HloCostAnalysis`` on the lowered (pre-optimisation) module, so that
the traced totals can be checked against ``jax.jit(f).lower(...).cost_analysis()``. Measured on
jax 0.10.2 (each rule below was checked on a one-equation function with array arguments):

* ``dot_general``: ``2 · |output| · |contracting dims|``.
* ``conv_general_dilated``: ``2 · |output| · |kernel window| · in_features / feature_groups``.
* arithmetic, comparison, logical, ``select_n``, ``convert_element_type``, ``floor`` ...:
  one FLOP per output element.
* transcendental functions (``exp``, ``log``, ``tanh``, ``sqrt``, ``rsqrt``, ``pow``, ``erf``,
  ``sin`` ...): zero FLOPs, one transcendental per output element. ``logistic`` lowers to
  ``1 / (1 + exp(-x))``: three FLOPs and one transcendental. ``exp2`` lowers to ``exp(x·ln 2)``.
* ``integer_pow`` by repeated squaring: ``floor(log2 n) + popcount(n) − 1`` multiplies (and one
  divide for negative exponents).
* reductions (``reduce_sum``, ``reduce_max`` ...): ``|input| − |output|``; ``argmax``/``argmin``
  reduce (value, index) pairs with a 9-operation comparator.
* cumulative ops (``cumsum`` ...): ``|output| · (axis length − 1)`` (XLA lowers them to a
  ``reduce-window`` over the whole prefix).
* ``scatter-add`` / ``scatter-mul``: one FLOP per update element.
* ``random_bits`` (threefry, partitionable as jax 0.10 defaults): ``(27 + 2 · rank)`` FLOPs per
  element, one more for bit widths below 32, plus 10 (exact on ranks 1 to 4, 8 to 32 bits).
* data movement (broadcast, reshape, transpose, slice, gather, concatenate, pad, iota, copy ...):
  zero.

Bytes are counted as every non-literal operand read once and every result written once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shardplan.kernels.registry import PRIMITIVE as KERNEL
from shardplan.kernels.registry import rule_for
from shardplan.trace.dtypes import itemsize

__all__ = [
    "ELEMENTWISE",
    "KNOWN_PRIMITIVES",
    "TRANSCENDENTAL",
    "ZERO_FLOP",
    "EquationCost",
    "equation_cost",
    "equation_flops",
    "is_known_primitive",
]

TRANSCENDENTAL = frozenset({
    "exp", "log", "tanh", "sqrt", "rsqrt", "cbrt", "pow", "erf", "erfc", "log1p", "expm1",
    "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh",
    "atanh", "lgamma", "digamma", "igamma", "igammac", "bessel_i0e", "bessel_i1e",
})
"""Primitives XLA counts as transcendentals, not FLOPs."""

ZERO_FLOP = frozenset({
    "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "slice",
    "dynamic_slice", "dynamic_update_slice", "gather", "concatenate", "pad", "iota", "copy",
    "copy_p", "rev", "sharding_constraint", "device_put", "convert_element_type_noop",
    "stop_gradient", "top_k", "scatter", "split", "bitcast_convert_type", "random_wrap",
    "random_unwrap", "random_seed", "random_fold_in", "random_split", "optimization_barrier",
    "pvary", "pcast", "reshard", "mesh_cast", "axis_index", "create_token", "debug_callback",
    "name", "with_sharding_constraint", "empty", "zeros_like", "broadcast",
})
"""Primitives that only move or re-index data."""

ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "neg", "max", "min", "abs", "sign", "floor",
    "ceil", "round", "clamp", "select_n", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    "xor", "shift_left", "shift_right_logical", "shift_right_arithmetic", "square",
    "convert_element_type", "reduce_precision", "imag", "real", "conj", "complex",
    "population_count", "clz", "is_finite", "integer_pow", "exp2", "logistic", "nextafter",
    "copysign", "square_p",
})
"""Primitives XLA charges one FLOP per output element (or a fixed multiple)."""

_REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "reduce_precision_sum",
})
_ARG_REDUCTIONS = frozenset({"argmax", "argmin"})
_ARG_REDUCE_COMPARATOR_OPS = 9  # XLA's (value, index) comparator: compares, selects, ands.
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
_SCATTER_COMBINE = frozenset({"scatter-add", "scatter_add", "scatter-mul", "scatter_mul",
                              "scatter-min", "scatter_min", "scatter-max", "scatter_max"})
_RANDOM_BITS_PER_ELEMENT = 27
_RANDOM_BITS_PER_DIM = 2
_RANDOM_BITS_KEY = 10
_COMPOSITE = {
    # primitive: (flops per element, transcendentals per element), from the lowered HLO.
    "logistic": (3, 1),
    "exp2": (1, 1),
    "erf_inv": (38, 2),
    "is_finite": (1, 0),
    "nextafter": (10, 0),
}


class EquationCost:
    """Per-execution cost of one equation."""

    __slots__ = ("bytes_read", "bytes_written", "flops", "transcendentals")

    def __init__(self, flops: float, transcendentals: float, bytes_read: int,
                 bytes_written: int) -> None:
        self.flops = flops
        self.transcendentals = transcendentals
        self.bytes_read = bytes_read
        self.bytes_written = bytes_written


def _size(shape: Sequence[int]) -> int:
    return int(math.prod(shape))


def nbytes(aval: Any) -> int:
    """Bytes of an abstract value (0 for one without a shape and dtype, a token)."""
    return _nbytes(aval)


def _nbytes(aval: Any) -> int:
    try:
        shape, dtype = aval.shape, aval.dtype
    except AttributeError:  # not an array (a token)
        return 0
    if shape is None or dtype is None:
        return 0
    # A numpy dtype is its own np.dtype(); other dtypes go the slow way, cached (hashing a
    # dtype costs about as much as np.dtype, and a large train step has 10^5 operands).
    size = dtype.itemsize if isinstance(dtype, np.dtype) else itemsize(dtype)
    return int(math.prod(shape)) * size


def _dot_flops(in_avals: Sequence[Any], out_avals: Sequence[Any],
               params: Mapping[str, Any]) -> float:
    (lhs_contract, _rhs_contract), _batch = params["dimension_numbers"]
    lhs_shape = in_avals[0].shape
    contracted = _size([lhs_shape[d] for d in lhs_contract])
    return 2.0 * _size(out_avals[0].shape) * contracted


def _conv_flops(in_avals: Sequence[Any], out_avals: Sequence[Any],
                params: Mapping[str, Any]) -> float:
    dn = params["dimension_numbers"]
    rhs_shape = in_avals[1].shape
    rhs_spec = dn.rhs_spec  # (out_feature_dim, in_feature_dim, *spatial)
    window = _size([rhs_shape[d] for d in rhs_spec[2:]])
    in_features = rhs_shape[rhs_spec[1]]
    return 2.0 * _size(out_avals[0].shape) * window * in_features


def _integer_pow_flops(y: int) -> int:
    n = abs(int(y))
    muls = 0 if n <= 1 else n.bit_length() - 1 + bin(n).count("1") - 1
    return muls + (1 if y < 0 else 0)


def equation_cost(primitive: str, in_avals: Sequence[Any], out_avals: Sequence[Any],
                  params: Mapping[str, Any]) -> EquationCost:
    """Returns the FLOPs, transcendentals and bytes of one execution of an equation.

    Args:
      primitive: the primitive's name (``eqn.primitive.name``).
      in_avals: abstract values of the non-literal operands (literals are free).
      out_avals: abstract values of the results.
      params: the equation's parameters.

    Returns:
      An :class:`EquationCost`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> a = jax.ShapeDtypeStruct((8, 16), jnp.float32)
      >>> equation_cost("add", [a, a], [a], {}).flops
      128
    """
    bytes_read = 0
    for a in in_avals:
        bytes_read += _nbytes(a)
    bytes_written = 0
    for a in out_avals:
        bytes_written += _nbytes(a)
    flops, trans = equation_flops(primitive, in_avals, out_avals, params)
    return EquationCost(flops, trans, bytes_read, bytes_written)


def equation_flops(primitive: str, in_avals: Sequence[Any], out_avals: Sequence[Any],
                   params: Mapping[str, Any]) -> tuple[float, float]:
    """The FLOPs and transcendentals of :func:`equation_cost`, without the bytes (which a
    caller that sees each value many times can cache by value)."""
    out_elems = _size(out_avals[0].shape) if out_avals and hasattr(out_avals[0], "shape") else 0
    flops: float = 0
    trans: float = 0
    # The two commonest cases first; no rule below applies to them (see _ONE_PER_ELEMENT).
    if primitive in _ONE_PER_ELEMENT:
        return out_elems, trans
    if primitive in _FREE:
        return flops, trans
    if primitive == KERNEL:
        rule = rule_for(str(params.get("name", "")))
        flops = rule.flops([tuple(a.shape) for a in in_avals], params.get("static", {})) \
            if rule is not None else 0.0
    elif primitive == "dot_general":
        flops = _dot_flops(in_avals, out_avals, params)
    elif primitive == "conv_general_dilated":
        flops = _conv_flops(in_avals, out_avals, params)
    elif primitive in TRANSCENDENTAL:
        trans = out_elems
    elif primitive in _COMPOSITE:
        per_flop, per_trans = _COMPOSITE[primitive]
        flops, trans = per_flop * out_elems, per_trans * out_elems
    elif primitive == "integer_pow":
        flops = _integer_pow_flops(params.get("y", 2)) * out_elems
    elif primitive in _REDUCTIONS:
        flops = _size(in_avals[0].shape) - out_elems if in_avals else 0
    elif primitive in _ARG_REDUCTIONS:
        flops = (_size(in_avals[0].shape) - out_elems) * _ARG_REDUCE_COMPARATOR_OPS
    elif primitive == "sort":
        # A comparison sort: about log2(n) comparisons per element along the sorted axis
        # (the keys decide; further operands are permuted along).
        axis = params.get("dimension", -1)
        n = in_avals[0].shape[axis] if in_avals and in_avals[0].shape else 1
        flops = out_elems * max(1, math.ceil(math.log2(max(n, 2))))
    elif primitive in _CUMULATIVE:
        axis = params.get("axis", 0)
        flops = out_elems * (in_avals[0].shape[axis] - 1) if in_avals else 0
    elif primitive in _SCATTER_COMBINE:
        flops = _size(in_avals[-1].shape) if in_avals else 0
    elif primitive == "random_bits":
        rank = len(out_avals[0].shape)
        narrow = params.get("bit_width", 32) < 32
        flops = (_RANDOM_BITS_PER_ELEMENT + _RANDOM_BITS_PER_DIM * rank + narrow) * out_elems
        flops += _RANDOM_BITS_KEY
    elif primitive in ZERO_FLOP:
        flops = 0
    else:
        # ELEMENTWISE primitives, and the fallback for primitives without a rule (the caller
        # records those with `is_known_primitive`): one FLOP per output element.
        flops = out_elems
    return flops, trans


def is_known_primitive(primitive: str) -> bool:
    """Whether :func:`equation_cost` has a rule for ``primitive`` (not the fallback)."""
    return primitive in KNOWN_PRIMITIVES


_RULED = frozenset({KERNEL, "dot_general", "conv_general_dilated", "integer_pow", "sort",
                    "random_bits"}) | TRANSCENDENTAL | frozenset(_COMPOSITE) | _REDUCTIONS \
    | _ARG_REDUCTIONS | _CUMULATIVE | _SCATTER_COMBINE
"""Primitives with a rule of their own in :func:`equation_cost` (before its last two cases)."""
_ONE_PER_ELEMENT = ELEMENTWISE - _RULED - ZERO_FLOP
"""Elementwise primitives that no other rule claims: one FLOP per output element."""
_FREE = ZERO_FLOP - _RULED
"""Data movement that no other rule claims: no FLOPs."""
KNOWN_PRIMITIVES = _RULED | ELEMENTWISE | ZERO_FLOP
"""Primitives with a cost rule (:func:`is_known_primitive`)."""
