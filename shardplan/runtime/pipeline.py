"""Running multi-stage plans: the gradient part of the step cut into per-stage forward and
backward programs on the stages' sub-meshes, driven microbatch by microbatch from Python.

On top of :mod:`shardplan.runtime.accumulate` (the step cut into a per-microbatch gradient part
and an update part), :class:`PipelinedStep` cuts the gradient part once more, by stage:

* **Labels.** The step is traced by :func:`shardplan.trace` at the microbatch's shapes; its op
  paths map every top-level equation to the layers it belongs to, the plan's stages name their
  layers, and JAX's autodiff names each equation forward or backward. An equation of a layer
  held by the replica's stage ``p`` is task ``F_p`` (forward) or ``B_p`` (backward); tasks are
  ordered ``F_0 < ... < F_{k-1} < B_{k-1} < ... < B_0``. An equation of no single stage (the
  shared layer: loss scaling, constants) joins the latest task among its producers, or, when it
  reads only the state and the batch, the earliest task that reads it.
* **Tasks.** Each task is a sub-jaxpr: its inputs are the state and batch leaves it reads and
  the values earlier tasks produce (activations from the previous stage, residuals of its own
  forward, cotangents from the next stage); its outputs are what later tasks read and its share
  of the cut values (gradients, metrics). Each task is compiled once, for its stage's sub-mesh;
  the state leaves it reads arrive with its layout's shardings, values from another stage by
  ``jax.device_put`` (replicated on the receiving sub-mesh).
* **Schedule.** The tasks of every microbatch are issued in an order that respects the data
  flow and follows each stage's schedule (:func:`~shardplan.solver.simulate.device_order`:
  GPipe, or 1F1B's warm-up forwards then one backward one forward); JAX's asynchronous
  dispatch lets the stages run concurrently.
* **Step end.** Each replica sums its microbatches' cut values on the devices that produced
  them; the sums meet on the first stage of replica 0, the mean-type ones are divided by the
  microbatch count, and the update part runs there once. Every stage reads the new state at the
  next step.

A one-stage replica is the degenerate case (tasks ``F_0`` and ``B_0`` on one sub-mesh):
data parallelism across device types with uneven microbatch counts.

Not yet: interleaved schedules (a stage holding several chunks), layers of a scanned stack on
different stages (the scan would have to be split by rows), the update split by stage, and
multi-process execution; each is refused with a clear error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.errors import PipelineError, format_error
from shardplan.plan import Plan
from shardplan.runtime.accumulate import (
    StepSplit,
    autodiff_phase,
    reduction_kinds,
    split_batch,
    split_step,
)
from shardplan.runtime.spmd import leaf_shardings, stage_mesh
from shardplan.solver.pipeline import Schedule
from shardplan.solver.simulate import device_order

__all__ = ["PipelinedStep"]


@dataclass(frozen=True)
class _Task:
    """One (stage, forward / backward) program of a replica.

    Attributes:
      order: position in ``F_0 .. F_{k-1}, B_{k-1} .. B_0``.
      stage: the replica's stage position.
      fn: the compiled program.
      inputs: per input, ``("state", leaf)``, ``("batch", leaf)`` or ``("value", var)``.
      outputs: the variables it produces for later tasks or the cut.
    """

    order: int
    stage: int
    fn: Any
    inputs: tuple[tuple[str, Any], ...]
    outputs: tuple[Any, ...]


def _is_var(v: Any) -> bool:
    return not isinstance(v, jcore.Literal)


def _layer_of_equations(step: Callable[..., Any], state: Any,
                        batch: Any) -> dict[int, frozenset[str]]:
    """Per top-level equation index of the step's jaxpr at these shapes, the names of the
    layers its ops belong to (:func:`shardplan.trace`; equations with no op: absent)."""
    from shardplan.trace import trace

    graph = trace(step, jax.eval_shape(lambda: state), jax.eval_shape(lambda: batch))
    names = [layer.name for layer in graph.layers]
    out: dict[int, set[str]] = {}
    for op in graph.ops:
        if op.path is not None:
            out.setdefault(op.path[0], set()).update(names[i] for i in op.layers)
    return {i: frozenset(x) for i, x in out.items()}


class PipelinedStep:
    """A train step bound to a multi-stage or microbatched plan: call it like the original
    step (the module docstring)."""

    def __init__(self, train_step: Callable[..., Any], plan: Plan) -> None:
        # (one-stage replicas run their chunks back to back: interleaving changes nothing)
        if plan.schedule == "interleaved" and plan.chunks > 1 and any(
                len(r.stages) > 1 for r in plan.replicas):
            raise PipelineError(format_error(
                "Interleaved pipelines cannot run yet.", where="plan.schedule",
                value=(plan.schedule, plan.chunks),
                remedy="make the plan with PlanConfig(schedules=('1f1b',))"))
        self._step = train_step
        self.plan = plan
        self._meshes = {s.index: stage_mesh(plan, s.index) for s in plan.stages}
        self._counts = plan.replica_microbatches
        self._ready: Any = None
        self.peak_microbatches: dict[int, int] = {}
        """After a call: per stage (index into ``plan.stages``), the most microbatches whose
        values (activations, residuals) the stage held at once."""

    # -- preparation ----------------------------------------------------------------------

    def _tasks(self, split: StepSplit, labels: dict[int, frozenset[str]], replica: int,
               state: Any, batch: Any) -> list[_Task]:
        plan = self.plan
        stages = [plan.stages[i] for i in plan.replicas[replica].stages]
        k = len(stages)
        owner: dict[str, int] = {}
        for p, st in enumerate(stages):
            for name in st.layers:
                if name != "shared":
                    owner[name] = p
        jaxpr = split.gradient.jaxpr
        eqns = list(jaxpr.eqns)
        producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
        order: list[int | None] = []
        for i, e in enumerate(eqns):
            names = labels.get(split.gradient_index[i], frozenset())
            held = {owner[n] for n in names if n in owner}
            ins = [producer[v] for v in e.invars if _is_var(v) and v in producer]
            known = [o for j in ins if (o := order[j]) is not None]
            earliest = max(known) if known else None
            if len(held) > 1:
                raise PipelineError(format_error(
                    "An equation of the step belongs to layers of several stages.",
                    where=f"equation {split.gradient_index[i]} ({e.primitive}), layers "
                          f"{sorted(names)}",
                    remedy="cut the stages at layer boundaries that no op crosses (a scanned "
                           "stack must sit on one stage)"))
            if held:
                p = held.pop()
                o = 2 * k - 1 - p if autodiff_phase(e) == "backward" else p
                if earliest is not None and earliest > o:
                    raise PipelineError(format_error(
                        "A stage reads a value that a later stage computes.",
                        where=f"equation {split.gradient_index[i]} ({e.primitive}) on stage "
                              f"{p}", remedy="cut the stages in the model's layer order"))
                order.append(o)
            else:
                order.append(earliest)
        # Equations of no stage that read only the state and the batch: the earliest reader.
        readers: dict[int, list[int]] = {}  # equation -> equations reading one of its results
        var_readers: dict[Any, list[int]] = {}  # value -> equations reading it
        for i, e in enumerate(eqns):
            for v in e.invars:
                if _is_var(v) and v in producer:
                    readers.setdefault(producer[v], []).append(i)
                    var_readers.setdefault(v, []).append(i)
        for i in range(len(eqns) - 1, -1, -1):
            if order[i] is None:
                later = [o for j in readers.get(i, ()) if (o := order[j]) is not None]
                order[i] = min(later) if later else 2 * k - 1
        cut = set(jaxpr.outvars)
        n_state = len(jax.tree.leaves(state))
        state_vars = {v: ("state", j) for j, v in enumerate(jaxpr.invars[:n_state])}
        batch_vars = {v: ("batch", j) for j, v in enumerate(jaxpr.invars[n_state:])}
        tasks = []
        for o in range(2 * k):
            mine = [i for i in range(len(eqns)) if order[i] == o]
            if not mine:
                continue
            defined = {v for i in mine for v in eqns[i].outvars}
            inputs: list[Any] = []
            for i in mine:
                for v in eqns[i].invars:
                    if _is_var(v) and v not in defined and v not in inputs \
                            and v not in jaxpr.constvars:
                        inputs.append(v)
            outputs = [v for v in defined
                       if v in cut or any((order[j] or 0) > o for j in var_readers.get(v, ()))]
            outputs.sort(key=lambda v: (producer[v], str(v)))
            sub = jcore.Jaxpr(jaxpr.constvars, inputs, outputs, [eqns[i] for i in mine],
                              debug_info=jaxpr.debug_info._replace(
                                  arg_names=tuple(f"in{j}" for j in range(len(inputs))),
                                  result_paths=tuple(f"out{j}" for j in range(len(outputs)))))
            fn = jax.jit(jcore.jaxpr_as_fun(jcore.ClosedJaxpr(sub, split.gradient.consts)))
            kinds = tuple(state_vars.get(v) or batch_vars.get(v) or ("value", v)
                          for v in inputs)
            tasks.append(_Task(o, o if o < k else 2 * k - 1 - o, fn, kinds, tuple(outputs)))
        return tasks

    def _prepare(self, state: Any, parts: Sequence[Any]) -> None:
        split = split_step(self._step, state, parts[0])
        kinds = (reduction_kinds(self._step, state, parts[0], parts[1], split)
                 if len(parts) > 1 else tuple("mean" for _ in split.cut_avals))
        labels = _layer_of_equations(self._step, state, parts[0])
        tasks = [self._tasks(split, labels, r, state, parts[0])
                 for r in range(len(self.plan.replicas))]
        plan = self.plan
        home = plan.stages[plan.replicas[0].stages[0]]
        home_mesh = self._meshes[home.index]
        shardings = {}
        for st in plan.stages:
            layout = plan.layouts[st.layout]
            shardings[st.index] = (
                leaf_shardings(state, layout.param_specs, self._meshes[st.index], "state"),
                leaf_shardings(parts[0], layout.batch_specs, self._meshes[st.index], "batch"))
        cut_sh = [NamedSharding(home_mesh, P()) for _ in split.cut_avals]
        update = jax.jit(jcore.jaxpr_as_fun(split.update),
                         in_shardings=(*jax.tree.leaves(shardings[home.index][0]), *cut_sh))
        self._ready = (split, kinds, tasks, shardings, cut_sh, update, home.index)

    # -- one step -------------------------------------------------------------------------

    def _issue_order(self, replica: int, tasks: list[_Task]) -> list[tuple[_Task, int]]:
        """Every (task, microbatch) of a replica in an order that respects the data flow and
        each stage's schedule (a round-robin merge of the stages' device orders)."""
        k = len(self.plan.replicas[replica].stages)
        m = self._counts[replica]
        schedule: Schedule = "gpipe" if self.plan.schedule == "gpipe" else "1f1b"
        queues = [[(2 * k - 1 - p if kind == "backward" else p, j)
                   for kind, j, _ in device_order(schedule, p, k, m)] for p in range(k)]
        by_order = {t.order: t for t in tasks}
        done: set[tuple[int, int]] = set()
        out: list[tuple[_Task, int]] = []
        heads = [0] * k
        while any(heads[p] < len(queues[p]) for p in range(k)):
            moved = False
            for p in range(k):
                while heads[p] < len(queues[p]):
                    o, j = queues[p][heads[p]]
                    if o > 0 and (o - 1, j) not in done:  # microbatch j's previous task
                        break
                    done.add((o, j))
                    if o in by_order:
                        out.append((by_order[o], j))
                    heads[p] += 1
                    moved = True
            if not moved:  # a schedule whose orders wait on each other: a bug, not the input
                raise PipelineError(format_error(
                    "The pipeline schedule deadlocks.", where=f"replica {replica}",
                    remedy="report this with the plan"))
        return out

    def __call__(self, state: Any, batch: Any) -> Any:
        total = sum(self._counts)
        parts = split_batch(batch, total, size=self.plan.microbatch_size)
        if self._ready is None:
            self._prepare(state, parts)
        split, kinds, tasks, shardings, cut_sh, update, home = self._ready
        cut_index = {v: i for i, v in enumerate(split.gradient.jaxpr.outvars)}
        sums: list[Any] = [None] * len(cut_index)
        placed: dict[int, list[Any]] = {}  # the state on each stage
        first = 0
        for r, count in enumerate(self._counts):
            local = self._run_replica(r, tasks[r], state, shardings, parts[first:first + count],
                                      placed, cut_index)
            for i, x in enumerate(local):
                if x is not None:
                    x = jax.device_put(x, cut_sh[i])
                    sums[i] = x if sums[i] is None else sums[i] + x
            first += count
        cut = [(s / total).astype(a.dtype) if k == "mean" else s
               for s, k, a in zip(sums, kinds, split.cut_avals, strict=True)]
        home_state = placed.get(home) or jax.tree.leaves(jax.device_put(state, shardings[home][0]))
        return jax.tree.unflatten(split.out_tree, update(*home_state, *cut))

    def _run_replica(self, r: int, tasks: list[_Task], state: Any, shardings: dict[int, Any],
                     parts: Sequence[Any], placed: dict[int, list[Any]],
                     cut_index: dict[Any, int]) -> list[Any]:
        """Runs replica ``r``'s tasks on its microbatches; its cut values summed where they
        were produced."""
        stage_ids = list(self.plan.replicas[r].stages)
        values = _Values(tasks, stage_ids, self._meshes)
        batches: dict[tuple[int, int], list[Any]] = {}
        local: list[Any] = [None] * len(cut_index)
        for task, j in self._issue_order(r, tasks):
            index = stage_ids[task.stage]
            state_sh, batch_sh = shardings[index]
            if index not in placed:
                placed[index] = jax.tree.leaves(jax.device_put(state, state_sh))
            if (index, j) not in batches:
                batches[index, j] = jax.tree.leaves(jax.device_put(parts[j], batch_sh))
            args = [placed[index][what] if kind == "state" else
                    batches[index, j][what] if kind == "batch" else
                    values.get(what, j, index, task.order) for kind, what in task.inputs]
            for v, x in zip(task.outputs, task.fn(*args), strict=True):
                values.put(v, j, index, x)
                if v in cut_index:
                    i = cut_index[v]
                    local[i] = x if local[i] is None else local[i] + x
            self.peak_microbatches[index] = max(self.peak_microbatches.get(index, 0),
                                                values.saved_microbatches(index))
        return local


class _Values:
    """The values crossing one replica's tasks, per microbatch and stage.

    A value stays where it was produced until the stages that read it fetch it, each when its
    first task reading it runs (a stage receives an activation when it runs the forward that
    needs it, with ``jax.device_put``), and every copy is dropped after its last reader. A
    stage *saves* microbatch ``j`` while it holds a value that its own backward of ``j`` will
    read (the activations kept for the backward).
    """

    def __init__(self, tasks: Sequence[_Task], stage_ids: Sequence[int],
                 meshes: dict[int, Any]) -> None:
        self.k = len(stage_ids)
        self.meshes = meshes
        self.readers: dict[tuple[Any, int], list[int]] = {}  # (value, stage) -> reader orders
        for task in tasks:
            for kind, what in task.inputs:
                if kind == "value":
                    self.readers.setdefault((what, stage_ids[task.stage]), []).append(
                        task.order)
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
        """Task output ``v`` of microbatch ``j``, produced on stage ``at``."""
        if v in self.stages_reading:
            self._keep(v, j, at, x)
            self.source[v, j] = at
            self.fetches[v, j] = len(self.stages_reading[v] - {at})

    def get(self, v: Any, j: int, at: int, order: int) -> Any:
        """Value ``v`` of microbatch ``j`` for the task of ``order`` on stage ``at``."""
        if (v, j, at) not in self.copies:  # fetch it from where it was produced
            origin = self.source[v, j]
            self._keep(v, j, at, jax.device_put(self.copies[v, j, origin],
                                                NamedSharding(self.meshes[at], P())))
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
