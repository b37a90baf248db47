"""Hides shardplan's own frames from the tracebacks of errors raised through its public API.

A user who passes a bad cluster or a step that cannot be planned wants the line of *their*
code that called shardplan and the message, not forty frames of planner internals. JAX solves
the same problem for its own frames (``jax._src.traceback_util``): a function wrapped with
``api_boundary`` re-raises an exception with the frames of excluded directories removed, under
``JAX_TRACEBACK_FILTERING`` (``off`` shows everything; ``auto``, the default, removes them and
adds a note saying so). :func:`api_boundary` here registers shardplan's package directory as
excluded and wraps the function with JAX's boundary.

This is the one place shardplan acts at import (STYLE rule 3): the registration happens when the
first public function is decorated. It cannot wait for the first call, because the wrapper must
be JAX's own function: any shardplan function above the boundary would put a shardplan frame
back into the filtered traceback.

``traceback_util`` is private JAX API (present in jax 0.10 and 0.11): where it is missing,
:func:`api_boundary` returns the function unchanged and tracebacks are simply unfiltered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

__all__ = ["LIBRARY_DIR", "api_boundary"]

F = TypeVar("F", bound=Callable[..., Any])

LIBRARY_DIR: str = str(Path(__file__).resolve().parent)
"""The directory whose frames are hidden: the ``shardplan`` package."""


@functools.cache
def _traceback_util() -> ModuleType | None:
    """JAX's traceback filtering module with shardplan's directory excluded, or None."""
    try:
        from jax._src import traceback_util
    except ImportError:
        return None
    if not (hasattr(traceback_util, "api_boundary")
            and hasattr(traceback_util, "register_exclusion")):
        return None
    traceback_util.register_exclusion(LIBRARY_DIR)
    return traceback_util


def api_boundary(fn: F, /) -> F:
    """Wraps a public entry point so that errors raised below it hide shardplan's frames.

    Args:
      fn: the public function (or a classmethod's function, wrapped before ``classmethod``).

    Returns:
      A function with ``fn``'s signature and docstring; without JAX's traceback filtering,
      ``fn`` itself.
    """
    util = _traceback_util()
    if util is None:
        return fn
    wrapped: F = util.api_boundary(fn)
    return wrapped
