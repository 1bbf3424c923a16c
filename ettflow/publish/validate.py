"""Validating a snapshot: its predictions on held-out batches against the trained model's.

The reference is the float DLRM loaded from the anchor (the trained model itself). The
snapshot is scored by `loadcheck.py` in a fresh Python process where `ettflow` and `torchrec`
cannot be imported, so a pass also proves the file loads without the training code.
"""

from __future__ import annotations

import itertools
import math
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ettflow.publish.anchor import NonFiniteCheckpointError
from ettflow.publish.config import PublishConfig, PublishError, SnapshotValidationError
from ettflow.trainer.data.pipeline import DataConfig, DataPipeline
from ettflow.trainer.data.schema import FeatureSchema
from ettflow.trainer.data.windows import list_windows
from ettflow.trainer.rank.evaluate import auc

LOADCHECK = Path(__file__).with_name("loadcheck.py")


@dataclass(frozen=True, kw_only=True)
class HeldOut:
    """Held-out batches as the snapshot takes them, and their labels."""

    windows: tuple[str, ...]
    batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (dense, values, lengths)
    labels: torch.Tensor

    @property
    def n_examples(self) -> int:
        return int(self.labels.numel())


def held_out(config: PublishConfig, schema: FeatureSchema) -> HeldOut:
    windows = config.windows or tuple(list_windows(config.data_root)[-1:])
    if not windows:
        raise PublishError(f"{config.data_root} holds no data windows to validate on: point --data at "
                           "the held-out windows")
    pipe = DataPipeline(DataConfig(root=config.data_root, schema=schema, batch_size=config.batch_size,
                                   windows=windows))
    got = list(itertools.islice(pipe.batches(), config.validation_batches))
    if not got:
        raise PublishError(f"held-out windows {list(windows)} of {config.data_root} hold fewer than one "
                           f"batch of {config.batch_size} rows: lower batch_size or add windows")
    return HeldOut(windows=tuple(windows),
                   batches=[(b.dense, b.sparse.values(), b.sparse.lengths()) for b in got],
                   labels=torch.cat([b.labels for b in got]))


@torch.no_grad()
def predict(module: nn.Module, data: HeldOut) -> torch.Tensor:
    """Click probabilities of an in-process module taking the snapshot signature."""
    return torch.cat([module(d, v, n).float() for d, v, n in data.batches])


def score_in_fresh_process(model_file: Path, data: HeldOut, *, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run `loadcheck.py` on the snapshot in a new interpreter; returns its output dict."""
    with tempfile.TemporaryDirectory(prefix="ettflow-loadcheck-") as tmp:
        inputs, output = Path(tmp) / "inputs.pt", Path(tmp) / "output.pt"
        torch.save(data.batches, inputs)
        cmd = [sys.executable, "-I", str(LOADCHECK), str(model_file), str(inputs), str(output)]
        try:
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise PublishError(f"scoring the snapshot in a fresh process took over {timeout_s:.0f} s") from e
        if -proc.returncode in (signal.SIGKILL, signal.SIGTERM):  # the OOM killer, an operator: a retry may pass
            raise PublishError(f"the process scoring the snapshot {model_file} was killed by signal "
                               f"{-proc.returncode} ({_signal_name(-proc.returncode)}); the publish is retried")
        if proc.returncode != 0 or not output.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
            raise SnapshotValidationError(
                f"the snapshot {model_file} does not load and run in a process without ettflow/torchrec "
                f"(exit {proc.returncode}):\n" + "\n".join(tail))
        result = torch.load(output, weights_only=True)
    if result["loaded"]:
        raise SnapshotValidationError(f"loading the snapshot imported {result['loaded']}: it depends on "
                                      "code an inference server does not have")
    return result


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def logloss(labels: np.ndarray, probs: np.ndarray) -> float:
    """Mean binary cross-entropy of click probabilities (clipped to [1e-7, 1 - 1e-7])."""
    p = np.clip(probs.astype(np.float64), 1e-7, 1 - 1e-7)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 6)


def compare(reference: torch.Tensor, snapshot: torch.Tensor, labels: torch.Tensor,
            tolerance: float) -> dict[str, Any]:
    """Metrics of the snapshot against the float model; raises beyond the tolerance, and
    `NonFiniteCheckpointError` when the float model's own predictions are not finite."""
    if snapshot.shape != reference.shape:
        raise SnapshotValidationError(f"the snapshot returned {tuple(snapshot.shape)} predictions, the "
                                      f"trained model {tuple(reference.shape)}: its signature is wrong")
    if not bool(torch.isfinite(reference).all()):
        bad = int((~torch.isfinite(reference)).sum())
        raise NonFiniteCheckpointError(
            f"the trained model itself predicts non-finite click probabilities for {bad} of "
            f"{reference.numel()} held-out examples: the checkpoint holds non-finite values (a numerics "
            "failure of training), not a quantization error. It is not published; publish an earlier "
            "anchor or retrain from the last finite checkpoint")
    diff = (snapshot - reference).abs()
    y, ref, snap = labels.numpy(), reference.numpy(), snapshot.numpy()
    metrics = {
        "n_examples": int(labels.numel()),
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "auc_float": _finite(auc(y, ref)),
        "auc_snapshot": _finite(auc(y, snap)),
        "logloss_float": round(logloss(y, ref), 6),
        "logloss_snapshot": round(logloss(y, snap), 6),
    }
    if not metrics["max_abs_diff"] <= tolerance:  # also catches NaN
        raise SnapshotValidationError(
            f"the snapshot's click probabilities differ from the trained model's by up to "
            f"{metrics['max_abs_diff']:.4g} (tolerance {tolerance}) on {metrics['n_examples']} held-out "
            "examples: the snapshot is not published. Publish with quantize off to see whether "
            "int8 tables cause it, or raise the tolerance if the loss is acceptable")
    return metrics
