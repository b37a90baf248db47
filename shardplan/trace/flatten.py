"""Flattens a closed jaxpr into a list of ops with execution counts.

Nested jaxprs are inlined: call-like primitives (``jit``, ``closed_call``, ``remat``,
``custom_jvp_call``, ``custom_vjp_call`` ...) by mapping their operands onto the inner inputs;
``scan`` and ``while`` by walking the body once with the execution count multiplied by the trip
count; ``cond`` by walking its most expensive branch; ``shard_map`` by walking the per-shard body
once per shard. Loop inputs that are sliced per iteration (a scan's ``xs``) and outputs that are
stacked (``ys``) get zero-cost *structural* ops, so the data flow from a stacked parameter into
the loop body stays visible.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend import core as jcore
from jax.extend import source_info_util

from shardplan.kernels.registry import PREFIX as KERNEL_PREFIX
from shardplan.kernels.registry import PRIMITIVE as KERNEL
from shardplan.kernels.registry import recorded, rule_for
from shardplan.trace.flops import (
    ELEMENTWISE,
    TRANSCENDENTAL,
    equation_cost,
    is_known_primitive,
)

__all__ = ["FlatGraph", "RawOp", "call_like_jaxpr", "flatten_jaxpr"]

_CALL_LIKE_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_WRAPPER_NAMES = frozenset({"jvp", "transpose", "vmap", "remat", "checkpoint", "pjit", "jit",
                            "rematted_computation", "custom_jvp_call", "custom_vjp_call",
                            "shard_map", "while", "scan", "cond", "body", "cond_fun", "body_fun"})


@dataclasses.dataclass
class RawOp:
    """An op while the graph is being built (mutable; frozen into ``Op`` later)."""

    primitive: str
    inputs: list[int]
    outputs: list[int]
    flops: float
    transcendentals: float
    bytes_read: int
    bytes_written: int
    count: int
    loop_trips: int
    name_stack: str
    source: str
    loop: tuple[tuple[int, int], ...]
    structural: bool
    attrs: dict[str, Any]
    path: tuple[int, ...] | None = None


@dataclasses.dataclass
class FlatGraph:
    """The result of flattening: ops, tensor table and bookkeeping for later passes."""

    ops: list[RawOp]
    tensor_shapes: list[tuple[int, ...]]
    tensor_dtypes: list[str]
    tensor_producers: list[int | None]
    inputs: list[int]
    outputs: list[int | None]
    # loop id -> outer tensor ids sliced per iteration (scan xs) by that loop
    loop_xs: dict[int, list[int]]
    loop_lengths: dict[int, int]
    unknown_primitives: list[tuple[str, str]]
    notes: list[str]


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


class _SourceCache:
    """``file:line (function)`` per equation, computed once per traceback.

    Backward equations share their forward equation's traceback, so caching by traceback
    identity halves the work; the jaxpr keeps the tracebacks alive while we hold their ids.
    """

    def __init__(self) -> None:
        self._by_tb: dict[int, str] = {}

    def __call__(self, eqn: Any) -> str:
        si = eqn.source_info
        key = id(si.traceback)
        hit = self._by_tb.get(key)
        if hit is not None:
            return hit
        try:
            text = source_info_util.summarize(si)
        except Exception:  # source info is best-effort metadata; never fail a trace on it
            text = ""
        self._by_tb[key] = text
        return text


def _join_stack(prefix: str, inner: str) -> str:
    if not prefix:
        return inner
    if not inner:
        return prefix
    return f"{prefix}/{inner}"


_SCOPE_NAME = re.compile(r"^[A-Za-z_][\w.\-]*$")


def user_scope(name_stack: str) -> str:
    """Extracts user ``named_scope`` names from a name stack, dropping transform wrappers.

    ``transpose(jvp(blocks.0))/attn`` gives ``blocks.0.attn``; ``jvp()`` gives ``""``.
    """
    parts: list[str] = []
    for comp in name_stack.split("/"):
        inner = comp
        while "(" in inner and inner.endswith(")"):
            head, _, rest = inner.partition("(")
            if head not in _WRAPPER_NAMES:
                break
            inner = rest[:-1]
        # Keep identifier-like names only: jax's own scopes (an einsum's "ij,jk->ik") are not
        # module names.
        if inner and inner not in _WRAPPER_NAMES and _SCOPE_NAME.match(inner):
            parts.append(inner)
    return ".".join(parts)


class _Builder:
    def __init__(self) -> None:
        self.ops: list[RawOp] = []
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[str] = []
        self.producers: list[int | None] = []
        self.loop_xs: dict[int, list[int]] = {}
        self.loop_lengths: dict[int, int] = {}
        self.unknown: dict[str, str] = {}
        self.notes: list[str] = []
        self._next_loop = 0
        # tensor id -> value for tensors XLA's algebraic simplifier treats as constants
        # (built from literals only); _UNKNOWN when the value itself is not tracked.
        self.consts: dict[int, Any] = {}
        self.source = _SourceCache()

    # -- tensors ---------------------------------------------------------------------------
    def new_tensor(self, aval: Any, producer: int | None) -> int:
        shape = tuple(int(d) for d in getattr(aval, "shape", ()))
        self.shapes.append(shape)
        self.dtypes.append(_dtype_name(getattr(aval, "dtype", "float32")))
        self.producers.append(producer)
        return len(self.shapes) - 1

    def new_loop(self, length: int) -> int:
        loop_id = self._next_loop
        self._next_loop += 1
        self.loop_lengths[loop_id] = length
        return loop_id

    # -- ops -------------------------------------------------------------------------------
    def add_op(self, primitive: str, in_ids: Sequence[int | None], in_avals: Sequence[Any],
               out_avals: Sequence[Any], params: dict, *, count: int, trips: int, stack: str,
               source: str, loop: tuple[tuple[int, int], ...], structural: bool = False,
               attrs: dict[str, Any] | None = None, folded: bool = False,
               path: tuple[int, ...] | None = None) -> list[int]:
        op_id = len(self.ops)
        if structural or folded:
            flops = trans = 0.0
            bytes_read = bytes_written = 0
        else:
            cost = equation_cost(primitive, in_avals, out_avals, params)
            flops, trans = cost.flops, cost.transcendentals
            bytes_read, bytes_written = cost.bytes_read, cost.bytes_written
            if not is_known_primitive(primitive) and primitive not in self.unknown:
                self.unknown[primitive] = source
        if folded:
            attrs = {**(attrs or {}), "folded": True}
        outs = [self.new_tensor(a, op_id) for a in out_avals]
        self.ops.append(RawOp(
            primitive=primitive, inputs=[t for t in in_ids if t is not None], outputs=outs,
            flops=flops, transcendentals=trans, bytes_read=bytes_read,
            bytes_written=bytes_written, count=count, loop_trips=trips, name_stack=stack,
            source=source, loop=loop, structural=structural, attrs=attrs or {},
            path=None if structural else path))
        return outs

    # -- walking ---------------------------------------------------------------------------
    def walk(self, jaxpr: Any, in_ids: Sequence[int | None], consts: Sequence[Any], *,
             count: int, trips: int, stack: str, loop: tuple[tuple[int, int], ...],
             path: tuple[int, ...] | None = None) -> list[int | None]:
        """Adds the ops of ``jaxpr``. ``path`` is the position of this jaxpr's equations in the
        traced program (indices through inlined calls) or None inside loop and branch bodies,
        whose equations the runtime cannot address one by one."""
        env: dict[Any, int | None] = {}
        for v, c in zip(jaxpr.constvars, consts, strict=False):
            env[v] = self.new_tensor(getattr(c, "aval", c), None)
        for v, t in zip(jaxpr.invars, in_ids, strict=True):
            env[v] = t

        def read(v: Any) -> int | None:
            if isinstance(v, jcore.Literal):
                return None
            return env.get(v)

        for i, eqn in enumerate(jaxpr.eqns):
            in_ids_e = [read(v) for v in eqn.invars]
            eqn_stack = _join_stack(stack, str(eqn.source_info.name_stack))
            outs = self._eqn(eqn, in_ids_e, count=count, trips=trips, stack=eqn_stack,
                             loop=loop, path=None if path is None else (*path, i))
            for v, t in zip(eqn.outvars, outs, strict=True):
                env[v] = t
        return [read(v) for v in jaxpr.outvars]

    def _eqn(self, eqn: Any, in_ids: list[int | None], *, count: int, trips: int, stack: str,
             loop: tuple[tuple[int, int], ...], path: tuple[int, ...] | None
             ) -> list[int | None]:
        name = eqn.primitive.name
        params = eqn.params
        kw: dict[str, Any] = dict(count=count, trips=trips, stack=stack, loop=loop)
        if name == "scan":
            return self._scan(eqn, in_ids, **kw)
        if name == "while":
            return self._while(eqn, in_ids, **kw)
        if name == "cond":
            return self._cond(eqn, in_ids, **kw)
        if name == "shard_map":
            return self._shard_map(eqn, in_ids, **kw)
        if name in ("pjit", "jit") and str(params.get("name", "")).startswith(KERNEL_PREFIX):
            return self._kernel(eqn, in_ids, **kw, path=path)
        inner = call_like_jaxpr(eqn)
        if inner is not None:
            jaxpr, consts = inner
            return self.walk(jaxpr, in_ids, consts, **kw, path=path)
        if list(jcore.jaxprs_in_params(params)) and not is_known_primitive(name):
            # A higher-order primitive we cannot look inside (e.g. a Pallas kernel): keep it as
            # one opaque op so its operands and results stay in the graph.
            self.unknown.setdefault(name, self.source(eqn))
        in_avals = [v.aval for v in eqn.invars if not isinstance(v, jcore.Literal)]
        out_avals = [v.aval for v in eqn.outvars]
        in_vals = [v.val if isinstance(v, jcore.Literal)
                   else (_NOT_CONST if t is None else self.consts.get(t, _NOT_CONST))
                   for v, t in zip(eqn.invars, in_ids, strict=True)]
        simplified, out_val = _simplify(name, in_vals, params)
        outs = self.add_op(name, in_ids, in_avals, out_avals, dict(params), count=count,
                           trips=trips, stack=stack, source=self.source(eqn), loop=loop,
                           attrs=_plain_attrs(name, params), folded=simplified, path=path)
        if out_val is not _NOT_CONST and len(outs) == 1:
            self.consts[outs[0]] = out_val
        return list(outs)

    def _kernel(self, eqn: Any, in_ids: list[int | None], *, count: int, trips: int, stack: str,
                loop: tuple[tuple[int, int], ...], path: tuple[int, ...] | None
                ) -> list[int | None]:
        """A shardplan kernel's ``jax.jit`` call: one op (:mod:`shardplan.kernels.registry`),
        not the Pallas call inside, which only its registered rule can split."""
        name = str(eqn.params["name"])
        in_avals = [v.aval for v in eqn.invars if not isinstance(v, jcore.Literal)]
        out_avals = [v.aval for v in eqn.outvars]
        if rule_for(name) is None:
            self.unknown.setdefault(f"{KERNEL}:{name}", self.source(eqn))
        call = recorded(name, in_avals)
        # The cost reads the call's static options (flash attention's ``causal``); a kernel
        # traced elsewhere is costed with the rule's defaults.
        params = {"name": name, "static": dict(call.static) if call is not None else {}}
        return list(self.add_op(KERNEL, in_ids, in_avals, out_avals, params, count=count,
                                trips=trips, stack=stack, source=self.source(eqn), loop=loop,
                                attrs={"kernel": name}, path=path))

    def _scan(self, eqn: Any, in_ids: list[int | None], *, count: int, trips: int, stack: str,
              loop: tuple[tuple[int, int], ...]) -> list[int | None]:
        p = eqn.params
        length = int(p["length"])
        n_consts, n_carry = int(p["num_consts"]), int(p["num_carry"])
        body = p["jaxpr"]
        loop_id = self.new_loop(length)
        inner_loop = (*loop, (loop_id, length))
        source = self.source(eqn)
        body_in: list[int | None] = list(in_ids[: n_consts + n_carry])
        xs_ids = in_ids[n_consts + n_carry:]
        xs_vars = body.jaxpr.invars[n_consts + n_carry:]
        self.loop_xs[loop_id] = [t for t in xs_ids if t is not None]
        for t, v in zip(xs_ids, xs_vars, strict=True):
            if t is None:
                body_in.append(None)
                continue
            (sliced,) = self.add_op("scan_slice", [t], [], [v.aval], {}, count=count,
                                    trips=trips, stack=stack, source=source, loop=loop,
                                    structural=True, attrs={"loop": loop_id})
            body_in.append(sliced)
        outs = self.walk(body.jaxpr, body_in, body.consts, count=count * length,
                         trips=trips * length, stack=stack, loop=inner_loop)
        carry_out = outs[:n_carry]
        ys = outs[n_carry:]
        results: list[int | None] = list(carry_out)
        for t, v in zip(ys, eqn.outvars[n_carry:], strict=True):
            srcs = [t] if t is not None else []
            (stacked,) = self.add_op("scan_stack", srcs, [], [v.aval], {}, count=count,
                                     trips=trips, stack=stack, source=source, loop=loop,
                                     structural=True, attrs={"loop": loop_id})
            results.append(stacked)
        return results

    def _while(self, eqn: Any, in_ids: list[int | None], *, count: int, trips: int, stack: str,
               loop: tuple[tuple[int, int], ...]) -> list[int | None]:
        p = eqn.params
        cond_n, body_n = int(p["cond_nconsts"]), int(p["body_nconsts"])
        body = p["body_jaxpr"]
        carry_in = in_ids[cond_n + body_n:]
        n_trips = _while_trip_count(eqn)
        if n_trips is None:
            self.notes.append(
                f"while loop at {self.source(eqn)}: trip count unknown, its body is counted once")
            n_trips = 1
        loop_id = self.new_loop(n_trips)
        body_in = list(in_ids[cond_n: cond_n + body_n]) + list(carry_in)
        return self.walk(body.jaxpr, body_in, body.consts, count=count * n_trips,
                         trips=trips * n_trips, stack=stack, loop=(*loop, (loop_id, n_trips)))

    def _cond(self, eqn: Any, in_ids: list[int | None], *, count: int, trips: int, stack: str,
              loop: tuple[tuple[int, int], ...]) -> list[int | None]:
        branches = eqn.params["branches"]
        costs = [_static_flops(b.jaxpr) for b in branches]
        chosen = int(np.argmax(costs))
        if len(branches) > 1 and len(set(costs)) > 1:
            self.notes.append(f"cond at {self.source(eqn)}: costed as its most expensive branch "
                              f"({chosen} of {len(branches)})")
        b = branches[chosen]
        return self.walk(b.jaxpr, in_ids[1:], b.consts, count=count, trips=trips, stack=stack,
                         loop=loop)

    def _shard_map(self, eqn: Any, in_ids: list[int | None], *, count: int, trips: int,
                   stack: str, loop: tuple[tuple[int, int], ...]) -> list[int | None]:
        p = eqn.params
        body = p["jaxpr"]
        mesh = p["mesh"]
        manual = p.get("manual_axes") or p.get("axis_names") or tuple(mesh.axis_names)
        shards = int(math.prod(mesh.shape[a] for a in manual))
        source = self.source(eqn)
        body_in: list[int | None] = []
        for t, v in zip(in_ids, body.invars, strict=True):
            if t is None or self.shapes[t] == tuple(v.aval.shape):
                body_in.append(t)
                continue
            (local,) = self.add_op("shard_map_split", [t], [], [v.aval], {}, count=count,
                                   trips=trips, stack=stack, source=source, loop=loop,
                                   structural=True)
            body_in.append(local)
        consts = getattr(body, "consts", ())
        inner = getattr(body, "jaxpr", body)
        outs = self.walk(inner, body_in, consts, count=count * shards, trips=trips,
                         stack=stack, loop=loop)
        results: list[int | None] = []
        for t, v in zip(outs, eqn.outvars, strict=True):
            if t is not None and tuple(self.shapes[t]) == tuple(v.aval.shape):
                results.append(t)
                continue
            (glob,) = self.add_op("shard_map_concat", [t] if t is not None else [], [], [v.aval],
                                  {}, count=count, trips=trips, stack=stack, source=source,
                                  loop=loop, structural=True)
            results.append(glob)
        return results


_NOT_CONST = object()
_UNKNOWN = object()
_PASS_THROUGH = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims",
                           "convert_element_type", "copy", "copy_p"})
_SCALAR_FNS: dict[str, Any] = {
    "add": np.add, "add_any": np.add, "sub": np.subtract, "mul": np.multiply,
    "div": np.divide, "max": np.maximum, "min": np.minimum, "neg": np.negative,
    "square": np.square, "sqrt": np.sqrt, "exp": np.exp, "log": np.log,
}


def _is_value(v: Any, x: float) -> bool:
    if v is _NOT_CONST or v is _UNKNOWN:
        return False
    try:
        return bool(np.all(np.asarray(v) == x))
    except (TypeError, ValueError):
        return False


def _simplify(primitive: str, in_vals: list[Any], params: Any) -> tuple[bool, Any]:
    """Mirrors the simplifications XLA applies before costing a lowered module.

    Returns (costs nothing, constant value of the result or _NOT_CONST). Measured on jax 0.10.2:
    ops whose operands all derive from literals are folded; ``x + 0``, ``x - 0``, ``x * 1``
    disappear; ``x / 1``, anything involving ``iota`` and reductions (even of constants) stay.
    """
    if not in_vals or primitive == "iota":
        return False, _NOT_CONST
    foldable = (primitive in _PASS_THROUGH or primitive in ELEMENTWISE
                or primitive in TRANSCENDENTAL)
    if foldable and all(v is not _NOT_CONST for v in in_vals):
        if primitive in _PASS_THROUGH and len(in_vals) == 1:
            return True, in_vals[0]
        fn = _SCALAR_FNS.get(primitive)
        if fn is not None and all(v is not _UNKNOWN for v in in_vals):
            try:
                with np.errstate(all="ignore"):
                    return True, fn(*[np.asarray(v) for v in in_vals])
            except (TypeError, ValueError):
                return True, _UNKNOWN
        return True, _UNKNOWN
    if primitive in ("add", "add_any") and any(_is_value(v, 0) for v in in_vals):
        return True, _NOT_CONST
    if primitive == "sub" and len(in_vals) == 2 and _is_value(in_vals[1], 0):
        return True, _NOT_CONST
    if primitive == "mul" and any(_is_value(v, 1) for v in in_vals):
        return True, _NOT_CONST
    return False, _NOT_CONST


def call_like_jaxpr(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """The inner jaxpr of a call-like equation whose operands map 1:1 onto its inputs."""
    for key in _CALL_LIKE_PARAMS:
        j = eqn.params.get(key)
        if j is None:
            continue
        jaxpr = getattr(j, "jaxpr", j)
        consts = getattr(j, "consts", ())
        if not hasattr(jaxpr, "eqns"):
            continue
        if len(jaxpr.invars) == len(eqn.invars) and len(jaxpr.outvars) == len(eqn.outvars):
            return jaxpr, consts
    return None


def _static_flops(jaxpr: Any) -> float:
    """FLOPs of a jaxpr without building a graph (used to pick a ``cond`` branch)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        subs = list(jcore.jaxprs_in_params(eqn.params))
        if subs:
            mult = int(eqn.params.get("length", 1))
            total += mult * max(_static_flops(s) for s in subs)
            continue
        in_avals = [v.aval for v in eqn.invars if not isinstance(v, jcore.Literal)]
        total += equation_cost(eqn.primitive.name, in_avals, [v.aval for v in eqn.outvars],
                               dict(eqn.params)).flops
    return total


