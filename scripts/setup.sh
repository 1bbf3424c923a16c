#!/usr/bin/env bash
# One-command setup: creates .venv and installs ettflow with everything it needs.
# Rerunning it when everything is installed takes seconds (a stamp of the inputs is checked).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${ETTFLOW_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3

# Versions: CPU host (default) vs GPU host (nvidia-smi present): the same release on both.
TORCH=2.13.0
FBGEMM=1.8.0
TORCHREC=1.8.0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && [ "${ETTFLOW_FORCE_CPU:-0}" != 1 ]; then
  FLAVOUR=gpu
  # Each torchrec release pairs with one torch + fbgemm-gpu release. A GPU host gets the same
  # release as a CPU host (torch 2.13.0, fbgemm 1.8.0, torchrec 1.8.0): the project's compile
  # cache, DCP staging and torch internals (_torch_compat.py) are written and tested against
  # 2.13, and one release on both hosts is what scripts/gpu_check.sh verifies. The PyPI Linux
  # wheels of torch and fbgemm-gpu are the CUDA builds; torchrec takes fbgemm-gpu as its dependency.
  TORCH_PKGS="torch==${TORCH} fbgemm-gpu==${FBGEMM} torchrec==${TORCHREC}"
else
  FLAVOUR=cpu
  TORCH_PKGS="torch==${TORCH} fbgemm-gpu-cpu==${FBGEMM}"
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
# pip checks what it installs against what is there, and on a CPU host it reports torchrec's
# declared CUDA fbgemm-gpu as missing ("ERROR: pip's dependency resolver ...") although
# fbgemm-gpu-cpu, the same library built for the CPU, is installed: that one note is expected
# and said in words; any other conflict is shown as pip wrote it.
pip_checked() {
  local log conflicts
  log=$(mktemp)
  if ! $PIP "$@" 2>"$log"; then cat "$log" >&2; rm -f "$log"; return 1; fi
  if [ "$FLAVOUR" = cpu ] && grep -q "^ERROR: pip's dependency resolver" "$log"; then
    # the conflict lines: those after the resolver's header
    conflicts=$(awk '/^ERROR: pip.s dependency resolver/ {on = 1; next} on && NF' "$log")
    if ! printf '%s\n' "$conflicts" | grep -vq "^torchrec [0-9.]* requires fbgemm-gpu, which is not installed\.$"; then
      grep -v -e "^ERROR: pip's dependency resolver" \
           -e "^torchrec [0-9.]* requires fbgemm-gpu, which is not installed\.$" "$log" >&2 || true
      echo "setup: torchrec declares the CUDA fbgemm-gpu; this CPU host has fbgemm-gpu-cpu (the same library for CPU), as intended"
      rm -f "$log"
      return 0
    fi
  fi
  cat "$log" >&2
  rm -f "$log"
}
# torch first and pinned, so nothing later pulls a multi-GB CUDA build on a CPU host.
$PIP $TORCH_PKGS
if [ "$FLAVOUR" = cpu ]; then
  # torchrec's declared dependency is the CUDA fbgemm-gpu: install it without deps.
  pip_checked --no-deps "torchrec==${TORCHREC}"
fi
# TorchRec's own needs, then the project (editable) with its dev extras.
pip_checked tensordict "torchmetrics==1.0.3" tqdm pyre-extensions iopath
pip_checked -e ".[dev]"
echo "$STAMP_INPUTS" > "$STAMP"
echo "setup: done"
