"""``shardplan launch``'s messages when a process fails: the launcher names it first, then its own
error; its peers' transport errors go to a log (``--verbose`` prints them); a healthy job's
output is relayed whole.

The processes are small Python programs (no jax): process 0 fails with a clear error and status
2, process 1 then prints a gloo-like traceback and exits with status 1, as a peer does when the
failure reaches it in a collective.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.processes import child_env

from shardplan.runtime.distributed import (
    EXIT_FILE,
    HOLD_S,
    PROCESS_ID,
    SETTLE_S,
    _announce_exit,
    _origin,
    launch,
)

ROOT = Path(__file__).parents[2]

CLEAR = "shardplan train: InfeasibleError: The state alone exceeds the usable memory."
TRANSPORT = "jax.errors.JaxRuntimeError: UNKNOWN: Gloo context initialization failed"

# Process 0 fails with a clear error and, with `blocked`, says it is exiting (as
# initialize_distributed's atexit hook does) and waits for its peer before it exits (as
# jax.distributed's shutdown does); process 1 prints a transport error once process 0 exits,
# or with `blocked` 3 * HOLD_S after process 0 began to exit, and exits 3 * HOLD_S later.
WORKER = textwrap.dedent(f"""
    import os, sys, time
    me, mode, marks = int(os.environ[{PROCESS_ID!r}]), sys.argv[1], sys.argv[2]

    def wait_for(path):
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)

    def mark(name):
        open(os.path.join(marks, name), "w").close()

    print(f"p{{me}} started", flush=True)
    if me == 0:
        sys.stderr.write({CLEAR!r} + "\\n  fix:   use more devices\\n")
        sys.stderr.flush()
        if mode == "blocked":
            open(os.environ[{EXIT_FILE!r}], "w").close()
            wait_for(os.path.join(marks, "p1-failed"))
            time.sleep(0.2)
        mark("p0-exits")
        sys.exit(2)
    if mode == "blocked":
        wait_for(os.environ[{EXIT_FILE!r}][:-1] + "0")
        time.sleep(3 * {HOLD_S!r})
    else:
        wait_for(os.path.join(marks, "p0-exits"))
        time.sleep(0.05)
    sys.stderr.write("Traceback (most recent call last):\\n  File \\"train.py\\", line 1\\n"
                     + {TRANSPORT!r} + "\\n")
    sys.stderr.flush()
    if mode == "blocked":  # its own exit waits too (jax.distributed's shutdown)
        time.sleep(3 * {HOLD_S!r})
    mark("p1-failed")
    sys.exit(1)
""")


def _worker(tmp_path: Path, mode: str) -> list[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    marks = tmp_path / "marks"
    marks.mkdir(exist_ok=True)
    return [sys.executable, str(script), mode, str(marks)]


def _log_named(err: str) -> str:
    found = re.search(r"the other processes' output after the failure: (\S+) \(--verbose", err)
    assert found, err
    return Path(found[1]).read_text()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["prompt", "blocked"])
def test_the_launcher_names_the_failure_first_and_logs_the_peers_transport_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str) -> None:
    code = launch(_worker(tmp_path, mode), 2, grace_s=5)
    out, err = capsys.readouterr()
    assert code == 1
    assert "[p0] p0 started" in out and "[p1] p1 started" in out
    named = err.index("shardplan launch: process 0 (pid ")
    assert err[named:].startswith("shardplan launch: process 0 (pid ") and \
        "exited with status 2; stopping the others" in err[named:].splitlines()[0]
    assert f"[p0] {CLEAR}\n[p0]   fix:   use more devices\n" in err
    if mode == "prompt":  # process 0 exited at once: its error follows the launcher's message
        assert err.index(CLEAR) > named
    assert "shardplan launch: process 1 exited with status 1" in err
    assert TRANSPORT not in err and "Traceback" not in err
    log = _log_named(err)
    assert "[p1] Traceback (most recent call last):\n" in log and f"[p1] {TRANSPORT}\n" in log
    assert CLEAR not in log


@pytest.mark.slow
def test_verbose_prints_the_peers_transport_error_after_the_launchers_message(
        tmp_path: Path) -> None:
    env = child_env()
    done = subprocess.run([sys.executable, "-m", "shardplan.cli.main", "launch", "--nprocs", "2",
                           "--verbose", "--", *_worker(tmp_path, "prompt")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    named = done.stderr.index("shardplan launch: process 0 (pid ")
    assert named < done.stderr.index(CLEAR) < done.stderr.index(f"[p1] {TRANSPORT}")
    assert "output after the failure" not in done.stderr


@pytest.mark.slow
def test_a_healthy_jobs_output_is_relayed_whole_and_in_order(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    program = textwrap.dedent(f"""
        import os, sys, time
        me = os.environ[{PROCESS_ID!r}]
        for k in range(40):
            print(f"out {{me}} {{k}}", flush=True)
            print(f"warning {{me}} {{k}}", file=sys.stderr, flush=True)
            if k % 10 == 0:
                time.sleep(0.05)
        sys.stderr.write(f"last words {{me}}")  # no newline, right before the exit
    """)
    code = launch([sys.executable, "-c", program], 2)
    out, err = capsys.readouterr()
    assert code == 0
    for me in range(2):
        assert [line for line in out.splitlines() if line.startswith(f"[p{me}] ")] == \
            [f"[p{me}] out {me} {k}" for k in range(40)]
        assert [line for line in err.splitlines() if line.startswith(f"[p{me}] ")] == \
            [f"[p{me}] warning {me} {k}" for k in range(40)] + [f"[p{me}] last words {me}"]
    assert "shardplan launch" not in err


def test_the_process_named_is_the_first_to_fail_preferring_a_cause_to_a_transport_error(
) -> None:
    kill = -int(signal.SIGKILL)
    # Process 1's gloo error (status 1) ended first; process 0's own error (2) 0.4 s later.
    assert _origin({}, {0: (5.4, 2), 1: (5.0, 1)}) == 0
    # Process 0 began to exit at 8 s, stuck in jax's shutdown until its peer's timeout.
    assert _origin({0: 8.0, 1: 38.0}, {0: (39.0, 2), 1: (39.0, 1)}) == 0
    # A process killed from outside; its peer's gloo error follows.
    assert _origin({}, {0: (5.05, 1), 1: (5.0, kill)}) == 1
    # Both plain exceptions (status 1): the first; a cause long after the first is not it.
    assert _origin({}, {0: (7.0, 1), 1: (5.0, 1)}) == 1
    assert _origin({}, {0: (5.0 + 2 * SETTLE_S, 2), 1: (5.0, 1)}) == 1
    assert _origin({}, {0: (5.5, 2), 1: (5.0, 2)}) == 1
    assert _origin({}, {0: (5.0, 0), 1: (5.1, 0)}) is None


def test_the_exit_hook_leaves_the_notice_the_launcher_looks_for(tmp_path: Path) -> None:
    notice = tmp_path / "exiting-0"
    _announce_exit(str(notice))
    assert notice.read_text() == str(os.getpid())
    _announce_exit(str(tmp_path / "gone" / "exiting-1"))  # the launcher gone: no error
