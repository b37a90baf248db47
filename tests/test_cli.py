"""The command line, as the README's demo runs it."""

from __future__ import annotations

import pytest

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
