"""Planning HuggingFace Flax models as users bring them: Python loops over blocks, no weights.

``FlaxGPT2LMHeadModel`` at GPT-2 XL size (48 layers, d_model 1600, 25 heads, context 1024) and
``FlaxLlamaForCausalLM`` at Llama-2 7B size (32 layers, d_model 4096, 32 heads, SwiGLU 11008,
context 4096), each built abstractly (``jax.eval_shape`` of the model's own ``init_weights``:
nothing allocated, nothing downloaded), with the train step a user writes (next-token cross
entropy on ``model(input_ids, params=...)``, ``optax.adamw``), planned with pipeline stages
per device type on ``configs/clusters/a100x64_v100x64.yaml`` (64 A100 + 64 V100). The target is
at most 30 s of ``make_plan`` each, everything included (trace, layer cost tables, stage
planner, simulator, plan).

``transformers<5`` is a benchmark-only extra (``pip install -e '.[bench]'``), never a runtime
dependency of shardplan. Each case runs in its own process, ``--repeats`` times; the median is
reported. Prints a table and writes ``benchmarks/results/hf_models.json``.

Usage: ``python benchmarks/hf_models.py [--repeats 3] [--cases gpt2-xl,llama2-7b]``
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
RESULTS = ROOT / "benchmarks" / "results" / "hf_models.json"
CLUSTER = ROOT / "configs" / "clusters" / "a100x64_v100x64.yaml"
TARGET_S = 30.0
CASES = {
    # name: (global batch, sequence length)
    "gpt2-xl": (512, 1024),
    "llama2-7b": (256, 4096),
}


def _model(case: str):
    """The HF model (no weights) and its abstract parameters."""
    import jax

    if case == "gpt2-xl":
        from transformers import FlaxGPT2LMHeadModel, GPT2Config

        config = GPT2Config(n_layer=48, n_embd=1600, n_head=25, n_positions=1024,
                            vocab_size=50257)
        model = FlaxGPT2LMHeadModel(config, _do_init=False)
    else:
        from transformers import FlaxLlamaForCausalLM, LlamaConfig

        config = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                             num_key_value_heads=32, intermediate_size=11008,
                             max_position_embeddings=4096, vocab_size=32000)
        model = FlaxLlamaForCausalLM(config, _do_init=False)
    _, seq = CASES[case]
    params = jax.eval_shape(lambda: model.init_weights(jax.random.PRNGKey(0), (1, seq)))
    return model, params


def _child(case: str) -> dict:
    import time

    import jax
    import jax.numpy as jnp
    import optax

    import shardplan as sp

    model, params = _model(case)
    tx = optax.adamw(3e-4, weight_decay=0.1)
    state = (params, jax.eval_shape(tx.init, params))

    def train_step(state, batch):
        params, opt_state = state

        def loss_fn(p):
            logits = model(batch["input_ids"], params=p, train=False).logits
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1].astype(jnp.float32), batch["input_ids"][:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    global_batch, seq = CASES[case]
    batch = {"input_ids": jax.ShapeDtypeStruct((global_batch, seq), jnp.int32)}
    cluster = sp.Cluster.from_yaml(CLUSTER)
    t0 = time.perf_counter()
    plan = sp.make_plan(train_step, state, batch, cluster=cluster)
    seconds = time.perf_counter() - t0
    first = [plan.stages[i] for i in plan.replicas[0].stages]
    return {"case": case, "make_plan_s": seconds, "timings": dict(plan.timings),
            "layers": len(plan.stages[0].layers) if len(plan.stages) == 1 else None,
            "replicas": len(plan.replicas), "microbatch_size": plan.microbatch_size,
            "schedule": plan.schedule, "predicted_step_time_s": plan.predicted.step_time_s,
            "first_replica": [{"type": s.device_type, "devices": s.mesh.num_devices,
                               "layers": len(s.layers), "remat": s.remat} for s in first]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (median)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child)))
        return 0
    rows = []
    for case in args.cases.split(","):
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, __file__, "--child", case],
                                 capture_output=True, text=True,
                                 env={**os.environ, "JAX_PLATFORMS": "cpu",
                                      "PYTHONPATH": str(ROOT)})
            if out.returncode:
                raise SystemExit(f"case {case} failed:\n{out.stderr[-4000:]}")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        row = dict(runs[-1])
        row["make_plan_s"] = statistics.median(r["make_plan_s"] for r in runs)
        row["make_plan_s_runs"] = [r["make_plan_s"] for r in runs]
        row["within_target"] = row["make_plan_s"] <= TARGET_S
        rows.append(row)
        t = row["timings"]
        print(f"{case}: make_plan median {row['make_plan_s']:.2f} s of {args.repeats} (trace "
              f"{t.get('trace_s', 0):.2f}, layer tables {t.get('layer_tables_s', 0):.2f}, "
              f"stage planner {t.get('stage_planner_s', 0):.2f}); {row['replicas']} replicas, "
              f"{row['schedule']}, predicted {row['predicted_step_time_s']:.3f} s/step; target "
              f"{TARGET_S:g} s: {'PASS' if row['within_target'] else 'FAIL'}", flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "hf_models", "cluster": CLUSTER.name, "rows": rows,
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
