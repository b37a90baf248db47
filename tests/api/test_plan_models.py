"""make_plan -> apply_plan on the reference models: exact numerics, predicted collectives.

The tiny GPT, Llama and MoE train steps are planned for a described DGX A100 node (NVLink inside,
A100 figures) bound to the 8 local CPU devices, run for 3 steps against the unsharded step
(fp32, rtol = atol = 1e-4), and the compiled program's collective bytes per kind are held to
the plan's prediction (1 %). The runtime pins the plan's shardings on every addressable
equation, so the partitioner has no choice left that the prediction does not know about.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import shardplan_models as models

import shardplan as sp
from shardplan.xla import read_compiled

BATCH = 64


@pytest.fixture(scope="module", params=["gpt-tiny", "llama-tiny", "moe-tiny"])
def planned(request):
    config = models.load_model_config(request.param)
    graphdef, state = models.init_train_state(config, seed=0)
    batch = models.example_batch(config, BATCH)
    step = models.make_train_step(graphdef)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (state, batch))
    cluster = sp.Cluster.from_yaml("configs/clusters/dgx-a100.yaml", devices=jax.devices())
    plan = sp.make_plan(step, *abstract, cluster=cluster)
    return request.param, step, state, batch, plan


def test_planned_model_step_equals_the_unsharded_step_for_three_steps(planned) -> None:
    name, step, state, batch, plan = planned
    run = sp.apply_plan(step, plan)
    ref, got = state, state
    for _ in range(3):
        ref, ref_metrics = jax.jit(step)(ref, batch)
        got, metrics = run(got, batch)
        np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-4, atol=1e-4,
                                   err_msg=name)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)
    # The compiled program moves what the plan predicts, kind by kind.
    compiled = read_compiled(run.compiled(got, batch)[0]).collective_summary()
    predicted = {kind: entry["bytes"] for kind, entry in plan.predicted.collectives.items()
                 if entry["bytes"]}
    assert set(compiled) == set(predicted), (name, compiled, predicted)
    for kind, entry in compiled.items():
        assert entry["bytes"] == pytest.approx(predicted[kind], rel=0.01), (name, kind)
    assert plan.constraints  # the plan pins intermediate values, not only the arguments
    # Verified before the first step: XLA's per-device memory within 10 % of the prediction,
    # as plan.report() shows it.
    (program,) = run.plan.compiled["programs"]
    predicted_memory = max(plan.predicted.memory_bytes.values())
    assert program["memory_bytes"] == pytest.approx(predicted_memory, rel=0.10), name
    row = next(line for line in run.plan.report().splitlines()
               if line.startswith("  stage 0") and "iB" in line)
    assert 0.9 <= float(row.split()[-1]) <= 1.1, (name, row)
