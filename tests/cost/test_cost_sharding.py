"""Predicted communication, FLOPs and memory of sharded train steps, checked against XLA.

Each case compiles a tiny model's train step on 8 CPU devices under hand-written shardings and
compares shardplan's prediction (propagated from the same input shardings) with what XLA
compiled: collective bytes per kind from the optimized HLO, per-device FLOPs from
``cost_analysis`` and argument, output, temp and peak bytes from ``memory_analysis``.
"""

from __future__ import annotations

import jax
import pytest
import shardplan_models as models
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from shardplan_models.sharding import data_parallel, fsdp, megatron, with_batch

import shardplan as sp
from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.memory import estimate_memory
from shardplan.cost.rules import op_rule
from shardplan.cost.sharding import analyze_sharding, leaf_specs
from shardplan.xla import read_compiled

BATCH = 64
CASES = {
    "dp8": ("gpt-tiny", {}, (8,), ("data",), with_batch(data_parallel, "data")),
    "tp8": ("gpt-tiny", {"n_heads": 8}, (8,), ("model",), megatron("model")),
    "fsdp8": ("gpt-tiny", {}, (8,), ("data",), with_batch(fsdp("data", 8), "data")),
    "dp2xtp4": ("gpt-tiny", {}, (2, 4), ("data", "model"),
                with_batch(megatron("model"), "data")),
    "llama-dp2xtp4": ("llama-tiny", {"n_kv_heads": 4}, (2, 4), ("data", "model"),
                      with_batch(megatron("model"), "data")),
    "moe-dp8": ("moe-tiny", {}, (8,), ("data",), with_batch(data_parallel, "data")),
}


def _case(name: str):
    model, overrides, shape, axes, rule = CASES[name]
    cfg = models.load_model_config(model, overrides=overrides)
    graphdef, state = models.abstract_train_state(cfg)
    step = models.make_train_step(graphdef)
    batch = models.example_batch(cfg, BATCH, abstract=True)
    graph = sp.trace(step, state, batch)
    mesh = LogicalMesh.create(shape, axes)
    in_specs, out_specs = leaf_specs(graph, mesh, rule)
    # XLA's CPU pipeline keeps all-reduce + slice where GPU and TPU emit reduce-scatter.
    analysis = analyze_sharding(graph, mesh, in_specs, out_specs, reduce_scatter=False)
    jmesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(shape))

    def named(spec):
        return NamedSharding(jmesh, P(*[(s if len(s) != 1 else s[0]) or None for s in spec]))

    leaves = [named(in_specs[p.tensor]) for p in graph.parameters]
    treedef = jax.tree_util.tree_structure((state, batch))
    state_sh, batch_sh = jax.tree_util.tree_unflatten(treedef, leaves)
    metrics = jax.eval_shape(step, state, batch)[1]
    out_sh = (state_sh, jax.tree.map(lambda _: NamedSharding(jmesh, P()), metrics))
    compiled = jax.jit(step, in_shardings=(state_sh, batch_sh),
                       out_shardings=out_sh).lower(state, batch).compile()
    return graph, analysis, read_compiled(compiled)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    return request.param, *_case(request.param)


def test_collective_bytes_per_kind_match_the_compiled_hlo(case) -> None:
    name, _graph, analysis, report = case
    predicted = analysis.collective_summary()
    compiled = report.collective_summary()
    assert set(predicted) == set(compiled), (name, predicted, compiled)
    for kind, row in compiled.items():
        assert predicted[kind]["bytes"] == pytest.approx(row["bytes"], rel=0.01), (name, kind)


def test_per_device_flops_match_cost_analysis(case) -> None:
    name, graph, analysis, report = case
    assert analysis.per_device_flops(graph) == pytest.approx(report.flops_loop_corrected,
                                                             rel=0.02), name


def test_argument_and_output_bytes_match_memory_analysis(case) -> None:
    name, graph, analysis, report = case
    estimate = estimate_memory(graph, lambda t: analysis.local_bytes(graph, t))
    assert estimate.argument_bytes == report.memory.argument_bytes, name
    assert estimate.output_bytes == pytest.approx(report.memory.output_bytes, rel=0.01), name


def test_peak_memory_matches_memory_analysis(case) -> None:
    name, graph, analysis, report = case
    estimate = estimate_memory(graph, lambda t: analysis.local_bytes(graph, t),
                               collectives=analysis.collectives)
    m = report.memory
    # memory_analysis()'s peak_memory_in_bytes is 0 on CPU; the allocation is the sum.
    compiled = m.argument_bytes + m.output_bytes + m.temp_bytes - m.alias_bytes
    assert estimate.peak_bytes == pytest.approx(compiled, rel=0.10), name
    # The intermediates alone, which the arguments and results (exact) would otherwise hide.
    assert estimate.temp_bytes == pytest.approx(m.temp_bytes, rel=0.10), name


def test_data_parallel_gradients_are_one_reduction_per_parameter() -> None:
    graph, analysis, _ = _case("dp8")
    reduced = {c.tensor for c in analysis.collectives
               if c.kind == "all-reduce" and graph.tensors[c.tensor].shape}
    grad_bytes = sum(graph.tensors[t].nbytes for t in reduced)
    # Every trained parameter's gradient is all-reduced once (the tied embedding twice: its
    # gradient has two parts, from the lookup and from the output head).
    wte = graph.param_by_path["0/wte/embedding/value"].nbytes
    assert grad_bytes == sum(p.nbytes for p in graph.params_with_role("parameter")) + wte


def test_megatron_mlp_reduces_activations_not_weights() -> None:
    graph, analysis, _ = _case("tp8")
    kinds = {c.kind for c in analysis.collectives}
    assert kinds == {"all-reduce"}
    forward = [c for c in analysis.collectives if graph.ops[c.op].phase == "forward"
               and graph.tensors[c.tensor].shape]
    # One all-reduce after attention-out and one after MLP-out per block, of [B, S, d].
    assert len(forward) == 2 * 2
    assert all(graph.tensors[c.tensor].shape == (BATCH, 32, 64) for c in forward)


def test_rules_cover_every_op_of_the_reference_models() -> None:
    cfg = models.load_model_config("moe-tiny")
    graphdef, state = models.abstract_train_state(cfg)
    graph = sp.trace(models.make_train_step(graphdef), state,
                     models.example_batch(cfg, 8, abstract=True))
    for op in graph.ops:
        rule = op_rule(graph, op)
        assert len(rule.operands) == len(op.inputs) and len(rule.results) == len(op.outputs)
        for t, dims in zip(op.inputs, rule.operands, strict=True):
            assert len(dims) == len(graph.tensors[t].shape) or not dims, op
