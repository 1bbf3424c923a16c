"""The environment a process that runs flows sets before Prefect and Ray are imported."""

from __future__ import annotations

import os

# Prefect's console lines carry their time zone (its default shows a bare local "18:53:12.086", while
# reports and the warehouse are UTC): the standard formatter's date format and its three line
# formats (Prefect's, with the milliseconds dropped: they would follow the zone), read by Prefect's
# logging setup from `PREFECT_LOGGING_<path>` when it is imported
LOG_DATEFMT = "%H:%M:%S %Z"
LOG_FORMATS = {
    "FORMAT": "%(asctime)s | %(levelname)-7s | %(name)s - %(message)s",
    "FLOW_RUN_FMT": "%(asctime)s | %(levelname)-7s | Flow run %(flow_run_name)r - %(message)s",
    "TASK_RUN_FMT": "%(asctime)s | %(levelname)-7s | Task run %(task_run_name)r - %(message)s",
}


def set_env_defaults() -> None:
    """A cold machine needs longer than Prefect's 20 s for the ephemeral API server; no
    analytics; no Ray usage stats; console times labelled with their zone (`LOG_DATEFMT`). A
    value the caller set is kept."""
    if "PREFECT_LOGGING_FORMATTERS_STANDARD_DATEFMT" not in os.environ:  # the caller's format stands whole
        os.environ["PREFECT_LOGGING_FORMATTERS_STANDARD_DATEFMT"] = LOG_DATEFMT
        for key, fmt in LOG_FORMATS.items():
            os.environ.setdefault(f"PREFECT_LOGGING_FORMATTERS_STANDARD_{key}", fmt)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
