"""``shardplan`` command line: one subcommand per pipeline entry point.

Subcommands:
  trace       trace a train step into an op graph and print its summary.
  plan        plan a train step on a cluster and print (or save) the plan.
  calibrate   measure the local devices and write a calibrated device YAML.
  launch      run a command as N local processes of one jax.distributed job.
  train       train a model as a YAML config says (plan, run, checkpoint, evaluate).
  show        print a saved plan in the terminal; with --html also write the HTML report.

``trace`` and ``plan`` take a model preset (``gpt-tiny``), a model YAML, or the user's own step
as ``path/to/file.py:factory`` or ``package.module:factory``: a factory callable with no
arguments that returns ``(train_step, state, batch)`` (see :func:`load_step`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from shardplan.cli.target import STEP_SHAPE, is_step_target, load_step
from shardplan.errors import ConfigError, ShardplanError, format_error

if TYPE_CHECKING:
    from shardplan.cluster import Cluster
    from shardplan.train._lock import RunLock
    from shardplan.train.config import RunConfig

__all__ = ["CalibrateConfig", "PlanCommandConfig", "ShowConfig", "TraceConfig",
           "calibrate_main", "load_step", "main", "plan_main", "show_main", "trace_main"]

# -------------------------------------------------------------------------------------------
# trace and plan


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """Options of ``shardplan trace``.

    Attributes:
      model: a model preset name (``gpt-tiny``), a path to a model YAML, or a step factory
        (``path/to/file.py:factory``, ``package.module:factory``; see :func:`load_step`).
      batch: global batch size (sequences; presets only, default 8).
      seq_len: sequence length (default: the model's ``max_seq_len``; presets only).
      scan_layers: override the model's ``scan_layers`` (presets only).
      abstract: trace on ``ShapeDtypeStruct``s only (never allocates; for large models;
        presets only: a factory's state is what it returns).
    """

    model: str
    batch: int | None = None
    seq_len: int | None = None
    scan_layers: bool | None = None
    abstract: bool = True


@dataclasses.dataclass(frozen=True)
class _Step:
    """A traced-or-planned step and how to describe it."""

    train_step: Callable[..., Any]
    state: Any
    batch: Any
    describe: Callable[[Any], str]  # the first line, given the traced op graph (or None)
    built_s: float


def _build_step(config: TraceConfig) -> _Step:
    """The step ``config.model`` names: a preset's reference step, or the user's factory."""
    import jax

    start = time.perf_counter()
    if is_step_target(config.model):
        preset_only = {"--batch": config.batch is not None, "--seq-len": config.seq_len is not None,
                       "--scan/--loop": config.scan_layers is not None,
                       "--concrete": not config.abstract}
        given = [flag for flag, set_ in preset_only.items() if set_]
        if given:
            raise ConfigError(format_error(
                f"{', '.join(given)} applies to model presets and YAML files; a step factory "
                "builds its own state and batch.", where=config.model, value=given,
                remedy="drop the option, or change the factory"))
        train_step, state, batch = load_step(config.model)
        leaves = jax.tree.leaves(batch)
        samples = getattr(leaves[0], "shape", (None,))[:1] if leaves else ()

        def describe(graph: Any) -> str:
            size = f"batch {samples[0]} samples" if samples else "no batch arrays"
            params = f"{graph.num_params:,} parameters; " if graph is not None else ""
            return f"step {config.model}: {params}{size}"

        return _Step(train_step, state, batch, describe, time.perf_counter() - start)
    if config.model.endswith(".py"):
        raise ConfigError(format_error(
            "A Python file needs the name of its step factory after a colon.",
            where="the model argument", value=config.model,
            remedy=f"{config.model}:make_step (a function with no arguments that returns "
                   f"{STEP_SHAPE}); or a model preset or model YAML"))
    import shardplan_models as models
    overrides = {} if config.scan_layers is None else {"scan_layers": config.scan_layers}
    model_config = models.load_model_config(config.model, overrides=overrides)
    if config.abstract:
        graphdef, state = models.abstract_train_state(model_config)
    else:
        graphdef, state = models.init_train_state(model_config)
    size = config.batch or 8
    batch = models.example_batch(model_config, size, seq_len=config.seq_len,
                                 abstract=config.abstract)
    line = (f"model {config.model}: {model_config.num_params():,} parameters; "
            f"batch {size} x {config.seq_len or model_config.max_seq_len} tokens")
    return _Step(models.make_train_step(graphdef), state, batch, lambda _: line,
                 time.perf_counter() - start)


def trace_main(config: TraceConfig) -> int:
    """Traces the step ``config.model`` names (a preset's reference step or the user's
    factory) and prints the op-graph summary."""
    import jax

    from shardplan.trace import trace

    step = _build_step(config)
    start = time.perf_counter()
    graph = trace(step.train_step, step.state, step.batch)
    traced_s = time.perf_counter() - start
    print(f"{step.describe(graph)}; jax {jax.__version__} on {jax.devices()[0].platform}")
    print(f"built the (abstract) state in {step.built_s:.2f} s, traced in {traced_s:.2f} s")
    print()
    print(graph.summary())
    return 0


@dataclasses.dataclass(frozen=True)
class PlanCommandConfig:
    """Options of ``shardplan plan``.

    Attributes:
      target: what to plan, as :class:`TraceConfig` takes it.
      cluster: a cluster YAML (``configs/clusters/*.yaml``): planned as described, no devices
        needed.
      types: the local devices, emulating these device types (catalog name -> count, on
        consecutive devices; ``shardplan train``'s ``cluster.local.types``). With neither,
        the local devices as they are.
      out: also save the plan here (``shardplan show`` draws it).
    """

    target: TraceConfig
    cluster: str | None = None
    types: dict[str, int] | None = None
    out: str | None = None


def plan_main(config: PlanCommandConfig) -> int:
    """Plans the step ``config.target`` names on the cluster and prints the plan's summary."""
    import jax

    from shardplan.api.wiring import make_plan

    cluster = _plan_cluster(config)
    step = _build_step(config.target)
    start = time.perf_counter()
    plan = make_plan(step.train_step, step.state, step.batch, cluster=cluster)
    planned_s = time.perf_counter() - start
    print(f"{step.describe(None)}; jax {jax.__version__}")
    print(cluster.summary().splitlines()[0])
    if config.types and jax.default_backend() == "cpu":
        print("note: the device types are emulated on CPU devices; the plan is made for "
              f"{config.types}")
    print(f"built the state in {step.built_s:.2f} s, planned in {planned_s:.2f} s")
    print()
    print(plan.summary())
    if config.out:
        print(f"wrote {plan.save(config.out)} (shardplan show {config.out} draws it)")
    return 0


def _plan_cluster(config: PlanCommandConfig) -> Cluster:
    """The cluster to plan on: the YAML as described, or the local devices (typed)."""
    from shardplan.cluster import Cluster

    if config.cluster is not None:
        return Cluster.from_yaml(config.cluster)
    if config.types:
        import os

        import jax

        # On CPU, make as many devices as the types name (a GPU backend ignores it). Once the
        # backend is up this raises; Cluster.local then says if the count differs.
        if "device_count" not in os.environ.get("XLA_FLAGS", ""):
            with contextlib.suppress(RuntimeError):
                jax.config.update("jax_num_cpu_devices", sum(config.types.values()))
    return Cluster.local(types=config.types)


def _parse_types(text: str) -> dict[str, int]:
    """``a100-80g=4,v100-32g=4`` -> ``{"a100-80g": 4, "v100-32g": 4}``."""
    out: dict[str, int] = {}
    for item in text.split(","):
        name, eq, count = item.strip().partition("=")
        if not eq or not name or not count.strip().isdigit() or int(count) < 1:
            raise ConfigError(format_error(
                "--types takes device types and counts as NAME=COUNT,NAME=COUNT.",
                where="--types", value=text, remedy="e.g. --types a100-80g=4,v100-32g=4"))
        out[name.strip()] = int(count)
    return out


@dataclasses.dataclass(frozen=True)
class CalibrateConfig:
    """Options of ``shardplan calibrate``.

    Attributes:
      quick: small benchmark sizes (seconds on a CPU; too small to load a GPU).
      device: the catalog entry to start from; default the local devices' type.
      out: the YAML file to write; default ``calibrated/<device>.yaml``.
    """

    quick: bool = False
    device: str | None = None
    out: str | None = None


def calibrate_main(config: CalibrateConfig) -> int:
    """Runs the micro-benchmarks of :mod:`shardplan.cost.calibrate`, prints and writes them."""
    from shardplan.cost.calibrate import calibrate, write_device_yaml

    start = time.perf_counter()
    calibration = calibrate(device=config.device, quick=config.quick)
    path = write_device_yaml(calibration,
                             config.out or f"calibrated/{calibration.base.name}.yaml")
    print(calibration.summary())
    print(f"wrote {path} in {time.perf_counter() - start:.1f} s")
    return 0


def _local_device_count(config: RunConfig) -> int | None:
    """How many local devices the run's cluster section asks for (None: whatever jax has)."""
    section = config.cluster
    if section.local is not None:
        return int(sum(section.local.types.values())) if section.local.types else None
    if section.path:
        from shardplan.cluster import Cluster

        return Cluster.from_yaml(section.path).num_devices
    return None


def _cpu_devices(config: RunConfig) -> int | None:
    """How many CPU devices this process makes (on CPU the devices are emulated; a GPU backend
    ignores it): the cluster's, split evenly over the processes under ``shardplan launch``
    unless it was given ``--cpu-devices``; None leaves jax's choice (XLA_FLAGS set, or a
    cluster without a device count).

    Raises:
      ConfigError: the cluster's devices do not split evenly over the processes.
    """
    import os

    from shardplan.runtime.distributed import CPU_DEVICES, NUM_PROCESSES

    wanted = _local_device_count(config)
    if not wanted or "device_count" in os.environ.get("XLA_FLAGS", ""):
        return None
    processes = int(os.environ.get(NUM_PROCESSES) or 1)
    if processes == 1:
        return wanted
    if int(os.environ.get(CPU_DEVICES) or 0):
        return None  # the launcher's --cpu-devices decides
    if wanted % processes:
        from shardplan.errors import ConfigError, format_error

        raise ConfigError(format_error(
            "The cluster's devices do not split evenly over the processes.",
            where="cluster (shardplan launch --nprocs)",
            value={"devices": wanted, "processes": processes},
            remedy=f"launch a divisor of {wanted} processes, or give --cpu-devices"))
    return wanted // processes


def train_main(path: str, overrides: Sequence[str]) -> int:
    """``shardplan train config.yaml [--section.key=value ...]``."""
    import os

    from shardplan.train.config import load_run_config

    config = load_run_config(path, overrides)
    from shardplan.runtime.distributed import PROCESS_ID
    from shardplan.train._lock import RunLock

    # Process 0 locks the run directory first, so that a second run on it is refused before
    # the model code loads; train() checks the lock is on output.dir.
    lock = (RunLock(config.output.dir).acquire()
            if int(os.environ.get(PROCESS_ID) or 0) == 0 else None)
    try:
        return _train(config, lock)
    finally:
        if lock is not None:
            lock.release()


def _train(config: RunConfig, lock: RunLock | None) -> int:
    """:func:`train_main` once the run directory is locked (by process 0)."""
    import os

    import jax

    from shardplan.runtime.distributed import NUM_PROCESSES, initialize_distributed

    devices = _cpu_devices(config)
    if devices:
        jax.config.update("jax_num_cpu_devices", devices)
    if os.environ.get(NUM_PROCESSES):
        initialize_distributed()  # under `shardplan launch`: one process of the job
    from shardplan.train.loop import RunStopped, train

    local = config.cluster.local
    main_process = jax.process_index() == 0
    if jax.default_backend() == "cpu" and local is not None and local.types and main_process:
        print("note: the device types are emulated on CPU devices; the plan is made for "
              f"{dict(local.types)}, and CPU timings say nothing about them")
    try:
        result = train(config, progress=sys.stderr.isatty(), lock=lock)
    except RunStopped as stop:  # SIGINT / SIGTERM: one line, the shell's exit status
        print(f"shardplan train: {stop}", file=sys.stderr, flush=True)
        return stop.exit_code
    if not main_process:
        return 0
    first = result.val_losses.get(result.first_step)
    last = result.val_losses.get(result.last_step)
    line = f"trained steps {result.first_step}..{result.last_step} in {result.run_dir}"
    if first is not None and last is not None:
        line += f"; validation loss {first:.4f} -> {last:.4f} ({last / first:.0%} of the first)"
    print(line)
    return 0


@dataclasses.dataclass(frozen=True)
class ShowConfig:
    """Options of ``shardplan show``.

    Attributes:
      plan: the plan file (``plan.save`` / ``shardplan train`` wrote it).
      html: also write the self-contained HTML report here (a file in an existing directory).
      width: columns of the terminal view (at least ``viz.terminal.MIN_WIDTH``, 40).
    """

    plan: str
    html: str | None = None
    width: int = 100


def show_main(config: ShowConfig) -> int:
    """Prints the terminal view of a saved plan (:mod:`shardplan.viz.terminal`), and with
    ``config.html`` writes the HTML report and prints its path.

    Raises:
      ConfigError: a width below the view's minimum (``--width``), a plan file that cannot be
        read or is not a valid plan, an HTML path that cannot be written; checked before
        anything is printed.
    """
    from shardplan.plan import load_plan
    from shardplan.viz.terminal import check_width, show

    check_width(config.width, where="shardplan show --width")
    plan = load_plan(config.plan)
    report = None
    if config.html:
        from shardplan.viz.html import write_html

        report = write_html(plan, config.html)  # first: a path it cannot write fails early
    show(plan, width=config.width)
    if report is not None:
        print(f"wrote {report}")
    return 0


def _target_arguments(p: argparse.ArgumentParser) -> None:
    """The step to trace or plan, and the options of a preset's."""
    p.add_argument("model", help="model preset name, model YAML path, or the user's step as "
                                 "path/to/file.py:factory or package.module:factory (a "
                                 f"function with no arguments returning {STEP_SHAPE})")
    p.add_argument("--batch", type=int, default=None,
                   help="global batch size (default 8; presets only)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (presets only)")
    scan = p.add_mutually_exclusive_group()
    scan.add_argument("--scan", dest="scan_layers", action="store_true", default=None,
                      help="scan over stacked blocks (nnx.scan; presets only)")
    scan.add_argument("--loop", dest="scan_layers", action="store_false",
                      help="Python loop over blocks (presets only)")
    p.add_argument("--concrete", dest="abstract", action="store_false",
                   help="initialise real arrays instead of tracing abstractly (presets only)")


def _trace_config(args: argparse.Namespace) -> TraceConfig:
    return TraceConfig(model=args.model, batch=args.batch, seq_len=args.seq_len,
                       scan_layers=args.scan_layers, abstract=args.abstract)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardplan", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("trace", help="trace a train step and print its op graph")
    _target_arguments(p)
    pp = sub.add_parser("plan", help="plan a train step on a cluster and print the plan")
    _target_arguments(pp)
    where = pp.add_mutually_exclusive_group()
    where.add_argument("--cluster", default=None, metavar="CLUSTER.yaml",
                       help="a cluster YAML (configs/clusters/), planned as described")
    where.add_argument("--types", default=None, metavar="NAME=COUNT,...",
                       help="the local devices emulating these device types, e.g. "
                            "a100-80g=4,v100-32g=4 (default: the local devices as they are)")
    pp.add_argument("--out", default=None, metavar="PLAN.json",
                    help="also save the plan (shardplan show draws it)")
    c = sub.add_parser("calibrate", help="benchmark the local devices, write a device YAML")
    c.add_argument("--quick", action="store_true", help="small sizes (seconds on CPU)")
    c.add_argument("--device", default=None,
                   help="catalog device to start from (default: the local device type)")
    c.add_argument("--out", default=None,
                   help="output YAML (default calibrated/<device>.yaml)")
    lp = sub.add_parser("launch", help="run a command as N local jax.distributed processes")
    lp.add_argument("--nprocs", type=int, required=True, help="number of processes")
    lp.add_argument("--cpu-devices", type=int, default=0,
                    help="CPU devices per process (default: jax's)")
    lp.add_argument("--verbose", action="store_true",
                    help="after a failure, also print the other processes' errors (their "
                         "transport errors; without it they go to a log file it names)")
    lp.add_argument("cmd", nargs=argparse.REMAINDER,
                    help="-- then the command, which calls shardplan.initialize_distributed()")
    tp = sub.add_parser("train", help="train as a YAML config says (configs/train/*.yaml)")
    tp.add_argument("config", help="the run's YAML file")
    tp.add_argument("overrides", nargs=argparse.REMAINDER,
                    help="dotted overrides, e.g. --train.steps=200 --output.dir=runs/x")
    sh = sub.add_parser("show", help="print a saved plan; --html writes the HTML report")
    sh.add_argument("plan", help="the plan's JSON file")
    sh.add_argument("--html", default=None, metavar="REPORT.html",
                    help="also write the self-contained HTML report to this file")
    sh.add_argument("--width", type=int, default=100, help="columns (default 100)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardplan`` command."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "trace":
            return trace_main(_trace_config(args))
        if args.command == "plan":
            types = _parse_types(args.types) if args.types is not None else None
            return plan_main(PlanCommandConfig(target=_trace_config(args),
                                               cluster=args.cluster, types=types,
                                               out=args.out))
        if args.command == "calibrate":
            return calibrate_main(CalibrateConfig(quick=args.quick, device=args.device,
                                                  out=args.out))
        if args.command == "launch":
            from shardplan.runtime.distributed import launch

            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            return launch(cmd, args.nprocs, cpu_devices=args.cpu_devices,
                          verbose=args.verbose)
        if args.command == "train":
            return train_main(args.config, args.overrides)
        if args.command == "show":
            return show_main(ShowConfig(plan=args.plan, html=args.html, width=args.width))
    except ShardplanError as e:
        print(f"shardplan {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a run's own handling (train_main has its own)
        print(f"shardplan {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    return 1


if __name__ == "__main__":
    sys.exit(main())
