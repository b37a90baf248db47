"""The bad-input contract (docs/errors.md): one test per row of its table. Each checks the
error's type, that the message names the offending item (key path, field, value, equation or
source line) and that it gives a remedy. Planning runs on ``ShapeDtypeStruct``s."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import re
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import shardplan_models as models
from helpers import fused_qkv_lm
from helpers.steps import mlp_step

import shardplan as sp
from shardplan.cost.rules import op_rule
from shardplan.planner.multi import _warn_gap
from shardplan.planner.single import _warn_time_limit
from shardplan.solver import Solution
from shardplan.solver.stages.pipeline import (
    REMATS,
    DeviceGroup,
    LayerKind,
    LayerOption,
    Link,
    PipelineProblem,
)
from shardplan.solver.stages.search import solve_pipeline

MIXED = {"a100-80g": 4, "v100-32g": 4}

CLUSTER = {
    "name": "two",
    "groups": [
        {"name": "a", "device": "a100-80g", "nodes": 2, "devices_per_node": 4,
         "intra_node": {"bandwidth_GB_s": 300, "latency_us": 2},
         "inter_node": {"bandwidth_GB_s": 25, "latency_us": 5}},
        {"name": "b", "device": "v100-32g", "nodes": 1, "devices_per_node": 8,
         "intra_node": {"bandwidth_GB_s": 150, "latency_us": 2}},
    ],
    "between_groups": {"bandwidth_GB_s": 6.25, "latency_us": 5},
}


def _fields(message: str) -> dict[str, str]:
    """The ``where`` / ``value`` / ``fix`` lines of a :func:`~shardplan.errors.format_error`
    message."""
    return dict(re.findall(r"^  (where|value|fix):\s+(.*)$", message, re.MULTILINE))


# -------------------------------------------------------------------------------------------
# 1-2: clusters (the YAML spelling of every rule: test_cluster.py's validation table)


def test_unknown_device_type_names_the_key_and_the_catalog() -> None:
    bad = copy.deepcopy(CLUSTER)
    bad["groups"][0]["device"] = "a100x"
    with pytest.raises(sp.ClusterError) as info:
        sp.Cluster.from_dict(bad)
    got = _fields(str(info.value))
    assert got["where"] == "groups[0].device" and got["value"] == "'a100x'"
    assert "did you mean" in got["fix"] and "'a100-80g'" in got["fix"]
    assert "Catalog names: a100-40g, a100-80g, cpu," in got["fix"]
    assert "inline spec" in got["fix"]  # the other remedy: give the device's figures
    with pytest.raises(sp.ClusterError) as info:
        sp.Cluster.local(types={"a100": 8})
    got = _fields(str(info.value))
    assert got["where"] == "types['a100']" and "did you mean 'a100-80g'" in got["fix"]


@pytest.mark.parametrize(("group", "key", "value", "where"), [
    (0, "nodes", 0, "groups[0].nodes"),
    (1, "devices_per_node", -2, "groups[1].devices_per_node"),
    (1, "intra_node", {"latency_us": 2}, "groups[1].intra_node.bandwidth_GB_s"),
])
def test_zero_or_negative_counts_and_a_missing_bandwidth_name_the_key_path(
        group: int, key: str, value: object, where: str) -> None:
    bad = copy.deepcopy(CLUSTER)
    bad["groups"][group][key] = value
    with pytest.raises(sp.ClusterError) as info:
        sp.Cluster.from_dict(bad)
    got = _fields(str(info.value))
    assert got["where"] == where and got["fix"]


def test_zero_devices_of_a_local_type_name_the_type() -> None:
    with pytest.raises(sp.ClusterError) as info:
        sp.Cluster.local(types={"a100-80g": 0, "v100-32g": 8})
    got = _fields(str(info.value))
    assert got["where"] == "types['a100-80g']" and got["value"] == "0"
    assert ">= 1" in got["fix"]


# -------------------------------------------------------------------------------------------
# 3: config keys


def test_an_unknown_config_key_suggests_the_closest() -> None:
    with pytest.raises(sp.ConfigError) as info:
        sp.PlanConfig(time_limit=5)  # type: ignore[call-arg]
    got = _fields(str(info.value))
    assert got["where"] == "PlanConfig(time_limit=...)"
    assert got["fix"].startswith("did you mean 'time_limit_s'?")
    with pytest.raises(sp.ConfigError) as info:
        sp.PlanConfig.from_dict({"stage_time_limit_s": 5, "max_stage": 2})
    got = _fields(str(info.value))
    assert got["where"] == "PlanConfig.max_stage" and "did you mean 'max_stages'?" in got["fix"]
    # Values are type-checked (a quoted number, a schedule that is not one), naming the key.
    for key, value in (("time_limit_s", "5"), ("schedules", ["1f1b", "zb"]),
                       ("pipeline", 1)):
        with pytest.raises(sp.ConfigError) as info:
            sp.PlanConfig.from_dict({key: value}, where="plan.yaml: config")
        got = _fields(str(info.value))
        assert got["where"] == f"plan.yaml: config.{key}" and got["value"] == repr(value)
        assert got["fix"].startswith("give a")
    # What a YAML file gives (lists, ints for floats) becomes the dataclass's values.
    config = sp.PlanConfig.from_dict({"time_limit_s": 5, "schedules": ["1f1b"],
                                      "tie_periods": [1], "memory_budget_bytes": None})
    assert config == sp.PlanConfig(time_limit_s=5.0, schedules=("1f1b",), tie_periods=(1,))


# -------------------------------------------------------------------------------------------
# 4-6: plans that cannot exist


def test_a_model_that_cannot_fit_gives_the_lower_bound_and_the_devices_needed() -> None:
    config = models.load_model_config("gpt3-175b", overrides={"scan_layers": True})
    graphdef, state = models.abstract_train_state(config)
    step = models.make_train_step(graphdef)
    batch = models.example_batch(config, 8, abstract=True)
    need = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert need > 2e12  # 175 B parameters and two Adam moments in fp32
    for types in ({"a100-80g": 8}, MIXED):  # the one-mesh and the stage planner's paths
        with pytest.raises(sp.InfeasibleError) as info:
            sp.make_plan(step, state, batch, cluster=sp.Cluster.local(types=types))
        message = str(info.value)
        assert f"{need:,} bytes" in message
        assert f"'per_device_lower_bound_bytes': {math.ceil(need / 8)}" in message
        for name, usable in (("a100-80g", 72e9), ("v100-32g", 28.8e9)):  # 90 % of memory
            if name in types:
                assert f"{name}: at least {math.ceil(need / usable):,} devices" in message
        assert "use more or larger devices" in _fields(message)["fix"]


def test_a_batch_no_data_parallel_degree_divides_lists_batch_sizes_that_work() -> None:
    # Width 63 and batch 4095 split over no mesh axis of 8 devices (2, 4, 8): every device
    # would hold the whole step's activations, over the 4 MB budget.
    config = sp.PlanConfig(memory_budget_bytes=4e6)
    step, state, x = mlp_step(63, 4095)
    with pytest.raises(sp.InfeasibleError) as info:
        sp.make_plan(step, state, x, cluster=sp.Cluster.local(), config=config)
    fix = _fields(str(info.value))["fix"]
    assert "the batch of 4095 samples splits over at most 1 of the 8 devices" in fix
    assert "batch sizes all 8 devices can share: 4088 or 4096" in fix
    # The size it names does work: data parallelism fits the same budget.
    step, state, x = mlp_step(63, 4096)
    plan = sp.make_plan(step, state, x, cluster=sp.Cluster.local(), config=config)
    assert max(plan.predicted.memory_bytes.values()) <= 4e6


def test_more_interleaved_stage_chunks_than_layers_names_both() -> None:
    # PlanConfig has no exact stage count (max_stages is a bound, which more stages than
    # layers cannot break); what can ask for more pipeline parts than there are layers is the
    # interleaved schedule: every stage holds `chunks` model chunks of at least one layer.
    step, state, x = mlp_step(64, 8, layers=2)  # 3 pipeline layers: 2 blocks and the loss
    config = sp.PlanConfig(pipeline=True, schedules=("interleaved",), chunks=(4,))
    with pytest.raises(sp.InfeasibleError) as info:
        sp.make_plan(step, state, x, cluster=sp.Cluster.local(types={"a100-80g": 8}),
                     config=config)
    message = str(info.value)
    assert "the model's 3 pipeline layers" in message and "chunks [4]" in message
    assert "every requested chunk count exceeds the layers" in message
    assert _fields(message)["fix"].startswith("allow the 1f1b or gpipe schedule")


# -------------------------------------------------------------------------------------------
# 7: primitives without a rule


def _callback_step(w, x):
    def loss(w):
        return jnp.mean((x @ w["w"]) ** 2)

    value, grads = jax.value_and_grad(loss)(w)
    h = x @ w["w"]
    # A host callback: a primitive with no cost or sharding rule (pure_callback).
    spread = jax.pure_callback(np.tanh, jax.ShapeDtypeStruct(h.shape, h.dtype), h)  # UNKNOWN
    return jax.tree.map(lambda p, g: p - 0.1 * g, w, grads), {"loss": value,
                                                            "spread": spread.mean()}


def test_an_unknown_primitive_is_refused_by_name_and_line_unless_not_strict() -> None:
    state = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if text.endswith("# UNKNOWN"))
    for config in (sp.PlanConfig(), sp.PlanConfig(pipeline=True)):  # both planners
        with pytest.raises(sp.TraceError) as info:
            sp.make_plan(_callback_step, state, x, cluster=sp.Cluster.local(), config=config)
        got = _fields(str(info.value))
        assert re.fullmatch(rf"pure_callback at .*test_errors\.py:{line}:\d+ \(_callback_step\)",
                            got["where"]), got["where"]
        assert "PlanConfig(strict=False)" in got["fix"] and "add a rule" in got["fix"]
    with pytest.warns(sp.ShardplanWarning, match=r"(?s)planned replicated.*pure_callback at"):
        plan = sp.make_plan(_callback_step, state, x, cluster=sp.Cluster.local(),
                            config=sp.PlanConfig(strict=False))
    assert plan.stages
    # Replicated, not guessed elementwise: every factor of the callback is fixed.
    graph = sp.trace(_callback_step, state, x)
    op = next(o for o in graph.ops if o.primitive == "pure_callback")
    assert {f.kind for f in op_rule(graph, op).factors} == {"fixed"}


def test_the_reference_models_have_no_unknown_primitives() -> None:
    # strict=True is the default: it must not refuse the models the project ships.
    for name in ("gpt-tiny", "llama-tiny", "moe-tiny", "gpt-tiny-scan"):
        config = models.load_model_config(name)
        graphdef, state = models.abstract_train_state(config)
        graph = sp.trace(models.make_train_step(graphdef), state,
                         models.example_batch(config, 4, abstract=True))
        assert graph.unknown_primitives == (), name


def test_dropout_is_not_an_unknown_primitive() -> None:
    def f(w, x, key):
        h = x @ w
        keep = jax.random.bernoulli(key, 0.9, h.shape)
        return jnp.where(keep, h / 0.9, 0).sum()

    graph = sp.trace(f, jnp.ones((4, 4)), jnp.ones((8, 4)), jax.random.key(0))
    assert graph.unknown_primitives == ()


# -------------------------------------------------------------------------------------------
# 8: solver time limits


def test_solver_limits_warn_with_the_gap_and_return_the_incumbent() -> None:
    # The stage planner, stopped by its work budget after the first unit: the best seed plan.
    step, state, x = mlp_step(256, 64, 4)
    cluster = sp.Cluster.local(types=MIXED)
    with pytest.warns(sp.ShardplanWarning,
                      match=r"(?s)work limit of 1 units: the plan is the best found, within "
                            r"\d+\.\d % of a proven lower bound; not proven optimal\."
                            r".*PlanConfig.stage_work_limit.*raise"):
        cut = sp.make_plan(step, state, x, cluster=cluster,
                           config=sp.PlanConfig(stage_work_limit=1))
    best = sp.make_plan(step, state, x, cluster=cluster)
    assert cut.solver["status"] == "feasible" and best.solver["status"] == "optimal"
    assert cut.predicted.step_time_s >= best.predicted.step_time_s
    # Every stage-planner plan records its proven gap, and the summary shows it.
    assert best.solver["gap"] == 0.0
    assert best.solver["lower_bound"] == best.solver["objective_value"]
    value, floor = cut.solver["objective_value"], cut.solver["lower_bound"]
    assert 0 < floor <= value and cut.solver["gap"] == pytest.approx((value - floor) / value)
    assert f"within {100 * cut.solver['gap']:.1f} % of a proven lower bound" in cut.summary()
    # The intra-op solver, given 1 ms: less than CP-SAT's presolve, so the greedy hint. (A
    # problem whose relaxation is fractional: a GPT-2-style block written as users write it,
    # with a fused q/k/v projection and 25 heads, at batch 1 on one 8-GPU node; the models'
    # GPT blocks and the small MLPs have integral relaxations there.)
    step, state, ids = fused_qkv_lm.abstract_case(batch=1)
    node = sp.Cluster.from_dict({"name": "h100-node", "groups": [{
        "name": "h100", "device": "h100-sxm", "nodes": 1, "devices_per_node": 8,
        "intra_node": {"bandwidth_GB_s": 450.0, "latency_us": 2.0}}]})
    with pytest.warns(sp.ShardplanWarning,
                      match=r"(?s)0.001 s limit: the sharding is the best found, within "
                            r"\d+\.\d % of a proven lower bound; not proven optimal\."
                            r".*PlanConfig.time_limit_s.*raise"):
        plan = sp.make_plan(step, state, ids, cluster=node,
                            config=sp.PlanConfig(time_limit_s=0.001, relative_gap=0.0,
                                                 tie_periods=(1,)))
    assert plan.solver["status"] == "feasible" and plan.solver["gap"] > 0


def _split_problem(**limits: Any) -> PipelineProblem:
    """Two layers on two one-device groups: layer 0 runs only on group x, layer 1 only on y.
    The quick plans (replicas on one group) find nothing; the one plan is a 2-stage pipeline
    x -> y, which only the exact search builds."""
    def option() -> LayerOption:
        return LayerOption(1, (0.0, 0.5), (0.0, 0.5), dict.fromkeys(REMATS, (0.0, 0.0)),
                           dict.fromkeys(REMATS, 0.0), 0.0, 0.0)

    free = Link(1.0, 0.0)
    kinds = (LayerKind("a", {0: (option(),)}, 0.0, 0.0), LayerKind("b", {1: (option(),)}, 0.0, 0.0))
    groups = (DeviceGroup("x", 1, 1, 100.0, 1.0, free, free),
              DeviceGroup("y", 1, 1, 100.0, 1.0, free, free))
    return PipelineProblem(kinds, (0, 1), groups, free, batch=2, microbatch_sizes=(1,),
                           **limits)


def test_a_stage_planner_out_of_budget_before_any_plan_names_the_plan_config_limits() -> None:
    assert solve_pipeline(_split_problem()).stats.optimal  # a plan exists
    with pytest.raises(sp.SolverError) as info:
        solve_pipeline(_split_problem(work_limit=1, time_limit_s=60.0))
    message = str(info.value)
    assert message.startswith("The stage planner found no plan within its budget (")
    assert "of 1 work units, time limit 60 s) and could not prove that none exists." in message
    got = _fields(message)
    assert got["where"] == "PlanConfig.stage_work_limit, PlanConfig.stage_time_limit_s"
    assert got["value"] == "{'stage_work_limit': 1, 'stage_time_limit_s': 60.0}"
    assert got["fix"].startswith("raise PlanConfig.stage_work_limit (0: no limit) or "
                                 "PlanConfig.stage_time_limit_s")
    assert "PipelineProblem" not in message


@pytest.mark.parametrize("bound", [0.0, math.inf], ids=["zero", "none"])
def test_a_solver_limit_without_a_proven_lower_bound_says_so(bound: float) -> None:
    # A bound of 0 (or none) proves nothing: the warnings say "no lower bound proven", never
    # "within 100.0 % of the lower bound". Cheap inputs: each warning's own helper.
    solved = solve_pipeline(_split_problem())
    cut = SimpleNamespace(evaluation=solved.evaluation, stats=dataclasses.replace(
        solved.stats, optimal=False, lower_bound=bound, work=5))
    with pytest.warns(sp.ShardplanWarning) as record:
        _warn_gap(cut, _split_problem(work_limit=2))  # type: ignore[arg-type]
    (message,) = [str(w.message) for w in record]
    assert message.startswith("The stage planner reached its work limit of 2 units: the plan "
                              "is the best found, no lower bound proven; not proven optimal.")
    assert _fields(message)["where"] == "PlanConfig.stage_work_limit" and "%" not in message
    # The intra-op solver: a gap of 100 % (its bound is 0) or none at all.
    gap = 1.0 if bound == 0.0 else math.inf
    choice = SimpleNamespace(
        solution=Solution("feasible", (0,), 2.0, 0.0, gap, 0.1),
        mesh=SimpleNamespace(axis_names=("x",), axis_sizes=(8,)))
    with pytest.warns(sp.ShardplanWarning) as record:
        _warn_time_limit(choice, sp.PlanConfig(time_limit_s=5))  # type: ignore[arg-type]
    (message,) = [str(w.message) for w in record]
    assert message.startswith("The intra-op solver reached its 5 s limit: the sharding is the "
                              "best found, no lower bound proven; not proven optimal.")
    assert _fields(message)["where"].startswith("PlanConfig.time_limit_s") and "%" not in message


# -------------------------------------------------------------------------------------------
# 9: arguments


class _Config:
    """Something a user might leave in their state."""


@pytest.mark.parametrize("leaf", ["hello", _Config()], ids=["string", "object"])
def test_a_state_leaf_that_is_not_an_array_names_its_key_path(leaf: object) -> None:
    state = {"blocks": [{"w": jax.ShapeDtypeStruct((4, 4), jnp.float32), "name": leaf}]}
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32)

    def step(state, x):
        return state, (x @ state["blocks"][0]["w"]).sum()

    with pytest.raises(sp.TraceError) as info:
        sp.make_plan(step, state, x, cluster=sp.Cluster.local())
    got = _fields(str(info.value))
    assert got["where"] == "state/blocks/0/name"
    assert type(leaf).__name__ in got["value"] and "jax.ShapeDtypeStruct" in got["fix"]
    with pytest.raises(sp.TraceError) as info:
        sp.trace(step, state, x)
    assert _fields(str(info.value))["where"] == "argument 0, key path blocks/0/name"
    # None is an empty subtree, as everywhere in JAX: not an error.
    state["blocks"][0]["name"] = None
    assert sp.trace(step, state, x).parameters


# -------------------------------------------------------------------------------------------
# 10: steps that cannot be pipelined (the runtime's other refusals: test_accumulate.py)


def test_a_metric_that_is_no_mean_or_sum_refuses_microbatching_by_name() -> None:
    w = {"w": jnp.ones((3,))}
    batch = jnp.arange(24, dtype=jnp.float32).reshape(8, 3) / 10

    def step(state, x):
        w = state["w"]
        grad = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return {"w": w - 0.01 * grad}, {"worst": jnp.max(x @ w)}  # MAX

    config = sp.PlanConfig(pipeline=True, microbatch_sizes=(4,), stage_time_limit_s=60.0)
    plan = sp.make_plan(step, w, batch, cluster=sp.Cluster.local(types={"a100-80g": 8}),
                        config=config)
    assert plan.microbatches == 2
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if text.endswith("# MAX"))
    with pytest.raises(sp.PipelineError) as info:
        sp.apply_plan(step, plan)(w, batch)
    got = _fields(str(info.value))
    assert "returned as metrics/worst" in got["where"]
    assert f"test_errors.py:{line}:" in got["where"]
    assert "a mean or a sum over the batch" in got["fix"]


# -------------------------------------------------------------------------------------------
# 12: tracebacks

_LIBRARY = str(Path(sp.__file__).resolve().parent)


def _library_frames(error: BaseException) -> list[str]:
    return [f.f_code.co_filename for f, _ in traceback.walk_tb(error.__traceback__)
            if str(Path(f.f_code.co_filename).resolve()).startswith(_LIBRARY)]


def _errors(planned) -> list[BaseException]:
    """An error from each public entry point, raised in shardplan's own code."""
    step = lambda state, x: (state, x.sum())  # noqa: E731
    calls = [
        lambda: planned({"v": jnp.ones((4,))}, jnp.ones((8, 4))),  # a state it was not made for
        lambda: sp.make_plan(step, {"w": "not an array"}, jnp.ones((8, 2)),
                             cluster=sp.Cluster.local()),
        lambda: sp.trace(step, {"w": "not an array"}, jnp.ones((8, 2))),
        lambda: sp.Cluster.from_dict({"name": "x", "groups": []}),
        lambda: sp.Cluster.local(types={"a100": 8}),
        lambda: sp.load_plan("/nonexistent/plan.json"),
    ]
    out = []
    for call in calls:
        with pytest.raises(sp.ShardplanError) as info:
            call()
        out.append(info.value)
    return out


