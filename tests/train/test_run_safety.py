"""Runs lose nothing: one run per run directory, nothing written before a run's checks pass,
damaged checkpoints named (and skipped only when asked), signals end a run with one line, a
plan is reusable as a file (multi-stage plans included), and bad paths are typed errors.

In-process runs are ``configs/train/tiny.yaml`` for a few steps on two CPU devices; the tests of
the lock and of signals run ``shardplan train`` as a user does, in subprocesses (``slow``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers.processes import child_env
from helpers.steps import mlp_step
from shardplan_models.config import load_model_config

import shardplan as sp
from shardplan.train._lock import LOCK_FILE, RunLock
from shardplan.train.checkpoint import Checkpointer
from shardplan.train.config import load_run_config
from shardplan.train.loop import train

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "train" / "tiny.yaml")
DEMO = str(ROOT / "configs" / "train" / "demo.yaml")
BASE = ("--train.eval_every=2", "--train.sample_tokens=0", "--train.measure_steps=0",
        "--output.checkpoint_every=2", "--cluster.local.types={cpu: 2}")


def _config(run_dir: Path, steps: int, *overrides: str, path: str = TINY):
    return load_run_config(path, [*BASE, f"--train.steps={steps}", f"--output.dir={run_dir}",
                                  *overrides])


def _run(run_dir: Path, steps: int, *overrides: str, path: str = TINY):
    return train(_config(run_dir, steps, *overrides, path=path), progress=False,
                 print_fn=lambda _: None)


def _bit_equal(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _flip(path: Path, count: int = 64) -> None:
    """Inverts ``count`` bytes in the middle of ``path`` (its size unchanged)."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2
    for i in range(start, min(start + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _largest_file(step_dir: Path) -> Path:
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.name != "checksums.json"]
    return max(files, key=lambda p: p.stat().st_size)


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """A tiny run of 4 steps, checkpoints at steps 2 and 4 (copied by the tests that damage
    them)."""
    run_dir = tmp_path_factory.mktemp("four")
    return run_dir, _run(run_dir, 4)


def _checkpoints(run_dir: Path) -> Checkpointer:
    return Checkpointer(run_dir / "checkpoints", every_steps=1, keep=100)


def _copy(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


# --------------------------------------------------------------------------------------------
# nothing written before the checks; damaged checkpoints


def test_a_refused_resume_writes_nothing_in_the_run_directory(four_steps, tmp_path) -> None:
    run_dir = _copy(four_steps[0], tmp_path / "run")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()
              and p.name != LOCK_FILE}
    with pytest.raises(sp.CheckpointError, match="other training data"):
        _run(run_dir, 6, "--data.seed=1")
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()
             and p.name != LOCK_FILE}
    assert after == before
    # The stored config still resumes the run as it was started.
    stored = load_run_config(run_dir / "config.yaml",
                             ["--train.steps=6", f"--output.dir={run_dir}"])
    assert stored.data.seed == 0
    assert train(stored, progress=False, print_fn=lambda _: None).last_step == 6


def test_a_damaged_latest_checkpoint_is_refused_then_resumed_from_the_intact_one_when_asked(
        four_steps, tmp_path) -> None:
    run_dir = _copy(four_steps[0], tmp_path / "run")
    damaged = _largest_file(run_dir / "checkpoints" / "4")
    _flip(damaged)
    with pytest.raises(sp.CheckpointError) as err:
        _run(run_dir, 6)
    message = str(err.value)
    assert "step 4" in message and "damaged" in message
    assert str(damaged) in message, message
    assert "resume from step 2" in message and "--output.resume_from_intact=true" in message
    assert (run_dir / "checkpoints" / "4").is_dir()  # refused: nothing moved
    lines: list[str] = []
    result = train(_config(run_dir, 6, "--output.resume_from_intact=true"), progress=False,
                   print_fn=lines.append)
    assert result.first_step == 2 and result.last_step == 6
    assert (run_dir / "damaged-checkpoints" / "4").is_dir()
    assert _checkpoints(run_dir).verify(6).ok
    # Steps 2..6 from the intact step 2 are the steps an undamaged run takes.
    alone = _copy(four_steps[0], tmp_path / "alone")
    subprocess.run(["rm", "-r", str(alone / "checkpoints" / "4")], check=True)
    _bit_equal(_run(alone, 6).state, result.state)


