"""Layer cost tables of GPT-3 175B on the three-type clusters: time split, tables, textbook checks.

The step is the GPT-3 175B train step of ``models/`` (abstract ``ShapeDtypeStruct`` state, 96
blocks as an ``nnx.scan``, AdamW), traced at a reference microbatch of ``--reference-batch``
sequences of 2048 tokens, as ``make_plan`` traces it for the stage planner. Each repeat runs in
its own process (one run's caches do not help another) and measures:

* ``trace_s``: ``sp.trace`` of the step (the abstract state is built before, as a caller does);
* ``tables_s``: ``layer_costs`` on the cluster, split into the step facts (op rules, fusion,
  tying), the layouts, the relaxations' builds, pricing, solving, and the read-back per
  (group, size) (``LayerCosts.timings``).

The last repeat also prints the table per group and sub-mesh size (the block kind: forward and
backward seconds per sample, the recomputation of each remat policy, state bytes per device,
saved activation bytes per sample per device under each policy) and checks it against textbook
formulas for one block and one sequence of ``s`` tokens, width ``h``, ``a`` heads:

* forward FLOPs ``24 s h^2 (1 + s / 6h)`` (Narayanan et al. 2021, eq. 3 divided by 3 for the
  forward pass, without the logit layer), against the traced block's forward FLOPs;
* forward seconds on one device against those FLOPs at the device's bf16 peak times its
  matmul efficiency (the roofline lower bound: the ratio is the share of non-matmul time);
* state ``16`` bytes per parameter (fp32 weights, fp32 gradients, two fp32 Adam moments:
  the model config's ``param_dtype`` is float32), ``12 h^2 + 13 h`` parameters per block,
  against ``state_bytes * devices``;
* saved activations ``s h (34 + 5 a s / h)`` bytes without remat, ``34 s h`` with selective
  remat, ``2 s h`` with full remat (Korthikanti et al. 2022, Table 2 and section 4.2, bf16
  activations with dropout), against ``activation_bytes * devices`` on one device.

``--check-quality`` also runs the full mesh search of every (group, size) the way the tables
did before (``best_mesh``: the problem built and solved from scratch by ``ilp.solve``) and
reports, per (group, size), the objective of both (the predicted step seconds of the whole
step), how many nodes' strategies differ, and the largest relative difference of the table's
figures read back from either solution.

Before the shared search (commit 9af0005: one ``best_mesh`` per group and size, the placed
analysis read back for every layer), measured the same way on this 2-core machine at a load
average of 2.8 (three runs each, medians): h100_a100_l4x256 tables 46.8 s wall, 30.8 s CPU;
h100_a100_l4x1024 43.6 s wall, 30.1 s CPU (trace 0.8 to 1.4 s).

Prints tables and writes ``benchmarks/results/layer_tables.json``.

Usage: ``python benchmarks/layer_tables.py [--repeats 3] [--reference-batch 1]
[--clusters h100_a100_l4x256 h100_a100_l4x1024] [--check-quality]``
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

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results" / "layer_tables.json"
CLUSTERS = ("h100_a100_l4x256", "h100_a100_l4x1024")
TARGET_S = 5.0
"""The layer tables' share of the 10 s ``make_plan`` budget of issue 5, trace included."""
FIELDS = ("forward_s", "backward_s", "state_bytes", "update_s")


def _step(reference_batch: int):
    import shardplan_models as models
    config = models.load_model_config("gpt3-175b", overrides={"scan_layers": True})
    graphdef, state = models.abstract_train_state(config)
    batch = models.example_batch(config, reference_batch, abstract=True)
    return config, models.make_train_step(graphdef), state, batch


def _option_row(option) -> dict:
    return {"forward_s": option.forward_s[1], "backward_s": option.backward_s[1],
            "recompute_s": {p: v[1] for p, v in option.recompute_s.items()},
            "state_bytes": option.state_bytes,
            "activation_bytes": dict(option.activation_bytes), "update_s": option.update_s}


