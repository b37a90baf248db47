"""From a solved intra-op problem back to the graph: input shardings, the per-op constraints
the runtime pins, and the sharding analysis the predictions are made from."""

from __future__ import annotations

from shardplan.cost.sharding import ShardingAnalysis, Spec, analyze_sharding, leaf_specs
from shardplan.planner.nodes import IntraOpProblem
from shardplan.solver import Solution
from shardplan.trace.graph import OpGraph

__all__ = ["decode_constraints", "decode_input_specs", "placed_analysis"]


def decode_constraints(graph: OpGraph, ip: IntraOpProblem, solution: Solution
                       ) -> dict[tuple[int, ...], tuple[int, tuple[Spec, ...], tuple[Spec, ...]]]:
    """What to pin, by equation path: ``{path: (op id, result specs, operand specs)}``.

    Every op (not a value regenerated from constants; not inside a ``while`` or ``cond`` body,
    which the runtime does not address) with a non-scalar result; a ``scan`` body's ops too. Followers are pinned too: a value whose producer
    is free while two consumers read it differently is where the partitioner makes its own
    choice (measured: computing a replicated value sharded for one consumer and gathering it
    for the other), so nothing is left to propagation. Its results are pinned as the chosen strategy leaves
    them after reducing partial sums, which is how the solver priced its consumers; its
    operands as the strategy reads them (operand specs follow ``op.inputs``, which omits
    literals: the runtime matches them to the equation's non-literal operands).
    """
    if solution.assignment is None:
        raise ValueError("the solution has no assignment")
    out: dict[tuple[int, ...], tuple[int, tuple[Spec, ...], tuple[Spec, ...]]] = {}
    for op in graph.ops:
        n = ip.op_nodes.get(op.id)
        if (n is None or op.path is None or op.structural
                or op.attrs.get("folded") or any(t in ip.free_tensors for t in op.outputs)
                or not any(graph.tensors[t].shape for t in op.outputs)):
            continue
        strategy = ip.strategies[n][solution.assignment[n]]
        out[op.path] = (op.id, strategy.result_specs, strategy.operand_specs)
    return out


def decode_input_specs(ip: IntraOpProblem, solution: Solution) -> dict[int, Spec]:
    """The chosen sharding of every input tensor."""
    if solution.assignment is None:
        raise ValueError("the solution has no assignment")
    return {
        t: ip.strategies[n][solution.assignment[n]].result_specs[0]
        for t, n in ip.input_nodes.items()
    }


def placed_analysis(graph: OpGraph, ip: IntraOpProblem, solution: Solution, *,
                    reduce_scatter: bool) -> ShardingAnalysis:
    """The sharding analysis of a solution: inputs as decoded and every op placed as the
    solver decided (the runtime pins the deciding ops; the others follow them); values built
    from constants are left to propagation."""
    specs = decode_input_specs(ip, solution)
    ins, outs = leaf_specs(graph, ip.mesh, lambda p: specs[p.tensor])
    pinned, factors = dict(ins), {}
    assignment = solution.assignment or ()
    for op in graph.ops:
        if any(t in ip.free_tensors for t in op.outputs):
            continue
        strategy = ip.strategies[ip.op_nodes[op.id]][assignment[ip.op_nodes[op.id]]]
        factors[op.id] = strategy.factors
        pinned.update(zip(op.outputs, strategy.result_specs, strict=True))
    return analyze_sharding(graph, ip.mesh, pinned, outs, reduce_scatter=reduce_scatter,
                            op_factors=factors)
