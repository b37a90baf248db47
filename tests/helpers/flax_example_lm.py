"""A decoder-only Linen language model and its train step, written the way Flax's own
``examples/lm1b`` (``models.py`` + ``train.py``) writes them, at toy sizes.

Nothing here knows about shardplan: a frozen ``TransformerConfig``, sinusoidal or learned
position embeddings, pre-LayerNorm blocks with multi-head self-attention under a causal mask
combined with a padding mask, dropout everywhere (attention weights included), a shared
embedding whose ``attend`` gives the logits, flax's ``TrainState`` with AdamW under a warmup +
rsqrt-decay schedule, a label-smoothed cross-entropy weighted by ``inputs > 0`` and the
example's summed metrics. The step is ``train_step(state, batch, config, learning_rate_fn,
label_smoothing, dropout_rng)``; callers bind the trailing arguments with
``functools.partial`` as the example does before ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import common_utils, train_state
from jax import lax


@struct.dataclass
class TransformerConfig:
    """Global hyperparameters, passed to every module instead of long keyword lists."""

    vocab_size: int
    output_vocab_size: int
    logits_via_embedding: bool = True
    dtype: Any = jnp.float32
    emb_dim: int = 32
    num_heads: int = 4
    num_layers: int = 2
    qkv_dim: int = 32
    mlp_dim: int = 64
    max_len: int = 16
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    deterministic: bool = False
    kernel_init: Callable[..., Any] = nn.initializers.xavier_uniform()
    bias_init: Callable[..., Any] = nn.initializers.normal(stddev=1e-6)
    posemb_init: Callable[..., Any] | None = None


def shift_right(x: jax.Array, axis: int = 1) -> jax.Array:
    """Shifts ``x`` one position right along ``axis``, filling the first position with 0."""
    pad_widths = [(0, 0)] * x.ndim
    pad_widths[axis] = (1, 0)
    padded = jnp.pad(x, pad_widths, mode="constant", constant_values=x.dtype.type(0))
    return lax.dynamic_slice_in_dim(padded, 0, padded.shape[axis] - 1, axis)


def sinusoidal_init(max_len: int = 2048, min_scale: float = 1.0,
                    max_scale: float = 10000.0) -> Callable[..., jax.Array]:
    """An initializer of the fixed ``(1, max_len, features)`` sine/cosine position table."""

    def init(key: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> jax.Array:
        del key, dtype
        features = shape[-1]
        table = np.zeros((max_len, features), np.float32)
        position = np.arange(max_len)[:, None]
        scale = -np.log(max_scale / min_scale) / (features // 2 - 1)
        frequencies = min_scale * np.exp(np.arange(features // 2) * scale)
        table[:, :features // 2] = np.sin(position * frequencies)
        table[:, features // 2:2 * (features // 2)] = np.cos(position * frequencies)
        return jnp.asarray(table[None])

    return init


class AddPositionEmbs(nn.Module):
    """Adds position embeddings: sinusoidal, or learned when ``config.posemb_init`` is set."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        config = self.config
        assert inputs.ndim == 3, f"expected (batch, length, features), got {inputs.shape}"
        shape = (1, config.max_len, inputs.shape[-1])
        if config.posemb_init is None:
            table = sinusoidal_init(max_len=config.max_len)(None, shape)
        else:
            table = self.param("pos_embedding", config.posemb_init, shape)
        return inputs + table[:, :inputs.shape[1], :]


class MlpBlock(nn.Module):
    """The feed-forward block: Dense, ReLU, dropout, Dense, dropout."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        config = self.config
        x = nn.Dense(config.mlp_dim, dtype=config.dtype, kernel_init=config.kernel_init,
                     bias_init=config.bias_init)(inputs)
        x = nn.relu(x)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        x = nn.Dense(inputs.shape[-1], dtype=config.dtype, kernel_init=config.kernel_init,
                     bias_init=config.bias_init)(x)
        return nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)


class DecoderBlock(nn.Module):
    """A pre-LayerNorm decoder layer: masked self-attention, then the MLP, each residual."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs: jax.Array, decoder_mask: jax.Array | None = None) -> jax.Array:
        config = self.config
        x = nn.LayerNorm(dtype=config.dtype)(inputs)
        x = nn.MultiHeadDotProductAttention(
            num_heads=config.num_heads, dtype=config.dtype, qkv_features=config.qkv_dim,
            kernel_init=config.kernel_init, bias_init=config.bias_init, use_bias=False,
            broadcast_dropout=False, dropout_rate=config.attention_dropout_rate,
            deterministic=config.deterministic)(x, mask=decoder_mask)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        x = x + inputs
        z = nn.LayerNorm(dtype=config.dtype)(x)
        return x + MlpBlock(config=config)(z)


