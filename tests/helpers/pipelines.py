"""Tiny models planned on 4 A100 + 4 V100 (local), and plans rewritten by hand into stages, for
the runtime tests."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import shardplan_models as models

import shardplan as sp
from shardplan.plan.plan import Layout, MeshSpec, ReplicaSpec, Stage

RTOL = ATOL = 1e-4


def planned_tiny(name: str):
    """A tiny model, its step and its one-stage-replica plan on 4 A100 + 4 V100 (local)."""
    config = models.load_model_config(name)
    graphdef, state = models.init_train_state(config, seed=0)
    step = models.make_train_step(graphdef)
    batch = models.example_batch(config, 16, seed=0)
    cluster = sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
    plan = sp.make_plan(step, jax.eval_shape(lambda: state), jax.eval_shape(lambda: batch),
                        cluster=cluster, config=sp.PlanConfig(max_stages=1))
    return config, state, step, plan


def three_steps_match(config, state, step, plan, reference=None, batch_size=16):
    """Three steps of ``plan`` against the unsharded ``reference`` (default: the step)."""
    run = sp.apply_plan(step, plan, measure_steps=2)  # step 2 timed, step 3 clocked per stage
    ref, reference = state, reference or jax.jit(step)
    for i in range(3):
        batch = models.example_batch(config, batch_size, seed=i)
        state, metrics = run(state, batch)
        ref, ref_metrics = reference(ref, batch)
        for x, y in zip(jax.tree.leaves((state, metrics)), jax.tree.leaves((ref, ref_metrics)),
                        strict=True):
            np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                       rtol=RTOL, atol=ATOL)
    return run


def staged_plan(plan, groups, microbatch_size: int, counts, schedule: str = "1f1b",
              param_spec=None, kernel_specs=None):
    """``plan`` rewritten as replicas of stages: ``groups`` per replica, a list of
    (device type, device ids, layer names) per stage; replicated layouts (or
    ``param_spec(key, rank)``'s), the microbatch split over a stage's devices, and
    ``kernel_specs`` (:attr:`Layout.kernel_specs`) in every layout."""
    first = plan.stages[0]
    specs = plan.layouts[first.layout] if first.layout else Layout(
        {k: spec for k, (_, spec) in plan.param_specs.items()}, plan.batch_specs)
    replicated = {k: (param_spec or (lambda _, n: tuple(() for _ in range(n))))(k, len(v))
                  for k, v in specs.param_specs.items()}
    stages, replicas, layouts, memory = [], [], {}, {}
    for r, (group, count) in enumerate(zip(groups, counts, strict=True)):
        indices = []
        for device_type, ids, layers in group:
            name = f"{device_type}:inner={len(ids)}"
            layouts[name] = Layout(replicated, {
                k: (("inner",), *tuple(() for _ in v[1:])) if microbatch_size % len(ids) == 0
                else tuple(() for _ in v) for k, v in specs.batch_specs.items()},
                kernel_specs or {})
            indices.append(len(stages))
            stages.append(Stage(len(stages), device_type, MeshSpec(("inner",), (len(ids),),
                                                                    tuple(ids)),
                                (*layers, "shared"), "none", r, name))
            memory.update({d: 1 for d in ids})
        replicas.append(ReplicaSpec(tuple(indices), count))
    return dataclasses.replace(
        plan, stages=tuple(stages), layouts=layouts, microbatch_size=microbatch_size,
        microbatches=sum(counts), replicas=tuple(replicas), schedule=schedule, chunks=1,
        predicted=dataclasses.replace(plan.predicted, memory_bytes=memory),
        # made by hand: its memory figures are placeholders, no budget was planned for
        solver={k: v for k, v in plan.solver.items() if k != "memory_budget_bytes"})


def one_stage_plan_of(plan, step, state, config):
    """A one-stage plan of this step (its state's specs), for ``staged_plan`` to rewrite."""
    return sp.make_plan(step, jax.eval_shape(lambda: state),
                        jax.eval_shape(lambda: models.example_batch(config, 16, seed=0)),
                        cluster=sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4}),
                        config=sp.PlanConfig(max_stages=1))


def budget_planned(name: str, batch_size: int, fraction: float, *, n_layers: int = 4,
                    max_stages: int = 0, **overrides):
    """A tiny model of ``n_layers`` blocks, its step and the planner's pipeline plan on 4 A100
    + 4 V100 (local) under ``fraction`` of its one-stage replica's predicted peak (at most
    ``max_stages`` stages per replica; 0: any), and that budget."""
    config = models.load_model_config(name, overrides={"n_layers": n_layers, **overrides})
    graphdef, state = models.init_train_state(config, seed=0)
    step = models.make_train_step(graphdef)
    shapes = (jax.eval_shape(lambda: state),
              jax.eval_shape(lambda: models.example_batch(config, batch_size, seed=0)))
    cluster = sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
    one = sp.make_plan(step, *shapes, cluster=cluster, config=sp.PlanConfig(max_stages=1))
    budget = fraction * max(one.predicted.memory_bytes.values())
    plan = sp.make_plan(step, *shapes, cluster=cluster,
                        config=sp.PlanConfig(memory_budget_bytes=budget, pipeline=True,
                                             max_stages=max_stages))
    return config, state, step, plan, budget


def layer_param_bytes(state, layers):
    """Bytes of the model parameters the layers own (``pre``: the embedding; ``blocks.i``: block
    ``i``; ``post``: the final norm and the head)."""
    owners = {"pre": ("embed",), "post": ("norm", "head", "ln_f", "lm_head")}
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        key = jax.tree_util.keystr(path, simple=True, separator="/")
        if not key.startswith("0/"):
            continue
        parts = key.split("/")
        for layer in layers:
            if layer.startswith("blocks."):
                hit = len(parts) > 2 and parts[1] == "blocks" and parts[2] == layer.split(".")[1]
            else:
                hit = parts[1] in owners[layer] or parts[1].startswith(owners[layer])
            if hit:
                total += leaf.size * leaf.dtype.itemsize
                break
    return total


def priced_exchange(step, state, batch, cluster, groups, counts, microbatch_size):
    """What the planner's model prices for the gradient exchange of the hand-made plan
    ``groups`` (per replica, its stages as (device type, device ids, layer names)): the
    layer tables of ``step`` on ``cluster``, the plan as the stage planner's value, and
    :func:`~shardplan.solver.stages.pipeline.exchange_bytes` of it, per (replica, stage position)."""
    from shardplan.planner.layer_costs import layer_costs
    from shardplan.planner.multi import microbatch_of, pipeline_problem
    from shardplan.solver.stages.pipeline import (
        PipelinePlan,
        Replica,
        StagePlacement,
        exchange_bytes,
    )

    shapes = jax.eval_shape(lambda: state), jax.eval_shape(lambda: batch)
    graph = sp.trace(step, shapes[0], microbatch_of(shapes[1], 2))
    costs = layer_costs(graph, cluster, reference_batch=2)
    problem = pipeline_problem(costs, cluster, batch=16,
                               memory_bytes=[g.device.memory_bytes for g in cluster.groups])
    group_of = {g.name: i for i, g in enumerate(cluster.groups)}
    plan = PipelinePlan(tuple(
        Replica(tuple(StagePlacement(group_of[t], len(ids),
                                     tuple(costs.names.index(n) for n in layers))
                      for t, ids, layers in stages), count)
        for stages, count in zip(groups, counts, strict=True)), microbatch_size, "1f1b")
    return exchange_bytes(problem, plan)
