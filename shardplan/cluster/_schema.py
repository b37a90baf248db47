"""YAML loading, schema checks and a frozen mapping, shared by the cluster modules.

Every check raises :class:`~shardplan.errors.ClusterError` built with
:func:`~shardplan.errors.format_error`, naming the file (and line, when the value came from a
YAML file), the key path (``groups[1].nodes``), the offending value and a remedy. The helpers
here know nothing about devices or clusters; they only know where a value came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any, TypeVar

import yaml

from shardplan._files import read_text
from shardplan.errors import ClusterError, ShardplanWarning, format_error

__all__ = [
    "FrozenMap",
    "Where",
    "as_float",
    "as_int",
    "as_mapping",
    "as_str",
    "check_keys",
    "fail",
    "load_yaml",
    "short_float",
    "warn",
]


class _Loader(yaml.SafeLoader):
    """A ``SafeLoader`` that also reads YAML 1.2 floats such as ``312e12`` as numbers.

    PyYAML implements YAML 1.1, where a float needs a dot and a signed exponent
    (``3.12e+14``); ``312e12`` would silently become the *string* ``"312e12"``. Hardware figures
    are written in exactly that form, so shardplan's files accept it. Quoted values stay strings.
    """


_YAML12_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))

_K = TypeVar("_K")
_V = TypeVar("_V")


class FrozenMap(Mapping[_K, _V]):
    """A read-only, hashable mapping, so that :class:`DeviceSpec` stays a hashable value."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[_K, _V] | Iterable[tuple[_K, _V]] = ()) -> None:
        self._items: dict[_K, _V] = dict(items)

    def __getitem__(self, key: _K) -> _V:
        return self._items[key]

    def __iter__(self) -> Iterator[_K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._items == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMap({self._items!r})"


_MAX_VALUE_REPR = 160
"""Longest ``repr`` of an offending value shown in a message; longer ones are cut."""


@dataclasses.dataclass(frozen=True, eq=False)
class Where:
    """Where a value came from: an optional file, a key path inside it, and the file's lines.

    Attributes:
      file: the YAML file the value was read from, or None for a dict given in Python.
      path: the key path, e.g. ``groups[1].intra_node.latency_us``; empty for the top level.
      lines: key path -> 1-based line number, for values read from a YAML file.
    """

    file: str | None = None
    path: str = ""
    lines: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def key(self, name: str) -> Where:
        """Returns the location of key ``name`` inside this mapping."""
        path = f"{self.path}.{name}" if self.path else name
        return dataclasses.replace(self, path=path)

    def index(self, i: int) -> Where:
        """Returns the location of item ``i`` inside this list."""
        return dataclasses.replace(self, path=f"{self.path}[{i}]")

    def line(self) -> int | None:
        """The line of this key path, or of its nearest enclosing key that has one."""
        path = self.path
        while path:
            if path in self.lines:
                return self.lines[path]
            cut = max(path.rfind("."), path.rfind("["))
            path = path[:cut] if cut > 0 else ""
        return None

    def __str__(self) -> str:
        path = self.path or "(top level)"
        if self.file is None:
            return path
        line = self.line()
        return f"{path} ({self.file}, line {line})" if line else f"{path} ({self.file})"


class _Shown:
    """Shows a pre-formatted value in :func:`format_error` without quoting it again."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _shown(value: object) -> _Shown:
    text = repr(value)
    if len(text) > _MAX_VALUE_REPR:
        text = text[: _MAX_VALUE_REPR - 5] + " ...)"
    return _Shown(text)


def fail(where: Where | str, what: str, value: object, remedy: str) -> ClusterError:
    """Builds (does not raise) a :class:`ClusterError` for ``value`` at ``where``.

    Args:
      where: the location; a plain string for values that did not come from a mapping.
      what: one sentence saying what is wrong.
      value: the offending value, always shown (also when it is None).
      remedy: what the user should change.

    Returns:
      The error, for the caller to ``raise`` (so the traceback points at the check).
    """
    return ClusterError(
        format_error(what, where=str(where), value=_shown(value), remedy=remedy, has_value=True)
    )


_SKIPPED_MODULES = ("shardplan", "jax._src.traceback_util")
"""Modules whose frames a warning is not attributed to: shardplan's own, and the wrapper of its
public entry points (``shardplan/_traceback.py``); the first other frame is the user's call."""


def _skipped(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in _SKIPPED_MODULES)


def warn(where: Where | str, what: str, value: object, remedy: str) -> None:
    """Issues a :class:`ShardplanWarning` laid out like :func:`fail`'s errors.

    The warning is attributed to the first caller outside the ``shardplan`` package, so that
    ``python -W`` and pytest show the user's line (``Cluster.from_yaml(...)``), whatever the
    depth of the parser below it.
    """
    level = 2  # stacklevel 2: warn's caller
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and _skipped(str(frame.f_globals.get("__name__", ""))):
        frame, level = frame.f_back, level + 1
    warnings.warn(
        format_error(what, where=str(where), value=_shown(value), remedy=remedy, has_value=True),
        ShardplanWarning,
        stacklevel=level,
    )


def short_float(x: float) -> float:
    """Rounds ``x`` to 12 significant digits, undoing unit-conversion noise (1.5e-6 * 1e6)."""
    return float(f"{x:.12g}")


# --------------------------------------------------------------------------------------------
# YAML files


def _record_lines(node: yaml.Node, path: str, lines: dict[str, int], file: str) -> None:
    """Fills ``lines`` with key path -> line for every key and list item under ``node``.

    Raises:
      ClusterError: a mapping repeats a key (PyYAML would silently keep the last one).
    """
    if isinstance(node, yaml.MappingNode):
        first_seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            child = f"{path}.{key}" if path else key
            line = key_node.start_mark.line + 1
            if key in first_seen:
                raise fail(
                    Where(file, child, {child: line}),
                    f"key {key!r} appears twice in the same mapping",
                    key,
                    f"delete one of the two entries (the first is on line {first_seen[key]})",
                )
            first_seen[key] = line
            lines[child] = line
            _record_lines(value_node, child, lines, file)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            child = f"{path}[{i}]"
            lines[child] = item.start_mark.line + 1
            _record_lines(item, child, lines, file)


def load_yaml(path: str | os.PathLike[str], *, what: str = "cluster file") -> tuple[Any, Where]:
    """Parses a YAML file, keeping the line of every key for error messages.

    Args:
      path: the file.
      what: what the file is, for messages ("cluster file", "device spec").

    Returns:
      ``(data, where)``: the parsed document and the top-level :class:`Where` of the file.

    Raises:
      ClusterError: the file cannot be read (missing, a directory, no permission), is not UTF-8
        (message names the line, column and byte offset of the first bad byte), does not parse
        (message names file, line and column) or repeats a key.
    """
    text = read_text(path, what=what, error=ClusterError, remedy="check the path")
    file = os.fspath(path)
    loader = _Loader(text)
    lines: dict[str, int] = {}
    try:
        node = loader.get_single_node()
        if node is None:
            return None, Where(file, "", lines)
        _record_lines(node, "", lines, file)
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        place = f"{file}, line {mark.line + 1}, column {mark.column + 1}" if mark else file
        problem = " ".join(p for p in (e.context, e.problem) if p)
        raise fail(
            place,
            "the YAML does not parse",
            problem,
            "fix the YAML syntax at that line (indentation, a missing ':', an unclosed bracket "
            "or quote)",
        ) from e
    except yaml.YAMLError as e:
        raise fail(file, "the YAML does not parse", str(e), "fix the YAML syntax") from e
    finally:
        loader.dispose()
    return data, Where(file, "", lines)


# --------------------------------------------------------------------------------------------
# typed getters


def as_mapping(value: object, where: Where, *, what: str) -> Mapping[str, Any]:
    """Returns ``value`` if it is a mapping with string keys, else raises ClusterError."""
    if not isinstance(value, Mapping):
        raise fail(
            where,
            f"expected {what} (a mapping of key: value), got {type(value).__name__}",
            value,
            f"write {what} as 'key: value' lines or a {{...}} dict",
        )
    for key in value:
        if not isinstance(key, str):
            raise fail(
                where.key(str(key)),
                f"keys must be strings, got {type(key).__name__}",
                key,
                "quote the key or fix the indentation",
            )
    return value


def check_keys(
    mapping: Mapping[str, Any],
    where: Where,
    *,
    allowed: Sequence[str],
    required: Sequence[str] = (),
    remedies: Mapping[str, str] | None = None,
) -> None:
    """Rejects unknown keys (with a did-you-mean) and missing required keys.

    Args:
      mapping: the mapping to check.
      where: its location.
      allowed: every key the schema knows.
      required: keys that must be present (and not null).
      remedies: per missing key, what to add; a generic remedy otherwise.

    Raises:
      ClusterError: naming the first unknown or missing key.
    """
    for key in mapping:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise fail(
                where.key(key),
                f"unknown key {key!r}",
                key,
                f"{hint}Allowed keys here: {', '.join(allowed)}",
            )
    for key in required:
        if mapping.get(key) is None:
            remedy = (remedies or {}).get(key, f"add '{key}: ...'")
            raise fail(where.key(key), f"missing required key {key!r}", dict(mapping), remedy)


def _type_name(value: object) -> str:
    return "a string" if isinstance(value, str) else type(value).__name__


def as_float(
    value: object, where: Where, *, what: str, minimum: float = 0.0, allow_minimum: bool = False
) -> float:
    """Returns ``value`` as a finite float greater than ``minimum``.

    Args:
      value: the raw value.
      where: its location.
      what: what the number means, with its unit, for the message ("a bandwidth in GB/s").
      minimum: the bound the number must exceed.
      allow_minimum: accept ``minimum`` itself (">=" instead of ">").

    Raises:
      ClusterError: not a number (a quoted string, a bool, null) or out of range.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        remedy = f"write {what} as a plain number"
        if isinstance(value, str):
            remedy += " without quotes (312e12, 3.12e14 and 312_000 all parse as numbers)"
        raise fail(where, f"expected {what}, got {_type_name(value)}", value, remedy)
    number = float(value)
    low_ok = number >= minimum if allow_minimum else number > minimum
    if not math.isfinite(number) or not low_ok:
        bound = f">= {minimum:g}" if allow_minimum else f"> {minimum:g}"
        raise fail(
            where,
            f"{what} must be a finite number {bound}",
            value,
            f"use a value {bound} (check the unit: {what})",
        )
    return number


def as_int(value: object, where: Where, *, what: str, minimum: int = 1) -> int:
    """Returns ``value`` as an int >= ``minimum``; integral floats (``80e9``) are accepted.

    Raises:
      ClusterError: not a whole number, or below ``minimum``.
    """
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        remedy = f"write {what} as a whole number"
        if isinstance(value, str):
            remedy += " without quotes"
        raise fail(
            where, f"expected {what} (a whole number), got {_type_name(value)}", value, remedy
        )
    if value < minimum:
        raise fail(where, f"{what} must be >= {minimum}", value, f"use a count >= {minimum}")
    return value


def as_str(value: object, where: Where, *, what: str) -> str:
    """Returns ``value`` if it is a non-empty string.

    Raises:
      ClusterError: not a string, or empty.
    """
    if not isinstance(value, str) or not value.strip():
        raise fail(
            where,
            f"expected {what} (a non-empty string), got {_type_name(value)}",
            value,
            f"write {what} as text, e.g. in quotes",
        )
    return value
