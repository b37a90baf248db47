"""``plan.report()``: the prediction next to what XLA compiled and what the run measured.

Rows per stage: peak memory per device, FLOPs per device, step (or busy) time; then the
collectives per kind. A column reads ``-`` where nothing was recorded (a plan not yet run, a
backend without memory figures). For a one-stage plan every figure compares like for like: the
stage runs one program. A pipeline stage runs several programs (per task and microbatch) whose
buffers the runtime holds across them, so its compiled column shows the largest single program
and the FLOP sum of its programs over one microbatch each; that row is labelled so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardplan._format import HASH_CHARS, format_bytes, format_si, format_time
from shardplan.plan.plan import VIEWS, Plan

__all__ = [
    "bytes_cell",
    "compiled_collectives",
    "number_cell",
    "plan_report",
    "programs_by_stage",
    "ratio_cell",
    "report_table",
    "seconds_cell",
    "stage_label",
]

_ROW = "  {:<28} {:>16} {:>16} {:>16} {:>8}"


def number_cell(x: float | None) -> str:
    """A count (FLOPs) as :func:`~shardplan._format.format_si` writes it (three significant
    digits, an SI prefix); ``-`` when not recorded.

    Example:
        >>> number_cell(2.5e12), number_cell(None)
        ('2.5 T', '-')
    """
    return "-" if x is None else format_si(x)


def ratio_cell(a: float | None, b: float | None) -> str:
    """``b / a`` (compiled or measured over predicted) to three significant digits; ``-`` when
    either is not recorded or ``a`` is zero.

    Example:
        >>> ratio_cell(2.0, 3.0), ratio_cell(None, 3.0)
        ('1.5', '-')
    """
    if a is None or b is None or not a:
        return "-"
    return f"{b / a:.3g}"


def bytes_cell(x: float | None) -> str:
    """Bytes as :func:`~shardplan._format.format_bytes` writes them; ``-`` when not recorded.

    Example:
        >>> bytes_cell(2048), bytes_cell(None)
        ('2.00 KiB', '-')
    """
    return "-" if x is None else format_bytes(int(x))


def seconds_cell(x: float | None) -> str:
    """Seconds as :func:`~shardplan._format.format_time` writes them; ``-`` when not
    recorded.

    Example:
        >>> seconds_cell(0.25), seconds_cell(None)
        ('250.0 ms', '-')
    """
    return "-" if x is None else format_time(float(x))


def programs_by_stage(plan: Plan, /) -> dict[int, list[Mapping[str, Any]]]:
    """The compiled programs ``plan.compiled`` records, by stage index, in recorded order.

    Example:
        >>> from shardplan.plan.plan import _example
        >>> programs_by_stage(_example())
        {}
    """
    out: dict[int, list[Mapping[str, Any]]] = {}
    programs: Any = plan.compiled.get("programs", ())
    for prog in programs:
        out.setdefault(int(prog["stage"]), []).append(prog)
    return out


def compiled_collectives(programs: Mapping[int, Sequence[Mapping[str, Any]]], /
                         ) -> dict[str, list[int]]:
    """``{kind: [count, bytes]}`` summed over the compiled programs of every stage (a merged
    replica's program once, not per member stage: ``same_as``)."""
    total: dict[str, list[int]] = {}
    for progs in programs.values():
        for prog in progs:
            if "same_as" in prog:
                continue
            for kind, entry in prog["collectives"].items():
                row = total.setdefault(kind, [0, 0])
                row[0] += int(entry["count"])
                row[1] += int(entry["bytes"])
    return total


_Programs = Mapping[int, Sequence[Mapping[str, Any]]]
"""The compiled programs by stage index (:func:`programs_by_stage`)."""


def report_table(plan: Plan, /) -> tuple[list[str], list[list[str]]]:
    """What :meth:`Plan.report` shows, as data: the lines saying what was compiled and
    measured, and the table rows ``[label, predicted, compiled, measured, ratio]`` with each
    section's heading as a one-cell row (the text report and the HTML report render these).

    Example:
        >>> from shardplan.plan.plan import _example
        >>> head, rows = report_table(_example())
        >>> rows[0], rows[1]
        (['memory per device (peak)'], ['stage 0 (cpu x2)', '1.00 KiB', '-', '', '-'])
    """
    programs = programs_by_stage(plan)
    measured: Mapping[str, Any] = plan.measured
    backend = plan.compiled.get("backend")
    head = [f"compiled: {sum(map(len, programs.values()))} program(s) on {backend}" if backend
            else "compiled: - (the plan has not run: sp.apply_plan / sp.auto record it)",
            f"measured: median of {measured['steps']} steps" if measured
            else "measured: - (recorded after the first timed steps)"]
    rows = [*_peak_memory_rows(plan, programs), *_state_rows(plan),
            *_traffic_rows(plan, programs), *_flops_rows(plan, programs), *_time_rows(plan),
            *_collective_rows(plan, programs)]
    return head, rows


def _peak_memory_rows(plan: Plan, programs: _Programs) -> list[list[str]]:
    """Peak memory per device of each stage: predicted, compiled, held while running; then
    the memory per device the plan was made for."""
    rows: list[list[str]] = [["memory per device (peak)"]]
    for st in plan.stages:
        predicted = max((plan.predicted.memory_bytes.get(d, 0) for d in st.mesh.device_ids),
                        default=None)
        figures = [p["memory_bytes"] for p in programs.get(st.index, ())
                   if p["memory_bytes"] is not None]
        compiled = max(figures) if figures else None
        # What the device held: a program's own figure plus the arrays the pipeline driver
        # kept beside it when it ran (state copies and optimizer state, saved activations of
        # other microbatches, gradient sums), the largest over the first step's runs.
        held = [p["memory_bytes"] + p["beside_bytes"] for p in programs.get(st.index, ())
                if p["memory_bytes"] is not None and p.get("beside_bytes") is not None]
        rows.append([stage_label(plan, st.index), bytes_cell(predicted), bytes_cell(compiled),
                     bytes_cell(max(held)) if held else "", ratio_cell(predicted, compiled)])
    # The memory per device the plan was made for (its budget, or the capacity less the
    # headroom), per device type it uses.
    budgets: Any = plan.solver.get("memory_budget_bytes", {})
    for name in dict.fromkeys(st.device_type for st in plan.stages):
        if name in budgets:
            rows.append([f"allowed on a {name}", bytes_cell(budgets[name]), "", "", ""])
    return rows


def _state_rows(plan: Plan) -> list[list[str]]:
    """What stays on a device between steps: the model's parameters and optimizer state per
    stage, and what the devices held after the last timed step (no rows when neither is
    recorded)."""
    resident: Any = plan.solver.get("resident_bytes", {})
    live: Any = plan.measured.get("live_bytes", {})
    if not (resident or live):
        return []
    rows = [["memory per device between steps (state)"]]
    for st in plan.stages:
        kept = resident.get(str(st.index))
        found = [live[str(d)] for d in st.mesh.device_ids if str(d) in live]
        rows.append([stage_label(plan, st.index), bytes_cell(kept), "",
                     bytes_cell(max(found)) if found else "",
                     ratio_cell(kept, max(found) if found else None)])
    return rows


def _traffic_rows(plan: Plan, programs: _Programs) -> list[list[str]]:
    """Bytes per step across data-parallel replicas and between stages (no rows when nothing
    of it was priced or measured)."""
    measured: Mapping[str, Any] = plan.measured
    sync: Any = plan.solver.get("sync_bytes", {})
    moved = measured.get("moved_bytes")
    if not (sync or moved is not None or "transfer_bytes" in plan.solver):  # (exchange: with sync)
        return []
    rows = [["bytes per step: replicas' all-reduce per device, exchange and transfers in all"]]
    # The gradient bytes a device of each stage all-reduces per step as the stage planner
    # priced them, against the compiled sync programs' all-reduce.
    for st in plan.stages:
        reduced = [int(p["collectives"]["all-reduce"]["bytes"])
                   for p in programs.get(st.index, ()) if str(p["name"]).startswith("sync")
                   and "all-reduce" in p["collectives"]]
        if str(st.index) in sync or reduced:
            priced = sync.get(str(st.index))
            rows.append([f"{stage_label(plan, st.index)} sync", bytes_cell(priced),
                         bytes_cell(sum(reduced)) if reduced else "-", "",
                         ratio_cell(priced, sum(reduced) if reduced else None)])
    # Between replicas that differ: what their gradient exchange brought each stage's
    # devices, priced (runtime/exchange.py; solver.pipeline.exchange_bytes) and measured.
    swapped: Any = plan.solver.get("exchange_bytes", {})
    got: Any = measured.get("sync_moved_bytes", {})
    for st in plan.stages:
        key = str(st.index)
        if key in swapped or key in got:
            rows.append([f"{stage_label(plan, st.index)} exchange",
                         bytes_cell(swapped.get(key)), "", bytes_cell(got.get(key)),
                         ratio_cell(swapped.get(key), got.get(key))])
    # What the step's transfers between stages carried (priced: the boundary activations and
    # their gradients) and its batch.
    sent: Any = plan.solver.get("transfer_bytes")
    if moved is not None or sent is not None:
        rows.append(["moved between stages", bytes_cell(sent), "", bytes_cell(moved),
                     ratio_cell(sent, moved)])
    if measured.get("batch_bytes") is not None:
        rows.append(["batch placed", "", "", bytes_cell(measured["batch_bytes"]), ""])
    return rows


def _flops_rows(plan: Plan, programs: _Programs) -> list[list[str]]:
    rows = [["FLOPs per device per step"]]
    for st in plan.stages:
        flops = (plan.predicted.stage_flops[st.index]
                 if st.index < len(plan.predicted.stage_flops) else None)
        done = [float(p["flops"]) for p in programs.get(st.index, ())]
        rows.append([stage_label(plan, st.index), number_cell(flops),
                     number_cell(sum(done) if done else None), "",
                     ratio_cell(flops, sum(done) if done else None)])
    return rows


def _time_rows(plan: Plan) -> list[list[str]]:
    """The whole step's time; under a pipeline, each stage's busy time too."""
    measured: Mapping[str, Any] = plan.measured
    step = measured.get("step_time_s")
    stage_times: Mapping[str, Any] = measured.get("stage_time_s", {})
    pipelined = len(plan.stages) > 1 or plan.microbatches > 1
    rows = [["step time"],
            ["whole step", seconds_cell(plan.predicted.step_time_s), "", seconds_cell(step),
             ratio_cell(plan.predicted.step_time_s, step)]]
    for st in plan.stages if pipelined else ():
        rows.append([f"{stage_label(plan, st.index)} busy", "", "",
                     seconds_cell(stage_times.get(str(st.index))), ""])
    return rows


def _collective_rows(plan: Plan, programs: _Programs) -> list[list[str]]:
    rows = [["collectives per device per step (count x bytes)"]]
    compiled_coll = compiled_collectives(programs)
    for kind in sorted(set(plan.predicted.collectives) | set(compiled_coll)):
        p, c = plan.predicted.collectives.get(kind), compiled_coll.get(kind)
        rows.append([kind, f"{p['count']} x {bytes_cell(p['bytes'])}" if p else "-",
                     f"{c[0]} x {bytes_cell(c[1])}" if c else "-", "",
                     ratio_cell(p["bytes"] if p else None, c[1] if c else None)])
    return rows


def plan_report(plan: Plan, /) -> str:
    """The text of :meth:`Plan.report` (at most 100 columns, no colour codes)."""
    head, rows = report_table(plan)
    lines = [f"Plan {plan.content_hash[:HASH_CHARS]}: predicted | compiled | measured"]
    lines += [f"  {line}" for line in head]
    if (len(plan.stages) > 1 or plan.microbatches > 1) and programs_by_stage(plan):
        lines.append("  (pipeline stages run several programs: compiled memory is the largest")
        lines.append("   one, compiled FLOPs the sum of the stage's programs for one microbatch;")
        lines.append("   measured memory is the most a device held while a program ran: the")
        lines.append("   program's own figure plus the arrays the driver kept beside it;")
        lines.append("   between steps, what the device held after the last timed step)")
    lines += ["", _ROW.format("", "predicted", "compiled", "measured", "ratio")]
    lines += [f"  {row[0]}" if len(row) == 1 else _ROW.format(*row) for row in rows]
    if len(rows[-1]) == 1:  # the collectives' heading, with no kind under it
        lines.append("  (none predicted or compiled)")
    return "\n".join(line.rstrip() for line in lines)


def stage_label(plan: Plan, index: int, /) -> str:
    """A stage as the report labels its rows: index, device type and device count.

    Example:
        >>> from shardplan.plan.plan import _example
        >>> stage_label(_example(), 0)
        'stage 0 (cpu x2)'
    """
    st = plan.stages[index]
    return f"stage {index} ({st.device_type} x{st.mesh.num_devices})"


VIEWS["text_report"] = plan_report  # Plan.report renders through it (plan/ does not import viz/)
