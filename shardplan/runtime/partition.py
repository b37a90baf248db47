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
values earlier tasks produce; its outputs are what later tasks or the update read. A constant
(a value of literals and constants alone: a causal mask, the loop-invariant values autodiff
hoists out of a scanned stack's loop) is computed again by every task that reads it, never
handed on (:func:`_constants_read`).

A ``scan`` over a scanned block stack (``nnx.scan``: one loop over stacked parameters) whose
rows lie on several virtual stages is cut into one *segment* per run of rows: the segment scans
its rows of the inputs, the carries chain from segment to segment, and the transposed scan of
the backward pass is cut at the same rows, each backward segment reading its own forward
segment's saved rows (so saved activations stay on their stage). A stacked leaf held as
per-stage pieces (:mod:`shardplan.runtime.rows`) is read by each segment as its piece, and
the stacked gradients are handed on as the pieces the backward segments produced; otherwise
they are joined where the last segment runs. A task holding segments is evaluated equation by
equation (``primitive.bind``) under ``jax.jit``.

A cut value that autodiff sums from terms computed on several stages (the gradient of a
parameter read by layers of several stages: a tied embedding's lookup and output head) is not
summed inside each microbatch: each stage hands on its own term (:attr:`Program.terms`), the
runtime accumulates it over the microbatches where it was computed, and the stages' sums meet
once per step. A stage so holds one accumulator for its term instead of one term per
microbatch in flight, waiting for the backward of the stage that would add it.

Update part (:func:`update_programs`)
-------------------------------------
Each replica runs the update on its own stages (:mod:`shardplan.runtime.exchange` gives every
replica the totals). Every update equation runs on one stage of the replica: the stage holding
most of the bytes it reads (the gradients live where the backward produced them, a parameter where its layers run;
optimizer state adopts the stage of its first reader). A chain of equations stays on its stage;
where it crosses stages (the partial sums of a global gradient norm meeting, the clip factor
going back) the equations after the crossing form the next *level*. Programs are per (level,
stage), run level by level; values crossing stages are sent by the runtime. The update thus runs
where the parameters live and only small values (norms, scales, counters) move.

This module is over 600 lines: the gradient part's cut (tasks, scan segments, recomputation,
cross-stage terms) and the update part's cut share the program builder and item types, and
issue 25's layering step splits the runtime's pipeline modules together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.extend import core as jcore

from shardplan.errors import PipelineError, format_error
from shardplan.kernels.registry import PREFIX as KERNEL_PREFIX
from shardplan.runtime.accumulate import StepSplit, autodiff_phase
from shardplan.runtime.constrain import Pins, run_pinned
from shardplan.runtime.rows import RowSplit, Runs, bind
from shardplan.trace.dtypes import nbytes as array_nbytes

__all__ = ["Program", "VirtualStages", "gradient_programs", "row_runs", "update_programs",
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
      terms: per output that is one stage's term of a cut value summed over several stages
        (:func:`gradient_programs`), that cut value.
    """

    key: int
    stage: int
    fn: Any
    inputs: tuple[Input, ...]
    outputs: tuple[Any, ...]
    terms: Mapping[Any, Any] = field(default_factory=dict)


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


def _plain_call(eqn: Any) -> Any:
    """The inner jaxpr of a ``jit`` equation that inlining leaves unchanged in meaning: not a
    kernel call (one op of the cost model), no constants, no sharding it imposes, every result
    computed by its own inner equation; else None."""
    if eqn.primitive.name not in ("pjit", "jit") or str(eqn.params.get("name", "")).startswith(
            KERNEL_PREFIX):
        return None
    closed = eqn.params.get("jaxpr")
    if not isinstance(closed, jcore.ClosedJaxpr) or closed.consts or closed.jaxpr.constvars:
        return None
    jaxpr = closed.jaxpr
    for key in ("in_shardings", "out_shardings"):
        if any(type(x).__name__ != "UnspecifiedValue" for x in eqn.params.get(key, ())):
            return None
    made = {v for e in jaxpr.eqns for v in e.outvars}
    outs = [v for v in jaxpr.outvars if _is_var(v)]
    if len(outs) != len(jaxpr.outvars) or len(set(outs)) != len(outs) or not set(outs) <= made:
        return None
    return jaxpr


def _inline_calls(jaxpr: Any, paths: Sequence[tuple[int, ...]]
                  ) -> tuple[Any, list[tuple[int, ...]]]:
    """``jaxpr`` with its plain nested ``jit`` calls (:func:`_plain_call`) replaced by their
    equations, recursively, and per equation of the result its path (``paths``: the top-level
    equations'; an inlined equation's path extends its call's by its index in the call, as
    :attr:`shardplan.trace.Op.path` does). A call's equations then go to stages, and to
    rematerialisation, one by one: a jitted attention function's core is recomputed under
    ``selective`` while its projections are not. The jaxpr's own variables stay as they are
    (a call's results become its inner equations' results); an inlined equation's name stack
    is its call's followed by its own, so its autodiff phase is its call's."""
    eqns: list[Any] = []
    out_paths: list[tuple[int, ...]] = []

    def add(eqn: Any, path: tuple[int, ...], rename: dict[Any, Any]) -> None:
        eqn = eqn.replace(invars=[rename.get(v, v) if _is_var(v) else v for v in eqn.invars])
        inner = _plain_call(eqn)
        if inner is None:
            eqns.append(eqn)
            out_paths.append(path)
            return
        local: dict[Any, Any] = dict(zip(inner.invars, eqn.invars, strict=True))
        local.update(zip(inner.outvars, eqn.outvars, strict=True))
        stack = eqn.source_info.name_stack
        for j, e in enumerate(inner.eqns):
            outvars = [local.get(v) or (jcore.DropVar(v.aval) if isinstance(v, jcore.DropVar)
                                        else jcore.Var(v.aval)) for v in e.outvars]
            local.update(zip(e.outvars, outvars, strict=True))
            e = e.replace(outvars=outvars, source_info=e.source_info.replace(
                name_stack=stack + e.source_info.name_stack))
            add(e, (*path, j), local)

    for e, path in zip(jaxpr.eqns, paths, strict=True):
        add(e, path, {})
    if len(eqns) == len(jaxpr.eqns):
        return jaxpr, list(paths)
    return jaxpr.replace(eqns=eqns), out_paths


def _compile(jaxpr: Any, consts: Sequence[Any], eqns: Sequence[Any], inputs: Sequence[Any],
             outputs: Sequence[Any], out_shardings: Any = None,
             donate: tuple[int, ...] = ()) -> Any:
    sub = jcore.Jaxpr(jaxpr.constvars, list(inputs), list(outputs), list(eqns),
                      debug_info=jaxpr.debug_info._replace(
                          arg_names=tuple(f"in{j}" for j in range(len(inputs))),
                          result_paths=tuple(f"out{j}" for j in range(len(outputs)))))
    fn = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(sub, consts))
    if out_shardings is None:
        return jax.jit(fn, donate_argnums=donate)
    return jax.jit(fn, out_shardings=out_shardings, donate_argnums=donate)


def _programs(jaxpr: Any, consts: Sequence[Any], eqns: Sequence[Any],
              groups: Sequence[tuple[int, int]], group_of: Sequence[int],
              sources: Mapping[Any, Input], keep: Callable[[Any, int], bool],
              out_sharding: Callable[[Any, int], Any] | None = None,
              donate: Mapping[tuple[int, int], tuple[int, ...]] | None = None,
              again: Mapping[int, Sequence[int]] | None = None,
              pins: Mapping[int, Pins] | None = None,
              path_of: Mapping[int, tuple[int, ...]] | None = None,
              ) -> list[Program]:
    """One program per group ``(key, stage)`` of equations or items (``group_of``: each one's
    group); ``keep(var, group)``: whether a value the group defines is an output; ``donate``:
    per group, the arguments its program donates; ``again``: per group, equations of earlier
    groups it runs once more (rematerialisation) instead of reading their results; ``pins``:
    per stage, the shardings its layout pins (kernel calls), on equations found by their path
    (``path_of``: by the equation's ``id``)."""
    out: list[Program] = []
    for g, (key, stage) in enumerate(groups):
        mine = sorted({i for i in range(len(eqns)) if group_of[i] == g}
                      | set((again or {}).get(g, ())))
        if not mine:
            continue
        defined = {v for i in mine for v in eqns[i].outvars}
        inputs: list[Any] = []
        for i in mine:
            for v in eqns[i].invars:
                if _is_var(v) and v not in defined and v not in inputs \
                        and v not in jaxpr.constvars:
                    inputs.append(v)
        # by the item that makes each and its place among that item's results: a jax Var's
        # and a _Piece's str() hold its id(), which would order them differently per run
        outputs = sorted((v for v in defined if keep(v, g)), key=lambda v: next(
            (i, list(eqns[i].outvars).index(v)) for i in mine if v in eqns[i].outvars))
        shardings = None if out_sharding is None else [out_sharding(v, stage) for v in outputs]
        plain = [eqns[i].eqn if isinstance(eqns[i], _Item) else eqns[i] for i in mine
                 if not isinstance(eqns[i], _Item) or eqns[i].kind == "eqn"]
        stage_pins = (pins or {}).get(stage)
        held = [x.eqn if isinstance(x, _Item) else x for x in (eqns[i] for i in mine)]
        pinned = {} if stage_pins is None else {
            id(e): path for e in held  # (segments of a cut scan included)
            if e is not None and (path := (path_of or {}).get(id(e))) is not None
            and stage_pins.touch(path)}
        if len(plain) == len(mine) and not pinned:
            fn = _compile(jaxpr, consts, plain, inputs, outputs, shardings,
                          (donate or {}).get((key, stage), ()))
        else:
            items = [e if isinstance(e, _Item) else _Item("eqn", e, tuple(e.invars),
                                                          tuple(e.outvars), frozenset())
                     for e in (eqns[i] for i in mine)]
            fn = _interpreted(items, jaxpr.constvars, consts, inputs, outputs,
                              _pinned_bind(stage_pins, pinned) if pinned else bind)
        out.append(Program(key, stage, fn, tuple(sources.get(v, ("value", v)) for v in inputs),
                           tuple(outputs)))
    return out


@dataclass(frozen=True, eq=False)
class _Piece:
    """A value that cutting a scanned stack by stage introduces: a segment's carry, or its rows
    of a stacked output."""

    aval: Any

    def __repr__(self) -> str:
        return f"piece{id(self)}"


@dataclass(frozen=True, eq=False)
class _Item:
    """One step of a task: a jaxpr equation (``eqn``), the rows ``[a, b)`` of a scan cut by
    stage (``segment``; ``sliced``: its inputs to cut to those rows), rows joined back into
    the stacked value (``join``), or the rows ``[a, b)`` of a stacked value (``rows``)."""

    kind: str
    eqn: Any
    invars: tuple[Any, ...]
    outvars: tuple[Any, ...]
    names: frozenset[str]
    rows: tuple[int, int] = (0, 0)
    sliced: tuple[bool, ...] = ()


def row_runs(rows: Sequence[str], owner: Mapping[str, int]) -> Runs:
    """The runs ``[a, b)`` of consecutive rows of a stack (its layers in row order) that lie
    on one virtual stage each."""
    runs: list[tuple[int, int]] = []
    for r in range(len(rows)):
        if r and owner[rows[r]] == owner[rows[r - 1]]:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return tuple(runs)


def _cut_scans(eqns: Sequence[Any], names: Sequence[frozenset[str]], virtual: VirtualStages,
               stacks: Mapping[str, tuple[Sequence[str], frozenset[int]]],
               state_leaf: Mapping[Any, int], outputs: Sequence[Any],
               state_pieces: Mapping[Any, tuple[tuple[str, ...], Mapping[tuple[int, int], Any]]]
               | None = None,
               cut_runs: Mapping[int, Runs] | None = None,
               ) -> tuple[list[_Item], list[Any], dict[int, Runs]]:
    """The equations as items, each ``scan`` over a stack whose rows lie on several virtual
    stages cut into one segment per run of rows (forward and backward scans alike, carries
    chained). A backward segment reads its forward segment's rows directly, so saved
    activations stay on their stage; joins nobody reads are dropped.

    ``state_pieces``: per state leaf held as pieces (:mod:`shardplan.runtime.rows`), its
    stack's rows and its pieces; a segment reads its piece. ``cut_runs``: per output to hand
    on as pieces, its runs (``None``: every output that a cut scan stacks, by its own runs).
    Returns the items, the outputs (an output with runs replaced by its pieces) and the runs
    of the outputs so handed on."""
    items: list[_Item] = []
    pieces: dict[Any, dict[tuple[int, int], Any]] = {}
    stacked: dict[Any, tuple[str, ...]] = {}  # a cut scan's stacked outputs -> its rows
    for v, (rows_of, parts_of) in (state_pieces or {}).items():
        pieces[v], stacked[v] = dict(parts_of), tuple(rows_of)
        items.append(_Item("join", None, tuple(parts_of[r] for r in sorted(parts_of)), (v,),
                           frozenset()))
    for e, label in zip(eqns, names, strict=True):
        label, held, rows = _stack_rows(e, label, virtual, stacks, state_leaf, stacked)
        if (len(held) < 2 or e.primitive.name != "scan" or rows is None
                or e.params["length"] != len(rows)):
            items.append(_Item("eqn", e, tuple(e.invars), tuple(e.outvars), label))
            continue
        items.extend(_segments(e, rows, row_runs(rows, virtual.owner), pieces, stacked))
    if cut_runs is None:
        cut_runs = {k: tuple(sorted(pieces[v])) for k, v in enumerate(outputs)
                    if _is_var(v) and v in pieces and len(pieces[v]) > 1}
    handed, sliced = _handed_pieces(outputs, cut_runs, pieces)
    items.extend(sliced)
    return _read_items(items, handed), handed, dict(cut_runs)


def _stack_rows(e: Any, label: frozenset[str], virtual: VirtualStages,
                stacks: Mapping[str, tuple[Sequence[str], frozenset[int]]],
                state_leaf: Mapping[Any, int], stacked: Mapping[Any, tuple[str, ...]],
                ) -> tuple[frozenset[str], set[int], tuple[str, ...] | None]:
    """``e``'s label (emptied over a whole stack), its virtual stages, its stack's rows or None."""
    held = {virtual.owner[n] for n in label if n in virtual.owner}
    rows = next((tuple(layers) for layers, _ in stacks.values() if label <= set(layers)),
                None)
    if e.primitive.name == "scan":
        # The trace gives a loop's ops no top-level equation: a scan is over a stack when
        # it reads the stack's stacked leaves, or a cut scan's rows (its transpose).
        xs = [x for x in e.invars[e.params["num_consts"] + e.params["num_carry"]:]
              if _is_var(x)]
        found = [tuple(layers) for layers, leaves in stacks.values()
                 if len(layers) == e.params["length"]
                 and any(state_leaf.get(x) in leaves for x in xs)]
        found += [stacked[x] for x in xs if x in stacked]
        if found:
            rows = found[0]
            held = {virtual.owner[n] for n in rows if n in virtual.owner}
    if len(held) > 1 and rows is not None and e.primitive.name != "scan":
        # An op the trace gives a whole stack (one reading the stack's final carry): it
        # follows the values it reads.
        label = frozenset()
    return label, held, rows


def _segments(e: Any, rows: tuple[str, ...], runs: Runs,
              pieces: dict[Any, dict[tuple[int, int], Any]],
              stacked: dict[Any, tuple[str, ...]]) -> list[_Item]:
    """The items of scan ``e`` cut into one segment per run, then its joins; records its pieces."""
    items: list[_Item] = []
    nc, ncar = e.params["num_consts"], e.params["num_carry"]
    consts, carry, xs = e.invars[:nc], e.invars[nc:nc + ncar], e.invars[nc + ncar:]
    parts: list[list[tuple[int, int, Any]]] = [[] for _ in e.outvars[ncar:]]
    for a, b in (reversed(runs) if e.params["reverse"] else runs):
        seg_xs = [pieces.get(x, {}).get((a, b)) if _is_var(x) else None for x in xs]
        carry_out = [_Piece(v.aval) for v in e.outvars[:ncar]]
        ys = [_Piece(v.aval.update(shape=(b - a, *v.aval.shape[1:])))
              for v in e.outvars[ncar:]]
        items.append(_Item(
            "segment", e, (*consts, *carry, *(p if p is not None else x
                                              for p, x in zip(seg_xs, xs, strict=True))),
            (*carry_out, *ys), frozenset(rows[a:b]), (a, b),
            (False,) * (nc + ncar) + tuple(p is None for p in seg_xs)))
        carry = carry_out
        for k, y in enumerate(ys):
            parts[k].append((a, b, y))
    for v, p in zip(e.outvars[:ncar], carry, strict=True):
        items.append(_Item("join", None, (p,), (v,), frozenset()))
    for v, ps in zip(e.outvars[ncar:], parts, strict=True):
        ps.sort(key=lambda t: t[0])
        pieces[v] = {(a, b): y for a, b, y in ps}
        stacked[v] = rows
        items.append(_Item("join", None, tuple(y for _, _, y in ps), (v,), frozenset()))
    return items


def _handed_pieces(outputs: Sequence[Any], cut_runs: Mapping[int, Runs],
                   pieces: dict[Any, dict[tuple[int, int], Any]],
                   ) -> tuple[list[Any], list[_Item]]:
    """The outputs as handed on (runs as pieces), and the ``rows`` items slicing missing pieces."""
    handed: list[Any] = []
    sliced: list[_Item] = []
    for k, v in enumerate(outputs):
        if k not in cut_runs:
            handed.append(v)
            continue
        mine = pieces.get(v, {})
        for a, b in cut_runs[k]:
            if (a, b) not in mine:  # rows of another cut: sliced where the value is
                mine[a, b] = _Piece(v.aval.update(shape=(b - a, *v.aval.shape[1:])))
                sliced.append(_Item("rows", None, (v,), (mine[a, b],), frozenset(), (a, b)))
            handed.append(mine[a, b])
    return handed, sliced


def _read_items(items: Sequence[_Item], handed: Sequence[Any]) -> list[_Item]:
    """``items`` without the joins whose results neither ``handed`` nor a later item reads."""
    needed = {v for v in handed if _is_var(v)}
    kept: list[_Item] = []
    for item in reversed(items):
        if item.kind == "join" and not needed & set(item.outvars):
            continue
        kept.append(item)
        needed.update(v for v in item.invars if _is_var(v))
    return kept[::-1]


def _pinned_bind(pins: Pins | None, pinned: Mapping[int, tuple[int, ...]]
                 ) -> Callable[[Any, Sequence[Any], Mapping[str, Any]], list[Any]]:
    """:func:`~shardplan.runtime.rows.bind` but for the equations ``pinned`` names (by
    ``id``, their paths), which :func:`~shardplan.runtime.constrain.run_pinned` evaluates
    with ``pins``."""
    def run(eqn: Any, values: Sequence[Any], params: Mapping[str, Any]) -> list[Any]:
        path = pinned.get(id(eqn))
        if path is None or pins is None:
            return bind(eqn, values, params)
        return run_pinned(eqn, values, path, pins, params)

    return run


def _interpreted(items: Sequence[_Item], constvars: Sequence[Any], consts: Sequence[Any],
                 inputs: Sequence[Any], outputs: Sequence[Any],
                 evaluate: Callable[[Any, Sequence[Any], Mapping[str, Any]], list[Any]] = bind,
                 ) -> Any:
    """A jitted program evaluating ``items`` (for tasks holding segments of a cut scan or
    pinned equations), each equation by ``evaluate`` (``rows.bind``, or
    :func:`_pinned_bind`'s)."""
    def run(*args: Any) -> list[Any]:
        env: dict[Any, Any] = dict(zip(constvars, consts, strict=True))
        env.update(zip(inputs, args, strict=True))

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jcore.Literal) else env[v]

        for item in items:
            if item.kind == "join":
                values = [read(v) for v in item.invars]
                out = [values[0] if len(values) == 1 else jax.lax.concatenate(values, 0)]
            elif item.kind == "rows":
                out = [jax.lax.slice_in_dim(read(item.invars[0]), *item.rows, axis=0)]
            else:
                e = item.eqn
                values = [read(v) for v in item.invars]
                params = dict(e.params)
                if item.kind == "segment":
                    a, b = item.rows
                    values = [jax.lax.slice_in_dim(x, a, b, axis=0) if cut else x
                              for x, cut in zip(values, item.sliced, strict=True)]
                    params["length"] = b - a
                    if isinstance(params.get("unroll"), int) and not isinstance(
                            params["unroll"], bool):
                        params["unroll"] = max(1, min(params["unroll"], b - a))
                out = evaluate(e, values, params)
            env.update(zip(item.outvars, out, strict=True))
        return [read(v) for v in outputs]

    return jax.jit(run)


def gradient_programs(split: StepSplit, labels: Mapping[tuple[int, ...], frozenset[str]],
                      virtual: VirtualStages, n_state: int,
                      stacks: Mapping[str, tuple[Sequence[str], frozenset[int]]] | None = None,
                      remat: Mapping[int, str] | None = None,
                      rerun: Mapping[str, Collection[tuple[int, ...]]] | None = None,
                      rows: RowSplit | None = None,
                      cut_runs: Mapping[int, Runs] | None = None,
                      pins: Mapping[int, Pins] | None = None,
                      ) -> tuple[list[Program], list[Any], dict[int, Runs]]:
    """The gradient part of one replica cut into its tasks (the module docstring).

    Args:
      split: the step's cut.
      labels: per equation path of the step (:attr:`shardplan.trace.Op.path` and its
        prefixes), the layers its ops belong to.
      virtual: the replica's virtual stages.
      n_state: the number of state leaves.
      stacks: per block stack, its layers in row order and the state leaves they own (a scan
        over a stack is cut by stage, :func:`_cut_scans`).
      remat: per stage (index into ``plan.stages``), its rematerialisation policy: under
        ``full`` a backward task runs its forward task's equations again from the stage's
        inputs, under ``none`` and ``selective`` those of its forward equations that
        ``rerun`` names for the policy; the forward task then hands the backward only what it
        does not recompute.
      rerun: per remat policy short of ``full``, the paths of the step's equations a
        backward task computes again instead of receiving their values (the runtime's
        ``_labels``: values XLA's fusion keeps out of memory, and under ``selective`` the
        attention core).
      rows: the state leaves held as pieces (:mod:`shardplan.runtime.rows`): a program reads
        ``("state", i)`` for internal leaf ``i``.
      cut_runs: per cut value to hand on as pieces, its runs (``None``: with ``rows``, every
        stacked output of a cut scan, by its runs; else none).
      pins: per stage, the equations its layout pins (:attr:`shardplan.Layout.kernel_specs`:
        the kernel calls, run in ``shard_map`` with those specs), by the step's paths.

    Returns:
      The tasks; their cut outputs, the internal cut values (``RowSplit(n_cut, runs)``: a
      value handed on as pieces replaced by them); and the runs of those so handed on.

    Raises:
      PipelineError: an equation belongs to layers of several virtual stages, or reads a value
        of a later one.
    """
    # Nested jit calls are cut into their equations, each with its path (_inline_calls).
    jaxpr, paths = _inline_calls(split.gradient.jaxpr, [(i,) for i in split.gradient_index])
    big_k = virtual.count
    rows = rows or RowSplit(n_state, {})
    sources, state_pieces = _gradient_sources(jaxpr, n_state, rows, stacks or {})
    eqns, outvars, runs = _cut_scans(
        jaxpr.eqns, [labels.get(p, frozenset()) for p in paths], virtual, stacks or {},
        {v: j for j, v in enumerate(jaxpr.invars[:n_state])}, jaxpr.outvars, state_pieces,
        cut_runs if cut_runs is not None or rows.runs else {})
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    order = _task_order(eqns, producer, virtual)
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
    missing = [v for v in outvars if not _is_var(v) or v not in producer]
    if missing:
        raise PipelineError(format_error(
            "A value the update reads is not computed by the forward or backward pass.",
            where="the gradient part's outputs", value=[str(v) for v in missing],
            remedy="compute every returned metric from the batch or the gradients"))
    groups = [(o, virtual.stages[virtual.position[o if o < big_k else 2 * big_k - 1 - o]])
              for o in range(2 * big_k)]
    group_of = [int(o) for o in order if o is not None]
    again = _run_again(eqns, group_of, producer, jaxpr, paths, virtual, remat, rerun)
    # Per equation, the tasks that run it: its own, and those running it again.
    runs_of: dict[int, set[int]] = {i: {g} for i, g in enumerate(group_of)}
    for g, extra in again.items():
        for i in extra:
            runs_of[i].add(g)
    terms = _cross_stage_terms(eqns, group_of, producer, readers, outvars,
                               [stage for _, stage in groups])
    for v, parts in terms.items():  # the adds joining terms of several stages: not run
        for i in _sum_tree(v, eqns, producer, readers, outvars, parts):
            group_of[i] = -1
    term_of = {t: v for v, parts in terms.items() for t in parts}
    cut = (set(outvars) - set(terms)) | set(term_of)

    def keep(v: Any, g: int) -> bool:
        # Only the task that owns an equation hands its results on, to the tasks that read
        # them without running the equation themselves.
        i = producer[v]
        return group_of[i] == g and (v in cut or any(
            h != g and h not in runs_of[i] for j in readers.get(v, ()) for h in runs_of[j]))

    programs = _programs(jaxpr, split.gradient.consts, eqns, groups, group_of, sources, keep,
                         again=again, pins=pins,
                         path_of={id(e): p for e, p in zip(jaxpr.eqns, paths, strict=True)})
    return [dataclasses.replace(p, terms={v: term_of[v] for v in p.outputs if v in term_of})
            if any(v in term_of for v in p.outputs) else p for p in programs], outvars, runs


def _gradient_sources(jaxpr: Any, n_state: int, rows: RowSplit,
                      stacks: Mapping[str, tuple[Sequence[str], frozenset[int]]],
                      ) -> tuple[dict[Any, Input],
                                 dict[Any, tuple[tuple[str, ...], dict[tuple[int, int], Any]]]]:
    """Where each input of the gradient part comes from, and the state leaves held as pieces."""
    state_pieces: dict[Any, tuple[tuple[str, ...], dict[tuple[int, int], Any]]] = {}
    sources: dict[Any, Input] = {}
    for j, v in enumerate(jaxpr.invars[:n_state]):
        if j not in rows.runs:
            sources[v] = ("state", rows.index(j))
            continue
        stack = next((tuple(layers) for layers, leaves in stacks.values()
                      if j in leaves), None)
        if stack is None:  # (optimizer state of a stacked leaf: the gradient does not read it)
            continue
        row_parts = {r: _Piece(v.aval.update(shape=(r[1] - r[0], *v.aval.shape[1:])))
                     for r in rows.runs[j]}
        state_pieces[v] = (stack, row_parts)
        sources.update({p: ("state", rows.index(j, r)) for r, p in row_parts.items()})
    sources.update({v: ("batch", j) for j, v in enumerate(jaxpr.invars[n_state:])})
    return sources, state_pieces


def _task_order(eqns: Sequence[_Item], producer: Mapping[Any, int],
                virtual: VirtualStages) -> list[int | None]:
    """Per item, its task's position in ``F_0 .. B_0``, or None where nothing decides it.

    Raises:
      PipelineError: an equation belongs to layers of several virtual stages, or reads a value
        of a later one.
    """
    big_k = virtual.count
    order: list[int | None] = []
    for i, e in enumerate(eqns):
        names = e.names
        held = {virtual.owner[n] for n in names if n in virtual.owner}
        known = [o for v in e.invars if _is_var(v) and v in producer
                 if (o := order[producer[v]]) is not None]
        earliest = max(known) if known else None
        what = e.eqn.primitive if e.eqn is not None else e.kind
        if len(held) > 1:
            raise PipelineError(format_error(
                "An equation of the step belongs to layers of several stages.",
                where=f"equation {i} ({what}), layers {sorted(names)}",
                remedy="cut the stages at layer boundaries that no op crosses (a scanned "
                       "stack's rows may sit on different stages; other loops may not)"))
        if held:
            s = held.pop()
            o = 2 * big_k - 1 - s if e.eqn is not None and autodiff_phase(
                e.eqn) == "backward" else s
            if earliest is not None and earliest > o:
                raise PipelineError(format_error(
                    "A stage reads a value that a later stage computes.",
                    where=f"equation {i} ({what}) on virtual stage {s}",
                    remedy="cut the stages in the model's layer order"))
            order.append(o)
        else:
            order.append(earliest)
    return order


def _run_again(eqns: Sequence[_Item], group_of: Sequence[int], producer: Mapping[Any, int],
               jaxpr: Any, paths: Sequence[tuple[int, ...]], virtual: VirtualStages,
               remat: Mapping[int, str] | None,
               rerun: Mapping[str, Collection[tuple[int, ...]]] | None,
               ) -> dict[int, list[int]]:
    """Per task, the equations of other tasks it reruns: its remat policy's, constants it reads."""
    big_k = virtual.count
    ids = {policy: {id(e) for e, p in zip(jaxpr.eqns, paths, strict=True) if p in chosen}
           for policy, chosen in ((k, set(c)) for k, c in (rerun or {}).items())}
    again = _recomputed(eqns, group_of, producer, big_k, [
        (remat or {}).get(virtual.stages[virtual.position[s]], "none") for s in range(big_k)],
        ids)
    for g, constants in _constants_read(eqns, group_of, producer, jaxpr.constvars,
                                        again).items():
        again[g] = sorted(set(again.get(g, ())) | constants)
    return again


def _sum_tree(v: Any, eqns: Sequence[_Item], producer: Mapping[Any, int],
              readers: Mapping[Any, Sequence[int]], cut: Sequence[Any],
              leaves: Collection[Any]) -> list[int]:
    """The ``add_any`` equations summing ``leaves`` into ``v``."""
    if v in leaves:
        return []
    i = producer[v]
    return [i, *(j for x in eqns[i].invars if _is_var(x)
                 for j in _sum_tree(x, eqns, producer, readers, cut, leaves))]


def _cross_stage_terms(eqns: Sequence[_Item], group_of: Sequence[int],
                       producer: Mapping[Any, int], readers: Mapping[Any, Sequence[int]],
                       cut: Sequence[Any], stage_of: Sequence[int]) -> dict[Any, list[Any]]:
    """Per cut value that ``add_any`` equations sum from values of several stages, those
    values: the largest sub-sums computed on one stage from that stage's values (the module
    docstring). Only sums whose partial results nothing else reads are split."""
    outputs = set(cut)

    def is_add(x: Any) -> bool:
        if x not in producer:
            return False
        item = eqns[producer[x]]
        return item.kind == "eqn" and item.eqn.primitive.name == "add_any"

    def stages(x: Any) -> set[int]:  # the stages computing the values summed into x
        if x not in producer:
            return {-1}  # a state or batch leaf summed in as it is
        here = {stage_of[group_of[producer[x]]]}
        if not is_add(x):
            return here
        return here.union(*(stages(y) for y in eqns[producer[x]].invars if _is_var(y)))

    def split(x: Any, top: bool) -> list[Any] | None:
        if not is_add(x) or (not top and (x in outputs or len(readers.get(x, ())) != 1)):
            return None
        if len(stages(x)) == 1:
            return [x]
        out: list[Any] = []
        for y in eqns[producer[x]].invars:
            if not _is_var(y):
                return None
            parts = split(y, False)
            if parts is None:
                if y not in producer:
                    return None
                parts = [y]
            out.extend(parts)
        return out

    found: dict[Any, list[Any]] = {}
    for v in dict.fromkeys(x for x in cut if _is_var(x)):
        parts = split(v, True)
        if parts is not None and len(parts) > 1 and v not in parts:
            found[v] = parts
    return found


def _constants_read(eqns: Sequence[_Item], group_of: Sequence[int],
                    producer: Mapping[Any, int], constvars: Sequence[Any],
                    again: Mapping[int, Sequence[int]]) -> dict[int, set[int]]:
    """Per task, the equations of other tasks that compute constants it reads (values of
    literals and constants alone: a causal mask, the loop-invariant values autodiff hoists
    out of a scanned stack's loop), which it computes again: a constant is never handed
    from stage to stage, nor kept from a forward task for its backward."""
    known = set(constvars)
    constant: set[int] = set()
    for i, e in enumerate(eqns):
        if e.kind == "eqn" and not e.eqn.effects and all(
                not _is_var(v) or v in known for v in e.invars):
            constant.add(i)
            known.update(e.outvars)
    out: dict[int, set[int]] = {}
    runs: dict[int, set[int]] = {}
    for i, g in enumerate(group_of):
        runs.setdefault(g, set()).add(i)
    for g, extra in again.items():
        runs.setdefault(g, set()).update(extra)
    for g, mine in runs.items():
        need = {i for i in _producers_in(eqns, producer, mine, constant) if group_of[i] != g}
        if need:
            out[g] = need
    return out


def _recomputed(eqns: Sequence[_Item], group_of: Sequence[int], producer: Mapping[Any, int],
                big_k: int, policies: Sequence[str], rerun: Mapping[str, Collection[int]],
                ) -> dict[int, list[int]]:
    """Per backward task, the equations of its forward task it runs again under its stage's
    remat policy (``policies``, per virtual stage): under ``full`` every one its backward
    needs, otherwise those ``rerun[policy]`` names (ids of the step's equations) it needs,
    with the values of that set they read from each other."""
    out: dict[int, list[int]] = {}
    for s, policy in enumerate(policies):
        chosen = rerun.get(policy, ())
        if policy != "full" and not chosen:
            continue
        b = 2 * big_k - 1 - s
        allowed = {i for i, g in enumerate(group_of) if g == s and (
            policy == "full" or (eqns[i].kind == "eqn" and id(eqns[i].eqn) in chosen))}
        need = _producers_in(eqns, producer, [i for i, g in enumerate(group_of) if g == b],
                             allowed)
        if need:
            out[b] = sorted(need)
    return out


def _producers_in(eqns: Sequence[_Item], producer: Mapping[Any, int], readers: Iterable[int],
                  allowed: Collection[int]) -> set[int]:
    """The equations of ``allowed`` whose results ``readers`` read, directly or through
    other equations of ``allowed``."""
    todo = [producer[v] for i in readers for v in eqns[i].invars
            if _is_var(v) and producer.get(v) in allowed]
    need: set[int] = set()
    while todo:
        i = todo.pop()
        if i in need:
            continue
        need.add(i)
        todo.extend(producer[v] for v in eqns[i].invars
                    if _is_var(v) and producer.get(v) in allowed)
    return need


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
    readers: dict[Any, list[int]] = {}
    for i, e in enumerate(eqns):
        for v in e.invars:
            if _is_var(v):
                readers.setdefault(v, []).append(i)
    stage_of = _placed(eqns, at, position, readers, state_index)
    home = [at.get(v, default) for v in jaxpr.invars[:n_state]]
    at = {v: s for v, s in zip(jaxpr.invars, [*home, *cut_at], strict=True)}
    groups, group_of = _level_groups(eqns, stage_of, at, position, readers, default)
    group_readers: dict[Any, set[int]] = {}
    for e, g in zip(eqns, group_of, strict=True):
        for v in e.invars:
            if _is_var(v):
                group_readers.setdefault(v, set()).add(g)
    final = {v for v in jaxpr.outvars if _is_var(v)}  # a literal output (a reset counter)
    sources: dict[Any, Input] = {v: ("state", j) for v, j in state_index.items()}
    sources.update({v: ("cut", i) for i, v in enumerate(jaxpr.invars[n_state:])})
    # The new state leaves (the step returns the new state first) stay in their home stage's
    # sharding, so that the next step finds them in place.
    leaf_of = {v: j for j, v in enumerate(jaxpr.outvars[:n_state])
               if _is_var(v) and v.aval.shape == jaxpr.invars[j].aval.shape}
    def build(donate: Mapping[tuple[int, int], tuple[int, ...]] | None) -> list[Program]:
        return _programs(
            jaxpr, split.update.consts, eqns, groups, group_of, sources,
            lambda v, g: v in final or bool(group_readers.get(v, set()) - {g}),
            lambda v, s: state_sharding(s, leaf_of[v]) if v in leaf_of and home[leaf_of[v]] == s
            else None, donate)

    programs = build(None)
    produced = {v: p.stage for p in programs for v in p.outputs}
    where: list[Any] = []
    for v in jaxpr.outvars:
        if not _is_var(v):
            where.append(("literal", v.val))
        elif v in produced:
            where.append(("value", v, produced[v]))
        else:
            where.append(sources[v])
    return build(_donated(programs, where)), where, home


def _heaviest(e: Any, at: Mapping[Any, int], position: Mapping[int, int]) -> int | None:
    """The stage holding most of the bytes ``e`` reads (earliest on ties); None: nothing placed."""
    weight: dict[int, int] = {}
    for v in e.invars:
        if _is_var(v) and v in at:
            weight[at[v]] = weight.get(at[v], 0) + array_nbytes(v.aval.shape, v.aval.dtype) + 1
    if not weight:
        return None
    return max(weight, key=lambda s: (weight[s], -position.get(s, len(position))))


def _placed(eqns: Sequence[Any], at: dict[Any, int], position: Mapping[int, int],
            readers: Mapping[Any, Sequence[int]], state_index: Mapping[Any, int],
            ) -> list[int | None]:
    """Per update equation, its stage (None: unplaced); ``at`` gains the stages placed."""
    # Optimizer state adopts the stage of its first placed reader: stages spread forward from
    # what is placed, and back from placed readers (``mu * b1`` reads only ``mu``; the ``add``
    # with the gradient's share places it), until nothing changes.
    stage_of: list[int | None] = [None] * len(eqns)

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
            if stage_of[i] is None and (s := _heaviest(e, at, position)) is not None:
                place(i, s)
                changed = True
        for i in range(len(eqns) - 1, -1, -1):
            if stage_of[i] is None:
                later = [t for v in eqns[i].outvars for r in readers.get(v, ())
                         if (t := stage_of[r]) is not None]
                if later:
                    place(i, later[0])
                    changed = True
    return stage_of


def _level_groups(eqns: Sequence[Any], stage_of: Sequence[int | None], at: dict[Any, int],
                  position: Mapping[int, int], readers: Mapping[Any, Sequence[int]],
                  default: int) -> tuple[list[tuple[int, int]], list[int]]:
    """The ``(level, stage)`` groups in run order, and each equation's; ``at`` gains stages."""
    # Levels: as soon as possible (a crossing starts the next level) gives the number of
    # levels; then every equation moves to the latest level its readers allow, so a level
    # holds only what the crossings need (a norm's partial sums, a counter) and everything
    # else runs in the last level: no parameter-sized value passes between levels.
    level: dict[Any, int] = {}
    stages: list[int] = []
    for i, e in enumerate(eqns):
        s = _heaviest(e, at, position)
        s = stage_of[i] if s is None else s
        s = default if s is None else s
        lv = max([level[v] + (at[v] != s) for v in e.invars if _is_var(v) and v in level],
                 default=0)
        stages.append(s)
        at.update({v: s for v in e.outvars})
        level.update({v: lv for v in e.outvars})
    last_level = max(level.values(), default=0)
    latest = [last_level] * len(eqns)
    for i in range(len(eqns) - 1, -1, -1):
        for v in eqns[i].outvars:
            for r in readers.get(v, ()):
                latest[i] = min(latest[i], latest[r] - (stages[r] != stages[i]))
    keys = list(zip(latest, stages, strict=True))
    groups = sorted(set(keys), key=lambda g: (g[0], position.get(g[1], len(position)), g[1]))
    index = {g: n for n, g in enumerate(groups)}
    return groups, [index[key] for key in keys]


def _donated(programs: Sequence[Program], where: Sequence[Any],
             ) -> dict[tuple[int, int], tuple[int, ...]]:
    """Per update program ``(level, stage)``, the arguments it donates."""
    # A state leaf's copy on a stage is donated to the last update program there that reads
    # it, unless the step returns the leaf unchanged: the new state reuses the old one's
    # buffers, as in the one-program step (jit is lazy: building the programs again is free).
    unchanged = {w[1] for w in where if w[0] == "state"}
    last: dict[tuple[int, int], tuple[tuple[int, int], int]] = {}
    for prog in programs:
        for a, (kind, what) in enumerate(prog.inputs):
            if kind == "state":
                last[prog.stage, what] = ((prog.key, prog.stage), a)
    donate: dict[tuple[int, int], tuple[int, ...]] = {}
    for (_, j), (group, a) in last.items():
        if j not in unchanged:
            donate[group] = (*donate.get(group, ()), a)
    return donate
