"""Flash attention as Pallas kernels (forward and backward), plus a plain-jnp reference.

The forward kernel is FlashAttention-2 (Dao 2023, arXiv:2307.08691, Algorithm 1): each program
owns one block of queries and streams blocks of keys and values through an online softmax (running
row max ``m`` and running sum ``l``, fp32), writing the output and the log-sum-exp of every row.
The backward pass is two kernels (Algorithm 2, split the way the FlashAttention-2 Triton kernels
split it): one owns a block of keys/values and loops over the queries of every query head that
shares it (dK, dV), the other owns a block of queries and loops over the keys (dQ). Both recompute
the probabilities from the saved log-sum-exp, so nothing quadratic in the sequence is stored.

Kernel-aware planning: the differentiable entry point :func:`flash_attention` is a
``jax.custom_vjp`` whose forward and backward each call exactly one ``jax.jit``-wrapped function,
named :data:`FWD_NAME` and :data:`BWD_NAME`. In a traced train step they appear as ``jit``
equations with ``params["name"]`` equal to those names, taking and returning arrays only (every
static option is baked in), so the runtime can wrap exactly those calls in ``shard_map``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from shardplan.errors import ConfigError, format_error
from shardplan.kernels.registry import PREFIX, call

__all__ = ["BWD_NAME", "FWD_NAME", "flash_attention", "flash_attention_reference"]

# (Past 600 lines: three Pallas kernels, their launch wrappers and the custom_vjp share the
# static options and masking helpers; splitting forward from backward would export those.)

FWD_NAME = f"{PREFIX}flash_attention_fwd"
"""``params["name"]`` of the forward kernel's ``jit`` equation."""

BWD_NAME = f"{PREFIX}flash_attention_bwd"
"""``params["name"]`` of the backward kernels' ``jit`` equation."""

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
"""Logit given to masked entries: finite, so that a block of only masked entries never computes
``inf - inf``; far below any real logit, so that ``exp2(_MASK_VALUE - m)`` is 0 for a row that has
seen a real logit."""

_LOG2_E = math.log2(math.e)
"""The kernels work in base 2 (``exp2`` is one instruction on GPUs): ``e**x == 2**(x * log2 e)``."""

_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

_CPU_BLOCK = 32
"""Default block edge in interpret mode: every grid step and loop iteration is interpreted, so
fewer, larger blocks are faster; 32 keeps tiny test shapes at one or two blocks."""


@dataclasses.dataclass(frozen=True)
class _Options:
    """Static (hashable) options baked into the named kernels, never passed as arrays.

    Attributes:
      causal: mask keys after the query.
      sm_scale: softmax scale applied to ``q @ k.T`` (``1 / sqrt(head_dim)``).
      seq_len: the true sequence length (inputs are padded to ``padded_len`` inside).
      padded_len: the sequence length rounded up to a multiple of every block.
      head_dim_padded: head dim rounded up to a power of two (Triton tiles need one).
      fwd_blocks: ``(block_q, block_k)`` of the forward kernel.
      bwd_blocks: ``(block_q, block_k)`` of both backward kernels.
      interpret: run the Pallas kernels in interpret mode (CPU) instead of compiling them.
      num_warps: Triton warps per program (forward, backward).
      num_stages: Triton software-pipelining stages (forward, backward).
    """

    causal: bool
    sm_scale: float
    seq_len: int
    padded_len: int
    head_dim_padded: int
    fwd_blocks: tuple[int, int]
    bwd_blocks: tuple[int, int]
    interpret: bool
    num_warps: tuple[int, int]
    num_stages: tuple[int, int]


# ----------------------------------------------------------------------------------------------
# Kernels. Refs are 2-D (or 1-D) views of one (batch, head) slice; shape comments name the tile.


