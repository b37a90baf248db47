"""``trace(fn, *args) -> OpGraph``: the entry point of the trace stage."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from shardplan._gc import gc_paused
from shardplan._traceback import api_boundary
from shardplan.errors import TraceError, format_error
from shardplan.trace.flatten import FlatGraph, flatten_jaxpr, user_scope
from shardplan.trace.graph import Layer, OpGraph, Parameter, Phase, Role, Tensor, TensorDraft
from shardplan.trace.layers import (
    POST,
    PRE,
    SHARED,
    LayerAssignment,
    assign_layers,
    fingerprint_reprs,
)

__all__ = ["build_graph", "check_leaves", "trace"]

_FORWARD_PHASES = ("forward", "recompute")


def _keystr(path: Sequence[Any]) -> str:
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def _keystrs(paths: Sequence[Sequence[Any]]) -> list[str]:
    """``[_keystr(path) for path in paths]``, each key entry written once.

    ``keystr`` joins one text per key entry; the paths of a flattened tree share the entry
    objects of their common prefixes (every leaf under ``blocks/3`` holds the same two), so
    the text is kept per entry object. ``paths`` holds the entries while the cache lives.
    """
    texts: dict[int, str] = {}
    out = []
    for path in paths:
        for key in path:
            if id(key) not in texts:
                texts[id(key)] = jax.tree_util.keystr((key,), simple=True, separator="/")
        out.append("/".join(map(texts.__getitem__, map(id, path))))
    return out


def check_leaves(args: tuple[Any, ...], /,
                 names: Sequence[str] | None = None) -> list[tuple[str, Any]]:
    """The ``(key path, leaf)`` pairs of ``args``, every leaf an array, a scalar or a
    ``jax.ShapeDtypeStruct`` (``None`` is an empty subtree, as everywhere in JAX).

    Args:
      args: the arguments, a tuple.
      names: a name per argument for the message (``("state", "batch")``: the error names
        ``state/blocks/0/name``); default ``argument <i>, key path ...``.

    Raises:
      TraceError: naming the key path and the type of the first leaf that is not an array.
    """
    leaves = jax.tree_util.tree_flatten_with_path(args)[0]
    for path, leaf in leaves:
        if not isinstance(leaf, _ARRAY_LIKE):
            index = path[0].idx if hasattr(path[0], "idx") else None
            key = _keystr(path[1:])
            if names is not None and index is not None and index < len(names):
                where = f"{names[index]}/{key}" if key else names[index]
            else:
                where = f"argument {index if index is not None else '?'}, key path " \
                        f"{key or '<root>'}"
            raise TraceError(format_error(
                "A leaf of the traced arguments is not an array.",
                where=where,
                value=f"{type(leaf).__name__}: {leaf!r}"[:200],
                remedy="pass arrays or jax.ShapeDtypeStruct leaves only; keep Python objects "
                       "(strings, callables, configs) out of the state pytree, e.g. in a "
                       "closure or the graphdef"))
    paths = _keystrs([path for path, _ in leaves])
    return [(path, leaf) for path, (_, leaf) in zip(paths, leaves, strict=True)]


_ARRAY_LIKE = (jax.ShapeDtypeStruct, jax.Array, np.ndarray, np.generic, bool, int, float, complex)
"""What a leaf of the traced arguments may be."""


def _raw_phase(stack: str) -> Phase | None:
    if "transpose(" in stack:
        return "recompute" if "rematted_computation" in stack else "backward"
    if "jvp(" in stack:
        return "forward"
    return None


def _phases(flat: FlatGraph, state_outputs: set[int]) -> list[Phase]:
    # The autodiff phase by name stack; stacks repeat, so each distinct one is parsed once.
    raw_of = {stack: _raw_phase(stack) for stack in set(flat.name_stacks)}
    raw = list(map(raw_of.__getitem__, flat.name_stacks))
    first_ad = next((i for i, p in enumerate(raw) if p is not None), None)
    if first_ad is None:
        return ["forward"] * len(raw)
    # Which ops contribute to the new state (reverse reachability from the state outputs).
    live = set(state_outputs)
    contributes = []
    for op in reversed(flat.ops):
        if live.isdisjoint(op.outputs):
            contributes.append(False)
        else:
            contributes.append(True)
            live.update(op.inputs)
    contributes.reverse()
    phases: list[Phase] = ["forward"] * first_ad
    for p, c in zip(raw[first_ad:], contributes[first_ad:], strict=True):
        phases.append(p if p is not None else "update" if c else "other")
    return phases


def _readers(flat: FlatGraph, consumers: list[list[int]], tensor: int) -> list[int]:
    """Ops reading ``tensor``, following zero-cost structural ops (loop slicing)."""
    out: list[int] = []
    stack = [tensor]
    seen: set[int] = set()
    while stack:
        t = stack.pop()
        for op_id in consumers[t]:
            if op_id in seen:
                continue
            seen.add(op_id)
            out.append(op_id)
            if flat.ops[op_id].structural:
                stack.extend(flat.ops[op_id].outputs)
    return sorted(out)


def _roles(phases: list[Phase], readers: dict[int, list[int]],
           first_arg: set[int]) -> dict[int, Role]:
    # A function with no autodiff and no update (a forward pass: an evaluation loss, an
    # inference step) reads its first argument's leaves as the parameters of its layers.
    forward_only = set(phases) <= {"forward"}
    roles: dict[int, Role] = {}
    for t, ops in readers.items():
        seen = {phases[o] for o in ops}
        if not ops:
            roles[t] = "unused"
        elif (seen & {"forward", "recompute"} and "update" in seen) or (forward_only and t in first_arg):
            roles[t] = "parameter"
        elif seen == {"update"} or seen == {"update", "other"}:
            roles[t] = "optimizer_state"
        else:
            roles[t] = "other"
    return roles


def _link_state(paths: dict[int, str], shapes: list[tuple[int, ...]], params: list[int],
                opt: list[int]) -> dict[int, int]:
    """Maps each optimizer-state leaf to the parameter whose path is its longest suffix."""
    by_suffix: dict[tuple[str, ...], list[int]] = {}
    for t in params:
        comps = tuple(c for c in paths[t].split("/") if c)
        for k in range(1, len(comps) + 1):
            by_suffix.setdefault(comps[-k:], []).append(t)
    links: dict[int, int] = {}
    for t in opt:
        comps = tuple(c for c in paths[t].split("/") if c)
        for k in range(len(comps), 1, -1):
            cands = [p for p in by_suffix.get(comps[-k:], []) if shapes[p] == shapes[t]]
            if len(cands) == 1:
                links[t] = cands[0]
                break
            if len(cands) > 1:
                break
    return links


def module_path(path: str) -> str:
    """``0/blocks/3/attn/q/kernel/value`` -> ``blocks.3.attn.q`` (the owning module)."""
    comps = [c for c in path.split("/") if c]
    if comps and comps[-1] == "value":
        comps = comps[:-1]
    comps = comps[:-1]
    while comps and comps[0].isdigit():
        comps = comps[1:]
    return ".".join(comps)


@api_boundary
def trace(fn: Callable[..., Any], /, *args: Any, name: str | None = None) -> OpGraph:
    """Traces ``fn(*args)`` into an :class:`OpGraph`, abstractly (nothing is allocated).

    Args:
      fn: any JAX-traceable function of pytrees of arrays, e.g. a train step
        ``(state, batch) -> (state, metrics)``.
      *args: example arguments: arrays or ``jax.ShapeDtypeStruct`` pytrees.
      name: a name for the graph (default: ``fn.__name__``).

    Returns:
      The op graph with phases, parameters (key paths relative to their argument) and layers.

    Raises:
      TraceError: a leaf is not an array, or ``fn`` cannot be traced.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> g = trace(lambda w, x: jnp.tanh(x @ w).sum(),
      ...           jax.ShapeDtypeStruct((4, 4), jnp.float32),
      ...           jax.ShapeDtypeStruct((2, 4), jnp.float32))
      >>> g.total_flops()  # 64 in the matmul, 7 in the sum; tanh is a transcendental
      71.0
    """
    leaves = check_leaves(args)
    with gc_paused():  # JAX's trace of a large step allocates millions of objects too
        try:
            traced = jax.jit(fn).trace(*args)
        except TraceError:
            raise
        except Exception as e:  # the user's function failed to trace: say where, keep the cause
            raise TraceError(format_error(
                f"Tracing {getattr(fn, '__name__', fn)!r} failed: {type(e).__name__}: {e}"[:2000],
                remedy="make the function traceable with jax.jit on these argument shapes")) from e
        return build_graph(traced, leaves, name=name or str(getattr(fn, "__name__", "fn")))


def build_graph(traced: jax.stages.Traced, leaves: Sequence[tuple[str, Any]], /, *,
                name: str) -> OpGraph:
    """Shardplan's passes over a traced function: flatten and cost, phases and roles, layers.

    :func:`trace` is :func:`check_leaves`, ``jax.jit(fn).trace(*args)``, then this; it is apart
    so that the two halves can be timed apart (``benchmarks/trace_scale.py``).

    Args:
      traced: ``jax.jit(fn).trace(*args)``.
      leaves: ``check_leaves(args)``.
      name: the graph's name.

    Returns:
      The op graph.

    Raises:
      TraceError: the jaxpr's inputs do not line up with ``leaves``.
    """
    with gc_paused():
        flat = flatten_jaxpr(traced.jaxpr)
        if len(flat.inputs) != len(leaves):
            raise TraceError(format_error(
                "The traced jaxpr's inputs do not line up with the argument leaves.",
                value=(len(flat.inputs), len(leaves)),
                remedy="pass every argument as a pytree of arrays (no static arguments)"))
        input_paths = {t: p for t, (p, _) in zip(flat.inputs, leaves, strict=True)}
        out_leaves = jax.tree_util.tree_flatten_with_path(traced.out_info)[0]
        output_paths = _keystrs([p for p, _ in out_leaves])
        in_path_set = set(input_paths.values())
        state_outputs = {t for t, p in zip(flat.outputs, output_paths, strict=True)
                         if t is not None and p in in_path_set}
        phases = _phases(flat, state_outputs)
        return _build(flat, phases, input_paths, output_paths, name)


def _build(flat: FlatGraph, phases: list[Phase], input_paths: dict[int, str],
           output_paths: list[str], name: str) -> OpGraph:
    shapes, dtypes = flat.tensor_shapes, flat.tensor_dtypes
    n_tensors = len(shapes)
    nbytes = list(map(flat.signature_bytes.__getitem__, flat.tensor_signatures))
    tensors = tuple(map(TensorDraft.freeze, map(
        TensorDraft, range(n_tensors), shapes, dtypes, flat.tensor_producers, nbytes)))
    consumers: list[list[int]] = [[] for _ in range(n_tensors)]
    for i, op in enumerate(flat.ops):
        for t in op.inputs:
            consumers[t].append(i)
    readers = {t: _readers(flat, consumers, t) for t in flat.inputs}
    roles = _roles(phases, readers, {t for t in flat.inputs if _arg_index(input_paths[t]) == 0})
    param_ts = [t for t in flat.inputs if roles[t] == "parameter"]
    opt_ts = [t for t in flat.inputs if roles[t] == "optimizer_state"]
    links = _link_state(input_paths, shapes, param_ts, opt_ts)
    param_paths = {t: input_paths[t] for t in param_ts}
    assignment = assign_layers(flat, phases, param_paths, state_links=links,
                               tensor_bytes=nbytes, sources=[op.source for op in flat.ops])
    stacked = {t for st in assignment.stacks for ids in st.instance_params for t in ids}
    glue = set(param_ts) - stacked
    layers, unit_layers = _make_layers(flat, phases, assignment, param_paths, glue, readers,
                                       links, tensors)
    op_layers = _op_layers(assignment, unit_layers)
    layer_of_tensor = _param_layers(assignment, unit_layers, glue, readers, phases, links)
    scopes = _scopes(flat, param_paths, layers, op_layers)
    # The drafts' last three fields (placeholders so far, see FlatGraph), then the values.
    ops = []
    for op, phase, scope, op_layer in zip(flat.ops, phases, scopes, op_layers, strict=True):
        op.phase = phase
        op.scope = scope
        op.layers = op_layer
        ops.append(op.freeze())
    parameters = tuple(
        Parameter(path=_strip_arg(input_paths[t]), arg_index=_arg_index(input_paths[t]),
                  tensor=t, shape=shapes[t], dtype=dtypes[t],
                  role=roles[t], readers=tuple(readers[t]), layer=layer_of_tensor.get(t),
                  stacked=t in stacked and any(st.scan_loops for st in assignment.stacks
                                               if t in st.instance_params[0]),
                  param_path=_strip_arg(input_paths[links[t]]) if t in links else None)
        for t in flat.inputs)
    return OpGraph(name=name, ops=tuple(ops), tensors=tensors, inputs=tuple(flat.inputs),
                   outputs=tuple(flat.outputs), output_paths=tuple(output_paths),
                   parameters=parameters, layers=tuple(layers),
                   unknown_primitives=tuple(flat.unknown_primitives),
                   notes=tuple(flat.notes) + assignment.notes)


def _arg_index(full_path: str) -> int:
    head = full_path.split("/", 1)[0]
    return int(head) if head.isdigit() else 0


def _strip_arg(full_path: str) -> str:
    parts = full_path.split("/", 1)
    return parts[1] if len(parts) == 2 else ""


def _make_layers(flat: FlatGraph, phases: list[Phase], a: LayerAssignment,
                 param_paths: dict[int, str], glue: set[int], readers: dict[int, list[int]],
                 links: dict[int, int], tensors: tuple[Tensor, ...]
                 ) -> tuple[list[Layer], dict[int, tuple[int, ...]]]:
    """Builds Layer values: pre, the stack instances (a scan expands to its length), post,
    shared. Returns them and, per unit id (incl. PRE/POST/SHARED), its layer indices."""
    ops_of: dict[int, list[int]] = {}
    for op_id, u in enumerate(a.op_unit):
        ops_of.setdefault(u, []).append(op_id)
    glue_unit: dict[int, int] = {}
    for t in glue:
        fwd_readers = [o for o in readers[t] if phases[o] in _FORWARD_PHASES]
        glue_unit[t] = a.op_unit[fwd_readers[0]] if fwd_readers else PRE
        if glue_unit[t] >= 0:
            glue_unit[t] = PRE
    specs: list[tuple[int, str, str, str | None, float, list[int]]] = []
    # (unit, name, kind, stack, share, param tensors)
    if ops_of.get(PRE) or any(u == PRE for u in glue_unit.values()):
        specs.append((PRE, "pre", "pre", None, 1.0,
                      [t for t, u in glue_unit.items() if u == PRE]))
    for u, unit in enumerate(a.units):
        st = a.stacks[unit.stack]
        ids = list(st.instance_params[unit.instance])
        if st.scan_loops:
            for k in range(st.length):
                specs.append((u, st.instance_names[k], "block", st.name, 1.0 / st.length, ids))
        else:
            specs.append((u, st.instance_names[unit.instance], "block", st.name, 1.0, ids))
    if ops_of.get(POST) or any(u == POST for u in glue_unit.values()):
        specs.append((POST, "post", "post", None, 1.0,
                      [t for t, u in glue_unit.items() if u == POST]))
    if ops_of.get(SHARED):
        specs.append((SHARED, "shared", "shared", None, 1.0, []))
    unit_layers: dict[int, list[int]] = {}
    layers: list[Layer] = []
    # The layers of a scanned stack share their ops, parameters and share of each op: their
    # FLOPs and fingerprint are computed once, per (unit, share).
    shared: dict[tuple[int, float], tuple[dict[str, float], str]] = {}
    prints = _Fingerprints(flat)
    for idx, (u, lname, kind, stack, share, pids) in enumerate(specs):
        unit_layers.setdefault(u, []).append(idx)
        ops = ops_of.get(u, [])
        if (u, share) not in shared:
            flops, keys = _layer_ops(flat, phases, ops, share)
            rel = _relative_paths(a, u, pids, param_paths)
            params = [repr(("param", rel[t], tensors[t].shape, tensors[t].dtype)) for t in pids]
            shared[(u, share)] = flops, prints(keys, params)
        flops, print_ = shared[(u, share)]
        pbytes = sum(tensors[t].nbytes for t in pids) * share
        layers.append(Layer(index=idx, name=lname, kind=kind, stack=stack,  # type: ignore[arg-type]
                            fingerprint=print_, ops=tuple(ops), op_share=share,
                            params=tuple(_strip_arg(param_paths[t]) for t in pids),
                            param_bytes=int(pbytes), flops=dict(flops)))
    return layers, {u: tuple(v) for u, v in unit_layers.items()}


_ItemKey = tuple[str, str, tuple[int, ...], tuple[int, ...], str, float]
"""An op's fingerprint item, as (phase, primitive, input signature ids, output signature ids,
attributes' repr, executions): see _Fingerprints."""


