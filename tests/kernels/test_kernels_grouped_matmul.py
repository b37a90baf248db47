"""The grouped-matmul Pallas kernel (interpret mode on CPU) and the MoE layer paths built on it.

References: ``jax.lax.ragged_dot`` for the kernel; the dense GShard dispatch/combine MoE layer for
``moe_impl: ragged | pallas``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import shardplan_models as models
from flax import nnx
from jax.extend import core as jcore
from shardplan_models.config import expert_capacity
from shardplan_models.moe import MoEMLP

import shardplan.kernels
from shardplan.errors import ConfigError

# The function, from its module: mypy resolves `shardplan.kernels.grouped_matmul` to the module
# of the same name (the public path is checked in test_public_path_is_the_kernel).
from shardplan.kernels.grouped_matmul import (
    BWD_NAME,
    FWD_NAME,
    SWIZZLE_TILES,
    _swizzle,
    grouped_matmul,
    shard_group_sizes,
)

FAST_COMPILE: dict[str, Any] = {"xla_backend_optimization_level": 0}
"""XLA options for test programs: the kernels are tiny, compile time dominates."""

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
"""rtol = atol of the kernel against ``ragged_dot`` per dtype (issue 10 acceptance)."""


def run_compiled(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs ``jax.jit(fn)(*args)`` compiled with :data:`FAST_COMPILE`."""
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)


def test_public_path_is_the_kernel() -> None:
    assert shardplan.kernels.grouped_matmul is grouped_matmul  # sp.kernels.grouped_matmul
    assert "grouped_matmul" in shardplan.kernels.__all__


def _operands(m: int, k: int, n: int, groups: int, dtype: Any, seed: int) -> tuple[jax.Array, ...]:
    """``lhs [m, k]``, ``rhs [groups, k, n]`` and a cotangent ``[m, n]`` drawn with numpy."""
    rng = np.random.default_rng(seed)
    lhs, rhs, dout = (rng.normal(0.0, 0.5, shape).astype(np.float32)
                      for shape in ((m, k), (groups, k, n), (m, n)))
    return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(dout, dtype)


def _value_and_vjp(matmul: Callable[..., jax.Array], lhs: jax.Array, rhs: jax.Array,
                   group_sizes: jax.Array, dout: jax.Array) -> tuple[jax.Array, ...]:
    """``(out, d_lhs, d_rhs)`` of ``matmul(lhs, rhs, group_sizes)`` for the cotangent ``dout``."""
    out, vjp = jax.vjp(lambda a, b: matmul(a, b, group_sizes), lhs, rhs)
    return (out, *vjp(dout))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("m", "k", "n", "sizes", "blocks"),
    [
        # Sum 33 < m = 40 (rows 33.. give 0), an empty group, sizes and k, n not tile multiples:
        # the 16-row tiles straddle the group boundaries 7, 24 and 33.
        (40, 24, 20, [7, 0, 17, 9], {"block_m": 16, "block_k": 16, "block_n": 16}),
        # Empty first and last groups, sum == m, default tiles (one 64-row tile, two groups).
        (64, 32, 32, [0, 30, 34, 0], {}),
    ],
    ids=["straddling-tiles", "default-tiles"],
)
def test_forward_and_grads_match_ragged_dot(m: int, k: int, n: int, sizes: list[int],
                                            blocks: dict[str, Any], dtype: Any) -> None:
    lhs, rhs, dout = _operands(m, k, n, len(sizes), dtype, seed=m)
    group_sizes = jnp.asarray(sizes, jnp.int32)

    def both(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
             dout: jax.Array) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        def kernel(a: jax.Array, b: jax.Array, g: jax.Array) -> jax.Array:
            return grouped_matmul(a, b, g, **blocks)

        return (_value_and_vjp(kernel, lhs, rhs, group_sizes, dout),
                _value_and_vjp(jax.lax.ragged_dot, lhs, rhs, group_sizes, dout))

    got, want = run_compiled(both, lhs, rhs, group_sizes, dout)
    tolerance = TOLERANCE[dtype]
    for name, g, w in zip(("out", "d_lhs", "d_rhs"), got, want, strict=True):
        assert g.dtype == dtype, name
        assert g.shape == w.shape, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=tolerance, atol=tolerance, err_msg=name)
    total = sum(sizes)
    assert np.all(np.asarray(got[0][total:]) == 0)  # rows past sum(group_sizes)
    for g, size in enumerate(sizes):
        if size == 0:  # an empty group's weights get no gradient
            assert np.all(np.asarray(got[2][g]) == 0)


