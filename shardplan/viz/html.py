"""The self-contained HTML report of a :class:`~shardplan.plan.plan.Plan`.

One file, nothing fetched at view time: the page's CSS (``report.css``) and script
(``report.js`` and ``report_figures.js``, plain ES2017, wrapped in one function so the page
gets no globals) are inlined from this package, the figures are inline
SVG the script draws, and the plan's data is one JSON blob (``<script type="application/json"
id="plan-data">``) that the script renders from. Sections (stable ids): ``#summary``,
``#cluster``, ``#stages``, ``#tensors`` (searchable; picking a row draws its tiling in
``#tiling``), ``#timeline``, ``#memory``, ``#runner-ups``, ``#figures``. ``report.html#tensor=
<key path>`` opens with that tensor picked.

The blob stays small on large plans: tensors are grouped by key pattern (one record per pattern,
kind, stage, spec, type; the layer indices of its leaves listed), devices are three integers
each, memory is one bar per group of devices with equal figures, and the pipeline timeline
keeps each (replica, stage) row once (a twin replica's rows refer to the first).

Example:
    >>> from shardplan.plan.plan import _example
    >>> text = plan_html(_example())
    >>> text.startswith("<!DOCTYPE html>") and 'id="plan-data"' in text
    True
"""

from __future__ import annotations

import html
import json
import math
import os
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardplan._format import HASH_CHARS, compress_layers, plain_json, starred_values
from shardplan.errors import ConfigError, ShardplanError, format_error
from shardplan.plan.plan import VIEWS
from shardplan.plan.summary import ACCUMULATION_WORDS
from shardplan.viz import data
from shardplan.viz.explain import chosen_label, peak_memory_bytes, runner_label
from shardplan.viz.report import report_table

if TYPE_CHECKING:
    from shardplan.plan.plan import Plan

__all__ = ["SECTIONS", "notebook_html", "payload", "plan_html", "write_html"]

SECTIONS = ("summary", "cluster", "stages", "tensors", "timeline", "memory", "runner-ups",
            "figures")
"""The report's section ids, in page order."""

_KINDS = ("forward", "backward", "send_forward", "send_backward")
_TICKS_PER_STEP = 1e6
"""Timeline times are integers: the step is cut into at least this many ticks (one tick is
the power of ten below ``step / 1e6`` seconds), six significant digits of every time."""

_SCRIPTS = ("report.js", "report_figures.js")
"""The script's parts, in order (one file would pass ~600 lines)."""

_IFRAME_HEIGHT_PX = 900  # the notebook frame: about one screen of the report


# --------------------------------------------------------------------------- the data blob


def _summary(plan: Plan) -> dict[str, Any]:
    name = plan.cluster_info.get("name")
    return {"id": plan.content_hash[:HASH_CHARS], "hash": plan.content_hash,
            "stages": len(plan.stages), "replicas": max(len(plan.replicas), 1),
            "devices": plan.num_devices, "schedule": plan.schedule, "chunks": plan.chunks,
            "microbatches": plan.microbatches, "microbatch_size": plan.microbatch_size,
            "accumulation": ACCUMULATION_WORDS[plan.accumulation],
            "step_time_s": plan.predicted.step_time_s, "compute_s": plan.predicted.compute_s,
            "communication_s": plan.predicted.communication_s,
            "cluster": str(name) if name is not None else None,
            "status": str(plan.solver.get("status", "")),
            "version": plan.shardplan_version, "notes": list(plan.notes)}


def _stages(plan: Plan, types: list[str]) -> list[list[Any]]:
    """Per stage: ``[type index, axis names, axis sizes, device ids, remat, layers, replica,
    layout]``."""
    return [[types.index(s.device_type), list(s.mesh.axis_names), list(s.mesh.axis_sizes),
             list(s.mesh.device_ids), s.remat, compress_layers(s.layers), s.replica, s.layout]
            for s in plan.stages]


def _fill(pattern: str, values: Sequence[str]) -> str | None:
    """The key path ``pattern`` names with its ``*`` s replaced by ``values`` (as the report's
    script does), or ``None`` when the counts differ."""
    out, rest = [], list(values)
    for comp in pattern.split("/"):
        if comp == "*" or comp.endswith("_*"):
            if not rest:
                return None
            out.append(comp[:-1] + rest.pop(0))
        else:
            out.append(comp)
    return "/".join(out) if not rest else None


