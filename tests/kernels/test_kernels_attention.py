"""Flash attention (Pallas, interpret mode on CPU) against the plain-jnp reference.

Shapes are tiny because interpret mode compiles every kernel into XLA loops; each case compiles
the forward and both backward kernels once (a few seconds on one core).
"""

from __future__ import annotations

import functools

import jax
import jax.export
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardplan.errors import ConfigError
from shardplan.kernels import flash_attention, flash_attention_reference
from shardplan.kernels.flash_attention import (
    BWD_NAME,
    FWD_NAME,
    _make_options,
    shardplan_kernel__flash_attention_bwd,
    shardplan_kernel__flash_attention_fwd,
)

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}


def _segments(batch: int, seq: int) -> jax.Array:
    """Uneven segments: three in the first example, two in the second."""
    a, b = seq // 5, seq // 2
    rows = [[0] * a + [1] * b + [2] * (seq - a - b), [0] * (seq - seq // 3) + [5] * (seq // 3)]
    return jnp.asarray(rows[:batch], jnp.int32)


def _inputs(batch, seq, heads, kv_heads, head_dim, dtype, seed=0):
    kq, kk, kv, kw = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (batch, seq, heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim), jnp.float32).astype(dtype)
    cotangent = jax.random.normal(kw, (batch, seq, heads, head_dim), jnp.float32).astype(dtype)
    return q, k, v, cotangent


def _output_and_grads(attention, q, k, v, cotangent):
    """``(o, dq, dk, dv)`` of ``attention``, where the grads are d sum(o * cotangent)."""
    o, vjp = jax.vjp(attention, q, k, v)
    return (o, *vjp(cotangent))


@pytest.mark.parametrize(
    ("seq", "heads", "kv_heads", "causal", "segmented", "blocks", "dtype"),
    [
        # grouped-query (2 query heads per kv head), odd length, 3 uneven segments, causal
        (37, 4, 2, True, True, (16, 16), jnp.float32),
        # one kv head for all query heads, segments without causality, query tile < key tile
        (37, 4, 1, False, True, (8, 16), jnp.float32),
        # plain multi-head, causal only, query tile > key tile
        (29, 2, 2, True, False, (16, 8), jnp.float32),
        (37, 4, 2, True, True, (16, 16), jnp.bfloat16),
        # no mask but the padding, default (CPU) tiles: one key block unmasked, one masked
        (40, 2, 1, False, False, (None, None), jnp.float16),
    ],
)
def test_matches_reference(seq, heads, kv_heads, causal, segmented, blocks, dtype):
    batch, head_dim = 2, 16
    q, k, v, cotangent = _inputs(batch, seq, heads, kv_heads, head_dim, dtype)
    segment_ids = _segments(batch, seq) if segmented else None
    kernel = functools.partial(flash_attention, causal=causal, segment_ids=segment_ids,
                               block_q=blocks[0], block_k=blocks[1], interpret=True)
    reference = functools.partial(flash_attention_reference, causal=causal,
                                  segment_ids=segment_ids)
    got = jax.jit(functools.partial(_output_and_grads, kernel))(q, k, v, cotangent)
    want = jax.jit(functools.partial(_output_and_grads, reference))(q, k, v, cotangent)
    tol = TOLERANCE[dtype]
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == dtype and g.shape == w.shape, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=tol, atol=tol, err_msg=name)


