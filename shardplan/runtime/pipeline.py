"""Running multi-stage plans: the step cut into per-stage forward, backward and update programs
on the stages' sub-meshes, driven microbatch by microbatch from Python, in one process or in
several (``jax.distributed``).

On top of :mod:`shardplan.runtime.accumulate` (the step cut into a per-microbatch gradient part
and an update part) and :mod:`shardplan.runtime.partition` (both parts cut by stage),
:class:`PipelinedStep` runs a plan:

* **Schedule.** The gradient tasks of every microbatch are issued in an order that respects the
  data flow and follows each stage's schedule (:func:`~shardplan.solver.stages.simulate.device_order`:
  GPipe; 1F1B's warm-up forwards then one backward one forward; interleaved 1F1B over a stage's
  chunks); JAX's asynchronous dispatch lets the stages run concurrently. Values move between
  stages with ``jax.device_put`` when the reading stage first needs them and are dropped after
  their last reader, so under 1F1B stage ``p`` of ``k`` holds at most ``k - p`` microbatches of
  activations (:attr:`PipelinedStep.peak_microbatches`).
* **Remat.** A stage's remat policy decides what its forward task hands its backward task
  (:func:`~shardplan.runtime.partition.gradient_programs`): everything the backward reads
  (``none``), all but the attention core (``selective``), or only the stage's inputs, the
  backward running the forward again (``full``). Under the first two the backward also runs
  again the forward equations whose values XLA's fusion keeps out of memory, so that the
  forward hands on the buffers the memory model counts, not every jaxpr residual.
* **Accumulation.** Each replica sums its microbatches' cut values (gradients, metrics) on the
  devices that produced them; the replicas' sums are all-reduced (below), and the mean-type
  ones are divided by the microbatch count (uneven replica shares weigh by microbatches). A
  gradient whose terms come from several stages (a tied embedding: the head's term and the
  embedding's) is accumulated term by term on the stages that produce them
  (:attr:`~shardplan.runtime.partition.Program.terms`); the terms meet once per step, on the
  latest one's stage, not once per microbatch.
* **Data parallelism.** Identical replicas
  (:func:`~shardplan.runtime.spmd.identical_replicas`: the same stages, device type, sub-mesh
  and microbatch count, in one process) run as one: each stage's mesh is
  the members' sub-meshes stacked along a leading :data:`REPLICA` axis, a merged microbatch
  is the members' microbatches joined along the samples, and each gradient task runs under
  ``shard_map`` manual over that axis only (:func:`_spread`), so every member's devices run
  the member's own program on their own samples, with no communication. The members' sums
  meet once per step in each stage's ``sync`` program (:func:`_sync`: an all-reduce over
  :data:`REPLICA` of the stage's gradient sums, the ring the stage planner prices), and the
  update then runs on the stacked mesh, so each member's devices update their own copy of the
  stage's layers. The transfers between stages carry each member's slice to the same
  member's next stage.
* **Replicas that differ** (another device type or layer split; after the merge above, the
  *parties*) all-reduce their sums between their stages
  (:class:`~shardplan.runtime.exchange.Exchange`: a reduce-scatter and an all-gather over
  ``jax.device_put``, each stage receiving ``2 (G - 1) / G`` of the bytes it holds, the
  ring's share the stage planner prices), so every replica ends with the same totals.
* **Update.** Every replica updates its own layers: the update is cut by each replica's own
  stages (:func:`~shardplan.runtime.partition.update_programs`), each stage running the
  equations on the parameters it holds; values crossing a replica's stages (a global
  gradient norm's partial sums, the clip factor, a step counter) are sent between them. The
  new state leaves stay on their home stages (a returned state is a pytree whose leaves live
  on different sub-meshes): the step returns replica 0's, and every other replica keeps its
  own copy, which its stages read at the next step when the state passed in is the one
  returned. No replica's devices hold another's state (no parameter server).
* **Processes.** Under ``jax.distributed`` every process runs this same driver: it runs the
  programs of the stages on its devices, and joins each transfer it sends or receives (through
  one device on each side: cross-process copies need equal device counts). A value of another
  process's stage is a placeholder (an array with no shards here). Each stage must sit inside
  one process.

A one-stage replica is the degenerate case (tasks ``F_0`` and ``B_0`` on one sub-mesh):
data parallelism across device types with uneven microbatch counts.

A scanned stack (``nnx.scan``) whose rows lie on several stages is cut into per-stage segments
(:func:`~shardplan.runtime.partition.gradient_programs`), and its stacked leaves are held as
per-stage pieces (:mod:`shardplan.runtime.rows`): the driver works on the *internal* leaves
(a stacked leaf replaced by its pieces) and shows the user each stacked leaf as one array over
the stages' devices. Where no ``NamedSharding`` describes the pieces (uneven runs, interleaved
stages, unlike sub-meshes) the leaf lives whole on one stage, each stage reading its rows from
a full copy.

This module is over 600 lines: the driver (placing, running and timing the tasks, moving
values between stages and processes, the stacked leaves' conversions) stays in one piece
until issue 25's layering step splits the runtime's pipeline modules together.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan._traceback import api_boundary
from shardplan.errors import PipelineError, PlanMismatchError, ShardplanWarning, format_error
from shardplan.plan import Plan
from shardplan.plan.plan import Layout, ReplicaSpec
from shardplan.runtime.accumulate import (
    AccumulationForm,
    StepSplit,
    accumulation_form,
    reduction_kinds,
    split_batch,
    split_step,
)
from shardplan.runtime.constrain import Pins, parse_path
from shardplan.runtime.exchange import Exchange
from shardplan.runtime.partition import (
    Program,
    VirtualStages,
    _is_var,
    gradient_programs,
    row_runs,
    update_programs,
    virtual_stages,
)
from shardplan.runtime.rows import RowSplit, assembled, expressible, split_rows
from shardplan.runtime.spmd import REPLICA, leaf_shardings, runtime_meshes
from shardplan.runtime.verify import (
    MEASURE_STEPS,
    StepTimer,
    check_arguments,
    check_fits,
    compiled_figures,
    device_bytes,
)
from shardplan.solver.stages.pipeline import Schedule
from shardplan.solver.stages.simulate import device_order
from shardplan.trace.dtypes import itemsize

__all__ = ["PipelinedStep", "placeholder"]

# (Past 600 lines: the driver is one class, PipelinedStep, whose placement, schedule,
# per-program compile and check, and transfers share its prepared state; the program cutting
# already lives in partition.py and accumulate.py.)


def _labels(step: Callable[..., Any], state: Any, batch: Any,
            ) -> tuple[dict[tuple[int, ...], frozenset[str]], list[str],
                       dict[str, tuple[list[str], frozenset[int]]],
                       dict[str, frozenset[tuple[int, ...]]]]:
    """Per equation path of the step's jaxpr at these shapes (an op's
    :attr:`~shardplan.trace.Op.path` and each prefix of it: a call's path covers its ops), the
    names of the layers its ops belong to (:func:`shardplan.trace`; equations with no op, or a
    loop's: absent); the layers' names in model order; per block stack, its layers in order (the
    rows of a scanned stack) and the state leaves they own; and per remat policy short of
    ``full``, the paths of the equations a backward task runs again rather than receive their
    values (:func:`~shardplan.runtime.partition.gradient_programs`): under ``none`` those
    whose every op computes values XLA's fusion keeps out of memory
    (:func:`shardplan.cost.buffers.buffer_tensors`: in one program XLA computes them again
    inside the backward pass's fusions, so the saved activations are the buffers the model
    counts), under ``selective`` those and the ones whose every op computes attention-core
    values (:func:`shardplan.cost.activations.saved_activation_bytes`)."""
    from shardplan.cost.activations import activation_facts
    from shardplan.trace import trace

    graph = trace(step, jax.eval_shape(lambda: state), jax.eval_shape(lambda: batch))
    names = [layer.name for layer in graph.layers]
    facts = activation_facts(graph)
    out: dict[tuple[int, ...], set[str]] = {}
    in_core: dict[tuple[int, ...], bool] = {}
    in_fusion: dict[tuple[int, ...], bool] = {}
    for op in graph.ops:
        # A loop body's ops: the runtime cuts a scan by the stacks it reads (partition), not
        # by its body's labels.
        if op.path is None or op.loop:
            continue
        layers = [names[j] for j in op.layers]
        core = all(facts.core[t] for t in op.outputs)
        fusion = op.phase == "forward" and not any(facts.fused[t] for t in op.outputs)
        for k in range(1, len(op.path) + 1):
            i = op.path[:k]
            out.setdefault(i, set()).update(layers)
            if op.outputs:
                in_core[i] = in_core.get(i, True) and core
                in_fusion[i] = in_fusion.get(i, True) and fusion
    paths = [jax.tree_util.keystr(p, simple=True, separator="/")
             for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    stacks: dict[str, tuple[list[str], set[int]]] = {}
    for layer in graph.layers:
        if layer.stack is not None:
            rows, leaves = stacks.setdefault(layer.stack, ([], set()))
            rows.append(layer.name)
            leaves.update(paths.index(p) for p in layer.params if p in paths)
    fused = frozenset(i for i, c in in_fusion.items() if c)
    return ({i: frozenset(x) for i, x in out.items()}, names,
            {k: (rows, frozenset(leaves)) for k, (rows, leaves) in stacks.items()},
            {"none": fused, "selective": fused | {i for i, c in in_core.items() if c}})


def placeholder(aval: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """An array of another process's devices: shape, dtype and sharding, no shards here (what
    a process holds for a value only other processes compute)."""
    def nothing(index: Any) -> np.ndarray:  # asked once, for no device, when replicated
        return np.broadcast_to(np.zeros((), aval.dtype), aval.shape)[index]

    return jax.make_array_from_callback(tuple(aval.shape), sharding, nothing,
                                        dtype=aval.dtype)


class _Mover:
    """Moves values between the stages' sub-meshes, in one process or across processes."""

    def __init__(self, meshes: dict[int, jax.sharding.Mesh]) -> None:
        self.meshes = meshes
        self.moved_bytes = 0  # bytes devices received from other devices (:func:`received`)
        self.batch_bytes = 0  # and the batch's bytes they received
        self.sync_bytes: dict[int, int] = {}  # per stage, what the replicas' exchange brought
        # per stage, how its batch splits its samples (the leading dimension's spec entry,
        # None where it does not) and one member's microbatch size (:meth:`landing`)
        self.samples: dict[int, tuple[Any, int]] = {}
        self.multi = jax.process_count() > 1
        me = jax.process_index()
        self.here: dict[int, bool] = {}
        for s, mesh in meshes.items():
            processes = sorted({d.process_index for d in mesh.devices.flat})
            if len(processes) > 1:
                raise PlanMismatchError(format_error(
                    "A pipeline stage spans several processes.", where=f"plan.stages[{s}]",
                    value=processes, remedy="give each process whole stages (one device type "
                                            "per process)"))
            self.here[s] = processes == [me]
        self._hops = {s: NamedSharding(jax.sharding.Mesh(np.array(m.devices.flat[:1]),
                                                         ("hop",)), P())
                      for s, m in meshes.items()}

    def replicated(self, stage: int) -> NamedSharding:
        return NamedSharding(self.meshes[stage], P())

    def landing(self, stage: int, aval: Any) -> NamedSharding:
        """Where a gradient task's value of one member's ``aval`` lands on ``stage``: as
        :meth:`spread`, its leading dimension split as the stage's batch is where it has the
        microbatch's samples (each device receives its own samples' part, as the planner
        prices a boundary activation, not the whole microbatch)."""
        base = self.spread(stage)
        entry, samples = self.samples.get(stage, (None, 0))
        if entry is None or not aval.shape or aval.shape[0] != samples:
            return base
        return NamedSharding(base.mesh, P(entry))

    def spread(self, stage: int) -> NamedSharding:
        """A gradient task's value on ``stage``: one slice per member replica along its
        leading axis where the stage is a merged replica's (its mesh has :data:`REPLICA`),
        else replicated."""
        mesh = self.meshes[stage]
        return NamedSharding(mesh, P(REPLICA) if REPLICA in mesh.axis_names else P())

    def move(self, x: Any, aval: Any, src: int, dst: int,
             sharding: NamedSharding | None = None, *, sync: bool = False) -> Any:
        """``x`` (of stage ``src``; ``None`` when not here) on stage ``dst`` in ``sharding``
        (default: replicated); ``None`` when ``dst`` is not here. Counted in
        :attr:`moved_bytes`, or with ``sync`` (the replicas' gradient exchange) in
        :attr:`sync_bytes` for ``dst``."""
        sharding = sharding or self.replicated(dst)
        if x is not None:
            self._count(x, dst, sharding, sync)
        if not self.multi or (self.here[src] and self.here[dst]):
            return jax.device_put(x, sharding)
        if not (self.here[src] or self.here[dst]):
            return None
        hop = (jax.device_put(x, self._hops[src]) if self.here[src]
               else placeholder(aval, self._hops[src]))
        landed = jax.device_put(hop, self._hops[dst])
        if self.here[dst]:
            # The receiver waits for the data: receives posted ahead of their senders hold the
            # CPU client's workers, and enough of them starve the computations that would
            # send (both processes then wait on each other).
            landed.block_until_ready()
        return jax.device_put(landed, sharding) if self.here[dst] else None


    def move_many(self, items: Sequence[tuple[Any, Any, int, int, NamedSharding]], *,
                  sync: bool = False) -> list[Any]:
        """:meth:`move` of each ``(x, aval, src, dst, sharding)``; in one process, one
        ``jax.device_put`` for all of them (a call per array costs more than the copy of a
        small one)."""
        if self.multi or not items:
            return [self.move(*item, sync=sync) for item in items]
        for x, _, _, dst, sharding in items:
            self._count(x, dst, sharding, sync)
        return list(jax.device_put([x for x, *_ in items], [item[4] for item in items]))

    def _count(self, x: Any, dst: int, sharding: NamedSharding, sync: bool) -> None:
        """What ``x`` put on ``sharding`` brings the devices of stage ``dst``: in
        :attr:`sync_bytes` (the replicas' exchange) or :attr:`moved_bytes`."""
        got = received(x, sharding)
        if sync:
            self.sync_bytes[dst] = self.sync_bytes.get(dst, 0) + got
        else:
            self.moved_bytes += got


