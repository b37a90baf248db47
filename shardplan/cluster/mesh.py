"""Logical device meshes: named axes laid over a cluster's device ids.

A :class:`LogicalMesh` is the jax-free description of a ``jax.sharding.Mesh``: axis names, axis
sizes and the cluster device ids in row-major order (the last axis varies fastest, so the
innermost axis should map onto the fastest link). The cost model and the solver reason about
collectives over subsets of its axes; the runtime turns it into a real mesh.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from shardplan.errors import ClusterError, format_error

__all__ = ["LogicalMesh"]


@dataclasses.dataclass(frozen=True)
class LogicalMesh:
    """Named axes over device ids.

    Attributes:
      axis_names: e.g. ``("data", "model")``.
      axis_sizes: e.g. ``(2, 4)``; their product is the number of devices.
      device_ids: cluster device ids in row-major order over the axes.

    Example:
      >>> mesh = LogicalMesh(("data", "model"), (2, 4), tuple(range(8)))
      >>> mesh.groups(("model",))
      ((0, 1, 2, 3), (4, 5, 6, 7))
      >>> mesh.groups(("data",))
      ((0, 4), (1, 5), (2, 6), (3, 7))
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    device_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.axis_names) != len(self.axis_sizes):
            raise ClusterError(format_error(
                "A mesh needs one size per axis name.", where="LogicalMesh",
                value=(self.axis_names, self.axis_sizes),
                remedy="pass axis_names and axis_sizes of equal length"))
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ClusterError(format_error(
                "Mesh axis names must be distinct.", where="LogicalMesh.axis_names",
                value=self.axis_names, remedy="rename the repeated axis"))
        if any(s < 1 for s in self.axis_sizes):
            raise ClusterError(format_error(
                "Mesh axis sizes must be positive.", where="LogicalMesh.axis_sizes",
                value=self.axis_sizes, remedy="use sizes >= 1"))
        if math.prod(self.axis_sizes) != len(self.device_ids):
            raise ClusterError(format_error(
                "The mesh's axis sizes do not multiply to its number of devices.",
                where="LogicalMesh", value=(self.axis_sizes, len(self.device_ids)),
                remedy="give exactly prod(axis_sizes) device ids"))
        if len(set(self.device_ids)) != len(self.device_ids):
            raise ClusterError(format_error(
                "A device appears twice in the mesh.", where="LogicalMesh.device_ids",
                value=self.device_ids, remedy="list each device id once"))

    @classmethod
    def create(cls, shape: Sequence[int], names: Sequence[str],
               device_ids: Sequence[int] | None = None) -> LogicalMesh:
        """A mesh over ``device_ids`` (default ``0 .. prod(shape)-1``)."""
        ids = tuple(range(math.prod(shape))) if device_ids is None else tuple(device_ids)
        return cls(tuple(names), tuple(int(s) for s in shape), ids)

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)

    @property
    def shape(self) -> dict[str, int]:
        """``{axis name: size}``."""
        return dict(zip(self.axis_names, self.axis_sizes, strict=True))

    def size(self, axes: str | Sequence[str]) -> int:
        """Number of devices along ``axes`` (product of their sizes; 1 for none)."""
        if isinstance(axes, str):
            axes = (axes,)
        return math.prod(self.axis_sizes[self._index(a)] for a in axes)

    def _index(self, axis: str) -> int:
        try:
            return self.axis_names.index(axis)
        except ValueError:
            raise ClusterError(format_error(
                f"Mesh has no axis {axis!r}.", where="LogicalMesh",
                value=self.axis_names, remedy=f"use one of {list(self.axis_names)}")) from None

    def groups(self, axes: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """The device groups of a collective over ``axes``: one group per combination of the
        other axes' coordinates, each group ordered row-major over ``axes``."""
        over = [self._index(a) for a in axes]
        rest = [i for i in range(len(self.axis_names)) if i not in over]
        strides = [math.prod(self.axis_sizes[i + 1:]) for i in range(len(self.axis_sizes))]
        out = []
        for rest_coord in itertools.product(*(range(self.axis_sizes[i]) for i in rest)):
            base = sum(c * strides[i] for c, i in zip(rest_coord, rest, strict=True))
            group = []
            for coord in itertools.product(*(range(self.axis_sizes[i]) for i in over)):
                flat = base + sum(c * strides[i] for c, i in zip(coord, over, strict=True))
                group.append(self.device_ids[flat])
            out.append(tuple(group))
        return tuple(out)
