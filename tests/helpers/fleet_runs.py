"""Runs measured without training, for the fleet and automation tests: hand-made timelines
written to a real spool (`spool_timeline`) and archived (`archive_fleet`), and `measured_run`,
a Prefect flow whose run spools such a timeline under its own flow run id and is archived by
ettflow's real state hook (ETT table and timeline artifacts, the `ettflow.run.measured` event).
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow

from ettflow.ett.archive import archive_spooled_run
from ettflow.ett.spool import SpoolWriter
from ettflow.ett.warehouse import RunInfo, Warehouse
from ettflow.tasks.archive import archive_on_flow_state

from helpers.timelines import Timeline

REPO = Path(__file__).resolve().parents[2]
POOL = "ettflow-process"  # conftest.PREFECT_POOL


def spool_timeline(spool: Path, t: Timeline, t0: float) -> None:
    writers: dict[tuple[int, int], SpoolWriter] = {}
    for e in t.events:
        w = writers.get((e.attempt, e.rank)) or writers.setdefault(
            (e.attempt, e.rank), SpoolWriter(spool, t.run_id, e.attempt, e.rank))
        w.record(e.phase, e.start + t0, e.end + t0, sync=False, **e.attrs)
    for w in writers.values():
        w.close()


def fleet_run(run_id: str, compile_s: float, *, failures: int = 0) -> Timeline:
    """2 s scheduling, `compile_s` compile, 20 one-second steps, 2 s shutdown. Each of the
    `failures` kills rank 0 one step after the attempt started training (detected 1 s later);
    the next attempt reschedules (2 s), restores the checkpoint (1 s) and goes on from the
    step it reached: nothing is replayed."""
    t = Timeline(run_id)
    t.mark("submitted", 0).ev("scheduling", 0, 2, rank=-1).ev("pt2_compile", 2, 2 + compile_s)
    s, step = 2 + compile_s, 0
    for _ in range(failures):
        t.steps(s, step, 1).fail(s + 1, s + 2, reason=f"injected kill at step {step + 1}",
                                 failure_class="infrastructure")
        t.next_attempt().ev("scheduling", s + 2, s + 4, rank=-1).ev("checkpoint_restore", s + 4, s + 5)
        s, step = s + 5, step + 1
    return t.steps(s, step, 20 - step).ev("shutdown", s + 20 - step, s + 22 - step, rank=-1)


FLEET = {  # deployment -> compile seconds per run, oldest first: `nightly` regresses at the end
    "nightly": [10, 10, 11, 10, 9, 10, 20, 21, 19],
    "hourly": [4, 4, 5, 4, 4, 4],
}


def archive_fleet(url: str, spool: Path, start: float, *, flow_run_ids: dict[str, str] | None = None) -> list[str]:
    """Spool and archive the FLEET's runs (an hour apart from `start`; the third `hourly` run
    fails once), each tagged with its deployment; their run ids, oldest first."""
    flow_run_ids = flow_run_ids or {}
    done = []
    with Warehouse.open(url) as wh:
        for d, compiles in FLEET.items():
            for i, c in enumerate(compiles):
                run_id = f"{d}-{i}"
                spool_timeline(spool, fleet_run(run_id, c, failures=int(d == "hourly" and i == 2)), start + 3600 * i)
                archive_spooled_run(wh, spool, RunInfo(run_id=run_id, model="dlrm", mode="optimized",
                                                       flow_run_id=flow_run_ids.get(run_id), status="completed",
                                                       tags={"deployment": d}))
                done.append(run_id)
    return done


@flow(name="measured-run", flow_run_name="measured-{compile_s}s-{failures}f", on_completion=[archive_on_flow_state],
      on_failure=[archive_on_flow_state])
def measured_run(spool_root: str, warehouse_url: str, compile_s: float = 10.0, failures: int = 0):
    """Spool `fleet_run` under this flow run's id, ending now; then finish the run as the
    refresh's body does (`finish_run`: archive, artifacts, event), so its state message says
    its ETT."""
    from prefect.context import FlowRunContext
    from prefect.runtime import flow_run
    from prefect.states import Completed

    from ettflow.ett.run_summary import FinalState, state_message
    from ettflow.tasks.archive import finish_run

    t = fleet_run(flow_run.id, compile_s, failures=failures)
    spool_timeline(Path(spool_root), t, time.time() - max(e.end for e in t.events))
    summary = finish_run("measured-run", FlowRunContext.get().flow_run, state=FinalState.COMPLETED,
                         outcome="published", in_body=True)
    return Completed(message=state_message(summary), data=flow_run.id)


def run_as_deployment(env: dict, flow_name: str, deployment: str, entrypoint: str, parameters: dict) -> str:
    """Create the deployment `deployment` of `flow_name` (`entrypoint` in this repository) and
    one flow run of it through the API `env` names, and execute the run as a worker does
    (`prefect flow-run execute`, in this repository); the flow run's id."""
    import subprocess
    import sys
    import time

    import httpx

    api = env["PREFECT_API_URL"]

    def post(path: str, body: dict) -> httpx.Response:
        # as Prefect's own client does (PREFECT_CLIENT_MAX_RETRIES): a 503 of a busy server (its
        # SQLite database timed out; seen on a loaded host) is tried again, a bounded number of times
        for wait_s in (1, 2, 4, 8, 0):
            answer = httpx.post(f"{api}{path}", json=body, timeout=30)
            if answer.status_code != 503 or not wait_s:
                return answer
            time.sleep(wait_s)
        return answer

    flow_id = post("/flows/", {"name": flow_name}).json()["id"]
    made = post("/deployments/", {"name": deployment, "flow_id": flow_id, "entrypoint": entrypoint,
                                  "path": str(REPO), "work_pool_name": POOL})
    assert made.status_code < 300, made.text
    run = post(f"/deployments/{made.json()['id']}/create_flow_run", {"parameters": parameters})
    assert run.status_code < 300, run.text
    run_id = run.json()["id"]
    prefect = str(Path(sys.executable).with_name("prefect"))
    out = subprocess.run([prefect, "flow-run", "execute", run_id], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, f"prefect flow-run execute {run_id} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return run_id
