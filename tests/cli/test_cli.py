"""The command line, as the README's demo runs it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import shardplan as sp
from shardplan.cli.main import main


def test_trace_command_prints_the_op_graph(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "configs/models/gpt-tiny.yaml", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "118,528 parameters" in out
    assert "blocks.0 .. blocks.1 (x2)" in out and "1 distinct fingerprint" in out


def test_trace_command_reports_a_bad_model_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "no-such-model", "--batch", "2"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "ConfigError" in err


# The user's own step: path/to/file.py:factory or package.module:factory.

EXAMPLE = "models/example_step.py:make_step"


def test_trace_command_traces_a_step_factory_from_a_file(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["trace", EXAMPLE]) == 0
    out = capsys.readouterr().out
    # 4 blocks of LayerNorm + 64x256 MLP, a 256x64 embedding and head, the final norm.
    assert out.startswith(f"step {EXAMPLE}: 165,760 parameters; batch 8 samples; jax ")
    assert "blocks.0 .. blocks.3 (x4)" in out and "1 distinct fingerprint" in out
    # The same factory named as a module.
    assert main(["trace", "shardplan_models.example_step:make_step"]) == 0
    assert "blocks.0 .. blocks.3 (x4)" in capsys.readouterr().out


def test_plan_command_plans_a_step_factory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_file = tmp_path / "plan.json"
    argv = ["plan", EXAMPLE, "--types", "a100-80g=4,v100-32g=4", "--out", str(out_file)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"step {EXAMPLE}: batch 8 samples; jax ")
    assert "cluster 'local': 8 devices in 2 groups" in out and "emulated" in out
    assert "\nPlan " in out and "Predicted" in out
    plan = sp.load_plan(out_file)
    assert {s.device_type for s in plan.stages} <= {"a100-80g", "v100-32g"}
    assert main(["plan", EXAMPLE, "--cluster", "configs/clusters/dgx-a100.yaml"]) == 0
    assert "described only" in capsys.readouterr().out


BAD_STEPS = """
def returns_two():
    return (lambda state, batch: (state, 0.0)), {}

def returns_none():
    pass

def raises():
    return helper()

def helper():
    raise ValueError("no data at /data/tokens")  # RAISES

def needs(config, size=2):
    return None
"""


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, str]:
    """Runs ``argv``, expects exit status 2 and a ConfigError; returns its message's first
    line (``what``) and ``where`` / ``value`` / ``fix`` lines."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    first = captured.err.splitlines()[0]
    assert first.startswith(f"shardplan {argv[0]}: ConfigError: "), captured.err
    fields = dict(re.findall(r"^  (where|value|fix):\s+(.*)$", captured.err, re.MULTILINE))
    return {"what": first.split("ConfigError: ", 1)[1], **fields}


def test_a_step_file_that_does_not_exist_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    got = _error(capsys, ["trace", "models/no_such_step.py:make_step"])
    assert got["what"] == "The step's file does not exist."
    assert got["value"] == "'models/no_such_step.py'" and "relative to" in got["where"]


def test_a_step_module_that_cannot_be_imported_shows_the_import_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    got = _error(capsys, ["trace", "no_such_package.steps:make_step"])
    assert got["what"] == (
        "There is no module 'no_such_package.steps': No module named 'no_such_package'"
    )
    assert "path/to/file.py:factory" in got["fix"]
    # A module whose own import fails: the ImportError's message and the line.
    broken = tmp_path / "broken_step.py"
    broken.write_text("import json\nimport not_a_real_package_xyz\n")
    got = _error(capsys, ["plan", f"{broken}:make_step"])
    assert got["what"] == (
        f"Importing {str(broken)!r} failed: ModuleNotFoundError: No module "
        "named 'not_a_real_package_xyz'"
    )
    assert got["where"] == f"{broken}:2 (<module>)"
    syntax = tmp_path / "syntax_step.py"
    syntax.write_text("def make_step(:\n    pass\n")
    got = _error(capsys, ["trace", f"{syntax}:make_step"])
    assert "SyntaxError" in got["what"] and got["where"] == f"{syntax}:1"


def test_a_missing_factory_suggests_the_modules_callables(
    capsys: pytest.CaptureFixture[str],
) -> None:
    got = _error(capsys, ["trace", "models/example_step.py:make_stp"])
    assert got["what"] == "The module has no factory 'make_stp'."
    assert got["fix"] == (
        "did you mean 'make_step'? callables defined in the module: Block, TinyLM, make_step"
    )
    # A Python file without a factory name: how to give one.
    got = _error(capsys, ["trace", "models/example_step.py"])
    assert got["what"] == "A Python file needs the name of its step factory after a colon."
    assert got["fix"].startswith("models/example_step.py:make_step")


def test_a_factory_that_raises_or_needs_arguments_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "bad_steps.py"
    path.write_text(BAD_STEPS)
    line = next(i for i, text in enumerate(BAD_STEPS.splitlines(), 1) if text.endswith("# RAISES"))
    got = _error(capsys, ["trace", f"{path}:raises"])
    assert got["what"] == "The factory 'raises' raised ValueError: no data at /data/tokens"
    assert got["where"] == f"{path}:{line} (helper)"
    got = _error(capsys, ["trace", f"{path}:needs"])
    assert got["what"] == "The factory 'needs' needs arguments: config."
    assert got["value"] == "'needs(config, size=2)'"


def test_a_factory_that_returns_no_3_tuple_says_what_it_returned(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "bad_returns.py"
    path.write_text(BAD_STEPS)
    got = _error(capsys, ["trace", f"{path}:returns_two"])
    assert got["what"] == (
        "The factory 'returns_two' returned a tuple of 2 items (function, "
        "dict), not (train_step, state, batch)."
    )
    assert got["fix"].startswith("return a 3-tuple (train_step, state, batch)")
    got = _error(capsys, ["plan", f"{path}:returns_none"])
    assert got["what"] == (
        "The factory 'returns_none' returned None, not (train_step, state, batch)."
    )


def test_preset_options_with_a_step_factory_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    got = _error(capsys, ["trace", EXAMPLE, "--batch", "4"])
    assert got["what"].startswith("--batch applies to model presets and YAML files")
    got = _error(capsys, ["plan", EXAMPLE, "--types", "a100-80g:4"])
    assert got["where"] == "--types" and "a100-80g=4,v100-32g=4" in got["fix"]
