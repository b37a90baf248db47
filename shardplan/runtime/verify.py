"""Checks a plan against what XLA compiles for it, and measures how long its steps take.

Before a planned step first runs, its programs are compiled and XLA's own figures read
(:func:`compiled_figures`: per program, ``memory_analysis()``, FLOPs and the collectives in the
optimized HLO); a program whose memory exceeds what its stage was planned to hold (the budget
the plan was made for, at most the device's capacity) is refused (:func:`check_fits`) before
anything runs, and one more than 10 % over the prediction is warned about. The figures go into the plan (``plan.compiled``),
next to the prediction, and :meth:`~shardplan.plan.Plan.report` shows both; a
:class:`StepTimer` then times the first steps and records them (``plan.measured``).
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from shardplan._format import format_bytes
from shardplan.cluster.catalog import load_device
from shardplan.errors import ConfigError, InfeasibleError, ShardplanWarning, format_error
from shardplan.plan import Plan
from shardplan.plan.match import check_plan_matches
from shardplan.trace.args import arg_types
from shardplan.xla.report import MemoryReport, read_compiled

__all__ = ["FIT_WARNING_RATIO", "MEASURE_STEPS", "StepTimer", "check_arguments", "check_fits",
           "compiled_figures", "compiled_memory", "compiled_peak", "device_bytes",
           "device_capacity", "memory_allowed"]

MEASURE_STEPS = 10
"""Steps timed after the first (which compiles) before ``plan.measured`` is recorded."""


def compiled_memory(train_step: Callable[..., Any], plan: Plan, state: Any,
                    batch: Any) -> tuple[MemoryReport | None, ...]:
    """XLA's memory figures for the program of the one-mesh ``plan``, per device (None
    where the backend reports none).

    Compiles on the local jax devices the plan names; ``state`` and ``batch`` may be
    ``ShapeDtypeStruct`` stand-ins (nothing runs).

    Raises:
      PipelineError: ``plan`` has several stages (a pipeline's programs are compiled, and
        their memory recorded, as its first step runs).
    """
    from shardplan.runtime.spmd import PlannedStep

    out = []
    for compiled in PlannedStep(train_step, plan, verify=False).compiled(state, batch):
        stats = compiled.memory_analysis()
        out.append(MemoryReport.from_stats(stats) if stats is not None else None)
    return tuple(out)


def compiled_peak(train_step: Callable[..., Any], plan: Plan, state: Any,
                  batch: Any) -> int | None:
    """The largest per-device allocation XLA compiles ``plan``'s programs to (None where the
    backend reports none): the measurement ``make_plan`` checks its memory model with
    (:data:`shardplan.planner.single.CompiledPeak`)."""
    reports = [r for r in compiled_memory(train_step, plan, state, batch) if r is not None]
    return max((r.peak_bytes for r in reports), default=None)


def check_arguments(plan: Plan, state: Any, batch: Any) -> None:
    """Raises :class:`~shardplan.errors.PlanMismatchError` naming the leaves whose shape or
    dtype differ from what the plan was made for (a plan of another model or batch size)."""
    check_plan_matches(plan, state_types=arg_types(state), batch_types=arg_types(batch))


def compiled_figures(programs: Sequence[tuple[int, str, jax.stages.Compiled]]) -> dict[str, Any]:
    """XLA's figures per compiled program, as :attr:`Plan.compiled` keeps them.

    Args:
      programs: ``(stage index, program name, compiled)`` for every program a step runs.

    Returns:
      ``{"backend": ..., "programs": [{"stage", "name", "memory_bytes", "argument_bytes",
      "output_bytes", "temp_bytes", "alias_bytes", "flops", "collectives"}]}``, bytes and FLOPs
      per device; ``memory_bytes`` is ``argument + output + temp − alias`` (None where the
      backend reports no memory).
    """
    out = []
    for stage, name, compiled in programs:
        report = read_compiled(compiled)
        memory = report.memory
        out.append({
            "stage": stage, "name": name,
            "memory_bytes": memory.peak_bytes if memory else None,
            "argument_bytes": memory.argument_bytes if memory else None,
            "output_bytes": memory.output_bytes if memory else None,
            "temp_bytes": memory.temp_bytes if memory else None,
            "alias_bytes": memory.alias_bytes if memory else None,
            "flops": report.flops_loop_corrected,
            "collectives": report.collective_summary(),
        })
    return {"backend": jax.default_backend(), "programs": out}


def device_capacity(plan: Plan, stage: int) -> int | None:
    """Memory of one device of ``plan.stages[stage]``: from the plan's cluster outline, else the
    device catalog; None where neither knows the device type."""
    name = plan.stages[stage].device_type
    types: Any = plan.cluster_info.get("device_types", {})
    if name in types:
        return int(types[name]["memory_bytes"])
    try:
        return load_device(name).memory_bytes
    except ConfigError:
        return None


def memory_allowed(plan: Plan, stage: int) -> tuple[int | None, str]:
    """The bytes one device of ``plan.stages[stage]`` may hold, and what they are: the memory
    the plan was made for (``plan.solver["memory_budget_bytes"]``: the budget, or the
    capacity less the headroom) where the plan records it, else the device's capacity
    (:func:`device_capacity`); None where neither is known."""
    name = plan.stages[stage].device_type
    budgets: Any = plan.solver.get("memory_budget_bytes", {})
    capacity = device_capacity(plan, stage)
    if name in budgets:
        budget = int(budgets[name])
        if capacity is None or budget <= capacity:
            return budget, "the memory the plan was made for"
    return capacity, f"one {name}'s memory"


FIT_WARNING_RATIO = 1.10
"""A compiled program above this multiple of its stage's predicted peak is warned about."""


