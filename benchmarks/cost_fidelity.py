"""Predicted vs compiled: communication, FLOPs and memory of sharded train steps.

Tiny reference models on 8 CPU devices under hand-written shardings (data parallel 8, tensor
parallel 8, FSDP 8, data 2 × tensor 4, and Llama / MoE variants). For each, shardplan predicts
from the input shardings alone; XLA compiles the same step with the same shardings. Printed and
written to ``benchmarks/results/cost_fidelity.json``.

Usage: ``python benchmarks/cost_fidelity.py``
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import shardplan_models as models
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from shardplan_models.sharding import data_parallel, fsdp, megatron, with_batch

import shardplan as sp
from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.memory import estimate_memory
from shardplan.cost.sharding import analyze_sharding, leaf_specs
from shardplan.xla import read_compiled

RESULTS = Path(__file__).resolve().parent / "results" / "cost_fidelity.json"
BATCH = 128
CASES = {
    "gpt dp8": ("gpt-tiny", {}, (8,), ("data",), with_batch(data_parallel, "data")),
    "gpt tp8": ("gpt-tiny", {"n_heads": 8}, (8,), ("model",), megatron("model")),
    "gpt fsdp8": ("gpt-tiny", {}, (8,), ("data",), with_batch(fsdp("data", 8), "data")),
    "gpt dp2xtp4": ("gpt-tiny", {}, (2, 4), ("data", "model"),
                    with_batch(megatron("model"), "data")),
    "llama dp2xtp4": ("llama-tiny", {"n_kv_heads": 4}, (2, 4), ("data", "model"),
                      with_batch(megatron("model"), "data")),
    "moe dp8": ("moe-tiny", {}, (8,), ("data",), with_batch(data_parallel, "data")),
}


def run_case(name: str) -> dict:
    model, overrides, shape, axes, rule = CASES[name]
    cfg = models.load_model_config(model, overrides=overrides)
    graphdef, state = models.abstract_train_state(cfg)
    step = models.make_train_step(graphdef)
    batch = models.example_batch(cfg, BATCH, abstract=True)
    graph = sp.trace(step, state, batch)
    mesh = LogicalMesh.create(shape, axes)
    in_specs, out_specs = leaf_specs(graph, mesh, rule)
    analysis = analyze_sharding(graph, mesh, in_specs, out_specs, reduce_scatter=False)
    memory = estimate_memory(graph, lambda t: analysis.local_bytes(graph, t),
                             collectives=analysis.collectives)
    jmesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(shape))

    def named(spec):
        return NamedSharding(jmesh, P(*[(s if len(s) != 1 else s[0]) or None for s in spec]))

    treedef = jax.tree_util.tree_structure((state, batch))
    state_sh, batch_sh = jax.tree_util.tree_unflatten(
        treedef, [named(in_specs[p.tensor]) for p in graph.parameters])
    metrics = jax.tree.map(lambda _: NamedSharding(jmesh, P()),
                           jax.eval_shape(step, state, batch)[1])
    compiled = jax.jit(step, in_shardings=(state_sh, batch_sh),
                       out_shardings=(state_sh, metrics)).lower(state, batch).compile()
    report = read_compiled(compiled)
    m = report.memory
    xla_total = m.argument_bytes + m.output_bytes + m.temp_bytes - m.alias_bytes
    return {
        "case": name, "mesh": dict(zip(axes, shape, strict=True)),
        "collectives": {"predicted": analysis.collective_summary(),
                        "compiled": report.collective_summary()},
        "flops": {"predicted": analysis.per_device_flops(graph),
                  "compiled": report.flops_loop_corrected},
        "memory": {
            "predicted": {"argument": memory.argument_bytes, "output": memory.output_bytes,
                          "temp": memory.temp_bytes, "total": memory.peak_bytes},
            "compiled": {"argument": m.argument_bytes, "output": m.output_bytes,
                         "temp": m.temp_bytes, "total": xla_total,
                         "xla_peak_memory_in_bytes": m.xla_peak_bytes},
        },
    }


def main() -> int:
    rows = [run_case(name) for name in CASES]
    print(f"8 CPU devices, batch {BATCH}; predicted / compiled")
    print(f"{'case':<15}{'collective bytes (per kind)':<44}{'FLOPs':>8}{'args':>7}{'temp':>7}"
          f"{'total mem':>10}")
    for r in rows:
        pred, comp = r["collectives"]["predicted"], r["collectives"]["compiled"]
        kinds = sorted(set(pred) | set(comp))
        coll = ", ".join(f"{k.replace('all-', 'a')} "
                         f"{pred.get(k, {}).get('bytes', 0) / max(comp.get(k, {}).get('bytes', 1), 1):.3f}"
                         for k in kinds)
        mp, mc = r["memory"]["predicted"], r["memory"]["compiled"]
        print(f"{r['case']:<15}{coll:<44}"
              f"{r['flops']['predicted'] / r['flops']['compiled']:>8.3f}"
              f"{mp['argument'] / mc['argument']:>7.3f}{mp['temp'] / max(mc['temp'], 1):>7.3f}"
              f"{mp['total'] / mc['total']:>10.3f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"benchmark": "cost_fidelity", "jax": jax.__version__,
                                   "batch": BATCH, "cases": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
