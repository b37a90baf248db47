"""GPT-2 / GPT-3 style decoder-only transformer in Flax NNX.

Token embedding ``wte`` plus learned positions ``wpe``; pre-LayerNorm blocks (``ln1``, ``attn``,
``ln2``, ``mlp``) with biases, causal multi-head attention and a GELU MLP; a final ``ln_f``; and a
head tied to ``wte`` or an untied ``lm_head``. Follows Radford et al. 2019 (GPT-2) and Brown et al.
2020 (GPT-3, which uses the same architecture at larger sizes, with dense attention here).

Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from shardplan_models.config import load_model_config
    >>> model = GPT(load_model_config("gpt-tiny"), rngs=nnx.Rngs(0))
    >>> logits, aux = model(jnp.zeros((2, 16), jnp.int32))
    >>> logits.shape, float(aux)
    ((2, 16, 256), 0.0)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from shardplan_models.common import (
    INIT_STD,
    CausalSelfAttention,
    GeluMLP,
    make_blocks,
    run_blocks,
    to_dtype,
)
from shardplan_models.config import GPTConfig

__all__ = ["GPT", "GPTBlock"]


class GPTBlock(nnx.Module):
    """One pre-LayerNorm GPT block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        dtype, param_dtype = to_dtype(config.dtype), to_dtype(config.param_dtype)
        d = config.d_model
        norm = {"epsilon": config.layer_norm_eps, "dtype": dtype, "param_dtype": param_dtype}
        self.ln1 = nnx.LayerNorm(d, rngs=rngs, **norm)
        self.attn = CausalSelfAttention(
            d,
            n_heads=config.n_heads,
            n_kv_heads=config.n_heads,
            use_bias=True,
            n_layers=config.n_layers,
            dtype=dtype,
            param_dtype=param_dtype,
            impl=config.attention_impl,
            rngs=rngs,
        )
        self.ln2 = nnx.LayerNorm(d, rngs=rngs, **norm)
        self.mlp = GeluMLP(
            d,
            config.d_ff,
            n_layers=config.n_layers,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Maps ``[batch, seq, d_model]`` to itself; the auxiliary loss is 0."""
        x = x + self.attn(self.ln1(x))  # [batch, seq, d_model]
        x = x + self.mlp(self.ln2(x))  # [batch, seq, d_model]
        return x, jnp.zeros((), jnp.float32)


class GPT(nnx.Module):
    """A GPT decoder: ``tokens int32[batch, seq] -> (logits [batch, seq, vocab], aux_loss=0)``.

    Args:
      config: sizes and options; ``config.scan_layers`` picks a list of blocks (``blocks/0/...``)
        or one stacked block applied with ``nnx.scan`` (``blocks/...`` with a leading
        ``n_layers`` axis).
      rngs: random streams for initialisation.
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config
        dtype, param_dtype = to_dtype(config.dtype), to_dtype(config.param_dtype)
        d = config.d_model
        embed = {
            "dtype": dtype,
            "param_dtype": param_dtype,
            "embedding_init": nnx.initializers.normal(INIT_STD),
            "rngs": rngs,
        }
        self.wte = nnx.Embed(config.vocab_size, d, **embed)
        self.wpe = nnx.Embed(config.max_seq_len, d, **embed)
        self.blocks = make_blocks(
            lambda r: GPTBlock(config, rngs=r),
            config.n_layers,
            scan_layers=config.scan_layers,
            rngs=rngs,
        )
        self.ln_f = nnx.LayerNorm(
            d, epsilon=config.layer_norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        # GPT-2 and GPT-3 tie the output head to the token embedding (Press & Wolf 2017).
        self.lm_head: nnx.Linear | None = (
            None
            if config.tie_embeddings
            else nnx.Linear(
                d,
                config.vocab_size,
                use_bias=False,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=nnx.initializers.normal(INIT_STD),
                rngs=rngs,
            )
        )

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Returns ``(logits [batch, seq, vocab], aux_loss float32[])`` for ``int32[batch, seq]``.

        Raises:
          ValueError: the sequence is longer than ``config.max_seq_len`` (no position embedding).
        """
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds max_seq_len={self.config.max_seq_len} of the "
                "position table wpe; shorten the batch or raise max_seq_len"
            )
        positions = jnp.arange(seq)[None, :]  # [1, seq]
        x = self.wte(tokens) + self.wpe(positions)  # [batch, seq, d_model]
        x, aux = run_blocks(self.blocks, x, scan_layers=self.config.scan_layers)
        x = self.ln_f(x)  # [batch, seq, d_model]
        if self.lm_head is not None:
            return self.lm_head(x), aux  # [batch, seq, vocab], []
        return self.wte.attend(x), aux  # tied head: x @ wte.T, [batch, seq, vocab]
