"""A refresh with nothing to train, through Prefect (no Ray: nothing is reserved): it ends
Completed with a message saying so and is archived as `skipped`; a refresh that finds the
model's windows claimed by another one waits `claim_wait_s`, then is skipped the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from ettflow.ett import lineage
from ettflow.ett.lineage import LineageRecord, Outcome
from ettflow.ett.spool import read_spool
from ettflow.ett.warehouse import Warehouse
from ettflow.flows.refresh import refresh_model
from ettflow.trainer.data.windows import list_windows

from helpers.flows import flow_kwargs

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def env(tmp_path, flow_data, prefect_harness):
    return {"data_root": str(flow_data), "max_embeddings": 100, "work_root": str(tmp_path / "work"),
            "snapshot_root": str(tmp_path / "snapshots"), "spool_root": str(tmp_path / "spool"),
            "warehouse_url": f"sqlite:///{tmp_path / 'warehouse.db'}", "model": "skippy"}


def run(env, **over):
    state = refresh_model(**flow_kwargs({**env, **over}), return_state=True)
    return state, str(state.state_details.flow_run_id)


def assert_archived_as_skipped(env, run_id, reason):
    evs = read_spool(env["spool_root"], run_id).events
    assert [(e.phase, e.attrs.get("stage"), e.attrs.get("outcome")) for e in evs] == [
        ("scheduling", "claim_windows", "skipped")]  # no reservation, no training: only the decision
    with Warehouse.open(env["warehouse_url"]) as wh:
        (row,) = wh.runs_frame(run_id=run_id).to_dict("records")
        (rec,) = [r for r in wh.lineage("skippy") if r.run_id == run_id]
    assert row["status"] == "skipped" and row["tags"]["skip_reason"] == reason and not row["started_training"]
    assert rec.outcome is Outcome.SKIPPED and rec.reason == reason and rec.windows == ()
    # named for what it is: no window it never claimed (issue 43), and no TTS or shares in the report
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert client.read_flow_run(run_id).name == "skippy-optimized · skipped"
    from ettflow.ett.report import run_table

    with Warehouse.open(env["warehouse_url"]) as wh:
        (shown,) = run_table(wh.runs_frame(run_id=run_id)).to_dict("records")
    import pandas as pd

    assert shown["status"] == "skipped" and pd.isna(shown["TTS_s"]) and pd.isna(shown["sched%"])


def test_nothing_new_to_train_is_skipped(env, flow_data):
    known = list_windows(flow_data)
    with Warehouse.open(env["warehouse_url"]) as wh:
        wh.record_lineage(LineageRecord(model="skippy", run_id="r0", windows=known[:2], outcome=Outcome.PUBLISHED,
                                        anchor="/a0", created_at=1.0, finished_at=2.0))
    state, run_id = run(env)
    reason = (f"nothing new to train for model skippy: watermark {known[1]} is the newest window before the "
              f"held-out {known[2]}")
    assert state.is_completed() and state.message == reason
    assert state.result() == {"run_id": run_id, "model": "skippy", "outcome": "skipped", "reason": reason}
    assert_archived_as_skipped(env, run_id, reason)
    assert not (Path(env["work_root"]) / "skippy" / "runs" / run_id).exists()
    with Warehouse.open(env["warehouse_url"]) as wh:
        assert wh.watermark("skippy") == known[1]


def test_windows_held_by_another_refresh_are_left_to_it(env, flow_data):
    with Warehouse.open(env["warehouse_url"]) as wh:
        lineage.claim_windows(wh, "skippy", "other-run", lambda mark, parent: (list_windows(flow_data)[:2], None))
    state, run_id = run(env, claim_wait_s=0.5)
    assert state.is_completed() and state.message.startswith("model skippy is being refreshed by run other-run")
    assert_archived_as_skipped(env, run_id, state.message)


@pytest.mark.parametrize("held_out, damage", [(False, "type"), (True, "type"), (False, "missing")])
def test_a_bad_data_file_refuses_the_refresh_before_anything_is_reserved(env, flow_data, tmp_path, held_out, damage):
    """Every input is checked before the trainer is reserved (tasks/input_check.py): a training or
    held-out file whose column has the wrong type, or lacks a column, refuses the refresh, naming
    the file and the column, in one line; no reservation, no Ray, no training; its windows are
    released. Refused like a bad parameter (issue 42 #8): no ETT row (it was one at ETT 0%,
    NoF 1), no failure in the spool's history; the run is named and tagged `refused`."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    shutil.copytree(flow_data, data)
    window = list_windows(data)[2 if held_out else 0]
    part = sorted((data / window).glob("*.parquet"))[0]
    table = pq.read_table(part)
    if damage == "type":
        pq.write_table(table.set_column(table.schema.get_field_index("int_3"), "int_3",
                                        pa.array(["x"] * table.num_rows, type=pa.string())), part)
        said = f"{part}: column 'int_3' has type string"
    else:
        pq.write_table(table.drop_columns(["int_3"]), part)
        said = f"{part}: column 'int_3' is missing"
    state, run_id = run(env, data_root=str(data))
    assert state.is_failed()
    assert state.message.startswith(f"refused: the input data cannot be trained on: {said}"), state.message
    assert "Traceback" not in state.message
    assert not (Path(env["spool_root"]) / run_id).exists()  # nothing reserved, trained or failed: nothing spooled
    with Warehouse.open(env["warehouse_url"]) as wh:
        assert wh.runs_frame(run_id=run_id).empty  # no ETT row
        (rec,) = [r for r in wh.lineage("skippy") if r.run_id == run_id]
        again = lineage.claim_windows(wh, "skippy", "next", lambda mark, parent: (("w",), None))
    assert rec.outcome is Outcome.FAILED and "int_3" in rec.reason
    assert not isinstance(again, lineage.Busy)  # its claims are gone
