"""Collective communication times: the α-β ring model with a per-call start-up, on a cluster's
real links.

All functions are pure (no jax), in seconds and bytes. A link is a
:class:`~shardplan.cluster.Link`: ``bandwidth_bytes_per_s`` per direction per device and
``latency_s``, the latency α of one message over it (one step of a ring).

**What B is.** The ring functions take ``nbytes`` = B, the size of the *full* buffer on one
device, unsharded along the collective's axes:

=================  ===========================================  ==============================
collective         B                                            XLA result per device (HLO)
=================  ===========================================  ==============================
all-reduce         the buffer (input = output)                  B
all-gather         the gathered *result*                        B
reduce-scatter     the *input* (before scattering)              B / n
all-to-all         the per-device buffer (input = output)       B
collective-permute the buffer sent (= received)                 B
=================  ===========================================  ==============================

**Start-up.** Every collective call first pays a fixed start-up α0 (kernel launch and the
synchronisation of the participants; on XLA:CPU the rendezvous of the device threads) that
does not grow with n, then its steps. This is NCCL's own tuning model (NVIDIA/nccl
``src/graph/tuning.cc``, ``ncclTopoTuneModel``): ``latency = baseLat + nsteps·hwLat``, with a
base latency per algorithm and protocol independent of the hardware (ring: LL 6.6, LL128 14,
Simple 8.4 µs) and a per-step latency per link type (ring LL / LL128 / Simple: NVLink 0.6 /
1.9 / 3.4, PCIe 1.0 / 2.5 / 5.7, network 2.7 / 4.0 / 14 µs). A link's ``latency_s`` keeps its
meaning, the per-step α (the catalog's 2 µs NVLink and 5 µs InfiniBand steps lie between
NCCL's LL128 and Simple figures), and the start-up is :data:`STARTUP_STEPS` of them,
``α0 = 4·α``: NCCL's base over step latency is 11 / 7.4 / 2.5 on NVLink, 6.6 / 5.6 / 1.5 on
PCIe, 2.4 / 3.5 / 0.6 on the network, so 4 is its middle; on the catalog's 2 µs NVLink step
α0 = 8 µs (NCCL ring: 6.6-8.4 µs), on a 5 µs NIC 20 µs, on 25 µs TCP 100 µs, and on the
emulated CPU devices (10 µs) 40 µs, which makes a 4-device all-reduce of 32 KiB 1.65x a
2-device one (measured on XLA:CPU: 1.6-2.1x; the per-step model alone said 2.63x). Without
it ten 2-device all-reduces looked cheaper than five 4-device ones of twice the bytes
(20α < 30α), though they take twice the calls. A call is one start-up, whatever it spans:
XLA issues one NCCL call (or one XLA:CPU rendezvous) per collective instruction (after its
combiner passes have merged some), and NCCL runs a multi-node ring or tree inside that one
call (tuning.cc adds one ``baseLat`` and splits only the steps into intra- and inter-node
ones), so a hierarchical collective pays one start-up, on the slowest link it uses (every
participant must have started). The bandwidth terms are unchanged, so the large-message
limit is the plain ring's.

**Flat ring** over n devices (Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 2005, §4; Patarasuk & Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009), α0 = 4·α::

    all-reduce           α0 + 2(n−1)·α + 2(n−1)/n · B/bw
    all-gather           α0 + (n−1)·α + (n−1)/n · B/bw
    reduce-scatter       α0 + (n−1)·α + (n−1)/n · B/bw
    all-to-all           α0 + (n−1)·α + (n−1)/n · B/bw      (pairwise exchange, B per device)
    send/recv            α0 + α + B/bw                      (one message)
    n == 1               0

**Hierarchical** (a group of one device type spanning k nodes with m participants per node,
n = k·m; the two-level decomposition of BlueConnect, Cho et al., SysML 2019, §3, and of
Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``; NCCL's multi-node rings have the same bandwidth
term because every byte crossing nodes is first reduced inside the node). Intra-node steps use
the node link (i), the cross-node step the per-device NIC link (e), all m NICs of a node in
parallel, each carrying the 1/m shard its device owns; the one start-up
α0 = 4·max(α_i, α_e) of the call comes first (4·α_i when k = 1, 4·α_e when m = 1)::

    reduce-scatter  α0 + RS_i(m, B)      then RS_e(k, B/m)
        = α0 + (m−1)·α_i + (m−1)/m · B/bw_i  +  (k−1)·α_e + (k−1)/k · (B/m)/bw_e
    all-gather      α0 + AG_e(k, B/m)    then AG_i(m, B)          (same total)
    all-reduce      α0 + RS_i(m, B) + AR_e(k, B/m) + AG_i(m, B)
        = α0 + 2(m−1)·α_i + 2(m−1)/m · B/bw_i  +  2(k−1)·α_e + 2(k−1)/k · (B/m)/bw_e
    all-to-all      each device sends B/n to every other device: m−1 messages in the node,
                    n−m across nodes, the two parts summed (an upper bound: they may overlap)
        = α0 + (m−1)·α_i + (m−1)/n · B/bw_i  +  (n−m)·α_e + (k−1)/k · B/bw_e

so hierarchical all-reduce = hierarchical reduce-scatter + all-gather − one start-up (one
call, not two), and with equal links every formula is the flat ring's. With uneven
participants per node the bound takes the largest per-node count for the intra-node steps
and the smallest for the shard size across nodes.

**Across device groups** (types) there is no hierarchy to exploit: the collective is a flat
ring over all n devices in id order (NCCL lays rings out node by node, so contiguous ids
share a node), and a pipelined ring runs at the pace of its slowest hop: the ring, start-up
included, is costed on the *bottleneck link* — the lowest bandwidth and the highest latency
of its hops (``Cluster.link_between``). A collective-permute (a pipeline send) is one call
per hop, ``α0 + α + B/bw`` on that hop's link; the slowest hop bounds it.

**Efficiency.** :func:`collective_time_s` derates each link's bandwidth by the smallest
``efficiency.collective`` of the device types in the group (achieved NCCL bus bandwidth over
nominal link bandwidth); latencies and start-ups are not derated. The ring functions take
the link as given.

Example:
    >>> from shardplan.cluster import Link
    >>> round(ring_all_reduce_s(8, 2**30, Link(300e9, 2e-6)) * 1e3, 4)  # 8 GPUs, 1 GiB, ms
    6.2995
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from shardplan.cluster import Cluster, Link, LogicalMesh
from shardplan.errors import ClusterError, format_error

# (Past 600 lines: about half is the formulas' docstrings with hand-worked examples, which the
# doctests run. The ring, hierarchical and across-group formulas and the per-call start-up are
# one model; the mesh-axis helpers at the end, mesh_axis_links and mesh_collective_time_s, are
# the piece to move out, with planner/layout.py's MeshCollectives.)

__all__ = [
    "COLLECTIVE_KINDS",
    "STARTUP_STEPS",
    "CollectiveKind",
    "LinkLevel",
    "all_to_all_s",
    "b_bytes_from_result",
    "collective_startup_s",
    "collective_time_s",
    "hierarchical_all_gather_s",
    "hierarchical_all_reduce_s",
    "hierarchical_all_to_all_s",
    "hierarchical_reduce_scatter_s",
    "link_for_group",
    "mesh_axis_links",
    "mesh_collective_time_s",
    "ring_all_gather_s",
    "ring_all_reduce_s",
    "ring_reduce_scatter_s",
    "send_recv_s",
    "startup_s",
]

CollectiveKind = Literal[
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"
]
"""XLA's names of the collectives (HLO opcodes, without ``-start`` / ``-done``)."""

