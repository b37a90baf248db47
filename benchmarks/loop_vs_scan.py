"""The same GPT written as a Python loop and as an ``nnx.scan``: measured and predicted step time.

Issue 20 asks loop and scan plans to agree, predicted step time included. They agree on the
plan (``tests/planner/test_loop_scan.py``: the same mesh or stage split and the same specs), but XLA
does not compile the two into the same program: a scan's backward loop reads residuals the
forward loop stacked (dynamic-update-slice writes, dynamic-slice reads) and XLA fuses no value
across the loop boundary, so the scan moves more bytes and runs slower. This script measures
that on one CPU device (jitted step, donated state, median over interleaved rounds, the two
forms side by side in one process) next to what ``make_plan`` predicts for each, on the
cluster of that one device.

Prints a table and writes ``benchmarks/results/loop_vs_scan.json``.

Usage: ``python benchmarks/loop_vs_scan.py [--rounds 7] [--layers 4]``
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=1").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import jax
import shardplan_models as models

import shardplan as sp

RESULTS = Path(__file__).resolve().parent / "results" / "loop_vs_scan.json"
MODEL = {"vocab_size": 1024, "max_seq_len": 256, "d_model": 512, "n_heads": 8, "d_ff": 2048}
BATCH = 8
STEPS_PER_ROUND = 3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per form (median)")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    cluster = sp.Cluster.local(devices=jax.devices()[:1])
    forms = {}
    for form in ("loop", "scan"):
        config = models.load_model_config(
            "gpt-small", overrides={**MODEL, "n_layers": args.layers, "scan_layers": form == "scan"})
        graphdef, state = models.init_train_state(config)
        batch = models.example_batch(config, BATCH)
        step = models.make_train_step(graphdef)
        plan = sp.make_plan(step, state, batch, cluster=cluster)
        run = jax.jit(step, donate_argnums=0)
        state, _ = run(state, batch)  # compile and warm up
        jax.block_until_ready(state)
        forms[form] = {"run": run, "state": state, "batch": batch, "times": [],
                       "predicted_s": plan.predicted.step_time_s}
    for _ in range(args.rounds):  # interleaved, so load changes hit both forms alike
        for f in forms.values():
            start = time.perf_counter()
            for _ in range(STEPS_PER_ROUND):
                f["state"], _ = f["run"](f["state"], f["batch"])
            jax.block_until_ready(f["state"])
            f["times"].append((time.perf_counter() - start) / STEPS_PER_ROUND)
    rows = []
    for form, f in forms.items():
        measured = statistics.median(f["times"])
        rows.append({"form": form, "measured_step_s": measured,
                     "measured_runs_s": f["times"], "predicted_step_s": f["predicted_s"]})
        print(f"{form}: measured {measured * 1e3:8.1f} ms (median of {args.rounds}), "
              f"predicted {f['predicted_s'] * 1e3:8.1f} ms")
    loop, scan = rows
    ratios = {"measured_scan_over_loop": scan["measured_step_s"] / loop["measured_step_s"],
              "predicted_scan_over_loop": scan["predicted_step_s"] / loop["predicted_step_s"]}
    print(f"scan / loop: measured {ratios['measured_scan_over_loop']:.3f}, "
          f"predicted {ratios['predicted_scan_over_loop']:.3f}")
    RESULTS.write_text(json.dumps({
        "model": {**MODEL, "n_layers": args.layers, "batch": BATCH},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "jax": jax.__version__, "load_avg_1min": os.getloadavg()[0]},
        "rows": rows, **ratios}, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
