"""Planning time and ILP size of GPT-3-shaped train steps vs layers, devices and layer tying.

Two measurements, each in its own process (so one run's caches do not help another):

1. **End to end**: ``sp.make_plan`` of the GPT-3 175B train step (abstract ``ShapeDtypeStruct``
   state, 96 layers as an ``nnx.scan``, AdamW) on 8 DGX A100 nodes (64 GPUs: NVLink inside,
   25 GB/s per GPU between nodes): trace, mesh search, ILP, plan; median of ``--repeats``.
   The global batch is 16 sequences of 2048 tokens and the memory budget is lifted: without
   rematerialisation or microbatching no batch of this model fits 80 GB per GPU by the cost
   model (the fully sharded AdamW state alone is 175e9 x 16 bytes / 64 = 44 GB per GPU, and one
   2048-token sequence's activations at 8-way tensor parallelism ~55 GB by Korthikanti et al.'s
   formula), so this measures planning time, not a runnable plan.
2. **Scaling**: the same model with 12, 24, 48 and 96 blocks as an ``nnx.scan`` (one body, so
   the problem does not grow with depth) on 8, 64, 512 and 1024 GPUs (1 to 128 DGX A100 nodes):
   the intra-op problem of each mesh candidate built and solved; problem size (nodes, edges,
   strategy pairs, solver variables), build and solve seconds, status.
3. **Tying**: the model as a Python loop of ``--loop-layers`` blocks on 8 GPUs, with every block
   tied to the first (period 1) and untied, solver limit ``--time-limit-s``.

Prints tables and writes ``benchmarks/results/solver_scale.json``.

Usage: ``python benchmarks/solver_scale.py [--repeats 3] [--loop-layers 4] [--time-limit-s 60]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "solver_scale.json"
BATCH = 16
TARGET_S = 5.0
LAYERS = (12, 24, 48, 96)
DEVICES = (8, 64, 512, 1024)


def _cluster(devices: int):
    import yaml

    import shardplan as sp

    spec = yaml.safe_load((Path(__file__).resolve().parent.parent / "configs" / "clusters"
                           / "dgx-a100x16.yaml").read_text())
    spec["groups"][0]["nodes"] = devices // 8
    spec["name"] = f"dgx-a100x{devices // 8}"
    return sp.Cluster.from_dict(spec)


def _step(layers: int, scan: bool):
    import shardplan_models as models
    config = models.load_model_config("gpt3-175b",
                                      overrides={"scan_layers": scan, "n_layers": layers})
    graphdef, state = models.abstract_train_state(config)
    batch = models.example_batch(config, BATCH, abstract=True)
    return models.make_train_step(graphdef), state, batch


def _end_to_end() -> dict:
    import shardplan as sp

    step, state, batch = _step(96, scan=True)
    cluster = _cluster(64)
    t0 = time.perf_counter()
    plan = sp.make_plan(step, state, batch, cluster=cluster,
                        config=sp.PlanConfig(memory_budget_bytes=1e15))
    seconds = time.perf_counter() - t0
    mesh = plan.stages[0].mesh
    return {"make_plan_s": seconds, "mesh": dict(zip(mesh.axis_names, mesh.axis_sizes,
                                                     strict=True)),
            "status": plan.solver["status"], "variables": plan.solver["variables"],
            "predicted_step_time_s": plan.predicted.step_time_s}


def _scaling(layers: int, scan: bool, devices_list: tuple[int, ...], periods: tuple[int, ...],
             time_limit_s: float) -> list[dict]:
    import shardplan as sp
    from shardplan.planner.intraop import build_intraop_problem
    from shardplan.planner.mesh import candidate_meshes
    from shardplan.solver import solve

    step, state, batch = _step(layers, scan=scan)
    t0 = time.perf_counter()
    graph = sp.trace(step, state, batch)
    trace_s = time.perf_counter() - t0
    rows = []
    for devices in devices_list:
        cluster = _cluster(devices)
        for mesh in candidate_meshes(cluster.groups[0].device_ids, cluster):
            for period in periods:
                t0 = time.perf_counter()
                ip = build_intraop_problem(graph, mesh, cluster, tie_period=period,
                                           time_limit_s=time_limit_s)
                t1 = time.perf_counter()
                solution = solve(ip.problem)
                t2 = time.perf_counter()
                p = ip.problem
                rows.append({
                    "layers": layers, "scan": scan, "devices": devices,
                    "mesh": list(mesh.axis_sizes), "tied": scan or period == 1,
                    "trace_s": trace_s, "build_s": t1 - t0,
                    "solve_s": t2 - t1, "nodes": len(p.nodes), "edges": len(p.edges),
                    "strategy_pairs": sum(len(e.cost) for e in p.edges),
                    "variables": solution.stats.get("variables"),
                    "lp_relaxation": solution.stats.get("lp_relaxation"),
                    "status": solution.status, "objective_s": solution.objective})
    return rows


def _child(kind: str, layers: int, time_limit_s: float) -> None:
    if kind == "end_to_end":
        out: object = _end_to_end()
    elif kind == "scaling":
        out = _scaling(layers, True, DEVICES, (1,), time_limit_s)
    else:
        out = _scaling(layers, False, (8,), (1, 0), time_limit_s)
    print(json.dumps(out))


def _run_child(*args: str) -> object:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True,
                         text=True, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="end-to-end runs (median)")
    parser.add_argument("--loop-layers", type=int, default=4)
    parser.add_argument("--time-limit-s", type=float, default=60.0)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, layers, limit = args.child
        _child(kind, int(layers), float(limit))
        return 0
    runs = [_run_child("end_to_end", "96", "0") for _ in range(args.repeats)]
    limit = str(args.time_limit_s)
    e2e = dict(runs[-1])  # type: ignore[arg-type]
    e2e["make_plan_s"] = statistics.median(r["make_plan_s"] for r in runs)  # type: ignore[index]
    e2e["make_plan_s_runs"] = [r["make_plan_s"] for r in runs]  # type: ignore[index]
    e2e["within_target"] = e2e["make_plan_s"] <= TARGET_S
    print(f"GPT-3 175B (scan, 96 layers), batch {BATCH} x 2048, 64 x A100 (8 nodes x 8): "
          f"make_plan median {e2e['make_plan_s']:.2f} s of {args.repeats} "
          f"(target {TARGET_S} s: {'PASS' if e2e['within_target'] else 'FAIL'}); mesh "
          f"{e2e['mesh']}, {e2e['status']}, {e2e['variables']} variables")
    rows: list[dict] = []
    for layers in LAYERS:
        rows += _run_child("scaling", str(layers), limit)  # type: ignore[arg-type]
    rows += _run_child("tying", str(args.loop_layers), limit)  # type: ignore[arg-type]
    print(f"{'layers':>6}{'blocks as':>10}{'devices':>8}{'mesh':>12}{'tied':>6}{'nodes':>7}"
          f"{'pairs':>10}{'vars':>9}{'build s':>9}{'solve s':>9}  status")
    for r in rows:
        print(f"{r['layers']:>6}{'scan' if r['scan'] else 'loop':>10}{r['devices']:>8}"
              f"{'x'.join(map(str, r['mesh'])):>12}"
              f"{'yes' if r['tied'] else 'no':>6}{r['nodes']:>7}{r['strategy_pairs']:>10}"
              f"{r['variables'] or 0:>9}{r['build_s']:>9.2f}{r['solve_s']:>9.2f}  {r['status']}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "solver_scale",
        "model": "gpt3-175b",
        "global_batch": BATCH,
        "end_to_end": e2e,
        "scaling": rows,
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
