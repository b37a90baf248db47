"""Cluster descriptions: the device catalog, device groups, nodes and links."""

from __future__ import annotations

from shardplan.cluster.catalog import catalog_names as catalog_names
from shardplan.cluster.catalog import load_device as load_device
from shardplan.cluster.cluster import Cluster as Cluster
from shardplan.cluster.device import DeviceSpec as DeviceSpec
from shardplan.cluster.device import Efficiency as Efficiency
from shardplan.cluster.group import DeviceGroup as DeviceGroup
from shardplan.cluster.group import GroupLink as GroupLink
from shardplan.cluster.link import Link as Link
from shardplan.cluster.mesh import LogicalMesh as LogicalMesh

__all__ = [
    "Cluster",
    "DeviceGroup",
    "DeviceSpec",
    "Efficiency",
    "GroupLink",
    "Link",
    "LogicalMesh",
    "catalog_names",
    "load_device",
]
