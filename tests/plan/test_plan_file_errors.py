"""Hand-edited plan files (``shardplan train --plan.file=...``, ``shardplan show``): every value
the runtime or the viewer would trip over later is refused when the file is read, as a typed
error naming the key path, the value and a remedy. Plans are built by hand: no planning."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardplan.cli.main import main
from shardplan.errors import ConfigError
from shardplan.plan import load_plan
from shardplan.plan._values import PLAN_SCHEDULES, REMATS, parse_type
from shardplan.plan.plan import Layout, MeshSpec, Plan, Predicted, ReplicaSpec, Stage
from shardplan.viz.terminal import MIN_WIDTH, show_text

FIRST = ("pre", "blocks.0", "blocks.1", "shared")
SECOND = ("blocks.2", "blocks.3", "post", "shared")  # the shared layer is on every stage


def two_replica_plan() -> Plan:
    """Two replicas of two stages each (a100s, then v100s) with their layouts and types."""
    a100, v100 = "a100-80g:model=2", "v100-32g:model=2"
    specs = {"params/w": ((), ("model",)), "params/emb": (("model",), ())}
    types = {"params/w": "float32[64,256]", "params/emb": "float32[512,64]"}
    stages = tuple(
        Stage(i, device, MeshSpec(("model",), (2,), (2 * i, 2 * i + 1)), layers,
              "full" if i % 2 else "none", i // 2, layout)
        for i, (device, layers, layout) in enumerate(
            [("a100-80g", FIRST, a100), ("a100-80g", SECOND, a100),
             ("v100-32g", FIRST, v100), ("v100-32g", SECOND, v100)]))
    return Plan(shardplan_version="0.1.0", graph_fingerprint="g", cluster_hash="c",
                config_hash="k", stages=stages, param_specs={k: (0, v) for k, v in specs.items()},
                batch_specs={}, microbatches=4, schedule="1f1b", microbatch_size=2,
                replicas=(ReplicaSpec((0, 1), 3), ReplicaSpec((2, 3), 1)),
                layouts={a100: Layout(specs, {"tokens": ((), ())}),
                         v100: Layout(specs, {"tokens": ((), ())})},
                state_types=types, batch_types={"tokens": "int32[8,128]"},
                predicted=Predicted(1.0, 0.8, 0.2, dict.fromkeys(range(8), 2**30), {}),
                solver={"status": "optimal"})


def one_stage_plan() -> Plan:
    """One stage on a (data=2) mesh: a 2-D parameter and a 2-D batch leaf, with their types."""
    return Plan(shardplan_version="0.1.0", graph_fingerprint="g", cluster_hash="c",
                config_hash="k",
                stages=(Stage(0, "cpu", MeshSpec(("data",), (2,), (0, 1)), ("pre", "post")),),
                param_specs={"params/w": (0, (("data",), ()))},
                batch_specs={"tokens": (("data",), ())},
                state_types={"params/w": "float32[8,16]"},
                batch_types={"tokens": "int32[4,32]"},
                predicted=Predicted(1e-3, 8e-4, 2e-4, {0: 1024, 1: 1024}, {}),
                solver={"status": "optimal"})


def _write(tmp_path: Path, plan: Plan, edit: Callable[[dict[str, Any]], object]) -> Path:
    """``plan``'s file after ``edit`` changed its JSON, as a user would by hand."""
    data = json.loads(plan.to_json())
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return path


def _refused(path: Path, *parts: str) -> str:
    """``load_plan(path)``'s ConfigError message, checked to name ``parts`` and the file."""
    with pytest.raises(ConfigError) as info:
        load_plan(path)
    message = str(info.value)
    for part in (*parts, str(path), "fix:"):
        assert part in message, (part, message)
    return message


def test_the_valid_plans_load_again(tmp_path: Path) -> None:
    for plan in (two_replica_plan(), one_stage_plan()):
        assert load_plan(plan.save(tmp_path / "plan.json")) == plan


def test_the_plans_values_are_the_planners() -> None:
    # shardplan.solver loads OR-Tools, so the plan package keeps its own copy of the names.
    from shardplan.solver.stages.pipeline import REMATS as SOLVER_REMATS
    from shardplan.solver.stages.pipeline import SCHEDULES

    assert REMATS == SOLVER_REMATS
    assert ("none", *SCHEDULES) == PLAN_SCHEDULES


# --------------------------------------------------------------------------- remat, schedule