def received(x: Any, sharding: jax.sharding.Sharding) -> int:
    """The bytes the devices of ``sharding`` receive when ``x`` is put there: each device's
    shard, except on a device that holds ``x`` already (a host array: every shard)."""
    held = x.sharding.device_set if isinstance(x, jax.Array) else set()
    shard = int(np.prod(sharding.shard_shape(np.shape(x)), dtype=np.int64)) * itemsize(x.dtype)
    return shard * sum(d not in held for d in sharding.device_set)


def _spread(prog: Program, mesh: jax.sharding.Mesh) -> Program:
    """A gradient task of a merged replica: each member's devices run the task on their own
    microbatch (``shard_map``, manual over :data:`REPLICA` only: inside, the program is the
    member's, over the stage's own axes), the state shared, the values the members' joined
    along their leading axis (a scalar's with one added: the layout of each member's buffers
    as the member's own program makes them, so that no output is copied to gain an axis);
    nothing is reduced across members until the step's sums are (:func:`_sync`)."""
    state = [kind == "state" for kind, _ in prog.inputs]
    scalar = [kind == "value" and not what.aval.shape for kind, what in prog.inputs]

    def member(*args: Any) -> list[Any]:
        outs = prog.fn(*(a[0] if s else a for a, s in zip(args, scalar, strict=True)))
        return [x if np.ndim(x) else x[None] for x in outs]

    fn = jax.jit(jax.shard_map(member, mesh=mesh,
                               in_specs=tuple(P() if s else P(REPLICA) for s in state),
                               out_specs=P(REPLICA), axis_names={REPLICA}, check_vma=False))
    return dataclasses.replace(prog, fn=fn)


