"""Tests of the device catalog and Cluster (shardplan/cluster), on 8 fake CPU devices."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import pytest
import yaml

from shardplan.cluster import (
    Cluster,
    DeviceGroup,
    DeviceSpec,
    Link,
    catalog_names,
    load_device,
)
from shardplan.errors import ClusterError, ConfigError

REPO = Path(__file__).resolve().parents[2]
DEVICE_FILES = sorted((REPO / "configs" / "devices").glob("*.yaml"))
CLUSTER_FILES = sorted((REPO / "configs" / "clusters").glob("*.yaml"))
CONTRACT_NAMES = (
    "h200",
    "h100-sxm",
    "a100-80g",
    "a100-40g",
    "v100-32g",
    "l40s",
    "l4",
    "t4",
    "rtx4090",
    "cpu",
)
CITATION = re.compile(r"^(measured:|estimate:)|\b(19|20)\d\d\b")
"""A source is a measurement, an explained estimate, or a document with its year."""


def _link(gb_s: float, us: float) -> dict[str, float]:
    return {"bandwidth_GB_s": gb_s, "latency_us": us}


# --------------------------------------------------------------------------------------------
# the device catalog


def test_catalog_holds_the_contract_names() -> None:
    assert set(CONTRACT_NAMES) <= set(catalog_names())
    assert {p.stem for p in DEVICE_FILES} == set(catalog_names())


@pytest.mark.parametrize("path", DEVICE_FILES, ids=lambda p: p.stem)
def test_every_device_file_parses_and_cites_every_number(path: Path) -> None:
    spec = load_device(path.stem)  # the loader itself rejects a number without a source
    assert spec.name == path.stem
    assert spec.intra_node_link is not None and spec.inter_node_link is not None
    assert spec.device_kinds, "Cluster.local needs the jax device kinds of every catalog type"
    for field, citation in spec.sources.items():
        assert CITATION.search(citation), f"{path.name}: source of {field}: {citation!r}"
    for value in (
        *spec.peak_flops_per_s.values(),
        spec.memory_bytes,
        spec.hbm_bandwidth_bytes_per_s,
    ):
        assert value > 0


@pytest.mark.parametrize(
    ("name", "dtype", "flops"),
    [
        ("a100-80g", "bf16", 312e12),
        ("a100-40g", "bf16", 312e12),
        ("a100-80g", "fp32", 19.5e12),
        ("h100-sxm", "bf16", 989.4e12),
        ("h200", "bf16", 989e12),
        ("v100-32g", "fp16", 125e12),
        ("l40s", "bf16", 362e12),
        ("l4", "bf16", 121e12),
        ("rtx4090", "bf16", 165e12),
        ("t4", "fp16", 65e12),
    ],
)
def test_peak_figures_match_the_notes(name: str, dtype: str, flops: float) -> None:
    assert load_device(name).flops_per_s(dtype) == pytest.approx(flops, rel=2e-3)


@pytest.mark.parametrize(
    ("name", "memory_gb", "hbm_gb_s"),
    [
        ("h200", 141, 4800),
        ("h100-sxm", 80, 3350),
        ("a100-80g", 80, 2039),
        ("a100-40g", 40, 1555),
        ("v100-32g", 32, 900),
        ("l40s", 48, 864),
        ("l4", 24, 300),
        ("rtx4090", 24, 1008),
        ("t4", 16, 320),
    ],
)
def test_memory_figures_match_the_notes(name: str, memory_gb: int, hbm_gb_s: int) -> None:
    spec = load_device(name)
    assert spec.memory_bytes == memory_gb * 10**9
    assert spec.hbm_bandwidth_bytes_per_s == hbm_gb_s * 1e9


@pytest.mark.parametrize("name", ["v100-32g", "t4"])
def test_devices_without_bf16_run_fp16(name: str) -> None:
    spec = load_device(name)
    assert "bf16" not in spec.peak_flops_per_s and "fp8" not in spec.peak_flops_per_s
    assert spec.fallback_dtype == "fp16"
    assert spec.effective_dtype("bf16") == spec.effective_dtype("bfloat16") == "fp16"
    assert spec.flops_per_s("bf16") == spec.peak_flops_per_s["fp16"]
    assert spec.effective_dtype("tf32") == "fp32"  # no TF32 tensor cores: plain fp32


def test_dtype_names_from_jax_are_understood() -> None:
    h100 = load_device("h100-sxm")
    assert h100.effective_dtype("float8_e4m3fn") == "fp8"
    assert h100.flops_per_s("float32") == 66.9e12
    assert load_device("a100-80g").effective_dtype("float8_e5m2") == "bf16"  # no fp8 on Ampere


def test_v100_attention_is_far_slower_than_its_matmul() -> None:
    v100, a100 = load_device("v100-32g").efficiency, load_device("a100-80g").efficiency
    assert v100.attention < 0.5 * v100.matmul  # HeterMoE: no fused attention before SM80
    assert a100.attention > 0.5 * a100.matmul


def test_nvlink_figures_are_per_direction() -> None:
    h100_link = load_device("h100-sxm").intra_node_link
    assert h100_link is not None and h100_link.bandwidth_bytes_per_s == 450e9  # 900 both ways


def test_unsupported_dtype_without_fallback_names_device_and_dtype() -> None:
    spec = load_device(
        {
            "name": "npu-x",
            "peak_flops_per_s": {"bf16": 1e14},
            "memory_bytes": 16e9,
            "hbm_bandwidth_bytes_per_s": 1e12,
        }
    )
    with pytest.raises(ClusterError, match=r"(?s)'npu-x'.*fp8"):
        spec.flops_per_s("fp8")
    with pytest.raises(ClusterError, match="int8"):
        spec.flops_per_s("int8")


def test_inline_spec_round_trips_and_needs_three_figures() -> None:
    spec = load_device(
        {
            "name": "npu-x",
            "peak_flops_per_s": {"bf16": 1e14},
            "memory_bytes": 16e9,
            "hbm_bandwidth_bytes_per_s": 1e12,
        }
    )
    assert load_device(spec.to_dict()) == spec
    with pytest.raises(ClusterError) as e:
        load_device({"peak_flops_per_s": {"bf16": 1e14}, "memory_bytes": 16e9})
    assert "hbm_bandwidth_bytes_per_s" in str(e.value)


def test_load_device_unknown_name_suggests_close_names() -> None:
    with pytest.raises(ClusterError) as e:
        load_device("a100")
    message = str(e.value)
    assert "'a100-80g'" in message and "'a100-40g'" in message and "peak_flops_per_s" in message
    assert isinstance(e.value, ConfigError)


def test_catalog_file_without_a_source_is_rejected(tmp_path: Path) -> None:
    text = (REPO / "configs" / "devices" / "l4.yaml").read_text()
    (tmp_path / "l4.yaml").write_text(text.replace('  hbm_bandwidth_bytes_per_s: "', '  x: "'))
    with pytest.raises(ClusterError) as e:
        load_device("l4", directory=tmp_path)
    assert "l4.yaml" in str(e.value) and "source.x" in str(e.value)


# --------------------------------------------------------------------------------------------
# cluster files and round trips


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.stem)
def test_every_cluster_file_parses_and_round_trips(path: Path) -> None:
    cluster = Cluster.from_yaml(path)
    assert cluster.devices is None
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    assert Cluster.from_dict(yaml.safe_load(yaml.safe_dump(cluster.to_dict()))) == cluster
    assert re.fullmatch(r"[0-9a-f]{64}", cluster.content_hash())
    assert cluster.name in cluster.summary()


def test_example_cluster_sizes() -> None:
    sizes = {p.stem: Cluster.from_yaml(p).num_devices for p in CLUSTER_FILES}
    assert sizes["dgx-a100"] == 8 and sizes["dgx-a100x16"] == 128
    assert sizes["a100x8_v100x8"] == 16 and sizes["a100x64_v100x64"] == 128
    assert sizes["h100_a100_l4x256"] == 768 and sizes["h100_a100_l4x1024"] == 1024
    big = Cluster.from_yaml(REPO / "configs" / "clusters" / "h100_a100_l4x256.yaml")
    assert big.device_types == ("h100-sxm", "a100-80g", "l4")
    assert [g.num_devices for g in big.groups] == [256, 256, 256]


def test_inline_device_in_a_cluster_round_trips() -> None:
    d: dict[str, Any] = {
        "name": "custom",
        "groups": [
            {
                "device": {
                    "name": "npu-x",
                    "peak_flops_per_s": {"bf16": 2e14},
                    "memory_bytes": 32e9,
                    "hbm_bandwidth_bytes_per_s": 1.2e12,
                },
                "nodes": 1,
                "devices_per_node": 4,
                "intra_node": _link(100, 3),
            }
        ],
    }
    cluster = Cluster.from_dict(d)
    assert cluster.groups[0].device.name == "npu-x"
    assert isinstance(cluster.to_dict()["groups"][0]["device"], dict)
    assert Cluster.from_dict(cluster.to_dict()) == cluster


def test_from_yaml_binds_local_devices() -> None:
    path = REPO / "configs" / "clusters" / "dgx-a100.yaml"
    devices = jax.devices()[:8]
    cluster = Cluster.from_yaml(path, devices=devices)
    assert cluster.devices == tuple(devices)
    assert cluster.groups[0].device.name == "a100-80g"  # described figures, CPU devices
    assert cluster.content_hash() == Cluster.from_yaml(path).content_hash()
    assert hash(cluster) == hash(Cluster.from_yaml(path, devices=devices))


def test_binding_the_wrong_number_of_devices_says_both_counts() -> None:
    path = REPO / "configs" / "clusters" / "a100x8_v100x8.yaml"
    with pytest.raises(ClusterError) as e:
        Cluster.from_yaml(path, devices=jax.devices()[:8])
    message = str(e.value)
    assert "16 devices" in message and "8 jax devices" in message
    assert "a100x8_v100x8.yaml" in message and "xla_force_host_platform_device_count" in message


# --------------------------------------------------------------------------------------------
# Cluster.local


def test_local_sees_8_cpu_devices_as_one_group() -> None:
    cluster = Cluster.local()
    assert cluster.num_devices == 8 and cluster.device_types == ("cpu",)
    (group,) = cluster.groups
    assert (group.nodes, group.devices_per_node, group.device_ids) == (1, 8, tuple(range(8)))
    assert group.inter_node is None and cluster.between_groups is None
    assert cluster.devices == tuple(jax.devices())
    assert group.intra_node == load_device("cpu").intra_node_link


def test_local_subset() -> None:
    cluster = Cluster.local(devices=jax.devices()[:4])
    assert cluster.num_devices == 4 and cluster.devices == tuple(jax.devices()[:4])
    assert cluster.ids_of("cpu") == (0, 1, 2, 3)


def test_local_types_emulates_a_mixed_cluster() -> None:
    cluster = Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
    assert cluster.device_types == ("a100-80g", "v100-32g")
    assert cluster.ids_of("a100-80g") == (0, 1, 2, 3)
    assert cluster.ids_of(cluster.group("v100-32g")) == (4, 5, 6, 7)
    assert cluster.group("a100-80g").device.flops_per_s("bf16") == 312e12
    assert cluster.group("v100-32g").device.effective_dtype("bf16") == "fp16"
    assert cluster.group_of(5).device.name == "v100-32g"
    # between the groups: the slower of the two types' inter-node links (V100: 4 x EDR / 8)
    assert cluster.between_groups == load_device("v100-32g").inter_node_link
    assert cluster.link_between(0, 1) == load_device("a100-80g").intra_node_link
    assert cluster.link_between(3, 4) == cluster.between_groups


def test_local_types_must_add_up() -> None:
    with pytest.raises(ClusterError, match=r"(?s)add up to 6 but there are 8"):
        Cluster.local(types={"a100-80g": 4, "v100-32g": 2})
    with pytest.raises(ClusterError, match="did you mean 'v100-32g'"):
        Cluster.local(types={"a100-80g": 4, "v100-32": 4})


@dataclasses.dataclass(frozen=True)
class _FakeDevice:
    """Stands in for a jax device of another kind or process (only the attributes local reads)."""

    id: int
    device_kind: str = "cpu"
    process_index: int = 0
    platform: str = "gpu"


def test_local_unknown_device_kind_asks_for_types() -> None:
    with pytest.raises(ClusterError) as e:
        Cluster.local(devices=[_FakeDevice(0, "Mystery GPU 9000")])
    message = str(e.value)
    assert "'Mystery GPU 9000'" in message and "types=" in message and "memory_bytes" in message


def test_local_processes_are_nodes() -> None:
    devices = [_FakeDevice(i, process_index=i // 4) for i in range(8)]
    cluster = Cluster.local(devices=devices)
    group = cluster.groups[0]
    assert (group.nodes, group.devices_per_node) == (2, 4)
    assert cluster.node_of(3) == 0 and cluster.node_of(4) == 1
    assert cluster.link_between(3, 4) == load_device("cpu").inter_node_link
    uneven = [_FakeDevice(i, process_index=int(i >= 5)) for i in range(8)]
    with pytest.raises(ClusterError, match="different device counts"):
        Cluster.local(devices=uneven)


# --------------------------------------------------------------------------------------------
# links, hashes


def _two_group_two_node() -> Cluster:
    return Cluster.from_dict(
        {
            "name": "two-by-two",
            "groups": [
                {
                    "name": "fast",
                    "device": "a100-80g",
                    "nodes": 2,
                    "devices_per_node": 2,
                    "intra_node": _link(300, 2),
                    "inter_node": _link(25, 5),
                },
                {
                    "name": "slow",
                    "device": "v100-32g",
                    "nodes": 2,
                    "devices_per_node": 2,
                    "intra_node": _link(150, 2),
                    "inter_node": _link(6.25, 5),
                },
            ],
            "between_groups": _link(3, 20),
        }
    )


def test_link_between_picks_intra_inter_and_between() -> None:
    c = _two_group_two_node()  # ids: fast 0,1 | 2,3   slow 4,5 | 6,7
    assert c.link_between(0, 1) == Link(300e9, 2e-6)
    assert c.link_between(1, 2) == Link(25e9, 5e-6)
    assert c.link_between(4, 5) == Link(150e9, 2e-6)
    assert c.link_between(5, 6) == Link(6.25e9, 5e-6)
    assert c.link_between(0, 7) == c.link_between(7, 0) == Link(3e9, 20e-6)
    with pytest.raises(ClusterError, match="itself"):
        c.link_between(2, 2)
    with pytest.raises(ClusterError, match=r"0\.\.7"):
        c.link_between(0, 8)


def test_group_links_override_between_groups() -> None:
    d = _two_group_two_node().to_dict()
    d["groups"].append(
        {
            "name": "third",
            "device": "l4",
            "nodes": 1,
            "devices_per_node": 2,
            "intra_node": _link(31.5, 5),
        }
    )
    d["group_links"] = [{"groups": ["fast", "slow"], **_link(12, 5)}]
    c = Cluster.from_dict(d)
    assert c.link_between(0, 4) == Link(12e9, 5e-6)
    assert c.link_between(0, 8) == c.between_groups == Link(3e9, 20e-6)
    assert Cluster.from_dict(c.to_dict()) == c


@pytest.mark.slow
def test_content_hash_is_stable_across_processes() -> None:
    path = REPO / "configs" / "clusters" / "a100x8_v100x8.yaml"
    code = (
        "import sys; from shardplan.cluster import Cluster; "
        "print(Cluster.from_yaml(sys.argv[1]).content_hash())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        env={"PYTHONHASHSEED": "123"},
    )
    assert out.stdout.strip() == Cluster.from_yaml(path).content_hash()


def test_content_hash_follows_figures_not_text() -> None:
    base = _two_group_two_node()
    d = base.to_dict()
    d["description"] = "another comment"
    assert Cluster.from_dict(d).content_hash() == base.content_hash()
    d["between_groups"] = _link(4, 20)
    assert Cluster.from_dict(d).content_hash() != base.content_hash()
    bound = base.bind(jax.devices()[:8])
    assert bound.content_hash() == base.content_hash() and bound != base


def test_direct_construction_is_validated() -> None:
    a100 = load_device("a100-80g")
    with pytest.raises(ClusterError, match="inter_node"):
        DeviceGroup(
            "g",
            a100,
            nodes=2,
            devices_per_node=1,
            intra_node=Link(1e9, 0),
            inter_node=None,
            device_ids=(0, 1),
        )
    group = DeviceGroup("g", a100, 1, 2, Link(1e9, 0), None, (0, 1))
    with pytest.raises(ClusterError, match="between_groups"):
        Cluster("c", (group, dataclasses.replace(group, name="h", device_ids=(2, 3))))
    with pytest.raises(ClusterError, match="bandwidth"):
        Link(0.0, 1e-6)
    assert isinstance(a100, DeviceSpec) and hash(a100) == hash(load_device("a100-80g"))


# --------------------------------------------------------------------------------------------
# validation: one row per rule; the message names the file, the key path and the value

BASE = """\
name: bad
groups:
  - name: a
    device: a100-80g
    nodes: 2
    devices_per_node: 4
    intra_node: {bandwidth_GB_s: 300, latency_us: 2}
    inter_node: {bandwidth_GB_s: 25, latency_us: 5}
  - name: b
    device: v100-32g
    nodes: 1
    devices_per_node: 8
    intra_node: {bandwidth_GB_s: 150, latency_us: 2}
