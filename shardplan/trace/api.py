"""``trace(fn, *args) -> OpGraph``: the entry point of the trace stage."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from shardplan._traceback import api_boundary
from shardplan.errors import TraceError, format_error
from shardplan.trace.flatten import FlatGraph, flatten_jaxpr, user_scope
from shardplan.trace.graph import Layer, Op, OpGraph, Parameter, Phase, Role, Tensor
from shardplan.trace.layers import POST, PRE, SHARED, LayerAssignment, assign_layers, fingerprint

__all__ = ["check_leaves", "trace"]

_FORWARD_PHASES = ("forward", "recompute")


def _keystr(path: Sequence[Any]) -> str:
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


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
    out = []
    for path, leaf in leaves:
        ok = isinstance(leaf, jax.ShapeDtypeStruct | jax.Array | np.ndarray | np.generic
                        | bool | int | float | complex)
        if not ok:
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
        out.append((_keystr(path), leaf))
    return out


def _raw_phase(stack: str) -> Phase | None:
    if "transpose(" in stack:
        return "recompute" if "rematted_computation" in stack else "backward"
    if "jvp(" in stack:
        return "forward"
    return None


def _phases(flat: FlatGraph, state_outputs: set[int]) -> list[Phase]:
    raw = [_raw_phase(op.name_stack) for op in flat.ops]
    ad = [i for i, p in enumerate(raw) if p is not None]
    if not ad:
        return ["forward"] * len(raw)
    first_ad = ad[0]
    # Which ops contribute to the new state (reverse reachability from the state outputs).
    live = set(state_outputs)
    contributes = [False] * len(flat.ops)
    for i in range(len(flat.ops) - 1, -1, -1):
        op = flat.ops[i]
        if any(t in live for t in op.outputs):
            contributes[i] = True
            live.update(op.inputs)
    phases: list[Phase] = []
    for i, p in enumerate(raw):
        if p is not None:
            phases.append(p)
        elif i < first_ad:
            phases.append("forward")
        else:
            phases.append("update" if contributes[i] else "other")
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


def _roles(phases: list[Phase], readers: dict[int, list[int]]) -> dict[int, Role]:
    roles: dict[int, Role] = {}
    for t, ops in readers.items():
        seen = {phases[o] for o in ops}
        if not ops:
            roles[t] = "unused"
        elif seen & {"forward", "recompute"} and "update" in seen:
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
      >>> g.total_flops()
      75.0
    """
    leaves = check_leaves(args)
    try:
        traced = jax.jit(fn).trace(*args)
    except TraceError:
        raise
    except Exception as e:  # the user's function failed to trace: say where, keep the cause
        raise TraceError(format_error(
            f"Tracing {getattr(fn, '__name__', fn)!r} failed: {type(e).__name__}: {e}"[:2000],
            remedy="make the function traceable with jax.jit on these argument shapes")) from e
    flat = flatten_jaxpr(traced.jaxpr)
    if len(flat.inputs) != len(leaves):
        raise TraceError(format_error(
            "The traced jaxpr's inputs do not line up with the argument leaves.",
            value=(len(flat.inputs), len(leaves)),
            remedy="pass every argument as a pytree of arrays (no static arguments)"))
    input_paths = {t: p for t, (p, _) in zip(flat.inputs, leaves, strict=True)}
    out_leaves = jax.tree_util.tree_flatten_with_path(traced.out_info)[0]
    output_paths = [_keystr(p) for p, _ in out_leaves]
    in_path_set = set(input_paths.values())
    state_outputs = {t for t, p in zip(flat.outputs, output_paths, strict=True)
                     if t is not None and p in in_path_set}
    phases = _phases(flat, state_outputs)
    return _build(flat, phases, input_paths, output_paths,
                  name or str(getattr(fn, "__name__", "fn")))


