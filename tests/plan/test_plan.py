"""The Plan artifact: construction checks, canonical JSON, files, summary. Pure Python, fast."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from shardplan.errors import ConfigError, PlanMismatchError
from shardplan.plan import SCHEMA_VERSION, MeshSpec, Plan, Predicted, Stage, load_plan

GIB = 1024**3
LONG_KEY = "0/0/encoder/" + "/".join(f"very_long_module_name_{i}" for i in range(6)) + "/kernel"


def _specs() -> dict[str, tuple[int, Any]]:
    specs: dict[str, tuple[int, Any]] = {
        "0/0/embed/embedding/value": (0, (("model",), ())),
        "0/0/head/kernel/value": (1, ((), ())),
        LONG_KEY: (0, ((), ())),
    }
    for i in range(6):
        stage = 0 if i < 2 else 1
        # Stage 0 shards the MLP over "model"; stage 1 (no "model" axis) over "data" (FSDP).
        up = ((), ("model",)) if stage == 0 else (("data",), ())
        specs[f"0/0/blocks/{i}/mlp/up/kernel/value"] = (stage, up)
        specs[f"0/0/blocks/{i}/mlp/up/bias/value"] = (stage, ((),))
        specs[f"0/1/opt_state/0/mu/blocks/{i}/mlp/up/kernel/value"] = (stage, up)
    return specs


def make_plan(**changes: Any) -> Plan:
    """Two stages: 4 A100s as (data=2, model=2) run pre + blocks 0-1, 4 V100s (data=4) the rest."""
    stages = (
        Stage(0, "a100-80g", MeshSpec(("data", "model"), (2, 2), (0, 1, 2, 3)),
              ("pre", "blocks.0", "blocks.1")),
        Stage(1, "v100-32g", MeshSpec(("data",), (4,), (4, 5, 6, 7)),
              ("blocks.2", "blocks.3", "blocks.4", "blocks.5", "post"), remat="full"),
    )
    fields: dict[str, Any] = dict(
        shardplan_version="0.1.0",
        graph_fingerprint="f" * 64,
        cluster_hash="c" * 64,
        config_hash="d" * 64,
        stages=stages,
        param_specs=_specs(),
        batch_specs={"inputs": (("data",), ()), "targets": ("data", None)},
        microbatches=8,
        schedule="1f1b",
        predicted=Predicted(
            step_time_s=0.1234, compute_s=0.1, communication_s=0.0234,
            memory_bytes={d: (10 + d) * GIB for d in range(8)},
            collectives={"all-reduce": {"count": 12, "bytes": 3 * GIB},
                         "collective-permute": {"count": 16, "bytes": 64 * 2**20}}),
        solver={"status": "optimal", "objective": 0.1234, "gap": 0.0, "solve_time_s": 1.5,
                "ilp": {"variables": 1200, "constraints": 3400}},
        notes=("stage 1 has no bf16: it runs in fp16",),
    )
    fields.update(changes)
    return Plan(**fields)


def _edited(plan: Plan, edit: Any) -> str:
    """The plan's JSON after ``edit(data)`` mutates the decoded object."""
    data = json.loads(plan.to_json())
    edit(data)
    return json.dumps(data)


# --------------------------------------------------------------------------- values


def test_plan_is_a_frozen_hashable_value() -> None:
    plan = make_plan()
    assert plan.num_devices == 8
    assert plan.schema_version == SCHEMA_VERSION
    assert plan.param_specs["0/0/blocks/0/mlp/up/kernel/value"] == (0, ((), ("model",)))
    # PartitionSpec-style entries (None, a bare axis name) are normalised.
    assert plan.batch_specs["targets"] == (("data",), ())
    assert plan == make_plan() and hash(plan) == hash(make_plan())
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.microbatches = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.param_specs["x"] = (0, ())  # type: ignore[index]
    assert pickle.loads(pickle.dumps(plan)) == plan


def test_json_round_trip_is_equal_and_byte_identical() -> None:
    plan = make_plan()
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan
    assert again.to_json() == text
    assert text.endswith("}\n") and not text.endswith("\n\n")
    data = json.loads(text)
    assert list(data) == sorted(data)
    assert data["param_specs"]["0/0/blocks/0/mlp/up/kernel/value"] == {
        "spec": [[], ["model"]], "stage": 0}
    assert data["predicted"]["memory_bytes"]["7"] == 17 * GIB
    assert all(len(line) <= 100 or LONG_KEY in line for line in text.splitlines())
    assert "\n  " in text and "\n\t" not in text  # 2-space indent
    # Keys sort numerically: blocks/2 before blocks/10 regardless of insertion order.
    specs = {f"0/blocks/{i}/w": (0, ((),)) for i in (10, 2, 1)}
    keys = [k for k in json.loads(make_plan(param_specs=specs).to_json())["param_specs"]]
    assert keys == ["0/blocks/1/w", "0/blocks/2/w", "0/blocks/10/w"]