def _literal_value(v: Any) -> Any:
    if isinstance(v, jcore.Literal):
        return v.val
    return None


def _while_trip_count(eqn: Any) -> int | None:
    """Trip count of a ``while`` whose condition is ``i < n`` with literal bounds, else None.

    Recognises the ``fori_loop`` pattern: a carried counter starting at a literal, compared
    with ``lt`` against a literal or a carried literal bound, and incremented by 1 in the body.
    """
    p = eqn.params
    cond_n, body_n = int(p["cond_nconsts"]), int(p["body_nconsts"])
    cond = p["cond_jaxpr"].jaxpr
    body = p["body_jaxpr"].jaxpr
    carry_outer = eqn.invars[cond_n + body_n:]
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name != "lt":
        return None
    lhs, rhs = cond.eqns[0].invars
    cond_carry = cond.invars[cond_n:]

    def init_of(v: Any) -> Any:
        if isinstance(v, jcore.Literal):
            return v.val
        if v in cond_carry:
            return _literal_value(carry_outer[cond_carry.index(v)])
        return None

    if lhs not in cond_carry:
        return None
    k = cond_carry.index(lhs)
    start, stop = init_of(lhs), init_of(rhs)
    if start is None or stop is None:
        return None
    # The body must increment carry k by exactly 1.
    body_in = body.invars[body_n + k]
    body_out = body.outvars[k]
    for e in body.eqns:
        if e.outvars[0] is body_out and e.primitive.name == "add":
            a, b = e.invars
            step = _literal_value(b) if a is body_in else _literal_value(a)
            if step == 1:
                return max(int(stop) - int(start), 0)
    return None


