"""The self-contained HTML report (``shardplan.viz.html``, ``Plan.to_html``): what the file
holds, without a browser (``tests/viz/test_viz_browser.py`` opens it in Chromium).

Plans: ``_example()`` (one stage, two devices); a hand-built two-stage plan on two device
types (a 2 x 2 mesh and a 2 x 1 x 2 mesh, two idle devices) with a 3-d and a 0-d leaf and a
GPipe timeline of two microbatches worked out below; and a real one-stage plan of an MLP on
the 8 local devices, planned on ``ShapeDtypeStruct``s.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import pytest
from helpers.plans import two_stage_plan
from helpers.steps import mlp_step

import shardplan as sp
from shardplan._format import key_pattern
from shardplan.plan.plan import Plan, _example
from shardplan.viz import data
from shardplan.viz.html import SECTIONS, payload, plan_html, write_html

_BLOB = re.compile(r'<script type="application/json" id="plan-data">(.*?)</script>', re.S)


def _blob(text: str) -> dict:
    (raw,) = _BLOB.findall(text)
    return json.loads(raw)


def _paths(blob: dict) -> list[str]:
    """The key paths the blob names: each group's pattern with its members' layer indices."""
    out = []
    for pattern, *_, members in blob["tensors"]["groups"]:
        for member in members:
            if isinstance(member, list):
                out.append(member[0])
                continue
            values = iter(member.split(",") if member else [])
            out.append("/".join(c[:-1] + next(values) if c == "*" or c.endswith("_*") else c
                                for c in pattern.split("/")))
    return out






@pytest.fixture(scope="module")
def local_plan() -> Plan:
    step, state, x = mlp_step(256, 32, layers=3)
    return sp.make_plan(step, state, x, cluster=sp.Cluster.local(devices=jax.devices()[:8]))


@pytest.mark.parametrize("make", [_example, two_stage_plan], ids=["one-stage", "two-stage"])
def test_the_document_is_self_contained_and_has_every_section(make) -> None:
    text = plan_html(make())
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    for section in SECTIONS:
        assert text.count(f'<section id="{section}">') == 1, section
    # Nothing is fetched: no external script, style, image, font or link target.
    assert not re.search(r"\b(src|href)\s*=\s*[\"']?\s*(https?:)?//", text, re.I)
    assert not re.search(r"@import|url\(\s*[\"']?(https?:)?//", text, re.I)
    assert "<link" not in text.lower() and "http://" not in text and "https://" not in text
    # The inlined CSS and script are there, the script once.
    assert text.count("<style>") == 1 and text.count("<script>") == 1
    assert "renderTensors" in text and "#tensor-table" in text


def test_the_blob_parses_back_and_names_every_tensor(local_plan) -> None:
    for plan in (local_plan, two_stage_plan()):
        blob = _blob(plan_html(plan))
        want = [t.path for t in data.tensors(plan)]
        assert _paths(blob) == want  # in the plan's order, none lost, none made up
        assert blob["summary"]["id"] == plan.content_hash[:12]
        assert len(blob["stages"]) == len(plan.stages)
        assert len(blob["devices"]) == 3 * len(data.devices(plan))
    # the per-leaf alternatives plan.explain(tensor=...) reads, as the planner stored them
    assert _blob(plan_html(local_plan))["alternatives"] == json.loads(
        local_plan.to_json())["solver"]["alternatives"]
    # Leaves of equal layers (pattern, kind, stage, spec, type) share one group.
    plan = two_stage_plan(extra={f"0/blocks/{i}/ln/scale": "float32[64]" for i in range(2, 98)})
    groups = payload(plan)["tensors"]["groups"]
    (ln,) = [g for g in groups if g[0] == "0/blocks/*/ln/scale"]
    # 7 groups: blocks 0 and 1 of w (other stages), w3, count, mu, the 96 ln leaves, batch x
    assert ln[7] == [str(i) for i in range(2, 98)] and len(groups) == 7


def test_a_script_tag_in_a_key_path_cannot_break_out() -> None:
    bad = "0/</script><script>alert(1)</script>/w"
    plan = two_stage_plan(extra={bad: "float32[4]", "0/<!--/x&y\u2028": "float32[4]"})
    text = plan_html(plan)
    assert text.lower().count("</script>") == 2  # the blob's end and the report script's
    assert text.count("<script>") == 1 and "alert(1)" in text  # only inside the JSON, escaped
    assert "<!--" not in text
    assert bad in _paths(_blob(text)) and "0/<!--/x&y\u2028" in _paths(_blob(text))


def test_the_timeline_keeps_every_task_in_integer_ticks() -> None:
    blob = payload(two_stage_plan())
    tl = blob["timeline"]
    tick = tl["tick_s"]
    assert tick == pytest.approx(1e-8)  # 10 ms step: 1e6 ticks of 10 ns
    assert tl["end"] * tick == pytest.approx(0.010)
    rows = {(r[0], r[1]): r for r in tl["rows"]}
    assert sorted(rows) == [(0, 0), (0, 1)]
    # stage 1: F0, F1, B0, B1 as [kind, microbatch, chunk, start, duration] in ticks
    assert rows[(0, 1)][2] == [0, 0, 0, 150_000, 100_000, 0, 1, 0, 250_000, 100_000,
                               1, 0, 0, 350_000, 200_000, 1, 1, 0, 550_000, 200_000]
    # its transfers go to the previous stage (offset -1)
    assert rows[(0, 1)][3][5::6] == [-1, -1]
    no_timeline = payload(two_stage_plan(timeline=False))["timeline"]
    assert "reason" in no_timeline and "no pipeline timeline" in no_timeline["reason"]
    assert "One stage" in payload(_example())["timeline"]["reason"]


def test_memory_groups_equal_devices_and_counts_idle_ones() -> None:
    plan = two_stage_plan()
    blob = payload(plan)
    # 8 used devices in two groups (one per stage: equal figures within a stage).
    assert sorted((g[1], g[2]) for g in blob["memory"]) == [([0], 4), ([1], 4)]
    stage0 = next(g for g in blob["memory"] if g[1] == [0])
    # parameters on stage 0: w [64, 32] f32 split in 2 (4 KiB) + w3 [8, 16, 4] bf16 split
    # in 2 x 2 (256 B); optimizer: mu [64, 32] split in 2 (4 KiB) + count (4 B)
    assert stage0[3:6] == [4096 + 256, 4096 + 256, 4096 + 4]
    assert stage0[8] == 80 * 2**30
    idle = [blob["devices"][i:i + 3] for i in range(0, len(blob["devices"]), 3)
            if blob["devices"][i + 2] == -1]
    assert [blob["types"][t] for _, t, _ in idle] == ["v100-32g", "v100-32g"]


def test_runner_ups_and_figures_follow_explain_and_report() -> None:
    plan = two_stage_plan()
    blob = payload(plan)
    chosen, runner = blob["runner_ups"]["rows"]
    assert chosen[1:] == [0.01, 2**20, "chosen"]
    assert runner == ["1 x [a100-80g 8]", 0.015, 2**21, "slower by 50 %"]
    labels = [r[0] for r in blob["figures"]["rows"]]
    report = plan.report()
    for label in labels:
        assert label in report
    assert "whole step" in labels and "memory per device (peak)" in labels


def test_the_file_for_a_small_plan_is_small(local_plan, tmp_path) -> None:
    path = write_html(local_plan, tmp_path / "report.html")
    assert path.read_text(encoding="utf-8") == plan_html(local_plan)
    # the page's CSS and script are about 35 kB; the plan adds little to them
    assert 10_000 < path.stat().st_size < 80_000


def test_to_html_and_repr_html() -> None:
    plan = two_stage_plan()
    assert plan.to_html() == plan_html(plan)
    frame = plan._repr_html_()
    assert frame.startswith("<iframe srcdoc=") and "<script" not in frame  # escaped inside
    assert "&lt;section id=&quot;tensors&quot;&gt;" in frame
    # A plan read back from its file renders the same report.
    assert Plan.from_json(plan.to_json()).to_html() == plan.to_html()
    assert dataclasses.replace(plan, notes=("a note",)).to_html() != plan.to_html()
    assert key_pattern("0/blocks/3/w") in plan.to_html()
