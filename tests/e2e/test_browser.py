"""The Prefect UI in a real browser: Debian's `chromium`, headless, driven by Playwright
(`executable_path`: no browser download; scripts/setup_browser.sh installs both) over the UI
of the real `prefect server` (conftest's `prefect_server`).

A flow run of the deployment `refresh-adhoc` measured without training (helpers/fleet_runs.py:
ETT 27.8%, NoF 2), archived by ettflow's real hook, and the `ett-fleet-report` flow over a
warehouse that also holds a small fleet (both made by e2e/conftest.py's `measured_runs`, shared
with the automations test). The test checks, as a person would see them:

- the flow run page: its state, and in its Details tab the state message with its ETT;
- the run's Artifacts tab, and the artifacts it opens: the ETT table (its rows) and the
  timeline picture, rendered (an <img> with a non-zero natural width);
- the fleet artifact's page: its sections and both pictures rendered;
- the runs list, where a run's name carries its ETT, and the automations page, where each
  shipped automation's name carries its threshold.

Screenshots are test outputs, under the test's tmp dir (the run's details, artifacts tab, ETT
table and timeline, the fleet view; `failure.png` and `failure.html` when a check fails); with
`ETTFLOW_SCREENSHOTS=docs/screenshots` the README's two (run-page.png, fleet-view.png) are
written there too.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from helpers.prefect_cli import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("Debian's chromium is not installed: run `bash scripts/setup_browser.sh` (scripts/test.sh does)",
                    pytrace=False)
    return path


def save(page, name: str, tmp_path: Path, *, readme: bool = False) -> Path:
    """A screenshot of the page under the test's tmp dir; the README's two also under
    $ETTFLOW_SCREENSHOTS when set."""
    out = tmp_path / name
    page.screenshot(path=str(out), full_page=True)
    if readme and os.environ.get("ETTFLOW_SCREENSHOTS"):
        folder = Path(os.environ["ETTFLOW_SCREENSHOTS"])
        folder = folder if folder.is_absolute() else REPO / folder
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(out, folder / name)
    return out


def rendered_images(page) -> list[dict]:
    """Every <img> on the page with a data: PNG source: its natural size once loaded."""
    return page.eval_on_selector_all(
        "img[src^='data:image/png']",
        "imgs => imgs.map(i => ({alt: i.alt, complete: i.complete, w: i.naturalWidth, h: i.naturalHeight}))")


def test_run_page_and_fleet_view_in_chromium(measured_runs, tmp_path):
    from playwright.sync_api import sync_playwright

    api, run_id, fleet_run_id = measured_runs.api, measured_runs.run_id, measured_runs.fleet_run_id
    ui = api.removesuffix("/api")
    artifacts = httpx.post(f"{api}/artifacts/filter",
                           json={"artifacts": {"flow_run_id": {"any_": [fleet_run_id]}}}).json()
    fleet_artifact = next(a for a in artifacts if a["key"] == "ett-fleet")

    started = time.perf_counter()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(30_000)
        try:
            check_pages(page, ui, run_id, fleet_artifact["id"], tmp_path)
        except Exception:
            save(page, "failure.png", tmp_path)  # what the browser showed, beside its HTML
            (tmp_path / "failure.html").write_text(page.content())
            raise
        finally:
            browser.close()
    print(f"browser part: {time.perf_counter() - started:.1f} s (screenshots in {tmp_path})")


def tab(page, name: str):
    """A tab of the flow run page (Prefect's UI: `li.p-tab`)."""
    return page.locator("li.p-tab", has_text=name)


def check_pages(page, ui: str, run_id: str, fleet_artifact_id: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    expect.set_options(timeout=30_000)  # a busy 2-core machine
    page.goto(f"{ui}/runs/flow-run/{run_id}")
    # the run's name says its ETT once archived (issue 27: ETT in the runs list without a click)
    expect(page.get_by_text("dlrm-optimized · ETT 27.8%").first).to_be_visible()
    expect(page.get_by_text("Completed").first).to_be_visible()
    save(page, "run-details-top.png", tmp_path)
    tab(page, "Details").click()  # the flow run's details show its state message
    expect(page.get_by_text("State Message").first).to_be_visible()
    expect(page.get_by_text("ETT 27.8% · NoF 2").first).to_be_visible()  # the state message says its ETT
    save(page, "run-details.png", tmp_path)

    tab(page, "Artifacts").click()  # a card per artifact; each opens the artifact's page
    expect(page.get_by_text("ett-timeline-refresh-adhoc").first).to_be_visible()
    save(page, "run-page.png", tmp_path, readme=True)

    page.get_by_text("ett-refresh-adhoc", exact=True).first.click()  # the ETT table
    for row in ("ETT %", "NoF", "TTS s", "pt2_compile", "effective_training", "compiler"):
        expect(page.get_by_text(row, exact=True).first).to_be_visible()
    save(page, "run-ett-table.png", tmp_path)

    page.go_back()
    tab(page, "Artifacts").click()
    page.get_by_text("ett-timeline-refresh-adhoc", exact=True).first.click()  # the timeline picture
    page.wait_for_function("() => [...document.querySelectorAll(\"img[src^='data:image/png']\")]"
                           ".some(i => i.complete && i.naturalWidth > 0)")
    timeline = [i for i in rendered_images(page) if i["alt"].startswith("ETT timeline of run")]
    assert len(timeline) == 1 and timeline[0]["w"] > 0 and timeline[0]["h"] > 0, rendered_images(page)
    save(page, "run-timeline.png", tmp_path)

    page.goto(f"{ui}/artifacts/artifact/{fleet_artifact_id}")
    expect(page.get_by_text("ETT of the fleet").first).to_be_visible()
    expect(page.get_by_text("Regressions").first).to_be_visible()
    page.wait_for_function("() => [...document.querySelectorAll(\"img[src^='data:image/png']\")]"
                           ".filter(i => i.complete && i.naturalWidth > 0).length >= 2")
    assert {i["alt"] for i in rendered_images(page) if i["w"] > 0} == {"ETT per run of the fleet",
                                                                       "components of the fleet"}
    save(page, "fleet-view.png", tmp_path, readme=True)

    # the runs list shows each run's ETT without a click: in its name once archived (issue 27)
    page.goto(f"{ui}/runs")
    expect(page.get_by_text("dlrm-optimized · ETT 27.8%").first).to_be_visible()
    save(page, "runs-list.png", tmp_path, readme=True)

    # the automations page: each shipped automation's name says its threshold
    page.goto(f"{ui}/automations")
    for name in ("ettflow: ETT below 40% on refresh-adhoc", "ettflow: NoF above 1"):
        expect(page.get_by_text(name).first).to_be_visible()
    # ... and its description says what triggers it (the page's "Trigger" says only "A custom trigger")
    expect(page.get_by_text("with ETT below 40% (its ettflow.ett_pct label)", exact=False).first).to_be_visible()
    save(page, "automations.png", tmp_path, readme=True)
