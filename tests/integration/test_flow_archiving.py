"""The archiving hooks against a real warehouse (a fresh SQLite file, then PostgreSQL): two
hooks archiving one run at once, and a flow retry archiving it again, leave one copy."""

from __future__ import annotations

import threading

from ettflow.ett.sample import write_sample_run
from ettflow.ett.spool import SpoolWriter, read_spool
from ettflow.ett.warehouse import Warehouse
from ettflow.tasks import archive


def test_concurrent_hooks_archive_one_copy(warehouse_url, tmp_path):
    spool = tmp_path / "spool"
    write_sample_run(spool, "run-a", seed=1)
    with SpoolWriter(spool, "run-a", 1, -1) as rec:  # a failed publish try, off the clock
        rec.record("publish_standalone", 1_700_099_000.0, 1_700_099_001.0, outcome="failed",
                   failure_class="publish", error="OSError: disk full")
    p = {"spool_root": str(spool), "warehouse_url": warehouse_url, "model": "m", "mode": "baseline"}
    errors = []

    def hook(status):
        try:
            archive.archive_run("run-a", p, status=status, flow_run_id="run-a")
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=hook, args=(s,)) for s in ("train failed", "completed")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hook("completed")  # and once more, as a flow retry would
    assert errors == []
    with Warehouse.open(warehouse_url) as wh:
        runs = wh.runs_frame(run_id="run-a")
        events = wh.table_frame("events", "run-a")
    n_spool = len(read_spool(spool, "run-a").events)
    assert len(runs) == 1 and len(events) == n_spool and runs.iloc[0]["status"] == "completed"
    # the sample run's own failure and the failed publish try (issue 26: a publish failure is in NoF)
    assert runs.iloc[0]["nof"] == 2 and runs.iloc[0]["tags"]["publish_failures"] == 1
    with Warehouse.open(warehouse_url) as wh:
        failures = wh.table_frame("failures", "run-a")
    assert sorted(zip(failures.failure_class, failures.seq)) == [("infrastructure", 0), ("publish", 1)]
