"""Overhead of the pipeline executor (``shardplan.runtime.pipeline``) on CPU.

Two measurements, each printed and written to ``benchmarks/results/pipeline_overhead.json``:

1. **Executor time per microbatch per stage.** A Linen MLP of width 16 (its compute is a few
   microseconds) runs as a 2- and a 4-stage 1F1B pipeline, one device per stage, with 8 and
   32 microbatches of one sample. The step's growth from 8 to 32 microbatches, divided by
   ``24 * stages``, is what one microbatch costs one stage: dispatching its forward and backward
   programs, moving its activation and cotangent to the neighbouring stage
   (``jax.device_put``), accumulating its gradients and the Python bookkeeping. The model's
   own compute per microbatch (the unsharded step on one sample, jitted) is printed beside it.
2. **A one-stage plan through the pipeline executor vs the SPMD path.** The tiny GPT planned on
   8 devices as one stage: ``apply_plan`` runs it as one jitted program (``PlannedStep``), while
   ``PipelinedStep`` runs the same plan as forward-backward and update programs. Timed in
   interleaved pairs (the order inside a pair alternates); reported: median per variant and the
   ratio of the medians.

3. **Data-parallel replicas: bytes and step time against the previous runtime.** A 4-block
   Llama as two replicas of two stages, (a) the planner's plan of two identical A100 replicas
   (one program per stage, the gradients all-reduced inside it) and (b) an A100 and a V100
   replica cutting the model at different layers (their sums exchanged, ``runtime/
   exchange.py``). Per step: the bytes the transfers between stages moved and what the
   replicas' synchronisation moved, priced (``plan.solver`` / ``exchange_bytes``) next to
   measured (``plan.measured``) and compiled (the sync programs' all-reduce). The step time
   against the runtime before this issue's data parallelism (``--baseline``, default
   ``7240e12``: every replica's gradient sums sent to replica 0, which alone updated and
   served the parameters), checked out with ``git worktree`` and run on the same plan files
   in a subprocess, one after the other (the same number of steps, medians and their ratio).

Usage: ``python benchmarks/pipeline_overhead.py [--repeats 30] [--baseline REV]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn
import jax
import numpy as np
import optax
import shardplan_models as models
from flax.training import train_state

import shardplan as sp
from shardplan.runtime.pipeline import PipelinedStep

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.pipelines import staged_plan  # the tests' hand-made plans

RESULTS = Path(__file__).resolve().parent / "results" / "pipeline_overhead.json"


class MLP(nn.Module):
    width: int = 16
    hidden: int = 4

    @nn.compact
    def __call__(self, x: Any) -> Any:
        for i in range(self.hidden):
            x = nn.relu(nn.Dense(self.width, name=f"hidden_{i}")(x))
        return nn.Dense(4, name="head")(x)


def mlp_case(batch: int) -> tuple[Callable[..., Any], Any, Any]:
    model = MLP()
    x = jax.random.normal(jax.random.key(0), (batch, 16))
    y = jax.random.randint(jax.random.key(1), (batch,), 0, 4)
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(2), x[:1])["params"],
        tx=optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)))

    def step(state: Any, batch: Any) -> Any:
        def loss(params: Any) -> Any:
            logits = state.apply_fn({"params": params}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), {"loss": value}

    return step, state, {"x": x, "y": y}


def _median_step(run: Callable[..., Any], state: Any, batch: Any, repeats: int) -> float:
    state, _ = run(state, batch)  # compiles
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, metrics = run(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _shape(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def executor_overhead(repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    step, state, one = mlp_case(1)
    compute = _median_step(jax.jit(step), state, one, repeats * 4)
    names = [layer.name for layer in sp.trace(step, jax.eval_shape(lambda: state),
                                              jax.eval_shape(lambda: one)).layers
             if layer.name != "shared"]
    bases = {}  # per batch size, a plan made for it (its argument types)
    for m in (8, 32):
        step, state, batch = mlp_case(m)
        bases[m] = sp.make_plan(step, jax.tree.map(_shape, state), jax.tree.map(_shape, batch),
                                cluster=sp.Cluster.local(types={"a100-80g": 8}),
                                config=sp.PlanConfig(max_stages=1))
    for k in (2, 4):
        layers = [tuple(str(n) for n in part) for part in np.array_split(names, k)]
        times = {}
        for m in (8, 32):
            step, state, batch = mlp_case(m)
            plan = staged_plan(bases[m], [[("a100-80g", (p,), names) for p, names in
                                     enumerate(layers)]], 1, [m])
            times[m] = _median_step(sp.apply_plan(step, plan), state, batch, repeats)
        per = (times[32] - times[8]) / (24 * k)
        out[f"{k}_stages"] = {"step_8_microbatches_s": times[8],
                              "step_32_microbatches_s": times[32],
                              "per_microbatch_per_stage_s": per}
        print(f"{k} stages: step {times[8] * 1e3:.1f} ms (8 microbatches), "
              f"{times[32] * 1e3:.1f} ms (32): {per * 1e6:.0f} us per microbatch per stage")
    out["model_compute_per_microbatch_s"] = compute
    print(f"the model's own step on one sample (one jitted program): {compute * 1e6:.0f} us")
    return out


def spmd_vs_pipeline(repeats: int) -> dict[str, Any]:
    config = models.load_model_config("gpt-tiny")
    graphdef, state = models.init_train_state(config, seed=0)
    step = models.make_train_step(graphdef)
    batch = models.example_batch(config, 16, seed=0)
    plan = sp.make_plan(step, jax.eval_shape(lambda: state), jax.eval_shape(lambda: batch),
                        cluster=sp.Cluster.local(types={"a100-80g": 8}),
                        config=sp.PlanConfig(max_stages=1, pipeline=False))
    assert len(plan.stages) == 1 and plan.microbatches == 1, plan.summary()
    spmd, piped = sp.apply_plan(step, plan), PipelinedStep(step, plan)
    states = {"spmd": jax.tree.map(np.array, state), "pipeline": jax.tree.map(np.array, state)}
    runs = {"spmd": spmd, "pipeline": piped}
    for name in runs:  # compile and place
        states[name] = runs[name](states[name], batch)[0]
    jax.block_until_ready(states)
    times: dict[str, list[float]] = {"spmd": [], "pipeline": []}
    for i in range(repeats):
        for name in (("spmd", "pipeline") if i % 2 == 0 else ("pipeline", "spmd")):
            t0 = time.perf_counter()
            states[name], metrics = runs[name](states[name], batch)
            jax.block_until_ready((states[name], metrics))
            times[name].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    ratio = med["pipeline"] / med["spmd"]
    print(f"one-stage plan of gpt-tiny on 8 devices: SPMD path {med['spmd'] * 1e3:.1f} ms, "
          f"pipeline executor {med['pipeline'] * 1e3:.1f} ms: ratio {ratio:.2f}")
    return {"median_s": med, "ratio_of_medians": ratio,
            "programs": {"spmd": 1, "pipeline": 2 + len(piped._ready.update[0])
                         if piped._ready else None}}


BASELINE = "7240e12"
"""The runtime before identical replicas ran as one and replicas that differ exchanged their
sums: every replica's gradient sums went to replica 0, which alone updated the state."""