class _Fingerprints:
    """Layer fingerprints (:func:`~shardplan.trace.layers.fingerprint`) from item keys.

    A layer's fingerprint hashes the ``repr`` of one item per op, ``(phase, primitive,
    ((shape, dtype) of each input), (... of each output), sorted attributes, executions)``,
    and of one per parameter. Ops come here as *keys* that determine their item's text: the
    same strings and numbers, the attributes already as text, and each (shape, dtype) pair as
    its signature id (equal ids, equal pairs). Layers with equal keys in equal
    order (the blocks of a Python loop) have equal texts, so each distinct layer is written
    out and hashed once; any other layer is simply written out too.
    """

    def __init__(self, flat: FlatGraph) -> None:
        self._pairs = [repr(pair) for pair in flat.signatures]
        self._done: dict[tuple[tuple[_ItemKey, ...], tuple[str, ...]], str] = {}

    def __call__(self, keys: list[_ItemKey], params: list[str]) -> str:
        """The fingerprint of a layer: ``keys`` of its ops, reprs of its parameter items."""
        done = (tuple(keys), tuple(params))
        text = self._done.get(done)
        if text is None:
            text = self._done[done] = fingerprint_reprs(list(map(self._item, keys)) + params)
        return text

    def _item(self, key: _ItemKey) -> str:
        phase, primitive, ins, outs, attrs, count = key
        return f"({phase!r}, {primitive!r}, {self._tuple(ins)}, {self._tuple(outs)}, " \
               f"{attrs}, {count!r})"  # a 6-tuple's repr

    def _tuple(self, sigs: tuple[int, ...]) -> str:
        """``repr`` of the tuple of (shape, dtype) pairs with signature ids ``sigs``."""
        texts = list(map(self._pairs.__getitem__, sigs))
        return f"({texts[0]},)" if len(texts) == 1 else f"({', '.join(texts)})"


