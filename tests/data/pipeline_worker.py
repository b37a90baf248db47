"""One process of the multi-process pipeline tests (run under ``shardplan launch``).

``pipeline_worker.py OUT [STEPS]``: a 2-stage 1F1B plan of gpt-tiny, stage 0 on the first
process's four CPU devices and stage 1 on the second's; runs STEPS steps (default 3; 0: until
killed) and writes the leaves of the new state and metrics that live on this process to
``OUT/process{i}.npz``.
"""

from __future__ import annotations

import os
import sys

import shardplan as sp

sp.initialize_distributed()

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import shardplan_models as models  # noqa: E402
from helpers.pipelines import planned_tiny, staged_plan  # noqa: E402


def main(out: str, steps: int) -> None:
    me = jax.process_index()
    print(f"process {me} pid {os.getpid()}", flush=True)
    config, state, step, plan = planned_tiny("gpt-tiny")
    piped = staged_plan(plan, [[("a100-80g", (0, 1, 2, 3), ("pre", "blocks.0")),
                              ("v100-32g", (4, 5, 6, 7), ("blocks.1", "post"))]], 4, [4])
    run = sp.apply_plan(step, piped)
    i = 0
    while steps == 0 or i < steps:
        state, metrics = run(state, models.example_batch(config, 16, seed=i % 3))
        jax.block_until_ready([x for x in jax.tree.leaves((state, metrics))
                               if x.is_fully_addressable])
        print(f"step {i} done", flush=True)
        i += 1
    leaves = jax.tree.leaves((state, metrics))
    np.savez(os.path.join(out, f"process{me}.npz"),
             **{str(n): np.asarray(x) for n, x in enumerate(leaves) if x.is_fully_addressable})
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)
