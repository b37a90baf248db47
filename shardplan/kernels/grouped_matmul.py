"""Grouped (ragged) matrix multiplication as Pallas kernels, for mixture-of-experts layers.

``grouped_matmul(lhs, rhs, group_sizes)`` has the semantics of :func:`jax.lax.ragged_dot`: the
rows of ``lhs [m, k]`` are split into consecutive groups of ``group_sizes [groups]`` rows, and
group ``g`` is multiplied by ``rhs[g] [k, n]``. Rows past ``sum(group_sizes)`` give zeros; a sum
past ``m`` is clipped at ``m`` (both as ``ragged_dot`` does).

Kernels (written here; Megablox's ``gmm``/``tgmm`` is the idea, not the code):

* forward and ``d_lhs``: one program per ``[block_m, block_n]`` output tile. An ``m`` tile may
  span several groups: the program iterates over exactly the groups its rows touch and runs the
  ``k`` loop for each with that group's ``rhs`` tile, the other groups' rows of ``lhs`` zeroed,
  into one float32 accumulator. ``d_lhs = dout @ rhs[g]^T`` is the same kernel reading ``rhs``
  transposed.
* ``d_rhs`` ("transposed grouped matmul", ``d_rhs[g] = lhs_g^T @ dout_g``): one program per
  group and ``[block_k, block_n]`` tile; it loops over the ``m`` tiles of its group's row range,
  masking the rows of the neighbouring groups.

Programs are ordered in bands of row tiles (:data:`SWIZZLE_TILES`) so that those running at the
same time share operand blocks in L2.

Accumulation is float32; outputs are in ``lhs``'s dtype. On a GPU backend the kernels are compiled
with Pallas' Triton lowering; elsewhere they run in interpret mode (plain HLO, slow but exact).

Kernel-aware planning: the forward runs inside a ``jax.jit`` named :data:`FWD_NAME` taking
``(lhs [m, k], rhs [groups, k, n], group_sizes [groups] int32)`` and returning ``out [m, n]``;
the backward inside one named :data:`BWD_NAME` taking ``(lhs, rhs, group_sizes, dout [m, n])``
and returning ``(d_lhs [m, k], d_rhs [groups, k, n])`` (the tiling is a static argument, not an
operand). In a differentiated train step they are ``jit`` equations (``pjit`` in older jax
versions) with ``params["name"]`` equal to these names. Legal splits (for a ``shard_map`` around
either call; ``group_sizes`` is always passed whole, replicated):

* ``n`` (last dim of ``rhs``, ``out`` and ``dout``): split with no data movement; ``d_rhs`` is
  split along ``n`` too, and ``d_lhs`` is a partial sum per device that needs a ``psum``.
* ``k`` (``lhs`` dim 1, ``rhs`` dim 1): each device holds a partial ``out`` that needs a
  ``psum``; ``d_lhs`` and ``d_rhs`` are then split along ``k`` with no communication.
* ``m`` (rows of ``lhs``, ``out``, ``dout``) with ``rhs`` replicated (data parallelism over
  tokens): legal if each device passes the sizes of its own row range,
  :func:`shard_group_sizes` ``(group_sizes, row_start, rows)``, a local computation on the
  replicated ``group_sizes``; ``d_rhs`` is then a partial sum per device (``psum``).
* ``groups`` (experts; ``rhs`` dim 0) with the matching rows of ``lhs``/``out``: expert
  parallelism, **not** a plain split. ``group_sizes`` is data-dependent, so each device must
  first receive exactly its experts' rows (tokens sorted by expert, then an all-to-all that sends
  each expert's row range to the device owning that expert, padded to a static capacity) and call
  the kernel with its ``rhs`` shard and the ``group_sizes`` of its own experts; the results go
  back with the inverse all-to-all. Splitting ``rhs`` dim 0 alone, without moving rows, is wrong.

Example:
    >>> import jax.numpy as jnp
    >>> lhs = jnp.ones((5, 4)); rhs = jnp.stack([jnp.eye(4), 2 * jnp.eye(4)])
    >>> grouped_matmul(lhs, rhs, jnp.array([2, 2], jnp.int32))[:, 0].tolist()
    [1.0, 1.0, 2.0, 2.0, 0.0]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.typing import ArrayLike

from shardplan.errors import ConfigError, format_error
from shardplan.kernels.registry import call

__all__ = ["BWD_NAME", "FWD_NAME", "grouped_matmul", "shard_group_sizes"]

FWD_NAME = "shardplan_kernel__grouped_matmul_fwd"
"""``params["name"]`` of the ``pjit`` equation that runs the forward kernel."""

BWD_NAME = "shardplan_kernel__grouped_matmul_bwd"
"""``params["name"]`` of the ``pjit`` equation that runs both backward kernels."""

DEFAULT_BLOCK_M = 128
"""Rows of ``lhs`` per program; smaller wastes less at group boundaries, larger reuses ``rhs``."""

DEFAULT_BLOCK_K = 64
"""Contraction width per step of the inner loop (one ``[block_m, block_k]`` ``lhs`` tile)."""

DEFAULT_BLOCK_N = 128
"""Output columns per program."""

MIN_BLOCK = 16
"""Smallest tile side: Triton's ``tt.dot`` needs every dimension >= 16."""