def _dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """``a @ b`` on 2-D tiles with optional transposes, accumulated in fp32."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _mask(opts: _Options, q_pos: jax.Array, k_pos: jax.Array, q_seg: jax.Array | None,
          k_seg: jax.Array | None, *, padded_keys: bool = True) -> jax.Array | None:
    """``[block_q, block_k]`` bool of allowed (query, key) pairs, or None when all are.

    ``padded_keys=False`` leaves padded keys unmasked, for the dK/dV kernel, whose padded key
    rows are sliced off (each key's gradient depends on no other key).
    """
    mask = None
    if padded_keys and opts.seq_len != opts.padded_len:  # never attend to padded keys
        mask = jnp.broadcast_to(k_pos[None, :] < opts.seq_len, (q_pos.size, k_pos.size))
    if opts.causal:
        causal = q_pos[:, None] >= k_pos[None, :]
        mask = causal if mask is None else mask & causal
    if q_seg is not None and k_seg is not None:
        same = q_seg[:, None] == k_seg[None, :]
        mask = same if mask is None else mask & same
    return mask


def _num_kv_blocks(opts: _Options, q_block: jax.Array, block_q: int, block_k: int) -> jax.Array:
    """How many key blocks query block ``q_block`` needs: skips padding and, if causal, the future."""
    n_valid = pl.cdiv(opts.seq_len, block_k)
    if not opts.causal:
        return jnp.int32(n_valid)
    # ceil(last query of the block + 1, block_k); `//` on program ids is not lowered by Triton.
    needed = lax.div((q_block + 1) * block_q + block_k - 1, block_k)
    return jnp.minimum(needed, n_valid)


def _num_unmasked_kv_blocks(opts: _Options, q_block: jax.Array, block_q: int, block_k: int,
                            has_segments: bool) -> jax.Array:
    """How many leading key blocks query block ``q_block`` sees whole, so they skip the mask.

    Masking costs a compare and a select per logit; FlashAttention-2 (section 3.1.1) applies it
    only to the blocks on the causal diagonal. Segments can cut any block, so they mask all.
    """
    if has_segments:
        return jnp.int32(0)
    unpadded = opts.seq_len // block_k                      # key blocks without padding
    if not opts.causal:
        return jnp.int32(unpadded)
    # Every key of block j precedes every query of the block iff (j + 1) * block_k <= first query.
    return jnp.minimum(lax.div(q_block * block_q, block_k), unpadded)


def _masked_then_unmasked(lower, split, upper, body, carry):
    """``body(i, carry, masked)`` over ``[lower, split)`` masked, then ``[split, upper)`` not."""
    carry = lax.fori_loop(lower, split, functools.partial(body, masked=True), carry)
    return lax.fori_loop(split, upper, functools.partial(body, masked=False), carry)


def _unmasked_then_masked(lower, split, upper, body, carry):
    """``body(i, carry, masked)`` over ``[lower, split)`` unmasked, then ``[split, upper)`` masked."""
    carry = lax.fori_loop(lower, split, functools.partial(body, masked=False), carry)
    return lax.fori_loop(split, upper, functools.partial(body, masked=True), carry)


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, opts: _Options, has_segments: bool):
    """One query block: stream key/value blocks through an online softmax (FA-2 Algorithm 1)."""
    if has_segments:
        seg_ref, o_ref, lse_ref = refs
    else:
        seg_ref, (o_ref, lse_ref) = None, refs
    block_q, block_k = opts.fwd_blocks
    i = pl.program_id(2)
    q = q_ref[...]                                           # [block_q, head_dim]
    q_pos = i * block_q + lax.iota(jnp.int32, block_q)
    q_seg = None if seg_ref is None else seg_ref[pl.ds(i * block_q, block_q)]
    qk_scale = opts.sm_scale * _LOG2_E

    def body(j, carry, masked):
        acc, m_prev, l_prev = carry
        k = k_ref[pl.ds(j * block_k, block_k), :]           # [block_k, head_dim]
        v = v_ref[pl.ds(j * block_k, block_k), :]
        s = _dot(q, k, trans_b=True) * qk_scale             # [block_q, block_k], base-2 logits
        if masked:
            k_seg = None if seg_ref is None else seg_ref[pl.ds(j * block_k, block_k)]
            mask = _mask(opts, q_pos, j * block_k + lax.iota(jnp.int32, block_k), q_seg, k_seg)
            if mask is not None:
                s = jnp.where(mask, s, _MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        correction = jnp.exp2(m_prev - m_next)               # rescales what was summed so far
        p = jnp.exp2(s - m_next[:, None])
        l_next = correction * l_prev + jnp.sum(p, axis=1)
        acc = correction[:, None] * acc + _dot(p.astype(v.dtype), v)
        return acc, m_next, l_next

    acc0 = jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32)
    m0 = jnp.full((block_q,), _MASK_VALUE, jnp.float32)
    l0 = jnp.zeros((block_q,), jnp.float32)
    acc, m, l_sum = _unmasked_then_masked(
        0, _num_unmasked_kv_blocks(opts, i, block_q, block_k, has_segments),
        _num_kv_blocks(opts, i, block_q, block_k), body, (acc0, m0, l0))
    # A row that never saw an allowed key still has m == _MASK_VALUE: output 0, lse +inf (so the
    # backward pass recomputes p = exp2(s - inf) = 0 and the row contributes no gradient).
    seen = m > _MASK_VALUE
    l_safe = jnp.where(seen, l_sum, 1.0)
    o_ref[...] = jnp.where(seen[:, None], acc / l_safe[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log2(l_safe), jnp.inf)


def _probs_and_dlogits(opts: _Options, q, k, v, do, lse, delta, mask, qk_scale):
    """Recomputes ``p`` from the saved base-2 lse, and ``ds = p * (dp - delta)`` (FA-2 Alg. 2)."""
    s = _dot(q, k, trans_b=True) * qk_scale                 # [block_q, block_k]
    if mask is not None:
        s = jnp.where(mask, s, _MASK_VALUE)
    p = jnp.exp2(s - lse[:, None])                           # softmax probabilities
    dp = _dot(do, v, trans_b=True)                           # [block_q, block_k]
    ds = p * (dp - delta[:, None])                           # d loss / d (scaled logits)
    return p, ds


def _bwd_dkv_kernel(q_ref, k_ref, v_ref, *refs, opts: _Options, has_segments: bool, group: int):
    """One key/value block: loops over the query heads sharing it and their query blocks."""
    if has_segments:
        seg_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    else:
        seg_ref, (do_ref, lse_ref, delta_ref, dk_ref, dv_ref) = None, refs
    block_q, block_k = opts.bwd_blocks
    j = pl.program_id(2)
    k = k_ref[...]                                           # [block_k, head_dim]
    v = v_ref[...]
    k_pos = j * block_k + lax.iota(jnp.int32, block_k)
    k_seg = None if seg_ref is None else seg_ref[pl.ds(j * block_k, block_k)]
    qk_scale = opts.sm_scale * _LOG2_E
    # Causal: query blocks before this key block see none of it; those from `whole` on see all of
    # it (no mask). Query blocks of padding only are skipped.
    last = pl.cdiv(opts.seq_len, block_q)
    if has_segments or opts.causal:
        first = lax.div(j * block_k, block_q) if opts.causal else jnp.int32(0)
        whole = (jnp.minimum(lax.div((j + 1) * block_k + block_q - 1, block_q), last)
                 if not has_segments else jnp.int32(last))
    else:
        first = whole = jnp.int32(0)

    def body(i, carry, masked, g):
        dk, dv = carry
        rows = pl.ds(i * block_q, block_q)
        q = q_ref[rows, g, :]                                # [block_q, head_dim]
        do = do_ref[rows, g, :]
        q_seg = None if seg_ref is None or not masked else seg_ref[rows]
        mask = None
        if masked:
            mask = _mask(opts, i * block_q + lax.iota(jnp.int32, block_q), k_pos, q_seg, k_seg,
                         padded_keys=False)
        p, ds = _probs_and_dlogits(opts, q, k, v, do, lse_ref[g, rows], delta_ref[g, rows], mask,
                                   qk_scale)
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)  # [block_k, head_dim]
        dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
        return dk, dv

    carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for g in range(group):  # static: query heads sharing this kv head (grouped-query attention)
        carry = _masked_then_unmasked(first, whole, last, functools.partial(body, g=g), carry)
    dk, dv = carry
    dk_ref[...] = (dk * opts.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _bwd_dq_kernel(q_ref, k_ref, v_ref, *refs, opts: _Options, has_segments: bool):
    """One query block: loops over the key blocks it attends to, accumulating dQ."""
    if has_segments:
        seg_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
    else:
        seg_ref, (do_ref, lse_ref, delta_ref, dq_ref) = None, refs
    block_q, block_k = opts.bwd_blocks
    i = pl.program_id(2)
    q = q_ref[...]                                           # [block_q, head_dim]
    do = do_ref[...]
    lse = lse_ref[...]                                       # [block_q]
    delta = delta_ref[...]
    q_pos = i * block_q + lax.iota(jnp.int32, block_q)
    q_seg = None if seg_ref is None else seg_ref[pl.ds(i * block_q, block_q)]
    qk_scale = opts.sm_scale * _LOG2_E

    def body(j, dq, masked):
        cols = pl.ds(j * block_k, block_k)
        k = k_ref[cols, :]                                   # [block_k, head_dim]
        v = v_ref[cols, :]
        mask = None
        if masked:
            k_seg = None if seg_ref is None else seg_ref[cols]
            mask = _mask(opts, q_pos, j * block_k + lax.iota(jnp.int32, block_k), q_seg, k_seg)
        _, ds = _probs_and_dlogits(opts, q, k, v, do, lse, delta, mask, qk_scale)
        return dq + _dot(ds.astype(k.dtype), k)

    dq = _unmasked_then_masked(
        0, _num_unmasked_kv_blocks(opts, i, block_q, block_k, has_segments),
        _num_kv_blocks(opts, i, block_q, block_k), body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * opts.sm_scale).astype(dq_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers on padded [batch, padded_len, heads, head_dim_padded] arrays.


def _compiler_params(opts: _Options, which: int) -> Any:
    """``compiler_params=`` for the Triton lowering (None in interpret mode)."""
    if opts.interpret:
        return None
    from jax.experimental.pallas import triton as plgpu  # GPU-only module; import when used

    return plgpu.CompilerParams(num_warps=opts.num_warps[which], num_stages=opts.num_stages[which])


def _fwd_call(q, k, v, seg, opts: _Options):
    batch, seq, heads, head_dim = q.shape
    group = heads // k.shape[2]
    block_q, _ = opts.fwd_blocks
    tile = lambda b, h, i: (b, i, h, 0)             # noqa: E731
    whole_kv = lambda b, h, i: (b, 0, h // group, 0)  # noqa: E731
    in_specs = [pl.BlockSpec((None, block_q, None, head_dim), tile),
                pl.BlockSpec((None, seq, None, head_dim), whole_kv),
                pl.BlockSpec((None, seq, None, head_dim), whole_kv)]
    args = [q, k, v]
    if seg is not None:
        in_specs.append(pl.BlockSpec((None, seq), lambda b, h, i: (b, 0)))
        args.append(seg)
    kernel = functools.partial(_fwd_kernel, opts=opts, has_segments=seg is not None)
    return pl.pallas_call(
        kernel,
        grid=(batch, heads, seq // block_q),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, block_q, None, head_dim), tile),
                   pl.BlockSpec((None, None, block_q), lambda b, h, i: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32)],
        interpret=opts.interpret,
        name="shardplan_flash_attention_fwd",
        compiler_params=_compiler_params(opts, 0),
    )(*args)


def _bwd_dkv_call(q, k, v, seg, do, lse, delta, opts: _Options):
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    _, block_k = opts.bwd_blocks
    kv_tile = lambda b, h, j: (b, j, h, 0)            # noqa: E731
    # Block h (of size `group`) of the heads axis: the query heads that share kv head h.
    q_group = lambda b, h, j: (b, 0, h, 0)            # noqa: E731
    in_specs = [pl.BlockSpec((None, seq, group, head_dim), q_group),
                pl.BlockSpec((None, block_k, None, head_dim), kv_tile),
                pl.BlockSpec((None, block_k, None, head_dim), kv_tile)]
    args = [q, k, v]
    if seg is not None:
        in_specs.append(pl.BlockSpec((None, seq), lambda b, h, j: (b, 0)))
        args.append(seg)
    row_stats = pl.BlockSpec((None, group, seq), lambda b, h, j: (b, h, 0))
    in_specs += [pl.BlockSpec((None, seq, group, head_dim), q_group), row_stats, row_stats]
    args += [do, lse, delta]
    kernel = functools.partial(_bwd_dkv_kernel, opts=opts, has_segments=seg is not None,
                               group=group)
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, seq // block_k),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, block_k, None, head_dim), kv_tile)] * 2,
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        interpret=opts.interpret,
        name="shardplan_flash_attention_bwd_dkv",
        compiler_params=_compiler_params(opts, 1),
    )(*args)


def _bwd_dq_call(q, k, v, seg, do, lse, delta, opts: _Options):
    batch, seq, heads, head_dim = q.shape
    group = heads // k.shape[2]
    block_q, _ = opts.bwd_blocks
    tile = lambda b, h, i: (b, i, h, 0)             # noqa: E731
    whole_kv = lambda b, h, i: (b, 0, h // group, 0)  # noqa: E731
    row_stats = pl.BlockSpec((None, None, block_q), lambda b, h, i: (b, h, i))
    in_specs = [pl.BlockSpec((None, block_q, None, head_dim), tile),
                pl.BlockSpec((None, seq, None, head_dim), whole_kv),
                pl.BlockSpec((None, seq, None, head_dim), whole_kv)]
    args = [q, k, v]
    if seg is not None:
        in_specs.append(pl.BlockSpec((None, seq), lambda b, h, i: (b, 0)))
        args.append(seg)
    in_specs += [pl.BlockSpec((None, block_q, None, head_dim), tile), row_stats, row_stats]
    args += [do, lse, delta]
    kernel = functools.partial(_bwd_dq_kernel, opts=opts, has_segments=seg is not None)
    return pl.pallas_call(
        kernel,
        grid=(batch, heads, seq // block_q),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_q, None, head_dim), tile),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=opts.interpret,
        name="shardplan_flash_attention_bwd_dq",
        compiler_params=_compiler_params(opts, 1),
    )(*args)


# ----------------------------------------------------------------------------------------------
# The two named functions the planner finds in a traced step and the runtime wraps in shard_map.


def _pad(x: jax.Array, opts: _Options, *, head_axis: int | None, value: float = 0.0) -> jax.Array:
    """Pads axis 1 (sequence) to ``padded_len`` and ``head_axis`` to ``head_dim_padded``."""
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, opts.padded_len - x.shape[1])
    if head_axis is not None:
        widths[head_axis] = (0, opts.head_dim_padded - x.shape[head_axis])
    if all(w == (0, 0) for w in widths):
        return x
    return jnp.pad(x, widths, constant_values=value)


def _pad_stats(x: jax.Array, opts: _Options, value: float) -> jax.Array:
    """Pads a ``[batch, heads, seq]`` row statistic along the sequence."""
    pad = opts.padded_len - x.shape[2]
    return jnp.pad(x, ((0, 0), (0, 0), (0, pad)), constant_values=value) if pad else x


@functools.partial(jax.jit, static_argnames=("opts",))
def shardplan_kernel__flash_attention_fwd(q, k, v, segment_ids=None, *, opts: _Options):
    """Forward kernel: ``(q, k, v[, segment_ids]) -> (o, lse)``; arrays in, arrays out.

    Shapes: ``q`` and ``o`` ``[batch, seq, heads, head_dim]``; ``k``, ``v``
    ``[batch, seq, kv_heads, head_dim]``; ``segment_ids`` ``[batch, seq]`` int32 (absent from the
    equation when None); ``lse`` ``[batch, heads, seq]`` float32, the base-2 log-sum-exp of each
    row's scaled logits (``+inf`` for a row with no allowed key).

    Legal to split across devices: batch (every operand's axis 0) and heads (``q``/``o`` axis 2,
    ``k``/``v`` axis 2 split into the same number of contiguous pieces, ``lse`` axis 1), so a
    heads split of ``n`` needs ``kv_heads % n == 0``. Never the sequence or head_dim: every query
    block reads every key block of its (batch, head). (With ``kv_heads == 1`` the kv operands may
    instead stay whole on every heads shard; then the backward's ``dk``/``dv`` are partial sums
    that need a ``psum`` over the heads axis.)
    """
    seq, head_dim = q.shape[1], q.shape[3]
    seg = None if segment_ids is None else _pad(segment_ids, opts, head_axis=None)
    o, lse = _fwd_call(_pad(q, opts, head_axis=3), _pad(k, opts, head_axis=3),
                       _pad(v, opts, head_axis=3), seg, opts)
    return o[:, :seq, :, :head_dim], lse[:, :, :seq]


@functools.partial(jax.jit, static_argnames=("opts",))
def shardplan_kernel__flash_attention_bwd(q, k, v, segment_ids, o, lse, do, *, opts: _Options):
    """Backward kernels: ``(q, k, v[, segment_ids], o, lse, do) -> (dq, dk, dv)``.

    ``o``, ``lse`` are the forward's outputs (the residuals), ``do`` the output cotangent
    (``[batch, seq, heads, head_dim]``); ``dq`` has ``q``'s shape, ``dk``/``dv`` those of
    ``k``/``v`` (summed over the query heads sharing each kv head). Legal splits: as for
    :func:`shardplan_kernel__flash_attention_fwd`.
    """
    seq, head_dim = q.shape[1], q.shape[3]
    # delta_i = sum_d o_id * do_id = sum_j p_ij dp_ij (FA-2 Algorithm 2, line 4); cheap and
    # elementwise, so XLA fuses it.
    delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
    seg = None if segment_ids is None else _pad(segment_ids, opts, head_axis=None)
    qp, kp, vp = (_pad(x, opts, head_axis=3) for x in (q, k, v))
    dop = _pad(do, opts, head_axis=3)
    # Padded query rows get lse = +inf, so their recomputed probabilities are exactly 0.
    lsep, deltap = _pad_stats(lse, opts, jnp.inf), _pad_stats(delta, opts, 0.0)
    dk, dv = _bwd_dkv_call(qp, kp, vp, seg, dop, lsep, deltap, opts)
    dq = _bwd_dq_call(qp, kp, vp, seg, dop, lsep, deltap, opts)
    return dq[:, :seq, :, :head_dim], dk[:, :seq, :, :head_dim], dv[:, :seq, :, :head_dim]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segment_ids, opts: _Options):
    return call(shardplan_kernel__flash_attention_fwd, q, k, v, segment_ids, opts=opts)[0]


def _attention_fwd(q, k, v, segment_ids, opts: _Options):
    o, lse = call(shardplan_kernel__flash_attention_fwd, q, k, v, segment_ids, opts=opts)
    return o, (q, k, v, segment_ids, o, lse)


def _attention_bwd(opts: _Options, residuals, do):
    q, k, v, segment_ids, o, lse = residuals
    dq, dk, dv = call(shardplan_kernel__flash_attention_bwd, q, k, v, segment_ids, o, lse, do,
                      opts=opts)
    # Integer inputs take a float0 cotangent.
    dseg = None if segment_ids is None else jnp.zeros(segment_ids.shape, jax.dtypes.float0)
    return dq, dk, dv, dseg


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------------------------
# Public API.


def _check_inputs(q, k, v, segment_ids) -> None:
    """Raises ConfigError for shapes/dtypes the kernel (and the reference) do not accept."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.ndim(x) != 4:
            raise ConfigError(format_error(
                f"flash_attention: {name} must be [batch, seq, heads, head_dim].",
                where=f"flash_attention({name}=...)", value=tuple(jnp.shape(x)),
                remedy="pass a rank-4 array in [batch, seq, heads, head_dim] layout"))
        if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
            raise ConfigError(format_error(
                f"flash_attention: {name} has an unsupported dtype.",
                where=f"flash_attention({name}=...)", value=str(x.dtype),
                remedy="use float32, bfloat16 or float16"))
    if k.shape != v.shape:
        raise ConfigError(format_error(
            "flash_attention: k and v must have the same shape.", where="flash_attention(k, v)",
            value={"k": tuple(k.shape), "v": tuple(v.shape)},
            remedy="pass keys and values of shape [batch, seq, kv_heads, head_dim]"))
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ConfigError(format_error(
            "flash_attention: q, k and v must have the same dtype.",
            where="flash_attention(q, k, v)",
            value={"q": str(q.dtype), "k": str(k.dtype), "v": str(v.dtype)},
            remedy="cast them to one dtype before the call"))
    (batch, seq, heads, head_dim), kv_heads = q.shape, k.shape[2]
    if (k.shape[0], k.shape[1], k.shape[3]) != (batch, seq, head_dim):
        raise ConfigError(format_error(
            "flash_attention: k/v must match q in batch, seq and head_dim.",
            where="flash_attention(q, k, v)",
            value={"q": tuple(q.shape), "k": tuple(k.shape)},
            remedy="self-attention only: q [b, s, h, d] with k, v [b, s, kv_heads, d]"))
    if kv_heads == 0 or heads % kv_heads:
        raise ConfigError(format_error(
            "flash_attention: the number of query heads must be a multiple of the kv heads.",
            where="flash_attention(q, k): heads % kv_heads",
            value={"heads": heads, "kv_heads": kv_heads},
            remedy="use kv_heads that divides heads (grouped-query attention)"))
    if segment_ids is not None and (
            tuple(jnp.shape(segment_ids)) != (batch, seq)
            or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ConfigError(format_error(
            "flash_attention: segment_ids must be an integer array of shape [batch, seq].",
            where="flash_attention(segment_ids=...)",
            value={"shape": tuple(jnp.shape(segment_ids)), "dtype": str(segment_ids.dtype),
                   "expected": (batch, seq)},
            remedy="pass one integer segment id per token"))


def _check_block(name: str, block: int | None) -> None:
    if block is not None and (block < 1 or block & (block - 1)):
        raise ConfigError(format_error(
            f"flash_attention: {name} must be a positive power of two.",
            where=f"flash_attention({name}=...)", value=block,
            remedy="use 16, 32, 64 or 128 (Triton tiles are powers of two)"))


def _make_options(q: jax.Array, *, causal: bool, block_q: int | None, block_k: int | None,
                  interpret: bool) -> _Options:
    """Block sizes, padding and Triton launch parameters for this call (all static)."""
    seq, head_dim = q.shape[1], q.shape[3]
    if interpret:
        fwd, bwd, min_block = (_CPU_BLOCK, _CPU_BLOCK), (_CPU_BLOCK, _CPU_BLOCK), 1
        head_dim_padded, warps = head_dim, (4, 4)
    else:
        # FlashAttention-2's Triton defaults: 128 queries x 64 keys forward, 64 x 64 backward
        # (the backward keeps dK, dV, K, V tiles live, so it needs the smaller tiles).
        fwd, bwd, min_block = (128, 64), (64, 64), 16  # tl.dot needs tiles of at least 16
        head_dim_padded = max(16, pl.next_power_of_2(head_dim))
        warps = (4, 4) if head_dim_padded <= 64 else (8, 8)
    if block_q is not None:
        fwd, bwd = (block_q, fwd[1]), (block_q, bwd[1])
    if block_k is not None:
        fwd, bwd = (fwd[0], block_k), (bwd[0], block_k)
    # No tile larger than the (power-of-two rounded) sequence: tiny inputs get tiny tiles.
    cap = max(min_block, pl.next_power_of_2(seq))
    fwd = (min(fwd[0], cap), min(fwd[1], cap))
    bwd = (min(bwd[0], cap), min(bwd[1], cap))
    multiple = max(*fwd, *bwd)  # powers of two: the largest is a multiple of all
    return _Options(
        causal=causal, sm_scale=1.0 / math.sqrt(head_dim), seq_len=seq,
        padded_len=pl.cdiv(seq, multiple) * multiple, head_dim_padded=head_dim_padded,
        fwd_blocks=fwd, bwd_blocks=bwd, interpret=interpret, num_warps=warps,
        num_stages=(2, 2))


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, /, *, causal: bool = True,
                    segment_ids: jax.Array | None = None, block_q: int | None = None,
                    block_k: int | None = None, interpret: bool | None = None) -> jax.Array:
    """Multi-head (or grouped-query) attention as Pallas flash-attention kernels.

    ``softmax(q @ k.T / sqrt(head_dim) + mask) @ v`` per (batch, head), with fp32 accumulation and
    an online softmax, so memory is linear in the sequence. Differentiable (``jax.custom_vjp``):
    the backward pass recomputes the probabilities from the log-sum-exp the forward saved.

    Masking: ``causal`` lets query ``i`` attend to keys ``j <= i``; ``segment_ids`` lets it attend
    only to keys with the same id (both apply when both are given). A query row with no allowed
    key (only possible for rows the kernel pads internally) gets output 0 and contributes no
    gradient; :func:`flash_attention_reference` follows the same convention.

    Sharding: the computation is independent per (batch, head), so batch and heads may be split
    across devices (kv heads split into as many contiguous pieces as the query heads); the sequence
    and head_dim must not be. The forward and backward run inside ``jax.jit`` functions named
    ``shardplan_kernel__flash_attention_fwd`` / ``..._bwd`` so that a planner can find them and
    wrap each in ``shard_map`` with those specs.

    Args:
      q: queries ``[batch, seq, heads, head_dim]``, float32, bfloat16 or float16.
      k: keys ``[batch, seq, kv_heads, head_dim]``; ``heads % kv_heads == 0``, same dtype as q.
      v: values, same shape and dtype as ``k``.
      causal: apply a causal mask.
      segment_ids: optional ``[batch, seq]`` integer ids; attention stays within equal ids.
      block_q: query tile (a power of two) for the forward and backward kernels; None picks a
        default for the backend and head_dim (GPU: 128 forward, 64 backward; CPU: 32).
      block_k: key tile (a power of two); None: GPU 64, CPU 32.
      interpret: run the kernels in Pallas interpret mode; None compiles them for the GPU (Triton)
        on a GPU backend and interprets them elsewhere.

    Returns:
      The attention output ``[batch, seq, heads, head_dim]`` in ``q``'s dtype.

    Raises:
      ConfigError: on a rank, shape, dtype, head-count or block-size mismatch.

    Example:
      >>> q = k = v = jnp.ones((1, 8, 2, 16), jnp.float32)
      >>> flash_attention(q, k, v, interpret=True).shape
      (1, 8, 2, 16)
    """
    _check_inputs(q, k, v, segment_ids)
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    opts = _make_options(q, causal=causal, block_q=block_q, block_k=block_k,
                         interpret=interpret)
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    return _attention(q, k, v, seg, opts)


def flash_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, /, *,
                              causal: bool = True,
                              segment_ids: jax.Array | None = None) -> jax.Array:
    """Plain-jnp attention in fp32 with :func:`flash_attention`'s semantics, for testing.

    Same layout, grouped-query rule, masks and fully-masked-row convention (output 0, zero
    gradient) as the kernel; materializes the ``[batch, heads, seq, seq]`` logits.

    Args:
      q: ``[batch, seq, heads, head_dim]``.
      k: ``[batch, seq, kv_heads, head_dim]``.
      v: like ``k``.
      causal: apply a causal mask.
      segment_ids: optional ``[batch, seq]`` integer ids.

    Returns:
      ``[batch, seq, heads, head_dim]`` in ``q``'s dtype.

    Raises:
      ConfigError: as :func:`flash_attention`.
    """
    _check_inputs(q, k, v, segment_ids)
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    hi = lax.Precision.HIGHEST
    qg = q.astype(jnp.float32).reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32), precision=hi)
    s = s / math.sqrt(head_dim)                              # [batch, kv_heads, group, seq, seq]
    mask = jnp.ones((batch, 1, 1, seq, seq), bool)
    if causal:
        mask &= jnp.tril(jnp.ones((seq, seq), bool))
    if segment_ids is not None:
        mask &= (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]
    m = lax.stop_gradient(jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    # exp(-inf) = 0 with a zero gradient, so masked entries never produce inf * 0 = nan.
    p = jnp.exp(jnp.where(mask, s - m, -jnp.inf))
    total = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p / jnp.where(total == 0, 1.0, total), v.astype(jnp.float32),
                   precision=hi)
    return o.reshape(batch, seq, heads, head_dim).astype(q.dtype)
