"""The Prefect UI in a real browser, as a person reads it: Debian's `chromium`, headless, driven by
Playwright (`executable_path`: no browser download; scripts/setup_browser.sh installs both).

`browse(ui, tmp_path, check)` opens a page and runs `check(page)`, keeping a screenshot and the
HTML of what the browser showed when a check fails. `check_run_pages` reads a refresh's pages
(the runs list, the run's Details and Artifacts, its ETT table and timeline) and
`check_automations` the automations page. Screenshots go under the test's tmp dir; with
`ETTFLOW_SCREENSHOTS=docs/screenshots` the README's ones are written there too.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from helpers.prefect_cli import REPO


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("Debian's chromium is not installed: run `bash scripts/setup_browser.sh` (scripts/test.sh does)",
                    pytrace=False)
    return path


def save(page, name: str, tmp_path: Path, *, readme: bool = False) -> Path:
    """A screenshot of the page under the test's tmp dir; the README's also under
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


def clipped_cells(page) -> list[str]:
    """The text of every table cell whose content runs past the cell's right edge or its
    table's frame (the Prefect UI cuts it there: what a user cannot read)."""
    return page.evaluate("""() => [...document.querySelectorAll('td, th')].filter(cell => {
        const text = document.createRange();
        text.selectNodeContents(cell);
        const right = text.getBoundingClientRect().right;
        return right > cell.getBoundingClientRect().right + 1
            || right > cell.closest('table').parentElement.getBoundingClientRect().right + 1;
    }).map(cell => cell.innerText)""")


def browse(tmp_path: Path, check: Callable[[object], None]) -> float:
    """Run `check(page)` in a fresh headless Chromium; the seconds it took."""
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=30_000)  # a busy 2-core machine
    started = time.perf_counter()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        page.set_default_timeout(30_000)
        try:
            check(page)
        except Exception:
            save(page, "failure.png", tmp_path)  # what the browser showed, beside its HTML
            (tmp_path / "failure.html").write_text(page.content())
            raise
        finally:
            browser.close()
    return time.perf_counter() - started


def tab(page, name: str):
    """A tab of the flow run page (Prefect's UI: `li.p-tab`)."""
    return page.locator("li.p-tab", has_text=name)


def check_run_pages(page, ui: str, run_id: str, *, name: str, message: str, slug: str, tmp_path: Path,
                    rows: Iterable[str] = ("ETT %", "NoF", "TTS s", "effective_training")) -> None:
    """A refresh's pages: its name (`name`, with its ETT) in the runs list and on its page, its
    state message (`message`) in Details, its artifacts (`ett-<slug>`, `ett-timeline-<slug>`,
    `snapshot-<slug>`): the ETT table's `rows`, the timeline picture rendered, the manifest; no
    table cell cut at the page's edge."""
    from playwright.sync_api import expect

    page.goto(f"{ui}/runs")  # the runs list shows each run's ETT without a click (issue 27)
    expect(page.get_by_text(name).first).to_be_visible()
    save(page, "runs-list.png", tmp_path, readme=True)

    page.goto(f"{ui}/runs/flow-run/{run_id}")
    expect(page.get_by_text(name).first).to_be_visible()
    expect(page.get_by_text("Completed").first).to_be_visible()
    tab(page, "Details").click()  # the flow run's details show its state message
    expect(page.get_by_text("State Message").first).to_be_visible()
    expect(page.get_by_text(re.compile(re.escape(message))).first).to_be_visible()
    save(page, "run-details.png", tmp_path, readme=True)

    tab(page, "Artifacts").click()  # a card per artifact; each opens the artifact's page
    expect(page.get_by_text(f"ett-timeline-{slug}").first).to_be_visible()
    save(page, "run-artifacts.png", tmp_path, readme=True)

    page.get_by_text(f"ett-{slug}", exact=True).first.click()  # the ETT table
    for row in rows:
        expect(page.get_by_text(row, exact=True).first).to_be_visible()
    assert clipped_cells(page) == []  # it fits a 1440-px page, owner column included (issue 43)
    save(page, "run-ett-table.png", tmp_path, readme=True)

    page.go_back()
    tab(page, "Artifacts").click()
    page.get_by_text(f"ett-timeline-{slug}", exact=True).first.click()  # the timeline picture
    page.wait_for_function("() => [...document.querySelectorAll(\"img[src^='data:image/png']\")]"
                           ".some(i => i.complete && i.naturalWidth > 0)")
    timeline = [i for i in rendered_images(page) if i["alt"].startswith("ETT timeline of run")]
    assert len(timeline) == 1 and timeline[0]["w"] > 0 and timeline[0]["h"] > 0, rendered_images(page)
    save(page, "run-timeline.png", tmp_path, readme=True)

    page.go_back()
    tab(page, "Artifacts").click()
    page.get_by_text(f"snapshot-{slug}", exact=True).first.click()  # the snapshot's manifest
    expect(page.get_by_text("anchor checkpoint", exact=True).first).to_be_visible()
    expect(page.get_by_text(re.compile(r"^step_\d+$")).first).to_be_visible()  # the anchor, by its folder
    expect(page.get_by_text(re.compile(r"^anchor checkpoint: /.*/step_\d+$")).first).to_be_visible()  # whole
    assert clipped_cells(page) == []  # no path cut at the page's edge (issue 43)
    save(page, "run-snapshot.png", tmp_path, readme=True)


def check_automations(page, ui: str, names: Iterable[str], trigger_text: str, tmp_path: Path) -> None:
    """The automations page: each shipped automation's name says its threshold, and a
    description says what triggers it (the page's "Trigger" says only "A custom trigger")."""
    from playwright.sync_api import expect

    page.goto(f"{ui}/automations")
    for name in names:
        expect(page.get_by_text(name).first).to_be_visible()
    expect(page.get_by_text(trigger_text, exact=False).first).to_be_visible()
    save(page, "automations.png", tmp_path, readme=True)
