"""Microbatching an unmodified train step: its jaxpr cut into a per-microbatch gradient part and
a once-per-step update part.

This is the first piece of the pipeline runtime: every multi-stage plan runs the batch-dependent
part of the step (forward and backward) once per microbatch, accumulates what it hands to the
update (the gradients, the loss and other metrics), and runs the update once. The cut is found
in the step's own jaxpr, so the user's step runs as written (``DESIGN.md``, decision 4).

The cut (:func:`split_step`)
----------------------------
The step is traced at the microbatch's shapes. JAX's autodiff names its equations: a
``jvp(...)`` name stack marks the forward pass, ``transpose(...)`` the backward pass. Every
top-level equation goes to

* the **gradient part** when it is forward or backward, or when it reads the batch (directly or
  through other such equations) without reading a backward result (e.g. an accuracy metric);
* the **update part** when it reads a backward result or an update-part value (the optimizer,
  the global gradient norm, the new parameters);
* both, as needed, when it reads the state only (a step counter, a learning-rate schedule):
  such equations are recomputed where they are used, which changes no value.

The *cut values* are what the gradient part produces and the update part or the step's outputs
read: the gradients and the batch-dependent metrics. The update part must not change with the
batch size (the step is cut again at twice the batch and the two update parts compared): a
value computed from the batch's shape alone would otherwise be the microbatch's.

Accumulation (:func:`reduction_kinds`)
--------------------------------------
A gradient of a mean loss over ``M`` equal microbatches is the mean of the microbatch gradients;
of a sum loss, their sum. Which one a cut value is, is measured once, on the first two
microbatches ``x1``, ``x2``: the gradient part on ``[x1, x2]`` (traced at twice the size) gives
``(f(x1) + f(x2)) / 2`` for a mean and ``f(x1) + f(x2)`` for a sum. The gradients (the values the
backward pass produces) come from one loss and are judged together, by the norm of the error of
each answer over all of them, so that a gradient that is zero up to rounding (a bias ahead of a
normalisation) does not decide; every other cut value (a metric) is judged alone, each within
:data:`MEAN_SUM_RTOL`. A value that is neither (a maximum over the batch, a running statistic)
cannot be accumulated: :class:`~shardplan.errors.PipelineError` names it. For losses that are
means or sums over examples the microbatched step equals the whole-batch step up to float
rounding; where the loss depends on the batch as a whole (mixture-of-experts routing with a
capacity, a load-balancing term) it is gradient accumulation over the microbatches.

Example:
    >>> import jax, jax.numpy as jnp
    >>> def step(w, batch):
    ...     loss, g = jax.value_and_grad(lambda w: jnp.mean((batch @ w) ** 2))(w)
    ...     return w - 0.1 * g, {"loss": loss}
    >>> w, x = jnp.ones((3,)), jnp.arange(12.0).reshape(4, 3)
    >>> run = microbatched(step, microbatches=2)
    >>> new_w, metrics = run(w, x)
    >>> ref_w, ref_metrics = step(w, x)
    >>> bool(jnp.allclose(new_w, ref_w)), bool(jnp.allclose(metrics["loss"], ref_metrics["loss"]))
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from shardplan.errors import ConfigError, PipelineError, format_error
from shardplan.trace.batch import BatchUse, autodiff_phase, batch_use
from shardplan.trace.dtypes import is_prng_key

__all__ = ["ACCUMULATIONS", "MEAN_SUM_RTOL", "AccumulationForm", "StepSplit",
           "accumulation_form", "autodiff_phase", "microbatched",
           "reduction_kinds", "split_batch", "split_step"]

Reduction = Literal["mean", "sum"]

MEAN_SUM_RTOL = 0.05
"""How close (relative to the value) the measurement must come to a mean or a sum. Exact means
and sums over examples land within float rounding (about 1e-7); a mixture-of-experts loss,
whose token routing (capacity) and load-balancing term depend on the batch they see, within a
few 1e-4: there the microbatched step is gradient accumulation, as every MoE trainer runs it,
not the whole-batch step. A maximum over two different microbatches is off by far more."""


@dataclass(frozen=True)
class StepSplit:
    """A train step cut into its gradient and update parts (the module docstring).

    Attributes:
      gradient: ``(*state leaves, *batch leaves) -> cut values``, at the microbatch's shapes.
      update: ``(*state leaves, *cut values) -> output leaves``.
      cut_avals: the cut values' shapes and dtypes.
      out_tree: the step's output tree structure.
      cut_backward: per cut value, whether the backward pass produced it (a gradient).
      gradient_eqns: top-level equations in the gradient part.
      update_eqns: top-level equations in the update part.
      gradient_index: the gradient part's equations' indices in the step's top-level jaxpr.
    """

    gradient: jcore.ClosedJaxpr
    update: jcore.ClosedJaxpr
    cut_avals: tuple[Any, ...]
    out_tree: Any
    cut_backward: tuple[bool, ...]
    gradient_eqns: int
    update_eqns: int
    gradient_index: tuple[int, ...] = ()


def _is_var(v: Any) -> bool:
    return not isinstance(v, jcore.Literal)


def split_step(train_step: Callable[..., Any], state: Any, batch: Any, /, *,
               evaluation: bool = False) -> StepSplit:
    """Cuts ``train_step(state, batch)`` into its gradient and update parts, and checks that the
    update part does not change with the batch size (the step cut again at twice the batch).

    Args:
      train_step: ``(state, batch) -> outputs``, using ``jax.value_and_grad`` /
        ``nnx.value_and_grad`` (or ``jax.grad``) for its gradients.
      state: the state pytree (arrays or ``ShapeDtypeStruct``s).
      batch: one *microbatch* (arrays or ``ShapeDtypeStruct``s): the parts are traced at its
        shapes.
      evaluation: ``train_step`` is a forward pass (an evaluation: ``(state, batch) ->
        metrics``), with no backward pass; its gradient part is everything that reads the
        batch.

    Returns:
      The :class:`StepSplit`.

    Raises:
      PipelineError: the step has no backward pass to cut at, or its update part reads a value
        computed from the batch's shape alone (``jnp.ones_like(batch).sum()``), which one
        microbatch's program would get wrong.
    """
    split = _split(train_step, state, batch, evaluation=evaluation)
    doubled = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((2 * np.shape(x)[0], *np.shape(x)[1:]),
                                       jax.typeof(x).dtype), batch)
    if str(_split(train_step, state, doubled, evaluation=evaluation).update.jaxpr) != str(
            split.update.jaxpr):
        raise PipelineError(format_error(
            "The train step's update (or a returned metric) depends on the batch size through "
            "a value computed from the batch's shape alone, which a microbatch's program would "
            "compute for the microbatch instead.",
            where=f"the update part of {getattr(train_step, '__name__', train_step)!r} "
                  f"({split.update_eqns} equations)",
            remedy="compute such values from the batch's contents (e.g. jnp.sum(mask) rather "
                   "than a shape), or inside the loss"))
    return split


def _split(train_step: Callable[..., Any], state: Any, batch: Any, /, *,
           evaluation: bool = False) -> StepSplit:
    """:func:`split_step` without the batch-size check."""
    closed, out_shape = jax.make_jaxpr(train_step, return_shape=True)(state, batch)
    out_tree = jax.tree.structure(out_shape)
    jaxpr = closed.jaxpr
    n_state, n_batch = len(jax.tree.leaves(state)), len(jax.tree.leaves(batch))
    eqns = list(jaxpr.eqns)
    part = _equation_parts(eqns, set(jaxpr.invars[n_state:n_state + n_batch]))
    if "gradient" not in part or not (evaluation or any(autodiff_phase(e) == "backward"
                                                        for e in eqns)):
        raise PipelineError(format_error(
            "The train step has no backward pass to cut into microbatches.",
            where=f"train step {getattr(train_step, '__name__', train_step)!r}",
            remedy="compute the gradients inside the step with jax.value_and_grad / jax.grad "
                   "(or nnx.value_and_grad)"))
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    outs = [v for v in jaxpr.outvars if _is_var(v)]
    grad_idx = _with_state_inputs(eqns, producer, part,
                                  [i for i, p in enumerate(part) if p == "gradient"])
    update_seeds = [i for i, p in enumerate(part) if p == "update"]
    update_seeds += [producer[v] for v in outs if v in producer and part[producer[v]] == "state"]
    update_idx = _with_state_inputs(eqns, producer, part, update_seeds)
    in_gradient = {i for i in grad_idx if part[i] == "gradient"}
    cut: list[Any] = []
    for v in [v for i in update_idx for v in eqns[i].invars] + outs:
        if _is_var(v) and producer.get(v) in in_gradient and v not in cut:
            cut.append(v)
    info = jaxpr.debug_info
    names = tuple(info.arg_names or ()) or tuple(f"arg{i}" for i in range(len(jaxpr.invars)))
    cut_names = tuple(f"cut[{i}]" for i in range(len(cut)))
    gradient = jcore.Jaxpr(
        jaxpr.constvars, jaxpr.invars[:n_state + n_batch], cut, [eqns[i] for i in grad_idx],
        debug_info=info._replace(arg_names=names[:n_state + n_batch], result_paths=cut_names))
    update = jcore.Jaxpr(
        jaxpr.constvars, [*jaxpr.invars[:n_state], *cut], jaxpr.outvars,
        [eqns[i] for i in update_idx],
        debug_info=info._replace(arg_names=names[:n_state] + cut_names))
    return StepSplit(jcore.ClosedJaxpr(gradient, closed.consts),
                     jcore.ClosedJaxpr(update, closed.consts),
                     tuple(v.aval for v in cut), out_tree,
                     tuple(autodiff_phase(eqns[producer[v]]) == "backward" for v in cut),
                     len(grad_idx), len(update_idx), tuple(grad_idx))


def _equation_parts(eqns: Sequence[Any], batch_dep: set[Any]) -> list[str]:
    """Per equation, its part: gradient, update or state (``batch_dep`` gains batch values)."""
    update_dep: set[Any] = set()
    part: list[str] = []
    for e in eqns:
        ins = [v for v in e.invars if _is_var(v)]
        phase = autodiff_phase(e)
        reads_batch = any(v in batch_dep for v in ins)
        if phase is not None:
            where = "gradient"
        elif any(v in update_dep for v in ins):
            where = "update"
        elif reads_batch:
            where = "gradient"
        else:
            where = "state"
        if phase == "backward" or where == "update":
            update_dep.update(e.outvars)
        if phase is not None or reads_batch:
            batch_dep.update(e.outvars)
        part.append(where)
    return part


def _with_state_inputs(eqns: Sequence[Any], producer: Mapping[Any, int], part: Sequence[str],
                       seeds: Sequence[int]) -> list[int]:
    """``seeds`` and the state-only equations they read, transitively, in order."""
    keep, todo = set(seeds), list(seeds)
    while todo:
        for v in eqns[todo.pop()].invars:
            j = producer.get(v) if _is_var(v) else None
            if j is not None and part[j] == "state" and j not in keep:
                keep.add(j)
                todo.append(j)
    return sorted(keep)


def _describe_cut(split: StepSplit, i: int) -> str:
    """``cut value 1 (f32[]), returned as metrics/worst, computed at step.py:12 (step)``: the
    cut value, the step outputs that return it unchanged, and its source line."""
    from jax._src import source_info_util

    text = f"cut value {i} ({split.cut_avals[i]})"
    update = split.update.jaxpr
    cut_in = update.invars[len(update.invars) - len(split.cut_avals) + i]
    paths = jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_unflatten(split.out_tree, range(split.out_tree.num_leaves)))[0]
    names = []
    for (path, _), var in zip(paths, update.outvars, strict=True):
        if var is cut_in:
            key = jax.tree_util.keystr(path, simple=True, separator="/")
            head, _, rest = key.partition("/")
            names.append(f"{ {'0': 'state', '1': 'metrics'}.get(head, head)}/{rest}"
                         if rest else key)
    if names:
        text += ", returned as " + ", ".join(names)
    var = split.gradient.jaxpr.outvars[i]
    eqn = next((e for e in split.gradient.jaxpr.eqns if var in e.outvars), None)
    if eqn is not None:
        text += f", computed at {source_info_util.summarize(eqn.source_info)}"
    return text


def _norm(xs: Sequence[np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.sum(x * x)) for x in xs)))


def reduction_kinds(train_step: Callable[..., Any], state: Any, first: Any, second: Any,
                    split: StepSplit, /, *, accumulation: str = "exact",
                    gradient: Callable[..., Any] | None = None) -> tuple[Reduction, ...]:
    """Whether each cut value accumulates as a mean or a sum over microbatches, measured on two
    microbatches (concrete arrays of ``split``'s shapes; the module docstring).

    Under ``accumulation="per_microbatch"`` (gradient accumulation: each microbatch draws its
    own random numbers and computes its own batch statistics, so the pair's value is not the
    microbatches' mean or sum) each value takes the nearer of the two, and is refused only
    where it is nearer neither (off both by more than their distance).

    ``gradient`` is ``split.gradient`` compiled, where the caller has it (default: compiled
    here).

    Raises:
      PipelineError: a cut value is neither a mean nor a sum over the batch.
    """
    pair = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), first, second)
    both = _split(train_step, state, pair)
    if [(a.shape, a.dtype) for a in both.cut_avals] != [
            (a.shape, a.dtype) for a in split.cut_avals]:
        raise PipelineError(format_error(
            "The train step's gradient part changes shape with the batch size, so it cannot be "
            "accumulated over microbatches.",
            where="cut values " + ", ".join(str(a) for a in split.cut_avals),
            remedy="return gradients and metrics whose shapes do not depend on the batch size"))
    leaves = jax.tree.leaves(state)
    # compiled, not run op by op: one program per batch size instead of a dispatch (and a
    # compilation) per equation
    run = gradient or jax.jit(jcore.jaxpr_as_fun(split.gradient))
    f1 = [np.asarray(x, np.float64) for x in run(*leaves, *jax.tree.leaves(first))]
    f2 = [np.asarray(x, np.float64) for x in run(*leaves, *jax.tree.leaves(second))]
    f12 = [np.asarray(x, np.float64)
           for x in jax.jit(jcore.jaxpr_as_fun(both.gradient))(*leaves,
                                                                *jax.tree.leaves(pair))]
    groups = [[i for i, b in enumerate(split.cut_backward) if b]]
    groups += [[i] for i, b in enumerate(split.cut_backward) if not b]
    kinds: list[Reduction] = ["mean"] * len(f1)
    for group in groups:
        if not group:
            continue
        separation = _norm([(f1[i] + f2[i]) / 2 for i in group])  # |sum - mean|
        mean_err = _norm([f12[i] - (f1[i] + f2[i]) / 2 for i in group])
        sum_err = _norm([f12[i] - (f1[i] + f2[i]) for i in group])
        rtol = MEAN_SUM_RTOL if accumulation == "exact" else 1.0
        if separation == 0.0 or (mean_err <= rtol * separation and (
                accumulation == "exact" or mean_err <= sum_err)):
            continue
        if sum_err <= rtol * separation:
            for i in group:
                kinds[i] = "sum"
            continue
        what = ("the gradients" if split.cut_backward[group[0]]
                else _describe_cut(split, group[0]))
        raise PipelineError(format_error(
            "A value the train step hands from its gradient computation to its update (or "
            "returns) is neither a mean nor a sum over the batch, so it cannot be accumulated "
            "over microbatches exactly.",
            where=f"{what}: off a mean by {mean_err:.3g}, off a sum by {sum_err:.3g} "
                  f"(norm of the value {separation:.3g})",
            remedy="compute it as a mean or a sum over the batch (a maximum or a per-example "
                   "statistic cannot be split into microbatches), or plan it with one "
                   "microbatch per replica (PlanConfig.microbatch_sizes=(batch size,))"))
    return tuple(kinds)


ACCUMULATIONS = ("exact", "per_microbatch")
"""The accumulation semantics a plan may ask for (``PlanConfig.accumulation``): ``"exact"``, a
microbatched step equals the whole-batch step (up to float rounding); ``"per_microbatch"``,
gradient accumulation: each microbatch draws random numbers with its own key (the step's key
folded with the index of the microbatch's first sample) and computes its own batch
statistics."""


class AccumulationForm:
    """The train step rewritten to be cut into microbatches (the module docstring of
    :mod:`shardplan.trace.batch`): it takes ``(batch, context)`` where it took ``batch``; the
    context (:meth:`context`) holds, per sample, its index in the step's batch and the whole
    batch's *normalisers* (sums over the batch that scale each sample's share, such as the
    token count of a padded-token loss). In the rewritten step each normaliser is the whole
    batch's, so every microbatch's loss and gradients are its share of the batch's and add up
    to them exactly; under ``"per_microbatch"`` accumulation each random draw over the batch
    uses the step's key folded with the index of the microbatch's first sample.

    Attributes:
      step: ``(state, (batch, context)) -> outputs``.
      use: what the analysis found.
    """

    def __init__(self, train_step: Callable[..., Any], use: BatchUse, *, fold: bool) -> None:
        self._user = train_step
        self.use = use
        self._folds = frozenset(f.top for f in use.random) if fold else frozenset()
        self._totals: Callable[..., Any] | None = None
        self._totals_for: Any = None

    def batch_specs(self, specs: Mapping[str, Any]) -> dict[str, Any]:
        """A plan's batch specs for ``(batch, context)``: the context split like the batch's
        samples."""
        lead = next((spec[0] for spec in specs.values() if len(spec)), ())
        out = {(f"0/{k}" if k else "0"): spec for k, spec in specs.items()}
        out["1/0"] = (lead,)
        for k, shape in enumerate(self.use.normaliser_shapes, start=1):
            out[f"1/{k}"] = (lead,) + ((),) * len(shape)
        return out

    def context(self, state: Any, batch: Any) -> tuple[Any, ...]:
        """Per sample of ``batch`` (the step's whole batch): its index, and each normaliser of
        the whole batch (host arrays)."""
        size = int(np.shape(jax.tree.leaves(batch)[0])[0])
        index = np.arange(size, dtype=np.int32)
        if not self.use.normalisers:
            return (index,)
        key = jax.tree.structure(batch), tuple((np.shape(x), str(jax.typeof(x).dtype))
                                               for x in jax.tree.leaves(batch))
        if self._totals is None or self._totals_for != key:
            self._totals, self._totals_for = self._normaliser_program(state, batch), key
        totals = self._totals(*jax.tree.leaves(batch))
        return (index, *(np.broadcast_to(np.asarray(t), (size, *np.shape(t)))
                         for t in totals))

    def _normaliser_program(self, state: Any, batch: Any) -> Callable[..., Any]:
        """The step's equations that compute its normalisers, from the batch alone, jitted."""
        closed = jax.make_jaxpr(self._user)(jax.tree.map(_bare, state),
                                            jax.tree.map(_bare, batch))
        jaxpr, n_state = closed.jaxpr, len(jax.tree.leaves(state))
        producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
        wanted = [v for i in self.use.normalisers for v in jaxpr.eqns[i].outvars]
        keep, todo = set(self.use.normalisers), list(self.use.normalisers)
        while todo:
            for v in jaxpr.eqns[todo.pop()].invars:
                j = producer.get(v) if _is_var(v) else None
                if j is not None and j not in keep:
                    keep.add(j)
                    todo.append(j)
        state_vars = set(jaxpr.invars[:n_state])
        assert not any(v in state_vars for i in keep for v in jaxpr.eqns[i].invars), (
            "a normaliser reads the state")
        info = jaxpr.debug_info
        names = tuple(info.arg_names or ()) or tuple(f"arg{i}" for i in range(len(jaxpr.invars)))
        program = jcore.Jaxpr(
            jaxpr.constvars, jaxpr.invars[n_state:], wanted, [jaxpr.eqns[i] for i in sorted(keep)],
            debug_info=info._replace(arg_names=names[n_state:], result_paths=tuple(
                f"normaliser[{k}]" for k in range(len(wanted)))))
        return jax.jit(jcore.jaxpr_as_fun(jcore.ClosedJaxpr(program, closed.consts)))

    def step(self, state: Any, batched: tuple[Any, tuple[Any, ...]]) -> Any:
        """The rewritten step (the class docstring), traced at the call's shapes."""
        batch, context = batched
        closed, out_shape = jax.make_jaxpr(self._user, return_shape=True)(
            jax.tree.map(_bare, state), jax.tree.map(_bare, batch))
        jaxpr = closed.jaxpr
        replace = {}
        for k, i in enumerate(self.use.normalisers, start=1):
            (var,) = jaxpr.eqns[i].outvars
            replace[i] = [context[k][0].astype(var.aval.dtype)]
        outs = _evaluate(jaxpr, closed.consts, [*jax.tree.leaves(state),
                                                *jax.tree.leaves(batch)],
                         replace, self._folds, context[0][0])
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _bare(x: Any) -> Any:
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
              replace: Mapping[int, list[Any]], folds: frozenset[int], index: Any) -> list[Any]:
    """``jaxpr`` evaluated (as ``jax.core.eval_jaxpr``, each equation under its own name stack
    and source line, so the autodiff phases read as before), with the results of the
    equations in ``replace`` given, and the keys read by the equations in ``folds`` folded
    with ``index``."""
    from jax._src import source_info_util

    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for i, eqn in enumerate(jaxpr.eqns):
        if i in replace:
            env.update(zip(eqn.outvars, replace[i], strict=True))
            continue
        values = [read(v) for v in eqn.invars]
        if i in folds:
            if not any(is_prng_key(jax.typeof(x).dtype) for x in values):
                raise PipelineError(format_error(
                    "A random draw over the batch takes no typed key array from the step, so "
                    "it cannot be folded with the microbatch's index.",
                    where=source_info_util.summarize(eqn.source_info),
                    remedy="draw with a typed key (jax.random.key, nnx.Rngs) passed in the "
                           "state, or wrap a raw key with jax.random.wrap_key_data outside "
                           "any jit or scan of the step"))
            values = [jax.random.fold_in(x, index) if is_prng_key(jax.typeof(x).dtype) else x for x in values]
        bound = eqn.primitive.get_bind_params(eqn.params)
        subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
              eqn.ctx.manager):
            out = eqn.primitive.bind(*subfuns, *values, **params)
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out],
                       strict=True))
    return [read(v) for v in jaxpr.outvars]


