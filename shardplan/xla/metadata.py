"""Op metadata and source locations in HLO text.

An instruction's ``metadata={op_name="jit(f)/dot" source_file="f.py" source_line=3}`` names
the JAX op it came from and where. Newer XLA prints ``stack_frame_id=N`` instead, an index
into the module text's ``FileNames`` / ``FunctionNames`` / ``FileLocations`` / ``StackFrames``
tables (:func:`parse_frame_tables`).

Example:
    >>> fields = parse_metadata('{op_name="jit(f)/neg" source_file="f.py" source_line=3}')
    >>> fields["op_name"], source_of(fields, {})
    ('jit(f)/neg', 'f.py:3')
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

__all__ = [
    "parse_frame_tables",
    "parse_metadata",
    "source_of",
]

_METADATA_FIELD_RE = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s}]+)')


def parse_metadata(text: str | None) -> dict[str, str]:
    """Parses ``{op_name="..." source_line=3 ...}`` into a dict of unquoted strings."""
    if not text:
        return {}
    fields: dict[str, str] = {}
    for key, value in _METADATA_FIELD_RE.findall(text):
        if value.startswith('"'):
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        fields[key] = value
    return fields


def source_of(metadata: Mapping[str, str], frames: Mapping[int, str]) -> str | None:
    """``file:line`` from ``source_file``/``source_line`` or from ``stack_frame_id``."""
    if "source_file" in metadata:
        line = metadata.get("source_line")
        return f"{metadata['source_file']}:{line}" if line else metadata["source_file"]
    frame = metadata.get("stack_frame_id", "")
    return frames.get(int(frame)) if frame.isdigit() else None


_TABLE_NAMES = frozenset({"FileNames", "FunctionNames", "FileLocations", "StackFrames"})
_TABLE_ROW_RE = re.compile(r"^\s*(\d+)\s+(.*?)\s*$")


def parse_frame_tables(lines: Sequence[str]) -> dict[int, str]:
    """Maps each ``stack_frame_id`` to the ``file:line`` of its own location."""
    tables: dict[str, dict[int, str]] = {name: {} for name in _TABLE_NAMES}
    current: dict[int, str] | None = None
    for line in lines:
        stripped = line.strip()
        if stripped in _TABLE_NAMES:
            current = tables[stripped]
            continue
        row = _TABLE_ROW_RE.match(line) if current is not None else None
        if row is None or current is None:
            current = None
            continue
        current[int(row.group(1))] = row.group(2)
    files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
    locations: dict[int, str] = {}
    for loc_id, text in tables["FileLocations"].items():
        fields = parse_metadata(text)
        file_id, line_no = fields.get("file_name_id", ""), fields.get("line", "")
        if file_id.isdigit() and int(file_id) in files:
            locations[loc_id] = f"{files[int(file_id)]}:{line_no}"
    frames: dict[int, str] = {}
    for frame_id, text in tables["StackFrames"].items():
        location = parse_metadata(text).get("file_location_id", "")
        if location.isdigit() and int(location) in locations:
            frames[frame_id] = locations[int(location)]
    return frames
