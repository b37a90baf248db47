"""Layers shared by the reference models: attention, MLPs, rotary embeddings, block stacks.

Everything here is plain Flax NNX and ``jax.numpy``: full ``[seq, seq]`` attention scores with a
causal mask, einsum projections, no fused kernels and no tracing helpers. The models are meant to
look like ordinary user code, which is what the planner has to read.

Block stacks come in two layouts (see :func:`make_blocks` and :func:`run_blocks`):

* a list (``scan_layers=False``): ``nnx.List`` of blocks, state paths ``blocks/0/attn/q/kernel``;
* a stack (``scan_layers=True``): one block whose parameters have a leading ``n_layers`` axis,
  state paths ``blocks/attn/q/kernel``, applied with ``nnx.scan`` (one ``scan`` in the jaxpr).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
    "INIT_STD",
    "Block",
    "CausalSelfAttention",
    "GeluMLP",
    "SwiGLU",
    "apply_rope",
    "attention",
    "causal_attention",
    "make_blocks",
    "residual_init",
    "rope_tables",
    "run_blocks",
    "to_dtype",
]

INIT_STD: float = 0.02
"""Standard deviation of the normal initialiser of kernels and embeddings (GPT-2, Llama)."""

_DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def to_dtype(name: str) -> Any:
    """Maps a config dtype name (``"float32"``, ``"bfloat16"``) to the jnp dtype.

    Example:
      >>> to_dtype("bfloat16")
      <class 'jax.numpy.bfloat16'>
    """
    return _DTYPES[name]


def residual_init(n_layers: int) -> nnx.Initializer:
    """Initialiser of projections that write into the residual stream.

    GPT-2 scales them by ``1 / sqrt(2 * n_layers)`` (two residual writes per block) so the
    residual stream's variance does not grow with depth (Radford et al. 2019, section 2.3).
    """
    return nnx.initializers.normal(INIT_STD / math.sqrt(2 * n_layers))


class Block(Protocol):
    """A transformer block: ``block(x, *args) -> (x, aux_loss)`` with x ``[batch, seq, d_model]``."""

    def __call__(self, x: jax.Array, *args: jax.Array) -> tuple[jax.Array, jax.Array]: ...


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention with full ``[seq, seq]`` scores; k/v may have fewer heads (GQA).

    Args:
      q: queries ``[batch, seq, n_heads, head_dim]``.
      k: keys ``[batch, seq, n_kv_heads, head_dim]``; ``n_heads`` must be a multiple of
        ``n_kv_heads``. Each key/value head serves ``n_heads // n_kv_heads`` query heads.
      v: values, shaped like ``k``.

    Returns:
      ``[batch, seq, n_heads, head_dim]`` in q's dtype. The softmax runs in float32.

    Example:
      >>> x = jnp.ones((1, 4, 2, 8))
      >>> causal_attention(x, x[:, :, :1], x[:, :, :1]).shape
      (1, 4, 2, 8)
    """
    n_heads, n_kv_heads = q.shape[2], k.shape[2]
    if n_kv_heads != n_heads:
        k = jnp.repeat(k, n_heads // n_kv_heads, axis=2)  # [batch, seq, n_heads, head_dim]
        v = jnp.repeat(v, n_heads // n_kv_heads, axis=2)  # [batch, seq, n_heads, head_dim]
    seq, head_dim = q.shape[1], q.shape[3]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)  # [batch, heads, q, k]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))  # [q, k]
    scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [batch, heads, q, k]
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)  # [batch, seq, heads, head_dim]


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Cosines and sines of rotary position embeddings (Su et al. 2021, RoFormer eq. 34).

    Frequency ``i`` of ``head_dim // 2`` is ``theta ** (-2 i / head_dim)``; position ``p`` rotates
    pair ``i`` by the angle ``p * frequency_i``.

    Returns:
      ``(cos, sin)``, each float32 ``[seq_len, head_dim // 2]``.

    Example:
      >>> cos, sin = rope_tables(16, 8, 10000.0)
      >>> cos.shape
      (16, 4)
    """
    frequencies = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * frequencies[None, :]  # [seq, hd/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates the two halves of each head of ``x`` by the position angles (the HF layout).

    Args:
      x: ``[batch, seq, heads, head_dim]``.
      cos: ``[seq, head_dim // 2]`` from :func:`rope_tables`.
      sin: ``[seq, head_dim // 2]``.

    Returns:
      ``x`` with rotary position information, same shape and dtype.
    """
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # each [batch, seq, heads, hd/2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # [1, seq, 1, hd/2]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)  # [batch, seq, heads, head_dim]


class CausalSelfAttention(nnx.Module):
    """Causal multi-head self-attention with separate ``q``, ``k``, ``v``, ``o`` projections.

    ``n_kv_heads < n_heads`` is grouped-query attention (Ainslie et al. 2023): ``k`` and ``v``
    project to ``n_kv_heads * head_dim`` and each of their heads is shared by
    ``n_heads // n_kv_heads`` query heads. With rotary tables passed to the call, q and k are
    rotated (Llama); without, positions must already be in ``x`` (GPT).

    Example:
      >>> attn = CausalSelfAttention(64, n_heads=4, n_kv_heads=2, use_bias=False,
      ...                            n_layers=2, rngs=nnx.Rngs(0))
      >>> attn(jnp.ones((2, 8, 64))).shape
      (2, 8, 64)
    """

    def __init__(
        self,
        d_model: int,
        *,
        n_heads: int,
        n_kv_heads: int,
        use_bias: bool,
        n_layers: int,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        impl: str = "xla",
        rngs: nnx.Rngs,
    ) -> None:
        self.impl = impl
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = d_model // n_heads
        kv_width = n_kv_heads * self.head_dim

        def linear(d_in: int, d_out: int, init: nnx.Initializer) -> nnx.Linear:
            return nnx.Linear(
                d_in,
                d_out,
                use_bias=use_bias,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=init,
                rngs=rngs,
            )

        self.q = linear(d_model, d_model, nnx.initializers.normal(INIT_STD))
        self.k = linear(d_model, kv_width, nnx.initializers.normal(INIT_STD))
        self.v = linear(d_model, kv_width, nnx.initializers.normal(INIT_STD))
        self.o = linear(d_model, d_model, residual_init(n_layers))

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """Attends ``x [batch, seq, d_model]`` causally; ``rope`` = ``(cos, sin)`` or None."""
        batch, seq, _ = x.shape
        q = self.q(x).reshape(batch, seq, self.n_heads, self.head_dim)  # [b, s, heads, hd]
        k = self.k(x).reshape(batch, seq, self.n_kv_heads, self.head_dim)  # [b, s, kv_heads, hd]
        v = self.v(x).reshape(batch, seq, self.n_kv_heads, self.head_dim)  # [b, s, kv_heads, hd]
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = attention(q, k, v, impl=self.impl)  # [batch, seq, heads, head_dim]
        return self.o(out.reshape(batch, seq, self.n_heads * self.head_dim))  # [b, s, d_model]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str = "xla") -> jax.Array:
    """Causal attention computed as ``impl`` says (``ModelConfig.attention_impl``): ``"xla"``
    (:func:`causal_attention`), ``"pallas"`` (:func:`shardplan.kernels.flash_attention`) or
    ``"cudnn"`` (``jax.nn.dot_product_attention(implementation="cudnn")``, GPU only). Layouts
    as :func:`causal_attention`.

    Raises:
      ConfigError: ``impl`` is unknown, or ``"cudnn"`` off a GPU.
    """
    if impl == "xla":
        return causal_attention(q, k, v)
    if impl == "pallas":
        from shardplan.kernels import flash_attention

        return flash_attention(q, k, v, causal=True)
    if impl == "cudnn" and jax.default_backend() == "gpu":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    from shardplan.errors import ConfigError, format_error

    raise ConfigError(format_error(
        "cuDNN attention needs a GPU." if impl == "cudnn" else "Unknown attention.",
        where="model attention_impl", value=impl,
        remedy="use attention_impl: xla or pallas here (cudnn runs on GPUs only)"
        if impl == "cudnn" else "use one of xla, pallas, cudnn"))


# ---------------------------------------------------------------------------------------------
# MLPs
# ---------------------------------------------------------------------------------------------


class GeluMLP(nnx.Module):
    """The GPT-2 MLP: ``down(gelu(up(x)))`` with biases, hidden width ``d_ff``.

    Example:
      >>> GeluMLP(64, 256, n_layers=2, rngs=nnx.Rngs(0))(jnp.ones((2, 8, 64))).shape
      (2, 8, 64)
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        n_layers: int,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        common = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        self.up = nnx.Linear(d_model, d_ff, kernel_init=nnx.initializers.normal(INIT_STD), **common)
        self.down = nnx.Linear(d_ff, d_model, kernel_init=residual_init(n_layers), **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps ``[batch, seq, d_model]`` to ``[batch, seq, d_model]``."""
        h = jax.nn.gelu(self.up(x), approximate=True)  # [batch, seq, d_ff]
        return self.down(h)  # [batch, seq, d_model]


class SwiGLU(nnx.Module):
    """The Llama MLP: ``down(silu(gate(x)) * up(x))`` without biases (Shazeer 2020).

    Example:
      >>> SwiGLU(64, 128, n_layers=2, rngs=nnx.Rngs(0))(jnp.ones((2, 8, 64))).shape
      (2, 8, 64)
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        n_layers: int,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        common = {"use_bias": False, "dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        normal = nnx.initializers.normal(INIT_STD)
        self.gate = nnx.Linear(d_model, d_ff, kernel_init=normal, **common)
        self.up = nnx.Linear(d_model, d_ff, kernel_init=normal, **common)
        self.down = nnx.Linear(d_ff, d_model, kernel_init=residual_init(n_layers), **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps ``[batch, seq, d_model]`` to ``[batch, seq, d_model]``."""
        h = jax.nn.silu(self.gate(x)) * self.up(x)  # [batch, seq, d_ff]
        return self.down(h)  # [batch, seq, d_model]


# ---------------------------------------------------------------------------------------------
# Block stacks
# ---------------------------------------------------------------------------------------------


def make_blocks(
    make_block: Callable[[nnx.Rngs], nnx.Module],
    n_layers: int,
    *,
    scan_layers: bool,
    rngs: nnx.Rngs,
) -> nnx.Module:
    """Creates ``n_layers`` blocks, as a list or as one stacked block.

    Args:
      make_block: builds one block from an ``nnx.Rngs``.
      n_layers: number of blocks.
      scan_layers: False gives ``nnx.List([block_0, ...])``; True gives one block whose every
        variable has a leading ``n_layers`` axis, created by ``nnx.vmap`` over split rngs so each
        layer gets its own initial values.
      rngs: the random streams; split ``n_layers`` ways when stacking.

    Returns:
      The blocks, to be applied with :func:`run_blocks`.
    """
    if not scan_layers:
        return nnx.List([make_block(rngs) for _ in range(n_layers)])

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_stack(rngs: nnx.Rngs) -> nnx.Module:
        return make_block(rngs)

    return make_stack(rngs)


def run_blocks(
    blocks: nnx.Module, x: jax.Array, *args: Any, scan_layers: bool
) -> tuple[jax.Array, jax.Array]:
    """Applies the blocks from :func:`make_blocks` in order and sums their auxiliary losses.

    Args:
      blocks: an ``nnx.List`` of blocks, or one stacked block when ``scan_layers``.
      x: the residual stream ``[batch, seq, d_model]``.
      *args: extra inputs every block gets unchanged (e.g. rotary tables); broadcast in the scan.
      scan_layers: apply a stacked block with ``nnx.scan`` (one ``scan`` of length ``n_layers``
        whose body is one block) instead of a Python loop over a list.

    Returns:
      ``(x, aux_sum)``: the output stream and the float32 sum of the blocks' auxiliary losses.
    """
    aux = jnp.zeros((), jnp.float32)
    if not scan_layers:
        for block in blocks:  # type: ignore[attr-defined]
            x, block_aux = block(x, *args)
            aux = aux + block_aux
        return x, aux

    @nnx.scan(in_axes=(nnx.Carry, 0, *(None for _ in args)), out_axes=nnx.Carry)
    def scan_body(
        carry: tuple[jax.Array, jax.Array], block: Block, *block_args: Any
    ) -> tuple[jax.Array, jax.Array]:
        h, total = carry
        h, block_aux = block(h, *block_args)
        return h, total + block_aux

    return scan_body((x, aux), blocks, *args)
