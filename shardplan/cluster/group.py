"""Device groups (devices of one type, in nodes) and per-pair links between groups."""

from __future__ import annotations

import dataclasses

from shardplan._schema import Where
from shardplan.cluster._schema import as_int, as_str, fail
from shardplan.cluster.device import DeviceSpec
from shardplan.cluster.link import Link
from shardplan.errors import ClusterError, format_error

__all__ = ["LINK_HINT", "MAX_DEVICES", "DeviceGroup", "GroupLink", "check_device_count"]

LINK_HINT = "{bandwidth_GB_s: <GB/s per direction per device>, latency_us: <µs>}"
"""How a link is written, for remedies in error messages."""

MAX_DEVICES = 2**20
"""The most devices a cluster may describe (1,048,576), in all and so in any group or node.

A cluster holds one id per device (``DeviceGroup.device_ids``, ``Cluster``'s id map), so a
count is checked against this limit before anything of its size is built: ``nodes: 1e9`` is
then an error in microseconds, not an exhausted memory. The limit is about 5x the largest
training clusters built so far (~200,000 GPUs, 2025) and 1,024x the largest cluster
shardplan's configs and benchmarks plan (configs/clusters/h100_a100_l4x1024.yaml, 1,024 GPUs);
a cluster of this size takes about a second and a few hundred MB to describe."""


def check_device_count(
    count: float, where: Where | str, *, what: str, value: object = None
) -> None:
    """Raises a ClusterError when ``count`` devices are more than :data:`MAX_DEVICES`.

    Args:
      count: the number of devices (a node count stands for at least that many devices).
      where: the key path of the count (``groups[0].nodes``) or of the group it belongs to.
      what: the start of the sentence, ending with the count ("the group has 2,048 x 1,024 =
        2,097,152 devices").
      value: the value to show; default ``count``.

    Raises:
      ClusterError: naming ``where``, the value and the limit.
    """
    if count <= MAX_DEVICES:
        return
    raise fail(
        where,
        f"{what}, more than the {MAX_DEVICES:,} devices a cluster may have",
        count if value is None else value,
        f"describe at most {MAX_DEVICES:,} devices in all (shardplan.cluster.group.MAX_DEVICES; "
        "the largest training clusters have ~200,000); check the count for a typing slip "
        "(nodes and devices_per_node are counts, e.g. nodes: 128, devices_per_node: 8)",
    )


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
    """Devices of one type, ``nodes`` nodes of ``devices_per_node`` each.

    Attributes:
      name: unique within the cluster (default: the device name).
      device: the device type's figures.
      nodes: number of nodes (hosts).
      devices_per_node: devices in each node.
      intra_node: the link between two devices of the same node.
      inter_node: the per-device link between nodes; None only when ``nodes == 1``.
      device_ids: the cluster ids of the group's devices, node-major: node ``k`` holds
        ``device_ids[k * devices_per_node : (k + 1) * devices_per_node]``.
    """

    name: str
    device: DeviceSpec
    nodes: int
    devices_per_node: int
    intra_node: Link
    inter_node: Link | None
    device_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        where = Where(path=f"DeviceGroup({self.name!r})")
        as_str(self.name, where.key("name"), what="a group name")
        if not isinstance(self.device, DeviceSpec):
            raise fail(
                where.key("device"),
                "device must be a DeviceSpec",
                self.device,
                "use shardplan.cluster.load_device(name_or_spec)",
            )
        as_int(self.nodes, where.key("nodes"), what="a node count")
        as_int(self.devices_per_node, where.key("devices_per_node"), what="a device count per node")
        check_device_count(
            self.nodes * self.devices_per_node,
            where,
            what=f"the group has {self.nodes:,} x {self.devices_per_node:,} = "
            f"{self.nodes * self.devices_per_node:,} devices",
            value={"nodes": self.nodes, "devices_per_node": self.devices_per_node},
        )
        for key in ("intra_node", "inter_node"):
            link = getattr(self, key)
            if link is not None and not isinstance(link, Link):
                raise fail(
                    where.key(key),
                    f"{key} must be a Link",
                    link,
                    "use Link(bandwidth_bytes_per_s, latency_s)",
                )
        if self.inter_node is None and self.nodes > 1:
            raise fail(
                where.key("inter_node"),
                f"the group has {self.nodes} nodes but no inter_node link",
                {"nodes": self.nodes, "inter_node": None},
                f"give inter_node: {LINK_HINT}",
            )
        ids = tuple(int(i) for i in self.device_ids)
        if len(ids) != self.nodes * self.devices_per_node or len(set(ids)) != len(ids):
            raise fail(
                where.key("device_ids"),
                f"expected {self.nodes} x {self.devices_per_node} distinct device ids",
                ids,
                "give one id per device, node by node",
            )
        object.__setattr__(self, "device_ids", ids)

    @property
    def num_devices(self) -> int:
        """``nodes * devices_per_node``."""
        return self.nodes * self.devices_per_node

    def node_ids(self, node: int) -> tuple[int, ...]:
        """The device ids of node ``node`` (0-based) of this group."""
        if not 0 <= node < self.nodes:
            raise ClusterError(
                format_error(
                    f"group {self.name!r} has no node {node}",
                    where="node",
                    value=node,
                    remedy=f"use a node index in 0..{self.nodes - 1}",
                )
            )
        start = node * self.devices_per_node
        return self.device_ids[start : start + self.devices_per_node]


@dataclasses.dataclass(frozen=True)
class GroupLink:
    """The link between two particular groups, overriding ``Cluster.between_groups`` for them.

    Attributes:
      groups: the two group names (order does not matter).
      link: the per-device link between them.
    """

    groups: tuple[str, str]
    link: Link

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        if not isinstance(self.link, Link):
            raise fail(
                Where(path=f"GroupLink({self.groups!r}).link"),
                "link must be a Link",
                self.link,
                "use Link(bandwidth_bytes_per_s, latency_s)",
            )
