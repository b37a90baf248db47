"""Pipeline plans' memory per stage: predicted, compiled, and held on the device.

Issue 21 asks that a pipeline stage run in the memory it was planned for. For the tiny GPT
and Llama, as Python loops and as ``nnx.scan`` stacks (4 blocks), planned on 4 A100 + 4 V100
(emulated on 8 CPU devices) under budgets that are fractions of the one-stage replica's
predicted peak, this script runs three steps of each plan and prints, per stage:

* ``predicted``: the plan's per-device peak (the stage planner's ``state + mb x (in_flight x
  activation + work)``, :func:`shardplan.solver.stages.pipeline.stage_held`);
* ``compiled``: the largest of the stage's programs as XLA compiled it (``memory_analysis``:
  arguments + outputs + temporaries - aliased);
* ``held``: the most one device of the stage held while a program ran: the program's own figure
  plus the arrays the pipeline driver kept beside it (optimizer state, gradient sums, other
  microbatches' saved values), as ``plan.compiled`` records it in the first step;
* ``resident``: what the plan predicts the stage keeps between steps (its layers' parameters
  and optimizer state, ``plan.solver["resident_bytes"]``);
* ``live``: what the device held after the third step, as the runtime measured it
  (``plan.measured["live_bytes"]``: ``jax.live_arrays`` on CPU);

and the ratios to the prediction and to the budget, and whether the stage's stacked leaves
(a scanned stack's) are held as its own rows. Writes
``benchmarks/results/pipeline_memory.json``.

Usage: ``python benchmarks/pipeline_memory.py [--fractions 0.6 0.4 0.3] [--max-stages 3]
[--layers 6]`` (``--max-stages``: plans of at most that many stages per replica, so that a
budget can force three; the results then go to ``pipeline_memory_max<N>.json``.
``--layers``: blocks per model, 4 by default; three stages cut a scanned stack of 6 into equal
runs, one of 4 they cannot, so the stage planner gives a 4-block scan no 3-stage plan).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import platform
import warnings
from collections import defaultdict
from pathlib import Path

import jax
import shardplan_models as models

import shardplan as sp

RESULTS = Path(__file__).resolve().parent / "results" / "pipeline_memory.json"
CASES = {"gpt loop": ("gpt-tiny", {}), "gpt scan": ("gpt-tiny-scan", {}),
         "llama loop": ("llama-tiny", {}), "llama scan": ("llama-tiny", {"scan_layers": True})}
BATCH = 16


def run_case(name: str, fraction: float, max_stages: int | None = None,
             n_layers: int = 4) -> dict:
    preset, overrides = CASES[name]
    config = models.load_model_config(preset, overrides={"n_layers": n_layers, **overrides})
    graphdef, state = models.init_train_state(config, seed=0)
    step = models.make_train_step(graphdef)
    shapes = (jax.eval_shape(lambda: state),
              jax.eval_shape(lambda: models.example_batch(config, BATCH, seed=0)))
    cluster = sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = sp.make_plan(step, *shapes, cluster=cluster, config=sp.PlanConfig(max_stages=1))
        budget = fraction * max(one.predicted.memory_bytes.values())
        plan = sp.make_plan(step, *shapes, cluster=cluster,
                            config=sp.PlanConfig(memory_budget_bytes=budget, pipeline=True,
                                                 max_stages=max_stages or 0))
    run = sp.apply_plan(step, plan, measure_steps=2)  # the third step records live bytes
    for i in range(3):
        state, _ = run(state, models.example_batch(config, BATCH, seed=i))
    jax.block_until_ready(state)
    plan = run.plan
    live = {int(d): b for d, b in plan.measured["live_bytes"].items()}
    split = run._ready.rows.runs
    programs = defaultdict(list)
    for p in plan.compiled["programs"]:
        programs[p["stage"]].append(p)
    stages = []
    for st in plan.stages:
        predicted = max(plan.predicted.memory_bytes.get(d, 0) for d in st.mesh.device_ids)
        largest = max(programs[st.index], key=lambda p: p["memory_bytes"])
        held = max(p["memory_bytes"] + p["beside_bytes"] for p in programs[st.index])
        stages.append({
            "stage": st.index, "device_type": st.device_type, "devices": st.mesh.num_devices,
            "layers": [n for n in st.layers if n != "shared"], "remat": st.remat,
            "predicted_bytes": predicted, "compiled_bytes": largest["memory_bytes"],
            "compiled_program": largest["name"], "held_bytes": held,
            "resident_bytes": plan.solver["resident_bytes"][str(st.index)],
            "live_bytes": max(live.get(d, 0) for d in st.mesh.device_ids)})
    return {"case": name, "fraction": fraction, "max_stages": max_stages, "n_layers": n_layers,
            "budget_bytes": budget,
            "stacked_rows_split": bool(split),
            "replicas": [len(r.stages) for r in plan.replicas], "schedule": plan.schedule,
            "microbatch_size": plan.microbatch_size, "stages": stages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.6, 0.4, 0.3])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--max-stages", type=int, default=None)
    parser.add_argument("--layers", type=int, default=4, help="blocks per model")
    args = parser.parse_args()
    results = (RESULTS if args.max_stages is None else
               RESULTS.with_name(f"pipeline_memory_max{args.max_stages}.json"))
    rows = []
    print(f"{'case':<11}{'budget':>6}{'stage':>6} {'remat':<10}{'predicted':>10}{'compiled':>10}"
          f"{'held':>10}{'comp/pred':>10}{'held/pred':>10}{'held/budget':>12}"
          f"{'resident':>10}{'live':>10}{'live/res':>9}")
    for case in args.cases:
        for fraction in args.fractions:
            try:
                row = run_case(case, fraction, args.max_stages, args.layers)
            except sp.ShardplanError as err:  # refused before the first step: recorded
                first = str(err).splitlines()[0]
                rows.append({"case": case, "fraction": fraction, "max_stages": args.max_stages,
                             "n_layers": args.layers, "refused": str(err)})
                print(f"{case:<11}{fraction:>6.2f}  refused: {first}", flush=True)
                continue
            rows.append(row)
            for s in row["stages"]:
                p = s["predicted_bytes"]
                print(f"{case:<11}{fraction:>6.2f}{s['stage']:>6} {s['remat']:<10}"
                      f"{p:>10,}{s['compiled_bytes']:>10,}{s['held_bytes']:>10,}"
                      f"{s['compiled_bytes'] / p:>10.2f}{s['held_bytes'] / p:>10.2f}"
                      f"{s['held_bytes'] / row['budget_bytes']:>12.2f}"
                      f"{s['resident_bytes']:>10,}{s['live_bytes']:>10,}"
                      f"{s['live_bytes'] / max(s['resident_bytes'], 1):>9.2f}", flush=True)
            if case.endswith("scan"):
                print(f"{'':<11}(stacked leaves per stage: "
                      f"{'yes' if row['stacked_rows_split'] else 'no'})")
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({
        "benchmark": "pipeline_memory", "jax": jax.__version__, "batch": BATCH, "rows": rows,
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
    }, indent=2) + "\n")
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
