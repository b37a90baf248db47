"""``sp.visualize(array)``: which part of a live sharded ``jax.Array`` each device holds.

Works for any rank and any sharding, from the sharding alone
(``sharding.devices_indices_map(shape)``), so under several processes it also shows the blocks
of devices this process cannot address. Printed:

* a header: dtype, shape, the mesh and ``PartitionSpec`` of a ``NamedSharding`` (else the
  sharding's type), and which dimensions are split over which mesh axes into how many blocks;
* for rank 1 and 2, a grid like ``jax.debug.visualize_array_sharding``: rows are the blocks of
  dimension 0, columns those of dimension 1 (of dimension 0 for rank 1), each cell the devices
  that hold it;
* for every rank, each block with its index ranges per dimension (``[0:4, 0:2]``) and the
  devices that hold it (devices holding the same block share a line).

Example:
    >>> import jax, numpy as np
    >>> x = jax.device_put(np.zeros((4, 2), np.float32), jax.devices()[0])
    >>> print(visualize_text(x).splitlines()[-1])
      device 0: [0:4, 0:2]
"""

from __future__ import annotations

import io
import os
import sys
from typing import TYPE_CHECKING, Any, TextIO

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from shardplan._format import MAX_WIDTH, compress_ids
from shardplan.errors import ConfigError, format_error

if TYPE_CHECKING:
    import jax

__all__ = ["blocks", "visualize", "visualize_text"]

Bounds = tuple[tuple[int, int], ...]
"""Per dimension, ``(start, stop)`` element indices."""

MIN_CELL_WIDTH = 9
"""A grid column needs about this many columns; with more blocks than fit, no grid is drawn."""


def blocks(array: jax.Array | Any, /) -> dict[Bounds, list[int]]:
    """``{index ranges per dimension: [device ids]}`` of ``array``'s sharding, ranges sorted.

    Args:
      array: a ``jax.Array`` (or anything with ``.shape`` and a ``.sharding``).

    Raises:
      ConfigError: ``array`` has no sharding (a NumPy array, a tracer inside ``jit``).
    """
    sharding = getattr(array, "sharding", None)
    if sharding is None or not hasattr(sharding, "devices_indices_map"):
        raise ConfigError(format_error(
            "Only an array with a sharding can be visualized.", where="visualize(array)",
            value=type(array).__name__,
            remedy="pass a jax.Array (jax.device_put(x, sharding)); inside jit, use "
                   "jax.debug.inspect_array_sharding"))
    shape = tuple(int(n) for n in array.shape)
    out: dict[Bounds, list[int]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        bounds = tuple(_range(s, n) for s, n in zip(index, shape, strict=True))
        out.setdefault(bounds, []).append(int(device.id))
    return {b: sorted(out[b]) for b in sorted(out)}


def _range(index: slice | int, size: int) -> tuple[int, int]:
    if isinstance(index, slice):
        start, stop, _ = index.indices(size)
        return start, stop
    return int(index), int(index) + 1


def _format_bounds(bounds: Bounds) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in bounds) + "]"


def _describe(array: Any, found: dict[Bounds, list[int]]) -> list[str]:
    """The header lines: what the array is and how its dimensions are split."""
    sharding = array.sharding
    shape = tuple(array.shape)
    ndev = sum(len(d) for d in found.values())
    lines = [f"{array.dtype}{list(shape)} on {ndev} device{'s' if ndev != 1 else ''}: "
             f"{len(found)} distinct block{'s' if len(found) != 1 else ''}"]
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is not None and spec is not None:
        axes = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
        lines.append(f"  NamedSharding on mesh ({axes}), spec {spec}")
    else:
        lines.append(f"  {type(sharding).__name__}")
    for dim in range(len(shape)):
        count = len({b[dim] for b in found})
        over = ""
        if mesh is not None and spec is not None and dim < len(spec) and spec[dim] is not None:
            names = spec[dim] if isinstance(spec[dim], tuple) else (spec[dim],)
            over = " over " + " x ".join(f"'{a}' ({mesh.shape[a]})" for a in names)
        if count > 1 or over:
            lines.append(f"  dim {dim} (size {shape[dim]}): {count} blocks{over}")
    if all(count == 1 for count in (len({b[d] for b in found}) for d in range(len(shape)))):
        lines.append("  not split: every device holds the whole array")
    return lines


