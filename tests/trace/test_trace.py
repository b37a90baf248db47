"""Tracing train steps into op graphs: FLOPs against XLA, the GPT formula, parameters, layers."""

from __future__ import annotations

import dataclasses

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import shardplan_models as models
from flax import nnx
from flax.training import train_state

import shardplan as sp
from shardplan.trace.api import module_path

MODELS = ["gpt-tiny", "llama-tiny", "moe-tiny"]


def _reference_step(name: str, *, scan: bool, n_layers: int | None = None, batch: int = 4,
                    abstract: bool = False):
    overrides: dict = {"scan_layers": scan}
    if n_layers is not None:
        overrides["n_layers"] = n_layers
    cfg = models.load_model_config(name, overrides=overrides)
    if abstract:
        graphdef, state = models.abstract_train_state(cfg)
    else:
        graphdef, state = models.init_train_state(cfg)
    step = models.make_train_step(graphdef)
    return cfg, step, state, models.example_batch(cfg, batch, abstract=abstract)


def _xla_flops(fn, *args) -> float:
    """XLA's FLOP count of the lowered (pre-partitioning) module."""
    return float(jax.jit(fn).lower(*args).cost_analysis()["flops"])


# ------------------------------------------------------------------------------------------
# FLOPs
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("name", MODELS)
def test_total_flops_match_xla_cost_analysis(name: str, scan: bool) -> None:
    _, step, state, batch = _reference_step(name, scan=scan)
    graph = sp.trace(step, state, batch)
    # XLA's cost analysis counts a while-loop body once, whatever its trip count, so compare
    # like with like: our count with every loop body counted once (count_loops=False).
    xla = _xla_flops(step, state, batch)
    ours = graph.total_flops(count_loops=False)
    assert ours == pytest.approx(xla, rel=0.02)
    if scan:
        # With trip counts multiplied in, the scanned model does the same work as the loop.
        _, step_l, state_l, batch_l = _reference_step(name, scan=False)
        loop_total = sp.trace(step_l, state_l, batch_l).total_flops()
        assert graph.total_flops() == pytest.approx(loop_total, rel=0.005)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, y: x + y,
        lambda x, y: jnp.tanh(x) * y,
        lambda x, y: jax.nn.gelu(x @ y.T),
        lambda x, y: jax.nn.softmax(x, axis=-1).sum(0),
        lambda x, y: jnp.cumsum(x, 1) - jnp.argmax(y, 1)[:, None],
        lambda x, y: jnp.where(x > 0, jnp.sqrt(jnp.abs(x)), y**3),
        lambda x, y: jax.nn.logsumexp(x, axis=1) + jnp.square(x.imag).sum(1),
        lambda x, y: jax.nn.sigmoid(x) * 1.0 + 0.0,
        lambda x, y: jnp.einsum("ij,kj->ik", x, y) / 3.0,
    ],
)
def test_primitive_flop_rules_match_xla(fn) -> None:
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    graph = sp.trace(fn, x, x)
    assert graph.total_flops() == pytest.approx(_xla_flops(fn, x, x), rel=0.02, abs=2)


@pytest.mark.parametrize("shape,dtype", [((64,), jnp.uint32), ((16, 4, 8), jnp.uint8),
                                         ((3, 5), jnp.uint16)])
def test_random_bits_has_a_flop_rule_matching_xla(shape, dtype) -> None:
    # Dropout draws its masks with random_bits: a known primitive, costed as XLA lowers it.
    key = jax.random.key(0)

    def fn(k):
        return jax.random.bits(k, shape, dtype)

    graph = sp.trace(fn, key)
    assert graph.unknown_primitives == ()
    assert graph.total_flops() == _xla_flops(fn, key)


def test_gpt_matmul_flops_match_model_flops_formula() -> None:
    # Korthikanti et al. 2022: forward + backward matmul FLOPs of a GPT with MLP width 4h and
    # full attention scores = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)). Untied head, so every
    # matmul of the formula is a matmul of the model. Abstract shapes: nothing is allocated.
    cfg = models.GPTConfig(vocab_size=1024, max_seq_len=128, d_model=256, n_layers=6,
                           n_heads=4, d_ff=1024, tie_embeddings=False)
    graphdef, state = models.abstract_train_state(cfg)
    b = 8
    batch = models.example_batch(cfg, b, abstract=True)
    graph = sp.trace(models.make_train_step(graphdef), state, batch)
    s, L, h, v = cfg.max_seq_len, cfg.n_layers, cfg.d_model, cfg.vocab_size  # paper's names
    formula = 72 * b * s * L * h**2 * (1 + s / (6 * h) + v / (12 * L * h))
    matmul = sum(op.total_flops for op in graph.ops if op.primitive == "dot_general"
                 and op.phase in ("forward", "backward"))
    assert matmul == pytest.approx(formula, rel=0.02)
    fwd = sum(op.total_flops for op in graph.ops
              if op.primitive == "dot_general" and op.phase == "forward")
    assert fwd == pytest.approx(formula / 3, rel=0.02)  # backward = 2 x forward


