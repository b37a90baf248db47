"""The device catalog: ``configs/devices/*.yaml`` read and checked into :class:`DeviceSpec` values.

Hardware facts are data (STYLE.md rule 6): every figure lives in a YAML file next to a
``source:`` citation, and this module only parses and checks them. A file looks like::

    name: a100-80g
    vendor: nvidia
    device_kinds: ["NVIDIA A100-SXM4-80GB"]      # jax's Device.device_kind strings
    peak_flops_per_s: {bf16: 312e12, fp16: 312e12, tf32: 156e12, fp32: 19.5e12}
    memory_bytes: 80e9
    hbm_bandwidth_bytes_per_s: 2039e9
    efficiency: {matmul: 0.75, attention: 0.6, memory_bound: 0.85, collective: 0.8}
    fallback_dtype: bf16                         # runs fp8 work as bf16
    intra_node_link: {bandwidth_GB_s: 300, latency_us: 2}
    inter_node_link: {bandwidth_GB_s: 25, latency_us: 5}
    source: {peak_flops_per_s.bf16: "NVIDIA A100 datasheet (2021)", ...}

Peak figures are dense (no 2:4 sparsity). A dtype the device lacks is absent; work in that dtype
runs as ``fallback_dtype`` (``tf32`` without tensor-core TF32 runs as ``fp32``).

Example:
    >>> from shardplan.cluster import load_device
    >>> load_device("a100-80g").flops_per_s("bfloat16")
    312000000000000.0
    >>> load_device("v100-32g").effective_dtype("bf16")
    'fp16'
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardplan._schema import Where
from shardplan.cluster._ranges import (
    DEVICE_MEMORY_BYTES,
    HBM_BANDWIDTH_BYTES_PER_S,
    PEAK_FLOPS_PER_S,
    check_plausible,
)
from shardplan.cluster._schema import (
    as_float,
    as_int,
    as_mapping,
    as_str,
    check_keys,
    fail,
    load_yaml,
)
from shardplan.cluster.device import (
    DEFAULT_INLINE_EFFICIENCY,
    DTYPES,
    DeviceSpec,
    Efficiency,
    canonical_dtype,
)
from shardplan.cluster.link import Link, parse_link
from shardplan.errors import ClusterError, did_you_mean

# DeviceSpec, Efficiency, Link and canonical_dtype live in device.py / link.py; re-exported here
# because this is where the catalog's values come from.
__all__ = [
    "DEVICE_KEYS",
    "DeviceSpec",
    "Efficiency",
    "Link",
    "canonical_dtype",
    "catalog_dir",
    "catalog_name_for_kind",
    "catalog_names",
    "load_device",
    "parse_device",
]

# --------------------------------------------------------------------------------------------
# parsing

_INLINE_REQUIRED = ("peak_flops_per_s", "memory_bytes", "hbm_bandwidth_bytes_per_s")
_CATALOG_REQUIRED = (
    "name",
    "vendor",
    *_INLINE_REQUIRED,
    "efficiency",
    "intra_node_link",
    "inter_node_link",
    "source",
)
DEVICE_KEYS = (
    "name",
    "vendor",
    "description",
    "device_kinds",
    *_INLINE_REQUIRED,
    "efficiency",
    "fallback_dtype",
    "price_per_hour_usd",
    "intra_node_link",
    "inter_node_link",
    "source",
)
"""The keys of a device YAML, in the catalog's order."""
_INLINE_NEEDS = (
    "an inline device spec needs at least peak_flops_per_s (e.g. {bf16: 312e12}), "
    "memory_bytes and hbm_bandwidth_bytes_per_s; see configs/devices/*.yaml"
)
_LINK_FIELDS = ("bandwidth_GB_s", "latency_us")
_LINK_KEYS = ("intra_node_link", "inter_node_link")
_SOURCE_FREE_TEXT = ("fallback_dtype", "device_kinds")
"""Non-numeric fields that may carry a source but need not."""


