"""Size and render time of the HTML plan report (``plan.to_html()``), and the README screenshot.

The issue's acceptance: reports for a one-stage 8-device plan, the heterogeneous demo plan and a
planned-only GPT-3 175B on the three-type 768-GPU cluster each render in under 2 s and stay
under 5 MB. Plans (all on ``ShapeDtypeStruct`` s, nothing runs):

* ``one-stage``: the tiny GPT (``gpt-tiny``) on the 8 local devices, one stage;
* ``demo``: the plan ``shardplan train configs/train/demo.yaml`` makes (a 4-block GPT on 4
  A100s + 4 V100s, emulated, split into pipeline stages on both types);
* ``gpt3-175b-768``: GPT-3 175B on ``h100_a100_l4x256.yaml`` as ``benchmarks/plan_scale.py``
  plans it.

Each report is written, opened in headless Chromium (Debian's ``/usr/bin/chromium`` through
Playwright), and timed from navigation start to the end of ``DOMContentLoaded`` (the report's
inline script runs before it, so this includes drawing every section); console errors are
counted. The demo's report, with a tensor picked, is saved as ``docs/report.png``.

Prints a table and writes ``benchmarks/results/visualizer.json``.

Usage: ``python benchmarks/visualizer.py [--cases one-stage,demo,gpt3-175b-768] [--no-png]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

RESULTS = ROOT / "benchmarks" / "results" / "visualizer.json"
SCREENSHOT = ROOT / "docs" / "report.png"
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MAX_BYTES = 5_000_000
MAX_RENDER_S = 2.0


def _one_stage():
    import shardplan_models as models

    import shardplan as sp

    config = models.load_model_config("gpt-tiny")
    graphdef, state = models.abstract_train_state(config)
    batch = models.example_batch(config, 16, abstract=True)
    return sp.make_plan(models.make_train_step(graphdef), state, batch,
                        cluster=sp.Cluster.local())


def _demo():
    import shardplan_models as models

    import shardplan as sp
    from shardplan.data.place import abstract_batch
    from shardplan.train.config import load_run_config

    config = load_run_config(ROOT / "configs" / "train" / "demo.yaml")
    graphdef, state = models.abstract_train_state(config.model.build(),
                                                  optimizer=config.optimizer_transform())
    return sp.make_plan(models.make_train_step(graphdef), state, abstract_batch(config.data),
                        cluster=config.cluster.build(), config=config.plan.config)


def _gpt3():
    import shardplan_models as models
    from plan_scale import BATCH, _cluster
    from plan_scale import CASES as SCALE_CASES

    import shardplan as sp

    file, keep, _ = SCALE_CASES["768"]
    config = models.load_model_config("gpt3-175b", overrides={"scan_layers": True})
    graphdef, state = models.abstract_train_state(config)
    batch = models.example_batch(config, BATCH, abstract=True)
    return sp.make_plan(models.make_train_step(graphdef), state, batch,
                        cluster=_cluster(file, keep), config=sp.PlanConfig(pipeline=True))


CASES = {"one-stage": _one_stage, "demo": _demo, "gpt3-175b-768": _gpt3}


def _render(browser: Any, path: Path, fragment: str = "") -> tuple[float, list[str], Any]:
    """Opens the report; returns (seconds to the end of DOMContentLoaded, errors, page)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.resolve().as_uri() + fragment)
    page.wait_for_load_state("load")
    ms = page.evaluate("() => performance.getEntriesByType('navigation')[0]"
                       ".domContentLoadedEventEnd")
    return ms / 1e3, errors, page


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    parser.add_argument("--no-png", action="store_true", help="do not write docs/report.png")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    from shardplan.viz import data
    from shardplan.viz.html import write_html

    rows = []
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for case in args.cases.split(","):
            t0 = time.perf_counter()
            plan = CASES[case]()
            plan_s = time.perf_counter() - t0
            plan.content_hash  # noqa: B018  (hashed once here, not inside the report's time)
            t0 = time.perf_counter()
            path = write_html(plan, Path(tmp) / f"{case}.html")
            write_s = time.perf_counter() - t0
            render_s, errors, page = _render(browser, path)
            page.close()
            row = {"case": case, "stages": len(plan.stages), "devices": plan.num_devices,
                   "cluster_devices": len(data.devices(plan)),
                   "tensors": len(data.tensors(plan)),
                   "timeline": "timeline" in plan.solver, "plan_s": plan_s,
                   "write_html_s": write_s, "bytes": path.stat().st_size,
                   "render_s": render_s, "console_errors": errors,
                   "ok": path.stat().st_size < MAX_BYTES and render_s < MAX_RENDER_S
                   and not errors}
            rows.append(row)
            print(f"{case}: {row['stages']} stages, {row['devices']} of "
                  f"{row['cluster_devices']} devices, {row['tensors']} tensors, timeline "
                  f"{'yes' if row['timeline'] else 'no'}: {row['bytes'] / 1e3:,.0f} kB, "
                  f"written in {write_s:.2f} s, rendered in {render_s:.2f} s, "
                  f"{len(errors)} console errors: {'PASS' if row['ok'] else 'FAIL'}")
            if case == "demo" and not args.no_png:
                split = [t for t in data.tensors(plan) if any(t.spec)] or data.tensors(plan)
                _, _, page = _render(browser, path, "#tensor=" + quote(split[0].path, safe=""))
                page.screenshot(path=str(SCREENSHOT), full_page=True)
                page.close()
                print(f"    screenshot: {SCREENSHOT.relative_to(ROOT)}")
        browser.close()
    RESULTS.write_text(json.dumps({
        "benchmark": "visualizer", "max_bytes": MAX_BYTES, "max_render_s": MAX_RENDER_S,
        "machine": platform.platform(), "python": platform.python_version(),
        "rows": rows}, indent=2) + "\n", encoding="utf-8")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