def test_scan_body_counted_times_length() -> None:
    def f(w, x):
        def body(c, wi):
            return jnp.tanh(c @ wi), None

        return jax.lax.scan(body, x, w)[0].sum()

    w = jax.ShapeDtypeStruct((5, 16, 16), jnp.float32)
    x = jax.ShapeDtypeStruct((4, 16), jnp.float32)
    graph = sp.trace(f, w, x)
    dots = [op for op in graph.ops if op.primitive == "dot_general"]
    assert len(dots) == 1 and dots[0].count == 5 and dots[0].loop_trips == 5
    assert dots[0].total_flops == 5 * 2 * 4 * 16 * 16


# ------------------------------------------------------------------------------------------
# Parameters and layers
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("name", MODELS)
def test_parameters_and_layers(name: str, scan: bool) -> None:
    cfg, step, state, batch = _reference_step(name, scan=scan, n_layers=4, abstract=True)
    graph = sp.trace(step, state, batch)
    # Parameter count: the graph's trained leaves = the model's own nnx.Param leaves.
    model_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
        nnx.state(nnx.eval_shape(lambda: models.build_model(cfg, rngs=nnx.Rngs(0))), nnx.Param)))
    assert graph.num_params == cfg.num_params() == model_params
    # Exactly n_layers identical blocks, between a "pre" and a "post" layer.
    blocks = graph.blocks
    assert len(blocks) == cfg.n_layers
    assert len({b.fingerprint for b in blocks}) == 1
    assert [b.name for b in blocks] == [f"blocks.{i}" for i in range(cfg.n_layers)]
    kinds = [layer.kind for layer in graph.layers]
    assert kinds[0] == "pre" and kinds[cfg.n_layers + 1] == "post"
    # Every block has forward, backward and update work; the block FLOPs add up.
    for b in blocks:
        assert b.flops["forward"] > 0 and b.flops["backward"] > 0 and b.flops["update"] > 0
    per_layer = sum(layer.total_flops for layer in graph.layers)
    assert per_layer == pytest.approx(graph.total_flops(), rel=1e-9)
    # Roles: parameters, their optimizer state (linked back to them), the batch.
    roles = {p.role for p in graph.parameters}
    assert roles <= {"parameter", "optimizer_state", "other"}
    batch_leaves = [p for p in graph.parameters if p.arg_index == 1]
    assert {p.role for p in batch_leaves} == {"other"}
    mu = [p for p in graph.parameters if p.role == "optimizer_state" and "/mu/" in p.path]
    assert mu and all(p.param_path is not None for p in mu)
    for p in mu:
        assert graph.param_by_path[p.param_path].shape == p.shape


def test_loop_blocks_own_their_parameters_and_scopes() -> None:
    _, step, state, batch = _reference_step("gpt-tiny", scan=False, n_layers=3, abstract=True)
    graph = sp.trace(step, state, batch)
    by_name = {layer.name: layer for layer in graph.layers}
    for i in range(3):
        layer = by_name[f"blocks.{i}"]
        assert layer.params and all(f"blocks/{i}/" in p for p in layer.params)
        for path in layer.params:
            assert graph.param_by_path[path].layer == layer.index
        dots = [graph.ops[o] for o in layer.ops if graph.ops[o].primitive == "dot_general"
                and graph.ops[o].phase == "forward"]
        assert dots and all(op.scope.startswith(f"blocks.{i}") for op in dots)
    # Tied embedding: the token table belongs to "pre"; the head's matmul to "post".
    wte = graph.param_by_path["0/wte/embedding/value"]
    assert graph.layers[wte.layer].kind == "pre"
    assert module_path("0/blocks/3/attn/q/kernel/value") == "blocks.3.attn.q"


