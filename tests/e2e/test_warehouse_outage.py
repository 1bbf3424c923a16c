"""Fault-matrix case 4: PostgreSQL refusing connections mid-run (reached through a TCP proxy the
test closes once training runs): `ettflow refresh` (in this process: Prefect test harness,
the session's Ray) publishes, exits 0 with a warning, the row waits as pending, and `ettflow
archive --pending` writes it exactly once when PostgreSQL is back. Measured times are printed
(`pytest -s`)."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from ettflow.ett.archive import read_pending
from ettflow.ett.spool import read_spool
from ettflow.ett.warehouse import Warehouse

from helpers.flows import TINY, assert_components_sum_to_wall, warehouse_row
from helpers.processes import alive, trainer_actors
from helpers.spool import training_started
from helpers.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

START_S = 240.0  # a cold start on a busy 2-core machine
BOUND_S = 60.0  # the actors gone after the run


def say(capsys, message: str) -> None:
    """Print past pytest's capture (measured times, for the reliability table)."""
    with capsys.disabled():
        print(f"\n{message}", flush=True)


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
            run = training_started(spool)
            if run is not None:
                proxy.close()
                seen.update(closed_at=time.time(), run=run, actors=trainer_actors())
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=close_when_training, daemon=True)
    watcher.start()
    args = ["refresh", "--data-root", str(flow_data), "--batch-size", "32", "--max-steps", "60",
            "--checkpoint-every-steps", "10", "--switch", "compile=false", "--switch", "live_recovery=false",
            "--switch", "memory_checkpoint=false", "--no-failure", "--warehouse-url", url,
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
        row, events, failures = warehouse_row(url, run_id)
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
            again, _, _ = warehouse_row(url, run_id)
            assert again["archived_at"] == row["archived_at"]
        finally:
            engine.dispose()
    finally:
        proxy.close()
