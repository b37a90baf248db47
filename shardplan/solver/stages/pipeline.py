"""The inter-op (pipeline) problem: which layers run as stages on which device type, on how
many devices each, in how many data-parallel replicas, with which microbatches, schedule and
remat. Plain data and the exact closed-form objective; imports nothing from jax.

This module is the contract between the layer cost tables (built from the traced step by the
intra-op planner), the stage planner (:mod:`shardplan.solver.stages.search`, which minimises
:func:`evaluate_pipeline`), the brute-force enumeration that checks it, and the event simulator
(:mod:`shardplan.solver.stages.simulate`), which plays the same plan out microbatch by microbatch.

The model
---------
A **layer** is one repeated block of the train step (its kind: the layer fingerprint). Running
layer kind ``k`` on a sub-mesh of ``d`` devices of group ``g`` costs what
``kinds[k].options[g]`` says for the option with ``devices == d`` (the intra-op solution on that
sub-mesh): forward and backward seconds per microbatch as ``fixed + per_sample * mb`` (``mb``
the microbatch size in samples), the extra backward seconds of each remat policy, the bytes of
saved activations per sample per device under each policy, the backward pass's working bytes
per sample (the forward values it recomputes under each policy, and the buffers it makes and
frees), the static bytes per device (parameters, two gradient copies, optimizer state), and
the optimizer update's seconds per step.

A **plan** (:class:`PipelinePlan`) is one or more **replicas** (data-parallel copies of the
model; they may differ in structure and device types). A replica is a sequence of **stages**;
stage ``i`` runs the contiguous layers ``[first, last)`` on ``devices`` devices of group
``group``, with one remat policy; the stages of a replica cover every layer in order. All
replicas use one microbatch size ``mb``; replica ``r`` runs ``microbatches[r]`` of them, and
``sum(microbatches) * mb == batch`` (uneven data parallelism: faster replicas take more
microbatches). One schedule for the plan: ``gpipe``, ``1f1b`` or ``interleaved`` with
``chunks = v >= 2``: a replica's layers are cut into ``k * v`` contiguous chunks of equal
length and chunk ``j`` runs on stage ``j mod k`` (Megatron's interleaved 1F1B), so stage ``i``
holds chunks ``i, i + k, ..., i + (v - 1) k``.

Feasibility (:func:`check_pipeline` lists every violation):

* each stage's group has an option of ``devices`` devices for every layer kind it runs;
* per group, the devices of all stages of all replicas add up to at most ``count``;
* stage memory (per device) fits ``memory_bytes``:
  ``state + mb * (in_flight * activation + work)`` where ``state`` and ``activation`` sum
  over the stage's layers (activation under the stage's remat), ``work`` is the most of the
  stage's summed ``recompute_bytes`` (under its remat) and its layers' largest
  ``work_bytes`` (:func:`stage_work`: one backward program's transient buffers, over the
  activations of the microbatches it holds), and ``in_flight`` is
  ``m`` (GPipe), ``min(m, k - i)`` (1F1B, stage ``i`` of ``k``, 0-based) or, interleaved,
  ``min(m v, 2 (k - i - 1) + (v - 1) k + 1) / v`` (Megatron's warm-up chunks plus one, in
  units of the whole stage's activations; :func:`in_flight`);
* ``sum(microbatches) * mb == batch``, every ``microbatches[r] >= 1``;
* interleaved: ``k * v`` divides the number of layers, each stage holds exactly its chunks,
  and ``m % k == 0``;
* each scanned stack (``stacks``: the layers ``[a, b)`` whose parameters are rows of shared
  stacked leaves) lies on one stage, or is cut into runs of equal length on distinct stages of
  one group and sub-mesh size (:func:`stack_violations`): the runtime holds a stacked leaf as
  its stages' row slices, one ``jax.Array`` over their devices, which no ``NamedSharding``
  describes otherwise (:mod:`shardplan.runtime.rows`).

Step time (:func:`evaluate_pipeline`), per replica with ``k`` stages and ``m`` microbatches:

* ``t_i = f_i + b_i + recompute_i``: stage ``i``'s forward + backward (+ remat recomputation)
  seconds per microbatch, summed over its layers;
* ``c_h`` for each hop ``h`` between consecutive layers on different stages (``k - 1`` hops;
  interleaved ``k v - 1``): sending the boundary activation forward and its gradient back,
  ``2 * link.time(boundary_bytes(last layer before the hop) * mb)`` on the link between the
  two stages (:func:`stage_link`);
* GPipe and 1F1B: ``T_r = sum(t) + sum(c) + (m - 1) * P`` with the period ``P`` the most
  of ``max(t)``, ``max(c) / 2`` (a duplex link carries one transfer per direction per
  microbatch) and every window average ``(sum t[i..j] + sum c[i..j-1]) / (j - i + 1)``
  (:func:`period_1f1b`): under 1F1B stage ``i`` holds one microbatch more than stage
  ``i + 1``, so a round trip from stage ``i`` through ``j`` is covered by only ``j - i + 1``
  microbatches and transfers sit on the steady state's critical path. On balanced stages
  without transfers this is the textbook ``(m + k - 1) t``; with transfers the simulator
  (:mod:`shardplan.solver.stages.simulate`) never takes longer (``tests/solver/test_simulate.py``), and
  takes as long up to the first microbatches and a stage whose own round trip hides under
  its warm-up. GPipe gets the same closed form (the stage planner's rule G), although
  draining every forward before the first backward makes it pay the forward and the
  backward bottleneck separately; the simulator has the difference exactly;
* interleaved with ``v`` chunks: ``T_r = sum(t) / v + sum(c) + (m - 1 / v) * max(max(t),
  v * max(c) / 2)`` over the ``k v - 1`` hops: the pipeline fills and drains one chunk at a
  time (bubble ``(k - 1) t / v``, Narayanan et al. 2021), every microbatch crosses every hop,
  and a link carries ``v`` transfers per direction per microbatch. Exact against the
  simulator on balanced stages whose transfers are shorter than a chunk's forward and
  backward; the module :mod:`shardplan.solver.stages.simulate` lists the rest;
* gradient synchronisation across replicas (``R > 1``), not overlapped with the pipeline
  (:func:`sync_s`): the stages of a replica hold disjoint devices, so each stage all-reduces
  its own layers' gradients with the replicas holding the same layers, all stages at once,
  one bucketed ring all-reduce per stage (Patarasuk & Yuan 2009: ``2 (R - 1)`` steps, each
  moving ``1 / R`` of a device's shard). A device of stage ``s`` of replica ``r`` holds
  ``sigma_{r,s} = sum_{layers of s} gradient_bytes / devices_s`` and the busiest device sets
  the pace: ``sync = 2 (R - 1) / R * max_{r,s} sigma_{r,s} / bandwidth + 2 (R - 1) *
  latency`` on the plan's :func:`sync_link`. (When replicas cut the layers differently, a
  stage's layers meet several stages of another replica; the bytes each device sends are
  still its ``2 (R - 1) / R`` share, and the latency is charged once, as if each device's
  pieces went in one bucket.) Both the busiest stage and the plan-wide link keep the stage
  planner's search separable per replica and stage. The runtime all-reduces inside classes
  of identical replicas, cut to one size (:func:`equal_classes`), and exchanges between the
  classes (:func:`exchange_bytes`): per device the ring's bytes, in no more time.
* the update: ``max`` over all stages of the sum of their layers' ``update_s``, after the
  synchronisation (every stage updates at once).

``step_time = max_r T_r + sync + update``. The cost objective (``objective="cost"``) is
``step_time * sum(devices used * price_per_hour) / 3600`` dollars per step, subject to
``batch / step_time >= min_throughput``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = [
    "REMATS",
    "SCHEDULES",
    "DeviceGroup",
    "LayerKind",
    "LayerOption",
    "Link",
    "PipelineEvaluation",
    "PipelinePlan",
    "PipelineProblem",
    "Replica",
    "StagePlacement",
    "check_pipeline",
    "equal_classes",
    "evaluate_pipeline",
    "exchange_bytes",
    "group_link",
    "in_flight",
    "looped_work",
    "period_1f1b",
    "replica_classes",
    "replica_time",
    "slowest_link",
    "stack_violations",
    "stage_held",
    "stage_link",
    "stage_sigma",
    "stage_work",
    "sync_link",
    "sync_s",
    "transfer_bytes",
]

# (Past 600 lines: the contract's dataclasses, the closed-form evaluator and its checks are
# read together; the per-replica figures shared with solver/stages/runs.py live beside the evaluator
# so that both sum in the same order.)

Remat = Literal["none", "selective", "full"]
Schedule = Literal["gpipe", "1f1b", "interleaved"]
REMATS: tuple[Remat, ...] = ("none", "selective", "full")
SCHEDULES: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Link:
    """A per-device link: ``time(n) = latency_s + n / bandwidth_bytes_per_s``."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def time_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class DeviceGroup:
    """The devices of one type.

    Attributes:
      name: the device type (``a100-80g``).
      count: devices.
      devices_per_node: devices per node.
      memory_bytes: usable bytes per device (headroom already taken off).
      price_per_hour: price of one device-hour (the cost objective).
      intra_node: the link between two devices of one node.
      inter_node: the per-device link between nodes.
    """

    name: str
    count: int
    devices_per_node: int
    memory_bytes: float
    price_per_hour: float
    intra_node: Link
    inter_node: Link


