"""The error hierarchy every shardplan failure is reported through.

Each error names *what* is wrong (field, key path, equation, mesh), *where* (file, source line),
and *how to fix it*. Build messages with :func:`format_error` so they read the same everywhere.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "CheckpointError",
    "ClusterError",
    "ConfigError",
    "DataError",
    "InfeasibleError",
    "PipelineError",
    "PlanMismatchError",
    "RuntimeFailure",
    "ShardplanError",
    "ShardplanWarning",
    "SolverError",
    "TraceError",
    "did_you_mean",
    "format_error",
    "unknown_key",
]


def format_error(what: str, *, where: str | None = None, value: object = None,
                 remedy: str | None = None, has_value: bool = False) -> str:
    """Formats an error message as ``what`` + location + offending value + remedy.

    Args:
      what: one sentence saying what is wrong.
      where: the field, key path, file or equation the problem is in.
      value: the offending value (shown with ``repr``) when ``has_value`` is true or it is not None.
      remedy: what the user should change.
      has_value: show ``value`` even when it is None.

    Returns:
      A multi-line message.
    """
    lines = [what]
    if where is not None:
        lines.append(f"  where: {where}")
    if has_value or value is not None:
        lines.append(f"  value: {value!r}")
    if remedy is not None:
        lines.append(f"  fix:   {remedy}")
    return "\n".join(lines)


def did_you_mean(word: str, choices: Iterable[str], *, n: int = 1, cutoff: float = 0.6) -> str:
    """``"did you mean 'x'? "`` for the choice closest to ``word`` (``difflib``), else ``""``.

    Args:
      word: what the user wrote.
      choices: what they may write.
      n: suggest up to this many choices, closest first (``"did you mean 'x' or 'y'? "``).
      cutoff: how close a choice must be (``difflib.get_close_matches``' ratio, 0 to 1).

    Example:
      >>> did_you_mean("time_limit", ["time_limit_s", "max_stages"])
      "did you mean 'time_limit_s'? "
    """
    close = difflib.get_close_matches(word, list(choices), n=n, cutoff=cutoff)
    return f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""


def unknown_key(key: object, known: Iterable[str], where: str, *,
                owner: str = "") -> ConfigError:
    """The error for an unknown ``key`` at ``where``, with a did-you-mean among ``known``.

    Example:
      >>> print(unknown_key("time_limit", ["time_limit_s"], "PlanConfig(time_limit=...)",
      ...                   owner="PlanConfig"))
      PlanConfig has no option 'time_limit'.
        where: PlanConfig(time_limit=...)
        value: 'time_limit'
        fix:   did you mean 'time_limit_s'? options: time_limit_s
    """
    known = list(known)
    what = f"{owner} has no option {key!r}." if owner else f"Unknown key {key!r}."
    label = "options" if owner else "keys here"
    return ConfigError(format_error(
        what, where=where, value=key,
        remedy=f"{did_you_mean(str(key), known)}{label}: {', '.join(known)}"))


class ShardplanError(Exception):
    """Base class of every error shardplan raises on purpose."""


class ConfigError(ShardplanError, ValueError):
    """A configuration file, key or value is invalid."""


class ClusterError(ConfigError):
    """A cluster description (YAML, dict or local devices) is invalid."""


class TraceError(ShardplanError):
    """A function could not be traced into an op graph."""


class InfeasibleError(ShardplanError):
    """No plan satisfies the constraints (memory, divisibility, device counts)."""


class SolverError(ShardplanError):
    """The solver failed or returned an error status."""


class PlanMismatchError(ShardplanError):
    """A plan does not belong to the graph, cluster or state it is applied to."""


class PipelineError(ShardplanError):
    """A train step cannot be partitioned into pipeline stages."""


class CheckpointError(ShardplanError):
    """A checkpoint is missing, corrupt, or belongs to another model."""


class DataError(ShardplanError):
    """Training data is missing or unusable."""


class RuntimeFailure(ShardplanError):
    """A run failed while executing (lost process, NaN loss, ...)."""


class ShardplanWarning(UserWarning):
    """Base class of shardplan's own warnings (tests turn them into errors)."""
