"""The Prefect UI in a real browser (helpers/browser.py: Debian's `chromium`, headless, driven by
Playwright) over the UI of the real `prefect server` (conftest's `prefect_server`): the fleet view,
and the custom run form of `refresh-adhoc` (prefect.yaml's deployment, deployed here).

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

import json
import re
import shutil

import httpx
import pytest

from helpers.browser import browse, rendered_images, save
from helpers.prefect_cli import REPO, prefect

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


def test_the_refresh_run_form_in_chromium(prefect_server, tmp_path):
    """The form a user fills to start a refresh (Deployments / refresh-adhoc / Run): a group per
    section of `RefreshParameters` with its description, each field's help with its default and
    limits, a switch as "preset" or an on/off toggle. `world_size` 0 is refused by the server
    before a run exists (409: nothing created); a valid form sends what `RefreshParameters`
    parses, untouched switches as null (the mode's preset). The valid submission is stopped in
    the browser: a run in the shared work pool could be taken by another test's worker."""
    from playwright.sync_api import expect

    from ettflow.tasks.parameters import RefreshParameters

    env, api = prefect_server
    shutil.copy(REPO / "prefect.yaml", tmp_path / "prefect.yaml")
    prefect(env, "--no-prompt", "deploy", "--name", "refresh-adhoc", "--prefect-file", str(tmp_path / "prefect.yaml"))
    deployment = httpx.get(f"{api}/deployments/name/refresh-model/refresh-adhoc").json()
    ui = api.removesuffix("/api")

    def field(page, label: str):
        return page.locator(".schema-form-property",
                            has=page.locator(".schema-form-property__label", has_text=re.compile(f"^{label}"))).last

    def check(page) -> None:
        page.goto(f"{ui}/deployments/deployment/{deployment['id']}/run")
        for section in RefreshParameters.sections():
            expect(page.get_by_text(f"{section} (Optional)", exact=True)).to_be_visible()
        world = field(page, "World Size")
        expect(world).to_contain_text("The number of trainer ranks (one Ray actor each). [default 2; at least 1]")
        cache = field(page, "Compile Cache")
        expect(cache.get_by_text("preset", exact=True)).to_be_visible()
        cache.get_by_text("on/off", exact=True).click()
        cache.get_by_role("switch").click()  # on
        expect(cache.get_by_role("switch")).to_have_attribute("aria-checked", "true")
        cache.scroll_into_view_if_needed()
        save(page, "run-form-switches.png", tmp_path, readme=True)

        world.locator("input").fill("0")
        with page.expect_response(re.compile("/create_flow_run$")) as refused:
            page.get_by_role("button", name="Submit").click()
        assert refused.value.status == 409, refused.value.text()  # the server refused: no run was created
        expect(page.get_by_text("0 is less than the minimum of 1").first).to_be_visible()
        world.scroll_into_view_if_needed()
        save(page, "run-form.png", tmp_path, readme=True)

        sent: list[dict] = []

        def stop(route) -> None:  # what a valid form sends, kept here and not created
            sent.append(json.loads(route.request.post_data)["parameters"])
            route.abort()

        page.route(re.compile("/create_flow_run$"), stop)
        world.locator("input").fill("3")
        page.get_by_role("button", name="Submit").click()
        for _ in range(300):  # the handler runs while the page waits
            if sent:
                break
            page.wait_for_timeout(100)
        (given,) = sent
        params = RefreshParameters.parse(given)
        switches, _ = params.resolved_switches()
        assert params.training.world_size == 3 and switches.compile_cache and params.mode == "optimized"
        assert {k: v for k, v in given["switches"].items() if v is not None} == {"compile_cache": True}

    print(f"browser part: {browse(tmp_path, check):.1f} s (screenshots in {tmp_path})")
