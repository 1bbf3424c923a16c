"""Held-out loss and AUC, gathered over every rank."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from ettflow.trainer.collectives import Group
from ettflow.trainer.data.batch import Batch


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted half); NaN with one class."""
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, dtype=np.float64)
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    sorted_scores = scores[order]
    # average ranks over ties
    i = 0
    while i < len(scores):
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


@torch.no_grad()
def evaluate(sparse_arch, dense_step, batches: Iterable[Batch], device: torch.device,
             control: Group | None) -> dict[str, float]:
    """Mean BCE loss and AUC over the held-out batches of every rank, gathered on the control
    group (CPU). All ranks must pass the same number of batches (the lookup is a collective)."""
    labels, scores = [], []
    for batch in batches:
        batch = batch.to(device)
        embedded = sparse_arch(batch.sparse)
        _, logits = dense_step(batch.dense, embedded, batch.labels)
        labels.append(batch.labels.float())
        scores.append(logits.float())
    if not labels:
        return {}
    y, s = torch.cat(labels).cpu(), torch.cat(scores).cpu()
    if control is not None and control.size > 1:
        y, s = torch.cat(control.all_gather(y)), torch.cat(control.all_gather(s))
    loss = torch.nn.functional.binary_cross_entropy_with_logits(s, y).item()
    return {"loss": loss, "auc": auc(y.numpy(), s.numpy()), "examples": int(y.numel())}
