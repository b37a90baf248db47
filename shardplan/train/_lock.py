"""One run per run directory: an OS advisory lock held for the run's lifetime.

``shardplan train`` takes an exclusive ``flock`` on ``<output.dir>/run.lock`` before it reads or
writes anything else there, and holds it until it returns. A second run on the same directory
is refused at once, naming the holder's pid, host and start time (written into the lock file
by the holder). The kernel releases the lock when the holder's process ends, however it ends,
so a run killed with SIGKILL leaves a ``run.lock`` file but no lock: the next run takes it
without any cleanup. (``flock`` locks work across the processes of one machine, and on NFS
through the server's locks; under ``shardplan launch`` only process 0 takes it.)

Example:
    >>> import tempfile
    >>> run_dir = tempfile.mkdtemp()
    >>> with RunLock(run_dir):
    ...     try:
    ...         RunLock(run_dir).acquire()
    ...     except ConfigError as err:
    ...         print(str(err).splitlines()[0][:40])
    Another run is using this run directory:
    >>> RunLock(run_dir).acquire().release()  # released: free again
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType

from shardplan.errors import ConfigError, format_error

__all__ = ["LOCK_FILE", "RunLock", "make_run_dir"]

LOCK_FILE = "run.lock"
"""The lock's file name in the run directory."""


def make_run_dir(path: str | os.PathLike[str], /, *, where: str = "output.dir") -> Path:
    """Creates the run directory (and its parents) if missing.

    Raises:
      ConfigError: the path is a file, lies under a file, or cannot be created or written
        (naming ``where``, the path and the system's reason).
    """
    run_dir = Path(path)
    blocker = next((p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()),
                   None)
    if blocker is not None:
        what = "is a file" if blocker == run_dir else f"lies under a file ({blocker})"
        raise ConfigError(format_error(
            f"The run directory {what}.", where=where, value=str(run_dir),
            remedy="give output.dir a directory path (new or an earlier run's)"))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(format_error(
            f"The run directory cannot be created: {(err.strerror or str(err)).lower()}.",
            where=where, value=str(run_dir),
            remedy="give output.dir a path you may write to")) from err
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(format_error(
            "The run directory is not writable.", where=where, value=str(run_dir),
            remedy="give output.dir a path you may write to, or change its permissions"))
    return run_dir


class RunLock:
    """The exclusive lock on a run directory (module docstring); a context manager.

    Args:
      run_dir: the run directory (created if missing, :func:`make_run_dir`).
      where: the config key that named it, for messages.
    """

    def __init__(self, run_dir: str | os.PathLike[str], /, *, where: str = "output.dir") -> None:
        self.run_dir = Path(run_dir)
        self.where = where
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        """The lock file."""
        return self.run_dir / LOCK_FILE

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> RunLock:
        """Takes the lock, writing this process's pid, host and start time into the file.

        Raises:
          ConfigError: another process holds it (naming the directory, its pid, host and
            start time), or the directory is not usable (:func:`make_run_dir`).
        """
        make_run_dir(self.run_dir, where=self.where)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ConfigError(format_error(
                f"The run directory's lock file cannot be opened: "
                f"{(err.strerror or str(err)).lower()}.",
                where=self.where, value=str(self.path),
                remedy="give output.dir a path you may write to")) from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(format_error(
                "Another run is using this run directory: two runs in one directory would "
                "overwrite each other's checkpoints, config and metrics.",
                where=f"{self.where} = {self.run_dir}",
                value=holder,
                remedy="wait for that run to end (or stop it), or give this run another "
                       "output.dir")) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Releases the lock (the file stays; an unlocked file means nothing)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, object] | str:
    """The holder's record (pid, host, start), or what the file says if it is not one."""
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode("utf-8", errors="replace")
    try:
        record = json.loads(text)
    except ValueError:
        return text.strip() or "a process that has not written its pid yet"
    return record if isinstance(record, dict) else text
