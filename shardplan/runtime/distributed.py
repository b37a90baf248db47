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

Output
------
Each process's lines are relayed with a ``[pN]`` prefix: standard output at once, standard
error after :data:`HOLD_S` seconds, in order per process, and everything before the launcher
exits. Standard error is held so that a failure reads cause first: when one process fails, its
peers fail too, in their next collective, with the transport's traceback (a gloo
``JaxRuntimeError``), often before the failing process has exited: ``jax.distributed``'s
shutdown at exit waits for them (30 s and more when a peer waits in a collective). So once a
process has begun to exit (under the launcher, :func:`initialize_distributed` has each process
say so), the *other* processes' standard error is held until its status is known (at most
:data:`EXITING_HOLD_S` seconds); its own is relayed as usual, so its error shows at once.

Failure
-------
The launcher watches its processes. When one exits with an error or is killed, the launcher
names it (``process 1 (pid 4242) was killed by SIGKILL``), then prints that process's held
output (its own error), writes the reason to the job's status file and stops the others: a
watchdog thread in each process (started by :func:`initialize_distributed`) reads the status
file, prints the reason and exits with status 1 within a second, even while its main thread
waits on a transfer from the lost process; a process that does not stop is killed after
:data:`GRACE_S` seconds. The others' standard error from then on (and what was still held of
it) goes to a log file whose path the launcher prints last; ``--verbose`` prints it instead.
The process named is the first to fail, by when it began to exit; among those that failed
within :data:`SETTLE_S` seconds of the first, one that exited with another status than a
transport failure gives (1, an uncaught exception; ``SIGABRT``) is named first (``shardplan``'s
own errors exit with status 2). Outside the launcher, ``jax.distributed``'s heartbeats stop the
job (``heartbeat_timeout_s``).

The launcher exits with status 0 when every process succeeded, else 1.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from shardplan.errors import ConfigError, RuntimeFailure, format_error

__all__ = ["EXITING_HOLD_S", "GRACE_S", "HOLD_S", "SETTLE_S", "initialize_distributed",
           "launch"]

GRACE_S = 10.0
"""How long the launcher waits for the other processes to stop before it kills them."""

HOLD_S = 0.5
"""How long the launcher holds each standard-error line before relaying it. A peer's transport
error comes milliseconds to a fraction of a second after the failing process exits; held lines
are still the launcher's to place when it learns of the failure."""

EXITING_HOLD_S = 60.0
"""While a process has begun to exit and its status is not known yet, the most a standard-error
line of another process is held. jax's own timeouts (30 s for a gloo rendezvous, the heartbeats)
decide how long a failing process waits in its exit for peers that wait on it, and when they
print their transport errors."""

SETTLE_S = 1.0
"""When the first process to fail exited as a transport failure leaves a peer (status 1 or
``SIGABRT``), how long the launcher waits for another to fail with a status that names a cause
(a ``shardplan`` error's 2, a kill) before it names one."""

_DRAIN_S = 2.0
"""How long the launcher waits for the rest of a failed process's output after its exit."""

_POLL_S = 0.1
"""How often the launcher looks for exit notices and for signals it received."""

_TRANSPORT_STATUSES = frozenset({1, -signal.SIGABRT})
"""Exit statuses a peer's failure leaves a process with: 1 from an uncaught exception (jax raises
the transport's error as a ``JaxRuntimeError``; the watchdog's exit), ``SIGABRT`` from a fatal
error in XLA's runtime. A process's own failure can end so too: it is named when it is first."""

_STOPS = "shardplan: process {} stops: "
"""The watchdog's line, which the launcher relays from every process."""

_ENV = "SHARDPLAN_"
COORDINATOR, NUM_PROCESSES, PROCESS_ID = (f"{_ENV}COORDINATOR", f"{_ENV}NUM_PROCESSES",
                                          f"{_ENV}PROCESS_ID")
TRANSFER_ADDRESS, CPU_DEVICES, STATUS_FILE = (f"{_ENV}TRANSFER_ADDRESS", f"{_ENV}CPU_DEVICES",
                                              f"{_ENV}STATUS_FILE")
EXIT_FILE = f"{_ENV}EXIT_FILE"


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
            print(_STOPS.format(me) + reason, file=sys.stderr, flush=True)
            os._exit(1)


