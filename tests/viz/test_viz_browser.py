"""The HTML report opened in headless Chromium (Debian's ``chromium``, driven by Playwright):
no console errors, every section drawn, picking a tensor (a click, or ``#tensor=`` in the URL)
draws its tiling with one cell per device of its stage and the blocks ``viz.data.tiles`` gives,
and a screenshot.

Plans: a one-stage MLP on the 8 local devices; the stage planner's plan of a wider MLP on 4
A100s + 4 V100s (emulated; several stages on both types, with the simulator's timeline); and
the hand-built two-stage plan of ``test_viz_html`` (a 3-d leaf on a 2 x 2 mesh, a leaf split
over two of three mesh axes, a 0-d leaf). Skipped, saying why, only where Chromium or
Playwright is missing.
"""

from __future__ import annotations

import struct
from pathlib import Path
from urllib.parse import quote

import jax
import pytest
from helpers.plans import two_stage_plan
from helpers.steps import mlp_step

import shardplan as sp
from shardplan._format import format_spec
from shardplan.plan.plan import Plan, _example
from shardplan.viz import data
from shardplan.viz.explain import _groups_of, _records
from shardplan.viz.html import SECTIONS, write_html

pytestmark = pytest.mark.slow  # drives a headless Chromium

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

if not CHROMIUM.exists():
    pytest.skip(f"{CHROMIUM} is absent (Debian: apt-get install chromium; .ci/run installs it)",
                allow_module_level=True)
playwright = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def one_stage() -> Plan:
    step, state, x = mlp_step(256, 32, layers=3)
    return sp.make_plan(step, state, x, cluster=sp.Cluster.local(devices=jax.devices()[:8]))


@pytest.fixture(scope="module")
def mixed() -> Plan:
    # tests/planner/test_pipeline_plan.py's mixed plan: wide enough that both types get stages
    step, state, x = mlp_step(1024, 8192, learning_rate=1e-3)
    cluster = sp.Cluster.local(types={"a100-80g": 4, "v100-32g": 4})
    return sp.make_plan(step, state, x, cluster=cluster,
                        config=sp.PlanConfig(stage_time_limit_s=120.0))


def _labels(plan: Plan, path: str) -> dict[str, str]:
    """``{device id: "[0:32, :]"}``: the block each device of the leaf's stage holds."""
    (t,) = [t for t in data.tensors(plan) if t.path == path]
    assert t.shape is not None
    out = {}
    for tile in data.tiles(t.spec, plan.stages[t.stage].mesh, t.shape):
        assert tile.bounds is not None and len(tile.bounds) == len(t.shape)
        parts = [":" if c == 1 else f"{a}:{b}"
                 for (_, c), (a, b) in zip(tile.block, tile.bounds, strict=True)]
        out[str(tile.device)] = "[" + ", ".join(parts) + "]"
    return out


def _open(browser, url: str):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    messages: list[tuple[str, str]] = []
    page.on("console", lambda m: messages.append((m.type, m.text)))
    page.on("pageerror", lambda e: messages.append(("pageerror", str(e))))
    page.goto(url)
    page.wait_for_load_state("load")
    return page, messages


def _tiling(page) -> dict[str, str]:
    cells = page.locator("#tiling svg rect.tile")
    return {cells.nth(i).get_attribute("data-device"): cells.nth(i).get_attribute("data-block")
            for i in range(cells.count())}


def _check_page(page, messages, plan: Plan) -> None:
    assert not [m for m in messages if m[0] in ("error", "pageerror")], messages
    # the script adds no globals (it runs in one function scope)
    # (not "tensors" or "stages": elements with those ids are window properties anyway)
    names = ["D", "TENSOR_ROWS", "fmtBytes", "select", "renderTensors", "drawTimeline", "zoom"]
    # (a global eval sees top-level const / let bindings too, which are not window properties)
    assert page.evaluate("names => names.filter(n => (0, eval)('typeof ' + n) !== 'undefined')",
                         names) == []
    for section in SECTIONS:
        assert page.locator(f"#{section} h2").count() == 1, section
        assert len(page.locator(f"#{section}").inner_text().strip()) > 20, section
    assert page.locator("#cluster .dev").count() == len(data.devices(plan))
    assert page.locator("#cluster .dev.idle").count() == sum(
        d.stage is None for d in data.devices(plan))
    assert page.locator("#stages tbody tr").count() == len(plan.stages)
    assert page.locator("#tensor-table tbody tr[data-i]").count() == len(data.tensors(plan))
    assert page.locator("#memory .membar").count() >= 1


def _pick(page, plan: Plan, path: str) -> None:
    """Clicks the tensor row of ``path`` and checks the tiling it draws."""
    index = page.evaluate("p => Array.from(document.querySelectorAll('#tensor-table tr[data-i]'))"
                          ".find(r => r.cells[0].textContent === p).getAttribute('data-i')", path)
    row = page.locator(f'#tensor-table tr[data-i="{index}"]')
    row.click()
    assert row.get_attribute("aria-selected") == "true"
    assert page.locator('#tensor-table tr[aria-selected="true"]').count() == 1
    assert _tiling(page) == _labels(plan, path)


def _check_hash(browser, path: Path, plan: Plan, tensor: str) -> None:
    page, messages = _open(browser, f"{path.resolve().as_uri()}#tensor={quote(tensor, safe='')}")
    assert not [m for m in messages if m[0] in ("error", "pageerror")], messages
    selected = page.locator('#tensor-table tr[aria-selected="true"]')
    assert selected.count() == 1 and selected.locator("td").first.inner_text() == tensor
    assert _tiling(page) == _labels(plan, tensor)
    page.close()


