"""The run config's YAML side: reading the file, dotted overrides, and back to plain values.

The sections are built from what the file holds by :func:`shardplan._schema.build` (frozen
dataclasses by their type hints: unknown keys rejected with a did-you-mean naming the key path,
nested dataclasses built, each value checked). :func:`apply_override` sets a dotted override
(``train.steps=200``) in the mapping before it is built, checking each key against the same
schema (:func:`shardplan._schema.mapping_fields`); :func:`plain` turns a built config back into
what ``yaml.safe_dump`` writes.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from shardplan._files import read_text
from shardplan._schema import invalid, mapping_fields, type_name
from shardplan.errors import ConfigError, did_you_mean, format_error

__all__ = ["apply_override", "plain", "read_yaml"]


# --------------------------------------------------------------------------------------------
# dataclasses -> YAML values


def plain(value: Any) -> Any:
    """A dataclass, mapping or tuple as plain dicts and lists (what ``yaml.safe_dump`` takes)."""
    to_dict = getattr(value, "to_dict", None)
    if to_dict is not None and not isinstance(value, type):  # PlanSection: a flat mapping
        return to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------
# overrides and the file


def split_override(text: str) -> tuple[list[str], Any]:
    """``"--train.steps=200"`` -> ``(["train", "steps"], 200)``; the value is YAML."""
    key, sep, raw = text.removeprefix("--").partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise invalid(
            f"The override {text!r} is not `section.key=value`.",
            where=f"override {text}",
            value=text,
            remedy="write e.g. --train.steps=200 or model.overrides.n_layers=4",
        )
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise invalid(
            f"The value of the override {text!r} is not valid YAML: {err}",
            where=f"override {text}",
            value=raw,
            remedy="quote strings: --train.sample_prompt='\"def \"'",
        ) from err
    return key.split("."), value


def apply_override(raw: dict[str, Any], text: str, root: type) -> None:
    """Sets one dotted override in the mapping ``raw``, checking each key against the schema."""
    path, value = split_override(text)
    hint: Any = root
    node = raw
    for depth, key in enumerate(path):
        cls = hint
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            cls = next(a for a in typing.get_args(hint) if a is not type(None))
        if dataclasses.is_dataclass(cls):
            fields = mapping_fields(typing.cast(type, cls))
            if key not in fields:
                where = ".".join(path[: depth + 1])
                raise ConfigError(
                    format_error(
                        f"The override {text!r} names an unknown key {where!r}.",
                        where=f"override {text}",
                        value=key,
                        remedy=f"{did_you_mean(key, list(fields))}keys of "
                        f"{'.'.join(path[:depth]) or 'the file'}: {', '.join(fields)}",
                    )
                )
            hint = fields[key]
        elif typing.get_origin(cls) in (dict, Mapping) or cls is Any:
            hint = Any  # a free mapping (model.overrides, cluster.local.types)
        else:
            raise invalid(
                f"The override {text!r} goes below {'.'.join(path[:depth])!r}, "
                f"which holds a value of type {type_name(cls)}, not keys.",
                where=f"override {text}",
                value=value,
                remedy=f"set --{'.'.join(path[:depth])}=<value>",
            )
        if depth == len(path) - 1:
            node[key] = value
        else:
            if not isinstance(node.get(key), dict):
                node[key] = {}  # absent, or null (`local:` with nothing under it)
            node = node[key]


def read_yaml(path: Path, root: type) -> dict[str, Any]:
    """The mapping in the YAML file ``path`` (empty for an empty file).

    Raises:
      ConfigError: the file cannot be read (naming it), is not YAML (file:line:column), or
        holds no mapping (naming the sections of ``root``).
    """
    text = read_text(path, what="run config", remedy="check the path (configs/train/ has examples)")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = str(path) if mark is None else f"{path}:{mark.line + 1}:{mark.column + 1}"
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(
            format_error(
                f"The run config is not valid YAML: {problem}.",
                where=where,
                remedy="fix the YAML syntax at that line and column",
            )
        ) from err
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise invalid(
            "A run config must be a mapping of sections.",
            where=str(path),
            value=type(data).__name__,
            remedy=f"write sections: {', '.join(mapping_fields(root))}",
        )
    return data
