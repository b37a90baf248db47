"""A plain-text summary of a :class:`~shardplan.plan.plan.Plan`, at most 100 columns wide.

The text has no colour or other escape codes (it reads the same with ``NO_COLOR`` set, in logs
and in review comments); ``shardplan/viz`` renders the rich version. Parameter shardings are
grouped by *pattern* (:func:`~shardplan._format.key_pattern`): a numeric key-path component
that follows a named one (a layer index, ``blocks/3``) and a Linen-style index suffix
(``Dense_3``) become ``*``, and leaves with the same pattern and spec share one line. The
formatting pieces (sizes, times, specs, fitting lines) are :mod:`shardplan._format`'s.

Example:
    >>> from shardplan.plan.plan import _example
    >>> print(plan_summary(_example()))  # doctest: +ELLIPSIS
    Plan ...: 1 stage, 2 devices, 1 microbatch, schedule none
    ...
    Parameter shardings: stage  pattern [leaves] -> spec
      0  0/w [1 leaf] -> (None, 'data')
    ...
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from shardplan._format import (
    HASH_CHARS,
    MAX_WIDTH,
    clip_line,
    compress_ids,
    elide_middle,
    format_bytes,
    format_gib,
    format_share,
    format_spec,
    format_time,
    format_value,
    key_pattern,
    layer_runs,
    pack_items,
    plural,
    wrap_text,
)

if TYPE_CHECKING:
    from shardplan.plan.plan import Plan

__all__ = ["ACCUMULATION_WORDS", "MAX_STAGE_ROWS", "plan_summary"]


# --------------------------------------------------------------------------- sections


def _microbatches(plan: Plan) -> str:
    return plural(plan.microbatches, "microbatch", "microbatches")


def _header(plan: Plan) -> list[str]:
    replicas = (f" in {plural(len(plan.replicas), 'replica')}" if len(plan.replicas) > 1
                else "")
    size = f" of {plan.microbatch_size}" if plan.microbatch_size else ""
    chunks = f" ({plan.chunks} chunks per stage)" if plan.chunks > 1 else ""
    return [
        f"Plan {plan.content_hash[:HASH_CHARS]}: {plural(len(plan.stages), 'stage')}{replicas}, "
        f"{plural(plan.num_devices, 'device')}, {_microbatches(plan)}{size}, "
        f"schedule {plan.schedule}{chunks}",
        f"  schema {plan.schema_version}, shardplan {plan.shardplan_version}, "
        f"graph {plan.graph_fingerprint[:HASH_CHARS] or '-'}, "
        f"cluster {plan.cluster_hash[:HASH_CHARS] or '-'}, "
        f"config {plan.config_hash[:HASH_CHARS] or '-'}",
        *([f"  accumulation: {ACCUMULATION_WORDS[plan.accumulation]}"]
          if plan.microbatches > 1 or plan.accumulation != "exact" else []),
    ]


ACCUMULATION_WORDS = {
    "exact": "exact (the microbatches' gradients and metrics add up to the whole batch's)",
    "per_microbatch": "gradient accumulation semantics (each microbatch draws its own random "
                      "numbers and computes its own batch statistics)",
}
"""How :attr:`Plan.accumulation` reads in the summary and the HTML report."""


MAX_STAGE_ROWS = 16
"""Plans with more stages list their replicas' structure instead of every stage."""


def _device_types(plan: Plan) -> list[str]:
    """Per device type: devices, stages, replicas and layers (multi-stage plans)."""
    devices: dict[str, set[int]] = {}
    replicas: dict[str, set[int]] = {}
    layers: dict[str, set[str]] = {}
    stages: dict[str, int] = {}
    for st in plan.stages:
        devices.setdefault(st.device_type, set()).update(st.mesh.device_ids)
        replicas.setdefault(st.device_type, set()).add(st.replica)
        layers.setdefault(st.device_type, set()).update(st.layers)
        stages[st.device_type] = stages.get(st.device_type, 0) + 1
    lines = ["Device types"]
    for name in stages:
        lines.append(f"  {name}: {plural(len(devices[name]), 'device')} in "
                     f"{plural(stages[name], 'stage')} of "
                     f"{plural(len(replicas[name]), 'replica')}, "
                     f"{plural(len(layers[name]), 'distinct layer')}")
    return lines