@dataclass(frozen=True)
class LayerOption:
    """One layer kind on a sub-mesh of ``devices`` devices of one group (the intra-op
    solution there). Seconds per microbatch are ``fixed + per_sample * mb``.

    Attributes:
      devices: sub-mesh size.
      forward_s: ``(fixed, per sample)`` forward seconds.
      backward_s: ``(fixed, per sample)`` backward seconds.
      recompute_s: per remat policy, ``(fixed, per sample)`` extra backward seconds (the
        recomputed forward); ``none`` is ``(0, 0)``.
      activation_bytes: per remat policy, bytes saved for the backward pass per sample, per
        device.
      state_bytes: per device, the parameters, their optimizer state, and two gradient
        copies: the sums over the microbatches and one microbatch's fresh gradients before
        they are added; and for parameters the layer reads but another owns (a tied
        embedding read by the head), their copy and two copies of the layer's gradient term.
      update_s: the optimizer update per step.
      recompute_bytes: per remat policy, the forward buffers the backward pass computes again
        per sample, per device (``none``: 0; ``full``: all it would otherwise save); a
        stage's backward program holds its layers' together.
      work_bytes: per remat policy, the buffers the backward pass makes and frees while it
        runs this layer, at their peak, per sample, per device (``selective``: with the
        attention core computed again beside them); a stage's backward program holds the
        largest of its layers'.
      resident_bytes: per device, what stays between steps: the parameters and their
        optimizer state (``state_bytes`` less the two gradient copies). Reported, not
        planned on.
    """

    devices: int
    forward_s: tuple[float, float]
    backward_s: tuple[float, float]
    recompute_s: Mapping[str, tuple[float, float]]
    activation_bytes: Mapping[str, float]
    state_bytes: float
    update_s: float
    recompute_bytes: Mapping[str, float] = field(default_factory=dict)
    work_bytes: Mapping[str, float] = field(default_factory=dict)
    resident_bytes: float = 0.0


