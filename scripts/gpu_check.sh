#!/usr/bin/env bash
# The GPU host check, in two parts.
#
#   bash scripts/gpu_check.sh [--part 1|2|all] [--keep] [--dry-run-cpu] [--state-mb N]
#
# Part 1 needs only torch (no TorchRec, fbgemm-gpu, Ray or Prefect): it runs on a bare GPU host
# with a CUDA torch and this source tree (python -m ettflow.bench.gpu_part1, PYTHONPATH=.):
# the training (NCCL) and control (gloo) groups at world size 1 through ettflow's collectives
# module, the dense step compiled cold and then warm from ettflow's compile-cache archive on
# CUDA (ratio), sync vs pinned-staged save blocking of a dense state of --state-mb (default
# 256; ratio), and a restore from the pinned copy equal to the original bitwise. Without CUDA
# it runs on the CPU, says in its title that it is not a GPU result, and exits 0.
#
# Part 2 needs the full install (scripts/setup.sh on the GPU host):
#   1. the CUDA build imports: torch built with CUDA and seeing a GPU, an fbgemm-gpu CUDA op
#      on the device, torchrec (the versions setup.sh pairs: one release on CPU and GPU hosts);
#   2. a 1-rank refresh with device=cuda through the real `ettflow refresh` command (its own
#      ETTFLOW_HOME and PREFECT_HOME), cold: an empty compile cache;
#   3. the same refresh again on the same work root: the compile cache is restored (warm);
#   4. a table: versions, each run's status, ETT%, pt2_compile seconds, cache hit, and the
#      warm/cold compile ratio on CUDA, measured side by side in this one run.
# Where TorchRec or fbgemm-gpu is not installed, part 2 says so and is skipped (exit 0 when part 1
# passed). On a host without CUDA part 2 stops at step 1 with exit status 2 and says why.
# --dry-run-cpu runs part 2's steps 2-4 on the CPU, to check the script itself on a CPU host:
# its table is marked as not a GPU result and it exits 3.
#
# Record the tables in BENCHMARKS.md with the command line, the GPU and the torch version.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=$(command -v python3); fi
fi
PY=$PYTHON
ETTFLOW=$(dirname "$PY")/ettflow
DEVICE=cuda
KEEP=0
PART=all
STATE_MB=256
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run-cpu) DEVICE=cpu ;;
    --keep) KEEP=1 ;;
    --part) PART=${2:-}; shift ;;
    --state-mb) STATE_MB=${2:-}; shift ;;
    *) echo "gpu_check: unknown argument $1 (use --part 1|2|all, --keep, --dry-run-cpu, --state-mb N)" >&2; exit 64 ;;
  esac
  shift
done
case "$PART" in 1|2|all) ;; *) echo "gpu_check: --part takes 1, 2 or all, got '$PART'" >&2; exit 64 ;; esac
[ -x "$PY" ] || { echo "gpu_check: no Python at $PY: run scripts/setup.sh first (or set PYTHON)" >&2; exit 2; }

# ---- part 1: torch only ------------------------------------------------------------------------
if [ "$PART" != 2 ]; then
  echo "gpu_check: part 1 (torch only)"
  PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} "$PY" -m ettflow.bench.gpu_part1 --state-mb "$STATE_MB" \
    || { echo "gpu_check: FAILED: part 1 (above)" >&2; exit 1; }
  [ "$PART" = 1 ] && exit 0
fi

# ---- part 2: the full 1-rank refresh -----------------------------------------------------------
if ! "$PY" -c 'import torchrec, fbgemm_gpu' >/dev/null 2>&1; then
  echo "gpu_check: part 2 SKIPPED: TorchRec or fbgemm-gpu is not installed for $PY (run scripts/setup.sh on this host)"
  exit 0
fi

WORK=$(mktemp -d -t ettflow-gpu-check-XXXX)
[ "$KEEP" = 1 ] && echo "gpu_check: work folder $WORK (kept)" || trap 'rm -rf "$WORK"' EXIT
export ETTFLOW_HOME=$WORK/home PREFECT_HOME=$WORK/prefect ETTFLOW_WAREHOUSE_URL=sqlite:///$WORK/warehouse.db
export RAY_USAGE_STATS_ENABLED=0 PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-180}
unset RAY_ADDRESS  # a local Ray with this machine's GPU, not a cluster the shell happens to name

# ---- 1. the CUDA build imports ---------------------------------------------------------------
if [ "$DEVICE" = cuda ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: FAILED: no NVIDIA GPU on this host (nvidia-smi missing or lists none)." >&2
    echo "gpu_check: run this on a GPU machine; on a CPU host, --dry-run-cpu checks the script itself." >&2
    exit 2
  fi
  "$PY" - > "$WORK/imports.json" <<'EOF' || { echo "gpu_check: FAILED: the CUDA build does not import or run (above)" >&2; exit 2; }
import json, sys
import torch
problems = []
if torch.version.cuda is None:
    problems.append(f"torch {torch.__version__} is a CPU build: rerun scripts/setup.sh on this GPU host "
                    "(it installs the CUDA wheels when nvidia-smi lists a GPU)")
elif not torch.cuda.is_available():
    problems.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: check the driver "
                    "(nvidia-smi) and CUDA_VISIBLE_DEVICES")