def test_library_frames_are_hidden_from_tracebacks() -> None:
    def step(state, x):
        return {"w": state["w"] * 0.5}, (x @ state["w"]).sum()

    state = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    plan = sp.make_plan(step, state, jax.ShapeDtypeStruct((8, 4), jnp.float32),
                        cluster=sp.Cluster.local())
    planned = sp.apply_plan(step, plan)
    previous = jax.config.jax_traceback_filtering
    try:
        jax.config.update("jax_traceback_filtering", "auto")
        for error in _errors(planned):
            assert _library_frames(error) == [], (error, _library_frames(error))
            assert any(__file__ == f.f_code.co_filename
                       for f, _ in traceback.walk_tb(error.__traceback__))
        jax.config.update("jax_traceback_filtering", "off")
        for error in _errors(planned):
            assert _library_frames(error), error
    finally:
        jax.config.update("jax_traceback_filtering", previous)
    # The wrapped entry points keep their names, docstrings and signatures.
    assert sp.make_plan.__name__ == "make_plan" and "Plans" in (sp.make_plan.__doc__ or "")
    assert "cluster" in inspect.signature(sp.make_plan).parameters


def test_every_row_of_the_contract_names_tests_that_exist() -> None:
    # docs/errors.md: each row's last cell names its tests (`file.py::test_name`, or a bare
    # name in tests/test_errors.py, or in the file named before it in the same cell).
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    rows = [line for line in (root / "docs" / "errors.md").read_text().splitlines()
            if re.match(r"\| \d+ \|", line)]
    assert len(rows) >= 20
    for row in rows:
        cell = row.rstrip(" |").rsplit("|", 1)[-1]
        names, current = [], "test_errors.py"
        for file, name in re.findall(r"(?:(test_\w+\.py)::)?(test_\w+)", cell):
            current = file or current
            names.append((current, name))
        assert names, row
        for file, name in names:
            (path,) = (root / "tests").rglob(file)  # tests/<stage>/test_x.py
            text = path.read_text()
            assert re.search(rf"^def {name}\(", text, re.M), (file, name)
