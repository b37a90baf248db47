"""The plan artifact: frozen, jax-free values that say how a train step is sharded and staged.

A :class:`Plan` is what users review, diff and commit. Shardings are *specs*: one tuple of mesh
axis names per array dimension (``()``: replicated), which the runtime turns into
``PartitionSpec``\\ s; nothing here imports jax. Nothing in a plan depends on when it was made, so
equal inputs give equal JSON (up to the solver's wall-clock fields, :data:`VOLATILE_SOLVER_SUFFIX`).

Constructors validate: fields that contradict each other (a spec naming an axis its stage's mesh
lacks, mesh sizes vs device ids, stage numbering, a parameter on a missing stage) raise
:class:`~shardplan.errors.PlanMismatchError`; values of the wrong type or range raise
:class:`~shardplan.errors.ConfigError`.

Example:
    >>> mesh = MeshSpec(("data",), (2,), (0, 1))
    >>> plan = Plan(
    ...     shardplan_version="0.1.0", graph_fingerprint="g", cluster_hash="c", config_hash="k",
    ...     stages=(Stage(0, "cpu", mesh, ("pre", "blocks.0", "post")),),
    ...     param_specs={"0/w": (0, ((), ("data",)))}, batch_specs={"x": (("data",), ())},
    ...     predicted=Predicted(1e-3, 8e-4, 2e-4, {0: 1024, 1: 1024}, {}),
    ...     solver={"status": "optimal"})
    >>> plan.num_devices, plan.param_specs["0/w"]
    (2, (0, ((), ('data',))))
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from shardplan.errors import ConfigError, PlanMismatchError, ShardplanError, format_error

if TYPE_CHECKING:
    import os
    from pathlib import Path

__all__ = [
    "SCHEMA_VERSION", "SUPPORTED_SCHEMA_VERSIONS", "VOLATILE_SOLVER_SUFFIX", "FrozenMap",
    "MeshSpec", "Plan", "Predicted", "Spec", "Stage", "as_spec", "check_schema_version",
    "natural_key",
]

SCHEMA_VERSION = 2
"""Version of the JSON layout :meth:`Plan.to_json` writes (``docs/plan-format.md``)."""

SUPPORTED_SCHEMA_VERSIONS: tuple[int, ...] = (2,)
"""Schema versions :meth:`Plan.from_json` reads."""

VOLATILE_SOLVER_SUFFIX = "_time_s"
"""``Plan.solver`` keys ending in this are wall-clock durations (``solve_time_s``).

