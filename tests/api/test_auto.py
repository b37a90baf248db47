"""sp.auto: plans once per input signature, caches, runs like the unsharded step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.steps import mlp_step

import shardplan as sp
from shardplan.api import auto as auto_module

WIDTH, BATCH, LAYERS = 32, 16, 2


@pytest.fixture(scope="module")
def cluster() -> sp.Cluster:
    return sp.Cluster.local(devices=jax.devices()[:4])


@pytest.fixture
def counted(monkeypatch):
    """Counts make_plan calls (through the name auto.py calls) and traces of the user's step."""
    counts = {"make_plan": 0, "step": 0}
    real_make_plan = auto_module.make_plan

    def make_plan(*args, **kwargs):
        counts["make_plan"] += 1
        return real_make_plan(*args, **kwargs)

    monkeypatch.setattr(auto_module, "make_plan", make_plan)
    step, _, _ = mlp_step(WIDTH, BATCH, layers=LAYERS, learning_rate=1e-3)

    def train_step(state, x):
        """The MLP train step."""
        counts["step"] += 1  # runs only while jax traces it
        return step(state, x)

    return train_step, step, counts


def _real_state(seed: int = 0, batch: int = BATCH):
    rng = np.random.default_rng(seed)
    params = [{"kernel": jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / 4, jnp.float32),
               "bias": jnp.asarray(rng.normal(size=(WIDTH,)) / 4, jnp.float32)}
              for _ in range(LAYERS)]
    x = jnp.asarray(rng.normal(size=(batch, WIDTH)), jnp.float32)
    return (params, optax.adam(1e-3).init(params)), x


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def test_auto_step_equals_the_unsharded_step_and_plans_once(cluster, counted) -> None:
    train_step, step, counts = counted
    run = sp.auto(cluster=cluster, config=sp.PlanConfig(time_limit_s=5))(train_step)
    assert counts["make_plan"] == 0 and run.plans == ()  # decorating plans nothing
    state, x = _real_state()
    ref, got = state, state
    for i in range(3):
        ref, ref_loss = jax.jit(step)(ref, x)
        got, loss = run(got, x)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-4, atol=1e-4)
        if i == 0:
            traces_after_first_call = counts["step"]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    # Calls 2 and 3 neither planned nor traced the step again.
    assert counts["make_plan"] == 1
    assert counts["step"] == traces_after_first_call
    assert len(run.plans) == 1 and run.plans[0].num_devices == 4
    assert run.plan_for(got, x) is run.plans[0]


def test_a_new_batch_shape_plans_again_and_the_cache_can_be_cleared(cluster, counted) -> None:
    train_step, _, counts = counted
    run = sp.auto(train_step, cluster=cluster, config=sp.PlanConfig(time_limit_s=5))
    state, x = _real_state()
    # plan_for plans from the arguments' shapes only, so ShapeDtypeStructs work as well.
    plan = run.plan_for(_abstract(state), _abstract(x))
    assert run.plan_for(state, x) is plan and counts["make_plan"] == 1
    wide = jax.ShapeDtypeStruct((2 * BATCH, WIDTH), jnp.float32)
    other = run.plan_for(_abstract(state), wide)
    assert counts["make_plan"] == 2 and run.plans == (plan, other)
    run.cache_clear()
    assert run.plans == ()
    assert isinstance(run.plans, tuple)  # a snapshot: callers cannot edit the cache


def test_signature_keys_on_structure_shape_dtype_and_weak_type() -> None:
    x = jnp.zeros((2, 3), jnp.float32)
    sig = auto_module.signature
    assert sig({"w": x}, x) == sig({"w": jnp.ones((2, 3))}, jax.ShapeDtypeStruct((2, 3),
                                                                               jnp.float32))
    assert sig({"w": x}, x) != sig({"w": x}, x.astype(jnp.bfloat16))
    assert sig({"w": x}, x) != sig({"w": x}, x[:1])
    assert sig({"w": x}, x) != sig({"v": x}, x)
    assert sig([x], 1.0) != sig([x], jnp.float32(1.0))  # a Python float is weakly typed
    assert sig([x], 1.0)[1][-1] == ((), jnp.dtype(jnp.float32), True)


def test_auto_wraps_the_function_and_resolves_the_cluster_lazily(counted) -> None:
    train_step, _, counts = counted
    run = sp.auto(train_step)
    assert run.__name__ == "train_step" and run.__doc__ == "The MLP train step."
    assert run.__wrapped__ is train_step
    assert run.cluster is None and counts["make_plan"] == 0


