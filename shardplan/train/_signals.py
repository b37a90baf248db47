"""How a run ends on SIGINT (Ctrl-C) or SIGTERM: one line naming the intact checkpoint, and the
shell's exit status (130, 143), never a traceback.

While a run is in :class:`Signals`, either signal raises :class:`Stop` in the main thread,
except inside :meth:`Signals.deferred` (a checkpoint being written, the run directory's files),
where it is held until the block ends, so nothing is left half-written. ``train`` turns the
:class:`Stop` into :class:`RunStopped`, whose message :func:`stopped` writes.

Example:
    >>> import os, signal
    >>> with Signals() as signals:
    ...     try:
    ...         with signals.deferred():
    ...             os.kill(os.getpid(), signal.SIGTERM)  # held until the block ends
    ...             print("finished the save")
    ...     except Stop as stop:
    ...         print("stopped by", stop)
    finished the save
    stopped by SIGTERM
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["RunStopped", "Signals", "Stop", "saved_steps", "stopped"]


class RunStopped(Exception):
    """A run ended by SIGINT (Ctrl-C) or SIGTERM: the message says which step's checkpoint is
    intact; ``exit_code`` is the shell's for the signal (130, 143)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Stop(BaseException):
    """Raised in the main thread by :class:`Signals`'s handler (a ``BaseException``, as
    ``KeyboardInterrupt`` is, so no ``except Exception`` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Signals:
    """SIGINT and SIGTERM raise :class:`Stop` while the run is in this context, except inside
    :meth:`deferred` (a checkpoint being written, files being closed), where they are held
    and raised at its end. Outside the main thread (where Python delivers no signals) it
    does nothing."""

    def __init__(self) -> None:
        self._old: dict[int, Any] = {}
        self._deferring = 0
        self._pending: int | None = None

    def _handle(self, signum: int, _frame: Any) -> None:
        if self._deferring:
            self._pending = signum
        else:
            raise Stop(signum)

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle)
                         for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            pending, self._pending = self._pending, None
            if pending is not None and not self._deferring:
                raise Stop(pending)


def saved_steps(directory: Path) -> list[int]:
    """The committed checkpoint steps in ``directory`` (orbax names them by the step)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def stopped(stop: Stop, run_dir: Path, step: int | None, total: int) -> RunStopped:
    """The one line a signalled run ends with, and its exit status (128 + the signal)."""
    where = ("before training began" if step is None
             else f"during step {step + 1} of {total}")
    kept = saved_steps(run_dir / "checkpoints")
    if kept:
        folder = run_dir / "checkpoints" / str(kept[-1])
        said = (f"the checkpoint of step {kept[-1]} is intact ({folder}): run the same command "
                "to resume from it")
    else:
        said = "no checkpoint is saved: the same command starts the run over"
    return RunStopped(f"stopped by {signal.Signals(stop.signum).name} {where}; {said}",
                      128 + stop.signum)
