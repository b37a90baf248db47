"""Traced FLOPs against XLA's cost analysis, and matmul FLOPs against the GPT formula.

For each tiny reference model (Python loop and ``nnx.scan`` variants) compares
``OpGraph.total_flops(count_loops=False)`` with ``jax.jit(step).lower(...).cost_analysis()``
(XLA counts a loop body once, so loops are counted once on both sides), and for an untied GPT the
forward+backward matmul FLOPs with Korthikanti et al. 2022's ``72·B·s·l·h²·(1 + s/(6h) +
V/(12·l·h))``. Prints a table and writes ``benchmarks/results/trace_fidelity.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import shardplan_models as models

import shardplan as sp

RESULTS = Path(__file__).resolve().parent / "results" / "trace_fidelity.json"


def main() -> int:
    rows = []
    for name in ("gpt-tiny", "llama-tiny", "moe-tiny"):
        for scan in (False, True):
            cfg = models.load_model_config(name, overrides={"scan_layers": scan})
            graphdef, state = models.abstract_train_state(cfg)
            step = models.make_train_step(graphdef)
            batch = models.example_batch(cfg, 8, abstract=True)
            graph = sp.trace(step, state, batch)
            xla = float(jax.jit(step).lower(state, batch).cost_analysis()["flops"])
            ours = graph.total_flops(count_loops=False)
            rows.append({"model": name, "layers": "scan" if scan else "loop",
                         "traced_flops": ours, "xla_flops": xla, "ratio": ours / xla,
                         "blocks": len(graph.blocks),
                         "distinct_fingerprints": len({b.fingerprint for b in graph.blocks})})
    cfg = models.GPTConfig(vocab_size=1024, max_seq_len=128, d_model=256, n_layers=6, n_heads=4,
                           d_ff=1024, tie_embeddings=False)
    graphdef, state = models.abstract_train_state(cfg)
    b = 8
    graph = sp.trace(models.make_train_step(graphdef), state,
                     models.example_batch(cfg, b, abstract=True))
    s, L, h, v = cfg.max_seq_len, cfg.n_layers, cfg.d_model, cfg.vocab_size
    formula = 72 * b * s * L * h**2 * (1 + s / (6 * h) + v / (12 * L * h))
    matmul = sum(op.total_flops for op in graph.ops
                 if op.primitive == "dot_general" and op.phase in ("forward", "backward"))
    print(f"{'model':<12}{'layers':<8}{'traced FLOPs':>15}{'XLA FLOPs':>15}{'ratio':>9}"
          f"{'blocks':>8}{'fingerprints':>14}")
    for r in rows:
        print(f"{r['model']:<12}{r['layers']:<8}{r['traced_flops']:>15.4g}{r['xla_flops']:>15.4g}"
              f"{r['ratio']:>9.4f}{r['blocks']:>8}{r['distinct_fingerprints']:>14}")
    print(f"GPT (B={b}, s={s}, l={L}, h={h}, V={v}) matmul FLOPs / formula: {matmul / formula:.6f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "trace_fidelity", "jax": jax.__version__, "rows": rows,
        "gpt_formula": {"batch": b, "seq": s, "layers": L, "hidden": h, "vocab": v,
                        "matmul_flops": matmul, "formula": formula, "ratio": matmul / formula},
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
