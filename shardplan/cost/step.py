"""The cost of one train step on one sharded mesh: compute, communication, memory.

:func:`step_cost` combines the pieces of this package for a homogeneous mesh (one device type,
as every pipeline stage is): the roofline time of each op on its local shard (only values that
exist in memory are charged memory traffic: buffers, arguments and results), the α-β time of every predicted collective on the
links its mesh axes span (an all-reduce that XLA combines with others pays a share of one
call's start-up, :mod:`shardplan.cost.combine`), and the memory estimate. Compute and communication are added, i.e.
no overlap is assumed, which is the conservative choice for ranking plans.
"""

from __future__ import annotations

import dataclasses

from shardplan.cluster import Cluster
from shardplan.cost.collectives import mesh_collective_time_s
from shardplan.cost.combine import combinable_ops, startup_share
from shardplan.cost.compute import graph_compute_time_s
from shardplan.cost.memory import MemoryEstimate, estimate_memory, in_memory_tensors
from shardplan.cost.sharding import ShardingAnalysis
from shardplan.errors import ClusterError, format_error
from shardplan.trace.graph import OpGraph

__all__ = ["StepCost", "step_cost"]


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Predicted figures of one step on one device of a mesh.

    Attributes:
      device: the device type (catalog name).
      compute_s: serial compute time of the local shard of every op.
      communication_s: time of every collective (none overlapped).
      per_device_flops: FLOPs one device executes.
      collectives: ``{kind: {"count", "bytes"}}`` per device.
      memory: the memory estimate.
    """

    device: str
    compute_s: float
    communication_s: float
    per_device_flops: float
    collectives: dict[str, dict[str, int]]
    memory: MemoryEstimate

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.communication_s


def step_cost(graph: OpGraph, analysis: ShardingAnalysis, cluster: Cluster, *,
              donated: bool = False) -> StepCost:
    """Predicts compute time, communication time and memory of one step.

    Args:
      graph: the traced step.
      analysis: its sharding on a mesh over ``cluster``'s device ids.
      cluster: the cluster (device figures and links).
      donated: the state arguments are donated (results reuse their buffers).

    Raises:
      ClusterError: the mesh spans several device types.
    """
    mesh = analysis.mesh
    types = {cluster.group_of(d).device.name for d in mesh.device_ids}
    if len(types) != 1:
        raise ClusterError(format_error(
            "A mesh must hold devices of one type (a stage is homogeneous).",
            where="mesh device ids", value=sorted(types),
            remedy="build one mesh per device group and pipeline between them"))
    device = cluster.group_of(mesh.device_ids[0]).device
    buffers = in_memory_tensors(graph)
    compute = graph_compute_time_s(
        graph, device, divisor_of=lambda op_id: float(mesh.size(analysis.op_axes[op_id])),
        materialized=lambda t: buffers[t])
    # A partial sum's all-reduce that XLA combines with others pays a share of a call's
    # start-up (cost.combine).
    combinable = combinable_ops(graph)
    comm = sum(mesh_collective_time_s(
        c.kind, c.result_bytes, mesh, c.axes, cluster,
        startup_share=(startup_share(c.result_bytes, device)
                       if c.kind == "all-reduce" and c.op in combinable else 1.0)) * c.count
        for c in analysis.collectives)
    memory = estimate_memory(graph, lambda t: analysis.local_bytes(graph, t), donated=donated,
                             collectives=analysis.collectives)
    return StepCost(device=device.name, compute_s=compute, communication_s=comm,
                    per_device_flops=analysis.per_device_flops(graph),
                    collectives=analysis.collective_summary(), memory=memory)