COLLECTIVE_KINDS: tuple[CollectiveKind, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)

LinkLevel = Literal["intra_node", "inter_node", "between_groups"]
"""The physical level a set of devices spans: one node, several nodes of one device group, or
several device groups."""

_LEVEL_RANK: dict[LinkLevel, int] = {"intra_node": 0, "inter_node": 1, "between_groups": 2}

STARTUP_STEPS = 4
"""The start-up α0 of one collective call, in per-step latencies α of its link: α0 = 4·α.

NCCL's ring base latency over its per-step latency (``baseLat / hwLat`` in NVIDIA/nccl
``src/graph/tuning.cc``) is 11 / 7.4 / 2.5 (LL / LL128 / Simple) on NVLink, 6.6 / 5.6 / 1.5
on PCIe and 2.4 / 3.5 / 0.6 on the network; 4 is the middle of that range, gives the
catalog's 2 µs NVLink step NCCL's 8 µs ring start-up, and makes a 4-device XLA:CPU
all-reduce 1.6-1.7x a 2-device one, as measured (module docstring)."""


# --------------------------------------------------------------------------------------------
# flat ring (B convention)


def _check(n: int, nbytes: float) -> None:
    if n < 1 or nbytes < 0:
        raise ClusterError(
            format_error(
                "a collective needs n >= 1 devices and nbytes >= 0",
                where="shardplan.cost.collectives",
                value={"n": n, "nbytes": nbytes},
                remedy="pass the number of participating devices and a byte count >= 0",
            )
        )


