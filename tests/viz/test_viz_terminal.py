"""The terminal visualizer (``shardplan show``, ``shardplan.viz.terminal``) and
``sp.visualize`` for live sharded arrays.

Plans are built by hand (no planning: each test takes well under a second): a one-stage plan on
8 devices and a two-replica, two-stage plan on a100 + v100 stages (v100s partly idle) whose
1F1B timeline comes from the event simulator. Arrays live on the 8 fake CPU devices.
"""

from __future__ import annotations

import io
import re

import jax
import numpy as np
import pytest
from helpers.plans import balanced_problem
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from rich.cells import cell_len

import shardplan as sp
from shardplan.cli.main import main
from shardplan.errors import ConfigError
from shardplan.plan.plan import (
    Layout,
    MeshSpec,
    Plan,
    Predicted,
    ReplicaSpec,
    Spec,
    Stage,
    _example,
)
from shardplan.solver.stages.simulate import device_order, simulate
from shardplan.viz.array import visualize_text
from shardplan.viz.terminal import BACKWARD, FORWARD, gantt_lines, show, show_text

GB = 10**9
LONG = "0/" + "/".join(["a_very_long_module_name"] * 5) + "/kernel/value"  # 128 characters


def _block_leaves(n: int) -> tuple[dict[str, Spec], dict[str, str]]:
    """Parameters and Adam moments of ``n`` blocks: up [128, 512] split on 'model', down
    [512, 128] split on 'model' in dim 0, and an embedding."""
    specs: dict[str, Spec] = {}
    types: dict[str, str] = {}
    for i in range(n):
        specs[f"0/blocks/{i}/mlp/up/kernel/value"] = ((), ("model",))
        types[f"0/blocks/{i}/mlp/up/kernel/value"] = "float32[128,512]"
        specs[f"0/blocks/{i}/mlp/down/kernel/value"] = (("model",), ())
        types[f"0/blocks/{i}/mlp/down/kernel/value"] = "float32[512,128]"
        specs[f"1/opt_state/0/mu/blocks/{i}/mlp/up/kernel/value"] = ((), ("model",))
        types[f"1/opt_state/0/mu/blocks/{i}/mlp/up/kernel/value"] = "float32[128,512]"
    specs["0/wte/embedding/value"] = ((), ())
    types["0/wte/embedding/value"] = "float32[1000,128]"
    # An optimizer leaf laid out unlike its parameter: shown, not folded.
    specs["1/opt_state/0/mu/wte/embedding/value"] = (("model",), ())
    types["1/opt_state/0/mu/wte/embedding/value"] = "float32[1000,128]"
    specs[LONG] = ((), ())
    types[LONG] = "float32[4,4]"
    return specs, types


def one_stage_plan() -> Plan:
    """8 cpu devices on a (data=2, model=4) mesh, two blocks."""
    specs, types = _block_leaves(2)
    mesh = MeshSpec(("data", "model"), (2, 4), tuple(range(8)))
    return Plan(shardplan_version="0.1.0", graph_fingerprint="g", cluster_hash="c",
                config_hash="k", stages=(Stage(0, "cpu", mesh, ("pre", "blocks.0", "blocks.1",
                                                                "post")),),
                param_specs={k: (0, v) for k, v in specs.items()},
                batch_specs={"inputs": (("data",), ())}, state_types=types,
                batch_types={"inputs": "int32[16,32]"},
                predicted=Predicted(1e-3, 8e-4, 2e-4, dict.fromkeys(range(8), 3 * 2**20), {}),
                solver={"status": "optimal"},
                cluster_info={"name": "local", "device_types": {
                    "cpu": {"count": 8, "memory_bytes": 4 * GB}}})


def _timeline_rows() -> list[list]:
    """The simulator's 1F1B timelines: replica 0 (stages 0, 1; 6 microbatches) and replica 1
    (stages 2, 3; 2 microbatches), as ``solver.timeline`` rows."""
    rows = []
    for replica, stages, m in ((0, (0, 1), 6), (1, (2, 3), 2)):
        for e in simulate(*balanced_problem(2, m, "1f1b"), timeline=True).events:
            to = None if e.to_stage is None else stages[e.to_stage]
            rows.append([replica, stages[e.stage], e.kind, e.microbatch, e.chunk, e.start_s,
                         e.end_s, to])
    return rows


