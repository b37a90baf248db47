"""Token corpora: the built-in one (the Python standard library), text files, ``.bin`` files.

Each reader returns a :class:`Corpus`: one flat array of token ids, the files it came from, and
a fingerprint of its content that a checkpoint keeps to tell whether the data changed.

Text (the built-in corpus and ``text`` files) is tokenised at byte level: token id = byte value,
vocabulary 256, nothing to download or ship. Files are concatenated in sorted path order with
no separator (a byte vocabulary has no spare id for one).

The built-in corpus reads the ``.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``) in sorted relative-path order, up to a byte budget,
skipping the directories in :data:`BUILTIN_EXCLUDED_DIRS`. It is the same on every machine with
the same Python version and build; the fingerprint says when it is not. Reading it takes
0.03 s (4 MiB, 219 files, CPython 3.11.7, warm page cache), so it is not cached: a cache would
read as many bytes from disk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sysconfig
from pathlib import Path

import numpy as np

from shardplan.errors import DataError, format_error

__all__ = [
    "BIN_DTYPE",
    "BUILTIN_EXCLUDED_DIRS",
    "BYTE_VOCAB_SIZE",
    "Corpus",
    "read_bin",
    "read_builtin",
    "read_text",
]

BYTE_VOCAB_SIZE: int = 256
"""Vocabulary of the byte-level tokenisation: one id per byte value."""

BIN_DTYPE = np.dtype(np.uint16)
"""Token type of ``.bin`` files (nanoGPT's ``prepare.py`` format: raw little-endian uint16)."""

BUILTIN_EXCLUDED_DIRS: frozenset[str] = frozenset({
    # Not the standard library: installed packages and bytecode.
    "site-packages", "dist-packages", "__pycache__",
    # Shipped apart by Linux distributions (python3-tk, idle, python3-distutils, libpython-test),
    # so including them would make the corpus differ between machines of the same version.
    "test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "distutils", "ensurepip",
    # Compiled extensions, and codec tables (1.4 MB of hex numbers, not text).
    "lib-dynload", "encodings",
})
"""Standard-library directories the built-in corpus skips (at any depth)."""

_HASH_CHUNK_BYTES = 1 << 24
"""Hash and scan large files in 16 MiB pieces, so memory stays flat."""

_FULL_HASH_MAX_BYTES = 1 << 28
"""``.bin`` files up to 256 MiB are hashed whole; larger ones are hashed by sampling (their size
and 64 evenly spaced 1 MiB pieces), which keeps opening a 17 GB file under a second."""


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """A flat array of token ids and where it came from.

    Attributes:
      tokens: ``[n_tokens]`` unsigned ids (``uint8`` for byte-level text, ``uint16`` for a
        memory-mapped ``.bin``).
      source: the config source it was read as (``builtin``, ``text``, ``bin``).
      where: how messages name it, e.g. ``data.path ('corpus.txt')``.
      files: the files read, in order (relative to the standard library for ``builtin``).
      fingerprint: ``sha256:<hex>`` of the token bytes (``sha256-sampled:`` for large
        ``.bin`` files); equal fingerprints mean equal tokens.
      vocab_size: the tokenisation's vocabulary (256 for bytes), or None when unknown
        (``.bin`` files carry no vocabulary).
      description: a short human-readable summary (Python version, file count, bytes).
    """

    tokens: np.ndarray
    source: str
    where: str
    files: tuple[str, ...]
    fingerprint: str
    vocab_size: int | None
    description: str

    @property
    def n_tokens(self) -> int:
        """Tokens in the corpus."""
        return int(self.tokens.shape[0])

    def max_token(self) -> int:
        """The largest token id (a scan of the whole array, in pieces for memory-mapped files)."""
        step = _HASH_CHUNK_BYTES // self.tokens.itemsize
        return max(int(self.tokens[i:i + step].max()) for i in range(0, self.n_tokens, step))

    def check_vocab(self, vocab_size: int, /) -> None:
        """Raises a DataError if a token id is not below the model's ``vocab_size``.

        Raises:
          DataError: naming the corpus, the largest id and the model's vocabulary.
        """
        if self.vocab_size is not None and self.vocab_size <= vocab_size:
            return  # every id of the tokenisation fits: no scan needed
        largest = self.max_token()
        if largest >= vocab_size:
            raise DataError(format_error(
                f"Token id {largest} is not below the model's vocab_size {vocab_size}.",
                where=self.where, value=largest,
                remedy=(f"use a model with vocab_size >= {largest + 1}"
                        + (" (byte-level text needs 256)" if self.source != "bin" else
                           ", or re-tokenise the file with the model's tokenizer"))))


def read_builtin(*, max_bytes: int, where: str = "data.source ('builtin')") -> Corpus:
    """The first ``max_bytes`` of the standard library's ``.py`` sources as byte tokens.

    Args:
      max_bytes: the byte budget; the last file read is cut to fit it exactly.
      where: how messages name the corpus.

    Returns:
      The corpus; ``files`` are paths relative to the standard library directory.

    Raises:
      DataError: the standard library directory has no ``.py`` files (an embedded Python).

    Example:
      >>> corpus = read_builtin(max_bytes=100_000)
      >>> corpus.n_tokens, corpus.vocab_size
      (100000, 256)
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    used: list[str] = []
    total = 0
    for rel in _stdlib_sources(root):
        if total >= max_bytes:
            break
        data = (root / rel).read_bytes()[:max_bytes - total]
        parts.append(data)
        used.append(rel)
        total += len(data)
    if not used:
        raise DataError(format_error(
            "The Python installation ships no standard-library .py sources to read.",
            where=f"{where}: {root}", value=str(root),
            remedy="use source: text or source: bin with a file of your own"))
    data = b"".join(parts)
    version = f"{platform.python_implementation()} {platform.python_version()}"
    return Corpus(
        tokens=np.frombuffer(data, dtype=np.uint8), source="builtin", where=where,
        files=tuple(used), fingerprint=f"sha256:{hashlib.sha256(data).hexdigest()}",
        vocab_size=BYTE_VOCAB_SIZE,
        description=f"{version} standard library: {len(used)} files, {total} bytes "
                    f"({used[0]} .. {used[-1]})")


def _stdlib_sources(root: Path) -> list[str]:
    """Relative POSIX paths of the standard library's ``.py`` files, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames
                       if d not in BUILTIN_EXCLUDED_DIRS and not d.startswith("config-")]
        for name in filenames:
            # _sysconfigdata_*.py records the build machine's compiler flags: it differs
            # between builds of the same version.
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                found.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(found)


