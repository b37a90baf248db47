"""A scanned stack's stacked leaves held as per-stage rows.

An ``nnx.scan`` stack keeps each parameter of its blocks as one leaf whose leading axis is the
block (``(L, ...)``). When a pipeline cuts the stack over stages, each stage runs some *runs*
of consecutive rows (:func:`~shardplan.runtime.partition.gradient_programs` cuts the scans). So
that no stage holds, fetches or updates the rows of another, the pipeline keeps such a leaf as
one array per run (:class:`RowSplit`), and the parts of the step that read it are written over
the pieces:

* the gradient part's scans read their segment's piece directly (``partition._cut_scans``),
  and the stacked gradients come out as the backward segments produced them;
* the update part is rewritten by :func:`split_rows`: an elementwise equation (the optimizer's
  moments, the parameter step) runs once per piece, a reduction over the stacked axis (a global
  gradient norm's sum of squares) sums the pieces' partial results, and anything else reads
  the pieces joined (correct, only not sliced). A value broadcast along the stacked axis (a
  zero gradient instantiated at the leaf's shape) is broadcast again at each piece's shape
  where it meets pieces, so that it is made on the piece's stage instead of whole on one
  stage and sliced there (which would draw the other stages' pieces to it).

Between steps, :func:`assembled` shows the pieces as one ``jax.Array`` over the devices of
their stages (the leaf's sharding gains a leading ``rows`` mesh axis: each device holds its
stage's rows and nothing else) when that is a ``NamedSharding``: runs of equal length on
distinct stages whose sub-meshes and specs for the leaf are alike. A checkpoint then saves
and restores the leaf as any other sharded array.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["RowSplit", "Runs", "assembled", "bind", "expressible", "split_rows", "stacked_mesh"]

Runs = tuple[tuple[int, int], ...]
"""The row ranges ``[a, b)`` of a stacked leaf, in row order, that lie on one stage each."""

# Primitives that map operands of one shape to results of that shape element by element: an
# equation of one runs once per piece of its stacked operands.
_ELEMENTWISE = frozenset({
    "abs", "add", "add_any", "and", "ceil", "clamp", "convert_element_type", "copy", "copy_p",
    "cos", "div", "eq", "erf", "exp", "exp2", "expm1", "floor", "ge", "gt", "integer_pow",
    "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg",
    "nextafter", "not", "or", "pow", "reduce_precision", "rem", "round", "rsqrt", "select_n",
    "sign", "sin", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor"})
_REDUCERS: dict[str, Callable[[Any, Any], Any]] = {
    "reduce_sum": jax.lax.add, "reduce_max": jax.lax.max, "reduce_min": jax.lax.min}
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
          "custom_vjp_call_jaxpr": "fun_jaxpr"}


@dataclass(frozen=True)
class RowSplit:
    """Which of ``count`` leaves are held as pieces (``runs``: leaf -> its runs, two or
    more); the *internal* leaves list every other leaf as it is and a split one as its pieces
    in row order, in the leaves' order."""

    count: int
    runs: Mapping[int, Runs]

    @functools.cached_property
    def internal(self) -> list[tuple[int, tuple[int, int] | None]]:
        """Per internal leaf, its leaf and rows (``None``: the whole leaf)."""
        return [(j, r) for j in range(self.count) for r in self.runs.get(j, (None,))]

    def index(self, j: int, rows: tuple[int, int] | None = None) -> int:
        """The internal index of leaf ``j`` (of its piece ``rows``)."""
        return self.internal.index((j, rows))

    def avals(self, avals: Sequence[Any]) -> list[Any]:
        """The internal leaves' avals, from the leaves'."""
        return [avals[j] if r is None else avals[j].update(shape=(r[1] - r[0],
                                                                 *avals[j].shape[1:]))
                for j, r in self.internal]


@dataclass(frozen=True)
class _Rows:
    """A stacked value as pieces (tracing :func:`split_rows`)."""

    parts: tuple[Any, ...]
    runs: Runs


@dataclass(frozen=True)
class _Broadcast:
    """``broadcast_in_dim(value, shape, dims)`` not made yet (tracing :func:`split_rows`): a
    value whose stacked axis 0 is a broadcast one (not in ``dims``)."""

    value: Any
    shape: tuple[int, ...]
    dims: tuple[int, ...]

    def made(self, rows: int | None = None) -> Any:
        shape = self.shape if rows is None else (rows, *self.shape[1:])
        return jax.lax.broadcast_in_dim(self.value, shape, self.dims)


def _join(x: Any) -> Any:
    if isinstance(x, _Broadcast):
        return x.made()
    if not isinstance(x, _Rows):
        return x
    return x.parts[0] if len(x.parts) == 1 else jax.lax.concatenate(list(x.parts), 0)


