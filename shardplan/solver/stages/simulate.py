"""An event simulator of a pipeline plan, independent of the closed form.

:func:`simulate` plays a :class:`~shardplan.solver.stages.pipeline.PipelinePlan` out microbatch by
microbatch: every replica's every stage runs its forward and backward tasks (per model chunk
under interleaving) in the order its schedule dictates, every activation and gradient crossing
two stages is a task of its own on the link between them, and the step ends with the
cross-replica gradient all-reduce and the optimizer update. It reads the plan's costs from the
:class:`~shardplan.solver.stages.pipeline.LayerOption` data itself and never calls
:func:`~shardplan.solver.stages.pipeline.evaluate_pipeline`, so the tests can hold the planner's
closed form to it.

The model
---------
* **Compute tasks.** Under interleaving with ``v`` chunks stage ``i``'s layers are cut into
  ``v`` equal parts; local chunk ``c`` is model chunk ``g = c k + i`` (``k`` stages). Without
  interleaving ``v = 1``, the chunk is the stage. Chunk ``g``'s forward of microbatch ``j``
  takes ``sum forward_s``, its backward ``sum backward_s + recompute_s[remat]`` over its layers,
  each ``fixed + per_sample * mb``.
* **Transfers.** Between model chunks ``g`` and ``g + 1`` on different stages: the forward
  activation (after ``F(g, j)``) and the gradient (after ``B(g + 1, j)``), each
  ``link.time_s(boundary_bytes(last layer of g) * mb)`` on
  :func:`~shardplan.solver.stages.pipeline.stage_link`. A link carries one transfer at a time per
  direction (one channel per ordered pair of stages, FIFO in the order the sender produced
  them); transfers overlap compute.
* **Dependencies.** ``F(g, j)`` needs ``F(g - 1, j)`` delivered; ``B(g, j)`` needs ``F(g, j)``
  and ``B(g + 1, j)`` delivered. A stage runs one compute task at a time, in its schedule's
  order (:func:`device_order`): GPipe all forwards then all backwards (both in microbatch
  order); 1F1B (PipeDream-Flush, Narayanan et al. 2021, Megatron
  ``forward_backward_pipelining_without_interleaving``) ``min(m, k - i)`` forwards, then one
  backward one forward, then the remaining backwards; interleaved 1F1B (Megatron
  ``forward_backward_pipelining_with_interleaving``, ``microbatch_group_size_per_vp_stage =
  k``) ``W = min(m v, 2 (k - i - 1) + (v - 1) k)`` chunk-forwards, then one forward one
  backward, then the remaining backwards, forward chunk ``(s mod k v) // k`` and backward chunk
  ``v - 1 - (s mod k v) // k`` for the ``s``-th forward / backward, microbatch
  ``(s // k v) k + s mod k``. (Megatron before core 0.7 ran every forward first when
  ``m == k``; the simulator follows the current code, which only caps ``W`` at ``m v``.)
* **Synchronisation.** Not overlapped with the pipeline: it starts when every replica has
  finished its backward passes. Each stage holds its layers' gradients on its own devices
  (``gradient_bytes / d`` of each layer per device on a stage of ``d``) and all-reduces them in
  one bucket with the stages of the other replicas that hold the same layers: a ring
  all-reduce (Patarasuk & Yuan 2009) of ``2 (R - 1)`` steps, each sending ``1 / R`` of the
  device's bucket, ``latency + bucket / (R bandwidth)`` per step on
  :func:`~shardplan.solver.stages.pipeline.sync_link`. Stages that share a layer, directly or through
  others, form one all-reduce group; a ring moves at its slowest member's pace, so a group
  finishes with its longest member; all groups run at once. A stage then runs its optimizer
  update (the sum of its layers' ``update_s``) as soon as its own group has finished.
* **Memory.** A forward stores its chunk's activations (``mb * activation_bytes[remat]``
  summed over the chunk's layers) when it starts; the matching backward frees them when it
  ends. The peak per device is the state bytes and one backward program's working bytes
  (:func:`~shardplan.solver.stages.pipeline.stage_work`, as the closed form counts them) plus the
  largest sum held at once.

Where it differs from the closed form
-------------------------------------
Per replica, with ``t_i = f_i + b_i`` (backward including recomputation), ``c_h`` a hop's
two transfers, ``f'`` / ``b'`` the stage forwards / backwards with every hop's one-way
``c_h / 2`` appended, and ``w_i = min(m, k - i)``, the simulator finds
(``tests/solver/test_simulate.py`` checks each statement):

* **1F1B**: the closed form's ``sum t + sum c + (m - 1) P``
  (:func:`~shardplan.solver.stages.pipeline.period_1f1b`: the largest of ``max t``, ``max c / 2``
  and the window averages) is exact on balanced stages without transfers and never below
  the simulation. It is above it (a) where a bottleneck stage hides the round trip
  downstream of it under its ``k - i`` warm-up forwards: stage ``i`` alone needs
  ``sum_{l<i} (t_l + c_l) + max(m t_i, f_i + R_i + m b_i + (m - w_i) f_i)`` with ``R_i =
  sum_{l>i} t_l + sum_{h>=i} c_h``; (b) while the first microbatches flow faster than the
  steady-state period that a window sets (a fraction of one period). The median random plan
  is within 1 %; the plans ``benchmarks/plan_quality.py`` returns are within 0.5 %.
* **GPipe** is exactly ``sum f' + sum b' + (m - 1) (max f' + max b')``: every forward drains
  before the first backward, so the forward and the backward bottleneck are paid separately,
  while transfers overlap fully. The closed form is 1F1B's (the stage planner searches 1F1B
  for both; a GPipe plan comes back only when 1F1B is not allowed).
* **Interleaved** on balanced stages, each transfer no longer than a chunk's forward and its
  backward, is ``sum t / v + sum c + (m v - 1) / v * max t``, exactly the closed form.
  Longer transfers stretch the steady state to between ``t / v`` and ``max(f, b) / v +
  c / 2`` per chunk (the wrap-around hop from stage ``k - 1`` to stage 0 has no warm-up
  slack), where the closed form charges ``max(t, v c / 2)`` per microbatch. On stages that
  differ (groups, sub-meshes, remat or layer kinds per chunk) the warm-up of ``2 (k - i - 1)
  + (v - 1) k`` chunk forwards no longer covers the bottleneck chunk's wait, and the
  simulation can exceed the closed form by up to about 20 % (up to 40 % with long
  transfers) on random plans; :func:`~shardplan.planner.multi.make_plan` reports both.
* **Memory.** GPipe and 1F1B hold exactly :func:`~shardplan.solver.stages.pipeline.in_flight`
  microbatches. Interleaved holds ``in_flight * v`` chunks at the peak, but the warm-up holds
  more of the early chunks, so when chunks differ in activation bytes the peak is
  ``state + mb * max_x (sum_{s<=W+x} a[(s mod k v) // k] - sum_{s<x} a[v - 1 - (s mod k v)
  // k])`` over the steady-state steps ``0 <= x < m v - W`` (``a`` per local chunk; all ``m v``
  forwards when ``W = m v``), not ``in_flight * sum a``.

* **Synchronisation and update.** The closed form charges ``max sync + max update``; the
  simulator ends the step at ``max`` over stages of (its group's all-reduce + its update),
  which is no later, and equal whenever the stage with the longest update sits in the
  all-reduce group that finishes last (always with one replica, and when the replicas cut the
  layers alike into stages of equal gradient bytes per device and updates). The gap is at
  most the smaller of the two terms; the update is the optimizer's pass over the state, tens of
  milliseconds against a step of seconds.

Example:
    >>> from shardplan.solver.stages.pipeline import (DeviceGroup, LayerKind, LayerOption, Link,
    ...     PipelinePlan, PipelineProblem, Replica, StagePlacement)
    >>> link = Link(1e9, 0.0)
    >>> o = LayerOption(1, (0.0, 1.0), (0.0, 2.0), {"none": (0.0, 0.0)}, {"none": 1.0}, 0.0,
    ...                 0.0)
    >>> kind = LayerKind("block", {0: (o,)}, 0.0, 0.0)
    >>> problem = PipelineProblem((kind,), (0, 0), (DeviceGroup("d", 2, 2, 1e9, 1.0, link,
    ...     link),), link, batch=4, microbatch_sizes=(1,), remats=("none",))
    >>> plan = PipelinePlan((Replica((StagePlacement(0, 1, (0,)), StagePlacement(0, 1, (1,))),
    ...                              4),), 1, "gpipe")
    >>> sim = simulate(problem, plan)
    >>> sim.step_time_s, sim.bubble_fraction  # (m + k - 1) t = 5 * 3; bubble (k-1)/(m+k-1)
    (15.0, 0.2)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from shardplan.errors import PipelineError, format_error
from shardplan.solver.stages.pipeline import (
    LayerOption,
    PipelinePlan,
    PipelineProblem,
    Schedule,
    StagePlacement,
    check_pipeline,
    looped_work,
    stage_link,
    stage_work,
    sync_link,
)

__all__ = ["Event", "EventKind", "Simulation", "device_order", "simulate"]

EventKind = Literal["forward", "backward", "send_forward", "send_backward"]
Step = tuple[Literal["forward", "backward"], int, int]
"""One compute task of a stage: ``(kind, microbatch, local chunk)``."""


@dataclass(frozen=True)
class Event:
    """One task of the timeline.

    Attributes:
      replica: the replica.
      stage: the stage that computes (``forward`` / ``backward``) or sends (``send_*``).
      kind: ``forward``, ``backward``, ``send_forward`` (an activation to the next model
        chunk) or ``send_backward`` (a gradient to the previous one).
      microbatch: the microbatch.
      chunk: the sending / computing stage's local chunk (``0`` without interleaving);
        model chunk ``chunk * k + stage``.
      start_s: start, seconds from the step's start.
      end_s: end.
      to_stage: the receiving stage of a transfer; ``None`` for compute.
    """

    replica: int
    stage: int
    kind: EventKind
    microbatch: int
    chunk: int
    start_s: float
    end_s: float
    to_stage: int | None = None


@dataclass(frozen=True)
class Simulation:
    """What the simulated step took.

    Attributes:
      step_time_s: ``max(replica_time_s)`` plus the last stage's all-reduce group and
        update (at most ``sync_s + update_s``; the module docstring).
      replica_time_s: each replica's pipeline time (its last compute task's end).
      sync_s: the cross-replica gradient all-reduce (the all-reduce group that ends last).
      update_s: the optimizer update (slowest stage).
      bubble_fraction: idle device-seconds over all devices' seconds during the pipeline phase
        ``[0, max(replica_time_s)]`` (a replica that finishes early idles until the sync).
      replica_bubble_fraction: per replica, idle device-seconds over its devices' seconds in
        ``[0, replica_time_s[r]]``. Both weigh a stage by its devices.
      peak_memory_bytes: per replica, per stage, bytes per device at the peak.
      peak_chunks: per replica, per stage, the most chunk activations held at once (microbatches
        without interleaving).
      peak_in_flight: ``peak_chunks / v``: comparable with
        :func:`~shardplan.solver.stages.pipeline.in_flight`.
      events: every task, in start order, when asked for (``timeline=True``); else empty.
    """

    step_time_s: float
    replica_time_s: tuple[float, ...]
    sync_s: float
    update_s: float
    bubble_fraction: float
    replica_bubble_fraction: tuple[float, ...]
    peak_memory_bytes: tuple[tuple[float, ...], ...]
    peak_chunks: tuple[tuple[int, ...], ...]
    peak_in_flight: tuple[tuple[float, ...], ...]
    events: tuple[Event, ...] = ()


def device_order(schedule: Schedule, stage: int, stages: int, microbatches: int,
                 chunks: int = 1) -> list[Step]:
    """The compute tasks of stage ``stage`` (0-based, of ``stages``) in the order it runs them.

    Args:
      schedule: ``gpipe``, ``1f1b`` or ``interleaved``.
      stage: the stage ``i``.
      stages: ``k``.
      microbatches: ``m`` (a multiple of ``k`` when interleaved).
      chunks: ``v`` (interleaved only).

    Returns:
      ``(kind, microbatch, local chunk)`` per task.

    Example:
        >>> device_order("1f1b", 1, 3, 4)  # doctest: +NORMALIZE_WHITESPACE
        [('forward', 0, 0), ('forward', 1, 0), ('backward', 0, 0), ('forward', 2, 0),
         ('backward', 1, 0), ('forward', 3, 0), ('backward', 2, 0), ('backward', 3, 0)]
    """
    k, m = stages, microbatches
    if schedule == "gpipe":
        return ([("forward", j, 0) for j in range(m)]
                + [("backward", j, 0) for j in range(m)])
    if schedule == "1f1b":
        warm = min(m, k - stage)
        out: list[Step] = [("forward", j, 0) for j in range(warm)]
        for j in range(m - warm):
            out += [("backward", j, 0), ("forward", warm + j, 0)]
        return out + [("backward", j, 0) for j in range(m - warm, m)]
    v = chunks
    total = m * v

    def forward(s: int) -> Step:
        return ("forward", (s // (k * v)) * k + s % k, (s % (k * v)) // k)

    def backward(s: int) -> Step:
        return ("backward", (s // (k * v)) * k + s % k, v - 1 - (s % (k * v)) // k)

    warm = min(total, 2 * (k - stage - 1) + (v - 1) * k)
    out = [forward(s) for s in range(warm)]
    for s in range(total - warm):
        out += [forward(warm + s), backward(s)]
    return out + [backward(s) for s in range(total - warm, total)]


_Key = tuple[int, str, int, int]
"""A task: ``(replica, "F" | "B" | "SF" | "SB", model chunk or hop g, microbatch)``."""


@dataclass(frozen=True)
class _Task:
    duration_s: float
    deps: tuple[_Key, ...]
    replica: int
    stage: int
    kind: EventKind
    microbatch: int
    chunk: int
    to_stage: int | None = None


@dataclass(frozen=True)
class _Stage:
    """A stage's per-chunk costs: seconds per microbatch, activation bytes per microbatch."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    last_layer: tuple[int, ...]
    devices: int


