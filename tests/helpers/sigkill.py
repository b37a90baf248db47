"""Killing a checkpoint save with SIGKILL at a chosen point, for the tests that check that the
previous checkpoint survives (``test_checkpoint.py``, ``test_train.py``).

A child process runs :data:`STALL` first: it makes orbax's atomic rename stop forever when it
reaches the temporary path ending in ``STALL_AT`` (after touching ``MARKER``), so that the
parent's SIGKILL lands at that point every time, with no race on the save's speed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

STALL = textwrap.dedent("""
    import os, time
    from orbax.checkpoint._src.path import atomicity

    _finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def _stalled(self):
        # Test hook: stop forever at one point of a save (the parent kills this process).
        if str(self.get()).endswith(os.environ["STALL_AT"]):
            open(os.environ["MARKER"], "w").close()
            time.sleep(600)
        return await _finalize(self)

    atomicity.AtomicRenameTemporaryPath.finalize = _stalled
""")
"""Python source that makes a save stall at ``$STALL_AT`` (touching ``$MARKER``)."""


def kill_while_saving(script: str, args: Sequence[str], *, stall_at: str, marker: Path,
                      env: Mapping[str, str], timeout_s: float = 300) -> None:
    """Runs ``STALL + script`` with ``args`` in a child process and SIGKILLs it once its save
    reached ``stall_at``; fails with the child's output if it never gets there."""
    child = subprocess.Popen(
        [sys.executable, "-c", STALL + textwrap.dedent(script), *args],
        env={**env, "STALL_AT": stall_at, "MARKER": str(marker)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), child.communicate(timeout=60)[0][-3000:]
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
