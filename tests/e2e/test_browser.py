"""The Prefect UI in a real browser (helpers/browser.py: Debian's `chromium`, headless, driven by
Playwright) over the UI of the real `prefect server` (conftest's `prefect_server`): the fleet view.

The `ett-fleet-report` flow runs as a deployment over a warehouse that holds a small fleet
(e2e/conftest.py's `measured_runs`, shared with the automations test). The test checks the
fleet artifact's page as a person would see it: its sections and both pictures rendered, the
ETT axis scaled to the data. A real worker-run refresh's pages (the runs list, its Details and
Artifacts, the ETT table and timeline) and the automations page are read in the same browser
by the stack's end-to-end test (e2e/test_local_stack.py), on the runs `ettflow up` scheduled.

Screenshots are test outputs under the test's tmp dir (`failure.png` and `failure.html` when a
check fails); with `ETTFLOW_SCREENSHOTS=docs/screenshots` the README's are written there too.
"""

from __future__ import annotations

import httpx
import pytest

from helpers.browser import browse, rendered_images, save

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_fleet_view_in_chromium(measured_runs, tmp_path):
    from playwright.sync_api import expect

    api, fleet_run_id = measured_runs.api, measured_runs.fleet_run_id
    ui = api.removesuffix("/api")
    artifacts = httpx.post(f"{api}/artifacts/filter",
                           json={"artifacts": {"flow_run_id": {"any_": [fleet_run_id]}}}).json()
    fleet_artifact = next(a for a in artifacts if a["key"] == "ett-fleet")

    def check(page) -> None:
        page.goto(f"{ui}/artifacts/artifact/{fleet_artifact['id']}")
        expect(page.get_by_text("ETT of the fleet").first).to_be_visible()
        expect(page.get_by_text("Regressions").first).to_be_visible()
        page.wait_for_function("() => [...document.querySelectorAll(\"img[src^='data:image/png']\")]"
                               ".filter(i => i.complete && i.naturalWidth > 0).length >= 2")
        assert {i["alt"] for i in rendered_images(page) if i["w"] > 0} == {"ETT per run of the fleet",
                                                                           "components of the fleet"}
        save(page, "fleet-view.png", tmp_path, readme=True)

    print(f"browser part: {browse(tmp_path, check):.1f} s (screenshots in {tmp_path})")
