"""The intra-op problem of one mesh, solved: Alpa's MLP cases (§A1.1 of the external cases)."""

from __future__ import annotations

import jax
import pytest
from helpers.steps import mlp_step

import shardplan as sp
from shardplan.cluster.mesh import LogicalMesh
from shardplan.cost.sharding import analyze_sharding, leaf_specs
from shardplan.cost.step import step_cost
from shardplan.planner.decode import decode_input_specs, placed_analysis
from shardplan.planner.intraop import build_intraop_problem
from shardplan.solver import evaluate, solve


def _plan(width: int, batch: int, cluster: sp.Cluster, tie_period: int = 2):
    step, state, x = mlp_step(width, batch)
    graph = sp.trace(step, state, x)
    mesh = LogicalMesh.create((4,), ("x",))
    ip = build_intraop_problem(graph, mesh, cluster, tie_period=tie_period)
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
    ip = build_intraop_problem(graph, mesh, cluster)
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


def _kernels(graph):
    return [p for p in graph.parameters if p.path.endswith("kernel") and p.role == "parameter"]


def test_wide_mlp_small_batch_gets_megatron_column_row_pairs() -> None:
    cluster = sp.Cluster.local(devices=jax.devices()[:4])
    graph, mesh, _, solution, specs = _plan(256, 32, cluster)
    column, row = ((), ("x",)), (("x",), ())
    assert [specs[p.tensor] for p in _kernels(graph)] == [column, row] * 3
    # The ILP's objective equals the cost of the same input shardings evaluated independently
    # (propagation + step cost) within 2 %.
    ins, outs = leaf_specs(graph, mesh, lambda p: specs[p.tensor])
    independent = step_cost(graph, analyze_sharding(graph, mesh, ins, outs,
                                                    reduce_scatter=False), cluster)
    assert solution.objective == pytest.approx(independent.step_time_s, rel=0.02)
    # Forward: one activation all-reduce per column/row pair plus the scalar loss.
    forward = [c for c in analyze_sharding(graph, mesh, ins, outs, reduce_scatter=False
                                           ).collectives
               if graph.ops[c.op].phase == "forward" and graph.tensors[c.tensor].shape]
    assert [c.kind for c in forward] == ["all-reduce"] * 3


def test_narrow_mlp_large_batch_is_data_parallel_when_bandwidth_bound() -> None:
    # Alpa's cost model is bandwidth-bound (alpha = beta = 1); describe such a cluster and bind
    # it to 4 local devices.
    cluster = sp.Cluster.from_dict(
        {"name": "bandwidth-bound", "groups": [{
            "device": "cpu", "nodes": 1, "devices_per_node": 4,
            "intra_node": {"bandwidth_GB_s": 1.0, "latency_us": 0.001}}]},
        devices=jax.devices()[:4])
    graph, _, _, _, specs = _plan(32, 256, cluster)
    assert all(specs[p.tensor] == ((), ()) for p in _kernels(graph))
    batch = [p for p in graph.parameters if p.arg_index == 1]
    assert [specs[p.tensor] for p in batch] == [(("x",), ())]


def test_narrow_mlp_on_latency_bound_cpu_links_stays_replicated() -> None:
    # With the catalog's CPU links (10 us per message) the 13 small gradient all-reduces of data
    # parallelism cost more than the compute they save: replication is optimal.
    cluster = sp.Cluster.local(devices=jax.devices()[:4])
    *_, specs = _plan(32, 256, cluster)
    assert all(spec == tuple(() for _ in spec) for spec in specs.values())


def test_tying_repeated_layers_keeps_the_optimum_with_the_right_period() -> None:
    # Dense_1 .. Dense_4 share a fingerprint. Tied with period 2 (alternating layers share
    # variables) the problem is smaller and keeps the untied optimum (column/row pairs); with
    # period 1 every layer must take the same strategy, which cannot alternate.
    cluster = sp.Cluster.local(devices=jax.devices()[:4])
    _, _, untied_ip, untied, _ = _plan(256, 32, cluster, tie_period=0)
    _, _, pair_ip, pair, _ = _plan(256, 32, cluster, tie_period=2)
    _, _, same_ip, same, _ = _plan(256, 32, cluster, tie_period=1)
    assert len(same_ip.problem.nodes) < len(pair_ip.problem.nodes) < len(untied_ip.problem.nodes)
    assert pair.objective == pytest.approx(untied.objective, rel=1e-6)
    assert same.objective > untied.objective


def test_elementwise_followers_shrink_the_ilp_and_keep_the_mlp_optimum() -> None:
    cluster = sp.Cluster.local(devices=jax.devices()[:4])
    step, state, x = mlp_step(256, 32)
    graph = sp.trace(step, state, x)
    mesh = LogicalMesh.create((4,), ("x",))
    free = build_intraop_problem(graph, mesh, cluster, tie_period=0,
                                 follow=False)
    followed = build_intraop_problem(graph, mesh, cluster, tie_period=0)
    assert len(followed.problem.followers) > len(free.problem.followers)
    a, b = solve(free.problem), solve(followed.problem)
    assert b.stats["variables"] < a.stats["variables"]
    assert b.objective == pytest.approx(a.objective, rel=1e-6)


