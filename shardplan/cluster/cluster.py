"""Clusters: groups of one device type, split into nodes, and the links between devices.

A :class:`Cluster` is a frozen value built from YAML (:meth:`Cluster.from_yaml`), a dict of the
same schema (:meth:`Cluster.from_dict`) or the devices jax sees (:meth:`Cluster.local`). It can
be *described only* (``devices is None``: plan a 1,024-GPU cluster on a laptop) or *bound* to
local jax devices of the same count (run a described topology on 8 fake CPU devices).

Device ids are the cluster's own numbering ``0 .. num_devices - 1``, node-major inside each
group and group after group; when bound, ``cluster.devices[i]`` is the jax device of id ``i``.

The schema (extra keys ``description``, per-group ``name`` and ``group_links`` are optional)::

    name: a100x8_v100x8
    groups:
      - name: a100                       # optional; default: the device name
        device: a100-80g                 # catalog name, or an inline spec mapping
        nodes: 1
        devices_per_node: 8
        intra_node: {bandwidth_GB_s: 300, latency_us: 2}
        inter_node: {bandwidth_GB_s: 25, latency_us: 5}   # required when nodes > 1
      - {device: v100-32g, nodes: 1, devices_per_node: 8,
         intra_node: {bandwidth_GB_s: 150, latency_us: 2}}
    between_groups: {bandwidth_GB_s: 6.25, latency_us: 5}  # required with >= 2 groups
    group_links:                         # optional per-pair overrides of between_groups
      - {groups: [a100, v100], bandwidth_GB_s: 6.25, latency_us: 5}

Bandwidths are GB/s (10^9 bytes/s) per direction per device; latencies are microseconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from shardplan._schema import FrozenMap, Where
from shardplan._traceback import api_boundary
from shardplan.cluster._parse import GROUP_EXAMPLE, cluster_parts, local_parts
from shardplan.cluster._schema import as_str, fail, load_yaml
from shardplan.cluster.catalog import catalog_names, load_device
from shardplan.cluster.device import DeviceSpec
from shardplan.cluster.group import LINK_HINT, DeviceGroup, GroupLink, check_device_count
from shardplan.cluster.link import Link
from shardplan.errors import ClusterError, did_you_mean, format_error

__all__ = ["Cluster", "DeviceGroup", "GroupLink", "Link"]  # the last three: re-exports


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A cluster: device groups, the links inside and between them, and optionally jax devices.

    Attributes:
      name: the cluster's name.
      groups: the device groups, in id order.
      between_groups: the per-device link between devices of different groups (required with
        two or more groups; ``group_links`` may override it per pair).
      devices: the bound jax devices (``devices[i]`` is device id ``i``), or None when the
        cluster is only described.
      description: free text.
      group_links: per-pair overrides of ``between_groups``.

    Example:
        >>> import jax
        >>> c = Cluster.local(types={"a100-80g": 4, "v100-32g": 4})  # on 8 CPU devices
        >>> c.device_types, c.ids_of("v100-32g")
        (('a100-80g', 'v100-32g'), (4, 5, 6, 7))
    """

    name: str
    groups: tuple[DeviceGroup, ...]
    between_groups: Link | None = None
    devices: tuple[Any, ...] | None = None
    description: str = ""
    group_links: tuple[GroupLink, ...] = ()
    _locations: Mapping[int, tuple[int, int]] = dataclasses.field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        where = Where(path=f"Cluster({self.name!r})")
        as_str(self.name, where.key("name"), what="a cluster name")
        groups = tuple(self.groups)
        if not groups:
            raise fail(
                where.key("groups"),
                "a cluster needs at least one device group",
                [],
                f"add a group, e.g. {GROUP_EXAMPLE}",
            )
        names = [g.name for g in groups]
        for name in names:
            if names.count(name) > 1:
                raise fail(
                    where.key("groups"),
                    f"two groups are named {name!r}",
                    names,
                    "give each group a distinct name",
                )
        total = sum(g.num_devices for g in groups)
        check_device_count(
            total,
            where.key("groups"),
            what=f"the groups have {total:,} devices",
            value={g.name: g.num_devices for g in groups},
        )
        locations: dict[int, tuple[int, int]] = {}
        for gi, group in enumerate(groups):
            for k, device_id in enumerate(group.device_ids):
                if device_id in locations:
                    raise fail(
                        where.key("groups"),
                        f"device id {device_id} is in two groups",
                        device_id,
                        "give every device exactly one id",
                    )
                locations[device_id] = (gi, k // group.devices_per_node)
        if set(locations) != set(range(len(locations))):
            raise fail(
                where.key("groups"),
                "device ids must be 0 .. num_devices - 1",
                sorted(locations),
                "number the devices consecutively from 0",
            )
        if len(groups) >= 2 and self.between_groups is None:
            raise fail(
                where.key("between_groups"),
                f"a cluster with {len(groups)} groups needs a between_groups link",
                names,
                f"give between_groups: {LINK_HINT}",
            )
        self._check_group_links(where, names)
        if self.devices is not None:
            devices = tuple(self.devices)
            if len(devices) != len(locations):
                raise _count_mismatch(self.name, len(locations), len(devices), None)
            object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "group_links", tuple(self.group_links))
        object.__setattr__(self, "_locations", FrozenMap(locations, sort=False))

    def _check_group_links(self, where: Where, names: list[str]) -> None:
        seen: set[frozenset[str]] = set()
        for gl in self.group_links:
            pair = frozenset(gl.groups)
            if len(gl.groups) != 2 or len(pair) != 2 or not pair <= set(names):
                raise fail(
                    where.key("group_links"),
                    "a group link joins two different existing groups",
                    gl.groups,
                    f"name two of: {', '.join(names)}",
                )
            if pair in seen:
                raise fail(
                    where.key("group_links"),
                    "two group links for the same pair",
                    gl.groups,
                    "keep one link per pair of groups",
                )
            seen.add(pair)

    # ----------------------------------------------------------------------------------------
    # construction

    @classmethod
    @api_boundary
    def from_yaml(
        cls, path: str | os.PathLike[str], devices: Sequence[Any] | None = None
    ) -> Cluster:
        """Reads a cluster description from a YAML file (see the module docstring).

        Args:
          path: the YAML file.
          devices: jax devices to bind the description to (same count), or None.

        Returns:
          The cluster.

        Raises:
          ClusterError: the file does not parse or breaks the schema (the message names the
            file, line, key path, value and a remedy), or ``devices`` has the wrong count.

        Example:
            >>> import jax
            >>> c = Cluster.from_yaml("configs/clusters/dgx-a100.yaml", devices=jax.devices())
            >>> c.num_devices, c.devices is not None
            (8, True)
        """
        data, where = load_yaml(path)
        cluster = cls(**cluster_parts(data, where))
        return cluster if devices is None else cluster._bind(devices, where.file)

    @classmethod
    @api_boundary
    def from_dict(cls, d: Mapping[str, Any], devices: Sequence[Any] | None = None) -> Cluster:
        """Builds a cluster from a dict with the YAML schema (see the module docstring).

        Args:
          d: the description.
          devices: jax devices to bind the description to (same count), or None.

        Raises:
          ClusterError: naming the key path, value and a remedy.
        """
        cluster = cls(**cluster_parts(d, Where()))
        return cluster if devices is None else cluster._bind(devices, None)

    @classmethod
    @api_boundary
    def local(
        cls, devices: Sequence[Any] | None = None, types: Mapping[str, int] | None = None
    ) -> Cluster:
        """The devices jax sees (or ``devices``), one group per device type.

        Each process's devices form one node. Device kinds are mapped to catalog names through
        the catalog's ``device_kinds`` lists; links come from each device file's
        ``intra_node_link`` / ``inter_node_link``. Between groups, the slowest of the groups'
        ``inter_node_link`` is used: devices of different types never share NVLink.

        Args:
          devices: the jax devices to use; default ``jax.devices()``.
          types: emulate a mixed cluster: catalog name -> count; consecutive devices take these
            types (and their catalog figures). The counts must sum to the number of devices.

        Returns:
          A cluster bound to those devices.

        Raises:
          ClusterError: no devices, a device kind the catalog does not know (without
            ``types``), unknown type names, counts that do not add up, or a device type with
            different device counts on different processes.
        """
        if devices is None:
            import jax  # here, not at the top: describing a cluster from YAML must not need jax

            devices = jax.devices()
        return cls(**local_parts(tuple(devices), types))

    def bind(self, devices: Sequence[Any]) -> Cluster:
        """This cluster bound to ``devices`` (jax devices, as many as the cluster describes).

        Raises:
          ClusterError: the counts differ, or a device is given twice.
        """
        return self._bind(devices, None)

    def _bind(self, devices: Sequence[Any], file: str | None) -> Cluster:
        devs = tuple(devices)
        if len(devs) != self.num_devices:
            raise _count_mismatch(self.name, self.num_devices, len(devs), file)
        if len(set(devs)) != len(devs):
            raise fail(
                f"devices= for cluster {self.name!r}",
                "the same device is given twice",
                devs,
                "pass each device once",
            )
        return dataclasses.replace(self, devices=devs)

    # ----------------------------------------------------------------------------------------
    # queries

    @property
    def num_devices(self) -> int:
        """Total number of devices."""
        return len(self._locations)

    @property
    def device_types(self) -> tuple[str, ...]:
        """The distinct device type names, in group order."""
        return tuple(dict.fromkeys(g.device.name for g in self.groups))

    def group(self, name: str) -> DeviceGroup:
        """The group called ``name``.

        Raises:
          ClusterError: no such group (with close matches).
        """
        for g in self.groups:
            if g.name == name:
                return g
        names = [g.name for g in self.groups]
        raise ClusterError(
            format_error(
                f"cluster {self.name!r} has no group {name!r}",
                where="group",
                value=name,
                remedy=f"{did_you_mean(name, names)}Groups: {', '.join(names)}",
            )
        )

    def ids_of(self, group: str | DeviceGroup) -> tuple[int, ...]:
        """The device ids of a group, given by name or as a :class:`DeviceGroup`."""
        return self.group(group if isinstance(group, str) else group.name).device_ids

    def _locate(self, device_id: int) -> tuple[int, int]:
        try:
            return self._locations[device_id]
        except KeyError:
            raise ClusterError(
                format_error(
                    f"cluster {self.name!r} has no device id {device_id}",
                    where="device_id",
                    value=device_id,
                    remedy=f"use an id in 0..{self.num_devices - 1}",
                )
            ) from None

    def group_of(self, device_id: int) -> DeviceGroup:
        """The group device ``device_id`` belongs to."""
        return self.groups[self._locate(device_id)[0]]

    def node_of(self, device_id: int) -> int:
        """The index of ``device_id``'s node inside its group."""
        return self._locate(device_id)[1]

    def link_between(self, device_id_a: int, device_id_b: int) -> Link:
        """The link two devices talk over.

        Same node: the group's ``intra_node``; same group, other node: its ``inter_node``;
        different groups: the pair's ``group_links`` entry, else ``between_groups``.

        Raises:
          ClusterError: an id is out of range, or the two ids are equal.
        """
        (ga, na), (gb, nb) = self._locate(device_id_a), self._locate(device_id_b)
        if device_id_a == device_id_b:
            raise ClusterError(
                format_error(
                    "a device has no link to itself",
                    where="link_between",
                    value=device_id_a,
                    remedy="ask for two different device ids",
                )
            )
        if ga == gb:
            group = self.groups[ga]
            if na == nb or group.inter_node is None:
                return group.intra_node
            return group.inter_node
        pair = {self.groups[ga].name, self.groups[gb].name}
        for gl in self.group_links:
            if set(gl.groups) == pair:
                return gl.link
        assert self.between_groups is not None  # __post_init__ requires it with >= 2 groups
        return self.between_groups

    # ----------------------------------------------------------------------------------------
    # serialisation

    def to_dict(self) -> dict[str, Any]:
        """The description as a dict of the YAML schema; :meth:`from_dict` reads it back.

        Catalog devices are written by name (inline when their figures differ from the
        catalog's). Bound devices are not part of it; ids are renumbered group by group.
        """
        return self._describe(expand_devices=False)

    def content_hash(self) -> str:
        """sha256 (hex) of a canonical JSON of the description, device figures expanded.

        Independent of bound devices, free-text descriptions and source citations; it changes
        when a figure the planner uses changes (including a catalog file's).
        """
        text = json.dumps(
            self._describe(expand_devices=True),
            sort_keys=True,
            separators=(",", ":"),
            allow_nan=False,
        )
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def _describe(self, *, expand_devices: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.description and not expand_devices:
            out["description"] = self.description
        groups = []
        for g in self.groups:
            entry: dict[str, Any] = {
                "name": g.name,
                "device": _device_for_hash(g.device) if expand_devices else _device_ref(g.device),
                "nodes": g.nodes,
                "devices_per_node": g.devices_per_node,
                "intra_node": g.intra_node.to_dict(),
            }
            if g.inter_node is not None:
                entry["inter_node"] = g.inter_node.to_dict()
            groups.append(entry)
        out["groups"] = groups
        if self.between_groups is not None:
            out["between_groups"] = self.between_groups.to_dict()
        if self.group_links:
            out["group_links"] = [
                {"groups": list(gl.groups), **gl.link.to_dict()} for gl in self.group_links
            ]
        return out

    def summary(self) -> str:
        """A few lines for a terminal: groups, ids, figures and links.

        Example:
            >>> print(Cluster.local().summary().splitlines()[0])
            cluster 'local': 8 devices in 1 group (bound to 8 jax devices)
        """
        bound = (
            f"bound to {len(self.devices)} jax devices"
            if self.devices is not None
            else "described only, not bound to jax devices"
        )
        plural = "s" if len(self.groups) > 1 else ""
        lines = [
            f"cluster {self.name!r}: {self.num_devices} devices in {len(self.groups)} "
            f"group{plural} ({bound})"
        ]
        width = max(len(g.name) for g in self.groups)
        for g in self.groups:
            spec = g.device
            lines.append(
                f"  {g.name:<{width}}  ids {_id_ranges(g.device_ids):<12} {g.nodes} node"
                f"{'s' if g.nodes > 1 else ''} x {g.devices_per_node} {spec.name}: "
                f"{_peak_text(spec)}, {spec.memory_bytes / 1e9:g} GB, "
                f"{spec.hbm_bandwidth_bytes_per_s / 1e9:g} GB/s memory"
            )
            links = f"intra-node {_link_text(g.intra_node)}"
            if g.inter_node is not None:
                links += f"; inter-node {_link_text(g.inter_node)}"
            lines.append(f"  {'':<{width}}  {links}")
        if self.between_groups is not None:
            lines.append(f"  between groups: {_link_text(self.between_groups)}")
        for gl in self.group_links:
            lines.append(f"  {gl.groups[0]} <-> {gl.groups[1]}: {_link_text(gl.link)}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# helpers


def _count_mismatch(name: str, described: int, given: int, file: str | None) -> ClusterError:
    where = f"devices= for cluster {name!r}" + (f" ({file})" if file else "")
    return ClusterError(
        format_error(
            f"the cluster describes {described} devices but {given} jax devices were given",
            where=where,
            value=given,
            remedy=f"pass exactly {described} devices (e.g. devices=jax.devices()[:{described}]); "
            f"on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={described} (or "
            f"jax.config.update('jax_num_cpu_devices', {described})) before jax starts; or "
            f"describe a cluster of {given} devices",
        )
    )


def _device_ref(spec: DeviceSpec) -> str | dict[str, Any]:
    """The catalog name if ``spec`` is exactly the catalog's entry, else the inline spec."""
    if spec.name in catalog_names() and load_device(spec.name) == spec:
        return spec.name
    return spec.to_dict()


def _device_for_hash(spec: DeviceSpec) -> dict[str, Any]:
    d = spec.to_dict()
    for free_text in ("source", "description", "device_kinds"):
        d.pop(free_text, None)
    return d


def _id_ranges(ids: Sequence[int]) -> str:
    """``(0, 1, 2, 3, 8, 9)`` -> ``"0-3,8-9"``."""
    parts: list[str] = []
    start = prev = ids[0]
    for i in (*ids[1:], None):
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        if i is not None:
            start = prev = i
    return ",".join(parts)


def _peak_text(spec: DeviceSpec) -> str:
    dtype = "bf16"
    try:
        run = spec.effective_dtype(dtype)
    except ClusterError:
        dtype = run = max(spec.peak_flops_per_s, key=lambda k: spec.peak_flops_per_s[k])
    as_run = f" (runs as {run})" if run != dtype else ""
    return f"{spec.peak_flops_per_s[run] / 1e12:g} TFLOP/s {dtype}{as_run}"


def _link_text(link: Link) -> str:
    return f"{link.bandwidth_bytes_per_s / 1e9:g} GB/s, {link.latency_s * 1e6:g} us"
