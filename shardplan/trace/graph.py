"""The op graph: what a traced train step computes, per equation, parameter and layer.

An :class:`OpGraph` is a flat, topologically ordered list of :class:`Op` s (nested jaxprs are
inlined; loop bodies appear once with an execution ``count``), the :class:`Tensor` s between them,
the :class:`Parameter` s (every leaf of the traced arguments, with its key path and role) and the
:class:`Layer` s (the repeated block structure the solver ties together). It is a plain value:
frozen, built once by :func:`shardplan.trace.trace`, never mutated.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Literal

from shardplan.trace.dtypes import nbytes

__all__ = ["Layer", "Op", "OpGraph", "Parameter", "Phase", "Role", "Tensor"]

Phase = Literal["forward", "backward", "recompute", "update", "other"]
"""Where an op runs in a train step: the forward pass, the backward pass, a rematerialised
forward inside the backward pass, the optimizer update, or anything else (metrics, glue)."""

PHASES: tuple[Phase, ...] = ("forward", "backward", "recompute", "update", "other")

Role = Literal["parameter", "optimizer_state", "other", "unused"]
"""What an input leaf is: a trained parameter (read by the forward pass and updated), optimizer
state (read only by the update), anything else that is read (batch data, frozen constants, step
counters outside the optimizer), or unused."""


@dataclasses.dataclass(frozen=True, slots=True)
class Tensor:
    """A value in the graph.

    Attributes:
      id: index into ``OpGraph.tensors``.
      shape: the value's global (unsharded) shape.
      dtype: numpy dtype name, e.g. ``"float32"``.
      producer: id of the op that computes it, or None for graph inputs.
      nbytes: size in bytes.
    """

    id: int
    shape: tuple[int, ...]
    dtype: str
    producer: int | None
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Op:
    """One equation of the (flattened) jaxpr.

    Attributes:
      id: index into ``OpGraph.ops``; ids follow program order.
      primitive: the JAX primitive name (``dot_general``, ``add`` ...).
      inputs: tensor ids of the non-literal operands.
      outputs: tensor ids of the results.
      flops: FLOPs of one execution (XLA's conventions; see :mod:`shardplan.trace.flops`).
      transcendentals: transcendental function evaluations of one execution.
      bytes_read: operand bytes of one execution.
      bytes_written: result bytes of one execution.
      count: executions per call of the traced function (loop trip counts multiplied in).
      loop_trips: the part of ``count`` that comes from loop trip counts (``scan``/``while``).
      phase: forward, backward, recompute, update or other.
      scope: module scope, e.g. ``blocks.3.attn.q``.
      source: ``file:line (function)`` of the user code that emitted it.
      layers: indices of the layers this op belongs to (several for the body of a scanned layer
        stack, which every layer of the stack executes).
      loop: nesting of loops around the op, outermost first, as ``(loop id, trip count)``.
      structural: True for the zero-cost markers of loop boundaries (slicing a scanned input,
        stacking a scanned output) that keep the graph's data flow explicit.
      attrs: primitive parameters the later stages need (dimension numbers, axes), as plain data.
      path: where its equation sits in the traced program: its index among the top-level
        equations, then among those of each inlined call (``jit``, custom derivatives) and
        ``scan`` body it is inside; None inside ``while`` and ``cond`` bodies and for
        structural markers. The runtime finds the equation again by it to constrain its
        result's sharding.
    """

    id: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    flops: float
    transcendentals: float
    bytes_read: int
    bytes_written: int
    count: int
    loop_trips: int
    phase: Phase
    scope: str
    source: str
    layers: tuple[int, ...]
    loop: tuple[tuple[int, int], ...]
    structural: bool
    attrs: Mapping[str, Any]
    path: tuple[int, ...] | None = None

    @property
    def total_flops(self) -> float:
        """FLOPs of all executions per call."""
        return self.flops * self.count


@dataclasses.dataclass(frozen=True, slots=True)
class Parameter:
    """A leaf of the traced arguments.

    Attributes:
      path: ``jax.tree_util.keystr(path, simple=True, separator="/")`` of the leaf within its
        argument (for a train step's state argument: the state key path).
      arg_index: which positional argument it is a leaf of.
      tensor: the tensor id of the leaf in the graph.
      shape: its shape.
      dtype: its dtype name.
      role: parameter, optimizer_state, other or unused.
      readers: ids of the ops that read it (through loop-slicing markers too).
      layer: index of the layer that owns it, or None (shared or not a parameter).
      stacked: True when its leading dimension stacks the layers of a scanned layer stack.
      param_path: for optimizer state, the path of the parameter it belongs to (same-shaped
        leaf whose path is a suffix of this one's), else None.
    """

    path: str
    arg_index: int
    tensor: int
    shape: tuple[int, ...]
    dtype: str
    role: Role
    readers: tuple[int, ...]
    layer: int | None
    stacked: bool
    param_path: str | None

    @property
    def nbytes(self) -> int:
        """Bytes of the leaf (a PRNG key's: its key data)."""
        return nbytes(self.shape, self.dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class Layer:
    """A contiguous piece of the model: a repeated block, or what comes before or after.

    Attributes:
      index: position in ``OpGraph.layers`` (forward order).
      name: ``blocks.3``; ``pre`` / ``post`` for the non-repeated parts around the blocks;
        ``shared`` for update ops that combine several layers (a global gradient norm).
      kind: ``pre``, ``block``, ``post`` or ``shared``.
      stack: name of the block stack it belongs to (``blocks``), or None.
      fingerprint: equal for layers that compute the same thing on the same shapes (the solver
        solves one of them and reuses the answer).
      ops: ids of its ops (scanned stacks: the loop body, shared by every layer of the stack).
      op_share: the fraction of each op's executions that belong to this layer (``1/n`` for the
        body of a scan over ``n`` layers, else 1).
      params: paths of the parameters it owns (for a scanned stack: the stacked leaves).
      param_bytes: bytes of its parameters (for a scanned stack: one layer's slice).
      flops: total FLOPs per phase.
    """

    index: int
    name: str
    kind: Literal["pre", "block", "post", "shared"]
    stack: str | None
    fingerprint: str
    ops: tuple[int, ...]
    op_share: float
    params: tuple[str, ...]
    param_bytes: int
    flops: Mapping[str, float]

    @property
    def total_flops(self) -> float:
        return float(sum(self.flops.values()))


class OpDraft:
    """An :class:`Op` under construction: the same fields, mutable, built without the frozen
    dataclass's per-field ``object.__setattr__`` (four times the cost of the rest of an op's
    tracing on a large model). :meth:`freeze` turns the object itself into that ``Op``.

    The trace stage alone builds drafts, and freezes each before the graph is returned.
    """

    __slots__ = Op.__slots__  # the same layout, which lets freeze() change the class

    def __init__(self, id: int, primitive: str, inputs: tuple[int, ...],
                 outputs: tuple[int, ...], flops: float, transcendentals: float,
                 bytes_read: int, bytes_written: int, count: int, loop_trips: int, phase: Phase,
                 scope: str, source: str, layers: tuple[int, ...],
                 loop: tuple[tuple[int, int], ...], structural: bool, attrs: Mapping[str, Any],
                 path: tuple[int, ...] | None) -> None:
        self.id = id
        self.primitive = primitive
        self.inputs = inputs
        self.outputs = outputs
        self.flops = flops
        self.transcendentals = transcendentals
        self.bytes_read = bytes_read
        self.bytes_written = bytes_written
        self.count = count
        self.loop_trips = loop_trips
        self.phase = phase
        self.scope = scope
        self.source = source
        self.layers = layers
        self.loop = loop
        self.structural = structural
        self.attrs = attrs
        self.path = path

    def freeze(self) -> Op:
        """The op, frozen: this object, now an :class:`Op` (not to be used as a draft again)."""
        self.__class__ = Op  # type: ignore[assignment]
        return self  # type: ignore[return-value]


class TensorDraft:
    """A :class:`Tensor` under construction (see :class:`OpDraft`)."""

    __slots__ = Tensor.__slots__

    def __init__(self, id: int, shape: tuple[int, ...], dtype: str,
                 producer: int | None, nbytes: int) -> None:
        self.id = id
        self.shape = shape
        self.dtype = dtype
        self.producer = producer
        self.nbytes = nbytes

    def freeze(self) -> Tensor:
        """The tensor, frozen: this object, now a :class:`Tensor`."""
        self.__class__ = Tensor  # type: ignore[assignment]
        return self  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class OpGraph:
    """A traced function as ops, tensors, parameters and layers.

    Attributes:
      name: the traced function's name.
      ops: every op in program order.
      tensors: every tensor; ``tensors[i].id == i``.
      inputs: tensor ids of the flattened arguments, in ``jax.tree_util`` order.
      outputs: tensor ids of the flattened results (None for a literal or constant result).
      output_paths: key paths of the results (``0/...`` for the first result).
      parameters: one entry per flattened argument leaf, in the same order as ``inputs``.
      layers: the layer structure in forward order, then ``shared`` if present.
      unknown_primitives: primitives without a cost rule, each with a source line (they are
        costed as elementwise ops).
      notes: anything the tracer had to approximate (unknown loop trip counts, conditionals).
    """

    name: str
    ops: tuple[Op, ...]
    tensors: tuple[Tensor, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int | None, ...]
    output_paths: tuple[str, ...]
    parameters: tuple[Parameter, ...]
    layers: tuple[Layer, ...]
    unknown_primitives: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()

    # ----------------------------------------------------------------------------------------
    # Queries
    # ----------------------------------------------------------------------------------------
    @functools.cached_property
    def consumers(self) -> tuple[tuple[int, ...], ...]:
        """For each tensor id, the ids of the ops that read it."""
        out: list[list[int]] = [[] for _ in self.tensors]
        for op in self.ops:
            for t in op.inputs:
                out[t].append(op.id)
        return tuple(tuple(c) for c in out)

    @functools.cached_property
    def fingerprinted(self) -> tuple[bool, ...]:
        """Per op, whether it takes part in its layer's fingerprint: not constant-folded by XLA
        (``attrs["folded"]``) and not on scalars only (see :mod:`shardplan.trace.layers`)."""
        tensors = self.tensors
        return tuple(not op.attrs.get("folded")
                     and any(tensors[t].shape for t in (*op.inputs, *op.outputs))
                     for op in self.ops)

    @functools.cached_property
    def param_by_path(self) -> Mapping[str, Parameter]:
        """Parameters keyed by ``"<arg index>:<path>"`` and, for argument 0, by bare path."""
        table: dict[str, Parameter] = {}
        for p in self.parameters:
            table[f"{p.arg_index}:{p.path}"] = p
            if p.arg_index == 0:
                table[p.path] = p
        return table

    def total_flops(self, phase: str | None = None, *, count_loops: bool = True) -> float:
        """Sums op FLOPs per call.

        Args:
          phase: only ops of this phase (None: all).
          count_loops: multiply loop bodies by their trip counts. False reproduces XLA's
            ``cost_analysis()``, which counts a ``while`` body once.
        """
        total = 0.0
        for op in self.ops:
            if phase is not None and op.phase != phase:
                continue
            count = op.count if count_loops else op.count // max(op.loop_trips, 1)
            total += op.flops * count
        return total

    def flops_by_primitive(self, phase: str | None = None) -> dict[str, float]:
        """Total FLOPs per primitive (loops multiplied in)."""
        out: dict[str, float] = {}
        for op in self.ops:
            if phase is None or op.phase == phase:
                out[op.primitive] = out.get(op.primitive, 0.0) + op.total_flops
        return out

    def params_with_role(self, role: Role) -> tuple[Parameter, ...]:
        return tuple(p for p in self.parameters if p.role == role)

    @property
    def num_params(self) -> int:
        """Number of trained parameter elements."""
        n = 0
        for p in self.parameters:
            if p.role == "parameter":
                k = 1
                for d in p.shape:
                    k *= d
                n += k
        return n

    @property
    def blocks(self) -> tuple[Layer, ...]:
        """The repeated layers (kind ``block``)."""
        return tuple(layer for layer in self.layers if layer.kind == "block")

    # ----------------------------------------------------------------------------------------
    # Presentation
    # ----------------------------------------------------------------------------------------
    def summary(self) -> str:
        """A readable table: layers (grouped by fingerprint), parameters, FLOPs and bytes."""
        from shardplan.trace.summary import graph_summary

        return graph_summary(self)
