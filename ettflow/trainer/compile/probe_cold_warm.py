"""Cold vs warm compile of the DLRM dense part, each in a fresh process.

    python -m ettflow.trainer.compile.probe_cold_warm [--batch 256 --sparse 26 --dim 16 ...]

Runs, each in its own interpreter (so no in-memory state helps): `cold` (empty archive root,
compiles and saves), `mega-only` (only torch.compiler.load_cache_artifacts of the saved
artifacts, no folder: what the artifacts alone buy) and `warm` (a new working folder, the
archive restored). Prints one row per run: restore, first step (compile + forward +
backward), save, and the cache counters. Timings are for information, not assertions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ettflow import child

MODES = ("cold", "mega-only", "warm")
RESULT_PREFIX = "PROBE_RESULT "


@dataclass(frozen=True, kw_only=True)
class DenseSize:
    batch: int = 256
    dense_in: int = 13
    sparse: int = 26  # F: sparse features
    dim: int = 16  # D: embedding dim (= last dense_arch layer)
    dense_arch: tuple[int, ...] = (512, 256, 16)
    over_arch: tuple[int, ...] = (512, 256, 1)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_arch", tuple(self.dense_arch))
        object.__setattr__(self, "over_arch", tuple(self.over_arch))
        if min(self.batch, self.dense_in, self.sparse, self.dim) < 1:
            raise ValueError(f"batch, dense_in, sparse and dim must be >= 1, got {self}")
        if self.dense_arch[-1] != self.dim or self.over_arch[-1] != 1:
            raise ValueError(
                f"dense_arch must end with dim={self.dim} and over_arch with 1, got {self}"
            )


def build_dense_forward(size: DenseSize):
    """dense_forward(dense [B, dense_in], embedded [B, F, D]) -> logits [B], from torchrec's
    DLRM DenseArch, InteractionArch and OverArch (the same layers in plain torch where TorchRec
    is not installed: `plain_dense_forward`, a bare GPU host's check)."""
    import torch

    from . import probe_models

    if probe_models.DenseForward is None:
        return plain_dense_forward(size)
    torch.manual_seed(0)
    return probe_models.DenseForward(size)


def plain_dense_forward(size: DenseSize):
    """TorchRec's DLRM dense part in plain torch (`probe_models.PlainDenseForward`)."""
    import torch

    from . import probe_models

    torch.manual_seed(0)
    return probe_models.PlainDenseForward(size)


def train_steps(model, size: DenseSize, steps: int, device: str = "cpu") -> list[float]:
    """Forward + backward `steps` times on `device`; seconds of each (the first includes
    compiling, and torch.compile's wrap, where dynamo loads a stored frame; each waits for the
    device)."""
    import torch

    from .compiled import compile_module

    model = model.to(device)
    dense = torch.randn(size.batch, size.dense_in, device=device)
    embedded = torch.randn(size.batch, size.sparse, size.dim, device=device, requires_grad=True)
    labels = torch.randint(0, 2, (size.batch,), device=device).float()
    seconds = []
    t0 = time.perf_counter()
    fn = compile_module(model)
    for _ in range(steps):
        logits = fn(dense, embedded)
        torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
        if device != "cpu":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
    return seconds


def _child(mode: str, root: Path, work: Path, size: DenseSize, threads: int, device: str = "cpu",
           precompile: bool = True) -> dict:
    from . import archive, trust
    from .cache import CompileCache
    from .config import CompileCacheConfig

    cache = CompileCache(CompileCacheConfig(root=root, work_dir=work, threads=threads, device=device,
                                            model=asdict(size), precompile=precompile))
    cache.prepare_env()
    out: dict = {"mode": mode, "key": cache.key}
    if mode == "mega-only":
        import torch

        t0 = time.perf_counter()
        path = archive.find_archive(root, cache.key)
        if path is not None:  # the artifacts are unpickled: the same checks as a restore
            if why := trust.first_untrusted(root, path, archive.manifest_path(path)):
                raise RuntimeError(why)
            archive.verify(path)
        with tempfile.TemporaryDirectory() as scratch:
            _, mega = archive.unpack(path, Path(scratch)) if path else (0, None)
        out["mega_loaded"] = bool(mega) and torch.compiler.load_cache_artifacts(mega) is not None
        out["restore_s"] = time.perf_counter() - t0
    else:
        restored = cache.restore()
        out.update(restore_s=restored.seconds, hit=restored.hit, restore_bytes=restored.bytes,
                   reason=restored.reason)
    steps = train_steps(build_dense_forward(size), size, steps=2, device=device)
    out.update(first_step_s=steps[0], next_step_s=steps[1])
    if mode == "cold":
        saved = cache.save()
        out.update(save_s=saved.seconds, archive_bytes=saved.bytes, skipped=saved.skipped_reason)
    out["stats"] = cache.stats().to_dict()
    return out


def spawn(mode: str, root: Path, work: Path, size: DenseSize, threads: int, device: str = "cpu",
          precompile: bool = True) -> dict:
    return child.run_child("ettflow.trainer.compile.probe_cold_warm",
                           ["child", mode, str(root), str(work), json.dumps(asdict(size)), str(threads), device,
                            str(int(precompile))],
                           RESULT_PREFIX, f"probe child {mode}")


def table(rows: list[dict]) -> str:
    head = f"{'run':<10}{'restore s':>10}{'1st step s':>11}{'save s':>8}{'fx hit/miss':>12}" \
           f"{'aot hit/miss':>13}{'frames loaded/traced':>21}{'built':>6}{'recomp':>7}"
    lines = [head]
    for r in rows:
        s = r["stats"]
        lines.append(
            f"{r['mode']:<10}{r['restore_s']:>10.2f}{r['first_step_s']:>11.2f}"
            f"{r.get('save_s', 0.0):>8.2f}{s['fxgraph_hit']:>6}/{s['fxgraph_miss']:<5}"
            f"{s['aot_hit']:>7}/{s['aot_miss']:<5}{s['frames_loaded']:>15}/{s['frames_compiled']:<5}"
            f"{s['built_objects']:>6}{s['recompiles']:>7}"
        )
    return "\n".join(lines)


def _int_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        mode, root, work, size_json, threads, device, precompile = argv[1:8]
        result = _child(mode, Path(root), Path(work), DenseSize(**json.loads(size_json)), int(threads), device,
                        precompile == "1")
        child.emit(RESULT_PREFIX, result)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in asdict(DenseSize()).items():
        kind = _int_tuple if isinstance(default, tuple) else int
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ",".join(MODES))
    p.add_argument("--root", help="archive root (default: a fresh temporary folder)")
    p.add_argument("--no-precompile", dest="precompile", action="store_false",
                   help="without dynamo's stored frames (CompileCacheConfig.precompile=False)")
    args = p.parse_args(argv)
    size = DenseSize(**{k: getattr(args, k) for k in asdict(DenseSize())})
    with tempfile.TemporaryDirectory(prefix="ettflow-probe-") as tmp:
        root = Path(args.root) if args.root else Path(tmp) / "archives"
        rows = []
        for i, mode in enumerate(args.modes.split(",")):
            if mode not in MODES:
                p.error(f"unknown mode {mode!r}; choose from {MODES}")
            rows.append(spawn(mode, root, Path(tmp) / f"work-{i}-{mode}", size, args.threads,
                              precompile=args.precompile))
            print(f"{mode}: done ({rows[-1]['first_step_s']:.1f} s first step)", flush=True)
        print(f"size {asdict(size)}, threads {args.threads}, key {rows[0]['key']}")
        print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