def _build(flat: FlatGraph, phases: list[Phase], input_paths: dict[int, str],
           output_paths: list[str], name: str) -> OpGraph:
    n_tensors = len(flat.tensor_shapes)
    tensors = tuple(
        Tensor(id=i, shape=flat.tensor_shapes[i], dtype=flat.tensor_dtypes[i],
               producer=flat.tensor_producers[i],
               nbytes=_nbytes(flat.tensor_shapes[i], flat.tensor_dtypes[i]))
        for i in range(n_tensors))
    consumers: list[list[int]] = [[] for _ in range(n_tensors)]
    for i, op in enumerate(flat.ops):
        for t in op.inputs:
            consumers[t].append(i)
    readers = {t: _readers(flat, consumers, t) for t in flat.inputs}
    roles = _roles(phases, readers)
    param_ts = [t for t in flat.inputs if roles[t] == "parameter"]
    opt_ts = [t for t in flat.inputs if roles[t] == "optimizer_state"]
    links = _link_state(input_paths, flat.tensor_shapes, param_ts, opt_ts)
    param_paths = {t: input_paths[t] for t in param_ts}
    assignment = assign_layers(
        flat, phases, param_paths, state_links=links,
        tensor_bytes=[t.nbytes for t in tensors], sources=[op.source for op in flat.ops])
    stacked = {t for st in assignment.stacks for ids in st.instance_params for t in ids}
    glue = set(param_ts) - stacked
    layers, unit_layers = _make_layers(flat, phases, assignment, param_paths, glue, readers,
                                       links, tensors)
    op_layers = _op_layers(assignment, unit_layers)
    layer_of_tensor = _param_layers(assignment, unit_layers, glue, readers, phases, links)
    ops = tuple(
        Op(id=i, primitive=op.primitive, inputs=tuple(op.inputs), outputs=tuple(op.outputs),
           flops=float(op.flops), transcendentals=float(op.transcendentals),
           bytes_read=op.bytes_read, bytes_written=op.bytes_written, count=op.count,
           loop_trips=op.loop_trips, phase=phases[i],
           scope=_scope(op.name_stack, op.inputs, param_paths, layers, op_layers[i]),
           source=op.source, layers=op_layers[i], loop=op.loop, structural=op.structural,
           attrs=op.attrs, path=op.path)
        for i, op in enumerate(flat.ops))
    parameters = tuple(
        Parameter(path=_strip_arg(input_paths[t]), arg_index=_arg_index(input_paths[t]),
                  tensor=t, shape=flat.tensor_shapes[t], dtype=flat.tensor_dtypes[t],
                  role=roles[t], readers=tuple(readers[t]), layer=layer_of_tensor.get(t),
                  stacked=t in stacked and any(st.scan_loops for st in assignment.stacks
                                               if t in st.instance_params[0]),
                  param_path=_strip_arg(input_paths[links[t]]) if t in links else None)
        for t in flat.inputs)
    return OpGraph(name=name, ops=ops, tensors=tensors, inputs=tuple(flat.inputs),
                   outputs=tuple(flat.outputs), output_paths=tuple(output_paths),
                   parameters=parameters, layers=tuple(layers),
                   unknown_primitives=tuple(flat.unknown_primitives),
                   notes=tuple(flat.notes) + assignment.notes)


@functools.lru_cache(maxsize=256)
def _itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys)
        return 8


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = _itemsize(dtype)
    for d in shape:
        n *= d
    return n


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
    op_items: dict[tuple[int, float], list[object]] = {}
    for idx, (u, lname, kind, stack, share, pids) in enumerate(specs):
        unit_layers.setdefault(u, []).append(idx)
        ops = ops_of.get(u, [])
        flops: dict[str, float] = {}
        for o in ops:
            op = flat.ops[o]
            flops[phases[o]] = flops.get(phases[o], 0.0) + op.flops * op.count * share
        rel = _relative_paths(a, u, pids, param_paths)
        if (u, share) not in op_items:  # the layers of a scanned stack share their ops
            op_items[(u, share)] = [
                (phases[o], flat.ops[o].primitive,
                 tuple((tensors[t].shape, tensors[t].dtype) for t in flat.ops[o].inputs),
                 tuple((tensors[t].shape, tensors[t].dtype) for t in flat.ops[o].outputs),
                 tuple(sorted(flat.ops[o].attrs.items())), flat.ops[o].count * share)
                for o in ops if _fingerprinted(flat, o)]
        items: list[object] = list(op_items[(u, share)])
        items += [("param", rel[t], tensors[t].shape, tensors[t].dtype) for t in pids]
        pbytes = sum(tensors[t].nbytes for t in pids) * share
        layers.append(Layer(index=idx, name=lname, kind=kind, stack=stack,  # type: ignore[arg-type]
                            fingerprint=fingerprint(items), ops=tuple(ops), op_share=share,
                            params=tuple(_strip_arg(param_paths[t]) for t in pids),
                            param_bytes=int(pbytes), flops=flops))
    return layers, {u: tuple(v) for u, v in unit_layers.items()}


def _fingerprinted(flat: FlatGraph, op_id: int) -> bool:
    """Whether an op takes part in its layer's fingerprint.

    Ops XLA folds away and ops on scalars only (a running sum of per-layer auxiliary losses,
    which the first layer starts from a literal zero) have exactly one sharding and no cost, so
    they do not distinguish layers for the solver.
    """
    op = flat.ops[op_id]
    if op.attrs.get("folded"):
        return False
    shapes = flat.tensor_shapes
    return any(shapes[t] for t in op.inputs) or any(shapes[t] for t in op.outputs)


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


def _scope(name_stack: str, inputs: list[int], param_paths: dict[int, str],
           layers: list[Layer], op_layers: tuple[int, ...]) -> str:
    scope = user_scope(name_stack)
    if scope:
        return scope
    for t in inputs:
        if t in param_paths:
            return module_path(param_paths[t])
    if len(op_layers) == 1:
        return layers[op_layers[0]].name
    if op_layers:
        return layers[op_layers[0]].stack or layers[op_layers[0]].name
    return ""
