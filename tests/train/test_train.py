"""``shardplan train``: a run resumes exactly where it stopped (also after a SIGKILL during a
checkpoint save), continues within 1e-4 on another plan (8-way data parallel -> a 2-stage
pipeline), stops on a NaN loss keeping its checkpoint, and refuses another model's checkpoints.

Runs are ``configs/train/tiny.yaml`` (gpt-tiny, a 64 KiB slice of the built-in corpus), a few
steps each, on two CPU devices (eight for the data-parallel plan).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers.processes import child_env
from helpers.sigkill import kill_while_saving

import shardplan as sp
from shardplan.train.config import load_run_config
from shardplan.train.loop import train

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "train" / "tiny.yaml")
STEPS = 6
BASE = (f"--train.steps={STEPS}", "--train.eval_every=3", "--train.sample_tokens=0",
        "--train.measure_steps=0", "--output.checkpoint_every=2",
        "--cluster.local.types={cpu: 2}")


def _config(run_dir: Path, *overrides: str):
    return load_run_config(TINY, [*BASE, f"--output.dir={run_dir}", *overrides])


def _run(run_dir: Path, *overrides: str):
    return train(_config(run_dir, *overrides), progress=False, print_fn=lambda _: None)


def _bit_equal(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("whole"))


_KILLED = """
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    from shardplan.train.config import load_run_config
    from shardplan.train.loop import train

    config, *overrides = sys.argv[1:]
    train(load_run_config(config, overrides), progress=False)
    print("the run was not stopped", flush=True)
