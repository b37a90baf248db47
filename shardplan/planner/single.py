"""``make_plan`` for one mesh of one device type: trace, search meshes, solve, build the Plan.

Multi-stage (pipelined, heterogeneous) plans are the stage planner's job; on a cluster with
several device types this module refuses with a clear error rather than ignoring devices.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Any

from shardplan.cluster import Cluster
from shardplan.cost.memory import MemoryEstimate, estimate_memory
from shardplan.cost.sharding import analyze_sharding, leaf_specs
from shardplan.cost.step import step_cost
from shardplan.errors import InfeasibleError, PipelineError, format_error
from shardplan.plan import MeshSpec, Plan, Predicted, Stage
from shardplan.planner.intraop import decode_constraints, decode_input_specs, tie_layers
from shardplan.planner.mesh import MeshChoice, best_mesh
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
    """

    memory_budget_bytes: float | None = None
    time_limit_s: float = 30.0
    relative_gap: float = 0.01
    tie_periods: tuple[int, ...] = (1, 2)
    max_mesh_axes: int = 2

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
    """Plans ``train_step(state, batch)`` on ``cluster`` (one device type) without running it.

    Args:
      train_step: ``(state, batch) -> (state, metrics)``.
      state: the state pytree (arrays or ``ShapeDtypeStruct``s).
      batch: the batch pytree.
      cluster: the cluster; its single device group is laid out as a mesh.
      config: planning options.

    Returns:
      A single-stage :class:`~shardplan.plan.Plan`.

    Raises:
      PipelineError: the cluster has several device types (multi-stage plans are not built
        here yet).
    """
    config = config or PlanConfig()
    if len(cluster.groups) != 1:
        raise PipelineError(format_error(
            "This planner builds single-mesh plans; the cluster has several device types.",
            where=f"cluster {cluster.name!r}", value=[g.name for g in cluster.groups],
            remedy="plan on one group (Cluster.local(devices=...) or a one-group YAML); "
                   "heterogeneous pipeline plans come with the stage planner"))
    graph = trace(train_step, state, batch)
    group = cluster.groups[0]
    budget = config.memory_budget_bytes or float(group.device.memory_bytes)
    reduce_scatter = group.device.name != "cpu"  # XLA:CPU keeps all-reduce + slice
    # The ILP bounds what the arguments hold; the predicted peak adds the step's temporaries.
    # Where the peak exceeds the budget, the arguments' bound is cut by the excess and the
    # problem solved again (the temporaries barely move when arguments are sharded further).
    argument_budget = budget
    peaks: list[float] = []
    for _ in range(MEMORY_ROUNDS):
        choice = _search(graph, cluster, config, argument_budget)
        plan, memory = _build_plan(graph, cluster, config, choice, reduce_scatter=reduce_scatter)
        peak = memory.peak_bytes
        if peak <= budget:
            return plan
        peaks.append(peak)
        argument_budget = min(argument_budget, memory.argument_bytes - (peak - budget))
        if argument_budget <= 0:
            break
    raise InfeasibleError(format_error(
        "No sharding keeps the predicted peak memory within the budget.",
        where=f"cluster {cluster.name!r}, {len(group.device_ids)} x {group.device.name}",
        value={"budget_bytes": budget, "predicted_peak_bytes": peaks},
        remedy="use more devices, a smaller batch, or raise PlanConfig.memory_budget_bytes "
               "(rematerialisation and microbatching come with the stage planner)"))


MEMORY_ROUNDS = 6
"""Solves with a tightened argument budget before giving up on a memory budget."""


def _search(graph: OpGraph, cluster: Cluster, config: PlanConfig,
            argument_budget: float) -> MeshChoice:
    """The best mesh and sharding over the tying periods, arguments within the budget."""
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
                              memory_budget_bytes=argument_budget)
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
    ins, outs = leaf_specs(graph, mesh, lambda p: specs[p.tensor])
    # The prediction places every op as the solver decided (the runtime pins the deciding ops;
    # the others follow them); values built from constants are left to propagation.
    pinned, factors = dict(ins), {}
    ip, assignment = choice.problem, choice.solution.assignment or ()
    for op in graph.ops:
        if any(t in ip.free_tensors for t in op.outputs):
            continue
        strategy = ip.strategies[ip.op_nodes[op.id]][assignment[ip.op_nodes[op.id]]]
        factors[op.id] = strategy.factors
        pinned.update(zip(op.outputs, strategy.result_specs, strict=True))
    analysis = analyze_sharding(graph, mesh, pinned, outs, reduce_scatter=reduce_scatter,
                                op_factors=factors)
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
