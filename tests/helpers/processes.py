"""The environment of the Python processes the tests start: this checkout importable, the
test session's XLA flags (conftest.py) inherited, and optionally without its device count (a
process of ``shardplan launch`` makes its own share of the devices)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env(*, own_devices: bool = False, **extra: str) -> dict[str, str]:
    """This process's environment with the checkout on ``PYTHONPATH`` and ``extra`` set.

    Args:
      own_devices: drop the 8-device flag from ``XLA_FLAGS`` (each process of a launch makes
        ``--cpu-devices`` devices); the other flags stay.
    """
    env = dict(os.environ)
    if own_devices:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env.update(extra)
    return env
