"""Pinning a plan's shardings on intermediate values of an unmodified train step.

The planner decides the sharding of every op, but a jitted step only takes shardings for its
arguments and results; the partitioner propagates the rest and may choose differently where
the choice is open (which operand of a matmul to gather, where to reduce). :func:`constrained`
re-evaluates the traced step's jaxpr equation by equation (``jax.jit(step).trace(...)``, the
same program the planner traced) and applies ``jax.lax.with_sharding_constraint`` to the
results of the equations the plan lists, so the compiled program does what the plan predicts.

Equations are addressed by their path (:attr:`shardplan.trace.Op.path`): the index among the
top-level equations, then among the equations of each call (``jit``, custom derivative rule)
they sit in. A call that holds a constrained equation is evaluated inline (a nested ``jit`` is
inlined by XLA anyway; a custom derivative rule's primal computation is what it computes, and
the step is already differentiated), and so is a ``scan`` that does (as a scan over the
evaluated body, :func:`_scan`); every other equation is bound as it is, ``while`` and ``cond``
bodies included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.extend import core as jex_core
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.errors import RuntimeFailure, format_error
from shardplan.kernels.registry import PREFIX as KERNEL_PREFIX
from shardplan.kernels.registry import recorded
from shardplan.plan.plan import Spec
from shardplan.runtime.rows import bind
from shardplan.trace.flatten import call_like_jaxpr

__all__ = ["Pins", "constrained", "parse_path", "partition_spec", "run_pinned"]


def partition_spec(spec: Spec) -> P:
    """A plan spec (per dimension, a tuple of mesh axes) as a ``PartitionSpec``."""
    return P(*[None if not axes else axes[0] if len(axes) == 1 else axes for axes in spec])


def parse_path(key: str) -> tuple[int, ...]:
    """``"12/3"`` -> ``(12, 3)``."""
    return tuple(int(p) for p in key.split("/"))


def constrained(fn: Callable[..., Any], args: Sequence[Any],
                constraints: Mapping[tuple[int, ...], tuple[tuple[Spec, ...], tuple[Spec, ...]]],
                mesh: Mesh) -> Callable[..., Any]:
    """``fn`` with the given equation results pinned to the given shardings.

    Args:
      fn: the step; traced once here on the shapes and dtypes of ``args``.
      args: example positional arguments (only their structure, shapes and dtypes matter).
      constraints: ``{equation path: (spec of each result, spec of each non-literal
        operand)}``.
      mesh: the mesh the specs name axes of.

    Returns:
      A function of the same arguments and results, meant to be jitted.
    """
    # Shapes and dtypes only: tracing committed, sharded arrays adds ``reshard`` equations the
    # planner's trace (of abstract arguments) does not have, which would shift the paths.
    abstract = jax.tree.map(_abstract_leaf, args)
    traced = jax.jit(fn).trace(*abstract)
    closed = traced.jaxpr
    out_tree = jax.tree.structure(traced.out_info)
    pins = Pins.of(constraints, mesh)

    def run(*call_args: Any) -> Any:
        flat = jax.tree.leaves(call_args)
        outs = _evaluate(closed.jaxpr, closed.consts, flat, (), pins)
        return jax.tree.unflatten(out_tree, outs)

    return run


_Pinned = tuple[tuple[NamedSharding, ...], tuple[NamedSharding, ...]]


@dataclasses.dataclass(frozen=True)
class Pins:
    """Shardings to pin, by equation path, on one mesh.

    Attributes:
      shardings: ``{equation path: (sharding of each result, of each non-literal operand)}``.
      inlined: the paths of the calls and ``scan`` s that hold a pinned equation (evaluated
        equation by equation rather than bound whole).
    """

    shardings: Mapping[tuple[int, ...], _Pinned]
    inlined: frozenset[tuple[int, ...]]

    @classmethod
    def of(cls, constraints: Mapping[tuple[int, ...], tuple[tuple[Spec, ...], tuple[Spec, ...]]],
           mesh: Mesh) -> Pins:
        """The pins of ``{path: (result specs, operand specs)}`` on ``mesh``."""
        def named(specs: tuple[Spec, ...]) -> tuple[NamedSharding, ...]:
            return tuple(NamedSharding(mesh, partition_spec(s)) for s in specs)

        return cls({path: (named(results), named(operands))
                    for path, (results, operands) in constraints.items()},
                   frozenset(path[:k] for path in constraints for k in range(1, len(path))))

    def touch(self, path: tuple[int, ...]) -> bool:
        """Whether the equation at ``path`` is pinned or holds pinned equations."""
        return path in self.shardings or path in self.inlined


def run_pinned(eqn: Any, values: Sequence[Any], path: tuple[int, ...], pins: Pins,
               params: Mapping[str, Any] | None = None) -> list[Any]:
    """The results of the step's equation at ``path`` on ``values``, with its pins (a kernel
    call run split; a call or scan holding pinned equations evaluated with theirs).
    ``params``: the equation's parameters to use instead of its own (a scan cut to fewer
    rows)."""
    return _equation(eqn, list(values), path, pins, _is_literal, params)


def _literal_in(eqn: Any) -> bool:
    """Whether an operand of ``eqn`` is a literal."""
    return any(isinstance(v, jex_core.Literal) for v in eqn.invars)


def _split_kernel(name: str, eqn: Any, values: Sequence[Any],
                  pinned: tuple[tuple[NamedSharding, ...], tuple[NamedSharding, ...]]
                  ) -> list[Any]:
    """A shardplan kernel's call run on every device's blocks (``shard_map`` with the plan's
    specs: XLA never partitions the kernel), re-traced at the local shapes from the call the
    kernel recorded; results the plan keeps whole over axes an operand is split on (a
    contracted dimension) are summed over those axes."""
    call = recorded(name, [v.aval for v in eqn.invars])
    if call is None:
        raise RuntimeFailure(format_error(
            "A kernel the plan splits was not called through shardplan.kernels.registry.call, "
            "or was called on these shapes with other static options (a causal and a "
            "non-causal attention of one shape), so it cannot be run again per device.",
            where=f"kernel {name}", value=[str(v.aval) for v in eqn.invars],
            remedy="call kernel functions through shardplan.kernels.registry.call, and give "
                   "kernels of one shape one set of options"))
    results, operands = pinned
    mesh = (results or operands)[0].mesh
    in_specs = tuple(s.spec for s in operands)
    out_specs = tuple(s.spec for s in results)

    def axes(spec: P) -> set[str]:
        out: set[str] = set()
        for entry in spec:
            out.update((entry,) if isinstance(entry, str) else entry or ())
        return out

    split = set().union(*(axes(s) for s in in_specs)) if in_specs else set()
    summed = [tuple(sorted(split - axes(s))) for s in out_specs]

    def body(*xs: Any) -> tuple[Any, ...]:
        outs = call.fn(*jax.tree.unflatten(call.treedef, xs), **call.static)
        outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
        return tuple(jax.lax.psum(o, a) if a else o for o, a in zip(outs, summed, strict=True))

    run = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                        check_vma=False)
    return list(run(*values))


def _abstract_leaf(x: Any) -> jax.ShapeDtypeStruct:
    """``x``'s shape, dtype and weak type; Python scalars too (flax's ``TrainState.create``
    starts ``step`` at the int ``0``, which jax traces as a weakly typed ``int32[]``)."""
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _is_literal(v: Any) -> bool:
    return isinstance(v, jex_core.Literal)


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], prefix: tuple[int, ...],
              pins: Pins, literal_args: frozenset[int] = frozenset()) -> list[Any]:
    """Evaluates ``jaxpr``. ``literal_args``: positions of arguments that were literals where
    the call was made; the tracer left them out of its ops' operands, and so do the plan's
    operand specs, which are matched to the other operands in order."""
    env: dict[Any, Any] = {}
    literal_vars: set[Any] = set()

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    def is_literal(v: Any) -> bool:
        return isinstance(v, jex_core.Literal) or v in literal_vars

    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = c
    for k, (v, a) in enumerate(zip(jaxpr.invars, args, strict=True)):
        env[v] = a
        if k in literal_args:
            literal_vars.add(v)
    for i, eqn in enumerate(jaxpr.eqns):
        outs = _equation(eqn, [read(v) for v in eqn.invars], (*prefix, i), pins, is_literal)
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jex_core.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _equation(eqn: Any, values: list[Any], path: tuple[int, ...], pins: Pins,
              is_literal: Callable[[Any], bool],
              params: Mapping[str, Any] | None = None) -> list[Any]:
    """One equation's results, with its pins and those of the equations inside it."""
    pinned = pins.shardings.get(path)
    if pinned is not None:
        operands = iter(pinned[1])
        values = [v if is_literal(var) else jax.lax.with_sharding_constraint(v, next(operands))
                  for var, v in zip(eqn.invars, values, strict=True)]
    params = eqn.params if params is None else params
    name = eqn.primitive.name
    kernel = str(params.get("name", "")) if name in ("pjit", "jit") else ""
    inlined = path in pins.inlined
    literals = frozenset(k for k, v in enumerate(eqn.invars) if is_literal(v)) if inlined \
        else frozenset()
    inner = call_like_jaxpr(eqn) if inlined and name != "scan" else None
    if pinned is not None and kernel.startswith(KERNEL_PREFIX) and not _literal_in(eqn):
        outs = _split_kernel(kernel, eqn, values, pinned)
    elif inlined and name == "scan":
        outs = _scan(params, values, path, pins, literals)
    elif inner is not None:
        outs = _evaluate(inner[0], inner[1], values, path, pins, literals)
    else:
        with eqn.ctx.manager:
            outs = bind(eqn, values, params)
    if pinned is not None:
        outs = [jax.lax.with_sharding_constraint(o, s) for o, s in zip(outs, pinned[0],
                                                                      strict=True)]
    return outs


def _scan(params: Mapping[str, Any], values: Sequence[Any], path: tuple[int, ...], pins: Pins,
          literal_args: frozenset[int]) -> list[Any]:
    """A ``scan`` whose body holds pinned equations, run again as ``jax.lax.scan`` over the
    body evaluated with its pins (and its kernel calls split): same length, direction and
    unrolling, the loop-invariant operands closed over."""
    n_consts, n_carry = int(params["num_consts"]), int(params["num_carry"])
    body = params["jaxpr"]
    consts = list(values[:n_consts])

    def step(carry: list[Any], xs: list[Any]) -> tuple[list[Any], list[Any]]:
        outs = _evaluate(body.jaxpr, body.consts, [*consts, *carry, *xs], path, pins,
                         literal_args)
        return outs[:n_carry], outs[n_carry:]

    carry, ys = jax.lax.scan(step, list(values[n_consts:n_consts + n_carry]),
                             list(values[n_consts + n_carry:]), length=int(params["length"]),
                             reverse=bool(params["reverse"]), unroll=params["unroll"])
    return [*carry, *ys]
