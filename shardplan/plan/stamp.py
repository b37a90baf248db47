"""The outline of the cluster a plan records (``Plan.cluster_info``), so that applying it to
another cluster can say what differs; the argument types beside it (``state_types``,
``batch_types``) come from :func:`shardplan.trace.args.arg_types`. The planner stamps both
(:func:`shardplan.planner.stamp.stamped`); ``check_plan`` compares them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardplan.cluster import Cluster

__all__ = ["cluster_info"]


def cluster_info(cluster: Cluster, /) -> dict[str, Any]:
    """The outline of ``cluster`` a plan keeps: its name and, per device type, how many devices
    and how much memory each has.

    Example:
      >>> import jax
      >>> from shardplan.cluster import Cluster
      >>> one = Cluster.local(types={"a100-80g": 1}, devices=jax.devices()[:1])
      >>> cluster_info(one)["device_types"]
      {'a100-80g': {'count': 1, 'memory_bytes': 80000000000}}
    """
    types: dict[str, dict[str, int]] = {}
    for group in cluster.groups:
        entry = types.setdefault(group.device.name,
                                 {"count": 0, "memory_bytes": group.device.memory_bytes})
        entry["count"] += len(group.device_ids)
    return {"name": cluster.name, "device_types": types}