def startup_s(link: Link) -> float:
    """The start-up α0 of one collective call on ``link``: ``STARTUP_STEPS · α``.

    Example:
        >>> startup_s(Link(300e9, 2e-6)) * 1e6  # NVLink, 2 µs per step: 8 µs (NCCL: 6.6-8.4)
        8.0
    """
    return STARTUP_STEPS * link.latency_s


def _ring_pass_s(steps: int, n: int, nbytes: float, link: Link) -> float:
    """``steps`` ring passes without the start-up: ``steps·(n−1)·α + steps·(n−1)/n · B/bw``;
    0 when ``n == 1``. One level of a hierarchical collective, or the body of a flat one."""
    _check(n, nbytes)
    if n == 1:
        return 0.0
    return steps * (n - 1) * (link.latency_s + nbytes / (n * link.bandwidth_bytes_per_s))


def _flat_s(steps: int, n: int, nbytes: float, link: Link) -> float:
    """One call of ``steps`` ring passes: ``α0 + steps·(n−1)·α + steps·(n−1)/n · B/bw``."""
    body_s = _ring_pass_s(steps, n, nbytes, link)
    return 0.0 if n == 1 else startup_s(link) + body_s


def ring_all_reduce_s(n: int, nbytes: float, link: Link) -> float:
    """Ring all-reduce time: ``α0 + 2(n−1)·α + 2(n−1)/n · B/bw`` (Thakur et al. 2005, §4.5;
    the start-up α0 = :func:`startup_s`, NCCL tuning.cc).

    Args:
      n: devices in the ring.
      nbytes: B, the buffer size on each device (input = output).
      link: the ring's link (per-direction bandwidth per device, per-step latency α).

    Returns:
      Seconds; 0 for ``n == 1``.

    Example:
        >>> round(ring_all_reduce_s(8, 2**30, Link(300e9, 2e-6)) * 1e3, 4)  # 8 + 28 µs + 6.2635 ms
        6.2995
    """
    return _flat_s(2, n, nbytes, link)


def ring_all_gather_s(n: int, nbytes: float, link: Link) -> float:
    """Ring all-gather time: ``α0 + (n−1)·α + (n−1)/n · B/bw`` (Thakur et al. 2005, §4.1).

    Args:
      n: devices in the ring.
      nbytes: B, the size of the gathered *result* on each device (each holds B/n before).
      link: the ring's link.

    Returns:
      Seconds; 0 for ``n == 1``.
    """
    return _flat_s(1, n, nbytes, link)


def ring_reduce_scatter_s(n: int, nbytes: float, link: Link) -> float:
    """Ring reduce-scatter time: ``α0 + (n−1)·α + (n−1)/n · B/bw`` (Thakur et al. 2005, §4.4).

    Args:
      n: devices in the ring.
      nbytes: B, the size of the *input* on each device (each keeps B/n of the sum).
      link: the ring's link.

    Returns:
      Seconds; 0 for ``n == 1``.
    """
    return _flat_s(1, n, nbytes, link)


def all_to_all_s(n: int, nbytes: float, link: Link) -> float:
    """All-to-all time, pairwise exchange: ``α0 + (n−1)·α + (n−1)/n · B/bw`` (Thakur et al.
    2005, §4.3).

    Args:
      n: devices taking part.
      nbytes: B, the per-device buffer; B/n goes to each device (one part stays).
      link: the link every pair exchanges over.

    Returns:
      Seconds; 0 for ``n == 1``.
    """
    return _flat_s(1, n, nbytes, link)


