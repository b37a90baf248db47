"""Traces GPT-3 175B abstractly and reports time and memory: JAX's trace and shardplan's passes.

GPT-3 175B (96 layers, d_model 12288, vocab 50257) with a global batch of 1536 sequences of 2048
tokens, AdamW with global-norm clipping (the reference train step in ``models/train.py``), as a
Python loop over blocks and as an ``nnx.scan`` over stacked blocks. Each variant runs in its own
process so that its peak resident memory is its own. Nothing is allocated: the state and the
batch are ``jax.ShapeDtypeStruct`` s.

``sp.trace`` is three steps, timed apart here: checking the argument leaves, JAX's own trace
(``jax.jit(step).trace``, with Python's cyclic garbage collector paused as ``sp.trace`` pauses
it), and shardplan's passes over the jaxpr (flatten and cost, phases and
roles, layers and fingerprints: ``shardplan.trace.api.build_graph``). ``passes_s`` is the first
and the last together: everything ``sp.trace`` spends outside JAX. Each is reported as wall time
and as this process's CPU time (``time.process_time``), and each run records the machine's
1-minute load average, since a shared machine slows wall times down.

Prints a table and writes ``benchmarks/results/trace_scale.json``.

Usage: ``python benchmarks/trace_scale.py [--repeats 3] [--variants loop scan]``
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "trace_scale.json"
BATCH = 1536
TIME_LIMIT_S = 30.0
MEMORY_LIMIT_BYTES = 4 * 2**30
PASSES_OVER_JAX_TARGET = 0.15
"""shardplan's passes should cost at most this fraction of JAX's own trace (loop variant)."""
_TIMED = ("state_build_s", "jax_trace_s", "passes_s", "trace_s", "jax_trace_cpu_s",
          "passes_cpu_s", "peak_rss_bytes", "load_avg_1min")


def _timed(fn, *args, **kwargs):
    """``(result, wall seconds, CPU seconds of this process)`` of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _measure(variant: str) -> dict:
    """Runs in a child process: builds the abstract state, traces, reports figures."""
    import resource

    import jax
    import shardplan_models as models

    from shardplan._gc import gc_paused

    # `shardplan.trace` the package (its `trace` function shadows the attribute).
    api = importlib.import_module("shardplan.trace.api")
    config = models.load_model_config("gpt3-175b",
                                      overrides={"scan_layers": variant == "scan"})
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    graphdef, state = models.abstract_train_state(config)
    batch = models.example_batch(config, BATCH, abstract=True)
    step = models.make_train_step(graphdef)
    state_build_s = time.perf_counter() - t0
    # sp.trace(step, state, batch), step by step (see api.trace): JAX's trace runs with the
    # cyclic garbage collector paused, as sp.trace runs it (shardplan._gc).
    leaves, check_s, check_cpu_s = _timed(api.check_leaves, (state, batch))
    with gc_paused():
        traced, jax_s, jax_cpu_s = _timed(jax.jit(step).trace, state, batch)
    graph, build_s, build_cpu_s = _timed(api.build_graph, traced, leaves,
                                         name=str(getattr(step, "__name__", "fn")))
    b, s, L, h, v = BATCH, config.max_seq_len, config.n_layers, config.d_model, config.vocab_size
    formula = 72 * b * s * L * h**2 * (1 + s / (6 * h) + v / (12 * L * h))
    matmul = sum(op.total_flops for op in graph.ops if op.primitive == "dot_general"
                 and op.phase in ("forward", "backward"))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {
        "variant": variant,
        "state_build_s": state_build_s,
        "jax_trace_s": jax_s,
        "passes_s": check_s + build_s,
        "trace_s": check_s + jax_s + build_s,
        "jax_trace_cpu_s": jax_cpu_s,
        "passes_cpu_s": check_cpu_s + build_cpu_s,
        "load_avg_1min": max(load_before, os.getloadavg()[0]),
        "peak_rss_bytes": rss,
        "ops": len(graph.ops),
        "tensors": len(graph.tensors),
        "blocks": len(graph.blocks),
        "distinct_block_fingerprints": len({blk.fingerprint for blk in graph.blocks}),
        "num_params": graph.num_params,
        "total_flops": graph.total_flops(),
        "matmul_flops_fwd_bwd": matmul,
        "model_flops_formula": formula,
        "jax": jax.__version__,
    }


def _summarise(runs: list[dict]) -> dict:
    """The last run's counts, the median of each timed figure, and every run's figures."""
    row = dict(runs[-1])
    for key in _TIMED:
        row[key] = statistics.median(r[key] for r in runs)
        row[key + "_runs"] = [r[key] for r in runs]
    # Per run, then the median: the ratio of medians would pair figures of different runs.
    row["passes_over_jax"] = statistics.median(r["passes_s"] / r["jax_trace_s"] for r in runs)
    row["passes_over_jax_cpu"] = statistics.median(
        r["passes_cpu_s"] / r["jax_trace_cpu_s"] for r in runs)
    row["trace_within_30_s"] = row["trace_s"] <= TIME_LIMIT_S
    row["memory_within_4_GiB"] = row["peak_rss_bytes"] <= MEMORY_LIMIT_BYTES
    row["matmul_over_formula"] = row["matmul_flops_fwd_bwd"] / row["model_flops_formula"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (median)")
    parser.add_argument("--variants", nargs="+", choices=["loop", "scan"],
                        default=["loop", "scan"], help="which block layouts to trace")
    parser.add_argument("--child", choices=["loop", "scan"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child)))
        return 0
    rows = []
    for variant in args.variants:
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, __file__, "--child", variant],
                                 capture_output=True, text=True, check=True,
                                 env={**os.environ, "JAX_PLATFORMS": "cpu"})
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        rows.append(_summarise(runs))
    print(f"GPT-3 175B train step, batch {BATCH} x 2048 tokens, traced abstractly "
          f"(median of {args.repeats}; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores)")
    print(f"{'variant':<8}{'state s':>9}{'JAX s':>8}{'passes s':>10}{'passes/JAX':>12}"
          f"{'(CPU)':>7}{'trace s':>9}{'load':>6}{'peak RSS':>11}{'ops':>8}{'blocks':>8}"
          f"{'matmul/formula':>16}")
    for r in rows:
        print(f"{r['variant']:<8}{r['state_build_s']:>9.1f}{r['jax_trace_s']:>8.1f}"
              f"{r['passes_s']:>10.2f}{r['passes_over_jax']:>12.3f}"
              f"{r['passes_over_jax_cpu']:>7.3f}{r['trace_s']:>9.1f}"
              f"{r['load_avg_1min']:>6.1f}{r['peak_rss_bytes'] / 2**30:>9.2f} G{r['ops']:>8}"
              f"{r['blocks']:>8}{r['matmul_over_formula']:>16.6f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "trace_scale",
        "model": "gpt3-175b",
        "global_batch": BATCH,
        "limits": {"trace_s": TIME_LIMIT_S, "peak_rss_bytes": MEMORY_LIMIT_BYTES,
                   "passes_over_jax": PASSES_OVER_JAX_TARGET},
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
        "results": rows,
    }, indent=2) + "\n")
    shown = RESULTS.relative_to(Path.cwd()) if RESULTS.is_relative_to(Path.cwd()) else RESULTS
    print(f"wrote {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
