"""``shardplan train``: a config-driven training run over a planned step.

One run: build the model and optimizer from the config, load the data, plan the step for the
cluster (or load a plan file, checked against the step), bind it with :func:`sp.apply_plan`,
resume from the latest checkpoint if there is one (restored straight into this plan's layout,
whatever plan wrote it), then train: a progress bar with loss, tokens/s and ETA, evaluation
every ``train.eval_every`` steps, ``metrics.jsonl``, checkpoints every
``output.checkpoint_every`` steps and at the end, and a short text sample from the model.

The run directory (``output.dir``) holds ``config.yaml`` (resolved: every default written
out), ``plan.json`` (rewritten with XLA's compiled figures and the measured step times once
recorded), ``report.txt`` (the plan's summary and predicted | compiled | measured),
``metrics.jsonl`` and ``checkpoints/``.

Batch ``k`` is a pure function of the data seed and ``k``, the optimizer's schedule counts in
the state, and the checkpoint holds the state and the step: a run stopped at step ``n`` and
resumed continues exactly as an uninterrupted run would.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import shardplan_models as models
from flax import nnx
from jax.extend.core import Var

from shardplan.api.wiring import apply_plan, check_plan, make_plan
from shardplan.cluster import Cluster
from shardplan.data import Dataset, abstract_batch, load_data
from shardplan.errors import (
    ConfigError,
    InfeasibleError,
    RuntimeFailure,
    format_error,
)
from shardplan.plan import Plan, load_plan
from shardplan.planner.memory import check_state_fits, state_bytes
from shardplan.planner.multi import memory_budget
from shardplan.runtime.spmd import state_shardings
from shardplan.trace.dtypes import itemsize
from shardplan.train._hosts import everywhere, from_main, is_main
from shardplan.train._lock import RunLock
from shardplan.train._resume import Resume, move_aside, resume
from shardplan.train._signals import RunStopped, Signals, Stop, stopped
from shardplan.train.checkpoint import Checkpointer, abstract_target
from shardplan.train.config import RunConfig

__all__ = ["RunResult", "RunStopped", "train"]


@dataclass(frozen=True)
class RunResult:
    """What a run did.

    Attributes:
      run_dir: the run directory.
      first_step: the step the run started from (0, or the checkpoint it resumed).
      last_step: the step it ended at.
      losses: the training loss of each step it ran, in order.
      val_losses: ``{step: validation loss}`` of each evaluation (the first at ``first_step``).
      sample: the text sampled from the model at the end ("" when ``train.sample_tokens`` is 0).
      plan: the plan it ran (with compiled and measured figures where recorded).
      state: the state at ``last_step`` (as the planned step left it).
      evaluation: the plan as the evaluation ran it, with its programs' compiled figures
        (``compiled["programs"]``: memory and ``beside_bytes`` per stage) where the plan is
        pipelined; ``None`` on a one-stage plan (one program on its mesh) or without
        evaluation.
    """

    run_dir: Path
    first_step: int
    last_step: int
    losses: tuple[float, ...]
    val_losses: dict[int, float]
    sample: str
    plan: Plan
    state: Any
    evaluation: Plan | None = None


def _plan(
    config: RunConfig, step: Callable[..., Any], state: Any, batch: Any, cluster: Any
) -> Plan:
    if config.plan.file:
        plan = load_plan(config.plan.file)
        check_plan(step, plan, state, batch, cluster=cluster)
        return plan
    return make_plan(step, state, batch, cluster=cluster, config=config.plan.config)


def _check_state_size(model_config: Any, optimizer: optax.GradientTransformation,
                      cluster: Cluster, config: RunConfig) -> None:
    """Refuses, before anything is allocated, a model and optimizer state that the cluster's
    devices cannot hold together (the planner's first check, on the state's shapes alone), or
    that the one device it is initialised on cannot hold (where the backend reports its
    memory: the state is initialised whole, on ``jax.local_devices()[0]``, and placed by the plan
    afterwards).

    Raises:
      InfeasibleError: naming the state's bytes and what holds less.
    """
    _, shapes = models.abstract_train_state(model_config, optimizer=optimizer)
    plan_config = config.plan.config
    check_state_fits(shapes, cluster, [memory_budget(plan_config, g.device.memory_bytes)
                                       for g in cluster.groups])
    device = jax.local_devices()[0]  # where this process's eager initialisation runs
    stats = device.memory_stats()
    limit = (stats or {}).get("bytes_limit")
    need = state_bytes(shapes)
    if limit and need > limit:
        raise InfeasibleError(format_error(
            f"shardplan train initialises the model and optimizer state whole on one device "
            f"before placing it by the plan, and the state ({need:,} bytes) exceeds that "
            f"device's memory ({limit:,} bytes). Initialising it sharded is not implemented.",
            where=f"model ({getattr(model_config, 'name', type(model_config).__name__)}), "
                  f"on {device}",
            value={"state_bytes": need, "device_bytes_limit": limit},
            remedy="train a smaller model with shardplan train, or initialise the state "
                   "sharded in your own step with sp.make_plan / sp.apply_plan"))


def _forward(graphdef: nnx.GraphDef) -> Callable[[Any, jax.Array], jax.Array]:
    """``logits(state, inputs)`` of the model in a split model+optimizer state."""

    def logits(state: Any, inputs: jax.Array) -> jax.Array:
        model, _ = nnx.merge(graphdef, state)
        out, _ = model(inputs)  # [batch, seq, vocab]
        return out.astype(jnp.float32)

    return logits


def _quiet(_: str) -> None:
    """Prints nothing (the processes other than process 0)."""


def _eval_metrics(forward: Callable[..., Any]) -> Callable[[Any, Any], dict[str, jax.Array]]:
    """``{"loss": mean cross-entropy}`` of a batch: the forward pass the plan evaluates."""

    def metrics(state: Any, batch: Any) -> dict[str, jax.Array]:
        logits = forward(state, batch["inputs"])
        return {"loss": optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["targets"]).mean()}

    return metrics


def _evaluate(evaluate: Callable[[Any, Any], Any], state: Any, dataset: Dataset,
              batches: int) -> float:
    """The mean validation loss over ``batches`` batches, each run through the plan
    (``run.evaluator``: the plan's stages on their devices; the loss brought to every
    process)."""
    values = [float(everywhere(evaluate(state, dataset.val_batch(i))["loss"]))
              for i in range(batches)]
    return float(np.mean(values))


def _sampling_mesh(plan: Plan) -> tuple[jax.sharding.Mesh, str, str] | None:
    """Where sampling runs when the plan cuts the model into several stages (a one-token
    forward cannot be split into the plan's microbatches) or spans several processes (each
    samples alone): the devices of this process of the device type the plan uses most of, as
    one mesh, that device type, and the reason, for the log; ``None`` for a one-stage plan in
    one process (sampling runs on its layout)."""
    if len(plan.stages) == 1 and jax.process_count() == 1:
        return None
    local = {d.id: d for d in jax.local_devices()}
    by_type: dict[str, list[int]] = {}
    for st in plan.stages:
        by_type.setdefault(st.device_type, []).extend(d for d in st.mesh.device_ids
                                                      if d in local)
    kind, ids = max(by_type.items(), key=lambda kv: len(kv[1]))
    if not ids:  # (a process holding no stage: its own devices)
        kind, ids = "local", sorted(local)
    mesh = jax.sharding.Mesh(np.array([local[d] for d in sorted(ids)]), ("sample",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    why = (f"cuts the model into {len(plan.stages)} stages" if len(plan.stages) > 1
           else f"spans {jax.process_count()} processes")
    reason = (f"sampling: the plan {why}, so the "
              f"sampler's forward runs on the {len(ids)} {kind} devices {sorted(ids)} "
              f"(the largest set of one device type), the parameters split over them")
    return mesh, kind, reason


def _sampling_sharding(x: Any, mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    """``x``'s layout on ``mesh``: its largest dimension that the mesh divides split over it
    (else replicated)."""
    size = mesh.devices.size
    dims = sorted(range(np.ndim(x)), key=lambda d: -np.shape(x)[d])
    axis = next((d for d in dims if np.shape(x)[d] % size == 0), None)
    spec: list[str | None] = [None] * np.ndim(x)
    if axis is not None:
        spec[axis] = "sample"
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def _sampler_state(forward: Callable[..., Any], state: Any, plan: Plan, seq_len: int,
                   print_fn: Callable[[str], None]) -> tuple[Any, Callable[..., Any]]:
    """The state the sampler reads and the forward over it: on a one-stage plan the state
    where the step keeps it; otherwise the leaves the forward reads (the parameters, not the
    optimizer state) on :func:`_sampling_mesh`, the others left out."""
    where = _sampling_mesh(plan)
    if where is None:
        return state, forward
    mesh, kind, reason = where
    print_fn(reason)
    leaves, treedef = jax.tree.flatten(state)
    window = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    closed = jax.make_jaxpr(lambda *xs: forward(jax.tree.unflatten(treedef, xs[:-1]),
                                                xs[-1]))(*leaves, window)
    read = {v for e in closed.jaxpr.eqns for v in e.invars if isinstance(v, Var)}
    read |= {v for v in closed.jaxpr.outvars if isinstance(v, Var)}
    used = [i for i, v in enumerate(closed.jaxpr.invars[:-1]) if v in read]
    if jax.process_count() > 1:  # a stage's leaves may be another process's
        picked = everywhere([leaves[i] for i in used])
    else:
        picked = [leaves[i] for i in used]
    layouts = [_sampling_sharding(x, mesh) for x in picked]
    # what each device would hold (alike on a 1-D mesh), checked before anything is placed
    held = sum(int(np.prod(sh.shard_shape(np.shape(x)), dtype=np.int64))
               * itemsize(x.dtype) for x, sh in zip(picked, layouts, strict=True))
    budgets: Any = plan.solver.get("memory_budget_bytes", {})
    budget = budgets.get(kind)
    if budget is not None and held > budget:
        raise InfeasibleError(format_error(
            "The model's parameters do not fit the devices sampling would run on.",
            where=f"sampling on {mesh.devices.size} {kind} devices",
            value={"bytes per device": held, "budget per device": budget},
            remedy="set train.sample_tokens=0 (no sample), or plan on a cluster with more "
                   "devices of one type"))
    placed = [jax.device_put(x, sh) for x, sh in zip(picked, layouts, strict=True)]
    avals = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]

    def forward_used(kept: list[Any], inputs: jax.Array) -> jax.Array:
        full: list[Any] = list(avals)
        for i, x in zip(used, kept, strict=True):
            full[i] = x
        # the leaves the forward does not read stay abstract: zeros XLA drops unread
        full = [jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x
                for x in full]
        return forward(jax.tree.unflatten(treedef, full), inputs)

    return placed, forward_used


def _sample(
    forward: Callable[..., Any], state: Any, prompt: str, tokens: int, seq_len: int, seed: int
) -> str:
    """``tokens`` bytes sampled (temperature 0.8) after ``prompt``, the model reading the last
    ``seq_len`` bytes (``forward(state, inputs)``: :func:`_sampler_state`'s)."""
    if tokens <= 0:
        return ""

    @jax.jit
    def next_token(state: Any, window: jax.Array, key: jax.Array) -> jax.Array:
        logits = forward(state, window[None])[0, -1]
        return jax.random.categorical(key, logits / 0.8)

    data = list(prompt.encode("utf-8")) or [ord("\n")]
    key = jax.random.key(seed)
    for _ in range(tokens):
        window = data[-seq_len:]
        window = [ord(" ")] * (seq_len - len(window)) + window
        key, sub = jax.random.split(key)
        data.append(int(next_token(state, jnp.asarray(window, jnp.int32), sub)))
    return bytes(data[len(prompt.encode("utf-8")) :]).decode("utf-8", errors="replace")


def _write_plan(run_dir: Path, plan: Plan) -> None:
    plan.save(run_dir / "plan.json")
    report = plan.summary() + "\n\n" + plan.report() + "\n"
    (run_dir / "report.txt").write_text(report, encoding="utf-8")


def train(
    config: RunConfig, /, *, progress: bool = True, print_fn: Callable[[str], None] = print,
    lock: RunLock | None = None,
) -> RunResult:
    """Runs the training ``config`` describes (module docstring).

    Process 0 holds an exclusive lock on ``output.dir`` for the whole run
    (:mod:`shardplan.train._lock`), and nothing in the directory is written until every check
    that can refuse the run has passed (the plan file's check, the checkpoint's checksums,
    data and leaves).

    Args:
      config: the run's configuration.
      progress: show a rich progress bar (off in tests and when output is not a terminal).
      print_fn: where the run's messages go.
      lock: the lock on ``output.dir`` when the caller has taken it already (``shardplan
        train`` does, before it loads the model code, to refuse a second run at once); it
        stays the caller's to release. None: process 0 takes and releases it here.

    Returns:
      A :class:`RunResult`.

    Raises:
      ConfigError: another run holds ``output.dir``, or it is a file, lies under one or is not
        writable.
      RuntimeFailure: the loss became NaN or infinite (names the step; the last checkpoint,
        written before it, is kept).
      CheckpointError: the run directory holds checkpoints of another model or data, or its
        latest checkpoint is damaged (naming the file and the newest intact step).
      PlanMismatchError: ``plan.file`` was made for another step, batch or cluster.
      RunStopped: SIGINT or SIGTERM (in the main thread) stopped the run; the message names
        the intact checkpoint.
    """
    run_dir = Path(config.output.dir)
    main = is_main()
    if not main:  # under several processes, process 0 writes the files and prints
        print_fn = _quiet
    if lock is not None and (not lock.held or lock.run_dir.resolve() != run_dir.resolve()):
        raise ConfigError(format_error(
            "The lock given is not held on the run's directory.", where="train(lock=)",
            value=str(lock.run_dir), remedy=f"lock output.dir ({run_dir}), or pass lock=None"))
    owned = RunLock(run_dir).acquire() if main and lock is None else None
    try:
        with Signals() as signals:
            return _train(config, run_dir, main, progress, print_fn, signals)
    finally:
        if owned is not None:
            owned.release()


def _train(config: RunConfig, run_dir: Path, main: bool, progress: bool,
           print_fn: Callable[[str], None], signals: Signals) -> RunResult:
    """:func:`train` once the run directory is locked."""
    at = _At()  # the step being trained, for the message of a signalled stop
    try:
        model_config = config.model.build()
        dataset = load_data(config.data, vocab_size=model_config.vocab_size)
        cluster = config.cluster.build()
        optimizer = config.optimizer_transform()
        _check_state_size(model_config, optimizer, cluster, config)
        graphdef, state = models.init_train_state(
            model_config, seed=config.train.seed, optimizer=optimizer
        )
        step_fn = models.make_train_step(graphdef)
        abstract_state = jax.eval_shape(lambda: state)
        plan = _shared_plan(config, step_fn, abstract_state, cluster, main)
        run = apply_plan(step_fn, plan, measure_steps=config.train.measure_steps)
        checkpoints = _open_checkpoints(config, run_dir)
        target = abstract_target(abstract_state, state_shardings(plan, abstract_state))
        try:
            resumed = resume(config, checkpoints, dataset, target)
        except BaseException:
            checkpoints.close()
            raise
        first = 0
        if resumed is not None:
            state, first = resumed.state, resumed.step
            if first >= config.train.steps:  # a finished run: nothing to train or write
                checkpoints.close()
                print_fn(resumed.message)
                print_fn(f"the run is complete (step {first} of train.steps="
                         f"{config.train.steps}); raise train.steps to continue it, or use "
                         "another output.dir")
                return RunResult(run_dir, first, first, (), {}, "", run.plan, state)
        # Every check has passed: from here on the run writes its directory.
        checkpoints = _write_run_dir(config, run_dir, main, plan, resumed, checkpoints,
                                     signals)
        summary = plan.summary().splitlines()
        cut = next((i for i, line in enumerate(summary) if "shardings" in line.lower()), None)
        print_fn("\n".join(summary[:cut]).rstrip()
                 + f"\n  (the whole plan: {run_dir}/report.txt)")
        if resumed is not None:
            print_fn(resumed.message)
        return _loop(config, _Run(run_dir, main, progress, print_fn, signals, at), run,
                     checkpoints, dataset, graphdef, state, first, model_config)
    except Stop as stop:
        raise stopped(stop, run_dir, at.step, config.train.steps) from None


def _shared_plan(config: RunConfig, step_fn: Callable[..., Any], abstract_state: Any,
                 cluster: Cluster, main: bool) -> Plan:
    """The run's plan, the same on every process."""
    # Solved (or loaded and checked) once, by process 0, so every process runs the same plan.
    made = (_plan(config, step_fn, abstract_state, abstract_batch(config.data), cluster)
            if main else None)
    plan = Plan.from_json(from_main(made.to_json().encode() if made else None).decode()) \
        if jax.process_count() > 1 else made
    assert plan is not None
    return plan


def _open_checkpoints(config: RunConfig, run_dir: Path) -> Checkpointer:
    """The run directory's checkpointer, as the config sets it."""
    return Checkpointer(run_dir / "checkpoints",
                        every_steps=config.output.checkpoint_every,
                        keep=config.output.keep_checkpoints)


def _write_run_dir(config: RunConfig, run_dir: Path, main: bool, plan: Plan,
                   resumed: Resume | None, checkpoints: Checkpointer,
                   signals: Signals) -> Checkpointer:
    """The checkpointer to train on with, the config and plan written (damaged ones moved aside)."""
    with signals.deferred():
        if resumed is not None and resumed.damaged:
            checkpoints.close()
            if main:
                move_aside(run_dir, run_dir / "checkpoints", resumed.damaged)
            if jax.process_count() > 1:
                from_main(b"")  # (every process waits for the move)
            checkpoints = _open_checkpoints(config, run_dir)
        if main:
            (run_dir / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
            _write_plan(run_dir, plan)
    return checkpoints


@dataclass
class _At:
    """The step a run is training (None before the first)."""

    step: int | None = None


@dataclass(frozen=True)
class _Run:
    """How a run reports and where it writes (what :func:`_loop` shares with :func:`train`)."""

    run_dir: Path
    main: bool
    progress: bool
    print_fn: Callable[[str], None]
    signals: Signals
    at: _At


def _loop(config: RunConfig, ctx: _Run, run: Any, checkpoints: Checkpointer,
          dataset: Dataset, graphdef: nnx.GraphDef, state: Any, first: int,
          model_config: Any) -> RunResult:
    """The training steps from ``first``, with evaluation, metrics, checkpoints and the
    sample (the module docstring)."""
    run_dir, main, print_fn = ctx.run_dir, ctx.main, ctx.print_fn
    meta = _checkpoint_meta(dataset, model_config)
    forward = _forward(graphdef)
    evaluator = run.evaluator(_eval_metrics(forward))
    tokens_per_step = config.data.batch_size * config.data.seq_len
    metrics_file = (run_dir / "metrics.jsonl").open("a", encoding="utf-8") if main else None
    losses: list[float] = []
    val_losses: dict[int, float] = {}

    def log(record: dict[str, Any]) -> None:
        if metrics_file is None:
            return
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()

    def evaluate(step: int) -> None:
        if config.data.val_batches and config.data.val_fraction > 0:
            val_losses[step] = _evaluate(evaluator, state, dataset, config.data.val_batches)
            log({"step": step, "val_loss": val_losses[step]})

    progress_bar = _Progress(config.train.steps, first, enabled=ctx.progress and main)
    measured_written = False
    try:
        evaluate(first)
        start = time.perf_counter()
        for step in range(first, config.train.steps):
            ctx.at.step = step
            state, metrics = run(state, dataset.train_batch(step))
            loss = float(everywhere(metrics["loss"]))  # held by the last stage's process
            if not math.isfinite(loss):
                raise _diverged(loss, step, checkpoints)
            losses.append(loss)
            done = step + 1
            elapsed = time.perf_counter() - start
            tokens_per_s = tokens_per_step * (done - first) / max(elapsed, 1e-9)
            log({"step": done, "loss": loss, "tokens_per_s": tokens_per_s, "time_s": elapsed})
            progress_bar.update(done, loss, tokens_per_s)
            if config.train.eval_every and done % config.train.eval_every == 0:
                evaluate(done)
            measured_written = _save_step(config, ctx, run, checkpoints, state, done, meta,
                                          measured_written)
            if done == config.train.stop_at:
                break
        ctx.at.step = None if not losses else first + len(losses)
        last = first + len(losses)
        if last == config.train.steps and last not in val_losses:
            evaluate(last)
        sample = _final_sample(config, forward, state, run.plan, print_fn)
    finally:
        _close_run(ctx, progress_bar, checkpoints, metrics_file)
    if main:
        with ctx.signals.deferred():
            _write_plan(run_dir, run.plan)
    if sample:
        print_fn(f"sample: {config.train.sample_prompt!r} -> {sample!r}")
    return RunResult(run_dir, first, last, tuple(losses), val_losses, sample, run.plan, state,
                     getattr(evaluator, "plan", None) if val_losses else None)


def _checkpoint_meta(dataset: Dataset, model_config: Any) -> dict[str, Any]:
    """What every checkpoint of the run records beside its step: the data and the model."""
    return {"data_fingerprint": dataset.fingerprint,
            "model": getattr(model_config, "name", type(model_config).__name__)}


def _save_step(config: RunConfig, ctx: _Run, run: Any, checkpoints: Checkpointer, state: Any,
               done: int, meta: dict[str, Any], measured_written: bool) -> bool:
    """Whether the measured plan is written, after writing step ``done``'s checkpoint if due."""
    stopping = done == config.train.steps or done == config.train.stop_at
    with ctx.signals.deferred():  # a checkpoint and the plan file are written whole
        if checkpoints.should_save(done, final=stopping):
            checkpoints.save(done, state, meta={**meta, "step": done})
        if ctx.main and run.plan.measured and not measured_written:  # after timed steps
            _write_plan(ctx.run_dir, run.plan)
            measured_written = True
    return measured_written


def _close_run(ctx: _Run, progress_bar: _Progress, checkpoints: Checkpointer,
               metrics_file: IO[str] | None) -> None:
    """Closes the progress bar, checkpoints and metrics file, signals deferred (returns None)."""
    with ctx.signals.deferred():
        progress_bar.close()
        checkpoints.close()
        if metrics_file is not None:
            metrics_file.close()


def _diverged(loss: float, step: int, checkpoints: Checkpointer) -> RuntimeFailure:
    """The error that stops a run whose loss became ``loss`` (not finite) at ``step``."""
    kept = checkpoints.latest_step()
    return RuntimeFailure(format_error(
        f"The loss became {loss} at step {step + 1}; the run stops (nothing of this step is "
        "saved).", where=f"step {step + 1}", value=loss,
        remedy=(f"the last checkpoint (step {kept}, {checkpoints.step_dir(kept)}) is kept: "
                "lower optimizer.learning_rate or raise warmup_steps, and run again to resume "
                "from it") if kept is not None
        else "lower optimizer.learning_rate or raise optimizer.warmup_steps"))


def _final_sample(config: RunConfig, forward: Callable[..., Any], state: Any, plan: Plan,
                  print_fn: Callable[[str], None]) -> str:
    """The run's closing text sample ("" when ``train.sample_tokens`` is 0)."""
    sample = ""
    if config.train.sample_tokens > 0:
        sampler_state, sampler = _sampler_state(forward, state, plan,
                                                config.data.seq_len, print_fn)
        sample = _sample(sampler, sampler_state, config.train.sample_prompt,
                         config.train.sample_tokens, config.data.seq_len, config.train.seed)
    return sample


class _Progress:
    """A rich progress bar: step, loss, tokens/s, ETA (nothing when disabled)."""

    def __init__(self, total: int, completed: int, *, enabled: bool) -> None:
        self._bar: Any = None
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._bar = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        )
        self._task = self._bar.add_task(
            "train", total=total, completed=completed, loss="-", tps="-"
        )
        self._bar.start()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self._bar is not None:
            self._bar.update(
                self._task, completed=step, loss=f"{loss:.4f}", tps=f"{tokens_per_s:,.0f}"
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