def _sync(stage: int, values: list[Any], avals: list[Any], width: int) -> Program:
    """The program summing a merged replica's per-member sums (``avals``: one member's,
    joined along the leading axis) over its ``width`` members, each then laid out as one
    member's: the gradients' all-reduce over :data:`REPLICA`, once per step (run and recorded
    as ``sync <stage>``)."""
    mesh = values[0].sharding.mesh
    shardings = [NamedSharding(mesh, P(*_member_spec(x.sharding.spec)[:len(a.shape)]))
                 for x, a in zip(values, avals, strict=True)]

    def total(xs: list[Any]) -> list[Any]:
        return [x.reshape(width, *a.shape).sum(axis=0, dtype=x.dtype)
                for x, a in zip(xs, avals, strict=True)]

    return Program(-1, stage, jax.jit(total, out_shardings=shardings), (), ())


def _joined_axis(spec: Any) -> Any:
    """The leading axis's spec entry of a value joined over the members: :data:`REPLICA`
    outermost, then what one member's value splits it over."""
    first = next(iter(spec), None)
    names = (first,) if isinstance(first, str) else tuple(first or ())
    return (REPLICA, *names) if names else REPLICA


def _member_spec(spec: Any) -> tuple[Any, ...]:
    """A joined value's spec with :data:`REPLICA` taken off its leading axis."""
    entries = list(tuple(spec))
    if entries:
        first = entries[0]
        names = (first,) if isinstance(first, str) else tuple(first or ())
        kept = tuple(n for n in names if n != REPLICA)
        entries[0] = kept[0] if len(kept) == 1 else kept or None
    return tuple(entries)


STEP_BARRIER_TIMEOUT_S = 3600
"""How long a process waits for the others at the end of a multi-process step."""


_STEPS_ENDED = itertools.count()
"""Multi-process steps run so far by this process (every process runs them in the same order,
so the count names the same step everywhere)."""


def _all_processes_at(key: str) -> None:
    """Waits until every process reaches the barrier ``key`` (the coordination service's, not
    a device collective).

    A multi-process step ends here: once every process has passed it, every transfer of the
    step has arrived, so a device collective that follows (a checkpoint's, the loss brought to
    every process) cannot wait on a process that is still waiting for a send queued behind
    that collective on the sender's devices (which deadlocks the CPU client).
    """
    from orbax.checkpoint import multihost

    multihost.get_barrier_sync_fn()(key=key, timeout_ms=STEP_BARRIER_TIMEOUT_S * 1000)


@dataclass(frozen=True)
class _Prepared:
    """What a plan needs compiled once per state and batch shape."""

    split: StepSplit
    kinds: tuple[str, ...]
    virtual: list[VirtualStages]
    tasks: list[list[Program]]  # per replica, its gradient tasks
    # per replica (each updates its own layers): its update programs, per step output where
    # it is (``update_programs``), per state leaf its stage, per cut value where it is summed
    update: list[list[Program]]
    where: list[list[Any]]
    home: list[list[int]]
    cut_at: list[list[int]]
    shardings: dict[int, tuple[list[Any], list[Any]]]  # stage -> state, batch leaf shardings
    needs: dict[int, list[int]]  # stage -> the state leaves it reads
    state_avals: list[Any]
    rows: RowSplit  # the state leaves held as pieces (the internal leaves, rows.py)
    cut_vars: list[list[Any]]  # per replica, its tasks' internal cut values
    user_shapes: list[Any]  # the user's state leaves' shapes