def _announce_exit(exit_file: str) -> None:
    """Tells the launcher this process has begun to exit (an ``atexit`` hook that runs before
    ``jax.distributed``'s shutdown, which can wait long for the other processes)."""
    try:
        with open(exit_file, "w") as f:
            f.write(str(os.getpid()))
    except OSError:
        pass  # the launcher is gone or cleaned up: nobody to tell


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
    if os.environ.get(EXIT_FILE):
        # jax registered its shutdown when it was imported; hooks run last-registered first.
        atexit.register(_announce_exit, os.environ[EXIT_FILE])
    jax.distributed.initialize(coordinator_address=os.environ[COORDINATOR],
                               num_processes=num, process_id=me,
                               initialization_timeout=initialization_timeout_s,
                               heartbeat_timeout_seconds=heartbeat_timeout_s)


class _Relay:
    """The processes' output and exits, under one lock (``cond``).

    Standard output is written at once. Standard error is held: :data:`HOLD_S` seconds, or
    :data:`EXITING_HOLD_S` while another process that has begun to exit has no status yet, and
    from a failure until :meth:`name` places it: the named process's lines after the launcher's
    message, the others' to the log (to the terminal with ``verbose``).
    """

    def __init__(self, nprocs: int, *, out: IO[str], err: IO[str], verbose: bool) -> None:
        self.cond = threading.Condition()
        self.began: dict[int, float] = {}  # process -> monotonic time it began to exit
        self.ended: dict[int, tuple[float, int]] = {}  # process -> (monotonic time, status)
        self._out, self._err, self._verbose = out, err, verbose
        self._held: list[deque[tuple[float, str]]] = [deque() for _ in range(nprocs)]
        self._state = "live"  # -> "failed" (all held) -> "named" (routed) -> "closed"
        self._origin: int | None = None
        self._log: IO[str] | None = None
        self.log_path: str | None = None

    def line(self, i: int, from_stderr: bool, text: str) -> None:
        """A line process ``i`` wrote (its relay threads call this)."""
        text = f"[p{i}] {text}" if text.endswith("\n") else f"[p{i}] {text}\n"
        if not from_stderr:
            _write(self._out, text)  # outside the lock: a slow reader holds up no decision
            return
        with self.cond:
            if self._state in ("named", "closed"):
                self._route(i, text)
            else:
                self._held[i].append((time.monotonic(), text))
                self.cond.notify_all()

    def end(self, i: int, code: int) -> None:
        """Process ``i`` ended with ``code`` (its waiter thread calls this)."""
        with self.cond:
            now = time.monotonic()
            self.ended[i] = (now, code)
            self.began.setdefault(i, now)
            if code != 0 and self._state == "live":
                self._state = "failed"
            self.cond.notify_all()

    def say(self, message: str) -> None:
        """Writes the launcher's own line to the terminal's standard error."""
        with self.cond:
            _write(self._err, message + "\n")

    def pump(self) -> None:
        """Writes held lines as they fall due (a thread), until :meth:`close`."""
        with self.cond:
            while self._state != "closed":
                self.cond.wait(timeout=self._release_due())

    def _release_due(self) -> float | None:
        """Writes the due held lines, oldest first; returns the seconds until the next is due."""
        if self._state != "live":
            return None
        exiting = {i for i in self.began if i not in self.ended}
        hold_s = [EXITING_HOLD_S if exiting - {i} else HOLD_S for i in range(len(self._held))]
        while heads := [(q[0][0] + hold_s[i], i) for i, q in enumerate(self._held) if q]:
            due_s, i = min(heads)
            if due_s > time.monotonic():
                return due_s - time.monotonic()
            _write(self._err, self._held[i].popleft()[1])
        return None

    def name(self, origin: int | None, drain: Callable[[], None]) -> None:
        """Places the held lines after the launcher's message: ``origin``'s (its whole output:
        ``drain`` waits for it) to the terminal, the others' routed (all to the terminal when
        ``origin`` is None: the launcher itself was stopped)."""
        drain()
        with self.cond:
            self._origin, self._state = origin, "named"
            if origin is not None:
                for _, text in self._held[origin]:
                    _write(self._err, text)
                self._held[origin].clear()
            self._route_held()

    def close(self) -> str | None:
        """Writes what is still held and stops the pump; returns the log's path, if written."""
        with self.cond:
            if self._state == "live":
                self._release_all()
            else:
                self._route_held()
            self._state = "closed"
            self.cond.notify_all()
            if self._log is not None:
                self._log.close()
                self._log = None
            return self.log_path

    def _release_all(self) -> None:
        lines = sorted((t, i, text) for i, q in enumerate(self._held) for t, text in q)
        for q in self._held:
            q.clear()
        for _, _, text in lines:
            _write(self._err, text)

    def _route_held(self) -> None:
        lines = sorted((t, i, text) for i, q in enumerate(self._held) for t, text in q)
        for q in self._held:
            q.clear()
        for _, i, text in lines:
            self._route(i, text)

    def _route(self, i: int, text: str) -> None:
        """After a failure: ``text`` (from process ``i``'s standard error) to the terminal when
        ``i`` failed first (or nobody did), with ``verbose``, or when it is the watchdog's line;
        else to the log."""
        shown = (self._origin is None or i == self._origin or self._verbose
                 or self._state == "closed" or text.startswith(f"[p{i}] {_STOPS.format(i)}"))
        if shown:
            _write(self._err, text)
            return
        if self._log is None:
            fd, self.log_path = tempfile.mkstemp(prefix="shardplan-launch-", suffix=".log")
            self._log = os.fdopen(fd, "w", encoding="utf-8")
        _write(self._log, text)