class Decoder(nn.Module):
    """Embeds the right-shifted tokens, runs the blocks, and maps back to the vocabulary."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs: jax.Array, decoder_mask: jax.Array | None = None) -> jax.Array:
        config = self.config
        assert inputs.ndim == 2, f"expected (batch, length), got {inputs.shape}"
        embed = nn.Embed(num_embeddings=config.output_vocab_size, features=config.emb_dim,
                         embedding_init=nn.initializers.normal(stddev=1.0))
        y = embed(shift_right(inputs.astype("int32")))
        y = AddPositionEmbs(config=config, name="posembed_output")(y)
        y = nn.Dropout(rate=config.dropout_rate)(y, deterministic=config.deterministic)
        y = y.astype(config.dtype)
        for layer in range(config.num_layers):
            y = DecoderBlock(config=config, name=f"decoderblock_{layer}")(y, decoder_mask)
        y = nn.LayerNorm(dtype=config.dtype, name="decoder_norm")(y)
        if config.logits_via_embedding:
            # The shared embedding's transpose gives the logits, scaled as the example does.
            return embed.attend(y.astype(jnp.float32)) / jnp.sqrt(y.shape[-1])
        return nn.Dense(config.output_vocab_size, dtype=config.dtype,
                        kernel_init=config.kernel_init, bias_init=config.bias_init,
                        name="logitdense")(y)


class TransformerLM(nn.Module):
    """The decoder-only language model: tokens ``(batch, length)`` to logits."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        config = self.config
        decoder_mask = nn.combine_masks(
            nn.make_attention_mask(inputs > 0, inputs > 0, dtype=config.dtype),
            nn.make_causal_mask(inputs, dtype=config.dtype))
        logits = Decoder(config=config, name="decoder")(inputs, decoder_mask=decoder_mask)
        return logits.astype(config.dtype)


def rsqrt_schedule(init_value: float, shift: int = 0) -> optax.Schedule:
    """``init_value * sqrt(shift / (step + shift))``: a reverse square-root decay."""

    def schedule(count: jax.Array) -> jax.Array:
        return init_value * (count + shift) ** -0.5 * shift ** 0.5

    return schedule


def create_learning_rate_schedule(learning_rate: float, warmup_steps: int) -> optax.Schedule:
    """A linear warmup to ``learning_rate``, then the rsqrt decay."""
    return optax.join_schedules(
        [optax.linear_schedule(init_value=0.0, end_value=learning_rate,
                               transition_steps=warmup_steps),
         rsqrt_schedule(init_value=learning_rate, shift=warmup_steps)],
        boundaries=[warmup_steps])


def compute_weighted_cross_entropy(logits: jax.Array, targets: jax.Array,
                                   weights: jax.Array | None = None,
                                   label_smoothing: float = 0.0) -> tuple[Any, Any]:
    """The label-smoothed cross-entropy summed over weighted positions, and the weight sum."""
    if logits.ndim != targets.ndim + 1:
        raise ValueError(f"Incorrect shapes: logits {logits.shape}, targets {targets.shape}")
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / (vocab_size - 1)
    normalizing_constant = -(confidence * jnp.log(confidence)
                             + (vocab_size - 1) * low_confidence
                             * jnp.log(low_confidence + 1e-20))
    soft_targets = common_utils.onehot(targets, vocab_size, on_value=confidence,
                                       off_value=low_confidence)
    loss = -jnp.sum(soft_targets * nn.log_softmax(logits), axis=-1) - normalizing_constant
    normalizing_factor: Any = np.prod(targets.shape)
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()
    return loss.sum(), normalizing_factor


