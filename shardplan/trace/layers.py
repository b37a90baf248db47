"""Finds the repeated block structure of a traced train step and assigns every op to a layer.

The mechanism is general (no module hooks, no names assumed):

1. **Stacks** come from the parameters. A Python loop over blocks gives key paths
   ``.../blocks/<i>/...`` whose per-index leaves have identical relative paths, shapes and dtypes;
   a scan over stacked blocks gives a ``scan`` whose per-iteration inputs (``xs``) are parameter
   leaves. Each stack has *instances* (one per block; a scanned stack is one instance standing for
   ``length`` layers).
2. **Anchors**: ops that read an instance's parameters (or run inside its scan) belong to it.
   Along the forward program order anchors must visit instances in order; along the backward
   order in reverse.
3. **Cuts**: between two consecutive instances (and between the first/last instance and the
   parameters used before/after the stack) the op sequence is cut at one position of the gap.
   The position minimises, in this order: the number of ops put on the side whose code they do
   not share a source line with, the bytes of values crossing the cut (the interface between
   layers: the residual stream in a transformer); among equals, forward ops stay with the layer
   they follow and backward ops with the layer they precede (the mirror image). Every gap is cut by the same rule, so identical blocks get
   identical op sets. Edges of the stack that no outside parameter bounds (a loss computed
   directly on the last block) are cut at the same distance from the anchors as the interior
   gaps.
4. **Update ops** take the layer of the parameter, gradient and optimizer-state values they read;
   ops that combine several layers (a global gradient norm) form the ``shared`` layer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import re
from collections.abc import Sequence

from shardplan.trace.flatten import FlatGraph
from shardplan.trace.graph import OpDraft

# (Past 600 lines: finding stacks, cutting the op sequence into units and labelling the update
# by leaf are one algorithm over one assignment; the parts share its private state.)

__all__ = ["LayerAssignment", "Stack", "Unit", "assign_layers", "find_stacks", "fingerprint",
           "fingerprint_reprs"]

PRE = -1
"""Unit id of everything before the first block."""
POST = -2
"""Unit id of everything after the last block."""
SHARED = -3
"""Unit id of update ops that combine several layers."""


@dataclasses.dataclass(frozen=True)
class Stack:
    """A stack of identical blocks found in the parameters.

    Attributes:
      name: dotted module path of the stack (``blocks``).
      instance_params: per instance (in index order), the input tensor ids of its parameters.
      scan_loops: loop ids of the scans over this stack (empty for a Python-loop stack).
      length: number of layers (instances, or the scan length).
      relative_paths: per instance, ``{tensor id: path relative to the instance}``.
      instance_names: per layer, its dotted name (``blocks.3``, ``params.Block_3``).
    """

    name: str
    instance_params: tuple[tuple[int, ...], ...]
    scan_loops: tuple[int, ...]
    length: int
    relative_paths: tuple[dict[int, str], ...]
    instance_names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Unit:
    """One instance of a stack: a block (or, for a scanned stack, all of them at once)."""

    stack: int
    instance: int


@dataclasses.dataclass(frozen=True)
class LayerAssignment:
    """The result: a unit per op and the units in forward order."""

    op_unit: tuple[int, ...]  # index into `units`, or PRE / POST / SHARED
    units: tuple[Unit, ...]
    stacks: tuple[Stack, ...]
    notes: tuple[str, ...]


def _components(path: str) -> list[str]:
    return [c for c in path.split("/") if c]


_NAMED_INDEX = re.compile(r"^(.*[^_\d])_(\d+)$")


def _indexed(comp: str) -> tuple[str, int] | None:
    """``"3"`` -> ``("", 3)`` (a list index); ``"Block_3"`` -> ``("Block", 3)`` (Linen's
    automatic submodule names); anything else -> None."""
    if comp.isdigit():
        return "", int(comp)
    m = _NAMED_INDEX.match(comp)
    if m:
        return m.group(1), int(m.group(2))
    return None


def find_stacks(flat: FlatGraph, param_tensors: dict[int, str]) -> list[Stack]:
    """Finds layer stacks among parameter leaves.

    Args:
      flat: the flattened graph (for scans over parameters).
      param_tensors: ``{input tensor id: key path}`` of the trained parameters.

    Returns:
      The stacks, Python-loop stacks first.
    """
    stacks = _loop_stacks(flat, param_tensors)
    in_path_stack = {t for st in stacks for ids in st.instance_params for t in ids}
    return stacks + _scanned_stacks(flat, param_tensors, in_path_stack)


def _loop_stacks(flat: FlatGraph, param_tensors: dict[int, str]) -> list[Stack]:
    """The Python-loop stacks among the parameter leaves, by their path prefix."""
    # --- Python-loop stacks: an integer path component with identical per-index structure.
    by_prefix: dict[tuple[str, ...], dict[int, list[tuple[str, tuple, str, int]]]] = {}
    names: dict[tuple[tuple[str, ...], int], str] = {}
    for tid, path in param_tensors.items():
        comps = _components(path)
        for j, comp in enumerate(comps):
            indexed = _indexed(comp)
            if indexed is None:
                continue
            base, index = indexed
            sig = ("/".join(comps[j + 1:]), flat.tensor_shapes[tid], flat.tensor_dtypes[tid],
                   tid)
            prefix = (*comps[:j], base) if base else tuple(comps[:j])
            by_prefix.setdefault(prefix, {}).setdefault(index, []).append(sig)
            base = _dotted(comps[:j]) or ("layers" if not indexed[0] else "")
            names[(prefix, index)] = f"{base}.{comp}" if base else comp
    # Per prefix, the largest set of indices whose leaves agree (relative paths, shapes, dtypes):
    # `Dense_1..Dense_3` of a Linen MLP whose first and last layers have other shapes.
    chosen: dict[tuple[str, ...], list[int]] = {}
    for prefix, per_index in by_prefix.items():
        classes: dict[tuple, list[int]] = {}
        for index, sigs in per_index.items():
            classes.setdefault(tuple(sorted(s[:3] for s in sigs)), []).append(index)
        best = max(classes.values(), key=lambda ix: (len(ix), -min(ix)))
        if len(best) >= 2:
            chosen[prefix] = sorted(best)
    outermost = [p for p in chosen if not any(q != p and p[: len(q)] == q for q in chosen)]
    stacks: list[Stack] = []
    for prefix in sorted(outermost):
        per_index = by_prefix[prefix]
        idx = chosen[prefix]
        inst = tuple(tuple(sorted(s[3] for s in per_index[i])) for i in idx)
        rel = tuple({s[3]: s[0] for s in per_index[i]} for i in idx)
        stacks.append(Stack(name=_dotted(prefix) or "layers", instance_params=inst,
                            scan_loops=(), length=len(idx), relative_paths=rel,
                            instance_names=tuple(names[(prefix, i)] for i in idx)))
    return stacks


def _scanned_stacks(flat: FlatGraph, param_tensors: dict[int, str],
                    in_path_stack: set[int]) -> list[Stack]:
    """The scanned stacks: scans over parameters outside ``in_path_stack``, grouped by leaf."""
    # --- Scanned stacks: scans whose per-iteration inputs include parameters.
    groups: list[tuple[set[int], list[int], int]] = []
    for loop_id, xs in flat.loop_xs.items():
        scanned = {t for t in xs if t in param_tensors and t not in in_path_stack}
        if not scanned:
            continue
        for params, loops, _length in groups:
            if params & scanned:
                params |= scanned
                loops.append(loop_id)
                break
        else:
            groups.append((set(scanned), [loop_id], flat.loop_lengths[loop_id]))
    stacks: list[Stack] = []
    for params, loops, length in groups:
        ids = tuple(sorted(params))
        paths = [_components(param_tensors[t]) for t in ids]
        common = _common_prefix(paths)
        name = _dotted(common) or "scan"
        scan_rel = {t: "/".join(_components(param_tensors[t])[len(common):]) for t in ids}
        stacks.append(Stack(name=name, instance_params=(ids,), scan_loops=tuple(sorted(loops)),
                            length=length, relative_paths=(scan_rel,),
                            instance_names=tuple(f"{name}.{k}" for k in range(length))))
    return stacks


def _dotted(comps: Sequence[str]) -> str:
    """Path components as a dotted module name, without the leading tuple indices."""
    parts = list(comps)
    while parts and parts[0].isdigit():
        parts = parts[1:]
    return ".".join(parts)


def _common_prefix(paths: Sequence[Sequence[str]]) -> list[str]:
    if not paths:
        return []
    out: list[str] = []
    for parts in zip(*paths, strict=False):
        if all(p == parts[0] for p in parts):
            out.append(parts[0])
        else:
            break
    # Keep at least the parent of each leaf.
    return out[: min(len(p) for p in paths) - 1]


class _Cutter:
    """Cuts an op sequence at layer boundaries (see the module docstring)."""

    def __init__(self, flat: FlatGraph, seq: list[int], tensor_bytes: list[int]) -> None:
        self.seq = seq
        pos = {op: i for i, op in enumerate(seq)}
        n = len(seq)
        diff = [0] * (n + 2)
        last_use: dict[int, int] = {}
        ops, producers = flat.ops, flat.tensor_producers
        for i, op_id in enumerate(seq):
            for t in ops[op_id].inputs:
                p = producers[t]
                if p is not None and p in pos:
                    last_use[t] = i  # positions only grow: the last one wins
        for t, last in last_use.items():
            p = flat.tensor_producers[t]
            assert p is not None
            start = pos[p] + 1  # cuts c in (produced position, last use]
            diff[start] += tensor_bytes[t]
            diff[last + 1] -= tensor_bytes[t]
        self.crossing = [0] * (n + 1)
        acc = 0
        for c in range(n + 1):
            acc += diff[c]
            self.crossing[c] = acc

    def cut(self, lo: int, hi: int, left_pref: list[int], right_pref: list[int], *,
            prefer_late: bool) -> int:
        """Best cut position ``c`` in ``(lo, hi]``: ops at positions ``>= c`` go right.

        ``left_pref[i]``/``right_pref[i]`` are 1 when op ``i`` prefers that side (its source line
        only occurs in the left / right unit's code). Ops at ``lo`` and ``hi`` are anchors of the
        left and right unit.
        """
        # mismatch(c) = #right-preferring ops in (lo, c) + #left-preferring ops in [c, hi)
        mismatch = sum(left_pref[i] for i in range(lo + 1, hi))
        best: tuple[int, int, int] | None = None
        for c in range(lo + 1, hi + 1):
            if c > lo + 1:
                mismatch += right_pref[c - 1] - left_pref[c - 1]
            key = (mismatch, self.crossing[c], -c if prefer_late else c)
            if best is None or key < best:
                best = key
        assert best is not None
        return -best[2] if prefer_late else best[2]


def link_gradients(flat: FlatGraph, phases: Sequence[str], param_tensors: dict[int, str],
                   state_links: dict[int, int]) -> dict[int, int]:
    """Finds the gradient of each parameter among the backward pass's results.

    The update applies elementwise math to same-shaped arrays of one leaf (gradient, moments,
    parameter: ``mu' = b1·mu + (1-b1)·g``, ``p' = p + u``); merging the values such ops combine
    links each gradient to its parameter, whatever the optimizer.

    Returns:
      ``{backward tensor id: parameter tensor id}``.
    """
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.get(x, x) != x:
            parent[x] = parent.get(parent[x], parent[x])
            x = parent[x]
        return x

    def union(a: int, b: int) -> int:
        ra, rb = find(a), find(b)
        if ra == rb:
            return ra
        if rb in param_tensors and ra not in param_tensors:
            ra, rb = rb, ra
        parent[rb] = ra
        return ra

    tok: dict[int, int] = {t: t for t in param_tensors}
    for opt_t, p in state_links.items():
        tok[opt_t] = p
    shapes = flat.tensor_shapes
    consumed_by_update: set[int] = set()
    ops, producers = flat.ops, flat.tensor_producers
    for op_id in [i for i, phase in enumerate(phases) if phase == "update" or phase == "other"]:
        op = ops[op_id]
        for t in op.inputs:
            if t not in tok:
                tok[t] = t
                producer = producers[t]
                if producer is not None and phases[producer] in ("backward", "recompute"):
                    consumed_by_update.add(t)
        if len(op.inputs) == 1:  # both cases below give the outputs the input's token
            for t in op.outputs:
                tok[t] = tok[op.inputs[0]]
            continue
        big = [t for t in op.inputs if shapes[t]]
        if big and len({shapes[t] for t in big}) == 1:
            root = tok[big[0]]
            for t in big[1:]:
                root = union(root, tok[t])
            for t in op.outputs:
                tok[t] = root
        elif len(op.inputs) == 1:
            for t in op.outputs:
                tok[t] = tok[op.inputs[0]]
    out: dict[int, int] = {}
    for t in consumed_by_update:
        root = find(tok[t])
        if root in param_tensors:
            out[t] = root
    return out


def assign_layers(flat: FlatGraph, phases: Sequence[str], param_tensors: dict[int, str],
                  state_links: dict[int, int],
                  tensor_bytes: list[int], sources: Sequence[str]) -> LayerAssignment:
    """Assigns every op to a unit (a block instance, or pre / post / shared).

    Args:
      flat: the flattened graph.
      phases: the phase of each op.
      param_tensors: trained parameters, ``{input tensor id: key path}``.
      state_links: ``{optimizer-state tensor id: parameter tensor id}``.
      tensor_bytes: bytes of each tensor.
      sources: source line of each op.

    Returns:
      A :class:`LayerAssignment`.
    """
    stacks = find_stacks(flat, param_tensors)
    stacked = {t for st in stacks for ids in st.instance_params for t in ids}
    glue_tensors = set(param_tensors) - stacked
    notes: list[str] = []
    units, tensor_unit, loop_unit = _units(stacks)
    n_ops = len(flat.ops)
    op_unit = [SHARED] * n_ops
    if not units:
        notes.append("no repeated layer stack found: the model is one layer")
        return LayerAssignment(op_unit=tuple([PRE] * n_ops), units=(), stacks=(),
                               notes=tuple(notes))
    grads = link_gradients(flat, phases, param_tensors, state_links)
    for g, p in grads.items():
        if p in tensor_unit:
            tensor_unit[g] = tensor_unit[p]
    fwd = [i for i in range(n_ops) if phases[i] == "forward"]
    bwd = [i for i in range(n_ops) if phases[i] in ("backward", "recompute")]
    # Each is asked several times per op below: work them out once.
    anchors: list[int | None] = [None] * n_ops
    glue_reads = [False] * n_ops
    for i in itertools.chain(fwd, bwd):
        anchors[i] = _anchor(flat.ops[i], tensor_unit, loop_unit)
        glue_reads[i] = _reads_glue(flat.ops[i], glue_tensors, grads)
    anchor_of, reads_glue_of = anchors.__getitem__, glue_reads.__getitem__
    order = _unit_order(fwd, anchors, len(units), notes)
    rank = {u: r for r, u in enumerate(order)}

    # Source lines prefer a side at a stack's edge. An op without one (an index normalised by
    # JAX itself) says nothing of the user's code: it prefers neither side, else it would tie
    # whatever else has no source line to the blocks in one form and not in the other.
    block_sources = {sources[i] for i in fwd if anchors[i] is not None} - {""}
    glue_sources = {sources[i] for i in fwd if anchors[i] is None and glue_reads[i]} - {""}
    fwd_labels = _segment(flat, fwd, anchor_of, reads_glue_of, rank, order,
                          block_sources - glue_sources, glue_sources - block_sources,
                          tensor_bytes, reverse=False, notes=notes)
    for op_id, u in zip(fwd, fwd_labels, strict=True):
        op_unit[op_id] = u
    # Backward: prefer sides by the forward code each source line belongs to.
    fwd_block_src = {sources[i] for i, u in zip(fwd, fwd_labels, strict=True) if u >= 0} - {""}
    fwd_glue_src = {sources[i] for i, u in zip(fwd, fwd_labels, strict=True) if u < 0} - {""}
    bwd_labels = _segment(flat, bwd, anchor_of, reads_glue_of, rank, order,
                          fwd_block_src - fwd_glue_src, fwd_glue_src - fwd_block_src,
                          tensor_bytes, reverse=True, notes=notes)
    for op_id, u in zip(bwd, bwd_labels, strict=True):
        op_unit[op_id] = u
    remap = {u: r for r, u in enumerate(order)}
    labels = [remap[u] if u >= 0 else u for u in op_unit]
    t_unit = {t: remap[u] for t, u in tensor_unit.items()}
    _label_update(flat, phases, labels, t_unit, glue_tensors, state_links)
    return LayerAssignment(op_unit=tuple(labels), units=tuple(units[u] for u in order),
                           stacks=tuple(stacks), notes=tuple(notes))


def _units(stacks: Sequence[Stack]) -> tuple[list[Unit], dict[int, int], dict[int, int]]:
    """The stacks' units, and the unit of each parameter tensor and of each scan loop."""
    units: list[Unit] = []
    tensor_unit: dict[int, int] = {}
    loop_unit: dict[int, int] = {}
    for s_idx, st in enumerate(stacks):
        for i_idx, ids in enumerate(st.instance_params):
            u = len(units)
            units.append(Unit(s_idx, i_idx))
            for t in ids:
                tensor_unit[t] = u
        for loop_id in st.scan_loops:
            loop_unit[loop_id] = len(units) - 1
    return units, tensor_unit, loop_unit


def _anchor(op: OpDraft, tensor_unit: dict[int, int], loop_unit: dict[int, int]) -> int | None:
    """The unit ``op`` is an anchor of (runs inside its scan or reads its parameters), or None."""
    for loop_id, _ in op.loop:
        if loop_id in loop_unit:
            return loop_unit[loop_id]
    if op.structural and op.attrs.get("loop") in loop_unit:
        return loop_unit[op.attrs["loop"]]
    for t in op.inputs:
        if t in tensor_unit:
            return tensor_unit[t]
    for t in op.outputs:
        if t in tensor_unit:  # the gradient of one of the unit's parameters
            return tensor_unit[t]
    return None


def _reads_glue(op: OpDraft, glue_tensors: set[int], grads: dict[int, int]) -> bool:
    """Reads a parameter outside the stacks, or computes such a parameter's gradient."""
    return (not glue_tensors.isdisjoint(op.inputs)
            or any(grads.get(t) in glue_tensors for t in op.outputs))


def _unit_order(fwd: Sequence[int], anchors: Sequence[int | None], n_units: int,
                notes: list[str]) -> list[int]:
    """The units by their first forward anchor, then those the forward pass never reads."""
    # Order units by first forward anchor.
    first: dict[int, int] = {}
    for pos, op_id in enumerate(fwd):
        a = anchors[op_id]
        if a is not None and a not in first:
            first[a] = pos
    order = sorted(first, key=first.__getitem__)
    missing = [u for u in range(n_units) if u not in first]
    if missing:
        notes.append(f"{len(missing)} stack instance(s) are never read in the forward pass")
        order += missing
    return order


def _segment(flat: FlatGraph, seq: list[int], anchor, reads_glue, rank: dict[int, int],
             order: list[int], block_src: set[str], glue_src: set[str],
             tensor_bytes: list[int], *, reverse: bool, notes: list[str]) -> list[int]:
    """Labels each op of ``seq`` with a unit (original id) or PRE / POST, by cutting gaps."""
    n = len(seq)
    if n == 0:
        return []
    srcs = [flat.ops[i].source for i in seq]
    is_block_src = [1 if s in block_src else 0 for s in srcs]
    is_glue_src = [1 if s in glue_src else 0 for s in srcs]
    anchors = [anchor(i) for i in seq]
    # First and last position of each unit's anchors.
    span: dict[int, list[int]] = {}
    for pos, a in enumerate(anchors):
        if a is not None:
            span.setdefault(a, [pos, pos])[1] = pos
    present = sorted(span, key=lambda u: rank[u], reverse=reverse)
    # Monotonicity: spans must not interleave.
    for a, b in itertools.pairwise(present):
        if span[a][1] >= span[b][0]:
            notes.append(
                "layer anchors interleave in the "
                f"{'backward' if reverse else 'forward'} pass; op-to-layer assignment "
                "follows parameter reads only")
            return _label_by_reads(anchors, present, reverse)
    cutter = _Cutter(flat, seq, tensor_bytes)
    first_unit, last_unit = present[0], present[-1]
    before, after = (POST, PRE) if reverse else (PRE, POST)
    labels = [before] * n
    zeros = [0] * n
    # Ties: in the forward pass an op stays with the layer it follows; the backward pass mirrors
    # that (the gradient of that op comes before the previous layer's backward).
    late = not reverse
    interior = [cutter.cut(span[a][1], span[b][0], zeros, zeros, prefer_late=late)
                for a, b in itertools.pairwise(present)]
    # How far interior cuts sit from the anchors: the edges of the stack are cut the same way
    # when no parameter outside the stack bounds them (e.g. a loss computed on the last block).
    kept_left = _mode([c - span[a][1] - 1 for c, a in zip(interior, present, strict=False)])
    moved_right = _mode([span[b][0] - c for c, b in zip(interior, present[1:], strict=False)])
    start = span[first_unit][0]
    lo = max((p for p in range(start) if reads_glue(seq[p])), default=-1)
    if lo >= 0 or moved_right is None:
        c0 = cutter.cut(lo, start, is_glue_src, is_block_src, prefer_late=late)
    else:
        c0 = max(0, start - moved_right)
    end = span[last_unit][1]
    hi = min((p for p in range(end + 1, n) if reads_glue(seq[p])), default=n)
    if hi < n or kept_left is None:
        c_end = cutter.cut(end, hi, is_block_src, is_glue_src, prefer_late=late)
    else:
        c_end = min(n, end + 1 + kept_left)
    boundaries = [c0, *interior, c_end]
    for k, u in enumerate(present):
        for pos in range(boundaries[k], boundaries[k + 1]):
            labels[pos] = u
    for pos in range(c_end, n):
        labels[pos] = after
    return labels


def _mode(values: list[int]) -> int | None:
    """The most common value (the smallest among equals), or None for no values."""
    if not values:
        return None
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return min(counts, key=lambda v: (-counts[v], v))


def _label_by_reads(anchors: list[int | None], present: list[int], reverse: bool) -> list[int]:
    labels: list[int] = []
    current = PRE if not reverse else POST
    for a in anchors:
        if a is not None:
            current = a
        labels.append(current)
    return labels


def _label_update(flat: FlatGraph, phases: Sequence[str], labels: list[int],
                  t_unit: dict[int, int], glue_tensors: set[int],
                  state_links: dict[int, int]) -> None:
    """Labels update/other ops by the layers of the values they read (in place).

    An update op belongs to a layer when it only touches values of one *leaf* of that layer
    (a parameter, its gradient and its optimizer state, merged as elementwise ops combine
    same-shaped arrays). An op that combines values of different leaves (the running sum of a
    global gradient norm), or of no layer (a step counter), goes to ``shared``.
    """
    update_ops = [i for i, phase in enumerate(phases) if phase in ("update", "other")]
    # Below, t_unit is read for the operands of update ops only: label those that the forward
    # and backward passes compute by their producer, and the parameters outside the stacks by
    # their first forward reader.
    producers = flat.tensor_producers
    for op_id in update_ops:
        for t in flat.ops[op_id].inputs:
            p = producers[t]
            if p is not None and phases[p] in ("forward", "backward", "recompute"):
                t_unit[t] = labels[p]
    if glue_tensors:
        for op_id, op in enumerate(flat.ops):
            if phases[op_id] == "forward" and not glue_tensors.isdisjoint(op.inputs):
                for t in op.inputs:
                    if t in glue_tensors and t not in t_unit:
                        t_unit[t] = labels[op_id]
    for opt_t, param_t in state_links.items():
        if param_t in t_unit:
            t_unit[opt_t] = t_unit[param_t]
    _label_by_leaf(flat, update_ops, labels, t_unit, state_links)


def _label_by_leaf(flat: FlatGraph, update_ops: list[int], labels: list[int],
                   t_unit: dict[int, int], state_links: dict[int, int]) -> None:
    """The second half of :func:`_label_update`: merges the values of one leaf (union-find
    over tokens) and labels each update op, in program order."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(x, x) != root:
            parent[x], x = root, parent[x]
        return root

    def token(t: int) -> int:
        x = state_links.get(t, t)
        up = parent.get(x, x)
        if up == x or parent.get(up, up) == up:  # a root or a root's child: nothing to compress
            return up
        return find(x)

    shape_of = flat.tensor_shapes.__getitem__
    unit_of, not_shared = t_unit.get, SHARED.__ne__
    for op_id in update_ops:
        op = flat.ops[op_id]
        units = list(map(unit_of, op.inputs, itertools.repeat(SHARED)))
        ins = list(itertools.compress(op.inputs, map(not_shared, units)))
        if len(ins) < len(units) and not any(map(shape_of, op.outputs)):
            # A scalar combined with a shared scalar (a running sum over leaves): shared.
            ins = []
        if len(ins) <= 1:  # the general case below, for one value (or none): its leaf's
            label = SHARED if not ins else t_unit[ins[0]]
            labels[op_id] = label
            single = token(ins[0]) if ins else SHARED
            for t in op.outputs:
                t_unit[t] = label
                if label != SHARED:
                    parent[t] = single
            continue
        layers_seen = set(filter(not_shared, units))
        tokens = set(map(token, ins))  # in the order of ins: find compresses paths as it goes
        big = set(filter(None, map(shape_of, ins)))  # the shapes of the non-scalars
        if len(big) == 1 and len(tokens) > 1:
            # Elementwise math on same-shaped arrays of one leaf (param, grad, moments).
            root = tokens.pop()
            for other in tokens:
                parent[find(other)] = root
            tokens = {root}
        label = next(iter(layers_seen)) if len(layers_seen) == 1 and len(tokens) == 1 else SHARED
        labels[op_id] = label
        for t in op.outputs:
            t_unit[t] = label
            if len(tokens) == 1 and label != SHARED:
                parent[t] = next(iter(tokens))


def fingerprint(items: Sequence[object]) -> str:
    """A short stable hash of a canonical description: the sorted ``repr`` s of its items, each
    followed by a zero byte."""
    return fingerprint_reprs(list(map(repr, items)))


def fingerprint_reprs(reprs: list[str]) -> str:
    """:func:`fingerprint` of the items whose ``repr`` s are ``reprs``."""
    if not reprs:
        return hashlib.sha256().hexdigest()[:16]
    reprs.sort()
    return hashlib.sha256(("\0".join(reprs) + "\0").encode()).hexdigest()[:16]
