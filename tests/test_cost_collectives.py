"""Tests of the α-β collective model (shardplan/cost/collectives.py), numbers worked by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardplan.cluster import Cluster, Link, LogicalMesh
from shardplan.cost.collectives import (
    COLLECTIVE_KINDS,
    CollectiveKind,
    all_to_all_s,
    b_bytes_from_result,
    collective_time_s,
    hierarchical_all_gather_s,
    hierarchical_all_reduce_s,
    hierarchical_all_to_all_s,
    hierarchical_reduce_scatter_s,
    link_for_group,
    mesh_axis_links,
    mesh_collective_time_s,
    ring_all_gather_s,
    ring_all_reduce_s,
    ring_reduce_scatter_s,
    send_recv_s,
)
from shardplan.errors import ClusterError

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
MIB = 2**20
NVLINK = Link(300e9, 2e-6)  # A100 NVLink 3: 300 GB/s per direction, 2 µs
NIC = Link(25e9, 5e-6)  # one HDR 200 Gb/s NIC per GPU, 5 µs


def _two_node_cluster() -> Cluster:
    """2 nodes x 4 A100: ids 0-3 on node 0, 4-7 on node 1."""
    return Cluster.from_dict(
        {
            "name": "a100-2x4",
            "groups": [
                {
                    "device": "a100-80g",
                    "nodes": 2,
                    "devices_per_node": 4,
                    "intra_node": {"bandwidth_GB_s": 300, "latency_us": 2},
                    "inter_node": {"bandwidth_GB_s": 25, "latency_us": 5},
                }
            ],
        }
    )


def _mixed_cluster() -> Cluster:
    """ids 0-7: A100 (NVLink 300 GB/s, 2 µs); 8-15: V100 (150 GB/s, 2 µs); 6.25 GB/s, 5 µs
    between them."""
    return Cluster.from_yaml(REPO / "configs" / "clusters" / "a100x8_v100x8.yaml")


# --------------------------------------------------------------------------------------------
# flat ring formulas


def test_ring_all_reduce_8_gpus_1_gib() -> None:
    # latency:   2(n−1)·α        = 2·7·2 µs                   = 28 µs
    # bandwidth: 2(n−1)/n · B/bw = 1.75 · 1073741824 / 300e9  = 6.263493973 ms
    # total                                                    = 6.291493973 ms
    assert ring_all_reduce_s(8, GIB, NVLINK) == pytest.approx(6.291493973e-3, rel=1e-9)


def test_ring_all_gather_and_reduce_scatter_are_half_an_all_reduce() -> None:
    # (n−1)·α + (n−1)/n · B/bw = 7·2 µs + 0.875 · 2^30 / 300e9 = 14 µs + 3.131746987 ms
    expected = 14e-6 + 0.875 * GIB / 300e9
    assert expected == pytest.approx(3.145746987e-3, rel=1e-9)
    assert ring_all_gather_s(8, GIB, NVLINK) == pytest.approx(expected, rel=1e-12)
    assert ring_reduce_scatter_s(8, GIB, NVLINK) == pytest.approx(expected, rel=1e-12)
    assert 2 * expected == pytest.approx(ring_all_reduce_s(8, GIB, NVLINK), rel=1e-12)


def test_all_to_all_and_send_recv() -> None:
    # all-to-all, 4 devices, 64 MiB each: 3·5 µs + 3/4 · 67108864 / 25e9 = 15 µs + 2.01326592 ms
    assert all_to_all_s(4, 64 * MIB, NIC) == pytest.approx(15e-6 + 2.01326592e-3, rel=1e-9)
    # send/recv of 1 MiB on the NIC: 5 µs + 1048576 / 25e9 = 5 µs + 41.94304 µs
    assert send_recv_s(MIB, NIC) == pytest.approx(46.94304e-6, rel=1e-9)


def test_one_device_is_free() -> None:
    for fn in (ring_all_reduce_s, ring_all_gather_s, ring_reduce_scatter_s, all_to_all_s):
        assert fn(1, GIB, NVLINK) == 0.0
    cluster = _two_node_cluster()
    for kind in COLLECTIVE_KINDS:
        assert collective_time_s(kind, GIB, [5], cluster) == 0.0


def test_zero_bytes_cost_only_latency() -> None:
    assert ring_all_reduce_s(4, 0, NVLINK) == pytest.approx(2 * 3 * 2e-6)
    assert send_recv_s(0, NIC) == pytest.approx(5e-6)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ClusterError):
        ring_all_reduce_s(0, GIB, NVLINK)
    with pytest.raises(ClusterError):
        ring_all_gather_s(4, -1, NVLINK)
    cluster = _two_node_cluster()
    with pytest.raises(ClusterError, match="distinct device ids"):
        collective_time_s("all-reduce", GIB, [], cluster)
    with pytest.raises(ClusterError, match="distinct device ids"):
        collective_time_s("all-reduce", GIB, [1, 1], cluster)
    with pytest.raises(ClusterError, match="no device id 99"):
        collective_time_s("all-reduce", GIB, [1, 99], cluster)
    with pytest.raises(ClusterError, match="unknown collective kind"):
        collective_time_s("broadcast", GIB, [0, 1], cluster)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# the HLO (per-device result) convention


def test_b_bytes_from_result() -> None:
    assert b_bytes_from_result("reduce-scatter", MIB, 8) == 8 * MIB  # result is B/n
    for kind in COLLECTIVE_KINDS:
        if kind != "reduce-scatter":
            assert b_bytes_from_result(kind, MIB, 8) == MIB


def test_hlo_entry_point_matches_b_convention_inside_a_node() -> None:
    cluster = Cluster.from_yaml(REPO / "configs" / "clusters" / "dgx-a100.yaml")
    group = list(range(8))
    b = 256 * MIB
    by_kind: dict[CollectiveKind, tuple[int, float]] = {
        # kind: (HLO per-device result bytes, B-convention time)
        "all-reduce": (b, ring_all_reduce_s(8, b, NVLINK)),
        "all-gather": (b, ring_all_gather_s(8, b, NVLINK)),  # result = gathered B
        "reduce-scatter": (b // 8, ring_reduce_scatter_s(8, b, NVLINK)),  # result = B/n
        "all-to-all": (b, all_to_all_s(8, b, NVLINK)),
        "collective-permute": (b, send_recv_s(b, NVLINK)),
    }
    for kind, (result_bytes, expected) in by_kind.items():
        got = collective_time_s(kind, result_bytes, group, cluster, use_efficiency=False)
        assert got == pytest.approx(expected, rel=1e-12), kind


def test_collective_efficiency_derates_bandwidth_only() -> None:
    cluster = Cluster.from_yaml(REPO / "configs" / "clusters" / "dgx-a100.yaml")
    # a100-80g efficiency.collective = 0.8: 2·7·2 µs + 1.75 · 2^30 / (0.8 · 300e9)
    expected = 28e-6 + 1.75 * GIB / 240e9
    got = collective_time_s("all-reduce", GIB, range(8), cluster)
    assert got == pytest.approx(expected, rel=1e-12)


# --------------------------------------------------------------------------------------------
# hierarchy: one device group across nodes


def test_link_for_group_levels() -> None:
    cluster = _two_node_cluster()
    assert link_for_group([0, 1, 2, 3], cluster) == ("intra_node", NVLINK)
    assert link_for_group([7], cluster) == ("intra_node", NVLINK)
    assert link_for_group([0, 4], cluster) == ("inter_node", NIC)
    assert link_for_group(range(8), cluster) == ("inter_node", NIC)


def test_hierarchical_all_reduce_two_nodes() -> None:
    # k = 2 nodes, m = 4 per node, B = 1 GiB:
    #   reduce-scatter in node:  3·2 µs + 3/4 · 2^30 / 300e9           = 6 µs + 2.68435456 ms
    #   all-reduce across nodes: 2·1·5 µs + 2·1/2 · (2^30 / 4) / 25e9  = 10 µs + 10.73741824 ms
    #   all-gather in node:      3·2 µs + 3/4 · 2^30 / 300e9           = 6 µs + 2.68435456 ms
    #   total                                                          = 16.12812736 ms
    expected = 16.12812736e-3
    assert hierarchical_all_reduce_s(2, 4, GIB, NVLINK, NIC) == pytest.approx(expected)
    cluster = _two_node_cluster()
    got = collective_time_s("all-reduce", GIB, range(8), cluster, use_efficiency=False)
    assert got == pytest.approx(expected, rel=1e-12)
    # A flat ring over the NIC would take 2·7·5 µs + 1.75 · 2^30 / 25e9 = 75.23192768 ms.
    assert ring_all_reduce_s(8, GIB, NIC) == pytest.approx(75.23192768e-3, rel=1e-9)


def test_hierarchical_all_gather_and_reduce_scatter_two_nodes() -> None:
    # all-gather to B = 1 GiB over 2 nodes x 4:
    #   across nodes (shards B/m = 256 MiB): 1·5 µs + 1/2 · 2^28 / 25e9 = 5 µs + 5.36870912 ms
    #   in node (to B):                      3·2 µs + 3/4 · 2^30 / 300e9 = 6 µs + 2.68435456 ms
    expected = 11e-6 + 5.36870912e-3 + 2.68435456e-3
    assert hierarchical_all_gather_s(2, 4, GIB, NVLINK, NIC) == pytest.approx(expected)
    assert hierarchical_reduce_scatter_s(2, 4, GIB, NVLINK, NIC) == pytest.approx(expected)
    cluster = _two_node_cluster()
    ag = collective_time_s("all-gather", GIB, range(8), cluster, use_efficiency=False)
    rs = collective_time_s("reduce-scatter", GIB // 8, range(8), cluster, use_efficiency=False)
    ar = collective_time_s("all-reduce", GIB, range(8), cluster, use_efficiency=False)
    assert ag == pytest.approx(expected, rel=1e-12)
    assert rs == pytest.approx(expected, rel=1e-12)
    assert ar == pytest.approx(ag + rs, rel=1e-12)  # hierarchical AR = RS + AG


def test_hierarchical_all_to_all_two_nodes() -> None:
    # n = 8, B = 64 MiB; each device sends B/8 = 8 MiB to each of 3 node peers and 4 remote ones:
    #   in node:      3·2 µs + 3/8 · 2^26 / 300e9 = 6 µs  + 83.88608 µs
    #   across nodes: 4·5 µs + 1/2 · 2^26 / 25e9  = 20 µs + 1.34217728 ms
    expected = 26e-6 + 83.88608e-6 + 1.34217728e-3
    assert hierarchical_all_to_all_s(2, 4, 64 * MIB, NVLINK, NIC) == pytest.approx(expected)
    got = collective_time_s(
        "all-to-all", 64 * MIB, range(8), _two_node_cluster(), use_efficiency=False
    )
    assert got == pytest.approx(expected, rel=1e-12)
    # equal links: the flat formula
    assert hierarchical_all_to_all_s(2, 4, 64 * MIB, NIC, NIC) == pytest.approx(
        all_to_all_s(8, 64 * MIB, NIC), rel=1e-12
    )


def test_one_device_per_node_is_a_flat_ring_on_the_nic() -> None:
    cluster = _two_node_cluster()
    got = collective_time_s("all-reduce", GIB, [1, 5], cluster, use_efficiency=False)
    # 2·1·5 µs + 2·1/2 · 2^30 / 25e9 = 10 µs + 42.94967296 ms
    assert got == pytest.approx(ring_all_reduce_s(2, GIB, NIC), rel=1e-12)
    assert got == pytest.approx(42.95967296e-3, rel=1e-9)


def test_uneven_nodes_take_the_conservative_bound() -> None:
    # ids 0, 1, 2 on node 0 and 4 on node 1: intra steps over m = 3, cross-node shards B/1.
    cluster = _two_node_cluster()
    got = collective_time_s("all-reduce", GIB, [0, 1, 2, 4], cluster, use_efficiency=False)
    expected = ring_all_reduce_s(3, GIB, NVLINK) + ring_all_reduce_s(2, GIB, NIC)
    assert got == pytest.approx(expected, rel=1e-12)


# --------------------------------------------------------------------------------------------
# across device groups


def test_cross_group_ring_is_bounded_by_the_slowest_hop() -> None:
    cluster = _mixed_cluster()
    # ring 6 -> 7 -> 8 -> 9 -> 6: NVLink 300, between 6.25, NVLink 150, between 6.25 GB/s
    level, link = link_for_group([9, 6, 8, 7], cluster)
    assert level == "between_groups"
    assert link == Link(6.25e9, 5e-6)
    # all-reduce of 1 MiB over the 4: 2·3·5 µs + 2·3/4 · 2^20 / 6.25e9 = 30 µs + 251.65824 µs
    got = collective_time_s("all-reduce", MIB, [6, 7, 8, 9], cluster, use_efficiency=False)
    assert got == pytest.approx(281.65824e-6, rel=1e-9)
    # with efficiency.collective = min(0.8 (a100), 0.8 (v100)) on the bandwidth
    derated = collective_time_s("all-reduce", MIB, [6, 7, 8, 9], cluster)
    assert derated == pytest.approx(30e-6 + 251.65824e-6 / 0.8, rel=1e-9)


def test_collective_permute_takes_the_slowest_hop() -> None:
    cluster = _mixed_cluster()
    # shift 0 -> 8 -> 0 (pipeline send between the groups): 5 µs + 2^20 / 6.25e9
    got = collective_time_s("collective-permute", MIB, [0, 8], cluster, use_efficiency=False)
    assert got == pytest.approx(5e-6 + 167.77216e-6, rel=1e-9)
    inside = collective_time_s(
        "collective-permute", MIB, [0, 1, 2, 3], cluster, use_efficiency=False
    )
    assert inside == pytest.approx(send_recv_s(MIB, NVLINK), rel=1e-12)


# --------------------------------------------------------------------------------------------
# mesh axes


def test_mesh_axis_links() -> None:
    mixed = LogicalMesh(("pipe", "data"), (2, 8), tuple(range(16)))
    assert mesh_axis_links(mixed, _mixed_cluster()) == {
        "pipe": "between_groups",
        "data": "intra_node",
    }
    two_node = LogicalMesh(("data", "model"), (2, 4), tuple(range(8)))
    assert mesh_axis_links(two_node, _two_node_cluster()) == {
        "data": "inter_node",
        "model": "intra_node",
    }
    flat = LogicalMesh(("all", "one"), (8, 1), tuple(range(8)))
    assert mesh_axis_links(flat, _two_node_cluster()) == {
        "all": "inter_node",
        "one": "intra_node",
    }


def test_mesh_collective_time_is_the_slowest_group() -> None:
    cluster = _two_node_cluster()
    mesh = LogicalMesh(("data", "model"), (2, 4), tuple(range(8)))
    data = mesh_collective_time_s("all-reduce", GIB, mesh, "data", cluster, use_efficiency=False)
    assert data == pytest.approx(ring_all_reduce_s(2, GIB, NIC), rel=1e-12)
    both = mesh_collective_time_s(
        "all-reduce", GIB, mesh, ("data", "model"), cluster, use_efficiency=False
    )
    assert both == pytest.approx(hierarchical_all_reduce_s(2, 4, GIB, NVLINK, NIC), rel=1e-12)