They are kept in the JSON (the summary shows them) but left out of :attr:`Plan.content_hash`,
so two plans made from equal inputs have the same hash although their solve times differ.
"""

Spec = tuple[tuple[str, ...], ...]
"""A sharding: per array dimension, the mesh axes it is split over (``()``: replicated)."""

_K = TypeVar("_K", str, int)
_V = TypeVar("_V")

_COLLECTIVE_FIELDS = ("bytes", "count")


def natural_key(key: str | int) -> tuple[Any, ...]:
    """Sort key that orders digit runs by value: ``blocks/2`` before ``blocks/10``.

    Example:
        >>> sorted(["b/10", "b/2", "a"], key=natural_key)
        ['a', 'b/2', 'b/10']
    """
    if isinstance(key, int):
        return (0, key)
    parts = re.split(r"(\d+)", key)
    # Digit runs compare by value, then by text ("01" vs "1") so distinct keys never tie.
    return (1, tuple((0, int(p), p) if i % 2 else (1, 0, p) for i, p in enumerate(parts)))


class FrozenMap(Mapping[_K, _V]):
    """An immutable, hashable mapping whose iteration order is :func:`natural_key` order.

    Example:
        >>> m = FrozenMap({"b": 1, "a": 2})
        >>> list(m), m == {"a": 2, "b": 1}, hash(m) == hash(FrozenMap({"a": 2, "b": 1}))
        (['a', 'b'], True, True)
    """

    __slots__ = ("_hash", "_items")

    def __init__(self, items: Mapping[_K, _V] | Iterable[tuple[_K, _V]] = ()) -> None:
        pairs = dict(items)
        self._items: dict[_K, _V] = dict(sorted(pairs.items(), key=lambda kv: natural_key(kv[0])))
        self._hash: int | None = None

    def __getitem__(self, key: _K) -> _V:
        return self._items[key]

    def __iter__(self) -> Iterator[_K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(self._items.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self._items) == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMap({self._items!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenMap, (self._items,))


# --------------------------------------------------------------------------- value checks


def _config_error(what: str, *, where: str, value: object = None, remedy: str,
                  kind: type[ShardplanError] = ConfigError) -> ShardplanError:
    return kind(format_error(what, where=where, value=value, remedy=remedy, has_value=True))


_mismatch = functools.partial(_config_error, kind=PlanMismatchError)


def _check_str(value: object, *, where: str, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not empty_ok and not value):
        raise _config_error("Expected a non-empty string.", where=where, value=value,
                            remedy="write a string such as 'a100-80g' or 'blocks.0'")
    return value


def _check_int(value: object, *, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _config_error(f"Expected an integer >= {minimum}.", where=where, value=value,
                            remedy=f"write a whole number >= {minimum}")
    return value


def _check_float(value: object, *, where: str) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(float(value)) or float(value) < 0:  # type: ignore[arg-type]
        raise _config_error("Expected a finite number >= 0.", where=where, value=value,
                            remedy="write seconds as a non-negative finite number")
    return float(value)  # type: ignore[arg-type]


def _sequence(value: object, *, where: str, example: str = "[...]") -> Sequence[Any]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise _config_error("Expected a list.", where=where, value=value,
                            remedy=f"write a list such as {example}")
    return value


def _check_strs(value: object, *, where: str) -> tuple[str, ...]:
    items = _sequence(value, where=where, example="['data', 'model']")
    return tuple(_check_str(v, where=f"{where}[{i}]") for i, v in enumerate(items))


def _check_ints(value: object, *, where: str, minimum: int) -> tuple[int, ...]:
    items = _sequence(value, where=where, example="[2, 4]")
    return tuple(_check_int(v, where=f"{where}[{i}]", minimum=minimum) for i, v in enumerate(items))


def as_spec(value: object, /, *, where: str = "spec") -> Spec:
    """Normalises a sharding to a :data:`Spec`.

    Accepts the canonical form and ``PartitionSpec``-like entries: per dimension ``None`` (or
    ``()``) for replicated, an axis name, or a sequence of axis names.

    Args:
      value: the sharding, one entry per array dimension.
      where: the field or key path named by errors.

    Returns:
      A tuple with one tuple of axis names per dimension.

    Raises:
      ConfigError: an entry is not ``None``, a name or a sequence of names, or an axis repeats.

    Example:
        >>> as_spec((None, "model", ("data", "fsdp")))
        ((), ('model',), ('data', 'fsdp'))
    """
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise _config_error(
            "A sharding must be a sequence with one entry per array dimension.", where=where,
            value=value, remedy="write e.g. [[\"data\"], []] (JSON) or ((\"data\",), ()) (Python)")
    dims: list[tuple[str, ...]] = []
    for d, entry in enumerate(value):
        if entry is None:
            dims.append(())
        elif isinstance(entry, str):
            dims.append((_check_str(entry, where=f"{where}[{d}]"),))
        else:
            dims.append(_check_strs(entry, where=f"{where}[{d}]"))
    axes = [a for dim in dims for a in dim]
    repeated = sorted({a for a in axes if axes.count(a) > 1})
    if repeated:
        raise _config_error(
            f"A sharding uses mesh axis {repeated[0]!r} on more than one dimension.",
            where=where, value=tuple(dims),
            remedy="split each mesh axis over at most one array dimension")
    return tuple(dims)


def _freeze_json(value: object, *, where: str) -> object:
    """JSON-native value -> immutable equivalent (lists -> tuples, dicts -> FrozenMap)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _config_error("Non-finite numbers cannot be written to a plan.", where=where,
                                value=value, remedy="use None for an unknown value")
        return value
    if isinstance(value, Mapping):
        return FrozenMap({_check_str(k, where=f"{where} key"):
                          _freeze_json(v, where=f"{where}.{k}") for k, v in value.items()})
    if isinstance(value, Sequence):
        return tuple(_freeze_json(v, where=f"{where}[{i}]") for i, v in enumerate(value))
    raise _config_error("Expected a JSON value (None, bool, number, string, list, mapping).",
                        where=where, value=value, remedy="convert it to a JSON-native value")


