"""Which warehouse a run writes to, and the check that it can before anything is reserved.

The URL never travels as a flow parameter with a password in it (Prefect stores parameters
in clear). `resolve_warehouse_url` is the one place tasks and hooks find it, first match wins:

1. the Prefect `Secret` block named by the `warehouse_secret` parameter (its value is the URL);
2. the `warehouse_url` parameter (password-free; one with a password is refused);
3. None: `Warehouse.open` then takes `ETTFLOW_WAREHOUSE_URL`, else the per-user SQLite file.

`check_warehouse` is the refresh's first task: it opens the warehouse (connect + schema
upgrade) and, when it cannot, fails the run at once with one redacted message that says
which setting to fix, before the trainer is reserved or anything is spooled.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed, State
from sqlalchemy.exc import SQLAlchemyError

from ettflow.ett.redact import redact_url, scrub
from ettflow.ett.warehouse import Warehouse, WarehouseError
from ettflow.ett.warehouse_db import ENV_URL, default_url

from .errors import ParameterError
from .parameters import WarehouseParams


class WarehouseUnavailable(RuntimeError):
    """The run's warehouse cannot be opened; the message shows the URL redacted and says what to fix."""

    explained = True  # shown without a traceback (`ettflow.console`)


def warehouse_params(where: WarehouseParams | Mapping[str, Any]) -> WarehouseParams:
    """The two warehouse parameters, checked (a password in `warehouse_url` is refused:
    Prefect stores parameters in clear; no message shows the URL)."""
    return where if isinstance(where, WarehouseParams) else WarehouseParams.of(where)


def resolve_warehouse_url(where: WarehouseParams | Mapping[str, Any]) -> str | None:
    """The warehouse URL named by a run's parameters (see the module docstring); None: the default."""
    where = warehouse_params(where)
    secret = where.warehouse_secret
    if secret:
        from prefect.blocks.system import Secret

        try:
            value = Secret.load(secret).get()
        except ValueError as exc:  # no such block (Prefect says ValueError / ObjectNotFound)
            raise ParameterError("warehouse_secret", f"names no readable Prefect Secret block {secret!r} ({exc}); "
                                 "create it with `Secret(value=URL).save(NAME)` or in the UI") from None
        if not isinstance(value, str) or not value:
            raise ParameterError("warehouse_secret", f"block {secret!r} must hold the warehouse URL as a string")
        return value
    return where.warehouse_url or None


def warehouse_source(where: WarehouseParams | Mapping[str, Any]) -> str:
    """Which setting named the warehouse, for messages that say what to fix."""
    where = warehouse_params(where)
    if where.warehouse_secret:
        return f"the Prefect Secret block {where.warehouse_secret!r} (parameter warehouse_secret)"
    if where.warehouse_url:
        return "the warehouse_url parameter"
    if os.environ.get(ENV_URL):
        return ENV_URL
    return f"the default SQLite file's folder, or set {ENV_URL}"


def open_check(params: WarehouseParams | Mapping[str, Any]) -> str:
    """Open and close the warehouse the parameters name; returns its redacted URL, or raises
    `WarehouseUnavailable` with a one-line, redacted message."""
    url = resolve_warehouse_url(params)
    target = url if url is not None else default_url()
    shown = redact_url(target)
    try:
        with Warehouse.open(url):
            return shown
    except (WarehouseError, SQLAlchemyError, OSError) as exc:
        cause = exc.__cause__ if isinstance(exc, WarehouseError) and exc.__cause__ is not None else exc
        reason = " ".join(str(getattr(cause, "orig", None) or cause).split())
        raise WarehouseUnavailable(scrub(f"warehouse {shown} is unreachable: {reason}; fix "
                                         f"{warehouse_source(params)}", target)) from None


@task(name="check-warehouse", cache_policy=NO_CACHE)
def check_warehouse(warehouse: WarehouseParams) -> str | State:
    """Fail fast: the run's warehouse (`RefreshPlan.warehouse`) opens (connect + schema), else a
    Failed state carrying `WarehouseUnavailable` or `ParameterError` (no traceback: the message
    is the whole story)."""
    try:
        shown = open_check(warehouse)
    except (ParameterError, WarehouseUnavailable) as exc:  # e.g. no such Secret block; unreachable
        return Failed(message=str(exc), data=exc)
    get_run_logger().info("warehouse %s is reachable", shown)
    return shown


def refusal(checked: State) -> State:
    """The flow's own final state for a failed check (a flow that returned the task's state
    would say only "1/1 states failed"): the same message and typed failure."""
    return Failed(message=checked.message, data=checked.result(raise_on_failure=False))


def error_text(exc: BaseException, where: WarehouseParams | Mapping[str, Any], *, trace: bool = False) -> str:
    """One line about `exc` (`ett.archive.outage_reason`), or with `trace` its whole traceback,
    with every secret of the URL the run's parameters name hidden, should a driver's message quote
    it, and any other URL's (`scrub_urls`): for a log line or a message. The URL is resolved again
    (an error path only); when that fails too, only the other URLs' are hidden."""
    from ettflow.ett.archive import outage_reason, outage_trace
    from ettflow.ett.warehouse import default_url

    try:
        url = resolve_warehouse_url(where) or default_url()
    except Exception:  # noqa: BLE001 - a secret store down: nothing to hide that it could give
        url = None
    return outage_trace(exc, url) if trace else outage_reason(exc, url)
