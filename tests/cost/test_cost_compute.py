"""Tests of the roofline compute model (shardplan/cost/compute.py) and of the calibration
(shardplan/cost/calibrate.py, ``shardplan calibrate``), numbers worked by hand."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import yaml

from shardplan._schema import Where
from shardplan.cli.main import main as cli_main
from shardplan.cluster import load_device
from shardplan.cluster.catalog import parse_device
from shardplan.cost.calibrate import fit_ring_link
from shardplan.cost.compute import (
    OpTime,
    compute_dtype,
    graph_compute_time_s,
    op_class,
    op_time_s,
    op_times,
    parameter_tensors,
)
from shardplan.trace import OpGraph, trace

A100 = load_device("a100-80g")  # bf16 312e12, fp32 19.5e12; eff matmul .75, memory .85; 2039e9 B/s
V100 = load_device("v100-32g")  # no bf16: fp16 125e12; eff matmul .70, memory .85; 900e9 B/s


def _sds(shape: tuple[int, ...], dtype: Any = jnp.bfloat16) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _dot_graph() -> OpGraph:
    """x [1024, 4096] @ w [4096, 4096], bf16."""
    return trace(lambda x, w: x @ w, _sds((1024, 4096)), _sds((4096, 4096)))


def _add_graph() -> OpGraph:
    """x + y on [1024, 4096] bf16."""
    return trace(lambda x, y: x + y, _sds((1024, 4096)), _sds((1024, 4096)))


def _train_step_graph() -> OpGraph:
    """A bf16 projection, a reshape to [batch, seq, heads, head_dim], q·qᵀ scores, grads, SGD."""

    def step(state: dict[str, Any], x: Any) -> Any:
        def loss(p: dict[str, Any]) -> Any:
            q = x @ p["wq"].astype(jnp.bfloat16)  # [8, 16]
            q = q.reshape(2, 4, 2, 8)  # [batch, seq, heads, head_dim]
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, q)  # [batch, heads, seq, seq]
            return scores.astype(jnp.float32).sum()

        value, grads = jax.value_and_grad(loss)(state)
        return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads), value

    return trace(step, {"wq": _sds((16, 16), jnp.float32)}, _sds((8, 16)))


# --------------------------------------------------------------------------------------------
# one op


def test_dot_roofline_on_a100_bf16() -> None:
    op = _dot_graph().ops[0]
    assert op.flops == 2 * 1024 * 4096 * 4096 == 34_359_738_368
    assert op.bytes_read + op.bytes_written == (1024 * 4096 + 4096 * 4096 + 1024 * 4096) * 2
    # compute: 34359738368 / (312e12 · 0.75)  = 146.8364887 µs
    # memory:  50331648 / (2039e9 · 0.85)     =  29.0406 µs      -> compute-bound
    t = op_time_s(op, A100, dtype="bfloat16")
    assert (t.dtype, t.bound, t.op_class) == ("bf16", "compute", "matmul")
    assert t.time_s == pytest.approx(146.8364887e-6, rel=1e-9)


def test_dot_on_v100_runs_bf16_as_fp16() -> None:
    op = _dot_graph().ops[0]
    # compute: 34359738368 / (125e12 · 0.70) = 392.6827242 µs (memory 65.79 µs)
    t = op_time_s(op, V100, dtype="bf16")
    assert t.dtype == "fp16"
    assert t.bound == "compute"
    assert t.time_s == pytest.approx(392.6827242e-6, rel=1e-9)


def test_add_roofline_is_memory_bound() -> None:
    op = _add_graph().ops[0]
    assert (op.flops, op.bytes_read + op.bytes_written) == (4_194_304, 25_165_824)
    # A100 memory: 25165824 / (2039e9 · 0.85) = 14.520280 µs (compute 4194304 / 265.2e12 = 16 ns)
    t = op_time_s(op, A100, dtype="bf16")
    assert (t.dtype, t.bound, t.op_class) == ("bf16", "memory", "memory_bound")
    assert t.time_s == pytest.approx(14.520280e-6, rel=1e-6)
    # V100 memory: 25165824 / (900e9 · 0.85) = 32.89650 µs, bf16 arithmetic runs as fp16
    t = op_time_s(op, V100, dtype="bf16")
    assert isinstance(t, OpTime)
    assert (t.dtype, t.bound, t.op_class) == ("fp16", "memory", "memory_bound")
    assert t.time_s == pytest.approx(32.89650e-6, rel=1e-6)


def test_transcendentals_count_at_the_fp32_rate() -> None:
    exp_op = trace(jnp.exp, _sds((1024, 4096))).ops[0]
    assert exp_op.transcendentals == 4_194_304
    no_bytes = dataclasses.replace(
        exp_op, flops=1e9, transcendentals=1e8, bytes_read=0, bytes_written=0
    )
    # 1e9 / (312e12 · 0.85) + 1e8 / (19.5e12 · 0.85) = 3.770739 µs + 6.033183 µs
    t = op_time_s(no_bytes, A100, dtype="bf16")
    assert t.bound == "compute"
    assert t.time_s == pytest.approx(1e9 / 265.2e12 + 1e8 / 16.575e12, rel=1e-12)


def test_divisors_split_flops_and_bytes() -> None:
    op = _dot_graph().ops[0]
    whole = op_time_s(op, A100, dtype="bf16").time_s
    assert op_time_s(op, A100, dtype="bf16", flops_divisor=4).time_s == pytest.approx(whole / 4)
    add = _add_graph().ops[0]
    whole = op_time_s(add, A100, dtype="bf16").time_s
    assert op_time_s(add, A100, dtype="bf16", bytes_divisor=8).time_s == pytest.approx(whole / 8)


# --------------------------------------------------------------------------------------------
# classification and dtypes


def test_op_class() -> None:
    graph = _train_step_graph()
    params = parameter_tensors(graph)
    dots = [op for op in graph.ops if op.primitive == "dot_general"]
    classes = [op_class(op, params) for op in dots]
    # forward x·w, forward q·qᵀ, its two gradients (still [batch, heads] batched), the dW dot
    assert classes == ["matmul", "attention", "attention", "attention", "matmul"]
    scores = dots[1]
    assert op_class(scores, {scores.inputs[0]}) == "matmul"  # a parameter operand: not attention
    assert op_class(_add_graph().ops[0]) == "memory_bound"
    kernel = dataclasses.replace(scores, primitive="pallas_call", scope="blocks.0.attn.flash")
    assert op_class(kernel) == "attention"
    assert op_class(dataclasses.replace(kernel, scope="blocks.0.moe", source="")) == "matmul"


def test_parameter_tensors_follow_casts() -> None:
    graph = _train_step_graph()
    params = parameter_tensors(graph)
    forward_dot = next(op for op in graph.ops if op.primitive == "dot_general")
    cast = graph.ops[graph.tensors[forward_dot.inputs[1]].producer or 0]
    assert cast.primitive == "convert_element_type"
    assert forward_dot.inputs[1] in params  # the bf16 cast of the fp32 weight is the weight


def test_compute_dtype() -> None:
    mixed = trace(
        lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.float32),
        _sds((64, 64)),
        _sds((64, 64)),
    )
    dot = mixed.ops[0]
    assert mixed.tensors[dot.outputs[0]].dtype == "float32"
    assert compute_dtype(dot, mixed) == "bf16"  # bf16 tensor cores, fp32 accumulation
    compare = trace(lambda x: x > 0, _sds((8,)))
    assert compute_dtype(compare.ops[-1], compare) == "bf16"  # bool result, bf16 operands
    integer = trace(lambda i: i + 1, _sds((8,), jnp.int32))
    assert compute_dtype(integer.ops[0], integer) == "fp32"


# --------------------------------------------------------------------------------------------
# a whole graph


def test_graph_total_on_a_traced_scan() -> None:
    def f(w: Any, x: Any) -> Any:
        def body(h: Any, _: Any) -> tuple[Any, None]:
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(body, x, None, length=3)
        return h.sum()

    graph = trace(f, _sds((256, 256), jnp.float32), _sds((128, 256), jnp.float32))
    dot, tanh, total = graph.ops
    assert (dot.primitive, dot.count, tanh.primitive, tanh.count) == ("dot_general", 3, "tanh", 3)
    assert total.primitive == "reduce_sum" and total.count == 1
    matmul_fp32 = 19.5e12 * 0.75
    memory = 2039e9 * 0.85
    # dot (fp32, x3):  2·128·256·256 = 16777216 FLOPs / 14.625e12 = 1.147160 µs
    #                  (its 524288 bytes / 1.73315e12 = 0.3025 µs)
    # tanh (x3):       (131072 + 131072) bytes / 1.73315e12 = 0.151253 µs
    #                  (32768 transcendentals / (19.5e12 · 0.85) = 2 ns)
    # sum (x1):        (131072 + 4) bytes / 1.73315e12 = 0.075629 µs
    # total: 3 · 1.147160 + 3 · 0.151253 + 0.075629 = 3.970868 µs
    expected = 3 * 16_777_216 / matmul_fp32 + 3 * 262_144 / memory + 131_076 / memory
    assert expected == pytest.approx(3.970868e-6, rel=1e-6)
    assert graph_compute_time_s(graph, A100) == pytest.approx(expected, rel=1e-9)
    # Sharding every op 4 ways divides the time by 4.
    quarter = graph_compute_time_s(graph, A100, divisor_of=lambda _: 4)
    assert quarter == pytest.approx(expected / 4, rel=1e-9)


def test_phases_views_and_folded_ops() -> None:
    graph = _train_step_graph()
    times = op_times(graph, A100)
    for op in graph.ops:
        free = op.primitive == "reshape" or op.attrs.get("folded") or op.structural
        assert (op.id in times) == (not free), op
    forward = graph_compute_time_s(graph, A100, phases={"forward"})
    by_hand = sum(
        t.time_s * graph.ops[i].count for i, t in times.items() if graph.ops[i].phase == "forward"
    )
    assert forward == pytest.approx(by_hand, rel=1e-12)
    rest = graph_compute_time_s(graph, A100, phases={"backward", "update", "other", "recompute"})
    assert forward + rest == pytest.approx(graph_compute_time_s(graph, A100), rel=1e-12)
    assert times[next(op.id for op in graph.ops if op.primitive == "dot_general")].dtype == "bf16"


def test_materialized_charges_only_buffers_that_stay_in_memory() -> None:
    graph = trace(lambda x: jnp.exp(x) * 2 + 1, _sds((1024, 4096)))  # exp, mul, add; 8 MiB each
    unfused = graph_compute_time_s(graph, A100)
    # every op reads and writes 8388608 bytes: 3 · 16777216 / (2039e9 · 0.85) = 29.04056 µs
    assert unfused == pytest.approx(3 * 16_777_216 / 1.73315e12, rel=1e-9)
    ends = {*graph.inputs, *(t for t in graph.outputs if t is not None)}
    fused = graph_compute_time_s(graph, A100, materialized=ends.__contains__)
    # one loop fusion: exp reads x, add writes the result, the intermediates stay in registers
    #   exp: 8388608 / 1.73315e12 = 4.840088 µs;  mul: 4194304 / (312e12 · 0.85) = 15.8 ns
    #   add: 8388608 / 1.73315e12 = 4.840088 µs
    expected = 2 * 8_388_608 / 1.73315e12 + 4_194_304 / 265.2e12
    assert fused == pytest.approx(expected, rel=1e-9)
    everything = graph_compute_time_s(graph, A100, materialized=lambda _: True)
    assert everything == pytest.approx(unfused, rel=1e-12)


# --------------------------------------------------------------------------------------------
# calibration


def test_fit_ring_link_recovers_alpha_and_bandwidth() -> None:
    def ring_s(nbytes: float) -> float:  # 4 devices, 10 GB/s, 20 µs: (4 + 2·3)·α + 2·3/4 · B/bw
        return 10 * 20e-6 + 1.5 * nbytes / 10e9

    link = fit_ring_link(4, 2**14, ring_s(2**14), 2**22, ring_s(2**22))
    assert link.bandwidth_bytes_per_s == pytest.approx(10e9, rel=1e-9)
    assert link.latency_s == pytest.approx(20e-6, rel=1e-9)
    # Noise: the large message no slower than the small one -> bandwidth from the large alone.
    noisy = fit_ring_link(4, 2**14, 1e-3, 2**22, 1e-3)
    assert noisy.bandwidth_bytes_per_s == pytest.approx(1.5 * 2**22 / 1e-3)
    small_bytes_s = 1.5 * 2**14 / noisy.bandwidth_bytes_per_s
    assert noisy.latency_s == pytest.approx((1e-3 - small_bytes_s) / 10)  # α0 + 6α = 10α


@pytest.mark.slow
def test_quick_calibration_writes_a_valid_device_yaml(tmp_path: Path) -> None:
    out = tmp_path / "cpu.yaml"
    start = time.perf_counter()
    assert cli_main(["calibrate", "--quick", "--out", str(out)]) == 0
    assert time.perf_counter() - start < 60  # typically 1-3 s on CPU; loose against noisy CI
    data = yaml.safe_load(out.read_text())
    spec = load_device(data)
    catalog_spec = parse_device(data, Where(path=str(out)), catalog=True)  # catalog-complete
    assert catalog_spec == spec
    assert spec.name == "cpu" and spec.peak_flops_per_s == load_device("cpu").peak_flops_per_s
    for name, value in spec.efficiency.to_dict().items():
        assert 0 < value <= 1, name
        source = spec.sources[f"efficiency.{name}"]
        assert source.startswith("measured: "), source
        assert f"jax {jax.__version__}" in source and source.endswith(", cpu")
    assert "psum over 8 devices" in spec.sources["intra_node_link.latency_us"]
