"""Tests of XLA's all-reduce combiner in the cost model (shardplan/cost/combine.py).

The premise, checked against XLA:CPU here: the gradient all-reduces of a data-parallel step
compile to one call (up to 256 operands a call), the tensor-parallel all-reduces of a Megatron
MLP to one call each; ``combinable_ops`` says which is which from the traced graph alone, and
a combinable all-reduce pays ``startup_share`` of one call's start-up.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardplan as sp
from shardplan.cluster import Cluster, load_device
from shardplan.cost.collectives import collective_startup_s, collective_time_s
from shardplan.cost.combine import (
    COMBINE_THRESHOLD_COUNT,
    GPU_COMBINE_THRESHOLD_BYTES,
    combinable_ops,
    startup_share,
)
from shardplan.errors import ClusterError
from shardplan.xla import read_compiled

WIDTH, BATCH, LAYERS = 64, 16, 4


def _loss(params, x):
    for w, b in params:
        x = jnp.tanh(x @ w + b)
    return jnp.mean(x**2)


def _step(params, x):
    loss, grads = jax.value_and_grad(_loss)(params, x)
    updated = [(w - 0.1 * gw, b - 0.1 * gb)
               for (w, b), (gw, gb) in zip(params, grads, strict=True)]
    return updated, loss


def _params():
    return [(jnp.full((WIDTH, WIDTH), 0.01 * (i + 1)), jnp.full((WIDTH,), 0.1))
            for i in range(LAYERS)]


def _all_reduces(shardings, params, x):
    mesh_params, batch = shardings
    compiled = jax.jit(_step, in_shardings=(mesh_params, batch)).lower(params, x).compile()
    return [c for c in read_compiled(compiled).collectives if c.kind == "all-reduce"]


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:4])


def test_weight_and_bias_gradients_and_the_loss_combine_and_nothing_else() -> None:
    params, x = _params(), jnp.ones((BATCH, WIDTH))
    graph = sp.trace(_step, params, x)
    combinable = combinable_ops(graph)
    ops = [graph.ops[o] for o in sorted(combinable)]
    # Per layer the kernel gradient (x^T dy, contracting the batch) and the bias gradient
    # (dy summed over the batch), and the loss's mean: 2 x 4 + 1.
    assert len(ops) == 2 * LAYERS + 1
    gradients = {graph.tensors[op.outputs[0]].shape for op in ops if op.phase == "backward"}
    assert gradients == {(WIDTH, WIDTH), (WIDTH,)}
    assert [op.phase for op in ops].count("backward") == 2 * LAYERS
    (loss,) = [op for op in ops if op.phase != "backward"]
    assert graph.tensors[loss.outputs[0]].shape == ()
    # Every forward matmul feeds a later one (or the loss's backward), and every activation
    # gradient of the backward pass feeds an earlier layer's gradients: none combines.
    for op in graph.ops:
        if op.primitive == "dot_general" and op.id not in combinable:
            assert op.phase == "forward" or graph.tensors[op.outputs[0]].shape == (BATCH, WIDTH)


def test_data_parallel_gradients_compile_to_one_all_reduce_call(mesh) -> None:
    # The premise: every gradient of the 4 layers (kernel and bias) and the loss is one
    # operand of one combined all-reduce on XLA:CPU.
    params, x = _params(), jnp.ones((BATCH, WIDTH))
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
    calls = _all_reduces((replicated, NamedSharding(mesh, P("d"))), params, x)
    assert len(calls) == 1
    gradient_bytes = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    assert calls[0].bytes == gradient_bytes + 4  # and the f32 loss
    assert len(combinable_ops(sp.trace(_step, params, x))) == 2 * LAYERS + 1


def test_megatron_all_reduces_stay_one_call_each(mesh) -> None:
    # Column then row split in pairs: the row-split matmul's partial sums feed the next layer.
    params, x = _params(), jnp.ones((BATCH, WIDTH))
    specs = [(P(None, "d"), P("d")) if i % 2 == 0 else (P("d", None), P()) for i in range(LAYERS)]
    shardings = [tuple(NamedSharding(mesh, s) for s in pair) for pair in specs]
    calls = _all_reduces((shardings, NamedSharding(mesh, P())), params, x)
    # 2 forward (after each row-split layer) and 1 backward (into the first pair's column
    # split): each its own call, as combinable_ops says (none of them is in it).
    forward = [c for c in calls if c.bytes == BATCH * WIDTH * 4]
    assert len(forward) == len(calls) == 3


def test_startup_share_follows_the_thresholds() -> None:
    a100, cpu = load_device("a100-80g"), load_device("cpu")
    assert startup_share(GPU_COMBINE_THRESHOLD_BYTES, a100) == 1.0
    assert startup_share(GPU_COMBINE_THRESHOLD_BYTES / 4, a100) == pytest.approx(0.25)
    assert startup_share(0, a100) == 1 / COMBINE_THRESHOLD_COUNT
    assert startup_share(2**30, cpu) == 1 / COMBINE_THRESHOLD_COUNT


def test_a_combined_all_reduce_pays_its_share_of_the_start_up_and_the_rest_in_full() -> None:
    cluster = Cluster.from_yaml("configs/clusters/dgx-a100.yaml")
    whole = collective_time_s("all-reduce", 2**20, range(8), cluster)
    alpha0 = collective_startup_s("all-reduce", range(8), cluster)
    assert alpha0 == pytest.approx(8e-6)  # 4 x 2 µs NVLink steps
    quarter = collective_time_s("all-reduce", 2**20, range(8), cluster, startup_share=0.25)
    assert whole - quarter == pytest.approx(0.75 * alpha0)
    assert collective_time_s("all-reduce", 2**20, [3], cluster, startup_share=0.0) == 0.0
    with pytest.raises(ClusterError, match="startup_share"):
        collective_time_s("all-reduce", 2**20, range(8), cluster, startup_share=1.5)
    assert math.isclose(collective_startup_s("collective-permute", [0, 1], cluster), 8e-6)
