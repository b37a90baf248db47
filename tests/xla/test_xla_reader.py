"""Tests of shardplan.xla: the HLO text parser and the report over a compiled program.

Compiled programs run on the 8 fake CPU devices of conftest.py. Expected collective bytes are
per device and worked out in comments (f32 = 4 bytes). The GPU async forms (``*-start``,
``async-start``) do not appear on CPU; they are tested on hand-written fixtures in
``tests/data/hlo/``.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.xla import (
    ArrayShape,
    CompiledReport,
    MemoryReport,
    TupleShape,
    parse_hlo,
    parse_hlo_module,
    parse_replica_groups,
    parse_shape,
    read_compiled,
    read_hlo_text,
)

HLO_DATA = Path(__file__).parents[1] / "data" / "hlo"
ALL_8 = (tuple(range(8)),)
RING_8 = tuple((i, (i + 1) % 8) for i in range(8))
TP_GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))  # the 'tp' axis of a row-major 2x4 mesh
DP_GROUPS = ((0, 4), (1, 5), (2, 6), (3, 7))  # its 'dp' axis


def _fixture(name: str) -> str:
    return (HLO_DATA / name).read_text()


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


# --------------------------------------------------------------------------------------------
# Compiled programs on 8 CPU devices
# --------------------------------------------------------------------------------------------


def test_each_collective_once_exact_counts_and_bytes() -> None:
    mesh = _mesh((8,), ("x",))

    def f(a):  # a: f32[8,16] per device (the global f32[64,16] split over x)
        return (
            jax.lax.psum(a, "x"),
            jax.lax.all_gather(a, "x", tiled=True),
            jax.lax.psum_scatter(a, "x", scatter_dimension=0, tiled=True),
            jax.lax.all_to_all(a, "x", 0, 0, tiled=True),
            jax.lax.ppermute(a, "x", list(RING_8)),
        )

    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    report = read_compiled(step.lower(jnp.ones((64, 16))).compile())

    # psum          → f32[8,16]  = 8·16·4  =  512 B
    # all_gather    → f32[64,16] = 64·16·4 = 4096 B
    # psum_scatter  → f32[1,16]  = 1·16·4  =   64 B
    # all_to_all    → f32[8,16]  = 512 B (on CPU a tuple of 8 × f32[1,16]: 8·64 = 512 B)
    # ppermute      → f32[8,16]  =  512 B
    assert report.collective_summary() == {
        "all-reduce": {"count": 1, "bytes": 512},
        "all-gather": {"count": 1, "bytes": 4096},
        "reduce-scatter": {"count": 1, "bytes": 64},
        "all-to-all": {"count": 1, "bytes": 512},
        "collective-permute": {"count": 1, "bytes": 512},
    }
    by_kind = {c.kind: c for c in report.collectives}
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        assert by_kind[kind].replica_groups == ALL_8, kind
    assert by_kind["collective-permute"].source_target_pairs == RING_8
    assert by_kind["collective-permute"].group_size == 2
    assert by_kind["all-gather"].shape == ArrayShape("f32", (64, 16))
    for c in report.collectives:
        assert c.dtype == "f32" and c.trip_count_known and not c.is_scalar
        assert c.op_name is not None and "shard_map" in c.op_name
        assert c.source is not None and Path(c.source.rsplit(":", 1)[0]).name == Path(__file__).name


@pytest.fixture(scope="module")
def mlp_report() -> CompiledReport:
    """A dp×tp MLP train step on a 2x4 mesh, compiled once for the tests that read it."""
    mesh = _mesh((2, 4), ("dp", "tp"))

    def loss(params, x, y):
        h = jax.nn.relu(x @ params["w1"])  # [batch, hidden], hidden split over tp
        return jnp.mean((h @ params["w2"] - y) ** 2)  # partial sums over tp → all-reduce

    def train_step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    param_shardings = {
        "w1": NamedSharding(mesh, P(None, "tp")),  # [64, 256] → [64, 64] per device
        "w2": NamedSharding(mesh, P("tp", None)),  # [256, 64] → [64, 64] per device
    }
    data = NamedSharding(mesh, P("dp", None))  # [32, 64] → [16, 64] per device
    step = jax.jit(
        train_step,
        in_shardings=(param_shardings, data, data),
        out_shardings=(param_shardings, NamedSharding(mesh, P())),
    )
    params = {"w1": jnp.ones((64, 256)), "w2": jnp.ones((256, 64))}
    return read_compiled(step.lower(params, jnp.ones((32, 64)), jnp.ones((32, 64))).compile())


def test_dp_tp_mlp_train_step_collectives_and_groups(mlp_report: CompiledReport) -> None:
    report = mlp_report
    all_reduces = report.collectives.of_kind("all-reduce")
    tp = [c for c in all_reduces if c.replica_groups == TP_GROUPS]
    dp = [c for c in all_reduces if c.replica_groups == DP_GROUPS]
    assert len(tp) + len(dp) == len(all_reduces) == len(report.collectives)
    # Activation all-reduce over tp: h @ w2 partial sums, f32[16,64] = 16·64·4 = 4096 B.
    assert sum(c.total_bytes for c in tp) == 4096
    assert [str(s) for c in tp for s in c.shapes] == ["f32[16,64]"]
    # Gradient sync over dp: dw1 and dw2, f32[64,64] each, plus the loss mean, f32[]:
    # 2·64·64·4 + 4 = 32772 B (XLA's combiner may fold them into one tuple all-reduce).
    assert sum(c.total_bytes for c in dp) == 32772
    assert sorted(str(s) for c in dp for s in c.shapes) == ["f32[64,64]", "f32[64,64]", "f32[]"]
    assert report.collective_summary() == {
        "all-reduce": {"count": len(all_reduces), "bytes": 4096 + 32772}
    }
    non_scalar = report.collective_summary(include_scalar=False)["all-reduce"]["bytes"]
    assert non_scalar in (4096 + 32768, 4096 + 32772)  # the loss is alone, or combined
    # XLA's own flops equal our HLO count (no loops): ≥ 5 matmuls of 2·16·64·64 each.
    assert report.flops == report.hlo.flops == report.flops_loop_corrected
    assert report.flops >= 5 * 2 * 16 * 64 * 64
    (param_in, x_in, _), _ = report.input_shardings
    assert param_in["w1"].spec == P(None, "tp") and x_in.spec == P("dp", None)


def test_memory_analysis_fields(mlp_report: CompiledReport) -> None:
    memory = mlp_report.memory
    assert memory is not None
    fields = (
        memory.argument_bytes,
        memory.output_bytes,
        memory.temp_bytes,
        memory.alias_bytes,
        memory.generated_code_bytes,
        memory.peak_bytes,
    )
    assert all(v >= 0 for v in fields)
    # Arguments per device: w1, w2 [64,64] f32 + x, y [16,64] f32 = 2·16384 + 2·4096 B.
    assert memory.argument_bytes == 40960
    assert memory.peak_bytes == (memory.argument_bytes + memory.output_bytes
                                 + memory.temp_bytes - memory.alias_bytes)
    # XLA:CPU's own figure leaves the temporaries out.
    assert memory.argument_bytes <= memory.xla_peak_bytes < memory.peak_bytes


def test_memory_report_reads_a_backend_without_a_peak_figure() -> None:
    stats = SimpleNamespace(
        argument_size_in_bytes=100,
        output_size_in_bytes=40,
        temp_size_in_bytes=30,
        alias_size_in_bytes=40,
        generated_code_size_in_bytes=7,
    )  # an older backend: no peak_memory_in_bytes
    memory = MemoryReport.from_stats(stats)
    assert (memory.peak_bytes, memory.xla_peak_bytes) == (100 + 40 + 30 - 40, 0)


def _scan_of_matmuls(steps: int, m: int = 16, k: int = 128) -> CompiledReport:
    mesh = _mesh((8,), ("x",))

    def body(carry, w):  # carry: [m, k], w: [k, k]
        return jax.lax.psum(carry @ w, "x"), None

    def f(carry, ws):
        return jax.lax.scan(body, carry, ws)[0]

    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P()))
    return read_compiled(step.lower(jnp.ones((m, k)), jnp.ones((steps, k, k))).compile())


@pytest.mark.parametrize("steps", [1, 5, 10])
def test_scan_counts_collectives_and_corrects_flops(steps: int) -> None:
    report = _scan_of_matmuls(steps)
    matmul = 2 * 16 * 128 * 128  # 524,288 flops per step
    # One psum of f32[16,128] = 16·128·4 = 8192 B per step.
    assert report.collective_summary() == {"all-reduce": {"count": steps, "bytes": steps * 8192}}
    # XLA's cost analysis counts the loop body once, whatever the trip count...
    assert report.flops == pytest.approx(matmul, rel=0.01)
    assert report.hlo.flops == report.flops  # our count follows XLA's convention exactly
    # ...the corrected figure runs it `steps` times: 5 × 2·m·n·k plus the rest, within 1 %.
    assert report.flops_loop_corrected == pytest.approx(steps * matmul, rel=0.01)
    if steps > 1:
        assert [loop.trip_count for loop in report.loops] == [steps]
        # Everything costing flops (matmul, all-reduce, counter add, compare) is in the loop.
        assert report.flops_loop_corrected == steps * report.flops


def test_nested_scans_multiply_through() -> None:
    mesh = _mesh((8,), ("x",))

    def inner(carry, w):
        return jax.lax.psum(carry @ w, "x"), None

    def outer(carry, ws):  # ws: [3, k, k]
        return jax.lax.scan(inner, carry, ws)[0], None

    def f(carry, wss):  # wss: [4, 3, k, k]
        return jax.lax.scan(outer, carry, wss)[0]

    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P()))
    report = read_compiled(step.lower(jnp.ones((16, 128)), jnp.ones((4, 3, 128, 128))).compile())
    # 4 × 3 = 12 psums of f32[16,128] (8192 B each).
    assert report.collective_summary() == {"all-reduce": {"count": 12, "bytes": 12 * 8192}}
    assert sorted((loop.trip_count, loop.multiplier) for loop in report.loops) == [(3, 4), (4, 1)]
    # Fusions called from the inner body inherit its multiplier, 12.
    (module,) = report.hlo.modules
    inner_body = next(loop.body for loop in report.loops if loop.trip_count == 3)
    fused = [s.callee for s in module.call_sites if s.caller == inner_body and s.role == "calls"]
    assert fused and all(module.multiplier(name) == 12 for name in fused)
    matmul = 2 * 16 * 128 * 128
    assert report.flops == pytest.approx(matmul, rel=0.01)
    assert report.flops_loop_corrected == pytest.approx(12 * matmul, rel=0.01)


def _conv(x, w, **kwargs):
    return jax.lax.conv_general_dilated(x, w, dimension_numbers=("NHWC", "HWIO", "NHWC"), **kwargs)


_IMAGES = jnp.ones((4, 12, 12, 4))  # [batch, h, w, c]
_KERNEL = jnp.ones((3, 3, 4, 6))  # [h, w, in, out]
_LOOP_FREE_PROGRAMS = {
    "elementwise+transcendental": (lambda a: jnp.tanh(a * 2 + 1) / jnp.exp(a), jnp.ones((7, 9))),
    "reduce+argmax": (lambda a: a.sum(0) + jnp.argmax(a, 1).sum(), jnp.ones((7, 9))),
    "batched dot": (
        lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
        jnp.ones((3, 5, 7)),
        jnp.ones((3, 7, 11)),
    ),
    "conv strided+dilated": (
        lambda x, w: _conv(
            x,
            w,
            window_strides=(2, 1),
            padding=((2, 2), (1, 1)),
            rhs_dilation=(2, 1),
            lhs_dilation=(1, 2),
        ),
        _IMAGES,
        _KERNEL,
    ),
    "conv grads": (
        lambda x, w: jax.grad(
            lambda x, w: _conv(x, w, window_strides=(2, 2), padding="SAME").sum(), argnums=(0, 1)
        )(x, w),
        _IMAGES,
        _KERNEL,
    ),
    "sort+cumsum": (lambda a: jnp.sort(a, 1) + jnp.cumsum(a, 1), jnp.ones((7, 9))),
    "scatter-add": (lambda a, i: a.at[i].add(1.0), jnp.ones((10, 4)), jnp.array([1, 3, 3])),
    "max-pool grad": (
        lambda a: jax.grad(
            lambda a: jax.lax.reduce_window(
                a, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"
            ).sum()
        )(a),
        _IMAGES,
    ),
}


@pytest.mark.parametrize("name", sorted(_LOOP_FREE_PROGRAMS))
def test_hlo_flops_equal_cost_analysis_on_loop_free_programs(name: str) -> None:
    fn, *args = _LOOP_FREE_PROGRAMS[name]
    report = read_compiled(jax.jit(fn).lower(*args).compile())
    assert report.cost_analysis  # the CPU backend reports a cost analysis
    assert report.loops == ()
    assert report.hlo.flops == report.flops == report.flops_loop_corrected


def test_mesh_axes_replica_groups_from_a_real_compile() -> None:
    # On a 2x4 mesh, summing a [dp, tp]-sharded matmul result reduces over 'dp' last; XLA
    # prints those groups in the mesh-axis syntax (mesh['axis_0'=2,...] {'axis_0'}) here.
    mesh = _mesh((2, 4), ("dp", "tp"))
    a = jax.device_put(jnp.ones((16, 16)), NamedSharding(mesh, P("dp", "tp")))
    b = jax.device_put(jnp.ones((16, 16)), NamedSharding(mesh, P("tp", None)))
    report = read_compiled(jax.jit(lambda a, b: jnp.sum(a @ b)).lower(a, b).compile())
    groups = {c.replica_groups for c in report.collectives}
    assert groups == {TP_GROUPS, DP_GROUPS}


# --------------------------------------------------------------------------------------------
# Hand-written HLO fixtures
# --------------------------------------------------------------------------------------------


def test_fixture_replica_group_syntaxes() -> None:
    report = read_hlo_text(_fixture("replica_groups.hlo"))
    groups = {c.name: c.replica_groups for c in report.collectives}
    assert groups == {
        "explicit": DP_GROUPS,  # {{0,4},{1,5},{2,6},{3,7}}
        "iota": TP_GROUPS,  # [2,4]<=[8]
        "transposed": DP_GROUPS,  # [4,2]<=[2,4]T(1,0)
        "mesh": DP_GROUPS,  # mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}
        "gathered": ((0, 4, 1, 5, 2, 6, 3, 7),),  # mesh['x'=2,'y'=4] {'y','x'}
        "everyone": ALL_8,  # {} with num_partitions=8
        "loss_mean": ALL_8,  # [1,8]<=[8]
    }
    # Six all-reduces: five of f32[16,8] (512 B) and the f32[] loss mean (4 B); one
    # all-gather of f32[128,8] (4096 B).
    assert report.collective_summary() == {
        "all-reduce": {"count": 6, "bytes": 5 * 512 + 4},
        "all-gather": {"count": 1, "bytes": 4096},
    }
    assert [c.name for c in report.collectives.scalar()] == ["loss_mean"]
    assert report.collective_summary(include_scalar=False)["all-reduce"] == {
        "count": 5,
        "bytes": 5 * 512,
    }
    explicit = report.collectives[0]
    assert (explicit.channel_id, explicit.use_global_device_ids) == (1, True)
    assert explicit.op_name == "jit(step)/dp/psum"


def test_fixture_gpu_async_collectives_count_once() -> None:
    report = read_hlo_text(_fixture("gpu_async_collectives.hlo"))
    records = {c.name: c for c in report.collectives}
    assert set(records) == {
        "all-reduce-start",
        "all-gather-start",
        "collective-permute-start",
        "reduce-scatter-start",
    }
    # all-reduce-start in a 3-trip loop: 3 × f32[64,4] = 3 × 1024 B.
    all_reduce = records["all-reduce-start"]
    assert (all_reduce.kind, all_reduce.count, all_reduce.bytes) == ("all-reduce", 3, 1024)
    assert all_reduce.replica_groups == TP_GROUPS and all_reduce.computation == "body"
    # all-gather-start → (f32[8,4], f32[64,4]): only element 1, the output, 64·4·4 = 1024 B.
    gather = records["all-gather-start"]
    assert (gather.kind, gather.bytes, gather.shapes) == (
        "all-gather",
        1024,
        (ArrayShape("f32", (64, 4)),),
    )
    # collective-permute-start → (f32[8,4], f32[8,4], u32[], u32[]): element 1, 128 B.
    permute = records["collective-permute-start"]
    assert (permute.kind, permute.bytes, permute.source_target_pairs) == (
        "collective-permute",
        128,
        RING_8,
    )
    # async-start wrapping a reduce-scatter: one record, the wrapped op's f32[8,4] = 128 B,
    # attributed to the wrapper's computation, with the inner op's groups and op name.
    scatter = records["reduce-scatter-start"]
    assert (scatter.kind, scatter.opcode, scatter.computation, scatter.bytes) == (
        "reduce-scatter",
        "async-start",
        "main",
        128,
    )
    assert scatter.replica_groups == ALL_8
    assert scatter.op_name == "jit(step)/shard_map/reduce_scatter"
    assert report.collective_summary() == {
        "all-reduce": {"count": 3, "bytes": 3072},
        "all-gather": {"count": 1, "bytes": 1024},
        "collective-permute": {"count": 1, "bytes": 128},
        "reduce-scatter": {"count": 1, "bytes": 128},
    }
    # Flops: body = s32 add (1) + all-reduce-start of 256 elements (256); condition = compare
    # (1); entry = f32[8,4] add (32). Once: 258 + 32 = 290; with the 3 trips: 3·258 + 32 = 806.
    assert (report.flops, report.flops_loop_corrected) == (290.0, 806.0)
    module = report.modules[0]
    assert module.multiplier("async_computation") == 1  # async-done does not call it again


def test_fixture_unknown_trip_count() -> None:
    report = read_hlo_text(_fixture("unknown_trip_count.hlo"))
    (all_reduce,) = report.collectives
    # The inner loop's trip count is unknown: it counts once per outer iteration (4).
    assert (all_reduce.count, all_reduce.bytes, all_reduce.trip_count_known) == (4, 32, False)
    loops = {loop.name: loop for loop in report.loops}
    assert loops["inner"].trip_count is None and loops["inner"].multiplier == 4
    assert loops["outer"].trip_count == 4
    module = report.modules[0]
    assert module.trip_count_known["outer_body"] and not module.trip_count_known["inner_body"]
    # Inner body: s32 add (1) + all-reduce f32[8] (8) + compare (1) = 10; outer body: add (1)
    # + inner loop (10) + compare (1) = 12 → 12 once, 4 × 12 = 48 corrected.
    assert (report.flops, report.flops_loop_corrected) == (12.0, 48.0)


def test_fixture_call_graph_conditional_call_and_fusion() -> None:
    text = _fixture("call_graph.hlo")
    report = read_hlo_text(text)
    module = report.modules[0]
    roles = {(s.caller, s.role, s.callee, s.factor) for s in module.call_sites}
    assert roles == {
        ("main", "body", "body", 6),
        ("main", "condition", "cond", 6),
        ("body", "branch_computations", "branch_0", 1),
        ("body", "branch_computations", "branch_1", 1),
        ("branch_0", "to_apply", "add", 1),
        ("main", "to_apply", "helper", 1),
        ("helper", "calls", "fused", 1),
    }
    assert dict(module.multipliers) == {
        "add": 6, "branch_0": 6, "branch_1": 6, "body": 6, "cond": 6,
        "fused": 1, "helper": 1, "main": 1,
    }  # fmt: skip
    # Each branch's collective counts once per loop trip (an upper bound: one branch runs).
    assert report.collective_summary() == {
        "all-reduce": {"count": 6, "bytes": 6 * 16},
        "collective-permute": {"count": 6, "bytes": 6 * 16},
    }
    # Body: remainder (1) + conditional = max(all-reduce 4, multiply 4) + add (1) = 6, condition
    # compare (1); entry: call → fusion → negate f32[4] (4). Once: 7 + 4; 6 trips: 6·7 + 4.
    assert (report.flops, report.flops_loop_corrected) == (11.0, 46.0)
    # The older true_computation= / false_computation= spelling is the same graph.
    old_style = text.replace(
        "branch_computations={%branch_0, %branch_1}",
        "true_computation=%branch_0, false_computation=%branch_1",
    )
    assert dict(parse_hlo_module(old_style).multipliers) == dict(module.multipliers)


# --------------------------------------------------------------------------------------------
# Parser units
# --------------------------------------------------------------------------------------------


def test_parse_shapes() -> None:
    shape = parse_shape("(f32[2,3]{1,0}, s32[], /*index=2*/(bf16[4]{0}, pred[2]{0}))")
    assert isinstance(shape, TupleShape)
    assert [str(leaf) for leaf in shape.leaves()] == ["f32[2,3]", "s32[]", "bf16[4]", "pred[2]"]
    assert shape.byte_size == 2 * 3 * 4 + 4 + 4 * 2 + 2 * 1
    assert parse_shape("s4[8]{0:E(4)}").byte_size == 4  # packed int4
    assert parse_shape("s4[8]{0}").byte_size == 8  # unpacked: one byte each
    assert parse_shape("f32[<=8,3]").dims == (8, 3)
    assert parse_shape("f32[8,128]{1,0:T(8,128)}").num_elements == 1024
    with pytest.raises(ValueError, match="not an HLO shape"):
        parse_shape("nonsense")


def test_parse_instruction_details() -> None:
    module = parse_hlo_module("""