def stage_work(recompute: float, work: float, looped: float = 0.0) -> float:
    """A stage's backward working bytes per sample beside its saved activations: the most of
    its layers' summed ``recompute_bytes`` (the recomputed forward values, live together
    when the backward starts) and their largest ``work_bytes`` (the transient buffers of one
    layer's backward); where the stage runs two or more rows of a scanned stack in a row,
    ``looped`` (:func:`looped_work`) on top of the recomputed values: the stack's backward is
    a loop, whose stacked values stay live until it ends, beside one row's buffers."""
    return max(recompute + looped, work)


def looped_work(stacks: Sequence[tuple[int, int]], layers: Sequence[int],
                work: Sequence[float]) -> float:
    """The largest ``work`` (per layer of ``layers``, in order) among the rows of a scanned
    stack that the stage holds two or more of in a row (a loop of two or more iterations;
    XLA inlines a loop of one), else 0 (:func:`stage_work`)."""
    if not stacks:
        return 0.0
    best = run_best = 0.0
    run = 0
    previous: tuple[int, int] | None = None
    for layer, w in zip(layers, work, strict=True):
        stack = next((s for s, (a, b) in enumerate(stacks) if a <= layer < b), -1)
        if stack >= 0 and previous == (layer - 1, stack):
            run, run_best = run + 1, max(run_best, w)
        else:
            run, run_best = (1, w) if stack >= 0 else (0, 0.0)
        if run >= 2:
            best = max(best, run_best)
        previous = (layer, stack)
    return best


@dataclass(frozen=True)
class LayerKind:
    """A repeated block (one layer fingerprint).

    Attributes:
      name: a label.
      options: per group index, its options (distinct ``devices``, ascending).
      boundary_bytes: the block's output activation per sample (what the next stage reads).
      gradient_bytes: the block's parameter gradients (all-reduced across replicas).
    """

    name: str
    options: Mapping[int, tuple[LayerOption, ...]]
    boundary_bytes: float
    gradient_bytes: float

    def option(self, group: int, devices: int) -> LayerOption | None:
        for o in self.options.get(group, ()):
            if o.devices == devices:
                return o
        return None


@dataclass(frozen=True)
class PipelineProblem:
    """Everything the stage planner decides over.

    Attributes:
      kinds: the layer kinds.
      layers: the kind index of each layer, in order.
      groups: the device groups.
      between_groups: the per-device link between devices of different groups (the default
        for pairs of groups without an entry in ``group_links``).
      batch: the global batch in samples.
      microbatch_sizes: candidate microbatch sizes (each divides ``batch``).
      schedules: schedules to consider.
      remats: remat policies to consider.
      chunks: interleaving depths ``v >= 2`` to consider for ``interleaved``.
      max_stages: most stages per replica (0: as many as layers).
      objective: ``time`` (step time) or ``cost`` (dollars per step, subject to
        ``min_throughput`` samples per second).
      min_throughput: the cost objective's floor, samples per second.
      group_links: per pair of group indices ``(a, b)``, ``a < b``, the per-device link between
        those two groups where it differs from ``between_groups``.
      time_limit_s: the stage planner's wall-clock budget: past it, the search stops and
        returns the best plan found with a proven lower bound
        (:class:`~shardplan.solver.stages.search.SolveStats`).
      work_limit: the stage planner's work budget in units (labels built, shapes compared,
        knapsack states, quick-sweep steps; 0: none). Unlike the wall clock, a search cut
        by it returns the same plan under any load.
      stacks: the scanned stacks, as layer ranges ``(a, b)`` (ascending, disjoint, two layers
        or more): layers ``a .. b - 1`` are the rows of stacked leaves, which a plan cuts only
        into equal runs on alike stages (:func:`stack_violations`).
      borrowed: ``(reader, owner, bytes)``: a parameter layer ``reader``'s forward reads that
        layer ``owner`` owns (a tied embedding read by the output head), for
        :func:`transfer_bytes`.
    """

    kinds: tuple[LayerKind, ...]
    layers: tuple[int, ...]
    groups: tuple[DeviceGroup, ...]
    between_groups: Link
    batch: int
    microbatch_sizes: tuple[int, ...]
    schedules: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved")
    remats: tuple[Remat, ...] = REMATS
    chunks: tuple[int, ...] = (2,)
    max_stages: int = 0
    objective: Literal["time", "cost"] = "time"
    min_throughput: float = 0.0
    group_links: Mapping[tuple[int, int], Link] = field(default_factory=dict)
    time_limit_s: float = 10.0
    work_limit: int = 0
    stacks: tuple[tuple[int, int], ...] = ()
    borrowed: tuple[tuple[int, int, float], ...] = ()