def _layer_ops(flat: FlatGraph, phases: list[Phase], ops: list[int], share: float
               ) -> tuple[dict[str, float], list[_ItemKey]]:
    """A layer's FLOPs per phase and the fingerprint keys of its ops (see _Fingerprints).

    An op takes part in the fingerprint unless XLA folds it away or it works on scalars only
    (a running sum of per-layer auxiliary losses, which the first layer starts from a literal
    zero): such ops have exactly one sharding and no cost, so they do not distinguish layers
    for the solver.
    """
    flops: dict[str, float] = {}
    keys: list[_ItemKey] = []
    shapes, op_flops = flat.tensor_shapes, flat.op_flops
    signature = flat.tensor_signatures.__getitem__
    for o in ops:
        op = flat.ops[o]
        phase = phases[o]
        flops[phase] = flops.get(phase, 0.0) + op_flops[o] * op.count * share
        attrs = op.attrs
        if attrs.get("folded") or not (any(map(shapes.__getitem__, op.inputs))
                                       or any(map(shapes.__getitem__, op.outputs))):
            continue
        keys.append((phase, op.primitive, tuple(map(signature, op.inputs)),
                     tuple(map(signature, op.outputs)),
                     repr(tuple(sorted(attrs.items()))) if attrs else "()", op.count * share))
    return flops, keys


