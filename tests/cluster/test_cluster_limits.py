"""Cluster descriptions at and past the limits: device counts too large to build, hardware
figures in the wrong unit, and files that are not UTF-8 text or not files
(shardplan/cluster/_parse.py, _ranges.py, _schema.py; docs/errors.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from shardplan.cluster import Cluster, load_device
from shardplan.cluster.group import MAX_DEVICES
from shardplan.errors import ClusterError, ShardplanWarning

REPO = Path(__file__).resolve().parents[2]


def _group(nodes: float, per_node: float, **links: Any) -> dict[str, Any]:
    group = {
        "device": "a100-80g",
        "nodes": nodes,
        "devices_per_node": per_node,
        "intra_node": {"bandwidth_GB_s": 300, "latency_us": 2},
        "inter_node": {"bandwidth_GB_s": 25, "latency_us": 5},
    }
    group.update(links)
    return group


def _cluster(*groups: dict[str, Any], **top: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"name": "c", "groups": list(groups)}
    if len(groups) > 1:
        d["between_groups"] = {"bandwidth_GB_s": 25, "latency_us": 5}
    d.update(top)
    return d


def _fields(message: str) -> dict[str, str]:
    """The ``where`` / ``value`` / ``fix`` lines of a format_error message."""
    return dict(re.findall(r"^  (where|value|fix):\s+(.*)$", message, re.MULTILINE))


# --------------------------------------------------------------------------------------------
# device counts: refused before anything of their size is built

# Runs each case in a process whose address space is capped at 2 GiB above what it holds after
# importing: a cluster that builds one id per device for 10^9 devices then fails with a
# MemoryError within seconds instead of exhausting the test machine. It prints, per case, the
# exception's type, its message and the seconds the call took.
_CHILD = r"""
import json, resource, sys, time
import jax
from shardplan.cluster import Cluster

devices = jax.devices()
with open("/proc/self/status") as f:
    held = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (held + 2 * 2**30, resource.RLIM_INFINITY))