def test_content_hash_is_stable_and_tracks_decisions() -> None:
    plan = make_plan()
    assert len(plan.content_hash) == 64
    assert plan.content_hash == make_plan().content_hash
    assert Plan.from_json(plan.to_json()).content_hash == plan.content_hash
    specs = _specs()
    specs["0/0/blocks/0/mlp/up/kernel/value"] = (0, (("model",), ()))
    assert make_plan(param_specs=specs).content_hash != plan.content_hash
    assert make_plan(microbatches=4).content_hash != plan.content_hash
    # Wall-clock solver fields are not decisions: they do not change the hash.
    slower = make_plan(solver={**plan.solver, "solve_time_s": 9.0})
    assert slower != plan and slower.content_hash == plan.content_hash


def test_save_and_load_atomically(tmp_path: Path) -> None:
    plan = make_plan()
    path = tmp_path / "plan.json"
    assert plan.save(path) == path
    assert load_plan(path) == plan
    assert load_plan(str(path)).to_json() == path.read_text(encoding="utf-8")
    # Overwriting replaces the file and leaves no temporary file behind.
    other = make_plan(microbatches=2)
    other.save(path)
    assert load_plan(path) == other
    assert os.listdir(tmp_path) == ["plan.json"]



def test_failed_save_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "plan.json"
    make_plan().save(path)
    before = path.read_bytes()

    def broken_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(ConfigError, match="No space left"):
        make_plan(microbatches=2).save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["plan.json"]
    with pytest.raises(ConfigError, match="directory does not exist"):
        make_plan().save(tmp_path / "missing" / "plan.json")


# --------------------------------------------------------------------------- errors


def test_wrong_schema_version_is_a_plan_mismatch() -> None:
    text = _edited(make_plan(), lambda d: d.update(schema_version=99))
    with pytest.raises(PlanMismatchError, match="schema_version 99") as info:
        Plan.from_json(text)
    assert "reads schema_version 2, 3, 4" in str(info.value) and SCHEMA_VERSION == 4
    assert "0.1.0" in str(info.value)  # names the shardplan version that wrote it


