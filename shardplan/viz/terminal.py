"""The terminal view of a plan (``shardplan show plan.json``), rendered with rich.

Sections, each fitting ``width`` columns (100 by default) and reading the same without colour
(``NO_COLOR=1`` or ``color=False``: no escape codes at all, every mark is a distinct character):

* the cluster by device type: devices, memory each, used and idle devices, the stages per type;
* the stages: layers (runs compressed), devices (ids compressed), mesh shape, remat; identical
  stages of several replicas share a row;
* the state shardings grouped by layer type, one row per distinct (pattern, shape, spec) with
  its leaf count and stages; optimizer leaves sharded as their parameters are folded into a line;
* a text Gantt of the pipeline schedule (:func:`gantt_lines`) from the simulator's timeline;
* memory per device type against capacity (:func:`memory_lines`), identical devices grouped;
* predicted | compiled | measured (:meth:`Plan.report`).

Example:
    >>> from shardplan.plan.plan import _example
    >>> text = show_text(_example())
    >>> print(text.splitlines()[0])  # doctest: +ELLIPSIS
    Plan ...: 1 stage, 2 devices, 1 microbatch, schedule none
"""

from __future__ import annotations

import io
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TextIO

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from shardplan._format import (
    HASH_CHARS,
    MAX_WIDTH,
    clip_line,
    compress_ids,
    elide_middle,
    format_bytes,
    format_spec,
    format_time,
    key_pattern,
    layer_runs,
    plural,
)
from shardplan.errors import ConfigError, format_error
from shardplan.plan.plan import natural_key
from shardplan.plan.summary import MAX_STAGE_ROWS
from shardplan.viz.data import capacities, devices, memory, parse_type

if TYPE_CHECKING:
    from shardplan.plan.plan import Plan, Spec

__all__ = ["MIN_WIDTH", "TimelineLike", "check_width", "gantt_lines", "memory_lines", "show",
           "show_text"]

# (Past 600 lines: one short renderer per section of `shardplan show`, sharing the console
# settings and the width handling; the figures themselves come from viz/data.py.)

FORWARD, BACKWARD, BUBBLE = "▒", "█", "·"
"""Gantt marks: a forward pass, a backward pass, an idle stage (a pipeline bubble)."""

PARAMS, GRADS, OPTIMIZER, OTHER, FREE = "█", "▓", "▒", "░", "·"
"""Memory bar marks: parameters, gradients, optimizer state, the rest of the peak, free."""

MEMORY_BAR_WIDTH = 50
"""Columns of a memory bar at most (it spans the device's capacity)."""

MAX_MEMORY_GROUPS = 12
"""More groups of devices than this: each type shows its highest and lowest peak only."""

LABEL_WIDTH = 14
"""Columns of a Gantt row's label (``r0 s2``; longer labels are cut)."""

MIN_WIDTH = 40
"""The fewest columns the view is drawn in (``shardplan show --width``): at 40 a Gantt row keeps
23 columns of schedule beside its label, and a sharding row its shape, spec and leaf count;
narrower, most lines are cut short of their figures (at 0, rich prints nothing at all)."""

_STYLES = {FORWARD: "blue", BACKWARD: "green", BUBBLE: "dim"}
_MEMORY_STYLES = {PARAMS: "magenta", GRADS: "yellow", OPTIMIZER: "cyan", OTHER: "blue",
                  FREE: "dim"}