def _tensors(plan: Plan) -> dict[str, Any]:
    """Tensors grouped: ``{"specs": [...], "groups": [[pattern, kind, stage, spec index, dtype,
    shape, bytes per device, members]]}``; a member is its starred values joined by ``,``, or
    ``[path]`` where the path does not follow from the pattern."""
    specs: list[list[list[str]]] = []
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for t in data.tensors(plan):
        spec = [list(dim) for dim in t.spec]
        if spec not in specs:
            specs.append(spec)
        pattern = t.pattern
        key = (pattern, t.kind, t.stage, specs.index(spec), t.dtype, t.shape,
               t.bytes_per_device)
        values = starred_values(t.path)
        member: str | list[str] = (",".join(values) if _fill(pattern, values) == t.path
                                   and all("," not in v for v in values) else [t.path])
        groups.setdefault(key, []).append(member)
    return {"specs": specs,
            "groups": [[p, k, s, i, d, list(shape) if shape is not None else None, b, members]
                       for (p, k, s, i, d, shape, b), members in groups.items()]}


def _devices(plan: Plan, types: list[str]) -> list[int]:
    """Flat ``[id, type index, stage or -1]`` per device of the cluster."""
    out: list[int] = []
    for d in data.devices(plan):
        if d.device_type not in types:
            types.append(d.device_type)
        out += [d.id, types.index(d.device_type), -1 if d.stage is None else d.stage]
    return out


def _memory(plan: Plan, types: list[str]) -> list[list[Any]]:
    """Devices with equal figures together: ``[type index, stages, devices, parameters,
    gradients, optimizer, other, peak, capacity, compiled]``."""
    groups: dict[tuple[Any, ...], list[list[int]]] = {}
    for m in data.memory(plan):
        key = (types.index(m.device_type), m.parameters, m.gradients, m.optimizer, m.other,
               m.peak, m.capacity, m.compiled)
        stages, count = groups.setdefault(key, [[], [0]])
        if m.stage not in stages:
            stages.append(m.stage)
        count[0] += 1
    return [[key[0], stages, count[0], *key[1:]] for key, (stages, count) in groups.items()]


def _timeline(plan: Plan) -> dict[str, Any]:
    """The simulator's timeline as rows of integer ticks, or ``{"reason": ...}``."""
    if len(plan.stages) == 1:
        return {"reason": "One stage: the plan has no pipeline, so no pipeline timeline."}
    try:
        from shardplan.plan.timeline import timeline_events
    except ImportError:  # a shardplan without the simulator's timeline
        events = None
    else:
        try:
            events = timeline_events(plan)
        except ShardplanError as err:  # show the rest of the plan, and say why not this
            return {"reason": "The plan's pipeline timeline cannot be read: "
                              + str(err).splitlines()[0]}
    if not events:
        return {"reason": "This plan file carries no pipeline timeline (the planner stores "
                          "none for plans too large to simulate, and older plan files have "
                          "none); make the plan again with a recent shardplan to see it."}
    end_s = max(e.end_s for e in events)
    tick_s = 10.0 ** math.floor(math.log10(end_s / _TICKS_PER_STEP)) if end_s > 0 else 1e-9
    order = {}
    for r, replica in enumerate(plan.replicas or ()):
        for position, stage in enumerate(replica.stages):
            order[(r, stage)] = (r, position)
    cells: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for e in events:
        compute, transfers = cells.setdefault((e.replica, e.stage), ([], []))
        start, stop = round(e.start_s / tick_s), round(e.end_s / tick_s)
        row = [_KINDS.index(e.kind), e.microbatch, e.chunk, start, stop - start]
        if e.to_stage is None:
            compute += row
        else:
            transfers += [*row, e.to_stage - e.stage]
    rows: list[list[Any]] = []
    seen: dict[str, int] = {}
    for (r, s), (compute, transfers) in sorted(
            cells.items(), key=lambda kv: order.get(kv[0], kv[0])):
        text = json.dumps([compute, transfers])
        if text in seen:  # a twin replica's row: the same tasks at the same times
            rows.append([r, s, seen[text]])
        else:
            seen[text] = len(rows)
            rows.append([r, s, compute, transfers])
    raw = plan.solver.get("timeline")
    window = raw.get("window") if isinstance(raw, Mapping) else None
    return {"tick_s": tick_s, "end": round(end_s / tick_s), "kinds": list(_KINDS),
            "rows": rows, "window": window if isinstance(window, int) else None,
            "microbatches": list(plan.replica_microbatches)}


def _finite(x: object) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


def _runner_ups(plan: Plan) -> dict[str, Any]:
    """The chosen plan and the runner-ups ``plan.explain()`` lists: ``[label, step time,
    peak memory, reason]`` each, the chosen one first."""
    rows: list[list[Any]] = [[chosen_label(plan), plan.predicted.step_time_s,
                              peak_memory_bytes(plan), "chosen"]]
    recorded = plan.solver.get("runner_ups")
    if isinstance(recorded, Sequence):
        for r in recorded:
            if isinstance(r, Mapping):
                step, memory = _finite(r.get("step_time_s")), _finite(r.get("memory_bytes"))
                rows.append([runner_label(plan, r), step,
                             None if memory is None else int(memory),
                             str(r.get("reason", ""))])
    note = ("This plan records no runner-ups (a plan made by a shardplan that did not record "
            "them)." if recorded is None else
            "No runner-up: the planner had no other feasible candidate." if len(rows) == 1
            else "")
    return {"rows": rows, "note": note}


