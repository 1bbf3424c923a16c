"""Anchor checkpoint -> validated inference snapshot, on the CPU, in one process.

    manifest = publish_snapshot(PublishConfig(anchor=..., output_root=..., data_root=...))

Steps (each timed into `manifest.timings_s`):
  load      verify the checkpoint, read anchor.json, DCP-load the model into a plain DLRM
  data      read the held-out batches
  reference the float model's click probabilities on them
  quantize  int8 row-wise tables (skipped when quantize=False)
  script    torchrec.fx trace + torch.jit.script + save into a hidden staging folder
  validate  score the saved file in a fresh process without ettflow/torchrec, compare
  total     all of the above; then (milliseconds, untimed) checksums, the manifest, fsync,
            and the atomic install as <output_root>/<run_id>/

Nothing here trains. A failed attempt leaves no snapshot (the staging folder is removed) and
can simply be run again; `is_retryable` says whether that may help. Retrying is the caller's
policy: the refresh's publish task declares Prefect retries, `ettflow publish` tries once.
"""

from __future__ import annotations

import logging
import platform
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ettflow.publish.anchor import load_float_model, open_anchor
from ettflow.publish.config import PublishConfig, PublishError, SnapshotValidationError
from ettflow.publish.manifest import SnapshotManifest, install, staging_dir
from ettflow.publish.snapshot import (
    QUANT_FORMAT,
    SnapshotModule,
    quantize_tables,
    save_snapshot,
    script_snapshot,
    signature,
)
from ettflow.publish.validate import compare, held_out, predict, score_in_fresh_process
from ettflow.trainer.data.schema import DataError

log = logging.getLogger("ettflow.publish")


class _Timer:
    def __init__(self) -> None:
        self.timings: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = round(time.perf_counter() - start, 4)


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name, dists in (("torchrec", ("torchrec",)), ("fbgemm_gpu", ("fbgemm-gpu-cpu", "fbgemm-gpu"))):
        for dist in dists:
            try:
                out[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def publish_snapshot(config: PublishConfig) -> SnapshotManifest:
    """Publish the anchor checkpoint as `<output_root>/<run_id>/` and return its manifest.

    Raises AnchorError (torn or not an anchor: do not retry), SnapshotValidationError (the
    snapshot disagrees with the trained model beyond the tolerance, or does not load without
    the training code), PublishError or OSError (may pass on a retry)."""
    started, timer = time.time(), _Timer()
    with timer("load"):
        anchor = open_anchor(config.anchor)
        dlrm = load_float_model(anchor)
    schema, run_id = anchor.schema, config.run_id or anchor.run_id
    if not run_id or "/" in run_id or run_id.startswith("."):
        raise PublishError(f"anchor.json's run_id {run_id!r} is not a folder name: pass run_id explicitly")
    with timer("data"):
        data = held_out(config, schema)
    with timer("reference"):
        reference = predict(SnapshotModule(dlrm, list(schema.sparse_names)), data)
    with timer("quantize"):
        model = quantize_tables(dlrm) if config.quantize else dlrm
    final = config.output_root / run_id
    tmp = staging_dir(config.output_root, run_id)
    try:
        with timer("script"):
            scripted = script_snapshot(model, schema)
            model_file = save_snapshot(scripted, tmp)
        with timer("validate"):
            scored = score_in_fresh_process(model_file, data)
            metrics = compare(reference, scored["probs"], data.labels, config.tolerance)
        delta = _as_delta(config, tmp, model_file, data, timer) if config.delta_on else {}
        timer.timings["total"] = round(time.time() - started, 4)
        draft = SnapshotManifest(
            run_id=run_id, step=anchor.step, path=str(final), created_at=time.time(),
            model=asdict(anchor.model), schema=schema.to_dict(),
            data={"root": str(config.data_root), "windows": list(data.windows), "batch_size": config.batch_size,
                  "batches": len(data.batches), "n_examples": data.n_examples},
            source={"checkpoint": str(anchor.path.resolve()), "manifest_sha256": anchor.manifest_sha256,
                    "step": anchor.step, "world_size": anchor.world_size, "cursor": anchor.cursor,
                    "run_id": anchor.run_id},
            quantization={"enabled": config.quantize, "format": QUANT_FORMAT if config.quantize else "float32"},
            signature=signature(schema, config.quantize),
            validation={"tolerance": config.tolerance, "passed": True,
                        "bounds": "max |p_snapshot - p_float| over the held-out examples (click probability)",
                        "loaded_without": ["ettflow", "torchrec"], "blocked_imports": scored["blocked_imports"]},
            metrics=metrics, timings_s=timer.timings, versions=_versions(),
            lineage={"parent_snapshot": config.parent_snapshot, "parent_anchor": anchor.parent,
                     "windows": list(anchor.windows) if anchor.windows is not None else None,
                     "held_out": list(data.windows)},
            delta=delta,
        )
        manifest = install(tmp, draft, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("published %s (step %d): max |dp| %.2g <= %.2g, AUC float %s snapshot %s, %.1f s",
             final, anchor.step, metrics["max_abs_diff"], config.tolerance, metrics["auc_float"],
             metrics["auc_snapshot"], timer.timings["total"])
    return manifest


def _as_delta(config: PublishConfig, tmp: Path, model_file: Path, data: Any, timer: _Timer) -> dict[str, Any]:
    """Replace the validated full module in `tmp` by its delta on `config.delta_on`, once the
    module rebuilt from that delta predicts exactly what the full one did (bitwise, so it scores
    the same AUC); the manifest's `delta` section. A snapshot that cannot be a delta stays full
    (said in the log; the section says why: `refused`, and `new_base` when the chain was deep)."""
    from ettflow.publish.delta_snapshot import DeltaSnapshotRefused, NewBase, load_module, write_delta_snapshot

    with timer("delta"):
        pack, rebuilt = tmp / "delta-pack", tmp / "rebuilt.pt"
        try:
            delta = write_delta_snapshot(Path(config.delta_on), model_file, pack, rebuilt=rebuilt)
        except DeltaSnapshotRefused as exc:
            log.log(logging.INFO if isinstance(exc, NewBase) else logging.WARNING,
                    "published as a full snapshot, not a delta on %s: %s", config.delta_on, exc)
            shutil.rmtree(pack, ignore_errors=True)
            return {"refused": str(exc)[:500], "new_base": isinstance(exc, NewBase)}  # full: why, in the manifest
        # in this process, both modules on the same threads (bitwise comparable); the full one
        # was scored in a fresh process above, and the rebuilt one differs from it in state only
        # if at all, so the same predictions here mean the same there
        full, again = predict(load_module(model_file), data), predict(load_module(rebuilt), data)  # (no_grad)
        if not torch.equal(again, full):
            raise SnapshotValidationError(
                f"the snapshot rebuilt from its delta on {config.delta_on} predicts differently from the full one "
                f"(max |dp| {float((again - full).abs().max()):.3g}): publish it full (no delta_on)")
        rebuilt.unlink()
        model_file.unlink()
        for part in pack.iterdir():
            part.replace(tmp / part.name)
        pack.rmdir()
    log.info("stored as a delta on %s: %d of %d rows changed, %d bytes (the full module: %d)", config.delta_on,
             delta["changed_rows"], delta["rows"], delta["bytes"], delta["full_bytes"])
    return delta


def is_retryable(error: BaseException) -> bool:
    """Whether another publish attempt may succeed (e.g. a Prefect task retry condition)."""
    if isinstance(error, PublishError):
        return error.retryable
    return not isinstance(error, (DataError, ValueError, TypeError))

