"""The simulator's pipeline timeline that a multi-stage plan carries, read back as events.

The stage planner (:mod:`shardplan.planner.multi`) plays its chosen plan out in the event
simulator (:func:`shardplan.solver.stages.simulate.simulate`) and stores every task of the step's
pipeline phase in ``plan.solver["timeline"]``, a plain JSON record (``docs/plan-format.md``)::

    {"columns": ["replica", "stage", "kind", "microbatch", "chunk", "start_s", "end_s",
                 "to_stage"],
     "same_as": [0, 1, 1],
     "window": null,
     "rows": [[0, 0, "forward", 0, 0, 0.0, 0.125, null], ...]}

``stage`` and ``to_stage`` are indices of the plan's :class:`~shardplan.plan.plan.Stage` s.
``same_as[r]`` is the replica whose rows replica ``r`` repeats (``r`` itself when its rows are
listed): equal replicas have equal timelines, and a large plan lists each only once. A
``window`` ``w`` (``null``: every microbatch) keeps only each replica's microbatches ``j < w``
and ``j >= microbatches - w``: the pipeline's fill and drain, for plans whose every event
would make the file too large. :func:`timeline_events` checks the record against the plan and
returns every replica's events, twins expanded, so a consumer (the visualizer) needs neither
the raw record nor a mapping.

Example:
    >>> from shardplan.plan.plan import _example
    >>> timeline_events(_example()) is None  # a one-stage plan carries no timeline
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

from shardplan._schema import invalid
from shardplan.errors import unknown_key
from shardplan.plan._values import _check_float, _check_int, _mismatch, _sequence

if TYPE_CHECKING:
    from shardplan.plan.plan import Plan

__all__ = ["TIMELINE_COLUMNS", "TIMELINE_KINDS", "TimelineEvent", "timeline_events"]

TimelineKind = Literal["forward", "backward", "send_forward", "send_backward"]

TIMELINE_COLUMNS: tuple[str, ...] = ("replica", "stage", "kind", "microbatch", "chunk",
                                     "start_s", "end_s", "to_stage")
"""The columns of ``solver.timeline.rows``, in order (:class:`TimelineEvent`'s fields)."""

TIMELINE_KINDS: tuple[TimelineKind, ...] = ("forward", "backward", "send_forward",
                                            "send_backward")
"""Event kinds: two compute tasks and the two transfers between consecutive stages."""

_WHERE = "plan.solver.timeline"
_KEYS = ("columns", "rows", "same_as", "window")


@dataclass(frozen=True)
class TimelineEvent:
    """One task of the simulated pipeline phase.

    Attributes:
      replica: the replica (index into ``plan.replicas``).
      stage: the plan stage (``plan.stages[stage]``) that computes it or sends it.
      kind: ``forward``, ``backward``, ``send_forward`` (an activation to the next stage) or
        ``send_backward`` (a gradient to the previous stage).
      microbatch: the replica's microbatch, ``0 .. microbatches - 1``.
      chunk: the stage's local model chunk under ``interleaved`` (``0`` otherwise).
      start_s: start, seconds from the step's start.
      end_s: end, seconds from the step's start.
      to_stage: the receiving plan stage of a transfer; ``None`` for compute.
    """

    replica: int
    stage: int
    kind: TimelineKind
    microbatch: int
    chunk: int
    start_s: float
    end_s: float
    to_stage: int | None = None


def timeline_events(plan: Plan, /) -> list[TimelineEvent] | None:
    """The simulator's timeline of ``plan``'s pipeline phase, every replica's events.

    Args:
      plan: any plan.

    Returns:
      The events sorted by start (then replica, stage, kind, microbatch, chunk), twins of a
      listed replica expanded onto their own stages (only the microbatches of the record's
      ``window`` when it has one); ``None`` when the plan carries no timeline (one-stage
      plans, and multi-stage plans too large to simulate or to store).

    Raises:
      ConfigError: ``solver.timeline`` is malformed (a key, column, type or range is wrong).
      PlanMismatchError: it names a replica, stage, microbatch or chunk the plan lacks, or a
        transfer between stages that are not consecutive in their replica.
    """
    raw = plan.solver.get("timeline")
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise invalid("The timeline must be an object.", where=_WHERE, value=raw,
                      remedy="write {'columns': [...], 'same_as': [...], 'window': "
                             "null, 'rows': [...]}")
    for key in raw:
        if key not in _KEYS:
            raise unknown_key(key, _KEYS, _WHERE)
    missing = [key for key in _KEYS if key not in raw]
    if missing:
        raise invalid("The timeline lacks a key.", where=f"{_WHERE}.{missing[0]}",
                      value=sorted(raw), remedy=f"give all of {list(_KEYS)}")
    columns = tuple(_sequence(raw["columns"], where=f"{_WHERE}.columns"))
    if columns != TIMELINE_COLUMNS:
        raise invalid("The timeline's columns are not the ones this shardplan reads.",
                      where=f"{_WHERE}.columns", value=list(columns),
                      remedy=f"write {list(TIMELINE_COLUMNS)}; or make the plan again")
    stages = ([tuple(r.stages) for r in plan.replicas] if plan.replicas
              else [tuple(range(len(plan.stages)))])
    same_as = _check_same_as(raw["same_as"], plan, stages)
    window = (None if raw["window"] is None
              else _check_int(raw["window"], where=f"{_WHERE}.window", minimum=1))
    chunks = plan.chunks if plan.schedule == "interleaved" else 1
    listed = [_event(row, i, plan, stages, same_as, chunks, window)
              for i, row in enumerate(_sequence(raw["rows"], where=f"{_WHERE}.rows"))]
    events = list(listed)
    for r, q in enumerate(same_as):
        if q != r:  # a twin runs the same tasks at the same times on its own stages
            position = {s: i for i, s in enumerate(stages[q])}
            events += [TimelineEvent(
                r, stages[r][position[e.stage]], e.kind, e.microbatch, e.chunk, e.start_s,
                e.end_s, None if e.to_stage is None else stages[r][position[e.to_stage]])
                for e in listed if e.replica == q]
    events.sort(key=lambda e: (e.start_s, e.replica, e.stage, e.kind, e.microbatch, e.chunk))
    return events


def _check_same_as(value: object, plan: Plan, stages: list[tuple[int, ...]]) -> list[int]:
    where = f"{_WHERE}.same_as"
    same_as = [_check_int(q, where=f"{where}[{r}]")
               for r, q in enumerate(_sequence(value, where=where, example="[0, 1, 1]"))]
    if len(same_as) != len(stages):
        raise _mismatch("The timeline's same_as needs one entry per replica of the plan.",
                        where=where, value=same_as,
                        remedy=f"give {len(stages)} entries (r itself for a listed replica)")
    counts = plan.replica_microbatches
    for r, q in enumerate(same_as):
        if q > r or same_as[q] != q or len(stages[q]) != len(stages[r]) or counts[q] != counts[r]:
            raise _mismatch(
                "A replica's timeline must repeat an earlier listed replica of as many stages "
                "and microbatches.", where=f"{where}[{r}]", value=q,
                remedy=f"write {r} and list replica {r}'s rows")
    return same_as


def _event(row: object, i: int, plan: Plan, stages: list[tuple[int, ...]], same_as: list[int],
           chunks: int, window: int | None) -> TimelineEvent:
    """Row ``i`` as an event, checked against the plan."""
    where = f"{_WHERE}.rows[{i}]"
    cells = _sequence(row, where=where, example="[0, 0, 'forward', 0, 0, 0.0, 0.1, None]")
    if len(cells) != len(TIMELINE_COLUMNS):
        raise invalid(f"A timeline row has {len(TIMELINE_COLUMNS)} cells, one per column.",
                      where=where, value=cells, remedy=f"write {list(TIMELINE_COLUMNS)}")
    replica, stage, kind, microbatch, chunk, start, end, to_stage = cells
    r = _check_int(replica, where=f"{where}.replica")
    if r >= len(stages) or same_as[r] != r:
        raise _mismatch("A timeline row names a replica that is not listed.",
                        where=f"{where}.replica", value=r,
                        remedy=f"use a replica r < {len(stages)} with same_as[r] == r")
    s = _check_int(stage, where=f"{where}.stage")
    if s not in stages[r]:
        raise _mismatch("A timeline row names a stage outside its replica.",
                        where=f"{where}.stage", value=s,
                        remedy=f"use a stage of replica {r}: {list(stages[r])}")
    if kind not in TIMELINE_KINDS:
        raise invalid("Unknown timeline event kind.", where=f"{where}.kind", value=kind,
                      remedy=f"use one of {list(TIMELINE_KINDS)}")
    j, m = _check_int(microbatch, where=f"{where}.microbatch"), plan.replica_microbatches[r]
    if j >= m:
        raise _mismatch("A timeline row names a microbatch the replica does not run.",
                        where=f"{where}.microbatch", value=j, remedy=f"use 0 .. {m - 1}")
    if window is not None and window <= j < m - window:
        raise _mismatch("A timeline row names a microbatch outside the timeline's window.",
                        where=f"{where}.microbatch", value=j,
                        remedy=f"keep microbatches j < {window} and j >= {m - window}, or "
                               "write window null")
    c = _check_int(chunk, where=f"{where}.chunk")
    if c >= chunks:
        raise _mismatch("A timeline row names a chunk the stage does not have.",
                        where=f"{where}.chunk", value=c, remedy=f"use 0 .. {chunks - 1}")
    start_s = _check_float(start, where=f"{where}.start_s")
    end_s = _check_float(end, where=f"{where}.end_s")
    if end_s < start_s:
        raise invalid("A timeline event ends before it starts.", where=f"{where}.end_s",
                      value=(start_s, end_s), remedy="write end_s >= start_s")
    target = None
    if kind in ("forward", "backward"):
        if to_stage is not None:
            raise invalid("A compute event has no receiving stage.",
                          where=f"{where}.to_stage", value=to_stage, remedy="write null")
    else:
        target = _check_int(to_stage, where=f"{where}.to_stage")
        k, step = len(stages[r]), 1 if kind == "send_forward" else -1
        # (interleaved: the last stage's chunk sends to the first stage's next chunk)
        nxt = stages[r].index(s) + step
        if chunks > 1:
            nxt %= k
        if k < 2 or not 0 <= nxt < k or target != stages[r][nxt]:
            raise _mismatch(f"A {kind} must go to the {'next' if step > 0 else 'previous'} "
                            "stage of its replica.", where=f"{where}.to_stage", value=target,
                            remedy=f"stages of replica {r} in order: {list(stages[r])}")
    return TimelineEvent(r, s, cast(TimelineKind, kind), j, c, start_s, end_s, target)
