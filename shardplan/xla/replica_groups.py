"""Replica groups and source-target pairs of HLO collectives.

``replica_groups=`` is printed in three syntaxes (explicit lists, ``iota`` and ``mesh`` axes);
:func:`parse_replica_groups` expands each into explicit groups of device ids.
:func:`parse_source_target_pairs` reads a collective-permute's ``source_target_pairs=``.

Example:
    >>> parse_replica_groups("[2,4]<=[8]")
    ((0, 1, 2, 3), (4, 5, 6, 7))
    >>> parse_source_target_pairs("{{0,1},{1,0}}")
    ((0, 1), (1, 0))
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from shardplan.xla.text import parse_int_list

__all__ = [
    "ReplicaGroups",
    "parse_replica_groups",
    "parse_source_target_pairs",
]

ReplicaGroups = tuple[tuple[int, ...], ...]

_MAX_DEVICES = 1 << 20
"""Largest device count a replica-group list may expand to; larger ones are left unparsed
(a guard against materialising absurd ``iota`` lists from damaged text)."""
_IOTA_RE = re.compile(r"^\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?$")
_MESH_RE = re.compile(r"^mesh\[(.*?)\](?:\s*,\s*device_ids=\((.*)\))?\s*\{(.*)\}$")
_DEVICE_IOTA_RE = re.compile(r"^\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?$")
_MESH_AXIS_RE = re.compile(r"^'?([^'=]+?)'?\s*=\s*(\d+)$")
_AXIS_REF_RE = re.compile(r"^'?([^':]+?)'?(?::\((\d+)\)(\d+))?$")


def parse_replica_groups(text: str | None, *, num_devices: int | None = None) -> ReplicaGroups:
    """Expands a ``replica_groups=`` value into explicit groups of device ids.

    Three syntaxes are understood:

    * explicit ``{{0,1},{2,3}}``; the empty ``{}`` means one group of all ``num_devices``
      devices (left empty when ``num_devices`` is None);
    * iota ``[G,S]<=[d0,d1,...]`` with an optional ``T(p0,p1,...)``: ``iota(prod(d))``
      reshaped to ``d``, transposed by ``p``, reshaped to ``[G, S]`` (XLA's
      ``IotaReplicaGroupList``), e.g. ``[4,2]<=[2,4]T(1,0)`` → ``{{0,4},{1,5},{2,6},{3,7}}``;
    * mesh axes ``mesh['x'=2,'y'=4] {'y'}`` (quotes optional, sub-axes ``'x':(1)2`` and
      ``device_ids=(...)`` allowed): the mesh's devices, row-major unless ``device_ids`` are
      given, reshaped to the axis sizes; the grouped axes are moved last (in the listed
      order) and the result is cut into groups (XLA's ``MeshAxesReplicaGroupList``).

    Args:
      text: the attribute value, or None.
      num_devices: the number of participants, used to expand ``{}``.

    Returns:
      A tuple of groups; ``()`` when ``text`` is None or cannot be parsed.
    """
    if text is None:
        return ()
    text = text.strip()
    try:
        if text.startswith("{"):
            return _explicit_groups(text, num_devices)
        if text.startswith("["):
            return _iota_groups(text)
        if text.startswith("mesh"):
            return _mesh_groups(text)
    except (ValueError, IndexError, KeyError):
        return ()
    return ()


def _explicit_groups(text: str, num_devices: int | None) -> ReplicaGroups:
    groups = tuple(parse_int_list(g) for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1]))
    groups = tuple(g for g in groups if g)
    if not groups and num_devices:
        return (tuple(range(num_devices)),)
    return groups


def _iota_groups(text: str) -> ReplicaGroups:
    match = _IOTA_RE.match(text.replace(" ", ""))
    if match is None:
        raise ValueError(text)
    num_groups, group_size = parse_int_list(match.group(1))
    reshape_dims = parse_int_list(match.group(2))
    perm = parse_int_list(match.group(3)) or tuple(range(len(reshape_dims)))
    if math.prod(reshape_dims) > _MAX_DEVICES:
        raise ValueError(text)
    ids = np.arange(math.prod(reshape_dims)).reshape(reshape_dims).transpose(perm)
    return _as_groups(ids.reshape(num_groups, group_size))


def _mesh_groups(text: str) -> ReplicaGroups:
    match = _MESH_RE.match(text)
    if match is None:
        raise ValueError(text)
    names: list[str] = []
    sizes: list[int] = []
    for part in match.group(1).split(","):
        axis = _MESH_AXIS_RE.match(part.strip())
        if axis is None:
            raise ValueError(part)
        names.append(axis.group(1))
        sizes.append(int(axis.group(2)))
    total = math.prod(sizes)
    if total > _MAX_DEVICES:
        raise ValueError(text)
    devices = _mesh_devices(match.group(2), total)
    refs = [_AXIS_REF_RE.match(r.strip()) for r in match.group(3).split(",") if r.strip()]
    axes = [(names.index(r.group(1)), r.group(2), r.group(3)) for r in refs if r]
    dims, grouped = _mesh_reindex(
        sizes, [(i, int(p) if p else None, int(s) if s else None) for i, p, s in axes]
    )
    others = [d for d in range(len(dims)) if d not in grouped]
    group_size = math.prod(dims[d] for d in grouped)
    arranged = devices.reshape(dims).transpose(others + grouped)
    return _as_groups(arranged.reshape(-1, group_size))


def _mesh_devices(text: str | None, total: int) -> np.ndarray:
    """The mesh's device ids in row-major order: listed (``0,2,1,3``), in XLA's iota form
    (``[2,2]T(1,0)``: ``arange`` reshaped and transposed), or ``arange(total)`` if absent."""
    if not text:
        return np.arange(total)
    iota = _DEVICE_IOTA_RE.match(text.replace(" ", ""))
    if iota is not None:
        dims = parse_int_list(iota.group(1))
        perm = parse_int_list(iota.group(2)) if iota.group(2) else tuple(range(len(dims)))
        if math.prod(dims) != total:
            raise ValueError(text)
        return np.arange(total).reshape(dims).transpose(perm).reshape(-1)
    ids = parse_int_list(text)
    if len(ids) != total:
        raise ValueError(text)
    return np.array(ids)


def _mesh_reindex(
    sizes: Sequence[int], axes: Sequence[tuple[int, int | None, int | None]]
) -> tuple[list[int], list[int]]:
    """Splits mesh axes with sub-axis refs into finer dims; returns the dims and the grouped
    dims in the listed order (``ComputeReindexedAxes`` in XLA's ``replica_group.cc``).

    A full axis ``a`` keeps its dim. Sub-axes ``a:(pre)size`` of an axis of size ``n`` split it
    into ``[pre₀, size₀, pre₁/(pre₀·size₀), size₁, ..., rest]`` (sorted by ``pre``).
    """
    dims: list[int] = []
    grouped_at: dict[tuple[int, int], int] = {}  # (axis, pre) -> reindexed dim
    for axis, full in enumerate(sizes):
        subs = sorted((pre, size) for a, pre, size in axes if a == axis and pre and size)
        if not subs:
            grouped_at[(axis, 0)] = len(dims)
            dims.append(full)
            continue
        covered = 1
        for pre, size in subs:
            if pre != covered:
                dims.append(pre // covered)
                covered = pre
            grouped_at[(axis, pre)] = len(dims)
            dims.append(size)
            covered *= size
        if covered != full:
            dims.append(full // covered)
    grouped = [grouped_at[(axis, pre or 0)] for axis, pre, _ in axes]
    return dims, grouped


def _as_groups(array: np.ndarray) -> ReplicaGroups:
    return tuple(tuple(int(x) for x in row) for row in array)


def parse_source_target_pairs(text: str | None) -> tuple[tuple[int, int], ...]:
    """Parses ``source_target_pairs={{0,1},{1,2}}`` into ``((0, 1), (1, 2))``."""
    if not text:
        return ()
    pairs = (parse_int_list(p) for p in re.findall(r"\{([\d,\s]*)\}", text))
    return tuple((p[0], p[1]) for p in pairs if len(p) == 2)
