"""The same model written as a Python loop and as an ``nnx.scan`` gets the same plan: the same
mesh or stage split and the same sharding of every parameter, up to key-path spelling (a
loop's ``blocks/3/attn/q/kernel`` is row 3 of the scan's stacked ``blocks/attn/q/kernel``,
whose spec has one more, unsharded, leading dimension).

The predicted step times are not equal, and should not be: XLA compiles a scan into a loop
whose residuals are stacked for the backward loop (written and read through dynamic slices)
and whose values it cannot fuse across the loop boundary, and the cost model prices that
(``tests/planner/test_layer_costs.py``; ``benchmarks/loop_vs_scan.py`` measures both programs).
"""

from __future__ import annotations

import re

import jax
import pytest
import shardplan_models as models

import shardplan as sp

BATCH = 16


def _plan(scan: bool, cluster: sp.Cluster, config: sp.PlanConfig) -> sp.Plan:
    model = models.load_model_config("gpt-tiny", overrides={"scan_layers": scan})
    graphdef, state = models.abstract_train_state(model)
    batch = models.example_batch(model, BATCH, abstract=True)
    return sp.make_plan(models.make_train_step(graphdef), state, batch, cluster=cluster,
                        config=config)


def _as_scanned(loop: sp.Plan) -> dict[str, object]:
    """The loop plan's parameter specs spelled as the scan's: one entry per stacked leaf (every
    block's spec, which must agree), with the stack's leading dimension unsharded."""
    out: dict[str, set] = {}
    for key, (_, spec) in loop.param_specs.items():
        m = re.fullmatch(r"(.*?/blocks)/\d+/(.*)", key)
        name, spec = (f"{m[1]}/{m[2]}", ((), *spec)) if m else (key, spec)
        out.setdefault(name, set()).add(spec)
    return {k: next(iter(v)) if len(v) == 1 else v for k, v in out.items()}


def _stages(plan: sp.Plan) -> list[tuple]:
    return [(s.device_type, s.mesh.axis_names, s.mesh.axis_sizes, s.mesh.device_ids, s.layers,
             s.remat) for s in plan.stages]


@pytest.mark.parametrize("where", ["one mesh of 8", "4 A100 + 4 V100, pipelined"])
def test_a_loop_and_a_scan_get_the_same_plan(where: str) -> None:
    if where == "one mesh of 8":
        cluster, config = sp.Cluster.local(devices=jax.devices()), sp.PlanConfig()
    else:
        cluster = sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
        config = sp.PlanConfig(pipeline=True)
    loop, scan = _plan(False, cluster, config), _plan(True, cluster, config)
    assert _stages(loop) == _stages(scan)
    assert [r.stages for r in loop.replicas] == [r.stages for r in scan.replicas]
    assert (loop.microbatch_size, loop.schedule) == (scan.microbatch_size, scan.schedule)
    assert loop.batch_specs == scan.batch_specs
    specs = {k: spec for k, (_, spec) in scan.param_specs.items()}
    assert _as_scanned(loop) == specs
    if where == "one mesh of 8":
        # Not a trivially replicated plan: the batch is split and some parameters are too.
        assert any(axes for spec in loop.batch_specs.values() for axes in spec)
        assert any(axes for spec in specs.values() for axes in spec)
