"""The warehouse on SQLite and on the real local PostgreSQL (`warehouse_url` in conftest):
round trips of every table, idempotent archiving (twice, and from several processes at
once), concurrent first opens of a fresh database, and the error for an unreachable one."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections import defaultdict
from pathlib import Path

import pytest
from sqlalchemy import func, inspect, select, text

from ettflow.ett import warehouse as warehouse_mod
from ettflow.ett.events import COMPONENTS, UNATTRIBUTED, EventError, PhaseEvent
from ettflow.ett.run_metrics import compute_run_metrics
from ettflow.ett.warehouse import (
    COMPONENT_COLUMNS,
    RunInfo,
    Warehouse,
    WarehouseError,
    default_url,
)
from ettflow.ett.warehouse_db import alembic_config
from ettflow.ett.warehouse_models import Base

from helpers.timelines import Timeline

TABLES = ("runs", "attempts", "run_components", "events", "failures", "checkpoints")


def with_seqs(events: list[PhaseEvent]) -> list[PhaseEvent]:
    """Number events per (attempt, rank) in order, as the spool does."""
    counter: dict[tuple[int, int], int] = defaultdict(int)
    out = []
    for ev in events:
        key = (ev.attempt, ev.rank)
        out.append(PhaseEvent(**{**ev.to_dict(), "seq": counter[key]}))
        counter[key] += 1
    return out


def run_events(run_id: str = "run-a", *, steps: int = 5, t0: float = 1_000.0) -> list[PhaseEvent]:
    """Two ranks, a checkpoint (blocking + background), a failure, a recovery that replays."""
    t = Timeline(run_id)
    t.mark("submitted", t0).ev("scheduling", t0, t0 + 10, rank=-1)
    t.ev("device_init", t0 + 10, t0 + 12).ev("device_init", t0 + 10, t0 + 13, rank=1)
    t.ev("pt2_compile", t0 + 13, t0 + 20).ev("pt2_compile", t0 + 13, t0 + 20, rank=1)
    s = t0 + 20
    t.steps(s, 0, steps).steps(s, 0, steps, rank=1)
    s += steps
    for rank in (0, 1):
        t.ev("checkpoint_save_blocking", s, s + 1, rank=rank, step=steps,
             path=f"/ckpt/{steps}/{rank}", bytes=1 << 20)
        t.ev("checkpoint_save_background", s + 1, s + 4, rank=rank, step=steps,
             path=f"/ckpt/{steps}/{rank}", bytes=1 << 22)
    t.steps(s + 1, steps, 3).steps(s + 1, steps, 3, rank=1)
    t.fail(s + 4, s + 6, failure_class="infrastructure", reason="node lost", failed_rank=1)
    t.next_attempt()
    r = s + 6
    t.ev("scheduling", r, r + 5, rank=-1).ev("checkpoint_restore", r + 5, r + 7)
    t.ev("checkpoint_restore", r + 5, r + 7, rank=1)
    t.steps(r + 7, steps, 3 + steps).steps(r + 7, steps, 3 + steps, rank=1)
    e = r + 10 + steps
    t.ev("shutdown", e, e + 2).ev("publish_standalone", e + 2, e + 9, rank=-1)
    return with_seqs(t.events)


def info_for(run_id: str, **kw) -> RunInfo:
    return RunInfo(run_id=run_id, model=kw.pop("model", "dlrm"), mode="optimized",
                   flow_run_id="flow-1", tags={"benchmark": True}, **kw)


def archive(wh: Warehouse, run_id: str = "run-a", **kw) -> list[PhaseEvent]:
    events = run_events(run_id, **{k: kw.pop(k) for k in ("steps", "t0") if k in kw})
    wh.archive_run(info_for(run_id, **kw), events, compute_run_metrics(events))
    return events


def counts(wh: Warehouse, run_id: str | None = None) -> dict[str, int]:
    with wh.engine.connect() as conn:
        out = {}
        for name in TABLES:
            t = Base.metadata.tables[name]
            stmt = select(func.count()).select_from(t)
            if run_id is not None:
                stmt = stmt.where(t.c.run_id == run_id)
            out[name] = conn.execute(stmt).scalar_one()
        return out


@pytest.fixture
def wh(warehouse_url):
    warehouse = Warehouse.open(warehouse_url)
    yield warehouse
    warehouse.close()


def test_round_trip_of_every_table(wh):
    events = archive(wh)
    m = compute_run_metrics(events)
    runs = wh.runs_frame()
    assert len(runs) == 1
    assert list(runs.columns[-len(COMPONENT_COLUMNS) :]) == list(COMPONENT_COLUMNS)
    row = runs.iloc[0]
    assert row[["run_id", "model", "mode", "flow_run_id", "status"]].tolist() == [
        "run-a", "dlrm", "optimized", "flow-1", "completed"]
    assert row.tags == {"benchmark": True}
    for name in ("wall_start", "wall_end", "wall_s", "tts_s", "ttr_total_s", "ttr_mean_s",
                 "ett_pct", "ett_l1_pct", "checkpoint_blocking_s"):
        assert row[name] == pytest.approx(getattr(m, name)), name
    assert (row.nof, row.effective_steps, row.replayed_steps, row.checkpoint_saves) == (
        1, m.effective_steps, m.replayed_steps, 1)
    assert m.replayed_steps > 0 and bool(row.started_training)
    for c in (*COMPONENTS, UNATTRIBUTED):
        assert row[f"{c}_s"] == pytest.approx(m.components[c]), c

    comps = wh.components_frame("run-a")
    assert list(comps.name[:7]) == [*COMPONENTS, UNATTRIBUTED]
    phases = comps[comps.kind == "phase"].set_index("name")
    assert set(phases.index) == set(m.phases)
    for name, pt in m.phases.items():
        got = (phases.exposed_s[name], phases.raw_s[name])
        assert got == pytest.approx((pt.exposed_s, pt.raw_s)), name
    assert phases.owner["checkpoint_restore"] == "storage"
    assert phases.owner["device_init"] == "trainer"
    components = comps[comps.kind == "component"].set_index("name")
    for c in (*COMPONENTS, UNATTRIBUTED):
        assert components.raw_s[c] == pytest.approx(m.components_raw[c]), c
        assert components.raw_s[c] >= components.exposed_s[c] - 1e-9, c

    attempts = wh.table_frame("attempts", "run-a")
    assert list(attempts.failed) == [True, False]
    assert attempts.phase_raw_s[1] == pytest.approx(m.attempts[1].phase_raw_s)
    failures = wh.table_frame("failures", "run-a")
    f = m.failures[0]
    assert failures.iloc[0][["attempt", "rank", "failure_class", "reason"]].tolist() == [
        0, 1, "infrastructure", "node lost"]
    assert failures.ttr_s[0] == pytest.approx(f.ttr_s) and bool(failures.recovered[0])

    ckpt = wh.table_frame("checkpoints", "run-a")
    assert sorted(ckpt.kind) == ["background", "background", "blocking", "blocking"]
    blocking = ckpt[(ckpt.kind == "blocking") & (ckpt["rank"] == 1)].iloc[0]
    assert blocking[["step", "path", "bytes", "duration_s"]].tolist() == [
        5, "/ckpt/5/1", 1 << 20, 1.0]

    back = wh.events_for("run-a")
    key = lambda e: (e.attempt, e.rank, e.seq)  # noqa: E731
    assert sorted(back, key=key) == sorted(events, key=key)
    assert compute_run_metrics(back) == m  # the warehouse loses nothing the metric needs


def test_archiving_twice_leaves_one_copy_and_updates_the_run(wh):
    archive(wh)
    first = counts(wh)
    archived_at = wh.runs_frame().archived_at[0]
    archive(wh, status="failed")
    assert counts(wh) == first
    assert first["events"] == len(run_events()) and first["checkpoints"] == 4
    row = wh.runs_frame().iloc[0]
    assert row.status == "failed" and row.archived_at >= archived_at


def test_rearchiving_keeps_only_what_the_last_archive_was_given(wh):
    archive(wh, steps=8)
    archive(wh, steps=5)
    assert counts(wh) == {**counts(wh), "events": len(run_events(steps=5))}
    assert compute_run_metrics(wh.events_for("run-a")) == compute_run_metrics(run_events(steps=5))


def test_a_database_without_native_upserts_is_refused(wh, monkeypatch):
    monkeypatch.setattr(warehouse_mod, "_UPSERT_INSERT", {})  # as if the dialect had no ON CONFLICT
    with pytest.raises(WarehouseError, match="supports SQLite and PostgreSQL"):
        archive(wh)
    assert counts(wh)["runs"] == 0


def test_thousands_of_step_events(wh):
    began = time.monotonic()
    events = archive(wh, steps=2_000)
    assert counts(wh)["events"] == len(events) > 8_000
    assert time.monotonic() - began < 30


def test_bad_events_are_rejected_before_anything_is_written(wh):
    events = run_events()
    m = compute_run_metrics(events)
    no_seq = [*events[:-1], PhaseEvent(**{**events[-1].to_dict(), "seq": None})]
    with pytest.raises(EventError, match="seq"):
        wh.archive_run(info_for("run-a"), no_seq, m)
    with pytest.raises(EventError, match="share"):
        wh.archive_run(info_for("run-a"), [*events, events[0]], m)
    with pytest.raises(ValueError, match="run-b"):
        wh.archive_run(info_for("run-b"), events, m)
    assert counts(wh) == dict.fromkeys(TABLES, 0)


def test_queries(wh):
    assert wh.runs_frame().empty and list(wh.runs_frame().columns)[-1] == "unattributed_s"
    assert wh.components_frame("nope").empty and wh.events_for("nope") == []
    archive(wh, "r1", t0=100.0)
    archive(wh, "r2", t0=300.0, model="other")
    archive(wh, "r3", t0=200.0)
    assert list(wh.runs_frame().run_id) == ["r1", "r3", "r2"]
    assert list(wh.runs_frame(model="dlrm").run_id) == ["r1", "r3"]
    assert list(wh.runs_frame(run_id="r2").model) == ["other"]
    assert list(wh.runs_frame(limit=2).run_id) == ["r3", "r2"]
    assert list(wh.runs_frame(model="dlrm", limit=1).run_id) == ["r3"]
    assert set(counts(wh, "r3").values()) == set(counts(wh, "r1").values())
    with pytest.raises(ValueError, match="tables"):
        wh.table_frame("nope")


def test_migrations_create_exactly_the_models(wh):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    with wh.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
        assert set(TABLES) <= set(inspect(conn).get_table_names())


def test_migrations_downgrade_and_upgrade_again(wh, warehouse_url):
    from alembic import command

    archive(wh)
    with wh.engine.connect() as conn, conn.begin():
        command.downgrade(alembic_config(conn), "base")
    with wh.engine.connect() as conn:
        assert not set(TABLES) & set(inspect(conn).get_table_names())
    with Warehouse.open(warehouse_url) as again:
        assert counts(again) == dict.fromkeys(TABLES, 0)
        archive(again)
        assert counts(again)["runs"] == 1


def test_sqlite_settings(tmp_path):
    wh = Warehouse.open(f"sqlite:///{tmp_path / 'w.db'}")
    with wh.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 30_000
    wh.close()


# -- several processes at once ------------------------------------------------------------


def _archive_worker(url: str, barrier, results) -> None:
    try:
        events = run_events()
        metrics = compute_run_metrics(events)
        barrier.wait(timeout=60)
        wh = Warehouse.open(url)  # the first open of a fresh database, in every worker at once
        try:
            for _ in range(3):
                wh.archive_run(info_for("run-a"), events, metrics)
        finally:
            wh.close()
        results.put("ok")
    except BaseException:  # noqa: BLE001 - reported to the parent process
        results.put(traceback.format_exc())


def _open_worker(url: str, barrier, results) -> None:
    try:
        barrier.wait(timeout=60)
        Warehouse.open(url).close()
        results.put("ok")
    except BaseException:  # noqa: BLE001 - reported to the parent process
        results.put(traceback.format_exc())


def _in_processes(target, url: str, n: int) -> list[str]:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=target, args=(url, barrier, results)) for _ in range(n)]
    for p in procs:
        p.start()
    out = []
    try:
        for _ in procs:
            out.append(results.get(timeout=120))
    except queue.Empty:
        out.append("a worker reported nothing within 120 s")
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return out


def test_processes_archiving_the_same_run_at_once_leave_one_copy(warehouse_url):
    assert _in_processes(_archive_worker, warehouse_url, 4) == ["ok"] * 4
    with Warehouse.open(warehouse_url) as wh:
        events = run_events()
        single = {"runs": 1, "attempts": 2, "events": len(events), "failures": 1,
                  "checkpoints": 4,
                  "run_components": 7 + len(compute_run_metrics(events).phases)}
        assert counts(wh) == single
        assert compute_run_metrics(wh.events_for("run-a")) == compute_run_metrics(events)


def test_processes_opening_a_fresh_database_at_once(warehouse_url):
    from alembic.script import ScriptDirectory

    assert _in_processes(_open_worker, warehouse_url, 4) == ["ok"] * 4
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    with Warehouse.open(warehouse_url) as wh, wh.engine.connect() as conn:
        versions = conn.execute(text("SELECT version_num FROM alembic_version")).scalars()
        assert versions.all() == [head]
        assert set(TABLES) <= set(inspect(conn).get_table_names())


# -- where the warehouse is, and when it is not there ---------------------------------------


def test_unreachable_postgres_names_the_url_and_what_to_check():
    with pytest.raises(WarehouseError) as err:
        Warehouse.open("postgresql+psycopg://postgres:s3cret@127.0.0.1:1/ettflow")
    msg = str(err.value)
    assert "postgresql+psycopg://postgres:***@127.0.0.1:1/ettflow" in msg and "s3cret" not in msg
    assert "PostgreSQL is running" in msg and "ETTFLOW_WAREHOUSE_URL" in msg


def test_unreachable_sqlite_and_unknown_dialect(tmp_path):
    with pytest.raises(WarehouseError, match="exists and is writable"):
        Warehouse.open(f"sqlite:///{tmp_path / 'missing' / 'w.db'}")
    with pytest.raises(WarehouseError, match="driver is installed"):
        Warehouse.open("nosuchdb://u:pw@host/db")


def test_default_url_honours_the_environment(monkeypatch, tmp_path):
    for name in ("ETTFLOW_WAREHOUSE_URL", "ETTFLOW_HOME", "XDG_DATA_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_url() == f"sqlite:///{tmp_path}/home/.local/share/ettflow/warehouse.db"
    assert (tmp_path / "home/.local/share/ettflow").is_dir()
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_url() == f"sqlite:///{tmp_path}/xdg/ettflow/warehouse.db"
    monkeypatch.setenv("ETTFLOW_HOME", str(tmp_path / "eh"))
    assert default_url() == f"sqlite:///{tmp_path}/eh/warehouse.db"
    assert Path(tmp_path / "eh").is_dir()
    monkeypatch.setenv("ETTFLOW_WAREHOUSE_URL", "postgresql+psycopg://u@h/db")
    assert default_url() == "postgresql+psycopg://u@h/db"


def test_open_without_url_uses_the_default(monkeypatch, tmp_path):
    monkeypatch.delenv("ETTFLOW_WAREHOUSE_URL", raising=False)
    monkeypatch.setenv("ETTFLOW_HOME", str(tmp_path))
    with Warehouse.open() as wh:
        archive(wh)
    assert (tmp_path / "warehouse.db").is_file()
    assert os.path.getsize(tmp_path / "warehouse.db") > 0