def _write(stream: IO[str], text: str) -> None:
    stream.write(text)
    stream.flush()


def _read(stream: IO[bytes], i: int, from_stderr: bool, relay: _Relay) -> None:
    for line in iter(stream.readline, b""):
        relay.line(i, from_stderr, line.decode(errors="replace"))


def _wait(p: subprocess.Popen[bytes], i: int, relay: _Relay) -> None:
    relay.end(i, p.wait())


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _origin(began: Mapping[int, float], ended: Mapping[int, tuple[float, int]]) -> int | None:
    """The process to name for a failure: the first to fail, by when it began to exit (else
    when it ended); among those within :data:`SETTLE_S` of it, one whose status is not a
    transport failure's first. None when none failed.

    Example: process 1 ended with 1 (a gloo error) at 5.0 s; process 0 began to exit at 5.3 s
    and ended with 2 at 5.4 s: ``_origin({0: 5.3, 1: 5.0}, {0: (5.4, 2), 1: (5.0, 1)}) == 0``.
    """
    failed = {i: code for i, (_, code) in ended.items() if code != 0}
    if not failed:
        return None
    when = {i: began.get(i, ended[i][0]) for i in failed}
    first_s = min(when.values())
    near = [i for i in failed if when[i] <= first_s + SETTLE_S]
    return min(near, key=lambda i: (failed[i] in _TRANSPORT_STATUSES, when[i], i))


def launch(command: Sequence[str], nprocs: int, *, cpu_devices: int = 0,
           grace_s: float = GRACE_S, verbose: bool = False) -> int:
    """Runs ``command`` as ``nprocs`` processes of one ``jax.distributed`` job on this machine.

    Each process's output is relayed with a ``[pN]`` prefix to ``sys.stdout`` / ``sys.stderr``
    (as they are when called). If one fails, it is named, its own output follows, and the others
    are stopped (the module docstring).

    Args:
      command: the program and its arguments; it calls :func:`initialize_distributed`.
      nprocs: the number of processes.
      cpu_devices: CPU devices per process (0: jax's default).
      grace_s: how long stopped processes get before they are killed.
      verbose: after a failure, also print the other processes' standard error (their
        transport errors), not only write it to the log.

    Returns:
      0 when every process succeeded, else 1.

    Raises:
      ConfigError: no command, or a process count below 1.
      RuntimeFailure: the command cannot be started.

    Example::

        launch([sys.executable, "-c", "print('hi')"], 2)  # [p0] hi, [p1] hi; returns 0
    """
    if not command:
        raise ConfigError(format_error("No command to launch.", where="launch command",
                                       remedy="shardplan launch --nprocs 2 -- python train.py"))
    if nprocs < 1 or cpu_devices < 0:
        raise ConfigError(format_error(
            "The process and device counts must be positive.", where="--nprocs/--cpu-devices",
            value=(nprocs, cpu_devices), remedy="e.g. --nprocs 2 --cpu-devices 4"))
    ports = _free_ports(nprocs + 1)
    job_dir = tempfile.mkdtemp(prefix="shardplan-launch-")
    status_file = os.path.join(job_dir, "status")
    exit_files = [os.path.join(job_dir, f"exiting-{i}") for i in range(nprocs)]
    relay = _Relay(nprocs, out=sys.stdout, err=sys.stderr, verbose=verbose)
    pump = threading.Thread(target=relay.pump, daemon=True, name="shardplan-launch-relay")
    pump.start()
    procs: list[subprocess.Popen[bytes]] = []
    readers: list[list[threading.Thread]] = []
    try:
        for i in range(nprocs):
            env = dict(os.environ)
            env.update({COORDINATOR: f"127.0.0.1:{ports[0]}", NUM_PROCESSES: str(nprocs),
                        PROCESS_ID: str(i), TRANSFER_ADDRESS: f"127.0.0.1:{ports[1 + i]}",
                        CPU_DEVICES: str(cpu_devices), STATUS_FILE: status_file,
                        EXIT_FILE: exit_files[i]})
            try:
                p = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
            except OSError as e:
                raise RuntimeFailure(format_error(
                    "The command cannot be started.", where="launch command",
                    value=list(command), remedy=f"check the program's path ({e})")) from e
            procs.append(p)
            readers.append([threading.Thread(target=_read, args=(s, i, s is p.stderr, relay),
                                             daemon=True) for s in (p.stdout, p.stderr)])
            for t in [*readers[i], threading.Thread(target=_wait, args=(p, i, relay),
                                                    daemon=True)]:
                t.start()
        return _supervise(procs, relay, readers, exit_files, status_file, grace_s)
    finally:
        for i, p in enumerate(procs):
            if i not in relay.ended:
                p.kill()
                p.wait()
        for t in (t for pair in readers for t in pair):
            t.join(timeout=5)
        log_path = relay.close()
        pump.join(timeout=5)
        if log_path is not None:
            relay.say("shardplan launch: the other processes' output after the failure: "
                      f"{log_path} (--verbose prints it)")
        shutil.rmtree(job_dir, ignore_errors=True)