class PipelinedStep:
    """A train step bound to a multi-stage or microbatched plan: call it like the original
    step (the module docstring)."""

    def __init__(self, train_step: Callable[..., Any], plan: Plan, *, verify: bool = True,
                 measure_steps: int = MEASURE_STEPS,
                 _evaluates: PipelinedStep | None = None) -> None:
        self._step = train_step
        # An evaluator (:meth:`evaluator`): the step whose state it reads, where that put it.
        self._parent = _evaluates
        self.plan = plan
        """The plan; once run, with XLA's figures per program (``compiled``) and, after the
        timed steps, measured step and per-stage times (``measured``)."""
        self._verify = verify
        self._timer = StepTimer(measure_steps)
        # XLA's figures (compiled_figures'), each program's added as the 1st call compiles it
        self._compiled: dict[str, Any] | None = None
        self._seen: set[int] = set()
        self._stage_busy: dict[int, float] | None = None  # per stage, in a clocked call
        # (a one-stage plan has no replica list: one replica of its stage)
        replicas = plan.replicas or (
            ReplicaSpec(tuple(s.index for s in plan.stages), plan.microbatches),)
        # Identical replicas run as one, each of its stages over the members' sub-meshes
        # stacked along a leading REPLICA axis (the module docstring, "Data parallelism").
        self._meshes, self._groups = runtime_meshes(plan)
        # per stage of a merged replica, the other members' stages at its position
        self._members = {s: [replicas[r].stages[i] for r in group[1:]]
                         for group in self._groups if len(group) > 1
                         for i, s in enumerate(replicas[group[0]].stages)}
        self._replicas = tuple(replicas[group[0]] for group in self._groups)
        self._widths = tuple(len(group) for group in self._groups)  # members per replica
        self._counts = tuple(replicas[group[0]].microbatches for group in self._groups)
        self.meshes = self._meshes
        self._mover = _Mover({s: self._meshes[s] for r in self._replicas for s in r.stages})
        self._ready: _Prepared | None = None
        # the step rewritten to be cut into microbatches, where it must be (accumulate.py)
        self._form: AccumulationForm | None = None
        self._orders: dict[int, list[tuple[Program, int]]] = {}  # per replica
        self._syncs: dict[tuple[int, int], Program] = {}  # (merged replica, stage) -> its sync
        # the bytes the last call's transfers, batch and gradient exchange (per stage) delivered
        self._moved_last: tuple[int, int, dict[int, int]] = (0, 0, {})
        # In the first call: per (stage, program name), the most bytes the driver held on a
        # device of the stage beside the program's arguments when it ran; and the driver's
        # containers of arrays to count (set per call).
        self._beside: dict[tuple[int, str], int] = {}
        self._holdings: list[Callable[[], Any]] = []
        self._returned: list[Any] = []  # the internal state leaves the last call returned
        self._located: list[int] = []  # and their stages
        # per replica after the first (one that differs: it keeps and updates its own copy),
        # the internal state leaves its update made in the last call, and their stages
        self._kept: dict[int, tuple[list[Any], list[int]]] = {}
        self._party = {s: r for r, rep in enumerate(self._replicas) for s in rep.stages}
        self._exchange: Exchange | None = None  # the replicas' gradient all-reduce
        self._user_returned: list[Any] = []  # the user's leaves it returned (rows.py)
        self.peak_microbatches: dict[int, int] = {}
        """After a call: per stage (index into ``plan.stages``), the most microbatches whose
        values (activations, residuals) the stage held at once."""

    def evaluator(self, fn: Callable[[Any, Any], Any], /) -> PipelinedStep:
        """``fn(state, batch) -> metrics`` (a forward pass: an evaluation loss) run through
        this step's plan: cut by the plan's stages like the step's forward, run per
        microbatch on the stages' devices, reading the state where this step keeps it (each
        replica its own copy of the state this step last returned; nothing is gathered or
        copied where it already lies), its metrics accumulated like the step's and returned
        on the last stage. ``fn``'s metrics must be means over the batch's samples (a mean
        loss); ``batch`` is one of the plan's batch size.

        Every program is compiled and checked against its devices' memory before it runs,
        and recorded in the evaluator's ``plan.compiled`` (with ``beside_bytes``, what the
        driver held on the stage's devices beside it), as the step's are.

        Example (``step`` a planned pipeline, ``loss(state, batch)`` a jitted mean loss)::

            evaluate = step.evaluator(lambda state, batch: {"loss": loss(state, batch)})
            val_loss = evaluate(state, val_batch)["loss"]
        """
        return PipelinedStep(fn, self.plan, verify=self._verify, measure_steps=0,
                             _evaluates=self)

    # -- preparation ----------------------------------------------------------------------

    def _prepare(self, state: Any, parts: Sequence[Any]) -> _Prepared:
        plan = self.plan
        # traced on shapes alone: a jaxpr traced on arrays placed on a mesh carries that mesh,
        # and a merged replica's programs run on another
        step = self._form.step if self._form is not None else self._step
        split = split_step(step, jax.tree.map(_bare, state), parts[0],
                           evaluation=self._parent is not None)
        # (an evaluator's metrics are means by its contract: measuring it as the step's are
        # would run it unsharded on the whole state)
        kinds = (reduction_kinds(step, state, parts[0], parts[1], split,
                                 accumulation=plan.accumulation)
                 if len(parts) > 1 and self._parent is None
                 else tuple("mean" for _ in split.cut_avals))
        labels, layer_order, stacks, rerun = _labels(step, state, parts[0])
        n_state = len(jax.tree.leaves(state))
        chunks = plan.chunks if plan.schedule == "interleaved" else 1
        virtual = [virtual_stages([plan.stages[i].layers for i in r.stages], r.stages,
                                  layer_order, chunks) for r in self._replicas]
        remat = {st.index: st.remat for st in plan.stages}
        shardings, pins = self._stage_shardings(state, parts[0])
        self._mover.samples.update(self._batch_samples(shardings, parts[0]))
        rows = _row_split(split, state, stacks, virtual[0], shardings)
        first, handed, cut_runs = gradient_programs(split, labels, virtual[0], n_state, stacks,
                                                    remat, rerun, rows, pins=pins)
        tasks, cut_vars = [first], [handed]
        for v in virtual[1:]:
            more, handed, _ = gradient_programs(split, labels, v, n_state, stacks, remat,
                                                rerun, rows, cut_runs, pins)
            tasks.append(more)
            cut_vars.append(handed)
        tasks = [[_spread(t, self._meshes[t.stage]) for t in ts] if width > 1 else ts
                 for ts, width in zip(tasks, self._widths, strict=True)]
        cut_rows = RowSplit(len(split.cut_avals), cut_runs)
        if rows.runs or cut_runs:  # the update over the pieces (rows.py)
            split = _update_over_pieces(split, rows, cut_rows, n_state,
                                        returns_state=self._parent is None)
            for s, (state_sh, batch_sh) in shardings.items():
                shardings[s] = ([state_sh[j] for j, _ in rows.internal], batch_sh)
        update, where, home, cut_at = self._update_programs(split, tasks, cut_vars, shardings)
        n_internal = len(rows.internal)
        return _Prepared(split, tuple(kinds[i] for i, _ in cut_rows.internal), virtual, tasks,
                         update, where, home, cut_at, shardings,
                         _needs(tasks, update, where, home),
                         [v.aval for v in split.update.jaxpr.invars[:n_internal]], rows,
                         cut_vars,
                         [np.shape(x) for x in jax.tree.leaves(state)])

    def _stage_shardings(self, state: Any, batch: Any,
                         ) -> tuple[dict[int, tuple[list[Any], list[Any]]], dict[int, Pins]]:
        """Per stage, its state and batch leaves' shardings; per stage, its layout's pins."""
        plan = self.plan
        shardings = {}
        pins: dict[int, Pins] = {}
        for st in plan.stages:
            layout = plan.layouts[st.layout] if st.layout else Layout(
                {k: spec for k, (_, spec) in plan.param_specs.items()}, plan.batch_specs)
            if layout.kernel_specs:  # the stage's kernel calls run split (constrain.Pins)
                pins[st.index] = Pins.of({parse_path(k): v for k, v in
                                          layout.kernel_specs.items()}, self._meshes[st.index])
            batch_specs = (self._form.batch_specs(layout.batch_specs)
                           if self._form is not None else layout.batch_specs)
            shardings[st.index] = (
                jax.tree.leaves(leaf_shardings(state, layout.param_specs,
                                               self._meshes[st.index], "state")),
                jax.tree.leaves(leaf_shardings(batch, batch_specs,
                                               self._meshes[st.index], "batch")))
        for s, (state_sh, batch_sh) in shardings.items():
            if REPLICA in self._meshes[s].axis_names:  # the members' microbatches, joined
                shardings[s] = (state_sh, [NamedSharding(x.mesh, P(_joined_axis(x.spec),
                                                                   *x.spec[1:]))
                                           for x in batch_sh])
        return shardings, pins

    def _batch_samples(self, shardings: dict[int, tuple[list[Any], list[Any]]],
                       batch: Any) -> dict[int, tuple[Any, int]]:
        """Per stage, how its batch splits samples, and one member's microbatch size."""
        samples: dict[int, tuple[Any, int]] = {}
        size = int(np.shape(jax.tree.leaves(batch)[0])[0])  # one member's microbatch
        for s, (_, batch_sh) in shardings.items():
            entry = next((x.spec[0] for x in batch_sh if len(x.spec)), None)
            names = (entry,) if isinstance(entry, str) else tuple(entry or ())
            split_over = int(np.prod([self._meshes[s].shape[n] for n in names if n != REPLICA]))
            samples[s] = ((entry if names and size % split_over == 0 else None), size)
        return samples

    def _update_programs(self, split: StepSplit, tasks: list[list[Program]],
                         cut_vars: list[list[Any]],
                         shardings: dict[int, tuple[list[Any], list[Any]]],
                         ) -> tuple[list[list[Program]], list[list[Any]], list[list[int]],
                                    list[list[int]]]:
        """Per replica: update programs, outputs' places, leaves' homes, cut values' stages."""
        # Every replica updates its own layers: the update cut by its own stages.
        update, where, home, cut_at = [], [], [], []
        for r, (ts, handed) in enumerate(zip(tasks, cut_vars, strict=True)):
            read_at, at = _read_and_cut_at(ts, handed)
            programs, out_at, leaf_at = update_programs(
                split, read_at, at, self._replicas[r].stages[0],
                lambda s, j: shardings[s][0][j])
            update.append(programs)
            where.append(out_at)
            home.append(leaf_at)
            cut_at.append(at)
        return update, where, home, cut_at

    # -- one step -------------------------------------------------------------------------

    def _issue_order(self, replica: int, tasks: list[Program],
                     virtual: VirtualStages) -> list[tuple[Program, int]]:
        """Every (task, microbatch) of a replica in an order that respects the data flow and
        each stage's schedule (a round-robin merge of the stages' device orders)."""
        k, big_k = len(virtual.stages), virtual.count
        m = self._counts[replica]
        schedule: Schedule = ("interleaved" if big_k > k else
                              "gpipe" if self.plan.schedule == "gpipe" else "1f1b")
        if schedule == "interleaved" and m % k:
            raise PipelineError(format_error(
                "The interleaved schedule needs a multiple of the stage count of microbatches.",
                where=f"plan.replicas[{replica}].microbatches", value=(m, k),
                remedy=f"use {m + k - m % k} microbatches"))
        queues = [[(2 * big_k - 1 - (c * k + p) if kind == "backward" else c * k + p, j)
                   for kind, j, c in device_order(schedule, p, k, m, big_k // k)]
                  for p in range(k)]
        by_key = {t.key: t for t in tasks}
        done: set[tuple[int, int]] = set()
        out: list[tuple[Program, int]] = []
        heads = [0] * k
        while any(heads[p] < len(queues[p]) for p in range(k)):
            moved = False
            for p in range(k):
                while heads[p] < len(queues[p]):
                    o, j = queues[p][heads[p]]
                    if o > 0 and (o - 1, j) not in done:  # microbatch j's previous task
                        break
                    done.add((o, j))
                    if o in by_key:
                        out.append((by_key[o], j))
                    heads[p] += 1
                    moved = True
            if not moved:  # a schedule whose orders wait on each other: a bug, not the input
                raise PipelineError(format_error(
                    "The pipeline schedule deadlocks.", where=f"replica {replica}",
                    remedy="report this with the plan"))
        return out

    def _place(self, ready: _Prepared, leaves: list[Any]) -> dict[tuple[int, int], Any]:
        """Every stage's copy of the state leaves it reads: a leaf the last call returned
        comes from its stage, a new one from where it is (in every process)."""
        here = self._mover.here
        owner = self._owner()
        placed: dict[tuple[int, int], Any] = {}
        for s, js in ready.needs.items():
            r = self._party[s]
            for j in js:
                x, target = leaves[j], ready.shardings[s][0][j]
                if j < len(owner._returned) and x is owner._returned[j]:
                    # the leaf the last call returned: this replica's own copy of it
                    x, src = ((owner._kept[r][0][j], owner._kept[r][1][j]) if r in owner._kept
                              else (x, owner._located[j]))
                    if s != src:
                        placed[s, j] = self._mover.move(x if here[src] else None,
                                                        ready.state_avals[j], src, s, target)
                        continue
                if not here[s]:
                    placed[s, j] = None
                elif isinstance(x, jax.Array) and x.sharding == target:
                    placed[s, j] = x
                else:  # a copy: the update programs donate it (runtime/spmd.py `_placed`)
                    placed[s, j] = jax.device_put(
                        jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, target)
        return placed

    def _owner(self) -> PipelinedStep:
        """The step whose returned state this one's placement starts from: itself, or for an
        evaluator the step it evaluates (whose internal leaves it checks are its own)."""
        parent = self._parent
        if parent is None:
            return self
        if parent._ready is not None and self._ready is not None and (
                parent._ready.rows != self._ready.rows or parent._groups != self._groups):
            raise PipelineError(format_error(
                "The evaluation holds the state in other pieces than the train step does.",
                where="PipelinedStep.evaluator", value=(parent._ready.rows, self._ready.rows),
                remedy="report this with the plan"))
        return parent

    @api_boundary
    def _run(self, prog: Program, name: str, args: list[Any]) -> Any:
        """Runs one program; in the first call, compiles it first (checked against its
        device's memory before it runs); in a clocked call, times it to completion."""
        if self._compiled is not None:
            if id(prog) not in self._seen:
                self._seen.add(id(prog))
                figures = compiled_figures([(prog.stage, name, prog.fn.lower(*args).compile())])
                check_fits(self.plan, figures)
                self._compiled["programs"] += figures["programs"]
            key = (prog.stage, name)
            self._beside[key] = max(self._beside.get(key, 0), self._held_beside(prog.stage, args))
        if self._stage_busy is None:
            return prog.fn(*args)
        start = time.perf_counter()
        out = jax.block_until_ready(prog.fn(*args))
        busy = self._stage_busy
        busy[prog.stage] = busy.get(prog.stage, 0.0) + time.perf_counter() - start
        return out

    def _held_beside(self, stage: int, args: list[Any]) -> int:
        """Bytes one device of ``stage`` holds, in arrays the driver keeps (state copies,
        values between tasks, batches, sums), that are not among ``args``: what the device
        holds beside a program's own figure while it runs."""
        device = self._meshes[stage].devices.flat[0]
        mine = {id(a) for a in jax.tree.leaves(args)}
        seen: set[int] = set()
        total = 0
        for held in self._holdings:
            for x in jax.tree.leaves(held()):
                if (not isinstance(x, jax.Array) or id(x) in mine or id(x) in seen
                        or x.is_deleted() or device not in x.sharding.device_set):
                    continue
                seen.add(id(x))
                total += int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)
                             ) * x.dtype.itemsize
        return total

    def __call__(self, state: Any, batch: Any) -> Any:
        first = self._ready is None
        if first:
            check_arguments(self.plan, state, batch)
            if self._verify:
                self._compiled = compiled_figures([])
        timer = self._timer
        # The last timed step also clocks every program (waiting for each): per-stage busy
        # times; it is left out of the step times.
        clocked = timer.steps > 0 and len(timer.step_times_s) == timer.steps - 1 and timer.timing
        if clocked:
            self._stage_busy = {}
        self._mover.moved_bytes = self._mover.batch_bytes = 0
        self._mover.sync_bytes = {}
        out, done = timer.run(lambda: self._call(state, batch))
        self._moved_last = (self._mover.moved_bytes, self._mover.batch_bytes,
                            dict(self._mover.sync_bytes))
        # The driver's containers (placed copies, gradient sums, the update's values) are the
        # step's: drop them, or the device holds them until the next step.
        self._holdings = []
        if self._compiled is not None:
            figures = self._compiled
            for program in figures["programs"]:
                program["beside_bytes"] = self._beside.get(
                    (program["stage"], program["name"]), 0)
            # A merged replica's program runs on every member's devices: listed per member
            # stage too, ``same_as`` the stage it was compiled for (counted once in totals).
            figures["programs"] += [{**program, "stage": member, "same_as": program["stage"]}
                                    for program in figures["programs"]
                                    for member in self._members.get(program["stage"], ())]
            self.plan = dataclasses.replace(self.plan, compiled=figures)
            self._compiled = None
            self._holdings = []
        if clocked:
            busy, self._stage_busy = self._stage_busy or {}, None
            if done:
                measured = timer.measured()
                if len(timer.step_times_s) > 1:  # the clocked step waited on every program
                    measured["step_time_s"] = statistics.median(timer.step_times_s[:-1])
                    measured["steps"] -= 1
                measured["stage_time_s"] = {str(st): t for st, t in sorted(busy.items())}
                # what the step's transfers between sub-meshes delivered, and its batch
                measured["moved_bytes"], measured["batch_bytes"], sync = self._moved_last
                if sync:  # what the replicas' gradient exchange brought each stage
                    measured["sync_moved_bytes"] = {str(st): b for st, b in sorted(sync.items())}
                # what each device holds after the step (the state it returned, chiefly)
                measured.update(device_bytes(
                    d for st in self.plan.stages for d in st.mesh.device_ids))
                self.plan = dataclasses.replace(self.plan, measured=measured)
        return out

    def _call(self, state: Any, batch: Any) -> Any:
        total = sum(c * w for c, w in zip(self._counts, self._widths, strict=True))
        parts = split_batch(batch, total, size=self.plan.microbatch_size or None)
        if self._ready is None:
            self._form = accumulation_form(
                self._step, state, parts[0], accumulation=self.plan.accumulation,
                microbatches=total, what=f"a plan of {total} microbatches")
        if self._form is not None:  # the batch with each sample's index and normalisers
            parts = split_batch((batch, self._form.context(state, batch)), total)
        if self._ready is None:
            self._ready = self._prepare(state, parts)
        ready = self._ready
        split, mover = ready.split, self._mover
        placed = self._place(ready, self._internal(ready, jax.tree.leaves(state)))
        sums: list[list[Any]] = []  # per replica, per cut value: its sum on its stage
        self._holdings = [lambda: list(placed.values()), lambda: sums]
        if (parent := self._parent) is not None:  # beside an evaluation: the step's state
            self._holdings.append(
                lambda: [parent._returned, [kept for kept, _ in parent._kept.values()]])
        first = 0
        for r, (count, width) in enumerate(zip(self._counts, self._widths, strict=True)):
            mine = parts[first:first + count * width]
            if width > 1:  # microbatch j of a merged replica: its members' j-th, joined
                mine = [jax.tree.map(_joined, *mine[j * width:(j + 1) * width])
                        for j in range(count)]
            sums.append(self._run_replica(r, ready, placed, mine,
                                          {v: i for i, v in enumerate(ready.cut_vars[r])}))
            first += count * width
        if len(sums) > 1:  # replicas that differ: every one gets the totals (exchange.py)
            if self._exchange is None:
                self._exchange = Exchange(
                    ready.cut_at, split.cut_avals,
                    lambda r, i: (sums[r][i].sharding if sums[r][i] is not None
                                  else mover.replicated(ready.cut_at[r][i])), self._meshes)
            sums[:] = self._exchange.run(
                sums, self._run, lambda items: mover.move_many(items, sync=True),
                lambda s: mover.here[s])
        if total > 1:  # the means, one program per stage holding sums
            for local, cut_at in zip(sums, ready.cut_at, strict=True):
                for stage in set(cut_at):
                    idx = [i for i, (x, at) in enumerate(zip(local, cut_at, strict=True))
                           if at == stage and x is not None and ready.kinds[i] == "mean"]
                    if idx:
                        for i, x in zip(idx, _divided([local[i] for i in idx], total),
                                        strict=True):
                            local[i] = x
        if self._parent is not None:  # an evaluation: its metrics, nothing updated
            out = jax.tree.unflatten(split.out_tree, self._update(ready, 0, placed, sums[0],
                                                                  returns_state=False)[2])
        else:
            for r in range(1, len(sums)):  # each replica updates its own copy
                self._kept[r] = self._update(ready, r, placed, sums[r])[:2]
            leaves, located, outputs = self._update(ready, 0, placed, sums[0])
            self._returned, self._located = leaves, located
            users = self._users(ready, leaves)
            self._user_returned = users
            out = jax.tree.unflatten(split.out_tree, [*users, *outputs])
        if mover.multi:
            _all_processes_at(f"shardplan-pipeline-step-{next(_STEPS_ENDED)}")
        return out

    def _update(self, ready: _Prepared, r: int, placed: dict[tuple[int, int], Any],
                cut: list[Any], *, returns_state: bool = True,
                ) -> tuple[list[Any], list[int], list[Any]]:
        """Replica ``r``'s update programs, level by level, on its totals ``cut``: the new
        internal state leaves, their stages, and the step's other outputs (an evaluation
        returns no state: all its outputs are the others)."""
        mover, split = self._mover, ready.split
        jaxpr = split.update.jaxpr
        n_state = len(ready.state_avals) if returns_state else 0
        cut_at, home = ready.cut_at[r], ready.home[r]
        store: dict[tuple[Any, int], Any] = {(("cut", i), s): x
                                             for i, (s, x) in enumerate(zip(cut_at, cut,
                                                                            strict=True))}
        made: dict[Any, int] = {("cut", i): s for i, s in enumerate(cut_at)}
        avals = {("cut", i): a for i, a in enumerate(split.cut_avals)}
        self._holdings.append(lambda: list(store.values()))

        for prog in ready.update[r]:
            # what the program reads from other stages (a norm's partial sums, a clip factor,
            # a counter: scalars, mostly), moved in one call
            wanted = {key: aval for kind, what in prog.inputs if kind != "state"
                      for key, aval in [(("cut", what), avals["cut", what]) if kind == "cut"
                                        else (what, what.aval)]
                      if (key, prog.stage) not in store}
            routes = [(store[key, made[key]], aval, made[key], prog.stage,
                       mover.replicated(prog.stage)) for key, aval in wanted.items()]
            for key, x in zip(wanted, mover.move_many(routes), strict=True):
                store[key, prog.stage] = x
            args = [placed[prog.stage, what] if kind == "state" else
                    store[("cut", what) if kind == "cut" else what, prog.stage]
                    for kind, what in prog.inputs]
            outs = (self._run(prog, f"update {prog.key}", args) if mover.here[prog.stage]
                    else [None] * len(prog.outputs))
            for v, x in zip(prog.outputs, outs, strict=True):
                store[v, prog.stage], made[v] = x, prog.stage
        leaves: list[Any] = []
        located: list[int] = []
        for n, w in enumerate(ready.where[r]):
            if w[0] == "literal":
                leaves.append(np.asarray(w[1]))
                located.append(-1)
                continue
            if w[0] == "value":
                x, s = store[w[1], w[2]], w[2]
            elif w[0] == "state":
                x, s = placed[home[w[1]], w[1]], home[w[1]]
            else:
                x, s = cut[w[1]], cut_at[w[1]]
            if x is None:
                aval = jaxpr.outvars[n].aval
                x = placeholder(aval, ready.shardings[s][0][n]
                                 if n < n_state and w[0] != "cut" else mover.replicated(s))
            leaves.append(x)
            located.append(s)
        return leaves[:n_state], located[:n_state], leaves[n_state:]

    def _internal(self, ready: _Prepared, leaves: list[Any]) -> list[Any]:
        """The internal state leaves of the user's (a stacked leaf held as pieces: the pieces
        the last call returned, else its rows sliced)."""
        if not ready.rows.runs:
            return leaves
        owner = self._owner()
        out = []
        for n, (j, r) in enumerate(ready.rows.internal):
            x = leaves[j]
            if r is None:
                out.append(x)
            elif j < len(owner._user_returned) and x is owner._user_returned[j]:
                out.append(owner._returned[n])
            else:
                out.append(x[r[0]:r[1]])
        return out

    def _users(self, ready: _Prepared, leaves: list[Any]) -> list[Any]:
        """The user's state leaves of the internal ones: a stacked leaf's pieces shown as one
        array over their stages' devices (``rows.assembled``)."""
        if not ready.rows.runs:
            return leaves
        out: list[Any] = []
        for n, (j, r) in enumerate(ready.rows.internal):
            if r is None:
                out.append(leaves[n])
            elif r == ready.rows.runs[j][0]:
                parts = leaves[n:n + len(ready.rows.runs[j])]
                whole = assembled(ready.user_shapes[j], parts)
                if whole is None:  # _row_split only splits leaves that assemble
                    raise PipelineError(format_error(
                        "A stacked leaf's per-stage rows do not form one array.",
                        where=f"state leaf {j}", value=[p.sharding for p in parts],
                        remedy="report this with the plan"))
                out.append(whole)
        return out

    def _run_replica(self, r: int, ready: _Prepared, placed: dict[tuple[int, int], Any],
                     parts: Sequence[Any],
                     cut_index: dict[Any, int]) -> list[Any]:
        """Runs replica ``r``'s tasks on its microbatches; its cut values summed where they
        were produced (``ready.cut_at[r]``)."""
        sums = self._run_tasks(r, ready, placed, parts, cut_index)
        local, at = self._stage_sums(ready, ready.tasks[r], sums, cut_index)
        if self._widths[r] > 1:  # the members' sums meet: one all-reduce per stage
            local = self._members_meet(r, ready, local, at)
        return local

    def _run_tasks(self, r: int, ready: _Prepared, placed: dict[tuple[int, int], Any],
                   parts: Sequence[Any], cut_index: dict[Any, int]) -> dict[int, list[Any]]:
        """Per task key of replica ``r``, its cut outputs summed over the microbatches."""
        tasks, virtual = ready.tasks[r], ready.virtual[r]
        mover = self._mover
        values = _Values(tasks, virtual.count, mover)
        batches: dict[tuple[int, int], list[Any]] = {}
        sums: dict[int, list[Any]] = {}  # task key -> its cut outputs' running sums
        holdings = [lambda: list(values.copies.values()), lambda: list(batches.values()),
                    lambda: list(sums.values())]
        self._holdings += holdings
        owned: set[int] = set()  # the task keys whose sums no one else holds
        if r not in self._orders:
            self._orders[r] = self._issue_order(r, tasks, virtual)
        for task, j in self._orders[r]:
            s = task.stage
            here = mover.here[s]
            if here and (s, j) not in batches and any(k == "batch" for k, _ in task.inputs):
                leaves = jax.tree.leaves(parts[j])
                mover.batch_bytes += sum(received(x, sh) for x, sh in
                                         zip(leaves, ready.shardings[s][1], strict=True))
                batches[s, j] = jax.device_put(leaves, ready.shardings[s][1])
            args = [placed[s, what] if kind == "state" else
                    (batches[s, j][what] if here else None) if kind == "batch" else
                    values.get(what, j, s, task.key) for kind, what in task.inputs]
            outs = (self._run(task, f"replica {r} task {task.key}", args) if here
                    else [None] * len(task.outputs))
            for v, x in zip(task.outputs, outs, strict=True):
                values.put(v, j, s, x)
            if here:
                cuts = [x for v, x in zip(task.outputs, outs, strict=True)
                        if task.terms.get(v, v) in cut_index]
                if task.key not in sums:
                    sums[task.key] = cuts
                else:  # from the third microbatch on, the sums are the adds' own buffers
                    add = _add_in_place if task.key in owned else _add
                    sums[task.key] = add(sums[task.key], cuts)
                    owned.add(task.key)
            self.peak_microbatches[s] = max(self.peak_microbatches.get(s, 0),
                                            values.saved_microbatches(s))
        for holding in holdings:  # the sums go on as the step's; the rest is dropped here
            self._holdings.remove(holding)
        return sums

    def _stage_sums(self, ready: _Prepared, tasks: Sequence[Program],
                    sums: dict[int, list[Any]], cut_index: dict[Any, int],
                    ) -> tuple[list[Any], list[int]]:
        """Per cut value, the replica's sum (terms met on the latest stage), and its stage."""
        mover = self._mover
        # Per cut value, the stages' sums of it (several: terms of a value summed over stages,
        # partition.py), the latest task's first; they meet on its stage.
        terms: dict[int, list[tuple[int, Any]]] = {}
        for task in sorted(tasks, key=lambda t: -t.key):
            held = iter(sums.get(task.key, ()))
            for v in task.outputs:
                if (c := task.terms.get(v, v)) in cut_index:
                    terms.setdefault(cut_index[c], []).append((task.stage, next(held, None)))
        local: list[Any] = [None] * len(cut_index)
        at = [0] * len(cut_index)
        for i, parts in terms.items():
            (stage, x), rest = parts[0], parts[1:]
            at[i] = stage
            for s, y in rest:  # None where the sum's stage is another process's
                y = mover.move(y, ready.split.cut_avals[i], s, at[i], mover.spread(at[i]))
                x = y if x is None else x + y
            local[i] = x
        return local, at

    def _members_meet(self, r: int, ready: _Prepared, local: list[Any],
                      at: list[int]) -> list[Any]:
        """``local`` with each sum all-reduced over merged replica ``r``'s members."""
        for stage in sorted(set(at)):
            idx = [i for i, s in enumerate(at) if s == stage and local[i] is not None]
            if (r, stage) not in self._syncs:
                self._syncs[r, stage] = _sync(
                    stage, [local[i] for i in idx],
                    [ready.split.cut_avals[i] for i in idx], self._widths[r])
            reduced = self._run(self._syncs[r, stage], f"sync {stage}",
                                [[local[i] for i in idx]])
            for i, x in zip(idx, reduced, strict=True):
                local[i] = x
        return local