def _seconds(coefficients: tuple[float, float], mb: int) -> float:
    return coefficients[0] + coefficients[1] * mb


def _state_and_work(problem: PipelineProblem, stage: StagePlacement, mb: int) -> float:
    """A stage's state bytes plus ``mb`` samples of its backward's working bytes."""
    opts = _options(problem, stage)
    work = stage_work(sum(o.recompute_bytes.get(stage.remat, 0.0) for o in opts),
                      max((o.work_bytes.get(stage.remat, 0.0) for o in opts),
                          default=0.0),
                      looped_work(problem.stacks, stage.layers,
                                  [o.work_bytes.get(stage.remat, 0.0) for o in opts]))
    return sum(o.state_bytes for o in opts) + mb * work


def _options(problem: PipelineProblem, stage: StagePlacement) -> list[LayerOption]:
    out = []
    for layer in stage.layers:
        option = problem.kinds[problem.layers[layer]].option(stage.group, stage.devices)
        assert option is not None, "check_pipeline guarantees an option"
        out.append(option)
    return out


def _stage(problem: PipelineProblem, stage: StagePlacement, mb: int, v: int) -> _Stage:
    opts, size = _options(problem, stage), len(stage.layers) // v
    parts = [opts[c * size:(c + 1) * size] for c in range(v)]
    return _Stage(
        forward_s=tuple(sum(_seconds(o.forward_s, mb) for o in p) for p in parts),
        backward_s=tuple(sum(_seconds(o.backward_s, mb)
                             + _seconds(o.recompute_s[stage.remat], mb) for o in p)
                         for p in parts),
        activation_bytes=tuple(mb * sum(o.activation_bytes[stage.remat] for o in p)
                               for p in parts),
        last_layer=tuple(stage.layers[(c + 1) * size - 1] for c in range(v)),
        devices=stage.devices)