def accumulation_form(train_step: Callable[..., Any], state: Any, batch: Any, /, *,
                      accumulation: str, microbatches: int,
                      what: str) -> AccumulationForm | None:
    """The form ``train_step`` runs in when cut into ``microbatches`` (over all replicas) of
    ``batch``'s shapes (one microbatch), or ``None`` where the step runs as written.

    Raises:
      PipelineError: the step cannot be cut under ``accumulation`` (random draws or batch
        statistics under ``"exact"``): :meth:`BatchUse.refusal_error`.
    """
    if microbatches == 1:
        return None
    use = batch_use(train_step, state, batch)
    if use.refusal(accumulation) is not None:
        raise use.refusal_error(accumulation, what=what)
    fold = accumulation == "per_microbatch" and bool(use.random)
    if not use.normalisers and not fold:
        return None
    return AccumulationForm(train_step, use, fold=fold)


def split_batch(batch: Any, microbatches: int, /, *, size: int | None = None) -> list[Any]:
    """``batch`` cut along its leading dimension into ``microbatches`` equal microbatches (of
    ``size`` samples each, when given).

    Raises:
      ConfigError: the leaves' leading dimensions differ, or do not split so.
    """
    sizes = sorted({int(np.shape(x)[0]) if np.ndim(x) else -1 for x in jax.tree.leaves(batch)})
    each = sizes[0] // microbatches if len(sizes) == 1 and sizes[0] > 0 else 0
    if not each or sizes[0] % microbatches or (size is not None and each != size):
        want = f" of {size} samples" if size is not None else ""
        raise ConfigError(format_error(
            f"The batch does not split into {microbatches} equal microbatches{want}.",
            where="batch leading dimensions (-1: a scalar leaf)", value=sizes,
            remedy="pass one batch size on every leaf: the microbatch count times the "
                   "microbatch size (the batch the plan was made for)"))
    return [jax.tree.map(lambda x, j=j: x[j * each:(j + 1) * each], batch)
            for j in range(microbatches)]


