"""The anchor checkpoint, read back into one plain (unsharded) DLRM on the CPU.

The trainer saved `{"model": dmp.state_dict(), "optim": ..., "rank_<r>": ...}` with DCP from N
ranks, each holding shards of the tables. `load_float_model` builds the same DLRM without
sharding, materializes only its embedding tables (they are built on the meta device; calling
`to_empty` on the whole DLRM would also wipe a buffer that is not in the checkpoint), and
asks DCP for the "model.*" keys alone: DCP reads each table's shards from the rank files that
hold them and assembles whole tensors, so N ranks reshard into one process. Optimizer state
and per-rank state are never read.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torchrec.models.dlrm import DLRM

from ettflow.publish.config import AnchorError, PublishError
from ettflow.trainer.checkpoint import CheckpointError, verify
from ettflow.trainer.checkpoint.layout import MANIFEST
from ettflow.trainer.data.schema import FeatureSchema
from ettflow.trainer.model import ModelConfig, build_dlrm
from ettflow.trainer.plugins import ANCHOR_FILE, read_anchor

MODEL_PREFIX = "model."


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
    manifest_sha256: str  # the checkpoint manifest's own sha256 (also in COMMITTED)


def _model_config(raw: Any, path: Path) -> ModelConfig:
    if not isinstance(raw, dict):
        raise AnchorError(f"{path / ANCHOR_FILE}: 'model' must be a ModelConfig dict, got {type(raw).__name__}")
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise AnchorError(f"{path / ANCHOR_FILE}: model has fields {unknown} this ettflow's ModelConfig does "
                          "not know; publish with the ettflow version that trained it")
    try:
        return ModelConfig(**raw)
    except (TypeError, ValueError) as e:
        raise AnchorError(f"{path / ANCHOR_FILE}: invalid model config ({e})") from e


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
    anchor = read_anchor(path)
    if anchor is None:
        raise AnchorError(f"{path} is a committed checkpoint but not an anchor (no {ANCHOR_FILE}): "
                          "publish the checkpoint the trainer marked at the end of training")
    missing = [k for k in ("run_id", "step", "model", "schema") if k not in anchor]
    if missing:
        raise AnchorError(f"{path / ANCHOR_FILE} lacks {missing}: it was not written by write_anchor")
    if anchor["step"] != info.step:
        raise AnchorError(f"{path / ANCHOR_FILE} names step {anchor['step']} but the checkpoint holds "
                          f"step {info.step}: the marker belongs to another checkpoint")
    try:
        schema = FeatureSchema.from_dict(anchor["schema"])
    except (TypeError, ValueError, KeyError) as e:
        raise AnchorError(f"{path / ANCHOR_FILE}: invalid schema ({e})") from e
    sha = json.loads((path / MANIFEST).read_text())["manifest_sha256"]  # verify() checked it
    return AnchorCheckpoint(path=path, run_id=str(anchor["run_id"]), step=info.step,
                            world_size=info.world_size, model=_model_config(anchor["model"], path),
                            schema=schema, cursor=anchor.get("cursor"), manifest_sha256=sha)


def load_float_model(anchor: AnchorCheckpoint) -> DLRM:
    """The trained DLRM, whole, on the CPU, in eval mode (see the module docstring)."""
    dlrm = build_dlrm(anchor.model, anchor.schema, device=torch.device("cpu"))
    dlrm.sparse_arch.embedding_bag_collection.to_empty(device="cpu")
    local = dlrm.state_dict()
    wanted = {MODEL_PREFIX + k: v for k, v in local.items()}
    meta = FileSystemReader(str(anchor.path)).read_metadata().state_dict_metadata
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
            dcp.load(wanted, storage_reader=FileSystemReader(str(anchor.path)), no_dist=True)
    except CheckpointException as e:  # a BaseException: would escape `except Exception`
        raise PublishError(f"reading the model from {anchor.path} failed: {e}") from e
    dlrm.load_state_dict({k[len(MODEL_PREFIX):]: v for k, v in wanted.items()}, strict=True)
    dlrm.eval()
    for p in dlrm.parameters():
        p.requires_grad_(False)
    return dlrm