def test_an_unknown_remat_or_schedule_names_the_key_and_the_allowed_values(
        tmp_path: Path) -> None:
    plan = two_replica_plan()
    path = _write(tmp_path, plan, lambda d: d["stages"][3].update(remat="sometimes"))
    _refused(path, "stages[3].remat", "'sometimes'", "none, selective, full")
    path = _write(tmp_path, plan, lambda d: d["stages"][1].update(remat="Selective"))
    _refused(path, "stages[1].remat", "did you mean 'selective'?")
    path = _write(tmp_path, plan, lambda d: d.update(schedule="2f2b"))
    _refused(path, "plan.schedule", "'2f2b'", "none, gpipe, 1f1b, interleaved")
    path = _write(tmp_path, plan, lambda d: d.update(schedule="1F1B"))
    _refused(path, "plan.schedule", "did you mean '1f1b'?")


# --------------------------------------------------------------------------- replicas' layers


def _stage_layers(stage: int, layers: list[str]) -> Callable[[dict[str, Any]], object]:
    return lambda d: d["stages"][stage].update(layers=layers)


def _one_implicit_replica(d: dict[str, Any]) -> None:
    """The replicas' list emptied: the four stages read as one pipeline."""
    d["replicas"] = []
    for stage in d["stages"]:
        stage["replica"] = 0


@pytest.mark.parametrize(("edit", "parts"), [
    pytest.param(_stage_layers(3, ["blocks.2", "post", "shared"]),
                 ("Replica 1 runs no stage with layer 'blocks.3'", "plan.replicas[1]",
                  "add 'blocks.3' to one of replica 1's stages [2, 3]",
                  "or remove it from stage 1"), id="dropped"),
    pytest.param(_stage_layers(3, ["blocks.2", "blocks.3", "pots", "shared"]),
                 ("Stage 3 (replica 1) runs layer 'pots', which no other replica runs",
                  "plan.stages[3].layers", "did you mean 'post'?"), id="renamed"),
    pytest.param(_stage_layers(2, ["pre", "blocks.0", "blocks.1", "blocks.2", "shared"]),
                 ("Layer 'blocks.2' runs on stage 2 and on stage 3 of replica 1",
                  "plan.stages[3].layers", "run each layer on one stage"), id="on-two-stages"),
    pytest.param(_stage_layers(0, ["pre", "pre", "blocks.0", "blocks.1", "shared"]),
                 ("Layer 'pre' runs twice on stage 0 of replica 0", "plan.stages[0].layers"),
                 id="twice-on-one-stage"),
    pytest.param(_one_implicit_replica,
                 ("Layer 'pre' runs on stage 0 and on stage 2 of the plan's one replica",
                  "plan.replicas is empty", "list them in plan.replicas"), id="replicas-empty"),
])
def test_replicas_that_do_not_run_the_same_layers_once_each_are_named(
        tmp_path: Path, edit: Callable[[dict[str, Any]], object], parts: tuple[str, ...]) -> None:
    _refused(_write(tmp_path, two_replica_plan(), edit), *parts)


def test_a_replica_without_stages_is_named(tmp_path: Path) -> None:
    def edit(d: dict[str, Any]) -> None:
        d.update(microbatches=2, replicas=[{"stages": [0], "microbatches": 1},
                                           {"stages": [], "microbatches": 1}])

    _refused(_write(tmp_path, one_stage_plan(), edit), "Replica 1 has no stages",
             "plan.replicas[1].stages")


def test_an_empty_replica_list_is_still_one_replica_of_all_stages(tmp_path: Path) -> None:
    # The default a one-replica pipeline is written with: its stages' layers differ.
    plan = two_replica_plan()

    def first_replica_only(d: dict[str, Any]) -> None:
        d.update(replicas=[], microbatches=3, stages=d["stages"][:2])
        d["predicted"]["memory_bytes"] = {"0": 1, "1": 1, "2": 1, "3": 1}

    loaded = load_plan(_write(tmp_path, plan, first_replica_only))
    assert loaded.replicas == () and [s.layers for s in loaded.stages] == [FIRST, SECOND]


# --------------------------------------------------------------------------- spec vs rank


@pytest.mark.parametrize(("edit", "where", "shape"), [
    pytest.param(lambda d: d["param_specs"]["params/w"].update(spec=["data", None, None]),
                 "plan.param_specs['params/w']", "float32[8,16] (rank 2)", id="param"),
    pytest.param(lambda d: d["batch_specs"].update(tokens=[["data"], [], []]),
                 "plan.batch_specs['tokens']", "int32[4,32] (rank 2)", id="batch"),
])
def test_a_spec_longer_than_its_leaf_rank_names_the_key_path_spec_and_shape(
        tmp_path: Path, edit: Callable[[dict[str, Any]], object], where: str,
        shape: str) -> None:
    message = _refused(_write(tmp_path, one_stage_plan(), edit), where, shape,
                       "3 entries", "at most 2 entries")
    assert "[['data'], [], []]" in message  # the spec, as the file writes it