def compute_weighted_accuracy(logits: jax.Array, targets: jax.Array,
                              weights: jax.Array | None = None) -> tuple[Any, Any]:
    """The number of weighted positions whose argmax is the target, and the weight sum."""
    if logits.ndim != targets.ndim + 1:
        raise ValueError(f"Incorrect shapes: logits {logits.shape}, targets {targets.shape}")
    correct = jnp.equal(jnp.argmax(logits, axis=-1), targets)
    normalizing_factor: Any = np.prod(logits.shape[:-1])
    if weights is not None:
        correct = correct * weights
        normalizing_factor = weights.sum()
    return correct.sum(), normalizing_factor


def compute_metrics(logits: jax.Array, labels: jax.Array, weights: jax.Array,
                    label_smoothing: float = 0.0) -> dict[str, Any]:
    """The summed metrics (divide by ``denominator`` to report them)."""
    loss, weight_sum = compute_weighted_cross_entropy(logits, labels, weights,
                                                      label_smoothing)
    accuracy, _ = compute_weighted_accuracy(logits, labels, weights)
    return {"loss": loss, "accuracy": accuracy, "denominator": weight_sum}


def train_step(state: train_state.TrainState, batch: dict[str, jax.Array],
               config: TransformerConfig, learning_rate_fn: optax.Schedule,
               label_smoothing: float = 0.0, dropout_rng: jax.Array | None = None,
               ) -> tuple[train_state.TrainState, dict[str, Any]]:
    """One training step: the language-model loss on ``batch["inputs"]``, AdamW, metrics."""
    if dropout_rng is None:
        raise ValueError("train_step draws dropout masks: pass dropout_rng")
    inputs = batch["inputs"]
    weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params: Any) -> tuple[jax.Array, jax.Array]:
        logits = cast(jax.Array, TransformerLM(config).apply(
            {"params": params}, inputs, rngs={"dropout": dropout_rng}))
        loss, weight_sum = compute_weighted_cross_entropy(logits, inputs, weights,
                                                          label_smoothing)
        return loss / weight_sum, logits

    lr = learning_rate_fn(state.step)
    (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new_state = state.apply_gradients(grads=grads)
    metrics = compute_metrics(logits, inputs, weights)
    metrics["learning_rate"] = lr
    return new_state, metrics


def create_train_state(config: TransformerConfig, learning_rate_fn: optax.Schedule, *,
                       batch_size: int, seed: int = 0) -> train_state.TrainState:
    """The initial ``TrainState``: parameters from the deterministic (eval) model, AdamW."""
    model = TransformerLM(dataclasses.replace(config, deterministic=True))
    variables = jax.jit(model.init)(jax.random.PRNGKey(seed),
                                    jnp.ones((batch_size, config.max_len), jnp.int32))
    optimizer = optax.adamw(learning_rate_fn, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)
    return train_state.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                         tx=optimizer)


def make_batches(config: TransformerConfig, *, count: int, batch_size: int,
                 seed: int = 0) -> list[dict[str, jax.Array]]:
    """``count`` batches of token ids in ``[1, vocab)``, each row padded with 0 after a random
    length (at least 2 tokens), as the example's padded input pipeline delivers them."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        tokens = rng.integers(1, config.vocab_size, size=(batch_size, config.max_len))
        lengths = rng.integers(2, config.max_len + 1, size=(batch_size, 1))
        tokens = np.where(np.arange(config.max_len)[None] < lengths, tokens, 0)
        batches.append({"inputs": jnp.asarray(tokens, jnp.int32)})
    return batches


def example_setup(*, vocab_size: int = 64, batch_size: int = 16, seed: int = 0,
                  ) -> tuple[train_state.TrainState, Callable[..., Any], TransformerConfig]:
    """``(state, step, config)``: the initial state and the step with its configuration bound
    as ``train.py`` binds it (``functools.partial(train_step, config=..., ...)``)."""
    config = TransformerConfig(vocab_size=vocab_size, output_vocab_size=vocab_size)
    learning_rate_fn = create_learning_rate_schedule(learning_rate=0.05, warmup_steps=2)
    state = create_train_state(config, learning_rate_fn, batch_size=batch_size, seed=seed)
    step = functools.partial(train_step, config=config, learning_rate_fn=learning_rate_fn,
                             label_smoothing=0.1, dropout_rng=jax.random.PRNGKey(seed + 1))
    return state, step, config