def test_corrupt_json_names_line_and_column(tmp_path: Path) -> None:
    text = make_plan().to_json()
    broken = text.replace('"microbatches": 8,', '"microbatches": 8,,')
    line = 1 + text[: text.index('"microbatches"')].count("\n")
    with pytest.raises(ConfigError, match=rf"line {line}, column \d+"):
        Plan.from_json(broken)
    path = tmp_path / "broken.json"
    path.write_text(text[: len(text) // 2], encoding="utf-8")
    with pytest.raises(ConfigError, match=r"broken\.json, line"):
        load_plan(path)


def test_unknown_keys_suggest_the_closest_known_key() -> None:
    plan = make_plan()
    text = _edited(plan, lambda d: d.update(microbatchs=d.pop("microbatches")))
    with pytest.raises(ConfigError, match="did you mean 'microbatches'"):
        Plan.from_json(text)

    def rename_in_stage(d: dict[str, Any]) -> None:
        d["stages"][1]["device_typ"] = d["stages"][1].pop("device_type")

    with pytest.raises(ConfigError, match=r"plan\.stages\[1\]\.device_typ") as info:
        Plan.from_json(_edited(plan, rename_in_stage))
    assert "did you mean 'device_type'" in str(info.value)


def test_spec_naming_an_axis_the_stage_mesh_lacks() -> None:
    key = "0/0/blocks/3/mlp/up/kernel/value"
    specs = _specs()
    specs[key] = (1, ((), ("model",)))  # stage 1's mesh has only "data"
    with pytest.raises(PlanMismatchError, match="'model'") as info:
        make_plan(param_specs=specs)
    message = str(info.value)
    assert key in message and "(data=4)" in message and "v100-32g" in message
    with pytest.raises(PlanMismatchError, match=r"batch_specs\['inputs'\]"):
        make_plan(batch_specs={"inputs": (("model",), ())})  # stage 1 has no "model" axis


def test_param_stage_index_out_of_range(tmp_path: Path) -> None:
    key = "0/0/head/kernel/value"
    specs = _specs()
    specs[key] = (2, ((), ()))
    with pytest.raises(PlanMismatchError, match="plan has 2 stages") as info:
        make_plan(param_specs=specs)
    assert key in str(info.value) and "0 .. 1" in str(info.value)
    # Through a file, the message also names the file.
    path = tmp_path / "plan.json"
    path.write_text(_edited(make_plan(), lambda d: d["param_specs"][key].update(stage=2)),
                    encoding="utf-8")
    with pytest.raises(PlanMismatchError, match=r"plan\.json"):
        load_plan(path)


def test_structural_checks_name_the_field() -> None:
    with pytest.raises(PlanMismatchError, match="multiply to 4 but it lists 3 devices"):
        MeshSpec(("data", "model"), (2, 2), (0, 1, 2))
    plan = make_plan()
    swapped = (dataclasses.replace(plan.stages[0], index=1),
               dataclasses.replace(plan.stages[1], index=0))
    with pytest.raises(PlanMismatchError, match=r"stages\[0\]\.index"):
        make_plan(stages=swapped)
    with pytest.raises(PlanMismatchError, match=r"memory_bytes\[9\]"):
        make_plan(predicted=dataclasses.replace(plan.predicted, memory_bytes={9: 1}))
    with pytest.raises(ConfigError, match=r"plan\.microbatches"):
        make_plan(microbatches=0)
    with pytest.raises(ConfigError, match=r"plan\.solver\.gap"):
        make_plan(solver={"gap": float("inf")})
    with pytest.raises(ConfigError, match="more than one dimension"):
        make_plan(batch_specs={"inputs": (("data",), ("data",))})
    with pytest.raises(ConfigError, match=r"missing\.json"):
        load_plan("missing.json")
    key = '"0/0/head/kernel/value"'
    text = make_plan().to_json()
    line = next(x for x in text.splitlines() if key in x)
    with pytest.raises(ConfigError, match="appears twice"):
        Plan.from_json(text.replace(line, f"{line}\n{line}"))
    bad_mesh = _edited(make_plan(), lambda d: d["stages"][1]["mesh"].update(axis_sizes=[3]))
    with pytest.raises(PlanMismatchError, match=r"in:    plan\.stages\[1\]\.mesh"):
        Plan.from_json(bad_mesh)


# --------------------------------------------------------------------------- summary


def test_summary_groups_patterns_and_fits_100_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = make_plan()
    text = plan.summary()
    lines = text.splitlines()
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    assert "\x1b" not in text
    assert "0/0/blocks/*/mlp/up/kernel/value [2 leaves] -> (None, 'model')" in text
    assert "0/0/blocks/*/mlp/up/kernel/value [4 leaves] -> ('data', None)" in text
    assert "0/1/opt_state/*/mu/blocks/*/mlp/up/kernel/value [2 leaves]" in text
    assert "0/0/blocks/*/mlp/up/bias/value [6 leaves] -> (None,)" in text
    assert "blocks.2 .. blocks.5, post" in text
    assert "(data=2, model=2)" in text and "0-3" in text and "4-7" in text
    assert "123.4 ms" in text and "all-reduce 12 ops, 3.00 GiB" in text
    assert "a100-80g 13.00 GiB" in text and "v100-32g 17.00 GiB" in text
    assert "optimal in 1.5 s" in text and "8 microbatches" in text and "1f1b" in text
    assert "inputs [1 leaf] -> ('data', None)" in text
    monkeypatch.setenv("NO_COLOR", "1")
    assert plan.summary() == text


def test_plan_package_imports_no_jax() -> None:
    package = Path(__file__).parents[2] / "shardplan" / "plan"
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "jax" or n.startswith(("jax.", "flax")) for n in names), path


def test_docs_example_is_a_canonical_plan() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "plan-format.md").read_text(encoding="utf-8")
    block = doc.split("```json\n", 1)[1].split("```", 1)[0]
    plan = Plan.from_json(block)
    assert plan.to_json() == block
    summary = doc.split("```text\n", 1)[1].split("```", 1)[0]
    assert plan.summary() + "\n" == summary


def test_plan_package_imports_no_stage_above_it() -> None:
    """plan/ sits below the planner, the runtime and the views: it renders through the views
    viz/ registers (plan.VIEWS), never by importing viz/."""
    package = Path(__file__).parents[2] / "shardplan" / "plan"
    above = ("shardplan.viz", "shardplan.planner", "shardplan.runtime", "shardplan.api")
    paths = sorted(package.glob("*.py"))
    assert paths, package
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == p or n.startswith(p + ".") for n in names for p in above), path


def test_the_plan_methods_render_through_the_registered_views(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from shardplan.plan.plan import VIEW_MODULES, VIEWS, _example
    from shardplan.viz import explain, html, report

    plan = _example()
    assert set(VIEWS) == set(VIEW_MODULES) == {"explain", "text_report", "report", "notebook"}
    assert plan.explain() == explain.explain(plan) and plan.report() == report.plan_report(plan)
    assert plan.explain(tensor="0/w") == explain.explain(plan, "0/w")
    assert plan.to_html() == html.plan_html(plan)
    assert plan._repr_html_() == html.notebook_html(plan)
    monkeypatch.delitem(VIEWS, "explain")
    with pytest.raises(RuntimeError, match="No plan view 'explain' is registered") as info:
        plan.explain()
    assert "import shardplan (or shardplan.viz.explain)" in str(info.value)
