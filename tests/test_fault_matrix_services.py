"""Issue 9's fault matrix, the cases that need real services (slow; run under the e2e lock):

- case 3, a deployed run whose flow process is SIGKILLed mid-training (a real `prefect server`,
  a process worker, the session's Ray): Prefect marks it CRASHED, `on_crashed` records an
  `orchestrator` failure in the row, closes the task runs it left open, and the trainer actors
  die with their owner;
- case 4, PostgreSQL refusing connections mid-run (reached through a TCP proxy the test closes
  once training runs): `ettflow refresh` publishes, exits 0 with a warning, the row waits as
  pending, and `ettflow archive --pending` writes it exactly once when PostgreSQL is back.

Each asserts the outcome and its message, that every spooled event is in the warehouse, the
row (status, NoF, failure class, components summing to wall), and that no trainer process of
the run is left. Measured times are printed (`pytest -s`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from processes import alive, describe, processes_of, trainer_actors
from sqlalchemy import create_engine, text

from ettflow.ett.archive import read_pending
from ettflow.ett.spool import read_spool
from ettflow.ett.warehouse import COMPONENT_COLUMNS, Warehouse

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore"), pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))
TINY = {"embedding_dim": 8, "dense_arch": [16, 8], "over_arch": [16, 1]}
START_S = 240.0  # a cold start on a busy 2-core machine (worker, flow process, trainer init)
BOUND_S = 60.0  # kill -> CRASHED, the row, the actors gone


# ---- helpers ---------------------------------------------------------------------------------


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


def training_started(run_spool: Path) -> bool:
    for path in run_spool.glob("*.jsonl"):
        try:
            if '"train_step"' in path.read_text():
                return True
        except OSError:
            continue
    return False


def say(capsys, message: str) -> None:
    """Print past pytest's capture (measured times, for the reliability table)."""
    with capsys.disabled():
        print(f"\n{message}", flush=True)


def row_of(url: str, run_id: str):
    with Warehouse.open(url) as wh:
        runs = wh.runs_frame(run_id=run_id)
        return (runs.iloc[0] if len(runs) else None), wh.table_frame("events", run_id), \
            wh.table_frame("failures", run_id)


def assert_components_sum_to_wall(row) -> None:
    assert abs(sum(row[c] for c in COMPONENT_COLUMNS) - row["wall_s"]) < 1e-3, \
        {c: row[c] for c in (*COMPONENT_COLUMNS, "wall_s")}


# ---- case 3: a crashed deployed run ------------------------------------------------------------


