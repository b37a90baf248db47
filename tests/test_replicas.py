"""Plans of one-stage replicas (``shardplan.runtime.replicas``): data parallelism across
sub-meshes of different device types with uneven microbatch counts, equal to the unsharded
step (fp32, 3 steps, 1e-4)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import models
import shardplan as sp
from shardplan.errors import PipelineError
from shardplan.plan.plan import Layout, MeshSpec, ReplicaSpec, Stage

RTOL = ATOL = 1e-4


@pytest.fixture(scope="module")
def gpt():
    config = models.load_model_config("gpt-tiny")
    graphdef, state = models.init_train_state(config, seed=0)
    step = models.make_train_step(graphdef)
    batch = models.example_batch(config, 16, seed=0)
    cluster = sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
    plan = sp.make_plan(step, jax.eval_shape(lambda: state), jax.eval_shape(lambda: batch),
                        cluster=cluster, config=sp.PlanConfig(max_stages=1))
    return config, state, step, plan


def _three_steps(config, state, step, plan) -> None:
    run = sp.apply_plan(step, plan)
    ref = state
    for i in range(3):
        batch = models.example_batch(config, 16, seed=i)
        state, metrics = run(state, batch)
        ref, ref_metrics = jax.jit(step)(ref, batch)
        for x, y in zip(jax.tree.leaves((state, metrics)), jax.tree.leaves((ref, ref_metrics)),
                        strict=True):
            np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                       rtol=RTOL, atol=ATOL)


def test_the_planned_replicas_equal_the_unsharded_step(gpt) -> None:
    config, state, step, plan = gpt
    assert len(plan.replicas) > 1 and all(len(r.stages) == 1 for r in plan.replicas)
    _three_steps(config, state, step, plan)


def test_two_device_types_with_uneven_shares(gpt) -> None:
    # Replica 0: two A100s (devices 0, 1), the microbatch split over them ("inner" axis);
    # replica 1: one V100 (device 4). Microbatches of 4 samples, 3 against 1.
    config, state, step, plan = gpt
    first = plan.stages[0]
    layers = first.layers
    specs = plan.layouts[first.layout]
    replicated = {k: tuple(() for _ in v) for k, v in specs.param_specs.items()}
    split = {k: (("inner",), *tuple(() for _ in v[1:]))
             for k, v in specs.batch_specs.items()}
    layouts = {"a100-80g:inner=2": Layout(replicated, split),
               "v100-32g:inner=1": Layout(replicated, {k: tuple(() for _ in v)
                                                       for k, v in split.items()})}
    stages = (Stage(0, "a100-80g", MeshSpec(("inner",), (2,), (0, 1)), layers, "none", 0,
                    "a100-80g:inner=2"),
              Stage(1, "v100-32g", MeshSpec(("inner",), (1,), (4,)), layers, "none", 1,
                    "v100-32g:inner=1"))
    predicted = dataclasses.replace(plan.predicted, memory_bytes={0: 1, 1: 1, 4: 1})
    mixed = dataclasses.replace(
        plan, stages=stages, layouts=layouts, microbatch_size=4, microbatches=4,
        replicas=(ReplicaSpec((0,), 3), ReplicaSpec((1,), 1)), predicted=predicted)
    _three_steps(config, state, step, mixed)


def test_replicas_of_several_stages_are_refused_by_name(gpt) -> None:
    _, _, step, plan = gpt
    stages = tuple(dataclasses.replace(s, replica=0) for s in plan.stages[:2])
    predicted = dataclasses.replace(
        plan.predicted, memory_bytes={d: 1 for s in stages for d in s.mesh.device_ids})
    piped = dataclasses.replace(plan, stages=stages, replicas=(ReplicaSpec((0, 1), 16),),
                                microbatches=16, predicted=predicted)
    with pytest.raises(PipelineError, match="pipeline executor"):
        sp.apply_plan(step, piped)
