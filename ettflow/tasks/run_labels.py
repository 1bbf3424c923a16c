"""What the Prefect API holds about a refresh beside its state: its name and its tags, and the
message of a state the flow did not set itself (crashed, cancelled, failed outside its body).

The strings come from `ett.run_summary`; this module only writes them, by the flow run's id
(never through the run context: the crash hook runs in another process). A refresh is
renamed once its windows are claimed (`name_flow_run`), and tagged when it is archived
(`tag_flow_run`). A run that Prefect marked CRASHED or CANCELLED (or FAILED where the flow
body could not finish it) gets a second state of the same type that carries the ETT message
(`restate_with_message`): the first one's message was Prefect's, and a state cannot be
edited. Without a Prefect API (a plain function call) these do nothing; an API error is
logged, never raised over the run.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Sequence
from uuid import UUID

log = logging.getLogger("ettflow.tasks")


def _api() -> bool:
    from prefect.settings import PREFECT_API_URL

    return bool(PREFECT_API_URL.value())


def _flow_run_id(flow_run_id: str) -> UUID | None:
    try:
        return UUID(str(flow_run_id))
    except ValueError:  # "local": the flow ran without a flow run
        return None


def name_flow_run(flow_run_id: str, name: str) -> bool:
    """Rename the flow run (e.g. once its windows are known); whether it was renamed."""
    fr = _flow_run_id(flow_run_id)
    if fr is None or not _api():
        return False
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            client.set_flow_run_name(fr, name)
    except Exception:  # noqa: BLE001 - the name is for the UI; the run goes on
        log.warning("could not rename flow run %s to %r", flow_run_id, name, exc_info=True)
        return False
    return True


def current_tags(flow_run_id: str) -> list[str]:
    fr = _flow_run_id(flow_run_id)
    if fr is None or not _api():
        return []
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return list(client.read_flow_run(fr).tags or [])
    except Exception:  # noqa: BLE001
        log.warning("could not read the tags of flow run %s", flow_run_id, exc_info=True)
        return []


def tag_flow_run(flow_run_id: str, tags: Sequence[str]) -> bool:
    """Replace the flow run's tags with `tags` (`ett.run_summary.run_tags` keeps the others)."""
    fr = _flow_run_id(flow_run_id)
    if fr is None or not _api():
        return False
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            client.update_flow_run(fr, tags=list(tags))
    except Exception:  # noqa: BLE001
        log.warning("could not tag flow run %s with %s", flow_run_id, list(tags), exc_info=True)
        return False
    return True


def restate_with_message(flow_run_id: str, state_type: str, message: str) -> bool:
    """Set a new FAILED, CRASHED or CANCELLED state carrying `message` on the flow run (forced:
    the run is in a final state already). Called by the hooks of those states, after archiving."""
    fr = _flow_run_id(flow_run_id)
    if fr is None or not _api():
        return False
    from prefect.states import Cancelled, Crashed, Failed

    make = {"failed": Failed, "crashed": Crashed, "cancelled": Cancelled}.get(state_type)
    if make is None:
        raise ValueError(f"restate_with_message sets failed, crashed or cancelled states, not {state_type!r}")
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            client.set_flow_run_state(fr, make(message=message), force=True)
    except Exception:  # noqa: BLE001
        log.warning("could not set the %s message of flow run %s", state_type, flow_run_id, exc_info=True)
        return False
    return True


RESTATE_WAIT_S = 60.0  # how long a cancelled run's message waits for the runner's CANCELLED


def restate_when_final(flow_run_id: str, state_type: str, message: str) -> subprocess.Popen:
    """`restate_with_message` once the run's state is `state_type`: a runner that cancels a run
    runs its hooks while it is CANCELLING, then sets its own CANCELLED ("Flow run was cancelled
    successfully.") over whatever a hook set, and the process that ran the hooks may end right
    after. So a process of its own waits for that state (`wait_then_restate`, at most
    `RESTATE_WAIT_S`) and sets the message again; its argv holds the id and the ETT message,
    nothing secret, and it inherits the hook's Prefect settings."""
    return subprocess.Popen([sys.executable, "-m", "ettflow.tasks.run_labels", flow_run_id, state_type, message],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def wait_then_restate(flow_run_id: str, state_type: str, message: str, *, wait_s: float = RESTATE_WAIT_S,
                      poll_s: float = 0.5) -> bool:
    """Wait until the run's state is `state_type`, then set `message` on it unless it carries
    it; whether it was set (False: no API, never that state within `wait_s`, or refused)."""
    fr = _flow_run_id(flow_run_id)
    if fr is None or not _api():
        return False
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            state = client.read_flow_run(fr).state
            if state is not None and state.type.value.lower() == state_type:
                return state.message == message or restate_with_message(flow_run_id, state_type, message)
            time.sleep(poll_s)
    log.warning("flow run %s was not %s within %.0f s: its message is Prefect's", flow_run_id, state_type, wait_s)
    return False


def deployment_name(flow_run) -> str | None:
    """The name of the deployment that started `flow_run` (None: none, or the API cannot say)."""
    if not getattr(flow_run, "deployment_id", None):
        return None
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return client.read_deployment(flow_run.deployment_id).name
    except Exception:  # noqa: BLE001 - the key falls back to the flow name
        log.warning("could not read deployment %s", flow_run.deployment_id, exc_info=True)
        return None


if __name__ == "__main__":  # `restate_when_final`'s process: FLOW_RUN_ID STATE_TYPE MESSAGE
    raise SystemExit(0 if wait_then_restate(*sys.argv[1:4]) else 1)