def _parse_peak(value: object, where: Where) -> dict[str, float]:
    peak_in = as_mapping(value, where, what="peak FLOP/s per dtype")
    check_keys(peak_in, where, allowed=DTYPES)
    if not peak_in:
        raise fail(
            where,
            "peak_flops_per_s is empty",
            dict(peak_in),
            "give the dense peak of each supported dtype, e.g. {bf16: 312e12}",
        )
    peak = {k: as_float(v, where.key(k), what="a peak FLOP/s figure") for k, v in peak_in.items()}
    for dtype, flops in peak.items():
        check_plausible(
            flops,
            where.key(dtype),
            PEAK_FLOPS_PER_S,
            key=f"peak_flops_per_s.{dtype}",
            written=peak_in[dtype],
        )
    return peak


def _parse_efficiency(value: object, where: Where, *, complete: bool) -> Efficiency:
    names = tuple(f.name for f in dataclasses.fields(Efficiency))
    eff_in = as_mapping(value, where, what="efficiencies per op class")
    check_keys(eff_in, where, allowed=names, required=names if complete else ())
    values = DEFAULT_INLINE_EFFICIENCY.to_dict()
    for name in eff_in:
        number = as_float(eff_in[name], where.key(name), what="an efficiency (fraction of peak)")
        if number > 1:
            raise fail(
                where.key(name),
                "an efficiency cannot exceed 1 (it is a fraction of peak)",
                number,
                "use a value in (0, 1]",
            )
        values[name] = number
    return Efficiency(**values)


def _numeric_fields(d: Mapping[str, Any]) -> list[str]:
    """Field paths of every number in a device mapping (each needs a source in the catalog)."""
    fields = [f"peak_flops_per_s.{k}" for k in d.get("peak_flops_per_s") or {}]
    fields += ["memory_bytes", "hbm_bandwidth_bytes_per_s"]
    fields += [f"efficiency.{k}" for k in d.get("efficiency") or {}]
    if d.get("price_per_hour_usd") is not None:
        fields.append("price_per_hour_usd")
    for link in _LINK_KEYS:
        if d.get(link) is not None:
            fields += [f"{link}.{k}" for k in _LINK_FIELDS]
    return fields


def _parse_sources(d: Mapping[str, Any], where: Where, *, complete: bool) -> dict[str, str]:
    numbers = _numeric_fields(d)
    sources = as_mapping(d.get("source") or {}, where, what="sources (field: citation)")
    check_keys(sources, where, allowed=(*numbers, *_SOURCE_FREE_TEXT))
    out = {k: as_str(v, where.key(k), what="a citation") for k, v in sources.items()}
    if complete:
        for field in numbers:
            if field not in out:
                raise fail(
                    where.key(field),
                    f"the figure {field} has no source",
                    d.get("name"),
                    f'add \'{field}: "<datasheet name (year)>"\' (or "measured: ...", '
                    '"estimate: ... because ...") under source:',
                )
    return out


