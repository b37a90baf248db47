"""Whole ``make_plan`` time of GPT-3 175B on heterogeneous clusters of 256 to 1,024 GPUs.

The issue's target: GPT-3 175B (96 layers as an ``nnx.scan``, abstract ``ShapeDtypeStruct``
state, AdamW) planned with pipeline stages per device type on the three-type 768-GPU cluster
(``configs/clusters/h100_a100_l4x256.yaml``: 256 H100 + 256 A100 + 256 L4) and on the
1,024-GPU one (``h100_a100_l4x1024.yaml``) in at most 10 s each, everything included: trace at
the reference microbatch, layer cost tables (intra-op solutions per device type and sub-mesh
size), the stage planner, the simulator and the plan. For the chart against Sailor (SOSP'25:
0.3 s, 6.2 s and 4,900 s for 1, 2 and 3 GPU types at 256 GPUs per type) the script also plans
on one type (the 256 H100s) and two (H100 + A100).

Each case runs in its own process (no warm caches), ``--repeats`` times; the median is
reported. Global batch: 1,536 sequences of 2,048 tokens (GPT-3's 3.2M-token batch).

Depth (``--depths``): the same model written as a Python loop (``scan_layers: false``, as
most user code and every HuggingFace Flax model is) and as an ``nnx.scan``, at 4, 8, 24 and 96
blocks on the 768-GPU cluster: whole ``make_plan`` time next to ``jax.make_jaxpr`` of the same
step (tracing alone, each in its own process), and a GPT-style model of d_model 4096 at 8
blocks. Loop planning should grow at most linearly with depth, and at 96 blocks take at most
10 s more than ``jax.make_jaxpr``.

Prints a table and writes ``benchmarks/results/plan_scale.json``.

Usage: ``python benchmarks/plan_scale.py [--repeats 3] [--cases 768,1024] [--depths 4,8,24,96]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "plan_scale.json"
BATCH = 1536
TARGET_S = 10.0
CASES = {
    # name: (cluster file, groups kept, within the target's scope)
    "256": ("h100_a100_l4x256.yaml", ("h100",), False),
    "512": ("h100_a100_l4x256.yaml", ("h100", "a100"), False),
    "768": ("h100_a100_l4x256.yaml", ("h100", "a100", "l4"), True),
    "1024": ("h100_a100_l4x1024.yaml", ("h100", "a100", "l4"), True),
}


def _cluster(file: str, keep: tuple[str, ...]):
    import yaml

    import shardplan as sp

    spec = yaml.safe_load((ROOT / "configs" / "clusters" / file).read_text())
    spec["groups"] = [g for g in spec["groups"] if g["name"] in keep]
    spec["group_links"] = [gl for gl in spec.get("group_links", ())
                           if set(gl["groups"]) <= set(keep)]
    if len(keep) == 1:
        spec.pop("between_groups", None)
        spec.pop("group_links", None)
    spec["name"] = f"{spec['name']}-{'-'.join(keep)}"
    return sp.Cluster.from_dict(spec)


def _child(case: str) -> dict:
    import time

    import shardplan_models as models

    import shardplan as sp

    file, keep, _ = CASES[case]
    config = models.load_model_config("gpt3-175b", overrides={"scan_layers": True})
    graphdef, state = models.abstract_train_state(config)
    batch = models.example_batch(config, BATCH, abstract=True)
    step = models.make_train_step(graphdef)
    cluster = _cluster(file, keep)
    t0 = time.perf_counter()
    plan = sp.make_plan(step, state, batch, cluster=cluster,
                        config=sp.PlanConfig(pipeline=True))
    seconds = time.perf_counter() - t0
    per_type: dict[str, dict[str, int]] = {}
    for stage in plan.stages:
        row = per_type.setdefault(stage.device_type, {"devices": 0, "stages": 0})
        row["devices"] += stage.mesh.num_devices
        row["stages"] += 1
    first = [plan.stages[i] for i in plan.replicas[0].stages]
    solver = json.loads(plan.to_json())["solver"]  # plain JSON values
    return {
        "case": case, "cluster": cluster.name, "devices": cluster.num_devices,
        "device_types": len(cluster.groups), "make_plan_s": seconds,
        "timings": dict(plan.timings), "status": plan.solver["status"],
        "replicas": len(plan.replicas), "microbatch_size": plan.microbatch_size,
        "microbatches": list(plan.replica_microbatches), "schedule": plan.schedule,
        "chunks": plan.chunks, "per_type": per_type,
        "first_replica": [{"type": s.device_type, "devices": s.mesh.num_devices,
                           "layers": len(s.layers), "remat": s.remat} for s in first],
        "predicted_step_time_s": plan.predicted.step_time_s,
        "simulated_step_s": plan.solver["simulated_step_s"],
        "throughput_samples_per_s": plan.solver["throughput_samples_per_s"],
        "solver": {k: solver.get(k) for k in ("configs", "labels", "shapes", "states",
                                               "lower_bound", "gap", "chosen", "candidates")},
    }


DEPTH_CLUSTER = "768"
WIDE = {"d_model": 4096, "n_heads": 32, "d_ff": 16384}
"""The GPT-style model of d_model 4096 (GPT-3's other dimensions)."""


def _depth_child(spec: str) -> dict:
    """``spec``: ``<blocks>:<loop|scan>:<plan|jaxpr>[:wide]``."""
    import time

    import jax
    import shardplan_models as models

    import shardplan as sp

    blocks, form, what, *wide = spec.split(":")
    overrides = {"scan_layers": form == "scan", "n_layers": int(blocks), **(WIDE if wide else {})}
    config = models.load_model_config("gpt3-175b", overrides=overrides)
    graphdef, state = models.abstract_train_state(config)
    batch = models.example_batch(config, BATCH, abstract=True)
    step = models.make_train_step(graphdef)
    file, keep, _ = CASES[DEPTH_CLUSTER]
    cluster = _cluster(file, keep)
    t0 = time.perf_counter()
    if what == "jaxpr":
        jax.make_jaxpr(step)(state, batch)
        return {"spec": spec, "seconds": time.perf_counter() - t0}
    plan = sp.make_plan(step, state, batch, cluster=cluster,
                        config=sp.PlanConfig(pipeline=True))
    seconds = time.perf_counter() - t0
    first = [plan.stages[i] for i in plan.replicas[0].stages]
    return {"spec": spec, "seconds": seconds, "timings": dict(plan.timings),
            "predicted_step_time_s": plan.predicted.step_time_s,
            "replicas": len(plan.replicas), "microbatch_size": plan.microbatch_size,
            "schedule": plan.schedule,
            "first_replica": [{"type": s.device_type, "devices": s.mesh.num_devices,
                               "layers": len(s.layers), "remat": s.remat} for s in first]}


def _depth_specs(depths: list[int]) -> list[str]:
    specs = [f"{d}:{form}:plan" for d in depths for form in ("loop", "scan")]
    return [*specs, f"{max(depths)}:loop:jaxpr", f"{max(depths)}:scan:jaxpr",
            "8:loop:plan:wide", "8:scan:plan:wide"]


def _depth_rows(specs: list[str], repeats: int) -> list[dict]:
    """Runs ``specs``, each row merged into the results file as soon as it is measured."""
    rows = []
    for spec in specs:
        runs = [_run_child(spec, flag="--depth-child") for _ in range(repeats)]
        row = dict(runs[-1])
        row["seconds"] = statistics.median(r["seconds"] for r in runs)
        row["runs_s"] = [r["seconds"] for r in runs]
        rows.append(row)
        t = row.get("timings", {})
        print(f"{spec:>20}: median {row['seconds']:7.2f} s of {repeats}"
              + (f" (trace {t.get('trace_s', 0):.2f}, tables {t.get('layer_tables_s', 0):.2f}, "
                 f"stage planner {t.get('stage_planner_s', 0):.2f}; predicted "
                 f"{row['predicted_step_time_s']:.3f} s/step)" if t else ""), flush=True)
        previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        kept = [r for r in previous.get("depth_rows", []) if r["spec"] != spec]
        order = {s: i for i, s in enumerate(_depth_specs([4, 8, 24, 96]))}
        merged = sorted([*kept, row], key=lambda r: order.get(r["spec"], len(order)))
        RESULTS.write_text(json.dumps({**previous, "depth_rows": merged}, indent=2) + "\n")
    return rows


def _run_child(case: str, flag: str = "--child") -> dict:
    out = subprocess.run([sys.executable, __file__, flag, case], capture_output=True,
                         text=True, env={**os.environ, "JAX_PLATFORMS": "cpu",
                                         "PYTHONPATH": str(ROOT)})
    if out.returncode:
        raise SystemExit(f"case {case} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (median)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    parser.add_argument("--depths", default="",
                        help="comma-separated block counts for the loop / scan rows (e.g. "
                             "4,8,24,96); only these rows are run")
    parser.add_argument("--specs", default="",
                        help="comma-separated depth rows to (re)measure, e.g. 8:scan:plan:wide")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--depth-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child)))
        return 0
    if args.depth_child:
        print(json.dumps(_depth_child(args.depth_child)))
        return 0
    if args.depths or args.specs:
        specs = (args.specs.split(",") if args.specs
                 else _depth_specs([int(d) for d in args.depths.split(",")]))
        _depth_rows(specs, args.repeats)
        print(f"wrote {RESULTS}")
        return 0
    rows = []
    for case in args.cases.split(","):
        runs = [_run_child(case) for _ in range(args.repeats)]
        row = dict(runs[-1])
        row["make_plan_s"] = statistics.median(r["make_plan_s"] for r in runs)
        row["make_plan_s_runs"] = [r["make_plan_s"] for r in runs]
        row["target_s"] = TARGET_S if CASES[case][2] else None
        row["within_target"] = row["make_plan_s"] <= TARGET_S if CASES[case][2] else None
        rows.append(row)
        t = row["timings"]
        verdict = ("" if row["within_target"] is None
                   else f"  target {TARGET_S:g} s: {'PASS' if row['within_target'] else 'FAIL'}")
        print(f"{row['cluster']}: {row['devices']} GPUs, {row['device_types']} types: make_plan "
              f"median {row['make_plan_s']:.2f} s of {args.repeats} (trace "
              f"{t.get('trace_s', 0):.2f}, layer tables {t.get('layer_tables_s', 0):.2f}, "
              f"stage planner {t.get('stage_planner_s', 0):.2f}: baselines "
              f"{t.get('stage_planner.baselines_s', 0):.2f}, search "
              f"{t.get('stage_planner.search_s', 0):.2f}, simulator "
              f"{t.get('stage_planner.simulate_s', 0):.2f}){verdict}")
        sim = row["simulated_step_s"]
        print(f"    {row['replicas']} replicas, microbatch {row['microbatch_size']}, "
              f"{row['schedule']}, {row['status']}; per type {row['per_type']}; predicted "
              f"{row['predicted_step_time_s']:.3f} s/step, simulated "
              + (f"{sim:.3f} s" if sim is not None else "(not simulated: too many tasks)"))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    RESULTS.write_text(json.dumps({
        **previous,
        "benchmark": "plan_scale", "model": "gpt3-175b", "global_batch": BATCH,
        "sequence": 2048, "rows": rows,
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
