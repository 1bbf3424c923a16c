"""`ettflow down` cancels the refreshes its worker runs before it stops it (`stack.deployed_runs.
cancel_running`), on the session's Prefect test harness: which runs it cancels, and how it waits.
What the worker does with a cancel (the ranks' emergency checkpoint, no failure, the ETT
message): e2e/test_deployed_crash.py."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

pytestmark = pytest.mark.timeout(300)


def _deployment(client, pool: str):
    from prefect.client.schemas.actions import WorkPoolCreate

    from ettflow.flows.refresh import refresh_model

    client.create_work_pool(WorkPoolCreate(name=pool, type="process"), overwrite=True)
    return client.create_deployment(flow_id=client.create_flow(refresh_model), name=f"d-{uuid.uuid4().hex[:6]}",
                                    work_pool_name=pool)


def test_down_cancels_the_running_refreshes_of_its_pool_and_waits_for_them(prefect_harness):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Cancelled, Running

    from ettflow.stack.deployed_runs import cancel_running

    pool, other = f"p-{uuid.uuid4().hex[:6]}", f"q-{uuid.uuid4().hex[:6]}"
    said: list[str] = []
    with get_client(sync_client=True) as client:
        mine, theirs = _deployment(client, pool), _deployment(client, other)
        running = client.create_flow_run_from_deployment(mine, state=Running())
        waiting = client.create_flow_run_from_deployment(mine)  # scheduled: left to the schedule
        elsewhere = client.create_flow_run_from_deployment(theirs, state=Running())

        def worker() -> None:  # what the pool's worker does with a CANCELLING run, a moment later
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                state = client.read_flow_run(running.id).state
                if state.is_cancelling():
                    assert state.message == "stopped by `ettflow down`"
                    time.sleep(0.5)
                    client.set_flow_run_state(running.id, Cancelled(message="ETT 9.9% · NoF 0 · cancelled"),
                                              force=True)
                    return
                time.sleep(0.1)

        thread = threading.Thread(target=worker)
        thread.start()
        ended = cancel_running(PREFECT_API_URL.value(), pool, timeout_s=30, poll_s=0.2, say=said.append)
        thread.join()
        assert [(r.run_id, r.state) for r in ended] == [(str(running.id), "CANCELLED")]
        assert ended[0].message.startswith("ETT 9.9%") and 0.5 <= ended[0].seconds < 30
        assert client.read_flow_run(waiting.id).state.is_scheduled()
        assert client.read_flow_run(elsewhere.id).state.is_running()  # another pool's: not this stack's
        assert any("cancelling the running refresh" in line for line in said), said
        # nothing running: nothing to wait for; a run nobody ends is said, after the bound
        assert cancel_running(PREFECT_API_URL.value(), pool, timeout_s=5, say=said.append) == []
        stuck = client.create_flow_run_from_deployment(mine, state=Running())
        assert cancel_running(PREFECT_API_URL.value(), pool, timeout_s=1, poll_s=0.2, say=said.append) == []
        assert client.read_flow_run(stuck.id).state.is_cancelling()
        assert "did not end within 1 s of its cancel" in said[-1], said
