#!/usr/bin/env bash
# Sets everything up (fast when already done), then runs the whole test suite.
# Two pytest sessions: the tests that start the real `ettflow refresh` command as a process
# (and kill it) run in a session of their own, apart from the session that holds a shared Ray
# and Prefect harness (see the note in tests/test_refresh_process.py). Naming test paths runs
# one session with just those.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_browser.sh  # chromium + playwright for tests/test_browser.py
export RAY_USAGE_STATS_ENABLED=0 PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-120}
PY=.venv/bin/python
for arg in "$@"; do
  # a test path given (tests/x.py, tests/x.py::test_y, a folder): one session with just those
  if [ "${arg#-}" = "$arg" ] && [ -e "${arg%%::*}" ]; then exec $PY -m pytest "$@"; fi
done
PROCESS_TESTS=(tests/test_refresh_process.py tests/test_console.py)
ignores=()
for t in "${PROCESS_TESTS[@]}"; do ignores+=(--ignore "$t"); done
rc=0
$PY -m pytest "$@" "${ignores[@]}" || rc=$?
rc2=0
$PY -m pytest "$@" "${PROCESS_TESTS[@]}" || rc2=$?
[ "$rc" -ne 0 ] && exit "$rc"
exit "$rc2"
