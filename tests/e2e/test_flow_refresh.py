"""`refresh_model` end to end on the real stack (Prefect test harness, Ray, TorchRec, the
warehouse), tiny sizes: a SIGKILL and its recovery (compiled, from the session's compile
cache), a publish failure retried without retraining, a flow retry that does not retrain, and
hooks that archive idempotently."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ettflow.ett.warehouse import COMPONENT_COLUMNS, Warehouse
from ettflow.flows.refresh import refresh_model
from ettflow.tasks import run_spool
from ettflow.tasks.archive import archive_on_flow_state
from ettflow.tasks.run_spool import RunRecorder
from ettflow.trainer.data.windows import list_windows

from helpers.flows import PLAIN, flow_env, run
from helpers.spool import events as spooled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 60  # 2 windows x 1920 rows / (2 ranks x 32)


@pytest.fixture(scope="module")
def env(tmp_path_factory, flow_data, flow_work_root, compile_cache, prefect_harness):
    # every run here refreshes the same 2 windows of one model from scratch (explicit windows win over
    # the watermark: no run is skipped); continuous refresh is tested in its own file
    return flow_env(tmp_path_factory.mktemp("refresh"), flow_data, flow_work_root, checkpoint_every_steps=10,
                    windows=list_windows(flow_data)[:2], warm_start=False)


def client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def artifacts_of(flow_run_id: str) -> dict[str, list]:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    only = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
    with client() as c:
        found = c.read_artifacts(artifact_filter=only)
    out: dict[str, list] = {}
    for a in found:
        out.setdefault(a.key or a.type, []).append(a)
    return out


def task_runs_of(flow_run_id: str, prefix: str) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client() as c:
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return [r for r in runs if r.name.startswith(prefix)]


def warehouse_run(env, run_id):
    with Warehouse.open(env["warehouse_url"]) as wh:
        return wh.runs_frame(run_id=run_id), wh.table_frame("events", run_id)


def events_of(env, run_id):
    return spooled(env["spool_root"], run_id)


LOAD_WITHOUT_TRAINING_CODE = """
import importlib.abc, json, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('ettflow', 'torchrec'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import torch, fbgemm_gpu
folder = sys.argv[1]
sig = json.load(open(folder + '/manifest.json'))['signature']
m = torch.jit.load(folder + '/model.pt')
B = 4
dense = torch.randn(B, len(sig['dense']['columns']))
values = torch.cat([torch.randint(0, f['num_embeddings'], (B,)) for f in sig['sparse']])
lengths = torch.ones(len(sig['sparse']) * B, dtype=torch.int32)
p = m(dense, values, lengths)
assert p.shape == (B,) and bool(((p >= 0) & (p <= 1)).all()), p
print('OK', sorted(k for k in sys.modules if k.startswith(('ettflow', 'torchrec'))))
"""


@pytest.fixture(scope="module")
def killed(env):
    state, run_id = run(env, fail_at=["kill:rank=1:step=30"])
    return state, run_id


def test_refresh_recovers_from_a_sigkill(env, killed):
    state, run_id = killed
    assert state.is_completed(), state.message
    # the run tells its ETT: the state message, its name (windows) and tags, through the API
    assert re.fullmatch(r"ETT \d+\.\d% · NoF 1 · TTS \d+\.\d s · infrastructure: .*rank 1.*step 30.*",
                        state.message), state.message
    with client() as c:
        fr = c.read_flow_run(run_id)
    first, last = (w.removeprefix("window=") for w in (env["windows"][0], env["windows"][-1]))
    assert fr.name == f"dlrm-optimized {first}..{last} (2) · {state.message.split(' · ')[0]}"  # ETT in the list
    assert {"model:dlrm", "mode:optimized", "failures:1", "outcome:published"} <= set(fr.tags), fr.tags
    # the log names the failure that ended attempt 0 in ettflow's words, Ray's detail after
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    with client() as c:
        logs = [log.message for log in c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))]
    ended = [m for m in logs if m.startswith("attempt 0 ended with an infrastructure failure: ")]
    assert ended and "(rank 1, step 30)" in ended[0], logs
    runs, events = warehouse_run(env, run_id)
    assert len(runs) == 1
    row = runs.iloc[0]
    assert row["flow_run_id"] == run_id and row["status"] == "completed" and row["nof"] == 1
    assert abs(sum(row[c] for c in COMPONENT_COLUMNS) - row["wall_s"]) < 1e-3
    assert row["effective_steps"] == 2 * STEPS and row["started_training"]
    assert len(events) == len(events_of(env, run_id))
    # the queueing before the first attempt and the release after training are on the clock; the
    # run publishes on the CPU, so its devices go back at the driver's teardown (the shutdown ends
    # there) and nothing holds them through the anchor and release tasks
    evs = events_of(env, run_id)
    assert any(e.phase == "scheduling" and e.attrs.get("stage") == "reserve_trainer" for e in evs)
    shutdowns = [e for e in evs if e.phase == "shutdown" and e.attempt == 1]
    assert [e.attrs.get("stage") for e in shutdowns] == [None], [e.attrs for e in shutdowns]
    assert run_spool.training_attempts(evs) == [0, 1]
    # it compiled from the session's compile-cache archive (conftest `compile_cache`): no cold compile
    restores = [e for e in evs if e.phase == "compile_cache_restore" and e.attempt == 0]
    assert len(restores) == 2 and all(e.attrs["hit"] for e in restores), restores


def test_the_snapshot_validates_and_loads_without_the_training_code(env, killed):
    from ettflow.publish import verify_snapshot

    state, run_id = killed
    folder = state.result()["snapshot"]
    manifest = verify_snapshot(folder)
    assert manifest.run_id == run_id and manifest.step == STEPS and manifest.validation["passed"]
    out = subprocess.run([sys.executable, "-I", "-c", LOAD_WITHOUT_TRAINING_CODE, folder],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK []" in out.stdout, out.stderr[-2000:]


def test_the_flow_run_shows_its_artifacts(env, killed):
    _, run_id = killed
    found = artifacts_of(run_id)
    assert {"ett-refresh-model", "ett-timeline-refresh-model", "snapshot-refresh-model",
            "training-progress-refresh-model"} <= set(found)
    table = json.loads(found["ett-refresh-model"][0].data)
    assert {r["metric"] for r in table} >= {"ETT %", "NoF", "effective_training", "unattributed"}
    assert "data:image/png;base64," in found["ett-timeline-refresh-model"][0].data
    # the body finished the run: its completion hook attached nothing again
    assert {k: len(v) for k, v in found.items()} == dict.fromkeys(found, 1)
    # one progress artifact for the run, through its restart, ending at the final state
    (progress,) = found["training-progress-refresh-model"]
    assert progress.data == 100.0 and progress.description.startswith("Completed · ETT "), progress.description
    snapshot = found["snapshot-refresh-model"][0].data  # the manifest, not a file:// link
    assert "file://" not in snapshot and f"| step | {STEPS} |" in snapshot and "| manifest.json sha256 | `" in snapshot
    for key in ("ett-refresh-model", "ett-timeline-refresh-model", "snapshot-refresh-model"):
        assert re.match(r"ETT \d+\.\d% · NoF 1 · Completed · ", found[key][0].description), found[key][0].description


def test_a_crash_hook_in_another_thread_archives_and_attaches_by_id(env, killed):
    """As a worker runs on_crashed: no run context, a stale flow run read from the API. The
    run is archived again (one copy, new status) and its artifacts go to that flow run."""
    from prefect.states import Crashed

    _, run_id = killed
    with client() as c:
        stale = c.read_flow_run(run_id)
    before = sum(len(v) for v in artifacts_of(run_id).values())
    errors = []

    def crash_hook():
        try:
            archive_on_flow_state(refresh_model, stale, Crashed(message="process killed"))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=crash_hook)
    thread.start()
    thread.join()
    assert errors == []
    runs, events = warehouse_run(env, run_id)
    assert len(runs) == 1 and runs.iloc[0]["status"] == "crashed"
    assert len(events) == len(events_of(env, run_id))
    assert sum(len(v) for v in artifacts_of(run_id).values()) == before + 3
    # the crashed state tells the ETT too: a new CRASHED state carries the message (orchestrator failure counted)
    with client() as c:
        fr = c.read_flow_run(run_id)
    assert fr.state.type.value == "CRASHED", fr.state
    # its reason once: the orchestrator failure ("Prefect marked the flow run CRASHED: process killed")
    # repeats the outcome's and is not named again (issue 27)
    assert re.fullmatch(r"ETT \d+\.\d% · NoF 2 · TTS \d+\.\d s · crashed: process killed · "
                        r"infrastructure: [^;]*", fr.state.message), fr.state.message
    assert "outcome:crashed" in fr.tags and "failures:2" in fr.tags


def test_publish_failure_is_retried_without_retraining(env):
    """In-trainer publishing (the baseline's way) fails once, is retried by its task, and
    the trainer's events show one training; the publish time is shutdown, on the clock."""
    state, run_id = run(env, fail_at=["publish:times=1"], switches={**PLAIN, "publish_in_trainer": True})
    assert state.is_completed(), state.message
    evs = events_of(env, run_id)
    assert run_spool.training_attempts(evs) == [0] and [e.phase for e in evs].count("submitted") == 1
    (train,) = task_runs_of(run_id, "train")
    assert train.run_count == 1
    (pub,) = task_runs_of(run_id, "publish-snapshot")
    assert pub.run_count == 2
    tries = run_spool.publish_records(evs)
    assert [(e.phase, e.attrs["outcome"]) for e in tries] == [("publish", "failed"), ("publish", "published")]
    assert tries[0].attrs["failure_class"] == "publish"
    runs, _ = warehouse_run(env, run_id)
    row = runs.iloc[0]
    assert row["nof"] == 1 and row["tags"]["publish_failures"] == 1 and row["tags"]["publish_phase"] == "publish"
    assert row["wall_end"] >= tries[-1].end  # publishing held the devices: inside the wall clock
    held = [e for e in evs if e.phase == "shutdown" and e.attrs.get("stage") == "release_trainer"]
    assert len(held) == 1 and held[0].end >= tries[-1].end  # the lease held them until its release task
    with Warehouse.open(env["warehouse_url"]) as wh:
        comp = wh.components_frame(run_id).set_index("name")
        (failure,) = wh.table_frame("failures", run_id).itertuples()
    # the failed try is a publish failure in NoF (issue 26 #7), recovered by the retry: its TTR is
    # the retry's wait, on the clock (the devices were held)
    assert failure.failure_class == "publish" and failure.recovered and "injected publish failure" in failure.reason
    assert failure.ttr_s == pytest.approx(tries[1].start - tries[0].end, abs=1e-6)
    assert comp.loc["publish", "raw_s"] >= tries[-1].duration * 0.99


def test_a_flow_retry_does_not_retrain_and_archives_once(env):
    """Publishing fails past its task retries: the flow fails and is retried; the retry finds
    the anchor checkpoint and publishes it. One training, one archived copy."""
    retrying = refresh_model.with_options(retries=1, retry_delay_seconds=0)
    state, run_id = run(env, flow=retrying, fail_at=["publish:times=3"], max_steps=20, switches=PLAIN)
    assert state.is_completed(), state.message
    with client() as c:
        assert c.read_flow_run(run_id).run_count == 2
    evs = events_of(env, run_id)
    assert run_spool.training_attempts(evs) == [0] and [e.phase for e in evs].count("submitted") == 1
    assert len([e for e in evs if e.phase == "anchor_checkpoint"]) == 2  # one per rank, once
    assert len(task_runs_of(run_id, "train")) == 2  # the retry ran the task, which trained nothing
    runs, events = warehouse_run(env, run_id)
    assert len(runs) == 1 and runs.iloc[0]["status"] == "completed" and runs.iloc[0]["effective_steps"] == 40
    assert runs.iloc[0]["tags"]["publish_failures"] == 3 and len(events) == len(evs)


def test_a_refresh_stopped_after_sealing_its_anchor_is_published_by_the_next_not_retrained(
        flow_data, flow_work_root, compile_cache, tmp_path):
    """Issue 42 #2: publishing fails past its retries (as when `ettflow down` or a cancel stops a
    run while it publishes): the run fails with its anchor sealed, and its lineage record names
    the anchor. The next refresh of the same windows from the same parent verifies that anchor
    and publishes it: nothing reserved or trained, no ETT row of its own, the watermark moves."""
    from ettflow.ett.lineage import Outcome

    own = flow_env(tmp_path, flow_data, flow_work_root, checkpoint_every_steps=10, max_steps=20,
                   windows=list_windows(flow_data)[:2], warm_start=False, switches=PLAIN)
    state, first = run(own, fail_at=["publish:times=3"])
    assert state.is_failed(), state.message
    lost, thief = _loses_its_claims_while_it_publishes(own, first)
    state, second = run(own)
    assert state.is_completed(), state.message
    assert state.message.startswith(f"published the anchor of run {first}, which trained these windows"), \
        state.message
    assert state.result()["reused_from"] == first
    evs = RunRecorder(own["spool_root"], second).events()
    assert not [e for e in evs if e.phase in ("submitted", "scheduling", "train_step")]  # nothing reserved or trained
    with Warehouse.open(own["warehouse_url"]) as wh:
        stopped, reused = ([r for r in wh.lineage("dlrm") if r.run_id == rid] for rid in (first, second))
        assert wh.runs_frame(run_id=second).empty and len(wh.runs_frame(run_id=first)) == 1
    (stopped,), (reused,) = stopped, reused
    assert stopped.outcome is Outcome.FAILED and stopped.anchor and "injected publish failure" in stopped.reason
    assert (reused.outcome, reused.anchor, reused.windows) == (Outcome.PUBLISHED, stopped.anchor, stopped.windows)
    assert reused.snapshot and Path(reused.snapshot).name == second
    assert lost.outcome is Outcome.FAILED and thief not in (r.run_id for r in wh_lineage(own))


def wh_lineage(env):
    with Warehouse.open(env["warehouse_url"]) as wh:
        return wh.lineage("dlrm")


def _loses_its_claims_while_it_publishes(env, stopped: str):
    """A refresh of the stopped run's windows that loses its claims while it publishes that
    anchor (as one taken for dead while it stood still: its claims settled from outside it, and
    another refresh's taken) ends failed: the model's `current` does not move to its snapshot,
    its lineage is not PUBLISHED, the other refresh's claims stay. Returns its lineage record and
    the other refresh's run id (its claims released again, as when it ends)."""
    import time

    from sqlalchemy import select

    from ettflow.ett import lineage
    from ettflow.ett.warehouse_models import WindowClaim
    from ettflow.publish import read_current

    ended = {}
    # with a flow retry (Prefect retries a failed run while it has retries): the retry must not find
    # the windows held, skip, and archive the run as skipped; it ends failed at once
    retried = refresh_model.with_options(retries=1, retry_delay_seconds=0)
    thread = threading.Thread(target=lambda: ended.update(zip(("state", "run_id"), run(
        env, retried, fail_at=["publish:slow_s=3"]))))
    thread.start()
    with Warehouse.open(env["warehouse_url"]) as wh:
        def claims():
            with wh.engine.connect() as conn:
                return conn.execute(select(WindowClaim)).all()

        deadline = time.monotonic() + 300
        while not (held := claims()):
            assert thread.is_alive() and time.monotonic() < deadline, ended
            time.sleep(0.05)
        (holder,) = {c.run_id for c in held}
        windows = tuple(sorted(c.window for c in held))
        lineage.settle_ended_run(wh, "dlrm", holder, "crashed", reason="its heartbeat stopped (it stood still)")
        assert not isinstance(lineage.claim_windows(wh, "dlrm", "thief", lambda mark, parent: (windows, None)),
                              lineage.Busy)
        thread.join()
        state = ended["state"]
        assert state.is_failed() and "no longer holds its claims" in state.message, state.message
        assert "run thief holds windows" in state.message, state.message
        assert read_current(Path(env["snapshot_root"])) is None  # its snapshot (the model's first) is not current
        [record] = [r for r in wh.lineage("dlrm") if r.run_id == holder]
        assert lineage.release_claims(wh, "dlrm", "thief") == len(windows)
        assert wh.runs_frame(run_id=holder).empty  # it trained nothing (a stopped run's anchor): no ETT row
    assert record.reason.startswith(f"ClaimsLost: run {holder} no longer holds its claims")
    # its publish try was withdrawn, not a failure of its own: the loss of its claims is whoever's took them
    evs = RunRecorder(env["spool_root"], holder).events()
    tries = run_spool.publish_records(evs)
    assert [t.info.outcome for t in tries] == ["withdrawn"], tries
    assert "an earlier try of this run lost its window claims" in state.message, state.message
    assert run_spool.claims_lost(evs).startswith(f"run {holder} no longer holds its claims")
    assert not [e for e in evs if e.phase == "scheduling" and e.attrs.get("outcome") == "skipped"]
    return record, "thief"


def test_a_bad_parameter_fails_the_run_at_once(env):
    state, run_id = run(env, fail_at=["kill:rank=5:step=3"])
    assert state.is_failed() and "parameter 'fail_at'" in state.message
    assert RunRecorder(env["spool_root"], run_id).events() == []
    assert task_runs_of(run_id, "") == []


def test_a_task_failure_hook_archives_the_run(env, tmp_path):
    from prefect import flow, task

    from ettflow.ett.sample import write_sample_run
    from ettflow.tasks.archive import archive_on_task_state

    @task(name="boom", on_failure=[archive_on_task_state])
    def boom():
        raise RuntimeError("user code failed")

    @flow(name="hooked")
    def hooked(spool_root: str, warehouse_url: str, model: str = "hooked"):
        from prefect.runtime import flow_run

        write_sample_run(spool_root, flow_run.id, seed=4)
        boom()

    state = hooked(str(tmp_path), env["warehouse_url"], return_state=True)
    run_id = str(state.state_details.flow_run_id)
    assert state.is_failed()
    runs, _ = warehouse_run(env, run_id)
    assert len(runs) == 1 and runs.iloc[0]["status"] == "boom failed" and runs.iloc[0]["model"] == "hooked"


def test_the_command_names_a_bad_parameter(env):
    import argparse

    from ettflow.flows import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["refresh", "--world-size", "0", "--param", f"spool_root={env['spool_root']}",
                              "--warehouse-url", env["warehouse_url"]])
    from ettflow.tasks.errors import ParameterError

    with pytest.raises(ParameterError, match="parameter 'world_size' must be >= 1, got 0"):  # before any run
        args.func(args)
