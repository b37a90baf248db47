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
import itertools
import math
import operator
import re
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
from jax.extend import core as jcore
from jax.extend import source_info_util

from shardplan.kernels.registry import PREFIX as KERNEL_PREFIX
from shardplan.kernels.registry import PRIMITIVE as KERNEL
from shardplan.kernels.registry import recorded, rule_for
from shardplan.trace.dtypes import dtype_name
from shardplan.trace.flops import (
    ELEMENTWISE,
    KNOWN_PRIMITIVES,
    TRANSCENDENTAL,
    equation_cost,
    equation_flops,
    is_known_primitive,
    nbytes,
)
from shardplan.trace.graph import OpDraft

# (Past 600 lines: the walk over nested jaxprs and its per-equation fast path (_plain, the
# same op add_op builds, written out for the 10^5 equations of a large model) share the
# builder's tensor and signature tables.)

__all__ = ["FlatGraph", "call_like_jaxpr", "flatten_jaxpr"]

_CALL_LIKE_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_CALL_KEYS = frozenset(_CALL_LIKE_PARAMS)
_AVAL = operator.attrgetter("aval")
_WRAPPER_NAMES = frozenset({"jvp", "transpose", "vmap", "remat", "checkpoint", "pjit", "jit",
                            "rematted_computation", "custom_jvp_call", "custom_vjp_call",
                            "shard_map", "while", "scan", "cond", "body", "cond_fun", "body_fun"})


@dataclasses.dataclass
class FlatGraph:
    """The result of flattening: ops, tensor table and bookkeeping for later passes.

    ``ops`` are drafts of the graph's :class:`~shardplan.trace.graph.Op` values, every field
    final but three: ``phase``, ``scope`` and ``layers`` hold placeholders (``"other"``,
    ``""``, ``()``) that :func:`shardplan.trace.api.build_graph` fills in before it freezes
    them.
    """

    ops: list[OpDraft]
    name_stacks: list[str]  # per op: the name stack of its equation, joined through calls
    op_flops: list[float]  # per op: its FLOPs as the cost rule gave them (Op.flops is a float)
    tensor_shapes: list[tuple[int, ...]]
    tensor_dtypes: list[str]
    tensor_producers: list[int | None]
    # per tensor, a signature id: equal ids, equal (shape, dtype) pairs (and equal bytes)
    tensor_signatures: list[int]
    signatures: list[tuple[tuple[int, ...], str]]  # per signature id, the pair
    # per signature id, the bytes of a value of it (read off the dtype itself: a PRNG key's
    # are its key data's, whatever its implementation)
    signature_bytes: list[int]
    inputs: list[int]
    outputs: list[int | None]
    # loop id -> outer tensor ids sliced per iteration (scan xs) by that loop
    loop_xs: dict[int, list[int]]
    loop_lengths: dict[int, int]
    unknown_primitives: list[tuple[str, str]]
    notes: list[str]


