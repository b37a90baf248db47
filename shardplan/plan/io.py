"""Plan <-> canonical JSON, and plan files (``docs/plan-format.md`` describes the layout).

The JSON is *canonical*: keys sorted (digit runs by value, so ``blocks/2`` precedes
``blocks/10``), two-space indent, a list or flat object written on one line when it fits in
:data:`INLINE_WIDTH` columns, UTF-8, one trailing newline. Equal plans give byte-identical text,
which is what :attr:`Plan.content_hash` hashes (without the solver's ``*_time_s`` fields).

Example:
    >>> import tempfile, pathlib
    >>> from shardplan.plan.plan import _example
    >>> with tempfile.TemporaryDirectory() as d:
    ...     path = _example().save(pathlib.Path(d) / "plan.json")
    ...     load_plan(path) == _example()
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from shardplan._schema import invalid
from shardplan._traceback import api_boundary
from shardplan.errors import ConfigError, ShardplanError, did_you_mean, format_error
from shardplan.plan.plan import (
    VOLATILE_SOLVER_SUFFIX,
    Layout,
    MeshSpec,
    Plan,
    Predicted,
    ReplicaSpec,
    Spec,
    Stage,
    check_schema_version,
    natural_key,
)

__all__ = [
    "INLINE_WIDTH", "content_hash", "from_json", "load_plan", "plan_to_dict", "save", "to_json",
]

INLINE_WIDTH = 100
"""A list (or an object without nested objects) is written on one line if that line fits."""

_INDENT = "  "
_NO_SOURCE = "<plan JSON>"

# Keys of each JSON object: (required, optional). Optional keys take the dataclass default.
_PLAN_KEYS = ({"schema_version", "shardplan_version", "graph_fingerprint", "cluster_hash",
               "config_hash", "stages", "param_specs", "batch_specs", "predicted", "solver"},
              {"constraints", "microbatches", "schedule", "accumulation", "notes",
               "microbatch_size", "chunks", "replicas", "layouts", "state_types", "batch_types",
               "cluster_info", "compiled", "measured"})
_STAGE_KEYS = ({"index", "device_type", "mesh", "layers"}, {"remat", "replica", "layout"})
_REPLICA_KEYS = ({"stages", "microbatches"}, set[str]())
_LAYOUT_KEYS = ({"param_specs", "batch_specs"}, {"kernel_specs"})
_MESH_KEYS = ({"axis_names", "axis_sizes", "device_ids"}, set[str]())
_PREDICTED_KEYS = ({"step_time_s", "compute_s", "communication_s", "memory_bytes",
                    "collectives"}, {"stage_flops"})
_PARAM_KEYS = ({"stage", "spec"}, set[str]())
_CONSTRAINT_KEYS = ({"stage", "results", "operands"}, set[str]())
_KERNEL_SPEC_KEYS = ({"results", "operands"}, set[str]())


# --------------------------------------------------------------------------- plan -> JSON


def _spec_json(spec: Spec) -> list[list[str]]:
    return [list(dim) for dim in spec]


def _thaw(value: object) -> object:
    """FrozenMap -> dict, tuple -> list, recursively (the inverse of the plan's freezing)."""
    if isinstance(value, Mapping):
        return {str(k): _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def plan_to_dict(plan: Plan, /, *, volatile: bool = True) -> dict[str, Any]:
    """The JSON object of ``plan``; ``volatile=False`` drops the solver's ``*_time_s`` keys and
    the compiled and measured figures (what :func:`content_hash` hashes)."""
    solver = {k: v for k, v in plan.solver.items()
              if volatile or not k.endswith(VOLATILE_SOLVER_SUFFIX)}
    p = plan.predicted
    data: dict[str, Any] = {
        "schema_version": plan.schema_version,
        "shardplan_version": plan.shardplan_version,
        "graph_fingerprint": plan.graph_fingerprint,
        "cluster_hash": plan.cluster_hash,
        "config_hash": plan.config_hash,
        "stages": [{
            "index": s.index,
            "device_type": s.device_type,
            "mesh": {"axis_names": list(s.mesh.axis_names),
                     "axis_sizes": list(s.mesh.axis_sizes),
                     "device_ids": list(s.mesh.device_ids)},
            "layers": list(s.layers),
            "remat": s.remat,
            "replica": s.replica,
            "layout": s.layout,
        } for s in plan.stages],
        "param_specs": {k: {"stage": stage, "spec": _spec_json(spec)}
                        for k, (stage, spec) in plan.param_specs.items()},
        "batch_specs": {k: _spec_json(spec) for k, spec in plan.batch_specs.items()},
        "constraints": {k: {"stage": stage, "results": [_spec_json(s) for s in results],
                            "operands": [_spec_json(s) for s in operands]}
                        for k, (stage, results, operands) in plan.constraints.items()},
        "microbatches": plan.microbatches,
        "schedule": plan.schedule,
        "accumulation": plan.accumulation,
        "microbatch_size": plan.microbatch_size,
        "chunks": plan.chunks,
        "replicas": [{"stages": list(r.stages), "microbatches": r.microbatches}
                     for r in plan.replicas],
        "layouts": {name: {"param_specs": {k: _spec_json(v) for k, v in lay.param_specs.items()},
                           "batch_specs": {k: _spec_json(v) for k, v in lay.batch_specs.items()},
                           "kernel_specs": {k: {"results": [_spec_json(x) for x in results],
                                                "operands": [_spec_json(x) for x in operands]}
                                            for k, (results, operands)
                                            in lay.kernel_specs.items()}}
                    for name, lay in plan.layouts.items()},
        "predicted": {
            "step_time_s": p.step_time_s,
            "compute_s": p.compute_s,
            "communication_s": p.communication_s,
            "memory_bytes": {str(d): b for d, b in p.memory_bytes.items()},
            "collectives": _thaw(p.collectives),
            "stage_flops": list(p.stage_flops),
        },
        "solver": _thaw(solver),
        "notes": list(plan.notes),
        "state_types": dict(plan.state_types),
        "batch_types": dict(plan.batch_types),
        "cluster_info": _thaw(plan.cluster_info),
    }
    if volatile:  # what a run measured describes the run, not the plan: not hashed
        data["compiled"] = _thaw(plan.compiled)
        data["measured"] = _thaw(plan.measured)
    return data


def _scalar(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _is_scalar(value: object) -> bool:
    return not isinstance(value, dict | list)


def _is_flat_list(value: object) -> bool:
    """A list of scalars or of lists of scalars (a spec, a list of ids)."""
    return isinstance(value, list) and all(
        _is_scalar(v) or (isinstance(v, list) and all(_is_scalar(x) for x in v)) for v in value)


def _inline(value: object) -> str | None:
    """One-line rendering of a scalar, flat list or object of scalars / flat lists; else None."""
    if _is_scalar(value):
        return _scalar(value)
    if isinstance(value, list) and _is_flat_list(value):
        return "[" + ", ".join(_inline(v) or "" for v in value) + "]"
    if isinstance(value, dict) and all(_is_scalar(v) or _is_flat_list(v) for v in value.values()):
        items = sorted(value.items(), key=lambda kv: natural_key(kv[0]))
        return "{" + ", ".join(f"{_scalar(k)}: {_inline(v)}" for k, v in items) + "}"
    return None


def _items_over(value: object, limit: int) -> bool:
    """Whether ``value`` holds more than ``limit`` keys and scalars (then it cannot fit one
    line: each takes at least two columns); stops counting at the limit."""
    count = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            count += len(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        else:
            count += 1
        if count > limit:
            return True
    return False


def _dump(value: object, level: int, column: int) -> str:
    """Canonical text of ``value`` starting at ``column`` on a line indented ``level`` times."""
    # Large lists and objects (a pipeline timeline's rows) never fit a line: rendering them
    # inline first, at every level, made writing such a plan quadratic in its size.
    one_line = None if value and _items_over(value, INLINE_WIDTH // 2) else _inline(value)
    # +1: the comma that may follow.
    if one_line is not None and (column + len(one_line) + 1 <= INLINE_WIDTH
                                 or _is_scalar(value) or not value):
        return one_line
    pad = _INDENT * (level + 1)
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: natural_key(kv[0]))
        lines = []
        for k, v in items:
            key = f"{pad}{_scalar(k)}: "
            lines.append(key + _dump(v, level + 1, len(key)))
        return "{\n" + ",\n".join(lines) + "\n" + _INDENT * level + "}"
    assert isinstance(value, list)
    lines = [pad + _dump(v, level + 1, len(pad)) for v in value]
    return "[\n" + ",\n".join(lines) + "\n" + _INDENT * level + "]"


def to_json(plan: Plan, /) -> str:
    """Canonical JSON of ``plan`` (see the module docstring); ends with a newline."""
    return _dump(plan_to_dict(plan), 0, 0) + "\n"


def content_hash(plan: Plan, /) -> str:
    """sha256 hex digest of the canonical JSON without the solver's ``*_time_s`` keys."""
    text = _dump(plan_to_dict(plan, volatile=False), 0, 0) + "\n"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- JSON -> plan


def _object(value: object, keys: tuple[set[str], set[str]], *, where: str) -> dict[str, Any]:
    """Checks ``value`` is an object with the required keys and no unknown ones."""
    required, optional = keys
    if not isinstance(value, dict):
        raise invalid("Expected a JSON object.", where=where, value=value,
                      remedy="write the file with plan.save(path)")
    known = required | optional
    for key in sorted(value, key=natural_key):
        if key not in known:
            raise invalid(f"Unknown key {key!r} in {where}.", where=f"{where}.{key}", value=key,
                          remedy=f"{did_you_mean(key, sorted(known))}known keys: "
                                 f"{', '.join(sorted(known))}")
    missing = sorted(required - set(value))
    if missing:
        raise invalid(f"Missing key {missing[0]!r} in {where}.", where=f"{where}.{missing[0]}",
                      remedy="write the file with plan.save(path), or add the key "
                             "(docs/plan-format.md lists every field)")
    return value


def _list(value: object, *, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise invalid("Expected a JSON list.", where=where, value=value,
                      remedy="write a list, e.g. [\"data\", \"model\"]")
    return value


def _int_key(key: str, *, where: str) -> int:
    if not (key.isascii() and key.isdigit()) or str(int(key)) != key:
        raise invalid("Expected a device id (a non-negative integer written as a string).",
                      where=where, value=key, remedy='write e.g. "0": 17179869184')
    return int(key)


@contextlib.contextmanager
def _within(where: str) -> Iterator[None]:
    """Adds the JSON location to errors a constructor raises (it cannot know where it is)."""
    try:
        yield
    except ShardplanError as exc:
        raise type(exc)(f"{exc}\n  in:    {where}") from None


def _mesh(data: object, *, where: str) -> MeshSpec:
    d = _object(data, _MESH_KEYS, where=where)
    with _within(where):
        return MeshSpec(tuple(_list(d["axis_names"], where=f"{where}.axis_names")),
                    tuple(_list(d["axis_sizes"], where=f"{where}.axis_sizes")),
                    tuple(_list(d["device_ids"], where=f"{where}.device_ids")))


def _stage(data: object, *, where: str) -> Stage:
    d = _object(data, _STAGE_KEYS, where=where)
    mesh = _mesh(d["mesh"], where=f"{where}.mesh")
    with _within(where):
        return Stage(d["index"], d["device_type"], mesh,
                     tuple(_list(d["layers"], where=f"{where}.layers")), d.get("remat", "none"),
                     d.get("replica", 0), d.get("layout", ""))


def _replica(data: object, *, where: str) -> ReplicaSpec:
    d = _object(data, _REPLICA_KEYS, where=where)
    with _within(where):
        return ReplicaSpec(tuple(_list(d["stages"], where=f"{where}.stages")),
                           d["microbatches"])


def _layouts(data: object, *, where: str) -> dict[str, Layout]:
    if not isinstance(data, dict):
        raise invalid("Expected a JSON object {layout name: {param_specs, batch_specs}}.",
                      where=where, value=data,
                      remedy='write e.g. {"a100-80g:model=8": {"param_specs": {}, '
                             '"batch_specs": {}}}')
    out = {}
    for key, entry in data.items():
        e = _object(entry, _LAYOUT_KEYS, where=f"{where}[{key!r}]")
        with _within(f"{where}[{key!r}]"):
            kernels = e.get("kernel_specs", {})
            if not isinstance(kernels, dict):
                raise invalid("Expected a JSON object {equation path: {results, operands}}.",
                              where=f"{where}[{key!r}].kernel_specs", value=kernels,
                              remedy='write e.g. {"12": {"results": [[["data"]]], '
                                     '"operands": [[["data"]]]}}')
            specs = {k: _object(x, _KERNEL_SPEC_KEYS, where=f"{where}[{key!r}].kernel_specs"
                                                             f"[{k!r}]")
                     for k, x in kernels.items()}
            out[key] = Layout(e["param_specs"], e["batch_specs"],
                              {k: (x["results"], x["operands"]) for k, x in specs.items()})
    return out


def _predicted(data: object, *, where: str) -> Predicted:
    d = _object(data, _PREDICTED_KEYS, where=where)
    memory = d["memory_bytes"]
    if not isinstance(memory, dict):
        raise invalid("Expected a JSON object {device id: peak bytes}.",
                      where=f"{where}.memory_bytes", value=memory,
                      remedy='write e.g. {"0": 17179869184}')
    memory_bytes = {_int_key(k, where=f"{where}.memory_bytes.{k}"): v for k, v in memory.items()}
    with _within(where):
        return Predicted(step_time_s=d["step_time_s"], compute_s=d["compute_s"],
                         communication_s=d["communication_s"], memory_bytes=memory_bytes,
                         collectives=d["collectives"], stage_flops=tuple(d.get("stage_flops", ())))


def _param_specs(data: object, *, where: str) -> dict[str, tuple[int, Any]]:
    if not isinstance(data, dict):
        raise invalid("Expected a JSON object {key path: {stage, spec}}.", where=where, value=data,
                      remedy='write e.g. {"0/w": {"stage": 0, "spec": [[], ["model"]]}}')
    out: dict[str, tuple[int, Any]] = {}
    for key, entry in data.items():
        e = _object(entry, _PARAM_KEYS, where=f"{where}[{key!r}]")
        out[key] = (e["stage"], e["spec"])
    return out


def _constraints(data: object, *, where: str) -> dict[str, tuple[int, Any, Any]]:
    if not isinstance(data, dict):
        raise invalid("Expected a JSON object {equation path: {stage, results, operands}}.",
                      where=where, value=data,
                      remedy='write e.g. {"12": {"stage": 0, "results": [[["data"]]], '
                             '"operands": [[["data"]]]}}')
    out: dict[str, tuple[int, Any, Any]] = {}
    for key, entry in data.items():
        e = _object(entry, _CONSTRAINT_KEYS, where=f"{where}[{key!r}]")
        out[key] = (e["stage"], e["results"], e["operands"])
    return out


def _plan_from_data(data: object) -> Plan:
    if isinstance(data, dict) and "schema_version" in data:
        # Before the key checks: another version's keys would be reported as unknown.
        check_schema_version(data["schema_version"], made_by=data.get("shardplan_version"))
    d = _object(data, _PLAN_KEYS, where="plan")
    defaults = {"constraints": {}, "microbatches": 1, "schedule": "none",
                "accumulation": "exact", "notes": [],
                "microbatch_size": 0, "chunks": 1, "replicas": [], "layouts": {},
                "state_types": {}, "batch_types": {}, "cluster_info": {}, "compiled": {},
                "measured": {}}
    d = {**defaults, **d}
    return Plan(
        schema_version=d["schema_version"],
        shardplan_version=d["shardplan_version"],
        graph_fingerprint=d["graph_fingerprint"],
        cluster_hash=d["cluster_hash"],
        config_hash=d["config_hash"],
        stages=tuple(_stage(s, where=f"plan.stages[{i}]")
                     for i, s in enumerate(_list(d["stages"], where="plan.stages"))),
        param_specs=_param_specs(d["param_specs"], where="plan.param_specs"),
        batch_specs=d["batch_specs"],
        constraints=_constraints(d["constraints"], where="plan.constraints"),
        microbatches=d["microbatches"],
        schedule=d["schedule"],
        accumulation=d["accumulation"],
        microbatch_size=d["microbatch_size"],
        chunks=d["chunks"],
        replicas=tuple(_replica(r, where=f"plan.replicas[{i}]")
                       for i, r in enumerate(_list(d["replicas"], where="plan.replicas"))),
        layouts=_layouts(d["layouts"], where="plan.layouts"),
        predicted=_predicted(d["predicted"], where="plan.predicted"),
        solver=d["solver"],
        notes=tuple(_list(d["notes"], where="plan.notes")),
        state_types=d["state_types"],
        batch_types=d["batch_types"],
        cluster_info=d["cluster_info"],
        compiled=d["compiled"],
        measured=d["measured"],
    )


def _parse(text: str, *, source: str) -> object:
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:  # json.loads would keep the last silently: a lost parameter spec
                raise invalid(f"Key {key!r} appears twice in one JSON object.", where=source,
                              value=key, remedy="keep one of the two entries")
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        lines = exc.doc.splitlines()
        line = lines[exc.lineno - 1].strip() if 0 < exc.lineno <= len(lines) else ""
        raise ConfigError(format_error(
            f"The plan is not valid JSON: {exc.msg}.",
            where=f"{source}, line {exc.lineno}, column {exc.colno}", value=line[:80],
            remedy="restore the file from version control, or write it again with "
                   "plan.save(path)", has_value=True)) from None


def from_json(text: str, /, *, source: str = _NO_SOURCE) -> Plan:
    """Reads a plan from canonical (or hand-edited) JSON; see :meth:`Plan.from_json`.

    Args:
      text: the JSON text.
      source: what errors name as the text's origin (a file path).
    """
    if not isinstance(text, str):
        raise ConfigError(format_error("Plan.from_json expects a str.", where=source,
                                       value=type(text).__name__,
                                       remedy="decode bytes first, or use sp.load_plan(path)"))
    data = _parse(text, source=source)
    if source == _NO_SOURCE:
        return _plan_from_data(data)
    try:
        return _plan_from_data(data)
    except ShardplanError as exc:
        # Name the file in errors about the plan's fields (same error type, same message).
        raise type(exc)(f"{exc}\n  file:  {source}") from None


# --------------------------------------------------------------------------- files


def save(plan: Plan, path: str | os.PathLike[str], /) -> Path:
    """Writes ``plan.to_json()`` to ``path`` atomically; returns the path.

    The text goes to a temporary file in the same directory, is flushed to disk, and replaces
    ``path`` with ``os.replace``: readers see the old file or the new one, never a partial one.

    Raises:
      ConfigError: the directory does not exist or cannot be written.
    """
    target = Path(path)
    directory = target.parent
    if not directory.is_dir():
        raise ConfigError(format_error(
            "Cannot save the plan: its directory does not exist.", where=str(target),
            value=str(directory), remedy="create the directory first, or pick another path"))
    data = to_json(plan).encode("utf-8")
    # Keep an existing file's permissions; new files are readable by all (plans are committed).
    mode = target.stat().st_mode & 0o777 if target.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise ConfigError(format_error(
                f"Cannot save the plan: {exc.strerror or exc}.", where=str(target),
                remedy="check the path and its permissions")) from exc
        raise
    return target


@api_boundary
def load_plan(path: str | os.PathLike[str], /) -> Plan:
    """Reads a plan file written by :meth:`Plan.save`.

    Raises:
      ConfigError: the file is missing or unreadable, or not a valid plan; the message names it.
      PlanMismatchError: the plan's schema version is not supported, or its fields disagree.
    """
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(format_error(
            "No plan file at this path.", where=str(source.absolute()),
            remedy="check the path, or write a plan with plan.save(path)")) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(format_error(
            f"Cannot read the plan file: {exc}.", where=str(source.absolute()),
            remedy="pass a readable UTF-8 JSON file written by plan.save(path)")) from exc
    return from_json(text, source=str(source))