if problems:
    print("\n".join(problems), file=sys.stderr)
    sys.exit(1)
import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torchrec
x = torch.tensor([1, 2, 3], dtype=torch.int64, device="cuda")
cumsum = torch.ops.fbgemm.asynchronous_complete_cumsum(x).tolist()  # an fbgemm-gpu CUDA kernel
if cumsum != [0, 1, 3, 6]:
    print(f"fbgemm_gpu's CUDA cumsum gave {cumsum}, expected [0, 1, 3, 6]", file=sys.stderr)
    sys.exit(1)
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
                  "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"), "torchrec": torchrec.__version__,
                  "fbgemm_cuda_op": "ok"}))
EOF
else
  echo "gpu_check: DRY RUN on the CPU: checks the script, not a GPU (no CUDA import check)"
  "$PY" -c 'import json, torch, torchrec, fbgemm_gpu; print(json.dumps({"torch": torch.__version__, "cuda": None,
"gpu": "none (dry run on cpu)", "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"),
"torchrec": torchrec.__version__, "fbgemm_cuda_op": "not run"}))' > "$WORK/imports.json"
fi
echo "gpu_check: imports $(cat "$WORK/imports.json")"

# ---- 2./3. a 1-rank refresh, cold then warm ----------------------------------------------------
"$ETTFLOW" data generate --out "$WORK/data" --windows 3 --rows-per-window 4096 --seed 0 >/dev/null
mapfile -t WINDOWS < <(find "$WORK/data" -mindepth 1 -maxdepth 1 -type d -printf '%f\n' | sort)
refresh() {  # $1: cold|warm; explicit windows, so the second refresh trains again (not skipped)
  echo "gpu_check: refresh ($1, device=$DEVICE)"
  "$ETTFLOW" refresh --no-failure --world-size 1 --batch-size 256 --max-steps 40 \
    --data-root "$WORK/data" --window "${WINDOWS[0]}" --window "${WINDOWS[1]}" \
    --param device="\"$DEVICE\"" --param warm_start=false --param work_root="\"$WORK/shared\"" \
    --param tags="{\"gpu_check\": \"$1\"}" > "$WORK/refresh-$1.log" 2>&1 \
    || { tail -40 "$WORK/refresh-$1.log" >&2; echo "gpu_check: FAILED: the $1 refresh (log above)" >&2; exit 1; }
}
refresh cold
refresh warm

# ---- 4. the table -------------------------------------------------------------------------------
"$PY" - "$WORK/imports.json" "$DEVICE" <<'EOF'
import json, os, sys
from ettflow.ett.warehouse import Warehouse

imports, device = json.load(open(sys.argv[1])), sys.argv[2]
with Warehouse.open(os.environ["ETTFLOW_WAREHOUSE_URL"]) as wh:
    runs = wh.runs_frame().sort_values("wall_start")
    rows = {}
    for _, run in runs.iterrows():
        events = wh.table_frame("events", run["run_id"])
        which = run["tags"].get("gpu_check")
        compile_s = sum(e - s for p, s, e in zip(events["phase"], events["start"], events["end"]) if p == "pt2_compile")
        hits = [a.get("hit") for p, a in zip(events["phase"], events["attrs"]) if p == "compile_cache_restore"]
        rows[which] = dict(status=run["status"], ett=run["ett_pct"], wall=run["wall_s"], compile=compile_s,
                           hit=any(hits), steps=run["effective_steps"])
if set(rows) != {"cold", "warm"}:
    sys.exit(f"gpu_check: FAILED: expected a cold and a warm run in the warehouse, found {sorted(rows)}")
cold, warm = rows["cold"], rows["warm"]
ratio = 100.0 * warm["compile"] / cold["compile"] if cold["compile"] > 0 else float("nan")
title = "GPU check" if device == "cuda" else "GPU check: DRY RUN ON CPU, NOT A GPU RESULT"
print(f"\n## {title}\n")
print("| item | value |\n|---|---|")
for key in ("gpu", "torch", "cuda", "fbgemm_gpu", "torchrec", "fbgemm_cuda_op"):
    print(f"| {key} | {imports[key]} |")
print("\n| refresh (1 rank, device=%s) | status | wall s | ETT%% | pt2_compile s | cache hit | steps |" % device)
print("|---|---|---|---|---|---|---|")
for name, r in (("cold", cold), ("warm", warm)):
    print(f"| {name} | {r['status']} | {r['wall']:.1f} | {r['ett']:.2f} | {r['compile']:.2f} | {r['hit']} | {r['steps']} |")
print(f"\nwarm/cold compile: {ratio:.1f}% (pt2_compile of the warm refresh over the cold one's)")
bad = [f"{n} refresh {r['status']}" for n, r in rows.items() if r["status"] != "completed"]
bad += ["the warm refresh missed the compile cache"] if not warm["hit"] else []
if bad:
    sys.exit("gpu_check: FAILED: " + "; ".join(bad))
if device != "cuda":
    print("gpu_check: dry run on the CPU passed; this is not a GPU result", file=sys.stderr)
    sys.exit(3)
print("gpu_check: OK")
EOF
