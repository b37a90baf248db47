"""The kernels the planner knows: where each may be split, what it costs, how to run it split.

XLA cannot partition an opaque kernel (a Pallas call), so shardplan never lets it: each kernel's
forward and backward run inside a ``jax.jit`` whose name starts with :data:`PREFIX`
(``shardplan_kernel__flash_attention_fwd``), called through :func:`call`. In a traced train step
such a call is one equation; the tracer keeps it as one op (primitive :data:`PRIMITIVE`) instead
of looking inside, and this module says, per kernel (:class:`KernelRule`):

* how its operand and result dimensions relate, as a layout per array (``"b s (k g) d"``: one
  token per dimension, a parenthesised group for a dimension made of several factors, major
  first); the letters in ``split`` may be split over mesh axes, the letters in ``reduce`` too
  (their results are then partial sums, added up over those axes), every other letter never
  (the sequence of flash attention: each query block reads every key block);
* its FLOPs (the cost model's compute time uses them with the rule's op class, ``attention``
  or ``matmul``, at the device type's efficiency for that class).

The runtime (:mod:`shardplan.runtime.constrain`) runs a kernel equation the plan pins inside
``shard_map`` with the plan's specs: each device runs the kernel on its blocks, re-traced at the
local shapes from the call :func:`call` recorded (the Python function and its static options),
and results of a split ``reduce`` letter are summed over its axes.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["PREFIX", "PRIMITIVE", "KernelRule", "call", "factor_sizes", "parse_layout",
           "recorded", "rule_for"]

PREFIX = "shardplan_kernel__"
"""The name prefix of a kernel's ``jax.jit`` functions."""

PRIMITIVE = "shardplan_kernel"
"""The op primitive the tracer gives a kernel call (``op.attrs["kernel"]`` names it)."""

