"""The plan artifact: frozen, jax-free values that say how a train step is sharded and staged.

A :class:`Plan` is what users review, diff and commit. Shardings are *specs*: one tuple of mesh
axis names per array dimension (``()``: replicated), which the runtime turns into
``PartitionSpec``\\ s; nothing here imports jax. Nothing in a plan depends on when it was made, so
equal inputs give equal JSON (up to the solver's wall-clock fields, :data:`VOLATILE_SOLVER_SUFFIX`).

Constructors validate: fields that contradict each other (a spec naming an axis its stage's mesh
lacks, mesh sizes vs device ids, stage numbering, a parameter on a missing stage) raise
:class:`~shardplan.errors.PlanMismatchError`; values of the wrong type or range (a remat policy
or schedule shardplan does not know, a leaf type that is not ``dtype[shape]``), a spec with more
entries than its leaf's recorded rank, and replicas that do not run the same layers once each
(what a hand-edited plan file gets wrong) raise :class:`~shardplan.errors.ConfigError`.

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
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from shardplan._schema import FrozenMap, check_choice, invalid, natural_key
from shardplan.errors import format_error
from shardplan.plan._values import (
    ACCUMULATIONS,
    PLAN_SCHEDULES,
    REMATS,
    Spec,
    _check_float,
    _check_int,
    _check_ints,
    _check_rank,
    _check_replica_layers,
    _check_str,
    _check_strs,
    _freeze_json,
    _mismatch,
    _sequence,
    as_spec,
    parse_type,
)
from shardplan.plan.summary import plan_summary

if TYPE_CHECKING:
    import os
    from pathlib import Path

__all__ = [
    "SCHEMA_VERSION", "SUPPORTED_SCHEMA_VERSIONS", "VIEWS", "VIEW_MODULES",
    "VOLATILE_SOLVER_SUFFIX", "FrozenMap", "Layout", "MeshSpec", "Plan", "Predicted",
    "ReplicaSpec", "Spec", "Stage", "as_spec", "check_schema_version", "natural_key",
]

SCHEMA_VERSION = 4
"""Version of the JSON layout :meth:`Plan.to_json` writes (``docs/plan-format.md``)."""

SUPPORTED_SCHEMA_VERSIONS: tuple[int, ...] = (2, 3, 4)
"""Schema versions :meth:`Plan.from_json` reads (2 is 3 without the pipeline fields: a
one-stage, one-replica plan; 3 is 4 without the argument types, the cluster's outline and the
compiled and measured figures, so a version-3 plan is checked against its step by hashes only)."""

VOLATILE_SOLVER_SUFFIX = "_time_s"
"""``Plan.solver`` keys ending in this are wall-clock durations (``solve_time_s``).