class _SourceCache:
    """``file:line (function)`` per equation: ``source_info_util.summarize``, cached.

    The text depends only on the traceback's frames (code object and instruction of each),
    and jax's tracebacks compare and hash by exactly those, in C++. Every equation has a
    traceback object of its own, but the blocks of a Python-loop model run through the same
    lines: GPT-3 175B's 80,000 equations have a few hundred distinct tracebacks, and
    summarising one walks twenty-odd frames to the innermost user frame.
    """

    def __init__(self) -> None:
        self.by_traceback: dict[Any, str] = {}

    def __call__(self, eqn: Any) -> str:
        si = eqn.source_info
        try:
            return self.by_traceback[si.traceback]
        except KeyError:
            text = self.by_traceback[si.traceback] = self._summarize(si)
            return text
        except TypeError:  # an unhashable traceback (not jax's): no caching
            return self._summarize(si)

    @staticmethod
    def _summarize(si: Any) -> str:
        try:
            return source_info_util.summarize(si)
        except Exception:  # source info is best-effort metadata; never fail a trace on it
            return ""


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
        self.ops: list[OpDraft] = []
        self.name_stacks: list[str] = []
        self.op_flops: list[float] = []
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
        # Tensors: per tensor id its signature id, per signature id its (shape, dtype) pair and
        # the bytes of a value of it (cost rule's itemsize), by (pair, bytes).
        self.sigs: list[int] = []
        self.pairs: list[tuple[tuple[int, ...], str]] = []
        self.pair_bytes: list[int] = []
        self._pair_ids: dict[tuple[tuple[tuple[int, ...], str], int], int] = {}
        self._signatures: dict[tuple[Any, Any], tuple[int, int]] = {}

    # -- tensors ---------------------------------------------------------------------------
    def signature(self, aval: Any) -> tuple[int, int]:
        """Bytes and signature id (see FlatGraph) of an abstract value, cached by (shape,
        dtype): a train step has few distinct ones, and naming or even hashing a numpy dtype
        costs about as much as a dictionary lookup of the pair."""
        try:
            key = (aval.shape, aval.dtype)
            hit = self._signatures.get(key)
        except (AttributeError, TypeError):  # a token; an unhashable shape (not jax's)
            return self._signature(aval)
        if hit is None:
            hit = self._signatures[key] = self._signature(aval)
        return hit

    def _signature(self, aval: Any) -> tuple[int, int]:
        pair = (tuple(map(int, getattr(aval, "shape", ()))),
                dtype_name(getattr(aval, "dtype", "float32")))
        size = nbytes(aval)
        sig = self._pair_ids.get((pair, size))
        if sig is None:
            sig = self._pair_ids[(pair, size)] = len(self.pairs)
            self.pairs.append(pair)
            self.pair_bytes.append(size)
        return size, sig

    def shape(self, t: int) -> tuple[int, ...]:
        return self.pairs[self.sigs[t]][0]

    def new_tensor(self, aval: Any, producer: int | None) -> int:
        self.sigs.append(self.signature(aval)[1])
        self.producers.append(producer)
        return len(self.sigs) - 1

    def new_loop(self, length: int) -> int:
        loop_id = self._next_loop
        self._next_loop += 1
        self.loop_lengths[loop_id] = length
        return loop_id

    # -- ops -------------------------------------------------------------------------------
    def add_op(self, primitive: str, in_ids: Sequence[int | None], in_avals: Sequence[Any],
               out_avals: Sequence[Any], params: Mapping[str, Any], count: int, trips: int,
               stack: str, source: str, loop: tuple[tuple[int, int], ...],
               structural: bool = False, attrs: dict[str, Any] | None = None,
               path: tuple[int, ...] | None = None) -> list[int]:
        """Adds one op: a structural marker (free) or a kernel call (costed). Plain equations
        take :meth:`_plain`, which does the same."""
        op_id = len(self.ops)
        flops: float = 0.0
        trans: float = 0.0
        bytes_read = bytes_written = 0
        if not structural:
            flops, trans = equation_flops(primitive, in_avals, out_avals, params)
            bytes_read = sum(self.signature(a)[0] for a in in_avals)
            bytes_written = sum(self.signature(a)[0] for a in out_avals)
            if primitive not in self.unknown and not is_known_primitive(primitive):
                self.unknown[primitive] = source
        outs = [self.new_tensor(a, op_id) for a in out_avals]
        # Positional, in Op's field order; phase, scope and layers: placeholders (FlatGraph).
        self.ops.append(OpDraft(
            op_id, primitive, tuple([t for t in in_ids if t is not None]), tuple(outs),
            float(flops), float(trans), bytes_read, bytes_written, count, trips, "other", "",
            source, (), loop, structural, attrs or {}, None if structural else path))
        self.name_stacks.append(stack)
        self.op_flops.append(flops)
        return outs

    # -- walking ---------------------------------------------------------------------------
    def walk(self, jaxpr: Any, in_ids: Sequence[int | None], consts: Sequence[Any], *,
             count: int, trips: int, stack: str, loop: tuple[tuple[int, int], ...],
             path: tuple[int, ...] | None = None) -> list[int | None]:
        """Adds the ops of ``jaxpr``. ``path`` is the position of this jaxpr's equations in the
        traced program (indices through inlined calls and ``scan`` bodies) or None inside
        ``while`` and ``cond`` bodies, whose equations the runtime does not address one by
        one."""
        # Tensor ids by variable, keyed by id(): jax variables compare by identity (and the
        # jaxpr holds them all), literals are not hashable and map to None like an unknown.
        env: dict[int, int | None] = {}
        for v, c in zip(jaxpr.constvars, consts, strict=False):
            env[id(v)] = self.new_tensor(getattr(c, "aval", c), None)
        for v, t in zip(jaxpr.invars, in_ids, strict=True):
            env[id(v)] = t
        read = env.get
        # Equations share name-stack objects; their text (joined to ``stack``) is kept per
        # object id. The jaxpr holds every equation, so no id is reused during the walk.
        stacks: dict[int, str] = {}
        for i, eqn in enumerate(jaxpr.eqns):
            in_ids_e = list(map(read, map(id, eqn.invars)))
            name_stack = eqn.source_info.name_stack
            eqn_stack = stacks.get(id(name_stack))
            if eqn_stack is None:
                eqn_stack = stacks[id(name_stack)] = _join_stack(stack, str(name_stack))
            eqn_path = None if path is None else (*path, i)
            name = eqn.primitive.name
            params = eqn.params
            outs: Sequence[int | None] | None = None
            if name in _NESTING or not _CALL_KEYS.isdisjoint(params):
                outs = self._nested(eqn, in_ids_e, count=count, trips=trips, stack=eqn_stack,
                                    loop=loop, path=eqn_path)
            if outs is None:
                outs = self._plain(eqn, name, params, in_ids_e, count, trips, eqn_stack, loop,
                                   eqn_path)
            # One result per outvar; zip's strict= would cost a keyword parse per equation.
            env.update(zip(map(id, eqn.outvars), outs))  # noqa: B905
        return list(map(read, map(id, jaxpr.outvars)))

    def _plain(self, eqn: Any, name: str, params: Mapping[str, Any], in_ids: list[int | None],
               count: int, trips: int, stack: str, loop: tuple[tuple[int, int], ...],
               path: tuple[int, ...] | None) -> list[int]:
        """Adds an equation without a jaxpr to walk: one op (what :meth:`add_op` does, written
        out for the hundred thousand equations of a large model)."""
        literal = jcore.Literal
        unknown_in = None in in_ids  # literal operands (or unknown ones) among them
        if unknown_in:
            in_avals = [v.aval for v in eqn.invars if not isinstance(v, literal)]
        else:
            in_avals = list(map(_AVAL, eqn.invars))
        out_avals = list(map(_AVAL, eqn.outvars))
        try:  # self.source(eqn), written out
            source = self.source.by_traceback[eqn.source_info.traceback]
        except (KeyError, TypeError):
            source = self.source(eqn)
        folded, out_val = False, _NOT_CONST
        consts = self.consts
        # Only literal or constant operands can fold (see _simplify); most equations have none.
        if unknown_in or not consts.keys().isdisjoint(in_ids):
            in_vals = [v.val if isinstance(v, literal)
                       else (_NOT_CONST if t is None else consts.get(t, _NOT_CONST))
                       for v, t in zip(eqn.invars, in_ids)]  # noqa: B905 (same length)
            folded, out_val = _simplify(name, in_vals, params)
        if name not in KNOWN_PRIMITIVES:
            if any(True for _ in jcore.jaxprs_in_params(params)):
                # A higher-order primitive we cannot look inside (e.g. a Pallas kernel): keep
                # it as one opaque op so its operands and results stay in the graph.
                self.unknown.setdefault(name, source)
            if not folded:
                self.unknown.setdefault(name, source)
        attrs = _plain_attrs(name, params)
        signature = self.signature
        op_id = len(self.ops)
        outs: list[int] = []
        bytes_read = bytes_written = 0
        flops: float = 0.0
        trans: float = 0.0
        if folded:  # costs nothing
            attrs["folded"] = True
        else:
            flops, trans = equation_flops(name, in_avals, out_avals, params)
            for a in in_avals:
                bytes_read += signature(a)[0]
        sigs, producers = self.sigs, self.producers
        for a in out_avals:  # new_tensor, written out
            nbytes_out, sig = signature(a)
            if not folded:
                bytes_written += nbytes_out
            outs.append(len(sigs))
            sigs.append(sig)
            producers.append(op_id)
        # Positional, in Op's field order; phase, scope and layers: placeholders (FlatGraph).
        inputs = tuple([t for t in in_ids if t is not None] if unknown_in
                       else cast("list[int]", in_ids))
        self.ops.append(OpDraft(
            op_id, name, inputs, tuple(outs), float(flops), float(trans), bytes_read,
            bytes_written, count, trips, "other", "", source, (), loop, False, attrs, path))
        self.name_stacks.append(stack)
        self.op_flops.append(flops)
        if out_val is not _NOT_CONST and len(outs) == 1:
            consts[outs[0]] = out_val
        return outs

    def _nested(self, eqn: Any, in_ids: list[int | None], *, count: int, trips: int,
                stack: str, loop: tuple[tuple[int, int], ...], path: tuple[int, ...] | None
                ) -> list[int | None] | None:
        """The results of an equation with a jaxpr inside, walked; None for an opaque one."""
        name = eqn.primitive.name
        kw: dict[str, Any] = dict(count=count, trips=trips, stack=stack, loop=loop)
        if name == "scan":
            return self._scan(eqn, in_ids, **kw, path=path)
        if name == "while":
            return self._while(eqn, in_ids, **kw)
        if name == "cond":
            return self._cond(eqn, in_ids, **kw)
        if name == "shard_map":
            return self._shard_map(eqn, in_ids, **kw)
        if name in ("pjit", "jit") and str(eqn.params.get("name", "")).startswith(KERNEL_PREFIX):
            return self._kernel(eqn, in_ids, **kw, path=path)
        inner = call_like_jaxpr(eqn)
        if inner is not None:
            jaxpr, consts = inner
            return self.walk(jaxpr, in_ids, consts, **kw, path=path)
        return None

    def _kernel(self, eqn: Any, in_ids: list[int | None], *, count: int, trips: int, stack: str,
                loop: tuple[tuple[int, int], ...], path: tuple[int, ...] | None
                ) -> list[int | None]:
        """A shardplan kernel's ``jax.jit`` call: one op (:mod:`shardplan.kernels.registry`),
        not the Pallas call inside, which only its registered rule can split."""
        name = str(eqn.params["name"])
        if not eqn.outvars:
            # What autodiff leaves of a call whose work went elsewhere (a kernel inside a
            # ``scan`` body: the partial evaluation's empty known part): nothing to cost.
            return []
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
              loop: tuple[tuple[int, int], ...], path: tuple[int, ...] | None
              ) -> list[int | None]:
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
        # The body's equations extend the scan's path: the runtime pins them in a scan it
        # rebuilds around the evaluated body (runtime/constrain.py).
        outs = self.walk(body.jaxpr, body_in, body.consts, count=count * length,
                         trips=trips * length, stack=stack, loop=inner_loop, path=path)
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
            if t is None or self.shape(t) == tuple(v.aval.shape):
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
            if t is not None and tuple(self.shape(t)) == tuple(v.aval.shape):
                results.append(t)
                continue
            (glob,) = self.add_op("shard_map_concat", [t] if t is not None else [], [], [v.aval],
                                  {}, count=count, trips=trips, stack=stack, source=source,
                                  loop=loop, structural=True)
            results.append(glob)
        return results