def test_masks_change_the_result():
    """Guards the grid above against masks silently ignored by kernel and reference alike."""
    q, k, v, _ = _inputs(1, 16, 2, 2, 16, jnp.float32)
    reference = jax.jit(flash_attention_reference, static_argnames="causal")
    full, causal = reference(q, k, v, causal=False), reference(q, k, v, causal=True)
    segmented = reference(q, k, v, causal=False, segment_ids=jnp.asarray([[0] * 8 + [1] * 8]))
    # The last query sees every key under both masks; the first sees only itself when causal.
    np.testing.assert_allclose(causal[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(causal[:, 0], v[:, 0], rtol=1e-5, atol=1e-5)
    assert not np.allclose(causal[:, 0], full[:, 0], atol=1e-2)
    # Within the second segment, attention averages only its own values.
    np.testing.assert_allclose(
        segmented[:, 8:], reference(q[:, 8:], k[:, 8:], v[:, 8:], causal=False),
        rtol=1e-5, atol=1e-5)


def test_fwd_and_bwd_are_named_jit_equations():
    """The planner finds the kernels as `jit` equations with these names, arrays in and out."""
    q, k, v, _ = _inputs(2, 24, 4, 2, 16, jnp.float32)
    segment_ids = _segments(2, 24)

    def loss(q, k, v):
        o = flash_attention(q, k, v, segment_ids=segment_ids, block_q=8, block_k=8,
                            interpret=True)
        return jnp.sum(o * o)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    named: dict[str, list] = {}
    for eqn in _all_eqns(jaxpr.jaxpr):
        if eqn.primitive.name in ("jit", "pjit") and eqn.params["name"] in (FWD_NAME, BWD_NAME):
            named.setdefault(eqn.params["name"], []).append(eqn)
    assert set(named) == {FWD_NAME, BWD_NAME}
    assert len(named[FWD_NAME]) == len(named[BWD_NAME]) == 1
    shapes = lambda vs: [(tuple(x.aval.shape), str(x.aval.dtype)) for x in vs]  # noqa: E731
    qs, kvs, seg = ((2, 24, 4, 16), "float32"), ((2, 24, 2, 16), "float32"), ((2, 24), "int32")
    lse = ((2, 4, 24), "float32")
    fwd, bwd = named[FWD_NAME][0], named[BWD_NAME][0]
    assert shapes(fwd.invars) == [qs, kvs, kvs, seg]
    assert shapes(fwd.outvars) == [qs, lse]
    assert shapes(bwd.invars) == [qs, kvs, kvs, seg, qs, lse, qs]
    assert shapes(bwd.outvars) == [qs, kvs, kvs]


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _all_eqns(sub)


def test_named_kernels_split_over_batch_and_heads():
    """Under shard_map on a (batch=2, heads=2) mesh, both kernels still match the reference."""
    q, k, v, do = _inputs(2, 16, 4, 2, 16, jnp.float32)
    segment_ids = _segments(2, 16)
    opts = _make_options(q, causal=True, block_q=8, block_k=8, interpret=True)
    fwd = functools.partial(shardplan_kernel__flash_attention_fwd, opts=opts)
    bwd = functools.partial(shardplan_kernel__flash_attention_bwd, opts=opts)
    mesh = jax.make_mesh((2, 2), ("batch", "heads"), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    bshd, bs, bhs = P("batch", None, "heads", None), P("batch", None), P("batch", "heads", None)
    # Interpret-mode kernels are plain HLO, which check_vma rejects (see notes/jax.md, section 5).
    sharded_fwd = jax.jit(jax.shard_map(fwd, mesh=mesh, in_specs=(bshd, bshd, bshd, bs),
                                        out_specs=(bshd, bhs), check_vma=False))
    sharded_bwd = jax.jit(jax.shard_map(bwd, mesh=mesh,
                                        in_specs=(bshd, bshd, bshd, bs, bshd, bhs, bshd),
                                        out_specs=(bshd, bshd, bshd), check_vma=False))
    o, lse = sharded_fwd(q, k, v, segment_ids)
    grads = sharded_bwd(q, k, v, segment_ids, o, lse, do)
    reference = functools.partial(flash_attention_reference, segment_ids=segment_ids)
    want = jax.jit(functools.partial(_output_and_grads, reference))(q, k, v, do)
    assert lse.shape == (2, 4, 16)
    for name, got, w in zip(("o", "dq", "dk", "dv"), (o, *grads), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=2e-5, atol=2e-5, err_msg=name)


def test_kernels_lower_for_the_gpu():
    """The Triton path lowers on CPU (no GPU needed): tile sizes, padding and primitives pass the
    Pallas Triton lowering for a GQA, segmented, odd-length, odd-head_dim case (head_dim 80 is
    padded to 128). Compiling the Triton IR to PTX and running it needs a GPU (benchmarks/)."""
    q = jax.ShapeDtypeStruct((1, 200, 4, 80), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 200, 2, 80), jnp.bfloat16)
    segment_ids = jnp.zeros((1, 200), jnp.int32)

    def step(q, k, v):
        attention = functools.partial(flash_attention, segment_ids=segment_ids, interpret=False)
        return _output_and_grads(attention, q, k, v, jnp.ones(q.shape, q.dtype))

    triton = "__gpu$xla.gpu.triton"
    exported = jax.export.export(
        jax.jit(step), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)])(q, kv, kv)
    text = exported.mlir_module()
    for name in ("fwd", "bwd_dkv", "bwd_dq"):
        assert f'name = "shardplan_flash_attention_{name}"' in text
    assert text.count(f"custom_call @{triton}") == 3


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "segment_shape", "match"),
    [
        ((1, 8, 3, 16), (1, 8, 2, 16), None, r"heads % kv_heads(.|\n)*'heads': 3, 'kv_heads': 2"),
        ((1, 8, 4, 16), (1, 9, 2, 16), None, r"k/v must match q(.|\n)*\(1, 9, 2, 16\)"),
        ((1, 8, 4, 16), (1, 8, 2, 8), None, r"k/v must match q"),
        ((1, 8, 4), (1, 8, 2, 16), None, r"q must be(.|\n)*\(1, 8, 4\)"),
        ((1, 8, 4, 16), (1, 8, 2, 16), (1, 9), r"segment_ids(.|\n)*\(1, 9\)"),
    ],
)
def test_bad_inputs_raise_config_error(q_shape, k_shape, segment_shape, match):
    q = jnp.zeros(q_shape, jnp.float32)
    k = v = jnp.zeros(k_shape, jnp.float32)
    segment_ids = None if segment_shape is None else jnp.zeros(segment_shape, jnp.int32)
    for fn in (flash_attention, flash_attention_reference):
        with pytest.raises(ConfigError, match=match):
            fn(q, k, v, segment_ids=segment_ids)


def test_bad_options_raise_config_error():
    q = k = v = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(ConfigError, match=r"block_q(.|\n)*value: 24"):
        flash_attention(q, k, v, block_q=24)
    with pytest.raises(ConfigError, match="same dtype"):
        flash_attention(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(ConfigError, match=r"segment_ids(.|\n)*float32"):
        flash_attention(q, k, v, segment_ids=jnp.zeros((1, 8), jnp.float32))
    with pytest.raises(ConfigError, match="unsupported dtype"):
        flash_attention(q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32))
