"""Tests of the α-β collective model (shardplan/cost/collectives.py), numbers worked by hand.

Every collective call pays one start-up α0 = STARTUP_STEPS·α = 4·α on top of its ring steps:
8 µs on the 2 µs NVLink below, 20 µs on the 5 µs NIC.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardplan.cluster import Cluster, Link, LogicalMesh
from shardplan.cost.collectives import (
    COLLECTIVE_KINDS,
    STARTUP_STEPS,
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
    startup_s,
)
from shardplan.errors import ClusterError

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30
MIB = 2**20
NVLINK = Link(300e9, 2e-6)  # A100 NVLink 3: 300 GB/s per direction, 2 µs
NIC = Link(25e9, 5e-6)  # one HDR 200 Gb/s NIC per GPU, 5 µs
CPU = Link(5e9, 10e-6)  # an emulated CPU device: catalog 10 GB/s x efficiency 0.5, 10 µs


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
    # start-up:  4·α             = 4·2 µs                     = 8 µs
    # steps:     2(n−1)·α        = 2·7·2 µs                   = 28 µs
    # bandwidth: 2(n−1)/n · B/bw = 1.75 · 1073741824 / 300e9  = 6.263493973 ms
    # total                                                    = 6.299493973 ms
    assert ring_all_reduce_s(8, GIB, NVLINK) == pytest.approx(6.299493973e-3, rel=1e-9)


def test_ring_all_gather_and_reduce_scatter_are_half_an_all_reduce_plus_a_start_up() -> None:
    # 4·α + (n−1)·α + (n−1)/n · B/bw = 8 µs + 7·2 µs + 0.875 · 2^30 / 300e9
    #                                = 22 µs + 3.131746987 ms
    expected = 22e-6 + 0.875 * GIB / 300e9
    assert expected == pytest.approx(3.153746987e-3, rel=1e-9)
    assert ring_all_gather_s(8, GIB, NVLINK) == pytest.approx(expected, rel=1e-12)
    assert ring_reduce_scatter_s(8, GIB, NVLINK) == pytest.approx(expected, rel=1e-12)
    # an all-reduce is one call: RS + AG less one 8 µs start-up
    assert 2 * expected - 8e-6 == pytest.approx(ring_all_reduce_s(8, GIB, NVLINK), rel=1e-12)


def test_all_to_all_and_send_recv() -> None:
    # all-to-all, 4 devices, 64 MiB each: 4·5 µs + 3·5 µs + 3/4 · 67108864 / 25e9
    #                                   = 35 µs + 2.01326592 ms
    assert all_to_all_s(4, 64 * MIB, NIC) == pytest.approx(35e-6 + 2.01326592e-3, rel=1e-9)
    # send/recv of 1 MiB on the NIC: 4·5 µs + 5 µs + 1048576 / 25e9 = 25 µs + 41.94304 µs
    assert send_recv_s(MIB, NIC) == pytest.approx(66.94304e-6, rel=1e-9)


def test_one_device_is_free() -> None:
    for fn in (ring_all_reduce_s, ring_all_gather_s, ring_reduce_scatter_s, all_to_all_s):
        assert fn(1, GIB, NVLINK) == 0.0
    cluster = _two_node_cluster()
    for kind in COLLECTIVE_KINDS:
        assert collective_time_s(kind, GIB, [5], cluster) == 0.0


def test_zero_bytes_cost_only_latency() -> None:
    assert ring_all_reduce_s(4, 0, NVLINK) == pytest.approx(4 * 2e-6 + 2 * 3 * 2e-6)  # 20 µs
    assert send_recv_s(0, NIC) == pytest.approx(4 * 5e-6 + 5e-6)  # 25 µs


# --------------------------------------------------------------------------------------------
# the start-up: one per call


def test_start_up_is_four_step_latencies_once_per_call_whatever_n() -> None:
    assert STARTUP_STEPS == 4
    assert startup_s(NVLINK) == pytest.approx(8e-6)  # NCCL ring base latency: 6.6-8.4 µs
    assert startup_s(NIC) == pytest.approx(20e-6)
    for n in range(2, 17):
        # zero bytes: 4·α + steps·(n−1)·α, the start-up the same for every n
        assert ring_all_reduce_s(n, 0, NVLINK) == pytest.approx((4 + 2 * (n - 1)) * 2e-6)
        for fn in (ring_all_gather_s, ring_reduce_scatter_s, all_to_all_s):
            assert fn(n, 0, NVLINK) == pytest.approx((4 + (n - 1)) * 2e-6)


def test_ten_2_device_all_reduces_cost_more_than_five_4_device_ones_at_small_bytes() -> None:
    # Alpa's MLP on 4 CPU devices: Megatron's 5 all-reduces of B = 32 KiB over 4 devices
    # against a 2-D plan's 10 all-reduces of B/2 over 2 devices (the same bytes).
    b = 32 * 1024
    # four devices: 40 µs + 2·3·10 µs + 1.5 · 32768 / 5e9 (9.8304 µs) = 109.8304 µs, x5
    five_4 = 5 * ring_all_reduce_s(4, b, CPU)
    assert five_4 == pytest.approx(549.152e-6, rel=1e-9)
    # two devices:  40 µs + 2·1·10 µs + 1 · 16384 / 5e9 (3.2768 µs) = 63.2768 µs, x10
    ten_2 = 10 * ring_all_reduce_s(2, b // 2, CPU)
    assert ten_2 == pytest.approx(632.768e-6, rel=1e-9)
    # (without the start-up: 349.152 µs against 232.768 µs, the 2-D plan looked cheaper)
    assert ten_2 > five_4
    # A 4-device all-reduce is 1.65x a 2-device one of the same 32 KiB (40 + 60 + 9.8304 µs
    # over 40 + 20 + 6.5536 µs): XLA:CPU measured 1.6-2.1x; steps alone said 2.63x.
    ratio = ring_all_reduce_s(4, b, CPU) / ring_all_reduce_s(2, b, CPU)
    assert ratio == pytest.approx(109.8304 / 66.5536, rel=1e-9)
    # On NVLink too: 5 · (8 + 12 + 0.16384) µs = 100.8192 µs < 10 · (8 + 4 + 0.054613) µs
    assert 5 * ring_all_reduce_s(4, b, NVLINK) == pytest.approx(100.8192e-6, rel=1e-9)
    assert 10 * ring_all_reduce_s(2, b // 2, NVLINK) == pytest.approx(120.546133e-6, rel=1e-6)


def test_large_messages_keep_the_bandwidth_term() -> None:
    # t(B) − t(0) is the ring's bandwidth term exactly, start-up or not.
    for n in (2, 4, 8):
        bw_s = (n - 1) / n * GIB / 300e9
        assert ring_all_reduce_s(n, GIB, NVLINK) - ring_all_reduce_s(n, 0, NVLINK) == (
            pytest.approx(2 * bw_s, rel=1e-12))
        for fn in (ring_all_gather_s, ring_reduce_scatter_s, all_to_all_s):
            assert fn(n, GIB, NVLINK) - fn(n, 0, NVLINK) == pytest.approx(bw_s, rel=1e-12)
    # At 64 MiB the bandwidth wins: ten 2-device all-reduces of 32 MiB (10 · 0.5 · B/bw)
    # beat five 4-device ones of 64 MiB (5 · 1.5 · B/bw): 1.23848 ms < 1.77772 ms.
    b = 64 * MIB
    assert 10 * ring_all_reduce_s(2, b // 2, NVLINK) == pytest.approx(1.238481067e-3, rel=1e-9)
    assert 5 * ring_all_reduce_s(4, b, NVLINK) == pytest.approx(1.7777216e-3, rel=1e-9)


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
    # a100-80g efficiency.collective = 0.8, on the bandwidth only:
    # 4·2 µs + 2·7·2 µs + 1.75 · 2^30 / (0.8 · 300e9)
    expected = 36e-6 + 1.75 * GIB / 240e9
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
    # k = 2 nodes, m = 4 per node, B = 1 GiB, one call:
    #   start-up on the slower link: 4 · max(2, 5) µs                  = 20 µs
    #   reduce-scatter in node:  3·2 µs + 3/4 · 2^30 / 300e9           = 6 µs + 2.68435456 ms
    #   all-reduce across nodes: 2·1·5 µs + 2·1/2 · (2^30 / 4) / 25e9  = 10 µs + 10.73741824 ms
    #   all-gather in node:      3·2 µs + 3/4 · 2^30 / 300e9           = 6 µs + 2.68435456 ms
    #   total                                          42 µs + 16.10612736 ms = 16.14812736 ms
    expected = 16.14812736e-3
    assert hierarchical_all_reduce_s(2, 4, GIB, NVLINK, NIC) == pytest.approx(expected)
    cluster = _two_node_cluster()
    got = collective_time_s("all-reduce", GIB, range(8), cluster, use_efficiency=False)
    assert got == pytest.approx(expected, rel=1e-12)
    # A flat ring over the NIC would take 4·5 µs + 2·7·5 µs + 1.75 · 2^30 / 25e9
    #   = 90 µs + 75.16192768 ms = 75.25192768 ms.
    assert ring_all_reduce_s(8, GIB, NIC) == pytest.approx(75.25192768e-3, rel=1e-9)


def test_hierarchical_collectives_pay_one_start_up() -> None:
    # zero bytes, 2 nodes x 4: 20 µs start-up + 2·3·2 µs in the node + 2·1·5 µs across
    assert hierarchical_all_reduce_s(2, 4, 0, NVLINK, NIC) == pytest.approx(42e-6)
    # 20 µs + 3·2 µs + 1·5 µs
    assert hierarchical_all_gather_s(2, 4, 0, NVLINK, NIC) == pytest.approx(31e-6)
    assert hierarchical_reduce_scatter_s(2, 4, 0, NVLINK, NIC) == pytest.approx(31e-6)
    # 20 µs + 3·2 µs in the node + 4·5 µs across
    assert hierarchical_all_to_all_s(2, 4, 0, NVLINK, NIC) == pytest.approx(46e-6)
    # One node: the flat ring on the node link, its 8 µs start-up (the NIC is not used).
    for hier, flat in ((hierarchical_all_reduce_s, ring_all_reduce_s),
                       (hierarchical_all_gather_s, ring_all_gather_s),
                       (hierarchical_reduce_scatter_s, ring_reduce_scatter_s),
                       (hierarchical_all_to_all_s, all_to_all_s)):
        assert hier(1, 4, GIB, NVLINK, NIC) == pytest.approx(flat(4, GIB, NVLINK), rel=1e-12)
        assert hier(1, 1, GIB, NVLINK, NIC) == 0.0


def test_hierarchical_all_gather_and_reduce_scatter_two_nodes() -> None:
    # all-gather to B = 1 GiB over 2 nodes x 4, one call:
    #   start-up:                            4 · max(2, 5) µs            = 20 µs
    #   across nodes (shards B/m = 256 MiB): 1·5 µs + 1/2 · 2^28 / 25e9 = 5 µs + 5.36870912 ms
    #   in node (to B):                      3·2 µs + 3/4 · 2^30 / 300e9 = 6 µs + 2.68435456 ms
    expected = 31e-6 + 5.36870912e-3 + 2.68435456e-3
    assert hierarchical_all_gather_s(2, 4, GIB, NVLINK, NIC) == pytest.approx(expected)
    assert hierarchical_reduce_scatter_s(2, 4, GIB, NVLINK, NIC) == pytest.approx(expected)
    cluster = _two_node_cluster()
    ag = collective_time_s("all-gather", GIB, range(8), cluster, use_efficiency=False)
    rs = collective_time_s("reduce-scatter", GIB // 8, range(8), cluster, use_efficiency=False)
    ar = collective_time_s("all-reduce", GIB, range(8), cluster, use_efficiency=False)
    assert ag == pytest.approx(expected, rel=1e-12)
    assert rs == pytest.approx(expected, rel=1e-12)
    assert ar == pytest.approx(ag + rs - 20e-6, rel=1e-12)  # AR = RS + AG, one start-up


def test_hierarchical_all_to_all_two_nodes() -> None:
    # n = 8, B = 64 MiB; each device sends B/8 = 8 MiB to each of 3 node peers and 4 remote ones:
    #   start-up:     4 · max(2, 5) µs            = 20 µs
    #   in node:      3·2 µs + 3/8 · 2^26 / 300e9 = 6 µs  + 83.88608 µs
    #   across nodes: 4·5 µs + 1/2 · 2^26 / 25e9  = 20 µs + 1.34217728 ms
    expected = 46e-6 + 83.88608e-6 + 1.34217728e-3
    assert hierarchical_all_to_all_s(2, 4, 64 * MIB, NVLINK, NIC) == pytest.approx(expected)
    got = collective_time_s(
        "all-to-all", 64 * MIB, range(8), _two_node_cluster(), use_efficiency=False
    )
    assert got == pytest.approx(expected, rel=1e-12)
    # equal links: the flat formula (start-up 4·5 µs either way)
    assert hierarchical_all_to_all_s(2, 4, 64 * MIB, NIC, NIC) == pytest.approx(
        all_to_all_s(8, 64 * MIB, NIC), rel=1e-12
    )


def test_one_device_per_node_is_a_flat_ring_on_the_nic() -> None:
    cluster = _two_node_cluster()
    got = collective_time_s("all-reduce", GIB, [1, 5], cluster, use_efficiency=False)
    # 4·5 µs (the NIC's start-up; no node link used) + 2·1·5 µs + 2·1/2 · 2^30 / 25e9
    #   = 30 µs + 42.94967296 ms
    assert got == pytest.approx(ring_all_reduce_s(2, GIB, NIC), rel=1e-12)
    assert got == pytest.approx(42.97967296e-3, rel=1e-9)


def test_uneven_nodes_take_the_conservative_bound() -> None:
    # ids 0, 1, 2 on node 0 and 4 on node 1: intra steps over m = 3, cross-node shards B/1.
    cluster = _two_node_cluster()
    got = collective_time_s("all-reduce", GIB, [0, 1, 2, 4], cluster, use_efficiency=False)
    #   start-up, one call:      4 · max(2, 5) µs                      = 20 µs
    #   in node (m = 3):         2·2·2 µs + 2·2/3 · 2^30 / 300e9       = 8 µs + 4.772185884 ms
    #   across nodes (B/1):      2·1·5 µs + 2·1/2 · 2^30 / 25e9        = 10 µs + 42.94967296 ms
    #   total                                                          = 47.759858844 ms
    assert got == pytest.approx(47.759858844e-3, rel=1e-9)
    # = the two flat rings less the node ring's own 8 µs start-up
    expected = ring_all_reduce_s(3, GIB, NVLINK) - 8e-6 + ring_all_reduce_s(2, GIB, NIC)
    assert got == pytest.approx(expected, rel=1e-12)


# --------------------------------------------------------------------------------------------
# across device groups


def test_cross_group_ring_is_bounded_by_the_slowest_hop() -> None:
    cluster = _mixed_cluster()
    # ring 6 -> 7 -> 8 -> 9 -> 6: NVLink 300, between 6.25, NVLink 150, between 6.25 GB/s
    level, link = link_for_group([9, 6, 8, 7], cluster)
    assert level == "between_groups"
    assert link == Link(6.25e9, 5e-6)
    # all-reduce of 1 MiB over the 4, start-up on the bottleneck's 5 µs:
    #   4·5 µs + 2·3·5 µs + 2·3/4 · 2^20 / 6.25e9 = 50 µs + 251.65824 µs
    got = collective_time_s("all-reduce", MIB, [6, 7, 8, 9], cluster, use_efficiency=False)
    assert got == pytest.approx(301.65824e-6, rel=1e-9)
    # with efficiency.collective = min(0.8 (a100), 0.8 (v100)) on the bandwidth
    derated = collective_time_s("all-reduce", MIB, [6, 7, 8, 9], cluster)
    assert derated == pytest.approx(50e-6 + 251.65824e-6 / 0.8, rel=1e-9)


def test_collective_permute_takes_the_slowest_hop() -> None:
    cluster = _mixed_cluster()
    # shift 0 -> 8 -> 0 (pipeline send between the groups): 4·5 µs + 5 µs + 2^20 / 6.25e9
    got = collective_time_s("collective-permute", MIB, [0, 8], cluster, use_efficiency=False)
    assert got == pytest.approx(25e-6 + 167.77216e-6, rel=1e-9)
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
