"""A run taken for dead while it stood still, on the deployed path (docs/reliability.md row 51).

On a stack `ettflow up` started (its API on 127.0.0.1:4200): deployment run A trains the tiny
model; at step 20 its flow process is SIGSTOPped (its ranks, other processes, train on).
Deployment run B of the same model waits on A's windows, finds A's heartbeat stopped past its
bound, archives A as crashed, takes the windows, trains and publishes. Then A is SIGCONTed.
Prints what A and B ended as, how long A went on after SIGCONT and how far its ranks trained,
the model's lineage and watermark, both runs' ETT rows and where `current` points.

    ETTFLOW_HOME=/tmp/sig/home ettflow up
    ETTFLOW_HOME=/tmp/sig/home .venv/bin/python scripts/stood_still.py /tmp/sig
    ETTFLOW_HOME=/tmp/sig/home ettflow down
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from ettflow.ett.spool import read_spool
from ettflow.ett.warehouse import Warehouse
from ettflow.tasks.parameters import RefreshParameters
from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows

API = "http://127.0.0.1:4200/api"
PREFECT = str(Path(sys.executable).with_name("prefect"))
TINY = {"embedding_dim": 8, "dense_arch": [16, 8], "over_arch": [16, 1], "dense_lr": 0.02, "sparse_lr": 0.1}
PLAIN = {"compile": False, "live_recovery": False, "memory_checkpoint": False}  # no spare: A and B fit 4 CPUs
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def main(root: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_API_URL=API, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    data = root / "data"
    if not data.is_dir():
        # A's two windows are 9,600 steps of 2 ranks: it is still training when it resumes
        generate_windows(data, SyntheticConfig(windows=3, rows_per_window=307_200, files_per_window=2, seed=3))
    url = f"sqlite:///{root / 'warehouse.db'}"
    params = {"data_root": str(data), "architecture": TINY, "max_embeddings": 100, "world_size": 2,
              "batch_size": 32, "max_steps": 6000, "checkpoint_every_steps": 50, "eval_batches": 2, "switches": PLAIN,
              "work_root": str(root / "work"), "snapshot_root": str(root / "snapshots"),
              "spool_root": str(root / "spool"), "warehouse_url": url, "claim_wait_s": 900}
    t0 = time.time()

    def say(*words: object) -> None:
        print(f"[{time.time() - t0:6.1f} s]", *words, flush=True)

    def deployment_run(p: dict) -> str:
        out = subprocess.run([PREFECT, "deployment", "run", "refresh-model/refresh-adhoc", "--params",
                              json.dumps(RefreshParameters.parse(p).to_json())], env=env, capture_output=True,
                             text=True, check=True)
        return re.search(r"UUID: ([0-9a-f-]{36})", out.stdout).group(1)

    def state(run_id: str) -> tuple[str, str | None]:
        s = httpx.get(f"{API}/flow_runs/{run_id}", timeout=10).json()
        return s["state_type"], (s["state"] or {}).get("message")

    def step(run_id: str) -> int:
        try:
            events = read_spool(root / "spool", run_id).events
        except Exception:  # noqa: BLE001 - not spooled yet
            return 0
        return max((e.attrs.get("step", 0) for e in events if e.phase == "train_step"), default=0)

    a = deployment_run(params)
    say("run A", a)
    while step(a) < 20:
        time.sleep(0.5)
    proc = flow_process(a)
    proc.send_signal(signal.SIGSTOP)
    stopped = time.time()
    say(f"A's flow process {proc.pid} SIGSTOPped at step {step(a)}")
    b = deployment_run({**params, "max_steps": 100})
    say("run B", b)
    while state(b)[0] not in FINAL and time.time() - stopped < 600:
        time.sleep(1)
    say("B ended:", state(b))
    at_stop = step(a)
    proc.send_signal(signal.SIGCONT)
    resumed = time.time()
    say(f"A SIGCONTed after {resumed - stopped:.1f} s (its ranks at step {at_stop})")
    while state(a)[0] not in FINAL:
        time.sleep(0.2)
    say(f"A ended {time.time() - resumed:.1f} s after SIGCONT:", state(a))
    events = read_spool(root / "spool", a).events
    trained = max((e.end for e in events if e.phase == "train_step"), default=None)
    withdrawn = [e for e in events if e.phase == "shutdown" and e.attrs.get("withdrawn")]
    say(f"A's ranks trained to step {step(a)} of {params['max_steps']}; their last step ended "
        f"{trained - resumed:+.1f} s from SIGCONT" if trained else "A trained no step",
        f"; withdrawn at {withdrawn[0].start - resumed:+.1f} s, released {withdrawn[0].end - resumed:+.1f} s"
        if withdrawn else "; no withdrawal recorded")
    with Warehouse.open(url) as wh:
        for r in wh.lineage("dlrm"):
            say("lineage:", r.run_id[:8], r.outcome.value, ", ".join(r.windows), (r.reason or "")[:160])
        say("watermark:", wh.watermark("dlrm"))
        for run_id in (a, b):
            rows = wh.runs_frame(run_id=run_id)
            for _, r in rows.iterrows():
                say("ETT row:", run_id[:8], r["status"], f"NoF {r['nof']}", f"wall {r['wall_s']:.1f} s",
                    f"effective steps {r['effective_steps']}")
    say("current ->", json.loads((root / "snapshots" / "current").read_text())["snapshot"])
    say("snapshot folders:", sorted(p.name for p in (root / "snapshots").iterdir()))


def flow_process(run_id: str) -> psutil.Process:
    """The topmost process whose environment names the flow run (the worker passes it)."""
    for p in psutil.process_iter():
        try:
            if p.environ().get("PREFECT__FLOW_RUN_ID") != run_id:
                continue
            parent = p.parent()
            if parent is None or parent.environ().get("PREFECT__FLOW_RUN_ID") != run_id:
                return p
        except psutil.Error:
            continue
    raise SystemExit(f"no process runs flow run {run_id}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/sig"))