@dataclass(frozen=True)
class StagePlacement:
    """One stage of a replica: ``layers`` (indices, ascending; contiguous except under
    interleaving) on ``devices`` devices of group ``group``, with one remat policy."""

    group: int
    devices: int
    layers: tuple[int, ...]
    remat: Remat = "none"


@dataclass(frozen=True)
class Replica:
    """A data-parallel copy of the model: its stages in pipeline order and its microbatch
    count."""

    stages: tuple[StagePlacement, ...]
    microbatches: int


@dataclass(frozen=True)
class PipelinePlan:
    """A solution: replicas, one microbatch size, one schedule (``chunks`` = ``v`` when
    interleaved, else 1)."""

    replicas: tuple[Replica, ...]
    microbatch_size: int
    schedule: Schedule
    chunks: int = 1


@dataclass(frozen=True)
class PipelineEvaluation:
    """The closed-form figures of a plan.

    Attributes:
      step_time_s: ``max(replica_time_s) + sync_s + update_s``.
      replica_time_s: each replica's pipeline time.
      sync_s: cross-replica gradient all-reduce.
      update_s: the optimizer update (slowest stage).
      stage_time_s: per replica, per stage, ``t_i`` (seconds per microbatch).
      hop_time_s: per replica, per hop, ``c_h``.
      memory_bytes: per replica, per stage, bytes per device.
      cost_per_step: dollars per step.
      throughput: samples per second.
      violations: every broken constraint (empty: feasible).
    """

    step_time_s: float
    replica_time_s: tuple[float, ...]
    sync_s: float
    update_s: float
    stage_time_s: tuple[tuple[float, ...], ...]
    hop_time_s: tuple[tuple[float, ...], ...]
    memory_bytes: tuple[tuple[float, ...], ...]
    cost_per_step: float
    throughput: float
    violations: tuple[str, ...] = field(default=())

    @property
    def feasible(self) -> bool:
        return not self.violations


def stage_held(state: float, activation: float, work: float, mb: int, flight: float) -> float:
    """Bytes per device of a stage holding ``flight`` microbatches of ``mb`` samples: its
    state, their saved activations and one backward program's working bytes (the module
    docstring). Every memory check of the stage planner computes it so, to the bit."""
    return (state + mb * work) + flight * mb * activation


def in_flight(schedule: Schedule, stage: int, stages: int, microbatches: int,
              chunks: int = 1) -> float:
    """Microbatches whose activations stage ``stage`` (0-based, of ``stages``) holds at once,
    in units of the whole stage's activations."""
    if schedule == "gpipe":
        return float(microbatches)
    if schedule == "1f1b":
        return float(min(microbatches, stages - stage))
    v = chunks
    return min(microbatches * v, 2 * (stages - stage - 1) + (v - 1) * stages + 1) / v


def group_link(problem: PipelineProblem, a: int, b: int) -> Link:
    """The per-device link between groups ``a != b``: their ``group_links`` entry, else
    ``between_groups``."""
    return problem.group_links.get((min(a, b), max(a, b)), problem.between_groups)


def stage_link(problem: PipelineProblem, a: StagePlacement, b: StagePlacement) -> Link:
    """The link activations cross between two stages: :func:`group_link` across groups; inside
    a group the intra-node link when both sub-meshes fit in one node together, else the
    inter-node link."""
    if a.group != b.group:
        return group_link(problem, a.group, b.group)
    g = problem.groups[a.group]
    return g.intra_node if a.devices + b.devices <= g.devices_per_node else g.inter_node


def slowest_link(links: Iterable[Link]) -> Link:
    """The least bandwidth and the largest latency of ``links`` (not empty), as one link.

    A ring all-reduce over devices of several groups crosses the links between them; each of
    its ``2 (R - 1)`` steps lasts as long as its slowest hop, which is no shorter than the
    hop over the least bandwidth nor than the one with the largest latency. Taking both
    bounds from possibly different links is conservative, and it is monotone: more links
    never give a faster result (bandwidth no higher, latency no lower), which the stage
    planner's bounds rely on. Equal links give that link back.
    """
    links = list(links)
    return Link(min(link.bandwidth_bytes_per_s for link in links),
                max(link.latency_s for link in links))