def _read_and_cut_at(tasks: Sequence[Program], cut_vars: Sequence[Any],
                     ) -> tuple[dict[int, int], list[int]]:
    """A replica's state leaves -> the stage of its first task reading them, and per cut value
    the stage its sum is on (a value summed over several stages' terms: its latest term's)."""
    read_at: dict[int, int] = {}
    cut_index = {v: i for i, v in enumerate(cut_vars)}
    cut_at = [0] * len(cut_index)
    for prog in sorted(tasks, key=lambda t: t.key):
        for kind, j in prog.inputs:
            if kind == "state":
                read_at.setdefault(j, prog.stage)
        for v in prog.outputs:
            if prog.terms.get(v, v) in cut_index:
                cut_at[cut_index[prog.terms.get(v, v)]] = prog.stage
    return read_at, cut_at


def _row_split(split: StepSplit, state: Any,
               stacks: dict[str, tuple[list[str], frozenset[int]]], virtual: VirtualStages,
               shardings: dict[int, tuple[list[Any], list[Any]]]) -> RowSplit:
    """The state leaves to hold as per-stage pieces (rows.py): the stacked leaves a top-level
    scan of the gradient part reads row by row, for a stack whose rows lie on several of
    replica 0's stages, and the optimizer state of their shape; each only where its pieces
    form one array over their stages' devices (``rows.expressible``; else it stays whole on
    one stage, with a warning: the stage planner cuts stacks only where they do,
    ``solver.pipeline.stack_violations``, so only an edited plan gets there)."""
    jaxpr = split.gradient.jaxpr
    leaves = jax.tree.leaves(state)
    invar = {v: j for j, v in enumerate(jaxpr.invars[:len(leaves)])}
    runs: dict[int, tuple[tuple[int, int], ...]] = {}
    where: dict[tuple[tuple[int, int], ...], list[int]] = {}  # runs -> their stages

    def fits(j: int, r: tuple[tuple[int, int], ...]) -> bool:
        return expressible([shardings[s][0][j] for s in where[r]], r, np.ndim(leaves[j]))

    whole: dict[str, tuple[tuple[int, int], ...]] = {}
    for name, (layers, owned) in stacks.items():
        if not all(layer in virtual.owner for layer in layers):
            continue
        r = row_runs(layers, virtual.owner)
        where[r] = [virtual.stages[virtual.position[virtual.owner[layers[a]]]] for a, _ in r]
        if len(r) < 2:
            continue
        for e in jaxpr.eqns:
            if e.primitive.name != "scan" or e.params["length"] != len(layers):
                continue
            for x in e.invars[e.params["num_consts"] + e.params["num_carry"]:]:
                j = invar.get(x) if _is_var(x) else None
                if j is not None and j in owned and np.shape(leaves[j])[:1] == (len(layers),):
                    if fits(j, r):
                        runs[j] = r
                    else:
                        whole[name] = r
    if whole:
        warnings.warn(format_error(
            "A scanned stack is cut where its stages' rows do not form one array: its stacked "
            "leaves stay whole on one stage, and every stage reading them fetches a full copy "
            "(more memory than the plan predicts).",
            where=f"the stack {', '.join(whole)}", value={k: list(v) for k, v in whole.items()},
            remedy="cut the stack into runs of equal length on distinct stages of one device "
                   "type and sub-mesh size, as sp.make_plan does"), ShardplanWarning,
            stacklevel=5)
    read = {invar[v] for e in jaxpr.eqns for v in e.invars if _is_var(v) and v in invar}
    for j, x in enumerate(leaves):
        if j in runs or j in read:
            continue
        alike = {runs[k] for k in runs if np.shape(leaves[k]) == np.shape(x)}
        if len(alike) == 1 and fits(j, r := alike.pop()):
            runs[j] = r
    return RowSplit(len(leaves), runs)