def send_recv_s(nbytes: float, link: Link) -> float:
    """Point-to-point time ``α0 + α + B/bw`` (every device sends and receives B at once): one
    call (XLA's collective-permute is one NCCL send/recv group), one message.

    Args:
      nbytes: B, the bytes each device sends.
      link: the link between sender and receiver.

    Example:
        >>> round(send_recv_s(2**20, Link(25e9, 5e-6)) * 1e6, 3)  # 20 + 5 µs + 41.943 µs
        66.943
    """
    _check(1, nbytes)
    return startup_s(link) + link.transfer_time_s(nbytes)


# --------------------------------------------------------------------------------------------
# two-level (node, then across nodes) decompositions, B convention


def _hierarchical_startup_s(nodes: int, per_node: int, intra: Link, inter: Link) -> float:
    """One start-up for the whole call, on the slowest link it uses (module docstring)."""
    used = [link for link, count in ((intra, per_node), (inter, nodes)) if count > 1]
    return max((startup_s(link) for link in used), default=0.0)


def hierarchical_reduce_scatter_s(
    nodes: int, per_node: int, nbytes: float, intra: Link, inter: Link
) -> float:
    """Reduce-scatter inside each node, then across nodes on the 1/m shards (BlueConnect §3).

    ``α0 + (m−1)·α_i + (m−1)/m · B/bw_i + (k−1)·α_e + (k−1)/k · (B/m)/bw_e`` with
    k = ``nodes``, m = ``per_node``, and one start-up α0 = 4·max(α_i, α_e) for the call.

    Args:
      nodes: k, nodes taking part.
      per_node: m, participants in each node.
      nbytes: B, the input size on each device.
      intra: the link inside a node.
      inter: the per-device link between nodes (one NIC per device, all used at once).
    """
    shard_bytes = nbytes / per_node
    return (
        _hierarchical_startup_s(nodes, per_node, intra, inter)
        + _ring_pass_s(1, per_node, nbytes, intra)
        + _ring_pass_s(1, nodes, shard_bytes, inter)
    )


def hierarchical_all_gather_s(
    nodes: int, per_node: int, nbytes: float, intra: Link, inter: Link
) -> float:
    """All-gather across nodes (of the 1/m shards), then inside each node (BlueConnect §3).

    The mirror image of :func:`hierarchical_reduce_scatter_s`, same time.

    Args:
      nodes: k, nodes taking part.
      per_node: m, participants in each node.
      nbytes: B, the gathered result size on each device.
      intra: the link inside a node.
      inter: the per-device link between nodes.
    """
    shard_bytes = nbytes / per_node
    return (
        _hierarchical_startup_s(nodes, per_node, intra, inter)
        + _ring_pass_s(1, nodes, shard_bytes, inter)
        + _ring_pass_s(1, per_node, nbytes, intra)
    )


def hierarchical_all_reduce_s(
    nodes: int, per_node: int, nbytes: float, intra: Link, inter: Link
) -> float:
    """Reduce-scatter in the node, all-reduce of the 1/m shards across nodes, all-gather in the
    node (BlueConnect, Cho et al. 2019, §3; Horovod hierarchical all-reduce), in one call.

    ``α0 + 2(m−1)·α_i + 2(m−1)/m · B/bw_i + 2(k−1)·α_e + 2(k−1)/k · (B/m)/bw_e`` with one
    start-up α0 = 4·max(α_i, α_e).

    Args:
      nodes: k, nodes taking part.
      per_node: m, participants in each node.
      nbytes: B, the buffer on each device.
      intra: the link inside a node.
      inter: the per-device link between nodes.
    """
    shard_bytes = nbytes / per_node
    return (
        _hierarchical_startup_s(nodes, per_node, intra, inter)
        + _ring_pass_s(2, per_node, nbytes, intra)
        + _ring_pass_s(2, nodes, shard_bytes, inter)
    )


def hierarchical_all_to_all_s(
    nodes: int, per_node: int, nbytes: float, intra: Link, inter: Link
) -> float:
    """Pairwise all-to-all with each message on its own level, the levels summed, one call.

    Each device sends B/n to each of the other n−1 devices (n = k·m): m−1 messages in the
    node, n−m across nodes,
    ``α0 + (m−1)·α_i + (m−1)/n · B/bw_i + (n−m)·α_e + (k−1)/k · B/bw_e``, α0 = 4·max(α_i, α_e).
    Summing is an upper bound (NVLink and NIC transfers can overlap); with equal links it is
    :func:`all_to_all_s`.

    Args:
      nodes: k, nodes taking part.
      per_node: m, participants in each node.
      nbytes: B, the per-device buffer.
      intra: the link inside a node.
      inter: the per-device link between nodes.
    """
    _check(nodes * per_node, nbytes)
    n = nodes * per_node
    intra_s = (per_node - 1) * (intra.latency_s + nbytes / (n * intra.bandwidth_bytes_per_s))
    inter_s = (n - per_node) * (inter.latency_s + nbytes / (n * inter.bandwidth_bytes_per_s))
    return _hierarchical_startup_s(nodes, per_node, intra, inter) + intra_s + inter_s