They are kept in the JSON (the summary shows them) but left out of :attr:`Plan.content_hash`,
so two plans made from equal inputs have the same hash although their solve times differ.
"""

_COLLECTIVE_FIELDS = ("bytes", "count")


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
            raise invalid("Mesh axis names must be distinct.", where="MeshSpec.axis_names",
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
      index: position in :attr:`Plan.stages` (``0 .. n-1``; a replica's stages in pipeline
        order, replica after replica).
      device_type: catalog name of the stage's devices, e.g. ``"a100-80g"``.
      mesh: the stage's mesh.
      layers: names of the op graph's layers the stage runs, in order (``"pre"``, ``"blocks.0"``,
        ..., ``"post"``); under the interleaved schedule, its chunks' layers in order.
      remat: rematerialisation policy (``"none"``, ``"selective"``, ``"full"``).
      replica: the data-parallel replica (:attr:`Plan.replicas`) the stage belongs to.
      layout: the key of :attr:`Plan.layouts` whose shardings the stage uses; ``""``: the
        plan's own :attr:`Plan.param_specs` and :attr:`Plan.batch_specs` (one-stage plans).

    Example:
        >>> Stage(0, "cpu", MeshSpec(("data",), (2,), (0, 1)), ("pre", "blocks.0")).remat
        'none'
    """

    index: int
    device_type: str
    mesh: MeshSpec
    layers: tuple[str, ...]
    remat: str = "none"
    replica: int = 0
    layout: str = ""

    def __post_init__(self) -> None:
        _check_int(self.index, where="Stage.index")
        _check_str(self.device_type, where=f"stages[{self.index}].device_type")
        if not isinstance(self.mesh, MeshSpec):
            raise invalid("A stage's mesh must be a MeshSpec.",
                          where=f"stages[{self.index}].mesh", value=self.mesh,
                          remedy="pass MeshSpec(axis_names, axis_sizes, device_ids)")
        object.__setattr__(self, "layers",
                           _check_strs(self.layers, where=f"stages[{self.index}].layers"))
        check_choice(self.remat, REMATS, where=f"stages[{self.index}].remat",
                     what="remat policy")
        _check_int(self.replica, where=f"stages[{self.index}].replica")
        _check_str(self.layout, where=f"stages[{self.index}].layout", empty_ok=True)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The intra-op shardings of the train step on one kind of sub-mesh (a device type and a
    mesh shape), shared by every stage on such a sub-mesh.

    Attributes:
      param_specs: ``{state key path: spec}`` for every state leaf; a stage applies the specs of
        the leaves its layers own (of a stacked leaf, the rows of its layers).
      batch_specs: ``{batch key path: spec}`` of one microbatch.
      kernel_specs: ``{equation path: (spec of each result, spec of each non-literal
        operand)}`` of the step's kernel calls (:mod:`shardplan.kernels`): the stage's programs
        run them in ``shard_map`` with these specs (XLA never partitions a kernel). The
        stages' other equations take the shardings XLA propagates from their arguments.

    Example:
        >>> Layout({"0/w": ((), ("model",))}, {"x": ((), ())}).param_specs["0/w"]
        ((), ('model',))
    """

    param_specs: Mapping[str, Spec]
    batch_specs: Mapping[str, Spec]
    kernel_specs: Mapping[str, tuple[tuple[Spec, ...], tuple[Spec, ...]]] = dataclasses.field(
        default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("param_specs", "batch_specs"):
            specs = _mapping(getattr(self, name), where=f"layout.{name}",
                             example="{'0/w': ((), ('model',))}")
            object.__setattr__(self, name, FrozenMap({
                _check_str(k, where=f"layout.{name} key", empty_ok=True):
                as_spec(v, where=f"layout.{name}[{k!r}]") for k, v in specs.items()}))
        kernels = _mapping(self.kernel_specs, where="layout.kernel_specs",
                           example="{'12/3': (((('data',), ()),), ((('data',), ()),))}")
        checked: dict[str, tuple[tuple[Spec, ...], tuple[Spec, ...]]] = {}
        for key, entry in kernels.items():
            _check_path(key, where="layout.kernel_specs key")
            where = f"layout.kernel_specs[{key!r}]"
            if isinstance(entry, str) or not isinstance(entry, Sequence) or len(entry) != 2:
                raise invalid("Expected (result specs, operand specs).", where=where,
                              value=entry, remedy="write (((('data',), ()),), "
                                                  "((('data',), ()),))")
            checked[key] = _pinned_specs(entry[0], entry[1], where=where)
        object.__setattr__(self, "kernel_specs", FrozenMap(checked))


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """A data-parallel copy of the model: its stages and how many microbatches it runs.

    Attributes:
      stages: indices into :attr:`Plan.stages`, in pipeline order.
      microbatches: microbatches the replica runs per step (faster replicas run more).

    Example:
        >>> ReplicaSpec((0, 1), 8).microbatches
        8
    """

    stages: tuple[int, ...]
    microbatches: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", _check_ints(self.stages, where="replica.stages",
                                                       minimum=0))
        _check_int(self.microbatches, where="replica.microbatches", minimum=1)


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
      stage_flops: per stage, the FLOPs one of its devices executes per step (every
        microbatch); empty where the planner gave none (plans of schema version 3).

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
    stage_flops: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_flops", tuple(
            _check_float(f, where=f"predicted.stage_flops[{i}]")
            for i, f in enumerate(_sequence(self.stage_flops, where="predicted.stage_flops"))))
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
                raise invalid("Each collective kind needs exactly 'count' and 'bytes'.",
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
      microbatches: microbatches per step, over all replicas (``1``: no gradient
        accumulation).
      schedule: pipeline schedule: ``"none"`` for a single stage, else ``"gpipe"``, ``"1f1b"`` or
        ``"interleaved"``.
      accumulation: how the microbatches combine (:data:`ACCUMULATIONS`): ``"exact"`` or
        ``"per_microbatch"`` (gradient accumulation semantics); the reason a step runs whole
        batches is in :attr:`notes`.
      microbatch_size: samples per microbatch (``0``: the batch divided by ``microbatches``).
      chunks: model chunks per stage under the interleaved schedule (else 1).
      replicas: the data-parallel replicas, each with its stages and microbatch count (they
        add up to ``microbatches``); empty: one replica of all stages.
      layouts: the intra-op shardings the stages refer to by :attr:`Stage.layout`. In a plan
        with layouts, :attr:`param_specs` lists each leaf on the first stage of replica 0 that
        holds it, with that stage's spec (a view for reading; the stages' layouts are what
        runs).
      predicted: the cost model's prediction.
      solver: the solver's report (status, objective, gap, ``solve_time_s``, ILP size, ...);
        JSON-native values only.
      notes: free-text remarks for the reader, in order.
      timings: wall-clock seconds of the planning phases (``trace_s``, ``solve_s``, ...):
        shown by :meth:`summary`, but neither written to the JSON nor compared, so equal
        inputs give byte-identical plan files.
      state_types: ``{state key path: "float32[8,16]"}``: the dtype and shape of every state
        leaf the plan was made for (what a plan applied to another model is checked against,
        so the error can name the leaf that differs).
      batch_types: ``{batch key path: "int32[64,128]"}``, likewise for the batch.
      cluster_info: an outline of the cluster the plan was made for: ``{"name": ...,
        "device_types": {type: {"count": n, "memory_bytes": b}}}`` (capacities the plan's
        memory is held to; names what differs when the cluster hash does not match).
      compiled: what XLA compiled the plan's programs to on the devices it ran on
        (``{"programs": [{"stage", "name", "memory_bytes", "flops", "collectives", ...}]}``;
        empty until verified, see :func:`shardplan.runtime.verify.verify`). Written to the
        JSON, but neither hashed nor compared: it describes a run, not the plan.
      measured: step times measured while running (``{"steps", "step_time_s",
        "stage_time_s"}``; empty until measured). Written, not hashed, not compared.
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
    accumulation: str = "exact"
    microbatch_size: int = 0
    chunks: int = 1
    replicas: tuple[ReplicaSpec, ...] = ()
    layouts: Mapping[str, Layout] = dataclasses.field(default_factory=dict)
    predicted: Predicted
    solver: Mapping[str, object]
    notes: tuple[str, ...] = ()
    timings: Mapping[str, float] = dataclasses.field(default_factory=dict, compare=False)
    state_types: Mapping[str, str] = dataclasses.field(default_factory=dict)
    batch_types: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cluster_info: Mapping[str, object] = dataclasses.field(default_factory=dict)
    compiled: Mapping[str, object] = dataclasses.field(default_factory=dict, compare=False)
    measured: Mapping[str, object] = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        check_schema_version(self.schema_version)
        for name in ("state_types", "batch_types"):
            object.__setattr__(self, name, FrozenMap({
                _check_str(k, where=f"plan.{name} key", empty_ok=True):
                _checked_type(v, where=f"plan.{name}[{k!r}]")
                for k, v in _mapping(getattr(self, name), where=f"plan.{name}",
                                     example="{'params/w': 'float32[8,16]'}").items()}))
        for name in ("cluster_info", "compiled", "measured"):
            value = _mapping(getattr(self, name), where=f"plan.{name}", example="{}")
            object.__setattr__(self, name, _freeze_json(value, where=f"plan.{name}"))
        object.__setattr__(self, "timings", FrozenMap(
            {_check_str(k, where="plan.timings key"): _check_float(v, where=f"plan.timings[{k!r}]")
             for k, v in _mapping(self.timings, where="plan.timings",
                                  example="{'solve_s': 1.5}").items()}))
        for name in ("shardplan_version", "graph_fingerprint", "cluster_hash", "config_hash"):
            _check_str(getattr(self, name), where=f"plan.{name}", empty_ok=True)
        _check_int(self.microbatches, where="plan.microbatches", minimum=1)
        check_choice(self.schedule, PLAN_SCHEDULES, where="plan.schedule",
                     what="pipeline schedule")
        if self.accumulation not in ACCUMULATIONS:
            raise invalid(
                "plan.accumulation is not one the runtime knows.", where="plan.accumulation",
                value=self.accumulation, remedy=f"one of {', '.join(ACCUMULATIONS)}")
        _check_int(self.microbatch_size, where="plan.microbatch_size")
        _check_int(self.chunks, where="plan.chunks", minimum=1)
        if not isinstance(self.predicted, Predicted):
            raise invalid("plan.predicted must be a Predicted.", where="plan.predicted",
                          value=self.predicted, remedy="pass Predicted(...)")
        object.__setattr__(self, "notes", tuple(
            _check_str(n, where=f"plan.notes[{i}]", empty_ok=True)
            for i, n in enumerate(_sequence(self.notes, where="plan.notes"))))
        solver = _mapping(self.solver, where="plan.solver", example="{'status': 'optimal'}")
        object.__setattr__(self, "solver", _freeze_json(solver, where="plan.solver"))
        stages = tuple(_sequence(self.stages, where="plan.stages"))
        object.__setattr__(self, "stages", stages)
        _check_stages(stages)
        object.__setattr__(self, "layouts", _check_layouts(self.layouts, stages))
        object.__setattr__(self, "replicas", _check_replicas(self.replicas, stages,
                                                             self.microbatches))
        object.__setattr__(self, "param_specs", _check_param_specs(self.param_specs, stages))
        object.__setattr__(self, "batch_specs", _check_batch_specs(
            self.batch_specs, tuple(s for s in stages if not s.layout)))
        object.__setattr__(self, "constraints", _check_constraints(self.constraints, stages))
        _check_replica_layers([r.stages for r in self.replicas],
                              [s.layers for s in stages], listed=bool(self.replicas))
        _check_ranks(self)
        devices = {d for s in stages for d in s.mesh.device_ids}
        unknown = sorted(set(self.predicted.memory_bytes) - devices)
        if unknown:
            raise _mismatch("The prediction lists memory for a device no stage uses.",
                            where=f"plan.predicted.memory_bytes[{unknown[0]}]", value=unknown,
                            remedy=f"predict memory only for the plan's devices {sorted(devices)}")

    def __hash__(self) -> int:
        return hash(self.content_hash)

    @property
    def replica_microbatches(self) -> tuple[int, ...]:
        """Microbatches per step of each replica."""
        return (tuple(r.microbatches for r in self.replicas) if self.replicas
                else (self.microbatches,))

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
        # plan/io.py imports this module (it builds Plans from JSON): a circle within plan/,
        # so the four methods that write or read JSON import io when first called.
        from shardplan.plan import io

        return io.content_hash(self)

    def to_json(self) -> str:
        """Canonical JSON (``docs/plan-format.md``): equal plans give byte-identical text.

        Example:
            >>> text = _example().to_json()
            >>> Plan.from_json(text) == _example() and text.endswith("}\\n")
            True
        """
        from shardplan.plan import io  # (late: io imports this module, see content_hash)

        return io.to_json(self)

    @classmethod
    def from_json(cls, text: str, /) -> Plan:
        """Reads a plan written by :meth:`to_json`.

        Raises:
          PlanMismatchError: another schema version, or fields that contradict each other.
          ConfigError: the text is not valid JSON (line and column named), a key is missing or
            unknown (with a did-you-mean), or a value has the wrong type.
        """
        from shardplan.plan import io  # (late: io imports this module, see content_hash)

        return io.from_json(text)

    def save(self, path: str | os.PathLike[str], /) -> Path:
        """Writes :meth:`to_json` to ``path`` atomically (temp file + ``os.replace``)."""
        from shardplan.plan import io  # (late: io imports this module, see content_hash)

        return io.save(self, path)

    def summary(self) -> str:
        """Plain-text summary, at most 100 columns wide, no colour codes
        (:mod:`shardplan.plan.summary`).

        Example:
            >>> print(_example().summary().splitlines()[0])  # doctest: +ELLIPSIS
            Plan ...: 1 stage, 2 devices, 1 microbatch, schedule none
        """
        return plan_summary(self)

    def explain(self, tensor: str | None = None) -> str:
        """Why this plan: the runner-ups with their predicted step time and memory, or with
        ``tensor`` (a state key path or pattern) that leaf's alternative shardings and what
        each would change. Plain text, at most 100 columns (:mod:`shardplan.viz.explain`).

        Raises:
          ConfigError: ``tensor`` names no state leaf of the plan (with a did-you-mean).

        Example:
            >>> print(_example().explain().splitlines()[0])  # doctest: +ELLIPSIS
            Plan ...: why this plan
        """
        return _view("explain")(self, tensor)

    def report(self) -> str:
        """Predicted | compiled | measured, side by side: memory per stage, FLOPs, collectives
        and step time (plain text, at most 100 columns; :mod:`shardplan.viz.report`). Compiled
        and measured columns are filled once the plan has run through
        :func:`shardplan.apply_plan` or :func:`shardplan.auto` (``step.plan``); before that they
        read ``-``.

        Example:
            >>> print(_example().report().splitlines()[0])  # doctest: +ELLIPSIS
            Plan ...: predicted | compiled | measured
        """
        return _view("text_report")(self)

    def to_html(self) -> str:
        """The plan as one self-contained HTML report (inline CSS, script and SVG; nothing
        fetched): cluster map, stages, tensors with their tiling, pipeline timeline, memory,
        runner-ups and predicted | compiled | measured (:mod:`shardplan.viz.html`).

        Example:
            >>> _example().to_html().startswith("<!DOCTYPE html>")
            True
        """
        return _view("report")(self)

    def _repr_html_(self) -> str:
        """The HTML report in an ``<iframe srcdoc>``, for notebooks (Jupyter calls this)."""
        return _view("notebook")(self)


# --------------------------------------------------------------------------- views

VIEWS: dict[str, Callable[..., str]] = {}
"""The plan's rendered views by name, each called with the plan (and the view's own
arguments): ``"explain"`` (:meth:`Plan.explain`, with ``tensor``), ``"text_report"``
(:meth:`Plan.report`), ``"report"`` (:meth:`Plan.to_html`) and ``"notebook"``
(:meth:`Plan._repr_html_`). The ``shardplan.viz`` modules that render them register them when
imported (:data:`VIEW_MODULES`): viz sits above plan, so plan does not import it; ``import
shardplan`` imports both. A registry rather than a value passed in because the methods are the
public API (``plan.explain()``, Jupyter's ``_repr_html_``); it is filled at import only."""

VIEW_MODULES = {"explain": "shardplan.viz.explain", "text_report": "shardplan.viz.report",
                "report": "shardplan.viz.html", "notebook": "shardplan.viz.html"}
"""The module that registers each view of :data:`VIEWS`."""


def _view(name: str) -> Callable[..., str]:
    """The view ``name`` of :data:`VIEWS`.

    Raises:
      RuntimeError: no module registered it (``shardplan.plan`` was imported on its own, without
        the ``shardplan`` package that imports the views).
    """
    try:
        return VIEWS[name]
    except KeyError:
        module = VIEW_MODULES.get(name, "the shardplan.viz module that renders it")
        raise RuntimeError(format_error(
            f"No plan view {name!r} is registered, so the plan cannot be rendered this way.",
            where="shardplan.plan.plan.VIEWS", value=sorted(VIEWS),
            remedy=f"import shardplan (or {module}) before rendering the plan")) from None


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
        raise invalid("Expected a mapping.", where=where, value=value,
                      remedy=f"pass e.g. {example}")
    return value


def _check_stages(stages: tuple[Stage, ...]) -> None:
    if not stages:
        raise invalid("A plan needs at least one stage.", where="plan.stages", value=(),
                      remedy="add a Stage covering the devices the step runs on")
    for i, stage in enumerate(stages):
        if not isinstance(stage, Stage):
            raise invalid("Expected a Stage.", where=f"plan.stages[{i}]", value=stage,
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
            raise invalid("Expected a pair (stage index, spec).", where=where, value=entry,
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
        _check_path(key, where="plan.constraints key")
        if isinstance(entry, str) or not isinstance(entry, Sequence) or len(entry) != 3:
            raise invalid("Expected (stage index, result specs, operand specs).",
                          where=where, value=entry,
                          remedy="write (0, ((('data',), ()),), ((('data',), ()),))")
        stage = _check_int(entry[0], where=f"{where} stage")
        if stage >= len(stages):
            raise _mismatch(f"The constraint is on stage {stage}, but the plan has "
                            f"{len(stages)} stage{'s' if len(stages) != 1 else ''}.",
                            where=where, value=stage,
                            remedy=f"use a stage index in 0 .. {len(stages) - 1}")
        results, operands = _pinned_specs(entry[1], entry[2], where=where)
        for part, specs in (("results", results), ("operands", operands)):
            for i, spec in enumerate(specs):
                _check_axes(spec, stages[stage], where=f"{where} {part}[{i}]")
        out[key] = (stage, results, operands)
    return FrozenMap(out)


def _check_path(key: object, *, where: str) -> None:
    """Raises ConfigError unless ``key`` is an equation path: indices joined by ``/``."""
    if not isinstance(key, str) or not all(p.isdigit() for p in key.split("/")):
        raise invalid("An equation path is equation indices joined by '/'.",
                      where=where, value=key, remedy="write e.g. '12/3'")


def _pinned_specs(results: object, operands: object, *, where: str
                  ) -> tuple[tuple[Spec, ...], tuple[Spec, ...]]:
    """An equation's result and operand specs, each checked (``as_spec``)."""
    def specs(items: object, part: str) -> tuple[Spec, ...]:
        return tuple(as_spec(spec, where=f"{where} {part}[{i}]")
                     for i, spec in enumerate(_sequence(items, where=f"{where} {part}")))

    return specs(results, "results"), specs(operands, "operands")


def _check_layouts(value: object, stages: tuple[Stage, ...]) -> FrozenMap[str, Layout]:
    layouts = _mapping(value, where="plan.layouts", example="{'a100-80g:model=8': Layout(...)}")
    for key, layout in layouts.items():
        _check_str(key, where="plan.layouts key")
        if not isinstance(layout, Layout):
            raise invalid("Expected a Layout.", where=f"plan.layouts[{key!r}]",
                          value=layout, remedy="pass Layout(param_specs, batch_specs)")
    checked: set[tuple[str, tuple[str, ...]]] = set()
    for stage in stages:
        if not stage.layout:
            continue
        if stage.layout not in layouts:
            raise _mismatch(f"Stage {stage.index} uses layout {stage.layout!r}, which the plan "
                            "does not define.", where=f"plan.stages[{stage.index}].layout",
                            value=stage.layout, remedy=f"use one of {sorted(layouts)}")
        # Stages of one layout on meshes with the same axes (a pipeline's replicas) pass or
        # fail together: checked once, by the first of them.
        if (stage.layout, stage.mesh.axis_names) in checked:
            continue
        checked.add((stage.layout, stage.mesh.axis_names))
        layout, names = layouts[stage.layout], set(stage.mesh.axis_names)
        for name in ("param_specs", "batch_specs"):
            for key, spec in getattr(layout, name).items():
                if not all(axis in names for dim in spec for axis in dim):
                    _check_axes(spec, stage,
                                where=f"plan.layouts[{stage.layout!r}].{name}[{key!r}]")
        for key, (results, operands) in layout.kernel_specs.items():
            for part, specs in (("results", results), ("operands", operands)):
                for i, spec in enumerate(specs):
                    _check_axes(spec, stage, where=f"plan.layouts[{stage.layout!r}]"
                                                   f".kernel_specs[{key!r}] {part}[{i}]")
    return FrozenMap(dict(layouts))


def _check_replicas(value: object, stages: tuple[Stage, ...],
                    microbatches: int) -> tuple[ReplicaSpec, ...]:
    replicas = tuple(_sequence(value, where="plan.replicas"))
    if not replicas:
        for stage in stages:
            if stage.replica:
                raise _mismatch(f"Stage {stage.index} is in replica {stage.replica}, but the "
                                "plan lists no replicas.", where="plan.replicas", value=(),
                                remedy="list the replicas, or put every stage in replica 0")
        return ()
    seen: list[int] = []
    for r, replica in enumerate(replicas):
        if not isinstance(replica, ReplicaSpec):
            raise invalid("Expected a ReplicaSpec.", where=f"plan.replicas[{r}]",
                          value=replica, remedy="pass ReplicaSpec(stages, microbatches)")
        for s in replica.stages:
            if s >= len(stages) or stages[s].replica != r:
                raise _mismatch(f"Replica {r} lists stage {s}, which is not a stage of replica "
                                f"{r}.", where=f"plan.replicas[{r}].stages", value=replica.stages,
                                remedy="list each stage in the replica its Stage.replica names")
        seen += replica.stages
    if sorted(seen) != list(range(len(stages))):
        raise _mismatch("Every stage must belong to exactly one replica.",
                        where="plan.replicas", value=[r.stages for r in replicas],
                        remedy=f"list the stages 0 .. {len(stages) - 1} once each")
    total = sum(r.microbatches for r in replicas)
    if total != microbatches:
        raise _mismatch(f"The replicas run {total} microbatches but the plan says "
                        f"{microbatches}.", where="plan.replicas",
                        value=[r.microbatches for r in replicas],
                        remedy="make plan.microbatches the sum of the replicas' microbatches")
    return replicas


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


def _checked_type(value: object, *, where: str) -> str:
    """``value`` if it is a ``"dtype[shape]"`` string (:func:`parse_type`)."""
    parse_type(value, where=where)
    return str(value)


def _check_ranks(plan: Plan) -> None:
    """Raises ConfigError where a spec has more entries than its leaf has dimensions (as
    ``plan.state_types`` / ``batch_types`` record them; leaves without a type are not checked:
    plans of schema version 3 record none)."""
    groups: list[tuple[str, Mapping[str, Spec], Mapping[str, str]]] = [
        ("plan.param_specs", {k: spec for k, (_, spec) in plan.param_specs.items()},
         plan.state_types),
        ("plan.batch_specs", plan.batch_specs, plan.batch_types)]
    for name, layout in plan.layouts.items():
        groups += [(f"plan.layouts[{name!r}].param_specs", layout.param_specs, plan.state_types),
                   (f"plan.layouts[{name!r}].batch_specs", layout.batch_specs, plan.batch_types)]
    for where, specs, types in groups:
        for key, spec in specs.items():
            if key in types:
                _check_rank(spec, types[key], where=f"{where}[{key!r}]")
