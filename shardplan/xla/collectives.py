"""The collectives a compiled HLO module executes, and their per-kind summary.

Every all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute,
collective-broadcast and ragged-all-to-all is one :class:`Collective`, also in their async
forms: ``all-reduce-start`` / ``all-gather-start`` / ``collective-permute-start`` count once
(their ``-done`` is skipped), and ``async-start(...), calls=%comp`` wrapping a collective
counts once, as the wrapped collective, in the wrapper's computation (the op inside ``%comp``
is not counted again). ``count`` is the execution multiplier of the computation it runs in
(see :class:`~shardplan.xla.hlo.HloModule`), so a psum in a 5-step ``lax.scan`` counts 5.
``bytes`` is the size of the result *on one device* for one execution:

* synchronous ops and ``all-reduce-start``: all arrays of the result shape (a combined
  ``(f32[256,256], f32[])`` all-reduce is 262,148 bytes);
* ``all-gather-start`` / ``collective-permute-start``, whose result is the tuple
  ``(operands, outputs[, u32[] context...])``: tuple element 1, the outputs, only;
* ``async-start``: the result of the wrapped collective (the root of ``%comp``).

Example:
    >>> from shardplan.xla.hlo import parse_hlo_module
    >>> module = parse_hlo_module('''
    ... HloModule m, num_partitions=2
    ... %add (a: f32[], b: f32[]) -> f32[] {
    ...   %a = f32[] parameter(0)
    ...   %b = f32[] parameter(1)
    ...   ROOT %s = f32[] add(%a, %b)
    ... }
    ... ENTRY %main (p: f32[8]) -> f32[8] {
    ...   %p = f32[8]{0} parameter(0)
    ...   ROOT %r = f32[8]{0} all-reduce(%p), replica_groups=[1,2]<=[2], to_apply=%add
    ... }''')
    >>> find_collectives(module).summary()
    {'all-reduce': {'count': 1, 'bytes': 32}}
"""

from __future__ import annotations

from dataclasses import dataclass

from shardplan.xla.hlo import HloModule, Instruction
from shardplan.xla.replica_groups import parse_replica_groups, parse_source_target_pairs
from shardplan.xla.shapes import ArrayShape, Shape, TupleShape

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "Collectives",
    "find_collectives",
]

COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
)
"""The collective opcodes, without their ``-start`` / ``-done`` suffixes."""

# Async ops whose result is ``(operands, outputs, context...)``: the outputs are element 1.
_OUTPUT_IN_ELEMENT_1 = frozenset({"all-gather-start", "collective-permute-start"})


@dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    Attributes:
      kind: the collective, one of :data:`COLLECTIVE_KINDS` (``all-reduce`` also for
        ``all-reduce-start`` and for an ``async-start`` wrapping an all-reduce).
      opcode: the opcode as printed: ``all-reduce``, ``all-gather-start``, ``async-start``...
      name: the instruction's name (the ``async-start``'s for a wrapped collective).
      computation: the computation it runs in.
      module: the module's name.
      count: executions per program execution (its computation's multiplier; one in a
        conditional branch counts as if the branch always ran).
      bytes: result bytes on one device for one execution (see the module docstring).
      shapes: the result arrays counted in ``bytes``.
      replica_groups: the device groups, expanded to explicit ids (logical ids: positions in
        the executable's device assignment); ``()`` for collective-permute.
      source_target_pairs: ``(source, target)`` device pairs of a collective-permute.
      channel_id: ``channel_id=``, or None.
      use_global_device_ids: ``use_global_device_ids=true``.
      op_name: ``metadata={op_name=...}``, the JAX name stack, for attribution to layers.
      source: ``file:line`` from the metadata, when present.
      trip_count_known: False when an enclosing loop's trip count is unknown (then ``count``
        counts that loop once).
    """

    kind: str
    opcode: str
    name: str
    computation: str
    module: str
    count: int
    bytes: int
    shapes: tuple[ArrayShape, ...]
    replica_groups: tuple[tuple[int, ...], ...] = ()
    source_target_pairs: tuple[tuple[int, int], ...] = ()
    channel_id: int | None = None
    use_global_device_ids: bool = False
    op_name: str | None = None
    source: str | None = None
    trip_count_known: bool = True

    @property
    def total_bytes(self) -> int:
        """``bytes × count``: bytes on one device over one program execution."""
        return self.bytes * self.count

    @property
    def is_scalar(self) -> bool:
        """Whether every result array is a scalar (e.g. a loss-mean all-reduce of ``f32[]``)."""
        return bool(self.shapes) and all(s.rank == 0 for s in self.shapes)

    @property
    def dtype(self) -> str | None:
        """The element type of the result, or None when the arrays' types differ."""
        dtypes = {s.dtype for s in self.shapes}
        return dtypes.pop() if len(dtypes) == 1 else None

    @property
    def shape(self) -> ArrayShape | None:
        """The result array when there is exactly one, else None (see ``shapes``)."""
        return self.shapes[0] if len(self.shapes) == 1 else None

    @property
    def group_size(self) -> int:
        """Devices per replica group (2 for a collective-permute, 0 if unknown)."""
        if self.replica_groups:
            return len(self.replica_groups[0])
        return 2 if self.source_target_pairs else 0