# --------------------------------------------------------------------------------------------
# groups of device ids on a cluster


def _checked_group(group: Sequence[int], cluster: Cluster) -> tuple[int, ...]:
    ids = tuple(int(i) for i in group)
    if not ids or len(set(ids)) != len(ids):
        raise ClusterError(
            format_error(
                "a collective's group must list distinct device ids, at least one",
                where=f"collective group on cluster {cluster.name!r}",
                value=ids,
                remedy="pass the device ids taking part, each once (e.g. mesh.groups(axes)[0])",
            )
        )
    for device_id in ids:
        cluster.node_of(device_id)  # raises ClusterError naming an unknown id
    return ids


def _level(ids: tuple[int, ...], cluster: Cluster) -> LinkLevel:
    if len({cluster.group_of(i).name for i in ids}) > 1:
        return "between_groups"
    if len({cluster.node_of(i) for i in ids}) > 1:
        return "inter_node"
    return "intra_node"


def _bottleneck_link(ids: tuple[int, ...], cluster: Cluster) -> Link:
    """The slowest hop of a ring over ``ids`` in id order: min bandwidth, max latency."""
    ring = sorted(ids)
    hops = [cluster.link_between(a, b) for a, b in zip(ring, ring[1:] + ring[:1], strict=True)]
    return Link(min(h.bandwidth_bytes_per_s for h in hops), max(h.latency_s for h in hops))


def link_for_group(group: Sequence[int], cluster: Cluster) -> tuple[LinkLevel, Link]:
    """The physical level a device group spans and the link that bounds its collectives.

    Args:
      group: the participating device ids.
      cluster: the cluster they belong to.

    Returns:
      ``("intra_node", group's intra_node link)`` when all devices share a node (also for a
      single device); ``("inter_node", group's inter_node link)`` — the NIC — when they span
      nodes of one device group (collectives are then costed hierarchically, see the module
      docstring); ``("between_groups", bottleneck link)`` when they span device groups: the
      lowest bandwidth and highest latency of the hops of a ring in id order.

    Raises:
      ClusterError: an empty group, a repeated or unknown device id.

    Example:
        >>> c = Cluster.from_yaml("configs/clusters/a100x8_v100x8.yaml")
        >>> link_for_group([0, 1, 2, 3], c)[0], link_for_group([6, 7, 8, 9], c)[0]
        ('intra_node', 'between_groups')
    """
    ids = _checked_group(group, cluster)
    level = _level(ids, cluster)
    if level == "between_groups":
        return level, _bottleneck_link(ids, cluster)
    device_group = cluster.group_of(ids[0])
    if level == "inter_node":
        assert device_group.inter_node is not None  # a multi-node group always has one
        return level, device_group.inter_node
    return level, device_group.intra_node


def _derated(link: Link, efficiency: float) -> Link:
    return Link(link.bandwidth_bytes_per_s * efficiency, link.latency_s)


def _collective_efficiency(ids: tuple[int, ...], cluster: Cluster) -> float:
    return min(cluster.group_of(i).device.efficiency.collective for i in ids)


