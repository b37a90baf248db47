"""make_plan -> apply_plan on one mesh: the plan runs and matches the unsharded step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.steps import mlp_step

import shardplan as sp


@pytest.fixture(scope="module")
def planned():
    # lr 1e-3: a well-conditioned run, so the comparison measures the plan, not the
    # amplification of summation-order differences by an unstable optimizer.
    step, state_abs, x_abs = mlp_step(256, 32, learning_rate=1e-3)
    cluster = sp.Cluster.local(devices=jax.devices()[:4])
    plan = sp.make_plan(step, state_abs, x_abs, cluster=cluster,
                        config=sp.PlanConfig(time_limit_s=20.0))
    return step, plan


def _real_state(seed: int = 0):
    rng = np.random.default_rng(seed)
    params = [{"kernel": jnp.asarray(rng.normal(size=(256, 256)) / 16, jnp.float32),
               "bias": jnp.asarray(rng.normal(size=(256,)) / 16, jnp.float32)}
              for _ in range(6)]
    x = jnp.asarray(rng.normal(size=(32, 256)), jnp.float32)
    return (params, optax.adam(1e-3).init(params)), x


def test_plan_is_a_single_sharded_stage(planned) -> None:
    _, plan = planned
    assert len(plan.stages) == 1 and plan.num_devices == 4
    kernels = [spec for path, (_, spec) in plan.param_specs.items()
               if path.startswith("0/") and path.endswith("kernel")]
    assert len(kernels) == 6 and all(any(spec) for spec in kernels)  # every kernel is split
    assert plan.predicted.step_time_s > 0
    assert sp.Plan.from_json(plan.to_json()) == plan


def test_planned_step_equals_the_unsharded_step_for_three_steps(planned) -> None:
    step, plan = planned
    state, x = _real_state()
    ref, got = state, state
    run = sp.apply_plan(step, plan)
    for _ in range(3):
        ref, ref_loss = jax.jit(step)(ref, x)
        got, loss = run(got, x)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-4, atol=1e-4)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    # The new state keeps the plan's shardings (nothing is resharded between steps).
    leaves = jax.tree_util.tree_flatten_with_path(got[0])[0]
    for path, leaf in leaves:
        key = "0/" + jax.tree_util.keystr(path, simple=True, separator="/")
        _, spec = plan.param_specs[key]
        assert tuple(a or None for a in leaf.sharding.spec) == tuple(
            (axes[0] if len(axes) == 1 else axes) if axes else None for axes in spec)
    assert len(run.compiled(got, x)) == 1


def test_one_mesh_over_several_device_types_is_refused_with_a_clear_error() -> None:
    step, state_abs, x_abs = mlp_step(32, 8, layers=2)
    cluster = sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
    with pytest.raises(sp.PipelineError, match="several device types"):
        sp.make_plan(step, state_abs, x_abs, cluster=cluster,
                     config=sp.PlanConfig(pipeline=False))
