"""Candidate sharding strategies of one op on a mesh: the choices the intra-op solver makes.

A strategy assigns each mesh axis to at most one of the op's shardable factors (see
:mod:`shardplan.cost.rules`), with every factor's size divisible by the product of its axes.
That fixes the op's operand and result shardings, the axes its result is a partial sum over,
and how many devices share its work. For a ``dot_general`` on a 1-D mesh of axis ``x`` the
strategies are: replicated, split the lhs free dimension (row split of the activations: data
parallel), split the rhs free dimension (column split of the weight), split the contracted
dimension (row split of the weight; partial result). On a 2-D mesh each axis chooses
independently, which yields the 2-D strategies (data × tensor parallel) as products.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping

from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.rules import OpRule
from shardplan.cost.sharding import Spec

__all__ = ["OpStrategy", "enumerate_strategies", "factor_specs"]


@dataclasses.dataclass(frozen=True)
class OpStrategy:
    """One way to shard an op.

    Attributes:
      factors: ``{factor id: mesh axes}`` for the sharded factors.
      operand_specs: the sharding each operand must have.
      result_specs: the sharding of each result (before reducing partial sums).
      partial_axes: axes the results are partial sums over (a sharded contraction).
      shards: devices sharing the op's work (product of the sizes of all used axes).
    """

    factors: Mapping[int, tuple[str, ...]]
    operand_specs: tuple[Spec, ...]
    result_specs: tuple[Spec, ...]
    partial_axes: tuple[str, ...]
    shards: int

    @property
    def is_replicated(self) -> bool:
        return not self.factors


def factor_specs(dims_list, factors: Mapping[int, tuple[str, ...]]) -> tuple[Spec, ...]:
    """Per tensor, its spec when ``factors`` (``{factor id: axes}``) are sharded."""
    return tuple(tuple(tuple(a for f in fs for a in factors.get(f, ())) for fs in dims)
                 for dims in dims_list)


def enumerate_strategies(rule: OpRule, mesh: LogicalMesh) -> tuple[OpStrategy, ...]:
    """All strategies of an op (replicated first), deduplicated, in a deterministic order.

    Args:
      rule: the op's factor rule.
      mesh: the mesh; axes of size 1 are ignored.

    Returns:
      The strategies. Each mesh axis goes to at most one factor; a factor's size must be
      divisible by the product of its axes' sizes; ``fixed`` factors stay replicated.
    """
    axes = [a for a, n in zip(mesh.axis_names, mesh.axis_sizes, strict=True) if n > 1]
    eligible = [f for f, factor in enumerate(rule.factors)
                if factor.kind != "fixed" and factor.size > 1]
    seen: set[tuple[tuple[int, tuple[str, ...]], ...]] = set()
    out: list[OpStrategy] = []
    for choice in itertools.product([None, *eligible], repeat=len(axes)):
        factors: dict[int, tuple[str, ...]] = {}
        for axis, f in zip(axes, choice, strict=True):
            if f is not None:
                factors[f] = (*factors.get(f, ()), axis)
        if any(rule.factors[f].size % mesh.size(ax) for f, ax in factors.items()):
            continue
        key = tuple(sorted(factors.items()))
        if key in seen:
            continue
        seen.add(key)
        partial = tuple(a for f, ax in sorted(factors.items())
                        if rule.factors[f].kind == "reduce" for a in ax)
        used = tuple(a for ax in factors.values() for a in ax)
        out.append(OpStrategy(factors=factors, operand_specs=factor_specs(rule.operands, factors),
                              result_specs=factor_specs(rule.results, factors),
                              partial_axes=partial, shards=mesh.size(used)))
    return tuple(out)