def _table(costs, cluster) -> list[dict]:
    rows = []
    for (g, d), choice in sorted(costs.choices.items()):
        group = cluster.groups[g]
        row = {"group": group.name, "device": group.device.name, "devices": d,
               "mesh": list(choice.mesh.axis_sizes), "objective_s": choice.solution.objective,
               "solver": choice.solution.stats.get("solver"),
               "kinds": {}}
        for kind in costs.kinds:
            (option,) = [o for o in kind.options[g] if o.devices == d]
            row["kinds"][kind.name] = _option_row(option)
        rows.append(row)
    return rows


def _checks(config, graph, costs, cluster, reference_batch: int) -> dict:
    """Ratios of the block's figures to the textbook formulas (module docstring)."""
    s, h, a = config.max_seq_len, config.d_model, config.n_heads
    b = reference_batch
    block_index = costs.layers.index(1) if 1 in costs.layers else 0
    kind = costs.kinds[costs.layers[block_index]]
    layer = [x for x in graph.layers if x.kind != "shared"][block_index]
    flops = 24 * s * h**2 * (1 + s / (6 * h))  # per sequence
    params = 12 * h**2 + 13 * h
    out: dict = {"block": kind.name, "textbook_forward_flops_per_sequence": flops,
                 "traced_forward_flops_per_sequence": layer.flops.get("forward", 0.0) / b}
    out["forward_flops_ratio"] = out["traced_forward_flops_per_sequence"] / flops
    korthikanti = {"none": s * h * (34 + 5 * a * s / h), "selective": 34 * s * h,
                   "full": 2 * s * h}
    per_group = {}
    for g, group in enumerate(cluster.groups):
        device = group.device
        ideal_s = flops / (device.flops_per_s("bf16") * device.efficiency.matmul)
        one = {o.devices: o for o in kind.options[g]}
        row: dict = {}
        if 1 in one:
            row["forward_s_over_roofline_1dev"] = one[1].forward_s[1] / ideal_s
            row["activation_ratio_1dev"] = {p: one[1].activation_bytes[p] / korthikanti[p]
                                            for p in korthikanti}
        row["state_ratio"] = {d: o.state_bytes * d / (16 * params) for d, o in one.items()}
        per_group[group.name] = row
    out["per_group"] = per_group
    return out


def _quality(graph, cluster, costs) -> list[dict]:
    """The fast tables against the full search of each (group, size), as it ran before."""
    from shardplan.planner.layer_costs import _Readback
    from shardplan.planner.mesh import MeshSearch, best_mesh

    search = MeshSearch(graph, cluster)
    reps = {}
    for i, k in enumerate(costs.layers):
        reps.setdefault(k, [x for x in graph.layers if x.kind != "shared"][i].index)
    readback = _Readback(graph, cluster, list(reps.values()), costs.reference_batch,
                         facts=search.facts)
    rows = []
    for (g, d), fast in sorted(costs.choices.items()):
        t0 = time.perf_counter()
        full = best_mesh(graph, cluster.groups[g].device_ids[:d], cluster, max_axes=2,
                         tie_period=1, time_limit_s=30.0, relative_gap=0.01)
        full_s = time.perf_counter() - t0
        layout = search.layout(full.mesh)
        got = readback(fast, search.layout(fast.mesh))
        want = readback(full, layout)
        worst: dict[str, float] = {}
        for i in reps.values():
            x, y = _option_row(got[i]), _option_row(want[i])
            for name in FIELDS:
                worst[name] = max(worst.get(name, 0.0), _rel(x[name], y[name]))
            for p in x["activation_bytes"]:
                worst[f"activation_{p}"] = max(worst.get(f"activation_{p}", 0.0),
                                               _rel(x["activation_bytes"][p],
                                                    y["activation_bytes"][p]))
                worst[f"recompute_{p}"] = max(worst.get(f"recompute_{p}", 0.0),
                                              _rel(x["recompute_s"][p], y["recompute_s"][p]))
        a, b = fast.solution.assignment or (), full.solution.assignment or ()
        rows.append({
            "group": g, "devices": d, "mesh": list(fast.mesh.axis_sizes),
            "full_mesh": list(full.mesh.axis_sizes), "full_search_s": full_s,
            "objective_s": fast.solution.objective, "full_objective_s": full.solution.objective,
            "objective_rel_diff": ((fast.solution.objective - full.solution.objective)
                                   / full.solution.objective),
            "nodes_differing": sum(x != y for x, y in zip(a, b, strict=True)),
            "worst_rel_diff": worst})
    return rows