def _llama4() -> tuple[Any, Any, Callable[..., Any], Any]:
    config = models.load_model_config("llama-tiny", overrides={"n_layers": 4})
    graphdef, state = models.init_train_state(config, seed=0)
    return config, state, models.make_train_step(graphdef), models.example_batch(
        config, 16, seed=0)


def time_plan(path: Path, repeats: int) -> dict[str, Any]:
    """The median step of the plan at ``path`` on the 4-block Llama (whatever ``shardplan``
    this process imports: the baseline's, in its subprocess), and its measured figures."""
    _, state, step, batch = _llama4()
    run = sp.apply_plan(step, sp.load_plan(path))
    median = _median_step(run, state, batch, repeats)
    return {"median_s": median, "measured": dict(run.plan.measured or {}),
            "compiled": dict(run.plan.compiled or {}), "shardplan": sp.__file__}


def _replica_cases() -> dict[str, Any]:
    """The two plans of measurement 3 and what the planner prices for each."""
    from helpers.pipelines import budget_planned, priced_exchange

    config, state, step, plan, _ = budget_planned("llama-tiny", 16, 0.6)
    assert len(plan.replicas) == 2 and len(plan.stages) == 4, plan.summary()
    cluster = sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
    batch = models.example_batch(config, 16, seed=0)
    groups = [[("a100-80g", (0, 1), ("pre", "blocks.0")),
               ("a100-80g", (2, 3), ("blocks.1", "blocks.2", "blocks.3", "post"))],
              [("v100-32g", (4,), ("pre", "blocks.0", "blocks.1", "blocks.2")),
               ("v100-32g", (5,), ("blocks.3", "post"))]]
    one = sp.make_plan(step, jax.eval_shape(lambda: state), jax.eval_shape(lambda: batch),
                       cluster=cluster, config=sp.PlanConfig(max_stages=1))
    differ = staged_plan(one, groups, 1, [10, 6])
    priced = priced_exchange(step, state, batch, cluster, groups, [10, 6], 1)
    boundary = config.max_seq_len * config.d_model * 4  # one sample's activation, fp32
    return {
        "identical": (plan, {"transfer_bytes": plan.solver["transfer_bytes"],
                             "sync_bytes_per_device": dict(plan.solver["sync_bytes"])}),
        # (the A100 stages run a one-sample microbatch whole on both devices: both receive)
        "differ": (differ, {"transfer_bytes": (10 * 2 + 6) * 2 * boundary,
                            "exchange_bytes": sum(priced.values())}),
    }