def _update_over_pieces(split: StepSplit, rows: RowSplit, cut_rows: RowSplit,
                        n_state: int, *, returns_state: bool = True) -> StepSplit:
    """``split`` with its update over the pieces of the leaves and cut values held so; its
    first ``n_state`` outputs are the new state's leaves, held in the same pieces, unless it
    is an evaluation's (``returns_state=False``: its outputs are metrics, whole)."""
    cut_runs = cut_rows.runs
    update_jaxpr = split_rows(
        split.update,
        [*(rows.runs.get(j) for j in range(n_state)),
         *(cut_runs.get(i) for i in range(len(split.cut_avals)))],
        [rows.runs.get(j) if returns_state and j < n_state else None
         for j in range(len(split.update.jaxpr.outvars))])
    return dataclasses.replace(split, update=update_jaxpr,
                               cut_avals=tuple(cut_rows.avals(split.cut_avals)))


def _needs(tasks: Sequence[Sequence[Program]], update: Sequence[Sequence[Program]],
           where: Sequence[Sequence[Any]], home: Sequence[Sequence[int]],
           ) -> dict[int, list[int]]:
    """Per stage, the internal state leaves it reads (its programs', and those it returns)."""
    needs: dict[int, set[int]] = {}
    for prog in [*(t for ts in tasks for t in ts), *(u for us in update for u in us)]:
        needs.setdefault(prog.stage, set()).update(
            j for kind, j in prog.inputs if kind == "state")
    for out_at, leaf_at in zip(where, home, strict=True):
        for w in out_at:
            if w[0] == "state":
                needs.setdefault(leaf_at[w[1]], set()).add(w[1])
    return {s: sorted(js) for s, js in needs.items()}


