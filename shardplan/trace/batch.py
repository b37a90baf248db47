"""How a train step uses its batch as a whole: what decides whether it can be cut into
microbatches and how each microbatch's results combine (gradient accumulation).

A step whose loss is a mean or a sum over its examples accumulates exactly: the gradient of the
whole batch is the mean (or sum) of the microbatches'. Three things in ordinary train steps
break that, and :func:`batch_use` finds each in the step's jaxpr, on shapes alone, before any
plan is made:

* **Random draws over the batch** (dropout): ``random_bits`` whose shape has the batch
  dimension. A microbatch drawing with the step's key draws other numbers than the whole batch
  does, and every microbatch would draw the same ones.
* **Batch statistics** (BatchNorm, standardising inputs by the batch's mean): in the forward
  pass, a reduction over the batch's examples that flows back into every example. A
  microbatch's statistics are not the batch's.
* **Normalisers** (the padded-token or masked-LM loss ``sum(ce * w) / sum(w)``, weights
  normalised by their batch total): a sum over the batch's examples, computed from the batch
  alone, that divides or scales every example's share. These are *exact* once the sum is taken
  over the whole batch before any microbatch runs: :attr:`BatchUse.normalisers` lists them (as
  top-level equations) for the runtime to substitute (``runtime/accumulate.py``).

The analysis walks the step's jaxpr once (the trace the planner made already: JAX caches it)
and follows the *samples axis* from the batch's leading dimension through every equation: the
axis a value's examples lie along (kept by elementwise ops, moved by ``broadcast_in_dim``,
``transpose``, ``reshape``, ``dot_general``'s batch and free dimensions, ``gather``'s index
dimensions, a convolution's batch dimension), or none where an equation reduces over it (a
``reduce_*`` over that axis, a contraction of it, a scatter of examples into a table): the
equation is then a *root*, and the value a reduction over the examples. A reduction divided by
a literal equal to the number of elements it summed is a mean (``jnp.mean``), not a total.
Random values carry the axes their draw made, so a draw whose mask meets the examples along
their own axis is a draw over the batch. Nested jaxprs (``jit``, ``scan`` and ``while`` bodies,
``remat``, custom derivatives, ``cond`` branches) are walked with their operands' facts; a
primitive without a rule keeps the samples axis where its result has its operand's shape, and
otherwise ends the trail (no finding).

Example:
    >>> import jax, jax.numpy as jnp
    >>> def step(w, batch):
    ...     x, mask = batch
    ...     def loss(w):
    ...         return jnp.sum(((x @ w) ** 2) * mask) / jnp.sum(mask)
    ...     value, g = jax.value_and_grad(loss)(w)
    ...     return w - 0.1 * g, {"loss": value}
    >>> use = batch_use(step, jnp.ones((3,)), (jnp.ones((4, 3)), jnp.ones((4,))))
    >>> len(use.normalisers), use.random, use.statistics
    (1, (), ())
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jcore

from shardplan.errors import PipelineError, format_error

__all__ = ["BatchUse", "Finding", "autodiff_phase", "batch_use", "batch_use_of"]


@dataclass(frozen=True)
class Finding:
    """One use of the batch as a whole.

    Attributes:
      primitive: the equation's primitive (``random_bits``, ``reduce_sum``, ...).
      where: its source line, ``file:line (function)``.
      top: the index of the step's top-level equation that holds it.
    """

    primitive: str
    where: str
    top: int


@dataclass(frozen=True)
class BatchUse:
    """What :func:`batch_use` found (the module docstring).

    Attributes:
      random: random draws with the batch dimension in their shape.
      statistics: reductions over the examples that the forward pass uses per example (the
        reduction's equation; one finding per reduction).
      normalisers: top-level equation indices of sums over the examples, computed from the
        batch alone, that scale every example's share (exact with the whole batch's sum).
      normaliser_findings: the same, as findings (for the plan's note).
      normaliser_shapes: the same, their shapes (a reduction to a scalar: ``()``).
    """

    random: tuple[Finding, ...] = ()
    statistics: tuple[Finding, ...] = ()
    normalisers: tuple[int, ...] = ()
    normaliser_findings: tuple[Finding, ...] = ()
    normaliser_shapes: tuple[tuple[int, ...], ...] = ()

    def refusal(self, accumulation: str) -> tuple[str, str] | None:
        """``(why, where)`` when a step with this use cannot be cut into microbatches under
        ``accumulation`` (``"exact"`` or ``"per_microbatch"``), else ``None``.

        Under ``"exact"``, random draws over the batch and batch statistics are refused (a
        microbatch's result would differ from the batch's); under ``"per_microbatch"`` they
        are gradient accumulation: each microbatch draws with its own key and computes its own
        statistics.
        """
        if accumulation != "exact":
            return None
        parts = []
        if self.random:
            parts.append(("draws random numbers over the batch (dropout)", self.random))
        if self.statistics:
            parts.append(("uses statistics over the batch's examples in its forward pass "
                          "(batch normalisation)", self.statistics))
        if not parts:
            return None
        why = " and ".join(p for p, _ in parts)
        seen = {f"{f.primitive} at {f.where}": None for _, fs in parts for f in fs}
        where = "; ".join(list(seen)[:3]) + (f" and {len(seen) - 3} more" if len(seen) > 3
                                             else "")
        return why, where

    def notes(self, accumulation: str) -> list[str]:
        """A plan's notes on how its microbatches combine under ``accumulation``."""
        notes = []
        refused = self.refusal(accumulation)
        if refused is not None:
            why, where = refused
            notes.append(
                f"Whole-batch stages (one replica, one microbatch): the step {why} ({where}), "
                "so a microbatch's result would differ from the whole batch's. "
                "PlanConfig(accumulation=\"per_microbatch\") allows microbatches with "
                "gradient accumulation semantics.")
        elif self.random or self.statistics:
            what = " and ".join(w for w, found in (
                ("draws its random numbers with the step's key folded with the index of its "
                 "first sample", self.random),
                ("computes its own batch statistics", self.statistics)) if found)
            notes.append(
                "Gradient accumulation semantics (PlanConfig.accumulation="
                f"\"per_microbatch\"): each microbatch {what}, so the step's result depends "
                "on the microbatch size; it is deterministic.")
        for f in self.normaliser_findings:
            notes.append(
                f"Exact accumulation of a normalised loss: the sum over the batch at {f.where} "
                "scales every sample's share; it is summed over the whole batch before the "
                "microbatches run.")
        return notes

    def refusal_error(self, accumulation: str, *, what: str) -> PipelineError:
        """The error for cutting the step into microbatches where :meth:`refusal` says it
        cannot be; ``what`` names the plan or option that asked for them."""
        refused = self.refusal(accumulation)
        assert refused is not None
        why, where = refused
        return PipelineError(format_error(
            f"The train step cannot be cut into microbatches exactly: it {why}, so a "
            "microbatch's result would differ from the whole batch's.",
            where=f"{what}: {where}",
            remedy="plan it with one microbatch per replica (sp.make_plan does so itself "
                   "unless PlanConfig.microbatch_sizes excludes the batch size), or accept "
                   "gradient accumulation semantics with "
                   "PlanConfig(accumulation=\"per_microbatch\") (each microbatch draws its "
                   "own random numbers and computes its own batch statistics)"))


def autodiff_phase(eqn: Any) -> str | None:
    """``"forward"`` or ``"backward"`` for an equation JAX's autodiff emitted (by its name
    stack), else ``None``."""
    stack = str(eqn.source_info.name_stack)
    if "transpose(" in stack:
        return "backward"
    if "jvp(" in stack:
        return "forward"
    return None



class _Fact(NamedTuple):
    """What the walk knows of one value."""

    dep: bool = False  # reads the batch
    par: bool = False  # reads the state
    roots: frozenset[int] = frozenset()  # the reductions over the examples it derives from
    scaled: bool = False  # a reduction divided by its element count (a mean)
    axis: int | None = None  # the samples axis (a batch-dependent value), if any
    own: frozenset[int] | None = None  # a random value's axes its draw made
    origin: Any = None  # and that draw: (its equation, its top-level equation's index)


_CONST = _Fact()
_STATE = _Fact(par=True)


def _join(facts: Iterable[_Fact]) -> _Fact:
    """The facts of a value that reads all of ``facts`` (no samples axis, no randomness)."""
    dep = par = scaled = False
    roots: frozenset[int] = frozenset()
    for f in facts:
        dep, par, roots, scaled = dep or f.dep, par or f.par, roots | f.roots, scaled or f.scaled
    return _Fact(dep, par, roots, scaled)


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(getattr(getattr(v, "aval", None), "shape", ()))


def _inner(jaxpr: Any) -> Any:
    return jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr


def _reshaped_axis(old: tuple[int, ...], new: tuple[int, ...], axis: int) -> int | None:
    """The axis of ``new`` holding the first element of ``old``'s ``axis`` after a row-major
    reshape (``None`` where that axis is split below the first element's: never for the
    merges and splits of models)."""
    before = math.prod(old[:axis])
    run = 1
    for k, size in enumerate(new):
        if run <= before < run * size or (size == 1 and run == before and k == len(new) - 1):
            return k if before % run == 0 else None
        run *= size
    return None


# Primitives whose inner programs read the equation's operands one to one, their outputs one
# to one.
_ONE_TO_ONE = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
               "core_call": "call_jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr",
               "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
               "custom_vjp_call_jaxpr": "fun_jaxpr", "shard_map": "jaxpr"}
