"""``make_plan``: one mesh of one device type here (trace, search meshes, solve, build the
Plan); multi-stage plans (pipelines, several device types) in :mod:`shardplan.planner.multi`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from typing import Any, Literal

from shardplan.cluster import Cluster
from shardplan.cost.memory import MemoryEstimate, estimate_memory
from shardplan.cost.step import step_cost
from shardplan.errors import ConfigError, InfeasibleError, PipelineError, format_error
from shardplan.plan import MeshSpec, Plan, Predicted, Stage
from shardplan.planner.decode import decode_constraints, decode_input_specs, placed_analysis
from shardplan.planner.intraop import tie_layers
from shardplan.planner.memory import MemoryPeak, memory_peaks
from shardplan.planner.mesh import MeshChoice, best_mesh
from shardplan.solver.pipeline import REMATS, SCHEDULES, Remat, Schedule
from shardplan.trace import trace
from shardplan.trace.graph import OpGraph

__all__ = ["PlanConfig", "graph_fingerprint", "make_plan"]


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """Options of :func:`make_plan`.

    Attributes:
      memory_budget_bytes: per-device bytes the state and batch may take (None: the device's
        memory).
      time_limit_s: the solver's limit per candidate mesh.
      relative_gap: accept a sharding whose predicted cost is within this fraction of the
        proven optimum (the LP bound); 1 % by default, above the 0.1 % tie-breaking salt.
      tie_periods: layer-tying periods to try (1: every block alike; 2: alternating pairs).
      max_mesh_axes: most logical mesh axes (see :mod:`shardplan.planner.mesh`; 3 makes
        the problem about 17 times larger).
      memory_headroom: the fraction of each device's memory kept free (for the framework,
        fragmentation and what the model does not see) when ``memory_budget_bytes`` is None.
      pipeline: ``None``: multi-stage plans (the stage planner) on clusters with several device
        types, one mesh otherwise; ``True``: the stage planner on any cluster; ``False``: one
        mesh (refused on clusters with several device types).
      microbatch_sizes: candidate microbatch sizes in samples (empty: the powers of two that
        divide the batch, and the batch); stage planner only.
      schedules: pipeline schedules to consider (``gpipe``, ``1f1b``, ``interleaved``).
      remats: rematerialisation policies to consider per stage (``none``, ``selective``,
        ``full``).
      chunks: model chunks per stage the interleaved schedule may use.
      max_stages: most stages per replica (0: no limit).
      objective: ``"time"`` (minimum step time) or ``"cost"`` (minimum dollars per step at
        the catalog's prices, subject to ``min_throughput``).
      min_throughput: the cost objective's floor in samples per second.
      reference_microbatch: the microbatch size (samples) the layer cost tables are solved
        at; inside a stage the batch is then not split (data parallelism runs across
        replicas).
      stage_time_limit_s: the stage planner's budget: past it, the best plan found so far is
        returned with a proven lower bound (``plan.solver["status"] == "feasible"``, a
        :class:`~shardplan.errors.ShardplanWarning` gives the gap); small problems finish
        within it, proven optimal.
      stage_work_limit: the stage planner's work budget (labels, states and sweep steps;
        0, the default: none). A search cut by it returns the same plan on any machine
        under any load (a search cut by the clock may not); the time limit stays the
        safety net.
    """

    memory_budget_bytes: float | None = None
    time_limit_s: float = 30.0
    relative_gap: float = 0.01
    tie_periods: tuple[int, ...] = (1, 2)
    max_mesh_axes: int = 2
    memory_headroom: float = 0.1
    pipeline: bool | None = None
    microbatch_sizes: tuple[int, ...] = ()
    schedules: tuple[Schedule, ...] = SCHEDULES
    remats: tuple[Remat, ...] = REMATS
    chunks: tuple[int, ...] = (2,)
    max_stages: int = 0
    objective: Literal["time", "cost"] = "time"
    min_throughput: float = 0.0
    reference_microbatch: int = 1
    stage_time_limit_s: float = 2.5
    stage_work_limit: int = 0

    def __post_init__(self) -> None:
        checks = [
            ("memory_headroom", 0.0 <= self.memory_headroom < 1.0, "a fraction in [0, 1)"),
            ("objective", self.objective in ("time", "cost"), "'time' or 'cost'"),
            ("schedules", bool(self.schedules) and set(self.schedules) <= set(SCHEDULES),
             f"a non-empty subset of {SCHEDULES}"),
            ("remats", bool(self.remats) and set(self.remats) <= set(REMATS),
             f"a non-empty subset of {REMATS}"),
            ("chunks", all(isinstance(c, int) and c >= 2 for c in self.chunks),
             "integers >= 2"),
            ("microbatch_sizes", all(isinstance(m, int) and m >= 1
                                     for m in self.microbatch_sizes), "positive integers"),
            ("max_stages", isinstance(self.max_stages, int) and self.max_stages >= 0,
             "an integer >= 0"),
            ("min_throughput", self.min_throughput >= 0, "a number >= 0"),
            ("reference_microbatch", isinstance(self.reference_microbatch, int)
             and self.reference_microbatch >= 1, "an integer >= 1"),
            ("stage_time_limit_s", self.stage_time_limit_s > 0, "a number of seconds > 0"),
            ("stage_work_limit", isinstance(self.stage_work_limit, int)
             and self.stage_work_limit >= 0, "an integer >= 0"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ConfigError(format_error(
                    f"PlanConfig.{name} must be {want}.", where=f"PlanConfig.{name}",
                    value=getattr(self, name), remedy=f"pass {want}"))

    def content_hash(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def graph_fingerprint(graph: OpGraph) -> str:
    """A hash of what a plan depends on: argument leaves (paths, shapes, dtypes) and layers."""
    h = hashlib.sha256()
    for p in graph.parameters:
        h.update(f"{p.arg_index}/{p.path}:{p.shape}:{p.dtype}:{p.role}\n".encode())
    for layer in graph.layers:
        h.update(f"{layer.name}:{layer.fingerprint}\n".encode())
    return h.hexdigest()[:16]


def make_plan(train_step: Callable[..., Any], state: Any, batch: Any, /, *, cluster: Cluster,
              config: PlanConfig | None = None) -> Plan:
    """Plans ``train_step(state, batch)`` on ``cluster`` without running it.

    On a cluster of one device type (and ``PlanConfig.pipeline`` not ``True``): one mesh over
    all its devices, every op's sharding chosen by the intra-op ILP. With several device types
    (or ``pipeline=True``): a multi-stage plan from the stage planner
    (:func:`shardplan.planner.multi.make_pipeline_plan`): data-parallel replicas of pipeline
    stages, each stage on a sub-mesh of one device type, with microbatches, schedule and remat.

    Args:
      train_step: ``(state, batch) -> (state, metrics)``.
      state: the state pytree (arrays or ``ShapeDtypeStruct``s).
      batch: the batch pytree (every leaf's leading axis is the samples).
      cluster: the cluster.
      config: planning options.

    Returns:
      The :class:`~shardplan.plan.Plan`.

    Raises:
      InfeasibleError: no plan fits the devices' memory (the message gives the per-device
        lower bound and, per device type, the fewest devices that would hold the model).
      PipelineError: ``pipeline=False`` on a cluster with several device types.
    """
    config = config or PlanConfig()
    several = len(cluster.groups) != 1
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
    group = cluster.groups[0]
    from shardplan.planner.multi import memory_budget

    budget = memory_budget(config, group.device.memory_bytes)
    reduce_scatter = group.device.name != "cpu"  # XLA:CPU keeps all-reduce + slice
    # The ILP bounds the arguments; the predicted peak adds the step's intermediates. Where it
    # exceeds the budget, the buffers live at the peak become a constraint of their own (a
    # cut: the values in whatever sharding the solver picks, the rest as they were), and the
    # problem is solved again with every cut so far. Each cut excludes the plan it came from.
    # On a cluster bound to local devices, a plan whose predicted peak comes near the budget
    # is compiled and XLA's figure checked too. Where the model fell short on a plan, the
    # model's budget drops below that plan's prediction, by its shortfall; where nothing fits
    # that, it bisects back up towards the failed plan's prediction.
    cuts: list[MemoryPeak] = []
    peaks: list[float] = []
    model_budget = budget
    infeasible_below = 0.0  # the largest model budget known to have no plan
    failed_at = math.inf  # the smallest prediction of a plan that failed to compile within
    for _ in range(MEMORY_ROUNDS):
        try:
            choice = _search(graph, cluster, config, model_budget, tuple(cuts))
        except InfeasibleError:
            if failed_at == math.inf and not cuts:
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
        if cluster.devices is None or predicted < VERIFY_FRACTION * budget:
            return plan
        compiled = _compiled_peak(train_step, plan, state, batch)
        if compiled is None or compiled <= budget:
            if compiled is not None:
                plan = dataclasses.replace(plan, solver={**plan.solver,
                                                         "compiled_peak_bytes": compiled})
            return plan
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
               "(rematerialisation and microbatching come with the stage planner)"))


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


def _compiled_peak(train_step: Callable[..., Any], plan: Plan, state: Any,
                   batch: Any) -> int | None:
    """The largest per-device allocation XLA compiles the plan's programs to."""
    from shardplan.runtime.verify import compiled_memory

    reports = [r for r in compiled_memory(train_step, plan, state, batch) if r is not None]
    return max((r.peak_bytes for r in reports), default=None)


