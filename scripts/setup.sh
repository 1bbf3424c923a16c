#!/usr/bin/env bash
# One-command setup: creates .venv and installs ettflow with everything it needs.
# Rerunning it when everything is installed takes seconds (a stamp of the inputs is checked).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${ETTFLOW_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3

# Versions: CPU host (default) vs GPU host (nvidia-smi present).
TORCH_CPU=2.13.0
FBGEMM_CPU=1.8.0
TORCHREC=1.8.0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && [ "${ETTFLOW_FORCE_CPU:-0}" != 1 ]; then
  FLAVOUR=gpu
  # Each torchrec release pairs with one torch + fbgemm-gpu release.
  TORCH_PKGS="torch==2.8.0 fbgemm-gpu==1.3.0 torchrec==1.3.0"
else
  FLAVOUR=cpu
  TORCH_PKGS="torch==${TORCH_CPU} fbgemm-gpu-cpu==${FBGEMM_CPU}"
fi

STAMP_INPUTS="$FLAVOUR $TORCH_PKGS $(sha1sum pyproject.toml scripts/setup.sh | sha1sum)"
STAMP="$VENV/.ettflow-setup-stamp"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_INPUTS" ]; then
  echo "setup: .venv is up to date ($FLAVOUR)"
  exit 0
fi

echo "setup: creating $VENV ($FLAVOUR host)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip install --quiet --disable-pip-version-check"
# this machine's pip config names local indexes that may be absent: drop those warnings only
exec 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
# torch first and pinned, so nothing later pulls a multi-GB CUDA build on a CPU host.
$PIP $TORCH_PKGS
if [ "$FLAVOUR" = cpu ]; then
  # torchrec's declared dependency is the CUDA fbgemm-gpu: install it without deps.
  $PIP --no-deps "torchrec==${TORCHREC}"
fi
# TorchRec's own needs, then the project (editable) with its dev extras.
$PIP tensordict "torchmetrics==1.0.3" tqdm pyre-extensions iopath
$PIP -e ".[dev]"
echo "$STAMP_INPUTS" > "$STAMP"
echo "setup: done"
