"""shardplan's version, in one place: the installed package's metadata (``pyproject.toml``'s
``version``, as pip recorded it), or ``pyproject.toml`` itself for a source tree used without
installing it (``PYTHONPATH=.``). Plans record it (``Plan.shardplan_version``) and ``sp.auto``'s
cache keys on it.

Example:
    >>> import re
    >>> bool(re.fullmatch(r"\\d+\\.\\d+\\.\\d+.*", __version__))
    True
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

__all__ = ["__version__"]


def _read() -> str:
    try:
        return importlib.metadata.version("shardplan")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return str(tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"])


__version__ = _read()