@functools.partial(jax.jit, static_argnums=1)
def _divided(values: list[Any], count: int) -> list[Any]:
    """Sums of ``count`` microbatches as their means (one dispatch)."""
    return [(x / count).astype(x.dtype) for x in values]


def _bare(x: Any) -> Any:
    """``x``'s shape and dtype, without its placement."""
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype if hasattr(x, "dtype") else np.result_type(x),
                                weak_type=bool(getattr(x, "weak_type", False)))


def _joined(*xs: Any) -> Any:
    """Leaves of several microbatches as one, joined along the samples (host arrays stay on
    the host until placed)."""
    return (np.concatenate(xs) if all(isinstance(x, np.ndarray) for x in xs)
            else jnp.concatenate(xs))


def _sum(sums: list[Any], values: list[Any]) -> list[Any]:
    """One task's running sums plus its outputs of one more microbatch (one dispatch)."""
    return [a + b for a, b in zip(sums, values, strict=True)]


_add = jax.jit(_sum)
_add_in_place = jax.jit(_sum, donate_argnums=0)  # for sums that only the executor holds


class _Values:
    """The values crossing one replica's tasks, per microbatch and stage.

    A value stays where it was produced until the stages that read it fetch it, each when its
    first task reading it runs (a stage receives an activation when it runs the forward that
    needs it, with ``jax.device_put``), and every copy is dropped after its last reader. A
    stage *saves* microbatch ``j`` while it holds a value that its own backward of ``j`` will
    read (the activations kept for the backward).
    """

    def __init__(self, tasks: Sequence[Program], virtual_count: int, mover: _Mover) -> None:
        self.k = virtual_count  # tasks of this key and later are backward
        self.mover = mover
        self.readers: dict[tuple[Any, int], list[int]] = {}  # (value, stage) -> reader keys
        for task in tasks:
            for kind, what in task.inputs:
                if kind == "value":
                    self.readers.setdefault((what, task.stage), []).append(task.key)
        self.stages_reading: dict[Any, set[int]] = {}
        for v, at in self.readers:
            self.stages_reading.setdefault(v, set()).add(at)
        self.copies: dict[tuple[Any, int, int], Any] = {}  # (value, microbatch, stage)
        self.left: dict[tuple[Any, int, int], int] = {}  # reads still to come
        self.saved: dict[tuple[Any, int, int], int] = {}  # backward reads still to come
        self.source: dict[tuple[Any, int], int] = {}  # the stage that produced it
        self.fetches: dict[tuple[Any, int], int] = {}  # stages still to fetch it
        self.held: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> saved values

    def _keep(self, v: Any, j: int, at: int, x: Any) -> None:
        orders = self.readers.get((v, at), [])
        self.copies[v, j, at], self.left[v, j, at] = x, len(orders)
        backward = sum(o >= self.k for o in orders)
        if backward:
            self.saved[v, j, at] = backward
            self.held[at, j] = self.held.get((at, j), 0) + 1

    def _drop(self, v: Any, j: int, at: int) -> None:
        del self.copies[v, j, at]
        if self.saved.pop((v, j, at), 0):
            self.held[at, j] -= 1

    def put(self, v: Any, j: int, at: int, x: Any) -> None:
        """Task output ``v`` of microbatch ``j``, produced on stage ``at`` (``None``: by
        another process)."""
        if v in self.stages_reading:
            self._keep(v, j, at, x)
            self.source[v, j] = at
            self.fetches[v, j] = len(self.stages_reading[v] - {at})

    def get(self, v: Any, j: int, at: int, order: int) -> Any:
        """Value ``v`` of microbatch ``j`` for the task of ``order`` on stage ``at``."""
        if (v, j, at) not in self.copies:  # fetch it from where it was produced
            origin = self.source[v, j]
            self._keep(v, j, at, self.mover.move(self.copies[v, j, origin], v.aval, origin, at,
                                                 self.mover.landing(at, v.aval)))
            self.fetches[v, j] -= 1
            if not self.fetches[v, j] and not self.left[v, j, origin]:
                self._drop(v, j, origin)
        x = self.copies[v, j, at]
        self.left[v, j, at] -= 1
        if order >= self.k and self.saved.get((v, j, at)):
            self.saved[v, j, at] -= 1
            if not self.saved[v, j, at]:
                del self.saved[v, j, at]
                self.held[at, j] -= 1
        if not self.left[v, j, at] and (self.source[v, j] != at or not self.fetches[v, j]):
            self._drop(v, j, at)
        return x

    def saved_microbatches(self, at: int) -> int:
        """The microbatches stage ``at`` saves values for now."""
        return sum(1 for (s, _), n in self.held.items() if s == at and n > 0)
