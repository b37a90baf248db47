"""Layer cost tables: what each layer kind costs on a sub-mesh of each device type.

The stage planner (:mod:`shardplan.solver.stages`) cuts the layer sequence into stages; it needs,
for every layer kind (fingerprint) x device group x sub-mesh size, the intra-op solution's
forward and backward seconds, the recomputation each remat policy adds, the saved activations,
the static bytes (parameters, gradients, optimizer state) and the update's seconds
(:class:`~shardplan.solver.pipeline.LayerOption`), plus each kind's boundary activation and
gradient bytes.

One intra-op problem is solved per (device group, sub-mesh size): the whole traced step on that
many devices of that type, with the layers tied, at one reference microbatch size. Its solution
is then read back per layer, never solved per layer: each op's roofline time on its local shard
and the time of the collectives placed at it go to the layers the op belongs to (an op of a
scanned body to each of its layers equally), by phase. Times and activation bytes are taken as
proportional to the microbatch size (``per_sample``; no fixed part): the reference microbatch
is where the sharding was chosen.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping, Sequence

from shardplan.cluster import Cluster
from shardplan.cost.collectives import mesh_collective_time_s
from shardplan.cost.compute import op_times
from shardplan.cost.memory import buffer_tensors, saved_activation_bytes
from shardplan.planner.decode import placed_analysis
from shardplan.planner.mesh import MeshChoice, best_mesh
from shardplan.solver.pipeline import REMATS, LayerKind, LayerOption
from shardplan.trace.graph import Layer, OpGraph

__all__ = ["LayerCosts", "layer_costs", "submesh_sizes"]


@dataclasses.dataclass(frozen=True)
class LayerCosts:
    """The cost tables of one traced step.

    Attributes:
      kinds: the layer kinds (``options`` keyed by device group index).
      layers: per pipeline layer (the graph's layers except ``shared``), its kind index.
      names: per pipeline layer, its name.
      reference_batch: the microbatch size the step was traced and solved at.
      choices: per (group index, devices), the intra-op solution the options come from.
    """

    kinds: tuple[LayerKind, ...]
    layers: tuple[int, ...]
    names: tuple[str, ...]
    reference_batch: int
    choices: Mapping[tuple[int, int], MeshChoice]


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

    Args:
      graph: the train step traced at the reference microbatch size.
      cluster: the cluster; each group's first devices form the sub-meshes.
      reference_batch: the batch size ``graph`` was traced with.
      sizes: per group index, the sub-mesh sizes (default :func:`submesh_sizes`).
      max_mesh_axes, time_limit_s, relative_gap: as in ``PlanConfig``.
    """
    pipeline_layers = [layer for layer in graph.layers if layer.kind != "shared"]
    fingerprints: dict[str, int] = {}
    kind_of = [fingerprints.setdefault(layer.fingerprint, len(fingerprints))
               for layer in pipeline_layers]
    first_of_kind = {k: pipeline_layers[i] for i, k in reversed(list(enumerate(kind_of)))}
    options: dict[int, dict[int, list[LayerOption]]] = defaultdict(lambda: defaultdict(list))
    choices: dict[tuple[int, int], MeshChoice] = {}
    for g, group in enumerate(cluster.groups):
        wanted = (sizes.get(g, ()) if sizes is not None
                  else submesh_sizes(len(group.device_ids), group.devices_per_node))
        for d in wanted:
            choice = best_mesh(graph, group.device_ids[:d], cluster, max_axes=max_mesh_axes,
                               tie_period=1, time_limit_s=time_limit_s,
                               relative_gap=relative_gap)
            choices[(g, d)] = choice
            per_layer = _per_layer(graph, cluster, choice, reference_batch)
            for k, layer in first_of_kind.items():
                options[k][g].append(dataclasses.replace(per_layer[layer.index], devices=d))
    boundary = _boundary_bytes(graph, pipeline_layers, reference_batch)
    kinds = tuple(
        LayerKind(name=first_of_kind[k].name,
                  options={g: tuple(opts) for g, opts in options[k].items()},
                  boundary_bytes=boundary.get(first_of_kind[k].index, 0.0),
                  gradient_bytes=float(first_of_kind[k].param_bytes))
        for k in range(len(fingerprints)))
    return LayerCosts(kinds=kinds, layers=tuple(kind_of),
                      names=tuple(layer.name for layer in pipeline_layers),
                      reference_batch=reference_batch, choices=choices)


def _per_layer(graph: OpGraph, cluster: Cluster, choice: MeshChoice,
               batch: int) -> dict[int, LayerOption]:
    """Each layer's option on ``choice``'s mesh, per sample (``devices`` left 0)."""
    mesh = choice.mesh
    analysis = placed_analysis(graph, choice.problem, choice.solution, reduce_scatter=False)
    device = cluster.group_of(mesh.device_ids[0]).device
    buffers = buffer_tensors(graph)
    times = op_times(graph, device, divisor_of=lambda o: float(mesh.size(analysis.op_axes[o])),
                     materialized=lambda t: buffers[t])
    seconds: dict[int, float] = {o: t.time_s * graph.ops[o].count for o, t in times.items()}
    for c in analysis.collectives:
        seconds[c.op] = seconds.get(c.op, 0.0) + c.count * mesh_collective_time_s(
            c.kind, c.result_bytes, mesh, c.axes, cluster)
    phase: dict[tuple[int, str], float] = defaultdict(float)
    recompute: dict[tuple[int, str], float] = defaultdict(float)
    dropped = {policy: _dropped_by(graph, policy) for policy in REMATS}
    for op in graph.ops:
        s = seconds.get(op.id, 0.0)
        if not s or not op.layers:
            continue
        share = s / len(op.layers)
        for index in op.layers:
            phase[(index, op.phase)] += share
            for policy in REMATS:
                if op.id in dropped[policy]:
                    recompute[(index, policy)] += share

    def local(t: int) -> int:
        return analysis.local_bytes(graph, t)

    state = _state_bytes(graph, local)
    pipeline_layers = [layer for layer in graph.layers if layer.kind != "shared"]
    inputs = _crossing_bytes(graph, pipeline_layers, local, into=True)
    out: dict[int, LayerOption] = {}
    for layer in graph.layers:
        i = layer.index
        out[i] = LayerOption(
            devices=0,
            forward_s=(0.0, phase[(i, "forward")] / batch),
            backward_s=(0.0, (phase[(i, "backward")] + phase[(i, "recompute")]) / batch),
            recompute_s={p: (0.0, recompute[(i, p)] / batch) for p in REMATS},
            # Full remat keeps only the layer's input and recomputes the rest.
            activation_bytes={"none": saved_activation_bytes(graph, local, "none", layer=i)
                              / batch,
                              "selective": saved_activation_bytes(graph, local, "selective",
                                                                  layer=i) / batch,
                              "full": inputs.get(i, 0.0) / batch},
            state_bytes=state.get(i, 0.0),
            update_s=phase[(i, "update")])
    return out


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


def _state_bytes(graph: OpGraph, local) -> dict[int, float]:
    """Per layer, bytes one device holds of its parameters, their gradients (as large as the
    parameters) and their optimizer state; a stacked leaf (a scanned stack's) is split evenly
    over the layers that own it."""
    owners: dict[str, list[int]] = defaultdict(list)
    for layer in graph.layers:
        for owned in layer.params:
            owners[owned].append(layer.index)
    out: dict[int, float] = defaultdict(float)
    for p in graph.parameters:
        path = p.param_path if p.role == "optimizer_state" else p.path
        if p.role not in ("parameter", "optimizer_state") or path is None or path not in owners:
            continue
        nbytes = local(p.tensor) * (2 if p.role == "parameter" else 1)  # + its gradient
        for index in owners[path]:
            out[index] += nbytes / len(owners[path])
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
