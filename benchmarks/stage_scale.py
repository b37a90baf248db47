"""Stage planner solve time on GPT-3 175B over 1, 2 and 3 device types (256 GPUs per type) and
on a 1,024-GPU three-type cluster.

The problems are synthetic but sized as the real ones: 96 identical transformer layers (GPT-3
175B: ``h = 12288``, 96 heads, sequence 2048, bf16), a global batch of 1536 sequences,
microbatches of 1, 2, 4 or 8 sequences, GPipe / 1F1B / interleaved 1F1B (2 chunks), no /
selective / full remat, and sub-meshes of 1, 2, 4, 8, 16, 32 and 64 devices. Per device type,
from ``configs/devices/*.yaml``: peak bf16 FLOP/s times the matmul efficiency, memory (less the
planner's default 10 % headroom), HBM bandwidth and price; links, node sizes and device counts
from ``configs/clusters/h100_a100_l4x256.yaml`` and ``h100_a100_l4x1024.yaml``.

One layer on a sub-mesh of ``d`` devices (:func:`layer_option`) runs tensor parallel over
``tp = min(d, devices per node)`` devices of one node and data parallel over the ``d / tp``
node slices beyond it (each takes ``1 / dp`` of the microbatch):

* FLOPs per sample: forward ``24 s h^2 + 4 s^2 h``, backward twice that (Narayanan et al.
  2021, eq. 3: ``72 s h^2 (1 + s / 6h)`` for forward + backward + recomputation, less one
  forward); selective remat recomputes the attention core ``4 s^2 h``, full remat the whole
  forward;
* tensor parallelism adds 4 ring all-reduces of the activation ``2 s h`` bytes per sample
  (2 forward, 2 backward; Shoeybi et al. 2019) on the intra-node link;
* saved activations per sample per device (Korthikanti et al. 2022, Table 2 with sequence
  parallelism): ``s h (34 + 5 a s / h) / d`` bytes without remat, ``34 s h / d`` selective,
  ``2 s h`` full (the layer input);
* state ``16`` bytes per parameter ``/ d`` (bf16 weights and gradients, fp32 master weights
  and two Adam moments, sharded over the sub-mesh); gradients all-reduced across replicas
  ``2`` bytes per parameter; boundary activation ``2 s h`` bytes per sample;
* the update per step: the optimizer's pass over the state (read and write, at the HBM's
  memory-bound efficiency), plus, with ``dp > 1``, the gradient all-reduce among the node
  slices on the inter-node link.

Prints each case's solve time (median of ``--repeats``), the search statistics (whether the
plan is proven optimal; otherwise the proven lower bound and the gap to it) and the plan, and
writes ``benchmarks/results/stage_scale.json``. The solver runs with a time limit of
:data:`TIME_LIMIT_S`: at this scale the exact search does not finish, so the solve time is
about that limit, the plan is the quick plan (``shardplan.solver.stages.quick``) and
``stats.quick_s`` says how long finding it took.

Usage: ``python benchmarks/stage_scale.py [--repeats 3] [--case NAME ...]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import yaml

from shardplan.solver.stages.pipeline import (
    DeviceGroup,
    LayerKind,
    LayerOption,
    Link,
    PipelineProblem,
)
from shardplan.solver.stages.search import PipelineSolution, solve_pipeline

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results" / "stage_scale.json"

LAYERS = 96
HIDDEN = 12288
HEADS = 96
SEQ = 2048
BATCH = 1536
MICROBATCHES = (1, 2, 4, 8)
SUB_MESHES = (1, 2, 4, 8, 16, 32, 64)
HEADROOM = 0.1
"""The planner's default ``PlanConfig.memory_headroom``."""
TARGET_S = 3.0
"""The stage planner's share of the issue's 10 s ``make_plan`` budget."""
TIME_LIMIT_S = 2.5
"""``PipelineProblem.time_limit_s`` here: the exact search does not finish at this scale, so
the solve time is this limit plus the last step; ``stats.quick_s`` is when the plan was there."""