def _replicas(plan: Plan) -> list[str]:
    """Replicas grouped by structure: per group its members, microbatches and stages."""
    groups: dict[tuple, list[int]] = {}
    for r, replica in enumerate(plan.replicas):
        shape = tuple((plan.stages[i].device_type, plan.stages[i].mesh.describe(),
                       plan.stages[i].mesh.num_devices, tuple(layer_runs(plan.stages[i].layers)),
                       plan.stages[i].remat) for i in replica.stages)
        groups.setdefault((shape, replica.microbatches), []).append(r)
    lines = ["Replicas (identical ones together): stages in pipeline order"]
    for (shape, microbatches), members in groups.items():
        ids = compress_ids(members)
        lines.append(f"  {'replica' if len(members) == 1 else 'replicas'} {ids} "
                     f"({len(members)} x): {plural(microbatches, 'microbatch', 'microbatches')}"
                     " each")
        for device_type, mesh, n, layers, remat in shape:
            lead = f"    {device_type} {mesh} {plural(n, 'device')}, remat {remat}: "
            lines.extend(pack_items(list(layers) or ["-"], lead, " " * 6))
    return lines


def _stages(plan: Plan) -> list[str]:
    if len(plan.stages) > MAX_STAGE_ROWS:
        return [f"Stages: {len(plan.stages)} (too many to list; the replicas above show their "
                "structure, plan.stages has each one's devices)"]
    rows = [(str(s.index), s.device_type, s.mesh.describe(), compress_ids(s.mesh.device_ids),
             s.remat) for s in plan.stages]
    layers = [["layers"], *(layer_runs(s.layers) or ["-"] for s in plan.stages)]
    head = ("#", "device type", "mesh", "devices", "remat")
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(5)]
    lines = ["Stages"]
    for row, names in zip([head, *rows], layers, strict=True):
        lead = "  " + "  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths, strict=True))
        lead += "  "
        if len(lead) > MAX_WIDTH - 20:  # pathological widths: put layers on their own lines
            lines.append(clip_line(lead.rstrip()))
            lines.extend(pack_items(names, "      ", "      "))
        else:
            lines.extend(pack_items(names, lead, " " * len(lead)))
    return lines


def _grouped(entries: Iterable[tuple[str, str, str]]) -> list[tuple[str, str, str, int]]:
    """(stage label, key, spec) -> (stages, pattern, spec, leaves), in first-seen order."""
    groups: dict[tuple[str, str], tuple[list[str], int]] = {}
    for stage, key, spec in entries:
        stages, count = groups.get((key_pattern(key), spec), ([], 0))
        if stage not in stages:
            stages.append(stage)
        groups[(key_pattern(key), spec)] = (stages, count + 1)
    return [(", ".join(stages), pattern, spec, count)
            for (pattern, spec), (stages, count) in groups.items()]


def _spec_lines(rows: list[tuple[str, str, str, int]], *, with_stage: bool) -> list[str]:
    width = max((len(r[0]) for r in rows), default=0)
    lines = []
    for stages, pattern, spec, count in rows:
        lead = f"  {stages:<{width}}  " if with_stage else "  "
        tail = f" [{plural(count, 'leaf', 'leaves')}] -> {spec}"
        line = lead + pattern + tail
        if len(line) <= MAX_WIDTH:
            lines.append(line)
            continue
        # Too wide: the pattern on its own line (elided in the middle if needed), then the spec.
        lines.append(lead + elide_middle(pattern, MAX_WIDTH - len(lead)))
        lines.append(clip_line(" " * len(lead) + "  " + tail.lstrip()))
    return lines


def _layout_shardings(plan: Plan) -> list[str]:
    """Parameter and batch shardings per layout (multi-stage plans)."""
    lines = ["Shardings per layout: pattern [leaves] -> spec"]
    for name, layout in plan.layouts.items():
        users = [st.index for st in plan.stages if st.layout == name]
        lines.append(f"  {name} (stages {compress_ids(users) if users else '-'})")
        rows = _grouped(("", k, format_spec(v)) for k, v in layout.param_specs.items())
        rows += _grouped(("", "batch: " + k, format_spec(v))
                         for k, v in layout.batch_specs.items())
        lines += [("  " + line) for line in _spec_lines(rows, with_stage=False)] or ["    -"]
    return lines


def _shardings(plan: Plan) -> list[str]:
    if plan.layouts:
        return _layout_shardings(plan)
    params = _grouped((str(stage), key, format_spec(spec))
                      for key, (stage, spec) in plan.param_specs.items())
    lines = ["Parameter shardings: stage  pattern [leaves] -> spec"]
    lines += _spec_lines(params, with_stage=True) or ["  (none)"]
    lines.append("")
    batch = _grouped(("", key, format_spec(spec)) for key, spec in plan.batch_specs.items())
    lines.append("Batch shardings: pattern [leaves] -> spec")
    lines += _spec_lines(batch, with_stage=False) or ["  (none)"]
    if plan.constraints:
        per_stage: dict[int, int] = {}
        for stage, *_ in plan.constraints.values():
            per_stage[stage] = per_stage.get(stage, 0) + 1
        counts = ", ".join(f"stage {k}: {n}" for k, n in sorted(per_stage.items()))
        lines += ["", f"Sharding constraints on intermediate values: {len(plan.constraints)} "
                      f"({counts})"]
    return lines