between_groups: {bandwidth_GB_s: 6.25, latency_us: 5}
"""

INLINE_WITHOUT_MEMORY = "device: {peak_flops_per_s: {bf16: 1e14}, hbm_bandwidth_bytes_per_s: 1e12}"
ROWS = [
    # (id, old text, new text, key path, value as shown, more text the message must hold)
    (
        "unknown-device",
        "device: a100-80g",
        "device: a100",
        "groups[0].device",
        "'a100'",
        ["'a100-80g'", "peak_flops_per_s", "memory_bytes", "hbm_bandwidth_bytes_per_s"],
    ),
    (
        "inline-spec-incomplete",
        "device: a100-80g",
        INLINE_WITHOUT_MEMORY,
        "groups[0].device.memory_bytes",
        "'hbm_bandwidth_bytes_per_s': 1000000000000.0",
        ["peak_flops_per_s"],
    ),
    ("zero-nodes", "nodes: 2", "nodes: 0", "groups[0].nodes", "0", [">= 1"]),
    (
        "negative-devices",
        "devices_per_node: 8",
        "devices_per_node: -8",
        "groups[1].devices_per_node",
        "-8",
        [],
    ),
    (
        "missing-bandwidth",
        "{bandwidth_GB_s: 150, latency_us: 2}",
        "{latency_us: 2}",
        "groups[1].intra_node.bandwidth_GB_s",
        "{'latency_us': 2}",
        ["missing"],
    ),
    (
        "zero-bandwidth",
        "{bandwidth_GB_s: 25, latency_us: 5}",
        "{bandwidth_GB_s: 0, latency_us: 5}",
        "groups[0].inter_node.bandwidth_GB_s",
        "0",
        ["> 0"],
    ),
    (
        "missing-latency",
        "{bandwidth_GB_s: 6.25, latency_us: 5}",
        "{bandwidth_GB_s: 6.25}",
        "between_groups.latency_us",
        "{'bandwidth_GB_s': 6.25}",
        ["latency_us:"],
    ),
    (
        "missing-between-groups",
        "between_groups: {bandwidth_GB_s: 6.25, latency_us: 5}\n",
        "",
        "between_groups",
        "['a', 'b']",
        ["2 groups"],
    ),
    (
        "missing-inter-node",
        "    inter_node: {bandwidth_GB_s: 25, latency_us: 5}\n",
        "",
        "groups[0].inter_node",
        "{'nodes': 2}",
        ["inter_node:"],
    ),
    ("unknown-key", "nodes: 2", "node: 2", "groups[0].node", "'node'", ["did you mean 'nodes'"]),
    (
        "unknown-top-level-key",
        "between_groups:",
        "between_group:",
        "between_group",
        "'between_group'",
        ["did you mean 'between_groups'"],
    ),
    ("string-for-count", "nodes: 2", 'nodes: "2"', "groups[0].nodes", "'2'", ["without quotes"]),
    (
        "string-for-bandwidth",
        "bandwidth_GB_s: 300",
        "bandwidth_GB_s: fast",
        "groups[0].intra_node.bandwidth_GB_s",
        "'fast'",
        ["plain number"],
    ),
    (
        "duplicate-key",
        "    nodes: 2\n",
        "    nodes: 2\n    nodes: 3\n",
        "groups[0].nodes",
        "'nodes'",
        ["twice", "line 5"],
    ),
    ("duplicate-group-name", "- name: b", "- name: a", "groups[1].name", "'a'", ["distinct"]),
]


@pytest.mark.parametrize(
    ("old", "new", "key_path", "value", "more"),
    [row[1:] for row in ROWS],
    ids=[row[0] for row in ROWS],
)
def test_validation_errors_name_file_key_value_and_remedy(
    tmp_path: Path, old: str, new: str, key_path: str, value: str, more: list[str]
) -> None:
    assert BASE.count(old) == 1
    path = tmp_path / "bad_cluster.yaml"
    path.write_text(BASE.replace(old, new))
    with pytest.raises(ClusterError) as e:
        Cluster.from_yaml(path)
    message = str(e.value)
    assert "bad_cluster.yaml" in message
    assert f"where: {key_path} (" in message, message
    shown = re.search(r"^  value: (.*)$", message, re.MULTILINE)
    assert shown is not None and value in shown.group(1), message
    assert "fix:" in message
    for text in more:
        assert text in message, message


def test_error_names_the_line_of_the_bad_key(tmp_path: Path) -> None:
    path = tmp_path / "bad_cluster.yaml"
    path.write_text(BASE.replace("devices_per_node: 8", "devices_per_node: 0"))
    with pytest.raises(ClusterError, match=r"groups\[1\]\.devices_per_node \(.*, line 12\)"):
        Cluster.from_yaml(path)


def test_empty_groups(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("name: empty\ngroups: []\n")
    with pytest.raises(ClusterError) as e:
        Cluster.from_yaml(path)
    message = str(e.value)
    assert "empty.yaml" in message and "where: groups" in message and "value: []" in message


def test_yaml_that_does_not_parse_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(BASE.replace("nodes: 2", "nodes: [2"))
    with pytest.raises(ClusterError) as e:
        Cluster.from_yaml(path)
    message = str(e.value)
    assert "does not parse" in message and re.search(r"broken\.yaml, line \d+", message)


def test_from_dict_errors_name_the_key_path_without_a_file() -> None:
    d = _two_group_two_node().to_dict()
    d["groups"][1]["nodes"] = -1
    with pytest.raises(ClusterError) as e:
        Cluster.from_dict(d)
    assert "where: groups[1].nodes" in str(e.value) and "value: -1" in str(e.value)
