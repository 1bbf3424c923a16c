#!/usr/bin/env bash
# Sets everything up (fast when already done), then runs the whole test suite in one pytest
# session: tests/unit, tests/integration, tests/e2e (pyproject's testpaths, in that order),
# sharing one Ray, one Prefect harness, one real Prefect server and one compile-cache archive.
# Arguments go to pytest (a test path runs just that).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_browser.sh  # chromium + playwright for tests/e2e/test_browser.py
export RAY_USAGE_STATS_ENABLED=0 PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-120}
exec .venv/bin/python -m pytest "$@"