def check_fits(plan: Plan, figures: dict[str, Any]) -> None:
    """Raises :class:`~shardplan.errors.InfeasibleError` when a compiled program needs more
    memory per device than its stage was planned to hold (:func:`memory_allowed`: the budget
    the plan was made for, at most the device's capacity), and warns
    (:class:`~shardplan.errors.ShardplanWarning`) when it needs more than
    :data:`FIT_WARNING_RATIO` times the stage's predicted peak (plans made by the planner:
    those recording ``plan.solver["memory_budget_bytes"]``).

    The message names the stage, the program, XLA's figure against the allowed bytes and the
    prediction, and a memory budget under which the planner would make a plan that fits (the
    allowed bytes less what the prediction missed).
    """
    for program in figures["programs"]:
        stage, need = program["stage"], program["memory_bytes"]
        if need is None:
            continue
        st = plan.stages[stage]
        predicted = max((plan.predicted.memory_bytes.get(d, 0) for d in st.mesh.device_ids),
                        default=0)
        where = f"plan.stages[{stage}] ({st.device_type}, mesh {dict(st.mesh.shape)})"
        allowed, what = memory_allowed(plan, stage)
        if allowed is not None and need > allowed:
            missed = max(need - predicted, 0)
            budget = max(allowed - missed, 0)
            raise InfeasibleError(format_error(
                f"The compiled plan does not fit: program {program['name']!r} of stage {stage} "
                f"needs {format_bytes(need)} per device, more than {what} "
                f"({format_bytes(allowed)}; the plan predicted {format_bytes(predicted)}).",
                where=where,
                value={"compiled_bytes": need, "allowed_bytes": allowed,
                       "predicted_bytes": predicted},
                remedy=f"plan again with sp.PlanConfig(memory_budget_bytes={budget}): the "
                       f"allowed bytes less the {missed} bytes the prediction missed here, so "
                       "that a plan predicted within it fits once compiled; or use more "
                       "devices"))
        # Only a plan the planner made (it records the budget) holds a prediction to warn
        # against; a plan written by hand may leave its figures as placeholders.
        made = "memory_budget_bytes" in plan.solver
        if made and predicted and need > FIT_WARNING_RATIO * predicted:
            warnings.warn(format_error(
                f"Program {program['name']!r} of stage {stage} compiled to "
                f"{format_bytes(need)} per device, {need / predicted:.2f}x the stage's "
                f"predicted peak of {format_bytes(predicted)}.",
                where=where, value={"compiled_bytes": need, "predicted_bytes": predicted},
                remedy="plan with a smaller sp.PlanConfig(memory_budget_bytes=...) to leave "
                       "the difference free, and report the model this happened with"),
                ShardplanWarning, stacklevel=2)


