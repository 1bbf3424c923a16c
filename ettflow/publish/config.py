"""What a publish job does (`PublishConfig`), and the errors it raises."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Quantized (int8 row-wise) tables move a probability by a few 1e-3 on the models we train
# (0.0009 measured on the smoke run); 0.02 leaves room for larger tables and dims while still
# catching a wrong table, a wrong key order or a broken export (those move it by > 0.1).
DEFAULT_TOLERANCE = 0.02


class PublishError(RuntimeError):
    """Publishing failed; the message says what was wrong and what to do."""

    retryable = True  # a fresh attempt may succeed (I/O, a crashed subprocess)


class AnchorError(PublishError):
    """The anchor checkpoint cannot be published (torn, not an anchor, unknown model)."""

    retryable = False  # the same checkpoint fails the same way: retrain or fix the path


class SnapshotValidationError(PublishError):
    """The snapshot's predictions disagree with the trained model beyond the tolerance."""

    retryable = False  # deterministic: the same inputs give the same snapshot


@dataclass(frozen=True, kw_only=True)
class PublishConfig:
    """One publish job.

    anchor: the anchor checkpoint folder (`.../checkpoints/step_<n>` with anchor.json).
    output_root: snapshots go to `<output_root>/<run_id>/` (run_id from anchor.json).
    data_root: folder of held-out data windows (the layout the trainer reads).
    windows: window names to validate on; None: the last window of `data_root` (the one
        the trainer holds out by default).
    batch_size, validation_batches: validation reads this many batches of this size.
    tolerance: largest allowed |p_snapshot - p_float| over the validation examples, where p
        is the click probability; the snapshot is refused beyond it.
    quantize: int8 row-wise embedding tables (False: float tables, e.g. to isolate a diff).
    run_id: override anchor.json's run_id (the output folder name).
    parent_snapshot: the snapshot this one follows (the model's current one), for the
        manifest's lineage; None: the first of its model, or not known.
    delta_on: a published snapshot folder (the model's current one): store this snapshot as a
        delta on it (`delta_snapshot.py`: the rows that changed), once its materialization is
        checked to predict exactly as the full snapshot; None: a full snapshot.
    """

    anchor: Path | str
    output_root: Path | str
    data_root: Path | str
    windows: tuple[str, ...] | None = None
    batch_size: int = 512
    validation_batches: int = 8
    tolerance: float = DEFAULT_TOLERANCE
    quantize: bool = True
    run_id: str | None = None
    parent_snapshot: str | None = None
    delta_on: Path | str | None = None

    def __post_init__(self) -> None:
        for name in ("anchor", "output_root", "data_root"):
            value = getattr(self, name)
            if not isinstance(value, (str, Path)) or not str(value).strip():
                raise ValueError(f"PublishConfig.{name} must be a path, got {value!r}")
            object.__setattr__(self, name, Path(value))
        if self.windows is not None:
            if isinstance(self.windows, str) or not isinstance(self.windows, Sequence):
                raise ValueError(f"PublishConfig.windows must be a list of window names (or None for "
                                 f"the last window), got {self.windows!r}")
            object.__setattr__(self, "windows", tuple(self.windows))
            if not self.windows:
                raise ValueError("PublishConfig.windows is empty: name at least one held-out window, "
                                 "or pass None for the last window of data_root")
        for name in ("batch_size", "validation_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PublishConfig.{name} must be an int >= 1, got {value!r}")
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, (int, float)) or not (
            0 < self.tolerance < 1
        ):
            raise ValueError(f"PublishConfig.tolerance is a probability difference in (0, 1), "
                             f"got {self.tolerance!r} (int8 tables: {DEFAULT_TOLERANCE})")
        if not isinstance(self.quantize, bool):
            raise ValueError(f"PublishConfig.quantize must be a bool, got {self.quantize!r}")
        if self.run_id is not None and (not isinstance(self.run_id, str) or not self.run_id.strip()
                                        or "/" in self.run_id or self.run_id.startswith(".")):
            raise ValueError(f"PublishConfig.run_id must be a folder name (no '/', not starting "
                             f"with '.'), got {self.run_id!r}")