def sync_link(problem: PipelineProblem, plan: PipelinePlan) -> Link:
    """The link the cross-replica gradient all-reduce runs on. When the plan's stages that
    hold layers span several groups: :func:`slowest_link` over :func:`group_link` of every
    pair of those groups. Inside one group: its intra-node link when all those stages'
    devices fit in one node, otherwise its inter-node link."""
    holders = [s for r in plan.replicas for s in r.stages if s.layers]
    groups = sorted({s.group for s in holders})
    if len(groups) > 1:
        return slowest_link(group_link(problem, a, b)
                            for a, b in itertools.combinations(groups, 2))
    g = problem.groups[holders[0].group]
    total = sum(s.devices for s in holders)
    return g.intra_node if total <= g.devices_per_node else g.inter_node


def stage_sigma(problem: PipelineProblem, stage: StagePlacement) -> float:
    """``sigma_{r,s}``: the gradient bytes one device of ``stage`` all-reduces."""
    return sum(problem.kinds[problem.layers[layer]].gradient_bytes / stage.devices
               for layer in stage.layers)


def transfer_bytes(problem: PipelineProblem, plan: PipelinePlan) -> float:
    """The bytes a step of a structurally valid plan sends between stages: per replica, per
    hop (consecutive layers on different stages, in a microbatch's order), the boundary
    activation forward and its gradient back, for each of its microbatches; and once per
    step, each parameter a stage reads but another stage of the replica owns
    (``problem.borrowed``: a tied embedding read by the head) and its gradient term back.
    Each counted once, as if it lands split over the receiving stage's devices (a layout
    that replicates it over ``D`` devices receives ``D`` copies: the runtime counts those)."""
    v = plan.chunks if plan.schedule == "interleaved" else 1
    mb = plan.microbatch_size
    total = 0.0
    for replica in plan.replicas:
        stage_of = {x: i for i, st in enumerate(replica.stages) for x in st.layers}
        order = _layer_order(replica.stages, v)
        for a, b in itertools.pairwise(order):
            if stage_of[a] != stage_of[b]:
                boundary = problem.kinds[problem.layers[a]].boundary_bytes
                total += 2 * boundary * mb * replica.microbatches
        total += sum(2 * nbytes for reader, owner, nbytes in problem.borrowed
                     if stage_of[reader] != stage_of[owner])
    return total


def replica_classes(plan: PipelinePlan) -> list[list[int]]:
    """The replicas in classes of identical ones (equal stages and microbatch count), cut to
    one size (:func:`equal_classes`), in order of their first member. The runtime runs a
    class as one replica whose stages all-reduce their gradients inside their programs, and
    the classes exchange their sums (:func:`exchange_bytes`)."""
    classes: dict[Replica, list[int]] = {}
    for r, replica in enumerate(plan.replicas):
        classes.setdefault(replica, []).append(r)
    return equal_classes(list(classes.values()))