def test_scanned_stack_is_one_scan_shared_by_its_layers() -> None:
    _, step, state, batch = _reference_step("llama-tiny", scan=True, n_layers=3, abstract=True)
    graph = sp.trace(step, state, batch)
    blocks = graph.blocks
    assert len(blocks) == 3 and all(b.op_share == pytest.approx(1 / 3) for b in blocks)
    assert blocks[0].ops == blocks[2].ops  # the loop body, executed by every layer
    stacked = [p for p in graph.parameters if p.stacked]
    assert stacked and all(p.shape[0] == 3 for p in stacked)
    scans = {op.loop[0][1] for op in graph.ops if op.loop}
    assert scans == {3}


def test_phases_of_remat_and_update() -> None:
    def loss(ws, x):
        for w in ws:
            x = jax.checkpoint(lambda w_, x_: jnp.tanh(x_ @ w_))(w, x)
        return (x**2).sum()  # a constant cotangent would let XLA fold the last layer's mul

    def step(ws, x):
        value, g = jax.value_and_grad(loss)(ws, x)
        return [w - 0.1 * gw for w, gw in zip(ws, g, strict=True)], value

    ws = [jax.ShapeDtypeStruct((16, 16), jnp.float32)] * 3
    x = jax.ShapeDtypeStruct((4, 16), jnp.float32)
    graph = sp.trace(step, ws, x)
    phases = {op.phase for op in graph.ops}
    assert {"forward", "backward", "recompute", "update"} <= phases
    # The recomputed forward matmuls appear once per layer in the backward pass.
    recomputed = [op for op in graph.ops if op.phase == "recompute"
                  and op.primitive == "dot_general"]
    assert len(recomputed) == 3
    blocks = graph.blocks
    assert [b.name for b in blocks] == ["layers.0", "layers.1", "layers.2"]
    # The first layer skips the gradient of its input (x is not differentiated): it differs.
    assert blocks[1].fingerprint == blocks[2].fingerprint != blocks[0].fingerprint
    assert blocks[0].flops["backward"] < blocks[1].flops["backward"]
    assert graph.layers[-1].name == "post"  # the loss on the last layer's output
    assert all(p.role == "parameter" for p in graph.parameters if p.arg_index == 0)