def test_two_node_topology_gets_data_parallel_across_nodes_tensor_parallel_inside() -> None:
    # 2 nodes x 2 devices, the inter-node link 10x slower than the intra-node one, bound to 4
    # local devices. The mesh search lays the inner axis inside nodes.
    from shardplan.planner.mesh import best_mesh, candidate_meshes

    cluster = sp.Cluster.from_dict(
        {"name": "2x2", "groups": [{
            "device": "cpu", "nodes": 2, "devices_per_node": 2,
            "intra_node": {"bandwidth_GB_s": 100.0, "latency_us": 1.0},
            "inter_node": {"bandwidth_GB_s": 10.0, "latency_us": 10.0}}]},
        devices=jax.devices()[:4])
    assert [m.axis_sizes for m in candidate_meshes(range(4), cluster)] == [(2, 2)]
    step, state, x = mlp_step(256, 2048)
    graph = sp.trace(step, state, x)
    choice = best_mesh(graph, range(4), cluster, tie_period=2)
    assert choice.mesh.axis_names == ("outer", "inner") and choice.mesh.axis_sizes == (2, 2)
    assert choice.mesh.groups(("inner",)) == ((0, 1), (2, 3))  # inner axis = one node
    specs = decode_input_specs(choice.problem, choice.solution)
    # Tensor parallel only inside a node: some kernels are split on "inner" (column or row),
    # and nothing of the batch's size crosses nodes: every collective over "outer" moves a
    # parameter's gradient or shard (or the scalar loss), never an activation. (A kernel may
    # be stored sharded on "outer" too, ZeRO-style: the update then reads and writes half of
    # its parameter and Adam moments, for a gather of the kernel across nodes.)
    kernels = [specs[p.tensor] for p in _kernels(graph)]
    assert any(("inner",) in k for k in kernels), kernels
    analysis = placed_analysis(graph, choice.problem, choice.solution, reduce_scatter=False)
    across = [graph.tensors[c.tensor].shape for c in analysis.collectives if "outer" in c.axes]
    assert across and all(2048 not in shape for shape in across), across
    # Data parallel across nodes: the batch split on "outer".
    assert [specs[p.tensor] for p in graph.parameters if p.arg_index == 1] == [(("outer",), ())]


def test_memory_budget_below_the_replicated_footprint_shards_the_state() -> None:
    cluster = sp.Cluster.local(devices=jax.devices()[:4])
    step, state, x = mlp_step(32, 256)
    graph = sp.trace(step, state, x)
    mesh = LogicalMesh.create((4,), ("x",))
    replicated = sum(p.nbytes for p in graph.parameters)

    def local_bytes(specs):
        return sum(graph.tensors[t].nbytes // mesh.size([a for axes in spec for a in axes])
                   for t, spec in specs.items())

    for budget in (replicated * 0.5, replicated * 0.3):
        ip = build_intraop_problem(graph, mesh, cluster, tie_period=2,
                                   memory_budget_bytes=budget)
        solution = solve(ip.problem)
        assert solution.status == "optimal"
        specs = decode_input_specs(ip, solution)
        assert local_bytes(specs) <= budget
        sharded = [p for p in graph.parameters if p.role in ("parameter", "optimizer_state")
                   and any(specs[p.tensor])]
        assert sharded
    # Below a quarter of the footprint (everything split 4 ways) nothing fits.
    ip = build_intraop_problem(graph, mesh, cluster, tie_period=2,
                               memory_budget_bytes=replicated * 0.2)
    assert solve(ip.problem).status == "infeasible"


def test_candidate_meshes_follow_the_topology_one_per_symmetry_class() -> None:
    from shardplan.planner.mesh import candidate_meshes

    spec = {"name": "8x8", "groups": [{
        "device": "a100-80g", "nodes": 8, "devices_per_node": 8,
        "intra_node": {"bandwidth_GB_s": 300.0, "latency_us": 2.0},
        "inter_node": {"bandwidth_GB_s": 25.0, "latency_us": 5.0}}]}
    cluster = sp.Cluster.from_dict(spec)
    ids = cluster.groups[0].device_ids

    def shapes(ids, cluster, max_axes):
        return [m.axis_sizes for m in candidate_meshes(ids, cluster, max_axes=max_axes)]

    # Across nodes x inside nodes; 64 on one axis is the 8 x 8 mesh with both axes together.
    assert shapes(ids, cluster, 2) == [(8, 8)]
    # Splitting either level (2 x 4 and 4 x 2 cost the same on uniform links).
    assert shapes(ids, cluster, 3) == [(2, 4, 8), (8, 2, 4)]
    meshes = candidate_meshes(ids, cluster)
    assert meshes[0].groups(("inner",))[0] == tuple(range(8))  # the inner axis is one node
    local = sp.Cluster.local()
    assert shapes(range(8), local, 2) == [(2, 4)]
    assert shapes(range(8), local, 3) == [(2, 2, 2)]
    assert shapes(range(4), sp.Cluster.local(devices=jax.devices()[:4]), 2) == [(2, 2)]
