"""Continuous refresh end to end (Prefect test harness, Ray, TorchRec, the warehouse), tiny sizes.

A data root grows one hourly window at a time (`ettflow data append`); refreshes of one model:

    r1  windows w0 (w1 held out)        cold                      published
    +w2
    r2  w1 (w2 held out)                warm from r1's anchor     published, on ranks r1's release
                                        prewarmed, r1's anchor staged in their memory
    +w3
    r3  w2, a user error at the same step twice                   failed: the watermark stays at w1
    r4  w2 (w3 held out), on 1 rank     warm from r2's 2-rank anchor (resharded)   published; r1's
                                        snapshot pruned (the last 2 published stay)
    r5  nothing new                                               skipped
    +w4, w3's labels inverted (a deliberately worse window)
    r6  w3 (w4 held out), cold          its held-out AUC falls far below r4's: gated

Checked: each trains only its new windows (every step's cursor is in them, the step counter
starts at 0); r2's parameters just before its first step are bitwise r1's anchor (the
sha256 of every piece each rank restored from its staged copy, against the anchor read whole); the watermark; the
lineage and the manifests' parents; r4 starts on 1 rank from r2's 2-rank anchor (DCP reshards
the TorchRec state), bitwise. The gate is off here (a held-out AUC on 640 rows is
noisy) except for r6, whose model learns the inverse of the labels, so its AUC on the next
window is far below the current one's (tests/test_gate.py gates a shuffled-label snapshot at
the publish level). Two concurrent refreshes of one
model: tests/test_flow_skipped.py (a refresh finding the windows claimed ends skipped) and
tests/test_claims.py (the claim itself, SQLite and PostgreSQL): a second flow-level training
run here would double this file's time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ettflow.ett.lineage import Outcome
from ettflow.ett.warehouse import Warehouse
from ettflow.publish import read_current
from ettflow.trainer.data.cli import main as data_cli
from ettflow.trainer.data.windows import list_windows

from helpers.flows import PLAIN, flow_env, run
from helpers.spool import events as spooled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MODEL = "grow"


@pytest.fixture(scope="module")
def env(tmp_path_factory, flow_work_root, prefect_harness, ray_session):
    from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows

    root = tmp_path_factory.mktemp("continuous")
    generate_windows(root / "data", SyntheticConfig(windows=2, rows_per_window=640, files_per_window=1, seed=11))
    # no compile, spare or in-memory keeper (`PLAIN`): the refreshes' lineage is the subject here
    return flow_env(root, root / "data", flow_work_root, model=MODEL, checkpoint_every_steps=100, switches=PLAIN,
                    gate_max_auc_drop=None, keep_refreshes=10,  # the checks read every anchor afterwards
                    keep_snapshots=2)  # r4's prune removes r1's snapshot


def events(env, run_id, phase, attempt=None):
    return spooled(env["spool_root"], run_id, phase, attempt=attempt)


def watermark(env):
    with Warehouse.open(env["warehouse_url"]) as wh:
        return wh.watermark(MODEL)


def trained_window_indexes(env, run_id) -> set[int]:
    return {e.attrs["cursor_start"][0] for e in events(env, run_id, "train_step")}


def restored_matches_anchor(restores, anchor: str) -> list[str]:
    from ettflow.publish.anchor import load_float_model, open_anchor
    from ettflow.trainer.checkpoint.fingerprint import fingerprint_mismatches

    whole = load_float_model(open_anchor(anchor)).state_dict()
    bad: list[str] = []
    for e in restores:
        bad += fingerprint_mismatches(e.attrs["fingerprint"], whole)
    return bad


def invert_labels(data_root, window) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for part in sorted((Path(data_root) / window).glob("*.parquet")):
        table = pq.read_table(part)
        i = table.schema.get_field_index("label")
        flipped = pa.array(1 - table.column("label").to_numpy(), type=table.schema.field(i).type)
        pq.write_table(table.set_column(i, "label", flipped), part)


@pytest.fixture(scope="module")
def sequence(env):
    data = env["data_root"]
    out = {}
    from ettflow.trainer.group.warm_pool import POOL

    POOL.keep_warm(True)  # r1's release prewarms r2's ranks, which stage r1's anchor meanwhile
    try:
        out["r1"] = run(env)
        out["pooled_ready"] = POOL.wait_ready(120)
        POOL.keep_warm(False)  # r2 takes them and leaves nothing for the runs after it
        out["mark1"] = watermark(env)
        assert data_cli(["append", "--root", data]) == 0
        out["r2"] = run(env)
    finally:
        POOL.close()
    out["mark2"] = watermark(env)
    assert data_cli(["append", "--root", data]) == 0
    out["r3"] = run(env, fail_at=["raise:rank=1:step=2", "raise:rank=1:step=2"])  # stopped: user x2
    out["mark3"] = watermark(env)
    out["r4"] = run(env, world_size=1)  # capacity shrank: the 2-rank anchor is resharded onto 1 rank
    out["r5"] = run(env)
    out["current5"] = read_current(env["snapshot_root"])
    assert data_cli(["append", "--root", data]) == 0
    invert_labels(data, list_windows(data)[-2])
    out["r6"] = run(env, warm_start=False, gate_max_auc_drop=0.01)
    out["mark6"] = watermark(env)
    out["windows"] = list_windows(data)
    return out


def test_each_refresh_trains_only_its_new_windows_from_its_parent(env, sequence):
    w = sequence["windows"]
    (s1, r1), (s2, r2), (s4, r4) = sequence["r1"], sequence["r2"], sequence["r4"]
    for state in (s1, s2, s4):
        assert state.is_completed(), state.message
    res1, res2, res4 = s1.result(), s2.result(), s4.result()
    assert (res1["windows"], res2["windows"], res4["windows"]) == ([w[0]], [w[1]], [w[2]])
    assert [r["outcome"] for r in (res1, res2, res4)] == ["published"] * 3
    assert res1["parent"] is None and res2["parent"] == r1 and res4["parent"] == r2
    assert trained_window_indexes(env, r1) == {0}
    assert trained_window_indexes(env, r2) == {1} and trained_window_indexes(env, r4) == {2}
    for run_id in (r2, r4):
        assert min(e.attrs["step"] for e in events(env, run_id, "train_step")) == 0  # the counter restarts
    assert (sequence["mark1"], sequence["mark2"]) == (w[0], w[1])
    # the snapshot's manifest names its parent (snapshot and anchor) and its windows
    from ettflow.publish import read_current, read_manifest

    lineage = read_manifest(res2["snapshot"]).lineage
    assert lineage["parent_anchor"] == res1["anchor"] and lineage["parent_snapshot"] == res1["snapshot"]
    assert lineage["windows"] == [w[1]] and lineage["held_out"] == [w[2]]
    assert read_current(env["snapshot_root"]).path == res4["snapshot"]


def test_the_warm_start_begins_bitwise_at_the_parent_anchor(env, sequence):
    (s1, _), (_, r2) = sequence["r1"], sequence["r2"]
    restores = events(env, r2, "checkpoint_restore", attempt=0)
    assert sorted(e.rank for e in restores) == [0, 1]
    for e in restores:
        assert e.attrs["source"] == "parent" and e.attrs["path"] == s1.result()["anchor"]
        assert e.attrs["parent_world_size"] == 2 and len(e.attrs["fingerprint"]) > 4
    # r2's ranks were prewarmed at r1's release and staged r1's anchor in memory meanwhile: each
    # restored from there (checked against its manifest at staging), not from the disk
    assert sequence["pooled_ready"] == 2
    pooled = [e for e in events(env, r2, "spare_start", attempt=0) if e.attrs.get("for_rank") is not None]
    assert sorted(e.attrs["for_rank"] for e in pooled) == [0, 1], [e.attrs for e in pooled]
    assert [e.attrs.get("staged") for e in restores] == [True, True], [e.attrs for e in restores]
    # every piece each rank held just before its first step (restore -> step 0) is bitwise the parent anchor's
    assert restored_matches_anchor(restores, s1.result()["anchor"]) == []
    for e in restores:  # each rank restored before its own first step
        (first,) = [s for s in events(env, r2, "train_step", attempt=0) if s.attrs["step"] == 0 and s.rank == e.rank]
        assert first.start >= e.end


def test_a_failed_refresh_leaves_the_watermark_and_the_next_one_trains_its_windows(env, sequence):
    w = sequence["windows"]
    s3, r3 = sequence["r3"]
    assert s3.is_failed()
    assert sequence["mark3"] == w[1]  # not advanced by the failure
    with Warehouse.open(env["warehouse_url"]) as wh:
        records = {r.run_id: r for r in wh.lineage(MODEL)}
    assert records[r3].outcome is Outcome.FAILED and records[r3].windows == (w[2],)
    assert {e.attempt for e in events(env, r3, "train_step")} == {0, 1}
    assert "stopped after 2 failures (user x2)" in s3.message
    assert watermark(env) == w[2]  # r4 trained w2 again and published


def test_a_refresh_with_nothing_new_is_skipped(env, sequence):
    s5, r5 = sequence["r5"]
    assert s5.is_completed() and "nothing new to train" in s5.message
    assert s5.result()["outcome"] == "skipped" and events(env, r5, "train_step") == []
    # no ETT table or timeline (a 0% ETT would be a lie): one short artifact says why (issue 27)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as c:
        found = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[r5])))
    ett = [a for a in found if (a.key or "").startswith("ett-")]
    assert [(a.key.startswith("ett-timeline"), a.type) for a in ett] == [(False, "markdown")], ett
    assert "skipped: nothing new to train" in ett[0].data and "ETT" not in ett[0].description.split(" · ")[0]


def test_a_warm_start_reshards_a_two_rank_anchor_onto_one_rank(env, sequence):
    (s2, _), (_, r4) = sequence["r2"], sequence["r4"]
    restores = events(env, r4, "checkpoint_restore", attempt=0)
    assert [e.rank for e in restores] == [0]
    (e,) = restores
    assert e.attrs["source"] == "parent" and e.attrs["path"] == s2.result()["anchor"]
    assert e.attrs["parent_world_size"] == 2
    assert restored_matches_anchor(restores, s2.result()["anchor"]) == []
    assert {ev.rank for ev in events(env, r4, "train_step")} == {0}


def test_a_worse_snapshot_is_gated_and_the_current_one_stays(env, sequence):
    w = sequence["windows"]
    s6, r6 = sequence["r6"]
    assert s6.is_completed() and s6.message.startswith("ETT ") and " · gated: " in s6.message, s6.message
    res = s6.result()
    assert res["outcome"] == "gated" and res["windows"] == [w[3]] and res["parent"] is None  # cold, as asked
    assert "gate_max_auc_drop" in s6.message
    assert sequence["mark6"] == w[2]  # a gated refresh does not advance the watermark
    assert read_current(env["snapshot_root"]) == sequence["current5"]  # the current snapshot stays
    with Warehouse.open(env["warehouse_url"]) as wh:
        (record,) = [r for r in wh.lineage(MODEL) if r.run_id == r6]
    assert record.outcome is Outcome.GATED and record.snapshot == res["snapshot"] and record.reason


def test_each_refresh_keeps_the_last_snapshots_and_the_current_one(env, sequence):
    """`prune-snapshots` (`keep_snapshots`: 2): r4's prune removed r1's snapshot with its timeline
    picture; after r6 the snapshots of r6 (gated: this run's, not counted), r4 (current) and r2
    (the last 2 published with r4) stay. r3 (failed) and r5 (skipped) published nothing."""
    (_, r1), (_, r2), (_, r4), (_, r6) = (sequence[k] for k in ("r1", "r2", "r4", "r6"))
    root = Path(env["snapshot_root"])
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == sorted([r2, r4, r6])
    assert not (root / f"{r1}.ett-timeline.png").exists() and (root / f"{r2}.ett-timeline.png").is_file()


def test_each_refresh_records_the_interval_planned_from_its_model_s_history(env, sequence):
    """The claim task plans the interval from the model's runs so far (`ett.interval_plan`):
    here `checkpoint_every_steps` is fixed (100), so each refresh records `fixed` with the
    estimate beside it; r4's estimate holds r3's failures. Stored as the run's tag and marker,
    and shown by `ettflow report --intervals`."""
    from ettflow.cli import main

    (_, r1), (_, r2), (_, r3), (_, r4) = (sequence[k] for k in ("r1", "r2", "r3", "r4"))
    with Warehouse.open(env["warehouse_url"]) as wh:
        runs = wh.runs_frame(model=MODEL).set_index("run_id")
    planned = {r: runs.loc[r, "tags"]["checkpoint_interval"] for r in (r1, r2, r4)}
    assert {p["source"] for p in planned.values()} == {"fixed"}
    assert {p["interval_steps"] for p in planned.values()} == {100}
    assert (planned[r1]["runs"], planned[r2]["runs"], planned[r4]["runs"]) == (0, 1, 3)
    assert "rate_per_h" not in planned[r1]  # no hours anywhere: the trainer's guess per job
    assert runs.loc[r3, "nof"] == 2 and planned[r4]["rate_per_h"] > planned[r2]["rate_per_h"]
    assert len(events(env, r2, "checkpoint_interval")) == 1
    assert main(["report", "--url", env["warehouse_url"], "--model", MODEL, "--intervals"]) == 0
