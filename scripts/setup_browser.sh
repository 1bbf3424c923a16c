#!/usr/bin/env bash
# What tests/test_browser.py drives: Debian's `chromium` (headless) and Playwright's Python
# package, which drives that browser by its path (no browser download). Idempotent: when both
# are there it returns at once. Called by scripts/test.sh after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ETTFLOW_VENV:-$PWD/.venv}
if ! command -v chromium >/dev/null 2>&1; then
  echo "setup_browser: installing Debian's chromium (apt-get)"
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null
fi
# playwright is in the `dev` extras (scripts/setup.sh installs it); a venv made before it was there gets it here
"$VENV/bin/python" -c "import playwright.sync_api" 2>/dev/null \
  || "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "playwright>=1.40"
echo "setup_browser: $(chromium --version 2>/dev/null | head -1), playwright $("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("playwright"))')"
