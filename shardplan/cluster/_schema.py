"""The cluster modules' schema: :mod:`shardplan._schema`'s checks raising
:class:`~shardplan.errors.ClusterError`, and YAML loading that keeps every key's line.

Every check names the file (and line, when the value came from a YAML file), the key path
(``groups[1].nodes``), the offending value and a remedy. The helpers here know nothing about
devices or clusters; they only know where a value came from (:class:`~shardplan._schema.Where`).
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import yaml

from shardplan import _schema
from shardplan._files import read_text
from shardplan._schema import Where
from shardplan.errors import ClusterError

__all__ = [
    "as_float",
    "as_int",
    "as_mapping",
    "as_str",
    "check_keys",
    "fail",
    "load_yaml",
    "short_float",
]


class _Loader(yaml.SafeLoader):
    """A ``SafeLoader`` that also reads YAML 1.2 floats such as ``312e12`` as numbers.

    PyYAML implements YAML 1.1, where a float needs a dot and a signed exponent
    (``3.12e+14``); ``312e12`` would silently become the *string* ``"312e12"``. Hardware figures
    are written in exactly that form, so shardplan's files accept it. Quoted values stay strings.
    """


_YAML12_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))


def fail(where: Where | str, what: str, value: object, remedy: str) -> ClusterError:
    """Builds (does not raise) a :class:`ClusterError` for ``value`` at ``where``.

    Args:
      where: the location; a plain string for values that did not come from a mapping.
      what: one sentence saying what is wrong.
      value: the offending value, always shown (also when it is None; a long one cut).
      remedy: what the user should change.

    Returns:
      The error, for the caller to ``raise`` (so the traceback points at the check).
    """
    return ClusterError(_schema.error_text(what, where=where, value=value, remedy=remedy, cut=True))


# The toolkit's typed getters, raising ClusterError.
as_mapping = functools.partial(_schema.as_mapping, error=ClusterError)
check_keys = functools.partial(_schema.check_keys, error=ClusterError)
as_float = functools.partial(_schema.as_float, error=ClusterError)
as_int = functools.partial(_schema.as_int, error=ClusterError)
as_str = functools.partial(_schema.as_str, error=ClusterError)


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