def _predicted(plan: Plan) -> list[str]:
    p = plan.predicted
    busy_s = p.compute_s + p.communication_s
    lines = [
        f"Predicted (per step, {_microbatches(plan)}, schedule {plan.schedule})",
        f"  step time     {format_time(p.step_time_s)}",
        f"  compute       {format_time(p.compute_s)}{format_share(p.compute_s, busy_s)}",
        f"  communication {format_time(p.communication_s)}"
        f"{format_share(p.communication_s, busy_s)}",
    ]
    # Peak memory per device type: the max over the type's devices that have a prediction.
    devices_of: dict[str, set[int]] = {}
    for s in plan.stages:
        devices_of.setdefault(s.device_type, set()).update(s.mesh.device_ids)
    peaks = []
    for device_type, ids in devices_of.items():
        known = [p.memory_bytes[d] for d in ids if d in p.memory_bytes]
        if known:
            peaks.append(f"{device_type} {format_gib(max(known))} "
                         f"(max of {plural(len(known), 'device')})")
    lines += pack_items(peaks or ["not predicted"], "  peak memory   ", " " * 16, sep="; ")
    coll = [f"{kind} {plural(t['count'], 'op')}, {format_bytes(t['bytes'])}"
            for kind, t in p.collectives.items()]
    lines += pack_items(coll or ["none"], "  collectives   ", " " * 16, sep="; ")
    return lines


def _solver(plan: Plan) -> list[str]:
    s = plan.solver
    head = str(s.get("status", "status unknown"))
    if "solve_time_s" in s and isinstance(s["solve_time_s"], int | float):
        head += f" in {float(s['solve_time_s']):.3g} s"
    if "lower_bound" in s and s.get("status") != "optimal":  # the stage planner's proven gap
        gap = s.get("gap")
        head += (f", within {100 * float(gap):.1f} % of a proven lower bound"
                 if isinstance(gap, int | float) else ", no lower bound proven")
    # (runner-ups and per-leaf alternatives are Plan.explain()'s: one line says they are there)
    skip = ("status", "solve_time_s", "chosen", "candidates", "runner_ups", "alternatives",
            "timeline", "unused_types")
    rest = [f"{k}={format_value(v)}" for k, v in s.items() if k not in skip]
    lines = ["Solver"]
    lines += pack_items(rest, f"  {head}: ", "    ") if rest else [f"  {head}"]
    candidates = s.get("candidates")
    if isinstance(candidates, Mapping) and candidates:
        # the stage planner's final pick (solver/stages/portfolio.py): predicted / simulated per plan
        def seconds(x: object) -> str:
            return format_time(float(x)) if isinstance(x, int | float) else "-"

        rows = [f"{name}{' (chosen)' if name == s.get('chosen') else ''} "
                f"{seconds(c.get('step_s'))} / {seconds(c.get('simulated_step_s'))}"
                for name, c in candidates.items() if isinstance(c, Mapping)]
        lines += pack_items(rows, "  candidates, predicted / simulated step: ", "    ", sep="; ")
    if "runner_ups" in s or "alternatives" in s:
        unused = s.get("unused_types")
        more = (f"; why device types stay unused ({', '.join(unused)})"
                if isinstance(unused, Mapping) and unused else "")
        lines.append(f"  runner-ups and alternative shardings{more}: plan.explain()")
    if plan.timings:
        spent = [f"{k} {v:.3g} s" for k, v in plan.timings.items()]
        lines += pack_items(spent, "  planning took: ", "    ", sep="; ")
    return lines


def plan_summary(plan: Plan, /) -> str:
    """The summary :meth:`Plan.summary` returns (see the module docstring)."""
    lines = _header(plan)
    sections = [_stages, _shardings, _predicted, _solver]
    if plan.replicas:
        sections[:0] = [_device_types, _replicas]
    for section in sections:
        lines.append("")
        lines.extend(section(plan))
    if plan.notes:
        lines += ["", "Notes"]
        for note in plan.notes:
            lines += wrap_text(note, "  - ", "    ")
    return "\n".join(clip_line(line.rstrip()) for line in lines)
