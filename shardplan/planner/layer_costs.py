"""Layer cost tables: what each layer kind costs on a sub-mesh of each device type.

The stage planner (:mod:`shardplan.solver.stages.search`) cuts the layer sequence into stages; it needs,
for every layer kind (fingerprint) x device group x sub-mesh size, the intra-op solution's
forward and backward seconds, the recomputation each remat policy adds, the saved activations,
the static bytes (parameters, gradients, optimizer state) and the update's seconds
(:class:`~shardplan.solver.stages.pipeline.LayerOption`), plus each kind's boundary activation and
gradient bytes.

One intra-op problem is solved per (device group, sub-mesh size): the whole traced step on that
many devices of that type, with the layers tied, at one reference microbatch size. Its solution
is then read back per layer, never solved per layer: each op's roofline time on its local shard
and the time of the collectives placed at it go to the layers the op belongs to (an op of a
scanned body to each of its layers equally), by phase. Times and activation bytes are taken as
proportional to the microbatch size (``per_sample``; no fixed part): the reference microbatch
is where the sharding was chosen.

The searches share their work (:class:`~shardplan.planner.mesh.MeshSearch`): the problem is
laid out once per layout signature and priced per mesh (the same problem ``best_mesh`` builds,
to the bit), its LP relaxation is built once per layout and re-solved from the previous basis
(an integral optimum is the ILP's optimum; otherwise ``ilp.solve`` decides), size by size so
that consecutive solves differ only in the device type. Groups with the same device type,
links and node size share their solutions. The optimum is ``best_mesh``'s; where several
shardings cost exactly the same (ops whose every strategy is free: broadcasts, iotas), the
simplex may stop at another of them, which the read-back can price slightly differently
(GPT-3 175B: at most 1.4e-5 relative on the tables' figures; ``benchmarks/layer_tables.py``).
Sizes on which no layer's static bytes fit a device are skipped (``skipped_sizes``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from shardplan.cluster import Cluster
from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.compute import (
    VIEW_PRIMITIVES,
)
from shardplan.cost.memory import (
    activation_facts,
    backward_work_bytes,
    saved_activation_bytes_by_layer,
)
from shardplan.cost.rules import OpRule
from shardplan.cost.sharding import ShardingAnalysis, analyze_sharding, leaf_specs
from shardplan.planner.fold import Fold, expand, fold_blocks
from shardplan.planner.layout import IntraOpLayout, MeshCollectives, RooflineTable, StepFacts
from shardplan.planner.mesh import MeshChoice, MeshSearch
from shardplan.solver.stages.pipeline import REMATS, LayerKind, LayerOption
from shardplan.trace.graph import Layer, OpGraph

__all__ = ["LayerCosts", "layer_costs", "scanned_stacks", "submesh_sizes"]


@dataclasses.dataclass(frozen=True)
class LayerCosts:
    """The cost tables of one traced step.

    Attributes:
      kinds: the layer kinds (``options`` keyed by device group index).
      layers: per pipeline layer (the graph's layers except ``shared``), its kind index.
      names: per pipeline layer, its name.
      reference_batch: the microbatch size the step was traced and solved at.
      choices: per (group index, devices), the intra-op solution the options come from.
      skipped_sizes: per group index, the default sub-mesh sizes left out because no layer's
        static bytes fit a device even when split evenly over all of them.
      timings: seconds spent, by part: ``facts_s`` (the step's op rules, fusion, tying),
        ``layout_s``, ``relaxation_build_s``, ``price_s``, ``solve_s`` (see
        :class:`~shardplan.planner.mesh.MeshSearch`), ``readback_s``, ``total_s``; and
        ``per_submesh_s``: per (group, devices) the search and readback seconds of its own
        (0 where it reused another group's solution).
      stacks: the scanned stacks, as ranges of pipeline layers (:func:`scanned_stacks`).
      borrowed: ``(reader, owner, bytes)`` per parameter a pipeline layer's forward reads that
        another owns (:func:`borrowed_parameters`).
    """

    kinds: tuple[LayerKind, ...]
    layers: tuple[int, ...]
    names: tuple[str, ...]
    reference_batch: int
    choices: Mapping[tuple[int, int], MeshChoice]
    skipped_sizes: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    timings: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    stacks: tuple[tuple[int, int], ...] = ()
    borrowed: tuple[tuple[int, int, float], ...] = ()


def submesh_sizes(count: int, devices_per_node: int, *, limit: int = 64) -> tuple[int, ...]:
    """Sub-mesh sizes worth a stage: powers of two up to a node, then whole nodes in powers of
    two, up to ``count`` and ``limit`` devices (beyond that, data parallelism across replicas
    does the same job with fewer collectives)."""
    sizes = []
    d = 1
    while d <= min(count, limit):
        if d <= devices_per_node or d % devices_per_node == 0:
            sizes.append(d)
        d *= 2
    return tuple(sizes)


def layer_costs(graph: OpGraph, cluster: Cluster, *, reference_batch: int,
                sizes: Mapping[int, Sequence[int]] | None = None, max_mesh_axes: int = 2,
                time_limit_s: float = 30.0, relative_gap: float = 0.01) -> LayerCosts:
    """Solves ``graph`` (traced at ``reference_batch`` samples) on every device group and
    sub-mesh size and reads the solutions back per layer.

    The mesh searches share their work (:class:`~shardplan.planner.mesh.MeshSearch`: the
    problem laid out once per layout signature, priced per mesh, its relaxation re-solved
    warm), and groups of equal device type, node size and links share their solutions.

    Args:
      graph: the train step traced at the reference microbatch size.
      cluster: the cluster; each group's first devices form the sub-meshes.
      reference_batch: the batch size ``graph`` was traced with.
      sizes: per group index, the sub-mesh sizes (default :func:`submesh_sizes`).
      max_mesh_axes, time_limit_s, relative_gap: as in ``PlanConfig``.
    """
    start = time.perf_counter()
    pipeline_layers = [layer for layer in graph.layers if layer.kind != "shared"]
    fingerprints: dict[str, int] = {}
    kind_of = [fingerprints.setdefault(layer.fingerprint, len(fingerprints))
               for layer in pipeline_layers]
    first_of_kind = {k: pipeline_layers[i] for i, k in reversed(list(enumerate(kind_of)))}
    # Python-loop blocks are solved once per distinct block, as a scanned stack is: on the
    # graph with them folded (planner.fold), whose representative is each kind's first layer.
    fold = fold_blocks(graph, 1)
    solved = fold.graph if fold is not None else graph
    search = MeshSearch(solved, cluster, max_axes=max_mesh_axes, tie_period=1,
                        time_limit_s=time_limit_s, relative_gap=relative_gap, fold=fold)
    readback = _Readback(solved, cluster, [layer.index for layer in first_of_kind.values()],
                         reference_batch, facts=search.facts,
                         collective_cache=search.collective_cache,
                         members=fold.members if fold is not None else None)
    if sizes is not None:
        wanted = {g: tuple(sizes.get(g, ())) for g in range(len(cluster.groups))}
        skipped: dict[int, tuple[int, ...]] = {}
    else:
        wanted, skipped = _useful_sizes(graph, cluster, pipeline_layers)
    choices, per_layer, per_submesh, readback_s = _solve_all(search, readback, cluster, wanted)
    if fold is not None:  # the choices' problems on the full graph, for the plan
        choices = {key: _unfolded(choice, fold) for key, choice in choices.items()}
    options: dict[int, dict[int, list[LayerOption]]] = defaultdict(lambda: defaultdict(list))
    for g, ds in wanted.items():
        for d in ds:
            for k, layer in first_of_kind.items():
                options[k][g].append(dataclasses.replace(per_layer[(g, d)][layer.index],
                                                         devices=d))
    boundary = _boundary_bytes(graph, pipeline_layers, reference_batch)
    kinds = tuple(
        LayerKind(name=first_of_kind[k].name,
                  options={g: tuple(opts) for g, opts in options[k].items()},
                  boundary_bytes=boundary.get(first_of_kind[k].index, 0.0),
                  gradient_bytes=float(first_of_kind[k].param_bytes))
        for k in range(len(fingerprints)))
    timings = {**search.timings, "readback_s": readback_s, "fallbacks": search.fallbacks,
               "total_s": time.perf_counter() - start, "per_submesh_s": per_submesh}
    return LayerCosts(kinds=kinds, layers=tuple(kind_of),
                      names=tuple(layer.name for layer in pipeline_layers),
                      reference_batch=reference_batch, choices=choices,
                      skipped_sizes=skipped, timings=timings,
                      stacks=scanned_stacks(pipeline_layers),
                      borrowed=borrowed_parameters(graph, pipeline_layers))


def borrowed_parameters(graph: OpGraph, layers: Sequence[Layer],
                        ) -> tuple[tuple[int, int, float], ...]:
    """``(reader, owner, bytes)``, positions in ``layers``: each parameter a layer's forward
    reads that one other layer owns (a tied embedding read by the output head), with its
    bytes. A stage running the reader without the owner receives the parameter each step
    and sends its gradient term back (``solver.pipeline.transfer_bytes``)."""
    position = {layer.index: i for i, layer in enumerate(layers)}
    owners = _owners(graph)
    out: list[tuple[int, int, float]] = []
    for p in graph.parameters:
        if p.role != "parameter" or p.path not in owners:
            continue
        owning = [position[i] for i in owners[p.path] if i in position]
        if len(owning) != 1:  # (a scanned stack's leaf: its rows own it together)
            continue
        readers = {position[i] for r in p.readers if graph.ops[r].phase == "forward"
                   for i in graph.ops[r].layers if i in position}
        out.extend((reader, owning[0], float(graph.tensors[p.tensor].nbytes))
                   for reader in sorted(readers - set(owning)))
    return tuple(out)


def scanned_stacks(layers: Sequence[Layer]) -> tuple[tuple[int, int], ...]:
    """The scanned stacks among the pipeline ``layers``, as ranges ``(a, b)`` of their
    positions: the layers of one stack that own the same parameters (the stacked leaves,
    whose rows they are), two or more, consecutive."""
    rows: dict[str, list[int]] = {}
    owned: dict[str, set[tuple[str, ...]]] = {}
    for i, layer in enumerate(layers):
        if layer.stack is not None and layer.params:
            rows.setdefault(layer.stack, []).append(i)
            owned.setdefault(layer.stack, set()).add(tuple(sorted(layer.params)))
    return tuple(sorted((at[0], at[-1] + 1) for name, at in rows.items()
                        if len(at) > 1 and len(owned[name]) == 1
                        and at == list(range(at[0], at[-1] + 1))))


def _useful_sizes(graph: OpGraph, cluster: Cluster, layers: Sequence[Layer]
                  ) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
    """Per group, the :func:`submesh_sizes` a stage can use, and those it cannot: a sub-mesh
    on which no layer's static bytes (parameters, gradients, optimizer state), even split
    evenly over every device, fit one device's memory holds no stage of any plan (a stage
    holds at least one layer, and the stage planner's budget is at most the device's
    memory)."""
    state = _state_bytes(graph, lambda t: graph.tensors[t].nbytes)
    lightest = min((state.get(layer.index, 0.0) for layer in layers), default=0.0)
    wanted, skipped = {}, {}
    for g, group in enumerate(cluster.groups):
        sizes = submesh_sizes(len(group.device_ids), group.devices_per_node)
        # Evenly split, a device holds at least nbytes // d of each tensor (of a parameter
        # and its gradient): 2 bytes per tensor below nbytes / d at most.
        slack = 2 * len(graph.parameters)
        fits = [d for d in sizes if lightest / d - slack <= group.device.memory_bytes]
        wanted[g] = tuple(fits)
        if len(fits) < len(sizes):
            skipped[g] = tuple(d for d in sizes if d not in fits)
    return wanted, skipped


def _solve_all(search: MeshSearch, readback: _Readback, cluster: Cluster,
               wanted: Mapping[int, Sequence[int]]
               ) -> tuple[dict[tuple[int, int], MeshChoice],
                          dict[tuple[int, int], dict[int, LayerOption]],
                          dict[tuple[int, int], float], float]:
    """Per (group, size): the choice, its options per layer and its seconds; and the seconds
    of all read-backs.

    Solved size by size, each on every group in turn: a sub-mesh's relaxation starts from the
    basis of the same mesh on the previous device type, which is close (the optimal shardings
    differ in a few nodes), where the next size's is not.
    """
    choices: dict[tuple[int, int], MeshChoice] = {}
    per_layer: dict[tuple[int, int], dict[int, LayerOption]] = {}
    per_submesh: dict[tuple[int, int], float] = {}
    readback_s = 0.0
    solved: dict[tuple, tuple[int, int]] = {}
    for g, d in sorted(((g, d) for g, ds in wanted.items() for d in ds),
                       key=lambda task: (task[1], task[0])):
        ids = cluster.groups[g].device_ids[:d]
        key = _same_costs_key(cluster, ids)
        if key in solved:  # a group of the same devices and links: the same solution
            choices[(g, d)] = _moved(choices[solved[key]], ids, cluster)
            per_layer[(g, d)] = per_layer[solved[key]]
            per_submesh[(g, d)] = 0.0
            continue
        began = time.perf_counter()
        choice = search.best(ids)
        searched = time.perf_counter()
        choices[(g, d)] = choice
        per_layer[(g, d)] = readback(choice, search.layout(choice.mesh))
        readback_s += time.perf_counter() - searched
        per_submesh[(g, d)] = time.perf_counter() - began
        solved[key] = (g, d)
    order = sorted(choices)  # group by group, as the tables list them
    return ({k: choices[k] for k in order}, per_layer, {k: per_submesh[k] for k in order},
            readback_s)


def _unfolded(choice: MeshChoice, fold: Fold) -> MeshChoice:
    """``choice`` (solved on ``fold.graph``) with its problem on the full graph's ids."""
    return dataclasses.replace(choice, build=lambda: expand(fold, choice.problem))


def _same_costs_key(cluster: Cluster, ids: Sequence[int]) -> tuple:
    """What a sub-mesh's intra-op costs depend on: the device type, the group's links and
    how its devices spread over nodes (:func:`candidate_meshes` lays them out by node)."""
    group = cluster.group_of(ids[0])
    per_node: dict[int, int] = {}
    for d in ids:
        per_node[cluster.node_of(d)] = per_node.get(cluster.node_of(d), 0) + 1
    return (group.device, group.intra_node, group.inter_node, tuple(per_node.values()))


def _moved(choice: MeshChoice, ids: Sequence[int], cluster: Cluster) -> MeshChoice:
    """``choice`` on devices ``ids`` of another group with the same costs."""
    ordered = tuple(sorted(ids, key=lambda d: (cluster.node_of(d), d)))  # as candidate_meshes
    mesh = LogicalMesh(choice.mesh.axis_names, choice.mesh.axis_sizes, ordered)
    source = choice

    def build():
        return dataclasses.replace(source.problem, mesh=mesh)

    return MeshChoice(mesh=mesh, solution=choice.solution, candidates=choice.candidates,
                      build=build)


class _Readback:
    """Per layer, its :class:`LayerOption` on a solved sub-mesh (``devices`` left 0): the graph-
    level parts computed once, the rest per solution.

    Times: each op's roofline time on its local shard and the collectives the placed analysis
    puts at it, shared equally by the layers the op belongs to, by phase; per sample.
    """

    def __init__(self, graph: OpGraph, cluster: Cluster, layers: Sequence[int],
                 batch: int, *, facts: StepFacts,
                 collective_cache: dict[tuple, float] | None = None,
                 members: Mapping[int, int] | None = None) -> None:
        self.graph = graph
        self.collective_cache = collective_cache if collective_cache is not None else {}
        self.rules = facts.rules
        self.combinable = facts.combinable
        self.cluster = cluster
        self.layers = tuple(layers)
        self.batch = batch
        # A representative of folded loop blocks (planner.fold) runs its ops for all of its
        # members: its times are theirs together, per layer one member's share.
        self.members = {i: (members or {}).get(i, 1) for i in self.layers}
        wanted = set(layers)
        # The ops cost.compute.op_times costs: not structural, folded or a view.
        self.costed = [o for o in facts.fused if graph.ops[o].primitive not in VIEW_PRIMITIVES]
        # One roofline row per charged variant of an op (one, unless loop blocks were folded).
        rows: list[tuple[int, tuple]] = []
        for o in self.costed:
            variants, dtype, kind = facts.fused[o]
            rows += [(o, (charged, dtype, kind)) for charged in variants]
        self.rooflines = RooflineTable([row for _, row in rows])
        self.row_op = [o for o, _ in rows]
        self.rows = np.arange(len(rows))
        # Per op, the wanted layers it belongs to and how many layers share it.
        self.owners = {op.id: ([i for i in op.layers if i in wanted], len(op.layers))
                       for op in graph.ops if op.layers and wanted.intersection(op.layers)}
        dropped = {policy: _dropped_by(graph, policy) for policy in REMATS}
        self.recomputed = {op: tuple(p for p in REMATS if op in dropped[p])
                           for op in self.owners}
        self.activation_facts = activation_facts(graph)

    def __call__(self, choice: MeshChoice, layout: IntraOpLayout) -> dict[int, LayerOption]:
        graph, mesh, batch = self.graph, choice.mesh, self.batch
        assignment = choice.solution.assignment or ()
        analysis = _placed_analysis(graph, layout, mesh, assignment, self.rules)
        phase, recompute = self._layer_seconds(self._op_seconds(analysis, mesh))

        def local(t: int) -> int:
            return analysis.local_bytes(graph, t)

        state = _state_bytes(graph, local, self.layers)
        resident = _state_bytes(graph, local, self.layers, gradients=0)
        for i, nbytes in _borrowed_bytes(graph, local, self.layers).items():
            state[i] += nbytes
        # What XLA keeps from the forward into the backward pass under each policy (full:
        # the layer's input only), per sample: weight casts and other batch-independent
        # values are not activations.
        saved = saved_activation_bytes_by_layer(graph, local, facts=self.activation_facts)
        # What a stage's backward program holds beside them: the forward values it computes
        # again (full: all the forward would keep; selective: the attention core) and its
        # own transient buffers.
        work = backward_work_bytes(graph, local, facts=self.activation_facts)
        out: dict[int, LayerOption] = {}
        for i in self.layers:
            out[i] = LayerOption(
                devices=0,
                forward_s=(0.0, phase[(i, "forward")] / batch),
                backward_s=(0.0, (phase[(i, "backward")] + phase[(i, "recompute")]) / batch),
                recompute_s={p: (0.0, recompute[(i, p)] / batch) for p in REMATS},
                activation_bytes={p: saved[i][p] / batch for p in REMATS},
                state_bytes=state.get(i, 0.0),
                update_s=phase[(i, "update")],
                recompute_bytes={p: (saved[i]["none"] - saved[i][p]) / batch
                                 for p in REMATS},
                work_bytes={p: work[i][p] / batch for p in REMATS},
                resident_bytes=resident.get(i, 0.0))
        return out


    def _op_seconds(self, analysis: ShardingAnalysis, mesh: LogicalMesh) -> dict[int, float]:
        """Per op, its roofline seconds on its local shard and its collectives' seconds."""
        device = self.cluster.group_of(mesh.device_ids[0]).device
        # Each op's roofline on its local shard (cost.compute.op_times), times its count.
        sizes: dict[tuple[str, ...], float] = {}
        for axes in analysis.op_axes:
            if axes not in sizes:
                sizes[axes] = float(mesh.size(axes))
        divisor = np.asarray([sizes[analysis.op_axes[o]] for o in self.row_op])
        seconds: dict[int, float] = {}
        for o, t in zip(self.row_op, self.rooflines.times(device, self.rows, divisor).tolist(),
                        strict=True):
            seconds[o] = seconds.get(o, 0.0) + t
        # mesh_collective_time_s of each collective, memoised and shared between meshes.
        comm = MeshCollectives(mesh, self.cluster, self.collective_cache)
        for c in analysis.collectives:
            seconds[c.op] = seconds.get(c.op, 0.0) + c.count * comm.collective(
                c.kind, c.axes, c.result_bytes, combinable=c.op in self.combinable)
        return seconds

    def _layer_seconds(self, seconds: Mapping[int, float]
                       ) -> tuple[dict[tuple[int, str], float], dict[tuple[int, str], float]]:
        """Per (layer, phase) its share of ``seconds``; per (layer, policy) what it recomputes."""
        graph = self.graph
        phase: dict[tuple[int, str], float] = defaultdict(float)
        recompute: dict[tuple[int, str], float] = defaultdict(float)
        for op_id, (mine, shared_by) in self.owners.items():
            s = seconds.get(op_id, 0.0)
            if not s:
                continue
            share = s / shared_by
            op_phase = graph.ops[op_id].phase
            for index in mine:
                mine_s = share / self.members[index]
                phase[(index, op_phase)] += mine_s
                for policy in self.recomputed[op_id]:
                    recompute[(index, policy)] += mine_s
        return phase, recompute


def _placed_analysis(graph: OpGraph, layout: IntraOpLayout, mesh: LogicalMesh,
                     assignment: Sequence[int], rules: Sequence[OpRule]) -> ShardingAnalysis:
    """``decode.placed_analysis`` of an assignment of ``layout``'s nodes on ``mesh``."""
    strategies = layout.strategies
    specs = {t: strategies[n][assignment[n]].result_specs[0]
             for t, n in layout.input_nodes.items()}
    ins, outs = leaf_specs(graph, mesh, lambda p: specs[p.tensor])
    pinned, factors = dict(ins), {}
    for op in graph.ops:
        if any(t in layout.free_tensors for t in op.outputs):
            continue
        n = layout.op_nodes[op.id]
        strategy = strategies[n][assignment[n]]
        factors[op.id] = strategy.factors
        pinned.update(zip(op.outputs, strategy.result_specs, strict=True))
    return analyze_sharding(graph, mesh, pinned, outs, reduce_scatter=False, op_factors=factors,
                            rules=rules)


def _dropped_by(graph: OpGraph, policy: str) -> set[int]:
    """Forward ops a remat policy recomputes in the backward pass: those whose every saved
    result the policy does not keep (see ``saved_activation_bytes``)."""
    if policy == "none":
        return set()
    consumers = graph.consumers
    out = set()
    for op in graph.ops:
        if op.phase != "forward":
            continue
        kept = False
        for t in op.outputs:
            readers = [graph.ops[c] for c in consumers[t]]
            if policy == "full":
                kept |= any(r.phase == "forward" and r.layers != op.layers for r in readers)
            else:
                shape = graph.tensors[t].shape
                kept |= not (len(shape) >= 2 and shape[-1] == shape[-2] and shape[-1] > 1)
        if not kept:
            out.add(op.id)
    return out


def _state_bytes(graph: OpGraph, local, layers: Collection[int] | None = None,
                 gradients: int = 2) -> dict[int, float]:
    """Per layer (of ``layers``, default all), bytes one device holds of its parameters,
    ``gradients`` copies of their gradients (2: the sums over the microbatches, and one
    microbatch's fresh gradients before they are added; 0: what stays between steps) and
    their optimizer state; a stacked leaf (a scanned stack's) is split evenly over the layers
    that own it."""
    owners = _owners(graph)
    if layers is not None:
        owners = {path: held for path, held in owners.items() if set(held) & set(layers)}
    out: dict[int, float] = defaultdict(float)
    for p in graph.parameters:
        path = p.param_path if p.role == "optimizer_state" else p.path
        if p.role not in ("parameter", "optimizer_state") or path is None or path not in owners:
            continue
        nbytes = local(p.tensor) * (1 + gradients if p.role == "parameter" else 1)
        for index in owners[path]:
            out[index] += nbytes / len(owners[path])
    return out


def _owners(graph: OpGraph) -> dict[str, list[int]]:
    """Per parameter path, the layers that own it (a scanned stack's leaf: all its layers)."""
    owners: dict[str, list[int]] = defaultdict(list)
    for layer in graph.layers:
        for owned in layer.params:
            owners[owned].append(layer.index)
    return owners


def _borrowed_bytes(graph: OpGraph, local, layers: Collection[int]) -> dict[int, float]:
    """Per layer (of ``layers``), bytes one device holds during a step of the parameters its
    forward reads that other layers own (a tied embedding read by the output head): the
    parameter's copy on the layer's stage, the sums of its gradient term over the
    microbatches and one microbatch's fresh term (``partition``: each stage accumulates its
    own term, they meet once per step). Not held between steps. Counted whatever stage the
    owner runs on: where a stage holds the owner too (a replica of one stage), the
    prediction is that much over."""
    owners = _owners(graph)
    wanted = set(layers)
    out: dict[int, float] = defaultdict(float)
    for p in graph.parameters:
        if p.role != "parameter" or p.path not in owners:
            continue
        readers = {i for r in p.readers if graph.ops[r].phase == "forward"
                   for i in graph.ops[r].layers}
        for i in (readers & wanted).difference(owners[p.path]):
            out[i] += 3.0 * local(p.tensor)
    return out


def _boundary_bytes(graph: OpGraph, layers: Sequence[Layer], batch: int) -> dict[int, float]:
    """Per layer, the bytes per sample of the forward values it hands to later layers."""
    out = _crossing_bytes(graph, layers, lambda t: graph.tensors[t].nbytes, into=False)
    return {i: b / batch for i, b in out.items()}


def _crossing_bytes(graph: OpGraph, layers: Sequence[Layer], nbytes, *,
                    into: bool) -> dict[int, float]:
    """Per layer, the bytes of the forward values it hands to later layers (``into=False``)
    or receives from earlier ones (``into=True``). The layers of a scanned stack hand each
    other the loop's carry, which is what crosses between the stack and its neighbour."""
    position = {layer.index: i for i, layer in enumerate(layers)}
    out: dict[int, float] = defaultdict(float)
    consumers = graph.consumers
    for op in graph.ops:
        if op.phase != "forward" or len(op.layers) != 1 or op.layers[0] not in position:
            continue
        (mine,) = op.layers
        for t in op.outputs:
            later = sorted({min(graph.ops[c].layers) for c in consumers[t]
                            if graph.ops[c].phase == "forward" and graph.ops[c].layers
                            and min(graph.ops[c].layers) in position
                            and position[min(graph.ops[c].layers)] > position[mine]})
            if not later:
                continue
            if into:
                for receiver in later:
                    out[receiver] += nbytes(t)
            else:
                out[mine] += nbytes(t)
    for i, stacked in enumerate(layers):
        if stacked.stack is None or out[stacked.index]:
            continue
        if into:  # what the stack's first layer receives from before the stack
            source = next(x for x in layers if x.stack == stacked.stack)
        else:  # what the layer before the stack hands into it
            source = next((x for x in reversed(layers[:i]) if x.stack != stacked.stack),
                          stacked)
        out[stacked.index] = out[source.index]
    return out