"""


@pytest.mark.slow
def test_a_run_killed_while_saving_resumes_exactly_as_if_never_stopped(uninterrupted,
                                                                       tmp_path) -> None:
    # Checkpoints at steps 2, 4, 6: the run is killed (SIGKILL) in the middle of writing
    # step 4's arrays. Step 2 stays the latest and loads; the run resumes from it and ends with
    # the uninterrupted run's losses and state, bit for bit.
    run_dir, marker = tmp_path / "run", tmp_path / "stalled"
    env = child_env(JAX_PLATFORMS="cpu")
    kill_while_saving(_KILLED, [TINY, *BASE, f"--output.dir={run_dir}"],
                      stall_at="4.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp",
                      marker=marker, env=env)
    assert (run_dir / "checkpoints" / "4.orbax-checkpoint-tmp").is_dir()
    resumed = _run(run_dir)
    assert (resumed.first_step, resumed.last_step) == (2, STEPS)
    assert resumed.losses == uninterrupted.losses[2:]
    _bit_equal(resumed.state, uninterrupted.state)
    # The metrics log holds both runs' lines: steps 1-4 before the kill, then 3-6.
    steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").open())
             if "loss" in r]
    assert steps == [1, 2, 3, 4, 3, 4, 5, 6]


def _plan_file(plan, path: Path, cluster, **changes) -> str:
    """``plan`` changed as given, for ``cluster``, saved to ``path`` (made by hand: no memory
    budget recorded, its memory figures being placeholders)."""
    from shardplan.plan.stamp import cluster_info

    solver = {k: v for k, v in plan.solver.items() if k != "memory_budget_bytes"}
    dataclasses.replace(plan, cluster_hash=cluster.content_hash(), solver=solver,
                        cluster_info=cluster_info(cluster), constraints={}, **changes).save(path)
    return f"--plan.file={path}"


@pytest.mark.slow
def test_a_run_stopped_and_resumed_on_another_plan_continues_within_1e4(uninterrupted,
                                                                        tmp_path) -> None:
    # Steps 1-3 data-parallel over 8 devices; steps 4-6 on a 2-stage GPipe pipeline over
    # devices 0 and 1 (2 microbatches): the checkpoint written under the first plan is
    # restored straight into the pipeline's per-stage layout.
    from shardplan.plan.plan import Layout, MeshSpec, ReplicaSpec, Stage

    plan = uninterrupted.plan  # made for this step and batch (on 2 devices)
    cluster = sp.Cluster.local(types={"cpu": 8})
    replicated = {k: tuple(() for _ in spec) for k, (_, spec) in plan.param_specs.items()}
    whole = {k: tuple(() for _ in spec) for k, spec in plan.batch_specs.items()}
    split = {k: (("data",), *spec[1:]) for k, spec in whole.items()}
    layers = plan.stages[0].layers
    assert [n for n in layers if n.startswith("blocks.")] == ["blocks.0", "blocks.1"]
    data_parallel = _plan_file(
        plan, tmp_path / "dp.json", cluster,
        stages=(Stage(0, "cpu", MeshSpec(("data",), (8,), tuple(range(8))), layers),),
        param_specs={k: (0, spec) for k, spec in replicated.items()}, batch_specs=split,
        predicted=dataclasses.replace(plan.predicted, memory_bytes=dict.fromkeys(range(8), 1)))
    pipeline = _plan_file(
        plan, tmp_path / "piped.json", cluster,
        stages=tuple(Stage(i, "cpu", MeshSpec(("inner",), (1,), (i,)), part, "none", 0,
                           "cpu:inner=1")
                     for i, part in enumerate([("pre", "blocks.0", "shared"),
                                               ("blocks.1", "post", "shared")])),
        layouts={"cpu:inner=1": Layout(replicated, whole)},
        param_specs={k: (0, spec) for k, spec in replicated.items()}, batch_specs={},
        microbatches=2, microbatch_size=4, schedule="gpipe", replicas=(ReplicaSpec((0, 1), 2),),
        predicted=dataclasses.replace(plan.predicted, memory_bytes={0: 1, 1: 1}))
    run_dir, on_8 = tmp_path / "run", "--cluster.local.types={cpu: 8}"
    first = _run(run_dir, on_8, data_parallel, "--train.stop_at=3")
    assert first.last_step == 3 and first.plan.stages[0].mesh.shape == {"data": 8}
    second = _run(run_dir, on_8, pipeline)
    assert (second.first_step, second.last_step) == (3, STEPS)
    assert len(second.plan.stages) == 2 and second.plan.schedule == "gpipe"
    np.testing.assert_allclose(first.losses + second.losses, uninterrupted.losses,
                               rtol=1e-4, atol=1e-4)
    for x, y in zip(jax.tree.leaves(second.state), jax.tree.leaves(uninterrupted.state),
                    strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   rtol=1e-4, atol=1e-4)


def test_a_nan_loss_stops_the_run_naming_the_step_and_keeps_the_checkpoint(tmp_path) -> None:
    # The warmup starts at 0: step 1 changes nothing, step 2 applies a learning rate of 5e29,
    # and step 3's loss is NaN. The checkpoint of step 2 stays; nothing of step 3 is saved.
    run_dir = tmp_path / "run"
    with pytest.raises(sp.RuntimeFailure,
                       match=r"(?s)loss became nan at step 3.*last checkpoint \(step 2"):
        _run(run_dir, "--optimizer.learning_rate=1.0e+30", "--optimizer.warmup_steps=2",
             "--optimizer.clip_norm=1.0e+30")
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["2"]


def test_running_a_finished_run_again_trains_nothing(uninterrupted) -> None:
    printed: list[str] = []
    again = train(_config(uninterrupted.run_dir), progress=False, print_fn=printed.append)
    assert (again.first_step, again.last_step, again.losses) == (STEPS, STEPS, ())
    assert again.val_losses == {} and again.sample == ""
    assert any("the run is complete (step 6 of train.steps=6)" in line for line in printed)
    _bit_equal(again.state, uninterrupted.state)


def test_another_models_checkpoints_are_refused_naming_the_leaf(uninterrupted) -> None:
    wanted = (r"(?s)belongs to another model.*0/blocks/0/attn/k/kernel/value: checkpoint "
              r"float32\[64,64\], target float32\[32,32\].*fix:")
    with pytest.raises(sp.CheckpointError, match=wanted):
        _run(uninterrupted.run_dir, "--model.overrides={d_model: 32}")


@pytest.mark.slow
def test_two_processes_run_the_demo_config_as_the_unsharded_step(tmp_path) -> None:
    # `shardplan launch --nprocs 2 -- shardplan train configs/train/demo.yaml --train.steps=5`:
    # the demo's 5-stage plan over 2 processes x 4 CPU devices (the embedding's stage on the
    # second, the blocks' on the first). Process 0 logs the losses, which equal the unsharded
    # step's, and the checkpoint both processes wrote loads in this one process.
    import shardplan_models as models

    from shardplan.data import load_data
    from shardplan.train.checkpoint import Checkpointer, abstract_target

    demo = str(ROOT / "configs" / "train" / "demo.yaml")
    overrides = ["--train.steps=5", f"--output.dir={tmp_path / 'run'}",
                 "--train.sample_tokens=4", "--data.val_batches=2"]
    env = child_env(own_devices=True)  # 4 devices per process
    cli = [sys.executable, "-m", "shardplan.cli.main"]
    done = subprocess.run([*cli, "launch", "--nprocs", "2", "--", *cli, "train", demo,
                           *overrides], env=env, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[p0] trained steps 0..5" in done.stdout and "[p1] trained" not in done.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["step"] for r in records if "val_loss" in r] == [0, 5]

    config = load_run_config(demo, overrides)
    graphdef, state = models.init_train_state(config.model.build(), seed=config.train.seed,
                                              optimizer=config.optimizer_transform())
    step = jax.jit(models.make_train_step(graphdef))
    data = load_data(config.data, vocab_size=256)
    reference = []
    for k in range(5):
        state, metrics = step(state, data.train_batch(k))
        reference.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, reference, rtol=1e-4, atol=1e-4)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = abstract_target(state, jax.tree.map(lambda _: one, state))
    with Checkpointer(tmp_path / "run" / "checkpoints", every_steps=1, keep=1) as checkpoints:
        restored = checkpoints.restore(target=target)
    assert restored.step == 5
    for x, y in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_evaluation_runs_through_a_plan_of_four_quarter_stages(tmp_path) -> None:
    # gpt-tiny with 4 blocks cut into 4 stages of one block each (the first with the
    # embedding, the last with the head), 2 microbatches: every evaluation runs the plan's
    # forward on the stages' devices (nothing gathered), its loss equal to the unsharded
    # forward's within 1e-5; beside each evaluation program a device holds its stage's state
    # and nothing more; and sampling runs on the plan's CPU devices, saying why.
    import shardplan_models as models

    from shardplan.data import abstract_batch, load_data
    from shardplan.plan.plan import Layout, MeshSpec, ReplicaSpec, Stage
    from shardplan.train.loop import _eval_metrics, _forward

    four = ("--model.overrides.n_layers=4", "--cluster.local.types={cpu: 4}",
            "--train.sample_tokens=4")
    config = _config(tmp_path / "run", *four)
    model_config = config.model.build()
    graphdef, state = models.init_train_state(model_config, seed=config.train.seed,
                                              optimizer=config.optimizer_transform())
    step = models.make_train_step(graphdef)
    cluster = config.cluster.build()
    base = sp.make_plan(step, jax.eval_shape(lambda: state), abstract_batch(config.data),
                        cluster=cluster, config=sp.PlanConfig(max_stages=1, pipeline=False))
    replicated = {k: tuple(() for _ in spec) for k, (_, spec) in base.param_specs.items()}
    whole = {k: tuple(() for _ in spec) for k, spec in base.batch_specs.items()}
    parts = [("pre", "blocks.0"), ("blocks.1",), ("blocks.2",), ("blocks.3", "post")]
    quarters = _plan_file(
        base, tmp_path / "quarters.json", cluster,
        stages=tuple(Stage(i, "cpu", MeshSpec(("inner",), (1,), (i,)), (*part, "shared"),
                           "none", 0, "cpu:inner=1") for i, part in enumerate(parts)),
        layouts={"cpu:inner=1": Layout(replicated, whole)},
        param_specs={k: (0, spec) for k, spec in replicated.items()}, batch_specs={},
        microbatches=2, microbatch_size=4, schedule="1f1b", replicas=(ReplicaSpec((0, 1, 2, 3),
                                                                                  2),),
        predicted=dataclasses.replace(base.predicted, memory_bytes=dict.fromkeys(range(4), 1)))
    said: list[str] = []
    result = train(_config(tmp_path / "run", *four, quarters), progress=False,
                   print_fn=said.append)
    assert len(result.plan.stages) == 4 and result.val_losses.keys() == {0, 3, 6}
    # the last evaluation against the unsharded forward on the final state
    dataset = load_data(config.data, vocab_size=model_config.vocab_size)
    metrics = jax.jit(_eval_metrics(_forward(graphdef)))
    host = jax.device_get(result.state)
    want = np.mean([float(metrics(host, dataset.val_batch(i))["loss"])
                    for i in range(config.data.val_batches)])
    np.testing.assert_allclose(result.val_losses[STEPS], want, rtol=1e-5, atol=1e-5)
    programs = result.evaluation.compiled["programs"]
    assert {p["stage"] for p in programs} == {0, 1, 2, 3}
    leaves = jax.tree_util.tree_flatten_with_path(result.state)[0]
    for p in programs:  # beside a program: the stage's state (3 copies of its parameters)
        owned = {d: 0 for d in range(4)}
        for _, x in leaves:
            for d in x.sharding.device_set:
                owned[d.id] += x.nbytes
        assert p["beside_bytes"] <= 1.02 * owned[p["stage"]], (p, owned)
    assert any("sampling: the plan cuts the model into 4 stages" in line for line in said)
    assert len(result.sample) > 0
