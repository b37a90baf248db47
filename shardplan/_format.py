"""Plain-text formatting shared by every text and HTML view: sizes, times, counts, specs, key
patterns, runs of names, and lines fitted to :data:`MAX_WIDTH` columns.

The bottom layer of the package: the standard library only (no jax, nothing from shardplan's
subpackages), so the plan, the planner, the runtime and the views can all import it. Specs are
the plan's ``tuple[tuple[str, ...], ...]`` (one tuple of mesh axis names per dimension).

Example:
    >>> format_time(0.0123), format_bytes(3 * 1024**2), format_spec(((), ("data",)))
    ('12.3 ms', '3.00 MiB', "(None, 'data')")
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "HASH_CHARS",
    "MAX_WIDTH",
    "clip_line",
    "compress_ids",
    "compress_layers",
    "elide_middle",
    "format_bytes",
    "format_gib",
    "format_share",
    "format_si",
    "format_spec",
    "format_time",
    "format_value",
    "key_pattern",
    "layer_runs",
    "pack_items",
    "plain_json",
    "plural",
    "stage_runs",
    "starred_values",
    "table_lines",
    "wrap_text",
]

MAX_WIDTH = 100
"""No line of a text view is longer than this many columns."""

HASH_CHARS = 12
"""Hex digits of a hash the views show: enough to tell plans apart by eye."""

_GIB = 1024**3
_INDEXED = re.compile(r"^(.*\D)(\d+)$")  # "blocks.12" -> ("blocks.", "12")
_LINEN_INDEX = re.compile(r"^(.*[A-Za-z])_\d+$")  # "Dense_3" -> "Dense"


# --------------------------------------------------------------------------- sizes, times, counts


def format_time(seconds: float) -> str:
    """A duration in milliseconds: one decimal from 10 ms up, three below.

    Example:
        >>> format_time(0.0123), format_time(0.0004)
        ('12.3 ms', '0.400 ms')
    """
    ms = seconds * 1e3
    return f"{ms:,.1f} ms" if ms >= 10 else f"{ms:.3f} ms"


def format_bytes(n: int) -> str:
    """A byte count in the largest binary unit it reaches (GiB, MiB, KiB), two decimals; whole
    bytes below 1 KiB.

    Example:
        >>> format_bytes(3 * 1024**2), format_bytes(512)
        ('3.00 MiB', '512 B')
    """
    for unit, scale in (("GiB", _GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"


def format_gib(n: int) -> str:
    """Bytes in GiB with two decimals; below 0.1 GiB (tiny test models) as :func:`format_bytes`,
    in a unit that shows them.

    Example:
        >>> format_gib(2 * 1024**3), format_gib(1024**2)
        ('2.00 GiB', '1.00 MiB')
    """
    return f"{n / _GIB:,.2f} GiB" if n >= _GIB // 10 else format_bytes(n)


def format_si(x: float) -> str:
    """A count (FLOPs) to three significant digits with an SI prefix (``k``, ``M``, ``G``,
    ``T``; ``T`` is the largest, so a PFLOP reads ``1e+03 T``).

    Example:
        >>> format_si(2.5e12), format_si(12.0)
        ('2.5 T', '12')
    """
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g}"


def format_share(part: float, whole: float) -> str:
    """``part`` as a whole percentage of ``whole``, in parentheses after a space; ``""`` when
    ``whole`` is not positive.

    Example:
        >>> format_share(1, 4), format_share(1, 0)
        (' (25 %)', '')
    """
    return f" ({100 * part / whole:.0f} %)" if whole > 0 else ""


def plain_json(value: object) -> object:
    """A frozen record as plain JSON data: mappings become dicts with string keys and tuples
    lists, at every depth; other values pass through.

    Example:
        >>> plain_json({"mesh": (2, 4), 3: {"axes": ("data",)}})
        {'mesh': [2, 4], '3': {'axes': ['data']}}
    """
    if isinstance(value, Mapping):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [plain_json(v) for v in value]
    return value


def format_value(value: object) -> str:
    """A JSON-native value in one short cell: floats to four significant digits, strings as
    they are, mappings and tuples as compact JSON cut to 40 characters.

    Example:
        >>> format_value(0.123456), format_value({"mesh": (2, 4)})
        ('0.1235', '{"mesh":[2,4]}')
    """
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping | tuple):
        text = json.dumps(plain_json(value), separators=(",", ":"))
        return text if len(text) <= 40 else text[:37] + "..."
    return repr(value)


def plural(n: int, word: str, plural_word: str | None = None) -> str:
    """``n`` and ``word``, in the plural (``plural_word``, by default ``word + "s"``) unless ``n``
    is 1.

    Example:
        >>> plural(1, "stage"), plural(4, "microbatch", "microbatches")
        ('1 stage', '4 microbatches')
    """
    return f"{n} {word if n == 1 else plural_word or word + 's'}"


# --------------------------------------------------------------------------- specs and key paths


def format_spec(spec: Sequence[tuple[str, ...]], /) -> str:
    """A spec as a ``PartitionSpec``-like tuple.

    Example:
        >>> format_spec(((), ("model",), ("data", "fsdp")))
        "(None, 'model', ('data', 'fsdp'))"
    """
    entries = [None if not dim else dim[0] if len(dim) == 1 else dim for dim in spec]
    return repr(tuple(entries))


def key_pattern(path: str, /) -> str:
    """A key path with layer indices replaced by ``*``.

    A numeric component that follows a named one (``blocks/3``) is an index into a collection
    of layers; leading numeric components are positions in the state tuple and are kept.

    Example:
        >>> key_pattern("0/0/blocks/3/mlp/Dense_1/kernel/value")
        '0/0/blocks/*/mlp/Dense_*/kernel/value'
    """
    comps = path.split("/")
    out: list[str] = []
    for i, comp in enumerate(comps):
        if comp.isdigit() and i > 0 and not comps[i - 1].isdigit():
            out.append("*")
        else:
            m = _LINEN_INDEX.match(comp)
            out.append(f"{m.group(1)}_*" if m else comp)
    return "/".join(out)


def starred_values(path: str, /) -> tuple[str, ...]:
    """The components of ``path`` that :func:`key_pattern` replaces with ``*`` (layer
    indices), in order.

    Example:
        >>> starred_values("0/blocks/3/mlp/Dense_1/kernel")
        ('3', '1')
    """
    out = []
    for part, pat in zip(path.split("/"), key_pattern(path).split("/"), strict=True):
        if pat == "*":
            out.append(part)
        elif pat.endswith("_*") and part != pat:
            out.append(part[len(pat) - 1:])
    return tuple(out)


# --------------------------------------------------------------------------- runs of names and ids


def layer_runs(names: Sequence[str], /) -> list[str]:
    """Layer names with runs of three or more consecutively numbered ones as ``first .. last``.

    Example:
        >>> layer_runs(["pre", "blocks.0", "blocks.1", "blocks.2", "blocks.4"])
        ['pre', 'blocks.0 .. blocks.2', 'blocks.4']
    """
    parts: list[str] = []
    i = 0
    while i < len(names):
        j = i
        m = _INDEXED.match(names[i])
        if m is not None:
            prefix, start = m.group(1), int(m.group(2))
            while j + 1 < len(names) and names[j + 1] == f"{prefix}{start + j + 1 - i}":
                j += 1
        if j - i >= 2:
            parts.append(f"{names[i]} .. {names[j]}")
        else:
            parts.extend(names[i:j + 1])
        i = j + 1
    return parts


def compress_layers(names: Sequence[str], /) -> str:
    """``", "``-joined :func:`layer_runs`.

    Example:
        >>> compress_layers(["pre", "blocks.0", "blocks.1", "blocks.2", "post"])
        'pre, blocks.0 .. blocks.2, post'
    """
    return ", ".join(layer_runs(names)) or "-"


def compress_ids(ids: Iterable[int], /) -> str:
    """Sorted device ids with consecutive runs as ``a-b``.

    Example:
        >>> compress_ids([3, 0, 1, 2, 8, 10, 11])
        '0-3, 8, 10-11'
    """
    ordered = sorted(set(ids))
    runs: list[list[int]] = []
    for d in ordered:
        if runs and d == runs[-1][1] + 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def stage_runs(items: Sequence[str], /) -> str:
    """Stages joined by ``+``, runs of equal ones as ``n x item``.

    Example:
        >>> stage_runs(["h100 8", "h100 8", "h100 8", "a100 8"])
        '3 x h100 8 + a100 8'
    """
    runs: list[list[Any]] = []
    for item in items:
        if runs and runs[-1][0] == item:
            runs[-1][1] += 1
        else:
            runs.append([item, 1])
    return " + ".join(item if n == 1 else f"{n} x {item}" for item, n in runs)


# --------------------------------------------------------------------------- fitting lines


def clip_line(line: str, width: int = MAX_WIDTH) -> str:
    """``line`` cut to ``width`` columns, ending in ``...`` where it was cut.

    Example:
        >>> clip_line("stage 0 (cpu x2)", 10)
        'stage 0...'
    """
    return line if len(line) <= width else line[:width - 3] + "..."


def elide_middle(text: str, width: int) -> str:
    """``text`` cut to ``width`` columns by replacing its middle with ``...`` (a character of
    each end stays, so a width under 5 can be exceeded).

    Example:
        >>> elide_middle("blocks/attention/wq", 12)
        'bloc...on/wq'
    """
    if len(text) <= width:
        return text
    keep = max(width - 3, 2)
    return text[:keep // 2] + "..." + text[len(text) - (keep - keep // 2):]


def pack_items(items: Sequence[str], lead: str, subsequent: str, sep: str = ", ") -> list[str]:
    """Items joined by ``sep``, broken between items (never inside one) to fit
    :data:`MAX_WIDTH`: the first line led by ``lead``, the others by ``subsequent``.

    Example:
        >>> pack_items(["0-3", "8"], "  devices: ", "    ")
        ['  devices: 0-3, 8']
    """
    lines = [lead]
    for i, item in enumerate(items):
        piece = item + (sep.rstrip() if i + 1 < len(items) else "")
        if lines[-1] not in (lead, subsequent) and len(lines[-1]) + 1 + len(piece) > MAX_WIDTH:
            lines.append(subsequent)
        joiner = "" if lines[-1] in (lead, subsequent) else " "
        lines[-1] += joiner + piece
    return lines


def wrap_text(text: str, indent: str, subsequent: str | None = None) -> list[str]:
    """``text`` broken between words into lines of at most MAX_WIDTH columns, the first led by
    ``indent`` and the rest by ``subsequent`` (default ``indent``); an empty text gives one line,
    ``indent`` without its trailing spaces.

    Example:
        >>> wrap_text("no runner-up", "  ")
        ['  no runner-up']
    """
    return textwrap.wrap(text, MAX_WIDTH, initial_indent=indent,
                         subsequent_indent=indent if subsequent is None else subsequent,
                         break_on_hyphens=False) or [indent.rstrip()]


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  " + "  ".join(f"{c:<{w}}" for c, w in zip(cells, widths, strict=True))


def table_lines(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A table indented two columns, its columns padded to their widest cell (two spaces
    between them) and trailing spaces dropped, the head first.

    Example:
        >>> table_lines(("mesh", "step"), [("cpu (data=2)", "1.000 ms")])
        ['  mesh          step', '  cpu (data=2)  1.000 ms']
    """
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    return [_row(head, widths).rstrip(), *(_row(r, widths).rstrip() for r in rows)]