def _grid(found: dict[Bounds, list[int]], rank: int, width: int) -> Table | None:
    """Rows: blocks of dim 0; columns: blocks of dim 1 (rank 2) or of dim 0 (rank 1)."""
    if rank == 1:
        rows: list[tuple[int, int] | None] = [None]
        cols = sorted({b[0] for b in found})
    else:
        rows = list(sorted({b[0] for b in found}))
        cols = sorted({b[1] for b in found})
    if (len(cols) + 1) * MIN_CELL_WIDTH > width:
        return None
    table = Table(box=box.SQUARE, show_header=True, pad_edge=True, show_lines=True,
                  header_style="dim")
    table.add_column("" if rank == 1 else "dim 0 \\ 1", style="dim", overflow="fold")
    for a, b in cols:
        table.add_column(f"{a}:{b}", justify="center", overflow="fold")
    for row in rows:
        cells = []
        for col in cols:
            bounds = (col,) if row is None else (row, col)
            held = found.get(bounds)
            cells.append(compress_ids(held) if held else "-")
        label = "" if row is None else f"{row[0]}:{row[1]}"
        table.add_row(label, *cells)
    return table


def _console(file: TextIO, *, width: int, color: bool) -> Console:
    return Console(file=file, width=width, force_terminal=color, no_color=not color,
                   color_system="standard" if color else None, highlight=False, markup=False,
                   emoji=False, soft_wrap=False, legacy_windows=False)


def _render(console: Console, array: Any) -> None:
    found = blocks(array)
    rank = len(array.shape)
    head = _describe(array, found)
    console.print(Text(head[0], style="bold"))
    for line in head[1:]:
        console.print(Text(line, no_wrap=False))
    if 1 <= rank <= 2:
        grid = _grid(found, rank, console.width)
        if grid is None:
            console.print(Text(f"  ({len(found)} blocks: too many for a grid at this width)",
                               style="dim"))
        else:
            console.print(grid)
    console.print(Text("block per device (index ranges per dimension):", style="bold"))
    for bounds, ids in found.items():
        who = f"device{'s' if len(ids) > 1 else ''} {compress_ids(ids)}"
        console.print(Text(f"  {who}: {_format_bounds(bounds)}", overflow="fold"))


def visualize_text(array: jax.Array | Any, /, *, width: int = MAX_WIDTH,
                   color: bool = False) -> str:
    """What :func:`visualize` prints, as a string (no escape codes unless ``color``).

    Args:
      array: a ``jax.Array`` of any rank with any sharding.
      width: columns.
      color: include ANSI colour codes.

    Raises:
      ConfigError: ``array`` has no sharding.
    """
    buffer = io.StringIO()
    _render(_console(buffer, width=width, color=color), array)
    text = buffer.getvalue()
    return text if color else "\n".join(line.rstrip() for line in text.split("\n")).rstrip("\n")


def visualize(array: jax.Array | Any, /, *, width: int = MAX_WIDTH,
              file: TextIO | None = None) -> None:
    """Prints which block of ``array`` each device holds (the module docstring).

    In colour on a terminal unless ``NO_COLOR`` is set.

    Args:
      array: a ``jax.Array`` of any rank with any sharding (all devices are shown, also those
        of other processes).
      width: columns.
      file: where to print (default ``sys.stdout``).

    Raises:
      ConfigError: ``array`` has no sharding.

    Example:
        >>> import jax, numpy as np, shardplan as sp
        >>> sp.visualize(jax.device_put(np.float32(1.0), jax.devices()[0]))
        float32[] on 1 device: 1 distinct block
          SingleDeviceSharding
          not split: every device holds the whole array
        block per device (index ranges per dimension):
          device 0: []
    """
    out = file if file is not None else sys.stdout
    color = out.isatty() and not os.environ.get("NO_COLOR")
    _render(_console(out, width=width, color=color), array)