def _replica_tasks(problem: PipelineProblem, plan: PipelinePlan, r: int, stages: list[_Stage],
                   v: int, tasks: dict[_Key, _Task], resources: list[list[_Key]]) -> None:
    """Adds replica ``r``'s tasks, its stages' orders and its link channels' orders."""
    replica = plan.replicas[r]
    mb, k, m = plan.microbatch_size, len(replica.stages), replica.microbatches
    n_chunks = k * v
    hop_s: dict[int, float] = {}  # hop g: model chunk g -> g + 1 across two stages
    for g in range(n_chunks - 1):
        a, b = g % k, (g + 1) % k
        if a != b:
            boundary = problem.kinds[problem.layers[stages[a].last_layer[g // k]]].boundary_bytes
            link = stage_link(problem, replica.stages[a], replica.stages[b])
            hop_s[g] = link.time_s(boundary * mb)
    for g in range(n_chunks):
        i, c = g % k, g // k
        for j in range(m):
            f_deps: tuple[_Key, ...] = ()
            if g > 0:
                f_deps = ((r, "SF" if g - 1 in hop_s else "F", g - 1, j),)
            tasks[r, "F", g, j] = _Task(stages[i].forward_s[c], f_deps, r, i, "forward", j, c)
            b_deps: tuple[_Key, ...] = ((r, "F", g, j),)
            if g < n_chunks - 1:
                b_deps += ((r, "SB", g, j) if g in hop_s else (r, "B", g + 1, j),)
            tasks[r, "B", g, j] = _Task(stages[i].backward_s[c], b_deps, r, i, "backward", j, c)
            if g in hop_s:
                nxt = (g + 1) % k
                tasks[r, "SF", g, j] = _Task(hop_s[g], ((r, "F", g, j),), r, i,
                                             "send_forward", j, c, nxt)
                tasks[r, "SB", g, j] = _Task(hop_s[g], ((r, "B", g + 1, j),), r, nxt,
                                             "send_backward", j, (g + 1) // k, i)
    channels: dict[tuple[int, int], list[_Key]] = {}
    for i in range(k):
        steps = device_order(plan.schedule, i, k, m, v)
        resources.append([(r, "F" if kind == "forward" else "B", c * k + i, j)
                          for kind, j, c in steps])
        for kind, j, c in steps:  # a channel sends FIFO in the order its sender computes
            g = c * k + i
            if kind == "forward" and g in hop_s:
                channels.setdefault((i, (g + 1) % k), []).append((r, "SF", g, j))
            if kind == "backward" and g - 1 in hop_s:
                channels.setdefault((i, (g - 1) % k), []).append((r, "SB", g - 1, j))
    resources.extend(channels[pair] for pair in sorted(channels))


def _play(tasks: dict[_Key, _Task], resources: list[list[_Key]]) -> dict[_Key, float]:
    """Each task's start: the latest end among its dependencies and its resource predecessor
    (a longest path over the task DAG, in topological order).

    Raises:
      PipelineError: the schedule's orders wait on each other in a cycle.
    """
    preds: dict[_Key, list[_Key]] = {key: list(t.deps) for key, t in tasks.items()}
    for seq in resources:
        for a, b in itertools.pairwise(seq):
            preds[b].append(a)
    succs: dict[_Key, list[_Key]] = {key: [] for key in tasks}
    waiting = {key: len(p) for key, p in preds.items()}
    for key, p in preds.items():
        for q in p:
            succs[q].append(key)
    ready = [key for key, n in waiting.items() if n == 0]
    start: dict[_Key, float] = {}
    end: dict[_Key, float] = {}
    while ready:
        key = ready.pop()
        start[key] = max((end[q] for q in preds[key]), default=0.0)
        end[key] = start[key] + tasks[key].duration_s
        for s in succs[key]:
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
    if len(start) < len(tasks):
        stuck = sorted(key for key in tasks if key not in start)[:4]
        raise PipelineError(format_error(
            "the pipeline schedule deadlocks: tasks wait on each other in a cycle",
            where=f"tasks (replica, kind, chunk, microbatch) {stuck}",
            remedy="check device_order for this schedule and stage count"))
    return start


def _peak(order: Sequence[Step], stage: _Stage) -> tuple[float, int]:
    """Peak activation bytes and chunk count held: a forward stores at its start, the matching
    backward frees at its end, one task at a time on the device."""
    held = peak = 0.0
    count = peak_count = 0
    for kind, _, c in order:
        if kind == "forward":
            held += stage.activation_bytes[c]
            count += 1
            peak, peak_count = max(peak, held), max(peak_count, count)
        else:
            held -= stage.activation_bytes[c]
            count -= 1
    return peak, peak_count


def _sync_update_s(problem: PipelineProblem, plan: PipelinePlan) -> tuple[float, float, float]:
    """``(sync, update, sync and update)`` after the pipeline phase (the module docstring): the
    longest all-reduce group, the longest stage update, and the last stage to finish its
    update after its group's all-reduce."""
    n_replicas = len(plan.replicas)
    stages = [(r, i) for r, rep in enumerate(plan.replicas) for i in range(len(rep.stages))]
    update = {(r, i): sum(o.update_s for o in _options(problem, plan.replicas[r].stages[i]))
              for r, i in stages}
    if n_replicas == 1:
        return 0.0, max(update.values()), max(update.values())
    link = sync_link(problem, plan)
    ring = {}
    for r, i in stages:
        stage = plan.replicas[r].stages[i]
        bucket = sum(problem.kinds[problem.layers[x]].gradient_bytes
                     for x in stage.layers) / stage.devices
        ring[r, i] = 2 * (n_replicas - 1) * (link.latency_s + bucket / n_replicas
                                               / link.bandwidth_bytes_per_s)
    # All-reduce groups: stages joined by a layer they both hold (union-find).
    parent = {key: key for key in stages}

    def root(key: tuple[int, int]) -> tuple[int, int]:
        while parent[key] != key:
            key = parent[key]
        return key

    holder: dict[int, tuple[int, int]] = {}
    for r, i in stages:
        for x in plan.replicas[r].stages[i].layers:
            if x in holder:
                parent[root((r, i))] = root(holder[x])
            else:
                holder[x] = (r, i)
    group_end: dict[tuple[int, int], float] = {}
    for key in stages:
        group_end[root(key)] = max(group_end.get(root(key), 0.0), ring[key])
    done = max(group_end[root(key)] + update[key] for key in stages)
    return max(group_end.values()), max(update.values()), done


def simulate(problem: PipelineProblem, plan: PipelinePlan, /, *,
             timeline: bool = False) -> Simulation:
    """Plays ``plan`` out task by task (the module docstring) and measures it.

    Args:
      problem: the pipeline problem.
      plan: a structurally valid plan (memory may exceed the devices': it is reported).
      timeline: also return every task as an :class:`Event`.

    Returns:
      The :class:`Simulation`.

    Raises:
      PipelineError: the plan breaks a structural constraint of
        :func:`~shardplan.solver.stages.pipeline.check_pipeline`.
    """
    violations = check_pipeline(problem, plan)
    if violations:
        raise PipelineError(format_error(
            "cannot simulate a plan that breaks the pipeline constraints",
            where="; ".join(violations), remedy="simulate a plan check_pipeline accepts"))
    v = plan.chunks if plan.schedule == "interleaved" else 1
    mb = plan.microbatch_size
    tasks: dict[_Key, _Task] = {}
    resources: list[list[_Key]] = []
    built: dict[StagePlacement, _Stage] = {}
    stages = [[built[s] if s in built else built.setdefault(s, _stage(problem, s, mb, v))
               for s in rep.stages] for rep in plan.replicas]
    # Replicas interact only through the synchronisation after the pipeline phase, so equal
    # replicas (same stages, same microbatch count) have equal timelines: play each once.
    first: dict[object, int] = {}
    twin = [first.setdefault(rep, r) for r, rep in enumerate(plan.replicas)]
    for r in sorted(first.values()):
        _replica_tasks(problem, plan, r, stages[r], v, tasks, resources)
    start = _play(tasks, resources)
    if timeline:
        _copy_twins(tasks, start, twin)
    end = {key: start[key] + t.duration_s for key, t in tasks.items()}
    n = len(plan.replicas)
    busy, times = _busy_and_times(plan, tasks, end, twin)
    pipe = max(times)
    idle = [sum(s.devices * (times[r] - b) for s, b in zip(stages[r], busy[r], strict=True))
            for r in range(n)]
    devices = [sum(s.devices for s in stages[r]) for r in range(n)]
    overall_idle = sum(idle[r] + devices[r] * (pipe - times[r]) for r in range(n))
    peaks, counts = _peaks(problem, plan, stages, twin, v)
    sync, update, finish = _sync_update_s(problem, plan)
    events: tuple[Event, ...] = ()
    if timeline:
        events = tuple(sorted(
            (Event(t.replica, t.stage, t.kind, t.microbatch, t.chunk, start[key], end[key],
                   t.to_stage) for key, t in tasks.items()),
            key=lambda e: (e.start_s, e.replica, e.stage, e.kind, e.microbatch, e.chunk)))
    return Simulation(
        step_time_s=pipe + finish, replica_time_s=tuple(times), sync_s=sync,
        update_s=update,
        bubble_fraction=overall_idle / (sum(devices) * pipe) if pipe > 0 else 0.0,
        replica_bubble_fraction=tuple(idle[r] / (devices[r] * times[r]) if times[r] > 0
                                      else 0.0 for r in range(n)),
        peak_memory_bytes=tuple(peaks), peak_chunks=tuple(counts),
        peak_in_flight=tuple(tuple(c / v for c in row) for row in counts), events=events)


def _copy_twins(tasks: dict[_Key, _Task], start: dict[_Key, float], twin: Sequence[int]) -> None:
    """Gives each twin copy (``twin[r] != r``) its twin's tasks and start times as its own."""
    for r, q in enumerate(twin):
        if q != r:
            for key, t in list(tasks.items()):
                if key[0] == q:
                    tasks[(r, *key[1:])] = dataclasses.replace(t, replica=r)
                    start[(r, *key[1:])] = start[key]


def _busy_and_times(plan: PipelinePlan, tasks: dict[_Key, _Task], end: dict[_Key, float],
                    twin: Sequence[int]) -> tuple[list[list[float]], list[float]]:
    """Per replica and stage, the seconds computing; per replica, when its computing ends."""
    busy = [[0.0] * len(rep.stages) for rep in plan.replicas]
    times = [0.0] * len(plan.replicas)
    for key, t in tasks.items():
        if t.kind in ("forward", "backward"):
            busy[t.replica][t.stage] += t.duration_s
            times[t.replica] = max(times[t.replica], end[key])
    for r, q in enumerate(twin):
        busy[r], times[r] = busy[q], times[q]
    return busy, times


def _peaks(problem: PipelineProblem, plan: PipelinePlan, stages: list[list[_Stage]],
           twin: Sequence[int], v: int
           ) -> tuple[list[tuple[float, ...]], list[tuple[int, ...]]]:
    """Per replica and stage, the peak bytes a device holds and the most chunks in flight."""
    peaks: list[tuple[float, ...]] = []
    counts: list[tuple[int, ...]] = []
    for r, rep in enumerate(plan.replicas):
        if twin[r] != r:
            peaks.append(peaks[twin[r]])
            counts.append(counts[twin[r]])
            continue
        k = len(rep.stages)
        held = [_peak(device_order(plan.schedule, i, k, rep.microbatches, v), stages[r][i])
                for i in range(k)]
        # The state and one backward program's working bytes (as the closed form counts them).
        state = [_state_and_work(problem, s, plan.microbatch_size) for s in rep.stages]
        peaks.append(tuple(st + h for st, (h, _) in zip(state, held, strict=True)))
        counts.append(tuple(c for _, c in held))
    return peaks, counts