def device_bytes(device_ids: Iterable[int], /) -> dict[str, Any]:
    """What the devices hold now, for :attr:`Plan.measured`: per device id, its bytes in use
    (``live_bytes``) as the backend reports them (``device.memory_stats()``: GPU, with its
    peak since start as ``peak_bytes``), else the shards of every live ``jax.Array`` on it
    (CPU: ``jax.live_arrays``, which also counts the process's other arrays there); and which
    of the two it is (``live_source``)."""
    devices = jax.devices()
    wanted = [devices[i] for i in device_ids]
    stats = [d.memory_stats() or {} for d in wanted]
    if wanted and all("bytes_in_use" in st for st in stats):
        pairs = list(zip(wanted, stats, strict=True))
        out: dict[str, Any] = {
            "live_bytes": {str(d.id): int(st["bytes_in_use"]) for d, st in pairs},
            "live_source": "memory_stats"}
        if all("peak_bytes_in_use" in st for st in stats):
            out["peak_bytes"] = {str(d.id): int(st["peak_bytes_in_use"]) for d, st in pairs}
        return out
    live = {d.id: 0 for d in wanted}
    seen: set[tuple[int, int]] = set()  # arrays sharing a buffer (a view, rows.assembled)
    for x in jax.live_arrays():
        if x.is_deleted():
            continue
        for shard in x.addressable_shards:
            if shard.device.id in live:
                key = (shard.device.id, shard.data.unsafe_buffer_pointer())
                if key not in seen:
                    seen.add(key)
                    live[shard.device.id] += int(shard.data.nbytes)
    return {"live_bytes": {str(d): n for d, n in live.items()}, "live_source": "live_arrays"}


class StepTimer:
    """Times the steps after the first (which compiles) and, after ``steps`` of them, gives the
    figures :attr:`Plan.measured` keeps (median step time; per stage, its median busy time
    where the runtime reports one)."""

    def __init__(self, steps: int = MEASURE_STEPS) -> None:
        if not isinstance(steps, int) or steps < 0:
            raise ConfigError(format_error(
                "measure_steps must be an integer >= 0.", where="apply_plan(measure_steps=)",
                value=steps, remedy="pass e.g. 10, or 0 to measure nothing"))
        self.steps = steps
        self.calls = 0
        self.step_times_s: list[float] = []
        self.stage_times_s: dict[int, list[float]] = {}

    @property
    def timing(self) -> bool:
        """Whether the coming call is one to time (not the first, and not enough yet)."""
        return self.calls >= 1 and len(self.step_times_s) < self.steps

    def run(self, call: Callable[[], Any]) -> tuple[Any, bool]:
        """Runs ``call()``, timed to completion when this call is one to time; returns its
        result and whether the measurement just completed."""
        timing = self.timing
        self.calls += 1
        if not timing:
            return call(), False
        start = time.perf_counter()
        out = jax.block_until_ready(call())
        self.step_times_s.append(time.perf_counter() - start)
        return out, len(self.step_times_s) == self.steps

    def add_stage_time(self, stage: int, seconds: float) -> None:
        self.stage_times_s.setdefault(stage, []).append(seconds)

    def measured(self, stage_steps: int = 0) -> dict[str, Any]:
        """The figures, medians over the timed steps."""
        out: dict[str, Any] = {"steps": len(self.step_times_s),
                               "step_time_s": statistics.median(self.step_times_s)}
        if self.stage_times_s:
            out["stage_time_s"] = {str(s): sum(t) / max(stage_steps, 1)
                                   for s, t in sorted(self.stage_times_s.items())}
        return out