class TimelineLike(Protocol):
    """One task of a pipeline timeline (``shardplan.plan.timeline.TimelineEvent`` and the
    simulator's :class:`~shardplan.solver.stages.simulate.Event` both fit)."""

    @property
    def replica(self) -> int: ...
    @property
    def stage(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def microbatch(self) -> int: ...
    @property
    def start_s(self) -> float: ...
    @property
    def end_s(self) -> float: ...


# --------------------------------------------------------------------------- entry points


def show_text(plan: Plan, /, *, width: int = MAX_WIDTH, color: bool = False) -> str:
    """The terminal view as a string.

    Args:
      plan: the plan.
      width: columns (at least :data:`MIN_WIDTH`); every line fits them.
      color: include ANSI colour codes (``False``: plain text, as with ``NO_COLOR``).

    Returns:
      The rendered text, lines separated by ``\\n``.

    Raises:
      ConfigError: ``width`` is below :data:`MIN_WIDTH`.
    """
    check_width(width, where="show_text(width=...)")
    buffer = io.StringIO()
    console = _console(buffer, width=width, color=color)
    _print(console, plan)
    text = buffer.getvalue()
    return text if color else "\n".join(line.rstrip() for line in text.split("\n"))


def show(plan: Plan, /, *, width: int = MAX_WIDTH, file: TextIO | None = None) -> None:
    """Prints the terminal view to ``file`` (stdout), in colour on a terminal unless
    ``NO_COLOR`` is set (then without any escape code).

    Args:
      plan: the plan.
      width: columns (at least :data:`MIN_WIDTH`); every line fits them.
      file: where to print (default ``sys.stdout``).

    Raises:
      ConfigError: ``width`` is below :data:`MIN_WIDTH`.
    """
    check_width(width, where="show(width=...)")
    out = file if file is not None else sys.stdout
    color = out.isatty() and not os.environ.get("NO_COLOR")
    _print(_console(out, width=width, color=color), plan)


def check_width(width: object, /, *, where: str = "width") -> int:
    """``width`` if the view can be drawn in that many columns (at least :data:`MIN_WIDTH`).

    Raises:
      ConfigError: ``width`` is not an integer >= :data:`MIN_WIDTH`; the message names
        ``where`` (``--width`` on the command line).
    """
    if isinstance(width, bool) or not isinstance(width, int) or width < MIN_WIDTH:
        raise ConfigError(format_error(
            f"The terminal view needs at least {MIN_WIDTH} columns.", where=where, value=width,
            remedy=f"give a width of {MIN_WIDTH} or more (default {MAX_WIDTH})",
            has_value=True))
    return width


def _console(file: TextIO, *, width: int, color: bool) -> Console:
    # Explicit settings throughout, so FORCE_COLOR / TERM / COLUMNS in the environment cannot
    # add escape codes or change the width behind the caller's back.
    return Console(file=file, width=width, force_terminal=color, no_color=not color,
                   color_system="standard" if color else None, highlight=False, markup=False,
                   emoji=False, soft_wrap=False, legacy_windows=False)


def _print(console: Console, plan: Plan) -> None:
    width = console.width
    sections: list[tuple[str, Sequence[RenderableType]]] = [
        ("Cluster", [_cluster(plan)]),
        ("Stages", _stages(plan, width)),
        ("Shardings", _shardings(plan, width)),
        ("Pipeline schedule", _styled(gantt_lines(_timeline(plan), width=width,
                                                  why_none=_why_no_timeline(plan))
                                      + _window_note(plan, width))),
        ("Memory per device (predicted peak)", _styled(memory_lines(plan, width=width),
                                                        styles=_MEMORY_STYLES)),
        ("Predicted | compiled | measured", [_report(plan)]),
    ]
    first, second = _header(plan)
    console.print(Text(first, style="bold"), overflow="fold")
    console.print(Text(second))
    for title, body in sections:
        console.print()
        console.print(Text(title, style="bold underline"))
        for renderable in body:
            console.print(renderable)


def _styled(lines: Iterable[str], *, styles: Mapping[str, str] = _STYLES) -> list[Text]:
    """Lines as rich Text with each mark character in its colour (shown only with colour)."""
    out = []
    for line in lines:
        text = Text(line, no_wrap=True, overflow="crop")
        start = 0
        for i in range(1, len(line) + 1):  # one style span per run of equal marks
            if i == len(line) or line[i] != line[start]:
                style = styles.get(line[start])
                if style:
                    text.stylize(style, start, i)
                start = i
        out.append(text)
    return out


# --------------------------------------------------------------------------- header, cluster


def _header(plan: Plan) -> list[str]:
    replicas = f" in {plural(len(plan.replicas), 'replica')}" if len(plan.replicas) > 1 else ""
    size = f" of {plan.microbatch_size}" if plan.microbatch_size else ""
    chunks = f" ({plan.chunks} chunks per stage)" if plan.chunks > 1 else ""
    return [f"Plan {plan.content_hash[:HASH_CHARS]}: "
            f"{plural(len(plan.stages), 'stage')}{replicas}, "
            f"{plural(plan.num_devices, 'device')}, "
            f"{plural(plan.microbatches, 'microbatch', 'microbatches')}{size}, "
            f"schedule {plan.schedule}{chunks}",
            f"predicted step {format_time(plan.predicted.step_time_s)}"]


def _table(*columns: str, wrap: Sequence[str] = ()) -> Table:
    """A plain table; only the ``wrap`` columns wrap (the others keep their cells on one line,
    so a narrow console shortens the long lists rather than break ``(model=2)``)."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, expand=False)
    for name in columns:  # (a wrapping column still keeps its header whole)
        table.add_column(name, overflow="fold", no_wrap=name not in wrap,
                         min_width=len(name) if name in wrap else None)
    return table


def _cluster(plan: Plan) -> RenderableType:
    views = devices(plan)
    capacity = capacities(plan)
    kinds = list(dict.fromkeys([v.device_type for v in views] + list(capacity)))
    table = _table("device type", "devices", "memory each", "used", "idle", "stages",
                   wrap=("used", "stages"))
    for kind in kinds:
        mine = [v for v in views if v.device_type == kind]
        used = [v for v in mine if v.stage is not None]
        stages = [s.index for s in plan.stages if s.device_type == kind]
        mem = capacity.get(kind)
        table.add_row(kind, str(len(mine)), format_bytes(mem) if mem else "-",
                      f"{len(used)} ({compress_ids(v.id for v in used)})" if used else "0",
                      str(len(mine) - len(used)), compress_ids(stages) or "-")
    name = plan.cluster_info.get("name")
    caption = f"cluster {name}" if isinstance(name, str) and name else ""
    return Group(Text(caption, style="dim"), table) if caption else table


# --------------------------------------------------------------------------- stages


_StageEntry = tuple[list[int], str, str, tuple[str, ...], str]
"""(stage indices, device type, mesh, layers, remat) of a stages entry."""


def _runs(entries: list[_StageEntry]) -> list[_StageEntry]:
    """Consecutive entries alike but for their layers (deep pipelines) merged into one, its
    layers the union: the unnumbered ones that lead the first entry (``pre``), the numbered
    ones in order, then the other unnumbered ones (``post``, ``shared``)."""
    out: list[_StageEntry] = []
    for members, kind, mesh, layers, remat in entries:
        if out and out[-1][1:3] == (kind, mesh) and out[-1][4] == remat:
            last = out[-1]
            out[-1] = (last[0] + members, kind, mesh, _union(last[3], layers), remat)
        else:
            out.append((list(members), kind, mesh, layers, remat))
    return out


def _union(first: tuple[str, ...], second: tuple[str, ...]) -> tuple[str, ...]:
    names = list(dict.fromkeys(first + second))
    numbered = sorted((n for n in names if n[-1:].isdigit()), key=natural_key)
    lead = []
    for n in first:
        if n[-1:].isdigit():
            break
        lead.append(n)
    rest = [n for n in names if n not in lead and not n[-1:].isdigit()]
    return (*lead, *numbered, *rest)


def _stages(plan: Plan, width: int) -> list[Text]:
    """Stages that differ only in devices and replica share an entry: a line of what they are,
    then their devices and their layers, each broken between items to fit ``width``."""
    groups: dict[tuple, list[int]] = {}
    for s in plan.stages:
        key = (s.device_type, s.mesh.describe(), s.layers, s.remat)
        groups.setdefault(key, []).append(s.index)
    entries = [(members, *key) for key, members in groups.items()]
    if len(entries) > MAX_STAGE_ROWS:
        entries = _runs(entries)
    out = []
    for members, kind, mesh, layers, remat in entries:
        ids = [d for i in members for d in plan.stages[i].mesh.device_ids]
        replicas = sorted({plan.stages[i].replica for i in members})
        head = (f"stage{'s' if len(members) > 1 else ''} {compress_ids(members)} "
                f"(replica{'s' if len(replicas) > 1 else ''} {compress_ids(replicas)}): "
                f"{kind} {mesh}, remat {remat}")
        out.append(Text(clip_line(head, width), style="bold"))
        out += [Text(line) for line in _pack_words(
            [f"{plural(len(ids), 'device')}:", *compress_ids(ids).split(" ")], width, sep=" ",
            indent="    ")]
        out += [Text(line) for line in _pack_words(
            ["layers:", *(f"{r}," for r in layer_runs(layers))], width, sep=" ",
            indent="    ")]
        out[-1] = Text(str(out[-1]).rstrip(","))
    return out


# --------------------------------------------------------------------------- shardings


def _layer_type(pattern: str) -> str:
    """The layer a leaf belongs to: its pattern up to the first ``*`` (``0/blocks/*``), else
    up to its first named component (``0/wte``)."""
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        if "*" in part:
            return "/".join(parts[:i + 1])
    for i, part in enumerate(parts):
        if not part.isdigit():
            return "/".join(parts[:i + 1])
    return pattern


_OPTIMIZER_PARTS = frozenset({"opt_state", "mu", "nu", "count", "momentum", "trace", "step"})


def _parameter_suffix(pattern: str) -> str | None:
    """``1/opt_state/*/0/mu/blocks/*/w/value`` -> ``blocks/*/w/value`` (the parameter an
    optimizer leaf belongs to, without the state position); None when it names none."""
    parts = pattern.split("/")
    last = max((i for i, p in enumerate(parts) if p in _OPTIMIZER_PARTS), default=-1)
    rest = parts[last + 1:]
    while rest and (rest[0].isdigit() or rest[0] == "*"):
        rest = rest[1:]
    return "/".join(rest) if rest and last >= 0 else None


Row = tuple[str, str, str, int, str]
"""(pattern, shape, spec, leaves, stages) of one shardings row."""


def _rows(entries: Iterable[tuple[str, Spec, str]], types: Mapping[str, str]) -> list[Row]:
    """(key path, spec, stages label) -> rows grouped by (pattern, shape, spec), in order."""
    groups: dict[tuple[str, str, str], tuple[int, list[str]]] = {}
    for path, spec, stages in entries:
        typ = types.get(path)
        shape = str(list(parse_type(typ)[1])) if typ else "?"
        key = (key_pattern(path), shape, format_spec(spec))
        count, labels = groups.get(key, (0, []))
        if stages not in labels:
            labels.append(stages)
        groups[key] = (count + 1, labels)
    return [(p, s, spec, n, ", ".join(x for x in labels if x)) for (p, s, spec), (n, labels) in groups.items()]


def _shardings(plan: Plan, width: int) -> list[RenderableType]:
    """One block per layout (the plan's own specs for one-stage plans)."""
    if plan.layouts:
        blocks = []
        for name, layout in plan.layouts.items():
            users = [s.index for s in plan.stages if s.layout == name]
            label = f"stages {compress_ids(users)}" if users else "no stage"
            # (every row of a layout is on the layout's stages: the title says which)
            entries = [(k, v, "") for k, v in layout.param_specs.items()]
            batch = [(k, v, "") for k, v in layout.batch_specs.items()]
            blocks.append((f"layout {name} ({label})", entries, batch))
    else:
        entries = [(k, spec, str(stage)) for k, (stage, spec) in plan.param_specs.items()]
        batch = [(k, v, str(plan.stages[0].index)) for k, v in plan.batch_specs.items()]
        blocks = [("", entries, batch)]
    out: list[RenderableType] = [Text(clip_line(
        "  pattern [shape] → spec, ×leaves, stages; rows grouped by layer", width), style="dim")]
    for title, entries, batch in blocks:
        if title:
            out.append(Text(title, style="bold"))
        out += _styled_rows(_sharding_lines(_rows(entries, plan.state_types),
                                            _rows(batch, plan.batch_types), width))
    return out


def _sharding_lines(rows: list[Row], batch: list[Row], width: int) -> list[str]:
    params = [r for r in rows if _parameter_suffix(r[0]) is None]
    optimizer = [r for r in rows if _parameter_suffix(r[0]) is not None]
    by_suffix = {}
    for r in params:
        parts = r[0].split("/")
        while parts and parts[0].isdigit():
            parts = parts[1:]
        by_suffix["/".join(parts)] = (r[1], r[2])
    # An optimizer leaf (Adam's mu, nu) laid out as its parameter says nothing new: fold it.
    folded = [r for r in optimizer if by_suffix.get(_parameter_suffix(r[0]) or "") == r[1:3]]
    unfolded = [r for r in optimizer if r not in folded]
    lines: list[str] = []
    groups: dict[str, list[Row]] = {}
    for r in params + unfolded:
        groups.setdefault(_layer_type(r[0]), []).append(r)
    for layer, members in groups.items():
        leaves = sum(r[3] for r in members)
        lines.append(clip_line(f"{layer}  ({plural(leaves, 'leaf', 'leaves')})", width))
        lines += [line for r in members for line in _row_lines(r, width)]
    if folded:
        leaves = sum(r[3] for r in folded)
        lines.append(clip_line(f"optimizer state: {plural(leaves, 'leaf', 'leaves')} in "
                               f"{plural(len(folded), 'pattern')} sharded as their parameters",
                               width))
    if batch:
        lines.append("batch")
        lines += [line for r in batch for line in _row_lines(r, width)]
    return lines


def _row_lines(row: Row, width: int) -> list[str]:
    pattern, shape, spec, leaves, stages = row
    tail = f"×{leaves}".rjust(6) + (f"  {stages}" if stages else "")
    body = f"  {pattern} {shape} → {spec}"
    if len(body) + 2 + len(tail) <= width:
        return [body.ljust(width - len(tail)) + tail]
    # Too wide: the pattern alone (elided in the middle), then shape and spec under it.
    first = "  " + elide_middle(pattern, width - 2)
    second = f"      {shape} → {spec}"
    if len(second) + 2 + len(tail) <= width:
        return [first, second.ljust(width - len(tail)) + tail]
    return [first, clip_line(second, width), clip_line(" " * 6 + tail.strip(), width)]


def _styled_rows(lines: list[str]) -> list[Text]:
    out = []
    for line in lines:
        text = Text(line, no_wrap=True, overflow="crop")
        if not line.startswith(" "):
            text.stylize("bold")
        elif "→" in line:
            text.stylize("cyan", line.index("→") + 2, len(line.rstrip()))
        out.append(text)
    return out


def _pack_words(items: Sequence[str], width: int, indent: str = "  ",
                sep: str = "  ") -> list[str]:
    """Items joined by ``sep``, broken between items to fit ``width``."""
    lines = [indent]
    for item in items:
        if lines[-1].strip() and len(lines[-1]) + len(sep) + len(item) > width:
            lines.append(indent + "  ")
        lines[-1] += (sep if lines[-1].strip() else "") + item
    return [clip_line(line, width) for line in lines]


# --------------------------------------------------------------------------- Gantt


def _timeline(plan: Plan) -> list[TimelineLike] | None:
    from shardplan.plan.timeline import timeline_events

    events = timeline_events(plan)
    return None if events is None else list(events)


def _window_note(plan: Plan, width: int) -> list[str]:
    """A timeline cut to a window of microbatches (large plans) leaves its middle undrawn."""
    raw = plan.solver.get("timeline")
    window = raw.get("window") if isinstance(raw, Mapping) else None
    if not isinstance(window, int):
        return []
    return _pack_words([f"(only microbatches j < {window} and the last {window} of each replica "
                        "are recorded: the fill and the drain; the steady state between them",
                        "shows as idle)"], width)


def _why_no_timeline(plan: Plan) -> str:
    if len(plan.stages) == 1 and plan.microbatches == 1:
        return "one stage and one microbatch: no pipeline schedule to draw"
    if len(plan.stages) == 1 or all(len(r.stages) == 1 for r in plan.replicas):
        accumulate = plural(plan.microbatches, "microbatch", "microbatches")
        return f"no pipeline: every replica is one stage ({accumulate} accumulated)"
    return f"no simulated timeline recorded for this plan (schedule {plan.schedule})"


def gantt_lines(events: Sequence[TimelineLike] | None, /, *, width: int = MAX_WIDTH,
                why_none: str = "no timeline") -> list[str]:
    """A text Gantt chart of a pipeline timeline: one line per (replica, stage).

    Time runs left to right, scaled so the last compute task ends at the right edge. A forward
    pass is drawn with :data:`FORWARD`, a backward pass with :data:`BACKWARD`, both starting
    with the microbatch number where the task is wide enough to hold it and a mark; idle time
    is :data:`BUBBLE`. Replicas whose rows look the same share one line (``r0-3 s0``).
    Transfers are not drawn (they overlap compute).

    Args:
      events: the timeline (``None`` or empty: no pipeline; ``why_none`` says why).
      width: columns.
      why_none: the line shown without a timeline.

    Returns:
      The lines, each at most ``width`` columns.
    """
    compute = [e for e in events or () if e.kind in ("forward", "backward")]
    if not compute:
        return [clip_line(f"  ({why_none})", width)]
    end_s = max(e.end_s for e in compute)
    columns = max(width - LABEL_WIDTH - 3, 10)
    per_col = end_s / columns if end_s > 0 else 1.0
    rows: dict[tuple[int, int], list[str]] = {}
    for e in sorted(compute, key=lambda e: (e.replica, e.stage, e.start_s)):
        row = rows.setdefault((e.replica, e.stage), [BUBBLE] * columns)
        lo = min(columns - 1, round(e.start_s / per_col))
        hi = min(columns, max(lo + 1, round(e.end_s / per_col)))
        mark = FORWARD if e.kind == "forward" else BACKWARD
        row[lo:hi] = [mark] * (hi - lo)
        digits = str(e.microbatch)
        if hi - lo > len(digits):
            row[lo:lo + len(digits)] = list(digits)
    # Replicas with identical rows at the same position in their pipeline: one line.
    position: dict[tuple[int, int], int] = {}
    for replica in sorted({r for r, _ in rows}):
        stages = sorted(s for r, s in rows if r == replica)
        position.update({(replica, s): i for i, s in enumerate(stages)})
    merged: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for key, row in rows.items():
        merged.setdefault((position[key], "".join(row)), []).append(key)
    lines = []
    for (_, bar), keys in sorted(merged.items(), key=lambda kv: min(kv[1])):
        label = (f"r{compress_ids(r for r, _ in keys)} "
                 f"s{compress_ids(s for _, s in keys)}")
        label = label if len(label) <= LABEL_WIDTH else label[:LABEL_WIDTH - 1] + "…"
        lines.append(f"  {label:<{LABEL_WIDTH}} {bar}")
    scale = f"{format_time(end_s)}"
    axis = "0".ljust(columns - len(scale)) + scale
    lines.append(f"  {'':<{LABEL_WIDTH}} {axis}")
    legend = [f"{FORWARD} forward", f"{BACKWARD} backward", f"{BUBBLE} idle (bubble)",
              "digits: microbatch", f"1 column = {format_time(per_col)}"]
    lines += _pack_words(legend, width)
    return lines


# --------------------------------------------------------------------------- memory


def memory_lines(plan: Plan, /, *, width: int = MAX_WIDTH) -> list[str]:
    """Per group of devices with equal figures: a bar of the predicted peak against capacity.

    The bar spans the device's capacity (or, where the plan records none, the largest peak):
    :data:`PARAMS` parameters, :data:`GRADS` gradients, :data:`OPTIMIZER` optimizer state,
    :data:`OTHER` the rest of the peak (activations, temporaries), :data:`FREE` free. A part
    that is not zero gets at least one column. With more than :data:`MAX_MEMORY_GROUPS`
    groups (deep pipelines: every stage's peak differs a little), each device type shows its
    group with the highest and the one with the lowest peak, and how many lie between.

    Returns:
      The lines, each at most ``width`` columns.
    """
    views = memory(plan)
    groups: dict[_MemoryKey, list[int]] = {}
    for m in views:
        key = (m.device_type, m.parameters, m.gradients, m.optimizer, m.other, m.peak,
               m.capacity, m.compiled)
        groups.setdefault(key, []).append(m.device)
    stage_of = {d: s.index for s in plan.stages for d in s.mesh.device_ids}
    largest = max((max(m.peak or 0, m.parameters * 2 + m.optimizer + m.other) for m in views),
                  default=0)
    bar_width = max(min(MEMORY_BAR_WIDTH, width - 44), 10)

    def draw(key: _MemoryKey) -> list[str]:
        ids = groups[key]
        return _memory_group(key, ids, [stage_of[d] for d in ids], largest, bar_width, width)

    if len(groups) <= MAX_MEMORY_GROUPS:
        return [line for key in groups for line in draw(key)] or ["  (no stage)"]
    lines: list[str] = []
    for kind in dict.fromkeys(key[0] for key in groups):
        mine = sorted((key for key in groups if key[0] == kind), key=_peak)
        lines += draw(mine[-1])
        if len(mine) > 1:
            rest = sum(len(groups[key]) for key in mine[1:-1])
            if rest:
                lines.append(clip_line(f"  ... {rest} more {kind} devices, their peaks between "
                                       "these two", width))
            lines += draw(mine[0])
    return lines


_MemoryKey = tuple[str, int, int, int, int, int | None, int | None, int | None]
"""(device type, parameters, gradients, optimizer, other, peak, capacity, compiled)."""


def _peak(key: _MemoryKey) -> int:
    return key[5] if key[5] is not None else sum(key[1:5])


def _memory_group(key: _MemoryKey, ids: list[int], stages: list[int], largest: int,
                  bar_width: int, width: int) -> list[str]:
    kind, params, grads, opt, other, _, capacity, compiled = key
    stage_ids = sorted(set(stages))
    lines = [clip_line(f"{kind} × {len(ids)}: device{'s' if len(ids) > 1 else ''} "
                       f"{compress_ids(ids)} (stage{'s' if len(stage_ids) > 1 else ''} "
                       f"{compress_ids(stage_ids)})", width)]
    total = _peak(key)
    bar = _bar([(PARAMS, params), (GRADS, grads), (OPTIMIZER, opt), (OTHER, other)],
               capacity or largest or 1, bar_width)
    against = (f"of {format_bytes(capacity)} capacity ({100 * total / capacity:.1f} %)"
               if capacity else "(capacity unknown: no cluster outline in the plan)")
    over = " EXCEEDS CAPACITY" if capacity and total > capacity else ""
    lines.append(clip_line(f"  {bar} {format_bytes(total)} {against}{over}", width))
    lines += _pack_words([f"{PARAMS} parameters {format_bytes(params)}",
                          f"{GRADS} gradients {format_bytes(grads)}",
                          f"{OPTIMIZER} optimizer {format_bytes(opt)}",
                          f"{OTHER} other {format_bytes(other)}"], width)
    if compiled is not None:
        lines.append(clip_line(f"  compiled (XLA, largest program): {format_bytes(compiled)}",
                               width))
    return lines


def _bar(parts: Sequence[tuple[str, int]], scale: int, width: int) -> str:
    cells: list[str] = []
    for mark, size in parts:
        n = math.floor(size / scale * width) if scale else 0
        cells += [mark] * (max(n, 1) if size > 0 else 0)
    cells = cells[:width]
    return "".join(cells) + FREE * (width - len(cells))


# --------------------------------------------------------------------------- report


def _report(plan: Plan) -> RenderableType:
    lines = plan.report().splitlines()[1:]  # the header repeats the plan's hash
    return Group(*(Text(line, no_wrap=True, overflow="crop") for line in lines))
