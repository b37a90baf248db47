"""Multi-stage and microbatched plans (``shardplan.runtime.pipeline``): one-stage replicas
across device types with uneven microbatch counts, pipelines of 2 and 4 stages under GPipe and
1F1B, each equal to the unsharded step (fp32, 3 steps, 1e-4)."""

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


def _planned(name: str):
    """A tiny model, its step and its one-stage-replica plan on 4 A100 + 4 V100 (local)."""
    config = models.load_model_config(name)
    graphdef, state = models.init_train_state(config, seed=0)
    step = models.make_train_step(graphdef)
    batch = models.example_batch(config, 16, seed=0)
    cluster = sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
    plan = sp.make_plan(step, jax.eval_shape(lambda: state), jax.eval_shape(lambda: batch),
                        cluster=cluster, config=sp.PlanConfig(max_stages=1))
    return config, state, step, plan


@pytest.fixture(scope="module")
def gpt():
    return _planned("gpt-tiny")


def _three_steps(config, state, step, plan):
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
    return run


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


def _pipeline(plan, groups, microbatch_size: int, counts, schedule: str = "1f1b"):
    """``plan`` rewritten as replicas of stages: ``groups`` per replica, a list of
    (device type, device ids, layer names) per stage; replicated layouts, the microbatch split
    over a stage's devices."""
    first = plan.stages[0]
    specs = plan.layouts[first.layout]
    replicated = {k: tuple(() for _ in v) for k, v in specs.param_specs.items()}
    stages, replicas, layouts, memory = [], [], {}, {}
    for r, (group, count) in enumerate(zip(groups, counts, strict=True)):
        indices = []
        for device_type, ids, layers in group:
            name = f"{device_type}:inner={len(ids)}"
            layouts[name] = Layout(replicated, {
                k: (("inner",), *tuple(() for _ in v[1:])) if microbatch_size % len(ids) == 0
                else tuple(() for _ in v) for k, v in specs.batch_specs.items()})
            indices.append(len(stages))
            stages.append(Stage(len(stages), device_type, MeshSpec(("inner",), (len(ids),),
                                                                    tuple(ids)),
                                (*layers, "shared"), "none", r, name))
            memory.update({d: 1 for d in ids})
        replicas.append(ReplicaSpec(tuple(indices), count))
    return dataclasses.replace(
        plan, stages=tuple(stages), layouts=layouts, microbatch_size=microbatch_size,
        microbatches=sum(counts), replicas=tuple(replicas), schedule=schedule, chunks=1,
        predicted=dataclasses.replace(plan.predicted, memory_bytes=memory))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages(gpt, schedule: str) -> None:
    config, state, step, plan = gpt
    piped = _pipeline(plan, [[("a100-80g", (0, 1), ("pre", "blocks.0")),
                              ("v100-32g", (4, 5), ("blocks.1", "post"))]], 4, [4], schedule)
    _three_steps(config, state, step, piped)


@pytest.mark.parametrize(("schedule", "bound"), [("1f1b", [4, 3, 2, 1]), ("gpipe", [8] * 4)])
def test_four_stages_with_eight_microbatches(gpt, schedule: str, bound: list[int]) -> None:
    # Eight programs (F and B per stage), each on its own device; 1F1B keeps at most k - p
    # microbatches of activations alive on stage p, GPipe all of them.
    config, state, step, plan = gpt
    piped = _pipeline(plan, [[("a100-80g", (0,), ("pre",)), ("a100-80g", (1,), ("blocks.0",)),
                              ("v100-32g", (4,), ("blocks.1",)), ("v100-32g", (5,), ("post",))]],
                      2, [8], schedule)
    run = _three_steps(config, state, step, piped)
    tasks = run._ready[2][0]
    assert [(t.order, t.stage) for t in tasks] == [(o, o if o < 4 else 7 - o) for o in range(8)]
    peaks = [run.peak_microbatches[i] for i in range(4)]
    assert peaks[:3] == bound[:3] and peaks[3] <= bound[3]


def test_two_replicas_of_two_stages_with_uneven_shares(gpt) -> None:
    config, state, step, plan = gpt
    piped = _pipeline(plan, [[("a100-80g", (0, 1), ("pre", "blocks.0")),
                              ("a100-80g", (2, 3), ("blocks.1", "post"))],
                             [("v100-32g", (4,), ("pre", "blocks.0", "blocks.1")),
                              ("v100-32g", (5,), ("post",))]], 2, [5, 3])
    _three_steps(config, state, step, piped)


def test_interleaved_plans_are_refused_by_name(gpt) -> None:
    _, _, step, plan = gpt
    piped = _pipeline(plan, [[("a100-80g", (0,), ("pre", "blocks.0")),
                              ("a100-80g", (1,), ("blocks.1", "post"))]], 4, [4])
    piped = dataclasses.replace(piped, schedule="interleaved", chunks=2)
    with pytest.raises(PipelineError, match="Interleaved"):
        sp.apply_plan(step, piped)


def test_a_scanned_stack_split_across_stages_is_refused_by_name() -> None:
    config, state, step, plan = _planned("gpt-tiny-scan")
    batch = models.example_batch(config, 16, seed=0)
    names = [n for n in plan.stages[0].layers if n != "shared"]
    cut = names.index("blocks.1")
    piped = _pipeline(plan, [[("a100-80g", (0,), tuple(names[:cut])),
                              ("a100-80g", (1,), tuple(names[cut:]))]], 4, [4])
    with pytest.raises(PipelineError, match="layers of several stages"):
        sp.apply_plan(step, piped)(state, batch)