def parse_device(data: object, where: Where, *, catalog: bool) -> DeviceSpec:
    """Parses a device mapping (a catalog file or an inline spec) into a :class:`DeviceSpec`.

    Args:
      data: the parsed YAML / dict.
      where: its location, for error messages.
      catalog: a catalog file: name, vendor, efficiency, default links and a source for every
        number are required. An inline spec needs only peak_flops_per_s, memory_bytes and
        hbm_bandwidth_bytes_per_s.

    Raises:
      ClusterError: naming the key path, the value and a remedy.

    Warns:
      ShardplanWarning: a peak FLOP/s, memory or memory bandwidth figure outside its plausible
        range (a unit slip such as ``memory_bytes: 80`` for 80 GB; :mod:`._ranges`).
    """
    d = as_mapping(data, where, what="a device spec")
    check_keys(
        d,
        where,
        allowed=DEVICE_KEYS,
        required=_CATALOG_REQUIRED if catalog else _INLINE_REQUIRED,
        remedies={k: f"add '{k}: ...'; {_INLINE_NEEDS}" for k in _INLINE_REQUIRED},
    )
    # The checks run in this order (so which of several slips is reported first stays put):
    # name, peak figures, fallback, the kinds list, links, memory, bandwidth, then the rest.
    name = as_str(d.get("name", "custom"), where.key("name"), what="a device name")
    peak = _parse_peak(d["peak_flops_per_s"], where.key("peak_flops_per_s"))
    fallback = _parse_fallback(d.get("fallback_dtype"), peak, where.key("fallback_dtype"))
    kinds = _kinds_list(d.get("device_kinds") or [], where.key("device_kinds"))
    intra, inter = (_optional_link(d.get(key), where.key(key)) for key in _LINK_KEYS)
    memory, hbm = _parse_memory(d, where)
    return DeviceSpec(
        name=name,
        vendor=as_str(d.get("vendor", "unknown"), where.key("vendor"), what="a vendor"),
        peak_flops_per_s=peak,
        memory_bytes=memory,
        hbm_bandwidth_bytes_per_s=hbm,
        efficiency=_parse_efficiency(
            d.get("efficiency") or {}, where.key("efficiency"), complete=catalog
        ),
        fallback_dtype=fallback,
        price_per_hour_usd=_parse_price(
            d.get("price_per_hour_usd"), where.key("price_per_hour_usd")
        ),
        intra_node_link=intra,
        inter_node_link=inter,
        device_kinds=tuple(
            as_str(k, where.key("device_kinds").index(i), what="a device kind")
            for i, k in enumerate(kinds)
        ),
        description=_optional_str(
            d.get("description"), where.key("description"), what="a description"
        ),
        sources=_parse_sources(d, where.key("source"), complete=catalog),
    )


def _parse_fallback(value: Any, peak: Mapping[str, float], where: Where) -> str | None:
    """The ``fallback_dtype``: None, or one of the device's peak dtypes."""
    if value is not None and value not in peak:
        raise fail(
            where,
            "fallback_dtype must be one of the dtypes in peak_flops_per_s",
            value,
            f"use one of {', '.join(peak)}",
        )
    return value


def _kinds_list(value: object, where: Where) -> list[Any]:
    """The ``device_kinds`` list (its items are checked as the spec is built)."""
    if not isinstance(value, list):
        raise fail(
            where,
            "device_kinds must be a list of strings",
            value,
            'write e.g. device_kinds: ["NVIDIA A100-SXM4-80GB"]',
        )
    return value


def _optional_link(value: object, where: Where) -> Link | None:
    return parse_link(value, where) if value is not None else None


def _parse_memory(d: Mapping[str, Any], where: Where) -> tuple[int, float]:
    """``memory_bytes`` and ``hbm_bandwidth_bytes_per_s``, each checked for plausibility."""
    memory = as_int(d["memory_bytes"], where.key("memory_bytes"), what="memory in bytes")
    check_plausible(
        memory,
        where.key("memory_bytes"),
        DEVICE_MEMORY_BYTES,
        key="memory_bytes",
        written=d["memory_bytes"],
    )
    hbm = as_float(
        d["hbm_bandwidth_bytes_per_s"],
        where.key("hbm_bandwidth_bytes_per_s"),
        what="a memory bandwidth in bytes/s",
    )
    check_plausible(
        hbm,
        where.key("hbm_bandwidth_bytes_per_s"),
        HBM_BANDWIDTH_BYTES_PER_S,
        key="hbm_bandwidth_bytes_per_s",
        written=d["hbm_bandwidth_bytes_per_s"],
    )
    return memory, hbm


def _parse_price(value: object, where: Where) -> float | None:
    if value is None:
        return None
    return as_float(value, where, what="a price in USD per hour", allow_minimum=True)


def _optional_str(value: object, where: Where, *, what: str) -> str:
    """A non-empty string, or ``""`` for an absent (None) value."""
    return "" if value is None else as_str(value, where, what=what)


# --------------------------------------------------------------------------------------------
# the catalog on disk


def catalog_dir() -> Path:
    """``configs/devices`` of the repository this package lives in (parent of ``shardplan/``)."""
    return Path(__file__).resolve().parents[2] / "configs" / "devices"


