"""Kernel-aware planning: a kernel's ``jax.jit`` call is one op with its registered rule, the
solver splits it only on the dimensions the rule allows, and the runtime runs it in
``shard_map`` with the plan's specs (XLA never partitions the kernel); sharded execution equals
the unsharded step."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardplan as sp
from shardplan.kernels import registry
from shardplan.kernels.registry import PRIMITIVE, parse_layout, rule_for
from shardplan.runtime import constrain

B, S, H, KV, D, M = 8, 32, 4, 2, 16, 64


def _params() -> dict[str, jax.Array]:
    k = jax.random.split(jax.random.key(0), 4)
    return {"wq": jax.random.normal(k[0], (M, H * D)) * 0.1,
            "wk": jax.random.normal(k[1], (M, KV * D)) * 0.1,
            "wv": jax.random.normal(k[2], (M, KV * D)) * 0.1,
            "wo": jax.random.normal(k[3], (H * D, M)) * 0.1}


def _loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    q = (x @ p["wq"]).reshape(B, S, H, D)
    k = (x @ p["wk"]).reshape(B, S, KV, D)
    v = (x @ p["wv"]).reshape(B, S, KV, D)
    o = sp.kernels.flash_attention(q, k, v, causal=True)
    return jnp.mean((o.reshape(B, S, H * D) @ p["wo"] - x) ** 2)


def _step(p, batch):
    loss, grads = jax.value_and_grad(_loss)(p, batch["x"])
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), {"loss": loss}


def _batch() -> dict[str, jax.Array]:
    return {"x": jax.random.normal(jax.random.key(1), (B, S, M))}


def test_every_rule_keeps_its_split_letters_in_every_result() -> None:
    # The runtime sums a result over the axes its operands are split on and it is not: that
    # is right only if the letters a rule may split (not sum) appear in every result.
    for name in ("flash_attention_fwd", "flash_attention_bwd", "grouped_matmul_fwd",
                 "grouped_matmul_bwd"):
        rule = rule_for(registry.PREFIX + name)
        assert rule is not None
        for n in (3, 4, 6, 7):
            _, results = rule.layouts(n)
            for layout in results:
                letters = {x for dim in parse_layout(layout) for x in dim}
                assert rule.split <= letters, (name, layout)
                assert not rule.reduce & letters, (name, layout)


def test_a_kernel_call_is_one_op_with_its_flops() -> None:
    graph = sp.trace(_step, _params(), _batch())
    kernels = [op for op in graph.ops if op.primitive == PRIMITIVE]
    assert [op.attrs["kernel"] for op in kernels] == [
        "shardplan_kernel__flash_attention_fwd", "shardplan_kernel__flash_attention_bwd"]
    assert not any(op.primitive == "pallas_call" for op in graph.ops)
    pairs = S * S - S * (S - 1) // 2  # causal: each query meets the keys up to itself
    forward = 4 * B * H * D * pairs
    assert [op.flops for op in kernels] == [forward, 2.5 * forward]


def _kernels_split_legally(plan, graph) -> list:
    """The graph's kernel ops, after checking that the plan pins each one and splits it only
    on letters its rule allows (and splits at least one)."""
    kernels = [op for op in graph.ops if op.primitive == PRIMITIVE]
    assert kernels
    split_any = False
    for op in kernels:
        _, results, operands = plan.constraints["/".join(map(str, op.path))]
        rule = rule_for(op.attrs["kernel"])
        assert rule is not None
        operand_layouts, result_layouts = rule.layouts(len(operands))
        for layout, spec in zip([*operand_layouts, *result_layouts], [*operands, *results],
                                strict=True):
            for letters, axes in zip(parse_layout(layout), spec, strict=True):
                if axes:
                    split_any = True
                    # Only the major letter of a dimension may carry axes, and only one the
                    # rule allows: never attention's sequence (s, t), head_dim (d) or the
                    # query heads within a kv head (g); never a grouped matmul's rows (m) or
                    # experts (e).
                    assert letters[0] in rule.split | rule.reduce, (op.attrs["kernel"],
                                                                    layout, spec)
    assert split_any
    return kernels


# On XLA:CPU a Pallas kernel runs in interpret mode: its grid becomes loops over its blocks,
# with buffers the memory model, which prices the call as one op on its operands and
# results, does not see. The compiled program then exceeds the prediction by more than the
# 10 % verification warns at (the attention test model: 1.26x; the MoE model: 1.94x).
INTERPRETED_KERNELS = r"compiled to .* the stage's predicted peak"


def _same_three_steps(step, plan, state, batch, *, over: bool = False) -> None:
    expected = (pytest.warns(sp.ShardplanWarning, match=INTERPRETED_KERNELS) if over
                else contextlib.nullcontext())
    with expected:
        run = sp.apply_plan(step, plan)
        ours, m1 = run(state, batch)
    reference = jax.jit(step)
    theirs, m2 = reference(state, batch)
    for i in range(3):
        if i:
            ours, m1 = run(ours, batch)
            theirs, m2 = reference(theirs, batch)
        np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-4, atol=1e-4)
    for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-4)


def _split_calls(monkeypatch) -> list[str]:
    """The names of the kernel calls the runtime runs split from now on, in order."""
    calls: list[str] = []
    real = constrain._split_kernel

    def counting(name, *args):
        calls.append(name)
        return real(name, *args)

    monkeypatch.setattr(constrain, "_split_kernel", counting)
    return calls


def test_the_plan_splits_the_kernel_only_on_batch_and_heads_and_runs_it_split(
        monkeypatch) -> None:
    params, batch = _params(), _batch()
    plan = sp.make_plan(_step, params, batch, cluster=sp.Cluster.local(types={"cpu": 8}))
    kernels = _kernels_split_legally(plan, sp.trace(_step, params, batch))
    calls = _split_calls(monkeypatch)
    _same_three_steps(_step, plan, params, batch, over=True)
    assert sorted(set(calls)) == sorted(op.attrs["kernel"] for op in kernels)


@pytest.mark.parametrize(("preset", "overrides"), [
    ("llama-tiny", {"attention_impl": "pallas"}),
    ("moe-tiny", {"attention_impl": "pallas", "moe_impl": "pallas"}),
])
def test_tiny_models_on_the_pallas_paths_split_kernels_legally_and_equal_unsharded(
        preset, overrides) -> None:
    import shardplan_models as models
    config = models.load_model_config(preset, overrides=overrides)
    graphdef, state = models.init_train_state(config, seed=0)
    step = models.make_train_step(graphdef)
    batch = models.example_batch(config, 16, seed=0)
    plan = sp.make_plan(step, state, batch, cluster=sp.Cluster.local(types={"cpu": 8}))
    kernels = _kernels_split_legally(plan, sp.trace(step, state, batch))
    names = {op.attrs["kernel"] for op in kernels}
    assert "shardplan_kernel__flash_attention_fwd" in names
    assert ("shardplan_kernel__grouped_matmul_fwd" in names) == (preset == "moe-tiny")
    _same_three_steps(step, plan, state, batch, over=preset == "moe-tiny")


def test_a_call_recorded_with_other_options_at_one_shape_is_not_split() -> None:
    calls_before = dict(registry._CALLS)
    try:
        q = jnp.zeros((1, 16, 2, 8))
        sp.kernels.flash_attention(q, q, q, causal=True)
        sp.kernels.flash_attention(q, q, q, causal=False)
        name = "shardplan_kernel__flash_attention_fwd"
        assert registry.recorded(name, [q, q, q]) is None
        with pytest.raises(sp.RuntimeFailure, match=r"(?s)kernel shardplan_kernel__flash.*fix:"):
            constrain._split_kernel(name, _Eqn([q, q, q]), [q, q, q], ((), ()))
    finally:
        registry._CALLS.clear()
        registry._CALLS.update(calls_before)


class _Eqn:
    """An equation's operands, as ``_split_kernel`` reads them."""

    def __init__(self, arrays: list[jax.Array]) -> None:
        self.invars = [type("Var", (), {"aval": jax.typeof(a)})() for a in arrays]


