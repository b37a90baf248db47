"""Llama 2 style decoder-only transformer in Flax NNX.

Token embedding ``embed``; pre-RMSNorm blocks (``attn_norm``, ``attn``, ``mlp_norm``, ``mlp``)
without biases, rotary position embeddings on q and k, grouped-query attention (``n_kv_heads``
key/value heads, repeated to ``n_heads``) and a SwiGLU MLP (``gate``, ``up``, ``down``); a final
``norm`` and an untied ``lm_head``. Follows Touvron et al. 2023 (Llama 2).

Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from shardplan_models.config import load_model_config
    >>> model = Llama(load_model_config("llama-tiny"), rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32))[0].shape
    (2, 16, 256)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from shardplan_models.common import (
    INIT_STD,
    CausalSelfAttention,
    SwiGLU,
    make_blocks,
    rope_tables,
    run_blocks,
    to_dtype,
)
from shardplan_models.config import LlamaConfig

__all__ = ["Llama", "LlamaBlock", "llama_attention", "rms_norm"]


def llama_attention(config: LlamaConfig, *, rngs: nnx.Rngs) -> CausalSelfAttention:
    """Builds the bias-free grouped-query attention of a Llama-style block."""
    return CausalSelfAttention(
        config.d_model,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        use_bias=False,
        n_layers=config.n_layers,
        dtype=to_dtype(config.dtype),
        param_dtype=to_dtype(config.param_dtype),
        impl=config.attention_impl,
        rngs=rngs,
    )


def rms_norm(config: LlamaConfig, *, rngs: nnx.Rngs) -> nnx.RMSNorm:
    """Builds an RMSNorm of width ``d_model`` (a learned scale, no bias)."""
    return nnx.RMSNorm(
        config.d_model,
        epsilon=config.norm_eps,
        dtype=to_dtype(config.dtype),
        param_dtype=to_dtype(config.param_dtype),
        rngs=rngs,
    )


class LlamaBlock(nnx.Module):
    """One Llama block: ``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = rms_norm(config, rngs=rngs)
        self.attn = llama_attention(config, rngs=rngs)
        self.mlp_norm = rms_norm(config, rngs=rngs)
        self.mlp = SwiGLU(
            config.d_model,
            config.d_ff,
            n_layers=config.n_layers,
            dtype=to_dtype(config.dtype),
            param_dtype=to_dtype(config.param_dtype),
            rngs=rngs,
        )

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Maps ``[batch, seq, d_model]`` to itself given rotary tables; the aux loss is 0."""
        x = x + self.attn(self.attn_norm(x), (cos, sin))  # [batch, seq, d_model]
        x = x + self.mlp(self.mlp_norm(x))  # [batch, seq, d_model]
        return x, jnp.zeros((), jnp.float32)


class Llama(nnx.Module):
    """A Llama decoder: ``tokens int32[batch, seq] -> (logits [batch, seq, vocab], aux_loss=0)``.

    The auxiliary loss is the mean of the blocks' auxiliary losses: 0 here, the load-balancing
    loss for :class:`shardplan_models.moe.MoE`, which only swaps :attr:`block_type`.

    Args:
      config: sizes and options; ``config.scan_layers`` picks a list of blocks or one stacked
        block applied with ``nnx.scan``.
      rngs: random streams for initialisation.
    """

    block_type: ClassVar[Callable[..., nnx.Module]] = LlamaBlock
    """The block class; built as ``block_type(config, rngs=rngs)``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config
        dtype, param_dtype = to_dtype(config.dtype), to_dtype(config.param_dtype)
        self.embed = nnx.Embed(
            config.vocab_size,
            config.d_model,
            dtype=dtype,
            param_dtype=param_dtype,
            embedding_init=nnx.initializers.normal(INIT_STD),
            rngs=rngs,
        )
        block_type = type(self).block_type
        self.blocks = make_blocks(
            lambda r: block_type(config, rngs=r),
            config.n_layers,
            scan_layers=config.scan_layers,
            rngs=rngs,
        )
        self.norm = rms_norm(config, rngs=rngs)
        self.lm_head = nnx.Linear(
            config.d_model,
            config.vocab_size,
            use_bias=False,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=nnx.initializers.normal(INIT_STD),
            rngs=rngs,
        )

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Returns ``(logits [batch, seq, vocab], aux_loss float32[])`` for ``int32[batch, seq]``."""
        cos, sin = rope_tables(tokens.shape[1], self.config.head_dim, self.config.rope_theta)
        x = self.embed(tokens)  # [batch, seq, d_model]
        x, aux = run_blocks(self.blocks, x, cos, sin, scan_layers=self.config.scan_layers)
        x = self.norm(x)  # [batch, seq, d_model]
        return self.lm_head(x), aux / self.config.n_layers  # [batch, seq, vocab], []
