"""Builds a reference model from its config, for real or abstractly (shapes only).

``build_model`` allocates and initialises parameters (tiny models, CPU tests).
``abstract_state`` only traces the initialisation with ``nnx.eval_shape``: it returns
``jax.ShapeDtypeStruct`` leaves and never allocates, so a 175B model is planned on a laptop.

Example:
    >>> from shardplan_models.config import load_model_config
    >>> graphdef, state = abstract_state(load_model_config("gpt3-175b"))
    >>> count_params(state) == load_model_config("gpt3-175b").num_params()
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from flax import nnx
from shardplan_models.config import GPTConfig, LlamaConfig, ModelConfig, MoEConfig
from shardplan_models.gpt import GPT
from shardplan_models.llama import Llama
from shardplan_models.moe import MoE

__all__ = ["MODEL_CLASSES", "abstract_rngs", "abstract_state", "build_model", "count_params"]

MODEL_CLASSES: dict[type[ModelConfig], Callable[..., nnx.Module]] = {
    GPTConfig: GPT,
    LlamaConfig: Llama,
    MoEConfig: MoE,
}
"""The model class each config type builds (matched on the exact type)."""


def build_model(config: ModelConfig, /, *, rngs: nnx.Rngs) -> nnx.Module:
    """Builds and initialises the model a config describes.

    Args:
      config: a :class:`~shardplan_models.config.GPTConfig`, :class:`~shardplan_models.config.LlamaConfig` or
        :class:`~shardplan_models.config.MoEConfig`.
      rngs: random streams for initialisation.

    Returns:
      A :class:`~shardplan_models.gpt.GPT`, :class:`~shardplan_models.llama.Llama` or :class:`~shardplan_models.moe.MoE`.

    Raises:
      TypeError: ``config`` is not one of the config classes.

    Example:
      >>> from shardplan_models.config import load_model_config
      >>> type(build_model(load_model_config("llama-tiny"), rngs=nnx.Rngs(0))).__name__
      'Llama'
    """
    model_class = MODEL_CLASSES.get(type(config))
    if model_class is None:
        known = ", ".join(cls.__name__ for cls in MODEL_CLASSES)
        raise TypeError(f"build_model got a {type(config).__name__}; expected one of {known}")
    return model_class(config, rngs=rngs)


def abstract_state(config: ModelConfig, /, *, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """Returns ``(graphdef, state)`` of the model with ``jax.ShapeDtypeStruct`` leaves.

    Traces the initialisation with ``nnx.eval_shape``; nothing is allocated or computed.

    Args:
      config: the model config.
      seed: the seed ``build_model`` would use (it does not change any shape).

    Returns:
      The graph definition and the abstract state (all variables, here all ``nnx.Param``).
    """
    model = nnx.eval_shape(lambda: build_model(config, rngs=abstract_rngs(config, seed=seed)))
    return nnx.split(model)


def abstract_rngs(config: ModelConfig, /, *, seed: int = 0) -> nnx.Rngs:
    """``nnx.Rngs(seed)`` for building ``config``'s model inside ``nnx.eval_shape``, fast.

    Every random draw increments a counter variable. With a plain array counter, each increment
    under tracing makes flax probe ``tracer.sharding``, whose error message jax 0.10 builds by
    walking every equation traced so far, so initialising unrolled layers under ``eval_shape``
    is quadratic in depth (45 s for GPT-3 175B; fixed upstream in jax-ml/jax#40041). Counters
    held in refs are updated in place and skip that probe. Stacked layers (``scan_layers``)
    keep plain counters: ``nnx.split_rngs`` reshapes the keys, which a ref cannot do, and their
    one vmapped block makes few draws anyway. Shapes and structure are the same either way; the
    models keep no Rngs.
    """
    var_defaults = getattr(nnx, "var_defaults", None)  # flax >= 0.12
    if config.scan_layers or var_defaults is None:
        return nnx.Rngs(seed)
    with var_defaults(ref=True):
        return nnx.Rngs(seed)


def count_params(state: nnx.State | nnx.Module, /) -> int:
    """Counts the elements of the ``nnx.Param`` leaves of a model, or of its state.

    Works on real arrays and on ``jax.ShapeDtypeStruct`` leaves alike.

    Example:
      >>> from shardplan_models.config import load_model_config
      >>> count_params(build_model(load_model_config("gpt-tiny"), rngs=nnx.Rngs(0)))
      118528
    """
    if isinstance(state, nnx.Module):
        params = nnx.state(state, nnx.Param)
    else:
        params = nnx.filter_state(state, nnx.Param)
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
