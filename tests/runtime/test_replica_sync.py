"""Data-parallel replicas of a pipeline synchronise as the stage planner prices them.

Identical replicas (same stages, device type, sub-mesh and microbatch count) run as one: each
stage's programs over the members' sub-meshes stacked along a leading ``replica`` mesh axis,
each member's devices on their own microbatches, the gradient sums all-reduced once per step
inside the stage's ``sync`` program, and every member updating its own copy of the stage's
layers (runtime/pipeline.py, "Data parallelism").
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import shardplan_models as models
from helpers.pipelines import (
    budget_planned,
    layer_param_bytes,
    priced_exchange,
    staged_plan,
    three_steps_match,
)

import shardplan as sp
from shardplan.solver.stages.pipeline import equal_classes


def _llama():
    config = models.load_model_config("llama-tiny", overrides={"n_layers": 2})
    graphdef, state = models.init_train_state(config, seed=0)
    return config, state, models.make_train_step(graphdef)




@pytest.mark.parametrize("replicas", [2, 4])
def test_identical_replicas_run_as_one_program_per_stage(replicas: int) -> None:
    # `replicas` copies of a 2-stage Llama on 8 A100s, one per stage: every stage's programs run
    # once over the members' devices; its gradient sums are all-reduced once per step (the
    # sync program's all-reduce carries the stage's parameter bytes: the gradients, plus the
    # loss), the transfers between sub-meshes carry only the boundary activations, their
    # cotangents and the batch, and each member's devices hold their own stage's state.
    config, state, step = _llama()
    plan = sp.make_plan(step, jax.eval_shape(lambda: state),
                        jax.eval_shape(lambda: models.example_batch(config, 16, seed=0)),
                        cluster=sp.Cluster.local(types={"a100-80g": 8}),
                        config=sp.PlanConfig(max_stages=1))  # its specs, for staged_plan
    groups = [[("a100-80g", (2 * r,), ("pre", "blocks.0")),
               ("a100-80g", (2 * r + 1,), ("blocks.1", "post"))] for r in range(replicas)]
    piped = staged_plan(plan, groups, 2, [8 // replicas] * replicas)
    run = three_steps_match(config, state, step, piped)
    assert run._groups == [list(range(replicas))]
    programs = run.plan.compiled["programs"]
    for stage, layers in ((0, ("pre", "blocks.0")), (1, ("blocks.1", "post"))):
        (sync,) = [p for p in programs if p["stage"] == stage and p["name"].startswith("sync")]
        reduced = sync["collectives"]["all-reduce"]
        assert reduced["count"] == 1
        grads = layer_param_bytes(state, layers)
        assert grads <= reduced["bytes"] <= 1.01 * grads, (stage, reduced, grads)
        # no other program of the stage communicates: the members run their own microbatches
        assert all(not p["collectives"] for p in programs
                   if p["stage"] == stage and p is not sync and "same_as" not in p)
        # listed for every member stage (the same program), counted once in totals
        members = [p for p in programs if p.get("same_as") == stage and p["name"] == sync["name"]]
        assert len(members) == replicas - 1
    batch = models.example_batch(config, 16, seed=0)
    sample = {k: v.nbytes // 16 for k, v in batch.items()}
    boundary = config.max_seq_len * config.d_model * 4  # one sample's activation, fp32
    # 16 samples cross the cut forward and back; the batch goes to both stages
    expected, batch_bytes = 16 * 2 * boundary, 2 * 16 * sum(sample.values())
    moved = run.plan.measured["moved_bytes"]
    assert 0.9 * expected <= moved <= 1.1 * expected, (moved, expected)
    # (the batch is made on device 0, which holds its own share already: member 0's of stage 0)
    assert run.plan.measured["batch_bytes"] == batch_bytes - 16 // replicas * sum(sample.values())
    live = run.plan.measured["live_bytes"]
    # every member's devices hold their stage's parameters and two Adam moments (device 0,
    # the default device, also holds other tests' arrays: left out)
    for first, layers in ((0, ("pre", "blocks.0")), (1, ("blocks.1", "post"))):
        resident = 3 * layer_param_bytes(state, layers)
        for d in range(first, 2 * replicas, 2):
            if d:
                held = int(live[str(d)])
                assert 0.95 * resident <= held <= 1.1 * resident, (d, held, resident)


@pytest.mark.parametrize("name", ["llama-tiny", "gpt-tiny"])
def test_the_planners_replicas_all_reduce_what_it_priced(name: str) -> None:
    # The planner's own plan for a 4-block model on 4 A100 + 4 V100 under 60 % of its
    # one-stage peak: two identical replicas of two A100 stages. Each stage's sync all-reduces
    # the gradient bytes the planner priced (plan.solver["sync_bytes"]) within 1 %, the
    # transfers between stages carry what it priced within 10 % (plan.solver[
    # "transfer_bytes"]: the boundary activations and their gradients; for GPT, whose head
    # reads the token embedding, also the embedding crossing to the head's stage each step
    # and its gradient term coming back), and each replica's devices keep their own stage's
    # state (live bytes as predicted, within 10 %).
    config, state, step, plan, _ = budget_planned(name, 16, 0.6)
    assert len(plan.replicas) == 2
    run = three_steps_match(config, state, step, plan)
    assert len(run._groups) == 1
    priced = run.plan.solver["sync_bytes"]
    for p in run.plan.compiled["programs"]:
        if p["name"].startswith("sync") and "same_as" not in p:
            got = p["collectives"]["all-reduce"]["bytes"]
            assert np.isclose(got, priced[str(p["stage"])], rtol=0.01), (p["stage"], got, priced)
    # what the stages sent each other is what the planner priced (boundary activations and
    # their gradients), and the report shows it next to the priced and compiled all-reduce
    priced, moved = run.plan.solver["transfer_bytes"], run.plan.measured["moved_bytes"]
    assert 0.9 * priced <= moved <= 1.1 * priced, (moved, priced)
    report = run.plan.report()
    assert "stage 0 (a100-80g x1) sync" in report and "moved between stages" in report
    live = run.plan.measured["live_bytes"]
    for st in run.plan.stages:
        resident = run.plan.solver["resident_bytes"][str(st.index)]
        for d in st.mesh.device_ids:
            if d:  # (device 0 also holds other tests' arrays)
                assert 0.9 * resident <= int(live[str(d)]) <= 1.1 * resident, (d, resident)




def _llama4():
    config = models.load_model_config("llama-tiny", overrides={"n_layers": 4})
    graphdef, state = models.init_train_state(config, seed=0)
    return config, state, models.make_train_step(graphdef)


def _exchanged(groups, counts, sharded=False):
    """Three steps of the hand-made plan ``groups`` (per replica, its stages as (device type,
    device ids, layer names); microbatches of one sample, ``counts`` per replica) of a
    4-block Llama on 4 A100 + 4 V100, checked against the unsharded step, and what the
    gradient exchange brought each stage against what the planner's model prices for the
    plan (within 10 %: the loss and the chunks' padding apart)."""
    config, state, step = _llama4()
    cluster = sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
    batch = models.example_batch(config, 16, seed=0)
    plan = sp.make_plan(step, jax.eval_shape(lambda: state), jax.eval_shape(lambda: batch),
                        cluster=cluster, config=sp.PlanConfig(max_stages=1))
    def split_last(_, n):  # a 2-D leaf's last dimension over the stage's devices
        return (*(() for _ in range(n - 1)), ("inner",)) if n == 2 else ((),) * n

    piped = staged_plan(plan, groups, 1, counts, param_spec=split_last if sharded else None)
    run = three_steps_match(config, state, step, piped)
    priced = priced_exchange(step, state, batch, cluster, groups, counts, 1)
    measured = run.plan.measured["sync_moved_bytes"]
    index = {(r, i): s for r, rep in enumerate(run.plan.replicas)
             for i, s in enumerate(rep.stages)}
    for key, bytes_ in priced.items():
        got = measured[str(index[key])]
        assert 0.9 * bytes_ <= got <= 1.1 * bytes_, (key, got, bytes_)
    assert len(measured) == len(priced)
    return config, state, run


@pytest.mark.parametrize("sharded", [False, True])
def test_replicas_that_differ_exchange_what_the_planner_prices(sharded: bool) -> None:
    # An A100 replica (two stages of two devices) and a V100 replica (two of one) cutting a
    # 4-block Llama at different layers, 10 and 6 microbatches. No parameter server: each
    # replica's devices hold and update their own stage's state, the sums meet in a
    # reduce-scatter and all-gather between the replicas' stages (runtime/exchange.py), and
    # what that brings each stage is what the planner prices for the plan (within 10 %; the
    # loss and the chunks' padding apart). ``sharded``: the 2-D parameters split on their
    # last dimension over each stage's devices (flattening them is a relayout in the stage).
    groups = [[("a100-80g", (0, 1), ("pre", "blocks.0")),
               ("a100-80g", (2, 3), ("blocks.1", "blocks.2", "blocks.3", "post"))],
              [("v100-32g", (4,), ("pre", "blocks.0", "blocks.1", "blocks.2")),
               ("v100-32g", (5,), ("blocks.3", "post"))]]
    config, state, run = _exchanged(groups, [10, 6], sharded)
    assert len(run._groups) == 2  # they differ: two parties, no merge
    # the V100 replica's own copy equals the returned (A100) one: bit for bit where both
    # update programs reduce alike; with the parameters split on the A100 stages, the global
    # gradient norm's sum of squares is added in another order there (a rounding in the
    # clip factor: 1.9e-9 at most, measured)
    for mine, theirs in zip(run._kept[1][0], run._returned, strict=True):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(theirs),
                                   rtol=1e-6 if sharded else 0, atol=1e-8 if sharded else 0)
    # the transfers between stages are the boundary activations and their cotangents only:
    # no gradient sums or parameters cross between the replicas outside the exchange (a
    # microbatch of one sample runs whole on both devices of an A100 stage: both receive it)
    boundary = config.max_seq_len * config.d_model * 4  # one sample's activation, fp32
    expected = (10 * 2 + 6) * 2 * boundary
    moved = run.plan.measured["moved_bytes"]
    assert 0.9 * expected <= moved <= 1.1 * expected, (moved, expected)
    # every device holds its own stage's parameters and Adam moments, nothing of the other
    # replica's (device 0, the default device, also holds other tests' arrays: left out)
    live = run.plan.measured["live_bytes"]
    for _, ids, layers in (s for g in groups for s in g):
        resident = 3 * layer_param_bytes(state, layers) // (len(ids) if sharded else 1)
        for d in ids:
            if d:
                held = int(live[str(d)])
                assert 0.9 * resident <= held <= 1.15 * resident, (d, held, resident)
    report = run.plan.report()
    assert "exchange" in report