def prefect(env: dict, *args: str, timeout: float = 300) -> str:
    out = subprocess.run([PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"prefect {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


def flow_run_process(worker: psutil.Process, flow_run_id: str) -> psutil.Process | None:
    """The worker's child that runs the flow run: the topmost descendant whose environment
    names the flow run (Prefect passes PREFECT__FLOW_RUN_ID to it)."""
    runs = []
    for p in worker.children(recursive=True):
        try:
            if p.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id:
                runs.append(p)
        except psutil.Error:
            continue
    pids = {p.pid for p in runs}
    top = [p for p in runs if p.ppid() not in pids]
    return top[0] if top else None


def api_state(api: str, flow_run_id: str) -> dict:
    return httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()


def task_runs(api: str, flow_run_id: str) -> list[dict]:
    body = {"task_runs": {"flow_run_id": {"any_": [flow_run_id]}}}
    return httpx.post(f"{api}/task_runs/filter", json=body, timeout=10).json()


def test_a_killed_deployed_flow_run_is_crashed_with_an_orchestrator_failure(
        prefect_server, tmp_path, flow_data, flow_work_root):
    env, api = prefect_server  # conftest: the server, with prefect.yaml's work pool created
    shutil.copy(REPO / "prefect.yaml", tmp_path / "prefect.yaml")
    prefect(env, "--no-prompt", "deploy", "--all", "--prefect-file", str(tmp_path / "prefect.yaml"))
    warehouse, spool = f"sqlite:///{tmp_path / 'warehouse.db'}", tmp_path / "spool"
    params = {"data_root": str(flow_data), "architecture": TINY, "max_embeddings": 100, "world_size": 2,
              "batch_size": 32, "max_steps": 60, "checkpoint_every_steps": 10, "eval_batches": 2,
              "switches": {"compile": False}, "work_root": str(flow_work_root),
              "snapshot_root": str(tmp_path / "snapshots"), "spool_root": str(spool), "warehouse_url": warehouse}
    out = prefect(env, "deployment", "run", "refresh-model/refresh-adhoc", "--params", json.dumps(params))
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
    # the flow process starts (and owns) its own local Ray, as on a worker without RAY_ADDRESS;
    # every process it starts inherits ETTFLOW_HOME, which finds them afterwards
    home = tmp_path / "home"
    worker_env = {**{k: v for k, v in env.items() if k != "RAY_ADDRESS"}, "ETTFLOW_HOME": str(home)}
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115 - closed below
    worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "ettflow-process", "--type", "process",
                               "--run-once", "--limit", "1"], env=worker_env, cwd=REPO, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: training_started(spool / flow_run_id) or worker.poll() is not None, START_S,
                 "the deployed run to start training")
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-4000:]
        target = wait_for(lambda: flow_run_process(psutil.Process(worker.pid), flow_run_id), 10,
                          "the worker's flow-run process")
        actors = wait_for(trainer_actors, 30, "the trainer actors")
        started = [p for p in processes_of(home) if p.pid != worker.pid]  # the flow process, its Ray
        assert any("raylet" in " ".join(p.cmdline()) for p in started), describe(started)
        assert api_state(api, flow_run_id)["state_type"] == "RUNNING"

        killed = time.monotonic()
        os.kill(target.pid, signal.SIGKILL)
        crashed = wait_for(lambda: api_state(api, flow_run_id)["state_type"] == "CRASHED" and time.monotonic(),
                           BOUND_S, "the flow run to be CRASHED", poll_s=0.05)
        actors_gone = wait_for(lambda: not alive(actors) and time.monotonic(), BOUND_S,
                               "the trainer actors to die with their flow process")
        ray_gone = wait_for(lambda: not [p for p in alive(started) + processes_of(home) if p.pid != worker.pid]
                            and time.monotonic(), BOUND_S, "the flow process's Ray to stop")
        worker.wait(timeout=BOUND_S)  # --run-once: it exits once the crash is handled (hooks included)
        archived = time.monotonic()
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        log.close()
    print(f"\ncase 3: kill -> CRASHED {crashed - killed:.1f} s; trainer actors gone {actors_gone - killed:.1f} s; "
          f"its Ray gone {ray_gone - killed:.1f} s; "
          f"worker done (row written) {archived - killed:.1f} s")
    worker_log = (tmp_path / "worker.log").read_text()

    # the outcome and its message, through the API
    state = api_state(api, flow_run_id)["state"]
    assert state["type"] == "CRASHED", state
    assert "-9" in state["message"] or "SIGKILL" in state["message"], state["message"]
    # the crashed state tells the ETT (the hook set it again with the message), the orchestrator failure named
    crashed_message = r"ETT \d+\.\d% · NoF \d+ \(.*orchestrator: Prefect marked the flow run CRASHED"
    assert re.match(crashed_message, state["message"]), state["message"]
    # the train task does not stay Running: the hook closed the task runs the dead process left open
    tasks = task_runs(api, flow_run_id)
    assert not [t["name"] for t in tasks if t["state_type"] in ("RUNNING", "PENDING", "SCHEDULED")], tasks
    (train,) = [t for t in tasks if t["name"].startswith("train-")]
    assert train["state_type"] == "CRASHED"

    # the row: crashed, the orchestrator failure counted, nothing spooled missing, the partition exact
    row, events, failures = row_of(warehouse, flow_run_id)
    assert row is not None, worker_log[-4000:]
    assert row["status"] == "crashed" and row["nof"] >= 1, row.to_dict()
    assert "orchestrator" in set(failures["failure_class"]), failures
    marks = events[events["phase"].isin(["failure", "failure_detected"])]
    assert any(a.get("detection") == "prefect_crashed" for a in marks["attrs"])  # the timeline has it
    assert len(events) == len(read_spool(spool, flow_run_id).events)
    assert row["effective_steps"] >= 1
    assert_components_sum_to_wall(row)
    assert f"run {flow_run_id} crashed: orchestrator failure recorded" in worker_log
    found = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}).json()
    assert "ett-timeline-refresh-adhoc" in {a["key"] for a in found}
    # nothing of the run is left: its trainer actors are gone, and so are their placement groups
    assert not alive(actors) and not trainer_actors()
    assert not processes_of(home), describe(processes_of(home))


