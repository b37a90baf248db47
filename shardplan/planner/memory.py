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

Before any of that, :func:`check_state_fits` refuses a state that the whole cluster could not
hold even perfectly sharded, with the per-device lower bound and the devices it would take.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shardplan.cluster import Cluster
from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.memory import MemoryEstimate
from shardplan.cost.sharding import Spec
from shardplan.cost.strategies import OpStrategy
from shardplan.errors import InfeasibleError, format_error
from shardplan.solver import MemoryCut
from shardplan.trace.graph import OpGraph

__all__ = ["MemoryPeak", "check_state_fits", "memory_cut", "memory_peaks", "state_bytes"]


def state_bytes(state: Any, /) -> int:
    """The bytes of every leaf of ``state`` (arrays, scalars or ``ShapeDtypeStruct``s; a
    Python scalar counts 4 bytes)."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(state):
        itemsize = getattr(getattr(leaf, "dtype", None), "itemsize", 4)
        total += math.prod(getattr(leaf, "shape", ())) * itemsize
    return total


def check_state_fits(state: Any, cluster: Cluster, budgets: Sequence[float]) -> None:
    """Refuses a state larger than the usable memory of all of ``cluster``'s devices together.

    Every plan keeps at least one copy of the state (parameters and optimizer state) in device
    memory, so ``state bytes / devices`` is a lower bound on a device's share, and no group of
    ``b`` usable bytes per device holds the state alone on fewer than ``state bytes / b``
    devices. This check is cheap (no trace) and spares the solvers a search with no answer.

    Args:
      state: the state pytree.
      cluster: the cluster.
      budgets: per group (``cluster.groups`` order), the usable bytes per device.

    Raises:
      InfeasibleError: giving the state's bytes, the per-device lower bound and, per device
        type, the fewest devices that could hold the state.
    """
    need = state_bytes(state)
    have = sum(len(g.device_ids) * b for g, b in zip(cluster.groups, budgets, strict=True))
    if need <= have:
        return
    lines = [f"{g.device.name}: at least {math.ceil(need / b):,} devices "
             f"({b:,.0f} usable bytes each; the cluster has {len(g.device_ids)})"
             for g, b in zip(cluster.groups, budgets, strict=True) if b > 0]
    raise InfeasibleError(format_error(
        f"The state alone ({need:,} bytes of parameters and optimizer state) exceeds the "
        f"usable memory of all {cluster.num_devices} devices together ({have:,.0f} bytes): "
        f"even perfectly sharded, the fullest device would hold >= "
        f"{math.ceil(need / cluster.num_devices):,} bytes (the per-device lower bound).",
        where=f"state, on cluster {cluster.name!r}",
        value={"state_bytes": need, "per_device_lower_bound_bytes":
               math.ceil(need / cluster.num_devices)},
        remedy="use more or larger devices (the state alone needs, per device type: "
               + "; ".join(lines) + "), a smaller model, or a smaller optimizer state "
               "(e.g. bf16 moments), or raise PlanConfig.memory_budget_bytes"))


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
