"""Checksums of a checkpoint's files: written once a step is committed, verified on restore.

Orbax writes a step into a temporary folder and renames it once complete (atomic against a
killed save), but nothing it keeps says whether the bytes read later are the bytes written:
a flipped block on disk restores silently (its OCDBT and tensorstore metadata hold no data
checksums) and surfaces, if at all, as a NaN steps later. So once a step is final, process 0
hashes every file under it (SHA-256) into ``checksums.json`` in the step folder (written
atomically: a temporary file renamed), and a restore first compares every listed file's size
and hash.

A step without ``checksums.json`` (written before this existed, or killed between orbax's
commit and the manifest) is *unverified*: restorable, and said so.

Example:
    >>> import pathlib, tempfile
    >>> step = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (step / "data").write_bytes(b"0123456789")
    >>> write_manifest(step)
    >>> verify(step).ok
    True
    >>> _ = (step / "data").write_bytes(b"0123456780")  # same size, one byte changed
    >>> verify(step).problem
    'data: its SHA-256 differs from the one recorded when the step was saved'
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MANIFEST", "Verdict", "verify", "write_manifest"]

MANIFEST = "checksums.json"
"""The manifest's file name in a step folder."""

_FORMAT = 1
_CHUNK = 1 << 22  # bytes hashed per read


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(step_dir: Path) -> list[Path]:
    """Every regular file under ``step_dir`` but the manifest, in a fixed order."""
    out = []
    for root, dirs, names in os.walk(step_dir):
        dirs.sort()
        for name in sorted(names):
            path = Path(root) / name
            if path.parent == step_dir and name in (MANIFEST, MANIFEST + ".tmp"):
                continue
            out.append(path)
    return out


def write_manifest(step_dir: str | os.PathLike[str], /) -> None:
    """Hashes every file of the (committed) step folder into its ``checksums.json``."""
    step = Path(step_dir)
    files = {p.relative_to(step).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in _files(step)}
    tmp = step / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": _FORMAT, "files": files}, indent=1), encoding="utf-8")
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, step / MANIFEST)


@dataclass(frozen=True)
class Verdict:
    """What :func:`verify` found.

    Attributes:
      recorded: the step has a manifest (False: unverified, not damaged).
      problem: the first file that differs and how (None: every recorded file matches).
      file: that file's path.
    """

    recorded: bool
    problem: str | None = None
    file: Path | None = None

    @property
    def ok(self) -> bool:
        """No recorded file differs (an unverified step is ok)."""
        return self.problem is None


def verify(step_dir: str | os.PathLike[str], /) -> Verdict:
    """Compares the step's files with its manifest: sizes first, then SHA-256."""
    step = Path(step_dir)
    try:
        manifest = json.loads((step / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return Verdict(recorded=False)
    except (OSError, ValueError) as err:
        return Verdict(True, f"{MANIFEST}: unreadable ({type(err).__name__}: {err})",
                       step / MANIFEST)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("format") != _FORMAT or not isinstance(files, dict):
        return Verdict(True, f"{MANIFEST}: not a manifest this version reads", step / MANIFEST)
    for name, want in files.items():  # sizes first: cheap, and catch truncation
        path = step / name
        if not path.is_file():
            return Verdict(True, f"{name}: missing", path)
        size = path.stat().st_size
        if size != want["bytes"]:
            return Verdict(True, f"{name}: {size} bytes, {want['bytes']} when saved", path)
    for name, want in files.items():
        if _sha256(step / name) != want["sha256"]:
            return Verdict(True, f"{name}: its SHA-256 differs from the one recorded when the "
                                 "step was saved", step / name)
    return Verdict(recorded=True)
