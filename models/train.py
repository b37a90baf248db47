"""An ordinary, user-style training step for the reference models (Flax NNX + optax).

This is one example of the code a user brings to shardplan: a functional train step
``train_step(state, batch) -> (state, metrics)`` over ``nnx.split((model, optimizer))``. The
planner never imports it; tests and demos do.

Example:
    >>> import jax
    >>> from shardplan_models.config import load_model_config
    >>> config = load_model_config("gpt-tiny")
    >>> graphdef, state = init_train_state(config, seed=0)
    >>> train_step = jax.jit(make_train_step(graphdef))
    >>> state, metrics = train_step(state, example_batch(config, 4))
    >>> sorted(metrics)
    ['aux_loss', 'ce_loss', 'grad_norm', 'loss']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from shardplan_models.build import abstract_rngs, build_model
from shardplan_models.config import ModelConfig

from shardplan.errors import ConfigError, format_error

__all__ = [
    "TrainStep",
    "abstract_train_state",
    "default_decay_mask",
    "example_batch",
    "init_train_state",
    "make_optimizer",
    "make_train_step",
]

Batch = dict[str, Any]
"""``{"inputs": int32[batch, seq], "targets": int32[batch, seq]}`` (arrays or shape structs)."""

TrainStep = Callable[[nnx.State, Batch], tuple[nnx.State, dict[str, jax.Array]]]
"""``train_step(state, batch) -> (new_state, metrics)``."""

_NO_DECAY_NAMES = frozenset({"bias", "scale"})
"""Leaf names excluded from weight decay: biases and norm scales (as in GPT-2 / nanoGPT)."""


def default_decay_mask(params: Any) -> Any:
    """Marks which parameters get weight decay: all but biases and norm scales.

    Decided by name, not by rank, so it stays right for stacked (scanned) blocks, whose norm
    scales are 2-D ``[n_layers, d_model]``.

    Args:
      params: the parameter pytree optax sees.

    Returns:
      A pytree of bools with the structure of ``params``.
    """

    def decays(path: Any, _: Any) -> bool:
        names = jax.tree_util.keystr(path, simple=True, separator="/").split("/")
        return not _NO_DECAY_NAMES.intersection(names)

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(
    learning_rate: float | optax.Schedule = 3e-4,
    *,
    weight_decay: float = 0.1,
    clip_norm: float = 1.0,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    decay_mask: Callable[[Any], Any] | None = default_decay_mask,
) -> optax.GradientTransformation:
    """Global-norm clipping followed by AdamW (the GPT-3 recipe, Brown et al. 2020, C).

    Args:
      learning_rate: a constant or an optax schedule (e.g. ``optax.warmup_cosine_decay_schedule``).
      weight_decay: decoupled weight decay coefficient.
      clip_norm: maximum global gradient norm.
      b1: Adam's first-moment decay.
      b2: Adam's second-moment decay.
      eps: Adam's epsilon.
      decay_mask: which parameters decay (see :func:`default_decay_mask`); None decays all.

    Returns:
      ``optax.chain(optax.clip_by_global_norm(clip_norm), optax.adamw(...))``.

    Example:
      >>> tx = make_optimizer(optax.linear_schedule(0.0, 3e-4, 100), clip_norm=0.5)
    """
    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(
            learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask
        ),
    )


def _model_and_optimizer(
    config: ModelConfig, rngs: nnx.Rngs, optimizer: optax.GradientTransformation | None
) -> tuple[nnx.Module, nnx.Optimizer]:
    """Builds the model and its ``nnx.Optimizer`` over the ``nnx.Param`` variables."""
    model = build_model(config, rngs=rngs)
    tx = make_optimizer() if optimizer is None else optimizer
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def init_train_state(
    config: ModelConfig,
    /,
    *,
    seed: int = 0,
    optimizer: optax.GradientTransformation | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """Builds the model and optimizer and splits them into ``(graphdef, state)``.

    Args:
      config: the model config.
      seed: seed of the parameter initialisation.
      optimizer: the optax transformation; :func:`make_optimizer` ``()`` if None.

    Returns:
      ``nnx.split((model, optimizer))``: state paths start with ``0/`` (model) and ``1/``
      (optimizer step and ``opt_state``).
    """
    return nnx.split(_model_and_optimizer(config, nnx.Rngs(seed), optimizer))


def abstract_train_state(
    config: ModelConfig,
    /,
    *,
    optimizer: optax.GradientTransformation | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """Like :func:`init_train_state` but with ``jax.ShapeDtypeStruct`` leaves; never allocates.

    Traces the construction with ``nnx.eval_shape``, so it takes seconds even for GPT-3 175B.

    Example:
      >>> from shardplan_models.config import load_model_config
      >>> graphdef, state = abstract_train_state(load_model_config("gpt3-175b"))
    """

    def build() -> tuple[nnx.Module, nnx.Optimizer]:
        return _model_and_optimizer(config, abstract_rngs(config), optimizer)

    return nnx.split(nnx.eval_shape(build))


def make_train_step(graphdef: nnx.GraphDef, /) -> TrainStep:
    """Returns ``train_step(state, batch) -> (new_state, metrics)`` for a split model+optimizer.

    The loss is the mean next-token cross-entropy of ``model(batch["inputs"])`` against
    ``batch["targets"]`` plus ``aux_loss_coef * aux_loss`` (MoE load balancing; dense models
    have no ``aux_loss_coef`` and an aux loss of 0). The step is a pure function: it can be
    traced with ``jax.jit(train_step).trace(state, batch)`` and its new state has the input
    state's tree structure.

    Args:
      graphdef: the graph definition from :func:`init_train_state` or
        :func:`abstract_train_state`.

    Returns:
      The train step; ``metrics`` holds ``loss``, ``ce_loss``, ``aux_loss`` and ``grad_norm``.
    """

    def train_step(state: nnx.State, batch: Batch) -> tuple[nnx.State, dict[str, jax.Array]]:
        model, optimizer = nnx.merge(graphdef, state)
        aux_loss_coef = getattr(model.config, "aux_loss_coef", 0.0)

        def loss_fn(model: nnx.Module) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            logits, aux_loss = model(batch["inputs"])  # [batch, seq, vocab], []
            ce_loss = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), batch["targets"]
            ).mean()
            return ce_loss + aux_loss_coef * aux_loss, (ce_loss, aux_loss)

        (loss, (ce_loss, aux_loss)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        metrics = {
            "loss": loss,
            "ce_loss": ce_loss,
            "aux_loss": aux_loss,
            "grad_norm": optax.tree.norm(grads),
        }
        return nnx.state((model, optimizer)), metrics

    return train_step


def example_batch(
    config: ModelConfig,
    batch_size: int,
    /,
    *,
    seq_len: int | None = None,
    seed: int = 0,
    abstract: bool = False,
) -> Batch:
    """A batch of random tokens: ``targets`` are ``inputs`` shifted left by one position.

    Args:
      config: the model config (vocabulary size and maximum sequence length).
      batch_size: sequences per batch.
      seq_len: tokens per sequence; ``config.max_seq_len`` if None.
      seed: seed of the random tokens.
      abstract: return ``jax.ShapeDtypeStruct``s instead of arrays (for planning).

    Returns:
      ``{"inputs": int32[batch_size, seq_len], "targets": int32[batch_size, seq_len]}``.

    Raises:
      ConfigError: ``batch_size`` < 1 or ``seq_len`` outside ``[1, config.max_seq_len]``.

    Example:
      >>> from shardplan_models.config import load_model_config
      >>> example_batch(load_model_config("gpt-tiny"), 2, seq_len=8)["inputs"].shape
      (2, 8)
    """
    seq = config.max_seq_len if seq_len is None else seq_len
    if batch_size < 1:
        raise ConfigError(
            format_error(
                "batch_size must be >= 1.",
                where="example_batch(batch_size=)",
                value=batch_size,
                has_value=True,
                remedy="pass a positive batch size",
            )
        )
    if not 1 <= seq <= config.max_seq_len:
        raise ConfigError(
            format_error(
                f"seq_len must be in [1, max_seq_len={config.max_seq_len}].",
                where="example_batch(seq_len=)",
                value=seq,
                has_value=True,
                remedy="pass a shorter seq_len, or raise max_seq_len in the model config",
            )
        )
    if abstract:
        spec = jax.ShapeDtypeStruct((batch_size, seq), jnp.int32)
        return {"inputs": spec, "targets": spec}
    tokens = jax.random.randint(
        jax.random.key(seed), (batch_size, seq + 1), 0, config.vocab_size, dtype=jnp.int32
    )  # [batch, seq + 1]
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
