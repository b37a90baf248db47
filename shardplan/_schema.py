"""The schema toolkit every config and file reader shares: frozen mappings, typed field checks,
unknown keys with a did-you-mean, and frozen dataclasses built from mappings.

It sits below every stage (the standard library, :mod:`shardplan.errors` and nothing else), so
the cluster parser, the plan file, the planner's, data's and the run's configs check values the
same way. The wording of a message stays with its caller: each check takes what it names, its
error class and, where two callers phrase one check differently, the phrasing.

One module over the ~600-line guide on purpose: its four parts (frozen mappings, locations
and messages, typed checks, dataclasses from mappings) call each other, and a third of its
lines are the docstrings every reader of a config relies on.

Example:
    >>> FrozenMap({"blocks/10": 1, "blocks/2": 2})
    FrozenMap({'blocks/2': 2, 'blocks/10': 1})
    >>> import dataclasses
    >>> @dataclasses.dataclass(frozen=True)
    ... class Opts:
    ...     steps: int = 10
    ...     rate: float = 0.5
    >>> build(Opts, {"steps": 3, "rate": 1}, "opts")
    Opts(steps=3, rate=1.0)
    >>> try:
    ...     build(Opts, {"stepz": 3}, "opts")
    ... except ConfigError as err:
    ...     print(err)
    Unknown key 'stepz'.
      where: opts.stepz
      value: 'stepz'
      fix:   did you mean 'steps'? keys here: steps, rate
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any, Literal, TypeGuard, TypeVar

from shardplan.errors import (
    ConfigError,
    ShardplanError,
    ShardplanWarning,
    did_you_mean,
    format_error,
    unknown_key,
)

__all__ = ["FrozenMap", "Where", "as_float", "as_int", "as_mapping", "as_str", "build",
           "check_choice", "check_fields", "check_keys", "conform", "convert", "error_text",
           "field_names", "field_types", "invalid", "is_int", "is_number", "join_key",
           "mapping_fields", "natural_key", "options_from_mapping", "reject_unknown_kwargs",
           "require", "type_name", "warn"]

# --------------------------------------------------------------------------------------------
# frozen mappings

_K = TypeVar("_K", str, int)
_V = TypeVar("_V")


def natural_key(key: str | int) -> tuple[Any, ...]:
    """Sort key that orders digit runs by value: ``blocks/2`` before ``blocks/10``.

    Example:
        >>> sorted(["b/10", "b/2", "a"], key=natural_key)
        ['a', 'b/2', 'b/10']
    """
    if isinstance(key, int):
        return (0, key)
    parts = re.split(r"(\d+)", key)
    # Digit runs compare by value, then by text ("01" vs "1") so distinct keys never tie.
    return (1, tuple((0, int(p), p) if i % 2 else (1, 0, p) for i, p in enumerate(parts)))


class FrozenMap(Mapping[_K, _V]):
    """An immutable, hashable, picklable mapping, so that the values holding one stay values.

    Its keys iterate in :func:`natural_key` order, so that equal maps iterate (and serialise)
    alike; ``sort=False`` keeps the order given instead (a device file's dtypes, as written).
    Equality and the hash ignore the order.

    Example:
        >>> m = FrozenMap({"b": 1, "a": 2})
        >>> list(m), m == {"a": 2, "b": 1}, hash(m) == hash(FrozenMap({"a": 2, "b": 1}))
        (['a', 'b'], True, True)
        >>> list(FrozenMap({"fp32": 1, "bf16": 2}, sort=False))
        ['fp32', 'bf16']
    """

    __slots__ = ("_hash", "_items")

    def __init__(self, items: Mapping[_K, _V] | Iterable[tuple[_K, _V]] = (), /, *,
                 sort: bool = True) -> None:
        pairs = dict(items)
        if sort:
            pairs = dict(sorted(pairs.items(), key=lambda kv: natural_key(kv[0])))
        self._items: dict[_K, _V] = pairs
        self._hash: int | None = None

    def __getitem__(self, key: _K) -> _V:
        return self._items[key]

    def __iter__(self) -> Iterator[_K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._items.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._items == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMap({self._items!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle, (self._items,))


def _unpickle(items: dict[Any, Any]) -> FrozenMap[Any, Any]:
    """A pickled :class:`FrozenMap`: its items are in their order already."""
    return FrozenMap(items, sort=False)


# --------------------------------------------------------------------------------------------
# locations and messages

_MAX_VALUE_REPR = 160
"""Longest ``repr`` of an offending value shown by a ``cut`` message; longer ones are cut."""


@dataclasses.dataclass(frozen=True, eq=False)
class Where:
    """Where a value came from: an optional file, a key path inside it, and the file's lines.

    Attributes:
      file: the YAML file the value was read from, or None for a dict given in Python.
      path: the key path, e.g. ``groups[1].intra_node.latency_us``; empty for the top level.
      lines: key path -> 1-based line number, for values read from a YAML file.

    Example:
        >>> str(Where("c.yaml", "", {"groups": 3}).key("groups").index(1).key("nodes"))
        'groups[1].nodes (c.yaml, line 3)'
    """

    file: str | None = None
    path: str = ""
    lines: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def key(self, name: str) -> Where:
        """Returns the location of key ``name`` inside this mapping."""
        return dataclasses.replace(self, path=join_key(self.path, name))

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


def join_key(where: str, key: object) -> str:
    """The key path of ``key`` under ``where`` (``""`` is the top level)."""
    return f"{where}.{key}" if where else str(key)


class _Shown:
    """Shows a pre-formatted value in :func:`format_error` without quoting it again."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _cut(value: object) -> _Shown:
    text = repr(value)
    if len(text) > _MAX_VALUE_REPR:
        text = text[: _MAX_VALUE_REPR - 5] + " ...)"
    return _Shown(text)


def error_text(what: str, *, where: Where | str, value: object, remedy: str,
               show_none: bool = True, cut: bool = False) -> str:
    """An error message (:func:`~shardplan.errors.format_error`): what, where, value, fix.

    Args:
      what: one sentence saying what is wrong.
      where: the key path (or a :class:`Where`).
      value: the offending value.
      remedy: what the user should change.
      show_none: show ``value`` also when it is None.
      cut: cut a ``repr`` longer than 160 characters (values read from files may be huge).
    """
    shown = _cut(value) if cut else value
    return format_error(what, where=str(where), value=shown, remedy=remedy, has_value=show_none)


def invalid(what: str, /, *, where: Where | str, value: object = None, remedy: str,
            error: type[ShardplanError] = ConfigError, show_none: bool = True,
            cut: bool = False) -> ShardplanError:
    """Builds (does not raise) an ``error`` with :func:`error_text`'s message.

    Example:
        >>> print(invalid("Expected an integer >= 1.", where="plan.chunks", value=None,
        ...               remedy="write a whole number >= 1"))
        Expected an integer >= 1.
          where: plan.chunks
          value: None
          fix:   write a whole number >= 1
    """
    return error(error_text(what, where=where, value=value, remedy=remedy, show_none=show_none,
                            cut=cut))


def require(ok: bool, where: str, value: object, want: str, /, *, subject: str | None = None,
            verb: str = "give", show_none: bool = True,
            error: type[ShardplanError] = ConfigError) -> None:
    """Raises ``"<subject> must be <want>."`` (fix: ``"<verb> <want>"``) unless ``ok``.

    Args:
      ok: whether the value passed its check.
      where: the key path; also the subject unless ``subject`` is given.
      value: the value checked.
      want: what the value must be ("an integer >= 1").
      subject: how the sentence names the value (``"DataConfig.seq_len"``).
      verb: the remedy's verb ("give", "pass").
      show_none: show ``value`` also when it is None.
      error: the error class.
    """
    if not ok:
        raise invalid(f"{where if subject is None else subject} must be {want}.", where=where,
                      value=value, remedy=f"{verb} {want}", error=error, show_none=show_none)


_SKIPPED_MODULES = ("shardplan", "jax._src.traceback_util")
"""Modules whose frames a warning is not attributed to: shardplan's own, and the wrapper of its
public entry points (``shardplan/_traceback.py``); the first other frame is the user's call."""


def _skipped(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in _SKIPPED_MODULES)


def warn(where: Where | str, what: str, value: object, remedy: str) -> None:
    """Issues a :class:`ShardplanWarning` laid out like an error (values cut as from a file).

    The warning is attributed to the first caller outside the ``shardplan`` package, so that
    ``python -W`` and pytest show the user's line (``Cluster.from_yaml(...)``), whatever the
    depth of the parser below it.
    """
    level = 2  # stacklevel 2: warn's caller
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and _skipped(str(frame.f_globals.get("__name__", ""))):
        frame, level = frame.f_back, level + 1
    warnings.warn(
        error_text(what, where=where, value=value, remedy=remedy, cut=True),
        ShardplanWarning,
        stacklevel=level,
    )


# --------------------------------------------------------------------------------------------
# typed field checks


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int and not a bool (YAML's ``true`` is a Python int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[float]:
    """Whether ``value`` is an int or a float and not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _kind(value: object) -> str:
    return "a string" if isinstance(value, str) else type(value).__name__


def as_mapping(value: object, where: Where, *, what: str,
               error: type[ShardplanError] = ConfigError) -> Mapping[str, Any]:
    """Returns ``value`` if it is a mapping with string keys, else raises ``error``."""
    if not isinstance(value, Mapping):
        raise invalid(f"expected {what} (a mapping of key: value), got {type(value).__name__}",
                      where=where, value=value, error=error, cut=True,
                      remedy=f"write {what} as 'key: value' lines or a {{...}} dict")
    for key in value:
        if not isinstance(key, str):
            raise invalid(f"keys must be strings, got {type(key).__name__}",
                          where=where.key(str(key)), value=key, error=error, cut=True,
                          remedy="quote the key or fix the indentation")
    return value


def check_keys(mapping: Mapping[str, Any], where: Where, *, allowed: Sequence[str],
               required: Sequence[str] = (), remedies: Mapping[str, str] | None = None,
               error: type[ShardplanError] = ConfigError) -> None:
    """Rejects unknown keys (with a did-you-mean) and missing required keys.

    Args:
      mapping: the mapping to check.
      where: its location.
      allowed: every key the schema knows.
      required: keys that must be present (and not null).
      remedies: per missing key, what to add; a generic remedy otherwise.
      error: the error class.

    Raises:
      ShardplanError: (``error``) naming the first unknown or missing key.
    """
    for key in mapping:
        if key not in allowed:
            raise invalid(f"unknown key {key!r}", where=where.key(key), value=key, error=error,
                          cut=True, remedy=f"{did_you_mean(key, allowed)}Allowed keys here: "
                                           f"{', '.join(allowed)}")
    for key in required:
        if mapping.get(key) is None:
            remedy = (remedies or {}).get(key, f"add '{key}: ...'")
            raise invalid(f"missing required key {key!r}", where=where.key(key),
                          value=dict(mapping), remedy=remedy, error=error, cut=True)


def as_float(value: object, where: Where, *, what: str, minimum: float = 0.0,
             allow_minimum: bool = False, error: type[ShardplanError] = ConfigError) -> float:
    """Returns ``value`` as a finite float greater than ``minimum``.

    Args:
      value: the raw value.
      where: its location.
      what: what the number means, with its unit, for the message ("a bandwidth in GB/s").
      minimum: the bound the number must exceed.
      allow_minimum: accept ``minimum`` itself (">=" instead of ">").
      error: the error class.

    Raises:
      ShardplanError: (``error``) not a number (a quoted string, a bool, null) or out of range.
    """
    if not is_number(value):
        remedy = f"write {what} as a plain number"
        if isinstance(value, str):
            remedy += " without quotes (312e12, 3.12e14 and 312_000 all parse as numbers)"
        raise invalid(f"expected {what}, got {_kind(value)}", where=where, value=value,
                      remedy=remedy, error=error, cut=True)
    number = float(value)
    low_ok = number >= minimum if allow_minimum else number > minimum
    if not math.isfinite(number) or not low_ok:
        bound = f">= {minimum:g}" if allow_minimum else f"> {minimum:g}"
        raise invalid(f"{what} must be a finite number {bound}", where=where, value=value,
                      remedy=f"use a value {bound} (check the unit: {what})", error=error,
                      cut=True)
    return number


def as_int(value: object, where: Where, *, what: str, minimum: int = 1,
           error: type[ShardplanError] = ConfigError) -> int:
    """Returns ``value`` as an int >= ``minimum``; integral floats (``80e9``) are accepted.

    Raises:
      ShardplanError: (``error``) not a whole number, or below ``minimum``.
    """
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not is_int(value):
        remedy = f"write {what} as a whole number"
        if isinstance(value, str):
            remedy += " without quotes"
        raise invalid(f"expected {what} (a whole number), got {_kind(value)}", where=where,
                      value=value, remedy=remedy, error=error, cut=True)
    if value < minimum:
        raise invalid(f"{what} must be >= {minimum}", where=where, value=value,
                      remedy=f"use a count >= {minimum}", error=error, cut=True)
    return value


def as_str(value: object, where: Where, *, what: str,
           error: type[ShardplanError] = ConfigError) -> str:
    """Returns ``value`` if it is a non-empty string.

    Raises:
      ShardplanError: (``error``) not a string, or empty.
    """
    if not isinstance(value, str) or not value.strip():
        raise invalid(f"expected {what} (a non-empty string), got {_kind(value)}", where=where,
                      value=value, remedy=f"write {what} as text, e.g. in quotes", error=error,
                      cut=True)
    return value


def _lowered(value: object) -> str | None:
    return value.lower() if isinstance(value, str) else None


def check_choice(value: object, choices: Sequence[str], /, *, where: str, what: str,
                 label: str = "one of", match: Callable[[object], str | None] = _lowered,
                 error: type[ShardplanError] = ConfigError) -> str:
    """``value`` if it is one of ``choices``; else an error with a did-you-mean.

    Args:
      value: the value.
      choices: the allowed strings.
      where: the key path.
      what: what the value is ("remat policy"): the message says ``Unknown <what> <value>.``
      label: how the remedy introduces the choices ("one of", "sources").
      match: the text of ``value`` the did-you-mean looks for among ``choices`` (None: no
        suggestion); by default a string in lower case.
      error: the error class.

    Example:
        >>> try:
        ...     check_choice("Gpipe", ("gpipe", "1f1b"), where="plan.schedule", what="schedule")
        ... except ConfigError as err:
        ...     print(str(err).splitlines()[-1])
          fix:   did you mean 'gpipe'? one of: gpipe, 1f1b
    """
    if not isinstance(value, str) or value not in choices:
        text = match(value)
        hint = did_you_mean(text, choices) if text is not None else ""
        raise invalid(f"Unknown {what} {value!r}.", where=where, value=value,
                      remedy=f"{hint}{label}: {', '.join(choices)}", error=error)
    return value


# --------------------------------------------------------------------------------------------
# frozen dataclasses from mappings


@functools.cache
def field_names(cls: type, /) -> tuple[str, ...]:
    """The field names of the dataclass ``cls``, in order."""
    return tuple(f.name for f in dataclasses.fields(cls))


def field_types(cls: type, /) -> dict[str, Any]:
    """The fields of the dataclass ``cls`` and their (resolved) type hints, in order."""
    hints = typing.get_type_hints(cls)
    return {name: hints[name] for name in field_names(cls)}


def mapping_fields(cls: type, /) -> dict[str, Any]:
    """The keys of a mapping that :func:`build` makes a ``cls`` of, and their types: what the
    class's ``mapping_fields()`` classmethod says, if it has one, else its fields."""
    if hasattr(cls, "mapping_fields"):
        fields: dict[str, Any] = cls.mapping_fields()
        return fields
    return field_types(cls)


def type_name(hint: Any) -> str:
    """``int``, ``str | None``: a type hint as a message shows it."""
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def reject_unknown_kwargs(cls: type, kwargs: Mapping[str, Any], /) -> None:
    """Raises a ConfigError with a did-you-mean for a keyword that is no field of ``cls``
    (a config class's ``__new__`` calls it: ``__init__`` would raise a bare TypeError)."""
    for key in kwargs:
        if key not in field_names(cls):
            raise unknown_key(key, field_names(cls), f"{cls.__name__}({key}=...)",
                              owner=cls.__name__)


def options_from_mapping(cls: type, mapping: object, /, *, where: str, noun: str,
                         typed: bool = True) -> dict[str, Any]:
    """The options in ``mapping`` for the config class ``cls`` (e.g. a YAML file's section).

    Args:
      cls: the config dataclass (``PlanConfig``); messages name it.
      mapping: field name -> value.
      where: how messages name the mapping (``"plan.yaml: config"``).
      noun: what the mapping is, for a value that is not one ("plan config").
      typed: check each value against its field's type (:func:`conform`; lists taken for
        tuples, ints for floats); else return the values as given.

    Raises:
      ConfigError: ``mapping`` is not a mapping, a key is no field of ``cls`` (with a
        did-you-mean), or (``typed``) a value is not of its field's type; for each key in
        turn.
    """
    names = field_names(cls)
    if not isinstance(mapping, Mapping):
        raise invalid(f"A {noun} must be a mapping of option names to values.", where=where,
                      value=type(mapping).__name__, remedy=f"options: {', '.join(names)}")
    hints = field_types(cls) if typed else {}
    values = {}
    for key, value in mapping.items():
        if key not in names:
            raise unknown_key(str(key), names, f"{where}.{key}", owner=cls.__name__)
        ok, values[key] = conform(value, hints[key]) if typed else (True, value)
        if not ok:
            want = type_name(hints[key])
            raise invalid(f"{cls.__name__} option {key!r} must be of type {want}.",
                          where=f"{where}.{key}", value=value,
                          remedy=f"give a {want} (see the {cls.__name__} docstring)")
    return values


def conform(value: Any, hint: Any, /) -> tuple[bool, Any]:
    """Whether ``value`` is of type ``hint`` (lists taken for tuples), and the value as the
    field holds it (tuples for lists, floats for ints).

    Example:
        >>> conform([1, 2], tuple[float, ...]), conform(True, int)
        ((True, (1.0, 2.0)), (False, True))
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            ok, out = conform(value, option)
            if ok:
                return True, out
        return False, value
    if origin is Literal:
        return value in args and not isinstance(value, bool), value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            return False, value
        items = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        if len(items) != len(value):
            return False, value
        out = [conform(v, h) for v, h in zip(value, items, strict=True)]
        return all(ok for ok, _ in out), tuple(v for _, v in out)
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return is_int(value), value
    if hint is float:
        ok = is_number(value)
        return ok, float(value) if ok else value
    if hint is str:
        return isinstance(value, str), value
    return True, value  # a type this checker does not know: __post_init__ checks the value


def _floats_from_text(mapping: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """Parses float fields given as strings (YAML 1.1 reads ``3e-4``, without a dot, as one)."""
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
    """Builds the dataclass ``cls`` from a mapping, checking every key and value.

    Unknown keys are refused with a did-you-mean naming the key path; a float field takes a
    string that reads as a finite float; each value is :func:`convert`-ed to its field's
    type (nested dataclasses built in turn); a field without a default must be given. A class
    with a ``from_dict(mapping, *, where=...)`` classmethod builds itself from the checked
    keys; one with a ``mapping_fields()`` classmethod names its own keys.

    Raises:
      ConfigError: naming the key path (``train.steps``; ``where`` ``""`` is the top level).
    """
    if not isinstance(value, Mapping):
        raise invalid(
            f"`{where}` must be a mapping of keys to values.", where=where,
            value=type(value).__name__,
            remedy=f"write `{where}:` followed by indented `key: value` lines, or `{{}}` for "
                   "the defaults")
    fields = mapping_fields(cls)
    for key in value:
        if key not in fields:
            raise unknown_key(key, list(fields), join_key(where, key))
    value = _floats_from_text(value, fields)
    if hasattr(cls, "from_dict"):  # DataConfig, PlanConfig, PlanSection check their own values
        return cls.from_dict(value, where=where)
    kwargs = {key: convert(v, fields[key], join_key(where, key)) for key, v in value.items()}
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in kwargs
               and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise invalid(
            f"`{where}` is missing the key {missing[0]!r}." if where
            else f"The run config is missing the section {missing[0]!r}.",
            where=join_key(where, missing[0]), value=None,
            remedy=f"add `{missing[0]}: ...`" + (f" under `{where}:`" if where else ""))
    return cls(**kwargs)


def convert(value: Any, hint: Any, where: str) -> Any:
    """``value`` as the type ``hint`` (dataclasses built, lists as tuples, ints as floats).

    Raises:
      ConfigError: ``value`` is not of type ``hint`` (naming ``where``, the value and both
        types).
    """
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
            raise invalid(f"{where} must be a mapping.", where=where, value=value,
                          remedy="write `key: value` lines")
        return {convert(k, args[0], where): convert(v, args[1], join_key(where, k))
                for k, v in value.items()}
    if hint is Any:
        return value
    ok, out = conform(value, hint)
    if not ok:
        raise invalid(
            f"{where} must be of type {type_name(hint)}, not {type(value).__name__}.",
            where=where, value=value,
            remedy=f"give a value of type {type_name(hint)} (YAML: quote strings, write numbers "
                   "bare)")
    return out


def check_fields(section: Any, where: str) -> None:
    """Checks every field of the dataclass ``section`` against its type hint (naming
    ``where.field``) and stores it as the field holds it: ints as floats, lists as tuples,
    mappings as dataclasses (a frozen dataclass's ``__post_init__`` calls it)."""
    for name, hint in field_types(type(section)).items():
        value = convert(getattr(section, name), hint, join_key(where, name))
        object.__setattr__(section, name, value)
