"""Compile ablation, cumulative as in the study: each row adds one measure, in a fresh process.

1. `whole-model`: torch.compile of the whole (unsharded) DLRM forward + backward, sparse
   lookup included, on real batches whose jagged lengths vary: the cold cost and its recompiles.
2. `dense-step`: ettflow's dynamic-shape handling: only the dense step (fixed shapes: dense
   [B, 13], pooled embeddings [B, F, D]) is compiled; varying jagged lengths never reach it.
3. `warm-restart`: (2) in a new process whose compile cache is restored from the archive (2)
   saved: the restart of a failed job, or the next refresh.

    python -m ettflow.bench.compile_ablation --data DIR [--batches 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from ettflow.child import emit, run_child

MODES = ("whole-model", "dense-step", "warm-restart")
PREFIX = "ABLATION_RESULT "


def _child(mode: str, data: Path, archive_root: Path, batches: int, batch_size: int) -> dict:
    import torch

    from ettflow.trainer.compile.cache import CompileCache
    from ettflow.trainer.compile.compiled import compile_module
    from ettflow.trainer.compile.config import CompileCacheConfig
    from ettflow.trainer.data.pipeline import DataConfig, DataPipeline
    from ettflow.trainer.data.schema import criteo_schema
    from ettflow.trainer.model import DenseStep, ModelConfig, table_configs

    schema = criteo_schema(1000)
    model_cfg = ModelConfig()
    cache = CompileCache(CompileCacheConfig(root=archive_root, model={"bench": mode != "whole-model"}, threads=1,
                                            codec="none", max_bytes=512 * 2**20,
                                            enabled=mode != "whole-model"))
    cache.prepare_env()
    restored = cache.restore() if mode == "warm-restart" else None
    from torchrec import EmbeddingBagCollection
    from torchrec.models.dlrm import DLRM

    torch.manual_seed(0)
    dlrm = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=table_configs(schema, model_cfg.embedding_dim)),
                dense_in_features=len(schema.dense), dense_arch_layer_sizes=list(model_cfg.dense_arch),
                over_arch_layer_sizes=list(model_cfg.over_arch))
    pipe = DataPipeline(DataConfig(root=data, schema=schema, batch_size=batch_size))
    step = DenseStep(dlrm)
    if mode == "whole-model":
        compiled = compile_module(dlrm)

        def run(b):
            logits = compiled(b.dense, b.sparse).squeeze(-1)
            return torch.nn.functional.binary_cross_entropy_with_logits(logits, b.labels)
    else:
        compiled = compile_module(step)

        def run(b):
            return compiled(b.dense, dlrm.sparse_arch(b.sparse), b.labels)[0]
    times = []
    lengths = set()
    for i, b in enumerate(pipe.batches()):
        if i >= batches:
            break
        lengths.add(int(b.sparse.values().numel()))
        t0 = time.perf_counter()
        run(b).backward()
        times.append(time.perf_counter() - t0)
    saved = cache.save() if mode == "dense-step" else None
    stats = cache.stats().to_dict()
    return {"mode": mode, "first_step_s": times[0], "rest_s": sum(times[1:]), "distinct_value_counts": len(lengths),
            "recompiles": stats["recompiles"], "fx_hit": stats["fxgraph_hit"], "fx_miss": stats["fxgraph_miss"],
            "frames_loaded": stats["frames_loaded"],
            "restore_s": restored.seconds if restored else 0.0, "cache_hit": bool(restored and restored.hit),
            "archive_bytes": saved.bytes if saved else 0}


def run_ablation(data: Path, *, batches: int = 8, batch_size: int = 256) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="ettflow-ablation-") as tmp:
        for mode in MODES:
            rows.append(run_child("ettflow.bench.compile_ablation",
                                  ["child", mode, str(data), str(Path(tmp) / "archives"), str(batches),
                                   str(batch_size)], PREFIX, f"compile ablation {mode}"))
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        mode, data, root, batches, batch_size = argv[1:6]
        emit(PREFIX, _child(mode, Path(data), Path(root), int(batches), int(batch_size)))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=256)
    args = p.parse_args(argv)
    for row in run_ablation(Path(args.data), batches=args.batches, batch_size=args.batch_size):
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