# --------------------------------------------------------------------------- data types


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A stage's device mesh: named axes over cluster device ids, row-major.

    Mirrors :class:`shardplan.cluster.mesh.LogicalMesh` without depending on it.

    Attributes:
      axis_names: e.g. ``("data", "model")``.
      axis_sizes: e.g. ``(2, 4)``; their product is the number of device ids.
      device_ids: cluster device ids in row-major order (the last axis varies fastest).

    Example:
        >>> MeshSpec(("data", "model"), (2, 2), (0, 1, 2, 3)).shape
        {'data': 2, 'model': 2}
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    device_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        names = _check_strs(self.axis_names, where="MeshSpec.axis_names")
        sizes = _check_ints(self.axis_sizes, where="MeshSpec.axis_sizes", minimum=1)
        ids = _check_ints(self.device_ids, where="MeshSpec.device_ids", minimum=0)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "axis_sizes", sizes)
        object.__setattr__(self, "device_ids", ids)
        if len(names) != len(sizes):
            raise _mismatch("A mesh needs one size per axis name.", where="MeshSpec",
                            value=(names, sizes),
                            remedy="give axis_names and axis_sizes equal length")
        if len(set(names)) != len(names):
            raise _config_error("Mesh axis names must be distinct.", where="MeshSpec.axis_names",
                                value=names, remedy="rename the repeated axis")
        if math.prod(sizes) != len(ids):
            raise _mismatch(
                f"The mesh sizes multiply to {math.prod(sizes)} but it lists {len(ids)} devices.",
                where="MeshSpec", value=(sizes, ids),
                remedy="list exactly prod(axis_sizes) device ids, or change the sizes")
        if len(set(ids)) != len(ids):
            raise _mismatch("A device appears twice in one mesh.", where="MeshSpec.device_ids",
                            value=ids, remedy="list each device id once")

    @property
    def shape(self) -> dict[str, int]:
        """``{axis name: size}``."""
        return dict(zip(self.axis_names, self.axis_sizes, strict=True))

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)

    def describe(self) -> str:
        """``"(data=2, model=4)"``: axis names with sizes."""
        return "(" + ", ".join(f"{n}={s}" for n, s in self.shape.items()) + ")"


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: an SPMD program on a sub-mesh of one device type.

    Attributes:
      index: position in :attr:`Plan.stages` (``0 .. n-1``, in pipeline order).
      device_type: catalog name of the stage's devices, e.g. ``"a100-80g"``.
      mesh: the stage's mesh.
      layers: names of the op graph's layers the stage runs, in order (``"pre"``, ``"blocks.0"``,
        ..., ``"post"``).
      remat: rematerialisation policy; ``"none"`` keeps every activation.

    Example:
        >>> Stage(0, "cpu", MeshSpec(("data",), (2,), (0, 1)), ("pre", "blocks.0")).remat
        'none'
    """

    index: int
    device_type: str
    mesh: MeshSpec
    layers: tuple[str, ...]
    remat: str = "none"

    def __post_init__(self) -> None:
        _check_int(self.index, where="Stage.index")
        _check_str(self.device_type, where=f"stages[{self.index}].device_type")
        if not isinstance(self.mesh, MeshSpec):
            raise _config_error("A stage's mesh must be a MeshSpec.",
                                where=f"stages[{self.index}].mesh", value=self.mesh,
                                remedy="pass MeshSpec(axis_names, axis_sizes, device_ids)")
        object.__setattr__(self, "layers",
                           _check_strs(self.layers, where=f"stages[{self.index}].layers"))
        _check_str(self.remat, where=f"stages[{self.index}].remat")


@dataclasses.dataclass(frozen=True)
class Predicted:
    """What the cost model predicts for one training step under the plan.

    Attributes:
      step_time_s: predicted wall-clock time of one step, seconds.
      compute_s: the compute part of it (critical path), seconds.
      communication_s: the communication part of it (critical path), seconds.
      memory_bytes: ``{device id: peak bytes}``.
      collectives: ``{kind: {"count": n, "bytes": b}}`` per step, kinds as in HLO
        (``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"``,
        ``"collective-permute"``).

    Example:
        >>> p = Predicted(0.1, 0.08, 0.02, {0: 2**30}, {"all-reduce": {"count": 1, "bytes": 4}})
        >>> p.collectives["all-reduce"]["bytes"]
        4
    """

    step_time_s: float
    compute_s: float
    communication_s: float
    memory_bytes: Mapping[int, int]
    collectives: Mapping[str, Mapping[str, int]]  # kind -> {count, bytes}

    def __post_init__(self) -> None:
        for name in ("step_time_s", "compute_s", "communication_s"):
            object.__setattr__(self, name,
                               _check_float(getattr(self, name), where=f"predicted.{name}"))
        memory = {_check_int(d, where="predicted.memory_bytes key"):
                  _check_int(b, where=f"predicted.memory_bytes[{d}]")
                  for d, b in _mapping(self.memory_bytes, where="predicted.memory_bytes",
                                       example="{0: 17179869184}").items()}
        object.__setattr__(self, "memory_bytes", FrozenMap(memory))
        totals: dict[str, FrozenMap[str, int]] = {}
        collectives = _mapping(self.collectives, where="predicted.collectives",
                               example="{'all-reduce': {'count': 2, 'bytes': 4096}}")
        for kind, entry in collectives.items():
            where = f"predicted.collectives[{kind!r}]"
            _check_str(kind, where="predicted.collectives key")
            if not isinstance(entry, Mapping) or sorted(entry) != list(_COLLECTIVE_FIELDS):
                raise _config_error("Each collective kind needs exactly 'count' and 'bytes'.",
                                    where=where, value=entry,
                                    remedy="write {'count': n, 'bytes': b}")
            totals[kind] = FrozenMap({k: _check_int(entry[k], where=f"{where}.{k}")
                                      for k in _COLLECTIVE_FIELDS})
        object.__setattr__(self, "collectives", FrozenMap(totals))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """How a train step is sharded, staged and scheduled on a cluster (see module docstring).

    Attributes:
      schema_version: JSON layout version; always :data:`SCHEMA_VERSION` in memory.
      shardplan_version: version of shardplan that made the plan.
      graph_fingerprint: fingerprint of the traced op graph the plan is for.
      cluster_hash: hash of the cluster description the plan is for.
      config_hash: hash of the planning configuration.
      stages: the pipeline stages, ``stages[i].index == i``.
      param_specs: ``{state key path: (stage index, spec)}`` for every state leaf.
      batch_specs: ``{batch key path: spec}``; each spec must fit every stage's mesh, since the
        runtime places a batch leaf on whichever stage reads it.
      constraints: ``{equation path: (stage index, spec of each result, spec of each
        operand)}``: shardings the runtime pins with ``with_sharding_constraint`` on what an
        equation reads and writes, so the compiled program does what the plan predicts (the
        partitioner does not choose how to compute a matmul whose operands and result are all
        fixed). An equation path is ``"12"`` for the 13th
        top-level equation of the traced step, ``"12/3"`` for the 4th equation inside the call
        (``jit``, custom derivative) that equation makes (:attr:`shardplan.trace.Op.path`).
      microbatches: microbatches per step (``1``: no gradient accumulation).
      schedule: pipeline schedule, ``"none"`` for a single stage.
      predicted: the cost model's prediction.
      solver: the solver's report (status, objective, gap, ``solve_time_s``, ILP size, ...);
        JSON-native values only.
      notes: free-text remarks for the reader, in order.
    """

    schema_version: int = SCHEMA_VERSION
    shardplan_version: str
    graph_fingerprint: str
    cluster_hash: str
    config_hash: str
    stages: tuple[Stage, ...]
    param_specs: Mapping[str, tuple[int, Spec]]
    batch_specs: Mapping[str, Spec]
    constraints: Mapping[str, tuple[int, tuple[Spec, ...], tuple[Spec, ...]]] = (
        dataclasses.field(default_factory=dict))
    microbatches: int = 1
    schedule: str = "none"
    predicted: Predicted
    solver: Mapping[str, object]
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_schema_version(self.schema_version)
        for name in ("shardplan_version", "graph_fingerprint", "cluster_hash", "config_hash"):
            _check_str(getattr(self, name), where=f"plan.{name}", empty_ok=True)
        _check_int(self.microbatches, where="plan.microbatches", minimum=1)
        _check_str(self.schedule, where="plan.schedule")
        if not isinstance(self.predicted, Predicted):
            raise _config_error("plan.predicted must be a Predicted.", where="plan.predicted",
                                value=self.predicted, remedy="pass Predicted(...)")
        object.__setattr__(self, "notes", tuple(
            _check_str(n, where=f"plan.notes[{i}]", empty_ok=True)
            for i, n in enumerate(_sequence(self.notes, where="plan.notes"))))
        solver = _mapping(self.solver, where="plan.solver", example="{'status': 'optimal'}")
        object.__setattr__(self, "solver", _freeze_json(solver, where="plan.solver"))
        stages = tuple(_sequence(self.stages, where="plan.stages"))
        object.__setattr__(self, "stages", stages)
        _check_stages(stages)
        object.__setattr__(self, "param_specs", _check_param_specs(self.param_specs, stages))
        object.__setattr__(self, "batch_specs", _check_batch_specs(self.batch_specs, stages))
        object.__setattr__(self, "constraints", _check_constraints(self.constraints, stages))
        devices = {d for s in stages for d in s.mesh.device_ids}
        unknown = sorted(set(self.predicted.memory_bytes) - devices)
        if unknown:
            raise _mismatch("The prediction lists memory for a device no stage uses.",
                            where=f"plan.predicted.memory_bytes[{unknown[0]}]", value=unknown,
                            remedy=f"predict memory only for the plan's devices {sorted(devices)}")

    def __hash__(self) -> int:
        return hash(self.content_hash)

    @property
    def num_devices(self) -> int:
        """Number of distinct devices over all stages."""
        return len({d for s in self.stages for d in s.mesh.device_ids})

    @functools.cached_property
    def content_hash(self) -> str:
        """sha256 (hex) of the canonical JSON, without the solver's ``*_time_s`` fields.

        Equal plans have equal hashes; any change of a decision (a spec, a stage, a count) or of
        an input hash changes it.
        """
        from shardplan.plan import io  # io imports this module: import it when first needed

        return io.content_hash(self)

    def to_json(self) -> str:
        """Canonical JSON (``docs/plan-format.md``): equal plans give byte-identical text.

        Example:
            >>> text = _example().to_json()
            >>> Plan.from_json(text) == _example() and text.endswith("}\\n")
            True
        """
        from shardplan.plan import io

        return io.to_json(self)

    @classmethod
    def from_json(cls, text: str, /) -> Plan:
        """Reads a plan written by :meth:`to_json`.

        Raises:
          PlanMismatchError: another schema version, or fields that contradict each other.
          ConfigError: the text is not valid JSON (line and column named), a key is missing or
            unknown (with a did-you-mean), or a value has the wrong type.
        """
        from shardplan.plan import io

        return io.from_json(text)

    def save(self, path: str | os.PathLike[str], /) -> Path:
        """Writes :meth:`to_json` to ``path`` atomically (temp file + ``os.replace``)."""
        from shardplan.plan import io

        return io.save(self, path)

    def summary(self) -> str:
        """Plain-text summary, at most 100 columns wide, no colour codes.

        Example:
            >>> print(_example().summary().splitlines()[0])  # doctest: +ELLIPSIS
            Plan ...: 1 stage, 2 devices, 1 microbatch, schedule none
        """
        from shardplan.plan import summary

        return summary.plan_summary(self)


def _example() -> Plan:
    """A one-stage plan on two devices, for docstrings."""
    mesh = MeshSpec(("data",), (2,), (0, 1))
    return Plan(shardplan_version="0.1.0", graph_fingerprint="g", cluster_hash="c",
                config_hash="k", stages=(Stage(0, "cpu", mesh, ("pre", "blocks.0", "post")),),
                param_specs={"0/w": (0, ((), ("data",)))}, batch_specs={"x": (("data",), ())},
                predicted=Predicted(1e-3, 8e-4, 2e-4, {0: 1024, 1: 1024}, {}),
                solver={"status": "optimal", "solve_time_s": 0.01})


# --------------------------------------------------------------------------- plan checks
# (The module passes ~600 lines: every field's validation sits next to the dataclasses it guards,
# so each error names its field; the value checks above could move to their own module.)


def check_schema_version(version: object, *, made_by: object = None) -> None:
    """Raises PlanMismatchError unless ``version`` is in :data:`SUPPORTED_SCHEMA_VERSIONS`."""
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        wrote = f"shardplan {made_by}, which wrote it" if isinstance(made_by, str) else (
            "the shardplan version named in its shardplan_version field")
        raise _mismatch(
            f"This plan has schema_version {version!r}; this shardplan reads schema_version "
            f"{', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))}.",
            where="plan.schema_version", value=version,
            remedy=f"make the plan again with this shardplan (sp.make_plan), or install {wrote}")


def _mapping(value: object, *, where: str, example: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise _config_error("Expected a mapping.", where=where, value=value,
                            remedy=f"pass e.g. {example}")
    return value


def _check_stages(stages: tuple[Stage, ...]) -> None:
    if not stages:
        raise _config_error("A plan needs at least one stage.", where="plan.stages", value=(),
                            remedy="add a Stage covering the devices the step runs on")
    for i, stage in enumerate(stages):
        if not isinstance(stage, Stage):
            raise _config_error("Expected a Stage.", where=f"plan.stages[{i}]", value=stage,
                                remedy="pass Stage(index, device_type, mesh, layers)")
        if stage.index != i:
            raise _mismatch(
                f"Stage indices must be consecutive from 0; position {i} holds stage "
                f"{stage.index}.", where=f"plan.stages[{i}].index", value=stage.index,
                remedy=f"number the stages 0 .. {len(stages) - 1} in pipeline order")


def _check_axes(spec: Spec, stage: Stage, *, where: str) -> None:
    """Raises PlanMismatchError when ``spec`` names an axis ``stage``'s mesh lacks."""
    for dim in spec:
        for axis in dim:
            if axis not in stage.mesh.axis_names:
                raise _mismatch(
                    f"The sharding names mesh axis {axis!r}, which stage {stage.index}'s mesh "
                    f"{stage.mesh.describe()} ({stage.device_type}) does not have.",
                    where=where, value=spec,
                    remedy=f"use only the axes {stage.mesh.axis_names} of stage {stage.index}, "
                           f"or add {axis!r} to that mesh")