def _supervise(procs: list[subprocess.Popen[bytes]], relay: _Relay,
               readers: list[list[threading.Thread]], exit_files: list[str], status_file: str,
               grace_s: float) -> int:
    """Waits for the processes; on the first failure (or a signal to the launcher), names it,
    stops the others and returns 1; returns 0 when all succeeded."""
    received: list[int] = []

    def note(signum: int, _frame: Any) -> None:
        received.append(signum)

    old = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with relay.cond:
            while not received and all(c == 0 for _, c in relay.ended.values()):
                if len(relay.ended) == len(procs):
                    return 0
                _look_for_notices(relay, exit_files)
                relay.cond.wait(timeout=_POLL_S)
            if not received:
                _settle(relay, exit_files)
            origin = _origin(relay.began, relay.ended)
        if origin is not None:
            reason = f"process {origin} (pid {procs[origin].pid}) {_how(relay.ended[origin][1])}"
        else:
            reason = f"the launcher received {signal.Signals(received[0]).name}"
        relay.say(f"shardplan launch: {reason}; stopping the others")
        with open(status_file, "w") as f:
            f.write(reason)

        def drain() -> None:
            for t in readers[origin] if origin is not None else ():
                t.join(timeout=_DRAIN_S)

        relay.name(origin, drain)
        _stop(procs, relay, origin, grace_s)
        return 1
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _look_for_notices(relay: _Relay, exit_files: list[str]) -> None:
    """Notes the processes that have begun to exit (:func:`_announce_exit`); called with
    ``relay.cond`` held."""
    for i, path in enumerate(exit_files):
        if i not in relay.began and os.path.exists(path):
            relay.began[i] = time.monotonic()
            relay.cond.notify_all()


def _settle(relay: _Relay, exit_files: list[str]) -> None:
    """While every failure so far is a transport failure's status, waits up to
    :data:`SETTLE_S` for one with another status (the cause) or for every process to end.
    Called with ``relay.cond`` held."""
    deadline = time.monotonic() + SETTLE_S
    while (len(relay.ended) < len(exit_files)
           and all(c in _TRANSPORT_STATUSES for _, c in relay.ended.values() if c != 0)
           and (left_s := deadline - time.monotonic()) > 0):
        _look_for_notices(relay, exit_files)
        relay.cond.wait(timeout=min(left_s, _POLL_S))


def _stop(procs: list[subprocess.Popen[bytes]], relay: _Relay, origin: int | None,
          grace_s: float) -> None:
    """Waits ``grace_s`` for the others to stop (their watchdogs), kills those that did not, and
    says how each ended."""
    with relay.cond:
        deadline = time.monotonic() + grace_s
        while len(relay.ended) < len(procs) and (left_s := deadline - time.monotonic()) > 0:
            relay.cond.wait(timeout=left_s)
    for j, p in enumerate(procs):
        if j == origin:
            continue
        if j not in relay.ended:
            relay.say(f"shardplan launch: process {j} did not stop; killing it")
            p.kill()
            p.wait()
        else:
            relay.say(f"shardplan launch: process {j} {_how(relay.ended[j][1])}")