class Collectives(tuple[Collective, ...]):
    """A tuple of :class:`Collective` with filters and a per-kind summary."""

    __slots__ = ()

    def non_scalar(self) -> Collectives:
        """The collectives with at least one non-scalar result array."""
        return Collectives(c for c in self if not c.is_scalar)

    def scalar(self) -> Collectives:
        """The collectives whose results are all scalars."""
        return Collectives(c for c in self if c.is_scalar)

    def of_kind(self, kind: str) -> Collectives:
        """The collectives of one kind (``all-reduce``, ...)."""
        return Collectives(c for c in self if c.kind == kind)

    def summary(self) -> dict[str, dict[str, int]]:
        """``{kind: {"count": Σ count, "bytes": Σ bytes × count}}`` over kinds present."""
        out: dict[str, dict[str, int]] = {}
        for c in self:
            entry = out.setdefault(c.kind, {"count": 0, "bytes": 0})
            entry["count"] += c.count
            entry["bytes"] += c.total_bytes
        return out


def _collective_kind(opcode: str) -> str | None:
    """The collective kind of an opcode (``all-gather-start`` → ``all-gather``), or None."""
    if opcode.endswith(("-done", "-update")):
        return None
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVE_KINDS else None


def _result_arrays(instr: Instruction) -> tuple[ArrayShape, ...]:
    """The result arrays a collective moves to this device (see the module docstring)."""
    shape: Shape = instr.shape
    is_pair = isinstance(shape, TupleShape) and len(shape.elements) >= 2
    if instr.opcode in _OUTPUT_IN_ELEMENT_1 and isinstance(shape, TupleShape) and is_pair:
        shape = shape.elements[1]
    return shape.leaves()


def _group_participants(module: HloModule, instr: Instruction) -> int:
    """How many devices ``replica_groups={}`` means for ``instr`` (XLA's group modes)."""
    if instr.attr("use_global_device_ids") == "true":
        return module.replica_count * module.num_partitions
    if instr.attr("channel_id") is not None and module.num_partitions > 1:
        return module.num_partitions
    return module.replica_count


def _make_collective(
    module: HloModule, op: Instruction, wrapper: Instruction, kind: str
) -> Collective:
    """Builds the record of collective ``op``, executed by ``wrapper`` (``op`` itself unless
    it is wrapped by an ``async-start``)."""
    arrays = _result_arrays(op)
    channel = op.attr("channel_id")
    return Collective(
        kind=kind,
        opcode=wrapper.opcode,
        name=wrapper.name,
        computation=wrapper.computation,
        module=module.name,
        count=module.multiplier(wrapper.computation),
        bytes=sum(a.byte_size for a in arrays),
        shapes=arrays,
        replica_groups=parse_replica_groups(
            op.attr("replica_groups"), num_devices=_group_participants(module, op)
        )
        if op.attr("replica_groups") is not None
        else (),
        source_target_pairs=parse_source_target_pairs(op.attr("source_target_pairs")),
        channel_id=int(channel) if channel and channel.isdigit() else None,
        use_global_device_ids=op.attr("use_global_device_ids") == "true",
        op_name=op.op_name or wrapper.op_name,
        source=op.source or wrapper.source,
        trip_count_known=module.trip_count_known.get(wrapper.computation, True),
    )


def find_collectives(module: HloModule) -> Collectives:
    """All collectives a module executes, in text order (see the module docstring).

    Args:
      module: a parsed module.

    Returns:
      One record per collective instruction in a computation the entry reaches.
    """
    async_calls: dict[tuple[str, str], list[str]] = {}
    for site in module.call_sites:
        if site.opcode == "async-start":
            async_calls.setdefault((site.caller, site.instruction), []).append(site.callee)
    wrapped = {callee for callees in async_calls.values() for callee in callees}
    records: list[Collective] = []
    for computation in module.computations.values():
        if computation.name in wrapped or module.multiplier(computation.name) == 0:
            continue
        for instr in computation.instructions:
            kind = _collective_kind(instr.opcode)
            if kind is not None:
                records.append(_make_collective(module, instr, instr, kind))
            for callee in async_calls.get((computation.name, instr.name), ()):
                records.extend(_wrapped_collectives(module, instr, callee))
    return Collectives(records)


def _wrapped_collectives(module: HloModule, wrapper: Instruction, callee: str) -> list[Collective]:
    """The collectives inside ``callee``, the computation an ``async-start`` runs."""
    records: list[Collective] = []
    for op in module.computations[callee].instructions:
        kind = _collective_kind(op.opcode)
        if kind is not None:
            records.append(_make_collective(module, op, wrapper, kind))
    return records
