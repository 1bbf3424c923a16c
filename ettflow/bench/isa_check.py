"""The warm compile with inductor's CPU ISA check made in the process against taken from the host's record.

    python -m ettflow.bench.isa_check [--pairs 4] [--batch-size 128]

One cold compile fills a compile-cache archive (and the host's ISA record); then `--pairs`
pairs of fresh processes, interleaved so that the host's drift falls on both alike: `checked`
(the record removed first: the process makes inductor's check, as every compiling process did
before `compile/vec_isa.py`) and `recorded` (the record of the process before it). Each one
restores the archive and compiles the DLRM dense step as a rank does (`compile_dense_step`, the
default model, one forward and backward); the table has each side's compile seconds (median,
range) and their ratio. Timings are measurements for BENCHMARKS.md, never pass/fail; exit 1
only when a warm process missed the archive or did not take the path it was meant to.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from ettflow.child import emit, run_child

RESULT = "ISA_CHECK_RESULT "


def child(root: Path, batch_size: int) -> dict:
    """One fresh process: restore the archive (when there is one), compile, save on a miss."""
    import time

    from ettflow.trainer.compile.process_cache import prepare_compile_env
    from ettflow.trainer.config import TrainerConfig
    from ettflow.trainer.data.schema import criteo_schema

    cfg = TrainerConfig(data_root=str(root / "data"), schema=criteo_schema(), work_dir=str(root / "work"),
                        compile_cache_root=str(root / "cache"), batch_size=batch_size, world_size=1)
    cache = prepare_compile_env(cfg)
    import torch

    from ettflow.trainer.compile.compiled import compile_dense_step
    from ettflow.trainer.compile.vec_isa import settled
    from ettflow.trainer.data.batch import synthetic_batch
    from ettflow.trainer.model import DenseStep, build_dlrm

    dense_step = DenseStep(build_dlrm(cfg.model, cfg.schema, device=torch.device("cpu")))
    restored = cache.restore()
    t0 = time.perf_counter()
    compile_dense_step(dense_step, synthetic_batch(cfg.schema, batch_size), cfg, torch.device("cpu"))
    compile_s = time.perf_counter() - t0
    if not restored.hit:
        cache.save()
    isa = settled()
    return {"hit": restored.hit, "compile_s": compile_s, "isa": isa.check.value if isa else None,
            "isa_s": isa.seconds if isa else 0.0}


def _spawn(root: Path, batch_size: int) -> dict:
    return run_child("ettflow.bench.isa_check", ["--child", str(root), "--batch-size", str(batch_size)], RESULT,
                     "the compile process")


def run(pairs: int, batch_size: int) -> int:
    from ettflow.trainer.compile.vec_isa import RECORD_DIR
    from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows

    root = Path(tempfile.mkdtemp(prefix="ettflow-isa-bench-"))
    try:
        generate_windows(root / "data", SyntheticConfig(windows=1, rows_per_window=256, files_per_window=1))
        cold = _spawn(root, batch_size)
        print(f"cold compile (fills the archive and the host's record): {cold['compile_s']:.2f} s, "
              f"of it the ISA check {cold['isa_s']:.2f} s ({cold['isa']})")
        runs: dict[str, list[dict]] = {"checked": [], "recorded": []}
        for _ in range(pairs):
            shutil.rmtree(root / "cache" / RECORD_DIR, ignore_errors=True)
            runs["checked"].append(_spawn(root, batch_size))
            runs["recorded"].append(_spawn(root, batch_size))
        bad = [(side, r) for side, rs in runs.items() for r in rs if not r["hit"] or r["isa"] != side]
        print(f"\n{pairs} pairs of fresh processes, interleaved; each restored the archive, then compiled")
        print(f"{'ISA check':<10} {'compile s (median)':>19} {'range':>13} {'its check s':>12}")
        med = {}
        for side, rs in runs.items():
            times = [r["compile_s"] for r in rs]
            med[side] = statistics.median(times)
            print(f"{side:<10} {med[side]:>19.2f} {min(times):>6.2f}-{max(times):<6.2f} "
                  f"{statistics.median(r['isa_s'] for r in rs):>12.2f}")
        print(f"recorded / checked: {med['recorded'] / med['checked']:.2f} "
              f"({med['checked'] - med['recorded']:.2f} s less a warm compile)")
        for side, r in bad:
            print(f"unexpected: a {side} process {'missed the archive' if not r['hit'] else 'took ' + str(r['isa'])}")
        return 1 if bad else 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        emit(RESULT, child(args.child, args.batch_size))
        return 0
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    return run(args.pairs, args.batch_size)


if __name__ == "__main__":
    sys.exit(main())
