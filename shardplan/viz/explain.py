"""``Plan.explain()``: why the plan, as plain text at most 100 columns wide.

Without a tensor: the chosen plan against the runner-ups the planner recorded (the other meshes
of a single-mesh search; the other stage configurations the stage planner weighed), with their
predicted step time, peak memory per device and why each lost. With ``tensor=`` (a state key
path, or a pattern as the summary prints them): that leaf's chosen sharding and each
alternative, with the change of the predicted step time and memory if the leaf alone took it.

What the planner records, in ``Plan.solver`` (JSON-native, so no schema change; the planner's
:func:`~shardplan.planner.alternatives.alternatives_record` writes ``alternatives``):

* ``runner_ups``: a list of ``{"mesh": {"axis_names", "axis_sizes"}, "step_time_s",
  "memory_bytes", "objective_s", "status", "reason"}`` (single mesh) or ``{"config",
  "step_time_s", "memory_bytes", "reason", ...}`` (stage planner), best first.
* ``unused_types``: per device group the plan leaves unused, ``{"alone": {"devices_needed",
  "devices"}, "best_step_s", "config", "slower_by", "optimal", "limit", "limit_extra_s",
  "sync_link_GB_s"}`` of the best plan the stage planner found that uses it, or
  ``{"alone", "none_found"}`` (:func:`shardplan.planner.alternatives.unused_types`).
* ``alternatives``: ``{"basis": text, "groups": [{"chosen": spec, "options": [[spec,
  delta_step_s or None, delta_memory_bytes, feasible], ...]}, ...], "leaves": {pattern:
  group index, or [[group index, [starred values, ...]], ...] when leaves of one pattern lie in
  several groups}}``; multi-stage plans hold one such record per layout under ``"layouts"``.
  A group is a solver node with the nodes bound to it (tied layers, optimizer state), so a
  96-layer model stores one entry per distinct leaf, not 96.

Example:
    >>> from shardplan.plan.plan import _example
    >>> print(explain(_example()).splitlines()[0])  # doctest: +ELLIPSIS
    Plan ...: why this plan
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from shardplan._format import (
    HASH_CHARS,
    MAX_WIDTH,
    clip_line,
    format_bytes,
    format_gib,
    format_spec,
    format_time,
    key_pattern,
    stage_runs,
    starred_values,
    table_lines,
    wrap_text,
)
from shardplan.errors import ConfigError, did_you_mean, format_error
from shardplan.plan.plan import VIEWS

if TYPE_CHECKING:
    from shardplan.plan.plan import Plan, Spec

__all__ = ["chosen_label", "explain", "peak_memory_bytes", "pipeline_label", "runner_label"]

_CLOSEST = 5  # leaves listed under "closest alternatives" when no tensor is asked for
_UNREPAIRED = "not priced: needs other changes"


def _spec_of(value: object) -> Spec:
    assert isinstance(value, Sequence)
    return tuple(tuple(str(a) for a in dim) for dim in value)  # type: ignore[union-attr]


def _seconds(x: object) -> str:
    return format_time(float(x)) if isinstance(x, int | float) else "-"


def _memory(x: object) -> str:
    return format_gib(int(x)) if isinstance(x, int | float) else "-"


def _signed_time(x: object) -> str:
    if not isinstance(x, int | float):
        return "-"
    sign = "+" if x >= 0 else "-"
    return sign + format_time(abs(float(x)))


def _signed_bytes(x: object) -> str:
    if not isinstance(x, int | float):
        return "-"
    sign = "+" if x >= 0 else "-"
    return sign + format_bytes(abs(int(x)))


def pipeline_label(plan: Plan, /) -> str:
    """A multi-stage plan's configuration in one line: identical replicas once, each as its
    stages' device types and device counts, then microbatches, schedule and remat.

    Example:
        >>> from shardplan.plan.plan import _example
        >>> pipeline_label(_example())
        '1 x [cpu 2]; 1 mb of 0, none, remat none'
    """
    shapes: dict[str, int] = {}
    replicas = [r.stages for r in plan.replicas] or [tuple(range(len(plan.stages)))]
    for stages in replicas:
        shape = stage_runs([f"{plan.stages[i].device_type} {plan.stages[i].mesh.num_devices}"
                            for i in stages])
        shapes[shape] = shapes.get(shape, 0) + 1
    text = ", ".join(f"{n} x [{shape}]" for shape, n in shapes.items())
    remats = "/".join(sorted({s.remat for s in plan.stages}))
    chunks = f" v={plan.chunks}" if plan.schedule == "interleaved" else ""
    return (f"{text}; {plan.microbatches} mb of {plan.microbatch_size}, "
            f"{plan.schedule}{chunks}, remat {remats}")


def chosen_label(plan: Plan, /) -> str:
    """The chosen configuration in one line: a one-stage plan without layouts as its device type
    and mesh, any other as :func:`pipeline_label` writes it.

    Example:
        >>> from shardplan.plan.plan import _example
        >>> chosen_label(_example())
        'cpu (data=2)'
    """
    if len(plan.stages) == 1 and not plan.layouts:
        s = plan.stages[0]
        return f"{s.device_type} {s.mesh.describe()}"
    return pipeline_label(plan)


def runner_label(plan: Plan, row: Mapping[str, Any], /) -> str:
    """A runner-up of ``plan.solver["runner_ups"]`` in one line: a row with a ``mesh`` as the
    first stage's device type and the mesh's axes, any other row as its ``config``.

    Example:
        >>> from shardplan.plan.plan import _example
        >>> runner_label(_example(), {"mesh": {"axis_names": ["data"], "axis_sizes": [1]}})
        'cpu (data=1)'
    """
    mesh = row.get("mesh")
    if isinstance(mesh, Mapping):
        dims = ", ".join(f"{n}={s}" for n, s in zip(mesh.get("axis_names", ()),
                                                    mesh.get("axis_sizes", ()), strict=False))
        return f"{plan.stages[0].device_type} ({dims})"
    return str(row.get("config", "?"))


def peak_memory_bytes(plan: Plan, /) -> int | None:
    """The largest predicted memory of any device in bytes; ``None`` when none is predicted.

    Example:
        >>> from shardplan.plan.plan import _example
        >>> peak_memory_bytes(_example())
        1024
    """
    return max(plan.predicted.memory_bytes.values(), default=None)


def _runner_ups(plan: Plan) -> list[str]:
    rows = plan.solver.get("runner_ups")
    lines = ["Chosen plan and runner-ups (predicted per step; memory: peak bytes per device)"]
    table = [[chosen_label(plan), _seconds(plan.predicted.step_time_s),
              _memory(peak_memory_bytes(plan)), "chosen"]]
    if isinstance(rows, Sequence):
        table += [[runner_label(plan, r), _seconds(r.get("step_time_s")),
                   _memory(r.get("memory_bytes")), str(r.get("reason", ""))]
                  for r in rows if isinstance(r, Mapping)]
    head = ("mesh / stages", "step time", "memory", "why it lost")
    wide = table_lines(head, table)
    if max(map(len, wide)) <= MAX_WIDTH:
        lines += wide
    else:  # long configurations (pipelines): numbered rows, the configurations below
        labels = ["chosen", *(f"#{i}" for i in range(1, len(table)))]
        lines += table_lines(("", *head[1:]), [[k, *row[1:]] for k, row in zip(labels, table,
                                                                           strict=True)])
        for k, row in zip(labels, table, strict=True):
            lines += wrap_text(row[0], f"  {k + ':':<7} ", " " * 10)
    if rows is None:
        lines += wrap_text("This plan records no runner-ups (it was made by a shardplan that did "
                           "not record them); make the plan again to see them.", "  ")
    elif not rows:
        candidates = plan.solver.get("mesh_candidates")
        if len(plan.stages) == 1 and isinstance(candidates, Sequence) and len(candidates) <= 1:
            lines += wrap_text("No runner-up: the mesh search had one candidate. Coarser meshes "
                               "are special cases of it (an axis pair used together) and cost "
                               "the same or more; PlanConfig(max_mesh_axes=3) adds candidates.",
                               "  ")
        else:
            lines += wrap_text("No runner-up: the planner had no other feasible candidate.", "  ")
    return lines


def _unused_types(plan: Plan) -> list[str]:
    """Per device group the plan leaves unused, what using it would cost
    (``plan.solver["unused_types"]``, :func:`shardplan.planner.alternatives.unused_types`)."""
    rows = plan.solver.get("unused_types")
    if not isinstance(rows, Mapping) or not rows:
        return []
    lines = ["Device types this plan leaves unused"]
    for name, row in rows.items():
        if not isinstance(row, Mapping):
            continue
        alone = row.get("alone", {})
        need, have = alone.get("devices_needed"), alone.get("devices")
        if need is None:
            holds = "alone, no sub-mesh of it holds the model's largest layer (memory)"
        elif need > have:
            holds = (f"alone, one replica needs at least {need} of its devices and it has "
                     f"{have} (memory)")
        else:
            holds = f"alone, one replica needs at least {need} of its {have} devices"
        if "best_step_s" in row:
            which = ("the best plan that uses it" if row.get("optimal")
                     else "the best plan found that uses it")
            link = row.get("sync_link_GB_s")
            over = (f", over a {float(link):.3g} GB/s link"
                    if link is not None and str(row["limit"]).startswith("link") else "")
            text = (f"{name}: {which} takes {_seconds(row['best_step_s'])} per step, "
                    f"{100 * float(row['slower_by']):.1f} % slower: {row['limit']} takes "
                    f"{_seconds(row.get('limit_extra_s'))} more than the chosen plan's"
                    f"{over} ({row['config']}); {holds}.")
        else:
            why = row.get("none_found", "no plan the planner kept uses it")
            text = f"{name}: {why}; {holds}."
        lines += wrap_text(text, "  ", "    ")
    return [*lines, ""]


def _records(plan: Plan) -> list[tuple[str, Mapping[str, Any]]]:
    """``(layout name or "", alternatives record)`` of the plan."""
    alt = plan.solver.get("alternatives")
    if not isinstance(alt, Mapping):
        return []
    layouts = alt.get("layouts")
    if isinstance(layouts, Mapping):
        return [(str(k), v) for k, v in layouts.items() if isinstance(v, Mapping)]
    return [("", alt)]


def _groups_of(record: Mapping[str, Any], path: str) -> list[tuple[int, str]]:
    """``(group index, which leaves)`` of ``path`` (a key path or a pattern) in ``record``;
    "which leaves" is empty unless a pattern's leaves lie in several groups."""
    leaves = record.get("leaves", {})
    pattern = key_pattern(path)
    entry = leaves.get(pattern, leaves.get(path))
    if entry is None:
        return []
    if isinstance(entry, int):
        return [(entry, "")]
    wanted = ",".join(starred_values(path))
    exact = [(g, "") for g, members in entry if wanted in members and "*" not in path]
    return exact or [(g, f" [* = {', '.join(members)}]") for g, members in entry]


