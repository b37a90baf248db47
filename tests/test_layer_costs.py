"""Layer cost tables (planner/layer_costs.py): one intra-op solution per device group and
sub-mesh size, read back per layer kind."""

from __future__ import annotations

import pytest

import models
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
    # One device holds parameters, gradients and both Adam moments.
    assert a100.state_bytes == v100.state_bytes == 4 * layer.param_bytes
    # The V100 is slower (lower peak FLOP/s and bandwidth).
    assert v100.forward_s[1] > a100.forward_s[1] > 0
    assert v100.backward_s[1] > a100.backward_s[1] > a100.forward_s[1]
    act = a100.activation_bytes
    assert act["none"] > act["selective"] > act["full"] == block.boundary_bytes
    rc = a100.recompute_s
    assert rc["none"] == (0.0, 0.0)
    assert 0 < rc["selective"][1] < rc["full"][1] <= a100.forward_s[1]
    assert a100.update_s > 0


def test_a_scanned_stack_costs_what_the_unrolled_one_does(unrolled, scanned) -> None:
    _, _, flat = unrolled
    _, _, scan = scanned
    assert scan.layers == flat.layers
    a, b = flat.kinds[1].options[0][0], scan.kinds[1].options[0][0]
    assert b.state_bytes == a.state_bytes
    assert scan.kinds[1].boundary_bytes == flat.kinds[1].boundary_bytes
    assert b.activation_bytes["none"] == pytest.approx(a.activation_bytes["none"], rel=0.1)


def test_submesh_sizes() -> None:
    assert submesh_sizes(8, 8) == (1, 2, 4, 8)
    assert submesh_sizes(256, 8) == (1, 2, 4, 8, 16, 32, 64)
    assert submesh_sizes(6, 4) == (1, 2, 4)