_WALKED = frozenset({*_ONE_TO_ONE, "scan", "while", "cond", "random_bits"})
"""Primitives walked even where no operand reads the batch (a draw, or one inside)."""
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                         "reduce_or", "reduce_xor", "argmax", "argmin"})


class _Walk:
    """The walk of the module docstring."""

    def __init__(self, normalised: frozenset[int]) -> None:
        self.normalised = normalised  # top-level equations whose results count as the state's
        # per root: (equation, its top-level index or None when nested, a sum of the batch
        # alone, the number of elements it summed)
        self.roots: dict[int, tuple[Any, int | None, bool, int]] = {}
        self.random: dict[tuple[str, int], Finding] = {}  # by source line and top equation
        self.statistics: dict[str, Finding] = {}
        self.normalisers: dict[int, Finding] = {}
        self.sources: dict[Any, str] = {}
        self.top_eqn: Any = None  # the top-level equation being walked

    def where(self, eqn: Any, default: str = "") -> str:
        """``model.py:23 (__call__)``: the innermost frame of the user's code that made
        ``eqn``, and the library's line under it (``via flax/linen/normalization.py:122``)
        where a library made it; ``default`` where no frame is known."""
        tb = eqn.source_info.traceback
        try:
            return self.sources[tb] or default
        except KeyError:
            text = self.sources[tb] = _where(tb)
        except TypeError:
            text = _where(tb)
        return text or default

    def run(self, jaxpr: Any, ins: Sequence[_Fact], *, top: int | None) -> list[_Fact]:
        """Walks ``jaxpr`` (the step's, or an inner one) from its inputs' facts; returns its
        outputs'. ``top``: the top-level equation an inner program belongs to (``None``: this
        is the top level, whose backward pass is not walked: every use of the batch this
        module looks for is in the forward pass, and the backward pass only transposes it)."""
        env: dict[Any, _Fact] = dict(zip(jaxpr.invars, ins, strict=True))
        for i, eqn in enumerate(jaxpr.eqns):
            if top is None and i in self.normalised:
                env.update(dict.fromkeys(eqn.outvars, _STATE))
                continue
            args = [_CONST if isinstance(v, jcore.Literal) else env.get(v, _CONST)
                    for v in eqn.invars]
            if eqn.primitive.name not in _WALKED and not any(
                    f.dep or f.own is not None for f in args):  # the state's own computation
                env.update(dict.fromkeys(eqn.outvars,
                                         _STATE if any(f.par for f in args) else _CONST))
                continue
            if top is None:
                if autodiff_phase(eqn) == "backward":
                    continue
                self.top_eqn = eqn
            outs = self.equation(eqn, args, i if top is None else top, top is None)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [_CONST if isinstance(v, jcore.Literal) else env.get(v, _CONST)
                for v in jaxpr.outvars]

    def equation(self, eqn: Any, args: list[_Fact], top: int, at_top: bool) -> list[_Fact]:
        """The facts of ``eqn``'s results, noting what it finds."""
        name, params = eqn.primitive.name, eqn.params
        inner = self.inner(eqn, args, top)
        if inner is not None:
            return inner
        joined = _join(args)
        drawn = [f for f in args if f.own is not None]
        if not joined.dep and not drawn and name != "random_bits":
            return [joined] * len(eqn.outvars)  # the state's and constants' own computation
        shapes = [_shape(v) for v in eqn.invars]
        if name == "random_bits":
            out = _shape(eqn.outvars[0])
            return [joined._replace(own=frozenset(range(len(out))), origin=(eqn, top))]
        rows = [(f, s) for f, s in zip(args, shapes, strict=True)
                if f.dep and f.axis is not None]
        if drawn and rows:
            self.meet_randomness(args, shapes, rows)
        randomness = self.own_of(eqn, args, shapes) if drawn else {}
        outs = [self.axis_of(eqn, name, params, args, shapes, k, rows)
                for k in range(len(eqn.outvars))]
        reduced = [f for f in args if f.dep and f.axis is None]
        if reduced and any(axis is not None for axis, _ in outs):
            self.back_into_examples(reduced, top)  # a reduction meets the examples
        if name == "div" and len(args) == 2:
            if args[1].dep and args[1].axis is None:  # a share of a total: sum(a) / sum(w)
                self.normaliser(args[1])  # (a ratio of other totals, a load-balancing
                # term, is the runtime's to measure: gradient accumulation)
            elif args[0].roots and isinstance(eqn.invars[1], jcore.Literal):
                counts = {self.roots[r][3] for r in args[0].roots}
                if float(np.asarray(eqn.invars[1].val)) in counts:
                    joined = joined._replace(scaled=True)  # jnp.mean's divisor
        facts = []
        for (axis, root), v in zip(outs, eqn.outvars, strict=True):
            if axis is not None:
                facts.append(joined._replace(axis=axis, **randomness))
            elif root:  # this equation reduces over the examples
                key = id(eqn)
                count = max(math.prod(s) // max(math.prod(_shape(v)), 1) for _, s in rows)
                self.roots[key] = (eqn, top if at_top else None,
                                   name == "reduce_sum" and not joined.par and not joined.scaled,
                                   count)
                facts.append(joined._replace(roots=joined.roots | {key}))
            else:
                facts.append(joined._replace(**randomness) if randomness else joined)
        return facts

    def axis_of(self, eqn: Any, name: str, params: Any, args: list[_Fact],
                shapes: list[tuple[int, ...]], k: int,
                rows: list[tuple[_Fact, tuple[int, ...]]]) -> tuple[int | None, bool]:
        """``(samples axis of result k, whether the equation reduces over the examples)``."""
        if not rows:
            return None, False
        out = _shape(eqn.outvars[k])
        fact, shape = rows[0]
        axis = fact.axis
        assert axis is not None
        if name == "broadcast_in_dim":
            return params["broadcast_dimensions"][axis], False
        if name == "transpose":
            return tuple(params["permutation"]).index(axis), False
        if name == "reshape":
            new = _reshaped_axis(shape, out, axis)
            return new, new is None
        if name == "squeeze":
            dims = params["dimensions"]
            return (None, True) if axis in dims else (axis - sum(d < axis for d in dims), False)
        if name in _REDUCTIONS:
            axes = params["axes"]
            return (None, True) if axis in axes else (axis - sum(d < axis for d in axes), False)
        if name == "dot_general":
            return self.dot_axis(eqn, args)
        if name == "conv_general_dilated":
            return self.conv_axis(eqn, args)
        if name == "gather":
            return self.gather_axis(eqn, args)
        if name in ("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul",
                    "scatter-min", "scatter-max", "scatter_min", "scatter_max"):
            if args[0].dep and args[0].axis is not None:
                return args[0].axis, False
            return None, True  # examples summed (or written) into a table
        if name in ("slice", "dynamic_slice", "dynamic_update_slice", "pad", "rev",
                    "concatenate", "select_n", "clamp", "cumsum", "cumlogsumexp", "cummax",
                    "cummin", "cumprod", "sort", "top_k", "iota", "copy", "copy_p",
                    "convert_element_type", "reduce_precision", "split"):
            if len(out) == len(shape) and out[axis] == shape[axis]:
                return axis, False
            return None, True  # examples picked out
        if out == shape:  # elementwise, or a primitive that keeps its operand's layout
            return axis, False
        same = [f.axis for f, s in rows if s == out]
        return (same[0], False) if same else (None, False)

    @staticmethod
    def dot_axis(eqn: Any, args: list[_Fact]) -> tuple[int | None, bool]:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        ranks = [len(_shape(v)) for v in eqn.invars]
        free = [[d for d in range(ranks[0]) if d not in lc and d not in lb],
                [d for d in range(ranks[1]) if d not in rc and d not in rb]]
        for side, (f, contract, batch) in enumerate(zip(args, (lc, rc), (lb, rb),
                                                        strict=True)):
            if not f.dep or f.axis is None:
                continue
            if f.axis in contract:
                return None, True
            if f.axis in batch:
                return tuple(batch).index(f.axis), False
            return len(lb) + (len(free[0]) if side else 0) + free[side].index(f.axis), False
        return None, False

    @staticmethod
    def conv_axis(eqn: Any, args: list[_Fact]) -> tuple[int | None, bool]:
        dn = eqn.params["dimension_numbers"]
        lhs, rhs = args[0], args[1]
        if lhs.dep and lhs.axis is not None:
            if lhs.axis == dn.lhs_spec[0] and eqn.params.get("batch_group_count", 1) == 1:
                return dn.out_spec[0], False
            return None, True  # the examples contracted (a weight's gradient)
        if rhs.dep and rhs.axis is not None:
            if rhs.axis == dn.rhs_spec[0]:
                return dn.out_spec[1], False
            return None, True
        return None, False

    @staticmethod
    def gather_axis(eqn: Any, args: list[_Fact]) -> tuple[int | None, bool]:
        dn = eqn.params["dimension_numbers"]
        operand, indices = args[0], args[1]
        out_rank = len(_shape(eqn.outvars[0]))
        index_dims = [d for d in range(out_rank) if d not in dn.offset_dims]
        if indices.dep and indices.axis is not None:
            return index_dims[indices.axis], False
        if operand.dep and operand.axis is not None:
            batching = tuple(getattr(dn, "operand_batching_dims", ()))
            if operand.axis in batching:
                which = getattr(dn, "start_indices_batching_dims", ())[
                    batching.index(operand.axis)]
                return index_dims[which], False
            kept = [d for d in range(len(_shape(eqn.invars[0])))
                    if d not in dn.collapsed_slice_dims and d not in batching]
            if operand.axis in kept:
                return dn.offset_dims[kept.index(operand.axis)], False
            return None, True  # examples picked out by index
        return None, False

    @staticmethod
    def own_of(eqn: Any, args: list[_Fact], shapes: list[tuple[int, ...]]) -> dict[str, Any]:
        """A random result's axes its draw made, and the draw (nothing: not random)."""
        drawn = [(f, s) for f, s in zip(args, shapes, strict=True) if f.own is not None]
        if not drawn:
            return {}
        (f, shape), out = drawn[0], _shape(eqn.outvars[0])
        own: frozenset[int] | None
        if eqn.primitive.name == "broadcast_in_dim":
            dims = eqn.params["broadcast_dimensions"]
            own = frozenset(dims[a] for a in f.own or ())
        elif shape == out:
            own = f.own
        else:  # reshaped: every axis counts as drawn
            own = frozenset(range(len(out)))
        return {"own": own, "origin": f.origin}

    def meet_randomness(self, args: list[_Fact], shapes: list[tuple[int, ...]],
                        rows: list[tuple[_Fact, tuple[int, ...]]]) -> None:
        """A draw meets the examples along an axis it made: a draw over the batch."""
        for f, s in zip(args, shapes, strict=True):
            if f.own is None or f.dep:
                continue
            for r, rs in rows:
                if rs == s and r.axis in f.own:
                    draw, at = f.origin
                    where = self.where(draw, self.where(self.top_eqn))
                    self.random.setdefault((where, at), Finding("random_bits", where, at))

    def back_into_examples(self, reduced: list[_Fact], top: int) -> None:
        """A value reduced over the examples meets per-example values in the forward pass: a
        normaliser when every reduction it comes from is a total of the batch alone (taken at
        the top level, not divided by its element count), else a batch statistic."""
        roots = [self.roots[k] for f in reduced for k in f.roots]
        if not roots:
            return
        if all(self.normaliser(f) for f in reduced):
            return
        for e, top_i, _, _ in roots:
            where = self.where(e, self.where(self.top_eqn))
            self.statistics.setdefault(where, Finding(
                e.primitive.name, where, top if top_i is None else top_i))

    def normaliser(self, f: _Fact) -> bool:
        """Whether ``f`` is a total of the batch alone (its reductions sums of the batch at
        the top level, not divided by their element count); each of them noted if so."""
        roots = [self.roots[k] for k in f.roots]
        if not roots or f.scaled or not all(top_i is not None and only
                                            for _, top_i, only, _ in roots):
            return False
        for e, top_i, _, _ in roots:
            assert top_i is not None
            self.normalisers.setdefault(top_i, Finding(e.primitive.name, self.where(e), top_i))
        return True

    def inner(self, eqn: Any, args: list[_Fact], top: int) -> list[_Fact] | None:
        """The results' facts of an equation with inner programs, walked with its operands'
        facts (``None``: not such an equation)."""
        name, params = eqn.primitive.name, eqn.params
        if _ONE_TO_ONE.get(name, "") in params:
            return self.run(_inner(params[_ONE_TO_ONE[name]]), args, top=top)
        if name == "scan":
            consts, carry = params["num_consts"], params["num_carry"]
            body = _inner(params["jaxpr"])
            # the scanned operands lose their leading axis inside, the stacked results gain it
            ins = [*args[:consts + carry],
                   *(_shift(f, -1) for f in args[consts + carry:])]
            outs = self.loop(body, ins, consts, carry, top)
            return [*outs[:carry], *(_shift(f, 1) for f in outs[carry:])]
        if name == "while":
            cn, bn = params["cond_nconsts"], params["body_nconsts"]
            return self.loop(_inner(params["body_jaxpr"]), list(args[cn:]), bn,
                             len(args) - cn - bn, top)
        if name == "cond":
            branches = [self.run(_inner(b), args[1:], top=top)
                        for b in params["branches"]]
            return [b[0] if all(x == b[0] for x in b) else _join([*b, args[0]])
                    for b in zip(*branches, strict=True)]
        return None

    def loop(self, body: Any, ins: list[_Fact], consts: int, carry: int,
             top: int) -> list[_Fact]:
        """A loop body walked until its carries' facts no longer grow."""
        for _ in range(4):
            outs = self.run(body, ins, top=top)
            grown = [a if a == o else _join([a, o])._replace(
                axis=a.axis if a.axis == o.axis else None)
                for a, o in zip(ins[consts:consts + carry], outs[:carry], strict=True)]
            if grown == ins[consts:consts + carry]:
                break
            ins[consts:consts + carry] = grown
        return outs


def _shift(f: _Fact, by: int) -> _Fact:
    """``f`` for a value with one leading axis less (``by=-1``) or more (``by=1``); a scan
    over the samples axis itself runs example by example: no samples axis inside."""
    if f.axis is None:
        return f
    return f._replace(axis=f.axis + by if f.axis + by >= 0 else None)


def _where(traceback: Any) -> str:
    frames = list(itertools.islice(source_info_util.user_frames(traceback), 40))
    if not frames:
        return ""

    def text(f: Any) -> str:
        return f"{f.file_name}:{f.start_line} ({f.function_name})"

    user = next((f for f in frames if "site-packages" not in f.file_name), None)
    if user is None or user is frames[0]:
        return text(user or frames[0])
    lib = frames[0].file_name.rpartition("site-packages/")[2]
    return f"{text(user)}, via {lib}:{frames[0].start_line}"


def batch_use(train_step: Callable[..., Any], state: Any, batch: Any, /) -> BatchUse:
    """How ``train_step(state, batch)`` uses its batch as a whole (the module docstring), on
    ``batch``'s shapes (arrays or ``ShapeDtypeStruct``s; nothing runs; the trace is JAX's
    cached one where the step was traced at these shapes before). A batch of one sample is
    looked at as two: a samples axis of size 1 is dropped by reshapes that keep the others."""
    if any(np.shape(x)[:1] == (1,) for x in jax.tree.leaves(batch)):
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            (2 * np.shape(x)[0], *np.shape(x)[1:]) if np.ndim(x) else (),
            jax.typeof(x).dtype), batch)
    closed = jax.jit(train_step).trace(state, batch).jaxpr
    return batch_use_of(closed.jaxpr, len(jax.tree.leaves(state)))


def batch_use_of(jaxpr: Any, n_state: int, /) -> BatchUse:
    """:func:`batch_use` of the step's jaxpr (``n_state`` state leaves first among its
    inputs, then the batch's, each with its samples along its leading dimension)."""
    ins = [_STATE] * n_state + [_Fact(dep=True, axis=0 if _shape(v) else None)
                                for v in jaxpr.invars[n_state:]]
    normalised: frozenset[int] = frozenset()
    while True:  # again with each normaliser found taken as given, until none is new
        walk = _Walk(normalised)
        walk.run(jaxpr, ins, top=None)
        more = frozenset(walk.normalisers) - normalised
        if not more:
            break
        normalised |= more
    return BatchUse(tuple(walk.random.values()), tuple(walk.statistics.values()),
                    tuple(sorted(normalised)),
                    tuple(Finding(jaxpr.eqns[i].primitive.name, walk.where(jaxpr.eqns[i]), i)
                          for i in sorted(normalised)),
                    tuple(tuple(_shape(jaxpr.eqns[i].outvars[0])) for i in sorted(normalised)))
