"""The README's main job on the deployed path: `ettflow up --refreshes 2` brings up a Prefect
server, a Ray head, the work pool, the deployments (`prefect deploy --all` of prefect.yaml), a
process worker and the crash automation, then runs two refreshes as deployment runs that the
worker executes (the first with the induced kill, the second warm on a window that arrived for
it); both join the stack's Ray (no Ray start on their clock). What the API shows of a run (the
state message with its ETT, the name with its windows, the tags, the artifacts, the run form's
parameter help) and `ettflow report`'s status, deployment and link are checked on the second.
`ettflow up` again finds everything running; `ettflow down` leaves no process of the stack.
Tiny sizes (the session's compile-cache archive, 24 steps)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

import httpx
import psutil
import pytest

from ettflow.ett.warehouse import Warehouse
from ettflow.stack.records import StackRecord, session_processes, stack_processes
from ettflow.tasks.run_spool import RunRecorder

from helpers.flows import BATCH, MODEL, TINY
from helpers.stack import ettflow, free_ports, port_flags, stack_env
from helpers.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def test_up_runs_two_deployment_refreshes_then_down_leaves_nothing(tmp_path, compile_cache):
    api_port, ray_port, client_port = free_ports(3)
    home, work = tmp_path / "home", tmp_path / "work"
    shutil.copytree(compile_cache, work / MODEL / "compile-cache")  # the session's archive: no cold compile
    env = stack_env(home)
    ports = port_flags(api_port, ray_port, client_port)
    params = {"architecture": TINY, "max_embeddings": 100, "batch_size": BATCH, "max_steps": 24,
              "checkpoint_every_steps": 8, "eval_batches": 2, "work_root": str(work)}
    # the second run is scheduled 8 s after the first ended, as a deployment's schedule creates it: the
    # worker starts its process ahead (prefetch), the process waits for its time
    # a webhook URL, so the shipped alerts are applied too (nothing listens there: their posts fail, which
    # only the automations' own events record)
    argv = ["up", *ports, "--num-cpus", "4", "--refreshes", "2", "--every", "8",
            "--deployment", "refresh-model/refresh-scheduled", "--webhook-url", f"http://127.0.0.1:{free_ports(1)[0]}/"]
    for key, value in params.items():
        argv += ["--param", f"{key}={json.dumps(value)}"]
    try:
        up = ettflow(env, *argv, timeout=1200)
        out = up.stdout + up.stderr
        assert up.returncode == 0, out[-6000:]
        for service in ("prefect-server", "ray-head", "worker"):
            assert re.search(rf"{service}\s+\S+\s+started \(pid \d+\)", out), out[:3000]
        assert "crash-automation" in out and "alert-automations" in out
        links = re.findall(rf"refresh (\d): http://127\.0\.0\.1:{api_port}/runs/flow-run/([0-9a-f-]{{36}})", out)
        assert [n for n, _ in links] == ["1", "2"], out[-3000:]
        first, second = (run_id for _, run_id in links)
        # the demo's next window arrived before the second run was created (not on its clock)
        assert len(re.findall(r"new data arrived on the default synthetic source: window=\d+", out)) == 1, out[-3000:]
        api = f"http://127.0.0.1:{api_port}/api"
        for run_id in (first, second):
            run = httpx.get(f"{api}/flow_runs/{run_id}").json()
            assert run["state_type"] == "COMPLETED", run["state"]
            assert "scheduled" in run["tags"]  # a run of the scheduled deployment, executed by the worker
        with Warehouse.open(f"sqlite:///{home / 'warehouse.db'}") as wh:
            lineage = {r.run_id: r for r in wh.lineage(MODEL)}
            runs = wh.runs_frame(model=MODEL).set_index("run_id")
        assert lineage[second].parent_run_id == first
        assert set(lineage[second].windows).isdisjoint(lineage[first].windows)  # a new window, trained
        assert runs.loc[first, "nof"] == 1 and runs.loc[second, "nof"] == 0
        # the second run holds what pays: with the first run's history (a rare failure over a
        # fraction of a second of training) a spare would cost more than it saves, so it holds
        # none (a lost rank would get one started then) and nothing else: its capETT is its ETT
        second_row = runs.loc[second]
        assert second_row["held_s"] == 0 and second_row["unused_spare_s"] == 0, second_row
        assert second_row["capacity_ett_pct"] == pytest.approx(second_row["ett_pct"])
        # the first run (no history, a scripted kill) held none either and still recovered live:
        # a spare was started when rank 1 was lost and took its place
        spares_first = [e for e in RunRecorder(home / "spool", first).events() if e.phase == "spare_start"]
        assert [(e.attrs.get("used"), e.attrs.get("pooled"), e.attrs.get("rule")) for e in spares_first] == [
            (True, False, "spare-at-loss")], spares_first
        for run_id in (first, second):  # every reservation joined the stack's Ray: none started on the clock
            events = RunRecorder(home / "spool", run_id).events()
            reserved = [e for e in events if e.phase == "scheduling" and e.attrs.get("stage") == "reserve_trainer"]
            assert reserved and all(e.attrs["ray"] == "joined" for e in reserved), [e.attrs for e in reserved]
            assert not [e for e in events if e.phase == "ray_start"]
        # the deployment's next scheduled run (its cron, every 6 h) is hours ahead: at the first
        # run's release the cluster's pool held nothing for it (a prewarm would not pay: hold_rule.py), so this
        # ad hoc second run started its ranks itself; the pool's plan outlives every flow process
        pooled = [e for e in RunRecorder(home / "spool", second).events()
                  if e.phase == "spare_start" and e.attrs.get("pooled") and e.attrs.get("for_rank") is not None]
        assert pooled == [], [e.attrs for e in pooled]
        # its process was started ahead of its scheduled time and waited: held for it, off its clock
        prestart = [e for e in RunRecorder(home / "spool", second).events() if e.phase == "flow_prestart"]
        assert len(prestart) == 1 and prestart[0].duration > 0, prestart
        assert runs.loc[second, "wall_start"] >= prestart[0].end
        # the pool weighed a just-in-time prewarm for the cron's next run against the start it
        # would save (the runs' own measured starts) and holds nothing: it would not pay here.
        # Unless the cold starts measured were long enough that saving all of one would pay (a
        # loaded host): then it plans, hours ahead, to prewarm that run to measure a pooled start
        held = ettflow(env, "pool", "status", timeout=120)
        assert held.returncode == 0, held.stdout + held.stderr
        if "prewarmed to measure one" not in held.stdout:
            assert re.search(r"decided +model dlrm .*nothing held .*\[none\]", held.stdout), held.stdout
            assert re.search(r"rule +model dlrm +next scheduled run in \d+ s; a just-in-time prewarm would hold \d+ x "
                             r"\d+ s .* slot-s to save 2 rank\(s\) x start saved", held.stdout), held.stdout
        else:
            assert re.search(r"planned +model dlrm .*before its next scheduled run\) \[just-in-time\]", held.stdout), \
                held.stdout
        assert not re.search(r"^  worker ", held.stdout, re.M), held.stdout
        _what_the_api_shows(api, home, second, api_port)
        worker_log = (home / "stack" / "logs" / "worker.log").read_text()
        # the worker's console as clean as the CLI's; no actor of a run aborts as its process ends
        for noise in ("is_fx_tracing", "Connected to Ray cluster", "Finished in state Completed()", "SIGABRT"):
            assert noise not in worker_log, noise
        assert re.search(r"^  ettflow pool \S+ on \S+: 0 process\(es\) held;", "  " + held.stdout, re.M), held.stdout

        again = ettflow(env, "up", *ports, timeout=600)  # harmless: everything is found running
        assert again.returncode == 0, again.stdout + again.stderr
        for service in ("prefect-server", "ray-head", "worker"):
            assert re.search(rf"{service}\s+\S+\s+running \(pid \d+\)", again.stdout), again.stdout
        status = ettflow(env, "status", timeout=120)
        assert status.returncode == 0 and "answers" in status.stdout, status.stdout + status.stderr
        stopped = ettflow(env, "pool", "stop", timeout=120)
        assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout + stopped.stderr
        assert wait_for(lambda: not _pooled_processes(home), 30, "the pool's processes to stop")
        # the ledger: the second run's holding (its prefetched process, no slot); the pool held no
        # worker for a run that never came
        with Warehouse.open(f"sqlite:///{home / 'warehouse.db'}") as wh:
            ledger = wh.holdings(MODEL)
        mine = sorted((h.kind, h.used) for h in ledger if h.run_id == second)
        assert mine == [("flow_process", True)], mine
        unclaimed = [h for h in ledger if h.run_id is None]
        assert not [h for h in unclaimed if h.kind == "unclaimed_worker"], unclaimed
        slots_held = sum(h.held_s * h.slots for h in ledger if h.run_id == second)  # the flow process holds no slot
        assert slots_held == pytest.approx(runs.loc[second, "held_s"])
        report = ettflow(env, "report", "--model", MODEL, timeout=120)
        assert report.returncode == 0 and "Held capacity, the ledger" in report.stdout, report.stdout[-3000:]
        # which rule held what: the second run's prefetched process, used
        assert any(line.split()[:4] == [MODEL, "flow_process", "worker-prefetch", "used"]
                   for line in report.stdout.splitlines()), report.stdout[-3000:]
        skipped = _a_run_with_nothing_new(api, params, tmp_path / "old-data")
        _in_the_browser(api, second, skipped, tmp_path)
        _the_crash_automation_never_fired_on_them(api, (first, second), runs)
    finally:
        record = StackRecord.read(home / "stack" / "stack.json")
        down = ettflow(env, "down", timeout=300)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "Connected to Ray cluster" not in down.stdout + down.stderr  # Ray's start-up notes stay out (issue 43)
    assert record is not None and not stack_processes(record.stack_id)
    # nor anything of their sessions: Ray's agents retitle themselves, hiding their environment and
    # their command line from the two checks around this one (one was left running once)
    assert not [p for s in record.services if s.started for p in session_processes(s.pid)]
    assert not [p for p in psutil.process_iter(["cmdline"])
                if record.ray_temp_dir in " ".join(p.info["cmdline"] or ())]  # no Ray process of the head
    assert not (home / "stack" / "stack.json").exists()
    with socket.socket() as s:  # the API's port is free again (its closed connections may linger in TIME_WAIT)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", api_port))


def _a_run_with_nothing_new(api: str, params: dict, data: Path) -> str:
    """An ad hoc deployment run of the same model after the two (the UI's Run) on a source whose
    windows it has trained already (the demo's default source gets a new window whenever a run
    finds nothing new): the worker's refresh skips, named and told as what it is."""
    from ettflow.stack.deployed_runs import run_and_wait
    from ettflow.tasks.parameters import RefreshParameters
    from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows

    generate_windows(data, SyntheticConfig(windows=2, rows_per_window=256, files_per_window=1))  # 2024010100, 01
    run = run_and_wait(api, api.removesuffix("/api"), "refresh-model/refresh-adhoc",
                       RefreshParameters.parse({**params, "data_root": str(data)}), timeout_s=300,
                       say=lambda line: None)
    assert run.completed and "nothing new to train" in run.message, (run.state, run.message)
    assert run.name.endswith("· skipped") and "ETT" not in run.name, run.name
    # its artifacts: the progress (from the claim to the skip) and, in the ETT table's place, one that says why
    found = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [run.run_id]}}}).json()
    assert sorted(a["key"] for a in found) == ["ett-refresh-adhoc", "training-progress-refresh-adhoc"], found
    return run.run_id