def _closest(record: Mapping[str, Any]) -> list[str]:
    """The leaf patterns whose best feasible alternative costs least more."""
    groups = record.get("groups", ())
    best: list[tuple[float, str, str]] = []
    for pattern, entry in record.get("leaves", {}).items():
        ids = [entry] if isinstance(entry, int) else [g for g, _ in entry]
        for g in ids:
            for spec, delta, _, ok in groups[g]["options"]:
                if ok and isinstance(delta, int | float):
                    best.append((float(delta), pattern, format_spec(_spec_of(spec))))
                    break
    best.sort()
    lines = dict.fromkeys(f"  {_signed_time(d):>12}  {p} -> {s}" for d, p, s in best)
    return list(lines)[:_CLOSEST]


def _leaf(plan: Plan, tensor: str) -> list[str]:
    records = _records(plan)
    if not records:
        return wrap_text(f"This plan records no per-tensor alternatives, so none for {tensor!r} "
                         "(a multi-stage plan, or one made by a shardplan that did not record "
                         "them).", "")
    lines: list[str] = []
    shown: set[str] = set()  # each basis once
    found = False
    for name, record in records:
        for g, which in _groups_of(record, tensor):
            found = True
            group = record["groups"][g]
            where = f" (layout {name})" if name else ""
            lines += wrap_text(f"{tensor}{which}{where}: chosen "
                               f"{format_spec(_spec_of(group['chosen']))}", "", "    ")
            basis = str(record.get("basis", ""))
            if basis and basis not in shown:
                shown.add(basis)
                lines += wrap_text(basis, "  ")
            rows = [[format_spec(_spec_of(spec)), _signed_time(delta), _signed_bytes(memory),
                     "" if ok else (_UNREPAIRED if delta is None else "over the memory budget")]
                    for spec, delta, memory, ok in group["options"]]
            if rows:
                lines += table_lines(("alternative spec", "Δ step time", "Δ memory", ""), rows)
            else:
                lines.append("  no alternative: the leaf has one possible sharding")
    if not found:
        keys = [*plan.param_specs, *{key_pattern(k) for k in plan.param_specs}]
        close = did_you_mean(tensor, dict.fromkeys(keys), n=3, cutoff=0.5).rstrip()
        raise ConfigError(format_error(
            f"The plan has no state leaf {tensor!r}.", where="Plan.explain(tensor=...)",
            value=tensor,
            remedy=close or ("pass a key path of plan.param_specs, or a pattern as "
                             "plan.summary() prints it")))
    return lines


def explain(plan: Plan, /, tensor: str | None = None) -> str:
    """The text :meth:`Plan.explain` returns (module docstring).

    Raises:
      ConfigError: ``tensor`` names no state leaf of the plan (with a did-you-mean).
    """
    lines = [f"Plan {plan.content_hash[:HASH_CHARS]}: why this plan"]
    if tensor is not None:
        lines += ["", *_leaf(plan, tensor)]
        return "\n".join(clip_line(line.rstrip()) for line in lines)
    lines += ["", *_runner_ups(plan), ""]
    lines += _unused_types(plan)
    records = _records(plan)
    if not records:
        lines += wrap_text("This plan records no per-tensor alternatives (a plan made by a "
                           "shardplan that did not record them).", "")
    for name, record in records:
        where = f" in layout {name}" if name else ""
        lines += wrap_text(f"Closest alternatives{where} (Δ step time of a leaf's best other "
                           "sharding; explain(tensor=...) lists all)", "", "  ")
        lines += _closest(record) or ["  none: no leaf has another feasible sharding"]
    return "\n".join(clip_line(line.rstrip()) for line in lines)


VIEWS["explain"] = explain  # Plan.explain renders through it (plan/ does not import viz/)
