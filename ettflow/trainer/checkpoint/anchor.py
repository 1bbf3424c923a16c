"""The anchor marker: `anchor.json` inside the committed checkpoint a run ends with.

An anchor is the checkpoint that publishing reads and that the next refresh continues from.
The trainer's rank 0 writes the marker after the final checkpoint committed; it says which
run wrote it, at which step and data cursor, and the model and schema to rebuild the model
without the trainer's config. `AnchorInfo` is the typed content; the file is its JSON
(`to_json`), with the same keys as ever: run_id, step, cursor, world_size, model, schema; and
`parent` (the checkpoint a warm-started run began from), `windows` (the windows it trained)
and `trained_with` (the batch size a rank and the step cap it trained with, `TrainedWith`),
each absent when not known (a cold start, an older marker).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ettflow.trainer.checkpoint.layout import atomic_write_text
from ettflow.trainer.data.schema import FeatureSchema
from ettflow.trainer.model_config import ModelConfig

ANCHOR_FILE = "anchor.json"
REQUIRED = ("run_id", "step", "model", "schema")


class AnchorFormatError(ValueError):
    """An anchor.json that cannot be read as an `AnchorInfo` (the message names the file and field)."""


@dataclass(frozen=True)
class TrainedWith:
    """How the run trained its windows, beyond the model: the batch size a rank and `max_steps`
    (None: every full batch). A refresh that publishes a stopped run's anchor instead of training
    (`tasks/anchor_reuse.py`) must have asked for the same: another cap or batch trains the
    windows otherwise."""

    batch_size: int
    max_steps: int | None = None

    @classmethod
    def of(cls, config: Any) -> TrainedWith:
        """What a trainer config (`TrainerConfig`: its `batch_size` and `max_steps`) trains with:
        the one rule the rank's marker and the reuse check both read."""
        return cls(batch_size=config.batch_size, max_steps=config.max_steps)

    @classmethod
    def from_json(cls, raw: Any, *, where: str) -> TrainedWith:
        if not isinstance(raw, Mapping):
            raise AnchorFormatError(f"{where}: 'trained_with' must be an object, got {type(raw).__name__}")
        try:
            batch, cap = raw["batch_size"], raw.get("max_steps")
        except KeyError as e:
            raise AnchorFormatError(f"{where}: 'trained_with' lacks {e}") from e
        if not isinstance(batch, int) or (cap is not None and not isinstance(cap, int)):
            raise AnchorFormatError(f"{where}: 'trained_with' holds {raw!r}: whole numbers expected")
        return cls(batch_size=batch, max_steps=cap)


@dataclass(frozen=True, kw_only=True)
class AnchorInfo:
    """What anchor.json says about its checkpoint.

    run_id: the run that trained it. step: the training step it holds. cursor: each data
    pipeline's next row at that step (`Cursor.to_dict`, rank 0's), None when nothing was
    trained in the attempt that wrote it. world_size: the ranks that saved it. model,
    schema: what builds the model again. parent: the anchor checkpoint this run was warm
    started from (its model and optimizer state), None for a cold start. windows: the data
    windows the run trained on.
    """

    run_id: str
    step: int
    world_size: int | None = None
    model: ModelConfig
    schema: FeatureSchema
    cursor: dict[str, Any] | None = None
    parent: str | None = None
    windows: tuple[str, ...] | None = None  # the data windows the run trained (None: not recorded)
    trained_with: TrainedWith | None = None  # its batch and step cap (None: not recorded, an older marker)

    def __post_init__(self) -> None:
        if not self.run_id:
            raise AnchorFormatError("AnchorInfo.run_id must not be empty")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise AnchorFormatError(f"AnchorInfo.step must be an int >= 0, got {self.step!r}")

    def to_json(self) -> dict[str, Any]:
        out = {"run_id": self.run_id, "step": self.step, "cursor": self.cursor, "world_size": self.world_size,
               "model": asdict(self.model), "schema": self.schema.to_dict()}
        if self.parent is not None:
            out["parent"] = self.parent
        if self.windows is not None:
            out["windows"] = list(self.windows)
        if self.trained_with is not None:
            out["trained_with"] = asdict(self.trained_with)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = ANCHOR_FILE) -> AnchorInfo:
        """Parse and check; `where` (the file) prefixes every error message."""
        if not isinstance(data, Mapping):
            raise AnchorFormatError(f"{where}: expected a JSON object, got {type(data).__name__}")
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise AnchorFormatError(f"{where} lacks {missing}: it was not written by write_anchor")
        try:
            schema = FeatureSchema.from_dict(data["schema"])
        except (TypeError, ValueError, KeyError) as e:
            raise AnchorFormatError(f"{where}: invalid schema ({e})") from e
        model = _model_config(data["model"], where)
        try:
            trained = data.get("trained_with")
            return cls(run_id=str(data["run_id"]), step=data["step"], world_size=data.get("world_size"),
                       model=model, schema=schema, cursor=data.get("cursor"), parent=data.get("parent"),
                       windows=tuple(data["windows"]) if data.get("windows") is not None else None,
                       trained_with=TrainedWith.from_json(trained, where=where) if trained is not None else None)
        except AnchorFormatError as e:  # the field checks of __post_init__
            raise AnchorFormatError(f"{where}: {e}") from e


def _model_config(raw: Any, where: str) -> ModelConfig:
    if not isinstance(raw, Mapping):
        raise AnchorFormatError(f"{where}: 'model' must be a ModelConfig dict, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {f.name for f in fields(ModelConfig)})
    if unknown:
        raise AnchorFormatError(f"{where}: model has fields {unknown} this ettflow's ModelConfig does not "
                                "know; read it with the ettflow version that trained it")
    try:
        return ModelConfig(**raw)
    except (TypeError, ValueError) as e:
        raise AnchorFormatError(f"{where}: invalid model config ({e})") from e


def write_anchor(checkpoint: Path | str, info: AnchorInfo | Mapping[str, Any]) -> None:
    """Mark a committed checkpoint as a run's anchor (atomic: temp file, fsync, rename). A
    mapping is checked as an `AnchorInfo` first, so a written marker always reads back."""
    path = Path(checkpoint) / ANCHOR_FILE
    if not isinstance(info, AnchorInfo):
        info = AnchorInfo.from_json(info, where=str(path))
    atomic_write_text(path, json.dumps(info.to_json(), indent=1, sort_keys=True))


def read_anchor(checkpoint: Path | str) -> dict[str, Any] | None:
    """The marker's raw JSON (None: the checkpoint is not an anchor); `load_anchor` checks it."""
    path = Path(checkpoint) / ANCHOR_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def load_anchor(checkpoint: Path | str) -> AnchorInfo | None:
    """The marker as an `AnchorInfo` (None: no marker); `AnchorFormatError` when it is malformed."""
    path = Path(checkpoint) / ANCHOR_FILE
    try:
        raw = read_anchor(checkpoint)
    except json.JSONDecodeError as e:
        raise AnchorFormatError(f"{path}: not valid JSON ({e})") from e
    return None if raw is None else AnchorInfo.from_json(raw, where=str(path))
