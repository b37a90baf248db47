"""PlanConfig(respect_annotations=True): user sharding annotations (NNX ``with_partitioning``,
Linen ``with_partitioning`` / ``with_logical_partitioning`` + axis rules) are planning
constraints, checked first; the plan keeps them, plans the rest, and runs like the unsharded
step."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import shardplan as sp
from shardplan.planner.annotations import read_annotations

BATCH, FEATURES, HIDDEN = 16, 16, 32
CONFIG = sp.PlanConfig(respect_annotations=True, time_limit_s=10.0)


class MLP(nnx.Module):
    """Two Linear layers; kernels annotated FSDP x tensor parallel (``l1``) and row split
    (``l2``); biases left to the planner."""

    def __init__(self, rngs: nnx.Rngs, *, l1: tuple = ("data", "model"),
                 l2: tuple = ("model", None)) -> None:
        init = nnx.initializers.lecun_normal()
        self.l1 = nnx.Linear(FEATURES, HIDDEN, kernel_init=nnx.with_partitioning(init, l1),
                             rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, FEATURES, kernel_init=nnx.with_partitioning(init, l2),
                             rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(jax.nn.relu(self.l1(x)))  # [batch, features]


def _nnx_case(abstract: bool, **annotations):
    """(step, state, batch): the MLP with Adam, state and batch abstract or real."""

    def build():
        model = MLP(nnx.Rngs(0), **annotations)
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    # No mesh exists yet: the annotations stay metadata (flax would otherwise shard eagerly).
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(nnx.eval_shape(build) if abstract else build())

    def step(state, x):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - x) ** 2))(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    x = jax.random.normal(jax.random.key(1), (BATCH, FEATURES), jnp.float32)
    return step, state, jax.ShapeDtypeStruct(x.shape, x.dtype) if abstract else x


L1, L2 = (("data",), ("model",)), (("model",), ())
ANNOTATED = {f"{prefix}{layer}/kernel/value": spec
             for prefix in ("0/", "1/opt_state/0/mu/", "1/opt_state/0/nu/")
             for layer, spec in (("l1", L1), ("l2", L2))}
"""The kernels and their Adam moments (flax copies the metadata onto optimizer state)."""


@pytest.fixture(scope="module")
def nnx_plan():
    step, state, x = _nnx_case(abstract=True)
    return sp.make_plan(step, state, x, cluster=sp.Cluster.local(), config=CONFIG)


def test_annotations_read_the_same_off_real_and_abstract_nnx_states() -> None:
    _, abstract, _ = _nnx_case(abstract=True)
    _, real, _ = _nnx_case(abstract=False)
    assert read_annotations(abstract) == read_annotations(real) == ANNOTATED
    # Paths are the state's own (what make_plan keys param_specs by).
    paths = {jax.tree_util.keystr(p, simple=True, separator="/")
             for p, _ in jax.tree_util.tree_flatten_with_path(real)[0]}
    assert set(ANNOTATED) <= paths


def test_annotated_plan_keeps_the_annotations_on_the_users_mesh_axes(nnx_plan) -> None:
    (stage,) = nnx_plan.stages
    # The user's names, in order of first appearance, each axis given at least 2 devices.
    assert stage.mesh.axis_names == ("data", "model")
    assert sorted(stage.mesh.axis_sizes) == [2, 4]
    for path, spec in ANNOTATED.items():
        assert nnx_plan.param_specs[path] == (0, spec), path
    # The rest is planned: every unannotated leaf has a spec on the same mesh, and the solver
    # did place something the user left open (l1's bias follows its column split).
    assert nnx_plan.param_specs["0/l1/bias/value"] == (0, (("model",),))
    assert set(nnx_plan.param_specs) > set(ANNOTATED)
    assert sp.Plan.from_json(nnx_plan.to_json()) == nnx_plan
    assert "data" in nnx_plan.summary()


def test_annotated_plan_runs_like_the_unsharded_step_with_the_annotated_shardings(
        nnx_plan) -> None:
    step, state, x = _nnx_case(abstract=False)
    run = sp.apply_plan(step, nnx_plan, measure_steps=0)
    (compiled,) = run.compiled(state, x)
    state_shardings = compiled.input_shardings[0][0]
    leaves = jax.tree_util.tree_flatten_with_path(state_shardings)[0]
    got = {jax.tree_util.keystr(p, simple=True, separator="/"): s.spec for p, s in leaves}
    assert got["0/l1/kernel/value"] == P("data", "model")
    assert got["0/l2/kernel/value"] in (P("model", None), P("model"))
    assert {s.mesh.axis_names for _, s in leaves} == {("data", "model")}
    ref = got_state = state
    for _ in range(3):
        ref, ref_loss = jax.jit(step)(ref, x)
        got_state, loss = run(got_state, x)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-4, atol=1e-4)
    for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_explicit_partition_specs_are_honoured_also_where_they_replicate() -> None:
    # annotations= takes PartitionSpecs (what sp.auto passes for a stripped state). At this
    # size the planner alone replicates every kernel; the annotation splits l1's and pins
    # l2's replicated (P() is a full-rank None spec).
    step, state, x = _nnx_case(abstract=True)
    plan = sp.make_plan(step, state, x, cluster=sp.Cluster.local(), config=CONFIG,
                        annotations={"0/l1/kernel/value": P(None, "data"),
                                     "0/l2/kernel/value": P()})
    assert plan.stages[0].mesh.axis_names == ("data",)
    assert plan.stages[0].mesh.axis_sizes == (8,)
    for prefix in ("0/", "1/opt_state/0/mu/", "1/opt_state/0/nu/"):  # moments follow
        assert plan.param_specs[f"{prefix}l1/kernel/value"] == (0, ((), ("data",))), prefix
        assert plan.param_specs[f"{prefix}l2/kernel/value"] == (0, ((), ())), prefix


def test_tied_layers_with_different_annotations_are_planned_untied() -> None:
    # Layers 1 and 2 of this MLP have equal fingerprints, so tying period 1 would give their
    # kernels one ILP node; alternating annotations only allow period 2 (or none).
    from helpers.steps import mlp_step

    step, state, x = mlp_step(64, 16, layers=4)
    annotations = {f"0/{i}/kernel": (None, "model") if i % 2 == 0 else ("model", None)
                   for i in range(4)}
    plan = sp.make_plan(step, state, x, cluster=sp.Cluster.local(), config=CONFIG,
                        annotations=annotations)
    for path, spec in annotations.items():
        assert plan.param_specs[path][1] == tuple((a,) if a else () for a in spec), path


# ---------------------------------------------------------------------------- Linen


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.lecun_normal()
        x = nn.Dense(HIDDEN, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")),
                     name="up")(x)
        return nn.Dense(FEATURES, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")),
                        name="down")(nn.relu(x))


RULES = (("batch", "data"), ("embed", None), ("mlp", "model"))


def _linen_case():
    model = LinenMLP()

    def create():
        params = model.init(jax.random.key(0), jnp.ones((1, FEATURES)))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                             tx=optax.adam(1e-3))

    def step(state, x):
        def loss(params):
            return jnp.mean((state.apply_fn({"params": params}, x) - x) ** 2)

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), value

    return step, jax.eval_shape(create), jax.ShapeDtypeStruct((BATCH, FEATURES), jnp.float32)


def test_linen_logical_annotations_follow_the_axis_rules() -> None:
    step, state, x = _linen_case()
    config = sp.PlanConfig(respect_annotations=True, axis_rules=RULES, time_limit_s=10.0)
    plan = sp.make_plan(step, state, x, cluster=sp.Cluster.local(), config=config)
    (stage,) = plan.stages
    assert stage.mesh.axis_names == ("data", "model")  # the rules' mesh axes, in their order
    for prefix in ("params/", "opt_state/0/mu/", "opt_state/0/nu/"):
        assert plan.param_specs[f"{prefix}up/kernel/value"] == (0, ((), ("model",)))
        assert plan.param_specs[f"{prefix}down/kernel/value"] == (0, (("model",), ()))
    # The same annotations, read off the boxed params of an unboxed TrainState.
    boxed = LinenMLP().init(jax.random.key(0), jnp.ones((1, FEATURES)))["params"]
    assert read_annotations(boxed, rules=RULES, prefix="params") == {
        "params/up/kernel/value": ((), ("model",)), "params/down/kernel/value": (("model",), ())}


# ---------------------------------------------------------------------------- errors


def test_plan_config_takes_axis_rules_as_pairs_and_stays_hashable() -> None:
    json_rules: Any = [["mlp", "model"], ["x", None]]  # as json.loads gives them
    config = sp.PlanConfig(respect_annotations=True, axis_rules=json_rules)
    assert config.axis_rules == (("mlp", "model"), ("x", None))  # lists (JSON) become tuples
    assert hash(config) == hash(sp.PlanConfig(respect_annotations=True,
                                              axis_rules=(("mlp", "model"), ("x", None))))
    assert config.content_hash() != sp.PlanConfig(respect_annotations=True).content_hash()
    with pytest.raises(sp.ConfigError, match=r"PlanConfig\.axis_rules"):
        sp.PlanConfig(axis_rules=(("mlp", 3),))  # type: ignore[arg-type]  # on purpose


def test_annotations_without_respect_annotations_are_refused() -> None:
    step, state, x = _nnx_case(abstract=True)
    with pytest.raises(sp.ConfigError, match="respect_annotations is False"):
        sp.make_plan(step, state, x, cluster=sp.Cluster.local(),
                     annotations={"0/l2/kernel/value": ("model", None)})


def test_an_annotation_longer_than_the_leaf_rank_names_the_key_path() -> None:
    step, state, x = _nnx_case(abstract=True)
    with pytest.raises(sp.ConfigError, match=r"(?s)3 entries but the leaf has rank 2.*"
                                             r"0/l2/kernel/value"):
        sp.make_plan(step, state, x, cluster=sp.Cluster.local(), config=CONFIG,
                     annotations={"0/l2/kernel/value": ("model", None, None)})


@pytest.mark.parametrize(("annotations", "message"), [
    ({"0/l1/kernel/value": ("model", "model")}, r"(?s)axis 'model' twice.*0/l1/kernel/value"),
    ({"0/l9/kernel/value": ("model", None)},
     r"(?s)not a leaf of the state.*0/l9/kernel/value.*0/l1/kernel/value"),
])
def test_a_repeated_axis_or_an_unknown_key_path_names_the_key_path(annotations,
                                                                   message) -> None:
    step, state, x = _nnx_case(abstract=True)
    with pytest.raises(sp.ConfigError, match=message):
        sp.make_plan(step, state, x, cluster=sp.Cluster.local(), config=CONFIG,
                     annotations=annotations)


def test_an_annotation_no_mesh_divides_names_the_key_path_dimension_and_sizes() -> None:
    # On 6 devices the axes (data, model) are 2 x 3 or 3 x 2: together always 6, which does
    # not divide l1's 32 output features.
    step, state, x = _nnx_case(abstract=True)
    with pytest.raises(sp.ConfigError, match=r"(?s)Dimension 1 \(size 32\).*0/l1/kernel/value"
                                             r".*'sizes of the axes': \[6\]"):
        sp.make_plan(step, state, x, cluster=sp.Cluster.local(devices=jax.devices()[:6]),
                     config=CONFIG,
                     annotations={"0/l1/kernel/value": (None, ("data", "model")),
                                  "0/l2/kernel/value": ("model", None)})


def test_a_logical_name_without_a_rule_names_the_key_path_and_the_rules() -> None:
    step, state, x = _linen_case()
    config = sp.PlanConfig(respect_annotations=True, axis_rules=(("mlp", "model"),))
    with pytest.raises(sp.ConfigError, match=r"(?s)'embed' has no rule"
                       r".*params/down/kernel/value.*\('mlp', 'model'\)"):
        sp.make_plan(step, state, x, cluster=sp.Cluster.local(), config=config)


def test_annotations_on_a_multi_stage_plan_are_refused() -> None:
    step, state, x = _nnx_case(abstract=True)
    cluster = sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
    with pytest.raises(sp.ConfigError, match="one-mesh plans so far"):
        sp.make_plan(step, state, x, cluster=cluster, config=CONFIG)
