"""The environment a process that runs flows sets before Prefect and Ray are imported."""

from __future__ import annotations

import os


def set_env_defaults() -> None:
    """A cold machine needs longer than Prefect's 20 s for the ephemeral API server; no
    analytics; no Ray usage stats. A value the caller set is kept."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