@pytest.mark.parametrize(("row_tiles", "col_tiles"), [(1, 1), (3, 5), (SWIZZLE_TILES, 2),
                                                    (2 * SWIZZLE_TILES + 3, 4)])
def test_program_order_visits_every_tile_once(row_tiles: int, col_tiles: int) -> None:
    # The kernels' tests above have at most 4 row tiles (one band); this covers several bands
    # and a narrower last band.
    programs = np.arange(row_tiles * col_tiles, dtype=np.int32)
    rows, cols = _swizzle(jnp.asarray(programs), row_tiles, col_tiles)
    visited = sorted(zip(np.asarray(rows).tolist(), np.asarray(cols).tolist(), strict=True))
    assert visited == [(i, j) for i in range(row_tiles) for j in range(col_tiles)]
    # The first programs stay within one band of rows.
    first = np.asarray(rows)[: min(SWIZZLE_TILES, row_tiles) * col_tiles]
    assert first.max() < SWIZZLE_TILES


def _named_jits(jaxpr: jcore.Jaxpr) -> list[jcore.JaxprEqn]:
    """The ``jit``/``pjit`` equations named ``shardplan_kernel__*`` anywhere in ``jaxpr``."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("jit", "pjit") and str(eqn.params.get("name", "")).startswith(
                "shardplan_kernel__"):
            found.append(eqn)
        for sub in jcore.jaxprs_in_params(eqn.params):
            found.extend(_named_jits(sub))
    return found


def _shape(var: Any) -> tuple[int, ...]:
    """The shape of a jaxpr variable."""
    aval = var.aval
    assert isinstance(aval, jax.core.ShapedArray)
    return aval.shape


def test_kernels_are_named_jits_in_a_differentiated_step() -> None:
    m, k, n, groups = 48, 16, 32, 3
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((groups,), jnp.int32))

    def loss(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        out = grouped_matmul(jnp.tanh(lhs), rhs, group_sizes)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    closed = jax.make_jaxpr(jax.jit(jax.grad(loss, argnums=(0, 1))))(*args)
    eqns = {eqn.params["name"]: eqn for eqn in _named_jits(closed.jaxpr)}
    assert set(eqns) == {FWD_NAME, BWD_NAME}
    shapes = {name: ([_shape(v) for v in eqn.invars], [_shape(v) for v in eqn.outvars])
              for name, eqn in eqns.items()}
    assert shapes[FWD_NAME] == ([(m, k), (groups, k, n), (groups,)], [(m, n)])
    assert shapes[BWD_NAME] == ([(m, k), (groups, k, n), (groups,), (m, n)],
                                [(m, k), (groups, k, n)])


def test_gpu_path_lowers_to_triton() -> None:
    # Lowering (not compiling) for CUDA runs the Pallas Triton lowering on this CPU machine: it
    # rejects non-power-of-two loads and unsupported ops, so the GPU path is checked in CI.
    m, k, n, groups = 200, 96, 80, 5
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((groups,), jnp.int32),
            jax.ShapeDtypeStruct((m, n), jnp.bfloat16))

    def step(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
             dout: jax.Array) -> tuple[jax.Array, ...]:
        def kernel(a: jax.Array, b: jax.Array, g: jax.Array) -> jax.Array:
            return grouped_matmul(a, b, g, interpret=False)

        return _value_and_vjp(kernel, lhs, rhs, group_sizes, dout)

    text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3  # forward, d_lhs, d_rhs


def test_split_rows_and_columns_in_shard_map() -> None:
    # The documented legal splits, on 8 devices: rows (m) with per-shard group sizes from
    # shard_group_sizes and rhs replicated over "rows", and columns (n). Gradients come back
    # through shard_map's transpose (psum of d_rhs over "rows" and of d_lhs over "cols").
    m, k, n, sizes = 64, 16, 32, [5, 0, 30, 20]  # sum 55: the last shard has unassigned rows
    lhs, rhs, dout = _operands(m, k, n, len(sizes), jnp.float32, seed=7)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    mesh = jax.make_mesh((4, 2), ("rows", "cols"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rows = m // 4
    P = jax.sharding.PartitionSpec

    def local(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        row_start = jax.lax.axis_index("rows") * rows
        return grouped_matmul(lhs, rhs, shard_group_sizes(group_sizes, row_start, rows))

    # Interpret-mode kernels inside shard_map need check_vma=False (see notes/jax.md).
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("rows"), P(None, None, "cols"), P()),
                            out_specs=P("rows", "cols"), check_vma=False)

    def both(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
             dout: jax.Array) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        return (_value_and_vjp(sharded, lhs, rhs, group_sizes, dout),
                _value_and_vjp(jax.lax.ragged_dot, lhs, rhs, group_sizes, dout))

    got, want = run_compiled(both, lhs, rhs, group_sizes, dout)
    for name, g, w in zip(("out", "d_lhs", "d_rhs"), got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize(
    ("shapes", "argument", "value"),
    [
        ({"lhs": ((2, 3, 4), "float32")}, "lhs", "(2, 3, 4)"),
        ({"rhs": ((4, 8), "float32")}, "rhs", "(4, 8)"),
        ({"group_sizes": ((2, 1), "int32")}, "group_sizes", "(2, 1)"),
        ({"lhs": ((16, 4), "int32"), "rhs": ((2, 4, 8), "int32")}, "lhs", "'int32'"),
        ({"rhs": ((2, 4, 8), "bfloat16")}, "rhs", "'bfloat16'"),
        ({"group_sizes": ((2,), "float32")}, "group_sizes", "'float32'"),
        ({"group_sizes": ((3,), "int32")}, "group_sizes", "(3,)"),
        ({"rhs": ((2, 5, 8), "float32")}, "rhs", "(2, 5, 8)"),
        ({"block_m": 24}, "block_m", "24"),
    ],
    ids=["lhs-rank", "rhs-rank", "sizes-rank", "lhs-dtype", "rhs-dtype", "sizes-dtype",
         "group-count", "k-mismatch", "block"],
)
def test_bad_inputs_name_the_argument(shapes: dict[str, Any], argument: str, value: str) -> None:
    spec = {"lhs": ((16, 4), "float32"), "rhs": ((2, 4, 8), "float32"),
            "group_sizes": ((2,), "int32")}
    block_m = shapes.pop("block_m", None)
    spec.update(shapes)
    arrays = {name: np.zeros(shape, dtype) for name, (shape, dtype) in spec.items()}
    with pytest.raises(ConfigError) as err:
        grouped_matmul(arrays["lhs"], arrays["rhs"], arrays["group_sizes"], block_m=block_m)
    message = str(err.value)
    assert f"grouped_matmul({argument}=...)" in message
    assert f"value: {value}" in message
    assert "fix:" in message


# ------------------------------------------------------------------------------------------------
# The MoE layer: moe_impl ragged and pallas against dense, with tokens dropped at capacity
# ------------------------------------------------------------------------------------------------

_MOE = {"n_experts": 4, "top_k": 2, "capacity_factor": 0.5}
_BATCH, _SEQ, _D_MODEL, _D_FF = 2, 8, 16, 32


def _moe_mlp(moe_impl: str, **options: Any) -> tuple[nnx.GraphDef, nnx.State]:
    """An MoEMLP split into graphdef and numpy-drawn parameters (the same for every impl)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: MoEMLP(_D_MODEL, _D_FF, moe_impl=moe_impl, rngs=nnx.Rngs(0),
                       **{**_MOE, **options})))
    rng = np.random.default_rng(0)
    state = jax.tree.map(
        lambda leaf: jnp.asarray(rng.normal(0.0, 0.3, leaf.shape).astype(leaf.dtype)), abstract)
    return graphdef, state