def _relative_paths(a: LayerAssignment, u: int, pids: list[int],
                    param_paths: dict[int, str]) -> dict[int, str]:
    if u >= 0:
        unit = a.units[u]
        return dict(a.stacks[unit.stack].relative_paths[unit.instance])
    return {t: param_paths[t] for t in pids}


def _op_layers(a: LayerAssignment, unit_layers: dict[int, tuple[int, ...]]
               ) -> list[tuple[int, ...]]:
    return [unit_layers.get(u, ()) for u in a.op_unit]


def _param_layers(a: LayerAssignment, unit_layers: dict[int, tuple[int, ...]], glue: set[int],
                  readers: dict[int, list[int]], phases: list[Phase],
                  links: dict[int, int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for u, unit in enumerate(a.units):
        st = a.stacks[unit.stack]
        if st.scan_loops:
            continue  # a stacked leaf belongs to every layer of its stack
        for t in st.instance_params[unit.instance]:
            out[t] = unit_layers[u][0]
    for t in glue:
        fwd = [o for o in readers[t] if phases[o] in _FORWARD_PHASES]
        u = a.op_unit[fwd[0]] if fwd else PRE
        u = PRE if u >= 0 else u
        if u in unit_layers:
            out[t] = unit_layers[u][0]
    for opt_t, p in links.items():
        if p in out:
            out[opt_t] = out[p]
    return out


def _scopes(flat: FlatGraph, param_paths: dict[int, str], layers: list[Layer],
            op_layers: list[tuple[int, ...]]) -> list[str]:
    """Each op's module scope: its user ``named_scope`` s, else the module of the first
    parameter it reads, else its layer's name (or stack's, for several layers).

    Name stacks repeat (every op of a block's attention shares one), so each is parsed once.
    """
    user_scopes = {stack: user_scope(stack) for stack in set(flat.name_stacks)}
    modules = {t: module_path(p) for t, p in param_paths.items()}
    no_module = modules.keys().isdisjoint
    out = list(map(user_scopes.__getitem__, flat.name_stacks))
    for i, scope in enumerate(out):
        if scope:
            continue
        op = flat.ops[i]
        if not no_module(op.inputs):
            out[i] = next(modules[t] for t in op.inputs if t in modules)
        elif op_layers[i]:
            first = layers[op_layers[i][0]]
            out[i] = first.name if len(op_layers[i]) == 1 else (first.stack or first.name)
    return out