def _cut(x: Any, runs: Runs) -> _Rows:
    if isinstance(x, _Broadcast):
        return _Rows(tuple(x.made(b - a) for a, b in runs), runs)
    return _Rows(tuple(jax.lax.slice_in_dim(x, a, b, axis=0) for a, b in runs), runs)


def _broadcast(eqn: Any, values: list[Any]) -> _Broadcast | None:
    """``eqn`` kept as a :class:`_Broadcast` where it is one (a ``broadcast_in_dim`` adding
    the leading axis) or is elementwise over such values of one shape and dimensions, and
    scalars (then it applies to the values before their broadcast, which computes the same
    numbers)."""
    name = eqn.primitive.name
    if name == "broadcast_in_dim" and len(values) == 1 and not isinstance(values[0], _Rows):
        dims = tuple(eqn.params["broadcast_dimensions"])
        shape = tuple(eqn.params["shape"])
        if len(shape) > 1 and shape[0] > 1 and 0 not in dims:
            return _Broadcast(_join(values[0]), shape, dims)
        return None
    lazy = [x for x in values if isinstance(x, _Broadcast)]
    if (name not in _ELEMENTWISE or not lazy or eqn.primitive.multiple_results
            or any(isinstance(x, _Rows) for x in values)):
        return None
    first = lazy[0]
    if not all(x.shape == first.shape and x.dims == first.dims
               and np.shape(x.value) == np.shape(first.value) for x in lazy):
        return None
    if not all(isinstance(x, _Broadcast) or np.ndim(x) == 0 for x in values):
        return None
    inner = [x.value if isinstance(x, _Broadcast) else x for x in values]
    foldable = all(np.ndim(x) == 0 for x in inner) and _known(eqn, inner)
    (out,) = _folded(eqn, inner) if foldable else bind(eqn, inner)
    return _Broadcast(out, first.shape, first.dims)


def _known(eqn: Any, values: Sequence[Any]) -> bool:
    """Whether ``eqn`` over ``values`` can be computed while tracing: no effects, and every
    value known (literals, constants, what was computed from them alone)."""
    return not eqn.effects and not any(isinstance(x, jax.core.Tracer | _Rows | _Broadcast)
                                       for x in values)


def _folded(eqn: Any, values: Sequence[Any]) -> list[Any]:
    """``eqn`` computed while tracing (``_known``): its results are constants of every
    program, not values of one stage that the others' equations would wait for."""
    with jax.ensure_compile_time_eval():
        return bind(eqn, values)


def bind(eqn: Any, values: Sequence[Any], params: Mapping[str, Any] | None = None) -> list[Any]:
    """``eqn``'s primitive applied to ``values`` (with ``params``, default the equation's):
    its results as a list."""
    bind_params = eqn.primitive.get_bind_params(dict(eqn.params if params is None else params))
    subfuns: Sequence[Any] = ()
    if isinstance(bind_params, tuple):  # (sub-functions, params) before jax 0.9
        subfuns, bind_params = bind_params
    out = eqn.primitive.bind(*subfuns, *values, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _apply(eqn: Any, values: list[Any]) -> list[Any]:
    """One equation over values some of which are pieces."""
    name = eqn.primitive.name
    lazy = _broadcast(eqn, values)
    if lazy is not None:
        return [lazy]
    split = [x for x in values if isinstance(x, _Rows)]
    if not split:
        return bind(eqn, [_join(x) for x in values])
    runs = split[0].runs
    rows = sum(b - a for a, b in runs)
    if name in _CALLS and isinstance(eqn.params.get(_CALLS[name]), jcore.ClosedJaxpr):
        inner = eqn.params[_CALLS[name]]
        return _evaluate(inner.jaxpr, inner.consts, values)
    alike = all(x.runs == runs for x in split)
    if name in _ELEMENTWISE and alike:
        shape = eqn.outvars[0].aval.shape
        if shape and shape[0] == rows and all(
                isinstance(x, _Rows | _Broadcast) or np.ndim(x) == 0
                or tuple(np.shape(x)) == shape for x in values):
            values = [x if isinstance(x, _Rows) or (not isinstance(x, _Broadcast)
                                                     and np.ndim(x) == 0) else _cut(x, runs)
                      for x in values]
            parts = [bind(eqn, [x.parts[k] if isinstance(x, _Rows) else x for x in values])
                     for k in range(len(runs))]
            return [_Rows(tuple(p[n] for p in parts), runs) for n in range(len(eqn.outvars))]
    if name in _REDUCERS and len(values) == 1:
        (x,) = values
        parts = [bind(eqn, [p])[0] for p in x.parts]
        if 0 not in eqn.params["axes"]:
            return [_Rows(tuple(parts), runs)]
        total = parts[0]
        for p in parts[1:]:
            total = _REDUCERS[name](total, p)
        return [total]
    return bind(eqn, [_join(x) for x in values])


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        scalars = all(v.aval.shape == () for v in eqn.outvars)
        outs = _folded(eqn, values) if scalars and _known(eqn, values) else _apply(eqn, values)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def split_rows(closed: jcore.ClosedJaxpr, in_runs: Sequence[Runs | None],
               out_runs: Sequence[Runs | None]) -> jcore.ClosedJaxpr:
    """``closed`` rewritten over pieces: each input with runs is replaced by one input per
    run (its rows), each output with runs by one output per run (the module docstring).

    The result computes the same values: an elementwise equation per piece exactly, a
    reduction over the stacked axis as the reduction of the pieces' partial results."""
    avals: list[Any] = []
    for v, runs in zip(closed.jaxpr.invars, in_runs, strict=True):
        a = v.aval
        avals += [a] if runs is None else [a.update(shape=(r1 - r0, *a.shape[1:]))
                                           for r0, r1 in runs]

    def run(*flat: Any) -> list[Any]:
        it = iter(flat)
        args = [next(it) if runs is None else _Rows(tuple(next(it) for _ in runs), runs)
                for runs in in_runs]
        out: list[Any] = []
        for x, runs in zip(_evaluate(closed.jaxpr, closed.consts, args), out_runs,
                           strict=True):
            if runs is None:
                out.append(_join(x))
            else:
                if not (isinstance(x, _Rows) and x.runs == runs):
                    x = _cut(x if isinstance(x, _Broadcast) else _join(x), runs)
                out += x.parts
        return out

    return jax.make_jaxpr(run)(*(jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                      weak_type=getattr(a, "weak_type", False))
                                 for a in avals))