def _in_the_browser(api: str, run_id: str, skipped_id: str, tmp_path) -> None:
    """Issue 27, 43: a real worker-run refresh as a person reads it in Chromium: the runs list and
    the run's page with its ETT in the name, its Details (the state message, numbers first),
    its Artifacts (the ETT table, the timeline picture), the event feed (the measured event's
    card says ETT, capETT and NoF), a skipped run's page (what it is, no ETT), and the
    automations page (each shipped automation's threshold in its name, its trigger in its
    description). Screenshots: the test's tmp dir, and docs/screenshots with
    ETTFLOW_SCREENSHOTS=docs/screenshots."""
    from playwright.sync_api import expect

    from helpers.browser import browse, check_automations, check_run_pages, save, tab

    run = httpx.get(f"{api}/flow_runs/{run_id}").json()
    skipped = httpx.get(f"{api}/flow_runs/{skipped_id}").json()
    ui = api.removesuffix("/api")
    message = run["state"]["message"].split(" · TTS")[0]  # "ETT 12.3% · NoF 0"

    def check(page) -> None:
        check_run_pages(page, ui, run_id, name=run["name"], message=message, slug="refresh-scheduled",
                        tmp_path=tmp_path)
        page.goto(f"{ui}/events")  # the feed: each measured run's card names its numbers
        expect(page.get_by_text(re.compile(r"dlrm-\w+ · ETT \d+\.\d% · capETT \d+\.\d% · NoF 0 · "
                                           r"\w+")).first).to_be_visible()
        expect(page.get_by_text(re.compile(r"dlrm-\w+ · skipped")).first).to_be_visible()
        save(page, "event-feed.png", tmp_path, readme=True)
        page.goto(f"{ui}/runs/flow-run/{skipped_id}")  # a skipped run: named and told as what it is
        expect(page.get_by_text(skipped["name"]).first).to_be_visible()
        tab(page, "Details").click()
        expect(page.get_by_text(re.compile("nothing new to train")).first).to_be_visible()
        save(page, "run-skipped.png", tmp_path)
        check_automations(page, ui, ("ettflow: ETT below 60% on refresh-scheduled", "ettflow: NoF above 1",
                                     "ettflow: crash flow runs whose heartbeats stopped"),
                          "with ETT below 60% (its ettflow.ett_pct label)", tmp_path)

    print(f"\nbrowser part: {browse(tmp_path, check):.1f} s (screenshots in {tmp_path})")


