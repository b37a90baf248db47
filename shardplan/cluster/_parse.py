"""Builds the parts of a :class:`~shardplan.cluster.Cluster` from a dict or local devices.

Kept apart from the ``Cluster`` value so that each module stays small: the functions here
return the keyword arguments of ``Cluster(...)``, and ``Cluster``'s constructors call them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardplan._schema import Where
from shardplan.cluster._schema import as_int, as_mapping, as_str, check_keys, fail
from shardplan.cluster.catalog import catalog_name_for_kind, catalog_names, load_device
from shardplan.cluster.group import LINK_HINT, DeviceGroup, GroupLink, check_device_count
from shardplan.cluster.link import parse_link

__all__ = ["GROUP_EXAMPLE", "cluster_parts", "local_parts"]

_CLUSTER_KEYS = ("name", "description", "groups", "between_groups", "group_links")
_GROUP_KEYS = ("name", "device", "nodes", "devices_per_node", "intra_node", "inter_node")
_GROUP_LINK_KEYS = ("groups", "bandwidth_GB_s", "latency_us")
GROUP_EXAMPLE = (
    "{device: a100-80g, nodes: 1, devices_per_node: 8, "
    "intra_node: {bandwidth_GB_s: 300, latency_us: 2}}"
)


def _group_counts(g: Mapping[str, Any], where: Where, *, first_id: int) -> tuple[int, int]:
    """``(nodes, devices_per_node)`` of a group, checked against ``MAX_DEVICES`` (with the
    ``first_id`` devices of the groups before it) before anything of their size is built.

    Raises:
      ClusterError: a count that is not a whole number >= 1, or too many devices.
    """
    nodes = as_int(g["nodes"], where.key("nodes"), what="a node count")
    check_device_count(
        nodes, where.key("nodes"), what=f"the group has {nodes:,} nodes (at least as many devices)"
    )
    per_node = as_int(
        g["devices_per_node"], where.key("devices_per_node"), what="a device count per node"
    )
    check_device_count(
        per_node, where.key("devices_per_node"), what=f"each node has {per_node:,} devices"
    )
    count = nodes * per_node
    check_device_count(
        count,
        where,
        what=f"the group has {nodes:,} nodes x {per_node:,} devices = {count:,} devices",
        value={"nodes": nodes, "devices_per_node": per_node},
    )
    check_device_count(
        first_id + count,
        where,
        what=f"with this group's {count:,}, the cluster has {first_id + count:,} devices",
        value={"devices before this group": first_id, "this group": count},
    )
    return nodes, per_node


def _parse_group(value: object, where: Where, *, first_id: int, taken: set[str]) -> DeviceGroup:
    g = as_mapping(value, where, what="a device group")
    check_keys(
        g,
        where,
        allowed=_GROUP_KEYS,
        required=("device", "nodes", "devices_per_node", "intra_node"),
        remedies={
            "device": f"add 'device: <catalog name>' ({', '.join(catalog_names())}) or an "
            "inline spec {peak_flops_per_s, memory_bytes, hbm_bandwidth_bytes_per_s}",
            "nodes": "add 'nodes: <number of nodes>'",
            "devices_per_node": "add 'devices_per_node: <devices in each node>'",
            "intra_node": f"add intra_node: {LINK_HINT}",
        },
    )
    device = load_device(g["device"], where=where.key("device"))
    nodes, per_node = _group_counts(g, where, first_id=first_id)
    intra = parse_link(g["intra_node"], where.key("intra_node"))
    inter = None
    if g.get("inter_node") is not None:
        inter = parse_link(g["inter_node"], where.key("inter_node"))
    elif nodes > 1:
        raise fail(
            where.key("inter_node"),
            f"the group has {nodes} nodes but no inter_node link",
            {"nodes": nodes},
            f"add inter_node: {LINK_HINT} (e.g. 25 GB/s for one 200 Gb/s NIC per GPU), "
            "or use nodes: 1",
        )
    if g.get("name") is not None:
        name = as_str(g["name"], where.key("name"), what="a group name")
        if name in taken:
            raise fail(
                where.key("name"),
                f"two groups are named {name!r}",
                name,
                "give each group a distinct name",
            )
    else:
        name = device.name
        suffix = 1
        while name in taken:  # a second group of the same type: a100-80g.1, a100-80g.2, ...
            name, suffix = f"{device.name}.{suffix}", suffix + 1
    taken.add(name)
    ids = tuple(range(first_id, first_id + nodes * per_node))
    return DeviceGroup(
        name=name,
        device=device,
        nodes=nodes,
        devices_per_node=per_node,
        intra_node=intra,
        inter_node=inter,
        device_ids=ids,
    )


def _parse_group_links(value: object, where: Where, names: list[str]) -> tuple[GroupLink, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise fail(
            where,
            "group_links must be a list",
            value,
            "write a list of {groups: [a, b], bandwidth_GB_s: ..., latency_us: ...}",
        )
    out: list[GroupLink] = []
    seen: set[frozenset[str]] = set()
    for i, item in enumerate(value):
        w = where.index(i)
        m = as_mapping(item, w, what="a group link")
        check_keys(
            m,
            w,
            allowed=_GROUP_LINK_KEYS,
            required=("groups",),
            remedies={"groups": "add 'groups: [<group name>, <group name>]'"},
        )
        pair = m["groups"]
        if (
            not isinstance(pair, list)
            or len(pair) != 2
            or len(set(map(str, pair))) != 2
            or not all(p in names for p in pair)
        ):
            raise fail(
                w.key("groups"),
                "groups must name two different groups of this cluster",
                pair,
                f"name two of: {', '.join(names)}",
            )
        if frozenset(pair) in seen:
            raise fail(
                w.key("groups"),
                "a second link for the same pair of groups",
                pair,
                "keep one entry per pair",
            )
        seen.add(frozenset(pair))
        link = parse_link({k: v for k, v in m.items() if k != "groups"}, w)
        out.append(GroupLink(groups=(pair[0], pair[1]), link=link))
    return tuple(out)


def cluster_parts(data: object, where: Where) -> dict[str, Any]:
    """Parses a cluster description (YAML schema) into the keyword arguments of ``Cluster``.

    Raises:
      ClusterError: naming the file and line (when ``where`` has them), key path, value, fix.
    """
    d = as_mapping(data, where, what="a cluster description")
    check_keys(
        d,
        where,
        allowed=_CLUSTER_KEYS,
        required=("name", "groups"),
        remedies={
            "name": "add 'name: <cluster name>'",
            "groups": f"add 'groups:' with a list of groups, e.g. - {GROUP_EXAMPLE}",
        },
    )
    name = as_str(d["name"], where.key("name"), what="a cluster name")
    description = ""
    if d.get("description") is not None:
        description = as_str(d["description"], where.key("description"), what="a description")
    raw = d["groups"]
    if not isinstance(raw, list) or not raw:
        what = "groups is empty" if isinstance(raw, list) else "groups must be a list"
        raise fail(
            where.key("groups"),
            what,
            raw,
            f"list at least one group, e.g. groups: [{GROUP_EXAMPLE}]",
        )
    groups: list[DeviceGroup] = []
    taken: set[str] = set()
    for i, item in enumerate(raw):
        first_id = sum(g.num_devices for g in groups)
        groups.append(
            _parse_group(item, where.key("groups").index(i), first_id=first_id, taken=taken)
        )
    between = None
    if d.get("between_groups") is not None:
        between = parse_link(d["between_groups"], where.key("between_groups"))
    elif len(groups) >= 2:
        raise fail(
            where.key("between_groups"),
            f"a cluster with {len(groups)} groups needs a between_groups link",
            [g.name for g in groups],
            f"add between_groups: {LINK_HINT} (the per-device bandwidth of the network "
            "joining the groups, e.g. the slower group's NIC bandwidth per GPU)",
        )
    group_links = _parse_group_links(
        d.get("group_links"), where.key("group_links"), [g.name for g in groups]
    )
    return {
        "name": name,
        "groups": tuple(groups),
        "between_groups": between,
        "description": description,
        "group_links": group_links,
    }


def _local_type_names(devs: tuple[Any, ...], types: Mapping[str, int] | None) -> list[str]:
    """The catalog name of each local device: by ``device_kind``, or from ``types``."""
    if types is None:
        by_kind: dict[str, str] = {}
        kinds: list[str] = []
        for i, device in enumerate(devs):
            kind = str(getattr(device, "device_kind", "unknown"))
            if kind not in by_kind:
                name = catalog_name_for_kind(kind)
                if name is None:
                    raise fail(
                        f"devices[{i}] ({device})",
                        f"jax device kind {kind!r} is not in the device catalog",
                        kind,
                        f"emulate a catalog type with Cluster.local(types={{'<name>': "
                        f"{len(devs)}}}) (names: {', '.join(catalog_names())}); or describe the "
                        "cluster with an inline device spec {peak_flops_per_s, memory_bytes, "
                        "hbm_bandwidth_bytes_per_s} and Cluster.from_dict(..., devices=...); or "
                        "add the kind to device_kinds in its configs/devices/<name>.yaml",
                    )
                by_kind[kind] = name
            kinds.append(by_kind[kind])
        return kinds
    if not isinstance(types, Mapping) or not types:
        raise fail(
            "types=",
            "types must be a non-empty mapping of catalog name -> count",
            types,
            "pass e.g. types={'a100-80g': 4, 'v100-32g': 4}",
        )
    counts: dict[str, int] = {}  # counted, and checked against MAX_DEVICES, before expanded
    for key, count in types.items():
        where = Where(path=f"types[{key!r}]")
        spec = load_device(key, where=where)
        n = as_int(count, where, what="a device count")
        check_device_count(n, where, what=f"{n:,} devices of type {spec.name!r}")
        if spec.name in counts:
            raise fail(
                where, f"device type {spec.name!r} is listed twice", key, "list each type once"
            )
        counts[spec.name] = n
    total = sum(counts.values())
    check_device_count(total, "types=", what=f"the counts add up to {total:,}", value=dict(types))
    if total != len(devs):
        raise fail(
            "types=",
            f"the counts add up to {total} but there are {len(devs)} devices",
            dict(types),
            f"make the counts sum to {len(devs)}, or pass devices= with "
            f"{total} devices (e.g. devices=jax.devices()[:{total}])",
        )
    return [name for name, n in counts.items() for _ in range(n)]


def _local_group(name: str, ids: list[int], devs: tuple[Any, ...]) -> DeviceGroup:
    """One group of local devices of type ``name``; each jax process is one node."""
    spec = load_device(name)
    by_process: dict[int, list[int]] = {}
    for device_id in ids:
        process = int(getattr(devs[device_id], "process_index", 0))
        by_process.setdefault(process, []).append(device_id)
    counts = {process: len(v) for process, v in by_process.items()}
    if len(set(counts.values())) > 1:
        raise fail(
            f"devices of type {name!r}",
            "a device type has different device counts on different processes (nodes)",
            counts,
            "give every process the same number of devices of each type, or describe "
            "the cluster in YAML and bind it with Cluster.from_yaml(path, devices=...)",
        )
    if spec.intra_node_link is None:
        raise fail(
            f"configs/devices/{name}.yaml",
            "the device file has no intra_node_link",
            name,
            f"add intra_node_link: {LINK_HINT}",
        )
    nodes = len(by_process)
    return DeviceGroup(
        name=spec.name,
        device=spec,
        nodes=nodes,
        devices_per_node=next(iter(counts.values())),
        intra_node=spec.intra_node_link,
        inter_node=(spec.inter_node_link or spec.intra_node_link) if nodes > 1 else None,
        device_ids=tuple(i for process_ids in by_process.values() for i in process_ids),
    )


def local_parts(devices: tuple[Any, ...], types: Mapping[str, int] | None) -> dict[str, Any]:
    """The keyword arguments of ``Cluster`` for local jax devices (see ``Cluster.local``)."""
    if not devices:
        raise fail(
            "devices=",
            "no devices given",
            list(devices),
            "pass at least one jax device, e.g. devices=jax.devices()[:4]",
        )
    if len(set(devices)) != len(devices):
        raise fail("devices=", "the same device is given twice", devices, "pass each device once")
    ids_by_type: dict[str, list[int]] = {}
    for device_id, type_name in enumerate(_local_type_names(devices, types)):
        ids_by_type.setdefault(type_name, []).append(device_id)
    groups = tuple(_local_group(name, ids, devices) for name, ids in ids_by_type.items())
    between = None
    if len(groups) >= 2:
        # Devices of different types never share NVLink: take the slowest inter-node link.
        links = [g.device.inter_node_link or g.intra_node for g in groups]
        between = min(links, key=lambda link: (link.bandwidth_bytes_per_s, -link.latency_s))
    platform = str(getattr(devices[0], "platform", "jax"))
    how = "emulating " + ", ".join(f"{n} x {t}" for t, n in types.items()) if types else ""
    return {
        "name": "local",
        "groups": groups,
        "between_groups": between,
        "devices": devices,
        "description": f"{len(devices)} local {platform} devices {how}".strip(),
    }