Shapes = Sequence[tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class KernelRule:
    """One kernel function's sharding rule and cost.

    Attributes:
      name: the ``jax.jit`` function's name (:data:`PREFIX` + kernel).
      layouts: ``layouts(n_operands) -> (operand layouts, result layouts)`` (optional operands
        such as segment ids are absent from the equation when not given).
      split: letters that may be split over mesh axes (pass-through dimensions).
      reduce: letters that may be split with the results summed (contracted dimensions).
      op_class: the cost model's class: ``attention`` or ``matmul``.
      flops: ``flops(operand shapes, static options) -> FLOPs`` of one call.
    """

    name: str
    layouts: Callable[[int], tuple[tuple[str, ...], tuple[str, ...]]]
    split: frozenset[str]
    reduce: frozenset[str]
    op_class: str
    flops: Callable[[Shapes, Mapping[str, Any]], float]


def parse_layout(layout: str, /) -> list[tuple[str, ...]]:
    """``"b s (k g) d"`` -> ``[("b",), ("s",), ("k", "g"), ("d",)]``.

    Example:
        >>> parse_layout("b (k g) s")
        [('b',), ('k', 'g'), ('s',)]
    """
    dims: list[tuple[str, ...]] = []
    group: list[str] | None = None
    for token in layout.replace("(", " ( ").replace(")", " ) ").split():
        if token == "(":
            group = []
        elif token == ")":
            assert group is not None
            dims.append(tuple(group))
            group = None
        elif group is not None:
            group.append(token)
        else:
            dims.append((token,))
    return dims


def factor_sizes(layouts: Sequence[str], shapes: Shapes, /) -> dict[str, int]:
    """Each letter's size: from the dimensions that are one letter, then the groups' remaining
    letter by division (``(k g)`` of size 8 with ``k`` = 2 gives ``g`` = 4).

    Raises:
      ValueError: a layout does not match its shape's rank, or a size cannot be resolved.
    """
    parsed = [parse_layout(x) for x in layouts]
    sizes: dict[str, int] = {}
    for dims, shape in zip(parsed, shapes, strict=True):
        if len(dims) != len(shape):
            raise ValueError(f"layout {dims} does not fit shape {shape}")
        for letters, n in zip(dims, shape, strict=True):
            if len(letters) == 1:
                sizes.setdefault(letters[0], int(n))
    for dims, shape in zip(parsed, shapes, strict=True):
        for letters, n in zip(dims, shape, strict=True):
            unknown = [x for x in letters if x not in sizes]
            if len(unknown) == 1:
                known = math.prod(sizes[x] for x in letters if x in sizes)
                sizes[unknown[0]] = int(n) // max(known, 1)
            elif unknown:
                raise ValueError(f"cannot size {unknown} in {letters}")
    return sizes


def _attention_flops(shapes: Shapes, static: Mapping[str, Any], *, backward: bool) -> float:
    q, k = shapes[0], shapes[1]
    b, s, h, d = q
    t = k[1]
    causal = bool(getattr(static.get("opts"), "causal", True))  # the kernel's static options
    pairs = (s * t - (s * (s - 1)) / 2 if s == t else s * t / 2) if causal else s * t
    forward = 4.0 * b * h * d * pairs  # q k^T and p v: 2 FLOPs per multiply-add, 2 matmuls
    # The backward recomputes p (one matmul) and forms dv, dp, dq, dk (four): 2.5x forward.
    return 2.5 * forward if backward else forward


def _flash_layouts(backward: bool) -> Callable[[int], tuple[tuple[str, ...], tuple[str, ...]]]:
    q, kv, seg, lse = "b s (k g) d", "b t k d", "b s", "b (k g) s"

    def layouts(n: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        operands: tuple[str, ...]
        if not backward:
            operands = (q, kv, kv, seg) if n == 4 else (q, kv, kv)
            return operands, (q, lse)
        operands = (q, kv, kv, seg, q, lse, q) if n == 7 else (q, kv, kv, q, lse, q)
        return operands, (q, kv, kv)

    return layouts


def _gmm_flops(shapes: Shapes, _: Mapping[str, Any], *, backward: bool) -> float:
    (m, c), (_e, _c, n) = shapes[0], shapes[1]
    return (4.0 if backward else 2.0) * m * c * n  # every row meets one group's matrix


def _gmm_layouts(backward: bool) -> Callable[[int], tuple[tuple[str, ...], tuple[str, ...]]]:
    def layouts(n: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        del n
        if not backward:  # (lhs, rhs, group_sizes) -> out
            return ("m c", "e c n", "e"), ("m n",)
        # (lhs, rhs, group_sizes, dout) -> (dlhs, drhs): dlhs contracts n, drhs keeps it.
        return ("m c", "e c n", "e", "m n"), ("m c", "e c n")

    return layouts


_RULES: dict[str, KernelRule] = {
    rule.name: rule for rule in (
        KernelRule(f"{PREFIX}flash_attention_fwd", _flash_layouts(False), frozenset("bk"),
                   frozenset(), "attention",
                   lambda s, o: _attention_flops(s, o, backward=False)),
        KernelRule(f"{PREFIX}flash_attention_bwd", _flash_layouts(True), frozenset("bk"),
                   frozenset(), "attention",
                   lambda s, o: _attention_flops(s, o, backward=True)),
        KernelRule(f"{PREFIX}grouped_matmul_fwd", _gmm_layouts(False), frozenset("n"),
                   frozenset("c"), "matmul", lambda s, o: _gmm_flops(s, o, backward=False)),
        KernelRule(f"{PREFIX}grouped_matmul_bwd", _gmm_layouts(True), frozenset("c"),
                   frozenset(), "matmul", lambda s, o: _gmm_flops(s, o, backward=True)),
    )
}


def rule_for(name: str, /) -> KernelRule | None:
    """The rule of the kernel function ``name`` (``None``: not a kernel shardplan knows)."""
    return _RULES.get(name)


@dataclasses.dataclass(frozen=True)
class Recorded:
    """A kernel call as :func:`call` saw it: how to run it again on other shapes."""

    fn: Callable[..., Any]
    treedef: Any
    static: Mapping[str, Any]


_CALLS: dict[tuple[str, tuple[Any, ...]], Recorded | None] = {}
_LOCK = threading.Lock()


def _key(name: str, leaves: Sequence[Any]) -> tuple[str, tuple[Any, ...]]:
    return name, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


def call(fn: Callable[..., Any], /, *args: Any, **static: Any) -> Any:
    """``fn(*args, **static)`` for a kernel's ``jax.jit`` function, remembered by its name and
    argument shapes so that the runtime can run it again on each device's blocks.

    Two calls with equal shapes but other static options (a causal and a non-causal attention
    of one shape) make the entry ambiguous: the runtime then refuses to split that kernel.
    """
    import jax

    leaves, treedef = jax.tree.flatten(args)
    key = _key(fn.__name__, leaves)
    entry = Recorded(fn, treedef, dict(static))
    with _LOCK:
        if key in _CALLS and _CALLS[key] != entry:
            _CALLS[key] = None
        else:
            _CALLS.setdefault(key, entry)
    return fn(*args, **static)


def recorded(name: str, avals: Sequence[Any], /) -> Recorded | None:
    """The call :func:`call` recorded for kernel function ``name`` on arguments of these shapes
    and dtypes (``None``: none, or several with other static options)."""
    with _LOCK:
        return _CALLS.get(_key(name, avals))
