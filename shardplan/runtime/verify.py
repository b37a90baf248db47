"""Checks a plan against what XLA compiles for it on the devices it is bound to."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardplan.plan import Plan
from shardplan.xla.report import MemoryReport

__all__ = ["compiled_memory"]


def compiled_memory(train_step: Callable[..., Any], plan: Plan, state: Any,
                    batch: Any) -> tuple[MemoryReport | None, ...]:
    """XLA's memory figures for each program of ``plan`` (one per stage), per device (None
    where the backend reports none).

    Compiles on the local jax devices the plan names; ``state`` and ``batch`` may be
    ``ShapeDtypeStruct`` stand-ins (nothing runs).
    """
    from shardplan.runtime.spmd import apply_plan

    out = []
    for compiled in apply_plan(train_step, plan).compiled(state, batch):
        stats = compiled.memory_analysis()
        out.append(MemoryReport.from_stats(stats) if stats is not None else None)
    return tuple(out)