def b_bytes_from_result(kind: CollectiveKind, result_bytes_per_device: float, n: int) -> float:
    """Converts XLA's per-device *result* size of a collective to the B of the ring formulas.

    Only reduce-scatter differs: its result is B/n, so B = n · result. (All-gather's result is
    the gathered buffer, all-reduce's / all-to-all's / collective-permute's equal their input.)

    Raises:
      ClusterError: an unknown kind.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ClusterError(
            format_error(
                f"unknown collective kind {kind!r}",
                where="collective_time_s(kind=...)",
                value=kind,
                remedy=f"use one of {', '.join(COLLECTIVE_KINDS)}",
            )
        )
    return result_bytes_per_device * n if kind == "reduce-scatter" else result_bytes_per_device


def _per_node_counts(ids: tuple[int, ...], cluster: Cluster) -> tuple[int, int, int]:
    """``(k nodes, smallest, largest participants per node)``."""
    counts: dict[int, int] = {}
    for device_id in ids:
        node = cluster.node_of(device_id)
        counts[node] = counts.get(node, 0) + 1
    return len(counts), min(counts.values()), max(counts.values())


def _hierarchical_s(
    kind: CollectiveKind, nbytes: float, ids: tuple[int, ...], cluster: Cluster, eff: float
) -> float:
    """A collective of one device group across nodes (module docstring, "Hierarchical")."""
    group = cluster.group_of(ids[0])
    assert group.inter_node is not None
    intra, inter = _derated(group.intra_node, eff), _derated(group.inter_node, eff)
    nodes, fewest, most = _per_node_counts(ids, cluster)
    if kind == "all-to-all":
        return hierarchical_all_to_all_s(nodes, most, nbytes, intra, inter)
    # Uneven nodes: the intra-node steps of the fullest node, the cross-node shards of the
    # emptiest (the larger shard); both bound the real time from above.
    steps = {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 1}[kind]
    return (
        _hierarchical_startup_s(nodes, most, intra, inter)
        + _ring_pass_s(steps, most, nbytes, intra)
        + _ring_pass_s(steps, nodes, nbytes / fewest, inter)
    )


def collective_time_s(
    kind: CollectiveKind,
    result_bytes_per_device: float,
    group: Sequence[int],
    cluster: Cluster,
    *,
    use_efficiency: bool = True,
    startup_share: float = 1.0,
) -> float:
    """Time of one collective over ``group`` on ``cluster``, in XLA's byte convention.

    Args:
      kind: ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all`` or
        ``collective-permute``.
      result_bytes_per_device: the size of the HLO instruction's result on one device (for
        reduce-scatter 1/n of its input; see :func:`b_bytes_from_result`).
      group: the participating device ids (one replica group). For ``collective-permute``,
        the devices of a ring shift ``group[i] -> group[i+1]``; the slowest hop bounds it.
      cluster: the cluster the ids belong to.
      use_efficiency: derate link bandwidths by the group's smallest ``efficiency.collective``.
      startup_share: the part of the call's start-up (:func:`collective_startup_s`) this
        collective pays: 1 for a call of its own, less for one that XLA's combiner merges
        with others into one call (:func:`shardplan.cost.combine.startup_share`).

    Returns:
      Seconds: a flat ring inside one node, the hierarchical decomposition across nodes of one
      device group, a flat ring on the bottleneck link across device groups; 0 for one device.

    Raises:
      ClusterError: an unknown kind, an empty group, a repeated or unknown device id.

    Example:
        >>> c = Cluster.from_yaml("configs/clusters/dgx-a100.yaml")
        >>> t = collective_time_s("all-gather", 2**20, range(8), c, use_efficiency=False)
        >>> round(t * 1e6, 2)  # 4·2 µs + 7·2 µs + 7/8 · 1 MiB / 300 GB/s
        25.06
    """
    ids = _checked_group(group, cluster)
    n = len(ids)
    nbytes = b_bytes_from_result(kind, result_bytes_per_device, n)
    if n == 1:
        return 0.0
    if not 0.0 <= startup_share <= 1.0:
        raise ClusterError(format_error(
            "a collective pays between none and all of its call's start-up",
            where="collective_time_s(startup_share=...)", value=startup_share,
            remedy="pass a share in [0, 1]"))
    whole_s = _whole_call_s(kind, nbytes, ids, cluster, use_efficiency)
    if startup_share == 1.0:
        return whole_s
    return whole_s - (1.0 - startup_share) * _startup_of(kind, ids, cluster)


def collective_startup_s(kind: CollectiveKind, group: Sequence[int], cluster: Cluster) -> float:
    """The start-up α0 that one call of ``kind`` over ``group`` pays once, whatever its bytes
    (module docstring, "Start-up"): ``STARTUP_STEPS`` latencies of the slowest link the call
    uses; for a collective-permute, of its slowest hop; 0 for one device.

    Example:
        >>> c = Cluster.from_yaml("configs/clusters/dgx-a100.yaml")
        >>> collective_startup_s("all-reduce", range(8), c) * 1e6  # 4 x 2 µs NVLink steps
        8.0
    """
    ids = _checked_group(group, cluster)
    b_bytes_from_result(kind, 0, len(ids))  # checks the kind
    return 0.0 if len(ids) == 1 else _startup_of(kind, ids, cluster)


def _shift_hops(ids: tuple[int, ...], cluster: Cluster) -> list[Link]:
    """The links of a ring shift ``ids[i] -> ids[i+1]`` (a collective-permute), in order."""
    return [cluster.link_between(a, b) for a, b in zip(ids, ids[1:] + ids[:1], strict=True)]


def _startup_of(kind: CollectiveKind, ids: tuple[int, ...], cluster: Cluster) -> float:
    if kind == "collective-permute":
        return max(startup_s(h) for h in _shift_hops(ids, cluster))
    level, link = link_for_group(ids, cluster)
    if level == "inter_node":
        group = cluster.group_of(ids[0])
        assert group.inter_node is not None
        nodes, _, most = _per_node_counts(ids, cluster)
        return _hierarchical_startup_s(nodes, most, group.intra_node, group.inter_node)
    return startup_s(link)


def _whole_call_s(kind: CollectiveKind, nbytes: float, ids: tuple[int, ...], cluster: Cluster,
                  use_efficiency: bool) -> float:
    """:func:`collective_time_s` of a call of its own (``n > 1``, B convention)."""
    n = len(ids)
    eff = _collective_efficiency(ids, cluster) if use_efficiency else 1.0
    if kind == "collective-permute":
        return max(send_recv_s(nbytes, _derated(h, eff)) for h in _shift_hops(ids, cluster))
    level, link = link_for_group(ids, cluster)
    if level == "inter_node":
        return _hierarchical_s(kind, nbytes, ids, cluster, eff)
    flat = {
        "all-reduce": ring_all_reduce_s,
        "all-gather": ring_all_gather_s,
        "reduce-scatter": ring_reduce_scatter_s,
        "all-to-all": all_to_all_s,
    }[kind]
    return flat(n, nbytes, _derated(link, eff))


# --------------------------------------------------------------------------------------------
# mesh axes


def mesh_axis_links(mesh: LogicalMesh, cluster: Cluster) -> dict[str, LinkLevel]:
    """Which physical level each mesh axis spans (the widest over the axis's device groups).

    An axis whose groups each stay in one node is ``intra_node``; one whose groups span nodes
    of one device group ``inter_node``; one whose groups mix device groups ``between_groups``.
    A size-1 axis is ``intra_node``.

    Example:
        >>> c = Cluster.from_yaml("configs/clusters/a100x8_v100x8.yaml")
        >>> mesh_axis_links(LogicalMesh(("pipe", "model"), (2, 8), tuple(range(16))), c)
        {'pipe': 'between_groups', 'model': 'intra_node'}
    """
    out: dict[str, LinkLevel] = {}
    for axis in mesh.axis_names:
        levels = [_level(_checked_group(g, cluster), cluster) for g in mesh.groups((axis,))]
        out[axis] = max(levels, key=_LEVEL_RANK.__getitem__)
    return out


def mesh_collective_time_s(
    kind: CollectiveKind,
    result_bytes_per_device: float,
    mesh: LogicalMesh,
    axes: str | Sequence[str],
    cluster: Cluster,
    *,
    use_efficiency: bool = True,
    startup_share: float = 1.0,
) -> float:
    """Time of a collective over mesh ``axes``: all its groups run at once; the slowest bounds.

    Args:
      kind: the collective (see :func:`collective_time_s`).
      result_bytes_per_device: XLA's per-device result size.
      mesh: the logical mesh over the cluster's device ids.
      axes: the axis or axes the collective runs over.
      cluster: the cluster.
      use_efficiency: derate link bandwidths by ``efficiency.collective``.
      startup_share: as in :func:`collective_time_s`.

    Example:
        >>> c = Cluster.from_yaml("configs/clusters/dgx-a100.yaml")
        >>> m = LogicalMesh(("data", "model"), (2, 4), tuple(range(8)))
        >>> mesh_collective_time_s("all-reduce", 0, m, "model", c) * 1e6  # 4·2 + 2·3·2 µs
        20.0
    """
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return max(
        collective_time_s(kind, result_bytes_per_device, g, cluster,
                          use_efficiency=use_efficiency, startup_share=startup_share)
        for g in mesh.groups(names)
    )