def microbatched(train_step: Callable[..., Any], /, *, microbatches: int,
                 accumulation: str = "exact") -> Callable[[Any, Any], Any]:
    """``train_step`` run as ``microbatches`` equal microbatches: the gradient part once per
    microbatch (one compiled program), the cut values accumulated as each is a mean or a sum,
    the update once, in the form :func:`accumulation_form` gives it under ``accumulation``.
    Under ``"exact"`` the result equals the step on the whole batch up to float rounding;
    under ``"per_microbatch"`` it is gradient accumulation (the reference a pipelined plan of
    that accumulation equals).

    The split and the reductions are computed on the first call per state and batch shapes.

    Raises:
      ConfigError: ``microbatches`` is not a positive integer, or does not divide the batch.
      PipelineError: the step cannot be cut (see :func:`split_step`, :func:`reduction_kinds`,
        :func:`accumulation_form`).
    """
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(format_error(
            "microbatches must be a positive integer.", where="microbatched(microbatches=...)",
            value=microbatches, remedy="pass 1 or more"))
    compiled: dict[Any, tuple[AccumulationForm | None, StepSplit, tuple[Reduction, ...], Any,
                              Any]] = {}

    def run(state: Any, batch: Any) -> Any:
        parts = split_batch(batch, microbatches)
        key = (jax.tree.structure((state, batch)),
               tuple((np.shape(x), str(jax.typeof(x).dtype))
                     for x in jax.tree.leaves((state, batch))))
        form = (compiled[key][0] if key in compiled else accumulation_form(
            train_step, state, parts[0], accumulation=accumulation, microbatches=microbatches,
            what=f"microbatched(microbatches={microbatches})"))
        if form is not None:  # the batch with each sample's index and normalisers
            parts = split_batch((batch, form.context(state, batch)), microbatches)
        if key not in compiled:
            step = form.step if form is not None else train_step
            split = split_step(step, state, parts[0])
            grad = jax.jit(jcore.jaxpr_as_fun(split.gradient))
            kinds: tuple[Reduction, ...] = (
                reduction_kinds(step, state, parts[0], parts[1], split,
                                accumulation=accumulation, gradient=grad)
                if microbatches > 1 else tuple("mean" for _ in split.cut_avals))
            compiled[key] = (form, split, kinds, grad, jax.jit(jcore.jaxpr_as_fun(split.update)))
        _, split, kinds, gradient, update = compiled[key]
        leaves = jax.tree.leaves(state)
        total: list[Any] | None = None
        for mb in parts:
            values = gradient(*leaves, *jax.tree.leaves(mb))
            total = list(values) if total is None else [t + v for t, v in
                                                        zip(total, values, strict=True)]
        assert total is not None
        cut = [(t / microbatches).astype(a.dtype) if k == "mean" else t
               for t, k, a in zip(total, kinds, split.cut_avals, strict=True)]
        return jax.tree.unflatten(split.out_tree, update(*leaves, *cut))

    return run
