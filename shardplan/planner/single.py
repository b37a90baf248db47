"""``make_plan``: one mesh of one device type here (trace, search meshes, solve, build the
Plan); multi-stage plans (pipelines, several device types) in :mod:`shardplan.planner.multi`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shardplan._gc import gc_paused
from shardplan._version import __version__
from shardplan.cluster import Cluster
from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.memory import MemoryEstimate, estimate_memory
from shardplan.cost.sharding import Spec
from shardplan.cost.step import step_cost
from shardplan.errors import (
    ConfigError,
    InfeasibleError,
    PipelineError,
    ShardplanWarning,
    TraceError,
    format_error,
)
from shardplan.plan import MeshSpec, Plan, Predicted, Stage
from shardplan.planner.alternatives import leaf_alternatives, runner_ups
from shardplan.planner.annotations import (
    annotated_meshes,
    annotation_axes,
    check_annotations,
    leaf_shapes,
    read_annotations,
    tie_periods,
)
from shardplan.planner.config import PlanConfig
from shardplan.planner.decode import decode_constraints, decode_input_specs, placed_analysis
from shardplan.planner.fold import fold_blocks
from shardplan.planner.memory import MemoryPeak, check_state_fits, memory_peaks
from shardplan.planner.mesh import MeshChoice, best_mesh, coarser_meshes
from shardplan.planner.nodes import IntraOpProblem, tie_layers
from shardplan.planner.stamp import stamped
from shardplan.solver import Solution
from shardplan.trace import trace
from shardplan.trace.api import check_leaves
from shardplan.trace.graph import OpGraph

__all__ = ["FINGERPRINT_SAMPLES", "CompiledPeak", "PlanConfig", "check_api_arguments",
           "graph_fingerprint", "plan_step", "step_fingerprint"]


def graph_fingerprint(graph: OpGraph) -> str:
    """A hash of what a plan depends on: the argument leaves (paths, shapes, dtypes), the
    layers, and every equation a plan may address (its path, primitive and result types: the
    runtime pins shardings on equations by path, so a step whose program differs anywhere a
    plan could point, such as a learning-rate schedule of another form, is another step)."""
    h = hashlib.sha256()
    for p in graph.parameters:
        h.update(f"{p.arg_index}/{p.path}:{p.shape}:{p.dtype}:{p.role}\n".encode())
    for layer in graph.layers:
        h.update(f"{layer.name}:{layer.fingerprint}\n".encode())
    tensors = graph.tensors
    h.update("\n".join(
        f"{op.path}:{op.primitive}:"
        + ",".join(f"{tensors[t].shape}{tensors[t].dtype}" for t in op.outputs)
        for op in graph.ops if op.path is not None).encode())
    return h.hexdigest()[:16]


FINGERPRINT_SAMPLES = "fingerprint_samples"
"""The ``plan.solver`` key of the batch size the plan's step was traced at where it is not the
whole batch (a multi-stage plan's layer tables are traced at the reference microbatch):
:func:`step_fingerprint` traces there again."""


def step_fingerprint(train_step: Callable[..., Any], state: Any, batch: Any, /, *,
                     samples: int | None = None) -> tuple[str, OpGraph]:
    """The :func:`graph_fingerprint` of ``train_step`` traced on ``state`` and ``batch`` (or a
    ``samples``-sample slice of it, as a multi-stage plan records), and the graph: what a plan
    was made from, computed the same way at plan time and at check time."""
    from shardplan.planner.multi import batch_size, microbatch_of

    if samples is not None and samples != batch_size(batch):
        batch = microbatch_of(batch, samples)
    graph = trace(train_step, state, batch)
    return graph_fingerprint(graph), graph


def check_api_arguments(caller: str, /, *, cluster: object, config: object = None,
                        cluster_required: bool = True) -> None:
    """Raises a ConfigError naming ``caller``'s argument when ``cluster`` is not an
    :class:`~shardplan.cluster.Cluster` or ``config`` not a :class:`PlanConfig` (or None);
    ``cluster=None`` is accepted only where ``cluster_required`` is false.

    Example:
        >>> try:
        ...     check_api_arguments("make_plan", cluster="local")
        ... except ConfigError as err:
        ...     print(str(err).splitlines()[0])
        make_plan(cluster=) must be an sp.Cluster.
    """
    if not isinstance(cluster, Cluster) and (cluster is not None or cluster_required):
        named = (f" (a cluster file's path: sp.Cluster.from_yaml({cluster!r}))"
                 if isinstance(cluster, str) else "")
        raise ConfigError(format_error(
            f"{caller}(cluster=) must be an sp.Cluster.", where=f"{caller}(cluster=)",
            value=type(cluster).__name__,
            remedy="pass sp.Cluster.local(), sp.Cluster.from_yaml(path) or "
                   "sp.Cluster.from_dict(...)" + ("" if cluster_required else ", or None")
                   + named))
    if config is not None and not isinstance(config, PlanConfig):
        raise ConfigError(format_error(
            f"{caller}(config=) must be an sp.PlanConfig.", where=f"{caller}(config=)",
            value=type(config).__name__,
            remedy="pass sp.PlanConfig(...) (a mapping of options: sp.PlanConfig(**options)) "
                   "or None"))


CompiledPeak = Callable[[Callable[..., Any], Plan, Any, Any], "int | None"]
"""``(train_step, plan, state, batch) -> bytes``: the largest per-device allocation XLA
compiles a plan's programs to (None where the backend reports none). The runtime provides it
(:func:`shardplan.runtime.verify.compiled_peak`); the public ``make_plan``
(:mod:`shardplan.api.wiring`) passes it in, so the planner never imports the runtime."""


@stamped
@gc_paused()  # planning allocates millions of long-lived objects (shardplan._gc)
def plan_step(train_step: Callable[..., Any], state: Any, batch: Any, /, *, cluster: Cluster,
              config: PlanConfig | None = None,
              annotations: Mapping[str, Sequence[Any]] | None = None,
              compiled_peak: CompiledPeak | None = None) -> Plan:
    """Plans ``train_step(state, batch)`` on ``cluster`` as :func:`shardplan.make_plan`
    (:mod:`shardplan.api.wiring`, which documents it) does, with the compiled-memory check
    left to ``compiled_peak``.

    ``compiled_peak`` (None: no check) measures a one-mesh plan whose predicted peak comes
    within :data:`VERIFY_FRACTION` of the budget, on clusters bound to local devices; a plan
    over the budget as compiled makes the search lower the model's budget by the shortfall.
    """
    check_api_arguments("make_plan", cluster=cluster, config=config)
    config = config or PlanConfig()
    check_leaves((state, batch), ("state", "batch"))
    from shardplan.planner.multi import memory_budget

    check_state_fits(state, cluster,
                     [memory_budget(config, g.device.memory_bytes) for g in cluster.groups])
    several = len(cluster.groups) != 1
    fixed = _annotations(state, config, annotations)
    if fixed is not None and (config.pipeline or several):
        raise ConfigError(format_error(
            "PlanConfig(respect_annotations=True) is supported for one-mesh plans so far; this "
            "one would be a multi-stage plan.",
            where=f"cluster {cluster.name!r}, PlanConfig.pipeline={config.pipeline}",
            value=[g.name for g in cluster.groups],
            remedy="plan on one device group with pipeline=None/False, or drop "
                   "respect_annotations"))
    if config.pipeline or (config.pipeline is None and several):
        from shardplan.planner.multi import make_pipeline_plan

        return make_pipeline_plan(train_step, state, batch, cluster=cluster, config=config)
    if several:
        raise PipelineError(format_error(
            "PlanConfig(pipeline=False) asks for one mesh, but the cluster has several device "
            "types (XLA compiles one program for one device type).",
            where=f"cluster {cluster.name!r}", value=[g.name for g in cluster.groups],
            remedy="leave PlanConfig.pipeline at None (stages per device type), or plan on one "
                   "group"))
    graph = trace(train_step, state, batch)
    check_primitives(graph, strict=config.strict)
    plan, choice = _plan_one_mesh(graph, train_step, state, batch, cluster, config, fixed,
                                  compiled_peak)
    # (warned here, not in _plan_one_mesh: the warning's stacklevel points at the caller)
    _warn_time_limit(choice, config)
    return plan


def _plan_one_mesh(graph: OpGraph, train_step: Callable[..., Any], state: Any, batch: Any,
                   cluster: Cluster, config: PlanConfig, fixed: Mapping[str, Spec] | None,
                   compiled_peak: CompiledPeak | None) -> tuple[Plan, MeshChoice]:
    """The one-mesh plan of ``graph`` within the memory budget, and its mesh choice.

    The ILP bounds the arguments; the predicted peak adds the step's intermediates. Where it
    exceeds the budget, the buffers live at the peak become a constraint of their own (a
    cut: the values in whatever sharding the solver picks, the rest as they were), and the
    problem is solved again with every cut so far. Each cut excludes the plan it came from.
    On a cluster bound to local devices, a plan whose predicted peak comes near the budget
    is compiled and XLA's figure checked too. Where the model fell short on a plan, the
    model's budget drops below that plan's prediction, by its shortfall; where nothing fits
    that, it bisects back up towards the failed plan's prediction.

    Raises:
      InfeasibleError: no sharding keeps the peak within the budget.
    """
    group = cluster.groups[0]
    meshes = None
    axes = annotation_axes(fixed or {}, config.axis_rules)
    if fixed is not None and axes:
        meshes = tuple(annotated_meshes(group.device_ids, cluster, axes, fixed,
                                        leaf_shapes(state)))
    from shardplan.planner.multi import memory_budget

    budget = memory_budget(config, group.device.memory_bytes)
    reduce_scatter = group.device.name != "cpu"  # XLA:CPU keeps all-reduce + slice
    cuts: list[MemoryPeak] = []
    peaks: list[float] = []
    model_budget = budget
    infeasible_below = 0.0  # the largest model budget known to have no plan
    failed_at = math.inf  # the smallest prediction of a plan that failed to compile within
    for _ in range(MEMORY_ROUNDS):
        try:
            choice = _search(graph, cluster, config, model_budget, tuple(cuts),
                             meshes=meshes, fixed=fixed)
        except InfeasibleError as err:
            if failed_at == math.inf and not cuts:
                hint = batch_hint(batch, len(group.device_ids))
                if hint:
                    raise InfeasibleError(f"{err}\n  batch: {hint}") from None
                raise
            infeasible_below = model_budget
            if failed_at == math.inf or failed_at - infeasible_below < BISECT_BYTES:
                break
            model_budget = (infeasible_below + failed_at) / 2
            continue
        plan, memory = _build_plan(graph, cluster, config, choice, reduce_scatter=reduce_scatter)
        predicted = memory.peak_bytes
        if predicted > model_budget:
            peaks.append(predicted)
            cuts += memory_peaks(memory, model_budget, len(graph.ops))
            continue
        if compiled_peak is None or cluster.devices is None or (
                predicted < VERIFY_FRACTION * budget):
            return plan, choice
        compiled = compiled_peak(train_step, plan, state, batch)
        if compiled is None or compiled <= budget:
            if compiled is not None:
                plan = dataclasses.replace(plan, solver={**plan.solver,
                                                         "compiled_peak_bytes": compiled})
            return plan, choice
        peaks.append(compiled)
        failed_at = min(failed_at, predicted)
        model_budget = max(predicted - (compiled - budget),
                           (infeasible_below + failed_at) / 2 if infeasible_below else 0.0)
        model_budget = min(model_budget, failed_at - 1.0)
    raise InfeasibleError(format_error(
        "No sharding keeps the peak memory within the budget.",
        where=f"cluster {cluster.name!r}, {len(group.device_ids)} x {group.device.name}",
        value={"budget_bytes": budget, "peak_bytes_of_the_plans_tried": peaks},
        remedy="use more devices, a smaller batch, or raise PlanConfig.memory_budget_bytes "
               "(rematerialisation and microbatching come with the stage planner)"
               + (f"; {hint}" if (hint := batch_hint(batch, len(group.device_ids))) else "")))


def batch_hint(batch: Any, devices: int, /) -> str:
    """Why data parallelism cannot split ``batch`` over all ``devices``, and the nearest batch
    sizes it can (empty when the device count divides the batch).

    A mesh axis shards the batch dimension only where its size divides the batch, so a batch
    of ``B`` samples splits over at most ``gcd(B, devices)`` devices.

    Example:
      >>> import jax
      >>> batch_hint(jax.ShapeDtypeStruct((12, 4), "float32"), 8)[:48]
      'the batch of 12 samples splits over at most 4 of'
    """
    from shardplan.planner.multi import batch_size

    b = batch_size(batch)
    if b % devices == 0:
        return ""
    lower, upper = b // devices * devices, (b // devices + 1) * devices
    sizes = " or ".join(str(s) for s in (lower, upper) if s > 0)
    return (f"the batch of {b} samples splits over at most {math.gcd(b, devices)} of the "
            f"{devices} devices (data parallelism needs a mesh axis size that divides it); "
            f"batch sizes all {devices} devices can share: {sizes} (any multiple of "
            f"{devices})")


def _warn_time_limit(choice: MeshChoice, config: PlanConfig) -> None:
    """Warns that the intra-op solver stopped at ``PlanConfig.time_limit_s`` with a sharding
    further than ``relative_gap`` from its proven lower bound (a sharding within the gap is
    what the config asked for, whatever stopped the solver)."""
    sol = choice.solution
    if sol.status != "feasible" or sol.gap is None or sol.gap <= config.relative_gap:
        return
    # A gap of 100 % or more (bound 0 or none) proves nothing: say so rather than "within 100 %".
    bound = (f"within {100 * sol.gap:.1f} % of a proven lower bound"
             if math.isfinite(sol.gap) and sol.gap < 1.0 else "no lower bound proven")
    warnings.warn(format_error(
        f"The intra-op solver reached its {config.time_limit_s:g} s limit: the sharding is the "
        f"best found, {bound}; not proven optimal.",
        where=f"PlanConfig.time_limit_s (mesh {choice.mesh.axis_names} = "
              f"{choice.mesh.axis_sizes})",
        value=config.time_limit_s,
        remedy="raise PlanConfig.time_limit_s to search longer, or PlanConfig.relative_gap to "
               "accept this gap"), ShardplanWarning, stacklevel=4)


def check_primitives(graph: OpGraph, /, *, strict: bool) -> None:
    """Refuses (``strict``) or warns about the primitives of ``graph`` that have no cost or
    sharding rule (:attr:`OpGraph.unknown_primitives`); planned, they are replicated
    (:func:`shardplan.cost.rules.op_rule`).

    Raises:
      TraceError: ``strict`` and some primitive has no rule (each named with its source line).
    """
    if not graph.unknown_primitives:
        return
    names = "; ".join(f"{p} at {src or 'an unknown line'}" for p, src in graph.unknown_primitives)
    if strict:
        raise TraceError(format_error(
            "The step uses primitives shardplan has no cost or sharding rule for.",
            where=names, value=[p for p, _ in graph.unknown_primitives],
            remedy="pass PlanConfig(strict=False) to plan them replicated (every device "
                   "computes the whole result; their FLOPs are estimated), or add a rule "
                   "for them (shardplan/trace/flops.py and shardplan/cost/rules.py)"))
    warnings.warn(format_error(
        "The step uses primitives shardplan has no cost or sharding rule for; they are "
        "planned replicated (their operands and results on every device).",
        where=names, value=[p for p, _ in graph.unknown_primitives],
        remedy="add a rule for them (shardplan/trace/flops.py and shardplan/cost/rules.py)"),
        ShardplanWarning, stacklevel=2)


MEMORY_ROUNDS = 10
"""Solves with memory cuts (or a model budget lowered by a compiled plan's excess) before
giving up on a memory budget."""

BISECT_BYTES = 65536
"""The model budget's bisection stops when the interval is this narrow."""

VERIFY_FRACTION = 0.5
"""A plan whose predicted peak is at least this fraction of the budget is compiled and its
memory checked, on clusters bound to local devices: the model is within a few per cent on
the plans measured, but XLA's scheduler and partitioner can place buffers it does not model
(before reshards were priced as XLA does them, mixed 2-D plans compiled 30-70 % above it)."""


def _search(graph: OpGraph, cluster: Cluster, config: PlanConfig, budget: float,
            cuts: tuple[MemoryPeak, ...], *, meshes: tuple[LogicalMesh, ...] | None = None,
            fixed: Mapping[str, Spec] | None = None) -> MeshChoice:
    """The best mesh and sharding over the tying periods, the arguments and the cuts within
    the budget (on ``meshes`` if given, with the leaves of ``fixed`` sharded as it says)."""
    group = cluster.groups[0]
    choice: MeshChoice | None = None
    seen: list[object] = []
    others: list[tuple[LogicalMesh, Solution, IntraOpProblem]] = []
    periods = tie_periods(graph, config.tie_periods, fixed) if fixed else config.tie_periods
    for period in periods:
        ties = tie_layers(graph, period) if period else ({}, {})
        if ties in seen:  # e.g. a scanned stack, or too few blocks: the same problem again
            continue
        seen.append(ties)
        # Python-loop blocks are solved once per distinct block (planner.fold).
        fold = fold_blocks(graph, period) if period else None
        candidate = best_mesh(graph, group.device_ids, cluster, max_axes=config.max_mesh_axes,
                              tie_period=period, fold=fold,
                              time_limit_s=config.time_limit_s,
                              relative_gap=config.relative_gap,
                              memory_budget_bytes=budget, memory_peaks=cuts,
                              meshes=meshes, fixed_specs=fixed)
        objective = candidate.solution.objective
        assert objective is not None
        others += candidate.others  # the runner-ups (planner/alternatives.py)
        if choice is None or objective < (choice.solution.objective or float("inf")):
            if choice is not None:
                others.append((choice.mesh, choice.solution, choice.problem))
            choice, choice_period, choice_fold = candidate, period, fold
        else:
            others.append((candidate.mesh, candidate.solution, candidate.problem))
    assert choice is not None
    shapes = {m.axis_sizes for m, _, _ in others} - {choice.mesh.axis_sizes}
    if meshes is None and len(shapes) < RUNNER_UPS:
        # Too few other meshes were worth solving to choose: solve simpler ones for the
        # runner-ups (never chosen: their refinement holds every plan they have).
        coarse = [m for m in coarser_meshes(group.device_ids, cluster,
                                            max_axes=config.max_mesh_axes)
                  if m.axis_sizes not in shapes][:RUNNER_UPS - len(shapes)]
        if coarse:
            try:
                extra = best_mesh(graph, group.device_ids, cluster, tie_period=choice_period,
                                  fold=choice_fold,
                                  time_limit_s=config.time_limit_s,
                                  relative_gap=config.relative_gap,
                                  memory_budget_bytes=budget, memory_peaks=cuts,
                                  meshes=coarse, fixed_specs=fixed)
                others += [(extra.mesh, extra.solution, extra.problem), *extra.others]
            except InfeasibleError:
                pass  # no plan fits on the simpler meshes: nothing to show
    return dataclasses.replace(choice, others=tuple(others))


RUNNER_UPS = 2
"""Other mesh shapes a one-mesh plan reports as runner-ups (``plan.explain()``)."""


def _annotations(state: Any, config: PlanConfig,
                 annotations: Mapping[str, Sequence[Any]] | None) -> dict[str, Spec] | None:
    """The checked annotations to plan with (None: ``respect_annotations`` is off)."""
    if not config.respect_annotations:
        if annotations is not None:
            raise ConfigError(format_error(
                "make_plan got annotations= but PlanConfig.respect_annotations is False.",
                where="make_plan(annotations=...)", value=len(annotations),
                remedy="pass PlanConfig(respect_annotations=True), or no annotations"))
        return None
    if annotations is None:
        annotations = read_annotations(state, rules=config.axis_rules or None)
    return check_annotations(annotations, leaf_shapes(state))


def _build_plan(graph: OpGraph, cluster: Cluster, config: PlanConfig, choice: MeshChoice, *,
                reduce_scatter: bool) -> tuple[Plan, MemoryEstimate]:
    """The plan of a solved choice, and its per-device memory estimate."""
    mesh = choice.mesh
    specs = decode_input_specs(choice.problem, choice.solution)
    constraints = decode_constraints(graph, choice.problem, choice.solution)
    analysis = placed_analysis(graph, choice.problem, choice.solution,
                               reduce_scatter=reduce_scatter)
    cost = step_cost(graph, analysis, cluster)
    # apply_plan donates the state: new state leaves reuse the old ones' buffers.
    memory = estimate_memory(graph, lambda t: analysis.local_bytes(graph, t), donated=True,
                             collectives=analysis.collectives)
    sol = choice.solution
    plan = Plan(
        shardplan_version=_version(),
        graph_fingerprint=graph_fingerprint(graph),
        cluster_hash=cluster.content_hash(),
        config_hash=config.content_hash(),
        stages=(Stage(index=0, device_type=cluster.groups[0].device.name,
                      mesh=MeshSpec(mesh.axis_names, mesh.axis_sizes, mesh.device_ids),
                      layers=tuple(layer.name for layer in graph.layers)),),
        param_specs={p.path: (0, specs[p.tensor]) for p in graph.parameters if p.arg_index == 0},
        batch_specs={p.path: specs[p.tensor] for p in graph.parameters if p.arg_index == 1},
        constraints={"/".join(map(str, path)): (0, results, operands)
                     for path, (_, results, operands) in constraints.items()},
        predicted=Predicted(step_time_s=cost.step_time_s, compute_s=cost.compute_s,
                            communication_s=cost.communication_s,
                            memory_bytes={d: memory.peak_bytes for d in mesh.device_ids},
                            collectives=cost.collectives,
                            stage_flops=(cost.per_device_flops,)),
        solver={"status": sol.status, "objective_s": sol.objective, "gap": sol.gap,
                "variables": sol.stats.get("variables"),
                "mesh_candidates": [[list(shape), obj] for shape, obj in choice.candidates],
                "runner_ups": runner_ups(graph, cluster, choice, step_time_s=cost.step_time_s,
                                         peak_bytes=memory.peak_bytes,
                                         reduce_scatter=reduce_scatter),
                "alternatives": leaf_alternatives(graph, choice.problem, sol)},
    )
    return plan, memory


def _version() -> str:
    return __version__
