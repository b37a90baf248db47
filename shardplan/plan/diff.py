"""``sp.diff(plan_a, plan_b)``: what changed between two plans, as a value and as text.

A :class:`PlanDiff` lists the decisions that differ (stages, microbatching, schedule, remat,
parameter and batch shardings), the inputs the plans were made from (graph, cluster, config,
shardplan version) and the predicted figures. It is false when the plans agree on all of them
(the solver's report and the notes are not compared: two runs of the planner on equal inputs
give equal diffs although their solve times differ). Parameter shardings are grouped by key
pattern (:func:`~shardplan._format.key_pattern`), so a change to every block of a 96-layer
model is one line.

Example:
    >>> from shardplan.plan.plan import _example
    >>> bool(diff(_example(), _example()))
    False
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

from shardplan._format import (
    HASH_CHARS,
    clip_line,
    compress_ids,
    compress_layers,
    format_gib,
    format_spec,
    format_time,
    key_pattern,
    wrap_text,
)
from shardplan.errors import ConfigError, format_error

if TYPE_CHECKING:
    from shardplan.plan.plan import Plan, Spec, Stage

__all__ = ["Change", "PlanDiff", "SpecChange", "diff"]

MAX_STAGE_LINES = 24
"""Stage differences listed before the rest are counted only."""

_ABSENT = "-"


class Change(NamedTuple):
    """One field that differs: its name, the value in plan a and in plan b (as text)."""

    field: str
    before: str
    after: str


class SpecChange(NamedTuple):
    """Leaves of one key pattern whose sharding changed the same way.

    Attributes:
      pattern: the key pattern (``0/blocks/*/mlp/up/kernel/value``).
      leaves: how many leaves changed so.
      before: the spec in plan a (``"-"``: no such leaf), with its stage where the plans
        have several.
      after: the spec in plan b.
    """

    pattern: str
    leaves: int
    before: str
    after: str


@dataclasses.dataclass(frozen=True)
class PlanDiff:
    """The differences between two plans (module docstring); ``bool(diff)`` is false when
    there are none, ``str(diff)`` is plain text at most 100 columns wide.

    Attributes:
      before_hash: content hash of plan a.
      after_hash: content hash of plan b.
      inputs: ``shardplan_version``, ``graph_fingerprint``, ``cluster_hash``,
        ``config_hash`` where they differ.
      stages: per stage (or replica count), what differs: device type, devices, mesh axes,
        layers, remat, layout.
      settings: ``microbatches``, ``microbatch_size``, ``schedule``, ``chunks``, replica
        microbatches where they differ.
      param_specs: changed parameter shardings, grouped by key pattern (layouts' too, in
        multi-stage plans, prefixed with the layout's name).
      batch_specs: changed batch shardings.
      predicted: step time, compute, communication and peak memory per device where they
        differ.
    """

    before_hash: str
    after_hash: str
    inputs: tuple[Change, ...] = ()
    stages: tuple[Change, ...] = ()
    settings: tuple[Change, ...] = ()
    param_specs: tuple[SpecChange, ...] = ()
    batch_specs: tuple[SpecChange, ...] = ()
    predicted: tuple[Change, ...] = ()

    def __bool__(self) -> bool:
        return any((self.inputs, self.stages, self.settings, self.param_specs,
                    self.batch_specs, self.predicted))

    def __len__(self) -> int:
        return sum(map(len, (self.inputs, self.stages, self.settings, self.param_specs,
                             self.batch_specs, self.predicted)))

    def __str__(self) -> str:
        head = (f"Plan {self.before_hash[:HASH_CHARS]} -> {self.after_hash[:HASH_CHARS]}: ")
        if not self:
            return head + "no differences"
        lines = [head + f"{len(self)} difference{'s' if len(self) != 1 else ''}"]
        for title, changes in (("Inputs", self.inputs), ("Stages", self.stages),
                               ("Microbatching and schedule", self.settings),
                               ("Predicted (per step)", self.predicted)):
            if changes:
                lines += ["", title]
                width = max(len(c.field) for c in changes)
                for c in changes:
                    lines += wrap_text(f"{c.field:<{width}}  {c.before} -> {c.after}", "  ", "    ")
        for title, specs in (("Parameter shardings: pattern [leaves] before -> after",
                              self.param_specs),
                             ("Batch shardings: key before -> after", self.batch_specs)):
            if specs:
                lines += ["", title]
                for s in specs:
                    lines += wrap_text(f"{s.pattern} [{s.leaves}]: {s.before} -> {s.after}", "  ",
                                       "    ")
        return "\n".join(clip_line(line.rstrip()) for line in lines)


def diff(plan_a: Plan, plan_b: Plan, /) -> PlanDiff:
    """The differences between ``plan_a`` and ``plan_b`` (see :class:`PlanDiff`).

    Raises:
      ConfigError: an argument is not a :class:`~shardplan.plan.Plan`.

    Example:
        >>> from shardplan.plan.plan import _example
        >>> print(diff(_example(), _example()))  # doctest: +ELLIPSIS
        Plan ... -> ...: no differences
    """
    from shardplan.plan.plan import Plan

    for name, plan in (("plan_a", plan_a), ("plan_b", plan_b)):
        if not isinstance(plan, Plan):
            raise ConfigError(format_error("sp.diff compares two plans.",
                                           where=f"diff({name})", value=type(plan).__name__,
                                           remedy="pass Plan values (sp.load_plan(path) reads "
                                                  "one from a file)"))
    with_stage = len(plan_a.stages) > 1 or len(plan_b.stages) > 1
    params = _spec_changes(
        {k: _staged(s, spec, with_stage) for k, (s, spec) in plan_a.param_specs.items()},
        {k: _staged(s, spec, with_stage) for k, (s, spec) in plan_b.param_specs.items()})
    for name in sorted(set(plan_a.layouts) | set(plan_b.layouts)):
        a, b = plan_a.layouts.get(name), plan_b.layouts.get(name)
        params += _spec_changes(
            {f"{name}: {k}": format_spec(v) for k, v in (a.param_specs.items() if a else ())},
            {f"{name}: {k}": format_spec(v) for k, v in (b.param_specs.items() if b else ())})
    batch = _spec_changes({k: format_spec(v) for k, v in plan_a.batch_specs.items()},
                          {k: format_spec(v) for k, v in plan_b.batch_specs.items()},
                          group=False)
    return PlanDiff(
        before_hash=plan_a.content_hash, after_hash=plan_b.content_hash,
        inputs=_changes([("shardplan_version", plan_a.shardplan_version,
                          plan_b.shardplan_version)]) + tuple(
            Change(f, getattr(plan_a, f)[:HASH_CHARS], getattr(plan_b, f)[:HASH_CHARS])
            for f in ("graph_fingerprint", "cluster_hash", "config_hash")
            if getattr(plan_a, f) != getattr(plan_b, f)),
        stages=_stage_changes(plan_a, plan_b),
        settings=_changes([
            ("microbatches", plan_a.microbatches, plan_b.microbatches),
            ("microbatch_size", plan_a.microbatch_size, plan_b.microbatch_size),
            ("schedule", plan_a.schedule, plan_b.schedule),
            ("chunks", plan_a.chunks, plan_b.chunks),
            ("replica microbatches", list(plan_a.replica_microbatches),
             list(plan_b.replica_microbatches)),
        ]),
        param_specs=tuple(params), batch_specs=tuple(batch),
        predicted=_predicted(plan_a, plan_b))


def _changes(items: Iterable[tuple[str, object, object]]) -> tuple[Change, ...]:
    return tuple(Change(f, str(a), str(b)) for f, a, b in items if a != b)


def _staged(stage: int, spec: Spec, with_stage: bool) -> str:
    return f"stage {stage} {format_spec(spec)}" if with_stage else format_spec(spec)


def _spec_changes(a: Mapping[str, str], b: Mapping[str, str], *,
                  group: bool = True) -> list[SpecChange]:
    """Changed entries, grouped by (pattern, before, after) in first-seen order."""
    counts: dict[tuple[str, str, str], int] = {}
    for key in [*a, *(k for k in b if k not in a)]:
        before, after = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if before == after:
            continue
        row = (key_pattern(key) if group else key, before, after)
        counts[row] = counts.get(row, 0) + 1
    return [SpecChange(p, n, before, after) for (p, before, after), n in counts.items()]


def _describe(stage: Stage | None) -> dict[str, str]:
    if stage is None:
        return {"stage": "absent"}
    return {"device type": stage.device_type, "mesh": stage.mesh.describe(),
            "devices": compress_ids(stage.mesh.device_ids),
            "layers": compress_layers(stage.layers), "remat": stage.remat,
            "replica": str(stage.replica), "layout": stage.layout or _ABSENT}


def _stage_changes(plan_a: Plan, plan_b: Plan) -> tuple[Change, ...]:
    out = list(_changes([("stages", len(plan_a.stages), len(plan_b.stages)),
                         ("replicas", len(plan_a.replicas) or 1, len(plan_b.replicas) or 1)]))
    rows: list[Change] = []
    for i in range(max(len(plan_a.stages), len(plan_b.stages))):
        a = _describe(plan_a.stages[i] if i < len(plan_a.stages) else None)
        b = _describe(plan_b.stages[i] if i < len(plan_b.stages) else None)
        if "stage" in a or "stage" in b:
            rows.append(Change(f"stage {i}", "absent" if "stage" in a else "present",
                               "absent" if "stage" in b else "present"))
            continue
        rows += [Change(f"stage {i} {k}", a[k], b[k]) for k in a if a[k] != b[k]]
    if len(rows) > MAX_STAGE_LINES:
        rest = len(rows) - MAX_STAGE_LINES
        rows = [*rows[:MAX_STAGE_LINES],
                Change("...", f"{rest} more stage differences", "see plan.stages")]
    return tuple(out + rows)


def _predicted(plan_a: Plan, plan_b: Plan) -> tuple[Change, ...]:
    a, b = plan_a.predicted, plan_b.predicted
    out = []
    for name, x, y in (("step time", a.step_time_s, b.step_time_s),
                       ("compute", a.compute_s, b.compute_s),
                       ("communication", a.communication_s, b.communication_s)):
        if x != y:
            out.append(Change(name, format_time(x), format_time(y) + _relative(x, y)))
    pa = max(a.memory_bytes.values(), default=0)
    pb = max(b.memory_bytes.values(), default=0)
    if pa != pb:
        out.append(Change("peak memory per device", format_gib(pa),
                          format_gib(pb) + _relative(pa, pb)))
    return tuple(out)


def _relative(x: float, y: float) -> str:
    return f" ({100 * (y / x - 1):+.1f} %)" if x else ""
