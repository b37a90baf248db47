"""A small typed loader: YAML values -> frozen dataclasses, by their type hints.

One mechanism for every section of a run config: :func:`build` walks ``dataclasses.fields``
with ``typing.get_type_hints``, rejects unknown keys with a did-you-mean naming the key path,
builds nested dataclasses, and checks each value (:func:`convert`; an int is taken for a float,
a list for a tuple, a YAML 1.1 string such as ``3e-4`` for a float). A class with a
``from_dict(mapping, *, where=...)`` classmethod (``DataConfig``, ``PlanConfig``) builds
itself; one with a ``yaml_fields()`` classmethod names its own keys. :func:`apply_override`
sets a dotted override (``train.steps=200``) in the mapping before it is built.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from shardplan._files import read_text
from shardplan.errors import ConfigError, did_you_mean, format_error, unknown_key
from shardplan.planner.config import conform

__all__ = [
    "apply_override",
    "build",
    "check_fields",
    "convert",
    "fail",
    "is_int",
    "join_key",
    "plain",
    "read_yaml",
    "require",
    "unknown_key",
    "yaml_fields",
]


# --------------------------------------------------------------------------------------------
# checks and messages


def fail(what: str, where: str, value: object, remedy: str) -> ConfigError:
    """A ConfigError (:func:`~shardplan.errors.format_error`) showing ``value`` even if None."""
    return ConfigError(format_error(what, where=where, value=value, has_value=True, remedy=remedy))


def require(ok: bool, where: str, value: object, want: str) -> None:
    """Raises a ConfigError naming ``where`` and ``value`` unless ``ok``."""
    if not ok:
        raise fail(f"{where} must be {want}.", where, value, f"give {want}")


def is_int(value: object) -> bool:
    """Whether ``value`` is an int and not a bool (YAML's ``true`` is a Python int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_fields(section: Any, where: str) -> None:
    """Checks every field of ``section`` against its type hint (naming ``where.field``) and
    stores it as the field holds it: ints as floats, lists as tuples, mappings as sections."""
    hints = typing.get_type_hints(type(section))
    for field in dataclasses.fields(section):
        value = convert(
            getattr(section, field.name), hints[field.name], join_key(where, field.name)
        )
        object.__setattr__(section, field.name, value)


# --------------------------------------------------------------------------------------------
# YAML values <-> dataclasses, by their type hints


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


def yaml_fields(cls: type) -> dict[str, Any]:
    """The YAML keys of a section class and their types."""
    if hasattr(cls, "yaml_fields"):
        fields: dict[str, Any] = cls.yaml_fields()
        return fields
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def type_name(hint: Any) -> str:
    """``int``, ``str | None``: a type hint as a message shows it."""
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def join_key(where: str, key: object) -> str:
    """The key path of ``key`` under ``where`` (``""`` is the file's top level)."""
    return f"{where}.{key}" if where else str(key)


def parse_floats(mapping: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """Parses float fields that YAML 1.1 read as strings (``3e-4`` has no dot)."""
    out = dict(mapping)
    for key, value in mapping.items():
        hint = fields.get(key)
        wants_float = hint is float or float in typing.get_args(hint)
        if wants_float and isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                continue  # the type check reports it, naming the key
            if math.isfinite(number):
                out[key] = number
    return out


def build(cls: type, value: Any, where: str) -> Any:
    """Builds the dataclass ``cls`` from a YAML mapping, checking every key and value."""
    if not isinstance(value, Mapping):
        raise fail(
            f"`{where}` must be a mapping of keys to values.",
            where,
            type(value).__name__,
            f"write `{where}:` followed by indented `key: value` lines, or `{{}}` for the defaults",
        )
    fields = yaml_fields(cls)
    for key in value:
        if key not in fields:
            raise unknown_key(key, list(fields), join_key(where, key))
    value = parse_floats(value, fields)
    if hasattr(cls, "from_dict"):  # DataConfig, PlanConfig, PlanSection check their own values
        return cls.from_dict(value, where=where)
    kwargs = {key: convert(v, fields[key], join_key(where, key)) for key, v in value.items()}
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise fail(
            f"`{where}` is missing the key {missing[0]!r}."
            if where
            else f"The run config is missing the section {missing[0]!r}.",
            join_key(where, missing[0]),
            None,
            f"add `{missing[0]}: ...`" + (f" under `{where}:`" if where else ""),
        )
    return cls(**kwargs)


def convert(value: Any, hint: Any, where: str) -> Any:
    """``value`` as the type ``hint`` (sections built, lists as tuples, ints as floats)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return convert(value, options[0], where)
    elif dataclasses.is_dataclass(hint):
        if isinstance(value, typing.cast(type, hint)):
            return value
        return build(typing.cast(type, hint), value, where)
    elif origin in (dict, Mapping) and len(args) == 2:
        if not isinstance(value, Mapping):
            raise fail(f"{where} must be a mapping.", where, value, "write `key: value` lines")
        return {
            convert(k, args[0], where): convert(v, args[1], join_key(where, k))
            for k, v in value.items()
        }
    if hint is Any:
        return value
    ok, out = conform(value, hint)
    if not ok:
        raise fail(
            f"{where} must be of type {type_name(hint)}, not {type(value).__name__}.",
            where,
            value,
            f"give a value of type {type_name(hint)} (YAML: quote strings, write numbers bare)",
        )
    return out


# --------------------------------------------------------------------------------------------
# overrides and the file


def split_override(text: str) -> tuple[list[str], Any]:
    """``"--train.steps=200"`` -> ``(["train", "steps"], 200)``; the value is YAML."""
    key, sep, raw = text.removeprefix("--").partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise fail(
            f"The override {text!r} is not `section.key=value`.",
            f"override {text}",
            text,
            "write e.g. --train.steps=200 or model.overrides.n_layers=4",
        )
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise fail(
            f"The value of the override {text!r} is not valid YAML: {err}",
            f"override {text}",
            raw,
            "quote strings: --train.sample_prompt='\"def \"'",
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
            fields = yaml_fields(typing.cast(type, cls))
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
            raise fail(
                f"The override {text!r} goes below {'.'.join(path[:depth])!r}, "
                f"which holds a value of type {type_name(cls)}, not keys.",
                f"override {text}",
                value,
                f"set --{'.'.join(path[:depth])}=<value>",
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
        raise fail(
            "A run config must be a mapping of sections.",
            str(path),
            type(data).__name__,
            f"write sections: {', '.join(yaml_fields(root))}",
        )
    return data
