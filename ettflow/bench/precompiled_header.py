"""The compile cache with and without inductor's precompiled header, side by side.

A process with the compile-cache archive compiles without inductor's precompiled header
(`trainer/compile/env.py`); `header` below is the setting before that change (torch's default),
kept in a root of its own. For each side: `--cold` fresh roots, each compiled cold by a fresh
process (which saves the archive), then `--warm` fresh processes interleaved across the two
sides, each restoring its side's archive and compiling the default DLRM dense step as a rank
does (`compile_dense_step`: one forward and backward). The table has the archive's size, the
cold compile, the restore and the warm compile (medians and ranges, seconds of each process's
own clock).

    python -m ettflow.bench.precompiled_header --cold 2 --warm 4
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from ettflow.child import emit, run_child

RESULT = "HEADER_BENCH_RESULT "
SIDES = ("header", "no header")


def child(root: Path, header: bool, batch_size: int) -> dict:
    """One fresh process: restore the archive (when there is one), compile, save on a miss."""
    import time

    from ettflow.trainer import _torch_compat as compat
    from ettflow.trainer.compile import env
    from ettflow.trainer.compile.process_cache import prepare_compile_env
    from ettflow.trainer.config import TrainerConfig
    from ettflow.trainer.data.schema import criteo_schema

    if header:  # the setting before: torch's default (this side's archives are in a root of their own)
        env.skip_precompiled_headers = lambda: compat.set_precompile_headers(True)
    cfg = TrainerConfig(data_root=str(root / "data"), schema=criteo_schema(), work_dir=str(root / "work"),
                        compile_cache_root=str(root / "cache"), batch_size=batch_size, world_size=1)
    cache = prepare_compile_env(cfg)  # turns the header off, as in every rank with the archive
    import torch

    from ettflow.trainer.compile.compiled import compile_dense_step
    from ettflow.trainer.data.batch import synthetic_batch
    from ettflow.trainer.model import DenseStep, build_dlrm

    dense_step = DenseStep(build_dlrm(cfg.model, cfg.schema, device=torch.device("cpu")))
    restored = cache.restore()
    t0 = time.perf_counter()
    compile_dense_step(dense_step, synthetic_batch(cfg.schema, batch_size), cfg, torch.device("cpu"))
    compile_s = time.perf_counter() - t0
    saved = None if restored.hit else cache.save()
    return {"hit": restored.hit, "restore_s": restored.seconds, "restore_bytes": restored.bytes,
            "compile_s": compile_s, "archive_bytes": saved.bytes if saved is not None and saved.saved else 0,
            "header": compat.precompile_headers_setting()}


def _spawn(root: Path, header: bool, batch_size: int) -> dict:
    return run_child("ettflow.bench.precompiled_header",
                     ["--child", str(root), "--batch-size", str(batch_size)] + (["--header"] if header else []),
                     RESULT, "the compile process")


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def run(cold: int, warm: int, batch_size: int) -> int:
    from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows

    base = Path(tempfile.mkdtemp(prefix="ettflow-header-bench-"))
    try:
        colds: dict[str, list[dict]] = {side: [] for side in SIDES}
        for i in range(cold):  # interleaved; the last root of each side serves the warm processes
            for side in SIDES:
                root = base / f"{side.replace(' ', '-')}-{i}"
                generate_windows(root / "data", SyntheticConfig(windows=1, rows_per_window=256, files_per_window=1))
                colds[side].append({**_spawn(root, side == "header", batch_size), "root": root})
        warms: dict[str, list[dict]] = {side: [] for side in SIDES}
        for _ in range(warm):
            for side in SIDES:
                warms[side].append(_spawn(colds[side][-1]["root"], side == "header", batch_size))
        print(f"{cold} cold and {warm} warm fresh processes a side, interleaved; seconds: median (range)")
        print(f"{'side':<10} {'archive MB':>10} {'cold compile s':>20} {'restore s':>20} {'warm compile s':>20}")
        for side in SIDES:
            mb = statistics.median(r["archive_bytes"] for r in colds[side]) / 1e6
            print(f"{side:<10} {mb:>10.1f} {_spread([r['compile_s'] for r in colds[side]]):>20} "
                  f"{_spread([r['restore_s'] for r in warms[side]]):>20} "
                  f"{_spread([r['compile_s'] for r in warms[side]]):>20}")
        bad = [(side, r) for side in SIDES for r in colds[side] + warms[side]
               if r["header"] != (side == "header")]
        bad += [(side, r) for side in SIDES for r in warms[side] if not r["hit"]]
        for side, r in bad:
            print(f"unexpected: a {side} process {'missed its archive' if not r['hit'] else 'had the other setting'}")
        return 1 if bad else 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cold", type=int, default=2)
    p.add_argument("--warm", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--header", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        emit(RESULT, child(args.child, args.header, args.batch_size))
        return 0
    if args.cold < 1 or args.warm < 1:
        p.error("--cold and --warm must be at least 1")
    return run(args.cold, args.warm, args.batch_size)


if __name__ == "__main__":
    sys.exit(main())