PARAMS = 12 * HIDDEN**2
"""Parameters per layer: QKV, output, two MLP matrices (biases and norms left out)."""
FORWARD_FLOPS = 24 * SEQ * HIDDEN**2 + 4 * SEQ**2 * HIDDEN
"""Forward FLOPs per sample and layer (Narayanan et al. 2021, eq. 3, divided by 3)."""
ATTENTION_FLOPS = 4 * SEQ**2 * HIDDEN
"""The attention core's FLOPs, what selective remat recomputes."""
ACTIVATION_BYTES = 2 * SEQ * HIDDEN
"""One layer's input or output activation per sample in bf16."""
STATE_BYTES_PER_PARAM = 16
GRADIENT_BYTES_PER_PARAM = 2
UPDATE_BYTES_PER_PARAM = 32
"""The optimizer reads and writes the 16 bytes of state per parameter."""

CASES = {
    "h100x256": ("h100_a100_l4x256.yaml", ("h100",)),
    "h100_a100x512": ("h100_a100_l4x256.yaml", ("h100", "a100")),
    "h100_a100_l4x768": ("h100_a100_l4x256.yaml", ("h100", "a100", "l4")),
    "h100_a100_l4x1024": ("h100_a100_l4x1024.yaml", ("h100", "a100", "l4")),
}
"""Case name -> (cluster file, the groups used from it)."""


def _link(spec: dict) -> Link:
    return Link(float(spec["bandwidth_GB_s"]) * 1e9, float(spec["latency_us"]) * 1e-6)


def _ring_s(nbytes: float, parts: int, link: Link) -> float:
    """A ring all-reduce of ``nbytes`` over ``parts`` devices (Patarasuk & Yuan 2009)."""
    if parts <= 1:
        return 0.0
    return 2 * (parts - 1) * (link.latency_s + nbytes / parts / link.bandwidth_bytes_per_s)


