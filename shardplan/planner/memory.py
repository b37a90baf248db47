"""The memory budget as constraints of the intra-op problem (cutting planes).

The ILP bounds the arguments' bytes directly. The rest of a step's peak (activations, gathered
weights, results) depends on where XLA schedules each buffer, which the estimate of
:mod:`shardplan.cost.memory` models op by op. ``make_plan`` estimates a solved plan; at every op
where the estimate exceeds the budget, :func:`memory_peaks` records the buffers live there
(:class:`MemoryPeak`), and :func:`memory_cut` turns each into a
:class:`~shardplan.solver.MemoryCut` of the next problem: the arguments, the values in the
shardings the solver picks for their producers, the gathered copies as the reader's bytes where
its strategy needs more than the holder holds, and fixed bytes for the rest. A cut is exact for
the plan it came from, so the next solve excludes that plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.memory import MemoryEstimate
from shardplan.cost.sharding import Spec
from shardplan.cost.strategies import OpStrategy
from shardplan.solver import MemoryCut
from shardplan.trace.graph import OpGraph

__all__ = ["MemoryPeak", "memory_cut", "memory_peaks"]


@dataclasses.dataclass(frozen=True)
class MemoryPeak:
    """Where a plan's memory peaked, as a constraint for the next solve: the arguments (live
    throughout) plus the buffers live there must fit the budget, in whatever shardings the
    solver picks.

    Every argument whose readers span ``op`` counts its resharded copy for its first reader
    too (a lower bound as for ``copies``): a weight all-gathered in the forward pass is kept
    for the backward pass, whatever the plan the peak was measured in.

    Attributes:
      op: the op (program order) where the memory peaked.
      values: ``(tensor id, bytes)`` of the values live there; each counts in the sharding the
        solver picks for its producer (a tensor no op node writes counts as it was).
      copies: ``(tensor id, reader op id, bytes)`` of resharded copies (an all-gathered
        weight): at least the reader's operand bytes less the tensor's own, in the shardings
        the solver picks (a lower bound, exact when the copy is a gather).
      fixed_bytes: bytes no node decides (results, copies in another layout).
    """

    op: int
    values: tuple[tuple[int, float], ...]
    copies: tuple[tuple[int, int, float], ...]
    fixed_bytes: float


def memory_peaks(memory: MemoryEstimate, budget: float, n_ops: int) -> list[MemoryPeak]:
    """Constraints for the next solve: the buffers live at each op where the estimate exceeds
    the budget (one per distinct set of buffers)."""
    fixed = memory.argument_bytes + memory.output_bytes - memory.alias_bytes
    out: dict[tuple[tuple[int, int, int], ...], int] = {}
    for op in range(n_ops):
        buffers = memory.buffers_at(op)
        if fixed + sum(b for *_, b in buffers) > budget and buffers not in out:
            out[buffers] = op
    return [MemoryPeak(
        op=op,
        values=tuple((t, float(b)) for t, r, b in buffers if t >= 0 and r < 0),
        copies=tuple((t, r, float(b)) for t, r, b in buffers if r >= 0),
        fixed_bytes=float(memory.output_bytes - memory.alias_bytes
                          + sum(b for t, _, b in buffers if t < 0)))
        for buffers, op in out.items()]


def memory_cut(graph: OpGraph, mesh: LogicalMesh, peak: MemoryPeak,
                arguments: tuple[int, ...], memory: list[tuple[float, ...]],
                input_nodes: Mapping[int, int], op_nodes: Mapping[int, int],
                strategies: list[tuple[OpStrategy, ...]], *, name: str) -> MemoryCut:
    """A :class:`MemoryPeak` as a linear constraint on the nodes' strategies."""

    def local(t: int, specs: Iterable[Spec]) -> tuple[float, ...]:
        """Bytes of tensor ``t`` on one device in each of ``specs``."""
        return tuple(graph.tensors[t].nbytes / math.prod(mesh.size(axes) for axes in spec if axes)
                     for spec in specs)

    def decider(t: int) -> tuple[int | None, tuple[float, ...]]:
        """The node deciding tensor ``t``'s sharding and its bytes per strategy."""
        if t in input_nodes:
            i = input_nodes[t]
            return i, tuple(graph.tensors[t].nbytes / s.shards for s in strategies[i])
        producer = graph.tensors[t].producer
        if producer is None or producer not in op_nodes:
            return None, ()
        position = graph.ops[producer].outputs.index(t)
        n = op_nodes[producer]
        return n, local(t, (s.result_specs[position] for s in strategies[n]))

    terms: list[tuple[int, tuple[float, ...]]] = [(n, memory[n]) for n in arguments]
    fixed = peak.fixed_bytes
    for t, nbytes in peak.values:
        n, coefficients = decider(t)
        if n is None:
            fixed += nbytes
        else:
            terms.append((n, coefficients))
    gathered = {t: (reader, nbytes) for t, reader, nbytes in peak.copies}
    for t in input_nodes:
        readers = graph.consumers[t]
        if t not in gathered and readers and readers[0] <= peak.op <= readers[-1]:
            gathered[t] = (readers[0], 0.0)
    copies: list[tuple[int, tuple[float, ...], int, tuple[float, ...]]] = []
    for t, (reader, nbytes) in gathered.items():
        n, held = decider(t)
        r = op_nodes.get(reader)
        if n is None or r is None or t not in graph.ops[reader].inputs:
            fixed += nbytes
            continue
        i = graph.ops[reader].inputs.index(t)
        copies.append((r, local(t, (s.operand_specs[i] for s in strategies[r])), n, held))
    return MemoryCut(tuple(terms), fixed, name, tuple(copies))
