"""Strategy enumeration and resharding steps: the vocabulary of the intra-op solver."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import shardplan as sp
from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.rules import op_rule
from shardplan.cost.sharding import ReshardStep, reduce_steps, reshard_steps
from shardplan.cost.strategies import enumerate_strategies


def _dot_rule():
    graph = sp.trace(lambda x, w: x @ w, jax.ShapeDtypeStruct((32, 256), jnp.float32),
                     jax.ShapeDtypeStruct((256, 512), jnp.float32))
    (op,) = [o for o in graph.ops if o.primitive == "dot_general"]
    return op_rule(graph, op)


def test_dot_on_a_line_has_the_four_classic_strategies() -> None:
    rule = _dot_rule()
    mesh = LogicalMesh.create((4,), ("x",))
    strategies = enumerate_strategies(rule, mesh)
    by_operands = {s.operand_specs: s for s in strategies}
    # replicated; rows of x (data parallel); columns of w (column split); the contraction
    # (row split of w: each device holds a partial sum of the result).
    assert set(by_operands) == {
        (((), ()), ((), ())),
        ((("x",), ()), ((), ())),
        (((), ()), ((), ("x",))),
        (((), ("x",)), (("x",), ())),
    }
    assert strategies[0].is_replicated and strategies[0].shards == 1
    row_split = by_operands[(((), ("x",)), (("x",), ()))]
    assert row_split.partial_axes == ("x",) and row_split.result_specs == (((), ()),)
    assert all(s.shards == 4 for s in strategies[1:])


def test_two_axes_choose_independently_and_respect_divisibility() -> None:
    rule = _dot_rule()
    mesh = LogicalMesh.create((2, 4), ("data", "model"))
    strategies = enumerate_strategies(rule, mesh)
    # Each of the two axes picks none or one of 3 factors: 16 combinations, all divisible.
    assert len(strategies) == 16
    megatron_2d = [s for s in strategies
                   if s.operand_specs == ((("data",), ()), ((), ("model",)))]
    assert len(megatron_2d) == 1 and megatron_2d[0].shards == 8
    # A factor of size 3 cannot be split 2 ways.
    graph = sp.trace(lambda x: x * 2, jax.ShapeDtypeStruct((3, 8), jnp.float32))
    (op,) = graph.ops
    specs = {s.operand_specs for s in enumerate_strategies(op_rule(graph, op),
                                                           LogicalMesh.create((2,), ("x",)))}
    assert specs == {(((), ()),), (((), ("x",)),)}


def test_reshard_steps() -> None:
    assert reshard_steps((("x",), ()), (("x",), ())) == ()
    # Adding sharding is a free slice.
    assert reshard_steps(((), ()), (("x",), ())) == ()
    assert reshard_steps((("x",), ()), ((), ())) == (ReshardStep("all-gather", ("x",),
                                                                 ((), ())),)
    assert reshard_steps((("x",), ()), ((), ("x",))) == (ReshardStep("all-to-all", ("x",),
                                                                     ((), ("x",))),)
    # Axes dropped from both dimensions: one all-gather each, the last dimension first.
    assert reshard_steps((("x",), ("y",)), ((), ())) == (
        ReshardStep("all-gather", ("y",), (("x",), ())),
        ReshardStep("all-gather", ("x",), ((), ())))
    # Moved and dropped at once, or an axis put in front of another: XLA gathers the whole
    # value and slices it (see reshard_steps); priced as that all-gather.
    assert reshard_steps((("x", "y"), ()), ((), ("y",))) == (
        ReshardStep("all-gather", ("x", "y"), ((), ())),)
    assert reshard_steps((("y",), ()), (("x", "y"), ())) == (
        ReshardStep("all-gather", ("y",), ((), ())),)
    # A partial sum reduced to a sharded result: reduce-scatter (all-reduce on CPU).
    assert reduce_steps(((), ()), (("x",), ()), ("x",)) == (
        ReshardStep("reduce-scatter", ("x",), (("x",), ())),)
    assert reduce_steps(((), ()), (("x",), ()), ("x",), reduce_scatter=False) == (
        ReshardStep("all-reduce", ("x",), ((), ())),)
