"""The anchor checkpoint, read back into one plain (unsharded) DLRM on the CPU.

The trainer saved `{"model": dmp.state_dict(), "optim": ..., "rank_<r>": ...}` with DCP from N
ranks, each holding shards of the tables. `load_float_model` builds the same DLRM without
sharding, materializes only its embedding tables (they are built on the meta device; calling
`to_empty` on the whole DLRM would also wipe a buffer that is not in the checkpoint), and
asks DCP for the "model.*" keys alone: DCP reads each table's shards from the rank files that
hold them and assembles whole tensors, so N ranks reshard into one process. Optimizer state
and per-rank state are never read.

No code runs from the anchor's folder: `verify` checks every file against the sealed manifest
first, then `.metadata` is read by the trainer's restricted reader (`SafeFileSystemReader`) and
any non-tensor value by `SafeLoadPlanner` (`trainer/checkpoint/reading.py`), as a restore does;
plain DCP would `pickle.load` `.metadata`, and a folder someone else can write (a forged
`.metadata` with the manifest re-sealed to match) would run their code in the publishing process.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torchrec.models.dlrm import DLRM

from ettflow.publish.config import AnchorError, PublishError
from ettflow.trainer.checkpoint import CheckpointError, verify
from ettflow.trainer.checkpoint.anchor import ANCHOR_FILE, AnchorFormatError, load_anchor
from ettflow.trainer.checkpoint.layout import MANIFEST
from ettflow.trainer.checkpoint.reading import SafeFileSystemReader, SafeLoadPlanner
from ettflow.trainer.data.schema import FeatureSchema
from ettflow.trainer.model import ModelConfig, build_dlrm

MODEL_PREFIX = "model."


class NonFiniteCheckpointError(AnchorError):
    """The anchor holds NaN or infinite values, or its float model computes them: a numerics
    fault of training, not of publishing (quantization and the tolerance have nothing to do
    with it). Not retryable: publish an earlier anchor, or retrain from a finite checkpoint."""


@dataclass(frozen=True, kw_only=True)
class AnchorCheckpoint:
    """A verified anchor checkpoint and what anchor.json says about it."""

    path: Path
    run_id: str
    step: int
    world_size: int
    model: ModelConfig
    schema: FeatureSchema
    cursor: dict[str, Any] | None
    parent: str | None  # the anchor it was warm started from (None: a cold start)
    windows: tuple[str, ...] | None  # the windows it trained
    manifest_sha256: str  # the checkpoint manifest's own sha256 (also in COMMITTED)


def open_anchor(path: Path | str) -> AnchorCheckpoint:
    """Verify the checkpoint (refusing a torn one) and read its anchor.json."""
    path = Path(path)
    if not path.is_dir():
        raise AnchorError(f"anchor checkpoint {path} is not a folder: pass the trainer's anchor, "
                          "<work_dir>/checkpoints/step_<n>")
    try:
        info = verify(path)
    except CheckpointError as e:
        raise AnchorError(f"refusing to publish: {e}. Publish another committed anchor; a torn one "
                          "is never read") from e
    try:
        anchor = load_anchor(path)
    except AnchorFormatError as e:
        raise AnchorError(str(e)) from e
    if anchor is None:
        raise AnchorError(f"{path} is a committed checkpoint but not an anchor (no {ANCHOR_FILE}): "
                          "publish the checkpoint the trainer marked at the end of training")
    if anchor.step != info.step:
        raise AnchorError(f"{path / ANCHOR_FILE} names step {anchor.step} but the checkpoint holds "
                          f"step {info.step}: the marker belongs to another checkpoint")
    sha = json.loads((path / MANIFEST).read_text())["manifest_sha256"]  # verify() checked it
    return AnchorCheckpoint(path=path, run_id=anchor.run_id, step=info.step, world_size=info.world_size,
                            model=anchor.model, schema=anchor.schema, cursor=anchor.cursor, parent=anchor.parent,
                            windows=anchor.windows, manifest_sha256=sha)


def load_float_model(anchor: AnchorCheckpoint) -> DLRM:
    """The trained DLRM, whole, on the CPU, in eval mode (see the module docstring)."""
    dlrm = build_dlrm(anchor.model, anchor.schema, device=torch.device("cpu"))
    dlrm.sparse_arch.embedding_bag_collection.to_empty(device="cpu")
    local = dlrm.state_dict()
    wanted = {MODEL_PREFIX + k: v for k, v in local.items()}
    try:
        meta = SafeFileSystemReader(str(anchor.path)).read_metadata().state_dict_metadata
    except CheckpointError as e:  # not DCP's metadata (a forged pickle): refused before anything runs
        raise AnchorError(f"refusing to publish: {e}. Publish an anchor the trainer wrote") from e
    absent = sorted(k for k in wanted if k not in meta)
    if absent:
        raise AnchorError(f"{anchor.path} lacks model tensors {absent[:3]}{'...' if len(absent) > 3 else ''} "
                          "that the model in anchor.json needs: anchor.json and the checkpoint disagree")
    for key, tensor in wanted.items():
        saved = tuple(meta[key].size)
        if saved != tuple(tensor.shape):
            raise AnchorError(f"{anchor.path}: {key} has shape {saved} in the checkpoint, the model in "
                              f"anchor.json builds {tuple(tensor.shape)}")
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            # only tensors are asked for; the planner refuses any other value unpickled all the same
            dcp.load(wanted, storage_reader=SafeFileSystemReader(str(anchor.path)), planner=SafeLoadPlanner(),
                     no_dist=True)
    except CheckpointException as e:  # a BaseException: would escape `except Exception`
        raise PublishError(f"reading the model from {anchor.path} failed: {e}") from e
    dlrm.load_state_dict({k[len(MODEL_PREFIX):]: v for k, v in wanted.items()}, strict=True)
    dlrm.eval()
    for p in dlrm.parameters():
        p.requires_grad_(False)
    bad = [name for name, t in dlrm.state_dict().items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise NonFiniteCheckpointError(
            f"the anchor {anchor.path} holds non-finite values (NaN or inf) in {bad[:3]}"
            f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}: training diverged (a numerics failure) "
            "before this checkpoint was saved. It is not published; publish an earlier anchor or retrain "
            "from the last finite checkpoint")
    return dlrm
