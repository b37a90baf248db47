"""Python-loop blocks folded into one per fingerprint (planner/fold.py): the folded problem is
the unrolled graph's tied problem, a block's size."""

from __future__ import annotations

import math
import re

import pytest
import shardplan_models as models
from helpers.plans import TWO_TYPES

import shardplan as sp
from shardplan.planner.fold import fold_blocks
from shardplan.planner.intraop import build_intraop_problem
from shardplan.planner.layout import intraop_layout, step_facts
from shardplan.planner.mesh import candidate_meshes
from shardplan.solver import evaluate, solve
from shardplan.solver.intraop.reduce import SALTIPLIER


def _graph(name: str, layers: int, *, scan: bool = False, batch: int = 8) -> sp.OpGraph:
    config = models.load_model_config(name, overrides={"n_layers": layers, "scan_layers": scan})
    graphdef, state = models.abstract_train_state(config)
    return sp.trace(models.make_train_step(graphdef), state,
                    models.example_batch(config, batch, abstract=True))


@pytest.fixture(scope="module")
def gpt4() -> sp.OpGraph:
    return _graph("gpt-tiny", 4)


def test_a_loop_folds_into_one_block_per_fingerprint(gpt4) -> None:
    fold = fold_blocks(gpt4)
    assert fold is not None
    blocks = [layer.index for layer in gpt4.blocks]
    assert dict(fold.members) == {blocks[0]: 4}
    # Every op of the loop is computed by a folded op of the same primitive, and the folded
    # graph executes what the loop does: the same FLOPs, a block's ops once.
    assert all(gpt4.ops[o].primitive == fold.graph.ops[f].primitive
               for o, f in enumerate(fold.op_of))
    assert math.isclose(fold.graph.total_flops(), gpt4.total_flops(), rel_tol=1e-12)
    block_ops = len(gpt4.layers[blocks[0]].ops)
    assert len(fold.graph.ops) <= len(gpt4.ops) - 3 * block_ops + 3 * 2  # a loop index each
    # Every leaf is there or stands on its representative's: blocks 1-3's parameters and
    # Adam moments are dropped, each for block 0's leaf at the same position, which holds the
    # bytes of the four.
    kept = {fold.tensor_ids[p.tensor]: p for p in fold.graph.parameters}
    by_tensor = {p.tensor: p for p in gpt4.parameters}
    assert set(kept) | set(fold.leaf_of) == set(by_tensor) and not set(kept) & set(fold.leaf_of)
    for leaf, rep in fold.leaf_of.items():
        mine, theirs = by_tensor[leaf].path, by_tensor[rep].path
        assert re.sub(r"/blocks/[123]/", "/blocks/0/", mine) == theirs != mine
    assert len(fold.leaf_of) == 3 * len([p for p in kept.values() if "/blocks/0/" in p.path])
    weights = fold.leaf_weights
    folded = fold.graph.parameters
    assert {weights[p.tensor] for p in folded if "/blocks/0/" in p.path} == {4}
    assert {weights[p.tensor] for p in folded if "/blocks/" not in p.path} == {1}
    # Only the tensors it still names: the members' results are gone.
    assert len(fold.graph.tensors) < len(gpt4.tensors) / 2
    inputs = set(fold.graph.inputs)
    assert all(t is None or t in inputs or fold.graph.tensors[t].producer is not None
               for t in fold.graph.outputs)
    # The residual stream between blocks is what the folded graph cannot wire: carries, read
    # by the first block's ops for the three blocks that follow it (forward) or precede it
    # in the backward pass. (Each block's optimizer state, read by the update, and constants
    # computed per block, regenerated where they are read, are carried too.)
    graph = fold.graph

    def computed_value(t: int) -> bool:
        producer = graph.tensors[t].producer
        return producer is not None and not graph.ops[producer].attrs.get("folded")

    # (Scalar sums accumulated block after block, a global norm's, are carried as well.)
    computed = [c for c in fold.boundary.carries
                if computed_value(c.tensor) and graph.tensors[c.tensor].shape]
    assert {c.executions for c in computed} == {3}
    phases = {graph.ops[c.op].phase for c in computed}
    assert phases == {"forward", "backward"}
    assert {graph.tensors[c.tensor].shape for c in computed if graph.ops[c.op].phase
            == "forward"} == {(8, 32, 64)}  # [batch, seq, d_model]


def test_a_scanned_stack_has_nothing_to_fold() -> None:
    assert fold_blocks(_graph("gpt-tiny", 4, scan=True)) is None


@pytest.mark.parametrize(("name", "period"), [("gpt-tiny", 1), ("gpt-tiny", 2),
                                              ("llama-tiny", 1)])
