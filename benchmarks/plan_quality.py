"""Plan quality: shardplan's pipeline plans against the baselines, all scored by the simulator.

For each (cluster, model) case: the train step is traced abstractly (``ShapeDtypeStruct`` state,
the blocks as an ``nnx.scan``) at ``REFERENCE_BATCH`` sequences, the layer cost tables are built
(:func:`shardplan.planner.layer_costs.layer_costs`: one intra-op solution per device group and
sub-mesh size; cached under ``--cache``, keyed by the model and cluster files and the cost
model's sources), and the :class:`~shardplan.solver.stages.pipeline.PipelineProblem` for the case's
global batch with ``1 - HEADROOM`` of each device's memory. Then, each timed:

* ``shardplan``: :func:`~shardplan.solver.stages.portfolio.plan_pipeline`, what ``make_plan`` runs:
  the stage planner's search (exact for the closed form within its budget) seeded with the
  data-parallel and Megatron plans, the final pick checked in the simulator;
* ``data_parallel``: :func:`~shardplan.solver.stages.baselines.data_parallel_only`;
* ``megatron``: :func:`~shardplan.solver.stages.baselines.megatron_grid` on every device;
* ``megatron_fastest``: the same grid on the fastest device type alone (heterogeneous only);
* ``homogeneous``: the same planner on the fastest device type alone (heterogeneous only).

Every plan is played out by :func:`~shardplan.solver.stages.simulate.simulate`; the tables report the
simulated throughput (samples/s), the closed form's, the speed-up of shardplan over each
baseline (simulated), and on heterogeneous clusters the share of the ideal gain reached:
``(thr(shardplan) / thr(homogeneous) - 1) / (ideal - 1)`` with ``ideal`` the effective matmul
FLOP/s of all types over the fastest type's (:func:`~shardplan.solver.stages.baselines.ideal_gain`).

Each case runs in a child process with a time limit (``--case-timeout-s``): a case whose layer
tables or search do not finish is reported as timed out, not dropped. A model that no plan
fits is reported infeasible with the planner's per-type device minimums.

Writes ``benchmarks/results/plan_quality.json`` and ``plan_quality.png`` (simulated throughput
per cluster, model and method; planning time against cluster size and device types, from
``plan_scale.json`` / ``stage_scale.json`` when present and from this run, with Sailor's and
Alpa's published planning times marked), and copies the PNG to ``docs/img/``.

A diagnostic, not a baseline: ``shardplan_no_interleaved``, the planner on the same problem
without the interleaved schedule (whose closed form is exact only on equal chunks). The
stage planner stops at the problem's time limit (``--time-limit-s`` overrides it); its
``stats`` (``optimal``, ``lower_bound``) are recorded per case. ``--extra LABEL=PATH`` reports
another run (e.g. the planner alone with a longer time limit) beside this one, its methods over
this run's per case; ``--from-json`` re-derives tables, verdicts and charts without running.

Usage::

    python benchmarks/plan_quality.py [--quick] [--cluster NAME ...] [--model NAME ...]
        [--methods NAME ...] [--time-limit-s S] [--case-timeout-s 1800] [--cache DIR]
        [--refresh-tables] [--no-chart] [--out PATH]
    python benchmarks/plan_quality.py --from-json RUN.json [--merge RUN2.json ...]
        [--extra LABEL=RUN3.json ...]

Needs ``pip install -e '.[bench]'`` (matplotlib) for the charts.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import os
import pickle
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT_JSON = RESULTS / "plan_quality.json"
OUT_PNG = RESULTS / "plan_quality.png"
README_PNG = ROOT / "docs" / "img" / "plan_quality.png"
DEFAULT_CACHE = Path("/tmp/shardplan-plan-quality-cache")

REFERENCE_BATCH = 8
"""Sequences the step is traced and the intra-op solutions chosen at; the tables scale per
sample from there (``layer_costs``)."""

HEADROOM = 0.10
"""Share of each device's memory left out of the plan: CUDA context, NCCL buffers, allocator
fragmentation (the planner's default headroom)."""

ACCEPT_SHARE = 0.75
"""Issue 5's acceptance: on a heterogeneous cluster, shardplan reaches this share of the ideal
gain over homogeneous-only (simulated) for at least one realistic model."""

NOT_WORSE = 1e-6
"""Relative slack under which two simulated step times count as equal (the simulator sums in
another order than the planner)."""

# (model, global batch in sequences). Batches follow common practice: 0.5-1M tokens for
# 1-7B models, 2-4M tokens for the larger ones (GPT-3: 1536 x 2048 = 3.1M tokens, Brown et
# al. 2020, table 2.1; Llama 2: 4M tokens = 1024 x 4096, Touvron et al. 2023).
CASES: dict[str, list[tuple[str, int]]] = {
    "a100x8_v100x8": [("gpt-1.3b", 512), ("gpt-2.7b", 512), ("gpt-6.7b", 512),
                      ("llama2-7b", 256), ("gpt-13b", 512)],
    "a100x64_v100x64": [("gpt-6.7b", 1024), ("gpt-13b", 1024), ("llama2-13b", 1024),
                        ("llama2-70b", 1024), ("mixtral-8x7b", 1024)],
    "h100_a100_l4x256": [("gpt-13b", 1536), ("llama2-70b", 1024), ("gpt3-175b", 1536),
                         ("mixtral-8x7b", 1024)],
    "dgx-a100x16": [("gpt-6.7b", 1024), ("llama2-13b", 1024), ("llama2-70b", 1024),
                    ("gpt3-175b", 1536)],
    "cloud-ethernet": [("gpt-1.3b", 512), ("gpt-6.7b", 512), ("llama2-7b", 256),
                       ("gpt-13b", 512)],
}
QUICK: dict[str, list[str]] = {
    "a100x8_v100x8": ["gpt-1.3b", "gpt-6.7b"],
    "dgx-a100x16": ["gpt-6.7b"],
    "cloud-ethernet": ["gpt-1.3b"],
}
METHODS = ("shardplan", "data_parallel", "megatron", "megatron_fastest", "homogeneous")
BASELINES = METHODS[1:]
NO_PLAN = {
    "data_parallel": "no group holds the whole model as one stage on any sub-mesh size of the "
                     "tables (one microbatch in flight, every remat)",
    "megatron": "no grid point (tensor size, stages, split, microbatch, remat, schedule) fits "
                "memory and the batch",
    "megatron_fastest": "no grid point on the fastest type fits memory and the batch",
    "homogeneous": "the fastest type alone cannot hold the model",
}
"""Why a baseline family has no plan (the functions return None)."""
SINGLE_TYPE = ("homogeneous", "megatron_fastest")
"""The methods whose plans use the fastest device type only."""
DIAGNOSTICS = ("shardplan_no_interleaved",)
"""Not baselines: the planner on the same problem without the interleaved schedule, whose
closed form is optimistic against the simulator (see the report in the results)."""

# Published planning times (seconds) for the chart.
SAILOR_S = {1: 0.3, 2: 6.2, 3: 4900.0}
"""Sailor (SOSP'25): 1, 2 and 3 GPU types at 256 GPUs per type (issue 5)."""
ALPA_S = (64, 2393.0)
"""Alpa (OSDI'22): GPT-39B on 64 GPUs (issue 5)."""


# --------------------------------------------------------------------------------------------
# One case (child process)


def _cache_key(model: str, cluster_name: str, layers: str) -> str:
    h = hashlib.sha256()
    h.update(layers.encode())
    for path in (ROOT / "configs" / "models" / f"{model}.yaml",
                 ROOT / "configs" / "clusters" / f"{cluster_name}.yaml",
                 *sorted((ROOT / "configs" / "devices").glob("*.yaml"))):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(str(REFERENCE_BATCH).encode())
    return h.hexdigest()[:16]


def _tables(model: str, cluster, cluster_name: str, cache: Path,
            refresh: bool, layers: str) -> tuple[Any, float, bool]:
    """The layer cost tables of ``model`` on ``cluster`` (cached), the seconds building them
    took (when built now; else the cached figure) and whether they came from the cache.

    The cache key covers the model, cluster and device files and the reference batch, not the
    code: after a change to the cost model or the intra-op planner pass ``--refresh-tables``.
    """
    path = cache / f"{model}@{cluster_name}-{_cache_key(model, cluster_name, layers)}.pkl"
    if path.exists() and not refresh:
        with path.open("rb") as f:
            costs, seconds = pickle.load(f)
        return costs, seconds, True
    import shardplan_models as models

    import shardplan as sp
    from shardplan.planner.layer_costs import layer_costs

    t0 = time.perf_counter()
    config = models.load_model_config(model, overrides={"scan_layers": layers == "scan"})
    graphdef, state = models.abstract_train_state(config)
    batch = models.example_batch(config, REFERENCE_BATCH, abstract=True)
    graph = sp.trace(models.make_train_step(graphdef), state, batch)
    costs = layer_costs(graph, cluster, reference_batch=REFERENCE_BATCH)
    seconds = time.perf_counter() - t0
    # The intra-op solutions behind the options (``choices``) are not needed here and hold
    # closures that do not pickle.
    costs = dataclasses.replace(costs, choices={})
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        pickle.dump((costs, seconds), f)
    tmp.replace(path)
    return costs, seconds, False


def _plan_json(problem, plan) -> dict[str, Any]:
    """A compact description: identical replicas counted once."""
    shapes: dict[tuple, list[int]] = {}
    for r in plan.replicas:
        key = tuple((s.group, s.devices, len(s.layers), s.remat) for s in r.stages)
        shapes.setdefault(key, []).append(r.microbatches)
    return {
        "microbatch_size": plan.microbatch_size, "schedule": plan.schedule,
        "chunks": plan.chunks, "replicas": len(plan.replicas),
        "devices": {g.name: sum(s.devices for r in plan.replicas for s in r.stages
                                if s.group == i) for i, g in enumerate(problem.groups)},
        "shapes": [{"count": len(ms), "microbatches": sorted(set(ms)),
                    "stages": [f"{problem.groups[g].name}x{d}:{n}L:{remat}"
                               for g, d, n, remat in key]}
                   for key, ms in shapes.items()],
    }


def _proposed_step_s(plan, ev) -> float:
    """A candidate correction of the closed form, recorded to compare with the simulator (not
    used by any method). 1F1B: the steady-state period is at least every window of stages'
    ``(sum t + sum c) / stages`` (a window holds one microbatch fewer per stage down the
    pipe, so its transfers are not hidden; simulate.py's docstring, 1F1B (b)) and half a
    hop's round trip (the link is duplex), not ``max(max t, max c)``. Interleaved: ``(m - 1 /
    v)`` bottleneck periods, not ``(m - 1)`` (Narayanan et al. 2021, Sec. 2.2), which makes a
    one-stage "pipeline" cost ``m t``. GPipe: as the closed form."""
    v = plan.chunks if plan.schedule == "interleaved" else 1
    times = []
    for r, replica in enumerate(plan.replicas):
        t, c, m = ev.stage_time_s[r], ev.hop_time_s[r], replica.microbatches
        if plan.schedule == "1f1b":
            period = max(max(t), max(c, default=0.0) / 2)
            for i in range(len(t)):
                for j in range(i, len(t)):
                    period = max(period, (sum(t[i:j + 1]) + sum(c[i:j])) / (j - i + 1))
            times.append(sum(t) + sum(c) + (m - 1) * period)
        else:
            period = max(max(t), max(c, default=0.0))
            times.append((sum(t) + sum(c)) / v + (m - (1 / v if v > 1 else 1)) * period)
    return max(times) + ev.sync_s + ev.update_s


def _score(problem, plan, plan_s: float) -> dict[str, Any]:
    from shardplan.solver.stages.pipeline import evaluate_pipeline
    from shardplan.solver.stages.simulate import simulate

    ev = evaluate_pipeline(problem, plan)
    t0 = time.perf_counter()
    sim = simulate(problem, plan)
    sim_s = time.perf_counter() - t0
    peak_ok = all(sim.peak_memory_bytes[r][i] <= problem.groups[s.group].memory_bytes
                  * (1 + 1e-9) for r, rep in enumerate(plan.replicas)
                  for i, s in enumerate(rep.stages))
    return {
        "feasible": ev.feasible, "violations": list(ev.violations),
        "plan_s": plan_s, "simulate_s": sim_s,
        "closed_step_s": ev.step_time_s, "sim_step_s": sim.step_time_s,
        "closed_throughput": problem.batch / ev.step_time_s,
        "sim_throughput": problem.batch / sim.step_time_s,
        "closed_vs_sim": ev.step_time_s / sim.step_time_s - 1.0,
        "proposed_vs_sim": _proposed_step_s(plan, ev) / sim.step_time_s - 1.0,
        "closed": {"pipeline_s": max(ev.replica_time_s), "sync_s": ev.sync_s,
                   "update_s": ev.update_s},
        "sim": {"pipeline_s": max(sim.replica_time_s), "sync_s": sim.sync_s,
                "update_s": sim.update_s, "bubble_fraction": sim.bubble_fraction},
        "sim_memory_fits": peak_ok,
        "plan": _plan_json(problem, plan),
    }


def _table_ideal_gain(problem, fastest: int) -> float:
    """The ideal gain as the layer tables see it: per group, the most samples per
    device-second any sub-mesh size reaches on the whole model (forward + backward, no remat,
    no pipeline, no communication between stages or replicas), times the group's devices,
    summed over groups, over the fastest group's. Where it is below the FLOP/s ideal, the
    tables (e.g. V100 attention at a lower efficiency than its matmuls) leave the slower
    types less to give than their matmul FLOP/s suggest."""
    rates = []
    for g, group in enumerate(problem.groups):
        best = 0.0
        sizes = sorted({o.devices for k in problem.kinds for o in k.options.get(g, ())})
        for d in sizes:
            opts = [problem.kinds[k].option(g, d) for k in problem.layers]
            if any(o is None for o in opts):
                continue
            per_sample = sum(o.forward_s[1] + o.backward_s[1] for o in opts if o is not None)
            if per_sample > 0:
                best = max(best, 1.0 / (d * per_sample))
        rates.append(best * group.count)
    return sum(rates) / rates[fastest] if rates[fastest] > 0 else math.nan


def run_case(cluster_name: str, model: str, batch: int, cache: Path, *,
             refresh: bool = False, methods: tuple[str, ...] = METHODS + DIAGNOSTICS,
             time_limit_s: float | None = None, layers: str = "loop") -> dict[str, Any]:
    """Everything about one (cluster, model): tables, problem, every method, scores."""
    import shardplan as sp
    from shardplan.errors import InfeasibleError
    from shardplan.planner.alternatives import unused_types
    from shardplan.planner.multi import effective_matmul_flops_per_s, pipeline_problem
    from shardplan.solver.stages.baselines import (
        data_parallel_only,
        homogeneous_only,
        ideal_gain,
        megatron_grid,
    )
    from shardplan.solver.stages.portfolio import plan_pipeline
    from shardplan.solver.stages.search import PipelineInfeasibleError

    cluster = sp.Cluster.from_yaml(ROOT / "configs" / "clusters" / f"{cluster_name}.yaml")
    flops = [effective_matmul_flops_per_s(g.device, len(g.device_ids)) for g in cluster.groups]
    per_device = [effective_matmul_flops_per_s(g.device, 1) for g in cluster.groups]
    fastest = max(range(len(per_device)), key=lambda g: (per_device[g], -g))
    out: dict[str, Any] = {
        "cluster": cluster_name, "model": model, "batch": batch,
        "groups": [g.name for g in cluster.groups],
        "devices": [len(g.device_ids) for g in cluster.groups],
        "effective_matmul_flops_per_s": flops, "fastest": cluster.groups[fastest].name,
        "ideal_gain": ideal_gain(flops), "layers": layers,
    }
    costs, table_s, cached = _tables(model, cluster, cluster_name, cache, refresh, layers)
    out["tables_s"], out["tables_cached"] = table_s, cached
    print(f"  {cluster_name} {model} tables: {table_s:.1f} s{' (cached)' if cached else ''}",
          file=sys.stderr, flush=True)
    memory = [(1 - HEADROOM) * g.device.memory_bytes for g in cluster.groups]
    problem = pipeline_problem(costs, cluster, batch=batch, memory_bytes=memory)
    out["table_ideal_gain"] = _table_ideal_gain(problem, fastest)
    out["problem"] = {"layers": len(problem.layers), "kinds": len(problem.kinds),
                      "microbatch_sizes": list(problem.microbatch_sizes),
                      "submesh_sizes": {g.name: sorted({o.devices for k in problem.kinds
                                                        for o in k.options.get(i, ())})
                                        for i, g in enumerate(problem.groups)}}

    def timed(fn):
        t0 = time.perf_counter()
        try:
            plan = fn()
        except InfeasibleError as err:
            plan = err
        return plan, time.perf_counter() - t0

    stats: dict[str, Any] = {}

    def solve(p, key: str = "shardplan"):
        # What make_plan runs: the search seeded with the data-parallel and Megatron plans,
        # the final pick checked in the simulator (shardplan/solver/stages/portfolio.py).
        if time_limit_s is not None:
            p = dataclasses.replace(p, time_limit_s=time_limit_s)
        choice = plan_pipeline(p)
        stats[key] = {k: getattr(choice.stats, k) for k in choice.stats.__dataclass_fields__}
        # what make_plan records for Plan.explain: per unused device type, the fastest
        # candidate that uses it and what it loses on
        stats[key]["unused_types"] = unused_types(choice, p)
        stats[key]["chosen"] = choice.source
        stats[key]["timings"] = choice.timings
        return choice.plan

    no_interleaved = tuple(s for s in problem.schedules if s != "interleaved")

    runs = {"shardplan": lambda: solve(problem),
            "shardplan_no_interleaved": lambda: solve(
                dataclasses.replace(problem, schedules=no_interleaved),
                "shardplan_no_interleaved"),
            "data_parallel": lambda: data_parallel_only(problem),
            "megatron": lambda: megatron_grid(problem)}
    if len(cluster.groups) > 1:
        runs["megatron_fastest"] = lambda: megatron_grid(problem, groups=(fastest,))
        runs["homogeneous"] = lambda: homogeneous_only(
            problem, lambda p: solve(p, "homogeneous"), group=fastest)
    results: dict[str, Any] = {}
    for name, fn in runs.items():
        if name not in methods:
            continue
        plan, seconds = timed(fn)
        if plan is None or isinstance(plan, Exception):
            entry: dict[str, Any] = {"feasible": False, "plan_s": seconds}
            if isinstance(plan, PipelineInfeasibleError):
                report = plan.report
                entry["reason"] = report.reason
                entry["min_devices"] = dict(zip(out["groups"], report.min_devices,
                                                strict=True))
            results[name] = entry
        else:
            results[name] = _score(problem, plan, seconds)
        if name in stats:
            results[name]["stats"] = stats[name]
        print(f"  {cluster_name} {model} {name}: {seconds:.2f} s", file=sys.stderr, flush=True)
    out["methods"] = results
    return out


# --------------------------------------------------------------------------------------------
# Summary


def _versus(case: dict[str, Any], ours_name: str) -> dict[str, Any]:
    """Speed-ups of ``ours_name`` over each baseline (simulated and closed form) and its share
    of the ideal gain over homogeneous-only."""
    m = case.get("methods", {})
    ours = m.get(ours_name, {})
    out: dict[str, Any] = {"speedup_sim": {}, "speedup_closed": {}}
    if not ours.get("feasible"):
        return out
    for name in BASELINES:
        b = m.get(name)
        if b and b.get("feasible"):
            out["speedup_sim"][name] = ours["sim_throughput"] / b["sim_throughput"]
            out["speedup_closed"][name] = ours["closed_throughput"] / b["closed_throughput"]
    out["never_worse_sim"] = all(x >= 1 - NOT_WORSE for x in out["speedup_sim"].values())
    out["worse_than"] = sorted(k for k, x in out["speedup_sim"].items() if x < 1 - NOT_WORSE)
    ideal = case["ideal_gain"]
    hom = m.get("homogeneous", {})
    if ideal > 1 and hom.get("feasible"):
        gain = ours["sim_throughput"] / hom["sim_throughput"]
        out["gain_over_homogeneous_sim"] = gain
        out["ideal_share_sim"] = (gain - 1) / (ideal - 1)
        gain_c = ours["closed_throughput"] / hom["closed_throughput"]
        out["gain_over_homogeneous_closed"] = gain_c
        out["ideal_share_closed"] = (gain_c - 1) / (ideal - 1)
        # Strict: against the best simulated plan on the fastest type that any method found
        # (the planner's own homogeneous plan inherits the closed form's errors).
        single = max(m[k]["sim_throughput"] for k in SINGLE_TYPE if m.get(k, {}).get("feasible"))
        out["ideal_share_sim_strict"] = (ours["sim_throughput"] / single - 1) / (ideal - 1)
    return out


def _derived(case: dict[str, Any]) -> dict[str, Any]:
    """:func:`_versus` for shardplan, and for each diagnostic variant under ``diagnostics``."""
    out = _versus(case, "shardplan")
    out["diagnostics"] = {name: _versus(case, name) for name in DIAGNOSTICS
                          if name in case.get("methods", {})}
    return out


def _acceptance(cases: list[dict[str, Any]], variant: str = "shardplan") -> dict[str, Any]:
    """Issue 5's third acceptance line for ``variant`` (shardplan or a diagnostic), simulated."""

    def derived(c: dict[str, Any]) -> dict[str, Any]:
        d = c.get("derived", {})
        return d if variant == "shardplan" else d.get("diagnostics", {}).get(variant, {})

    hetero = {}
    for cluster in ("a100x8_v100x8", "a100x64_v100x64", "h100_a100_l4x256"):
        shares = {c["model"]: derived(c).get("ideal_share_sim") for c in cases
                  if c["cluster"] == cluster}
        strict = {c["model"]: derived(c).get("ideal_share_sim_strict") for c in cases
                  if c["cluster"] == cluster}
        best = max((x for x in shares.values() if x is not None), default=None)
        best_strict = max((x for x in strict.values() if x is not None), default=None)
        hetero[cluster] = {"ideal_share_sim": shares, "best": best,
                           "meets": best is not None and best >= ACCEPT_SHARE,
                           "ideal_share_sim_strict": strict, "best_strict": best_strict,
                           "meets_strict": best_strict is not None
                           and best_strict >= ACCEPT_SHARE}
    worse = [{"cluster": c["cluster"], "model": c["model"], "worse_than": derived(c)["worse_than"],
              "speedup_sim": derived(c)["speedup_sim"]}
             for c in cases if derived(c).get("worse_than")]
    homogeneous = [c for c in cases if len(c.get("groups", ())) == 1]
    megatron_ok = all(derived(c).get("speedup_sim", {}).get("megatron", math.inf)
                      >= 1 - NOT_WORSE for c in homogeneous)
    return {"variant": variant, "ideal_share": hetero,
            "never_worse_than_any_baseline_sim": not worse, "cases_worse": worse,
            "never_worse_than_megatron_on_homogeneous_sim": megatron_ok}


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _print_table(cases: list[dict[str, Any]]) -> None:
    shown = METHODS + DIAGNOSTICS
    head = (f"{'cluster':17} {'model':13} {'batch':>5} | "
            + " ".join(f"{n[:11]:>11}" for n in shown)
            + " | closed/sim-1 | ideal  share strict | plan_s")
    print("simulated throughput, samples/s (x: no feasible plan); share: of the ideal gain over "
          "homogeneous-only, strict: over the best fastest-type plan of any method")
    print(head)
    print("-" * len(head))
    for c in cases:
        if "error" in c:
            print(f"{c['cluster']:17} {c['model']:13} {c['batch']:>5} | {c['error']}")
            continue
        m, d = c["methods"], c["derived"]
        cells = []
        for name in shown:
            e = m.get(name)
            cells.append(f"{'':>11}" if e is None else (
                f"{e['sim_throughput']:>11.1f}" if e.get("feasible") else f"{'x':>11}"))
        ours = m.get("shardplan", {})
        gap = _fmt(100 * ours["closed_vs_sim"], "+.1f") + "%" if ours.get("feasible") else "-"
        share, strict = d.get("ideal_share_sim"), d.get("ideal_share_sim_strict")
        print(f"{c['cluster']:17} {c['model']:13} {c['batch']:>5} | " + " ".join(cells)
              + f" | {gap:>12} | {c['ideal_gain']:.3f} "
              + f"{_fmt(None if share is None else 100 * share):>5}% "
              + f"{_fmt(None if strict is None else 100 * strict):>5}%"
              + f" | {_fmt(ours.get('plan_s'), '.2f')}")


# --------------------------------------------------------------------------------------------
# Charts


def _scale_points() -> list[dict[str, Any]]:
    """Planning times from plan_scale.json / stage_scale.json: (source, devices, types, s)."""
    points = []
    for name in ("plan_scale.json", "stage_scale.json"):
        path = RESULTS / name
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        for case in data.get("cases", data.get("rows", [])):
            devices = case.get("devices")
            total = sum(devices) if isinstance(devices, list) else devices
            groups = case.get("groups")
            types = (len(groups) if isinstance(groups, list)
                     else case.get("device_types", case.get("types")))
            seconds = next((case[k] for k in ("make_plan_s", "plan_s", "solve_s", "seconds")
                            if isinstance(case.get(k), int | float)), None)
            if total and types and seconds is not None:
                points.append({"source": name.removesuffix(".json"), "devices": total,
                               "types": types, "seconds": seconds})
    return points


def _reference(case: dict[str, Any]) -> float | None:
    """The simulated throughput a case's bars are relative to: on a heterogeneous cluster the
    best plan on the fastest type alone (the planner's or the Megatron grid's: the planner's
    own inherits the closed form's errors), on a one-type cluster the Megatron grid's."""
    m = case.get("methods", {})
    names = SINGLE_TYPE if len(case.get("groups", ())) > 1 else ("megatron",)
    found = [m[k]["sim_throughput"] for k in names if m.get(k, {}).get("feasible")]
    return max(found) if found else None


def draw(cases: list[dict[str, Any]], path: Path) -> None:
    """Simulated throughput per cluster, model and method (relative to homogeneous-only, or
    to the Megatron grid on a one-type cluster), and planning time against cluster size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter
    except ImportError:
        raise SystemExit("plan_quality.py draws its charts with matplotlib: "
                         "pip install -e '.[bench]' (or pass --no-chart)") from None
    clusters = [c for c in CASES if any(x["cluster"] == c and "methods" in x for x in cases)]
    columns = 3
    rows_n = (len(clusters) + 1 + columns - 1) // columns
    fig = plt.figure(figsize=(15, 4.6 * rows_n + 0.6), layout="constrained")
    grid = fig.add_gridspec(rows_n, columns)
    colors = {"shardplan": "#1f77b4", "shardplan_no_interleaved": "#aec7e8",
              "data_parallel": "#bbbbbb", "megatron": "#ff7f0e", "megatron_fastest": "#ffbb78",
              "homogeneous": "#2ca02c"}
    shown = METHODS + DIAGNOSTICS
    for i, cluster in enumerate(clusters):
        ax = fig.add_subplot(grid[i // columns, i % columns])
        rows = [x for x in cases if x["cluster"] == cluster and "methods" in x]
        width = 0.84 / len(shown)
        for j, name in enumerate(shown):
            xs, ys = [], []
            for k, r in enumerate(rows):
                ref = _reference(r)
                e = r["methods"].get(name, {})
                if ref and e.get("feasible"):
                    xs.append(k + (j - (len(shown) - 1) / 2) * width)
                    ys.append(e["sim_throughput"] / ref)
            ax.bar(xs, ys, width, label=name.replace("_", " "), color=colors[name],
                   hatch="//" if name in DIAGNOSTICS else None, edgecolor="white", linewidth=0.3)
        ideal = rows[0]["ideal_gain"] if rows else 1.0
        if ideal > 1:
            ax.axhline(ideal, color="black", linestyle="--", linewidth=0.8)
            ax.axhline(1 + ACCEPT_SHARE * (ideal - 1), color="black", linestyle=":",
                       linewidth=0.8)
        ax.axhline(1.0, color="#2ca02c" if ideal > 1 else "#ff7f0e", linewidth=0.6)
        ax.set_xticks(range(len(rows)), [r["model"] for r in rows], rotation=35, ha="right",
                      fontsize=8)
        ax.set_title(cluster + ("" if ideal > 1 else " (one type)"), fontsize=9)
        ax.tick_params(axis="y", labelsize=8)
        if i % columns == 0:
            ax.set_ylabel("simulated throughput / reference", fontsize=8)
        if i == 0:
            ax.plot([], [], color="black", linestyle="--", label="ideal gain")
            ax.plot([], [], color="black", linestyle=":", label="75 % of ideal gain")
            fig.legend(fontsize=7, loc="outside lower center", ncols=8)
    fig.suptitle("Simulated throughput relative to the best plan on the fastest device type "
                 "alone (one-type clusters: to the Megatron grid); planning time", fontsize=10)
    ax = fig.add_subplot(grid[len(clusters) // columns, len(clusters) % columns])
    markers = {1: "o", 2: "s", 3: "^"}
    for p in _scale_points():
        ax.scatter(p["devices"], p["seconds"], marker=markers.get(p["types"], "x"),
                   color="#1f77b4" if p["source"] == "plan_scale" else "#17becf",
                   label=f"shardplan {p['source']} ({p['types']} type(s))")
    for c in cases:
        ours = c.get("methods", {}).get("shardplan", {})
        if "plan_s" in ours:
            ax.scatter(sum(c["devices"]), ours["plan_s"], marker=markers.get(len(c["groups"])),
                       color="#9467bd",
                       label=f"shardplan stage planner, this run ({len(c['groups'])} type(s))")
    for types, seconds in SAILOR_S.items():
        ax.scatter(256 * types, seconds, marker=markers[types], facecolors="none",
                   edgecolors="#d62728", s=80, label=f"Sailor, published ({types} type(s))")
    ax.scatter(*ALPA_S, marker="*", color="#8c564b", s=120, label="Alpa GPT-39B, published")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = [16, 32, 64, 128, 256, 512, 768, 1024]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.tick_params(axis="both", labelsize=8)
    ax.set_xlabel("GPUs in the cluster", fontsize=8)
    ax.set_ylabel("planning time, s", fontsize=8)
    ax.set_title("planning time (log-log)", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=6, loc="center left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Driver


def _child_run(args: argparse.Namespace) -> int:
    cluster, model, batch = args.child
    case = run_case(cluster, model, int(batch), Path(args.cache), refresh=args.refresh_tables,
                    methods=tuple(args.methods), time_limit_s=args.time_limit_s,
                    layers=args.layers)
    print(json.dumps(case))
    return 0


def _run_child(cluster: str, model: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", cluster, model, str(batch), "--cache",
           args.cache, "--layers", args.layers, "--methods", *args.methods]
    if args.refresh_tables:
        cmd.append("--refresh-tables")
    if args.time_limit_s is not None:
        cmd += ["--time-limit-s", str(args.time_limit_s)]
    timeout_s = args.case_timeout_s
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
    except subprocess.TimeoutExpired:
        return {"cluster": cluster, "model": model, "batch": batch,
                "error": f"timed out after {timeout_s:.0f} s"}
    sys.stderr.write(out.stderr[-4000:] if out.returncode else "")
    if out.returncode:
        last = out.stderr.strip().splitlines()[-1:] or ["?"]
        return {"cluster": cluster, "model": model, "batch": batch,
                "error": f"failed: {last[0][:200]}"}
    case = json.loads(out.stdout.strip().splitlines()[-1])
    case["wall_s"] = time.perf_counter() - t0
    return case


def _code_state() -> dict[str, Any]:
    """The commit the run used and the package files that differed from it (the results
    depend on the solver and cost model as they were)."""
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout.rstrip("\n")
        except (OSError, subprocess.CalledProcessError):
            return ""

    changed = [line[3:] for line in git("status", "--porcelain", "shardplan").splitlines()]
    return {"commit": git("rev-parse", "HEAD"), "changed": changed,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small subset (minutes)")
    parser.add_argument("--cluster", nargs="*", help="only these clusters")
    parser.add_argument("--model", nargs="*", help="only these models")
    parser.add_argument("--case-timeout-s", type=float, default=1800.0)
    parser.add_argument("--cache", default=str(DEFAULT_CACHE), help="layer table cache")
    parser.add_argument("--refresh-tables", action="store_true",
                        help="rebuild the layer tables (after a cost model change)")
    parser.add_argument("--time-limit-s", type=float, default=None,
                        help="the stage planner's time limit (default: the problem's)")
    parser.add_argument("--methods", nargs="*", default=list(METHODS + DIAGNOSTICS),
                        choices=METHODS + DIAGNOSTICS,
                        help="methods to run (default all; none: only build the tables)")
    parser.add_argument("--layers", choices=("loop", "scan"), default="loop",
                        help="trace the models' blocks as a Python loop (as HuggingFace Flax "
                             "models and most user code write them) or as an nnx.scan stack")
    parser.add_argument("--no-chart", action="store_true")
    parser.add_argument("--out", default=str(OUT_JSON), help="results JSON")
    parser.add_argument("--from-json", metavar="PATH",
                        help="re-derive the tables, verdicts and charts from an earlier run's "
                             "JSON (its cases merged over by --merge files), without running")
    parser.add_argument("--merge", nargs="*", default=[], metavar="PATH",
                        help="with --from-json: runs whose methods replace those of the same "
                             "(cluster, model) there")
    parser.add_argument("--extra", nargs="*", default=[], metavar="LABEL=PATH",
                        help="another run (e.g. a longer --time-limit-s, some methods only) "
                             "reported beside this one: its methods over this run's, per case")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    return parser


def _selected(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    todo = []
    for cluster, models in CASES.items():
        if args.cluster and cluster not in args.cluster:
            continue
        for model, batch in models:
            if args.model and model not in args.model:
                continue
            if args.quick and model not in QUICK.get(cluster, ()):
                continue
            todo.append((cluster, model, batch))
    return todo


def _merged(paths: list[str], todo: list[tuple[str, str, int]],
            base: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The cases of ``todo`` from ``base`` and the JSON files in order, a later file's methods
    replacing an earlier one's of the same (cluster, model)."""
    merged: dict[tuple[str, str], dict[str, Any]] = {
        (c["cluster"], c["model"]): c for c in (base or [])}
    for path in paths:
        for case in json.loads(Path(path).read_text())["cases"]:
            key = (case["cluster"], case["model"])
            if key in merged and "methods" in merged[key] and "methods" in case:
                case = {**merged[key], **case,
                        "methods": {**merged[key]["methods"], **case["methods"]}}
            merged[key] = case
    order = {key: i for i, key in enumerate((c, m) for c, m, _ in todo)}
    return sorted((c for key, c in merged.items() if key in order),
                  key=lambda c: order[(c["cluster"], c["model"])])


def _report(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Derives each case's figures, prints the table and the verdicts, returns the latter."""
    for case in cases:
        for name, entry in case.get("methods", {}).items():
            if not entry.get("feasible") and "reason" not in entry and name in NO_PLAN:
                entry["reason"] = NO_PLAN[name]
        if "methods" in case:
            case["derived"] = _derived(case)
    _print_table(cases)
    acceptance = _acceptance(cases)
    diagnostics = {name: _acceptance(cases, name) for name in DIAGNOSTICS}
    for a in (acceptance, *diagnostics.values()):
        shares = ", ".join(
            f"{k} {_fmt(None if v['best'] is None else 100 * v['best'])}% (strict "
            f"{_fmt(None if v['best_strict'] is None else 100 * v['best_strict'])}%)"
            for k, v in a["ideal_share"].items())
        print(f"{a['variant']}: ideal share (best per cluster) {shares}; never worse than any "
              f"baseline: {a['never_worse_than_any_baseline_sim']}; never worse than Megatron "
              f"on homogeneous: {a['never_worse_than_megatron_on_homogeneous_sim']}")
    return {"acceptance": acceptance, "acceptance_diagnostics": diagnostics}


def main() -> int:
    args = _parser().parse_args()
    if args.child:
        return _child_run(args)
    todo = _selected(args)
    code = _code_state()
    if args.from_json:
        cases = _merged([args.from_json, *args.merge], todo)
        source = json.loads(Path(args.from_json).read_text())
        code = source.get("code", {"unknown": args.from_json})
        default_limit = source.get("default_time_limit_s")
        if args.time_limit_s is None:
            args.time_limit_s = source.get("time_limit_s")
    else:
        from shardplan.solver.stages.pipeline import PipelineProblem

        default_limit = PipelineProblem.time_limit_s
        cases = []
        for cluster, model, batch in todo:
            print(f"{cluster} / {model} / batch {batch} ...", file=sys.stderr, flush=True)
            cases.append(_run_child(cluster, model, batch, args))
    out: dict[str, Any] = {
        "benchmark": "plan_quality", "reference_batch": REFERENCE_BATCH, "headroom": HEADROOM,
        "accept_share": ACCEPT_SHARE, "quick": args.quick, "layers": args.layers,
        "time_limit_s": args.time_limit_s if args.time_limit_s is not None else "default",
        "default_time_limit_s": default_limit,
        "code": code, "cases": cases, **_report(cases), "extra_runs": {},
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                    "cpus": os.cpu_count()},
    }
    for extra in args.extra:
        label, _, path = extra.partition("=")
        print(f"\n--- {label} ({path}): its methods over this run's ---")
        mine = {(c["cluster"], c["model"]) for c in json.loads(Path(path).read_text())["cases"]}
        combined = _merged([path], todo, copy.deepcopy(cases))
        verdicts = _report(combined)
        out["extra_runs"][label] = {
            "source": path, **verdicts,
            "cases": [{"cluster": c["cluster"], "model": c["model"], "derived": c.get("derived"),
                       "methods": c.get("methods")} for c in combined
                      if (c["cluster"], c["model"]) in mine]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    if not args.no_chart:
        draw(cases, OUT_PNG)
        README_PNG.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(OUT_PNG, README_PNG)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