def _check_png(path: Path) -> None:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert width == 1280 and height > 900 and path.stat().st_size > 30_000


def test_one_stage_report_renders_and_draws_a_tiling(browser, one_stage, tmp_path) -> None:
    plan = one_stage
    path = write_html(plan, tmp_path / "report.html")
    page, messages = _open(browser, path.resolve().as_uri())
    _check_page(page, messages, plan)
    assert "One stage" in page.locator("#timeline").inner_text()
    # a leaf split over both mesh axes, if the plan has one; else any split leaf
    split = [t for t in data.tensors(plan) if any(t.spec)]
    both = [t for t in split if sum(map(len, t.spec)) == 2] or split
    _pick(page, plan, both[0].path)
    assert page.locator("#tiling svg rect.tile").count() == 8
    # the leaf's other shardings, as plan.explain(tensor=...) lists them
    ((_, record),) = _records(plan)
    ((group, _),) = _groups_of(record, both[0].path)
    options = record["groups"][group]["options"]
    assert page.locator("#tiling table tbody tr").count() == len(options) > 0
    assert page.locator("#tiling table tbody tr td").first.inner_text() == format_spec(
        tuple(tuple(dim) for dim in options[0][0]))
    page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
    _check_png(tmp_path / "report.png")
    assert not [m for m in messages if m[0] in ("error", "pageerror")], messages
    page.close()
    _check_hash(browser, path, plan, split[-1].path)


def test_heterogeneous_report_draws_stages_timeline_and_tiling(browser, mixed,
                                                               tmp_path) -> None:
    plan = mixed
    assert {s.device_type for s in plan.stages} == {"a100-80g", "v100-32g"}
    path = write_html(plan, tmp_path / "report.html")
    page, messages = _open(browser, path.resolve().as_uri())
    _check_page(page, messages, plan)
    # the simulator's timeline: one row per (replica, stage), every compute task drawn
    # (each is wider than 2 px at this size), forward and backward per microbatch
    rows = page.locator("#timeline svg rect.lane")
    assert rows.count() == len(plan.stages)
    tasks = sum(r.microbatches * len(r.stages) for r in plan.replicas)
    assert page.locator("#timeline svg rect.task.forward").count() == tasks
    assert page.locator("#timeline svg rect.task.backward").count() == tasks
    assert "microbatch" in page.locator("#timeline svg rect.task title").first.text_content()
    tensor = next(t for t in data.tensors(plan) if t.stage != 0)
    _pick(page, plan, tensor.path)
    assert page.locator("#tiling svg rect.tile").count() == (
        plan.stages[tensor.stage].mesh.num_devices)
    page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
    _check_png(tmp_path / "report.png")
    page.close()
    _check_hash(browser, path, plan, data.tensors(plan)[0].path)


def test_tilings_of_3d_0d_and_three_axis_meshes(browser, tmp_path) -> None:
    plan = two_stage_plan()
    path = write_html(plan, tmp_path / "report.html")
    page, messages = _open(browser, path.resolve().as_uri())
    _check_page(page, messages, plan)
    # [8, 16, 4] split over 'data' (dim 0) and 'model' (dim 2) of a 2 x 2 mesh
    _pick(page, plan, "0/blocks/0/w3")
    assert sorted(_tiling(page).values()) == ["[0:4, :, 0:2]", "[0:4, :, 2:4]",
                                              "[4:8, :, 0:2]", "[4:8, :, 2:4]"]
    _pick(page, plan, "1/count")  # 0-d: every device holds it whole
    assert set(_tiling(page).values()) == {"[]"}
    assert "scalar" in page.locator("#tiling").inner_text()
    # the timeline: stage 1 idles before its first forward (the bubble), all 8 tasks drawn
    assert page.locator("#timeline svg rect.task.forward").count() == 4
    assert page.locator("#timeline svg rect.task.send_forward").count() == 2
    page.close()
    # [64, 32], dim 1 over 'x' x 'z' of the 2 x 1 x 2 mesh: the rows flatten (x, y)
    _check_hash(browser, path, plan, "0/blocks/1/w")
    page, _ = _open(browser, f"{path.resolve().as_uri()}#tensor=0%2Fblocks%2F1%2Fw")
    assert sorted(_tiling(page).values()) == ["[:, 0:8]", "[:, 16:24]", "[:, 24:32]",
                                              "[:, 8:16]"]
    assert "flatten" in page.locator("#tiling").inner_text()
    page.close()




def test_the_notebook_frame_renders_the_report(browser) -> None:
    plan = two_stage_plan()
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_content(f"<html><body><p>notebook cell</p>{plan._repr_html_()}</body></html>")
    frame = page.frame_locator("iframe")
    frame.locator("#tensor-table tbody tr[data-i]").first.click()
    assert frame.locator("#tiling svg rect.tile").count() == 4  # stage 0: a 2 x 2 mesh
    # 8 compute tasks and 4 transfers
    assert frame.locator("#timeline svg rect.task").count() == 12 and not errors
    page.close()


def test_a_plan_without_shapes_shows_block_indices(browser, tmp_path) -> None:
    # _example() records no argument types (as plan files of schema 3): blocks, no bounds
    path = write_html(_example(), tmp_path / "report.html")
    page, messages = _open(browser, f"{path.resolve().as_uri()}#tensor=0%2Fw")
    assert _tiling(page) == {"0": "[:, 0/2]", "1": "[:, 1/2]"}
    assert "records no shapes" in page.locator("#tiling").inner_text()
    assert not [m for m in messages if m[0] in ("error", "pageerror")], messages
    page.close()