def equal_classes(groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """``groups`` of identical replicas cut into classes of one size, the greatest common
    divisor of the groups' sizes, in order of their first member.

    The synchronisation runs in two phases, the members of a class all-reducing inside it and
    the classes exchanging; with classes of one size ``W`` every device moves the ring's
    ``2 (R - 1) / R`` of its bytes in the two together, and the slowest device of both phases
    is one holding the largest gradient share, so they take no longer than the ring
    :func:`sync_s` prices. Classes of unequal size could take longer (a class of 15 beside a
    lone replica: ``2 * 14/15 + 1`` against ``2 * 15/16`` times a device's bytes)."""
    size = math.gcd(*(len(g) for g in groups)) if groups else 1
    out = [list(g[i:i + size]) for g in groups for i in range(0, len(g), size)]
    return sorted(out, key=lambda c: c[0])


def exchange_bytes(problem: PipelineProblem, plan: PipelinePlan,
                   ) -> dict[tuple[int, int], float]:
    """The bytes the gradient exchange between :func:`replica_classes` brings each stage per
    step, keyed by (its class's first replica, stage position): with ``G`` classes, each
    class's stage receives ``2 (G - 1) / G`` of its layers' gradient bytes (a reduce-scatter
    and an all-gather, the ring's share), over all its devices (a class of ``W`` identical
    replicas: over its members' devices together). Empty with one class.

    With classes of ``W`` members each, the members' all-reduce (``2 (W - 1) / W`` of a
    device's bytes) and the exchange over ``W`` times the devices (``2 (G - 1) / (G W)``)
    add up to the ring's ``2 (R - 1) / R`` that :func:`sync_s` prices (the classes are of one
    size, :func:`equal_classes`)."""
    classes = replica_classes(plan)
    g = len(classes)
    if g < 2:
        return {}
    share = 2 * (g - 1) / g
    return {(members[0], i): share * sum(problem.kinds[problem.layers[x]].gradient_bytes
                                         for x in st.layers)
            for members in classes
            for i, st in enumerate(plan.replicas[members[0]].stages)}


def sync_s(problem: PipelineProblem, plan: PipelinePlan) -> float:
    """The cross-replica gradient synchronisation of a structurally valid plan (the module
    docstring): 0 with one replica."""
    r = len(plan.replicas)
    if r == 1:
        return 0.0
    sigma = max(stage_sigma(problem, s) for replica in plan.replicas for s in replica.stages)
    link = sync_link(problem, plan)
    return 2 * (r - 1) / r * sigma / link.bandwidth_bytes_per_s + 2 * (r - 1) * link.latency_s


def period_1f1b(t: Sequence[float], c: Sequence[float]) -> float:
    """The steady-state seconds per microbatch of a 1F1B replica with stage times ``t`` and
    round trips ``c`` (``c[i]`` between stages ``i`` and ``i + 1``): the most of ``max t``,
    ``max c / 2`` (a link is duplex: each direction carries one transfer per microbatch) and
    every window average ``(sum t[i..j] + sum c[i..j-1]) / (j - i + 1)`` (stage ``i`` holds
    ``k - i`` microbatches, one more than stage ``i + 1``, so a microbatch's round trip from
    ``i`` through ``j`` is covered by ``j - i + 1`` of them; the module docstring)."""
    period = max(max(t), max(c, default=0.0) / 2)
    k = len(t)
    if k <= 8:
        for i in range(k):
            run = t[i]
            for j in range(i + 1, k):
                run += c[j - 1] + t[j]
                period = max(period, run / (j - i + 1))
        return period
    # the same windows at once: ends[j] - starts[i] is sum t[i..j] + sum c[i..j-1]
    tc = np.asarray(t, dtype=np.float64) + np.append(np.asarray(c, dtype=np.float64), 0.0)
    prefix = np.concatenate(([0.0], np.cumsum(tc)))
    ends = prefix[1:] - np.append(np.asarray(c, dtype=np.float64), 0.0)
    size = np.arange(k)[None, :] - np.arange(k)[:, None] + 1
    window = (ends[None, :] - prefix[:-1, None]) / np.maximum(size, 1)
    return max(period, float(np.max(np.where(size >= 2, window, 0.0))))


def replica_time(t: Sequence[float], hops: Sequence[float], microbatches: int,
                 chunks: int) -> float:
    """One replica's closed-form pipeline time (the module docstring): ``t`` per stage,
    ``hops`` every round trip in the order a microbatch crosses them, ``chunks`` ``v`` (1
    without interleaving)."""
    if chunks == 1:
        return sum(t) + sum(hops) + (microbatches - 1) * period_1f1b(t, hops)
    period = max(max(t), chunks * max(hops, default=0.0) / 2)
    return sum(t) / chunks + sum(hops) + (microbatches - 1 / chunks) * period


def _linear(coefficients: tuple[float, float], mb: int) -> float:
    return coefficients[0] + coefficients[1] * mb


def check_pipeline(problem: PipelineProblem, plan: PipelinePlan) -> list[str]:
    """Every structural violation of ``plan`` (memory is checked by :func:`evaluate_pipeline`)."""
    out: list[str] = []
    mb = plan.microbatch_size
    if plan.schedule not in problem.schedules:
        out.append(f"schedule {plan.schedule!r} is not among PlanConfig.schedules "
                   f"{problem.schedules}")
    v = plan.chunks if plan.schedule == "interleaved" else 1
    if plan.schedule == "interleaved" and v not in problem.chunks:
        out.append(f"chunks {plan.chunks} is not among PlanConfig.chunks {problem.chunks}")
    if plan.schedule != "interleaved" and plan.chunks != 1:
        out.append(f"chunks {plan.chunks} without the interleaved schedule")
    if mb not in problem.microbatch_sizes or problem.batch % mb:
        out.append(f"microbatch size {mb} is not a candidate (PlanConfig.microbatch_sizes) "
                   f"dividing batch {problem.batch}")
    if not plan.replicas:
        out.append("no replicas")
    if sum(r.microbatches for r in plan.replicas) * mb != problem.batch:
        out.append(f"microbatches x {mb} do not add up to batch {problem.batch}")
    used = [0] * len(problem.groups)
    # Equal replicas break equal rules: check each distinct one once (a data-parallel plan
    # holds hundreds of equal replicas).
    seen: dict[Replica, tuple[list[str], list[tuple[int, int]]]] = {}
    for ri, replica in enumerate(plan.replicas):
        if replica not in seen:
            seen[replica] = _replica_violations(problem, replica, v)
        found, devices = seen[replica]
        out.extend(f"replica {ri}{text}" for text in found)
        for g, d in devices:
            used[g] += d
    for g, group in enumerate(problem.groups):
        if used[g] > group.count:
            out.append(f"group {group.name}: {used[g]} devices used > {group.count}")
    return out


def _replica_violations(problem: PipelineProblem, replica: Replica, v: int
                        ) -> tuple[list[str], list[tuple[int, int]]]:
    """:func:`check_pipeline`'s violations of one replica, each without its leading
    ``replica {index}``, and the (group, devices) of its stages in existing groups."""
    n = len(problem.layers)
    out: list[str] = []
    used: list[tuple[int, int]] = []
    k = len(replica.stages)
    if replica.microbatches < 1:
        out.append(f": {replica.microbatches} microbatches")
    if k == 0:
        out.append(": no stages")
        return out, used
    if problem.max_stages and k > problem.max_stages:
        out.append(f": {k} stages > PlanConfig.max_stages {problem.max_stages}")
    order = _layer_order(replica.stages, v)
    if order != list(range(n)):
        out.append(f": stages do not cover layers 0..{n - 1} in pipeline order")
    if v > 1:
        if n % (k * v):
            out.append(f": {k} stages x {v} chunks do not divide {n} layers")
        elif replica.microbatches % k:
            out.append(f": {replica.microbatches} microbatches not a multiple of {k} stages "
                       f"(interleaved)")
        elif order == list(range(n)):
            size = n // (k * v)
            for i, stage in enumerate(replica.stages):
                want = tuple(j for c in range(v) for j in
                             range((i + c * k) * size, (i + c * k + 1) * size))
                if stage.layers != want:
                    out.append(f", stage {i}: layers {stage.layers} are not its chunks {want}")
    for si, stage in enumerate(replica.stages):
        if not 0 <= stage.group < len(problem.groups):
            out.append(f", stage {si}: no group {stage.group}")
            continue
        used.append((stage.group, stage.devices))
        if stage.remat not in problem.remats:
            out.append(f", stage {si}: remat {stage.remat!r} not allowed")
        for layer in stage.layers:
            if not 0 <= layer < n:
                continue
            if problem.kinds[problem.layers[layer]].option(stage.group, stage.devices) is None:
                out.append(f", stage {si}: layer {layer} has no option on "
                           f"{stage.devices} x {problem.groups[stage.group].name}")
    out.extend(stack_violations(problem.stacks, replica.stages))
    return out, used


def stack_violations(stacks: Sequence[tuple[int, int]],
                     stages: Sequence[StagePlacement]) -> list[str]:
    """How ``stages`` (one replica's) cut the scanned ``stacks`` where the runtime cannot hold
    each stage's rows alone: a stack's rows on several stages must form runs of one length
    (consecutive rows on one stage), each on its own stage, all stages of one group and
    sub-mesh size (one ``jax.Array`` whose leading axis is split evenly over alike sub-meshes,
    :func:`shardplan.runtime.rows.expressible`). Each text starts with ``", "``."""
    owner = {layer: i for i, st in enumerate(stages) for layer in st.layers}
    out = []
    for a, b in stacks:
        runs: list[list[int]] = []  # [stage, rows]
        for layer in range(a, b):
            s = owner.get(layer, -1)
            if runs and runs[-1][0] == s:
                runs[-1][1] += 1
            else:
                runs.append([s, 1])
        if len(runs) < 2 or any(s < 0 for s, _ in runs):
            continue
        held = [s for s, _ in runs]
        what = f", scanned stack of layers {a}..{b - 1}"
        if len(set(held)) != len(held):
            out.append(f"{what}: its rows return to a stage (runs on stages {held})")
        elif len({n for _, n in runs}) != 1:
            out.append(f"{what}: cut into runs of unequal length {[n for _, n in runs]} "
                       f"(stages {held})")
        elif len({(stages[s].group, stages[s].devices) for s in held}) != 1:
            out.append(f"{what}: its stages {held} differ in group or sub-mesh size")
    return out


def _layer_order(stages: Sequence[StagePlacement], chunks: int) -> list[int]:
    """The layers in the order a microbatch's forward pass visits them."""
    if chunks == 1:
        return [layer for stage in stages for layer in stage.layers]
    k = len(stages)
    per = [len(s.layers) // chunks if len(s.layers) % chunks == 0 else -1 for s in stages]
    if any(p <= 0 for p in per) or len(set(per)) != 1:
        return []
    size = per[0]
    return [layer for c in range(chunks) for i in range(k)
            for layer in stages[i].layers[c * size:(c + 1) * size]]


_StageSums = tuple[float, float, float, float, float]
"""One stage's seconds per microbatch, state bytes, activation bytes per sample and update
seconds, each summed over its layers, and its working bytes per sample (:func:`stage_work`)
(:func:`_stage_sums`)."""


def _stage_sums(problem: PipelineProblem, stage: StagePlacement, mb: int) -> _StageSums:
    """The sums :func:`evaluate_pipeline` charges one structurally valid stage, in its order
    (layers ascending; ``sum`` over the same values gives the same bits)."""
    opts = [problem.kinds[problem.layers[layer]].option(stage.group, stage.devices)
            for layer in stage.layers]
    seconds = sum(_linear(o.forward_s, mb) + _linear(o.backward_s, mb)
                  + _linear(o.recompute_s[stage.remat], mb) for o in opts if o)
    state = sum(o.state_bytes for o in opts if o)
    activation = sum(o.activation_bytes[stage.remat] for o in opts if o)
    work = stage_work(sum(o.recompute_bytes.get(stage.remat, 0.0) for o in opts if o),
                      max((o.work_bytes.get(stage.remat, 0.0) for o in opts if o),
                          default=0.0),
                      looped_work(problem.stacks, stage.layers,
                                  [o.work_bytes.get(stage.remat, 0.0) if o else 0.0
                                   for o in opts]))
    return seconds, state, activation, sum(o.update_s for o in opts if o), work


@dataclass(frozen=True)
class _ReplicaFigures:
    """The closed-form figures of one structurally valid replica (:func:`_replica_figures`).

    Attributes:
      stage_time_s: per stage, ``t_i``.
      hop_time_s: per hop, ``c_h``.
      memory_bytes: per stage, bytes per device.
      over: the stages whose memory exceeds their group's ``memory_bytes``.
      update_s: the slowest stage's update (at least 0).
      time_s: the replica's pipeline time (:func:`replica_time`).
    """

    stage_time_s: tuple[float, ...]
    hop_time_s: tuple[float, ...]
    memory_bytes: tuple[float, ...]
    over: tuple[int, ...]
    update_s: float
    time_s: float


def _replica_figures(problem: PipelineProblem, stages: tuple[StagePlacement, ...],
                     microbatches: int, microbatch_size: int, schedule: Schedule, chunks: int,
                     sums: dict[tuple[StagePlacement, int], _StageSums]) -> _ReplicaFigures:
    """The figures :func:`evaluate_pipeline` gives one replica of a structurally valid plan
    (``chunks``: ``v``, 1 unless interleaved), bit for bit: the baselines score plans of
    many equal replicas with it without building them.

    Args:
      problem: the pipeline problem.
      stages: the replica's stages.
      microbatches: its microbatch count.
      microbatch_size: the plan's microbatch size.
      schedule: the plan's schedule.
      chunks: ``v`` under interleaving, else 1.
      sums: a cache of stage sums by (stage, microbatch size), filled here.
    """
    mb, k = microbatch_size, len(stages)
    t, mem, over = [], [], []
    update = 0.0
    for i, stage in enumerate(stages):
        key = (stage, mb)
        if key not in sums:
            sums[key] = _stage_sums(problem, stage, mb)
        seconds, state, activation, stage_update, work = sums[key]
        t.append(seconds)
        update = max(update, stage_update)
        held = stage_held(state, activation, work, mb,
                          in_flight(schedule, i, k, microbatches, chunks))
        mem.append(held)
        if held > problem.groups[stage.group].memory_bytes:
            over.append(i)
    stage_of = {layer: i for i, s in enumerate(stages) for layer in s.layers}
    hops = []
    for a, b in itertools.pairwise(_layer_order(stages, chunks)):
        if stage_of[a] != stage_of[b]:
            kind = problem.kinds[problem.layers[a]]
            link = stage_link(problem, stages[stage_of[a]], stages[stage_of[b]])
            hops.append(2 * link.time_s(kind.boundary_bytes * mb))
    return _ReplicaFigures(tuple(t), tuple(hops), tuple(mem), tuple(over), update,
                          replica_time(t, hops, microbatches, chunks))


def evaluate_pipeline(problem: PipelineProblem, plan: PipelinePlan) -> PipelineEvaluation:
    """The closed-form step time, memory and cost of ``plan`` (the module docstring), with
    every violation. Structural violations leave the figures ``inf``."""
    violations = check_pipeline(problem, plan)
    inf = math.inf
    if violations:
        return PipelineEvaluation(inf, (), inf, inf, (), (), (), inf, 0.0, tuple(violations))
    mb = plan.microbatch_size
    v = plan.chunks if plan.schedule == "interleaved" else 1
    replica_times, stage_times, hop_times, memories = [], [], [], []
    update = 0.0
    # Equal replicas have equal figures: compute each distinct one once.
    sums: dict[tuple[StagePlacement, int], _StageSums] = {}
    seen: dict[Replica, _ReplicaFigures] = {}
    for ri, replica in enumerate(plan.replicas):
        if replica not in seen:
            seen[replica] = _replica_figures(problem, replica.stages, replica.microbatches, mb,
                                             plan.schedule, v, sums)
        figures = seen[replica]
        for i in figures.over:
            held, group = figures.memory_bytes[i], problem.groups[replica.stages[i].group]
            violations.append(f"replica {ri}, stage {i}: {held:,.0f} bytes per device > "
                              f"{group.memory_bytes:,.0f} on {group.name}")
        update = max(update, figures.update_s)
        replica_times.append(figures.time_s)
        stage_times.append(figures.stage_time_s)
        hop_times.append(figures.hop_time_s)
        memories.append(figures.memory_bytes)
    sync = sync_s(problem, plan)
    step = max(replica_times) + sync + update
    price = sum(problem.groups[s.group].price_per_hour * s.devices
                for r in plan.replicas for s in r.stages)
    throughput = problem.batch / step if step > 0 else inf
    if problem.objective == "cost" and throughput < problem.min_throughput:
        violations.append(f"throughput {throughput:,.6g} samples/s < PlanConfig.min_throughput "
                          f"{problem.min_throughput:,.6g}")
    return PipelineEvaluation(
        step_time_s=step, replica_time_s=tuple(replica_times), sync_s=sync, update_s=update,
        stage_time_s=tuple(stage_times), hop_time_s=tuple(hop_times),
        memory_bytes=tuple(memories), cost_per_step=step * price / 3600.0,
        throughput=throughput, violations=tuple(violations))