_NESTING = frozenset({"scan", "while", "cond", "shard_map", "pjit", "jit"})
"""Primitives with a jaxpr inside that the walk treats by name (the rest: call_like_jaxpr)."""
_NOT_CONST = object()
_UNKNOWN = object()
_PASS_THROUGH = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims",
                           "convert_element_type", "copy", "copy_p"})
_SCALAR_FNS: dict[str, Any] = {
    "add": np.add, "add_any": np.add, "sub": np.subtract, "mul": np.multiply,
    "div": np.divide, "max": np.maximum, "min": np.minimum, "neg": np.negative,
    "square": np.square, "sqrt": np.sqrt, "exp": np.exp, "log": np.log,
}


_PY_NUMBER = (int, float)
_NP_VALUE = (np.ndarray, np.generic)
_INTEGER = (int, np.integer)
_SEQUENCE = (tuple, list)


def _is_value(v: Any, x: float) -> bool:
    if v is _NOT_CONST or v is _UNKNOWN:
        return False
    # The usual literal values, a Python or 0-d array scalar, compared as numpy would compare
    # them, without numpy's microseconds per call (jax's literal arrays are a subclass).
    if isinstance(v, _PY_NUMBER):
        return bool(v == x)
    if isinstance(v, _NP_VALUE) and v.ndim == 0 and v.dtype.kind in "biuf":
        return bool(v.item() == x)
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
    # (map over operator.is_, not generators: this runs for every equation with a literal)
    if foldable and not any(map(operator.is_, in_vals, itertools.repeat(_NOT_CONST))):
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
    if primitive in ("add", "add_any") and any(map(_is_value, in_vals, itertools.repeat(0))):
        return True, _NOT_CONST
    if primitive == "sub" and len(in_vals) == 2 and _is_value(in_vals[1], 0):
        return True, _NOT_CONST
    if primitive == "mul" and any(map(_is_value, in_vals, itertools.repeat(1))):
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


