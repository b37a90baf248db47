"""Sharding of every tensor of an OpGraph, and the collectives and per-device work it implies.

Given a :class:`~shardplan.cluster.mesh.LogicalMesh` and the shardings of some tensors (the
inputs: parameters, optimizer state, batch; and the outputs), :func:`analyze_sharding`

1. **propagates** shardings through the op rules of :mod:`shardplan.cost.rules`, forward and
   backward until nothing changes (as Shardy does between the user's annotations): a tensor
   dimension takes the mesh axes of the factor it belongs to; within one op an axis goes to one
   factor only, result (batch, free) factors before contracted ones;
2. **places each op**: its factors take the axes their operands carry, then (where free, since
   slicing costs nothing) those its results want;
3. **derives the communication**: an operand carrying axes its op does not use is all-gathered
   (all-to-all when the axis only moves to another dimension); a result of a sharded contraction
   is a partial sum, reduce-scattered where its consumers want it sharded on the reduced axes
   and all-reduced otherwise. The same tensor resharded the same way twice is counted once, as
   XLA's common-subexpression elimination does.

Specs are per-dimension tuples of mesh axis names, like a ``PartitionSpec`` with tuples:
``(("data",), (), ("model",))``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.rules import OpRule, op_rule
from shardplan.errors import ConfigError, format_error
from shardplan.trace.graph import OpGraph, Parameter

__all__ = ["CollectiveKind", "PredictedCollective", "ReshardStep", "ShardingAnalysis", "Spec",
           "analyze_sharding", "leaf_specs", "normalize_spec", "reduce_steps", "reshard_steps"]

Spec = tuple[tuple[str, ...], ...]
CollectiveKind = Literal["all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                         "collective-permute"]
_MAX_ROUNDS = 8


@dataclasses.dataclass(frozen=True, slots=True)
class PredictedCollective:
    """One collective the sharded program performs.

    Attributes:
      kind: all-reduce, all-gather, reduce-scatter or all-to-all.
      axes: the mesh axes it runs over.
      result_bytes: bytes of its result per device per execution (XLA's HLO convention).
      count: executions per step.
      tensor: the tensor it reshards or reduces.
      op: the op whose operand or result needed it.
    """

    kind: CollectiveKind
    axes: tuple[str, ...]
    result_bytes: int
    count: int
    tensor: int
    op: int


@dataclasses.dataclass(frozen=True)
class ShardingAnalysis:
    """The outcome of :func:`analyze_sharding`.

    Attributes:
      mesh: the mesh.
      specs: per tensor id, its sharding (as stored between ops).
      op_axes: per op id, the mesh axes its work is split over.
      collectives: the communication, in op order.
    """

    mesh: LogicalMesh
    specs: tuple[Spec, ...]
    op_axes: tuple[tuple[str, ...], ...]
    collectives: tuple[PredictedCollective, ...]

    def local_bytes(self, graph: OpGraph, tensor: int) -> int:
        """Bytes of ``tensor`` held by one device."""
        return graph.tensors[tensor].nbytes // _shards(self.mesh, self.specs[tensor])

    def per_device_flops(self, graph: OpGraph, *, count_loops: bool = True) -> float:
        """FLOPs one device executes per step (computation only)."""
        total = 0.0
        for op in graph.ops:
            count = op.count if count_loops else op.count // max(op.loop_trips, 1)
            total += op.flops * count / self.mesh.size(self.op_axes[op.id])
        return total

    def collective_summary(self, *, include_scalar: bool = True,
                           graph: OpGraph | None = None) -> dict[str, dict[str, int]]:
        """``{kind: {"count": executions, "bytes": per-device result bytes}}``."""
        out: dict[str, dict[str, int]] = {}
        for c in self.collectives:
            if not include_scalar and graph is not None and not graph.tensors[c.tensor].shape:
                continue
            row = out.setdefault(c.kind, {"count": 0, "bytes": 0})
            row["count"] += c.count
            row["bytes"] += c.result_bytes * c.count
        return out


def normalize_spec(spec: Sequence[object] | None, ndim: int, mesh: LogicalMesh, *,
                   where: str) -> Spec:
    """Turns a ``PartitionSpec``-like sequence (``None``, an axis name, or a tuple of names per
    dimension; shorter than ``ndim`` means trailing dims replicated) into a :data:`Spec`."""
    entries = list(spec) if spec is not None else []
    if len(entries) > ndim:
        raise ConfigError(format_error(
            "A sharding has more entries than the tensor has dimensions.", where=where,
            value=(tuple(entries), ndim), remedy="give at most one entry per dimension"))
    out: list[tuple[str, ...]] = []
    for e in [*entries, *([None] * (ndim - len(entries)))]:
        axes: tuple[str, ...] = (() if e is None else (e,) if isinstance(e, str)
                                 else tuple(str(a) for a in e))  # type: ignore[attr-defined]
        for a in axes:
            if a not in mesh.axis_names:
                raise ConfigError(format_error(
                    f"Unknown mesh axis {a!r} in a sharding.", where=where, value=tuple(entries),
                    remedy=f"use the mesh's axes {list(mesh.axis_names)}"))
        out.append(axes)
    return tuple(out)


def _shards(mesh: LogicalMesh, spec: Spec) -> int:
    return math.prod(mesh.size(axes) for axes in spec if axes)


def _axes_of(spec: Spec) -> set[str]:
    return {a for axes in spec for a in axes}


class _Propagator:
    def __init__(self, graph: OpGraph, mesh: LogicalMesh,
                 rules: Sequence[OpRule] | None = None) -> None:
        self.graph = graph
        self.mesh = mesh
        self.rules: Sequence[OpRule] = (rules if rules is not None
                                        else [op_rule(graph, op) for op in graph.ops])
        self.specs: list[list[tuple[str, ...]]] = [[()] * len(t.shape) for t in graph.tensors]
        self.fixed = [False] * len(graph.tensors)

    # -- factor assignment -----------------------------------------------------------------
    def _split(self, axes: tuple[str, ...], factors: tuple[int, ...], rule: OpRule
               ) -> list[tuple[int, tuple[str, ...]]]:
        """Assigns a dimension's axes to its factors, major factor first (Shardy's rule)."""
        out: list[tuple[int, tuple[str, ...]]] = []
        rest = list(axes)
        for f in factors:
            size = rule.factors[f].size
            taken: list[str] = []
            while rest and size % (self.mesh.size((*taken, rest[0]))) == 0:
                taken.append(rest.pop(0))
            out.append((f, tuple(taken)))
        return out

    def _proposals(self, rule: OpRule, tensors: Sequence[int], dims_list: Sequence,
                   proposals: dict[int, tuple[str, ...]]) -> None:
        for t, dims in zip(tensors, dims_list, strict=True):
            spec = self.specs[t]
            for d, factors in enumerate(dims):
                if d >= len(spec) or not spec[d] or not factors:
                    continue
                for f, axes in self._split(spec[d], factors, rule):
                    if axes and len(axes) > len(proposals.get(f, ())):
                        proposals[f] = axes

    def _resolve(self, rule: OpRule, proposals: dict[int, tuple[str, ...]]
                 ) -> dict[int, tuple[str, ...]]:
        order = sorted(proposals, key=lambda f: ({"pass": 0, "reduce": 1, "fixed": 2}
                                                 [rule.factors[f].kind], f))
        used: set[str] = set()
        final: dict[int, tuple[str, ...]] = {}
        for f in order:
            if rule.factors[f].kind == "fixed":
                continue
            axes: list[str] = []
            for a in proposals[f]:
                if a in used or rule.factors[f].size % self.mesh.size((*axes, a)) != 0:
                    break
                axes.append(a)
            if axes:
                final[f] = tuple(axes)
                used.update(axes)
        return final

    def assignment(self, op_id: int, *, with_results: bool) -> dict[int, tuple[str, ...]]:
        op, rule = self.graph.ops[op_id], self.rules[op_id]
        proposals: dict[int, tuple[str, ...]] = {}
        self._proposals(rule, op.inputs, rule.operands, proposals)
        final = self._resolve(rule, proposals)
        if with_results:
            extra: dict[int, tuple[str, ...]] = {}
            self._proposals(rule, op.outputs, rule.results, extra)
            used = {a for axes in final.values() for a in axes}
            for f, axes in extra.items():
                if f in final or rule.factors[f].kind != "pass":
                    continue
                keep: list[str] = []
                for a in axes:
                    if a in used or rule.factors[f].size % self.mesh.size((*keep, a)) != 0:
                        break
                    keep.append(a)
                if keep:
                    final[f] = tuple(keep)
                    used.update(keep)
        return final

    # -- propagation -----------------------------------------------------------------------
    def _step(self, op_id: int) -> bool:
        op, rule = self.graph.ops[op_id], self.rules[op_id]
        proposals: dict[int, tuple[str, ...]] = {}
        self._proposals(rule, op.inputs, rule.operands, proposals)
        self._proposals(rule, op.outputs, rule.results, proposals)
        if not proposals:
            return False
        final = self._resolve(rule, proposals)
        changed = False
        for t, dims in [*zip(op.inputs, rule.operands, strict=True),
                        *zip(op.outputs, rule.results, strict=True)]:
            if self.fixed[t]:
                continue
            spec = self.specs[t]
            present = {a for axes in spec for a in axes}
            for d, factors in enumerate(dims):
                if d >= len(spec) or spec[d] or not factors:
                    continue
                new = tuple(a for f in factors for a in final.get(f, ()) if a not in present)
                if new and self.graph.tensors[t].shape[d] % self.mesh.size(new) == 0:
                    spec[d] = new
                    present.update(new)
                    changed = True
        return changed

    def propagate(self) -> None:
        # An op whose operands and results are all pinned can change nothing: skip it (a
        # placed analysis pins every op's results, leaving only values built from constants).
        fixed = self.fixed
        ops = [op.id for op in self.graph.ops
               if not all(fixed[t] for t in (*op.inputs, *op.outputs))]
        for _ in range(_MAX_ROUNDS):
            changed = False
            for i in ops:
                changed |= self._step(i)
            for i in reversed(ops):
                changed |= self._step(i)
            if not changed:
                return


def analyze_sharding(graph: OpGraph, mesh: LogicalMesh, input_specs: Mapping[int, Spec],
                     output_specs: Mapping[int, Spec] | None = None, *,
                     reduce_scatter: bool = True,
                     op_factors: Mapping[int, Mapping[int, tuple[str, ...]]] | None = None,
                     rules: Sequence[OpRule] | None = None) -> ShardingAnalysis:
    """Propagates shardings from the given tensors and derives communication and work.

    Args:
      graph: the traced step.
      mesh: the logical mesh.
      input_specs: ``{tensor id: spec}`` for graph inputs (or any tensor to pin).
      output_specs: ``{index into graph.outputs: spec}`` for results (a train step's new state
        keeps its input sharding).
      reduce_scatter: whether the backend turns an all-reduce followed by a slice into a
        reduce-scatter (XLA's GPU and TPU pipelines do; the CPU pipeline keeps the all-reduce
        of the whole buffer and slices it: see ``DeviceSpec``'s platform).
      op_factors: ``{op id: {factor id: mesh axes}}`` for ops whose strategy is decided (a
        solver's choice, which the runtime pins): placed as given instead of inferred from
        their operands.
      rules: ``op_rule`` of every op, if already computed.

    Returns:
      The :class:`ShardingAnalysis`.
    """
    prop = _Propagator(graph, mesh, rules)
    for t, spec in input_specs.items():
        prop.specs[t] = list(spec)
        prop.fixed[t] = True
    for i, spec in (output_specs or {}).items():
        out = graph.outputs[i]
        if out is not None and not prop.fixed[out]:
            prop.specs[out] = list(spec)
            prop.fixed[out] = True
    prop.propagate()
    return _place(graph, mesh, prop, reduce_scatter=reduce_scatter, op_factors=op_factors or {})


def _place(graph: OpGraph, mesh: LogicalMesh, prop: _Propagator, *,
           reduce_scatter: bool,
           op_factors: Mapping[int, Mapping[int, tuple[str, ...]]]) -> ShardingAnalysis:
    specs: list[Spec] = [tuple(s) for s in prop.specs]
    op_axes: list[tuple[str, ...]] = []
    collectives: list[PredictedCollective] = []
    seen: dict[tuple[int, Spec], int] = {}
    # reshard_steps and reduce_steps, memoised: the same specs recur op after op.
    steps_of: dict[tuple[Spec, Spec], tuple[ReshardStep, ...]] = {}
    reduce_of: dict[tuple[Spec, Spec, tuple[str, ...]], tuple[ReshardStep, ...]] = {}

    def emit(kind: CollectiveKind, axes: tuple[str, ...], tensor: int, result_spec: Spec,
             op_id: int) -> None:
        key = (tensor, result_spec) if kind in ("all-gather", "all-to-all") else None
        count = graph.ops[op_id].count
        if key is not None and key in seen:
            return
        nbytes = graph.tensors[tensor].nbytes // _shards(mesh, result_spec)
        if key is not None:
            seen[key] = len(collectives)
        collectives.append(PredictedCollective(kind, axes, nbytes, count, tensor, op_id))

    # Constants (values XLA folds: built from literals alone) are materialised in whatever
    # sharding a reader wants; reading one never moves data.
    constant = {t for op in graph.ops if op.attrs.get("folded") for t in op.outputs}
    for op in graph.ops:
        rule = prop.rules[op.id]
        decided = op_factors.get(op.id)
        final = (dict(decided) if decided is not None
                 else prop.assignment(op.id, with_results=True))
        op_axes.append(tuple(sorted({a for axes in final.values() for a in axes},
                                    key=mesh.axis_names.index)))
        if op.structural:
            continue
        for t, dims in zip(op.inputs, rule.operands, strict=True):
            required: Spec = tuple(tuple(a for f in factors for a in final.get(f, ()))
                                   for factors in dims)
            if specs[t] == required or t in constant:  # reshard_steps: nothing to do
                continue
            key = (specs[t], required)
            if key not in steps_of:
                steps_of[key] = reshard_steps(*key)
            for step in steps_of[key]:
                emit(step.kind, step.axes, t, step.result_spec, op.id)
        partial = tuple(a for f, axes in final.items() if rule.factors[f].kind == "reduce"
                        for a in axes)
        for t, dims in zip(op.outputs, rule.results, strict=True):
            natural: Spec = tuple(tuple(a for f in factors for a in final.get(f, ()))
                                  for factors in dims)
            if not partial and natural == specs[t]:  # reduce_steps: nothing to do
                continue
            reduce_key = (natural, specs[t], partial)
            if reduce_key not in reduce_of:
                reduce_of[reduce_key] = reduce_steps(natural, specs[t], partial,
                                                     reduce_scatter=reduce_scatter)
            for step in reduce_of[reduce_key]:
                emit(step.kind, step.axes, t, step.result_spec, op.id)
    return ShardingAnalysis(mesh=mesh, specs=tuple(specs), op_axes=tuple(op_axes),
                            collectives=tuple(collectives))


@dataclasses.dataclass(frozen=True, slots=True)
class ReshardStep:
    """One collective of a resharding: its kind, mesh axes and the spec of its result."""

    kind: CollectiveKind
    axes: tuple[str, ...]
    result_spec: Spec


def reshard_steps(have: Spec, want: Spec) -> tuple[ReshardStep, ...]:
    """Collectives turning a value sharded as ``have`` into ``want``, as XLA's SPMD
    partitioner does them (measured on every pair of 2-D shardings over a 2 x 4 mesh):

    * axes appended to the minor end of dimensions: free (each device slices its part);
    * axes dropped from the minor end of dimensions: one all-gather per dimension, the last
      dimension first;
    * axes moved from the minor end of one dimension to the minor end of another: one
      all-to-all;
    * anything else (an axis added in front of another, moved and dropped at once, two
      dimensions swapping axes, ...) puts shards on other devices, which XLA does with extra
      collective-permutes or, often, by gathering the whole value and slicing it ("involuntary
      full rematerialization"): priced as that, an all-gather over every axis of ``have``.
    """
    if have == want:
        return ()
    rank = max(len(have), len(want))
    h = [tuple(have[d]) if d < len(have) else () for d in range(rank)]
    w = [tuple(want[d]) if d < len(want) else () for d in range(rank)]
    if all(w[d][:len(h[d])] == h[d] for d in range(rank)):
        return ()
    if all(h[d][:len(w[d])] == w[d] for d in range(rank)):
        # One all-gather per dimension, the last dimension first.
        steps, now = [], list(h)
        for d in reversed(range(rank)):
            if now[d] != w[d]:
                dropped, now[d] = now[d][len(w[d]):], w[d]
                steps.append(ReshardStep("all-gather", dropped, tuple(now)))
        return tuple(steps)
    changed = [d for d in range(rank) if h[d] != w[d]]
    if len(changed) == 2:
        for s, t in (changed, changed[::-1]):
            moved = h[s][len(w[s]):]
            if (moved and h[s][:len(w[s])] == w[s] and w[t] == h[t] + moved):
                return (ReshardStep("all-to-all", moved, tuple(w)),)
    every = tuple(a for axes in h for a in axes)
    return (ReshardStep("all-gather", every, tuple(() for _ in range(rank))),)


def reduce_steps(natural: Spec, want: Spec, partial: tuple[str, ...], *,
                 reduce_scatter: bool = True) -> tuple[ReshardStep, ...]:
    """Collectives turning a result that is a partial sum over ``partial`` axes (sharded as
    ``natural`` otherwise) into ``want``: a reduce-scatter over the reduced axes ``want``
    shards (where the backend has one), an all-reduce over the others, and an all-gather of
    axes ``natural`` has but ``want`` does not."""
    steps: list[ReshardStep] = []
    natural_axes = _axes_of(natural)
    if partial:
        want_axes = _axes_of(want) if reduce_scatter else set()
        scatter = tuple(a for a in partial if a in want_axes)
        replicate = tuple(a for a in partial if a not in want_axes)
        if replicate:
            steps.append(ReshardStep("all-reduce", replicate, natural))
        if scatter:
            after = tuple(tuple(a for a in axes if a in scatter or a in natural_axes)
                          for axes in want)
            steps.append(ReshardStep("reduce-scatter", scatter, after))
    extra = tuple(a for a in natural_axes if a not in _axes_of(want))
    if extra:
        steps.append(ReshardStep("all-gather", extra, tuple(
            tuple(a for a in axes if a not in extra) for axes in natural)))
    return tuple(steps)


def leaf_specs(graph: OpGraph, mesh: LogicalMesh,
               spec_of: Callable[[Parameter], Sequence[object] | None]
               ) -> tuple[dict[int, Spec], dict[int, Spec]]:
    """Input and output specs from a rule over the traced arguments' leaves.

    Args:
      graph: the traced step.
      mesh: the mesh.
      spec_of: a ``PartitionSpec``-like sharding (or None: replicated) for each argument leaf
        (a :class:`~shardplan.trace.graph.Parameter`, with its key path, role and shape).

    Returns:
      ``(input_specs, output_specs)`` for :func:`analyze_sharding`: results whose key path
      equals an argument's (the new state) keep that argument's sharding; other results
      (metrics) are replicated.
    """
    inputs: dict[int, Spec] = {}
    by_path: dict[tuple[str, tuple[int, ...]], Spec] = {}
    for p in graph.parameters:
        spec = normalize_spec(spec_of(p), len(p.shape), mesh, where=f"{p.arg_index}/{p.path}")
        inputs[p.tensor] = spec
        by_path[(f"{p.arg_index}/{p.path}", p.shape)] = spec
    outputs: dict[int, Spec] = {}
    for i, (t, path) in enumerate(zip(graph.outputs, graph.output_paths, strict=True)):
        if t is None:
            continue
        shape = graph.tensors[t].shape
        outputs[i] = by_path.get((path, shape), tuple(() for _ in shape))
    return inputs, outputs
