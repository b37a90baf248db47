"""``RunConfig``: the typed configuration of ``shardplan train config.yaml``.

One frozen dataclass per section of the YAML file (``model``, ``data``, ``optimizer``,
``cluster``, ``plan``, ``train``, ``output``), each checked when it is built. One loader
(:func:`shardplan._schema.build`) walks the dataclasses' fields (``typing.get_type_hints``)
over what ``yaml.safe_load`` read (:mod:`shardplan.train._typed_yaml`): an
unknown key at any level is a :class:`~shardplan.errors.ConfigError` with a did-you-mean naming
the key path and the file, a value of the wrong type one naming the key path and the value.
Dotted overrides (``--train.steps=200``) are applied to the mapping before it is built; their
values are YAML (``200`` an int, ``true`` a bool, ``[1, 2]`` a list).

:meth:`RunConfig.to_yaml` writes the resolved config (every default filled) that a run
directory stores; :func:`load_run_config` of that file gives an equal config.

Example:
    >>> config = load_run_config("configs/train/tiny.yaml", ["--train.steps=3"])
    >>> config.train.steps, config.model.build().n_layers
    (3, 2)
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optax
import yaml
from shardplan_models.config import ModelConfig, load_model_config
from shardplan_models.train import make_optimizer

from shardplan._schema import build, check_fields, convert, field_types, invalid, is_int, require
from shardplan.cluster import Cluster
from shardplan.data import BYTE_VOCAB_SIZE, DataConfig
from shardplan.errors import ConfigError, unknown_key
from shardplan.planner.config import PlanConfig
from shardplan.train._typed_yaml import apply_override, plain, read_yaml

__all__ = [
    "ClusterSection",
    "LocalCluster",
    "ModelSection",
    "OptimizerConfig",
    "OutputConfig",
    "PlanSection",
    "RunConfig",
    "TrainConfig",
    "load_run_config",
]


# --------------------------------------------------------------------------------------------
# the sections


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which model to train: a preset and the fields to change.

    Attributes:
      preset: a name in ``configs/models/`` (``"gpt-tiny"``) or a path to a model YAML file
        (relative to the working directory).
      overrides: model config fields replacing the preset's, e.g. ``{"n_layers": 4}``; checked
        by the model config loader (:func:`shardplan_models.config.load_model_config`).
    """

    preset: str
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fields(self, "model")
        require(
            isinstance(self.preset, str) and bool(self.preset),
            "model.preset",
            self.preset,
            "a preset name such as 'gpt-tiny' or a path to a model YAML file",
        )
        # Built now so that a bad preset or override fails when the config loads, not at step 0;
        # kept out of the fields (equality and to_dict see preset and overrides only).
        try:
            fields = [f.name for f in dataclasses.fields(load_model_config(self.preset))]
            for key in self.overrides:
                if key not in fields:
                    raise unknown_key(key, fields, f"model.overrides.{key}")
            built = load_model_config(self.preset, overrides=self.overrides)
        except ConfigError as err:
            raise ConfigError(
                f"{err}\n  in:    model (preset {self.preset!r}, overrides {self.overrides!r})"
            ) from err
        object.__setattr__(self, "_built", built)

    def build(self) -> ModelConfig:
        """Returns the model config: the preset with the overrides applied."""
        built: ModelConfig = self.__dict__["_built"]
        return built


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm clipping, on a linear-warmup + cosine-decay learning rate.

    The rate rises linearly from 0 at step 0 to ``learning_rate`` at ``warmup_steps``, then
    follows a cosine down to ``min_learning_rate`` at ``train.steps`` (Loshchilov & Hutter 2017,
    SGDR eq. 5, without restarts; the GPT-3 recipe, Brown et al. 2020, appendix B).

    Attributes:
      learning_rate: the peak learning rate.
      min_learning_rate: the rate the cosine ends at.
      warmup_steps: steps of linear warmup (0: none).
      weight_decay: AdamW's decoupled weight decay (not on biases and norm scales).
      b1: Adam's first-moment decay.
      b2: Adam's second-moment decay.
      eps: Adam's epsilon.
      clip_norm: the largest global gradient norm.
    """

    learning_rate: float = 1e-3
    min_learning_rate: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0

    def __post_init__(self) -> None:
        check_fields(self, "optimizer")
        for name in ("learning_rate", "weight_decay", "eps", "clip_norm"):
            value = getattr(self, name)
            require(
                value > 0 if name != "weight_decay" else value >= 0,
                f"optimizer.{name}",
                value,
                "a number >= 0" if name == "weight_decay" else "a number > 0",
            )
        require(
            0 <= self.min_learning_rate <= self.learning_rate,
            "optimizer.min_learning_rate",
            self.min_learning_rate,
            f"a number in [0, learning_rate={self.learning_rate}]",
        )
        for name in ("b1", "b2"):
            require(
                0 <= getattr(self, name) < 1,
                f"optimizer.{name}",
                getattr(self, name),
                "a number in [0, 1)",
            )
        require(
            self.warmup_steps >= 0, "optimizer.warmup_steps", self.warmup_steps, "an integer >= 0"
        )

    def schedule(self, steps: int, /) -> optax.Schedule:
        """The learning rate of each step: linear warmup, then cosine to the minimum.

        Args:
          steps: the length of the run (``train.steps``); the cosine ends there. A run no
            longer than the warmup only warms up (the rate rises throughout, as it would in
            the first steps of a longer run).

        Example:
          >>> lr = OptimizerConfig(learning_rate=1e-3, min_learning_rate=1e-4,
          ...                      warmup_steps=10).schedule(100)
          >>> [round(float(lr(step)), 8) for step in (0, 10, 100)]
          [0.0, 0.001, 0.0001]
        """
        require(is_int(steps) and steps > 0, "train.steps", steps, "an integer > 0")
        if steps <= self.warmup_steps:
            # A run no longer than its warmup (a smoke test: --train.steps=5) only warms up.
            return optax.linear_schedule(0.0, self.learning_rate, self.warmup_steps)
        # optax's decay_steps is the whole schedule, warmup included.
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=self.learning_rate,
            warmup_steps=self.warmup_steps,
            decay_steps=steps,
            end_value=self.min_learning_rate,
        )

    def build(self, steps: int, /) -> optax.GradientTransformation:
        """Clipping + AdamW (:func:`shardplan_models.train.make_optimizer`, its decay mask) on
        :meth:`schedule` ``(steps)``."""
        return make_optimizer(
            self.schedule(steps),
            weight_decay=self.weight_decay,
            clip_norm=self.clip_norm,
            b1=self.b1,
            b2=self.b2,
            eps=self.eps,
        )


@dataclasses.dataclass(frozen=True)
class LocalCluster:
    """The devices jax sees, one group per device type (:meth:`Cluster.local`).

    Attributes:
      types: emulate a mixed cluster: catalog device name -> count, given to consecutive
        devices (``{"a100-80g": 4, "v100-32g": 4}`` on 8 devices); None: every device jax
        sees, typed by its kind.
    """

    types: dict[str, int] | None = None

    def __post_init__(self) -> None:
        check_fields(self, "cluster.local")
        if self.types is not None:
            for name, count in self.types.items():
                require(
                    is_int(count) and count >= 1,
                    f"cluster.local.types.{name}",
                    count,
                    "an integer >= 1",
                )


@dataclasses.dataclass(frozen=True)
class ClusterSection:
    """The cluster to plan for and run on: exactly one of ``path`` and ``local``.

    Attributes:
      path: a cluster YAML file (``configs/clusters/*.yaml``), bound to the first
        ``num_devices`` devices jax sees.
      local: the local devices (:class:`LocalCluster`).
    """

    path: str | None = None
    local: LocalCluster | None = None

    def __post_init__(self) -> None:
        check_fields(self, "cluster")
        if (self.path is None) == (self.local is None):
            raise invalid(
                "The cluster section needs exactly one of `path` and `local`"
                + (" (both are given)." if self.path is not None else " (neither is given)."),
                where="cluster",
                value={"path": self.path, "local": self.local},
                remedy="write `cluster: {path: configs/clusters/<name>.yaml}`, or "
                "`cluster: {local: {}}` (all local devices), or "
                "`cluster: {local: {types: {a100-80g: 4, v100-32g: 4}}}`",
            )

    def build(self, devices: Sequence[Any] | None = None) -> Cluster:
        """Returns the cluster, bound to ``devices`` (default ``jax.devices()``).

        Raises:
          ConfigError: fewer devices than the cluster describes (naming both counts), or a
            cluster the cluster loader refuses (:class:`~shardplan.errors.ClusterError`).
        """
        if devices is None:
            import jax  # here: loading a config must not initialise a backend

            devices = jax.devices()
        devs = tuple(devices)
        if self.path is not None:
            cluster = Cluster.from_yaml(self.path)
            _check_device_count(cluster.num_devices, len(devs), f"cluster.path ({self.path})")
            return cluster.bind(devs[: cluster.num_devices])
        types_ = self.local.types if self.local is not None else None
        need = sum(types_.values()) if types_ else len(devs)
        _check_device_count(need, len(devs), "cluster.local.types")
        return Cluster.local(devs[:need], types=types_)


def _check_device_count(need: int, have: int, where: str) -> None:
    if have < need:
        raise invalid(
            f"The cluster has {need} devices but jax sees {have}.",
            where=where,
            value=need,
            remedy="run on a machine with that many devices, describe fewer devices, or on CPU "
            f"emulate them: XLA_FLAGS=--xla_force_host_platform_device_count={need}",
        )


@dataclasses.dataclass(frozen=True)
class PlanSection:
    """How to get the plan: plan with ``config``, or load ``file``.

    In YAML the section is flat: ``file`` next to the :class:`~shardplan.PlanConfig` options
    (``plan: {pipeline: true, max_stages: 2}``).

    Attributes:
      file: a plan file (``plan.save(path)``) to load instead of planning; None: plan.
      config: the planner's options.
    """

    file: str | None = None
    config: PlanConfig = dataclasses.field(default_factory=PlanConfig)

    def __post_init__(self) -> None:
        check_fields(self, "plan")

    @classmethod
    def mapping_fields(cls) -> dict[str, Any]:
        """The section's YAML keys and their types: ``file`` and the PlanConfig options."""
        return {"file": str | None, **field_types(PlanConfig)}

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any], /, *, where: str = "plan") -> PlanSection:
        """Builds the section from its flat YAML mapping."""
        values = dict(mapping)
        file = convert(values.pop("file", None), str | None, f"{where}.file")
        return cls(file=file, config=PlanConfig.from_dict(values, where=where))

    def to_dict(self) -> dict[str, Any]:
        """The flat YAML mapping: ``file`` and every PlanConfig option."""
        return {"file": self.file, **plain(dataclasses.asdict(self.config))}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training loop.

    Attributes:
      steps: optimizer steps to run.
      eval_every: evaluate on the validation batches every this many steps (their number is
        ``data.val_batches``); None: only at the end.
      log_every: log the training loss every this many steps.
      seed: seed of the parameter initialisation (the data order is ``data.seed``).
      sample_tokens: tokens of text sampled after training (0: no sample).
      sample_prompt: the text the sample continues.
      measure_steps: steps timed to compare the measured step time with the plan's prediction
        (0: none).
      stop_at: stop after this step as an interruption would (the schedule still spans
        ``steps``, and the next run resumes from the checkpoint written here); None: run to
        ``steps``.
    """

    steps: int = 1000
    eval_every: int | None = 100
    log_every: int = 10
    seed: int = 0
    sample_tokens: int = 200
    sample_prompt: str = "def "
    measure_steps: int = 10
    stop_at: int | None = None

    def __post_init__(self) -> None:
        check_fields(self, "train")
        require(
            self.stop_at is None or 1 <= self.stop_at <= self.steps,
            "train.stop_at",
            self.stop_at,
            "a step in 1 .. train.steps, or null",
        )
        require(self.steps >= 1, "train.steps", self.steps, "an integer >= 1")
        require(
            self.eval_every is None or self.eval_every >= 1,
            "train.eval_every",
            self.eval_every,
            "an integer >= 1, or null (evaluate at the end only)",
        )
        require(self.log_every >= 1, "train.log_every", self.log_every, "an integer >= 1")
        for name in ("seed", "sample_tokens", "measure_steps"):
            require(
                getattr(self, name) >= 0, f"train.{name}", getattr(self, name), "an integer >= 0"
            )


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    """Where the run writes.

    Attributes:
      dir: the run directory (resolved config, plan, checkpoints, metrics).
      checkpoint_every: save a checkpoint every this many steps; None: only at the end.
      keep_checkpoints: how many of the newest checkpoints to keep.
      resume: continue from the newest checkpoint in ``dir`` if there is one.
      resume_from_intact: where the newest checkpoint's files differ from the checksums
        recorded when it was saved, resume from the newest intact one, moving the damaged
        steps to ``dir/damaged-checkpoints`` (otherwise such a run is refused, naming the file).
    """

    dir: str = "runs/run"
    checkpoint_every: int | None = 100
    keep_checkpoints: int = 3
    resume: bool = True
    resume_from_intact: bool = False

    def __post_init__(self) -> None:
        check_fields(self, "output")
        require(bool(self.dir), "output.dir", self.dir, "a directory path")
        require(
            self.checkpoint_every is None or self.checkpoint_every >= 1,
            "output.checkpoint_every",
            self.checkpoint_every,
            "an integer >= 1, or null (at the end only)",
        )
        require(
            self.keep_checkpoints >= 1,
            "output.keep_checkpoints",
            self.keep_checkpoints,
            "an integer >= 1",
        )


def _local_cluster() -> ClusterSection:
    return ClusterSection(local=LocalCluster())


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything ``shardplan train`` needs, one section per YAML section.

    Only ``model.preset`` must be given; every other value has a default. Besides each
    section's checks, the sections must agree: ``data.seq_len <= model max_seq_len``, a
    byte-level corpus (``builtin``, ``text``) needs ``vocab_size >= 256``.
    """

    model: ModelSection
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    cluster: ClusterSection = dataclasses.field(default_factory=_local_cluster)
    plan: PlanSection = dataclasses.field(default_factory=PlanSection)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)

    def __post_init__(self) -> None:
        check_fields(self, "")
        model = self.model.build()
        if self.data.seq_len > model.max_seq_len:
            raise invalid(
                f"data.seq_len={self.data.seq_len} is longer than the model's max_seq_len="
                f"{model.max_seq_len}.",
                where="data.seq_len",
                value=self.data.seq_len,
                remedy=f"set data.seq_len <= {model.max_seq_len}, or "
                f"model.overrides.max_seq_len >= {self.data.seq_len}",
            )
        if self.data.source in ("builtin", "text") and model.vocab_size < BYTE_VOCAB_SIZE:
            raise invalid(
                f"The {self.data.source!r} corpus is byte-level ({BYTE_VOCAB_SIZE} token ids) "
                f"but the model's vocab_size is {model.vocab_size}.",
                where="data.source",
                value=self.data.source,
                remedy=f"set model.overrides.vocab_size: {BYTE_VOCAB_SIZE} (or more)",
            )

    def optimizer_transform(self) -> optax.GradientTransformation:
        """The optax optimizer of the run (:meth:`OptimizerConfig.build` over ``train.steps``)."""
        return self.optimizer.build(self.train.steps)

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain YAML values, every default filled."""
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_yaml(self) -> str:
        """:meth:`to_dict` as YAML, sections in declaration order."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


def load_run_config(path: str | os.PathLike[str], /, overrides: Sequence[str] = ()) -> RunConfig:
    """Reads a run config from YAML and applies dotted overrides.

    Args:
      path: the YAML file (``configs/train/demo.yaml``, or a run directory's stored config).
      overrides: ``"--section.key=value"`` (or without ``--``); values are YAML:
        ``--train.steps=200``, ``--output.resume=false``, ``--plan.schedules=[1f1b]``,
        ``--model.overrides.n_layers=4``.

    Returns:
      The checked config.

    Raises:
      ConfigError: the file is missing or not YAML (file, line, column), a key is unknown (key
        path, file and a did-you-mean; for an override, the override), a value has the wrong
        type or is out of range (key path and value), or the sections disagree.

    Example:
      >>> load_run_config("configs/train/tiny.yaml", ["output.resume=false"]).output.resume
      False
    """
    if isinstance(overrides, str):
        raise invalid(
            "The overrides must be a list of strings, not one string.",
            where="load_run_config(overrides=...)",
            value=overrides,
            remedy=f"pass [{overrides!r}]",
        )
    file = Path(path)
    raw = read_yaml(file, RunConfig)
    for text in overrides:
        apply_override(raw, text, RunConfig)
    try:
        return typing.cast(RunConfig, build(RunConfig, raw, ""))
    except ConfigError as err:
        shown = f"\n  overrides: {' '.join(overrides)}" if overrides else ""
        raise ConfigError(f"{err}\n  file:  {file}{shown}") from err
