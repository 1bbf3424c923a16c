#!/usr/bin/env bash
# Sets everything up (fast when already done), then runs the whole test suite in one pytest
# run: tests/unit, tests/integration, tests/e2e (pyproject's testpaths), on two xdist workers
# (tests/conftest.py sends each test file whole to one worker, the costliest first, and the
# deployed-path files, which share the real Prefect server, together).
# Arguments go to pytest (a test path runs just that; `-n 0` runs in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_browser.sh  # chromium + playwright for tests/e2e/test_browser.py
export RAY_USAGE_STATS_ENABLED=0 PREFECT_SERVER_ANALYTICS_ENABLED=false
# one OpenMP thread a process: two xdist workers on two cores, each starting rank processes, flow
# processes and publishes, would otherwise run torch's default of one thread a core in each, and
# OpenMP's spinning threads starve one another (a publish's reference pass under that load: 13.3 s
# with 2 threads, 1.3 s with 1; the whole suite 1519 s -> 1382 s). Ray's actors get 1 already.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-120}
# a worker that crashes is not restarted: conftest's scheduler sends the crashed file again
# from its start, so each restart re-ran the crashing test (minutes for an e2e) and ran nothing
# new (tried: a crash at a file's first test ran it 9 times); the run is red either way
exec .venv/bin/python -m pytest -n 2 --max-worker-restart=0 "$@"
