"""Typed, validated configurations of the reference models, and their YAML loader.

One frozen dataclass per model family: :class:`GPTConfig` (GPT-2/GPT-3), :class:`LlamaConfig`
(Llama 2: RoPE, RMSNorm, SwiGLU, grouped-query attention) and :class:`MoEConfig` (Llama-style blocks
whose MLP is a top-k routed mixture of experts, e.g. Mixtral). Each one checks its values when it is
built and counts its parameters in closed form (:meth:`~GPTConfig.num_params`), so planning a 175B
model needs no allocation at all.

Presets live in ``configs/models/<name>.yaml`` and carry a ``model: gpt|llama|moe`` discriminator:

    >>> from shardplan_models.config import load_model_config
    >>> config = load_model_config("gpt-tiny", overrides={"n_layers": 4})
    >>> config.model, config.n_layers
    ('gpt', 4)
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import difflib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import yaml

from shardplan._files import read_text
from shardplan.errors import ConfigError, format_error

__all__ = [
    "ATTENTION_IMPLS",
    "DTYPE_NAMES",
    "MOE_IMPLS",
    "PRESETS_DIR",
    "GPTConfig",
    "LlamaConfig",
    "MoEConfig",
    "ModelConfig",
    "config_from_dict",
    "expert_capacity",
    "load_model_config",
    "preset_names",
]

DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16")
"""The dtype names a config accepts for ``dtype`` (compute) and ``param_dtype`` (storage)."""

ATTENTION_IMPLS: tuple[str, ...] = ("xla", "pallas", "cudnn")
"""The values :class:`ModelConfig` accepts for ``attention_impl`` (see
:func:`shardplan_models.common.attention`)."""

MOE_IMPLS: tuple[str, ...] = ("dense", "ragged", "pallas")
"""The values :class:`MoEConfig` accepts for ``moe_impl`` (see :class:`shardplan_models.moe.MoEMLP`)."""

PRESETS_DIR: Path = Path(__file__).resolve().parent.parent / "configs" / "models"
"""Where preset YAML files live: ``<repo root>/configs/models``."""


def _did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """Returns ``" (did you mean 'x'?)"`` for the closest choice, or ``""`` if none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(abc.ABC):
    """Fields shared by every reference model (the decoder-only transformer skeleton).

    Attributes:
      vocab_size: number of token ids (rows of the embedding table).
      max_seq_len: longest sequence the model accepts (rows of GPT's position table).
      d_model: width of the residual stream.
      n_layers: number of transformer blocks.
      n_heads: number of attention (query) heads; ``d_model`` must be divisible by it.
      d_ff: hidden width of the MLP (of each expert, for MoE).
      dtype: compute dtype, ``"float32"`` or ``"bfloat16"``.
      param_dtype: storage dtype of the parameters.
      scan_layers: False stores the blocks as a list (``blocks/0/...``) applied in a Python loop;
        True stacks them (leading ``n_layers`` axis) and applies them with ``nnx.scan``.
      attention_impl: how causal attention is computed: ``"xla"`` (einsums and a softmax over
        the full scores), ``"pallas"`` (the flash-attention kernel
        :func:`shardplan.kernels.flash_attention`, which the planner splits only on batch and
        heads) or ``"cudnn"`` (``jax.nn.dot_product_attention(implementation="cudnn")``, GPU
        only).
      name: the preset's name (set by :func:`load_model_config` from the file name), or None.
    """

    model: ClassVar[str] = ""

    vocab_size: int
    max_seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = False
    attention_impl: str = "xla"
    name: str | None = None

    def __post_init__(self) -> None:
        self._check_types()
        for field in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, field)
            self._require(value > 0, field, "must be positive", "use a size >= 1")
        self._require(
            self.d_model % self.n_heads == 0,
            "d_model",
            f"must be divisible by n_heads={self.n_heads}",
            f"pick d_model = n_heads * head_dim, e.g. {self.n_heads * 64}",
        )
        self._require(
            self.attention_impl in ATTENTION_IMPLS,
            "attention_impl",
            f"is not a known attention{_did_you_mean(self.attention_impl, ATTENTION_IMPLS)}",
            f"use one of {', '.join(ATTENTION_IMPLS)}",
        )
        for field in ("dtype", "param_dtype"):
            self._require(
                getattr(self, field) in DTYPE_NAMES,
                field,
                f"is not a supported dtype{_did_you_mean(str(getattr(self, field)), DTYPE_NAMES)}",
                f"use one of {', '.join(DTYPE_NAMES)}",
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``d_model // n_heads``."""
        return self.d_model // self.n_heads

    @abc.abstractmethod
    def num_params(self) -> int:
        """Returns the exact number of parameters of the model this config builds."""

    def to_dict(self) -> dict[str, Any]:
        """Returns the config as a plain dict, with the ``model`` discriminator first."""
        return {"model": self.model, **dataclasses.asdict(self)}

    def _require(self, ok: bool, field: str, problem: str, remedy: str) -> None:
        """Raises a ConfigError naming ``field`` and its value unless ``ok``."""
        if not ok:
            value = getattr(self, field)
            raise ConfigError(
                format_error(
                    f"{type(self).__name__}.{field} {problem}.",
                    where=f"{type(self).__name__}.{field}",
                    value=value,
                    remedy=remedy,
                    has_value=True,
                )
            )

    def _check_types(self) -> None:
        """Checks every field against its annotation (YAML gives strings, bools, ints, floats)."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            kind = (
                field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
            )
            if kind == "int":
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif kind == "float":
                ok = isinstance(value, int | float) and not isinstance(value, bool)
                ok = ok and math.isfinite(value)
            elif kind == "bool":
                ok = isinstance(value, bool)
            elif kind == "str":
                ok = isinstance(value, str)
            elif kind == "str | None":
                ok = value is None or isinstance(value, str)
            else:  # pragma: no cover - guards against a field added with an unchecked type
                raise TypeError(f"unchecked field type {kind!r} of {field.name}")
            self._require(
                ok,
                field.name,
                f"must be of type {kind}, got {type(value).__name__}",
                f"write a value of type {kind} (YAML floats need a dot: 1.0e-5, not 1e-5)",
            )


def _attention_params(d_model: int, n_heads: int, n_kv_heads: int, *, bias: bool) -> int:
    """Parameters of q/k/v/o projections with ``n_kv_heads`` key/value heads."""
    head_dim = d_model // n_heads
    kv_width = n_kv_heads * head_dim
    weights = 2 * d_model * d_model + 2 * d_model * kv_width
    biases = 2 * d_model + 2 * kv_width if bias else 0
    return weights + biases


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig(ModelConfig):
    """A GPT-2 / GPT-3 style decoder: learned positions, pre-LayerNorm, GELU MLP, biases.

    Attributes:
      tie_embeddings: reuse the token embedding ``wte`` as the output head (GPT-2, GPT-3);
        False adds an untied ``lm_head`` without bias.
      layer_norm_eps: epsilon of every LayerNorm.

    Example:
      >>> GPTConfig(vocab_size=256, max_seq_len=32, d_model=64, n_layers=2, n_heads=4,
      ...           d_ff=256).num_params()
      118528
    """

    model: ClassVar[str] = "gpt"

    tie_embeddings: bool = True
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(self.layer_norm_eps > 0, "layer_norm_eps", "must be positive", "use 1e-5")

    def num_params(self) -> int:
        """Returns the exact parameter count (embeddings, blocks, final norm, optional head).

        Per block: two LayerNorms (scale + bias), q/k/v/o with biases, and the MLP
        ``d_model -> d_ff -> d_model`` with biases.
        """
        d, f = self.d_model, self.d_ff
        block = (
            2 * (2 * d)
            + _attention_params(d, self.n_heads, self.n_heads, bias=True)
            + (d * f + f)
            + (f * d + d)
        )
        embeddings = self.vocab_size * d + self.max_seq_len * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return embeddings + self.n_layers * block + 2 * d + head


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(ModelConfig):
    """A Llama 2 style decoder: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention, no biases.

    Attributes:
      n_kv_heads: number of key/value heads (grouped-query attention); ``n_heads`` must be
        divisible by it. ``n_kv_heads == n_heads`` is plain multi-head attention.
      rope_theta: base of the rotary position embedding frequencies.
      norm_eps: epsilon of every RMSNorm.

    Example:
      >>> LlamaConfig(vocab_size=256, max_seq_len=32, d_model=64, n_layers=2, n_heads=4,
      ...             n_kv_heads=2, d_ff=128).num_params()
      106816
    """

    model: ClassVar[str] = "llama"

    n_kv_heads: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(self.n_kv_heads > 0, "n_kv_heads", "must be positive", "use 1..n_heads")
        self._require(
            self.n_heads % self.n_kv_heads == 0,
            "n_kv_heads",
            f"must divide n_heads={self.n_heads}",
            "use a divisor of n_heads (n_kv_heads == n_heads is plain multi-head attention)",
        )
        self._require(
            self.head_dim % 2 == 0,
            "d_model",
            f"gives an odd head_dim={self.head_dim}, but rotary embeddings rotate pairs",
            "choose d_model and n_heads so that d_model // n_heads is even",
        )
        self._require(self.rope_theta > 0, "rope_theta", "must be positive", "use 10000.0")
        self._require(self.norm_eps > 0, "norm_eps", "must be positive", "use 1e-5")

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim

    def _mlp_params(self) -> int:
        """Parameters of one block's MLP: the SwiGLU ``gate``, ``up`` and ``down`` kernels."""
        return 3 * self.d_model * self.d_ff

    def num_params(self) -> int:
        """Returns the exact parameter count (embedding, blocks, final norm, untied head).

        Per block: two RMSNorm scales, q/k/v/o without biases (k and v of width ``kv_dim``),
        and the MLP (:meth:`_mlp_params`).
        """
        d = self.d_model
        block = 2 * d + _attention_params(d, self.n_heads, self.n_kv_heads, bias=False)
        block += self._mlp_params()
        return self.vocab_size * d + self.n_layers * block + d + d * self.vocab_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(LlamaConfig):
    """Llama-style blocks whose MLP is a top-k routed mixture of SwiGLU experts (Mixtral).

    Capacity is per sequence (a routing group is one batch row):
    ``ceil(capacity_factor * seq_len * top_k / n_experts)`` token slots per expert; tokens beyond
    it are dropped and pass through the residual only.

    Attributes:
      n_experts: number of experts per MoE layer.
      top_k: experts each token is routed to.
      capacity_factor: slack of each expert's token slots over a perfectly even split.
      aux_loss_coef: weight of the Switch load-balancing loss in the training loss.
      moe_impl: how the experts are computed; all three drop the same tokens and agree.
        ``"dense"``: GShard one-hot dispatch/combine einsums over ``[experts, capacity]`` slots.
        ``"ragged"``: tokens sorted by expert, ``jax.lax.ragged_dot``, scatter-add combine.
        ``"pallas"``: the same with the Pallas kernel :func:`shardplan.kernels.grouped_matmul`.

    Example:
      >>> MoEConfig(vocab_size=256, max_seq_len=32, d_model=64, n_layers=2, n_heads=4,
      ...           n_kv_heads=2, d_ff=128, n_experts=4, top_k=2).num_params()
      254784
    """

    model: ClassVar[str] = "moe"

    n_experts: int
    top_k: int
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01
    moe_impl: str = "dense"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(self.n_experts > 0, "n_experts", "must be positive", "use e.g. 8")
        self._require(self.top_k > 0, "top_k", "must be positive", "use 1 (Switch) or 2 (GShard)")
        self._require(
            self.top_k <= self.n_experts,
            "top_k",
            f"must be <= n_experts={self.n_experts}",
            "route each token to at most n_experts experts",
        )
        self._require(
            self.capacity_factor > 0, "capacity_factor", "must be positive", "use e.g. 1.25"
        )
        self._require(
            self.aux_loss_coef >= 0, "aux_loss_coef", "must be >= 0", "use e.g. 0.01 (Switch)"
        )
        self._require(
            self.moe_impl in MOE_IMPLS,
            "moe_impl",
            f"is not a known expert computation{_did_you_mean(self.moe_impl, MOE_IMPLS)}",
            f"use one of {', '.join(MOE_IMPLS)}",
        )

    def _mlp_params(self) -> int:
        """Parameters of one MoE MLP: the router kernel and the stacked expert kernels."""
        return self.d_model * self.n_experts + self.n_experts * 3 * self.d_model * self.d_ff

    def expert_capacity(self, tokens_per_group: int) -> int:
        """Token slots per expert for a routing group (a sequence); see :func:`expert_capacity`."""
        return expert_capacity(
            tokens_per_group,
            n_experts=self.n_experts,
            top_k=self.top_k,
            capacity_factor=self.capacity_factor,
        )


def expert_capacity(
    tokens_per_group: int, *, n_experts: int, top_k: int, capacity_factor: float
) -> int:
    """Token slots per expert: ``ceil(capacity_factor * tokens * top_k / n_experts)``.

    ``tokens`` is the size of a routing group (a sequence, in :class:`shardplan_models.moe.MoEMLP`). The
    result is clipped to ``[1, tokens_per_group]``: an expert never receives the same token
    twice, so more slots than tokens would stay empty.

    Example:
      >>> expert_capacity(32, n_experts=4, top_k=2, capacity_factor=1.25)
      20
    """
    slots = math.ceil(capacity_factor * tokens_per_group * top_k / n_experts)
    return max(1, min(slots, tokens_per_group))


_CONFIG_CLASSES: dict[str, type[ModelConfig]] = {
    cls.model: cls for cls in (GPTConfig, LlamaConfig, MoEConfig)
}


def preset_names() -> list[str]:
    """Returns the names of the preset YAML files in :data:`PRESETS_DIR`, sorted."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def _resolve(path_or_name: str | os.PathLike[str]) -> Path:
    """Finds the YAML file for a path or a preset name (``"gpt-tiny"``)."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    text = os.fspath(path_or_name)
    looks_like_path = path.suffix in (".yaml", ".yml") or os.sep in text or "/" in text
    if not looks_like_path:
        preset = PRESETS_DIR / f"{text}.yaml"
        if preset.is_file():
            return preset
        names = preset_names()
        raise ConfigError(
            format_error(
                f"Unknown model preset {text!r}{_did_you_mean(text, names)}.",
                where=str(PRESETS_DIR),
                remedy=f"use one of: {', '.join(names)}; or pass a path to a YAML file",
            )
        )
    raise ConfigError(
        format_error(
            f"Model config file not found: {text!r}.",
            where=str(path.resolve()),
            remedy=f"check the path, or use a preset name: {', '.join(preset_names())}",
        )
    )


def _check_keys(
    cls: type[ModelConfig], keys: list[str], *, where: str, allow_model: bool = False
) -> None:
    """Raises a ConfigError for the first key that is not a field of ``cls``."""
    fields = [f.name for f in dataclasses.fields(cls)]
    for key in keys:
        if key == "model" and allow_model:
            continue
        if key not in fields:
            raise ConfigError(
                format_error(
                    f"Unknown key {key!r} for a {cls.model!r} model"
                    f"{_did_you_mean(str(key), fields)}.",
                    where=where,
                    remedy=f"remove it or use one of the {cls.__name__} fields: {', '.join(fields)}",
                )
            )


def _coerce_floats(cls: type[ModelConfig], values: dict[str, Any]) -> dict[str, Any]:
    """Parses float fields that YAML 1.1 read as strings (``1e-5`` has no dot)."""
    out = dict(values)
    for field in dataclasses.fields(cls):
        value = out.get(field.name)
        if field.type == "float" and isinstance(value, str):
            # A string that is no number stays; __post_init__ reports the field and its value.
            with contextlib.suppress(ValueError):
                out[field.name] = float(value)
    return out


def config_from_dict(
    values: Mapping[str, Any], /, *, where: str = "<dict>", name: str | None = None
) -> ModelConfig:
    """Builds a config from a mapping with a ``model`` discriminator (the YAML schema).

    Args:
      values: ``{"model": "gpt"|"llama"|"moe", <field>: <value>, ...}``.
      where: where the mapping came from, for error messages (a file name).
      name: default for the ``name`` field when ``values`` has none.

    Returns:
      The validated config.

    Raises:
      ConfigError: no or an unknown ``model``, an unknown or missing key, or a bad value.

    Example:
      >>> config_from_dict({"model": "llama", "vocab_size": 256, "max_seq_len": 32,
      ...     "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128}).model
      'llama'
    """
    if not isinstance(values, Mapping):
        raise ConfigError(
            format_error(
                "A model config must be a mapping of field names to values.",
                where=where,
                value=type(values).__name__,
                remedy="write `key: value` lines, starting with `model: gpt|llama|moe`",
            )
        )
    kinds = list(_CONFIG_CLASSES)
    kind = values.get("model")
    if kind not in _CONFIG_CLASSES:
        problem = "has no `model` key" if kind is None else f"has unknown model {kind!r}"
        raise ConfigError(
            format_error(
                f"The model config {problem}{_did_you_mean(str(kind), kinds)}.",
                where=f"{where}: model",
                value=kind,
                remedy=f"add `model: <kind>` with kind one of {', '.join(kinds)}",
            )
        )
    cls = _CONFIG_CLASSES[kind]
    _check_keys(cls, [str(k) for k in values], where=where, allow_model=True)
    fields = {k: v for k, v in values.items() if k != "model"}
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in fields
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(
            format_error(
                f"The {kind!r} model config is missing required keys: {', '.join(missing)}.",
                where=where,
                remedy=f"add {', '.join(f'`{m}: ...`' for m in missing)}",
            )
        )
    if name is not None:
        fields.setdefault("name", name)
    try:
        return cls(**_coerce_floats(cls, fields))
    except ConfigError as err:
        raise ConfigError(f"{err}\n  file:  {where}") from err


def load_model_config(
    path_or_preset_name: str | os.PathLike[str],
    /,
    *,
    overrides: Mapping[str, Any] | None = None,
) -> ModelConfig:
    """Reads a model config from a YAML file or a preset name, then applies overrides.

    Args:
      path_or_preset_name: a path to a YAML file, or a preset name such as ``"gpt-tiny"`` which
        resolves to ``configs/models/gpt-tiny.yaml`` in the repository.
      overrides: field values replacing those of the file, e.g.
        ``{"n_layers": 4, "scan_layers": True}``.

    Returns:
      A :class:`GPTConfig`, :class:`LlamaConfig` or :class:`MoEConfig`; ``name`` defaults to the
      file's stem.

    Raises:
      ConfigError: the file is missing or unreadable, has an unknown or missing key (the message
        names the file and the key, with a did-you-mean), or a value is invalid.

    Example:
      >>> load_model_config("llama-tiny", overrides={"scan_layers": True}).scan_layers
      True
    """
    path = _resolve(path_or_preset_name)
    text = read_text(path, what="model config", remedy="check the path (configs/models/ has "
                                                       "the presets)")
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(
            format_error(
                f"Cannot read the model config: {err}",
                where=str(path),
                remedy="fix the YAML syntax",
            )
        ) from err
    config = config_from_dict(values if values is not None else {}, where=str(path), name=path.stem)
    if not overrides:
        return config
    where = f"overrides of {path}"
    _check_keys(type(config), [str(k) for k in overrides], where=where)
    try:
        return dataclasses.replace(config, **_coerce_floats(type(config), dict(overrides)))
    except ConfigError as err:
        raise ConfigError(f"{err}\n  file:  {where}") from err