def test_nested_jaxprs_are_inlined() -> None:
    @jax.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))

    @jax.jit
    def inner(w, x):
        return jax.nn.relu(x @ w)  # relu is a custom_jvp

    def f(w, x, flag):
        y = clip_grad(inner(w, x))
        y = jax.lax.cond(flag > 0, lambda v: v @ w, lambda v: v, y)
        # Square before summing: with a constant cotangent XLA rewrites dot(ones, x) into a
        # reduction before costing, which a jaxpr-level count does not mirror.
        return (y**2).sum()

    def g(w, x, flag):
        grad = jax.grad(f)(w, x, flag)
        # A while loop with literal bounds (not differentiable, so after the gradient).
        return jax.lax.while_loop(lambda c: c[0] < 7, lambda c: (c[0] + 1, c[1] * 2.0),
                                  (0, grad))[1]

    w = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    x = jax.ShapeDtypeStruct((4, 16), jnp.float32)
    flag = jax.ShapeDtypeStruct((), jnp.int32)
    graph = sp.trace(g, w, x, flag)
    prims = {op.primitive for op in graph.ops}
    assert not prims & {"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "cond", "while"}
    # The while body (one multiply of a [16,16] array) runs 7 times.
    loop_muls = [op for op in graph.ops if op.loop and op.primitive == "mul"]
    assert loop_muls and all(op.count == 7 for op in loop_muls)
    assert graph.total_flops(count_loops=False) == pytest.approx(_xla_flops(g, w, x, flag),
                                                                 rel=0.02)
    assert any("cond" in note for note in graph.notes)


def test_linen_train_state_and_plain_pytrees() -> None:
    class MLP(linen.Module):
        @linen.compact
        def __call__(self, x):
            x = linen.Dense(32)(x)
            for _ in range(3):
                x = linen.relu(linen.Dense(32)(x))
            return linen.Dense(4)(x)

    model = MLP()
    x = jnp.ones((8, 16))
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    tx = optax.adam(1e-3)
    ts = jax.eval_shape(lambda p: train_state.TrainState.create(
        apply_fn=model.apply, params=p, tx=tx), params)

    def step(state, batch):
        def loss(p):
            return jnp.mean((state.apply_fn(p, batch["x"]) - batch["y"]) ** 2)

        grads = jax.grad(loss)(state.params)
        return state.apply_gradients(grads=grads), {}

    batch = {"x": jax.ShapeDtypeStruct((8, 16), jnp.float32),
             "y": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    graph = sp.trace(step, ts, batch)
    n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    assert graph.num_params == n
    # Dense_1..Dense_3 are identical (32 -> 32); Dense_0 and Dense_4 differ in shape.
    assert [b.name for b in graph.blocks] == [f"params.params.Dense_{i}" for i in (1, 2, 3)]
    assert len({b.fingerprint for b in graph.blocks}) == 1
    roles = {p.path.split("/")[0]: p.role for p in graph.parameters if p.arg_index == 0}
    assert roles["params"] == "parameter" and roles["opt_state"] == "optimizer_state"


def test_plain_function_never_allocates() -> None:
    # 10^12-element operands: a trace that materialised them would fail.
    w = jax.ShapeDtypeStruct((1_000_000, 1_000_000), jnp.float32)
    x = jax.ShapeDtypeStruct((1024, 1_000_000), jnp.float32)
    graph = sp.trace(lambda w_, x_: (x_ @ w_).sum(), w, x)
    assert graph.total_flops() >= 2 * 1024 * 1e12
    assert all(layer.kind == "pre" for layer in graph.layers)


def test_non_array_leaf_is_a_trace_error_naming_the_key_path() -> None:
    state = {"params": {"w": jnp.ones((2, 2))}, "name": "my-model"}
    with pytest.raises(sp.TraceError) as err:
        sp.trace(lambda s: s["params"]["w"].sum(), state)
    assert "name" in str(err.value) and "my-model" in str(err.value)


def test_untraceable_function_is_a_trace_error() -> None:
    def bad(x):
        return x.reshape(3, 5)  # 16 elements do not reshape to 15

    with pytest.raises(sp.TraceError, match="bad"):
        sp.trace(bad, jax.ShapeDtypeStruct((16,), jnp.float32))


def test_summary_reads_well() -> None:
    _, step, state, batch = _reference_step("gpt-tiny", scan=False, abstract=True)
    text = sp.trace(step, state, batch).summary()
    for needle in ("parameter", "optimizer_state", "forward", "backward", "update",
                   "blocks.0 .. blocks.1 (x2)", "1 distinct fingerprint"):
        assert needle in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_graph_is_a_frozen_value() -> None:
    graph = sp.trace(lambda x: x * 2, jax.ShapeDtypeStruct((3,), jnp.float32))
    with pytest.raises(dataclasses.FrozenInstanceError):
        graph.name = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        graph.ops[0].flops = 0.0  # type: ignore[misc]
    # Every op and tensor is the value itself, not the draft it was built as.
    from shardplan.trace.graph import Op, Tensor

    assert all(type(op) is Op for op in graph.ops)
    assert all(type(t) is Tensor for t in graph.tensors)


# ------------------------------------------------------------------------------------------
# The passes' speed-ups change nothing
# ------------------------------------------------------------------------------------------
def _graph_digest(graph: sp.OpGraph) -> str:
    """A sha256 of every field of the graph: ops, tensors, parameters, layers, notes.

    Source lines enter as the index of their first appearance among the ops, so that the digest
    does not depend on where the checkout lives; which ops share a line (what the layer cuts
    read) is kept.
    """
    import hashlib

    def text(x: object) -> str:
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return type(x).__name__ + "(" + ",".join(
                f"{f.name}={text(getattr(x, f.name))}" for f in dataclasses.fields(x)) + ")"
        if isinstance(x, dict):
            return "{" + ",".join(f"{k!r}:{text(v)}" for k, v in x.items()) + "}"
        if isinstance(x, tuple | list):
            return "(" + ",".join(text(v) for v in x) + ")"
        return f"{type(x).__name__}:{x!r}"

    h = hashlib.sha256()
    for item in (graph.name, graph.inputs, graph.outputs, graph.output_paths,
                 graph.unknown_primitives, graph.notes, graph.tensors, graph.parameters,
                 graph.layers):
        h.update(text(item).encode())
    source_ids: dict[str, int] = {}
    for op in graph.ops:
        line = source_ids.setdefault(op.source, len(source_ids))
        h.update(text(dataclasses.replace(op, source=str(line))).encode())
    return h.hexdigest()[:32]


# `_graph_digest` of each tiny model's train step (abstract state, batch 4), taken with the trace
# stage as it was before its passes were made faster (commit 00c61bc, jax 0.10.2). A change to a
# model, to jax or to what the trace stage computes changes them: then check the new graph on
# purpose (e.g. against the trace stage of a commit whose graph you trust) and update the digest.
# The scanned models' digests were updated when scan bodies' ops got paths (and only that: with
# those paths set back to None they equal the earlier digests).
_REFERENCE_DIGESTS = {
    ("gpt-tiny", False): "c4b98127291c01a616ead6c06f426b53",
    ("gpt-tiny-scan", None): "74d39c89d95ea4924f3ea1e1046d7b8e",
    ("llama-tiny", False): "5f04c6b6648b51727dfba234e33bc645",
    ("llama-tiny", True): "547ab75538930762c784f346452990ff",
    ("moe-tiny", False): "ad1be2a2042bc56397afc3c6e024310e",
    ("moe-tiny", True): "237599d1222cd2b065435e191354fec9",
}


@pytest.mark.parametrize(("name", "scan"), list(_REFERENCE_DIGESTS),
                         ids=[f"{n}-{'preset' if s is None else 'scan' if s else 'loop'}"
                              for n, s in _REFERENCE_DIGESTS])
def test_graph_equals_the_reference_trace(name: str, scan: bool | None) -> None:
    cfg = models.load_model_config(name, overrides={} if scan is None else {"scan_layers": scan})
    graphdef, state = models.abstract_train_state(cfg)
    graph = sp.trace(models.make_train_step(graphdef), state,
                     models.example_batch(cfg, 4, abstract=True))
    assert _graph_digest(graph) == _REFERENCE_DIGESTS[(name, scan)], (
        f"the graph of {name} differs from the reference trace's; if the model or jax changed "
        "on purpose, check the new graph and update _REFERENCE_DIGESTS")


def test_source_lines_are_jax_summaries() -> None:
    # The flattener caches source lines per traceback; each must be what jax itself says.
    from jax.extend import core as jcore
    from jax.extend import source_info_util

    from shardplan.trace.flatten import _SourceCache

    cfg = models.load_model_config("llama-tiny", overrides={"n_layers": 2})
    graphdef, state = models.abstract_train_state(cfg)
    jaxpr = jax.jit(models.make_train_step(graphdef)).trace(
        state, models.example_batch(cfg, 4, abstract=True)).jaxpr.jaxpr
    cache = _SourceCache()
    eqns = []

    def collect(j) -> None:
        for eqn in j.eqns:
            eqns.append(eqn)
            for sub in jcore.jaxprs_in_params(eqn.params):
                collect(sub)

    collect(jaxpr)
    assert len(eqns) > 500
    assert len({id(e.source_info.traceback) for e in eqns}) > len(cache.by_traceback)
    for eqn in eqns:
        assert cache(eqn) == source_info_util.summarize(eqn.source_info)
    assert 0 < len(cache.by_traceback) < len(eqns) / 2  # the cache does hit


def test_drafts_freeze_into_the_values_they_describe() -> None:
    from shardplan.trace.graph import Op, OpDraft, Tensor, TensorDraft

    fields = dict(id=3, primitive="add", inputs=(1, 2), outputs=(4,), flops=8.0,
                  transcendentals=0.0, bytes_read=64, bytes_written=32, count=2, loop_trips=1,
                  phase="forward", scope="blocks.0", source="m.py:1 (f)", layers=(1,), loop=(),
                  structural=False, attrs={"axes": (0,)}, path=(5,))
    op = OpDraft(**fields).freeze()  # type: ignore[arg-type]
    assert type(op) is Op and op == Op(**fields)  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        op.count = 1  # type: ignore[misc]
    tensor = TensorDraft(0, (2, 4), "float32", None, 32).freeze()
    assert type(tensor) is Tensor and tensor == Tensor(0, (2, 4), "float32", None, 32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tensor.nbytes = 0  # type: ignore[misc]


@pytest.mark.parametrize("enabled", [True, False])
def test_tracing_leaves_the_garbage_collector_as_it_was(enabled: bool) -> None:
    import gc

    was = gc.isenabled()
    try:
        if not enabled:
            gc.disable()
        sp.trace(lambda x: jnp.tanh(x).sum(), jax.ShapeDtypeStruct((3,), jnp.float32))
        assert gc.isenabled() == enabled
        assert gc.get_freeze_count() == 0
    finally:
        if was:
            gc.enable()
