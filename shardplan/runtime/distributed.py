"""Several processes, one plan: ``shardplan launch`` and :func:`initialize_distributed`.

``shardplan launch --nprocs N -- CMD`` (:func:`launch`) starts ``N`` copies of ``CMD`` on this
machine, wired for ``jax.distributed`` on a loopback coordinator: each learns its place from
environment variables, and :func:`initialize_distributed` (called by the program before it
touches jax devices) joins the job: CPU collectives over gloo, cross-process transfers over
loopback sockets (``../shared/notes/jax.md`` section 7), and, with ``--cpu-devices K``, ``K``
CPU devices per process. Every process runs the same program; a
:class:`~shardplan.runtime.pipeline.PipelinedStep` runs the stages on its own devices and joins
the transfers it sends or receives, so the plan's stages map to processes by their devices.

On a real cluster the same program runs under SLURM, Open MPI or Kubernetes:
:func:`initialize_distributed` then calls ``jax.distributed.initialize()``, which detects the
job's coordinator, size and rank itself.

Failure
-------
The launcher watches its processes. When one exits with an error or is killed, the launcher
names it (``process 1 (pid 4242) was killed by SIGKILL``), writes that to the job's status file
and stops the others: a watchdog thread in each process (started by
:func:`initialize_distributed`) reads the status file, prints the reason and exits with status
1 within a second, even while its main thread waits on a transfer from the lost process; a
process that does not stop is killed after :data:`GRACE_S` seconds. Outside the launcher,
``jax.distributed``'s heartbeats stop the job (``heartbeat_timeout_s``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from shardplan.errors import ConfigError, RuntimeFailure, format_error

__all__ = ["GRACE_S", "initialize_distributed", "launch"]

GRACE_S = 10.0
"""How long the launcher waits for the other processes to stop before it kills them."""

_ENV = "SHARDPLAN_"
COORDINATOR, NUM_PROCESSES, PROCESS_ID = (f"{_ENV}COORDINATOR", f"{_ENV}NUM_PROCESSES",
                                          f"{_ENV}PROCESS_ID")
TRANSFER_ADDRESS, CPU_DEVICES, STATUS_FILE = (f"{_ENV}TRANSFER_ADDRESS", f"{_ENV}CPU_DEVICES",
                                              f"{_ENV}STATUS_FILE")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on the loopback interface."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _watch(status_file: str, me: int) -> None:
    """Exits this process (status 1) once the launcher reports a lost process."""
    while True:
        time.sleep(0.2)
        try:
            with open(status_file) as f:
                reason = f.read().strip()
        except OSError:
            continue
        if reason:
            print(f"shardplan: process {me} stops: {reason}", file=sys.stderr, flush=True)
            os._exit(1)


def initialize_distributed(*, heartbeat_timeout_s: int = 30,
                           initialization_timeout_s: int = 120) -> None:
    """Joins the job this process belongs to; call it before anything touches jax devices.

    Under ``shardplan launch`` the job is described by the launcher's environment variables;
    elsewhere ``jax.distributed.initialize()`` detects it (SLURM, Open MPI, Kubernetes).

    Args:
      heartbeat_timeout_s: after how long without a heartbeat ``jax.distributed`` declares a
        process lost.
      initialization_timeout_s: how long to wait for every process to join.

    Raises:
      ConfigError: the launcher's environment variables are malformed.
    """
    import jax

    if COORDINATOR not in os.environ:
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_s,
                                   initialization_timeout=initialization_timeout_s)
        return
    try:
        num, me = int(os.environ[NUM_PROCESSES]), int(os.environ[PROCESS_ID])
        cpu_devices = int(os.environ.get(CPU_DEVICES) or 0)
    except (KeyError, ValueError) as e:
        raise ConfigError(format_error(
            "The launcher's environment is incomplete.", where=f"{_ENV}* variables",
            value={k: v for k, v in os.environ.items() if k.startswith(_ENV)},
            remedy="start the program with shardplan launch --nprocs N -- CMD")) from e
    if cpu_devices:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    if TRANSFER_ADDRESS in os.environ:
        jax.config.update("jax_cross_host_transfer_socket_address",
                          os.environ[TRANSFER_ADDRESS])
        jax.config.update("jax_cross_host_transport_addresses", "127.0.0.1:0")
    if os.environ.get(STATUS_FILE):
        threading.Thread(target=_watch, args=(os.environ[STATUS_FILE], me), daemon=True,
                         name="shardplan-watchdog").start()
    jax.distributed.initialize(coordinator_address=os.environ[COORDINATOR],
                               num_processes=num, process_id=me,
                               initialization_timeout=initialization_timeout_s,
                               heartbeat_timeout_seconds=heartbeat_timeout_s)


def _relay(stream: IO[bytes], prefix: str, out: IO[str]) -> None:
    for line in iter(stream.readline, b""):
        out.write(prefix + line.decode(errors="replace"))
        out.flush()


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def launch(command: Sequence[str], nprocs: int, *, cpu_devices: int = 0,
           grace_s: float = GRACE_S) -> int:
    """Runs ``command`` as ``nprocs`` processes of one ``jax.distributed`` job on this machine.

    Each process's output is relayed with a ``[pN]`` prefix. If one fails, the others are
    stopped (the module docstring).

    Args:
      command: the program and its arguments; it calls :func:`initialize_distributed`.
      nprocs: the number of processes.
      cpu_devices: CPU devices per process (0: jax's default).
      grace_s: how long stopped processes get before they are killed.

    Returns:
      0 when every process succeeded, else 1.

    Raises:
      ConfigError: no command, or a process count below 1.
      RuntimeFailure: the command cannot be started.
    """
    if not command:
        raise ConfigError(format_error("No command to launch.", where="launch command",
                                       remedy="shardplan launch --nprocs 2 -- python train.py"))
    if nprocs < 1 or cpu_devices < 0:
        raise ConfigError(format_error(
            "The process and device counts must be positive.", where="--nprocs/--cpu-devices",
            value=(nprocs, cpu_devices), remedy="e.g. --nprocs 2 --cpu-devices 4"))
    ports = _free_ports(nprocs + 1)
    fd, status_file = tempfile.mkstemp(prefix="shardplan-launch-", suffix=".status")
    os.close(fd)
    procs: list[subprocess.Popen[bytes]] = []
    relays: list[threading.Thread] = []
    try:
        for i in range(nprocs):
            env = dict(os.environ)
            env.update({COORDINATOR: f"127.0.0.1:{ports[0]}", NUM_PROCESSES: str(nprocs),
                        PROCESS_ID: str(i), TRANSFER_ADDRESS: f"127.0.0.1:{ports[1 + i]}",
                        CPU_DEVICES: str(cpu_devices), STATUS_FILE: status_file})
            try:
                p = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
            except OSError as e:
                raise RuntimeFailure(format_error(
                    "The command cannot be started.", where="launch command",
                    value=list(command), remedy=f"check the program's path ({e})")) from e
            procs.append(p)
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=_relay, args=(stream, f"[p{i}] ", out),
                                     daemon=True)
                t.start()
                relays.append(t)
        return _supervise(procs, status_file, grace_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for t in relays:
            t.join(timeout=5)
        os.unlink(status_file)


def _supervise(procs: list[subprocess.Popen[bytes]], status_file: str, grace_s: float) -> int:
    """Waits for the processes; on the first failure (or a signal to the launcher), stops the
    others and names it."""
    received: list[int] = []

    def note(signum: int, _frame: Any) -> None:
        received.append(signum)

    old = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed or received:
                if failed:
                    i, code = failed[0]
                    reason = f"process {i} (pid {procs[i].pid}) {_how(code)}"
                else:
                    reason = f"the launcher received {signal.Signals(received[0]).name}"
                print(f"shardplan launch: {reason}; stopping the others", file=sys.stderr,
                      flush=True)
                with open(status_file, "w") as f:
                    f.write(reason)
                deadline = time.monotonic() + grace_s
                while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                for j, p in enumerate(procs):
                    if p.poll() is None:
                        print(f"shardplan launch: process {j} did not stop; killing it",
                              file=sys.stderr, flush=True)
                        p.kill()
                        p.wait()
                    elif not failed or j != failed[0][0]:
                        print(f"shardplan launch: process {j} {_how(p.returncode)}",
                              file=sys.stderr, flush=True)
                return 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