def _plain_attrs(primitive: str, params: Any) -> dict[str, Any]:
    """The primitive parameters later stages read, as plain Python data."""
    if primitive == "dot_general":
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        return {"lhs_contract": tuple(lc), "rhs_contract": tuple(rc),
                "lhs_batch": tuple(lb), "rhs_batch": tuple(rb)}
    out: dict[str, Any] = {}
    dn = params.get("dimension_numbers")
    if primitive == "gather" and dn is not None:
        out.update(offset_dims=tuple(dn.offset_dims),
                   collapsed_slice_dims=tuple(dn.collapsed_slice_dims),
                   start_index_map=tuple(dn.start_index_map),
                   operand_batching_dims=tuple(dn.operand_batching_dims),
                   start_indices_batching_dims=tuple(dn.start_indices_batching_dims),
                   slice_sizes=tuple(int(s) for s in params["slice_sizes"]))
    elif primitive.startswith("scatter") and dn is not None:
        out.update(update_window_dims=tuple(dn.update_window_dims),
                   inserted_window_dims=tuple(dn.inserted_window_dims),
                   scatter_dims_to_operand_dims=tuple(dn.scatter_dims_to_operand_dims),
                   operand_batching_dims=tuple(dn.operand_batching_dims),
                   scatter_indices_batching_dims=tuple(dn.scatter_indices_batching_dims))
    for key in ("axes", "axis", "dimensions", "permutation", "new_sizes",
                "broadcast_dimensions", "shape", "dimension"):
        if key in params:
            val = params[key]
            if isinstance(val, tuple | list):
                out[key] = tuple(int(x) if isinstance(x, int | np.integer) else x for x in val)
            elif isinstance(val, int | np.integer):
                out[key] = int(val)
    return out


def flatten_jaxpr(closed_jaxpr: Any) -> FlatGraph:
    """Flattens a ``ClosedJaxpr`` into ops in program order.

    Args:
      closed_jaxpr: e.g. ``jax.jit(f).trace(*args).jaxpr``.

    Returns:
      A :class:`FlatGraph` whose ``inputs`` are the tensor ids of the jaxpr's invars.
    """
    b = _Builder()
    jaxpr = closed_jaxpr.jaxpr
    in_ids: list[int | None] = [b.new_tensor(v.aval, None) for v in jaxpr.invars]
    outs = b.walk(jaxpr, in_ids, closed_jaxpr.consts, count=1, trips=1, stack="", loop=(),
                  path=())
    return FlatGraph(
        ops=b.ops, tensor_shapes=b.shapes, tensor_dtypes=b.dtypes, tensor_producers=b.producers,
        inputs=[t for t in in_ids if t is not None], outputs=outs, loop_xs=b.loop_xs,
        loop_lengths=b.loop_lengths, unknown_primitives=sorted(b.unknown.items()),
        notes=b.notes)
