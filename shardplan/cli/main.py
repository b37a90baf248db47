"""``shardplan`` command line: one subcommand per pipeline entry point.

Subcommands:
  trace       trace a model's train step into an op graph and print its summary.
  calibrate   measure the local devices and write a calibrated device YAML.
  launch      run a command as N local processes of one jax.distributed job.
  train       train a model as a YAML config says (plan, run, checkpoint, evaluate).
  show        print a saved plan in the terminal; with --html also write the HTML report.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shardplan.errors import ShardplanError

if TYPE_CHECKING:
    from shardplan.train.config import RunConfig

__all__ = ["CalibrateConfig", "ShowConfig", "TraceConfig", "calibrate_main", "main",
           "show_main", "trace_main"]


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """Options of ``shardplan trace``.

    Attributes:
      model: a model preset name (``gpt-tiny``) or a path to a model YAML.
      batch: global batch size (sequences).
      seq_len: sequence length (default: the model's ``max_seq_len``).
      scan_layers: override the model's ``scan_layers``.
      abstract: trace on ``ShapeDtypeStruct``s only (never allocates; for large models).
    """

    model: str
    batch: int = 8
    seq_len: int | None = None
    scan_layers: bool | None = None
    abstract: bool = True


def trace_main(config: TraceConfig) -> int:
    """Traces the reference train step of ``config.model`` and prints the op-graph summary."""
    import jax

    import models
    from shardplan.trace import trace

    overrides = {} if config.scan_layers is None else {"scan_layers": config.scan_layers}
    model_config = models.load_model_config(config.model, overrides=overrides)
    start = time.perf_counter()
    if config.abstract:
        graphdef, state = models.abstract_train_state(model_config)
    else:
        graphdef, state = models.init_train_state(model_config)
    batch = models.example_batch(model_config, config.batch, seq_len=config.seq_len,
                                 abstract=config.abstract)
    built = time.perf_counter()
    graph = trace(models.make_train_step(graphdef), state, batch)
    done = time.perf_counter()
    print(f"model {config.model}: {model_config.num_params():,} parameters; "
          f"batch {config.batch} x {config.seq_len or model_config.max_seq_len} tokens; "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")
    print(f"built the (abstract) state in {built - start:.2f} s, traced in {done - built:.2f} s")
    print()
    print(graph.summary())
    return 0


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

    import jax

    from shardplan.train.config import load_run_config

    config = load_run_config(path, overrides)
    from shardplan.runtime.distributed import NUM_PROCESSES, initialize_distributed

    devices = _cpu_devices(config)
    if devices:
        jax.config.update("jax_num_cpu_devices", devices)
    if os.environ.get(NUM_PROCESSES):
        initialize_distributed()  # under `shardplan launch`: one process of the job
    from shardplan.train.loop import train

    local = config.cluster.local
    main_process = jax.process_index() == 0
    if jax.default_backend() == "cpu" and local is not None and local.types and main_process:
        print("note: the device types are emulated on CPU devices; the plan is made for "
              f"{dict(local.types)}, and CPU timings say nothing about them")
    result = train(config, progress=sys.stderr.isatty())
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
      html: also write the self-contained HTML report here.
      width: columns of the terminal view.
    """

    plan: str
    html: str | None = None
    width: int = 100


def show_main(config: ShowConfig) -> int:
    """Prints the terminal view of a saved plan (:mod:`shardplan.viz.terminal`), and with
    ``config.html`` writes the HTML report and prints its path."""
    from shardplan.plan import load_plan
    from shardplan.viz.terminal import show

    plan = load_plan(config.plan)
    show(plan, width=config.width)
    if config.html:
        from shardplan.viz.html import write_html

        print(f"wrote {write_html(plan, config.html)}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardplan", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("trace", help="trace a model's train step and print its op graph")
    p.add_argument("model", help="model preset name or model YAML path")
    p.add_argument("--batch", type=int, default=8, help="global batch size (default 8)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length")
    scan = p.add_mutually_exclusive_group()
    scan.add_argument("--scan", dest="scan_layers", action="store_true", default=None,
                      help="scan over stacked blocks (nnx.scan)")
    scan.add_argument("--loop", dest="scan_layers", action="store_false",
                      help="Python loop over blocks")
    p.add_argument("--concrete", dest="abstract", action="store_false",
                   help="initialise real arrays instead of tracing abstractly")
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
            return trace_main(TraceConfig(model=args.model, batch=args.batch,
                                          seq_len=args.seq_len, scan_layers=args.scan_layers,
                                          abstract=args.abstract))
        if args.command == "calibrate":
            return calibrate_main(CalibrateConfig(quick=args.quick, device=args.device,
                                                  out=args.out))
        if args.command == "launch":
            from shardplan.runtime.distributed import launch

            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            return launch(cmd, args.nprocs, cpu_devices=args.cpu_devices)
        if args.command == "train":
            return train_main(args.config, args.overrides)
        if args.command == "show":
            return show_main(ShowConfig(plan=args.plan, html=args.html, width=args.width))
    except ShardplanError as e:
        print(f"shardplan {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
