"""Sharding rules: how an op's operand and result dimensions relate, as *factors*.

A factor is one index of the op's iteration space (the ``i``, ``j``, ``k`` of
``C[i, j] = Σ_k A[i, k] · B[k, j]``). Each tensor dimension maps onto zero or more factors
(several for a dimension that a reshape splits or merges, major first). Sharding a factor on
mesh axes shards every dimension it appears in; that is all a sharding strategy is. Factors are:

* ``pass``: appears in a result (a batch or free dimension);
* ``reduce``: appears in operands only (a contracted or reduced dimension, the rows a
  scatter-add sums into, the table rows a gather indexes); sharding it leaves each device with
  a partial sum of the result;
* ``fixed``: must stay replicated (a sort axis, a concatenated dimension, a dimension whose
  size a slice or pad changes, any dimension of a PRNG key array).

This is the factor-based formulation of OpenXLA Shardy's ``OpShardingRule``; the cost model, the
propagation in :mod:`shardplan.cost.sharding` and the solver all use it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

from shardplan.kernels.registry import PRIMITIVE as KERNEL
from shardplan.kernels.registry import factor_sizes, parse_layout, rule_for
from shardplan.trace.dtypes import is_prng_key
from shardplan.trace.graph import Op, OpGraph

__all__ = ["Factor", "OpRule", "op_rule", "replicate_keys"]

FactorKind = Literal["pass", "reduce", "fixed"]
Dims = tuple[tuple[int, ...], ...]  # per tensor dimension: its factor ids, major first


@dataclasses.dataclass(frozen=True, slots=True)
class Factor:
    size: int
    kind: FactorKind


@dataclasses.dataclass(frozen=True, slots=True)
class OpRule:
    """Factors of one op and where they appear.

    Attributes:
      factors: the factors.
      operands: per operand (``op.inputs`` order), per dimension, the factor ids.
      results: per result, per dimension, the factor ids.
    """

    factors: tuple[Factor, ...]
    operands: tuple[Dims, ...]
    results: tuple[Dims, ...]


class _Builder:
    def __init__(self) -> None:
        self.factors: list[Factor] = []

    def new(self, size: int, kind: FactorKind = "pass") -> int:
        self.factors.append(Factor(int(size), kind))
        return len(self.factors) - 1

    def fixed_dims(self, shape: Sequence[int]) -> Dims:
        return tuple((self.new(d, "fixed"),) if d > 1 else () for d in shape)

    def rule(self, operands: Sequence[Dims], results: Sequence[Dims]) -> OpRule:
        return OpRule(tuple(self.factors), tuple(operands), tuple(results))


def _shape(graph: OpGraph, t: int) -> tuple[int, ...]:
    return graph.tensors[t].shape


def _elementwise(b: _Builder, ins: list[tuple[int, ...]], outs: list[tuple[int, ...]]) -> OpRule:
    shape = outs[0] if outs else ins[0]
    dims = [(b.new(d),) if d > 1 else () for d in shape]

    def dims_of(s: tuple[int, ...]) -> Dims:
        if len(s) == 0:
            return ()
        return tuple(dims[i] if s[i] == shape[i] else () for i in range(len(s)))

    return b.rule([dims_of(s) for s in ins], [dims_of(s) for s in outs])


def _dot(b: _Builder, op: Op, ins: list[tuple[int, ...]]) -> OpRule:
    lhs, rhs = ins
    a = op.attrs
    lc, rc, lb, rb = a["lhs_contract"], a["rhs_contract"], a["lhs_batch"], a["rhs_batch"]
    lhs_dims: list[tuple[int, ...]] = [()] * len(lhs)
    rhs_dims: list[tuple[int, ...]] = [()] * len(rhs)
    out: list[tuple[int, ...]] = []
    for i, j in zip(lb, rb, strict=True):
        f = b.new(lhs[i])
        lhs_dims[i] = rhs_dims[j] = (f,)
        out.append((f,))
    for i in range(len(lhs)):
        if i not in lc and i not in lb:
            f = b.new(lhs[i])
            lhs_dims[i] = (f,)
            out.append((f,))
    for j in range(len(rhs)):
        if j not in rc and j not in rb:
            f = b.new(rhs[j])
            rhs_dims[j] = (f,)
            out.append((f,))
    for i, j in zip(lc, rc, strict=True):
        f = b.new(lhs[i], "reduce")
        lhs_dims[i] = rhs_dims[j] = (f,)
    return b.rule([tuple(lhs_dims), tuple(rhs_dims)], [tuple(out)])


def _reduce(b: _Builder, op: Op, ins: list[tuple[int, ...]], kind: FactorKind) -> OpRule:
    axes = set(op.attrs.get("axes", ()))
    dims, out = [], []
    for i, d in enumerate(ins[0]):
        if i in axes:
            dims.append((b.new(d, kind),) if d > 1 else ())
        else:
            f = (b.new(d),) if d > 1 else ()
            dims.append(f)
            out.append(f)
    n_out = len(op.outputs)
    return b.rule([tuple(dims)] * len(ins), [tuple(out)] * n_out)


def _broadcast(b: _Builder, op: Op, ins: list[tuple[int, ...]],
               outs: list[tuple[int, ...]]) -> OpRule:
    out_shape = outs[0]
    bdims = op.attrs.get("broadcast_dimensions", ())
    out_dims: list[tuple[int, ...]] = [(b.new(d),) if d > 1 else () for d in out_shape]
    if not ins:
        return b.rule([], [tuple(out_dims)])
    in_dims = []
    for i, d in enumerate(ins[0]):
        o = bdims[i]
        in_dims.append(out_dims[o] if d == out_shape[o] else ())
    return b.rule([tuple(in_dims)], [tuple(out_dims)])


def _transpose(b: _Builder, op: Op, ins: list[tuple[int, ...]]) -> OpRule:
    perm = op.attrs["permutation"]
    in_dims = [(b.new(d),) if d > 1 else () for d in ins[0]]
    return b.rule([tuple(in_dims)], [tuple(in_dims[p] for p in perm)])


def _reshape(b: _Builder, ins: list[tuple[int, ...]], outs: list[tuple[int, ...]]) -> OpRule:
    """Splits and merges: both shapes are refined into a common sequence of factors."""
    src, dst = [d for d in ins[0]], [d for d in outs[0]]
    in_dims: list[list[int]] = [[] for _ in src]
    out_dims: list[list[int]] = [[] for _ in dst]
    i = j = 0
    rem_i = src[0] if src else 1
    rem_j = dst[0] if dst else 1
    while i < len(src) and j < len(dst):
        if rem_i == 1:
            i += 1
            rem_i = src[i] if i < len(src) else 1
            continue
        if rem_j == 1:
            j += 1
            rem_j = dst[j] if j < len(dst) else 1
            continue
        g = math.gcd(rem_i, rem_j)
        if g == 1:  # sizes do not refine (e.g. 6 -> 4x... never for valid reshapes)
            return b.rule([b.fixed_dims(src)], [b.fixed_dims(dst)])
        f = b.new(g)
        in_dims[i].append(f)
        out_dims[j].append(f)
        rem_i //= g
        rem_j //= g
    return b.rule([tuple(tuple(d) for d in in_dims)], [tuple(tuple(d) for d in out_dims)])


def _gather(b: _Builder, op: Op, ins: list[tuple[int, ...]],
            outs: list[tuple[int, ...]]) -> OpRule:
    operand, indices = ins[0], ins[1]
    out = outs[0]
    a = op.attrs
    offset_dims = a["offset_dims"]
    collapsed = set(a["collapsed_slice_dims"])
    obatch = a["operand_batching_dims"]
    ibatch = a["start_indices_batching_dims"]
    slice_sizes = a["slice_sizes"]
    op_dims: list[tuple[int, ...]] = [()] * len(operand)
    idx_dims: list[tuple[int, ...]] = [()] * len(indices)
    out_dims: list[tuple[int, ...]] = [()] * len(out)
    window = [d for d in range(len(operand)) if d not in collapsed and d not in obatch]
    for o, d in zip(offset_dims, window, strict=True):
        if slice_sizes[d] == operand[d] and operand[d] > 1:
            f = b.new(operand[d])
            op_dims[d] = out_dims[o] = (f,)
        elif out[o] > 1:
            out_dims[o] = (b.new(out[o], "fixed"),)
    batch_out = [o for o in range(len(out)) if o not in offset_dims]
    idx_non_vector = list(range(len(indices) - 1))  # the last indices dim holds the index vector
    for o, k in zip(batch_out, idx_non_vector, strict=False):
        if out[o] <= 1:
            continue
        f = b.new(out[o])
        out_dims[o] = idx_dims[k] = (f,)
        if k in ibatch:
            op_dims[obatch[ibatch.index(k)]] = (f,)
    for d in range(len(operand)):
        if not op_dims[d] and operand[d] > 1:
            # An indexed dimension: each device gathers the rows it holds (zeros elsewhere) and
            # the results are summed, so sharding it leaves partial sums, like a contraction.
            kind: FactorKind = "reduce" if d in a["start_index_map"] else "fixed"
            op_dims[d] = (b.new(operand[d], kind),)
    return b.rule([tuple(op_dims), tuple(idx_dims)], [tuple(out_dims)])


def _scatter(b: _Builder, op: Op, ins: list[tuple[int, ...]], *, combine: bool) -> OpRule:
    operand, indices, updates = ins[0], ins[1], ins[2]
    a = op.attrs
    window_dims = a["update_window_dims"]
    inserted = set(a["inserted_window_dims"])
    obatch = a["operand_batching_dims"]
    ibatch = a["scatter_indices_batching_dims"]
    op_dims: list[tuple[int, ...]] = [()] * len(operand)
    idx_dims: list[tuple[int, ...]] = [()] * len(indices)
    upd_dims: list[tuple[int, ...]] = [()] * len(updates)
    window = [d for d in range(len(operand)) if d not in inserted and d not in obatch]
    for u, d in zip(window_dims, window, strict=True):
        if updates[u] == operand[d] and operand[d] > 1:
            f = b.new(operand[d])
            op_dims[d] = upd_dims[u] = (f,)
    scatter_upd = [u for u in range(len(updates)) if u not in window_dims]
    for u, k in zip(scatter_upd, range(len(indices) - 1), strict=False):
        if updates[u] <= 1:
            continue
        if k in ibatch:
            f = b.new(updates[u])
            op_dims[obatch[ibatch.index(k)]] = (f,)
        else:
            # Rows scattered into the operand: a sum over them when combining (scatter-add).
            f = b.new(updates[u], "reduce" if combine else "fixed")
        upd_dims[u] = idx_dims[k] = (f,)
    for d in range(len(operand)):
        if not op_dims[d] and operand[d] > 1:
            op_dims[d] = (b.new(operand[d], "fixed"),)
    return b.rule([tuple(op_dims), tuple(idx_dims), tuple(upd_dims)], [tuple(op_dims)])


def _same_shape_except(b: _Builder, ins: list[tuple[int, ...]], outs: list[tuple[int, ...]],
                       fixed_axes: set[int]) -> OpRule:
    """Dims of equal size pass through; the listed axes (and any size change) stay replicated."""
    ref = outs[0]
    dims: list[tuple[int, ...]] = []
    for i, d in enumerate(ref):
        kind: FactorKind = "fixed" if i in fixed_axes else "pass"
        if any(len(s) != len(ref) or s[i] != d for s in ins):
            kind = "fixed"
        dims.append((b.new(d, kind),) if d > 1 else ())
    per_in = []
    for s in ins:
        per_in.append(tuple(dims[i] if s[i] == ref[i] else
                            ((b.new(s[i], "fixed"),) if s[i] > 1 else ()) for i in range(len(s))))
    return b.rule(per_in, [tuple(dims)] * len(outs))


def _scan_slice(b: _Builder, ins: list[tuple[int, ...]]) -> OpRule:
    stacked = ins[0]
    lead = (b.new(stacked[0], "fixed"),) if stacked[0] > 1 else ()
    rest = [(b.new(d),) if d > 1 else () for d in stacked[1:]]
    return b.rule([(lead, *rest)], [tuple(rest)])


def _scan_stack(b: _Builder, outs: list[tuple[int, ...]]) -> OpRule:
    stacked = outs[0]
    lead = (b.new(stacked[0], "fixed"),) if stacked[0] > 1 else ()
    rest = [(b.new(d),) if d > 1 else () for d in stacked[1:]]
    return b.rule([tuple(rest)], [(lead, *rest)])


_REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                     "reduce_or", "reduce_xor"})
_ARG_REDUCE = frozenset({"argmax", "argmin"})


def _broadcastable(shape: tuple[int, ...], ref: tuple[int, ...]) -> bool:
    """Same rank with equal or unit dimensions (lax's implicit size-1 broadcast), or a scalar."""
    if not shape:
        return True
    return len(shape) == len(ref) and all(a == b or a == 1 for a, b in zip(shape, ref,
                                                                            strict=True))


def _kernel(b: _Builder, op: Op, ins: list[tuple[int, ...]], outs: list[tuple[int, ...]]
            ) -> OpRule:
    """A shardplan kernel: its registered layouts (:mod:`shardplan.kernels.registry`); the
    letters it may split are ``pass`` (or ``reduce``) factors, every other one is fixed."""
    rule = rule_for(str(op.attrs.get("kernel", "")))
    if rule is None:  # not a kernel shardplan knows: nothing of it may be split
        return b.rule([b.fixed_dims(s) for s in ins], [b.fixed_dims(s) for s in outs])
    operand_layouts, result_layouts = rule.layouts(len(ins))
    sizes = factor_sizes([*operand_layouts, *result_layouts], [*ins, *outs])
    ids: dict[str, int] = {}
    for letter, size in sizes.items():
        if size > 1:
            kind: FactorKind = ("pass" if letter in rule.split else
                                "reduce" if letter in rule.reduce else "fixed")
            ids[letter] = b.new(size, kind)

    def dims(layout: str) -> Dims:
        return tuple(tuple(ids[x] for x in letters if x in ids)
                     for letters in parse_layout(layout))

    return b.rule([dims(x) for x in operand_layouts], [dims(x) for x in result_layouts])


def replicate_keys(rule: OpRule, dtypes: Sequence[str]) -> OpRule:
    """``rule`` with every factor of a PRNG key array fixed: keys are never sharded.

    A key is a few bytes (its ``jax.random.key_data``), so sharding key arrays saves next to
    no memory or time; keeping them whole keeps every key where each device can draw from it
    (the random bits an op draws from one key can still be sharded).

    Args:
      rule: an op's rule (or :func:`~shardplan.planner.nodes.tensor_rule`'s).
      dtypes: the dtype names of its operands then its results.

    Example:
      >>> rule = OpRule((Factor(8, "pass"),), (((0,),),), (((0,),),))  # [8] -> [8]
      >>> replicate_keys(rule, ["key<fry>", "key<fry>"]).factors
      (Factor(size=8, kind='fixed'),)
    """
    dims = (*rule.operands, *rule.results)
    pinned = {f for dtype, tensor in zip(dtypes, dims, strict=True) if is_prng_key(dtype)
              for fs in tensor for f in fs}
    if not pinned:
        return rule
    return dataclasses.replace(rule, factors=tuple(
        Factor(f.size, "fixed") if i in pinned else f for i, f in enumerate(rule.factors)))


def op_rule(graph: OpGraph, op: Op) -> OpRule:
    """The factor rule of ``op`` (see the module docstring); a PRNG key operand or result
    is never sharded (:func:`replicate_keys`)."""
    dtypes = [graph.tensors[t].dtype for t in (*op.inputs, *op.outputs)]
    rule = _rule(graph, op)
    return replicate_keys(rule, dtypes) if any(map(is_prng_key, dtypes)) else rule


def _rule(graph: OpGraph, op: Op) -> OpRule:
    ins = [_shape(graph, t) for t in op.inputs]
    outs = [_shape(graph, t) for t in op.outputs]
    b = _Builder()
    p = op.primitive
    if p == KERNEL:
        return _kernel(b, op, ins, outs)
    if p == "dot_general" and len(ins) == 2:
        return _dot(b, op, ins)
    if p in _REDUCE and ins:
        return _reduce(b, op, ins, "reduce")
    if p in _ARG_REDUCE and ins:
        return _reduce(b, op, ins, "fixed")
    if p == "broadcast_in_dim":
        return _broadcast(b, op, ins, outs)
    if p == "transpose":
        return _transpose(b, op, ins)
    if p in ("reshape", "squeeze", "expand_dims") and ins:
        return _reshape(b, ins, outs)
    if p == "gather" and len(ins) == 2 and "offset_dims" in op.attrs:
        return _gather(b, op, ins, outs)
    if p.startswith("scatter") and len(ins) == 3 and "update_window_dims" in op.attrs:
        return _scatter(b, op, ins, combine=p != "scatter")
    if p == "scan_slice":
        return _scan_slice(b, ins)
    if p == "scan_stack":
        return _scan_stack(b, outs)
    if p == "top_k":
        # XLA lowers top_k to a custom call its partitioners do not split: the operand is
        # gathered and every device computes the whole result (measured on jax 0.10, CPU).
        return b.rule([b.fixed_dims(s) for s in ins], [b.fixed_dims(s) for s in outs])
    if p in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort"):
        axis = op.attrs.get("axis", op.attrs.get("dimension", len(ins[0]) - 1))
        return _same_shape_except(b, ins, outs, {axis})
    if p in ("concatenate", "split"):
        axis = op.attrs.get("dimension", op.attrs.get("axis", 0))
        return _same_shape_except(b, ins, outs, {axis})
    if p in ("slice", "pad", "dynamic_slice", "dynamic_update_slice", "rev"):
        n = len(outs[0])
        tensor_ins = [s for s in ins if len(s) == n]
        scalars = [s for s in ins if len(s) != n]
        rule = _same_shape_except(b, tensor_ins, outs, set())
        return OpRule(rule.factors, tuple(rule.operands) + tuple(() for _ in scalars),
                      rule.results) if scalars else rule
    if p == "iota":
        return b.rule([], [tuple((b.new(d),) if d > 1 else () for d in outs[0])])
    unknown = any(p == name for name, _ in graph.unknown_primitives)
    if outs and not unknown and all(_broadcastable(s, outs[0]) for s in ins + outs):
        return _elementwise(b, ins, outs)
    # No rule (or a primitive the tracer does not know, not guessed elementwise): replicated.
    return b.rule([b.fixed_dims(s) for s in ins], [b.fixed_dims(s) for s in outs])