TRITON_NUM_WARPS = 4
"""Warps per Triton program (4 suits 128x128 tiles with a float32 accumulator)."""

TRITON_NUM_STAGES = 3
"""Software-pipelining depth of the ``k`` loop on the GPU."""

SWIZZLE_TILES = 8
"""Programs run in bands of this many row tiles (Triton's "grouped ordering"): the tiles that run
at the same time share a few ``lhs`` row blocks and ``rhs`` column blocks, which stay in L2."""

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """Static kernel configuration (hashable: a ``custom_vjp`` non-diff argument and jit static)."""

    block_m: int
    block_k: int
    block_n: int
    interpret: bool


def _bad(argument: str, problem: str, value: object, remedy: str) -> ConfigError:
    """A ConfigError naming the ``grouped_matmul`` argument, its value and a remedy."""
    return ConfigError(format_error(
        f"grouped_matmul: {argument} {problem}.", where=f"grouped_matmul({argument}=...)",
        value=value, remedy=remedy, has_value=True))


def _check_inputs(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> None:
    """Raises a ConfigError for a bad rank, dtype or a shape mismatch between the arguments."""
    if lhs.ndim != 2:
        raise _bad("lhs", "must be 2-D [m, k]", lhs.shape, "flatten the token dims into m")
    if rhs.ndim != 3:
        raise _bad("rhs", "must be 3-D [groups, k, n]", rhs.shape, "stack one [k, n] per group")
    if group_sizes.ndim != 1:
        raise _bad("group_sizes", "must be 1-D [groups]", group_sizes.shape,
                   "pass one row count per group")
    if lhs.dtype not in _DTYPES:
        raise _bad("lhs", "has an unsupported dtype", str(lhs.dtype),
                   "use float32, bfloat16 or float16")
    if rhs.dtype != lhs.dtype:
        raise _bad("rhs", f"must have lhs's dtype {lhs.dtype}", str(rhs.dtype),
                   f"cast rhs to {lhs.dtype}")
    if group_sizes.dtype != jnp.int32:
        raise _bad("group_sizes", "must be int32", str(group_sizes.dtype),
                   "use group_sizes.astype(jnp.int32)")
    if rhs.shape[1] != lhs.shape[1]:
        raise _bad("rhs", f"has k={rhs.shape[1]} but lhs has k={lhs.shape[1]}", rhs.shape,
                   "make rhs [groups, lhs.shape[1], n]")
    if group_sizes.shape[0] != rhs.shape[0]:
        raise _bad("group_sizes", f"has {group_sizes.shape[0]} groups but rhs has {rhs.shape[0]}",
                   group_sizes.shape, "pass one size per rhs group (rhs.shape[0])")


def _block(argument: str, requested: int | None, default: int, dim: int) -> int:
    """The tile side: the request (or default), shrunk to the padded ``dim`` but >= 16."""
    if requested is not None and (
        not isinstance(requested, int) or requested < MIN_BLOCK or requested & (requested - 1)
    ):
        raise _bad(argument, f"must be a power of two >= {MIN_BLOCK}", requested,
                   "use 16, 32, 64 or 128 (or None for the default)")
    block = default if requested is None else requested
    return max(MIN_BLOCK, min(block, pl.next_power_of_2(max(dim, 1))))


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def _pad_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Zero-pads ``x`` at the end of each dim to ``shape`` (no-op when already that shape)."""
    if x.shape == shape:
        return x
    return jnp.pad(x, [(0, want - have) for have, want in zip(x.shape, shape, strict=True)])


def _group_offsets(group_sizes: jax.Array, rows: int, padded_rows: int) -> jax.Array:
    """Group boundaries ``[0, end_0, ..., end_{G-1}]`` clipped to ``rows``, padded to a power of 2.

    The padding entries are ``padded_rows + 1``, larger than every row index, so that "number of
    offsets <= r" minus one is the group containing row ``r`` (``groups`` when past the last).
    Triton loads only power-of-two sized vectors, hence the padding.
    """
    ends = jnp.clip(jnp.cumsum(group_sizes), 0, rows).astype(jnp.int32)  # [groups]
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])  # [groups + 1]
    size = pl.next_power_of_2(offsets.shape[0])
    return jnp.pad(offsets, (0, size - offsets.shape[0]), constant_values=padded_rows + 1)


def _precision(dtype: Any) -> jax.lax.Precision:
    """Full float32 products for float32 inputs (no TF32 on the GPU); native otherwise."""
    if jnp.dtype(dtype) == jnp.float32:
        return jax.lax.Precision.HIGHEST
    return jax.lax.Precision.DEFAULT


def _cost(flops: int, *arrays: jax.Array | jax.ShapeDtypeStruct) -> pl.CostEstimate:
    """A CostEstimate of ``flops`` reading/writing each of ``arrays`` once (for XLA's scheduler)."""
    nbytes = sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)
    return pl.CostEstimate(flops=int(flops), transcendentals=0, bytes_accessed=int(nbytes))


def _compiler_params(interpret: bool) -> Any:
    """Triton compiler parameters on the GPU; none in interpret mode."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton  # GPU only: keep CPU imports light

    return pltriton.CompilerParams(num_warps=TRITON_NUM_WARPS, num_stages=TRITON_NUM_STAGES)


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


def _swizzle(program: jax.Array, row_tiles: int, col_tiles: int) -> tuple[jax.Array, jax.Array]:
    """Tile ``(row, col)`` of the ``program``-th program, in bands of :data:`SWIZZLE_TILES` rows.

    Within a band, programs walk down the band's rows first, then across the columns (Triton's
    matmul tutorial, "L2 cache optimizations"); the last band may be narrower.
    """
    band_programs = SWIZZLE_TILES * col_tiles
    band = jax.lax.div(program, band_programs)
    first_row = band * SWIZZLE_TILES
    band_rows = jnp.minimum(row_tiles - first_row, SWIZZLE_TILES)
    within = jax.lax.rem(program, band_programs)
    return first_row + jax.lax.rem(within, band_rows), jax.lax.div(within, band_rows)


def _gmm_kernel(offsets_ref: Any, lhs_ref: Any, rhs_ref: Any, out_ref: Any, *, num_groups: int,
                block_m: int, block_k: int, block_n: int, row_tiles: int, col_tiles: int,
                num_k_tiles: int, transpose_rhs: bool, precision: jax.lax.Precision) -> None:
    """One ``[block_m, block_n]`` tile of ``out = lhs @ rhs[group(row)]`` (or ``rhs^T``).

    Refs: ``offsets [P]`` int32, ``lhs [block_m, K]``, ``rhs [G, K, N]`` (``[G, N, K]`` when
    ``transpose_rhs``), ``out [block_m, block_n]``.
    """
    i, j = _swizzle(pl.program_id(0), row_tiles, col_tiles)
    row0, col0 = i * block_m, j * block_n
    rows = row0 + jnp.arange(block_m, dtype=jnp.int32)  # [block_m]
    offsets = offsets_ref[...]  # [P]
    # Groups containing the tile's first and last rows; the tile touches exactly those between.
    first = jnp.sum((offsets <= row0).astype(jnp.int32)) - 1
    last = jnp.sum((offsets <= row0 + block_m - 1).astype(jnp.int32)) - 1
    last = jnp.minimum(last, num_groups - 1)
    contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))

    def group_body(g: jax.Array, acc: jax.Array) -> jax.Array:
        start, end = offsets_ref[g], offsets_ref[g + 1]
        in_group = (rows >= start) & (rows < end)  # [block_m]
        # An empty group inside the tile runs no k steps.
        overlaps = jnp.maximum(start, row0) < jnp.minimum(end, row0 + block_m)
        steps = jnp.where(overlaps, num_k_tiles, 0)

        def k_body(kk: jax.Array, acc: jax.Array) -> jax.Array:
            a = lhs_ref[:, pl.ds(kk * block_k, block_k)]  # [block_m, block_k]
            # Zeroing the other groups' rows lets all groups share one accumulator (a second
            # [block_m, block_n] float32 array would not fit in registers next to it).
            a = jnp.where(in_group[:, None], a, jnp.zeros_like(a))
            if transpose_rhs:
                b = rhs_ref[g, pl.ds(col0, block_n), pl.ds(kk * block_k, block_k)]  # [bn, bk]
            else:
                b = rhs_ref[g, pl.ds(kk * block_k, block_k), pl.ds(col0, block_n)]  # [bk, bn]
            return acc + jax.lax.dot_general(
                a, b, (contract, ((), ())), precision=precision,
                preferred_element_type=jnp.float32)

        return jax.lax.fori_loop(0, steps, k_body, acc)

    acc = jax.lax.fori_loop(first, last + 1, group_body,
                            jnp.zeros((block_m, block_n), jnp.float32))  # [block_m, block_n]
    out_ref[...] = acc.astype(out_ref.dtype)


def _tgmm_kernel(offsets_ref: Any, lhs_ref: Any, dout_ref: Any, out_ref: Any, *, block_m: int,
                 precision: jax.lax.Precision) -> None:
    """One ``[block_k, block_n]`` tile of ``d_rhs[g] = lhs_g^T @ dout_g``.

    Refs: ``offsets [P]`` int32, ``lhs [M, block_k]``, ``dout [M, block_n]``,
    ``out [block_k, block_n]`` (the group dim squeezed).
    """
    g = pl.program_id(1)
    start, end = offsets_ref[g], offsets_ref[g + 1]
    first_tile = start // block_m
    # An empty group loops over no tile and leaves a zero gradient.
    stop_tile = jnp.where(end > start, (end + block_m - 1) // block_m, first_tile)

    def m_body(t: jax.Array, acc: jax.Array) -> jax.Array:
        rows = t * block_m + jnp.arange(block_m, dtype=jnp.int32)  # [block_m]
        in_group = (rows >= start) & (rows < end)
        a = lhs_ref[pl.ds(t * block_m, block_m), :]  # [block_m, block_k]
        a = jnp.where(in_group[:, None], a, jnp.zeros_like(a))
        d = dout_ref[pl.ds(t * block_m, block_m), :]  # [block_m, block_n]
        return acc + jax.lax.dot_general(
            a, d, (((0,), (0,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(first_tile, stop_tile, m_body,
                            jnp.zeros(out_ref.shape, jnp.float32))  # [block_k, block_n]
    out_ref[...] = acc.astype(out_ref.dtype)


def _gmm_call(offsets: jax.Array, lhs: jax.Array, rhs: jax.Array, *, transpose_rhs: bool,
              block_m: int, block_k: int, block_n: int, interpret: bool) -> jax.Array:
    """``out [M, N]`` for padded ``lhs [M, K]`` and ``rhs [G, K, N]`` (``[G, N, K]`` transposed)."""
    padded_m, padded_k = lhs.shape
    num_groups = rhs.shape[0]
    padded_n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_shape = jax.ShapeDtypeStruct((padded_m, padded_n), lhs.dtype)
    row_tiles, col_tiles = padded_m // block_m, padded_n // block_n
    kernel = functools.partial(
        _gmm_kernel, num_groups=num_groups, block_m=block_m, block_k=block_k, block_n=block_n,
        row_tiles=row_tiles, col_tiles=col_tiles, num_k_tiles=padded_k // block_k,
        transpose_rhs=transpose_rhs, precision=_precision(lhs.dtype))
    tile = functools.partial(_swizzle, row_tiles=row_tiles, col_tiles=col_tiles)
    return pl.pallas_call(
        kernel,
        grid=(row_tiles * col_tiles,),
        in_specs=[
            pl.BlockSpec(offsets.shape, lambda p: (0,)),
            pl.BlockSpec((block_m, padded_k), lambda p: (tile(p)[0], 0)),
            pl.BlockSpec(rhs.shape, lambda p: (0, 0, 0)),  # the group is chosen in the kernel
        ],
        out_specs=pl.BlockSpec((block_m, block_n), tile),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=_compiler_params(interpret),
        # Each row is in at most one group: 2 M K N FLOPs (more only where tiles span groups).
        cost_estimate=_cost(2 * padded_m * padded_k * padded_n, lhs, rhs, out_shape),
        name="shardplan_gmm_t" if transpose_rhs else "shardplan_gmm",
    )(offsets, lhs, rhs)


def _tgmm_call(offsets: jax.Array, lhs: jax.Array, dout: jax.Array, num_groups: int, *,
               block_m: int, block_k: int, block_n: int, interpret: bool) -> jax.Array:
    """``d_rhs [G, K, N]`` for padded ``lhs [M, K]`` and ``dout [M, N]``."""
    padded_m, padded_k = lhs.shape
    padded_n = dout.shape[1]
    out_shape = jax.ShapeDtypeStruct((num_groups, padded_k, padded_n), lhs.dtype)
    kernel = functools.partial(_tgmm_kernel, block_m=block_m, precision=_precision(lhs.dtype))
    tile = functools.partial(_swizzle, row_tiles=padded_k // block_k, col_tiles=padded_n // block_n)
    return pl.pallas_call(
        kernel,
        # The group is the slow grid axis: programs running together read the same group's rows.
        grid=((padded_k // block_k) * (padded_n // block_n), num_groups),
        in_specs=[
            pl.BlockSpec(offsets.shape, lambda p, g: (0,)),
            pl.BlockSpec((padded_m, block_k), lambda p, g: (0, tile(p)[0])),
            pl.BlockSpec((padded_m, block_n), lambda p, g: (0, tile(p)[1])),
        ],
        out_specs=pl.BlockSpec((pl.squeezed, block_k, block_n),
                               lambda p, g: (g, *tile(p))),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=_compiler_params(interpret),
        cost_estimate=_cost(2 * padded_m * padded_k * padded_n, lhs, dout, out_shape),
        name="shardplan_tgmm",
    )(offsets, lhs, dout)


# ------------------------------------------------------------------------------------------------
# Named jits (what the planner sees) and the custom_vjp
# ------------------------------------------------------------------------------------------------


def _padded_dims(lhs: jax.Array, rhs: jax.Array, tiling: _Tiling) -> tuple[int, int, int]:
    """``(M, K, N)``: ``m``, ``k`` and ``n`` rounded up to their tile sides."""
    return (_round_up(lhs.shape[0], tiling.block_m), _round_up(lhs.shape[1], tiling.block_k),
            _round_up(rhs.shape[2], tiling.block_n))


@functools.partial(jax.jit, static_argnames=("tiling",))
def shardplan_kernel__grouped_matmul_fwd(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                                         *, tiling: _Tiling) -> jax.Array:
    """The forward kernel: ``out [m, n]`` from ``lhs [m, k]``, ``rhs [G, k, n]``, sizes ``[G]``."""
    (m, _), n = lhs.shape, rhs.shape[2]
    padded_m, padded_k, padded_n = _padded_dims(lhs, rhs, tiling)
    offsets = _group_offsets(group_sizes, m, padded_m)
    out = _gmm_call(
        offsets, _pad_to(lhs, (padded_m, padded_k)),
        _pad_to(rhs, (rhs.shape[0], padded_k, padded_n)), transpose_rhs=False,
        block_m=tiling.block_m, block_k=tiling.block_k, block_n=tiling.block_n,
        interpret=tiling.interpret)
    return out[:m, :n]


@functools.partial(jax.jit, static_argnames=("tiling",))
def shardplan_kernel__grouped_matmul_bwd(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, dout: jax.Array, *, tiling: _Tiling
) -> tuple[jax.Array, jax.Array]:
    """Both backward kernels: ``(d_lhs [m, k], d_rhs [G, k, n])`` from the inputs and ``dout``."""
    (m, k), (num_groups, _, n) = lhs.shape, rhs.shape
    padded_m, padded_k, padded_n = _padded_dims(lhs, rhs, tiling)
    offsets = _group_offsets(group_sizes, m, padded_m)
    lhs_p = _pad_to(lhs, (padded_m, padded_k))  # [M, K]
    rhs_p = _pad_to(rhs, (num_groups, padded_k, padded_n))  # [G, K, N]
    dout_p = _pad_to(dout.astype(lhs.dtype), (padded_m, padded_n))  # [M, N]
    # d_lhs = dout @ rhs[g]^T: the forward kernel contracting N (tiles of block_n) into K columns.
    d_lhs = _gmm_call(offsets, dout_p, rhs_p, transpose_rhs=True, block_m=tiling.block_m,
                      block_k=tiling.block_n, block_n=tiling.block_k, interpret=tiling.interpret)
    d_rhs = _tgmm_call(offsets, lhs_p, dout_p, num_groups, block_m=tiling.block_m,
                       block_k=tiling.block_k, block_n=tiling.block_n, interpret=tiling.interpret)
    return d_lhs[:m, :k], d_rhs[:, :k, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                    tiling: _Tiling) -> jax.Array:
    # Through the registry, so that the runtime can re-run the call on each device's blocks.
    return call(shardplan_kernel__grouped_matmul_fwd, lhs, rhs, group_sizes, tiling=tiling)


def _grouped_matmul_fwd(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                        tiling: _Tiling) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    out = call(shardplan_kernel__grouped_matmul_fwd, lhs, rhs, group_sizes, tiling=tiling)
    return out, (lhs, rhs, group_sizes)


def _grouped_matmul_bwd(tiling: _Tiling, residuals: tuple[jax.Array, ...],
                        dout: jax.Array) -> tuple[jax.Array, jax.Array, None]:
    lhs, rhs, group_sizes = residuals
    d_lhs, d_rhs = call(shardplan_kernel__grouped_matmul_bwd, lhs, rhs, group_sizes, dout,
                        tiling=tiling)
    return d_lhs, d_rhs, None  # group_sizes is integer: no cotangent


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def shard_group_sizes(group_sizes: jax.Array, row_start: jax.Array | int, rows: int) -> jax.Array:
    """The group sizes of rows ``[row_start, row_start + rows)`` of a grouped ``lhs``.

    For splitting ``m`` in a ``shard_map``: device ``i`` holds rows ``[i * rows, (i + 1) * rows)``
    and calls ``grouped_matmul(lhs_shard, rhs, shard_group_sizes(group_sizes, i * rows, rows))``;
    the concatenated results equal the unsplit call.

    Args:
      group_sizes: ``[groups]`` int32 sizes of the whole ``lhs``.
      row_start: first row of the shard (e.g. ``jax.lax.axis_index(axis) * rows``).
      rows: rows in the shard.

    Returns:
      ``[groups]`` int32: how many of each group's rows fall inside the shard.

    Example:
      >>> shard_group_sizes(jnp.array([3, 0, 4], jnp.int32), 2, 4).tolist()
      [1, 0, 3]
    """
    ends = jnp.cumsum(group_sizes)  # [groups]
    starts = ends - group_sizes  # [groups]
    stop = row_start + rows
    return (jnp.clip(ends, row_start, stop) - jnp.clip(starts, row_start, stop)).astype(jnp.int32)


def grouped_matmul(lhs: ArrayLike, rhs: ArrayLike, group_sizes: ArrayLike, /, *,
                   block_m: int | None = None, block_k: int | None = None,
                   block_n: int | None = None, interpret: bool | None = None) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` as a Pallas kernel with a Pallas backward.

    Rows ``[sum(group_sizes[:g]), sum(group_sizes[:g+1]))`` of ``lhs`` are multiplied by
    ``rhs[g]``; rows past ``sum(group_sizes)`` (clipped to ``m``) give zeros, as in ``ragged_dot``.
    Group sizes must be non-negative (like ``ragged_dot``, the result is unspecified otherwise).

    Args:
      lhs: ``[m, k]`` float32, bfloat16 or float16 (e.g. tokens sorted by expert).
      rhs: ``[groups, k, n]`` of ``lhs``'s dtype (e.g. one weight matrix per expert).
      group_sizes: ``[groups]`` int32 row counts, summing to at most ``m``.
      block_m: rows per tile (power of two >= 16; default 128, shrunk to fit small inputs).
      block_k: contraction width per inner step (default 64).
      block_n: output columns per tile (default 128).
      interpret: True runs the kernels in interpret mode; None (default) compiles them on a GPU
        backend (Triton) and interprets them elsewhere.

    Returns:
      ``[m, n]`` in ``lhs``'s dtype, accumulated in float32; differentiable in ``lhs`` and ``rhs``.

    Raises:
      ConfigError: a wrong rank or dtype, ``k`` or the group count disagreeing between the
        arguments, or a block size that is not a power of two >= 16.

    Example:
      >>> lhs = jnp.ones((3, 16)); rhs = jnp.ones((2, 16, 16))
      >>> grouped_matmul(lhs, rhs, jnp.array([1, 1], jnp.int32)).sum(axis=1).tolist()
      [256.0, 256.0, 0.0]
    """
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    _check_inputs(lhs, rhs, group_sizes)
    if 0 in lhs.shape or 0 in rhs.shape:  # nothing to multiply: ragged_dot gives zeros too
        return jnp.zeros((lhs.shape[0], rhs.shape[2]), lhs.dtype)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    tiling = _Tiling(
        block_m=_block("block_m", block_m, DEFAULT_BLOCK_M, lhs.shape[0]),
        block_k=_block("block_k", block_k, DEFAULT_BLOCK_K, lhs.shape[1]),
        block_n=_block("block_n", block_n, DEFAULT_BLOCK_N, rhs.shape[2]),
        interpret=bool(interpret),
    )
    return _grouped_matmul(lhs, rhs, group_sizes, tiling)