def read_text(path: str | os.PathLike[str], /, *, where: str = "data.path") -> Corpus:
    """A UTF-8 text file, or every ``.txt`` file under a directory, as byte tokens.

    A directory's files are found recursively and read in sorted relative-path order.

    Args:
      path: the file or directory.
      where: the config field ``path`` came from (messages name it with the path).

    Returns:
      The corpus.

    Raises:
      DataError: the path does not exist, a directory holds no ``.txt`` file, or a file is
        empty or not UTF-8.
    """
    base = Path(path)
    here = f"{where} ({str(path)!r})"
    _check_exists(base, here, "a UTF-8 text file or a directory of .txt files")
    if base.is_dir():
        files = sorted(base.rglob("*.txt"), key=lambda p: p.relative_to(base).as_posix())
        if not files:
            raise DataError(format_error(
                "The data directory holds no .txt files.", where=here, value=str(base),
                remedy="put UTF-8 .txt files in it, point path at a text file, or use "
                       "source: bin for pre-tokenised files"))
    else:
        files = [base]
    parts = []
    for file in files:
        data = file.read_bytes()
        _check_utf8(data, file, here)
        parts.append(data)
    data = b"".join(parts)
    _check_not_empty(len(data), here, str(base))
    return Corpus(
        tokens=np.frombuffer(data, dtype=np.uint8), source="text", where=here,
        files=tuple(str(f) for f in files),
        fingerprint=f"sha256:{hashlib.sha256(data).hexdigest()}", vocab_size=BYTE_VOCAB_SIZE,
        description=f"text: {len(files)} file(s), {len(data)} bytes under {base}")