def hetero_plan() -> Plan:
    """Two replicas of two stages: a100s (2 x 2) and v100s (2 x 2, two more v100s idle)."""
    specs, types = _block_leaves(4)
    a100, v100 = "a100-80g:model=2", "v100-32g:data=1,model=2"
    first = ("pre", "blocks.0", "blocks.1")
    second = ("blocks.2", "blocks.3", "post")
    stages = (
        Stage(0, "a100-80g", MeshSpec(("model",), (2,), (0, 1)), first, replica=0, layout=a100),
        Stage(1, "a100-80g", MeshSpec(("model",), (2,), (2, 3)), second, "selective", 0, a100),
        Stage(2, "v100-32g", MeshSpec(("data", "model"), (1, 2), (4, 5)), first, "full", 1,
              v100),
        Stage(3, "v100-32g", MeshSpec(("data", "model"), (1, 2), (6, 7)), second, "full", 1,
              v100),
    )
    home = {k: (1 if "blocks/2" in k or "blocks/3" in k else 0, v) for k, v in specs.items()}
    layouts = {a100: Layout(specs, {"inputs": ((), ())}),
               v100: Layout(specs, {"inputs": (("data",), ())})}
    return Plan(shardplan_version="0.1.0", graph_fingerprint="g", cluster_hash="c",
                config_hash="k", stages=stages, param_specs=home, batch_specs={},
                microbatches=8, schedule="1f1b", microbatch_size=2,
                replicas=(ReplicaSpec((0, 1), 6), ReplicaSpec((2, 3), 2)), layouts=layouts,
                predicted=Predicted(2e-2, 1.5e-2, 5e-3,
                                    {d: (9 + d) * 2**30 for d in range(8)}, {}),
                solver={"status": "optimal",
                        "timeline": {"columns": ["replica", "stage", "kind", "microbatch",
                                                 "chunk", "start_s", "end_s", "to_stage"],
                                     "same_as": [0, 1], "window": None,
                                     "rows": _timeline_rows()}},
                state_types=types, batch_types={"inputs": "int32[16,32]"},
                cluster_info={"name": "mixed", "device_types": {
                    "a100-80g": {"count": 4, "memory_bytes": 80 * GB},
                    "v100-32g": {"count": 6, "memory_bytes": 32 * GB}}})


PLANS = {"one-stage": one_stage_plan, "heterogeneous": hetero_plan, "example": _example}


def _fits(text: str, width: int = 100) -> None:
    assert "\x1b" not in text
    for line in text.splitlines():
        assert len(line) <= width and cell_len(line) <= width, line


@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_line_fits_100_columns_without_escape_codes(name: str) -> None:
    text = show_text(PLANS[name]())
    _fits(text)
    for section in ("Cluster", "Stages", "Shardings", "Pipeline schedule", "Memory per device",
                    "Predicted | compiled | measured"):
        assert f"\n{section}" in text
    _fits(show_text(PLANS[name](), width=72), width=72)