def _the_crash_automation_never_fired_on_them(api: str, run_ids, runs) -> None:
    """Issue 27: the crash (zombie) automation fired on two completed scheduled runs 77 s after
    their last heartbeat. It can fire on a run only `missing_after_s` after that run's last
    heartbeat (75 s with the stack's 30 s heartbeats; a finished run sends none after its end):
    past that and a margin after the first run's end, no event of it (triggered, or an action)
    exists and both runs are still COMPLETED. (Run with the issue's 3 minutes once: no firing.)"""
    from ettflow.flows.zombies import NAME, missing_after_s

    window = missing_after_s(30) + 15.0
    ended = float(runs.loc[run_ids[0], "wall_end"])
    waited = max(0.0, ended + window - time.time())
    time.sleep(waited)
    (automation,) = [a for a in httpx.post(f"{api}/automations/filter", json={}, timeout=30).json()
                     if a["name"] == NAME]
    fired = ["prefect.automation.triggered", "prefect.automation.action.triggered",
             "prefect.automation.action.executed", "prefect.automation.action.failed"]  # not `created`
    body = {"filter": {"event": {"name": fired}, "resource": {"id": [f"prefect.automation.{automation['id']}"]}},
            "limit": 50}
    fired = httpx.post(f"{api}/events/filter", json=body, timeout=30).json()["events"]
    assert fired == [], [(e["event"], e.get("related")) for e in fired]
    for run_id in run_ids:
        assert httpx.get(f"{api}/flow_runs/{run_id}").json()["state_type"] == "COMPLETED"
    print(f"\ncrash automation: no firing {time.time() - ended:.0f} s after the first run ended "
          f"(its window {missing_after_s(30):.0f} s; waited {waited:.0f} s for it)")


