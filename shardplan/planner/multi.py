"""Multi-stage plans: the step's layer cost tables, the stage planner, and the Plan.

:func:`make_pipeline_plan` traces the train step at a small reference microbatch, builds the
layer cost tables (:mod:`shardplan.planner.layer_costs`: per layer kind, device group and
sub-mesh size, the intra-op solution's times and bytes), turns them and the cluster's groups
and links into the plain-data :class:`~shardplan.solver.stages.pipeline.PipelineProblem`
(:func:`pipeline_problem`), solves it (:func:`~shardplan.solver.stages.portfolio.plan_pipeline`: the
stage planner seeded with the data-parallel and Megatron plans, the final pick played out in
the event simulator), places the stages on devices (:func:`allocate_devices`)
and writes the :class:`~shardplan.plan.Plan`: stages with their replica, device type, devices,
mesh, layers and remat; one *layout* (the intra-op shardings) per device group and sub-mesh;
microbatches, schedule and the predicted figures; and the simulator's timeline of the step's
pipeline phase (:func:`pipeline_timeline`, read back by
:func:`shardplan.plan.timeline.timeline_events`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from shardplan.cluster import Cluster
from shardplan.cluster.device import DeviceSpec
from shardplan.cluster.link import Link as ClusterLink
from shardplan.errors import ConfigError, format_error
from shardplan.kernels.registry import PRIMITIVE as KERNEL
from shardplan.plan.plan import Layout, MeshSpec, Plan, Predicted, ReplicaSpec, Spec, Stage
from shardplan.plan.timeline import TIMELINE_COLUMNS
from shardplan.planner.alternatives import (
    LAYOUT_BASIS,
    leaf_alternatives,
    pipeline_runner_ups,
    unused_types,
)
from shardplan.planner.decode import decode_constraints, decode_input_specs
from shardplan.planner.layer_costs import LayerCosts
from shardplan.planner.mesh import MeshChoice
from shardplan.solver.stages.pipeline import (
    REMATS,
    SCHEDULES,
    DeviceGroup,
    Link,
    PipelinePlan,
    PipelineProblem,
    Remat,
    Replica,
    Schedule,
    exchange_bytes,
    stage_sigma,
    transfer_bytes,
)
from shardplan.solver.stages.portfolio import PipelineChoice, plan_pipeline
from shardplan.solver.stages.simulate import simulate
from shardplan.trace.batch import BatchUse, batch_use
from shardplan.trace.graph import OpGraph

if TYPE_CHECKING:
    from shardplan.planner.single import PlanConfig

__all__ = ["TIMELINE_MAX_EVENTS", "allocate_devices", "batch_size",
           "effective_matmul_flops_per_s", "make_pipeline_plan", "memory_budget",
           "microbatch_candidates", "microbatch_of", "pipeline_problem", "pipeline_timeline"]

# (Past 600 lines: from the tables to the Plan in one pass, whose solver record, stage
# placement and timeline read the same problem and choice; the timeline's ~100 lines at the
# end are the piece to move out first if it grows.)

_NO_LINK = Link(1.0, 0.0)
"""Stands in for the link between groups on a one-group cluster (never used there)."""

TIMELINE_MAX_EVENTS = 4_000
"""The most rows ``plan.solver["timeline"]`` stores. A row takes about 65 bytes of the plan
file, so the timeline adds at most about 260 KB. When every replica's events are more, each
distinct replica is listed once (``same_as``); when even those are more, only the first and
the last ``window`` microbatches of each (the fill and the drain of the pipeline, with steady
state on both sides); when even one of each is more, no timeline is stored and a note says so.
(The stage planner simulates plans of at most
:data:`~shardplan.solver.stages.portfolio.SIMULATE_TASKS` compute tasks; larger ones have none.)"""


def _link(link: ClusterLink) -> Link:
    return Link(link.bandwidth_bytes_per_s, link.latency_s)


def microbatch_candidates(batch: int, devices: int | None = None, *,
                          most: int = 8) -> tuple[int, ...]:
    """Microbatch sizes worth trying for a global batch: the ``most`` smallest powers of two
    that divide it (and the batch itself) whose microbatch count ``batch / size`` is at most
    ``4 * devices`` (every replica runs at least one microbatch, and a pipeline gains little
    from more than a few microbatches per stage; the cost tables' times are linear in the
    microbatch size, so below that the bubble alone would pick the smallest size)."""
    if batch < 1:
        raise ConfigError(format_error("The global batch must be at least 1.", where="batch",
                                       value=batch, remedy="pass a batch with samples in it"))
    sizes: list[int] = []
    mb = 1
    while mb <= batch and len(sizes) < most:
        if batch % mb == 0 and (devices is None or batch // mb <= 4 * devices):
            sizes.append(mb)
        mb *= 2
    if batch not in sizes and len(sizes) < most:
        sizes.append(batch)
    return tuple(sizes)


def pipeline_problem(costs: LayerCosts, cluster: Cluster, *, batch: int,
                     memory_bytes: Sequence[float],
                     microbatch_sizes: Sequence[int] | None = None,
                     schedules: Sequence[Schedule] = SCHEDULES,
                     remats: Sequence[Remat] = REMATS, chunks: Sequence[int] = (2,),
                     max_stages: int = 0) -> PipelineProblem:
    """The stage planner's problem for ``costs`` on ``cluster``.

    Args:
      costs: the layer cost tables (their group indices are ``cluster.groups``' order).
      cluster: the cluster.
      batch: the global batch in samples.
      memory_bytes: per group, the usable bytes per device (headroom already taken off).
      microbatch_sizes: candidate microbatch sizes (default :func:`microbatch_candidates`);
        each must divide ``batch``.
      schedules, remats, chunks, max_stages: as in
        :class:`~shardplan.solver.stages.pipeline.PipelineProblem`.
    """
    sizes = (tuple(microbatch_sizes) if microbatch_sizes
             else microbatch_candidates(batch, cluster.num_devices))
    bad = [mb for mb in sizes if mb < 1 or batch % mb]
    if bad:
        raise ConfigError(format_error(
            "A microbatch size does not divide the global batch.",
            where="PlanConfig.microbatch_sizes", value={"batch": batch, "sizes": list(sizes)},
            remedy=f"use divisors of {batch}, e.g. {list(microbatch_candidates(batch))}"))
    if len(memory_bytes) != len(cluster.groups):
        raise ConfigError(format_error(
            "Give one memory figure per device group.", where="memory_bytes",
            value=list(memory_bytes), remedy=f"{len(cluster.groups)} figures, in group order"))
    groups = []
    for g, group in enumerate(cluster.groups):
        intra = _link(group.intra_node)
        price = group.device.price_per_hour_usd
        groups.append(DeviceGroup(
            name=group.name, count=len(group.device_ids),
            devices_per_node=group.devices_per_node, memory_bytes=float(memory_bytes[g]),
            price_per_hour=float(price) if price is not None else 0.0,
            intra_node=intra,
            inter_node=_link(group.inter_node) if group.inter_node is not None else intra))
    index = {group.name: g for g, group in enumerate(cluster.groups)}
    pairs = {}
    for gl in cluster.group_links:
        a, b = sorted(index[name] for name in gl.groups)
        pairs[(a, b)] = _link(gl.link)
    between = (_link(cluster.between_groups) if cluster.between_groups is not None
               else _NO_LINK)
    return PipelineProblem(
        kinds=costs.kinds, layers=costs.layers, groups=tuple(groups), between_groups=between,
        group_links=pairs, batch=batch, microbatch_sizes=sizes, schedules=tuple(schedules),
        remats=tuple(remats), chunks=tuple(chunks), max_stages=max_stages,
        stacks=costs.stacks, borrowed=costs.borrowed)


# --------------------------------------------------------------------------- make_plan


def effective_matmul_flops_per_s(device: DeviceSpec, count: int, *,
                                 dtype: str = "bf16") -> float:
    """``count`` devices' matmul FLOP/s as the cost model sees them: dense peak in ``dtype``
    (or the dtype the device runs it as: fp16 on a V100) times ``efficiency.matmul``."""
    return device.flops_per_s(dtype) * device.efficiency.matmul * count


def batch_size(batch: Any, /) -> int:
    """The global batch: the leading dimension every leaf of ``batch`` shares.

    Raises:
      ConfigError: a leaf is a scalar, or two leaves disagree (both named).
    """
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise ConfigError(format_error("The batch has no arrays.", where="batch", value=batch,
                                       remedy="pass the batch pytree the train step reads"))
    sizes: dict[int, str] = {}
    for path, leaf in leaves:
        key = jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape:
            raise ConfigError(format_error(
                "A batch leaf has no batch dimension.", where=f"batch key path {key}",
                value=shape, remedy="give every batch leaf the samples as its leading axis"))
        sizes.setdefault(int(shape[0]), key)
    if len(sizes) > 1:
        (a, ka), (b, kb) = list(sizes.items())[:2]
        raise ConfigError(format_error(
            "The batch leaves disagree on the number of samples (their leading dimension).",
            where=f"batch key paths {ka} and {kb}", value={ka: a, kb: b},
            remedy="give every batch leaf the samples as its leading axis"))
    return next(iter(sizes))


def microbatch_of(batch: Any, size: int, /) -> Any:
    """Abstract stand-ins (``ShapeDtypeStruct``) for a ``size``-sample slice of ``batch``."""
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((size, *x.shape[1:]), x.dtype), batch)


def allocate_devices(cluster: Cluster, stages: Sequence[tuple[int, int]]) -> list[tuple[int, ...]]:
    """Device ids for stages given as ``(group index, devices)``, in order.

    Stages of a node or more take whole nodes; smaller ones are packed first-fit into nodes in
    the order given (a replica's consecutive stages share a node where they fit, which is what
    the inter-op model's stage links assume); where first-fit leaves no node with room, the
    smaller stages are packed largest first, and as a last resort a stage spans two nodes.

    Raises:
      PipelineError: a group has fewer devices than its stages take.
    """
    from shardplan.errors import PipelineError

    out: list[tuple[int, ...] | None] = [None] * len(stages)
    for g, group in enumerate(cluster.groups):
        mine = [i for i, (gg, _) in enumerate(stages) if gg == g]
        need = sum(stages[i][1] for i in mine)
        if need > len(group.device_ids):
            raise PipelineError(format_error(
                "The stages take more devices than the group has.",
                where=f"group {group.name!r}", value={"stages": need,
                                                       "devices": len(group.device_ids)},
                remedy="a planner bug: report it with the plan"))
        per = group.devices_per_node
        nodes: list[list[int]] = [list(group.node_ids(n)) for n in range(group.nodes)]
        big = [i for i in mine if stages[i][1] >= per]
        small = [i for i in mine if stages[i][1] < per]
        for i in big:
            take = stages[i][1] // per
            free = [n for n, ids in enumerate(nodes) if len(ids) == per][:take]
            whole = [d for n in free for d in nodes[n]]
            for n in free:
                nodes[n] = []
            out[i] = tuple(whole) + _take_anywhere(nodes, stages[i][1] - len(whole))
        for order in (small, sorted(small, key=lambda i: -stages[i][1])):
            trial: list[list[int]] = [list(ids) for ids in nodes]
            placed: dict[int, tuple[int, ...]] = {}
            for i in order:
                d = stages[i][1]
                fit = next((n for n, ids in enumerate(trial) if len(ids) >= d), None)
                if fit is None:
                    break
                placed[i] = tuple(trial[fit][:d])
                trial[fit] = trial[fit][d:]
            if len(placed) == len(small):
                for i, taken in placed.items():
                    out[i] = taken
                break
        else:
            for i in small:
                out[i] = _take_anywhere(nodes, stages[i][1])
    return [taken for taken in out if taken is not None]


def _take_anywhere(nodes: list[list[int]], count: int) -> tuple[int, ...]:
    taken: list[int] = []
    for n, ids in enumerate(nodes):
        grab = ids[:count - len(taken)]
        taken += grab
        nodes[n] = ids[len(grab):]
        if len(taken) == count:
            break
    return tuple(taken)


def make_pipeline_plan(train_step: Callable[..., Any], state: Any, batch: Any, /, *,
                       cluster: Cluster, config: PlanConfig) -> Plan:
    """A multi-stage plan of ``train_step`` on ``cluster``: layer cost tables from the step
    traced at ``config.reference_microbatch`` samples, the stage planner over them, and the
    plan (see :func:`shardplan.make_plan`)."""
    from shardplan.planner.layer_costs import layer_costs
    from shardplan.trace import trace

    start = time.perf_counter()
    global_batch = batch_size(batch)
    reference = min(config.reference_microbatch, global_batch)
    sample = microbatch_of(batch, reference)
    graph = trace(train_step, state, sample)
    from shardplan.planner.single import check_primitives

    check_primitives(graph, strict=config.strict)
    traced = time.perf_counter()
    # how microbatches of this step combine (trace/batch.py): where a microbatch's result
    # would differ from the batch's, one microbatch per replica and one replica
    use = (batch_use(train_step, state, sample) if global_batch > 1
           else BatchUse())  # one sample: nothing to cut
    sizes = config.microbatch_sizes or None
    refused = use.refusal(config.accumulation)
    if refused is not None:
        if sizes and global_batch not in sizes:
            raise use.refusal_error(
                config.accumulation,
                what=f"PlanConfig.microbatch_sizes={list(sizes)} (batch {global_batch})")
        sizes = (global_batch,)
    analysed = time.perf_counter()
    costs = layer_costs(graph, cluster, reference_batch=reference,
                        max_mesh_axes=config.max_mesh_axes, time_limit_s=config.time_limit_s,
                        relative_gap=config.relative_gap)
    tabled = time.perf_counter()
    memory = [memory_budget(config, group.device.memory_bytes) for group in cluster.groups]
    problem = pipeline_problem(
        costs, cluster, batch=global_batch, memory_bytes=memory,
        microbatch_sizes=sizes,
        schedules=config.schedules, remats=config.remats, chunks=config.chunks,
        max_stages=config.max_stages)
    problem = dataclasses.replace(problem, objective=config.objective,
                                  min_throughput=config.min_throughput,
                                  time_limit_s=config.stage_time_limit_s,
                                  work_limit=config.stage_work_limit)
    choice = plan_pipeline(problem)
    if not choice.stats.optimal:
        _warn_gap(choice, problem)
    timings = {"trace_s": traced - start, "batch_use_s": analysed - traced,
               "layer_tables_s": tabled - analysed,
               "stage_planner_s": time.perf_counter() - tabled,
               **{f"stage_planner.{k}": v for k, v in choice.timings.items()}}
    return _pipeline_plan(graph, cluster, config, costs, problem, choice, timings, start,
                          use.notes(config.accumulation))


def proven_gap(value: float, lower_bound: float) -> float | None:
    """``(value - lower_bound) / value``: how far a plan's objective may lie above the best
    plan's; ``None`` where the bound proves nothing (0, or none: "within 100 %" would misread
    as a measured gap).

    Example:
        >>> proven_gap(10.0, 9.0), proven_gap(10.0, 0.0)
        (0.1, None)
    """
    if not (math.isfinite(lower_bound) and lower_bound > 0 and value > 0):
        return None
    gap = max(0.0, value - lower_bound) / value
    return gap if gap < 1.0 else None


def _warn_gap(choice: PipelineChoice, problem: PipelineProblem) -> None:
    """Warns that the stage planner stopped at its budget, with the proven gap."""
    import warnings

    from shardplan.errors import ShardplanWarning

    ev, stats = choice.evaluation, choice.stats
    value = ev.cost_per_step if problem.objective == "cost" else ev.step_time_s
    gap = proven_gap(value, stats.lower_bound)
    bound = (f"within {100 * gap:.1f} % of a proven lower bound" if gap is not None
             else "no lower bound proven")
    by_work = 0 < problem.work_limit < stats.work
    limit = (f"work limit of {problem.work_limit:,} units" if by_work
             else f"{problem.time_limit_s:g} s limit")
    field = "stage_work_limit" if by_work else "stage_time_limit_s"
    warnings.warn(format_error(
        f"The stage planner reached its {limit}: the plan is the best found, {bound}; "
        "not proven optimal.",
        where=f"PlanConfig.{field}",
        value=problem.work_limit if by_work else problem.time_limit_s,
        remedy=f"raise PlanConfig.{field} to search longer"), ShardplanWarning,
        stacklevel=4)


def memory_budget(config: PlanConfig, device_bytes: float) -> float:
    """Usable bytes per device: ``config.memory_budget_bytes``, else the device's memory less
    ``config.memory_headroom``."""
    if config.memory_budget_bytes is not None:
        return float(config.memory_budget_bytes)
    return float(device_bytes) * (1.0 - config.memory_headroom)


def _layout_name(group: str, axis_names: Sequence[str], axis_sizes: Sequence[int]) -> str:
    return f"{group}:" + ",".join(f"{n}={s}" for n, s in zip(axis_names, axis_sizes,
                                                             strict=True))


def _pipeline_plan(graph: OpGraph, cluster: Cluster, config: PlanConfig, costs: LayerCosts,
                   problem: PipelineProblem, solution: PipelineChoice,
                   timings: dict[str, float], start: float,
                   accumulation: Sequence[str] = ()) -> Plan:
    """The :class:`Plan` of a stage-planner solution."""
    from shardplan.planner.single import _version, graph_fingerprint

    pp = solution.plan
    ev = solution.evaluation
    placed = _place_stages(graph, cluster, costs, problem, solution)
    replicas = placed.replicas
    # what the gradient exchange between replicas that differ brings each stage (the
    # runtime's stage: a class of identical replicas runs on its first member's)
    exchange = {str(replicas[r][i]): math.ceil(b)
                for (r, i), b in exchange_bytes(problem, pp).items()}
    param_specs = _first_holders(graph, placed.stages, replicas[0], placed.layouts)
    slowest = max(range(len(pp.replicas)), key=lambda r: ev.replica_time_s[r])
    communication = ev.sync_s + sum(ev.hop_time_s[slowest])
    predicted = Predicted(step_time_s=ev.step_time_s,
                          compute_s=max(ev.step_time_s - communication, 0.0),
                          communication_s=communication, memory_bytes=placed.memory,
                          collectives={})
    solver = _solver_record(cluster, costs, problem, solution, placed, exchange)
    notes = [f"Layer cost tables solved at a reference microbatch of "
             f"{costs.reference_batch} sample(s); times and activations scale linearly with "
             "the microbatch size.",
             "Collective counts are not predicted for pipeline plans yet: see each layout's "
             "intra-op solution.", *accumulation]
    if solution.simulation is not None:  # the simulator played this plan: keep its timeline
        timings = _add_timeline(problem, pp, replicas, solver, notes, timings)
    return Plan(
        shardplan_version=_version(), graph_fingerprint=graph_fingerprint(graph),
        cluster_hash=cluster.content_hash(), config_hash=config.content_hash(),
        stages=tuple(placed.stages), param_specs=param_specs, batch_specs={},
        microbatches=sum(r.microbatches for r in pp.replicas), schedule=pp.schedule,
        accumulation=config.accumulation, microbatch_size=pp.microbatch_size, chunks=pp.chunks,
        replicas=tuple(ReplicaSpec(tuple(s), rep.microbatches)
                       for s, rep in zip(replicas, pp.replicas, strict=True)),
        layouts=placed.layouts, predicted=predicted, solver=solver, notes=tuple(notes),
        timings={**timings, "plan_s": time.perf_counter() - start})


@dataclasses.dataclass(frozen=True)
class _Placed:
    """A stage-planner solution's stages on devices, with their layouts and figures.

    Attributes:
      stages: the Plan's stages, in pipeline order per replica.
      replicas: per replica, the indices of its stages in ``stages``.
      layouts: per layout name, the intra-op shardings.
      alternatives: per layout name, its leaves' alternatives (for ``Plan.explain``).
    """

    stages: list[Stage]
    replicas: list[list[int]]
    layouts: dict[str, Layout]
    alternatives: dict[str, dict[str, Any]]
    memory: dict[int, int]
    """Per device, its predicted peak bytes."""
    resident: dict[str, int]
    """Per stage, the bytes per device it keeps between steps."""
    sync_bytes: dict[str, int]
    """Per stage, the gradient bytes a device all-reduces (several replicas only)."""


def _place_stages(graph: OpGraph, cluster: Cluster, costs: LayerCosts,
                  problem: PipelineProblem, solution: PipelineChoice) -> _Placed:
    """The solution's stages on devices, each with its layout and figures (:class:`_Placed`)."""
    pp = solution.plan
    ev = solution.evaluation
    flat = [(r, i, st) for r, rep in enumerate(pp.replicas) for i, st in enumerate(rep.stages)]
    ids = allocate_devices(cluster, [(st.group, st.devices) for _, _, st in flat])
    shared = [layer.name for layer in graph.layers if layer.kind == "shared"]
    placed = _Placed([], [[] for _ in pp.replicas], {}, {}, {}, {}, {})
    for index, ((r, i, st), devices) in enumerate(zip(flat, ids, strict=True)):
        group = cluster.groups[st.group]
        intra = costs.choices[(st.group, st.devices)]
        mesh = intra.mesh
        name = _layout_name(group.name, mesh.axis_names, mesh.axis_sizes)
        if name not in placed.layouts:
            placed.layouts[name], placed.alternatives[name] = _layout_of(graph, intra)
        placed.stages.append(Stage(index=index, device_type=group.device.name,
                                   mesh=MeshSpec(mesh.axis_names, mesh.axis_sizes, devices),
                                   layers=tuple(costs.names[x] for x in st.layers)
                                   + tuple(shared),
                                   remat=st.remat, replica=r, layout=name))
        placed.replicas[r].append(index)
        for d in devices:
            placed.memory[d] = math.ceil(ev.memory_bytes[r][i])
        options = [problem.kinds[problem.layers[x]].option(st.group, st.devices)
                   for x in st.layers]
        placed.resident[str(index)] = math.ceil(sum(o.resident_bytes for o in options if o))
        if len(pp.replicas) > 1:  # what one device of the stage all-reduces across replicas
            placed.sync_bytes[str(index)] = math.ceil(stage_sigma(problem, st))
    return placed


def _layout_of(graph: OpGraph, intra: MeshChoice) -> tuple[Layout, dict[str, Any]]:
    """The :class:`Layout` of one intra-op solution, with its leaves' alternatives."""
    specs = decode_input_specs(intra.problem, intra.solution)
    kernels = {"/".join(map(str, path)): (results, operands) for path, (op, results,
               operands) in decode_constraints(graph, intra.problem,
                                               intra.solution).items()
               if graph.ops[op].primitive == KERNEL}
    layout = Layout(
        {p.path: specs[p.tensor] for p in graph.parameters if p.arg_index == 0},
        {p.path: specs[p.tensor] for p in graph.parameters if p.arg_index == 1},
        kernels)
    return layout, leaf_alternatives(graph, intra.problem, intra.solution, basis=LAYOUT_BASIS)


def _solver_record(cluster: Cluster, costs: LayerCosts, problem: PipelineProblem,
                   solution: PipelineChoice, placed: _Placed,
                   exchange: dict[str, int]) -> dict[str, object]:
    """``Plan.solver`` of a stage-planner solution (``docs/plan-format.md``)."""
    from shardplan.planner.single import FINGERPRINT_SAMPLES

    pp, ev = solution.plan, solution.evaluation
    stats, simulation = solution.stats, solution.simulation
    value = ev.cost_per_step if problem.objective == "cost" else ev.step_time_s
    solver: dict[str, object] = {
        "status": "optimal" if stats.optimal else "feasible",
        "objective": problem.objective,
        "objective_value": value,
        "replica_seconds": [round(t, 9) for t in ev.replica_time_s],
        "sync_s": ev.sync_s, "update_s": ev.update_s,
        "simulated_step_s": simulation.step_time_s if simulation else None,
        "simulated_bubble_fraction": simulation.bubble_fraction if simulation else None,
        "cost_per_step_usd": ev.cost_per_step,
        "throughput_samples_per_s": ev.throughput,
        "configs": stats.configs, "labels": stats.labels, "shapes": stats.shapes,
        "states": stats.states,
        "resident_bytes": placed.resident,
        "sync_bytes": placed.sync_bytes,
        "exchange_bytes": exchange,
        # what the step's transfers between stages carry (activations forward, gradients back)
        "transfer_bytes": math.ceil(transfer_bytes(problem, pp)),
        # the final pick (solver/stages/portfolio.py): the search's plan or a baseline seed it did
        # not beat, with every candidate's closed-form and simulated step time
        "chosen": solution.source,
        "candidates": {c.name: {"step_s": c.evaluation.step_time_s,
                                "simulated_step_s": (c.simulation.step_time_s
                                                     if c.simulation else None)}
                       for c in solution.candidates},
        # for Plan.explain (planner/alternatives.py)
        "runner_ups": pipeline_runner_ups(solution, [g.device.name for g in cluster.groups]),
        # per device group the plan leaves unused, what using it would cost (Plan.explain)
        "unused_types": unused_types(solution, problem),
        "alternatives": {"layouts": placed.alternatives},
        # the batch size the fingerprinted graph was traced at (check_plan traces there too)
        FINGERPRINT_SAMPLES: costs.reference_batch,
    }
    # the proven gap of every plan to the search's lower bound (0 when optimal; None: no
    # bound above 0 proven)
    solver["lower_bound"] = stats.lower_bound if math.isfinite(stats.lower_bound) else None
    solver["gap"] = proven_gap(value, stats.lower_bound)
    if not stats.optimal:
        if 0 < problem.work_limit < stats.work:
            solver["work_limit_reached"] = problem.work_limit
        else:
            solver["time_limit_reached_s"] = problem.time_limit_s
    return solver


def _add_timeline(problem: PipelineProblem, pp: PipelinePlan, replicas: list[list[int]],
                  solver: dict[str, object], notes: list[str],
                  timings: dict[str, float]) -> dict[str, float]:
    """Stores the simulator's timeline in ``solver`` (or notes why not); the timings with it."""
    played = time.perf_counter()
    timeline = pipeline_timeline(problem, pp, replicas)
    timings = {**timings, "timeline_s": time.perf_counter() - played}
    if timeline is not None:
        solver["timeline"] = timeline
    else:
        notes.append(f"The simulator's timeline is not stored (solver.timeline): over "
                     f"{TIMELINE_MAX_EVENTS:,} events even with one microbatch at each "
                     "end of each distinct replica.")
    return timings


def _timeline_rows(replica: Replica, chunks: int, window: int | None = None) -> int:
    """The simulator's events of ``replica`` (:mod:`shardplan.solver.stages.simulate`) of its first
    and last ``window`` microbatches (all when ``None``): a forward and a backward per model
    chunk per microbatch, and two transfers per hop between chunks."""
    k, m = len(replica.stages), replica.microbatches
    hops = k * chunks - 1 if k > 1 else 0
    return (m if window is None else min(m, 2 * window)) * 2 * (k * chunks + hops)


def _significant(seconds: float) -> float:
    """``seconds`` to 6 significant digits (a microsecond of a step of seconds). The rounding
    is monotone, so tasks that do not overlap still do not."""
    return float(f"{seconds:.6g}")


def pipeline_timeline(problem: PipelineProblem, plan: PipelinePlan,
                      stage_indices: Sequence[Sequence[int]], /, *,
                      max_events: int = TIMELINE_MAX_EVENTS) -> dict[str, Any] | None:
    """The simulator's timeline of ``plan`` as the record ``Plan.solver["timeline"]`` holds
    (``docs/plan-format.md``; :func:`shardplan.plan.timeline.timeline_events` reads it).

    Args:
      problem: the pipeline problem.
      plan: a plan of it (the stage planner's).
      stage_indices: per replica, the :class:`~shardplan.plan.plan.Stage` index of each of
        its stages in pipeline order (``Plan.replicas[r].stages``).
      max_events: the most rows to store.

    Returns:
      ``{"columns", "same_as", "window", "rows"}``: one row per event with the Plan's stage
      indices and times to 6 significant digits, the first of these that fits in
      ``max_events`` rows: every replica listed (``same_as[r] == r``, ``window`` ``None``);
      each distinct replica once (``same_as[r]``: the earlier replica whose rows ``r``
      repeats); those with only the first and the last ``window`` microbatches of each
      replica, ``window`` as large as fits; ``None`` when not even ``window = 1`` fits.

    Raises:
      PipelineError: the plan breaks a structural constraint (as :func:`simulate`).
    """
    v = plan.chunks if plan.schedule == "interleaved" else 1
    first: dict[Replica, int] = {}
    twins = [first.setdefault(rep, r) for r, rep in enumerate(plan.replicas)]

    def rows_of(same_as: list[int], window: int | None) -> int:
        return sum(_timeline_rows(rep, v, window) for r, rep in enumerate(plan.replicas)
                   if same_as[r] == r)

    same_as, window = list(range(len(plan.replicas))), None
    if rows_of(same_as, None) > max_events:
        same_as = twins
        if rows_of(twins, None) > max_events:
            most = max(rep.microbatches for rep in plan.replicas)
            window = next((w for w in range((most + 1) // 2, 0, -1)
                           if rows_of(twins, w) <= max_events), None)
            if window is None:
                return None
    # The planner's simulation kept no events: play the plan again, asking for them, but each
    # distinct replica alone (replicas meet only in the all-reduce after the pipeline phase,
    # simulate.py), which spares the simulator copying every twin's tasks.
    distinct = sorted(first.values())
    alone = dataclasses.replace(plan, replicas=tuple(plan.replicas[q] for q in distinct))
    mb = plan.microbatch_size
    events = simulate(dataclasses.replace(
        problem, batch=mb * sum(rep.microbatches for rep in alone.replicas),
        microbatch_sizes=(mb,)), alone, timeline=True).events
    copies = [[r for r in range(len(plan.replicas)) if twins[r] == q and same_as[r] == r]
              for q in distinct]
    keyed = []
    for e in events:
        m = alone.replicas[e.replica].microbatches
        if window is not None and window <= e.microbatch < m - window:
            continue
        for r in copies[e.replica]:
            to = None if e.to_stage is None else stage_indices[r][e.to_stage]
            keyed.append(((e.start_s, r, e.stage, e.kind, e.microbatch, e.chunk),
                          [r, stage_indices[r][e.stage], e.kind, e.microbatch, e.chunk,
                           _significant(e.start_s), _significant(e.end_s), to]))
    keyed.sort(key=lambda pair: pair[0])  # the simulator's order over the whole plan
    return {"columns": list(TIMELINE_COLUMNS), "same_as": same_as, "window": window,
            "rows": [row for _, row in keyed]}


def _first_holders(graph: OpGraph, stages: Sequence[Stage], first_replica: Sequence[int],
                   layouts: dict[str, Layout]) -> dict[str, tuple[int, Spec]]:
    """Per state leaf: the first stage of the first replica whose layers own it (leaves no
    layer owns, such as a step counter, on its first stage), with that stage's spec."""
    owner: dict[str, str] = {}
    for layer in graph.layers:
        for path in layer.params:
            owner.setdefault(path, layer.name)
    out: dict[str, tuple[int, Spec]] = {}
    for p in graph.parameters:
        if p.arg_index != 0:
            continue
        name = owner.get(p.param_path if p.role == "optimizer_state" and p.param_path
                         else p.path)
        stage = next((s for s in first_replica if name in stages[s].layers), first_replica[0])
        out[p.path] = (stage, layouts[stages[stage].layout].param_specs[p.path])
    return out