def layer_option(device: dict, d: int, per_node: int, intra: Link, inter: Link
                 ) -> LayerOption:
    """One GPT-3 layer on ``d`` devices of a type (the module docstring)."""
    tp, dp = min(d, per_node), max(1, d // per_node)
    flops_per_s = float(device["peak_flops_per_s"]["bf16"]) * float(
        device["efficiency"]["matmul"]) * tp * dp
    # Two ring all-reduces per pass: fixed part (latency) and per-sample part (bytes).
    comm_fixed = 2 * _ring_s(0.0, tp, intra)
    comm_sample = 2 * (_ring_s(ACTIVATION_BYTES, tp, intra) - _ring_s(0.0, tp, intra)) / dp
    forward = (comm_fixed, FORWARD_FLOPS / flops_per_s + comm_sample)
    backward = (comm_fixed, 2 * FORWARD_FLOPS / flops_per_s + comm_sample)
    recompute = {"none": (0.0, 0.0), "selective": (0.0, ATTENTION_FLOPS / flops_per_s),
                 "full": forward}
    activation = {"none": SEQ * HIDDEN * (34 + 5 * HEADS * SEQ / HIDDEN) / d,
                  "selective": 34 * SEQ * HIDDEN / d, "full": float(ACTIVATION_BYTES)}
    hbm = float(device["hbm_bandwidth_bytes_per_s"]) * float(device["efficiency"]["memory_bound"])
    update = UPDATE_BYTES_PER_PARAM * PARAMS / d / hbm
    update += _ring_s(GRADIENT_BYTES_PER_PARAM * PARAMS / tp, dp, inter)
    return LayerOption(d, forward, backward, recompute, activation,
                       STATE_BYTES_PER_PARAM * PARAMS / d, update)


def gpt3_problem(cluster_file: str, names: tuple[str, ...]) -> PipelineProblem:
    """GPT-3 175B on the groups ``names`` of ``configs/clusters/<cluster_file>``."""
    spec = yaml.safe_load((ROOT / "configs" / "clusters" / cluster_file).read_text())
    by_name = {g["name"]: g for g in spec["groups"]}
    groups, options = [], {}
    for gi, name in enumerate(names):
        g = by_name[name]
        device = yaml.safe_load((ROOT / "configs" / "devices" / f"{g['device']}.yaml").read_text())
        count, per_node = int(g["nodes"]) * int(g["devices_per_node"]), int(g["devices_per_node"])
        intra, inter = _link(g["intra_node"]), _link(g["inter_node"])
        groups.append(DeviceGroup(name, count, per_node,
                                  float(device["memory_bytes"]) * (1 - HEADROOM),
                                  float(device["price_per_hour_usd"]), intra, inter))
        options[gi] = tuple(layer_option(device, d, per_node, intra, inter)
                            for d in SUB_MESHES if d <= count)
    index = {name: i for i, name in enumerate(names)}
    pairs = {}
    for gl in spec.get("group_links", ()):
        if all(n in index for n in gl["groups"]):
            a, b = sorted(index[n] for n in gl["groups"])
            pairs[a, b] = _link(gl)
    kind = LayerKind("gpt3-block", options, float(ACTIVATION_BYTES),
                     float(GRADIENT_BYTES_PER_PARAM * PARAMS))
    return PipelineProblem((kind,), (0,) * LAYERS, tuple(groups), _link(spec["between_groups"]),
                           BATCH, MICROBATCHES, chunks=(2,), group_links=pairs,
                           time_limit_s=TIME_LIMIT_S)


def _plan_text(problem: PipelineProblem, solution: PipelineSolution) -> list[str]:
    plan, ev = solution.plan, solution.evaluation
    lines = [f"  {plan.schedule} (chunks {plan.chunks}), microbatch {plan.microbatch_size}, "
             f"{len(plan.replicas)} replicas; step {ev.step_time_s:.3f} s = pipeline "
             f"{max(ev.replica_time_s):.3f} + sync {ev.sync_s:.3f} + update {ev.update_s:.3f}"]
    for r, replica in enumerate(plan.replicas):
        stages = ", ".join(
            f"{len(s.layers)}L@{s.devices}x{problem.groups[s.group].name}/{s.remat}"
            for s in replica.stages)
        lines.append(f"  replica {r}: {replica.microbatches} microbatches: {stages}")
    return lines


def _plan_json(problem: PipelineProblem, solution: PipelineSolution) -> dict:
    plan, ev = solution.plan, solution.evaluation
    return {
        "schedule": plan.schedule, "chunks": plan.chunks,
        "microbatch_size": plan.microbatch_size,
        "step_time_s": ev.step_time_s, "pipeline_s": max(ev.replica_time_s),
        "sync_s": ev.sync_s, "update_s": ev.update_s,
        "replicas": [{"microbatches": r.microbatches,
                      "stages": [{"group": problem.groups[s.group].name, "devices": s.devices,
                                  "layers": len(s.layers), "remat": s.remat}
                                 for s in r.stages]} for r in plan.replicas],
    }


def run_case(name: str, repeats: int) -> dict:
    problem = gpt3_problem(*CASES[name])
    times, solution, plans = [], None, set()
    for _ in range(repeats):
        t0 = time.perf_counter()
        solution = solve_pipeline(problem)
        times.append(time.perf_counter() - t0)
        plans.add(json.dumps(_plan_json(problem, solution), sort_keys=True))
    assert solution is not None
    stats = solution.stats
    value = solution.evaluation.step_time_s
    out = {
        "case": name, "groups": [g.name for g in problem.groups],
        "devices": [g.count for g in problem.groups],
        "solve_s": statistics.median(times), "solve_s_all": times,
        "stats": {key: getattr(stats, key) for key in stats.__dataclass_fields__},
        "gap": value / stats.lower_bound - 1 if stats.lower_bound > 0 else None,
        "time_limit_s": problem.time_limit_s,
        "same_plan_every_repeat": len(plans) == 1,
        "plan": _plan_json(problem, solution),
    }
    print(f"{name}: {sum(out['devices'])} GPUs ({', '.join(out['groups'])}): solve "
          f"{out['solve_s']:.3f} s (median of {repeats}: "
          f"{', '.join(f'{t:.3f}' for t in times)})")
    print("  stats: " + ", ".join(f"{k} {v}" for k, v in out["stats"].items()
                                   if k != "solve_time_s")
          + (f"; gap to the lower bound {out['gap']:.1%}" if out["gap"] is not None else ""))
    print("\n".join(_plan_text(problem, solution)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--case", action="append", choices=sorted(CASES),
                        help="run only these cases (default: all)")
    args = parser.parse_args(argv)
    results = [run_case(name, args.repeats) for name in (args.case or CASES)]
    if not args.case:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({
            "benchmark": "stage_scale", "model": "gpt3-175b (96 identical layers, abstract)",
            "global_batch": BATCH, "target_s": TARGET_S, "cases": results,
            "machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                        "cpus": os.cpu_count()},
        }, indent=2) + "\n")
        print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