# ---- case 4: the warehouse goes away mid-run ------------------------------------------------


class TcpProxy:
    """127.0.0.1:<port> forwarded to `target`, until `close()` (which drops the listener and
    every forwarded connection, so new connections are refused); `open()` listens again."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def open(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def close(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener is not None:
            listener.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # closed meanwhile
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def proxied(url: str, port: int) -> str:
    from sqlalchemy import make_url

    return make_url(url).set(host="127.0.0.1", port=port).render_as_string(hide_password=False)


def test_postgres_refusing_connections_mid_run_leaves_the_row_pending_then_archived_once(
        prefect_harness, ray_session, flow_data, flow_work_root, postgres_schema_url, tmp_path, capsys):
    from sqlalchemy import make_url

    from ettflow.cli import main as ettflow_main
    from ettflow.flows.cli import main as refresh_main

    pg = make_url(postgres_schema_url)
    proxy = TcpProxy((pg.host or "127.0.0.1", pg.port or 5432))
    proxy.open()
    url, spool = proxied(postgres_schema_url, proxy.port), tmp_path / "spool"
    seen: dict = {}

    def close_when_training() -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            runs = [p for p in spool.glob("*") if p.is_dir()]
            if runs and training_started(runs[0]):
                proxy.close()
                seen.update(closed_at=time.time(), run=runs[0].name, actors=trainer_actors())
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=close_when_training, daemon=True)
    watcher.start()
    args = ["refresh", "--data-root", str(flow_data), "--batch-size", "32", "--max-steps", "60",
            "--checkpoint-every-steps", "10", "--switch", "compile=false", "--no-failure", "--warehouse-url", url,
            "--param", f"spool_root={spool}", "--param", f"work_root={flow_work_root}",
            "--param", f"snapshot_root={tmp_path / 'snapshots'}", "--param", "max_embeddings=100",
            "--param", "eval_batches=2", "--param", f"architecture={json.dumps(TINY)}"]
    try:
        code = refresh_main(args)
        finished = time.time()
    finally:
        proxy.close()
        watcher.join(timeout=5)
    out = capsys.readouterr()
    assert "closed_at" in seen, f"training never started (exit {code}):\n{out.out[-3000:]}\n{out.err[-4000:]}"
    run_id = seen["run"]

    # the outcome: published and completed, exit 0, a warning saying how to retry (no report, no traceback)
    assert code == 0, out.err[-4000:]
    pending = read_pending(spool, run_id)
    assert pending is not None and pending.info.status == "completed"
    assert f"ettflow refresh: warning: {pending.message}" in out.err
    assert "ettflow archive --pending" in out.err and f"ettflow archive --run {run_id}" in out.err
    own = [line for line in out.err.splitlines() if "(TrainerActor" not in line]  # the command's, not Ray's echo
    assert not [line for line in own if line.startswith("Traceback")], out.err[-4000:]
    actor_tracebacks = [line for line in out.err.splitlines() if "(TrainerActor" in line and "Traceback" in line]
    say(capsys, f"case 4: {len(actor_tracebacks)} trainer traceback(s) echoed by Ray:\n"
          + "\n".join(line for line in out.err.splitlines() if "(TrainerActor" in line)[-3000:])
    say(capsys, f"case 4: the pending message appears {out.err.count(pending.message)} time(s) on stderr")
    assert pending.info.tags.get("snapshot") and Path(pending.info.tags["snapshot"]).is_dir()
    # the lineage (published: it advances the watermark) waits in the spool too
    from ettflow.ett.lineage import Outcome
    from ettflow.ett.lineage_pending import pending_lineage_file, read_pending_lineage

    waiting = read_pending_lineage(spool, run_id)
    assert waiting is not None and waiting.outcome is Outcome.PUBLISHED and waiting.windows
    assert waiting.snapshot == pending.info.tags["snapshot"]
    spooled = read_spool(spool, run_id).events
    train_ends = [e.end for e in spooled if e.phase == "train_step"]
    assert seen["closed_at"] < max(train_ends), "the proxy closed only after training"  # premise of the case
    assert seen["closed_at"] < finished
    # nothing of the run is left: its trainer actors were released
    wait_for(lambda: not alive(seen["actors"]), BOUND_S, "the trainer actors to exit")
    assert seen["actors"] and not trainer_actors()

    # PostgreSQL back: `ettflow archive --pending` writes the row, exactly once
    proxy.open()
    try:
        back = time.monotonic()
        assert ettflow_main(["archive", "--pending", "--url", url, "--spool", str(spool)]) == 0
        say(capsys, f"case 4: proxy reopened -> row written {time.monotonic() - back:.1f} s "
              f"(run finished {finished - seen['closed_at']:.1f} s after the outage began)")
        printed = capsys.readouterr().out
        assert f"run {run_id}: archived (completed)" in printed and f"run {run_id}: archived: lineage of" in printed
        assert read_pending(spool, run_id) is None and not pending_lineage_file(spool, run_id).exists()
        with Warehouse.open(url) as wh:  # the watermark advanced; the claims are settled (done)
            assert wh.watermark(waiting.model) == waiting.windows[-1]
            (record,) = [r for r in wh.lineage(waiting.model) if r.run_id == run_id]
            assert record == waiting
        engine = create_engine(postgres_schema_url)
        try:
            with engine.connect() as conn:
                states = conn.execute(text("SELECT DISTINCT state FROM window_claims WHERE run_id = :r"),
                                      {"r": run_id}).scalars().all()
        finally:
            engine.dispose()
        assert states == ["done"]
        row, events, failures = row_of(url, run_id)
        assert row["status"] == "completed" and row["nof"] == 0 and failures.empty
        assert row["effective_steps"] == 2 * 60 and row["tags"]["snapshot"] == pending.info.tags["snapshot"]
        assert_components_sum_to_wall(row)
        engine = create_engine(postgres_schema_url)
        try:
            def counts() -> tuple[int, int]:
                with engine.connect() as conn:
                    return (conn.execute(text("SELECT count(*) FROM runs WHERE run_id = :r"), {"r": run_id}).scalar(),
                            conn.execute(text("SELECT count(*) FROM events WHERE run_id = :r"), {"r": run_id}).scalar())

            assert counts() == (1, len(spooled))  # every spooled event, once
            # again: nothing changes
            assert ettflow_main(["archive", "--pending", "--url", url, "--spool", str(spool)]) == 0
            assert "1 skipped" in capsys.readouterr().out
            assert counts() == (1, len(spooled))
            again, _, _ = row_of(url, run_id)
            assert again["archived_at"] == row["archived_at"]
        finally:
            engine.dispose()
    finally:
        proxy.close()