def read_bin(path: str | os.PathLike[str], /, *, where: str = "data.path") -> Corpus:
    """A pre-tokenised ``uint16`` token file, memory-mapped (nothing is read up front).

    Args:
      path: the ``.bin`` file (raw little-endian ``uint16`` ids, as nanoGPT writes them).
      where: the config field ``path`` came from (messages name it with the path).

    Returns:
      The corpus; its ``tokens`` are a read-only ``np.memmap``.

    Raises:
      DataError: the path does not exist or is a directory, the file is empty, or its size
        is not a whole number of ``uint16`` tokens.
    """
    file = Path(path)
    here = f"{where} ({str(path)!r})"
    _check_exists(file, here, "a .bin file of uint16 token ids")
    if file.is_dir():
        raise DataError(format_error(
            "source: bin reads one file, but the path is a directory.", where=here,
            value=str(file), remedy="point path at the .bin file inside it (e.g. train.bin)"))
    size = file.stat().st_size
    if size % BIN_DTYPE.itemsize:
        raise DataError(format_error(
            f"The .bin file's size, {size} bytes, is not a whole number of "
            f"{BIN_DTYPE.itemsize}-byte uint16 tokens (truncated, or not a token file).",
            where=here, value=size,
            remedy="re-write the file as np.array(ids, dtype=np.uint16).tofile(path); for "
                   "plain text use source: text"))
    _check_not_empty(size // BIN_DTYPE.itemsize, here, str(file))
    tokens = np.memmap(file, dtype=BIN_DTYPE.newbyteorder("<"), mode="r")
    return Corpus(
        tokens=tokens, source="bin", where=here, files=(str(file),),
        fingerprint=_file_fingerprint(file, size), vocab_size=None,
        description=f"bin: {tokens.shape[0]} uint16 tokens in {file}")


def _check_exists(path: Path, where: str, want: str) -> None:
    if not path.exists():
        raise DataError(format_error(
            "The data path does not exist.", where=where, value=str(path),
            remedy=f"give {want} (a relative path is read from {os.getcwd()}), or use "
                   "source: builtin, which needs no file"))


def _check_not_empty(n_tokens: int, where: str, path: str) -> None:
    if n_tokens == 0:
        raise DataError(format_error(
            "The data file is empty: 0 tokens.", where=where, value=path,
            remedy="give a file with at least seq_len + 1 tokens"))


def _check_utf8(data: bytes, file: Path, where: str) -> None:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(format_error(
            f"{file} is not UTF-8 text: byte {err.start} is {data[err.start:err.start + 1]!r}.",
            where=where, value=str(file),
            remedy="re-encode it as UTF-8 (iconv -t UTF-8), or for a pre-tokenised file "
                   "use source: bin")) from None


def _file_fingerprint(file: Path, size: int) -> str:
    """``sha256:`` of the whole file, or ``sha256-sampled:`` of its size and 64 pieces."""
    digest = hashlib.sha256()
    with file.open("rb") as f:
        if size <= _FULL_HASH_MAX_BYTES:
            while chunk := f.read(_HASH_CHUNK_BYTES):
                digest.update(chunk)
            return f"sha256:{digest.hexdigest()}"
        digest.update(str(size).encode())
        piece = 1 << 20
        for i in range(64):
            f.seek((size - piece) * i // 63)
            digest.update(f.read(piece))
    return f"sha256-sampled:{digest.hexdigest()}"