def replicas_vs_baseline(repeats: int, baseline: str) -> dict[str, Any]:
    root = Path(__file__).resolve().parents[1]
    out: dict[str, Any] = {"baseline": baseline}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(tree),
                        baseline], check=True, capture_output=True)
        try:
            for name, (plan, priced) in _replica_cases().items():
                path = Path(tmp) / f"{name}.json"
                plan.save(path)
                now = time_plan(path, repeats)
                before = json.loads(subprocess.run(
                    [sys.executable, __file__, "--time-plan", str(path),
                     "--repeats", str(repeats)],
                    env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree, check=True,
                    capture_output=True, text=True).stdout.splitlines()[-1])
                if not before["shardplan"].startswith(str(tree)):  # the baseline's own code
                    raise RuntimeError(f"the baseline ran {before['shardplan']}")
                measured = now["measured"]
                entry = {
                    "priced": priced,
                    "measured": {k: measured.get(k) for k in
                                 ("moved_bytes", "batch_bytes", "sync_moved_bytes")},
                    "compiled_all_reduce_bytes": {
                        str(p["stage"]): p["collectives"]["all-reduce"]["bytes"]
                        for p in (now["compiled"] or {}).get("programs", ())
                        if str(p["name"]).startswith("sync") and "same_as" not in p},
                    "step_s": {"now": now["median_s"], "baseline": before["median_s"]},
                    "ratio_of_medians": now["median_s"] / before["median_s"],
                }
                out[name] = entry
                moved = measured.get("moved_bytes")
                print(f"2 replicas x 2 stages, {name}: moved between stages "
                      f"{moved} B (priced {priced['transfer_bytes']}), "
                      + (f"exchange {sum(measured['sync_moved_bytes'].values())} B (priced "
                         f"{priced['exchange_bytes']:.0f})" if "exchange_bytes" in priced
                         else f"sync per device priced {priced['sync_bytes_per_device']}")
                      + f"; step {now['median_s'] * 1e3:.1f} ms against "
                      f"{before['median_s'] * 1e3:.1f} ms before ({baseline}): ratio "
                      f"{entry['ratio_of_medians']:.2f}")
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force",
                            str(tree)], check=False, capture_output=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--baseline", default=BASELINE,
                        help="the git revision whose runtime measurement 3 compares against")
    parser.add_argument("--time-plan", type=Path, help=argparse.SUPPRESS)  # the subprocess
    parser.add_argument("--only-replicas", action="store_true",
                        help="measurement 3 alone (merged into the results file)")
    args = parser.parse_args()
    if args.time_plan:
        done = time_plan(args.time_plan, args.repeats)
        print(json.dumps({"median_s": done["median_s"], "shardplan": done["shardplan"]}))
        return
    if args.only_replicas:
        result = json.loads(args.out.read_text()) if args.out.exists() else {}
        result["replicas"] = replicas_vs_baseline(args.repeats, args.baseline)
        args.out.write_text(json.dumps(result, indent=2, default=dict) + "\n")
        print(f"wrote {args.out}")
        return
    result = {"executor": executor_overhead(args.repeats),
              "one_stage": spmd_vs_pipeline(args.repeats),
              "replicas": replicas_vs_baseline(args.repeats, args.baseline),
              "repeats": args.repeats, "jax": jax.__version__,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=dict) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
