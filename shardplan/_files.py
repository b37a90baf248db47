"""Reading a user's text file (a YAML config) with a typed error for every way it fails.

Run configs, model configs, cluster files and device catalogs all read through
:func:`read_text`, so a file that is missing, a directory, unreadable or not UTF-8 gets the
same message wherever it is given.

Example:
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "bad.yaml"
    >>> _ = path.write_bytes(b"name: caf\\xe9\\n")  # latin-1, not UTF-8
    >>> try:
    ...     read_text(path, what="run config")
    ... except ConfigError as err:
    ...     print(str(err).splitlines()[0])
    The run config is not UTF-8 text (invalid continuation byte); it is probably in a legacy encoding such as Latin-1 or Windows-1252.
"""

from __future__ import annotations

import os
from pathlib import Path

from shardplan.errors import ConfigError, format_error

__all__ = ["read_text"]

_BYTE_ORDER_MARKS = (
    (b"\x00\x00\xfe\xff", "UTF-32 (big-endian)"),
    (b"\xff\xfe\x00\x00", "UTF-32 (little-endian)"),
    (b"\xfe\xff", "UTF-16 (big-endian)"),
    (b"\xff\xfe", "UTF-16 (little-endian)"),
)
"""Byte-order marks of the encodings an editor may save a file in instead of UTF-8; the
UTF-32 marks first, since UTF-32 LE's starts with UTF-16 LE's."""


def read_text(path: str | os.PathLike[str], /, *, what: str,
              error: type[ConfigError] = ConfigError, remedy: str = "check the path") -> str:
    """The text of the UTF-8 file ``path`` (a UTF-8 byte-order mark is kept; YAML skips it).

    Args:
      path: the file.
      what: what the file is, for the message ("run config", "cluster file").
      error: the :class:`~shardplan.errors.ConfigError` subclass to raise.
      remedy: what to do when the file cannot be opened (relative paths are relative to the
        current directory, and the path must name a readable file: both are added).

    Raises:
      ConfigError: (or ``error``) the path is not a path, is missing, a directory, unreadable
        or holds a NUL byte (naming it and the system's reason); or the file is not UTF-8
        (naming its line, column and byte offset, the bytes there, and the encoding it seems
        to be in).
    """
    try:
        file = os.fspath(path)
    except TypeError as err:
        raise error(format_error(f"The {what} must be given as a file path.", where="path",
                                 value=path, remedy="pass a str or pathlib.Path")) from err
    try:
        data = Path(file).read_bytes()
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise error(format_error(
            f"Cannot read the {what}.", where=file, value=f"{type(err).__name__}: {reason}",
            remedy=f"{remedy} (relative paths are relative to the current directory); it must "
                   "be a readable file, not a directory")) from err
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        line_start = data.rfind(b"\n", 0, err.start) + 1
        column = len(data[line_start:err.start].decode("utf-8")) + 1  # valid up to err.start
        found = next((name for bom, name in _BYTE_ORDER_MARKS if data.startswith(bom)), None)
        seems = (f"it starts with a {found} byte-order mark" if found else
                 "it is probably in a legacy encoding such as Latin-1 or Windows-1252")
        raise error(format_error(
            f"The {what} is not UTF-8 text ({err.reason}); {seems}.",
            where=f"{file}, line {line}, column {column} (byte offset {err.start})",
            value=data[err.start:err.start + 8],
            remedy="save the file as UTF-8 (in most editors: 'Save with encoding' / 'Reopen "
                   "with encoding', then UTF-8; or iconv -f <encoding> -t UTF-8)")) from err
