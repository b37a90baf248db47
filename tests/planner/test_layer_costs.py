"""Layer cost tables (planner/layer_costs.py): one intra-op solution per device group and
sub-mesh size, read back per layer kind."""

from __future__ import annotations

import pytest
import shardplan_models as models

import shardplan as sp
from shardplan.planner.layer_costs import layer_costs, submesh_sizes

BATCH = 16


def _tables(scan: bool):
    config = models.load_model_config("gpt-tiny", overrides={"scan_layers": scan})
    graphdef, state = models.abstract_train_state(config)
    graph = sp.trace(models.make_train_step(graphdef), state,
                     models.example_batch(config, BATCH, abstract=True))
    cluster = sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
    return config, graph, layer_costs(graph, cluster, reference_batch=BATCH,
                                      sizes={0: (1, 2), 1: (1,)})


@pytest.fixture(scope="module")
def unrolled():
    return _tables(scan=False)


@pytest.fixture(scope="module")
def scanned():
    return _tables(scan=True)


def test_one_kind_per_fingerprint_and_one_option_per_group_and_size(unrolled) -> None:
    _, _, costs = unrolled
    assert costs.names == ("pre", "blocks.0", "blocks.1", "post")
    assert costs.layers == (0, 1, 1, 2)
    assert [sorted(k.options) for k in costs.kinds] == [[0, 1]] * 3
    assert all([o.devices for o in k.options[0]] == [1, 2] for k in costs.kinds)
    assert all([o.devices for o in k.options[1]] == [1] for k in costs.kinds)
    assert set(costs.choices) == {(0, 1), (0, 2), (1, 1)}


def test_block_figures(unrolled) -> None:
    config, graph, costs = unrolled
    block = costs.kinds[1]
    layer = graph.layers[1]
    # The residual stream crosses between blocks: seq x d_model fp32 values per sample.
    assert block.boundary_bytes == config.max_seq_len * config.d_model * 4
    assert block.gradient_bytes == layer.param_bytes
    (a100, _), (v100,) = block.options[0], block.options[1]
    # One device holds parameters, both Adam moments and two gradient copies (the sums and
    # one microbatch's fresh gradients before they are added).
    assert a100.state_bytes == v100.state_bytes == 5 * layer.param_bytes
    # The V100 is slower (lower peak FLOP/s and bandwidth).
    assert v100.forward_s[1] > a100.forward_s[1] > 0
    assert v100.backward_s[1] > a100.backward_s[1] > a100.forward_s[1]
    act = a100.activation_bytes
    assert act["none"] > act["selective"] > act["full"] == block.boundary_bytes
    # The backward recomputes what a policy does not keep, and makes its own transients.
    assert a100.recompute_bytes == {p: act["none"] - act[p] for p in act}
    assert 0 < a100.work_bytes["none"] < act["none"]
    rc = a100.recompute_s
    assert rc["none"] == (0.0, 0.0)
    assert 0 < rc["selective"][1] < rc["full"][1] <= a100.forward_s[1]
    assert a100.update_s > 0


def test_the_head_holds_the_tied_embedding_it_reads_during_the_step(unrolled) -> None:
    # gpt-tiny ties its output head to the token embedding, which the first layer owns: the
    # stage running the head holds a copy of it, the sums of its gradient term and one
    # microbatch's fresh term (not between steps: resident bytes leave them out).
    config, graph, costs = unrolled
    layer = {layer.name: layer for layer in graph.layers}
    post, pre = costs.kinds[2].options[0][0], costs.kinds[0].options[0][0]
    wte = config.vocab_size * config.d_model * 4
    assert post.state_bytes == 5 * layer["post"].param_bytes + 3 * wte
    assert post.resident_bytes == 3 * layer["post"].param_bytes
    # The first layer owns it: no copy there.
    assert pre.state_bytes == 5 * layer["pre"].param_bytes


def test_selective_remat_work_holds_the_recomputed_attention_core(unrolled) -> None:
    # Under selective remat the backward computes the attention core again when the layer's
    # backward starts; those values live beside its transients.
    _, _, costs = unrolled
    a100 = costs.kinds[1].options[0][0]
    work, core = a100.work_bytes, a100.recompute_bytes["selective"]
    assert work["full"] == work["none"] < work["selective"] <= work["none"] + core