def _pooled_processes(home) -> list[str]:
    """The stack's trainer workers, keepers and pool service still alive."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or ())
        if any(name in line for name in ("TrainerActor", "StateKeeper", "PoolService")):
            try:
                if p.environ().get("ETTFLOW_HOME") == str(home):
                    found.append(line[:80])
            except psutil.Error:
                continue
    return found


def _what_the_api_shows(api: str, home, run_id: str, api_port: int) -> None:
    """A completed deployment run as the UI shows it, and as `ettflow report` links it."""
    run = httpx.get(f"{api}/flow_runs/{run_id}").json()
    assert re.fullmatch(r"ETT \d+\.\d% · NoF 0 · TTS \d+\.\d s", run["state"]["message"]), run["state"]
    with Warehouse.open(f"sqlite:///{home / 'warehouse.db'}") as wh:
        (window,) = next(r for r in wh.lineage(MODEL) if r.run_id == run_id).windows
        row = wh.runs_frame(run_id=run_id).iloc[0]
    ett = run["state"]["message"].split(" · ")[0]  # the runs list shows the result (issue 27)
    assert run["name"] == f"{MODEL}-optimized {window.removeprefix('window=')} · {ett}"
    assert {"ettflow", "scheduled", f"model:{MODEL}", "mode:optimized", "failures:0", "outcome:published"} <= set(
        run["tags"]), run["tags"]
    # max_steps 24 on each of the 2 ranks, every step on new data
    assert row["flow_run_id"] == run_id and row["status"] == "completed" and row["effective_steps"] == 48
    assert row["tags"]["snapshot"] and os.path.isdir(row["tags"]["snapshot"])
    found = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [run_id]}}}).json()
    keys = [a["key"] for a in found]
    assert {"ett-refresh-scheduled", "ett-timeline-refresh-scheduled", "snapshot-refresh-scheduled"} <= set(keys)
    assert keys.count("training-progress-refresh-scheduled") == 1
    (table,) = [a for a in found if a["key"] == "ett-refresh-scheduled"]  # the spares it held, and why
    # the pool holds the model's spares for its training runs (this one alone: none pays), the
    # run's own decision beside it
    assert "spares: " in table["description"] and "a spare does not pay" in table["description"], table
    assert "a shared spare does not pay; this run alone: " in table["description"], table
    for a in found:  # the progress artifact ends at the final state and its message
        head = r"Completed · ETT \d+\.\d% · NoF 0 · TTS" if a["type"] == "progress" else \
            r"ETT \d+\.\d% · NoF 0 · Completed"
        assert re.match(head, a["description"]), a
        if a["type"] == "progress":  # and keeps what the run went through (issue 27)
            assert "\n- attempt 0, 0.0-" in a["description"] and "completed; " in a["description"], a
    deployment = httpx.get(f"{api}/deployments/name/refresh-model/refresh-scheduled").json()
    schema = deployment["parameter_openapi_schema"]  # the run form describes every parameter, section by section
    props, definitions = schema["properties"], schema["definitions"]
    assert props and all(p.get("description") or definitions[p["$ref"].rpartition("/")[2]].get("description")
                         for p in props.values())
    leaves = [leaf for name, p in props.items() if "$ref" in p
              for leaf in definitions[p["$ref"].rpartition("/")[2]]["properties"].values()]
    assert len(leaves) >= 44 and all(leaf.get("description") for leaf in leaves)
    assert "KIND[:FIELD=VALUE]" in definitions["FaultParams"]["properties"]["fail_at"]["description"]
    env = {**os.environ, "ETTFLOW_HOME": str(home), "PREFECT_API_URL": api,
           "PREFECT_UI_URL": f"http://127.0.0.1:{api_port}"}
    shown = ettflow(env, "report", "--run", run_id, "--format", "json", timeout=120)
    assert shown.returncode == 0, shown.stderr
    (row_shown,), _ = json.JSONDecoder().raw_decode(shown.stdout)  # the run table, then its components
    assert (row_shown["status"], row_shown["deployment"]) == ("completed", "refresh-scheduled")
    assert row_shown["capETT%"] == row_shown["ETT%"] and row_shown["held_s"] == 0  # beside the study's ETT
    assert row_shown["prefect_run"] == f"http://127.0.0.1:{api_port}/runs/flow-run/{run_id}"
