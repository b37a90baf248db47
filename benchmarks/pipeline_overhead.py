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

Usage: ``python benchmarks/pipeline_overhead.py [--repeats 30]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
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
from flax.training import train_state

import models
import shardplan as sp
from shardplan.runtime.pipeline import PipelinedStep

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_pipeline_runtime import _pipeline  # the tests' hand-made plans

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


def executor_overhead(repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    step, state, one = mlp_case(1)
    compute = _median_step(jax.jit(step), state, one, repeats * 4)
    base = sp.make_plan(step, jax.eval_shape(lambda: state), jax.eval_shape(lambda: one),
                        cluster=sp.Cluster.local(types={"a100-80g": 8}),
                        config=sp.PlanConfig(max_stages=1))
    names = [layer.name for layer in sp.trace(step, jax.eval_shape(lambda: state),
                                              jax.eval_shape(lambda: one)).layers
             if layer.name != "shared"]
    for k in (2, 4):
        layers = [tuple(str(n) for n in part) for part in np.array_split(names, k)]
        times = {}
        for m in (8, 32):
            step, state, batch = mlp_case(m)
            plan = _pipeline(base, [[("a100-80g", (p,), names) for p, names in
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
            "programs": {"spmd": 1, "pipeline": 2 + len(piped._ready.update)
                         if piped._ready else None}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = {"executor": executor_overhead(args.repeats),
              "one_stage": spmd_vs_pipeline(args.repeats),
              "repeats": args.repeats, "jax": jax.__version__,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
