"""Evaluation through the plan (``PipelinedStep.evaluator``): a forward pass cut by the plan's
stages, run per microbatch on the stages' devices, reading the state where the step keeps it;
nothing gathered onto one device."""

from __future__ import annotations

import jax
import numpy as np
import shardplan_models as models
from helpers.pipelines import layer_param_bytes, staged_plan

import shardplan as sp
from shardplan.train.loop import _eval_metrics, _forward

QUARTERS = [("a100-80g", (0,), ("pre", "blocks.0")), ("a100-80g", (1,), ("blocks.1",)),
            ("a100-80g", (2,), ("blocks.2",)), ("a100-80g", (3,), ("blocks.3", "post"))]


def test_an_evaluation_runs_on_the_stages_holding_a_quarter_of_the_model_each() -> None:
    # A 4-block Llama cut into four stages of one block each (the first with the embedding,
    # the last with the head): after a training step, its validation loss through the plan
    # equals the unsharded forward's within 1e-5, every stage runs its own part of the
    # forward, and no device holds more than its stage's state (parameters and Adam moments)
    # and one microbatch's values: beside each evaluation program the driver keeps the state
    # and nothing else, and the program itself holds the stage's parameters and one
    # microbatch's activations (below the training's own peak on that stage).
    config = models.load_model_config("llama-tiny", overrides={"n_layers": 4})
    graphdef, state = models.init_train_state(config, seed=0)
    step = models.make_train_step(graphdef)
    batch = models.example_batch(config, 16, seed=0)
    cluster = sp.Cluster.local(types={"a100-80g": 8})
    one = sp.make_plan(step, jax.eval_shape(lambda: state), jax.eval_shape(lambda: batch),
                       cluster=cluster, config=sp.PlanConfig(max_stages=1))
    plan = staged_plan(one, [QUARTERS], 4, [4])
    run = sp.apply_plan(step, plan, measure_steps=0)
    reference = jax.jit(step)(state, batch)[0]
    state, _ = run(state, batch)
    metrics = _eval_metrics(_forward(graphdef))
    evaluate = run.evaluator(metrics)
    val = models.example_batch(config, 16, seed=7)
    got = evaluate(state, val)
    want = jax.jit(metrics)(reference, val)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5, atol=1e-5)
    # a second evaluation reuses the compiled programs and gives the same bits
    assert float(evaluate(state, val)["loss"]) == float(got["loss"])
    programs = evaluate.plan.compiled["programs"]
    assert {p["stage"] for p in programs} == {0, 1, 2, 3}
    trained = {p["stage"]: p for p in run.plan.compiled["programs"]
               if p["name"].startswith("replica")}
    for p in programs:
        layers = QUARTERS[p["stage"]][2]
        state_bytes = 3 * layer_param_bytes(state, layers)  # parameters and two Adam moments
        assert p["beside_bytes"] <= 1.02 * state_bytes, (p["stage"], p["beside_bytes"])
        assert p["memory_bytes"] < trained[p["stage"]]["memory_bytes"], p
    # the state on the last stage is still the training's: nothing was copied or gathered
    ids = {d.id for x in jax.tree.leaves(state) for d in x.sharding.device_set}
    assert ids == {0, 1, 2, 3}


def test_an_evaluation_of_a_scanned_stack_held_in_rows_per_stage() -> None:
    # gpt-tiny-scan's four blocks are one nnx.scan; cut into quarters, each stage holds its
    # rows of the stacked parameters. The evaluation's last program returns metrics, not the
    # state: it must not cut them into the state's rows (it did: an IndexError in `shardplan
    # train` at the first validation of a scanned model's pipeline). Its loss equals the
    # unsharded forward's.
    config = models.load_model_config("gpt-tiny-scan", overrides={"n_layers": 4})
    graphdef, state = models.init_train_state(config, seed=0)
    step = models.make_train_step(graphdef)
    batch = models.example_batch(config, 16, seed=0)
    one = sp.make_plan(step, jax.eval_shape(lambda: state), jax.eval_shape(lambda: batch),
                       cluster=sp.Cluster.local(types={"a100-80g": 8}),
                       config=sp.PlanConfig(max_stages=1))
    run = sp.apply_plan(step, staged_plan(one, [QUARTERS], 4, [4]), measure_steps=0)
    reference = jax.jit(step)(state, batch)[0]
    state, _ = run(state, batch)
    assert run._ready.rows.runs, "the stacked leaves are held in rows per stage"
    metrics = _eval_metrics(_forward(graphdef))
    val = models.example_batch(config, 16, seed=7)
    got = run.evaluator(metrics)(state, val)
    want = jax.jit(metrics)(reference, val)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5, atol=1e-5)


def _gpt_planned(**options):
    """gpt-tiny, its step, a batch of 16 and its plan on 8 A100s (local) under ``options``."""
    config = models.load_model_config("gpt-tiny")
    graphdef, state = models.init_train_state(config, seed=0)
    step = models.make_train_step(graphdef)
    batch = models.example_batch(config, 16, seed=0)
    plan = sp.make_plan(step, jax.eval_shape(lambda: state), jax.eval_shape(lambda: batch),
                        cluster=sp.Cluster.local(types={"a100-80g": 8}),
                        config=sp.PlanConfig(max_stages=1, **options))
    return config, graphdef, state, step, batch, plan


def test_a_one_stage_plan_evaluates_on_its_layout() -> None:
    # The SPMD path: the evaluation runs as one program on the plan's mesh, the state where
    # the step left it (split over the mesh as planned).
    config, graphdef, state, step, batch, plan = _gpt_planned(pipeline=False)
    run = sp.apply_plan(step, plan, measure_steps=0)
    reference = jax.jit(step)(state, batch)[0]
    state, _ = run(state, batch)
    metrics = _eval_metrics(_forward(graphdef))
    val = models.example_batch(config, 16, seed=7)
    got = run.evaluator(metrics)(state, val)
    assert {d.id for d in got["loss"].sharding.device_set} == set(range(8))
    want = jax.jit(metrics)(reference, val)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5, atol=1e-5)


def test_sampling_a_pipelined_model_that_fits_no_one_type_is_refused_before_placing() -> None:
    # Sampling runs on the plan's devices of one type with the parameters split over them;
    # where they would hold more than the plan's budget per device, it says so, with the
    # bytes and the option that skips the sample, before anything is placed.
    import dataclasses

    import pytest

    from shardplan.errors import InfeasibleError
    from shardplan.train.loop import _sampler_state

    config, graphdef, state, _, _, one = _gpt_planned()
    plan = staged_plan(one, [[("a100-80g", (0,), ("pre", "blocks.0")),
                            ("a100-80g", (1,), ("blocks.1", "post"))]], 4, [4])
    said: list[str] = []
    placed, _ = _sampler_state(_forward(graphdef), state, plan, config.max_seq_len, said.append)
    assert said and "2 a100-80g devices [0, 1]" in said[0]
    assert {d.id for x in placed for d in x.sharding.device_set} == {0, 1}
    tight = dataclasses.replace(plan, solver={**plan.solver,
                                              "memory_budget_bytes": {"a100-80g": 1000}})
    with pytest.raises(InfeasibleError, match=r"train\.sample_tokens=0") as caught:
        _sampler_state(_forward(graphdef), state, tight, config.max_seq_len, said.append)
    assert "sampling on 2 a100-80g devices" in str(caught.value)