HloModule m, num_partitions=4
ENTRY %main (p: f32[4]) -> (f32[4], f32[4]) {
  %p = f32[4]{0} parameter(0), metadata={op_name="a \\"q\\" name" source_file="m.py" source_line=7}
  %c = f32[4]{0} constant({1, 2, 3, 4})
  %x = f32[4]{0} some-future-op(f32[4]{0} %p, %c), new_attr={a={b}, c="d,e"}, flag=true
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%x, /*index=1*/%c)
}
""")
    entry = module.entry_computation
    assert entry is not None and module.num_partitions == 4
    p, c, x, t = entry.instructions
    assert p.op_name == 'a "q" name' and p.source == "m.py:7"
    assert c.operands == ()
    assert (x.opcode, x.operands) == ("some-future-op", ("p", "c"))
    assert x.attr("new_attr") == '{a={b}, c="d,e"}' and x.attr("flag") == "true"
    assert t.is_root and entry.root is t and t.operands == ("x", "c")
    assert entry.operand_shapes(x) == (ArrayShape("f32", (4,)), ArrayShape("f32", (4,)))


def test_replica_group_expansion() -> None:
    assert parse_replica_groups("[4,2]<=[2,4]T(1,0)") == DP_GROUPS
    assert parse_replica_groups("[2,4]<=[2,2,2]T(2,1,0)") == ((0, 4, 2, 6), (1, 5, 3, 7))
    assert parse_replica_groups("{}", num_devices=4) == ((0, 1, 2, 3),)
    assert parse_replica_groups("mesh[a=2,b=4] {b}") == TP_GROUPS  # unquoted names
    # Sub-axis a:(2)2 of a=4 is a's minor half: devices 2·a + b with a = 2·a0 + a1.
    assert parse_replica_groups("mesh['a'=4,'b'=2] {'a':(2)2}") == ((0, 2), (1, 3), (4, 6), (5, 7))
    # A non-iota mesh device order.
    assert parse_replica_groups("mesh['a'=2,'b'=2], device_ids=(0,2,1,3) {'b'}") == ((0, 2), (1, 3))
    # The same order in XLA's iota form: arange(4).reshape(2, 2).T flattened is 0, 2, 1, 3.
    assert parse_replica_groups("mesh['a'=2,'b'=2], device_ids=([2,2]T(1,0)) {'b'}") == (
        (0, 2), (1, 3))
    assert parse_replica_groups(
        "mesh['axis_0'=1,'axis_1'=2,'axis_2'=2], device_ids=([2,2]T(1,0)) {'axis_1'}") == (
        (0, 1), (2, 3))
    assert parse_replica_groups("[3,3]<=[8]") == ()  # inconsistent: left unparsed
    assert parse_replica_groups(None) == ()


def test_mesh_device_ids_attribute_survives_instruction_parsing() -> None:
    # ``mesh[...], device_ids=(...) {...}`` holds a top-level comma inside one attribute.
    text = (
        "ENTRY %e (p: f32[2]) -> f32[4] {\n"
        "  %p = f32[2]{0} parameter(0)\n"
        "  ROOT %r = f32[4]{0} all-gather(%p), replica_groups=mesh['a'=2,'b'=2], "
        "device_ids=(0,2,1,3) {'a'}, dimensions={0}\n"
        "}"
    )
    (record,) = read_hlo_text(text).collectives
    assert record.replica_groups == ((0, 1), (2, 3))
    assert record.bytes == 16


def test_several_modules_and_a_list_of_texts() -> None:
    a, b = _fixture("replica_groups.hlo"), _fixture("unknown_trip_count.hlo")
    assert [m.name for m in parse_hlo(a + "\n" + b)] == ["replica_groups", "unknown_trip_count"]
    joined, listed = read_hlo_text(a + "\n" + b), read_hlo_text([a, b])
    assert joined.collectives == listed.collectives
    assert len(listed.collectives) == 8 and listed.flops == read_hlo_text(a).flops + 12


def test_mutilated_text_never_crashes() -> None:
    rng = random.Random(0)
    texts = [_fixture(name) for name in sorted(p.name for p in HLO_DATA.glob("*.hlo"))]
    for _ in range(200):
        text = rng.choice(texts)
        cut = sorted(rng.sample(range(len(text)), 6))  # delete 3 random spans
        starts, ends = [0, *cut[1::2]], [*cut[::2], len(text)]
        mutated = "".join(text[i:j] for i, j in zip(starts, ends, strict=True))
        lines = mutated.splitlines()
        head = rng.randrange(len(lines) + 1)
        scrambled = rng.sample(lines[:head], head) + lines[head:]  # and shuffle some lines
        report = read_hlo_text("\n".join(scrambled))
        assert report.flops >= 0 and all(c.bytes >= 0 for c in report.collectives)
    assert read_hlo_text("").collectives == ()
    assert read_hlo_text("garbage {\n ) = ( \n}\n").flops == 0.0


def test_iota_groups_match_numpy_semantics() -> None:
    # reshape(iota(24), [2,3,4]) → transpose(2,0,1) → reshape([4, 6])
    expected = np.arange(24).reshape(2, 3, 4).transpose(2, 0, 1).reshape(4, 6)
    groups = parse_replica_groups("[4,6]<=[2,3,4]T(2,0,1)")
    assert groups == tuple(tuple(int(v) for v in row) for row in expected)