def _rel(x: float, y: float) -> float:
    return 0.0 if x == y else abs(x - y) / max(abs(y), 1e-300)


def _child(cluster_name: str, reference_batch: int, detail: bool, quality: bool) -> dict:
    import shardplan as sp
    from shardplan.planner.layer_costs import layer_costs

    t0 = time.perf_counter()
    config, step, state, batch = _step(reference_batch)
    t1, c1 = time.perf_counter(), time.process_time()
    graph = sp.trace(step, state, batch)
    t2, c2 = time.perf_counter(), time.process_time()
    cluster = sp.Cluster.from_yaml(str(ROOT / "configs" / "clusters" / f"{cluster_name}.yaml"))
    t3, c3 = time.perf_counter(), time.process_time()
    costs = layer_costs(graph, cluster, reference_batch=reference_batch)
    t4, c4 = time.perf_counter(), time.process_time()
    timings = dict(costs.timings)
    per_submesh = timings.pop("per_submesh_s", {})
    out: dict = {"cluster": cluster_name, "state_build_s": t1 - t0, "trace_s": t2 - t1,
                 "tables_s": t4 - t3, "trace_cpu_s": c2 - c1, "tables_cpu_s": c4 - c3,
                 "load_average": os.getloadavg()[0], "timings": timings,
                 "per_submesh_s": {f"{cluster.groups[g].name}:{d}": v
                                   for (g, d), v in per_submesh.items()}}
    if detail:
        out["table"] = _table(costs, cluster)
        out["checks"] = _checks(config, graph, costs, cluster, reference_batch)
    if quality:
        out["quality"] = _quality(graph, cluster, costs)
    return out


def _run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True,
                         text=True, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                         cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _print_table(result: dict) -> None:
    print(f"{'group':>6}{'dev':>4}{'mesh':>7}{'fwd ms':>9}{'bwd ms':>9}{'sel ms':>8}"
          f"{'full ms':>8}{'state GB':>9}{'act none':>10}{'sel MB':>8}{'full MB':>8}"
          f"{'upd ms':>8}  block kind, per sample")
    for row in result["table"]:
        kinds = list(row["kinds"].values())
        k = kinds[1] if len(kinds) > 2 else kinds[0]
        act = k["activation_bytes"]
        print(f"{row['group']:>6}{row['devices']:>4}{'x'.join(map(str, row['mesh'])):>7}"
              f"{k['forward_s'] * 1e3:>9.2f}{k['backward_s'] * 1e3:>9.2f}"
              f"{k['recompute_s']['selective'] * 1e3:>8.2f}{k['recompute_s']['full'] * 1e3:>8.2f}"
              f"{k['state_bytes'] / 1e9:>9.2f}{act['none'] / 1e6:>10.0f}"
              f"{act['selective'] / 1e6:>8.0f}{act['full'] / 1e6:>8.1f}"
              f"{k['update_s'] * 1e3:>8.2f}")