def test_identical_replicas_beside_others_that_differ() -> None:
    # Two identical A100 replicas and two identical V100 replicas cutting the model elsewhere:
    # two classes of two (each one party: its stages all-reduce inside their sync programs);
    # the parties exchange their sums, each stage receiving what the planner prices.
    a100 = [[("a100-80g", (2 * r,), ("pre", "blocks.0")),
             ("a100-80g", (2 * r + 1,), ("blocks.1", "blocks.2", "blocks.3", "post"))]
            for r in range(2)]
    v100 = [[("v100-32g", (4 + 2 * r,), ("pre", "blocks.0", "blocks.1", "blocks.2")),
             ("v100-32g", (5 + 2 * r,), ("blocks.3", "post"))] for r in range(2)]
    _, _, run = _exchanged([*a100, *v100], [5, 5, 3, 3])
    assert run._groups == [[0, 1], [2, 3]]
    assert {p["stage"] for p in run.plan.compiled["programs"]
            if p["name"].startswith("sync")} >= {0, 1, 4, 5}


def test_classes_of_unequal_size_are_cut_to_one_size() -> None:
    # Two identical A100 replicas beside one V100 replica: merged, the A100s' all-reduce and
    # then the exchange (whose slowest devices, the V100's, receive all their bytes) would
    # take longer than the ring the planner prices; the runtime and the planner's model
    # (replica_classes) cut the classes to one size, here three parties, and the exchange
    # brings each stage what was priced.
    a100 = [[("a100-80g", (2 * r,), ("pre", "blocks.0")),
             ("a100-80g", (2 * r + 1,), ("blocks.1", "blocks.2", "blocks.3", "post"))]
            for r in range(2)]
    v100 = [("v100-32g", (4,), ("pre", "blocks.0", "blocks.1", "blocks.2")),
            ("v100-32g", (5,), ("blocks.3", "post"))]
    _, _, run = _exchanged([*a100, v100], [5, 5, 6])
    assert run._groups == [[0], [1], [2]]
    assert equal_classes([[0, 1, 4, 5], [2, 3], [6]]) == [[0], [1], [2], [3], [4], [5], [6]]
    assert equal_classes([[0, 2, 4, 6], [1, 3], [5, 7]]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