def _normal(spec: P, mesh: Any, rank: int) -> tuple[Any, ...]:
    """``spec`` padded to ``rank`` with mesh axes of size 1 dropped (they split nothing)."""
    out = []
    for entry in (*tuple(spec), *(None,) * (rank - len(tuple(spec)))):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(n for n in names if mesh.shape[n] > 1)
        out.append(kept[0] if len(kept) == 1 else kept or None)
    return tuple(out)


def expressible(shardings: Sequence[Any], runs: Runs, rank: int) -> bool:
    """Whether pieces of ``runs`` with these shardings (one per run) form one array over
    their devices (:func:`assembled`): runs of one length on distinct devices, sub-meshes of
    one shape and axis names, one spec for the leaf that does not split its rows."""
    if len({b - a for a, b in runs}) != 1 or not all(
            isinstance(s, NamedSharding) for s in shardings):
        return False
    meshes = [s.mesh for s in shardings]
    first = meshes[0]
    devices = [d for m in meshes for d in m.devices.flat]
    specs = {_normal(s.spec, s.mesh, rank) for s in shardings}
    return (len(specs) == 1 and len(set(devices)) == len(devices)
            and "rows" not in first.axis_names and next(iter(specs))[0] is None
            and all(m.axis_names == first.axis_names and m.devices.shape == first.devices.shape
                    for m in meshes))


def stacked_mesh(meshes: Sequence[Mesh], axis: str) -> Mesh:
    """Alike meshes (one shape, one set of axis names) as one, a new leading ``axis`` (Auto)
    with one entry per mesh: the stages of a stacked leaf's rows (:func:`assembled`), the
    members of a merged replica (:func:`shardplan.runtime.spmd.runtime_meshes`)."""
    first = meshes[0]
    types = tuple(getattr(first, "axis_types", None)
                  or (jax.sharding.AxisType.Auto,) * len(first.axis_names))
    return Mesh(np.stack([m.devices for m in meshes]), (axis, *first.axis_names),
                axis_types=(jax.sharding.AxisType.Auto, *types))


def assembled(shape: Sequence[int], parts: Sequence[jax.Array]) -> jax.Array | None:
    """The pieces of a stacked leaf (in row order, each on its stage's sub-mesh) as one
    ``jax.Array`` over their devices, without copying; ``None`` where no ``NamedSharding``
    describes them (:func:`expressible`)."""
    runs = tuple((0, x.shape[0]) for x in parts)
    if not expressible([x.sharding for x in parts], runs, len(shape)):
        return None
    shardings = [cast(NamedSharding, x.sharding) for x in parts]
    spec = _normal(shardings[0].spec, shardings[0].mesh, len(shape))
    mesh = stacked_mesh([cast(Mesh, s.mesh) for s in shardings], "rows")
    sharding = NamedSharding(mesh, P("rows", *spec[1:]))
    shards = [shard.data for x in parts for shard in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, shards)