def test_the_step_runs_on_the_clusters_devices_or_refuses(counted) -> None:
    # Plan device ids are cluster ids: a cluster bound to devices 4-7 must run there, never
    # silently on devices 0-3.
    train_step, _, _ = counted
    run = sp.auto(train_step, cluster=sp.Cluster.local(devices=jax.devices()[4:]),
                  config=sp.PlanConfig(time_limit_s=5))
    state, x = _real_state()
    try:
        new_state, _ = run(state, x)
    except sp.PlanMismatchError as e:
        assert "not on the cluster's devices" in str(e)
    else:
        placed = {d.id for leaf in jax.tree.leaves(new_state) for d in leaf.sharding.device_set}
        assert placed <= {d.id for d in jax.devices()[4:]}


@pytest.mark.parametrize("make", [
    lambda c: sp.auto(42, cluster=c),
    lambda c: sp.auto(cluster=c)("train_step"),
])
def test_a_non_callable_is_a_config_error(cluster, make) -> None:
    with pytest.raises(sp.ConfigError, match=r"(?s)train step function.*auto\(fn\).*fix:"):
        make(cluster)


def test_bad_options_are_config_errors(counted) -> None:
    train_step, _, _ = counted
    with pytest.raises(sp.ConfigError, match=r"(?s)must be an sp.Cluster.*'str'.*fix:"):
        sp.auto(train_step, cluster="a100x8")
    with pytest.raises(sp.ConfigError, match=r"(?s)must be an sp.PlanConfig.*'dict'.*fix:"):
        sp.auto(train_step, config={"time_limit_s": 5})


@pytest.mark.parametrize("args, kwargs", [
    ((0,), {}),
    ((0, 1, 2), {}),
    ((0,), {"batch": 1}),
    ((), {"state": 0, "batch": 1}),
])
def test_calls_that_are_not_state_batch_are_config_errors(cluster, counted, args,
                                                          kwargs) -> None:
    train_step, _, counts = counted
    run = sp.auto(train_step, cluster=cluster)
    with pytest.raises(sp.ConfigError, match=r"(?s)two positional arguments.*"
                                             r"step\(state, batch\).*fix:"):
        run(*args, **kwargs)
    assert counts["make_plan"] == 0


def test_a_leaf_that_is_not_an_array_is_a_config_error_naming_its_path(cluster,
                                                                      counted) -> None:
    train_step, _, counts = counted
    run = sp.auto(train_step, cluster=cluster)
    with pytest.raises(sp.ConfigError, match=r"(?s)array or a scalar.*batch/tokens.*'str'"):
        run({"w": jnp.zeros(2)}, {"tokens": "hello"})
    with pytest.raises(sp.ConfigError, match=r"(?s)traced value.*state/w"):
        jax.jit(run)({"w": jnp.zeros(2)}, jnp.zeros(2))
    assert counts["make_plan"] == 0


# --------------------------------------------------------------------------- caching


