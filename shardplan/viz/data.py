"""What the visualizer shows, derived from a :class:`~shardplan.plan.plan.Plan` alone.

The terminal view (:mod:`shardplan.viz.terminal`) and the HTML report (:mod:`shardplan.viz.html`)
draw the same figures, computed here once, without jax (a plan file is enough):

* :func:`tensors`: every state and batch leaf with its shape, dtype, stage, spec and bytes per
  device (from the plan's ``state_types`` / ``batch_types``; plans of schema 3 have none, and
  their leaves show spec and stage only);
* :func:`tiles`: which block of a tensor each device of its stage's mesh holds, for any rank;
* :func:`memory`: per device, the predicted peak split into parameters, gradients, optimizer
  state and the rest (activations and temporaries), against the device's capacity;
* :func:`devices`: every device of the cluster with its type and the stage it runs (or none).

Leaf kinds: a state leaf whose key path has an optimizer component (``opt_state``, an Adam
moment ``mu`` / ``nu``, a ``count``) or is a top-level step counter is optimizer state; other
state leaves are parameters. Gradients are counted as the parameters are laid out (the step
holds one gradient per parameter, sharded as the update reads it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardplan._format import key_pattern
from shardplan.plan._values import parse_type

if TYPE_CHECKING:
    from shardplan.plan.plan import MeshSpec, Plan, Spec, Stage

__all__ = ["DeviceView", "MemoryView", "TensorView", "Tile", "capacities", "devices",
           "dtype_bytes", "memory", "parse_type", "tensors", "tiles"]

_OPTIMIZER_PARTS = frozenset({"opt_state", "mu", "nu", "count", "momentum", "trace"})
_DTYPE_BYTES = {"bool": 1, "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
                "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "int32": 4,
                "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8,
                "complex64": 8, "complex128": 16,
                # PRNG keys: their key data (as shardplan.trace.dtypes.itemsize counts them)
                "key<fry>": 8, "key<rbg>": 16, "key<urbg>": 16}


def dtype_bytes(dtype: str, /) -> int:
    """Bytes per element of a dtype name (4 for names this table does not know)."""
    return _DTYPE_BYTES.get(dtype, 4)


def _kind(path: str) -> str:
    parts = path.split("/")
    if any(p in _OPTIMIZER_PARTS for p in parts) or parts[-1] == "step" or (
            len(parts) >= 2 and parts[-2] == "step"):
        return "optimizer"
    return "parameter"


def _ways(spec: Spec, mesh: MeshSpec) -> list[int]:
    """How many blocks each dimension is cut into on ``mesh``."""
    sizes = mesh.shape
    return [math.prod(sizes.get(a, 1) for a in dim) for dim in spec]


@dataclass(frozen=True)
class TensorView:
    """One leaf of the step's arguments as the plan places it.

    Attributes:
      path: the key path (``0/blocks/0/attn/k/kernel/value``; batch leaves start ``batch/``).
      pattern: the path with layer indices as ``*`` (rows with equal patterns group).
      kind: ``parameter``, ``optimizer`` or ``batch``.
      stage: the stage that holds it (a state leaf's home stage).
      spec: mesh axes per dimension (``()``: not split).
      dtype: the dtype name ("" when the plan records no types).
      shape: the global shape (``None`` when the plan records no types).
      bytes_per_device: bytes each device of the stage holds (0 when unknown).
    """

    path: str
    pattern: str
    kind: str
    stage: int
    spec: Spec
    dtype: str
    shape: tuple[int, ...] | None
    bytes_per_device: int


def tensors(plan: Plan, /) -> list[TensorView]:
    """Every state leaf (in the plan's order) then every batch leaf (on the first stage)."""
    meshes = {s.index: s.mesh for s in plan.stages}
    out = []
    items = [(path, stage, spec, plan.state_types.get(path), _kind(path))
             for path, (stage, spec) in plan.param_specs.items()]
    first = plan.stages[0].index
    batch_specs = dict(plan.batch_specs)
    if not batch_specs and plan.layouts:
        batch_specs = dict(plan.layouts[plan.stages[0].layout].batch_specs)
    items += [(f"batch/{path}", first, spec, plan.batch_types.get(path), "batch")
              for path, spec in batch_specs.items()]
    for path, stage, spec, typ, kind in items:
        dtype, shape = parse_type(typ) if typ else ("", None)
        per_device = 0
        if shape is not None:
            ways = _ways(spec, meshes[stage])
            per_device = math.prod(-(-n // w) for n, w in zip(shape, ways, strict=False))
            per_device *= dtype_bytes(dtype)
        out.append(TensorView(path, key_pattern(path), kind, stage, spec, dtype, shape,
                              per_device))
    return out


@dataclass(frozen=True)
class Tile:
    """The block of a tensor one device holds.

    Attributes:
      device: the cluster device id.
      coords: the device's position on the mesh, one index per mesh axis.
      block: per tensor dimension, ``(index, count)``: the ``index``-th of ``count`` blocks.
      bounds: per tensor dimension, ``(start, stop)`` element bounds (``None`` without a shape).
    """

    device: int
    coords: tuple[int, ...]
    block: tuple[tuple[int, int], ...]
    bounds: tuple[tuple[int, int], ...] | None


def tiles(spec: Spec, mesh: MeshSpec, shape: tuple[int, ...] | None = None) -> list[Tile]:
    """Which block each device of ``mesh`` holds of a tensor split as ``spec`` (any rank).

    A dimension split over several axes is cut major axis first, as ``PartitionSpec`` does;
    devices that differ only along axes the spec does not use hold the same block (replicas).

    Example:
        >>> from shardplan.plan.plan import MeshSpec
        >>> mesh = MeshSpec(("data", "model"), (2, 2), (0, 1, 2, 3))
        >>> [t.block for t in tiles(((), ("model",)), mesh)]
        [((0, 1), (0, 2)), ((0, 1), (1, 2)), ((0, 1), (0, 2)), ((0, 1), (1, 2))]
    """
    names, sizes = mesh.axis_names, mesh.axis_sizes
    out = []
    for flat, device in enumerate(mesh.device_ids):
        coords, rest = [], flat
        for size in reversed(sizes):
            coords.append(rest % size)
            rest //= size
        coords.reverse()
        at = dict(zip(names, coords, strict=True))
        size_of = dict(zip(names, sizes, strict=True))
        block = []
        for dim in spec:
            index, count = 0, 1
            for axis in dim:
                index, count = index * size_of.get(axis, 1) + at.get(axis, 0), \
                    count * size_of.get(axis, 1)
            block.append((index, count))
        bounds = None
        if shape is not None:
            bounds = tuple((min(n, i * -(-n // c)), min(n, (i + 1) * -(-n // c)))
                           for n, (i, c) in zip(shape, block, strict=False))
        out.append(Tile(device, tuple(coords), tuple(block), bounds))
    return out


@dataclass(frozen=True)
class DeviceView:
    """One device of the cluster.

    Attributes:
      id: the cluster device id.
      device_type: its catalog name.
      stage: the stage it runs (``None``: the plan leaves it idle).
      replica: the stage's replica (``None`` when idle).
    """

    id: int
    device_type: str
    stage: int | None
    replica: int | None


def devices(plan: Plan, /) -> list[DeviceView]:
    """Every device of the cluster, used ones first by id, then per type the ones the plan
    leaves idle (their ids are not recorded: they are numbered after the used ones)."""
    used = {d: s for s in plan.stages for d in s.mesh.device_ids}
    out = [DeviceView(d, s.device_type, s.index, s.replica) for d, s in sorted(used.items())]
    counts: dict[str, int] = {}
    info = plan.cluster_info.get("device_types", {})
    if isinstance(info, Mapping):
        counts = {str(k): int(v.get("count", 0)) for k, v in info.items()
                  if isinstance(v, Mapping)}
    next_id = max(used, default=-1) + 1
    for device_type, count in counts.items():
        idle = count - sum(1 for s in used.values() if s.device_type == device_type)
        for _ in range(max(idle, 0)):
            out.append(DeviceView(next_id, device_type, None, None))
            next_id += 1
    return out


@dataclass(frozen=True)
class MemoryView:
    """One device's predicted peak memory, split, against its capacity (bytes).

    Attributes:
      device: the cluster device id.
      device_type: its catalog name.
      stage: its stage.
      parameters: the parameters it holds.
      gradients: their gradients (laid out as the parameters).
      optimizer: the optimizer state it holds.
      other: the rest of the predicted peak (activations and temporaries; 0 where the state
        alone reaches the prediction).
      peak: the predicted peak (``None`` when the plan predicts none for this device).
      capacity: the device's memory (``None`` when the plan records no cluster outline).
      compiled: XLA's figure for the largest program on this device's stage (``None`` until
        the plan ran).
    """

    device: int
    device_type: str
    stage: int
    parameters: int
    gradients: int
    optimizer: int
    other: int
    peak: int | None
    capacity: int | None
    compiled: int | None


def capacities(plan: Plan, /) -> dict[str, int | None]:
    """Per device type of the plan's cluster outline, its memory in bytes (``None`` where the
    plan records none)."""
    info = plan.cluster_info.get("device_types", {})
    out: dict[str, int | None] = {}
    if isinstance(info, Mapping):
        for name, entry in info.items():
            mem = entry.get("memory_bytes") if isinstance(entry, Mapping) else None
            out[str(name)] = int(mem) if mem else None
    return out


def _compiled_by_stage(plan: Plan) -> dict[int, int]:
    out: dict[int, int] = {}
    programs = plan.compiled.get("programs", [])
    for p in programs if isinstance(programs, (list, tuple)) else []:
        if isinstance(p, Mapping) and p.get("memory_bytes") is not None:
            stage = int(p.get("stage", 0))
            out[stage] = max(out.get(stage, 0), int(p["memory_bytes"]))
    return out


def memory(plan: Plan, /) -> list[MemoryView]:
    """Per device of every stage (by id), its predicted memory split (module docstring).

    A stacked leaf (``nnx.scan`` layers: ``0/blocks/attn/q/kernel`` of shape ``[96, ...]`` in a
    plan with layers ``blocks.0 .. blocks.95``) is cut by rows: each stage holds the rows of
    its own layers, laid out by its own layout.
    """
    stacks = _stacks(plan)
    held: dict[int, dict[str, int]] = {}
    rows: dict[int, dict[str, int]] = {}
    for t in tensors(plan):
        if t.kind == "batch":
            continue
        stack = _stacked_on(t, stacks)
        if stack is None:
            held.setdefault(t.stage, {}).setdefault(t.kind, 0)
            held[t.stage][t.kind] += t.bytes_per_device
            continue
        for st in plan.stages:
            count = sum(1 for name in st.layers if _collection(name) == stack)
            if count:
                rows.setdefault(st.index, {}).setdefault(t.kind, 0)
                rows[st.index][t.kind] += _rows_bytes(plan, st, t, count)
    held = _replicate(plan, held)
    for index, kinds in rows.items():
        for kind, size in kinds.items():
            held.setdefault(index, {})[kind] = held.get(index, {}).get(kind, 0) + size
    compiled = _compiled_by_stage(plan)
    capacity = capacities(plan)
    out = []
    for s in plan.stages:
        mine = held.get(s.index, {})
        params, opt = mine.get("parameter", 0), mine.get("optimizer", 0)
        for d in s.mesh.device_ids:
            peak = plan.predicted.memory_bytes.get(d)
            other = max(0, peak - 2 * params - opt) if peak is not None else 0
            out.append(MemoryView(d, s.device_type, s.index, params, params, opt, other,
                                  peak, capacity.get(s.device_type), compiled.get(s.index)))
    return sorted(out, key=lambda m: m.device)


_LAYER_INDEX = re.compile(r"^(.*)\.(\d+)$")  # "blocks.12" -> ("blocks", "12")


def _collection(layer: str) -> str | None:
    """``"blocks.12"`` -> ``"blocks"``; None for a layer without an index (``"pre"``)."""
    m = _LAYER_INDEX.match(layer)
    return m.group(1) if m else None


def _stacks(plan: Plan) -> dict[str, int]:
    """``{collection: layers}`` of the numbered layers over all stages (``blocks``: 96)."""
    found: dict[str, set[str]] = {}
    for st in plan.stages:
        for name in st.layers:
            m = _LAYER_INDEX.match(name)
            if m:
                found.setdefault(m.group(1), set()).add(m.group(2))
    return {k: len(v) for k, v in found.items()}


def _stacked_on(t: TensorView, stacks: Mapping[str, int]) -> str | None:
    """The collection whose layers ``t`` stacks (one row each), or None."""
    if not t.shape:
        return None
    parts = t.path.split("/")
    for i, part in enumerate(parts):
        follows = parts[i + 1] if i + 1 < len(parts) else ""
        if part in stacks and not follows.isdigit() and t.shape[0] == stacks[part]:
            return part
    return None


def _rows_bytes(plan: Plan, stage: Stage, t: TensorView, rows: int) -> int:
    """Bytes per device of ``rows`` rows of stacked ``t`` on ``stage`` (its layout's spec)."""
    spec = t.spec
    if stage.layout and t.path in plan.layouts[stage.layout].param_specs:
        spec = plan.layouts[stage.layout].param_specs[t.path]
    assert t.shape is not None
    shape = (rows, *t.shape[1:])
    ways = _ways(spec, stage.mesh)
    return math.prod(-(-n // w) for n, w in zip(shape, ways, strict=False)) * dtype_bytes(t.dtype)


def _replicate(plan: Plan, held: dict[int, dict[str, int]]) -> dict[int, dict[str, int]]:
    """Each stage's holdings, also for the stages ``tensors`` does not list leaves on.

    A plan lists each leaf once, on the first stage of replica 0 that holds it; the stages of
    the other replicas hold copies. A stage with the same layers as a replica-0 stage holds what
    that stage holds (exact where the two share a layout; else an estimate at the listed
    stage's bytes per device); a stage with other layers holds each replica-0 stage's bytes in
    proportion to the layers the two share (an estimate: the plan does not record which layer
    owns each leaf).
    """
    if not plan.replicas:
        return held
    home = [plan.stages[i] for i in plan.replicas[0].stages]
    out = dict(held)
    for s in plan.stages:
        if s.replica == 0:
            continue
        same = [h for h in home if h.layers == s.layers]
        if same:
            out[s.index] = dict(held.get(same[0].index, {}))
            continue
        mine: dict[str, int] = {}
        for h in home:
            share = len(set(h.layers) & set(s.layers)) / max(len(h.layers), 1)
            for kind, size in held.get(h.index, {}).items():
                mine[kind] = mine.get(kind, 0) + int(size * share)
        out[s.index] = mine
    return out