out = []
for kind, arg in json.loads(sys.argv[1]):
    start = time.perf_counter()
    try:
        if kind == "yaml":
            Cluster.from_yaml(arg)
        elif kind == "dict":
            Cluster.from_dict(arg)
        else:
            Cluster.local(devices=devices[:1], types=arg)
        error, message = None, ""
    except BaseException as e:
        error, message = type(e).__name__, str(e)
    out.append([error, message, time.perf_counter() - start])
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_huge_device_counts_are_refused_within_a_second_naming_the_key_and_the_limit(
    tmp_path: Path,
) -> None:
    yaml_file = tmp_path / "huge.yaml"
    yaml_file.write_text(
        "name: huge\n"
        "groups:\n"
        "  - device: a100-80g\n"
        "    nodes: 1\n"
        "    devices_per_node: 1e9\n"
        "    intra_node: {bandwidth_GB_s: 300, latency_us: 2}\n"
    )
    cases: list[tuple[str, Any, str, str]] = [
        # (kind, argument, key path as the message names it, value as shown)
        ("yaml", str(yaml_file), "groups[0].devices_per_node (", "1000000000"),
        ("dict", _cluster(_group(1e9, 8)), "groups[0].nodes", "1000000000"),
        ("dict", _cluster(_group(10**30, 8)), "groups[0].nodes", str(10**30)),
        # Each count alone is within the limit, their product is not.
        ("dict", _cluster(_group(2048, 1024)), "groups[0]", "'devices_per_node': 1024"),
        # Each group is within the limit, the cluster is not.
        (
            "dict",
            _cluster(_group(MAX_DEVICES // 8, 8), _group(1, 8)),
            "groups[1]",
            "'this group': 8",
        ),
        ("local", {"a100-80g": 10**9}, "types['a100-80g']", "1000000000"),
    ]
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([(kind, arg) for kind, arg, *_ in cases])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert child.returncode == 0, child.stderr
    results = json.loads(child.stdout.strip().splitlines()[-1])
    for (kind, _, where, value), (error, message, seconds) in zip(cases, results, strict=True):
        assert error == "ClusterError", (kind, where, error, message[:300])
        fields = _fields(message)
        assert fields["where"].startswith(where), message
        assert value in fields["value"], message
        assert f"{MAX_DEVICES:,}" in message and "MAX_DEVICES" in fields["fix"], message
        assert seconds < 1.0, (where, seconds)
    assert "huge.yaml, line 5" in results[0][1], results[0][1]


# --------------------------------------------------------------------------------------------
# link and device figures outside physical ranges: a ShardplanWarning naming the likely slip


def _warning_from(build: Any) -> str:
    """The one ShardplanWarning ``build()`` issues (the suite turns warnings into errors)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    ours = [w for w in caught if issubclass(w.category, ShardplanWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert ours[0].filename == __file__, ours[0].filename  # the user's line, not shardplan's
    return str(ours[0].message)


LINK_SLIPS = [
    # (id, link, key, value as shown, text the remedy must hold)
    (
        "bytes-per-s-as-GB-s",
        {"bandwidth_GB_s": 300e9, "latency_us": 2},
        "bandwidth_GB_s",
        "300000000000.0",
        ["in GB/s", "if you wrote bytes/s, write 300", "0.01 .. 10000 GB/s"],
    ),
    (
        "seconds-per-byte-as-GB-s",
        {"bandwidth_GB_s": 1e-12, "latency_us": 2},
        "bandwidth_GB_s",
        "1e-12",
        ["seconds per byte", "write 1000", "0.01 .. 10000 GB/s"],
    ),
    (
        "MB-s-as-GB-s",
        {"bandwidth_GB_s": 25_000, "latency_us": 5},
        "bandwidth_GB_s",
        "25000",
        ["if you wrote MB/s, write 25"],
    ),
    (
        "seconds-as-us",
        {"bandwidth_GB_s": 300, "latency_us": 2e-6},
        "latency_us",
        "2e-06",
        ["in µs", "if you wrote seconds, write 2", "0.001 .. 1e+06 µs (or 0)"],
    ),
    (
        "nanoseconds-as-us",
        {"bandwidth_GB_s": 25, "latency_us": 5_000_000},
        "latency_us",
        "5000000",
        ["if you wrote nanoseconds, write 5000"],
    ),
]


@pytest.mark.parametrize(
    ("link", "key", "value", "remedy"),
    [row[1:] for row in LINK_SLIPS],
    ids=[row[0] for row in LINK_SLIPS],
)
def test_a_link_figure_outside_its_physical_range_warns_with_the_value_probably_meant(
    link: dict[str, float], key: str, value: str, remedy: list[str]
) -> None:
    message = _warning_from(lambda: Cluster.from_dict(_cluster(_group(1, 8, intra_node=link))))
    fields = _fields(message)
    assert fields["where"] == f"groups[0].intra_node.{key}", message
    assert fields["value"] == value, message
    assert "plausible range" in message
    for text in remedy:
        assert text in fields["fix"], message


def test_link_slips_are_found_wherever_links_are_written(tmp_path: Path) -> None:
    slip = {"bandwidth_GB_s": 6.25e9, "latency_us": 5}
    # between groups, and a per-pair override
    message = _warning_from(
        lambda: Cluster.from_dict(_cluster(_group(1, 8), _group(1, 8), between_groups=slip))
    )
    assert _fields(message)["where"] == "between_groups.bandwidth_GB_s", message
    pair = {"groups": ["a100-80g", "a100-80g.1"], **slip}
    message = _warning_from(
        lambda: Cluster.from_dict(_cluster(_group(1, 8), _group(1, 8), group_links=[pair]))
    )
    assert _fields(message)["where"] == "group_links[0].bandwidth_GB_s", message
    # an inline device spec's default link
    spec = load_device("a100-80g").to_dict()
    spec["inter_node_link"] = {"bandwidth_GB_s": 25, "latency_us": 5e-6}
    message = _warning_from(lambda: load_device(spec))
    assert _fields(message)["where"] == "device.inter_node_link.latency_us", message
    # a YAML file: the message names the file and the line
    path = tmp_path / "slip.yaml"
    path.write_text(
        "name: slip\n"
        "groups:\n"
        "  - device: a100-80g\n"
        "    nodes: 2\n"
        "    devices_per_node: 8\n"
        "    intra_node: {bandwidth_GB_s: 300, latency_us: 2}\n"
        "    inter_node: {bandwidth_GB_s: 25e9, latency_us: 5}\n"
    )
    message = _warning_from(lambda: Cluster.from_yaml(path))
    where = _fields(message)["where"]
    assert where == f"groups[0].inter_node.bandwidth_GB_s ({path}, line 7)", message
    assert "write 25" in _fields(message)["fix"], message


def test_zero_and_one_nanosecond_latencies_are_deliberate_and_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardplanWarning)
        for latency in (0, 0.001):
            link = {"bandwidth_GB_s": 1.0, "latency_us": latency}
            Cluster.from_dict(_cluster(_group(1, 4, intra_node=link)))
    message = _warning_from(
        lambda: Cluster.from_dict(
            _cluster(_group(1, 4, intra_node={"bandwidth_GB_s": 1.0, "latency_us": 0.0009}))
        )
    )
    assert "latency_us" in message


DEVICE_SLIPS = [
    # (id, key, value written, key path, value as shown, remedy text)
    ("memory-in-GB", "memory_bytes", 80, "memory_bytes", "80", "if you wrote GB, write 8e+10"),
    (
        "peak-in-TFLOP-s",
        "peak_flops_per_s",
        {"bf16": 312},
        "peak_flops_per_s.bf16",
        "312",
        "if you wrote TFLOP/s, write 3.12e+14",
    ),
    (
        "memory-bandwidth-in-GB-s",
        "hbm_bandwidth_bytes_per_s",
        2039,
        "hbm_bandwidth_bytes_per_s",
        "2039",
        "if you wrote GB/s, write 2.039e+12",
    ),
]


@pytest.mark.parametrize(
    ("key", "written", "key_path", "value", "remedy"),
    [row[1:] for row in DEVICE_SLIPS],
    ids=[row[0] for row in DEVICE_SLIPS],
)
def test_a_device_figure_in_the_wrong_unit_warns_naming_the_key_path(
    key: str, written: Any, key_path: str, value: str, remedy: str
) -> None:
    spec = {
        "peak_flops_per_s": {"bf16": 1e14},
        "memory_bytes": 16e9,
        "hbm_bandwidth_bytes_per_s": 1e12,
    }
    spec[key] = written
    message = _warning_from(lambda: Cluster.from_dict(_cluster(_group(1, 2, device=spec))))
    fields = _fields(message)
    assert fields["where"] == f"groups[0].device.{key_path}", message
    assert fields["value"] == value, message
    assert remedy in fields["fix"], message


def test_a_catalog_file_with_a_figure_in_the_wrong_unit_warns_naming_the_file(
    tmp_path: Path,
) -> None:
    text = (REPO / "configs" / "devices" / "l4.yaml").read_text()
    assert text.count("memory_bytes: 24e9") == 1
    (tmp_path / "l4.yaml").write_text(text.replace("memory_bytes: 24e9", "memory_bytes: 24"))
    message = _warning_from(lambda: load_device("l4", directory=tmp_path))
    assert re.match(
        rf"memory_bytes \({re.escape(str(tmp_path))}/l4\.yaml, line \d+\)$",
        _fields(message)["where"],
    ), message
    assert "if you wrote GB, write 2.4e+10" in message


# --------------------------------------------------------------------------------------------
# files that are not UTF-8 text, or not readable files


def test_a_latin1_cluster_file_names_the_line_and_byte_of_the_first_bad_byte(
    tmp_path: Path,
) -> None:
    path = tmp_path / "latin1.yaml"
    text = "name: lab\ndescription: Caf\u00e9 cluster\ngroups: []\n"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ClusterError) as e:
        Cluster.from_yaml(path)
    message = str(e.value)
    offset = text.index("\u00e9")
    assert _fields(message)["where"] == f"{path}, line 2, column 17 (byte offset {offset})"
    assert "not UTF-8" in message and "Latin-1" in message
    assert _fields(message)["value"].startswith(r"b'\xe9 clust"), message
    assert "save the file as UTF-8" in _fields(message)["fix"], message


def test_a_utf16_cluster_file_is_named_as_utf16(tmp_path: Path) -> None:
    path = tmp_path / "utf16.yaml"
    path.write_bytes(b"\xff\xfe" + "name: lab\ngroups: []\n".encode("utf-16-le"))
    with pytest.raises(ClusterError) as e:
        Cluster.from_yaml(path)
    message = str(e.value)
    assert _fields(message)["where"] == f"{path}, line 1, column 1 (byte offset 0)", message
    assert "UTF-16 (little-endian) byte-order mark" in message
    assert "save the file as UTF-8" in message


def test_a_device_catalog_file_that_is_not_utf8_names_the_file(tmp_path: Path) -> None:
    text = (REPO / "configs" / "devices" / "l4.yaml").read_text()
    bad = text.replace("description: ", "description: \u00b5 ", 1).encode("cp1252")
    (tmp_path / "l4.yaml").write_bytes(bad)
    with pytest.raises(ClusterError) as e:
        load_device("l4", directory=tmp_path)
    message = str(e.value)
    assert f"{tmp_path}/l4.yaml, line " in _fields(message)["where"], message
    assert "save the file as UTF-8" in message


def test_a_path_that_is_a_directory_or_holds_a_nul_byte_is_a_cluster_error(
    tmp_path: Path,
) -> None:
    with pytest.raises(ClusterError) as e:
        Cluster.from_yaml(tmp_path)
    fields = _fields(str(e.value))
    assert fields["where"] == str(tmp_path) and "IsADirectoryError" in fields["value"]
    assert "not a directory" in fields["fix"]
    with pytest.raises(ClusterError) as e:
        Cluster.from_yaml("clusters/a\0b.yaml")
    fields = _fields(str(e.value))
    assert "null byte" in fields["value"] and "check the path" in fields["fix"]