def _compile_counter():
    """Counts XLA backend compiles (jax's own monitoring event, one per executable built)."""
    from jax import monitoring

    count = [0]

    def listen(event: str, duration: float, **_: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    monitoring.register_event_duration_secs_listener(listen)
    return count


def test_five_calls_compile_the_step_once_and_a_new_auto_reuses_the_plan_on_disk(
        cluster, counted, tmp_path) -> None:
    train_step, _, counts = counted
    config = sp.PlanConfig(time_limit_s=5)
    first = sp.auto(train_step, cluster=cluster, config=config, cache_dir=tmp_path)
    state, x = _real_state()
    first(state, x)
    assert counts["make_plan"] == 1 and list(first.sources.values()) == ["planned"]
    assert len(list(tmp_path.glob("*.json"))) == 1
    # A new sp.auto of the same step (as a new process would have) loads the plan from disk:
    # no planning, and over five calls XLA compiles the step exactly once.
    again = sp.auto(train_step, cluster=cluster, config=config, cache_dir=tmp_path)
    compiles = _compile_counter()
    state, x = _real_state(seed=1)
    per_call, traces = [], []
    for _ in range(5):
        before = compiles[0]
        state, loss = again(state, x)
        per_call.append(compiles[0] - before)
        traces.append(counts["step"])
    jax.block_until_ready(loss)
    assert per_call == [1, 0, 0, 0, 0]
    assert counts["make_plan"] == 1 and list(again.sources.values()) == ["disk"]
    assert again.plans[0] == first.plans[0]
    assert traces[1:] == traces[:1] * 4  # nor traced again after the first call


def test_a_corrupt_plan_file_in_the_cache_is_planned_again_with_a_warning(
        cluster, counted, tmp_path) -> None:
    train_step, _, counts = counted
    config = sp.PlanConfig(time_limit_s=5)
    state, x = _real_state()
    sp.auto(train_step, cluster=cluster, config=config, cache_dir=tmp_path).plan_for(state, x)
    (path,) = tmp_path.glob("*.json")
    path.write_text("{ not json")
    run = sp.auto(train_step, cluster=cluster, config=config, cache_dir=tmp_path)
    with pytest.warns(sp.ShardplanWarning, match=r"(?s)cached plan .* is not usable.*JSON"):
        run.plan_for(state, x)
    assert counts["make_plan"] == 2 and sp.load_plan(path) == run.plans[0]


_SECOND_PROCESS = """
import sys
sys.path[:0] = [{tests!r}, {helpers!r}]
import jax
jax.config.update("jax_num_cpu_devices", 8)
import shardplan as sp
from shardplan.api import auto as auto_module
from test_auto import WIDTH, BATCH, LAYERS, _real_state
from helpers.steps import mlp_step

def refuse(*args, **kwargs):
    raise SystemExit("make_plan was called: the plan on disk was not reused")

auto_module.make_plan = refuse
step, _, _ = mlp_step(WIDTH, BATCH, layers=LAYERS, learning_rate=1e-3)

def train_step(state, x):
    return step(state, x)

run = sp.auto(train_step, cluster=sp.Cluster.local(devices=jax.devices()[:4]),
              config=sp.PlanConfig(time_limit_s=5), cache_dir={cache!r})
state, x = _real_state()
state, loss = run(state, x)
print("source", list(run.sources.values())[0], "loss", float(loss))
"""


@pytest.mark.slow
def test_a_second_process_reuses_the_plan_on_disk_without_planning(cluster, counted,
                                                                    tmp_path) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    train_step, _, counts = counted
    run = sp.auto(train_step, cluster=cluster, config=sp.PlanConfig(time_limit_s=5),
                  cache_dir=tmp_path)
    state, x = _real_state()
    _, loss = run(state, x)
    assert counts["make_plan"] == 1
    script = _SECOND_PROCESS.format(tests=str(Path(__file__).parent),
                                    helpers=str(Path(__file__).parents[1]), cache=str(tmp_path))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    _, source, _, value = done.stdout.split()
    assert source == "disk"
    np.testing.assert_allclose(float(value), float(loss), rtol=1e-6)


def test_auto_runs_an_nnx_split_state_like_the_unsharded_step(cluster) -> None:
    # The NNX style: model and nnx.Optimizer split into (graphdef, state); the step merges,
    # takes nnx.value_and_grad, updates and returns nnx.state(...).
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.up = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
            self.down = nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.gelu(self.up(x)))

    model = MLP(nnx.Rngs(0))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)))

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(
            lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), {"loss": loss}

    run = sp.auto(step, cluster=cluster, config=sp.PlanConfig(time_limit_s=5))
    ref, got = state, jax.tree.map(jnp.copy, state)
    for i in range(3):
        rng = np.random.default_rng(i)
        batch = {"x": jnp.asarray(rng.normal(size=(BATCH, WIDTH)), jnp.float32),
                 "y": jnp.asarray(rng.normal(size=(BATCH, WIDTH)), jnp.float32)}
        ref, ref_metrics = jax.jit(step)(ref, batch)
        got, metrics = run(got, batch)
        np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-4, atol=1e-4)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    (plan,) = run.plans
    assert "0/up/kernel/value" in plan.param_specs and plan.num_devices == 4


def test_auto_on_a_mixed_cluster_runs_the_stage_planners_plan(counted, tmp_path) -> None:
    train_step, step, counts = counted
    mixed = sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
    config = sp.PlanConfig(time_limit_s=5)
    run = sp.auto(train_step, cluster=mixed, config=config, cache_dir=tmp_path)
    state, x = _real_state()
    ref, got = state, jax.tree.map(jnp.copy, state)
    for _ in range(3):
        ref, ref_loss = jax.jit(step)(ref, x)
        got, loss = run(got, x)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-4, atol=1e-4)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    (plan,) = run.plans
    # The stage planner's plan (for this tiny MLP: one A100, 16 microbatches of one sample),
    # run by the pipeline runtime: per-task programs, each compiled and checked.
    assert plan.microbatches > 1 or len(plan.stages) > 1
    assert counts["make_plan"] == 1
    assert any(p["name"].startswith("replica 0 task") for p in plan.compiled["programs"])
    # A new sp.auto (as a new process would have) reuses the multi-stage plan from disk.
    again = sp.auto(train_step, cluster=mixed, config=config, cache_dir=tmp_path)
    again(got, x)
    assert counts["make_plan"] == 1 and list(again.sources.values()) == ["disk"]