def test_a_scanned_stack_costs_what_the_unrolled_one_does(unrolled, scanned) -> None:
    _, _, flat = unrolled
    _, _, scan = scanned
    assert scan.layers == flat.layers
    a, b = flat.kinds[1].options[0][0], scan.kinds[1].options[0][0]
    assert b.state_bytes == a.state_bytes
    assert scan.kinds[1].boundary_bytes == flat.kinds[1].boundary_bytes
    # The same remat boundary: the block's input. Without remat, a scan keeps more: its
    # forward loop hands the backward loop every residual the jaxpr names (stacked), where
    # unrolled blocks let XLA fuse the cheap ones into the backward pass (gpt-tiny per block
    # and sample: 329,728 against 231,424 bytes of XLA:CPU's temp; tests/cost/test_cost_memory.py).
    assert b.activation_bytes["full"] == a.activation_bytes["full"]
    assert (b.activation_bytes["none"] - b.activation_bytes["selective"]
            == a.activation_bytes["none"] - a.activation_bytes["selective"])
    assert b.activation_bytes["none"] == pytest.approx(1.43 * a.activation_bytes["none"],
                                                       rel=0.01)


def test_submesh_sizes() -> None:
    assert submesh_sizes(8, 8) == (1, 2, 4, 8)
    assert submesh_sizes(256, 8) == (1, 2, 4, 8, 16, 32, 64)
    assert submesh_sizes(6, 4) == (1, 2, 4)


def test_groups_of_one_device_type_and_links_share_their_solutions(unrolled) -> None:
    _, graph, _ = unrolled
    group = {"device": "a100-80g", "nodes": 1, "devices_per_node": 2,
             "intra_node": {"bandwidth_GB_s": 300.0, "latency_us": 2.0}}
    cluster = sp.Cluster.from_dict({
        "name": "twins", "groups": [{"name": "a", **group}, {"name": "b", **group}],
        "between_groups": {"bandwidth_GB_s": 25.0, "latency_us": 5.0}})
    costs = layer_costs(graph, cluster, reference_batch=BATCH, sizes={0: (1, 2), 1: (1, 2)})
    for d in (1, 2):
        a, b = costs.choices[(0, d)], costs.choices[(1, d)]
        assert set(b.mesh.device_ids) <= set(cluster.groups[1].device_ids)
        assert b.mesh.axis_sizes == a.mesh.axis_sizes
        assert b.solution == a.solution
        assert b.problem.mesh == b.mesh and b.problem.problem == a.problem.problem
        assert costs.timings["per_submesh_s"][(1, d)] == 0.0
    for kind in costs.kinds:
        assert kind.options[1] == kind.options[0]


def test_the_read_back_analysis_is_the_placed_analysis_of_the_solved_problem(unrolled) -> None:
    from shardplan.planner.decode import placed_analysis
    from shardplan.planner.fold import fold_blocks
    from shardplan.planner.layer_costs import _placed_analysis
    from shardplan.planner.mesh import MeshSearch

    _, graph, costs = unrolled
    cluster = sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
    # The tables solve the loop's blocks folded (planner.fold): the read-back is on the folded
    # graph, with the problem as the layout builds it there.
    fold = fold_blocks(graph, 1)
    assert fold is not None
    search = MeshSearch(fold.graph, cluster, fold=fold)
    choice = costs.choices[(0, 2)]
    layout = search.layout(choice.mesh)
    got = _placed_analysis(fold.graph, layout, choice.mesh, choice.solution.assignment,
                           search.facts.rules)
    want = placed_analysis(fold.graph, layout.problem(choice.mesh, cluster), choice.solution,
                           reduce_scatter=False)
    assert (got.specs, got.op_axes, got.collectives) == (want.specs, want.op_axes,
                                                         want.collectives)


def test_timings_split_the_work(unrolled) -> None:
    _, _, costs = unrolled
    t = costs.timings
    assert {"facts_s", "layout_s", "relaxation_build_s", "price_s", "solve_s", "readback_s",
            "total_s"} <= set(t)
    assert set(t["per_submesh_s"]) == set(costs.choices)
    assert t["fallbacks"] == 0


def test_sizes_on_which_no_layer_fits_are_skipped(unrolled) -> None:
    # Devices of two thirds of the lightest layer's static bytes: one device holds no layer.
    from shardplan.cluster import load_device
    from shardplan.planner.layer_costs import _state_bytes

    _, graph, _ = unrolled
    state = _state_bytes(graph, lambda t: graph.tensors[t].nbytes)
    lightest = min(state[layer.index] for layer in graph.layers if layer.kind != "shared")
    device = load_device("a100-80g").to_dict()
    device["memory_bytes"] = int(lightest / 1.5)
    cluster = sp.Cluster.from_dict({"name": "small", "groups": [{
        "device": device, "nodes": 1, "devices_per_node": 2,
        "intra_node": {"bandwidth_GB_s": 300.0, "latency_us": 2.0}}]})
    costs = layer_costs(graph, cluster, reference_batch=BATCH)
    assert costs.skipped_sizes == {0: (1,)}
    assert list(costs.choices) == [(0, 2)]
    assert all([o.devices for o in k.options[0]] == [2] for k in costs.kinds)
