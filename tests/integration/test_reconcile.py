"""`ettflow archive` and the hooks on the real warehouse (SQLite and PostgreSQL, `warehouse_url`
in conftest): a SIGKILLed driver archived as crashed from its spool, a Prefect CRASHED run
recorded with its orchestrator failure, a row that waits out a warehouse outage and is then
written exactly once, and bad spool lines counted in the row."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
from sqlalchemy import make_url

from ettflow.cli import main
from ettflow.ett.archive import archive_or_defer, pending_file, read_pending
from ettflow.ett.heartbeat import RunHeartbeat, heartbeat_file, read_heartbeat
from ettflow.ett.sample import write_sample_run
from ettflow.ett.spool import read_spool, spool_file
from ettflow.ett.warehouse import COMPONENT_COLUMNS, RunInfo, Warehouse
from ettflow.tasks import archive as archive_hooks
from ettflow.tasks.reconcile import reconcile, reconcile_before_refresh

DRIVER = textwrap.dedent(
    """
    import sys, time
    from ettflow.ett.heartbeat import RunHeartbeat
    from ettflow.ett.spool import SpoolWriter
    root, run = sys.argv[1], sys.argv[2]
    RunHeartbeat(root, run, every_s=0.2, labels={"model": "m", "mode": "optimized", "world_size": 1}).__enter__()
    d = SpoolWriter(root, run, 0, -1)
    t = time.time()
    d.mark("submitted", t)
    d.record("scheduling", t, t + 0.05)
    d.record("device_init", t + 0.05, t + 0.1)
    w = SpoolWriter(root, run, 0, 0)
    i = 0
    while True:
        s = time.time()
        w.record("train_step", s, s + 0.001, sync=i % 2 == 0, cursor_start=i, cursor_end=i + 1)
        print(i, flush=True)
        i += 1
        time.sleep(0.01)
    """
)


def unreachable(url: str, tmp_path) -> str:
    """A URL of the same backend that refuses connections (a closed port, a missing folder)."""
    if make_url(url).get_backend_name() == "postgresql":
        return "postgresql+psycopg://postgres@127.0.0.1:1/ettflow"
    return f"sqlite:///{tmp_path / 'no-such-folder' / 'warehouse.db'}"


def row_of(url: str, run_id: str):
    with Warehouse.open(url) as wh:
        runs = wh.runs_frame(run_id=run_id)
        return (runs.iloc[0] if len(runs) else None), wh.table_frame("events", run_id), \
            wh.table_frame("failures", run_id)


def wait_for(predicate, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def archive_cli(*args: str) -> int:
    return main(["archive", *args])


def died_inside_its_heartbeat(spool, run_id: str, every_s: float = 0.2) -> None:
    """A heartbeat record without an end, as a process killed inside the block leaves it."""
    with RunHeartbeat(spool, run_id, every_s=every_s, labels={"model": "m", "mode": "baseline"}):
        pass
    path = heartbeat_file(spool, run_id)
    data = json.loads(path.read_text())
    del data["ended_at"], data["outcome"]
    path.write_text(json.dumps(data))


def test_a_sigkilled_driver_is_archived_as_crashed_once(warehouse_url, tmp_path, capsys):
    spool = tmp_path / "spool"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(spool), "run-k"], stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if int(line) >= 20:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # a refresh starting meanwhile leaves a live run alone (its heartbeat is within the bound)
    beat = read_heartbeat(spool, "run-k")
    assert [r.action for r in reconcile(spool, warehouse_url, now=beat.last_beat + 1)] == ["skipped"]
    assert wait_for(lambda: read_heartbeat(spool, "run-k").is_orphaned())
    beat = read_heartbeat(spool, "run-k")

    assert archive_cli("--pending", "--url", warehouse_url, "--spool", str(spool)) == 0
    assert "run run-k: archived (crashed)" in capsys.readouterr().out
    row, events, failures = row_of(warehouse_url, "run-k")
    assert row["status"] == "crashed" and row["nof"] == 1 and row["model"] == "m"
    assert list(failures["failure_class"]) == ["orchestrator"]
    assert failures.iloc[0]["failed_at"] == pytest.approx(beat.last_beat)
    assert row["wall_end"] == pytest.approx(beat.detection_at)  # the wall clock ends at detection
    assert abs(sum(row[c] for c in COMPONENT_COLUMNS) - row["wall_s"]) < 1e-3
    spooled = read_spool(spool, "run-k").events
    assert len(events) == len(spooled) and row["effective_steps"] >= 21  # every acknowledged step

    # again, by hand and at the next refresh's start: nothing changes
    assert archive_cli("--pending", "--url", warehouse_url, "--spool", str(spool)) == 0
    assert [r.action for r in reconcile_before_refresh(spool, warehouse_url, "another-run")] == ["skipped"]
    again, events2, failures2 = row_of(warehouse_url, "run-k")
    assert again["archived_at"] == row["archived_at"] and len(events2) == len(events) and len(failures2) == 1
    assert len(read_spool(spool, "run-k").events) == len(spooled)
    # named, it is archived again: the same row
    assert archive_cli("--run", "run-k", "--url", warehouse_url, "--spool", str(spool)) == 0
    third, _, _ = row_of(warehouse_url, "run-k")
    assert (third["status"], third["nof"], third["wall_s"]) == (row["status"], row["nof"], row["wall_s"])


def test_prefect_crashed_hook_records_an_orchestrator_failure(warehouse_url, tmp_path, monkeypatch):
    spool = tmp_path / "spool"
    write_sample_run(spool, "run-c", seed=4, fail_at_step=None, start=time.time() - 3000)
    died_inside_its_heartbeat(spool, "run-c")
    published = []
    monkeypatch.setattr(archive_hooks, "publish_artifacts", lambda *a: published.append(a))  # no Prefect API here
    flow_run = SimpleNamespace(id="run-c", parameters={"spool_root": str(spool), "warehouse_url": warehouse_url,
                                                       "model": "m", "mode": "baseline"},
                               deployment_id=None, run_count=1)
    crashed = SimpleNamespace(type=SimpleNamespace(value="CRASHED"), message="Flow run process exited")
    before = time.time()
    for _ in range(2):  # the hook may run twice (a worker and a server-side crash detection)
        archive_hooks.archive_on_flow_state(SimpleNamespace(name="refresh-model"), flow_run, crashed)
    row, events, failures = row_of(warehouse_url, "run-c")
    assert row["status"] == "crashed" and row["nof"] == 1 and list(failures["failure_class"]) == ["orchestrator"]
    marks = events[events["phase"].isin(["failure", "failure_detected"])]
    assert len(marks) == 2 and all(a["detection"] == "prefect_crashed" for a in marks["attrs"])
    assert failures.iloc[0]["failed_at"] == pytest.approx(read_heartbeat(spool, "run-c").last_beat)
    assert failures.iloc[0]["detected_at"] >= before and row["wall_end"] == failures.iloc[0]["detected_at"]
    assert abs(sum(row[c] for c in COMPONENT_COLUMNS) - row["wall_s"]) < 1e-3
    assert len(published) == 2 and published[0][1].metrics.nof == 1  # the timeline shows the failure
    # the heartbeat goes stale later: reconciliation finds the crash recorded and the row right
    stale = read_heartbeat(spool, "run-c").detection_at + 1
    assert [r.action for r in reconcile(spool, warehouse_url, now=stale)] == ["skipped"]


def test_a_row_waits_out_a_warehouse_outage_and_is_written_exactly_once(warehouse_url, tmp_path, caplog, capsys):
    spool = tmp_path / "spool"
    write_sample_run(spool, "run-p", seed=1)
    with RunHeartbeat(spool, "run-p", every_s=0.2):
        pass  # the flow's body ended; then its hook meets the outage
    down = unreachable(warehouse_url, tmp_path)
    params = {"spool_root": str(spool), "warehouse_url": down, "model": "m", "mode": "baseline"}
    with caplog.at_level(logging.WARNING, logger="ettflow.tasks"):
        result = archive_hooks.archive_run("run-p", params, status="completed", flow_run_id="run-p")
    assert result is not None and not result.archived and result.metrics.nof == 1
    assert "pending" in caplog.text and "ettflow archive --run run-p" in caplog.text
    mark = read_pending(spool, "run-p")
    assert mark.info.status == "completed" and mark.retry_command == "ettflow archive --run run-p"
    assert mark.warehouse == make_url(down).render_as_string(hide_password=True)
    # a URL's password never reaches the mark (nor the log)
    secret = "postgresql+psycopg://postgres:s3cret@127.0.0.1:1/ettflow"
    with caplog.at_level(logging.WARNING):
        assert archive_or_defer(secret, spool, mark.info).pending.warehouse.endswith(":***@127.0.0.1:1/ettflow")
    assert "s3cret" not in pending_file(spool, "run-p").read_text() and "s3cret" not in caplog.text
    # still down: nothing written, the mark stays, exit 2
    assert archive_cli("--pending", "--url", down, "--spool", str(spool)) == 2
    assert "cannot open the warehouse" in capsys.readouterr().err and pending_file(spool, "run-p").is_file()
    # back: written once, the mark removed; again: nothing to do
    assert archive_cli("--pending", "--url", warehouse_url, "--spool", str(spool)) == 0
    assert "run run-p: archived (completed)" in capsys.readouterr().out
    assert not pending_file(spool, "run-p").exists()
    row, events, _ = row_of(warehouse_url, "run-p")
    assert row["status"] == "completed" and row["nof"] == 1 and row["flow_run_id"] == "run-p"
    assert len(events) == len(read_spool(spool, "run-p").events)
    assert archive_cli("--pending", "--url", warehouse_url, "--spool", str(spool)) == 0
    assert "1 skipped" in capsys.readouterr().out
    again, events2, _ = row_of(warehouse_url, "run-p")
    assert again["archived_at"] == row["archived_at"] and len(events2) == len(events)


def test_torn_and_corrupt_spool_lines_are_counted_and_named_in_the_row(warehouse_url, tmp_path, caplog, capsys):
    spool = tmp_path / "spool"
    write_sample_run(spool, "run-t", seed=2)
    path = spool_file(spool, "run-t", 0, 0)
    lines = path.read_bytes().split(b"\n")
    lines[1] = b'{"run_id": "run-t", "attempt": 0, "ra'  # corrupt in the middle
    path.write_bytes(b"\n".join(lines[:-1]) + b"\n" + b'{"run_id": "run-t", "att')  # and a torn tail
    params = {"spool_root": str(spool), "warehouse_url": warehouse_url, "model": "m", "mode": "baseline"}
    with caplog.at_level(logging.INFO, logger="ettflow.tasks"):
        result = archive_hooks.archive_run("run-t", params, status="completed", flow_run_id="run-t")
    assert result.archived and len(result.problems) == 2
    assert f"2 spool problems: {path}:2 (corrupt line)" in caplog.text and "(torn last line)" in caplog.text
    row, _, _ = row_of(warehouse_url, "run-t")
    tags = row["tags"]
    assert tags["spool_problems"] == 2 and tags["spool_problem_lines"][0].startswith(f"{path}:2: corrupt line")
    assert archive_cli("--run", "run-t", "--url", warehouse_url, "--spool", str(spool)) == 0
    assert "2 spool problems" in capsys.readouterr().out


def test_which_runs_pending_looks_at(warehouse_url, tmp_path, capsys):
    spool = tmp_path / "spool"
    write_sample_run(spool, "no-heartbeat", seed=3)  # a bench job or a sample: only archived when named
    write_sample_run(spool, "live", seed=3)
    with RunHeartbeat(spool, "live", every_s=5.0):
        assert [(r.run_id, r.action) for r in reconcile(spool, warehouse_url)] == [("live", "skipped")]
        assert reconcile_before_refresh(spool, warehouse_url, "live") == []  # the refresh's own run
        # a warehouse that is down never fails the refresh that starts
        assert reconcile_before_refresh(spool, unreachable(warehouse_url, tmp_path), "other") == []
    assert archive_cli("--run", "no-heartbeat", "--url", warehouse_url, "--spool", str(spool)) == 0
    row, _, _ = row_of(warehouse_url, "no-heartbeat")
    assert row["status"] == "unknown" and row["nof"] == 1
    assert archive_cli("--run", "missing", "--url", warehouse_url, "--spool", str(spool)) == 1
    assert "no spool for run 'missing'" in capsys.readouterr().err


def test_a_body_that_died_of_a_base_exception_is_crashed_unless_a_hook_said_otherwise(warehouse_url, tmp_path):
    spool = tmp_path / "spool"
    for run_id in ("interrupted", "cancelled"):
        write_sample_run(spool, run_id, seed=5, fail_at_step=None)
        with pytest.raises(KeyboardInterrupt), RunHeartbeat(spool, run_id, every_s=0.2):
            raise KeyboardInterrupt  # a signal in the flow's process: it ends "crashed"
    params = {"spool_root": str(spool), "warehouse_url": warehouse_url, "model": "m", "mode": "baseline"}
    assert archive_hooks.archive_run("cancelled", params, status="cancelled", flow_run_id="cancelled").archived
    done = {r.run_id: r for r in reconcile(spool, warehouse_url)}
    assert (done["interrupted"].action, done["interrupted"].status) == ("archived", "crashed")
    assert (done["cancelled"].action, done["cancelled"].status) == ("skipped", "cancelled")
    crashed, _, failures = row_of(warehouse_url, "interrupted")
    assert crashed["nof"] == 1 and list(failures["failure_class"]) == ["orchestrator"]
    cancelled, _, failures = row_of(warehouse_url, "cancelled")
    assert cancelled["status"] == "cancelled" and cancelled["nof"] == 0 and failures.empty


def test_a_skipped_run_killed_before_its_heartbeat_was_forgotten_stays_skipped(warehouse_url, tmp_path):
    """A skipped refresh archives its own row (`skipped`) and forgets its heartbeat as its block
    ends; killed in between (or before its row), its record is left without an end. It reserved
    and trained nothing and holds no claim: the next reconciliation archives it as skipped,
    never as a crashed run with an orchestrator failure (before: `crashed`, NoF 1)."""
    from ettflow.ett.lineage import Outcome
    from ettflow.tasks.run_spool import RunRecorder
    from ettflow.tasks.skipped import SKIP_STAGE

    spool = tmp_path / "spool"
    t = time.time() - 60
    for run_id in ("skip-a", "skip-b"):
        RunRecorder(spool, run_id).record(0, "scheduling", t, t + 1.5, stage=SKIP_STAGE,
                                          outcome=Outcome.SKIPPED.value, reason="nothing new to train for model m")
        died_inside_its_heartbeat(spool, run_id)
    # skip-b's own row was written before the kill (the body's `finish_run`), skip-a's never was
    archive_hooks.archive_run("skip-b", {"spool_root": str(spool), "warehouse_url": warehouse_url, "model": "m"},
                              status="completed")
    # skip-c's body raised after its skip (its heartbeat ended failed) and wrote no row
    RunRecorder(spool, "skip-c").record(0, "scheduling", t, t + 1.5, stage=SKIP_STAGE,
                                        outcome=Outcome.SKIPPED.value, reason="nothing new to train for model m")
    with pytest.raises(RuntimeError), RunHeartbeat(spool, "skip-c", every_s=0.2, labels={"model": "m"}):
        raise RuntimeError("the body failed after its skip")
    assert wait_for(lambda: all(read_heartbeat(spool, r).is_orphaned() for r in ("skip-a", "skip-b")))
    done = {r.run_id: r for r in reconcile(spool, warehouse_url)}
    assert {r: d.status for r, d in done.items()} == {"skip-a": "skipped", "skip-b": "skipped",
                                                      "skip-c": "skipped"}, done
    again = {r.run_id: r.action for r in reconcile(spool, warehouse_url)}
    assert again == {"skip-a": "skipped", "skip-b": "skipped", "skip-c": "skipped"}  # up to date: not archived again
    for run_id in ("skip-a", "skip-b", "skip-c"):
        row, _events, failures = row_of(warehouse_url, run_id)
        assert row["status"] == "skipped" and row["nof"] == 0 and failures.empty, run_id
        assert not [e for e in read_spool(spool, run_id).events if e.phase in ("failure", "failure_detected")]


def test_a_run_that_spooled_only_work_off_the_clock_is_archived_as_no_row_not_an_error(warehouse_url, tmp_path,
                                                                                       caplog):
    """A refresh that publishes a stopped run's anchor trains nothing (no ETT row by design); when
    its publish task fails, the task's hook archives the run as it stands: its spool holds only the
    publish try, off the clock. Before, the hook raised "no on-clock events" inside Prefect's hook
    runner (an error and its traceback in the run's log); now it archives nothing, quietly."""
    from ettflow.ett.spool import SpoolWriter

    spool = tmp_path / "spool"
    with SpoolWriter(spool, "reused", 0, -1) as rec:
        rec.record("publish_standalone", time.time() - 3, time.time() - 2, outcome="failed", failure_class="publish",
                   error="OSError: disk full")
    params = {"spool_root": str(spool), "warehouse_url": warehouse_url, "model": "m"}
    with caplog.at_level(logging.INFO, logger="ettflow.tasks"):
        assert archive_hooks.archive_run("reused", params, status="publish-snapshot failed") is None
    assert "spooled only work off the clock (publish_standalone): no ETT row" in caplog.text
    row, _events, _failures = row_of(warehouse_url, "reused")
    assert row is None


def ended_an_hour_ago(spool, run_id: str) -> None:
    """A finished run's record, its end and its files' last writes moved an hour back (the
    settle rule's age)."""
    path = heartbeat_file(spool, run_id)
    data = json.loads(path.read_text())
    data["ended_at"] -= 3600
    path.write_text(json.dumps(data))
    for f in (spool / run_id).iterdir():
        os.utime(f, (data["ended_at"], data["ended_at"]))


def test_a_refresh_never_reads_a_settled_run_until_something_writes_to_it(warehouse_url, tmp_path):
    """Every refresh reconciles its spool on its clock: a run whose row was found right an age
    after its end is settled for that warehouse and costs later refreshes no file read (before:
    every run the spool ever held, read at every refresh). Whatever may change its row takes it
    out again: a flow retry that reopens it (here killed inside its heartbeat), a late writer, a
    pending mark; another warehouse still gets every run. What the invariant cannot see (a line
    appended by a writer killed before its close) is found by the settled runs a refresh
    re-checks."""
    from ettflow.ett.archive import write_pending
    from ettflow.ett.settled import settled_runs
    from ettflow.ett.spool import SpoolWriter
    from ettflow.tasks.reconcile import warehouse_key

    spool = tmp_path / "spool"
    for run_id in ("old", "late", "marked", "recent"):
        write_sample_run(spool, run_id, seed=6, fail_at_step=None, start=time.time() - 7200)
        with RunHeartbeat(spool, run_id, every_s=0.2, labels={"model": "m", "mode": "optimized"}):
            pass
        if run_id != "recent":
            ended_an_hour_ago(spool, run_id)

    def refresh(recheck: int = 0) -> dict[str, str]:
        return {r.run_id: r.note for r in reconcile_before_refresh(spool, warehouse_url, "new-run", recheck=recheck)}

    assert set(refresh()) == {"old", "late", "marked", "recent"}  # archived: their rows were missing
    # settling costs a file a run: a refresh settles SETTLE_PER_REFRESH at most (here 1 of 3)
    assert [r.run_id for r in reconcile(spool, warehouse_url, settle_limit=1) if r.indexed] == ["late"]
    second = refresh()
    assert {r for r, note in second.items() if note.endswith("(settled)")} == {"old", "marked"}
    assert second["recent"] == "its row is up to date"  # ended a moment ago: read again next time
    assert set(refresh()) == {"recent"}  # the settled ones are not read
    assert settled_runs(spool, warehouse_key(warehouse_url)) == {"old", "late", "marked"}

    died_inside_its_heartbeat(spool, "old")  # a flow retry reopened it and was killed
    with SpoolWriter(spool, "late", 0, 0) as w:  # a late rank's line
        w.record("train_step", time.time() - 5, time.time() - 4, step=600, cursor_start=600, cursor_end=601)
    write_pending(spool, RunInfo(run_id="marked", model="m", mode="optimized", status="completed"), "down")
    assert settled_runs(spool, warehouse_key(warehouse_url)) == frozenset()
    done = {r.run_id: r for r in reconcile(spool, warehouse_url, now=time.time() + 60,
                                           settled=settled_runs(spool, warehouse_key(warehouse_url)))}
    assert set(done) == {"old", "late", "marked", "recent"}  # all read again
    assert done["late"].action == "archived" and done["marked"].action == "archived"
    late, _events, _failures = row_of(warehouse_url, "late")
    assert late["tags"]["spool_bytes"] == sum(p.stat().st_size for p in (spool / "late").glob("*.jsonl"))

    # a line appended behind the index's back (its writer killed before its close): not seen by a
    # refresh that re-checks none, found by one that re-checks the settled runs
    ended_an_hour_ago(spool, "late")
    refresh()
    assert "late" in settled_runs(spool, warehouse_key(warehouse_url))
    with open(spool / "late" / "attempt-000.rank-0.jsonl", "ab") as f:
        f.write(b'{"torn": \n')
    assert "late" not in refresh()
    assert refresh(recheck=10)["late"] == "row missing or stale"
    again, _events, _failures = row_of(warehouse_url, "late")
    assert again["tags"]["spool_bytes"] == sum(p.stat().st_size for p in (spool / "late").glob("*.jsonl"))

    # a row another process writes between the judgement and the entry (its unsettle came first)
    from ettflow.ett.settled import fingerprint, settle
    from ettflow.tasks import reconcile as rc

    key = warehouse_key(warehouse_url)
    judged_rows = rc._rows(warehouse_url, ["recent"])
    archive_hooks.archive_run("recent", {"spool_root": str(spool), "warehouse_url": warehouse_url, "model": "m"},
                              status="failed", flow_run_id="recent")
    assert settle(spool, "recent", key, fingerprint(spool, "recent"))
    judged = [rc.Reconciled("recent", "skipped", "its row is up to date (settled)", "completed", indexed=True)]
    kept = rc._rows_unchanged(spool, warehouse_url, judged_rows, judged)
    assert not kept[0].indexed and "recent" not in settled_runs(spool, key)

    # another warehouse (a team's new one) gets every run's row, settled for the first or not
    ended_an_hour_ago(spool, "late")
    refresh()
    assert "late" in settled_runs(spool, key)
    other = f"sqlite:///{tmp_path / 'other.db'}"
    archived = {r.run_id for r in reconcile_before_refresh(spool, other, "new-run") if r.action == "archived"}
    assert {"late", "marked", "recent"} <= archived  # "old", reopened a moment ago, may still count as live


def test_a_reconciliation_that_fails_midway_takes_back_what_it_settled(warehouse_url, tmp_path, monkeypatch):
    """Its rows were not read again after settling (`_rows_unchanged`): the entries go. An entry
    whose run folder was removed is dropped when a refresh draws it for a re-check."""
    import shutil

    from ettflow.ett.settled import settled_runs
    from ettflow.tasks import reconcile as rc

    spool = tmp_path / "spool"
    for run_id in ("a", "b"):
        write_sample_run(spool, run_id, seed=7, fail_at_step=None, start=time.time() - 7200)
        with RunHeartbeat(spool, run_id, every_s=0.2, labels={"model": "m", "mode": "optimized"}):
            pass
        ended_an_hour_ago(spool, run_id)
    assert {r.action for r in rc.reconcile(spool, warehouse_url)} == {"archived"}
    key = rc.warehouse_key(warehouse_url)
    real = rc.reconcile_run

    def fails_on_b(spool_root, url, run_id, *args, **kwargs):
        if run_id == "b":
            raise RuntimeError("the spool's disk went away")
        return real(spool_root, url, run_id, *args, **kwargs)

    monkeypatch.setattr(rc, "reconcile_run", fails_on_b)
    with pytest.raises(RuntimeError, match="went away"):
        rc.reconcile(spool, warehouse_url)
    assert settled_runs(spool, key) == frozenset()  # "a" was settled before "b" failed: taken back
    monkeypatch.setattr(rc, "reconcile_run", real)
    assert [r.run_id for r in rc.reconcile(spool, warehouse_url) if r.indexed] == ["a", "b"]
    shutil.rmtree(spool / "a")
    rc.reconcile_before_refresh(spool, warehouse_url, "new-run", recheck=10)
    assert settled_runs(spool, key) == {"b"}
