"""The user's own step for ``shardplan trace`` / ``shardplan plan``: ``path/to/file.py:factory``
or ``package.module:factory``, a callable with no arguments that returns
``(train_step, state, batch)``."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from shardplan.errors import ConfigError, did_you_mean, format_error

__all__ = ["STEP_SHAPE", "is_step_target", "load_step"]

STEP_SHAPE = "(train_step, state, batch)"
"""What a step factory returns: ``train_step(state, batch) -> (state, metrics)`` and its
arguments (pytrees of arrays or ``jax.ShapeDtypeStruct``\\ s)."""


def is_step_target(target: str, /) -> bool:
    """Whether ``target`` names a step factory (``...:factory``) rather than a model preset or
    YAML file (which never hold a colon)."""
    return ":" in target


def load_step(target: str, /) -> tuple[Callable[..., Any], Any, Any]:
    """Imports a step factory and calls it.

    Args:
      target: ``path/to/file.py:factory`` (a file, imported with its directory on
        ``sys.path``) or ``package.module:factory`` (imported with the current directory on
        ``sys.path``, as ``python -m`` would). The factory takes no arguments (or only ones
        with defaults) and returns ``(train_step, state, batch)``; state and batch may hold
        arrays or ``jax.ShapeDtypeStruct``\\ s.

    Returns:
      ``(train_step, state, batch)``.

    Raises:
      ConfigError: a malformed target, a file that does not exist, a module that cannot be
        imported (with the import's own message), no such factory (with a did-you-mean among
        the module's callables), a factory that needs arguments or raises, or one that
        returns anything but a 3-tuple whose first item is callable (saying what it
        returned).

    Example:
      >>> train_step, state, batch = load_step("models/example_step.py:make_step")
    """
    source, _, name = target.rpartition(":")
    if not source or not name.isidentifier():
        raise ConfigError(format_error(
            "A step is named as `path/to/file.py:factory` or `package.module:factory`.",
            where="the model argument", value=target,
            remedy="give the file or module, a colon and the factory's name, e.g. "
                   "models/example_step.py:make_step"))
    is_file = source.endswith(".py") or "/" in source or "\\" in source
    path = Path(source)
    if is_file and not path.is_file():
        raise ConfigError(format_error(
            "The step's file does not exist." if not path.exists()
            else "The step's file is not a file.",
            where=target if path.is_absolute() else f"{target} (relative to {Path.cwd()})",
            value=source,
            remedy="check the path; a module on sys.path is named with dots and no .py "
                   "(package.module:factory)"))
    with _on_sys_path(path.resolve().parent if is_file else Path.cwd()):
        module = _import_file(path, target) if is_file else _import_module(source, target)
        factory = _factory(module, name, target)
        try:
            made = factory()
        except Exception as e:
            raise ConfigError(format_error(
                f"The factory {name!r} raised {type(e).__name__}: {e}",
                where=_raised_at(e, getattr(module, "__file__", None)), value=target,
                remedy=f"fix the factory so that {name}() returns {STEP_SHAPE}")) from e
    if not isinstance(made, tuple | list) or len(made) != 3 or not callable(made[0]):
        raise ConfigError(format_error(
            f"The factory {name!r} returned {_describe(made)}, not {STEP_SHAPE}.",
            where=target, value=_describe(made, short=True),
            remedy=f"return a 3-tuple {STEP_SHAPE}: train_step(state, batch) -> "
                   "(state, metrics), state and batch pytrees of arrays or "
                   "jax.ShapeDtypeStruct"))
    train_step, state, batch = made
    return train_step, state, batch


@contextlib.contextmanager
def _on_sys_path(directory: Path) -> Iterator[None]:
    """``directory`` first on ``sys.path`` while the step is imported and built (as ``python
    file.py`` or ``python -m`` would put it there)."""
    entry = str(directory)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        sys.path.remove(entry)


def _import_file(path: Path, target: str) -> Any:
    """Imports ``path`` as a module of its own name (another name if that one is taken by a
    different module), registered in ``sys.modules`` so that dataclasses and pickling work."""
    import importlib.util

    resolved = path.resolve()
    name = path.stem if path.stem.isidentifier() else "step_module"
    taken = sys.modules.get(name)
    if taken is not None and Path(getattr(taken, "__file__", "") or "").resolve() != resolved:
        name = f"{name}__{abs(hash(str(resolved))):x}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ConfigError(format_error(
            "The step's file cannot be imported as a Python module.", where=target,
            value=str(path), remedy="give a .py file"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise _import_failed(f"Importing {str(path)!r} failed", e, str(resolved), target) from e
    return module


def _import_module(source: str, target: str) -> Any:
    import importlib

    try:
        return importlib.import_module(source)
    except ModuleNotFoundError as e:
        if e.name is not None and (source == e.name or source.startswith(e.name + ".")):
            raise ConfigError(format_error(
                f"There is no module {source!r}: {e}",
                where=f"{target} (looked in {Path.cwd()} and sys.path)", value=source,
                remedy="check the spelling, run from the directory that holds the package "
                       "(or install it), or give a file: path/to/file.py:factory")) from e
        raise _import_failed(f"Importing module {source!r} failed", e, None, target) from e
    except Exception as e:
        raise _import_failed(f"Importing module {source!r} failed", e, None, target) from e


def _import_failed(what: str, e: Exception, file: str | None, target: str) -> ConfigError:
    """The error for a module whose own code raised while it was imported."""
    where = (f"{e.filename}:{e.lineno}" if isinstance(e, SyntaxError) and e.filename
             else _raised_at(e, file))
    return ConfigError(format_error(
        f"{what}: {type(e).__name__}: {e}", where=where, value=target,
        remedy="fix the import (install what it needs) or the code at the line named"))


def _raised_at(e: BaseException, file: str | None) -> str:
    """``file:line (function)`` of the innermost frame of ``e``'s traceback in ``file`` (the
    user's module), else of its innermost frame."""
    import traceback

    frames = list(traceback.extract_tb(e.__traceback__))
    if file is not None:
        mine = [f for f in frames if Path(f.filename).resolve() == Path(file).resolve()]
        frames = mine or frames
    if not frames:
        return "(no traceback)"
    last = frames[-1]
    return f"{last.filename}:{last.lineno} ({last.name})"


def _factory(module: Any, name: str, target: str) -> Callable[[], Any]:
    """The module's callable ``name``, checked to need no arguments."""
    import inspect

    factory = getattr(module, name, None)
    if factory is None:
        own = sorted(k for k, v in vars(module).items() if not k.startswith("_")
                     and callable(v) and getattr(v, "__module__", None) == module.__name__)
        listed = ", ".join(own[:12]) + (", ..." if len(own) > 12 else "") or "(none)"
        raise ConfigError(format_error(
            f"The module has no factory {name!r}.", where=target, value=name,
            remedy=f"{did_you_mean(name, own)}callables defined in the module: {listed}"))
    if not callable(factory):
        raise ConfigError(format_error(
            f"{name!r} in the module is of type {type(factory).__name__}, not a factory.",
            where=target, value=_describe(factory, short=True),
            remedy=f"name a function with no arguments that returns {STEP_SHAPE}"))
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # builtins without a signature: let the call tell
        return factory
    needed = [p.name for p in signature.parameters.values()
              if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if needed:
        raise ConfigError(format_error(
            f"The factory {name!r} needs arguments: {', '.join(needed)}.", where=target,
            value=f"{name}{signature}",
            remedy="give them defaults, or write a factory with no arguments that calls it"))
    return factory


def _describe(value: Any, *, short: bool = False) -> str:
    """``a tuple of 2 items (function, dict)``, ``a dict``, ``None``; ``short``: the types
    only."""
    def kind(v: Any) -> str:
        shape = getattr(v, "shape", None)
        dtype = getattr(v, "dtype", None)
        if shape is not None and dtype is not None:
            return f"{type(v).__name__} {dtype}{list(shape)}"
        return "function" if callable(v) and hasattr(v, "__code__") else type(v).__name__

    if value is None:
        return "None"
    if isinstance(value, tuple | list):
        items = ", ".join(kind(v) for v in value[:5]) + (", ..." if len(value) > 5 else "")
        text = f"({items})" if isinstance(value, tuple) else f"[{items}]"
        n = len(value)
        return text if short else f"a {type(value).__name__} of {n} item{'s' * (n != 1)} {text}"
    return kind(value) if short else f"a {kind(value)}"
