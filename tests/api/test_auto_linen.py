"""sp.auto on a train step nobody wrote for shardplan: Flax's lm1b example, at toy sizes.

The step (``tests/helpers/flax_example_lm.py``) is bound with ``functools.partial`` as the example's
``train.py`` binds it and decorated as it is; three planned steps must equal ``jax.jit`` of the
same step, metrics and every state leaf, with dropout drawing its random bits on sharded
values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers.flax_example_lm import example_setup, make_batches

import shardplan as sp

BATCH, STEPS = 16, 3


def _copy(tree):
    """A copy of ``tree``'s arrays (the planned step donates its state); other leaves as is
    (``TrainState.create`` starts ``step`` at the Python int 0)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x,
                        tree)


def _sharded(spec) -> bool:
    return any(axes for axes in spec)


def test_auto_runs_the_lm1b_example_step_unmodified() -> None:
    # Partitionable threefry (jax's default) derives each element's bits from its global
    # index, so each device draws only its shard of a dropout mask, without communication;
    # the comparison below checks that those shards make up the unsharded mask.
    assert jax.config.values["jax_threefry_partitionable"]
    state, step, config = example_setup(batch_size=BATCH)
    assert not config.deterministic  # dropout is on in training, as in the example
    batches = make_batches(config, count=STEPS, batch_size=BATCH)
    # tie_periods=(1,): both decoder blocks share one solution (the default also tries
    # alternating blocks, a second solve that doubles the planning time).
    run = sp.auto(step, cluster=sp.Cluster.local(),
                  config=sp.PlanConfig(time_limit_s=5, tie_periods=(1,)))

    ref, got = state, _copy(state)
    reference = jax.jit(step)
    for i, batch in enumerate(batches):
        ref, ref_metrics = reference(ref, batch)
        got, metrics = run(got, batch)
        assert metrics.keys() == ref_metrics.keys() == {"loss", "accuracy", "denominator",
                                                        "learning_rate"}
        for name, value in metrics.items():
            np.testing.assert_allclose(value, ref_metrics[name], rtol=1e-4, atol=1e-4,
                                       err_msg=f"step {i}: metrics[{name!r}]")
    ref_leaves = jax.tree.leaves(ref)
    got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
    assert len(got_leaves) == len(ref_leaves)
    for (path, a), b in zip(got_leaves, ref_leaves, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4,
                                   err_msg=jax.tree_util.keystr(path, simple=True, separator="/"))
    assert int(got.step) == STEPS

    # One plan, on all 8 devices, that splits the batch: every dropout mask (one after the
    # embedding, four per layer) is drawn with its batch dimension sharded.
    plan = run.plan_for(got, batches[0])
    assert run.plans == (plan,) and plan.num_devices == len(jax.devices())
    graph = sp.trace(step, state, batches[0])
    ops = {"/".join(map(str, op.path)): op for op in graph.ops if op.path is not None}
    draws = [op for op in graph.ops if op.primitive == "random_bits"]
    assert len(draws) == 1 + 4 * config.num_layers
    pinned = {k: results for k, (_, results, _) in plan.constraints.items()
              if ops[k].primitive == "random_bits"}
    assert len(pinned) == len(draws)
    assert all(results[0][0] for results in pinned.values()), pinned
    assert any(_sharded(spec) for k, (_, results, _) in plan.constraints.items()
               if ops[k].primitive == "dot_general" for spec in results)