def test_a_layout_spec_longer_than_its_leaf_rank_is_named(tmp_path: Path) -> None:
    layout = "v100-32g:model=2"

    def edit(d: dict[str, Any]) -> None:
        d["layouts"][layout]["param_specs"]["params/emb"] = [["model"], [], []]

    _refused(_write(tmp_path, two_replica_plan(), edit),
             f"plan.layouts['{layout}'].param_specs['params/emb']", "float32[512,64] (rank 2)")
    batch = _write(tmp_path, two_replica_plan(),
                   lambda d: d["layouts"][layout]["batch_specs"].update(tokens=[[], [], []]))
    _refused(batch, f"plan.layouts['{layout}'].batch_specs['tokens']", "int32[8,128]")


def test_a_spec_naming_an_axis_the_mesh_lacks_is_still_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, one_stage_plan(),
                  lambda d: d["param_specs"]["params/w"].update(spec=[["model"], []]))
    with pytest.raises(Exception, match=r"mesh axis 'model'") as info:
        load_plan(path)
    assert "plan.param_specs['params/w']" in str(info.value)


# --------------------------------------------------------------------------- leaf types


@pytest.mark.parametrize(("edit", "where"), [
    pytest.param(lambda d: d.update(state_types="float32[8,16]"), "plan.state_types",
                 id="a-string"),
    pytest.param(lambda d: d.update(state_types=[["params/w", "float32", [8, 16], 0]]),
                 "plan.state_types", id="a-list"),
    pytest.param(lambda d: d["state_types"].update({"params/w": "float32[8,x]"}),
                 "plan.state_types['params/w']", id="a-dimension-not-an-int"),
    pytest.param(lambda d: d["state_types"].update({"params/w": "float32[8,,16]"}),
                 "plan.state_types['params/w']", id="an-empty-dimension"),
    pytest.param(lambda d: d["state_types"].update({"params/w": ["float32", [8, 16]]}),
                 "plan.state_types['params/w']", id="a-pair"),
    pytest.param(lambda d: d["batch_types"].update(tokens="int32[-4,32]"),
                 "plan.batch_types['tokens']", id="a-negative-dimension"),
])
def test_garbled_leaf_types_are_refused_at_load_and_by_show(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        edit: Callable[[dict[str, Any]], object], where: str) -> None:
    path = _write(tmp_path, one_stage_plan(), edit)
    _refused(path, where)
    assert main(["show", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("shardplan show: ConfigError:") and where in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_leaf_types_parse_as_the_planner_writes_them() -> None:
    assert parse_type("float32[64,256]") == ("float32", (64, 256))
    assert parse_type("key<fry>[]") == ("key<fry>", ())
    assert parse_type("bfloat16[2, 3]") == ("bfloat16", (2, 3))


# --------------------------------------------------------------------------- shardplan show


def test_show_html_into_a_directory_that_cannot_take_it_is_a_config_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    plan = one_stage_plan().save(tmp_path / "plan.json")
    missing = tmp_path / "out" / "missing" / "report.html"
    assert main(["show", str(plan), "--html", str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("shardplan show: ConfigError:")
    assert str(missing) in captured.err and "does not exist" in captured.err
    assert f"mkdir -p {missing.parent}" in captured.err
    assert captured.out == ""  # refused before the terminal view is printed
    assert main(["show", str(plan), "--html", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and f"give a file name, e.g. {tmp_path / 'report.html'}" in err
    assert main(["show", str(plan), "--html", str(plan / "report.html")]) == 2
    assert "parent is not a directory" in capsys.readouterr().err

    def unwritable(self: Path, *args: object, **kwargs: object) -> int:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "write_text", unwritable)
    assert main(["show", str(plan), "--html", str(tmp_path / "report.html")]) == 2
    err = capsys.readouterr().err
    assert "Permission denied" in err and "report.html" in err and "permissions" in err


def test_show_width_below_the_minimum_is_a_config_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = two_replica_plan().save(tmp_path / "plan.json")
    for width in (0, -3, MIN_WIDTH - 1):
        assert main(["show", str(plan), "--width", str(width)]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("shardplan show: ConfigError:") and captured.out == ""
        assert "--width" in captured.err and f"value: {width}" in captured.err
        assert f"at least {MIN_WIDTH} columns" in captured.err
    assert main(["show", str(plan), "--width", str(MIN_WIDTH)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and max(len(line) for line in lines) <= MIN_WIDTH
    with pytest.raises(ConfigError, match=r"show_text\(width=\.\.\.\)"):
        show_text(load_plan(plan), width=10)
