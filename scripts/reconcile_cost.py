"""What reconciliation costs every refresh as a spool fills: a spool of N finished, archived tiny
runs (each: a heartbeat that ended completed, a driver and two ranks' spool files, its row in a
SQLite warehouse), then `reconcile_before_refresh` timed three times. Every refresh runs it before
its claim, on its clock. Then (where the settled index exists, `ett.settled`) what
`ettflow archive --pending` does, settling every run, and three refreshes more. Runs ended a day
ago, so all may be settled.

    .venv/bin/python scripts/reconcile_cost.py /tmp/spoolbench/n1000 1000
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ettflow.ett.archive import archive_or_defer
from ettflow.ett.spool import SpoolWriter
from ettflow.tasks import reconcile as rc
from ettflow.tasks.archive import run_info


def fill(spool: Path, url: str, n: int) -> None:
    t = time.time() - 86400
    for i in range(n):
        run_id = f"run-{i:05d}"
        driver = SpoolWriter(spool, run_id, 0, -1)
        driver.mark("submitted", t)
        driver.record("scheduling", t, t + 1)
        for rank in (0, 1):
            w = SpoolWriter(spool, run_id, 0, rank)
            for s in range(5):
                w.record("train_step", t + 1 + s, t + 2 + s, step=s, cursor_start=s, cursor_end=s + 1)
            w.close()
        driver.record("shutdown", t + 7, t + 8)
        driver.close()
        (spool / run_id / "heartbeat.json").write_text(json.dumps({
            "run_id": run_id, "every_s": 2.0, "started_at": t, "ended_at": t + 9, "outcome": "completed",
            "labels": {"model": "m", "mode": "optimized"}}))
        for path in (spool / run_id).iterdir():  # written when the run was, a day ago
            os.utime(path, (t + 9, t + 9))
        archive_or_defer(url, spool, run_info(run_id, {"model": "m", "mode": "optimized"}, status="completed",
                                              flow_run_id=run_id))


def main(root: Path, n: int) -> None:
    spool, url = root / "spool", f"sqlite:///{root / 'warehouse.db'}"
    if not spool.exists():
        root.mkdir(parents=True, exist_ok=True)
        fill(spool, url, n)
    refreshes(spool, url, n)
    if hasattr(rc, "SETTLE_PER_REFRESH"):
        t0 = time.perf_counter()
        done = rc.reconcile(spool, url)
        print(f"reconcile (ettflow archive --pending) over {n} runs: {time.perf_counter() - t0:.3f} s, "
              f"{sum(getattr(r, 'indexed', False) for r in done)} settled", flush=True)
        refreshes(spool, url, n)


def refreshes(spool: Path, url: str, n: int) -> None:
    for _ in range(3):
        t0 = time.perf_counter()
        done = rc.reconcile_before_refresh(spool, url, "new-run")
        print(f"reconcile_before_refresh over {n} finished runs: {time.perf_counter() - t0:.3f} s "
              f"({len(done)} read, {sum(r.action != 'skipped' for r in done)} acted on, "
              f"{sum(getattr(r, 'indexed', False) for r in done)} settled)", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
