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
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from ettflow.ett.redact import has_password, redact_url
from ettflow.ett.warehouse import Warehouse, WarehouseError
from ettflow.ett.warehouse_db import ENV_URL, default_url

from .errors import ParameterError


class WarehouseUnavailable(RuntimeError):
    """The run's warehouse cannot be opened; the message shows the URL redacted and says what to fix."""

    explained = True  # shown without a traceback (`ettflow.console`)


def check_warehouse_params(url: Any, secret: Any) -> None:
    """Refuse a `warehouse_url` with a password (Prefect stores parameters in clear) and a
    `warehouse_secret` that is not a block name. Neither message shows the URL."""
    if url is not None and (not isinstance(url, str) or not url):
        raise ParameterError("warehouse_url", "must be a SQLAlchemy URL string or null")
    if url and has_password(url):
        raise ParameterError("warehouse_url", "holds a password, and flow parameters are stored in clear: put the "
                             "URL in ETTFLOW_WAREHOUSE_URL, or in a Prefect Secret block named by "
                             "`warehouse_secret`")
    if secret is not None and (not isinstance(secret, str) or not secret):
        raise ParameterError("warehouse_secret", f"must be the name of a Prefect Secret block or null, got {secret!r}")


def resolve_warehouse_url(params: Mapping[str, Any]) -> str | None:
    """The warehouse URL named by a run's parameters (see the module docstring); None: the default."""
    url, secret = params.get("warehouse_url"), params.get("warehouse_secret")
    check_warehouse_params(url, secret)
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
    return url or None


def warehouse_source(params: Mapping[str, Any]) -> str:
    """Which setting named the warehouse, for messages that say what to fix."""
    if params.get("warehouse_secret"):
        return f"the Prefect Secret block {params['warehouse_secret']!r} (parameter warehouse_secret)"
    if params.get("warehouse_url"):
        return "the warehouse_url parameter"
    if os.environ.get(ENV_URL):
        return ENV_URL
    return f"the default SQLite file's folder, or set {ENV_URL}"


def _scrubbed(text: str, url: str) -> str:
    try:
        password = make_url(url).password
    except Exception:  # noqa: BLE001 - unparseable: redact_url already hides what it can
        password = None
    return text.replace(password, "***") if password else text


def open_check(params: Mapping[str, Any]) -> str:
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
        raise WarehouseUnavailable(_scrubbed(f"warehouse {shown} is unreachable: {reason}; fix "
                                             f"{warehouse_source(params)}", target)) from None


@task(name="check-warehouse", cache_policy=NO_CACHE)
def check_warehouse(warehouse: Mapping[str, str | None]) -> str | State:
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
