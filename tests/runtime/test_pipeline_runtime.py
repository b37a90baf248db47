"""Multi-stage and microbatched plans (``shardplan.runtime.pipeline``): one-stage replicas
across device types with uneven microbatch counts, pipelines of 2 and 4 stages under GPipe and
1F1B, each equal to the unsharded step (fp32, 3 steps, 1e-4)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import shardplan_models as models
from helpers.pipelines import (
    ATOL,
    RTOL,
    budget_planned,
    one_stage_plan_of,
    planned_tiny,
    staged_plan,
    three_steps_match,
)

import shardplan as sp
from shardplan.errors import PipelineError, ShardplanWarning
from shardplan.plan.plan import Layout, MeshSpec, ReplicaSpec, Stage
from shardplan.runtime import constrain
from shardplan.runtime.pipeline import PipelinedStep


@pytest.fixture(scope="module")
def gpt():
    return planned_tiny("gpt-tiny")




def test_the_planned_replicas_equal_the_unsharded_step(gpt) -> None:
    config, state, step, plan = gpt
    assert len(plan.replicas) > 1 and all(len(r.stages) == 1 for r in plan.replicas)
    three_steps_match(config, state, step, plan)


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
        replicas=(ReplicaSpec((0,), 3), ReplicaSpec((1,), 1)), predicted=predicted,
        solver={k: v for k, v in plan.solver.items() if k != "memory_budget_bytes"})
    three_steps_match(config, state, step, mixed)




@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages(gpt, schedule: str) -> None:
    config, state, step, plan = gpt
    piped = staged_plan(plan, [[("a100-80g", (0, 1), ("pre", "blocks.0")),
                              ("v100-32g", (4, 5), ("blocks.1", "post"))]], 4, [4], schedule)
    run = three_steps_match(config, state, step, piped)
    # Verified before running: every program compiled, per stage, with XLA's figures; and
    # measured: the median step, and each stage's busy time in the clocked step.
    compiled = run.plan.compiled["programs"]
    assert {p["stage"] for p in compiled} == {0, 1}
    assert all(p["memory_bytes"] > 0 and p["flops"] > 0 for p in compiled)
    assert {p["name"] for p in compiled} >= {"replica 0 task 0", "replica 0 task 3"}
    assert run.plan.measured["steps"] == 1 and run.plan.measured["step_time_s"] > 0
    assert set(run.plan.measured["stage_time_s"]) == {"0", "1"}
    report = run.plan.report()
    assert "stage 1 (v100-32g x2) busy" in report and max(map(len, report.splitlines())) <= 100
    assert run.plan == piped  # what a run records is not part of the plan's identity


def _remat_run(gpt, remat: str):
    config, state, step, plan = gpt
    piped = staged_plan(plan, [[("a100-80g", (0,), ("pre", "blocks.0")),
                              ("v100-32g", (4,), ("blocks.1", "post"))]], 4, [4])
    piped = dataclasses.replace(piped, stages=tuple(
        dataclasses.replace(st, remat=remat) for st in piped.stages))
    run = three_steps_match(config, state, step, piped)
    return config, {p["name"]: p for p in run.plan.compiled["programs"] if p["stage"] == 0}


def test_each_remat_policy_runs_as_planned(gpt) -> None:
    # The plan's remat policy decides what a stage's forward hands its backward: everything
    # the backward reads (none), all but the attention core, which the backward recomputes
    # (selective), or only the stage's input, the whole forward recomputed (full). Stage 0
    # (the embedding and block 0) hands stage 1 the residual stream [4, seq, d] in each case.
    runs = {remat: _remat_run(gpt, remat) for remat in ("none", "selective", "full")}
    config = runs["full"][0]
    seq = models.example_batch(config, 1, seed=0)["inputs"].shape[1]
    boundary = 4 * seq * config.d_model * 4
    forward = {r: progs["replica 0 task 0"]["output_bytes"] for r, (_, progs) in runs.items()}
    backward = {r: progs["replica 0 task 3"]["flops"] for r, (_, progs) in runs.items()}
    assert forward["full"] == boundary < forward["selective"] < forward["none"]
    assert backward["none"] < backward["selective"] < backward["full"]
    # The update's levels before the last pass on only scalars (the global norm's partial
    # sums, the step counter): every parameter-sized value is computed in the last level.
    for _, progs in runs.values():
        levels = {int(n.split()[1]): p for n, p in progs.items() if n.startswith("update")}
        assert all(levels[k]["output_bytes"] <= 64 for k in levels if k < max(levels))
        # What the device held beside each program: at least block 0's Adam moments, which
        # no gradient task reads.
        moments = sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(gpt[1])
                      if any(f"['{m}']['blocks'][0]" in jax.tree_util.keystr(path)
                             for m in ("mu", "nu")))
        assert progs["replica 0 task 3"]["beside_bytes"] >= moments > 0


@pytest.mark.parametrize(("schedule", "bound"), [("1f1b", [4, 3, 2, 1]), ("gpipe", [8] * 4)])
def test_four_stages_with_eight_microbatches(gpt, schedule: str, bound: list[int]) -> None:
    # Eight programs (F and B per stage), each on its own device; 1F1B keeps at most k - p
    # microbatches of activations alive on stage p, GPipe all of them.
    config, state, step, plan = gpt
    piped = staged_plan(plan, [[("a100-80g", (0,), ("pre",)), ("a100-80g", (1,), ("blocks.0",)),
                              ("v100-32g", (4,), ("blocks.1",)), ("v100-32g", (5,), ("post",))]],
                      2, [8], schedule)
    run = three_steps_match(config, state, step, piped)
    tasks = run._ready.tasks[0]
    assert [(t.key, t.stage) for t in tasks] == [(o, o if o < 4 else 7 - o) for o in range(8)]
    peaks = [run.peak_microbatches[i] for i in range(4)]
    assert peaks[:3] == bound[:3] and peaks[3] <= bound[3]


def test_two_replicas_of_two_stages_with_uneven_shares(gpt) -> None:
    config, state, step, plan = gpt
    piped = staged_plan(plan, [[("a100-80g", (0, 1), ("pre", "blocks.0")),
                              ("a100-80g", (2, 3), ("blocks.1", "post"))],
                             [("v100-32g", (4,), ("pre", "blocks.0", "blocks.1")),
                              ("v100-32g", (5,), ("post",))]], 2, [5, 3])
    three_steps_match(config, state, step, piped)


def test_interleaved_two_chunks_per_stage(gpt) -> None:
    # Stage 0 runs "pre" and "blocks.1" (virtual stages 0 and 2), stage 1 "blocks.0" and "post".
    config, state, step, plan = gpt
    piped = staged_plan(plan, [[("a100-80g", (0, 1), ("pre", "blocks.1")),
                              ("v100-32g", (4, 5), ("blocks.0", "post"))]], 2, [8])
    piped = dataclasses.replace(piped, schedule="interleaved", chunks=2)
    run = three_steps_match(config, state, step, piped)
    assert [(t.key, t.stage) for t in run._ready.tasks[0]] == [
        (0, 0), (1, 1), (2, 0), (3, 1), (4, 1), (5, 0), (6, 1), (7, 0)]


def test_stages_out_of_layer_order_are_refused_by_name(gpt) -> None:
    config, state, step, plan = gpt
    piped = staged_plan(plan, [[("a100-80g", (0,), ("blocks.0", "post")),
                              ("a100-80g", (1,), ("pre", "blocks.1"))]], 4, [4])
    with pytest.raises(PipelineError, match="layer order"):
        sp.apply_plan(step, piped)(state, models.example_batch(config, 16, seed=0))


def test_a_scanned_stack_cut_across_stages() -> None:
    # gpt-tiny-scan's blocks are one nnx.scan over stacked parameters: under interleaved 1F1B
    # (stage 0: blocks 0 and 2, stage 1: blocks 1 and 3) its forward and backward scans are cut
    # into four segments (carries chained, each backward segment reading its own forward
    # segment's saved rows).
    config = models.load_model_config("gpt-tiny-scan", overrides={"n_layers": 4})
    graphdef, state = models.init_train_state(config, seed=0)
    step = models.make_train_step(graphdef)
    _, _, _, plan = planned_tiny("gpt-tiny")
    blocks = [f"blocks.{i}" for i in range(4)]
    groups = [("a100-80g", (0, 1), ("pre", blocks[0], blocks[2])),
              ("v100-32g", (4, 5), (blocks[1], blocks[3], "post"))]
    traced = sp.trace(step, jax.eval_shape(lambda: state),
                      jax.eval_shape(lambda: models.example_batch(config, 16, seed=0)))
    assert {layer.stack for layer in traced.layers if layer.name in blocks} == {"blocks"}
    piped = staged_plan(one_stage_plan_of(plan, step, state, config), [groups], 4, [4])
    piped = dataclasses.replace(piped, schedule="interleaved", chunks=2)
    # Rows 0 and 2 on one stage, 1 and 3 on another: no one array holds each stage's rows, so
    # the stacked leaves stay whole (the stage planner never cuts a stack so: stack_violations)
    with pytest.warns(ShardplanWarning, match="stacked leaves stay whole on one stage"):
        run = three_steps_match(config, state, step, piped)
    assert run._ready.virtual[0].count == 4
    assert [(t.key, t.stage) for t in run._ready.tasks[0]] == [
        (0, 0), (1, 1), (2, 0), (3, 1), (4, 1), (5, 0), (6, 1), (7, 0)]




def test_clip_by_global_norm_across_stages() -> None:
    # The clip is active (the first step's gradient norm is above it), so the update needs
    # the global norm: each stage sums its own gradients' squares, the partial sums meet, the
    # factor goes back. Only scalars cross stages in the update; the new parameters stay on their stages.
    config = models.load_model_config("gpt-tiny")
    graphdef, state = models.init_train_state(config, seed=0,
                                              optimizer=models.make_optimizer(clip_norm=0.05))
    step = models.make_train_step(graphdef)
    _, _, _, plan = planned_tiny("gpt-tiny")
    piped = staged_plan(plan, [[("a100-80g", (0, 1), ("pre", "blocks.0")),
                              ("v100-32g", (4, 5), ("blocks.1", "post"))]], 4, [4])
    run = three_steps_match(config, state, step, piped)
    norm = jax.jit(step)(state, models.example_batch(config, 16, seed=0))[1]["grad_norm"]
    assert float(norm) > 0.05
    update = run._ready.update[0]
    assert {p.stage for p in update} == {0, 1} and len(update) >= 3
    made = {v: p.stage for p in update for v in p.outputs}
    crossing = [v for p in update for kind, v in p.inputs
                if kind == "value" and made[v] != p.stage]
    assert crossing and all(v.aval.shape == () for v in crossing)
    homes = run._ready.home[0]
    assert homes.count(0) > 10 and homes.count(1) > 10


def test_moe_with_experts_sharded_inside_each_stage() -> None:
    # The experts' weights (and their Adam moments) are split over each stage's two devices;
    # the tasks run with those shardings. One microbatch: the load-balancing loss is a product
    # of means over the tokens a program sees, so a microbatched MoE step is gradient
    # accumulation (as every MoE trainer runs it), not the whole-batch step the reference is
    # (``tests/runtime/test_accumulate.py`` checks the accumulation itself).
    config, state, step, plan = planned_tiny("moe-tiny")

    def experts(key: str, rank: int):
        if "/mlp/w_" in key and rank == 3:
            return (("inner",), (), ())
        return tuple(() for _ in range(rank))

    piped = staged_plan(plan, [[("a100-80g", (0, 1), ("pre", "blocks.0")),
                              ("v100-32g", (4, 5), ("blocks.1", "post"))]],
                      16, [1],
                      param_spec=experts)
    run = three_steps_match(config, state, step, piped)
    sharded = [t for t in run._ready.tasks[0]
               if any(x.spec == jax.sharding.PartitionSpec("inner", None, None)
                      for x in run._ready.shardings[t.stage][0])]
    assert {t.stage for t in sharded} == {0, 1}
    key = "0/blocks/1/mlp/w_up/value"
    paths = [jax.tree_util.keystr(p, simple=True, separator="/")
             for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    new_state = run._returned[paths.index(key)]
    assert new_state.sharding.spec == jax.sharding.PartitionSpec("inner", None, None)
    assert {d.id for d in new_state.sharding.device_set} == {4, 5}




@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-tiny-scan"])
def test_a_planned_heterogeneous_pipeline(name: str) -> None:
    # The planner's own plan for a 4-block GPT on 4 A100 + 4 V100 whose replica does not fit
    # one device: a V100 and an A100 replica of four stages each, with 12 and 20 microbatches
    # (11 and 21 for the nnx.scan twin, each of whose stages holds its own row of the stacked
    # parameters), stages of one or two layers, each with the planner's intra-op layout.
    config, state, step, plan, _ = budget_planned(name, 64, 0.3)
    types = [{plan.stages[i].device_type for i in r.stages} for r in plan.replicas]
    assert len(plan.replicas) == 2 and {t for ts in types for t in ts} == {"a100-80g",
                                                                          "v100-32g"}
    assert plan.replicas[0].microbatches != plan.replicas[1].microbatches
    assert len({len([n for n in s.layers if n != "shared"]) for s in plan.stages}) > 1
    run = three_steps_match(config, state, step, plan, batch_size=64)
    assert bool(run._ready.rows.runs) == name.endswith("scan")  # stacked leaves per stage


def test_a_linen_train_state_through_two_stages() -> None:
    # A Linen MLP with flax's TrainState (apply_gradients, clip_by_global_norm + AdamW inside)
    # and an accuracy metric, cut after its second layer.
    from helpers.linen_case import linen_case

    state, step, batch = linen_case([32, 32, 32])
    plan = sp.make_plan(step, jax.eval_shape(lambda: state), jax.eval_shape(lambda: batch(0)),
                        cluster=sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4}),
                        config=sp.PlanConfig(max_stages=1))
    piped = staged_plan(plan, [[("a100-80g", (0, 1), ("pre", "params.hidden_1")),
                              ("v100-32g", (4, 5), ("params.hidden_2", "post"))]], 4, [4])
    run = sp.apply_plan(step, piped)
    ref = state
    for i in range(3):
        state, metrics = run(state, batch(i))
        ref, ref_metrics = jax.jit(step)(ref, batch(i))
        for a, b in zip(jax.tree.leaves((state, metrics)), jax.tree.leaves((ref, ref_metrics)),
                        strict=True):
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                       rtol=RTOL, atol=ATOL)
    assert {p.stage for p in run._ready.update[0]} == {0, 1}


@pytest.mark.parametrize("name", ["llama-tiny", "gpt-tiny"])
def test_a_planned_pipeline_holds_what_its_stages_were_predicted_to(name: str) -> None:
    # A 4-block Llama, and a GPT whose head reads the token embedding the first stage owns
    # (tied), as Python loops on 4 A100 + 4 V100 under a budget of 40 % of the one-stage
    # replica's peak: the planner cuts it into stages, and on every stage the most a device
    # held while a program ran (the program's own figure plus the arrays the driver kept
    # beside it: optimizer state, gradient sums, other microbatches' saved values, the tied
    # embedding's copy and gradient term) is the predicted peak within 10 %, and no program
    # exceeds the budget (measured: 0.96-1.05).
    config, state, step, plan, budget = budget_planned(name, 16, 0.4)
    assert len(plan.stages) >= 3
    run = sp.apply_plan(step, plan, measure_steps=0)
    run(state, models.example_batch(config, 16, seed=0))
    for st in run.plan.stages:
        predicted = max(run.plan.predicted.memory_bytes[d] for d in st.mesh.device_ids)
        programs = [p for p in run.plan.compiled["programs"] if p["stage"] == st.index]
        held = max(p["memory_bytes"] + p["beside_bytes"] for p in programs)
        assert 0.9 * predicted <= held <= 1.1 * predicted, (st.index, st.remat, held, predicted)
        assert max(p["memory_bytes"] for p in programs) <= budget


def test_a_kernel_inside_a_scanned_stack_runs_split_on_each_stage(monkeypatch) -> None:
    # Pallas attention inside llama-tiny's nnx.scan, over two stages of two devices each, the
    # layouts splitting the kernel calls over the batch: each stage's programs run them in
    # shard_map on the stage's devices (one manual computation per call in the lowered task
    # programs), and the step equals the unsharded one.
    config = models.load_model_config("llama-tiny", overrides={
        "n_layers": 2, "attention_impl": "pallas", "scan_layers": True})
    graphdef, state = models.init_train_state(config, seed=0)
    step = models.make_train_step(graphdef)
    graph = sp.trace(step, jax.eval_shape(lambda: state),
                     jax.eval_shape(lambda: models.example_batch(config, 4, seed=0)))
    kernels = [op for op in graph.ops if op.primitive == "shardplan_kernel"]
    assert len(kernels) == 2 and all(op.loop for op in kernels)

    def batch_split(tensors):
        return tuple((("inner",), *(() for _ in graph.tensors[t].shape[1:])) for t in tensors)

    specs = {"/".join(map(str, op.path)): (batch_split(op.outputs), batch_split(op.inputs))
             for op in kernels}
    _, _, _, plan = planned_tiny("llama-tiny")
    piped = staged_plan(one_stage_plan_of(plan, step, state, config),
                      [[("a100-80g", (0, 1), ("pre", "blocks.0")),
                        ("v100-32g", (4, 5), ("blocks.1", "post"))]], 4, [4],
                      kernel_specs=specs)
    calls, lowered = [], []
    real_split, real_run = constrain._split_kernel, PipelinedStep._run

    def split(name, eqn, values, pinned):
        calls.append((name, frozenset(d.id for d in pinned[0][0].mesh.devices.flat)))
        return real_split(name, eqn, values, pinned)

    def run(self, prog, name, args):
        if self._compiled is not None and id(prog) not in self._seen:
            text = prog.fn.lower(*args).as_text()
            lowered.append((prog.stage, max(text.count("sdy.manual_computation"),
                                            text.count("SPMDFullToShardShape"))))
        return real_run(self, prog, name, args)

    monkeypatch.setattr(constrain, "_split_kernel", split)
    monkeypatch.setattr(PipelinedStep, "_run", run)
    three_steps_match(config, state, step, piped)  # (made by hand: no memory figures checked)
    assert set(calls) == {(k.attrs["kernel"], frozenset(ids)) for k in kernels
                                  for ids in ((0, 1), (4, 5))}
    # Per stage: a forward and a backward call (a backward task recomputing the forward under
    # full remat would show one more); every call is in some task program of its stage.
    assert {stage: sum(n for s, n in lowered if s == stage) for stage in (0, 1)} == {0: 2, 1: 2}