def test_a_kernel_inside_a_scanned_stack_runs_split_in_the_loop(monkeypatch) -> None:
    # llama-tiny's blocks as one nnx.scan with Pallas attention: the kernel calls sit in the
    # forward and backward scans' bodies. The plan pins them there (their paths extend the
    # scan's), the runtime rebuilds each scan around its evaluated body and runs the calls in
    # shard_map with the plan's specs: one manual computation per call in the lowered step.
    import shardplan_models as models
    config = models.load_model_config("llama-tiny", overrides={"attention_impl": "pallas",
                                                               "scan_layers": True})
    graphdef, state = models.init_train_state(config, seed=0)
    step = models.make_train_step(graphdef)
    batch = models.example_batch(config, 16, seed=0)
    plan = sp.make_plan(step, state, batch, cluster=sp.Cluster.local(types={"cpu": 8}))
    kernels = _kernels_split_legally(plan, sp.trace(step, state, batch))
    assert {op.attrs["kernel"] for op in kernels} == {
        "shardplan_kernel__flash_attention_fwd", "shardplan_kernel__flash_attention_bwd"}
    assert all(op.loop for op in kernels)  # every call is inside a loop body
    calls = _split_calls(monkeypatch)
    _same_three_steps(step, plan, state, batch, over=True)
    assert sorted(calls) == sorted(op.attrs["kernel"] for op in kernels)
    run = sp.apply_plan(step, plan, verify=False)
    run._ensure(state, batch)
    placed = [jax.device_put(x, s) for x, s in zip((state, batch), run._shardings, strict=True)]
    lowered = run._jitted.lower(*placed).as_text()
    # (Shardy's manual computation; the older partitioner marks one by a full-to-shard call.)
    manual = max(lowered.count("sdy.manual_computation"), lowered.count("SPMDFullToShardShape"))
    assert manual == len(kernels)


def test_a_pipeline_plans_layouts_carry_their_kernel_calls_specs() -> None:
    # The stage planner's layouts hold the specs of every kernel call (decoded from each
    # layout's intra-op solution): the stages' programs run the calls under them.
    import shardplan_models as models
    from helpers.pipelines import budget_planned
    config, state, step, plan, _ = budget_planned("llama-tiny", 16, 0.6, attention_impl="pallas",
                                                   scan_layers=True)
    assert len(plan.stages) > 1 and plan.layouts
    graph = sp.trace(step, jax.eval_shape(lambda: state),
                     jax.eval_shape(lambda: models.example_batch(config, 16, seed=0)))
    paths = {"/".join(map(str, op.path)) for op in graph.ops if op.primitive == PRIMITIVE}
    assert len(paths) == 2
    for layout in plan.layouts.values():
        assert set(layout.kernel_specs) == paths

