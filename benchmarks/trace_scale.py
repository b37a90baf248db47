"""Traces GPT-3 175B abstractly and reports time and memory.

GPT-3 175B (96 layers, d_model 12288, vocab 50257) with a global batch of 1536 sequences of 2048
tokens, AdamW with global-norm clipping (the reference train step in ``models/train.py``), as a
Python loop over blocks and as an ``nnx.scan`` over stacked blocks. Each variant runs in its own
process so that its peak resident memory is its own. Nothing is allocated: the state and the
batch are ``jax.ShapeDtypeStruct`` s.

Prints a table and writes ``benchmarks/results/trace_scale.json``.

Usage: ``python benchmarks/trace_scale.py [--repeats 3]``
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

RESULTS = Path(__file__).resolve().parent / "results" / "trace_scale.json"
BATCH = 1536
TIME_LIMIT_S = 30.0
MEMORY_LIMIT_BYTES = 4 * 2**30


def _measure(variant: str) -> dict:
    """Runs in a child process: builds the abstract state, traces, reports figures."""
    import resource

    import jax

    import models
    import shardplan as sp

    config = models.load_model_config("gpt3-175b",
                                      overrides={"scan_layers": variant == "scan"})
    t0 = time.perf_counter()
    graphdef, state = models.abstract_train_state(config)
    batch = models.example_batch(config, BATCH, abstract=True)
    step = models.make_train_step(graphdef)
    t1 = time.perf_counter()
    graph = sp.trace(step, state, batch)
    t2 = time.perf_counter()
    b, s, L, h, v = BATCH, config.max_seq_len, config.n_layers, config.d_model, config.vocab_size
    formula = 72 * b * s * L * h**2 * (1 + s / (6 * h) + v / (12 * L * h))
    matmul = sum(op.total_flops for op in graph.ops if op.primitive == "dot_general"
                 and op.phase in ("forward", "backward"))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {
        "variant": variant,
        "state_build_s": t1 - t0,
        "trace_s": t2 - t1,
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (median)")
    parser.add_argument("--child", choices=["loop", "scan"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child)))
        return 0
    rows = []
    for variant in ("loop", "scan"):
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, __file__, "--child", variant],
                                 capture_output=True, text=True, check=True,
                                 env={**os.environ, "JAX_PLATFORMS": "cpu"})
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        row = dict(runs[-1])
        for key in ("state_build_s", "trace_s", "peak_rss_bytes"):
            row[key] = statistics.median(r[key] for r in runs)
            row[key + "_runs"] = [r[key] for r in runs]
        row["trace_within_30_s"] = row["trace_s"] <= TIME_LIMIT_S
        row["memory_within_4_GiB"] = row["peak_rss_bytes"] <= MEMORY_LIMIT_BYTES
        row["matmul_over_formula"] = row["matmul_flops_fwd_bwd"] / row["model_flops_formula"]
        rows.append(row)
    print(f"GPT-3 175B train step, batch {BATCH} x 2048 tokens, traced abstractly "
          f"(median of {args.repeats}; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores)")
    print(f"{'variant':<8}{'state s':>9}{'trace s':>9}{'peak RSS':>11}{'ops':>9}"
          f"{'blocks':>8}{'matmul/formula':>16}")
    for r in rows:
        print(f"{r['variant']:<8}{r['state_build_s']:>9.1f}{r['trace_s']:>9.1f}"
              f"{r['peak_rss_bytes'] / 2**30:>9.2f} G{r['ops']:>9}{r['blocks']:>8}"
              f"{r['matmul_over_formula']:>16.6f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "trace_scale",
        "model": "gpt3-175b",
        "global_batch": BATCH,
        "limits": {"trace_s": TIME_LIMIT_S, "peak_rss_bytes": MEMORY_LIMIT_BYTES},
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
        "results": rows,
    }, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(Path.cwd()) if RESULTS.is_relative_to(Path.cwd()) else RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