def test_output_dir_that_is_a_file_under_a_file_or_unwritable_is_a_config_error(
        tmp_path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    with pytest.raises(sp.ConfigError, match=r"(?s)is a file.*output.dir"):
        _run(a_file, 2)
    with pytest.raises(sp.ConfigError, match="lies under a file"):
        _run(a_file / "run", 2)
    if os.geteuid() == 0:
        return  # root writes anywhere: no unwritable directory to test with
    locked = tmp_path / "read_only"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(sp.ConfigError, match=r"(?s)cannot be created.*permission denied"):
            _run(locked / "run", 2)
        with pytest.raises(sp.ConfigError, match="not writable"):
            _run(locked, 2)
    finally:
        locked.chmod(0o700)


def test_a_locked_run_directory_is_refused_naming_the_holder(tmp_path) -> None:
    with RunLock(tmp_path), pytest.raises(sp.ConfigError) as err:
        _run(tmp_path, 2)
    message = str(err.value)
    assert "Another run is using this run directory" in message and str(tmp_path) in message
    assert f"'pid': {os.getpid()}" in message and "'host': " in message
    assert not (tmp_path / "config.yaml").exists()


def test_a_model_the_cluster_cannot_hold_is_refused_before_it_is_allocated(
        tmp_path, monkeypatch) -> None:
    def allocate(*args, **kwargs):
        raise AssertionError("the state was allocated before the size check")

    monkeypatch.setattr("models.init_train_state", allocate)
    # ~1.6e11 parameters: 1.9 TB of state with Adam's moments, on two CPU devices.
    big = ("--model.overrides={d_model: 65536, d_ff: 262144}",)
    with pytest.raises(sp.InfeasibleError, match="exceeds the usable memory"):
        _run(tmp_path, 2, *big)
    assert not (tmp_path / "config.yaml").exists()


def test_run_and_model_configs_that_are_not_utf8_are_config_errors(tmp_path) -> None:
    run = tmp_path / "run.yaml"
    run.write_bytes(Path(TINY).read_bytes().replace(b"# A run", b"# Caf\xe9 run"))
    with pytest.raises(sp.ConfigError) as err:
        load_run_config(run)
    assert "run config is not UTF-8" in str(err.value)
    assert f"{run}, line 1, column 6 (byte offset 5)" in str(err.value)
    model = tmp_path / "model.yaml"
    model.write_bytes(b"# \xff\nvocab_size: 256\n")
    with pytest.raises(sp.ConfigError, match="model config is not UTF-8"):
        load_model_config(str(model))


# --------------------------------------------------------------------------------------------
# plans as files


@pytest.fixture(scope="module")
def mixed_plan():
    """An MLP's plan on a mixed cluster (the stage planner's: several stages or microbatches),
    with its step and abstract arguments."""
    step, state, x = mlp_step(32, 16, layers=4, learning_rate=1e-3)
    cluster = sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
    plan = sp.make_plan(step, state, x, cluster=cluster,
                        config=sp.PlanConfig(pipeline=True, time_limit_s=5))
    return plan, step, state, x, cluster


def test_a_multi_stage_plan_passes_its_own_check_also_after_a_round_trip(
        mixed_plan, tmp_path) -> None:
    plan, step, state, x, cluster = mixed_plan
    assert len(plan.stages) > 1 or plan.microbatches > 1
    sp.check_plan(step, plan, state, x, cluster=cluster)
    plan.save(tmp_path / "plan.json")
    sp.check_plan(step, sp.load_plan(tmp_path / "plan.json"), state, x, cluster=cluster)


def test_a_plan_of_another_program_or_naming_another_layer_is_refused(mixed_plan) -> None:
    plan, step, state, x, cluster = mixed_plan
    # Same argument types and layers, another computation: the weights decayed after the update.
    def other(state, batch):
        (params, opt_state), loss = step(state, batch)
        return (jax.tree.map(lambda w: w * 0.999, params), opt_state), loss

    with pytest.raises(sp.PlanMismatchError, match="program differs from the one planned"):
        sp.check_plan(other, plan, state, x, cluster=cluster)
    data = json.loads(plan.to_json())
    stage = next(s for s in data["stages"] if any(name != "shared" for name in s["layers"]))
    renamed = next(name for name in stage["layers"] if name != "shared")
    stage["layers"] = [name + "x" if name == renamed else name for name in stage["layers"]]
    edited = sp.Plan.from_json(json.dumps(data))
    with pytest.raises(sp.PlanMismatchError) as err:
        sp.check_plan(step, edited, state, x, cluster=cluster)
    message = str(err.value)
    assert f"'{renamed}x' is not a layer of the step (did you mean '{renamed}'" in message
    assert f"the step's '{renamed}' run in no stage of the plan" in message


def test_plan_checks_name_arguments_of_the_wrong_type(mixed_plan) -> None:
    plan, step, state, x, _ = mixed_plan
    with pytest.raises(sp.ConfigError, match=r"(?s)make_plan\(cluster=\).*from_yaml\('local'\)"):
        sp.make_plan(step, state, x, cluster="local")
    with pytest.raises(sp.ConfigError, match=r"(?s)make_plan\(config=\).*'dict'"):
        sp.make_plan(step, state, x, cluster=sp.Cluster.local(), config={"time_limit_s": 5})
    with pytest.raises(sp.ConfigError, match=r"check_plan\(cluster=\)"):
        sp.check_plan(step, plan, state, x, cluster="local")
    # the step first, then its plan, in both entry points
    for call in (lambda: sp.check_plan(plan, step, state, x), lambda: sp.apply_plan(plan, step)):
        with pytest.raises(sp.ConfigError, match=r"\(train_step, plan, \.\.\.\) takes the step "
                                                 r"first, then its plan"):
            call()
    with pytest.raises(sp.ConfigError, match=r"(?s)apply_plan\(plan=\) must be an sp.Plan.*'str'"):
        sp.apply_plan(step, "plan.json")


@pytest.mark.slow
def test_the_demo_runs_again_from_its_own_plan_file(tmp_path) -> None:
    steps = ("--train.eval_every=2", "--data.val_batches=1", "--train.sample_tokens=0",
             "--train.measure_steps=0", "--train.steps=2", "--output.checkpoint_every=2")
    first = train(load_run_config(DEMO, [*steps, f"--output.dir={tmp_path / 'a'}"]),
                  progress=False, print_fn=lambda _: None)
    assert len(first.plan.stages) > 1
    again = train(load_run_config(DEMO, [*steps, f"--output.dir={tmp_path / 'b'}",
                                         f"--plan.file={tmp_path / 'a' / 'plan.json'}"]),
                  progress=False, print_fn=lambda _: None)
    _bit_equal(again.state, first.state)


def test_a_plan_file_for_a_run_inside_its_warmup_is_refused_not_crashed(four_steps,
                                                                         tmp_path) -> None:
    # tiny.yaml warms up for one step: a one-step run's learning rate is another program.
    with pytest.raises(sp.PlanMismatchError, match="no longer than its warmup"):
        _run(tmp_path, 1, f"--plan.file={four_steps[0] / 'plan.json'}")
    assert not (tmp_path / "config.yaml").exists()


# --------------------------------------------------------------------------------------------
# shardplan train in subprocesses: the lock across processes, kill -9, SIGINT and SIGTERM


def _cli(run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "shardplan.cli.main", "train", TINY, *BASE, f"--train.steps={steps}",
            "--train.eval_every=3", "--output.checkpoint_every=3", f"--output.dir={run_dir}",
            *extra]


def _env() -> dict[str, str]:
    return child_env(JAX_NUM_CPU_DEVICES="8")


def _start(run_dir: Path, steps: int) -> subprocess.Popen:
    """``shardplan train`` of the tiny config in a subprocess, its output piped."""
    return subprocess.Popen(_cli(run_dir, steps), env=_env(), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended ({proc.returncode}) before {path} existed:\n"
                                 + proc.communicate()[1])
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_second_run_on_one_directory_is_refused_and_the_first_is_untouched(tmp_path) -> None:
    run_dir = tmp_path / "run"
    first = _start(run_dir, 12)
    try:
        _wait_for(run_dir / LOCK_FILE, first)  # A holds the lock: it is planning
        deadline = time.monotonic() + 60
        while str(first.pid) not in (run_dir / LOCK_FILE).read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        started = time.monotonic()
        second = subprocess.run(_cli(run_dir, 12, "--optimizer.learning_rate=3e-3"),
                                env=_env(), cwd=ROOT, text=True, capture_output=True,
                                timeout=120)
        # Refused at once, before the model code loads (the bound is loose: this machine also
        # trains run A; the run directory's lock is the first thing shardplan train checks).
        print(f"second run refused after {time.monotonic() - started:.1f} s")
        assert second.returncode != 0
        assert "Another run is using this run directory" in second.stderr, second.stderr
        assert f"'pid': {first.pid}" in second.stderr and "Traceback" not in second.stderr
        assert time.monotonic() - started < 15
        out, err = first.communicate(timeout=600)
        assert first.returncode == 0, err
        assert "trained steps 0..12" in out, out
    finally:
        if first.poll() is None:
            first.kill()
    # Run A's checkpoints are those of the same run alone (in this process).
    alone = _run(tmp_path / "alone", 12, "--train.eval_every=3", "--output.checkpoint_every=3")
    ours, theirs = _checkpoints(run_dir), _checkpoints(tmp_path / "alone")
    assert ours.all_steps() == theirs.all_steps() == [9, 12]
    for step in (9, 12):
        _bit_equal(ours.restore(step, target=alone.state).state,
                   theirs.restore(step, target=alone.state).state)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len((tmp_path / "alone" / "metrics.jsonl").read_text().splitlines())


@pytest.mark.slow
def test_a_run_killed_with_sigkill_leaves_no_lock_behind(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, 400)
    try:
        _wait_for(run_dir / "checkpoints" / "3", proc)
    finally:
        proc.kill()
        proc.communicate()
    assert (run_dir / LOCK_FILE).exists()  # the file stays; the lock went with the process
    result = _run(run_dir, 6, "--train.eval_every=3", "--output.checkpoint_every=3")
    assert result.first_step >= 3 and result.last_step == 6


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_the_run_with_one_line_naming_the_intact_checkpoint(
        tmp_path, signum) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, 400)
    try:
        _wait_for(run_dir / "checkpoints" / "3", proc)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("shardplan train: stopped")]
    assert f"stopped by {signal.Signals(signum).name} during step" in line
    step = int(line.split("the checkpoint of step ")[1].split()[0])
    assert step % 3 == 0 and _checkpoints(run_dir).verify(step).ok
    assert f"({run_dir / 'checkpoints' / str(step)})" in line
    # The same command resumes from it.
    result = _run(run_dir, step + 3, "--train.eval_every=3", "--output.checkpoint_every=3")
    assert result.first_step == step


def test_the_lock_file_names_its_holder(tmp_path) -> None:
    with RunLock(tmp_path):
        record = json.loads((tmp_path / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid() and record["host"]