def _print_checks(checks: dict) -> None:
    print(f"  forward FLOPs per sequence: traced {checks['traced_forward_flops_per_sequence']:.4g}"
          f", 24 s h^2 (1 + s/6h) = {checks['textbook_forward_flops_per_sequence']:.4g}"
          f" (ratio {checks['forward_flops_ratio']:.3f})")
    for name, row in checks["per_group"].items():
        states = ", ".join(f"{d}: {r:.3f}" for d, r in row["state_ratio"].items())
        line = f"  {name}: state x devices / (16 B x params) {states}"
        if "forward_s_over_roofline_1dev" in row:
            acts = ", ".join(f"{p} {r:.2f}" for p, r in row["activation_ratio_1dev"].items())
            line += (f"; forward s / bf16 matmul roofline {row['forward_s_over_roofline_1dev']:.3f}"
                     f"; activations / Korthikanti (1 device) {acts}")
        print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference-batch", type=int, default=1)
    parser.add_argument("--clusters", nargs="+", default=list(CLUSTERS))
    parser.add_argument("--check-quality", action="store_true")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, ref, detail, quality = args.child
        print(json.dumps(_child(name, int(ref), detail == "1", quality == "1")))
        return 0
    results = {}
    for name in args.clusters:
        runs = [_run_child(name, str(args.reference_batch), "0", "0")
                for _ in range(args.repeats - 1)]
        runs.append(_run_child(name, str(args.reference_batch), "1",
                               "1" if args.check_quality else "0"))
        last = runs[-1]
        median = {key: statistics.median(r[key] for r in runs)
                  for key in ("trace_s", "tables_s", "trace_cpu_s", "tables_cpu_s")}
        parts = {key: statistics.median(r["timings"][key] for r in runs)
                 for key in last["timings"] if isinstance(last["timings"][key], float)}
        total = statistics.median(r["trace_s"] + r["tables_s"] for r in runs)
        result = {"trace_s_median": median["trace_s"], "tables_s_median": median["tables_s"],
                  "trace_and_tables_s_median": total, "within_target": total <= TARGET_S,
                  "trace_cpu_s_median": median["trace_cpu_s"],
                  "tables_cpu_s_median": median["tables_cpu_s"],
                  "parts_s_median": parts,
                  "runs": [{k: r[k] for k in ("trace_s", "tables_s", "trace_cpu_s",
                                              "tables_cpu_s", "state_build_s", "load_average")}
                           for r in runs],
                  "per_submesh_s": last["per_submesh_s"], "table": last["table"],
                  "checks": last["checks"]}
        if "quality" in last:
            result["quality"] = last["quality"]
        results[name] = result
        loads = ", ".join(f"{r['load_average']:.1f}" for r in runs)
        print(f"\n{name}: trace {median['trace_s']:.2f} s + tables {median['tables_s']:.2f} s "
              f"= {total:.2f} s (median of {args.repeats}; target {TARGET_S} s: "
              f"{'PASS' if total <= TARGET_S else 'FAIL'}); CPU time: trace "
              f"{median['trace_cpu_s']:.2f} s + tables {median['tables_cpu_s']:.2f} s; load "
              f"average {loads}")
        print("  parts (median s): " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
        print("  per (group, size) search + read-back (s): " + ", ".join(
            f"{k} {v:.2f}" for k, v in last["per_submesh_s"].items()))
        _print_table(last)
        _print_checks(last["checks"])
        for q in result.get("quality", []):
            worst = max(q["worst_rel_diff"].items(), key=lambda kv: kv[1])
            print(f"  quality g{q['group']} d{q['devices']:>2}: objective "
                  f"{q['objective_s']:.6g} vs full search {q['full_objective_s']:.6g} "
                  f"(rel {q['objective_rel_diff']:+.1e}), {q['nodes_differing']} nodes differ, "
                  f"worst figure {worst[0]} {worst[1]:.1e}; full search {q['full_search_s']:.1f} s")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "layer_tables", "model": "gpt3-175b (scan, 96 blocks, abstract)",
        "reference_batch": args.reference_batch, "repeats": args.repeats,
        "target_s": TARGET_S, "clusters": results,
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