def _check_param_specs(value: object,
                       stages: tuple[Stage, ...]) -> FrozenMap[str, tuple[int, Spec]]:
    out: dict[str, tuple[int, Spec]] = {}
    specs = _mapping(value, where="plan.param_specs",
                     example="{'0/blocks/0/mlp/kernel': (0, ((), ('model',)))}")
    for key, entry in specs.items():
        where = f"plan.param_specs[{key!r}]"
        _check_str(key, where="plan.param_specs key", empty_ok=True)  # "" = a bare array
        if isinstance(entry, str) or not isinstance(entry, Sequence) or len(entry) != 2:
            raise _config_error("Expected a pair (stage index, spec).", where=where, value=entry,
                                remedy="write (0, (('data',), ()))")
        stage = _check_int(entry[0], where=f"{where} stage")
        if stage >= len(stages):
            raise _mismatch(
                f"The parameter is placed on stage {stage}, but the plan has {len(stages)} "
                f"stage{'s' if len(stages) != 1 else ''}.", where=where, value=stage,
                remedy=f"use a stage index in 0 .. {len(stages) - 1}")
        spec = as_spec(entry[1], where=where)
        _check_axes(spec, stages[stage], where=where)
        out[key] = (stage, spec)
    return FrozenMap(out)


def _check_constraints(value: object, stages: tuple[Stage, ...]
                       ) -> FrozenMap[str, tuple[int, tuple[Spec, ...], tuple[Spec, ...]]]:
    out: dict[str, tuple[int, tuple[Spec, ...], tuple[Spec, ...]]] = {}
    entries = _mapping(value, where="plan.constraints",
                       example="{'12/3': (0, ((('data',), ()),), ((('data',), ()),))}")

    def order(key: object) -> tuple[int, ...]:
        return tuple(int(p) if p.isdigit() else -1 for p in str(key).split("/"))

    for key in sorted(entries, key=order):
        entry = entries[key]
        where = f"plan.constraints[{key!r}]"
        if not isinstance(key, str) or not all(p.isdigit() for p in key.split("/")):
            raise _config_error("An equation path is equation indices joined by '/'.",
                                where="plan.constraints key", value=key, remedy="write e.g. '12/3'")
        if isinstance(entry, str) or not isinstance(entry, Sequence) or len(entry) != 3:
            raise _config_error("Expected (stage index, result specs, operand specs).",
                                where=where, value=entry,
                                remedy="write (0, ((('data',), ()),), ((('data',), ()),))")
        stage = _check_int(entry[0], where=f"{where} stage")
        if stage >= len(stages):
            raise _mismatch(f"The constraint is on stage {stage}, but the plan has "
                            f"{len(stages)} stage{'s' if len(stages) != 1 else ''}.",
                            where=where, value=stage,
                            remedy=f"use a stage index in 0 .. {len(stages) - 1}")
        groups = []
        for part, items in (("results", entry[1]), ("operands", entry[2])):
            specs = tuple(as_spec(spec, where=f"{where} {part}[{i}]")
                          for i, spec in enumerate(_sequence(items, where=f"{where} {part}")))
            for i, spec in enumerate(specs):
                _check_axes(spec, stages[stage], where=f"{where} {part}[{i}]")
            groups.append(specs)
        out[key] = (stage, groups[0], groups[1])
    return FrozenMap(out)


def _check_batch_specs(value: object, stages: tuple[Stage, ...]) -> FrozenMap[str, Spec]:
    out: dict[str, Spec] = {}
    specs = _mapping(value, where="plan.batch_specs", example="{'inputs': (('data',), ())}")
    for key, entry in specs.items():
        where = f"plan.batch_specs[{key!r}]"
        _check_str(key, where="plan.batch_specs key", empty_ok=True)  # "" = a bare array
        spec = as_spec(entry, where=where)
        for stage in stages:
            _check_axes(spec, stage, where=where)
        out[key] = spec
    return FrozenMap(out)
