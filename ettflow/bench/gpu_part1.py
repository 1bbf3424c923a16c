"""The GPU check's part 1: what needs only torch, so it runs on a bare GPU host (a CUDA torch,
no TorchRec, fbgemm-gpu, Ray or Prefect).

    python -m ettflow.bench.gpu_part1 [--state-mb 256] [--repeats 3] [--out results.json]
    (scripts/gpu_check.sh --part 1 runs it)

1. **Groups**: the rank's training (NCCL on CUDA), control and checkpoint (gloo) groups at world
   size 1 through `trainer/collectives.py`: a device all-reduce and the dense gradients' average
   on the training group, a control all-reduce, the training group refusing a CPU tensor, and the
   teardown after a failure (NCCL: communicators aborted, then destroyed).
2. **Compile**: the DLRM dense step (TorchRec's layers in plain torch where TorchRec is absent)
   compiled cold in a fresh process that saves ettflow's compile-cache archive, then warm in
   another fresh process that restores it: first-step seconds and the warm/cold ratio.
3. **Save blocking**: a dense state of `--state-mb` on the device, saved synchronously
   (`torch.save` from the device: the loop waits for the copy and the write) against staged
   (the memory tier's `HostCopy`: a copy into pinned host buffers, the write in the
   background): the loop's blocking seconds, median of `--repeats`, and their ratio.
4. **Restore**: the staged host copy copied back into fresh device tensors, equal bitwise.

On a host without CUDA it runs on the CPU (gloo, unpinned buffers), says so in its title, and
exits 0: that checks the code, it is not a GPU result. Exit 1: a check failed (a wrong value, a
refusal that did not happen, a warm compile that missed the archive, a restore that differs);
the timings and ratios are measurements, printed for BENCHMARKS.md, never pass/fail.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Row:
    part: str
    check: str
    value: str
    ok: bool


def _groups(device, work: Path) -> list[Row]:
    import torch

    from ettflow.trainer.collectives import CollectiveDeviceError, Groups

    rows = []
    t0 = time.perf_counter()
    groups = Groups.form(device, init_method=f"file://{work}/pg", rank=0, world_size=1, timeout_s=60)
    rows.append(Row("groups", "form training + control + checkpoint",
                    f"{groups.training.backend} / {groups.control.backend} / {groups.checkpoint.backend}, "
                    f"{time.perf_counter() - t0:.2f} s", True))
    x = groups.training.all_reduce(torch.arange(4.0, device=device))
    rows.append(Row("groups", f"training all_reduce ({device.type} tensor)", str(x.tolist()),
                    x.tolist() == [0.0, 1.0, 2.0, 3.0]))
    p = torch.nn.Parameter(torch.ones(3, device=device))
    p.grad = torch.full((3,), 2.0, device=device)
    groups.training.average_grads([p])
    rows.append(Row("groups", "training average_grads", str(p.grad.tolist()), p.grad.tolist() == [2.0] * 3))
    rows.append(Row("groups", "control max_of (CPU)", str(groups.control.max_of([1.5, -2.0])),
                    groups.control.max_of([1.5, -2.0]) == [1.5, -2.0]))
    # NCCL refuses a CPU tensor; on a CPU host the check that stands for it (collective_check="as_nccl")
    strict = groups.training if device.type == "cuda" else replace(groups.training, refuses_cpu=True)
    try:
        strict.all_reduce(torch.ones(1))
        refused = "accepted"
    except CollectiveDeviceError as exc:
        refused = f"refused: {str(exc)[:60]}..."
    rows.append(Row("groups", "training refuses a CPU tensor", refused, refused.startswith("refused")))
    t0 = time.perf_counter()
    groups.teardown(failed=True)
    rows.append(Row("groups", "teardown after a failure",
                    f"{'abort + destroy' if groups.training.backend == 'nccl' else 'destroy'}, "
                    f"{time.perf_counter() - t0:.2f} s", not torch.distributed.is_initialized()))
    return rows


def _compile(device, work: Path) -> tuple[list[Row], dict]:
    from ettflow.trainer.compile.probe_cold_warm import DenseSize, spawn

    size, root = DenseSize(), work / "archives"
    cold = spawn("cold", root, work / "cold", size, 1, device.type)
    warm = spawn("warm", root, work / "warm", size, 1, device.type)
    ratio = warm["first_step_s"] / cold["first_step_s"] if cold["first_step_s"] > 0 else float("nan")
    rows = [Row("compile", "cold first step (compile + fwd + bwd)", f"{cold['first_step_s']:.2f} s, archive "
                f"{cold.get('archive_bytes', 0) / 2**20:.1f} MiB saved in {cold.get('save_s', 0):.2f} s", True),
            Row("compile", "warm first step (archive restored)", f"{warm['first_step_s']:.2f} s, restore "
                f"{warm['restore_s']:.2f} s, hit {warm['hit']}", bool(warm["hit"])),
            Row("compile", "warm / cold first step", f"{ratio:.3f} ({100 * ratio:.1f}%)", True)]
    return rows, {"cold": cold, "warm": warm, "ratio": ratio}


def _save_blocking(device, work: Path, state_mb: int, repeats: int) -> tuple[list[Row], dict]:
    import torch

    from ettflow.trainer.checkpoint.memory_copy import HostCopy

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    n = state_mb * 2**20 // 4 // 8  # 8 float32 tensors of state_mb / 8 each
    torch.manual_seed(0)
    state = {f"dense.{i}": torch.randn(n, device=device) for i in range(8)}
    sync()
    pinned = device.type == "cuda"
    host = HostCopy(pin=pinned)
    host.capture(state)  # the first capture allocates the buffers (as a run's first save does)
    sync_s, staged_s, background_s = [], [], []
    for i in range(repeats):
        sync()
        t0 = time.perf_counter()
        torch.save(state, work / f"sync-{i}.pt")  # from the device: copy and write, the loop waits
        sync_s.append(time.perf_counter() - t0)
        sync()
        t0 = time.perf_counter()
        copy = host.capture(state)  # into the (pinned) host buffers; the loop goes on after this
        staged_s.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        writer = threading.Thread(target=torch.save, args=(copy, work / f"staged-{i}.pt"), daemon=True)
        writer.start()  # the write goes on beside the loop (waited here only to time it)
        writer.join()
        background_s.append(time.perf_counter() - t1)
    med_sync, med_staged = statistics.median(sync_s), statistics.median(staged_s)
    ratio = med_staged / med_sync if med_sync > 0 else float("nan")
    rows = [Row("save", f"sync torch.save from {device.type} ({state_mb} MB)", f"{med_sync:.3f} s blocking", True),
            Row("save", f"staged into {'pinned' if pinned else 'unpinned'} host buffers",
                f"{med_staged:.3f} s blocking, write {statistics.median(background_s):.3f} s in the background",
                True),
            Row("save", "staged / sync blocking", f"{ratio:.3f} ({100 * ratio:.1f}%)", True)]
    # 4. restore: the host copy back into fresh device tensors, bitwise
    t0 = time.perf_counter()
    restored = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in restored.items():
        v.copy_(copy[k], non_blocking=pinned)
    sync()
    restore_s = time.perf_counter() - t0
    equal = all(torch.equal(restored[k], state[k]) for k in state)
    rows.append(Row("restore", "from the staged host copy, bitwise equal",
                    f"{equal}, {restore_s:.3f} s for {state_mb} MB", equal))
    return rows, {"sync_s": sync_s, "staged_s": staged_s, "background_s": background_s, "ratio": ratio,
                  "restore_s": restore_s, "pinned": pinned}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state-mb", type=int, default=256, help="the dense state saved (MB; default 256)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-compile", action="store_true", help="leave out part 1's compile (minutes on a CPU)")
    ap.add_argument("--out", help="also write the rows and measurements as JSON here")
    args = ap.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    where = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}" if cuda
             else f"NO CUDA: torch {torch.__version__} on the CPU (gloo, unpinned buffers): NOT A GPU RESULT")
    skipped = []
    rows: list[Row] = []
    detail: dict = {"device": where}
    with tempfile.TemporaryDirectory(prefix="ettflow-gpu-part1-") as tmp:
        work = Path(tmp)
        rows += _groups(device, work)
        if args.skip_compile:
            skipped.append("compile cold/warm (--skip-compile)")
        else:
            compile_rows, detail["compile"] = _compile(device, work)
            rows += compile_rows
        save_rows, detail["save"] = _save_blocking(device, work, args.state_mb, args.repeats)
        rows += save_rows
    print(f"\n## GPU check, part 1 (torch only): {where}\n")
    print("| part | check | value | ok |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r.part} | {r.check} | {r.value} | {'yes' if r.ok else '**NO**'} |")
    for s in skipped:
        print(f"\nskipped: {s}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": [asdict(r) for r in rows], "skipped": skipped, **detail},
                                             indent=1, default=str))
    failed = [r for r in rows if not r.ok]
    if failed:
        print(f"\ngpu_check part 1: FAILED: {', '.join(r.check for r in failed)}", file=sys.stderr)
        return 1
    print("\ngpu_check part 1: OK" + ("" if cuda else " (on the CPU: not a GPU result)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