def _figures(plan: Plan) -> dict[str, Any]:
    """``plan.report()`` as table rows (:func:`shardplan.viz.report.report_table`)."""
    head, rows = report_table(plan)
    return {"head": head, "rows": rows}


def payload(plan: Plan, /) -> dict[str, Any]:
    """The JSON-native data the report's script renders (the module docstring)."""
    types = [s.device_type for s in plan.stages]
    types = list(dict.fromkeys(types))
    devices = _devices(plan, types)  # adds the types only idle devices have
    return {"format": 1, "summary": _summary(plan), "types": types,
            "stages": _stages(plan, types), "devices": devices, "tensors": _tensors(plan),
            "memory": _memory(plan, types), "timeline": _timeline(plan),
            "runner_ups": _runner_ups(plan), "figures": _figures(plan),
            # per-leaf alternatives, as plan.explain(tensor=...) reads them (already compact:
            # one entry per solver group, not per layer)
            "alternatives": plain_json(plan.solver.get("alternatives"))}


# --------------------------------------------------------------------------- the document


def _asset(name: str) -> str:
    return resources.files("shardplan.viz").joinpath(name).read_text(encoding="utf-8")


def _script() -> str:
    """The page's script: its parts in one function scope, so the page gets no globals."""
    parts = "\n".join(_asset(name) for name in _SCRIPTS)
    return f'(function () {{\n"use strict";\n\n{parts}\n}}());\n'


def _script_json(value: object) -> str:
    """JSON that is safe inside ``<script>``: no ``<``, ``>`` or ``&`` (so no ``</script>``
    or ``<!--`` can end the element), no line separators JavaScript would reject."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    for raw, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                         ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(raw, escaped)
    return text


def plan_html(plan: Plan, /) -> str:
    """The report of ``plan`` as one self-contained HTML document (the module docstring).

    Example:
        >>> from shardplan.plan.plan import _example
        >>> 'id="tensors"' in plan_html(_example())
        True
    """
    summary = plan.content_hash[:HASH_CHARS]
    sections = "\n".join(f'<section id="{s}"></section>' for s in SECTIONS)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>shardplan plan {html.escape(summary)}</title>\n"
        f"<style>\n{_asset('report.css')}</style>\n</head>\n<body>\n"
        f"<header><h1>shardplan plan <code>{html.escape(summary)}</code></h1>"
        "<nav>" + " ".join(f'<a href="#{s}">{s.replace("-", " ")}</a>' for s in SECTIONS)
        + "</nav></header>\n<main>\n" + sections + "\n</main>\n"
        "<noscript><p>This report draws its figures with JavaScript; enable it to see "
        "them.</p></noscript>\n"
        f'<script type="application/json" id="plan-data">{_script_json(payload(plan))}'
        "</script>\n"
        f"<script>\n{_script()}</script>\n</body>\n</html>\n")


def write_html(plan: Plan, path: str | os.PathLike[str], /) -> Path:
    """Writes :func:`plan_html` to ``path`` (UTF-8) and returns the path.

    Raises:
      ConfigError: ``path`` is a directory, its directory does not exist, or it cannot be
        written; the message names the path.

    Example:
        >>> import tempfile
        >>> from shardplan.plan.plan import _example
        >>> with tempfile.TemporaryDirectory() as d:
        ...     write_html(_example(), Path(d) / "report.html").stat().st_size > 1000
        True
    """
    target = Path(path)
    if target.is_dir():
        raise ConfigError(format_error(
            "Cannot write the HTML report: the path is a directory.", where=str(target),
            remedy=f"give a file name, e.g. {target / 'report.html'}"))
    if not target.parent.is_dir():
        exists = target.parent.exists()
        raise ConfigError(format_error(
            "Cannot write the HTML report: "
            + ("its parent is not a directory." if exists else "its directory does not exist."),
            where=str(target), value=str(target.parent),
            remedy="give a path in an existing directory" if exists else
                   f"create the directory first (mkdir -p {target.parent}), or give another path"))
    text = plan_html(plan)
    try:
        target.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(format_error(
            f"Cannot write the HTML report: {exc.strerror or exc}.", where=str(target),
            remedy="check the path and its permissions, or give another path")) from exc
    return target


def notebook_html(plan: Plan, /) -> str:
    """The report in an ``<iframe srcdoc>``, for a notebook cell: the page keeps its own ids
    and script scope, so several reports in one notebook do not clash."""
    return (f'<iframe srcdoc="{html.escape(plan_html(plan), quote=True)}" '
            f'style="width:100%;height:{_IFRAME_HEIGHT_PX}px;border:0" '
            f'title="shardplan plan {plan.content_hash[:HASH_CHARS]}"></iframe>')


VIEWS.update(report=plan_html, notebook=notebook_html)  # Plan.to_html, Plan._repr_html_