def _loss_and_grads(graphdef: nnx.GraphDef) -> Callable[..., Any]:
    """``(state, x) -> ((loss, y), (d_state, d_x))`` for ``loss = sum(y^2) + aux``."""
    def loss(state: nnx.State, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        y, aux = nnx.merge(graphdef, state)(x)
        return jnp.sum(y**2) + aux, y

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


@pytest.mark.parametrize("moe_impl", ["ragged", "pallas"])
def test_moe_impl_matches_dense_with_dropped_tokens(moe_impl: str) -> None:
    # Capacity ceil(0.5 * 8 * 2 / 4) = 2 slots per expert per sequence: 4 experts x 2 slots hold
    # 8 of each sequence's 16 (token, choice) pairs, so at least 8 pairs per sequence are dropped.
    capacity = expert_capacity(_SEQ, n_experts=4, top_k=2, capacity_factor=0.5)
    assert capacity * _MOE["n_experts"] < _SEQ * _MOE["top_k"]
    x = jnp.asarray(np.random.default_rng(1).normal(size=(_BATCH, _SEQ, _D_MODEL)), jnp.float32)
    dense, state = _moe_mlp("dense")
    other, _ = _moe_mlp(moe_impl)
    roomy, _ = _moe_mlp("dense", capacity_factor=4.0)  # drops nothing

    def both(state: nnx.State, x: jax.Array) -> tuple[Any, Any, jax.Array]:
        return (_loss_and_grads(dense)(state, x), _loss_and_grads(other)(state, x),
                nnx.merge(roomy, state)(x)[0])

    want, got, undropped = run_compiled(both, state, x)
    (want_loss, want_y), want_grads = want
    (got_loss, got_y), got_grads = got
    # Dropping changes the output: the comparison below runs in the dropping regime.
    assert np.abs(np.asarray(want_y) - np.asarray(undropped)).max() > 1e-2
    np.testing.assert_allclose(got_y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want_grads)]
    for path, g, w in zip(paths, jax.tree.leaves(got_grads), jax.tree.leaves(want_grads),
                          strict=True):
        assert np.abs(np.asarray(w)).max() > 0, path  # every parameter and x gets a gradient
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=path)


def test_moe_model_config_selects_the_impl() -> None:
    ragged = models.load_model_config("moe-tiny", overrides={"moe_impl": "ragged"})
    assert isinstance(ragged, models.MoEConfig)
    assert getattr(models.load_model_config("moe-tiny"), "moe_impl", None) == "dense"
    model = nnx.eval_shape(lambda: models.MoE(ragged, rngs=nnx.Rngs(0)))
    impls = [m.moe_impl for _, m in nnx.iter_modules(model) if isinstance(m, MoEMLP)]
    assert impls == ["ragged"] * ragged.n_layers
    with pytest.raises(ConfigError, match=r"MoEConfig\.moe_impl") as err:
        models.load_model_config("moe-tiny", overrides={"moe_impl": "palas"})
    assert "did you mean 'pallas'" in str(err.value)
    assert "'palas'" in str(err.value)
    with pytest.raises(ConfigError, match=r"MoEMLP\(moe_impl=\.\.\.\)"):
        MoEMLP(8, 8, n_experts=2, top_k=1, capacity_factor=1.0, moe_impl="sparse",
               rngs=nnx.Rngs(0))