_ATTR_KEYS = ("axes", "axis", "dimensions", "permutation", "new_sizes", "broadcast_dimensions",
              "shape", "dimension")
"""Primitive parameters kept as attributes as they are (integers, tuples of integers)."""
_ATTR_KEY_SET = frozenset(_ATTR_KEYS)
_PLAIN_INT = frozenset({int})


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
    if params.keys().isdisjoint(_ATTR_KEY_SET):  # most equations (elementwise math)
        return out
    present = params.keys() & _ATTR_KEY_SET
    for key in sorted(present, key=_ATTR_KEYS.index) if len(present) > 1 else present:
        val = params[key]
        if isinstance(val, _SEQUENCE):
            if set(map(type, val)) <= _PLAIN_INT:  # already plain ints (the usual case)
                out[key] = tuple(val)
            else:
                out[key] = tuple([int(x) if isinstance(x, _INTEGER) else x for x in val])
        elif isinstance(val, _INTEGER):
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
        ops=b.ops, name_stacks=b.name_stacks, op_flops=b.op_flops,
        tensor_shapes=[b.pairs[s][0] for s in b.sigs],
        tensor_dtypes=[b.pairs[s][1] for s in b.sigs],
        tensor_producers=b.producers, tensor_signatures=b.sigs,
        signatures=b.pairs, signature_bytes=b.pair_bytes,
        inputs=[t for t in in_ids if t is not None], outputs=outs, loop_xs=b.loop_xs,
        loop_lengths=b.loop_lengths, unknown_primitives=sorted(b.unknown.items()),
        notes=b.notes)
