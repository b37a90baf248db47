"""What a single-mesh plan's search weighed, for :meth:`~shardplan.plan.Plan.explain`: the
runner-up meshes and, per state leaf, the other shardings of its solver node.

Both are written into ``Plan.solver`` as JSON-native values (``runner_ups`` and
``alternatives``, the latter by :func:`alternatives_record`; the layout is described in
:mod:`shardplan.viz.explain`, which reads them) from what the search already solved: no
problem is solved again.

* **Runner-ups** are the other candidate meshes :func:`~shardplan.planner.mesh.best_mesh`
  solved (the best solution per mesh shape over the tying periods), each priced as the plan is
  (:func:`~shardplan.cost.step.step_cost` of its placed sharding, the memory estimate of
  :func:`~shardplan.cost.memory.estimate_memory`), so their figures compare with
  ``plan.predicted``.
* **Alternatives** of a leaf are the other strategies of its node in the chosen mesh's solved
  problem, each with the change of the problem's objective (seconds) and of its per-device peak
  memory when the node, and the nodes bound to it by follower constraints (its optimizer state,
  the ops that follow it), take the alternative *with every other choice kept*, except the ops
  that could then no longer read it (an in-place read, such as the optimizer update reading
  the state, forbids a resharded operand): those are re-chosen at their cheapest
  (:func:`alternative`). The figures are the problem's own cost terms, as
  :func:`~shardplan.solver.intraop.evaluate.evaluate` adds them.

A pipeline plan also records, per device type it leaves unused, the best plan that uses it
(:func:`unused_types`): the one place here that searches again, within a share of the stage
planner's limits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from shardplan._format import key_pattern, stage_runs, starred_values
from shardplan.cluster import Cluster
from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.memory import estimate_memory
from shardplan.cost.step import step_cost
from shardplan.errors import InfeasibleError, SolverError
from shardplan.plan.plan import Spec
from shardplan.planner.decode import placed_analysis
from shardplan.planner.mesh import MeshChoice
from shardplan.planner.nodes import IntraOpProblem
from shardplan.solver import Solution
from shardplan.solver.intraop.problem import Problem
from shardplan.solver.stages.pipeline import PipelinePlan, PipelineProblem, sync_link
from shardplan.solver.stages.portfolio import PipelineChoice
from shardplan.solver.stages.search import infeasibility_report, solve_pipeline
from shardplan.trace.graph import OpGraph

__all__ = [
    "BASIS",
    "LAYOUT_BASIS",
    "MAX_REPAIRS",
    "RUNNER_UPS",
    "USING_SHARE",
    "LocalCosts",
    "alternative",
    "alternatives_record",
    "change",
    "leaf_alternatives",
    "node_groups",
    "pipeline_runner_ups",
    "runner_ups",
    "unused_types",
]

RUNNER_UPS = 3
"""Most runner-up meshes a plan records."""

BASIS = ("Δ: the change of the solver's objective (seconds per step) and of the peak bytes per "
         "device if this leaf alone (with the layers tied to it and its optimizer state) took "
         "the alternative, every other choice kept but for the ops that must then read it "
         "another way (re-chosen at their cheapest).")
"""How :func:`leaf_alternatives` computes its changes, for the reader of ``explain``."""

LAYOUT_BASIS = ("Δ, per device of this layout's stages: the change of its intra-op problem's "
                "objective (seconds per reference microbatch, not per pipeline step) and of its "
                "peak bytes if this leaf alone (with the layers tied to it and its optimizer "
                "state) took the alternative, every other choice kept but for the ops that must "
                "then read it another way (re-chosen at their cheapest).")
"""The basis of a multi-stage plan's per-layout alternatives (the layer cost tables' problems,
solved at the reference microbatch)."""


def runner_ups(graph: OpGraph, cluster: Cluster, choice: MeshChoice, *, step_time_s: float,
               peak_bytes: float, reduce_scatter: bool) -> list[dict[str, Any]]:
    """The best other meshes of the search, at most :data:`RUNNER_UPS`, fastest first (meshes
    without a solution last), each with its predicted step time, peak bytes per device and
    why it lost.

    Args:
      graph: the traced step.
      cluster: the cluster.
      choice: the search's choice, with the other candidates it solved (``choice.others``).
      step_time_s: the chosen plan's predicted step time.
      peak_bytes: the chosen plan's predicted peak bytes per device.
      reduce_scatter: as the plan was priced.
    """
    best: dict[tuple[tuple[str, ...], tuple[int, ...]],
               tuple[LogicalMesh, Solution, IntraOpProblem]] = {}
    for mesh, solution, ip in choice.others:
        key = (mesh.axis_names, mesh.axis_sizes)
        if key == (choice.mesh.axis_names, choice.mesh.axis_sizes):
            continue  # the chosen mesh under another layer tying: not another mesh
        kept = best.get(key)
        if kept is None or _objective(solution) < _objective(kept[1]):
            best[key] = (mesh, solution, ip)
    budget = choice.problem.problem.memory_budget_bytes
    rows = []
    for mesh, solution, ip in best.values():
        row: dict[str, Any] = {"mesh": {"axis_names": list(mesh.axis_names),
                                        "axis_sizes": list(mesh.axis_sizes)},
                               "status": solution.status, "objective_s": solution.objective,
                               "step_time_s": None, "memory_bytes": None}
        if solution.assignment is None:
            row["reason"] = ("no sharding fits the memory budget" if solution.status ==
                             "infeasible" else "no solution within the solver's time limit")
            rows.append(row)
            continue
        analysis = placed_analysis(graph, ip, solution, reduce_scatter=reduce_scatter)
        cost = step_cost(graph, analysis, cluster)
        memory = estimate_memory(graph, functools.partial(analysis.local_bytes, graph),
                                 donated=True, collectives=analysis.collectives)
        row["step_time_s"] = cost.step_time_s
        row["memory_bytes"] = memory.peak_bytes
        row["reason"] = _reason(cost.step_time_s, memory.peak_bytes, solution, choice,
                                step_time_s=step_time_s, peak_bytes=peak_bytes, budget=budget)
        rows.append(row)
    rows.sort(key=lambda r: (r["step_time_s"] is None, r["step_time_s"] or 0.0,
                             r["objective_s"] or 0.0))
    return rows[:RUNNER_UPS]


def _objective(solution: Solution) -> float:
    return math.inf if solution.objective is None else solution.objective


def _reason(step_s: float, peak: float, solution: Solution, choice: MeshChoice, *,
            step_time_s: float, peak_bytes: float, budget: float | None) -> str:
    if budget is not None and peak > budget >= peak_bytes:
        return f"over the memory budget ({peak / 2**30:,.2f} > {budget / 2**30:,.2f} GiB)"
    if step_s > step_time_s:
        return f"slower by {100 * (step_s / step_time_s - 1):.1f} %" if step_time_s > 0 else (
            "slower")
    # Priced as the plan is, it is not slower: the search ranks meshes by its objective.
    ours = choice.solution.objective or 0.0
    theirs = solution.objective or 0.0
    more = f" (+{100 * (theirs / ours - 1):.2g} %)" if ours > 0 else ""
    return f"higher solver objective{more}"


def node_groups(problem: Problem) -> dict[int, tuple[int, ...]]:
    """``{node: the nodes that must pick its strategy index}``: the node's follower tree
    (its leader's leader ..., and everything that follows any of them)."""
    leader = {f.node: f.leader for f in problem.followers}

    def root(n: int) -> int:
        seen = set()
        while n in leader and n not in seen:
            seen.add(n)
            n = leader[n]
        return n

    members: dict[int, list[int]] = {}
    roots = [root(n) for n in range(len(problem.nodes))]
    for n, r in enumerate(roots):
        members.setdefault(r, []).append(n)
    return {n: tuple(members[r]) for n, r in enumerate(roots)}


class LocalCosts:
    """A problem's costs around one node group at a time: what :func:`alternative` needs to
    move a group and repair its neighbours without summing the whole objective."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.groups = node_groups(problem)
        self.incident: dict[int, list[int]] = {}
        for k, e in enumerate(problem.edges):
            self.incident.setdefault(e.src, []).append(k)
            self.incident.setdefault(e.dst, []).append(k)
        self.steps = problem.memory_steps()

    def edge_cost(self, k: int, assignment: Sequence[int]) -> float:
        e = self.problem.edges[k]
        return e.cost[assignment[e.src] * self.problem.nodes[e.dst].num_strategies
                      + assignment[e.dst]]

    def group_cost(self, group: Sequence[int], assignment: Sequence[int]
                   ) -> tuple[int, float]:
        """The group's node costs and the costs of every edge touching it: how many are
        infinite (forbidden), and the sum of the others."""
        nodes = self.problem.nodes
        edges = {k for n in group for k in self.incident.get(n, ())}
        terms = [*(nodes[n].compute_cost[assignment[n]]
                   + nodes[n].communication_cost[assignment[n]] for n in group),
                 *(self.edge_cost(k, assignment) for k in edges)]
        finite = [t for t in terms if math.isfinite(t)]
        return len(terms) - len(finite), math.fsum(finite)

    def broken(self, group: Sequence[int], assignment: Sequence[int]) -> list[int]:
        """Nodes on the other end of the group's edges whose pair is forbidden."""
        out = []
        for n in group:
            for k in self.incident.get(n, ()):
                if math.isinf(self.edge_cost(k, assignment)):
                    e = self.problem.edges[k]
                    out.append(e.dst if e.src == n else e.src)
        return out


def alternative(local: LocalCosts, chosen: Sequence[int], node: int, strategy: int) -> list[int]:
    """The assignment in which ``node``'s group takes ``strategy``: every other choice kept,
    except where a pair becomes forbidden (an op that must read a value in place, such as the
    optimizer update reading the state): the node group on the other end is re-chosen with
    everything around it fixed (fewest forbidden pairs, then cheapest), and so on outwards
    from the groups that change, at most :data:`MAX_REPAIRS` times. Where a forbidden pair
    remains, the assignment stays infeasible (an infinite objective)."""
    after = list(chosen)
    moved = local.groups[node]
    for n in moved:
        after[n] = strategy
    pinned = set(moved)
    queue = local.broken(moved, after)
    repairs = 0
    while queue and repairs < MAX_REPAIRS:
        group = local.groups[queue.pop(0)]
        if pinned.intersection(group) or not local.broken(group, after):
            continue
        repairs += 1
        width = local.problem.nodes[group[0]].num_strategies
        costs = []
        for s in range(width):
            for n in group:
                after[n] = s
            costs.append(local.group_cost(group, after))
        best = min(range(width), key=lambda s: (costs[s], s != chosen[group[0]]))
        for n in group:
            after[n] = best
        queue += local.broken(group, after)
    return after


MAX_REPAIRS = 64
"""Most re-choices of neighbouring node groups :func:`alternative` makes for one
alternative (a group may be re-chosen again when a later repair breaks one of its pairs)."""


def change(local: LocalCosts, chosen: Sequence[int], after: Sequence[int],
           base_live: Sequence[float]) -> tuple[float, float, bool]:
    """``(objective change, peak bytes change, feasible)`` from ``chosen`` to ``after``: the
    terms :func:`~shardplan.solver.intraop.evaluate.evaluate` adds (node compute and communication,
    edge resharding), over the changed nodes and their edges only; the peak over the
    problem's memory steps; feasible when no cost is infinite, no alias pair is forbidden and
    (hard budget) the peak fits."""
    problem = local.problem
    nodes = problem.nodes
    changed = [n for n in range(len(after)) if after[n] != chosen[n]]
    delta = math.fsum(
        nodes[n].compute_cost[after[n]] + nodes[n].communication_cost[after[n]]
        - nodes[n].compute_cost[chosen[n]] - nodes[n].communication_cost[chosen[n]]
        for n in changed)
    for k in sorted({k for n in changed for k in local.incident.get(n, ())}):
        delta += local.edge_cost(k, after) - local.edge_cost(k, chosen)
    live = [cut.value(after) for cut in local.steps]
    if live:
        memory = max(live) - max(base_live)
    else:
        memory = math.fsum(nodes[n].memory_bytes[after[n]] - nodes[n].memory_bytes[chosen[n]]
                           for n in changed)
    budget = problem.memory_budget_bytes
    feasible = math.isfinite(delta) and not (
        live and budget is not None and problem.memory_mode == "hard" and max(live) > budget)
    for alias in problem.aliases:
        width = nodes[alias.b].num_strategies
        feasible = feasible and alias.allowed[after[alias.a] * width + after[alias.b]] != 0
    return delta, memory, feasible


def _spec_json(spec: Spec) -> list[list[str]]:
    return [list(dim) for dim in spec]


def alternatives_record(entries: Mapping[Any, Mapping[str, Any]],
                        leaves: Mapping[str, Sequence[tuple[Any, str]]], *,
                        basis: str = "") -> dict[str, Any]:
    """The JSON-native ``alternatives`` record (:mod:`shardplan.viz.explain` describes it).

    Args:
      entries: per group key, ``{"chosen": spec, "options": [(spec, delta_step_s or None,
        delta_memory_bytes, feasible), ...]}``.
      leaves: per key pattern, ``(group key, ",".join(starred values))`` of each leaf.
      basis: how the changes were computed, for the reader.
    """
    index = {key: i for i, key in enumerate(entries)}
    groups = []
    for entry in entries.values():
        options = sorted(entry["options"], key=lambda o: (not o[3], o[1] is None,
                                                          o[1] or 0.0, o[2]))
        groups.append({"chosen": _spec_json(entry["chosen"]),
                       "options": [[_spec_json(s), d, round(m) if math.isfinite(m)
                                    else None, bool(ok)] for s, d, m, ok in options]})
    by_pattern: dict[str, Any] = {}
    for pattern, members in leaves.items():
        distinct = list(dict.fromkeys(index[key] for key, _ in members))
        if len(distinct) == 1:
            by_pattern[pattern] = distinct[0]
        else:
            by_pattern[pattern] = [[g, [v for key, v in members if index[key] == g]]
                                   for g in distinct]
    return {"basis": basis, "groups": groups, "leaves": by_pattern}


def leaf_alternatives(graph: OpGraph, ip: IntraOpProblem, solution: Solution, *,
                      basis: str = BASIS) -> dict[str, Any]:
    """Per state leaf, the other strategies of its node with their cost and memory changes
    (see the module docstring and :func:`alternative`), grouped so that leaves sharing a node
    group (tied layers, a parameter and its optimizer state) share one entry: the
    ``alternatives`` record (:func:`alternatives_record`)."""
    chosen = solution.assignment
    if chosen is None:
        raise ValueError("the solution has no assignment")
    local = LocalCosts(ip.problem)
    base_live = [cut.value(chosen) for cut in local.steps]
    entries: dict[tuple[int, ...], dict[str, Any]] = {}
    leaves: dict[str, list[tuple[tuple[int, ...], str]]] = {}
    for p in graph.parameters:
        if p.arg_index != 0:
            continue
        n = ip.input_nodes[p.tensor]
        key = local.groups[n]
        if key not in entries:
            strategies = ip.strategies[n]
            options = []
            for k, strategy in enumerate(strategies):
                if k == chosen[n]:
                    continue
                delta, memory, feasible = change(local, chosen, alternative(local, chosen, n, k),
                                                 base_live)
                options.append((strategy.result_specs[0],
                                delta if math.isfinite(delta) else None, memory, feasible))
            entries[key] = {"chosen": strategies[chosen[n]].result_specs[0],
                            "options": options}
        leaves.setdefault(key_pattern(p.path), []).append((key, ",".join(starred_values(p.path))))
    return alternatives_record(entries, leaves, basis=basis)


def pipeline_runner_ups(choice: PipelineChoice, device_types: Sequence[str]
                        ) -> list[dict[str, Any]]:
    """The stage planner's other final candidates (:mod:`shardplan.solver.stages.portfolio`: the
    search's plan and the data-parallel and Megatron seeds), at most :data:`RUNNER_UPS`,
    fastest first: each with its configuration, closed-form step time (the scale of
    ``plan.predicted.step_time_s``), simulated step time, peak bytes per device and why it
    lost. Nothing is solved again."""
    chosen = choice.evaluation.step_time_s
    chosen_sim = choice.simulation.step_time_s if choice.simulation else None
    rows: list[dict[str, Any]] = []
    for c in choice.candidates:
        if c.plan == choice.plan:
            continue
        ev, sim = c.evaluation, c.simulation
        simulated = sim.step_time_s if sim else None
        if ev.violations:
            reason = f"infeasible: {ev.violations[0]}"
        elif ev.step_time_s > chosen:
            reason = f"slower by {100 * (ev.step_time_s / chosen - 1):.1f} %"
        elif simulated is not None and chosen_sim is not None and simulated > chosen_sim:
            reason = f"slower in the simulator by {100 * (simulated / chosen_sim - 1):.1f} %"
        else:
            reason = "not better by the planner's objective"
        rows.append({"name": c.name, "config": _pipeline_config(c.plan, device_types),
                     "step_time_s": ev.step_time_s, "simulated_step_s": simulated,
                     "memory_bytes": max((m for r in ev.memory_bytes for m in r), default=0.0),
                     "reason": reason})
    rows.sort(key=lambda r: r["step_time_s"])
    return rows[:RUNNER_UPS]


def _pipeline_config(plan: PipelinePlan, device_types: Sequence[str]) -> str:
    """``"4 x [a100-80g 8 + v100-32g 8]; 16 mb of 2, 1f1b, remat none"``: identical
    replicas once (the format of :func:`shardplan.viz.explain.pipeline_label`)."""
    shapes: dict[str, int] = {}
    for r in plan.replicas:
        shape = stage_runs([f"{device_types[s.group]} {s.devices}" for s in r.stages])
        shapes[shape] = shapes.get(shape, 0) + 1
    replicas = ", ".join(f"{n} x [{shape}]" for shape, n in shapes.items())
    remats = "/".join(sorted({s.remat for r in plan.replicas for s in r.stages}))
    microbatches = sum(r.microbatches for r in plan.replicas)
    chunks = f" v={plan.chunks}" if plan.schedule == "interleaved" else ""
    return (f"{replicas}; {microbatches} mb of {plan.microbatch_size}, "
            f"{plan.schedule}{chunks}, remat {remats}")


USING_SHARE = 0.25
"""Of the stage planner's time (and work) limit, what the searches for the best plans that use
the unused device groups get together, in equal parts (:func:`unused_types`)."""


def unused_types(choice: PipelineChoice, problem: PipelineProblem) -> dict[str, Any]:
    """Per device group the chosen plan leaves unused: what using it costs.

    The stage planner searches again for the best plan with a stage on the group
    (:func:`~shardplan.solver.stages.search.solve_pipeline` with ``using``), within an equal
    part of :data:`USING_SHARE` of its time and work limits, seeded with the final candidates
    that use it (:mod:`shardplan.solver.stages.portfolio`). Of the best found: ``best_step_s``,
    ``config``, ``slower_by`` (over the chosen plan), ``optimal`` (proven the best plan that
    uses the group), ``limit`` and ``limit_extra_s``: what it loses on, its synchronisation
    (with ``sync_link_GB_s``, the bandwidth of the link it runs on), its slowest replica's
    pipeline or its update, whichever it spends the most time on beyond the chosen plan's.
    ``none_found``: why there is none (no plan uses the group, proven, or none within the
    limit). ``"alone"``: the fewest of the group's devices that could hold one replica on it
    alone (a memory floor, :func:`~shardplan.solver.stages.search.infeasibility_report`;
    ``None``: no sub-mesh of it holds the model's largest layer) against how many it has."""
    used = {s.group for r in choice.plan.replicas for s in r.stages}
    chosen = choice.evaluation
    names = [g.name for g in problem.groups]
    unused = [g for g in range(len(problem.groups)) if g not in used]
    minimum = infeasibility_report(problem).min_devices if unused else ()
    out: dict[str, Any] = {}
    for g in unused:
        group = problem.groups[g]
        row: dict[str, Any] = {"alone": {"devices_needed": minimum[g],
                                         "devices": group.count}}
        seeds = [c.plan for c in choice.candidates if c.evaluation.feasible
                 and any(s.group == g for r in c.plan.replicas for s in r.stages)]
        share = USING_SHARE / len(unused)
        limited = dataclasses.replace(
            problem, time_limit_s=share * problem.time_limit_s,
            work_limit=max(1, int(share * problem.work_limit)) if problem.work_limit else 0)
        try:
            found = solve_pipeline(limited, seeds=seeds, using=g)
        except InfeasibleError:
            row["none_found"] = "no plan that uses it fits (proven)"
        except SolverError:
            row["none_found"] = (
                f"none found within its share of the stage planner's limits "
                f"({limited.time_limit_s:g} s"
                + (f", {limited.work_limit:,} work units" if limited.work_limit else "")
                + "; PlanConfig.stage_time_limit_s and stage_work_limit give it more)")
        else:
            ev = found.evaluation
            parts = {"synchronisation": ev.sync_s - chosen.sync_s,
                     "pipeline": max(ev.replica_time_s) - max(chosen.replica_time_s),
                     "update": ev.update_s - chosen.update_s}
            worst = max(parts, key=lambda k: parts[k])
            row.update(best_step_s=ev.step_time_s, config=_pipeline_config(found.plan, names),
                       slower_by=ev.step_time_s / chosen.step_time_s - 1.0,
                       optimal=found.stats.optimal,
                       limit={"synchronisation": "link bandwidth: its gradient "
                                                 "synchronisation",
                              "pipeline": "its slowest replica's pipeline",
                              "update": "its optimizer update"}[worst],
                       limit_extra_s=parts[worst])
            if len(found.plan.replicas) > 1:
                row["sync_link_GB_s"] = sync_link(
                    problem, found.plan).bandwidth_bytes_per_s / 1e9
        out[group.name] = row
    return out
