"""Cutting a microbatched step's two parts (:class:`~shardplan.runtime.accumulate.StepSplit`)
into per-stage programs: the pieces :class:`~shardplan.runtime.pipeline.PipelinedStep` runs.

Gradient part (:func:`gradient_programs`)
-----------------------------------------
A replica's stages, walked in the model's layer order, form its *virtual stages*: maximal runs
of consecutive layers on one stage. Without interleaving there is one per stage; under the
interleaved schedule stage ``p`` of ``k`` holds virtual stages ``p, p + k, ...`` (its chunks).
An equation of a layer of virtual stage ``s`` is task ``F_s`` (forward, by JAX's autodiff name
stack) or ``B_s`` (backward); tasks are ordered ``F_0 < ... < F_{K-1} < B_{K-1} < ... < B_0``.
An equation of no single layer (the ``shared`` layer: loss scaling, constants) joins the latest
task among its producers, or, when it reads only the state and the batch, the earliest task that
reads it. A task is a sub-jaxpr: its inputs are the state and batch leaves it reads and the
values earlier tasks produce; its outputs are what later tasks or the update read.

Update part (:func:`update_programs`)
-------------------------------------
Every update equation runs on one stage of replica 0: the stage holding most of the bytes it
reads (the gradients live where the backward produced them, a parameter where its layers run;
optimizer state adopts the stage of its first reader). A chain of equations stays on its stage;
where it crosses stages (the partial sums of a global gradient norm meeting, the clip factor
going back) the equations after the crossing form the next *level*. Programs are per (level,
stage), run level by level; values crossing stages are sent by the runtime. The update thus runs
where the parameters live and only small values (norms, scales, counters) move.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from shardplan.errors import PipelineError, format_error
from shardplan.runtime.accumulate import StepSplit, autodiff_phase

__all__ = ["Program", "VirtualStages", "gradient_programs", "update_programs",
           "virtual_stages"]

Input = tuple[str, Any]
"""``("state", leaf)``, ``("batch", leaf)``, ``("cut", index)`` or ``("value", var)``."""


@dataclass(frozen=True)
class Program:
    """One compiled piece of the step.

    Attributes:
      key: gradient part: the task's position in ``F_0 .. F_{K-1}, B_{K-1} .. B_0``; update
        part: its level.
      stage: the index into ``plan.stages`` it runs on.
      fn: the jitted sub-jaxpr.
      inputs: per argument, where it comes from (:data:`Input`).
      outputs: the variables it produces.
    """

    key: int
    stage: int
    fn: Any
    inputs: tuple[Input, ...]
    outputs: tuple[Any, ...]


@dataclass(frozen=True)
class VirtualStages:
    """A replica's layers cut into virtual stages (the module docstring).

    Attributes:
      owner: layer name -> virtual stage.
      position: per virtual stage, the replica's stage position (``0 .. k-1``) running it.
      stages: per replica stage position, the index into ``plan.stages``.
    """

    owner: Mapping[str, int]
    position: tuple[int, ...]
    stages: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.position)


def _is_var(v: Any) -> bool:
    return not isinstance(v, jcore.Literal)


def virtual_stages(stage_layers: Sequence[Sequence[str]], stage_ids: Sequence[int],
                   layer_order: Sequence[str], chunks: int) -> VirtualStages:
    """The virtual stages of a replica whose stage positions hold ``stage_layers``.

    Raises:
      PipelineError: the stages' layers are not consecutive runs of the model's layer order as
        the schedule needs (stage ``p`` of ``k`` holding runs ``p, p + k, ...``).
    """
    k = len(stage_layers)
    at = {name: p for p, names in enumerate(stage_layers) for name in names if name != "shared"}
    owner: dict[str, int] = {}
    position: list[int] = []
    for name in layer_order:
        if name not in at:
            continue
        if not position or position[-1] != at[name]:
            position.append(at[name])
        owner[name] = len(position) - 1
    v = chunks if k > 1 and len(position) > k else 1
    if position != [s % k for s in range(k * v)]:
        raise PipelineError(format_error(
            "The stages' layers are not cut in the model's layer order as the schedule needs.",
            where=f"stages {list(stage_ids)}", value=position,
            remedy="give stage p of k the p-th run of consecutive layers (under the "
                   "interleaved schedule, runs p, p + k, ...)"))
    return VirtualStages(owner, tuple(position), tuple(stage_ids))


def _compile(jaxpr: Any, consts: Sequence[Any], eqns: Sequence[Any], inputs: Sequence[Any],
             outputs: Sequence[Any], out_shardings: Any = None) -> Any:
    sub = jcore.Jaxpr(jaxpr.constvars, list(inputs), list(outputs), list(eqns),
                      debug_info=jaxpr.debug_info._replace(
                          arg_names=tuple(f"in{j}" for j in range(len(inputs))),
                          result_paths=tuple(f"out{j}" for j in range(len(outputs)))))
    fn = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(sub, consts))
    return jax.jit(fn) if out_shardings is None else jax.jit(fn, out_shardings=out_shardings)


def _programs(jaxpr: Any, consts: Sequence[Any], groups: Sequence[tuple[int, int]],
              group_of: Sequence[int], sources: Mapping[Any, Input],
              keep: Callable[[Any, int], bool],
              out_sharding: Callable[[Any, int], Any] | None = None) -> list[Program]:
    """One program per group ``(key, stage)`` of equations (``group_of``: each equation's
    group); ``keep(var, group)``: whether a value the group defines is an output."""
    eqns = list(jaxpr.eqns)
    out: list[Program] = []
    for g, (key, stage) in enumerate(groups):
        mine = [i for i in range(len(eqns)) if group_of[i] == g]
        if not mine:
            continue
        defined = {v for i in mine for v in eqns[i].outvars}
        inputs: list[Any] = []
        for i in mine:
            for v in eqns[i].invars:
                if _is_var(v) and v not in defined and v not in inputs \
                        and v not in jaxpr.constvars:
                    inputs.append(v)
        outputs = sorted((v for v in defined if keep(v, g)), key=lambda v: (
            next(i for i in mine if v in eqns[i].outvars), str(v)))
        shardings = None if out_sharding is None else [out_sharding(v, stage) for v in outputs]
        fn = _compile(jaxpr, consts, [eqns[i] for i in mine], inputs, outputs, shardings)
        out.append(Program(key, stage, fn, tuple(sources.get(v, ("value", v)) for v in inputs),
                           tuple(outputs)))
    return out


def gradient_programs(split: StepSplit, labels: Mapping[int, frozenset[str]],
                      virtual: VirtualStages, n_state: int) -> list[Program]:
    """The gradient part of one replica cut into its tasks (the module docstring).

    Args:
      split: the step's cut.
      labels: per top-level equation index of the step, the layers its ops belong to.
      virtual: the replica's virtual stages.
      n_state: the number of state leaves.

    Raises:
      PipelineError: an equation belongs to layers of several virtual stages, or reads a value
        of a later one.
    """
    jaxpr = split.gradient.jaxpr
    big_k = virtual.count
    eqns = list(jaxpr.eqns)
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    order: list[int | None] = []
    for i, e in enumerate(eqns):
        names = labels.get(split.gradient_index[i], frozenset())
        held = {virtual.owner[n] for n in names if n in virtual.owner}
        known = [o for v in e.invars if _is_var(v) and v in producer
                 if (o := order[producer[v]]) is not None]
        earliest = max(known) if known else None
        if len(held) > 1:
            raise PipelineError(format_error(
                "An equation of the step belongs to layers of several stages.",
                where=f"equation {split.gradient_index[i]} ({e.primitive}), layers "
                      f"{sorted(names)}",
                remedy="cut the stages at layer boundaries that no op crosses (a scanned "
                       "stack must sit on one stage)"))
        if held:
            s = held.pop()
            o = 2 * big_k - 1 - s if autodiff_phase(e) == "backward" else s
            if earliest is not None and earliest > o:
                raise PipelineError(format_error(
                    "A stage reads a value that a later stage computes.",
                    where=f"equation {split.gradient_index[i]} ({e.primitive}) on virtual "
                          f"stage {s}", remedy="cut the stages in the model's layer order"))
            order.append(o)
        else:
            order.append(earliest)
    readers: dict[Any, list[int]] = {}  # value -> equations reading it
    for i, e in enumerate(eqns):
        for v in e.invars:
            if _is_var(v) and v in producer:
                readers.setdefault(v, []).append(i)
    # Equations of no stage that read only the state and the batch: the earliest reader.
    for i in range(len(eqns) - 1, -1, -1):
        if order[i] is None:
            later = [o for v in eqns[i].outvars for j in readers.get(v, ())
                     if (o := order[j]) is not None]
            order[i] = min(later) if later else 2 * big_k - 1
    missing = [v for v in jaxpr.outvars if not _is_var(v) or v not in producer]
    if missing:
        raise PipelineError(format_error(
            "A value the update reads is not computed by the forward or backward pass.",
            where="the gradient part's outputs", value=[str(v) for v in missing],
            remedy="compute every returned metric from the batch or the gradients"))
    sources: dict[Any, Input] = {v: ("state", j) for j, v in enumerate(jaxpr.invars[:n_state])}
    sources.update({v: ("batch", j) for j, v in enumerate(jaxpr.invars[n_state:])})
    groups = [(o, virtual.stages[virtual.position[o if o < big_k else 2 * big_k - 1 - o]])
              for o in range(2 * big_k)]
    group_of = [int(o) for o in order if o is not None]
    cut = set(jaxpr.outvars)
    return _programs(jaxpr, split.gradient.consts, groups, group_of, sources,
                     lambda v, g: v in cut or any(group_of[j] > g for j in readers.get(v, ())))


def update_programs(split: StepSplit, read_at: Mapping[int, int], cut_at: Sequence[int],
                    default: int, state_sharding: Callable[[int, int], Any],
                    ) -> tuple[list[Program], list[Input | tuple[str, Any, int]], list[int]]:
    """The update part cut by stage and level (the module docstring).

    Args:
      split: the step's cut.
      read_at: state leaf -> the stage (index into ``plan.stages``) whose forward first reads
        it, for the leaves the gradient part reads.
      cut_at: per cut value, the stage holding it.
      default: the stage of what nothing else places (a step counter).
      state_sharding: ``(stage, leaf) -> sharding`` of a state leaf on a stage.

    Returns:
      The programs in the order to run them; per output leaf of the step, where it is
      (``("value", var, stage)``, ``("state", leaf)``, ``("cut", index)`` or
      ``("literal", value)``); per state leaf, its home stage.
    """
    jaxpr = split.update.jaxpr
    eqns = list(jaxpr.eqns)
    n_state = len(jaxpr.invars) - len(split.cut_avals)
    state_index = {v: j for j, v in enumerate(jaxpr.invars[:n_state])}
    at: dict[Any, int] = {jaxpr.invars[j]: s for j, s in read_at.items()}
    at.update({v: s for v, s in zip(jaxpr.invars[n_state:], cut_at, strict=True)})
    position = {s: i for i, s in enumerate(dict.fromkeys([default, *cut_at,
                                                           *read_at.values()]))}

    def nbytes(v: Any) -> int:
        return int(np.prod(v.aval.shape, dtype=np.int64)) * np.dtype(v.aval.dtype).itemsize

    def pick(e: Any) -> int | None:
        weight: dict[int, int] = {}
        for v in e.invars:
            if _is_var(v) and v in at:
                weight[at[v]] = weight.get(at[v], 0) + nbytes(v) + 1
        if not weight:
            return None
        return max(weight, key=lambda s: (weight[s], -position.get(s, len(position))))

    # Optimizer state adopts the stage of its first placed reader: stages spread forward from
    # what is placed, and back from placed readers (``mu * b1`` reads only ``mu``; the ``add``
    # with the gradient's share places it), until nothing changes.
    stage_of: list[int | None] = [None] * len(eqns)
    readers: dict[Any, list[int]] = {}
    for i, e in enumerate(eqns):
        for v in e.invars:
            if _is_var(v):
                readers.setdefault(v, []).append(i)

    def place(i: int, s: int) -> None:
        stage_of[i] = s
        for v in eqns[i].invars:
            if _is_var(v) and v in state_index and v not in at:
                at[v] = s
        at.update({v: s for v in eqns[i].outvars})

    changed = True
    while changed:
        changed = False
        for i, e in enumerate(eqns):
            if stage_of[i] is None and (s := pick(e)) is not None:
                place(i, s)
                changed = True
        for i in range(len(eqns) - 1, -1, -1):
            if stage_of[i] is None:
                later = [t for v in eqns[i].outvars for r in readers.get(v, ())
                         if (t := stage_of[r]) is not None]
                if later:
                    place(i, later[0])
                    changed = True
    home = [at.get(v, default) for v in jaxpr.invars[:n_state]]
    at = {v: s for v, s in zip(jaxpr.invars, [*home, *cut_at], strict=True)}
    level: dict[Any, int] = {}
    keys: list[tuple[int, int]] = []
    for i, e in enumerate(eqns):
        s = pick(e)
        s = stage_of[i] if s is None else s
        s = default if s is None else s
        lv = max([level[v] + (at[v] != s) for v in e.invars if _is_var(v) and v in level],
                 default=0)
        keys.append((lv, s))
        at.update({v: s for v in e.outvars})
        level.update({v: lv for v in e.outvars})
    groups = sorted(set(keys), key=lambda g: (g[0], position.get(g[1], len(position)), g[1]))
    index = {g: n for n, g in enumerate(groups)}
    group_of = [index[key] for key in keys]
    group_readers: dict[Any, set[int]] = {}
    for e, g in zip(eqns, group_of, strict=True):
        for v in e.invars:
            if _is_var(v):
                group_readers.setdefault(v, set()).add(g)
    final = set(jaxpr.outvars)
    sources: dict[Any, Input] = {v: ("state", j) for v, j in state_index.items()}
    sources.update({v: ("cut", i) for i, v in enumerate(jaxpr.invars[n_state:])})
    # The new state leaves (the step returns the new state first) stay in their home stage's
    # sharding, so that the next step finds them in place.
    leaf_of = {v: j for j, v in enumerate(jaxpr.outvars[:n_state])
               if _is_var(v) and v.aval.shape == jaxpr.invars[j].aval.shape}
    programs = _programs(
        jaxpr, split.update.consts, groups, group_of, sources,
        lambda v, g: v in final or bool(group_readers.get(v, set()) - {g}),
        lambda v, s: state_sharding(s, leaf_of[v]) if v in leaf_of and home[leaf_of[v]] == s
        else None)
    produced = {v: p.stage for p in programs for v in p.outputs}
    where: list[Any] = []
    for v in jaxpr.outvars:
        if not _is_var(v):
            where.append(("literal", v.val))
        elif v in produced:
            where.append(("value", v, produced[v]))
        else:
            where.append(sources[v])
    return programs, where, home