def test_no_color_means_no_escape_codes_even_on_a_terminal(monkeypatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    plan = hetero_plan()
    coloured = Tty()
    show(plan, file=coloured)
    assert "\x1b[" in coloured.getvalue()  # a terminal gets colour ...
    assert "\x1b[" in show_text(plan, color=True)
    monkeypatch.setenv("NO_COLOR", "1")
    plain = Tty()
    show(plan, file=plain)
    assert "\x1b" not in plain.getvalue()  # ... unless NO_COLOR is set
    assert [line.rstrip() for line in plain.getvalue().splitlines()] == \
        show_text(plan, color=False).splitlines()


def test_shardings_group_leaves_by_pattern_with_shape_and_spec() -> None:
    lines = show_text(one_stage_plan()).splitlines()
    up = [line for line in lines if "0/blocks/*/mlp/up/kernel/value" in line]
    assert len(up) == 1
    assert re.fullmatch(r"  0/blocks/\*/mlp/up/kernel/value \[128, 512\] → \(None, 'model'\)"
                        r" +×2  0", up[0])
    down = [line for line in lines if "mlp/down/kernel/value" in line]
    assert down and "[512, 128] → ('model', None)" in down[0] and "×2" in down[0]
    assert "0/blocks/*  (4 leaves)" in lines
    # Adam's mu of each up kernel is laid out as the kernel: folded into one line; the wte
    # moment is not, so it has a row of its own.
    assert "optimizer state: 2 leaves in 1 pattern sharded as their parameters" in lines
    assert any("1/opt_state/*/mu/wte/embedding/value [1000, 128] → ('model', None)" in line
               for line in lines)
    # The 128-character path is elided in the middle, its shape and spec on the next line.
    at = next(i for i, line in enumerate(lines) if line.startswith("  0/a_very_long"))
    assert "..." in lines[at] and lines[at].endswith("/kernel/value")
    assert lines[at + 1].strip().startswith("[4, 4] → (None, None)")
    assert "  inputs [16, 32] → ('data', None)" in "\n".join(lines)


def test_heterogeneous_plan_shows_types_idle_devices_layouts_and_stage_groups() -> None:
    text = show_text(hetero_plan())
    cluster = text.split("\nCluster\n")[1].split("\nStages\n")[0]
    a100 = next(line for line in cluster.splitlines() if line.startswith("a100-80g"))
    v100 = next(line for line in cluster.splitlines() if line.startswith("v100-32g"))
    assert a100.split()[:8] == ["a100-80g", "4", "74.51", "GiB", "4", "(0-3)", "0", "0-1"]
    assert v100.split()[:8] == ["v100-32g", "6", "29.80", "GiB", "4", "(4-7)", "2", "2-3"]
    stages = text.split("\nStages\n")[1].split("\nShardings\n")[0]
    assert stages.splitlines()[:6] == [
        "stage 0 (replica 0): a100-80g (model=2), remat none",
        "    2 devices: 0-1",
        "    layers: pre, blocks.0, blocks.1",
        "stage 1 (replica 0): a100-80g (model=2), remat selective",
        "    2 devices: 2-3",
        "    layers: blocks.2, blocks.3, post"]
    assert "stage 3 (replica 1): v100-32g (data=1, model=2), remat full" in stages
    assert "layout a100-80g:model=2 (stages 0-1)" in text
    assert "layout v100-32g:data=1,model=2 (stages 2-3)" in text


def _spans(bar: str) -> list[tuple[str, int]]:
    """(kind, microbatch) of each labelled task of a Gantt row, left to right."""
    return [("forward" if run[0] == FORWARD else "backward", int(digits))
            for digits, run in re.findall(rf"(\d+)([{FORWARD}{BACKWARD}]+)", bar)]


def test_gantt_draws_1f1b_tasks_in_schedule_order_one_line_per_stage() -> None:
    k, m = 3, 4
    events = simulate(*balanced_problem(k, m, "1f1b"), timeline=True).events
    lines = gantt_lines(events, width=100)
    rows = [line for line in lines if re.match(r"  r\d", line)]
    assert len(rows) == k
    for i, row in enumerate(rows):
        assert row.startswith(f"  r0 s{i} ")
        order = [(kind, j) for kind, j, _ in device_order("1f1b", i, k, m)]
        assert _spans(row[2 + 14 + 1:]) == order
    # Stage 2 starts after the first forward of stages 0 and 1: its row opens with bubbles.
    assert rows[2][17:20] == "···" and rows[0][17] == "0"
    _fits("\n".join(lines))
    assert any("▒ forward" in line and "█ backward" in line for line in lines)


def test_gantt_of_a_plan_has_a_line_per_replica_and_stage() -> None:
    text = show_text(hetero_plan())
    gantt = text.split("\nPipeline schedule\n")[1].split("\nMemory per device")[0]
    rows = [line for line in gantt.splitlines() if re.match(r"  r\d", line)]
    assert [row.split()[:2] for row in rows] == [["r0", "s0"], ["r0", "s1"], ["r1", "s2"],
                                                 ["r1", "s3"]]
    for row, stage in zip(rows, range(4), strict=True):
        m = 6 if stage < 2 else 2
        order = [(kind, j) for kind, j, _ in device_order("1f1b", stage % 2, 2, m)]
        assert _spans(row[17:]) == order
    assert "one stage and one microbatch" in show_text(one_stage_plan())


def test_memory_bars_name_capacity_and_group_identical_devices() -> None:
    text = show_text(one_stage_plan())
    memory = text.split("\nMemory per device (predicted peak)\n")[1].split("\nPredicted")[0]
    lines = memory.splitlines()
    assert lines[0] == "cpu × 8: devices 0-7 (stage 0)"
    # Per device: up [128, 512/4] and down [512/4, 128] of 2 blocks, fp32, 64 KiB each;
    # the embedding and the long leaf replicated (500 KiB + 64 B); mu: up kernels (128 KiB),
    # wte's moment split in 4 (125 KiB).
    assert "3.00 MiB of 3.73 GiB capacity (0.1 %)" in lines[1]
    assert "█ parameters 756.06 KiB" in lines[2] and "▓ gradients 756.06 KiB" in lines[2]
    assert "▒ optimizer 253.00 KiB" in lines[2]
    hetero = show_text(hetero_plan())
    assert "of 74.51 GiB capacity" in hetero and "of 29.80 GiB capacity" in hetero
    # Every device has its own predicted peak here, so no two group.
    assert hetero.count(" × 1: device ") == 8


def test_cli_show_prints_the_plan_and_writes_html(tmp_path, capsys) -> None:
    path = hetero_plan().save(tmp_path / "plan.json")
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Plan ") and "Pipeline schedule" in out
    _fits(out)
    assert main(["show", str(path), "--width", "80"]) == 0
    _fits(capsys.readouterr().out, width=80)
    pytest.importorskip("shardplan.viz.html", reason="the HTML report is not written yet")
    report = tmp_path / "report.html"
    assert main(["show", str(path), "--html", str(report)]) == 0
    assert f"wrote {report}" in capsys.readouterr().out
    assert report.read_text(encoding="utf-8").lstrip().lower().startswith("<!doctype html")


def test_cli_show_of_a_missing_plan_is_a_typed_error(tmp_path, capsys) -> None:
    assert main(["show", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardplan show: ConfigError:") and "nope.json" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 4,', encoding="utf-8")
    assert main(["show", str(bad)]) == 2
    assert capsys.readouterr().err.startswith("shardplan show: ConfigError:")


# --------------------------------------------------------------------------- sp.visualize


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)


def _held(text: str) -> dict[int, str]:
    """{device id: its ranges} from the per-device lines."""
    out = {}
    for ids, ranges in re.findall(r"^  devices? ([\d, -]+): (\[.*\])$", text, re.M):
        for part in ids.split(", "):
            lo, _, hi = part.partition("-")
            for d in range(int(lo), int(hi or lo) + 1):
                out[d] = ranges
    return out


CASES = [
    # shape, spec, device d (at mesh position (d // 4, d % 4)) -> its ranges
    ((), P(), lambda d: "[]"),
    ((8,), P("b"), lambda d: f"[{2 * (d % 4)}:{2 * (d % 4) + 2}]"),
    ((4, 8), P("a", "b"),
     lambda d: f"[{2 * (d // 4)}:{2 * (d // 4) + 2}, {2 * (d % 4)}:{2 * (d % 4) + 2}]"),
    ((8, 4), P(("a", "b"), None), lambda d: f"[{d}:{d + 1}, 0:4]"),
    ((4, 8), P(None, "a"), lambda d: f"[0:4, {4 * (d // 4)}:{4 * (d // 4) + 4}]"),
    ((2, 4, 6), P(None, "b", "a"),
     lambda d: f"[0:2, {d % 4}:{d % 4 + 1}, {3 * (d // 4)}:{3 * (d // 4) + 3}]"),
]


@pytest.mark.parametrize(("shape", "spec", "expected"), CASES,
                         ids=[f"rank{len(c[0])}-{c[1]}" for c in CASES])
def test_visualize_lists_the_exact_block_of_every_device(mesh, shape, spec, expected) -> None:
    assert [d.id for d in mesh.devices.flat] == list(range(8))
    x = jax.device_put(np.zeros(shape, np.float32), NamedSharding(mesh, spec))
    text = visualize_text(x)
    _fits(text)
    assert _held(text) == {d: expected(d) for d in range(8)}
    assert f"spec {spec}" in text


def test_visualize_grid_rows_and_columns_are_blocks_of_dims_0_and_1(mesh, capsys) -> None:
    x = jax.device_put(np.zeros((4, 8), np.float32), NamedSharding(mesh, P("a", "b")))
    sp.visualize(x)
    out = capsys.readouterr().out
    grid = [line for line in out.splitlines() if line.startswith("│")]
    cells = [[c.strip() for c in line.strip("│").split("│")] for line in grid]
    assert cells == [["dim 0 \\ 1", "0:2", "2:4", "4:6", "6:8"],
                     ["0:2", "0", "1", "2", "3"],
                     ["2:4", "4", "5", "6", "7"]]
    assert "dim 0 (size 4): 2 blocks over 'a' (2)" in out
    assert "dim 1 (size 8): 4 blocks over 'b' (4)" in out
    y = jax.device_put(np.zeros((8,), np.float32), NamedSharding(mesh, P("b")))
    row = [line for line in visualize_text(y).splitlines() if line.startswith("│")]
    assert [c.strip() for c in row[1].strip("│").split("│")] == ["", "0, 4", "1, 5", "2, 6",
                                                                "3, 7"]


def test_visualize_other_shardings_and_what_it_rejects() -> None:
    x = jax.device_put(np.zeros((3, 5), np.float32), jax.devices()[3])
    text = visualize_text(x)
    assert "SingleDeviceSharding" in text and _held(text) == {3: "[0:3, 0:5]"}
    assert "not split" in text
    with pytest.raises(ConfigError, match="sharding"):
        visualize_text(np.zeros(3))


def deep_plan(k: int = 20) -> Plan:
    """``k`` one-device a100 stages, one layer each, holding a stacked (scanned) kernel of
    ``k`` rows; every stage predicts its own peak."""
    stages = tuple(Stage(i, "a100-80g", MeshSpec(("model",), (1,), (i,)),
                         (("pre",) if i == 0 else ()) + (f"blocks.{i}",), replica=0,
                         layout="a100") for i in range(k))
    specs: dict[str, Spec] = {"0/blocks/mlp/up/kernel/value": ((), (), ("model",))}
    return Plan(shardplan_version="0.1.0", graph_fingerprint="g", cluster_hash="c",
                config_hash="k", stages=stages, param_specs={k_: (0, v) for k_, v in
                                                             specs.items()},
                batch_specs={}, microbatches=k, schedule="1f1b",
                replicas=(ReplicaSpec(tuple(range(k)), k),),
                layouts={"a100": Layout(specs, {})},
                state_types={"0/blocks/mlp/up/kernel/value": f"float32[{k},128,512]"},
                predicted=Predicted(1.0, 1.0, 0.0, {i: (i + 1) * 2**20 for i in range(k)}, {}),
                solver={"status": "optimal"},
                cluster_info={"device_types": {"a100-80g": {"count": k,
                                                            "memory_bytes": 80 * GB}}})


def test_deep_pipelines_merge_stages_and_show_the_extreme_memory_groups() -> None:
    text = show_text(deep_plan())
    _fits(text)
    stages = text.split("\nStages\n")[1].split("\nShardings\n")[0].splitlines()
    assert stages == ["stages 0-19 (replica 0): a100-80g (model=1), remat none",
                      "    20 devices: 0-19", "    layers: pre, blocks.0 .. blocks.19"]
    memory = text.split("\nMemory per device (predicted peak)\n")[1].split("\nPredicted")[0]
    heads = [line for line in memory.splitlines() if not line.startswith(" ")]
    assert heads == ["a100-80g × 1: device 19 (stage 19)", "a100-80g × 1: device 0 (stage 0)"]
    assert "  ... 18 more a100-80g devices, their peaks between these two" in memory
    # The stacked kernel is cut by rows: each stage holds its own layer's [128, 512] fp32.
    assert memory.count("█ parameters 256.00 KiB") == 2
    assert "  (no simulated timeline recorded for this plan (schedule 1f1b))" in text