def test_the_folded_problem_is_the_unrolled_graphs_tied_problem(name: str,
                                                                period: int) -> None:
    # Tying the unrolled graph's blocks gives one set of variables per block; folding them
    # builds that problem from one block. Same optimum, and any assignment of the folded
    # problem costs on the tied one exactly what it costs folded.
    graph = _graph(name, 4)
    fold = fold_blocks(graph, period)
    assert fold is not None
    mesh = candidate_meshes(TWO_TYPES.groups[0].device_ids[:8], TWO_TYPES)[0]
    tied = build_intraop_problem(graph, mesh, TWO_TYPES, tie_period=period)
    folded = build_intraop_problem(graph, mesh, TWO_TYPES, tie_period=period, fold=fold)
    assert len(folded.problem.nodes) < len(tied.problem.nodes)
    assert len(folded.problem.edges) < len(tied.problem.edges)
    # The folded problem names the full graph's ops and leaves.
    assert set(folded.op_nodes) == set(tied.op_nodes)
    assert set(folded.input_nodes) == set(tied.input_nodes)
    solution = solve(folded.problem)
    assert solution.status == "optimal" and solution.assignment is not None
    mapped = [0] * len(tied.problem.nodes)
    for table, own in ((tied.input_nodes, folded.input_nodes), (tied.op_nodes, folded.op_nodes)):
        for key, node in table.items():
            mapped[node] = solution.assignment[own[key]]
    assert math.isclose(evaluate(tied.problem, mapped).cost.total, solution.objective,
                        rel_tol=1e-12)
    # Both minimise their costs salted by node name (<= SALTIPLIER relative, to break ties):
    # where two shardings nearly tie, the two may pick either.
    assert math.isclose(solve(tied.problem).objective, solution.objective,
                        rel_tol=SALTIPLIER)


def test_a_folded_layout_priced_on_another_mesh_is_the_problem_built_there(gpt4) -> None:
    # The layer tables lay the folded graph out once per signature and price it per mesh: laid
    # out on an A100 mesh and priced on the V100 mesh of its shape (other device figures,
    # other links), it is the folded problem build_intraop_problem lays out there, which it
    # gives on the full graph's ids (every member's op and dropped leaf on its
    # representative's node).
    fold = fold_blocks(gpt4)
    assert fold is not None
    facts = step_facts(fold.graph, fold=fold)
    a100, v100 = TWO_TYPES.groups[0].device_ids, TWO_TYPES.groups[1].device_ids
    pairs = [pair for k in (2, 4) for pair in zip(candidate_meshes(a100[:k], TWO_TYPES),
                                                  candidate_meshes(v100[:k], TWO_TYPES),
                                                  strict=True)]
    assert [(a.axis_sizes, b.axis_sizes) for a, b in pairs] == [((2,), (2,)),
                                                                ((2, 2), (2, 2))]
    for here, there in pairs:
        layout = intraop_layout(fold.graph, here, facts=facts)
        got = layout.problem(there, TWO_TYPES, relative_gap=0.01)
        want = build_intraop_problem(gpt4, there, TWO_TYPES, fold=fold, relative_gap=0.01)
        assert got.problem == want.problem, there
        assert got.problem != layout.problem(here, TWO_TYPES, relative_gap=0.01).problem
        assert got.strategies == want.strategies
        assert want.op_nodes == {o: got.op_nodes[f] for o, f in enumerate(fold.op_of)}
        assert want.input_nodes == fold.full_inputs(got.input_nodes)
        assert len(want.input_nodes) == len(gpt4.parameters) > len(got.input_nodes)


def test_a_fold_of_another_graph_is_refused(gpt4) -> None:
    fold = fold_blocks(gpt4)
    mesh = candidate_meshes(TWO_TYPES.groups[0].device_ids[:2], TWO_TYPES)[0]
    with pytest.raises(ValueError, match="fold_blocks"):
        build_intraop_problem(gpt4, mesh, TWO_TYPES, tie_period=2, fold=fold)


def test_an_annotated_leaf_of_a_folded_block_holds_in_every_block(gpt4) -> None:
    # Block 2's leaf is dropped from the folded graph (it stands on block 0's): the user's
    # fixed spec applies to the node they share, as on the tied unrolled problem.
    fold = fold_blocks(gpt4)
    assert fold is not None
    path = "0/blocks/2/mlp/up/kernel/value"
    leaf = gpt4.param_by_path[path].tensor
    assert leaf in fold.leaf_of
    mesh = candidate_meshes(TWO_TYPES.groups[0].device_ids[:4], TWO_TYPES)[0]
    axis = mesh.axis_names[-1]
    fixed = {path: ((axis,), ())}
    tied = build_intraop_problem(gpt4, mesh, TWO_TYPES, fixed_specs=fixed)
    folded = build_intraop_problem(gpt4, mesh, TWO_TYPES, fold=fold, fixed_specs=fixed)
    solution = solve(folded.problem)
    assert solution.assignment is not None
    for t in (leaf, fold.leaf_of[leaf]):  # block 2's leaf and block 0's
        n = folded.input_nodes[t]
        assert folded.strategies[n][solution.assignment[n]].result_specs[0] == ((axis,), ())
    assert math.isclose(solve(tied.problem).objective, solution.objective, rel_tol=SALTIPLIER)