def _search(graph: OpGraph, cluster: Cluster, config: PlanConfig, budget: float,
            cuts: tuple[MemoryPeak, ...]) -> MeshChoice:
    """The best mesh and sharding over the tying periods, the arguments and the cuts within
    the budget."""
    group = cluster.groups[0]
    choice: MeshChoice | None = None
    seen: list[object] = []
    for period in config.tie_periods:
        ties = tie_layers(graph, period) if period else ({}, {})
        if ties in seen:  # e.g. a scanned stack, or too few blocks: the same problem again
            continue
        seen.append(ties)
        candidate = best_mesh(graph, group.device_ids, cluster, max_axes=config.max_mesh_axes,
                              tie_period=period,
                              time_limit_s=config.time_limit_s,
                              relative_gap=config.relative_gap,
                              memory_budget_bytes=budget, memory_peaks=cuts)
        objective = candidate.solution.objective
        assert objective is not None
        if choice is None or objective < (choice.solution.objective or float("inf")):
            choice = candidate
    assert choice is not None
    return choice


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
                            collectives=cost.collectives),
        solver={"status": sol.status, "objective_s": sol.objective, "gap": sol.gap,
                "variables": sol.stats.get("variables"),
                "mesh_candidates": [[list(shape), obj] for shape, obj in choice.candidates]},
    )
    return plan, memory


def _version() -> str:
    import shardplan

    return shardplan.__version__
