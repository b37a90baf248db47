"""``shardplan launch``: a 2-stage pipeline as 2 processes x 4 CPU devices (one stage each)
equals the unsharded step; a killed process stops the other, named, within 60 s."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import shardplan_models as models
from helpers.processes import child_env

from shardplan.errors import ConfigError
from shardplan.runtime.distributed import launch

WORKER = Path(__file__).parents[1] / "data" / "pipeline_worker.py"


def _launch_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardplan.cli.main", "launch", "--nprocs", "2",
            "--cpu-devices", "4", "--", sys.executable, str(WORKER), *args]


def _env() -> dict[str, str]:
    return child_env(own_devices=True)  # 4 devices per process


@pytest.mark.slow
def test_two_processes_equal_the_unsharded_step(tmp_path: Path) -> None:
    done = subprocess.run(_launch_command(str(tmp_path), "3"), env=_env(), timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[p0] step 2 done" in done.stdout and "[p1] step 2 done" in done.stdout
    config = models.load_model_config("gpt-tiny")
    graphdef, state = models.init_train_state(config, seed=0)
    step = jax.jit(models.make_train_step(graphdef))
    for i in range(3):
        state, metrics = step(state, models.example_batch(config, 16, seed=i))
    reference = jax.tree.leaves((state, metrics))
    parts = [np.load(tmp_path / f"process{p}.npz") for p in range(2)]
    held = [set(part.files) for part in parts]
    assert held[0] and held[1] and not held[0] & held[1]  # each process holds its stage's
    assert held[0] | held[1] == {str(n) for n in range(len(reference))}
    for part in parts:
        for key in part.files:
            np.testing.assert_allclose(part[key], np.asarray(reference[int(key)]),
                                       rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_killed_process_stops_the_other_naming_it() -> None:
    proc = subprocess.Popen(_launch_command("unused", "0"), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pids: dict[int, int] = {}
        stepped: set[int] = set()
        deadline = time.monotonic() + 240
        assert proc.stdout is not None
        while len(stepped) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if m := re.match(r"\[p(\d)\] process \d pid (\d+)", line):
                pids[int(m[1])] = int(m[2])
            if m := re.match(r"\[p(\d)\] step \d+ done", line):
                stepped.add(int(m[1]))
        assert stepped == {0, 1}, "the processes did not start stepping"
        killed = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        rest, _ = proc.communicate(timeout=90)
        elapsed = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < 60
    assert f"process 1 (pid {pids[1]}) was killed by SIGKILL" in rest
    assert "[p0] shardplan: process 0 stops: process 1" in rest
    assert "shardplan launch: process 0 exited with status 1" in rest


def test_launch_refuses_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="No command"):
        launch([], 2)
    with pytest.raises(ConfigError, match="positive"):
        launch(["true"], 0)