def catalog_names(*, directory: str | os.PathLike[str] | None = None) -> tuple[str, ...]:
    """The names of the catalog's devices (file stems of ``configs/devices/*.yaml``), sorted.

    Args:
      directory: another catalog directory (tests, calibration output); default the repo's.
    """
    root = Path(directory) if directory is not None else catalog_dir()
    return tuple(sorted(p.stem for p in root.glob("*.yaml")))


@functools.lru_cache(maxsize=64)
def _load_catalog_file(path: str, mtime_ns: int) -> DeviceSpec:
    """Parses one catalog file; cached per (path, modification time), so edits are seen."""
    del mtime_ns  # part of the cache key only
    data, where = load_yaml(path, what="device spec file")
    spec = parse_device(data, where, catalog=True)
    stem = Path(path).stem
    if spec.name != stem:
        raise fail(
            where.key("name"),
            f"the device name must equal the file name {stem!r}",
            spec.name,
            f"rename the file to {spec.name}.yaml or set name: {stem}",
        )
    return spec


def _unknown_device(name: str, where: Where, names: tuple[str, ...]) -> ClusterError:
    hint = did_you_mean(name.lower(), names, n=3, cutoff=0.5)
    return fail(
        where,
        f"unknown device type {name!r} (not in the device catalog)",
        name,
        f"{hint}Catalog names: {', '.join(names)}. For another device give an inline spec "
        f"instead of a name: {_INLINE_NEEDS}",
    )


def load_device(
    name_or_spec: str | Mapping[str, Any] | DeviceSpec,
    /,
    *,
    directory: str | os.PathLike[str] | None = None,
    where: Where | None = None,
) -> DeviceSpec:
    """Loads a catalog device by name, or parses an inline spec.

    Args:
      name_or_spec: a catalog name (``"a100-80g"``, case-insensitive), an inline spec mapping
        (at least ``peak_flops_per_s``, ``memory_bytes``, ``hbm_bandwidth_bytes_per_s``), or a
        :class:`DeviceSpec` (returned as is).
      directory: another catalog directory; default ``configs/devices`` of this repository.
      where: the location of the value, for error messages (used by the cluster parser).

    Returns:
      The device's figures.

    Raises:
      ClusterError: unknown name (with close matches and the catalog's names), or an invalid
        file or inline spec.

    Example:
        >>> load_device("h100-sxm").memory_bytes
        80000000000
        >>> load_device({"peak_flops_per_s": {"bf16": 1e14}, "memory_bytes": 16e9,
        ...              "hbm_bandwidth_bytes_per_s": 5e11}).name
        'custom'
    """
    where = where if where is not None else Where(path="device")
    if isinstance(name_or_spec, DeviceSpec):
        return name_or_spec
    if isinstance(name_or_spec, Mapping):
        return parse_device(name_or_spec, where, catalog=False)
    if not isinstance(name_or_spec, str):
        raise fail(
            where,
            "a device is a catalog name or an inline spec mapping",
            name_or_spec,
            f"write a catalog name such as 'a100-80g', or {_INLINE_NEEDS}",
        )
    root = Path(directory) if directory is not None else catalog_dir()
    names = catalog_names(directory=root)
    key = name_or_spec.strip().lower()
    if key not in names:
        raise _unknown_device(name_or_spec, where, names)
    path = root / f"{key}.yaml"
    return _load_catalog_file(str(path), path.stat().st_mtime_ns)


def catalog_name_for_kind(
    device_kind: str, *, directory: str | os.PathLike[str] | None = None
) -> str | None:
    """The catalog name whose ``device_kinds`` list ``device_kind`` (case-insensitive), or None.

    Example:
        >>> catalog_name_for_kind("cpu")
        'cpu'
    """
    wanted = device_kind.strip().lower()
    for name in catalog_names(directory=directory):
        spec = load_device(name, directory=directory)
        if any(kind.strip().lower() == wanted for kind in spec.device_kinds):
            return name
    return None
