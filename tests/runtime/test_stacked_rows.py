"""A scanned stack's stacked leaves held per stage (``shardplan.runtime.rows``): each stage keeps,
updates and returns only its rows, the numerics unchanged (fp32, 3 steps, 1e-4), a checkpoint of
the pieces restored onto a one-stage plan bit-exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import shardplan_models as models
from helpers.pipelines import budget_planned, one_stage_plan_of, staged_plan, three_steps_match
from jax.extend import core as jcore

import shardplan as sp
from shardplan.runtime.rows import split_rows
from shardplan.runtime.spmd import state_shardings
from shardplan.train.checkpoint import Checkpointer, abstract_target

BLOCKS = [f"blocks.{i}" for i in range(4)]


def test_an_optimizer_update_runs_per_piece() -> None:
    # AdamW behind a global-norm clip, over a stacked leaf cut into rows 0, 1-2, 3: every
    # elementwise equation runs once per piece, the norm sums the pieces' partial sums, and
    # no equation joins the pieces again; the new state equals the whole update's.
    tx = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2))
    params = {"w": jnp.arange(24.0).reshape(4, 3, 2) / 10, "b": jnp.ones(3)}
    grads = jax.tree.map(lambda x: 0.3 * x + 1, params)
    leaves, tree = jax.tree.flatten((params, tx.init(params), grads))

    def update(*flat):
        p, o, g = jax.tree.unflatten(tree, flat)
        u, o = tx.update(g, o, p)
        return jax.tree.leaves((optax.apply_updates(p, u), o))

    closed = jax.make_jaxpr(update)(*leaves)
    runs = ((0, 1), (1, 3), (3, 4))
    whole = jcore.jaxpr_as_fun(closed)(*leaves)
    in_runs = [runs if np.shape(x) == (4, 3, 2) else None for x in leaves]
    out_runs = [runs if np.shape(x) == (4, 3, 2) else None for x in whole]
    rewritten = split_rows(closed, in_runs, out_runs)
    assert not [e for e in rewritten.jaxpr.eqns if e.primitive.name == "concatenate"]
    flat = [y for x, r in zip(leaves, in_runs, strict=True)
            for y in ([x] if r is None else [x[a:b] for a, b in r])]
    out = iter(jcore.jaxpr_as_fun(rewritten)(*flat))
    for x, r in zip(whole, out_runs, strict=True):
        y = next(out) if r is None else jnp.concatenate([next(out) for _ in r])
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_a_value_broadcast_over_the_stacked_axis_is_made_per_piece() -> None:
    # A zero instantiated at the stacked leaf's shape (autodiff's, the step's) meeting the
    # pieces is made again at each piece's shape, its scalar computed while tracing: no
    # equation of the rewritten update makes or reads a value of all the rows, which would
    # draw every stage's piece to the one stage holding it.
    def norm(g):
        return jnp.sqrt(jnp.sum(jnp.square(g) + jnp.square(jnp.zeros((4, 3, 2)))))

    g = jnp.arange(24.0).reshape(4, 3, 2) / 10
    runs = ((0, 2), (2, 4))
    rewritten = split_rows(jax.make_jaxpr(norm)(g), [runs], [None])
    shapes = [v.aval.shape for e in rewritten.jaxpr.eqns for v in (*e.invars, *e.outvars)
              if hasattr(v, "aval")]
    assert (4, 3, 2) not in shapes
    assert not [e for e in rewritten.jaxpr.eqns if e.primitive.name == "square"
                and not e.outvars[0].aval.shape]  # 0.0 squared while tracing
    (out,) = jcore.jaxpr_as_fun(rewritten)(g[:2], g[2:])
    np.testing.assert_allclose(np.asarray(out), np.asarray(norm(g)), rtol=1e-6)


@pytest.fixture(scope="module")
def scanned():
    config = models.load_model_config("gpt-tiny-scan", overrides={"n_layers": 4})
    graphdef, state = models.init_train_state(config, seed=0)
    step = models.make_train_step(graphdef)
    return config, state, step, one_stage_plan_of(None, step, state, config)


def _stage_rows(run, state) -> dict[int, set[int]]:
    """Per device, the rows of the stacked leaves it holds in ``state`` (the returned state)."""
    held: dict[int, set[int]] = {}
    for x in jax.tree.leaves(state):
        if x.ndim and x.shape[0] == 4 and "rows" in x.sharding.mesh.axis_names:
            for shard in x.addressable_shards:
                rows = range(*shard.index[0].indices(4))
                held.setdefault(shard.device.id, set()).update(rows)
    return held


@pytest.mark.parametrize("cut", [2, 4])
def test_each_stage_holds_only_its_rows(scanned, cut: int) -> None:
    config, state, step, plan = scanned
    if cut == 2:
        groups = [("a100-80g", (0,), ("pre", *BLOCKS[:2])),
                  ("v100-32g", (4,), (*BLOCKS[2:], "post"))]
        want = {0: {0, 1}, 4: {2, 3}}
    else:
        groups = [("a100-80g", (0,), ("pre", BLOCKS[0])), ("a100-80g", (1,), (BLOCKS[1],)),
                  ("v100-32g", (4,), (BLOCKS[2],)), ("v100-32g", (5,), (BLOCKS[3], "post"))]
        want = {0: {0}, 1: {1}, 4: {2}, 5: {3}}
    piped = staged_plan(plan, [groups], 4, [4])
    run = three_steps_match(config, state, step, piped)
    ours, _ = run(state, models.example_batch(config, 16, seed=3))
    stacked = [x for x in jax.tree.leaves(ours) if x.ndim and x.shape[0] == 4]
    # every stacked leaf, parameters and both Adam moments, is spread over the stages
    assert stacked and all("rows" in x.sharding.mesh.axis_names for x in stacked)
    assert _stage_rows(run, ours) == want
    # the stacked gradients are never joined: no program outputs a whole stacked leaf
    whole = {tuple(np.shape(x)) for x in stacked}
    for prog in (*run._ready.tasks[0], *run._ready.update[0]):
        assert not any(tuple(v.aval.shape) in whole for v in prog.outputs
                       if v.aval.shape and v.aval.shape[0] == 4), prog.key
    # Between stages only the residual stream (and its gradient) and scalars pass: the
    # constants autodiff hoists out of the loop (the causal mask) are computed again by each
    # task that reads them instead of being sent and kept for the backward.
    made = {v: t.stage for t in run._ready.tasks[0] for v in t.outputs}
    crossing = {tuple(v.aval.shape) for t in run._ready.tasks[0] for kind, v in t.inputs
                if kind == "value" and made[v] != t.stage}
    assert crossing <= {(4, config.max_seq_len, config.d_model), ()}, crossing


def test_a_checkpoint_of_the_rows_restores_onto_a_one_stage_plan(scanned, tmp_path) -> None:
    config, state, step, plan = scanned
    groups = [("a100-80g", (0,), ("pre", *BLOCKS[:2])), ("v100-32g", (4,), (*BLOCKS[2:], "post"))]
    run = sp.apply_plan(step, staged_plan(plan, [groups], 4, [4]), measure_steps=0)
    ours, _ = run(state, models.example_batch(config, 16, seed=0))
    saved = [np.asarray(x) for x in jax.tree.leaves(ours)]
    with Checkpointer(tmp_path, every_steps=1, keep=1) as ckpt:
        ckpt.save(1, ours, meta={})
        target = abstract_target(ours, state_shardings(plan, ours))
        restored = ckpt.restore(target=target).state
    for x, y in zip(saved, jax.tree.leaves(restored), strict=True):
        assert np.array_equal(x, np.asarray(y))
    # and the one-stage plan goes on from there as the unsharded step does
    batch = models.example_batch(config, 16, seed=1)
    one = sp.apply_plan(step, plan, measure_steps=0)(restored, batch)
    ref = jax.jit(step)(jax.tree.unflatten(jax.tree.structure(ours), saved), batch)
    for x, y in zip(jax.tree.leaves(one), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,overrides,cut", [
    ("gpt-tiny-scan", {}, (4, 0.4, 0)), ("llama-tiny", {"scan_layers": True}, (4, 0.4, 0)),
    ("gpt-tiny-scan", {}, (6, 0.45, 3)), ("llama-tiny", {"scan_layers": True}, (6, 0.45, 3))])
def test_a_planned_scanned_pipeline_holds_what_it_was_planned_for(name: str, overrides,
                                                                  cut) -> None:
    # The planner's own pipeline for a 4-block nnx.scan stack on 4 A100 + 4 V100 under 40 % of
    # its one-stage replica's peak: four stages of one block each; for a 6-block stack under
    # 45 % with at most 3 stages: three stages of two blocks each (the stage planner cuts a
    # stack into equal runs only, so that each stage holds its rows). Every stage's largest
    # program is within 10 % of the stage's predicted peak and inside the budget, and after
    # three steps each device holds its stage's parameters and optimizer state as predicted,
    # within 10 % (measured: 1.00-1.01; CPU live bytes are jax.live_arrays, so device 0, the
    # default device, where earlier tests' arrays live in the same process, is not checked;
    # alone this test measures it at 1.01). What a device held while a program ran, the
    # program plus the arrays the driver kept beside it, is within 10 % of the prediction and
    # inside the budget too (measured: 0.86-1.03).
    n_layers, fraction, max_stages = cut
    config, state, step, plan, budget = budget_planned(name, 16, fraction, n_layers=n_layers,
                                                        max_stages=max_stages, **overrides)
    assert [len([x for x in st.layers if x.startswith("blocks.")]) for st in plan.stages] == (
        [1, 1, 1, 1] if n_layers == 4 else [2, 2, 2])
    run = sp.apply_plan(step, plan, measure_steps=2)  # the third step records live bytes
    for i in range(3):
        state, _ = run(state, models.example_batch(config, 16, seed=i))
    assert run._ready.rows.runs  # the stacked leaves are held per stage
    measured = run.plan.measured["live_bytes"]
    for st in run.plan.stages:
        predicted = max(run.plan.predicted.memory_bytes[d] for d in st.mesh.device_ids)
        programs = [p for p in run.plan.compiled["programs"] if p["stage"] == st.index]
        compiled = max(p["memory_bytes"] for p in programs)
        held = max(p["memory_bytes"] + p["beside_bytes"] for p in programs)
        assert compiled <= min(1.1 * predicted, budget), (st.index, compiled, predicted)
        assert held <= min(1.1 * predicted, budget), (st.index, held, predicted)
        resident = run.plan.solver["resident_bytes"][str(st.index)]
        live = max(measured[str(d)] for d in st.mesh.device_ids)
        if 0 not in st.mesh.device_ids:  # (device 0 also holds other tests' arrays)
            assert 0.9 * resident <= live <= 1.1 * resident, (st.index, live, resident)
    report = run.plan.report()
    assert "memory per device between steps (state)" in report
