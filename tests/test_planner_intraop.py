"""The intra-op problem of one mesh, solved: Alpa's MLP cases (§A1.1 of the external cases)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import shardplan as sp
from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.sharding import analyze_sharding, leaf_specs
from shardplan.cost.step import step_cost
from shardplan.planner.intraop import build_intraop_problem, decode_input_specs
from shardplan.solver import evaluate, solve


def mlp_step(width: int, batch: int, layers: int = 6):
    """Alpa's test MLP: Dense layers with bias and ReLU, MSE against ones, Adam (lr 1e-2)."""
    params = [{"kernel": jax.ShapeDtypeStruct((width, width), jnp.float32),
               "bias": jax.ShapeDtypeStruct((width,), jnp.float32)} for _ in range(layers)]
    tx = optax.adam(1e-2)
    opt = jax.eval_shape(tx.init, params)

    def step(state, x):
        params, opt_state = state

        def loss(p):
            h = x
            for i, layer in enumerate(p):
                h = h @ layer["kernel"] + layer["bias"]
                if i < len(p) - 1:
                    h = jax.nn.relu(h)
            return jnp.mean((h - 1.0) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    return step, (params, opt), jax.ShapeDtypeStruct((batch, width), jnp.float32)


def _plan(width: int, batch: int, cluster: sp.Cluster):
    step, state, x = mlp_step(width, batch)
    graph = sp.trace(step, state, x)
    mesh = LogicalMesh.create((4,), ("x",))
    ip = build_intraop_problem(graph, mesh, cluster, reduce_scatter=False)
    solution = solve(ip.problem)
    assert solution.status == "optimal"
    return graph, mesh, ip, solution, decode_input_specs(ip, solution)


def test_replicated_plan_costs_the_same_in_the_ilp_and_in_the_step_model() -> None:
    # The ILP prices each op and edge; the step model propagates shardings and prices the
    # whole step. For the all-replicated plan (strategy 0 everywhere) both must agree.
    cluster = sp.Cluster.local(devices=jax.devices()[:4])
    step, state, x = mlp_step(256, 32)
    graph = sp.trace(step, state, x)
    mesh = LogicalMesh.create((4,), ("x",))
    ip = build_intraop_problem(graph, mesh, cluster, reduce_scatter=False)
    replicated = evaluate(ip.problem, tuple(0 for _ in ip.problem.nodes))
    assert not replicated.violations
    ins, outs = leaf_specs(graph, mesh, lambda p: None)
    independent = step_cost(graph, analyze_sharding(graph, mesh, ins, outs,
                                                    reduce_scatter=False), cluster)
    assert replicated.cost.total == pytest.approx(independent.step_time_s, rel=1e-3)


@pytest.mark.parametrize("width,batch", [(256, 32), (32, 256)])
def test_solution_is_optimal_and_beats_replication(width: int, batch: int) -> None:
    cluster = sp.Cluster.local(devices=jax.devices()[:4])
    _, _, ip, solution, _ = _plan(width, batch, cluster)
    assert not evaluate(ip.problem, solution.assignment).violations
    replicated = evaluate(ip.problem, tuple(0 for _ in ip.problem.nodes)).cost.total
    assert solution.objective <= replicated
    # Optimizer state is sharded like its parameter.
    for follower in ip.problem.followers:
        assert solution.assignment[follower.node] == solution.assignment[follower.leader]
