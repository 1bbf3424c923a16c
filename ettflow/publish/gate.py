"""The publish gate: a new snapshot replaces the model's current one only if it is not worse.

    outcome = gate_snapshot(manifest, config, GateConfig(max_auc_drop=0.01))
    outcome.outcome     # Outcome.PUBLISHED (the `current` pointer moved) or Outcome.GATED
    outcome.reason      # why, in words: the run's state message when gated

Both snapshots are scored on the same held-out batches (`validate.held_out` of the publish
config: the new snapshot's validation data, so its own scores come from its manifest) by
`validate.score_in_fresh_process`, the scoring that validates every snapshot. The current
one is checked against its manifest first (`verify_snapshot`). The decision (`decide`) is
pure: gated when the new AUC is below the current one by more than `max_auc_drop`, or its
log loss above by more than `max_logloss_increase` (a limit set to None is not checked); a
delta snapshot is scored materialized (`delta_snapshot.py`). A
model's first snapshot, or one whose current snapshot has another schema or cannot be scored
(its folder, or a link of its delta chain, fails its manifest or is gone), is published without
a comparison, and the reason says so. A caller may fence the pointer's move (`guard`, given the
outcome the move makes: the flow moves it only while its run still holds its windows, and
records the refresh PUBLISHED with it, `ett.lineage.publishing`): what the guard raises leaves
`current` where it was.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ettflow.ett.lineage import Outcome
from ettflow.publish.config import PublishConfig, PublishError
from ettflow.publish.current import CurrentPointer, move_current, read_current
from ettflow.publish.manifest import SnapshotManifest, verify_snapshot
from ettflow.publish.snapshot import MODEL_FILE

DEFAULT_MAX_AUC_DROP = 0.01


@dataclass(frozen=True, kw_only=True)
class GateConfig:
    """max_auc_drop: largest allowed fall of held-out AUC against the current snapshot;
    max_logloss_increase: largest allowed rise of held-out log loss. None: not checked."""

    max_auc_drop: float | None = DEFAULT_MAX_AUC_DROP
    max_logloss_increase: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_auc_drop", "max_logloss_increase"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise ValueError(f"GateConfig.{name} must be a number >= 0 or None (not checked), got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Scores:
    """Held-out quality of one snapshot: AUC (None with one class only) and log loss."""

    auc: float | None
    logloss: float


@dataclass(frozen=True, kw_only=True)
class PublishOutcome:
    """What the publish task decided. snapshot: the new snapshot's folder (installed either
    way); outcome: PUBLISHED or GATED; reason: why, in words; metrics: the new and the
    current snapshot's held-out scores and the limits; current: the folder `current` names
    after the decision (the new snapshot, or the one that stayed)."""

    snapshot: str
    outcome: Outcome
    reason: str
    metrics: dict[str, Any] = field(default_factory=dict)
    current: str | None = None

    def __post_init__(self) -> None:
        if self.outcome not in (Outcome.PUBLISHED, Outcome.GATED):
            raise ValueError(f"PublishOutcome.outcome is published or gated, got {self.outcome!r}")

    @property
    def gated(self) -> bool:
        return self.outcome is Outcome.GATED

    @property
    def message(self) -> str:
        """The run's state message."""
        return f"{self.outcome.value}: {self.reason}"


def decide(new: Scores, current: Scores, config: GateConfig) -> tuple[Outcome, str]:
    """PUBLISHED or GATED, and why (pure)."""
    problems, notes = [], []
    if config.max_auc_drop is not None and new.auc is not None and current.auc is not None:
        drop = current.auc - new.auc
        text = f"held-out AUC {new.auc:.4f} vs current {current.auc:.4f}"
        if drop > config.max_auc_drop:
            problems.append(f"{text}: a drop of {drop:.4f} > gate_max_auc_drop {config.max_auc_drop}")
        else:
            notes.append(text)
    if config.max_logloss_increase is not None:
        rise = new.logloss - current.logloss
        text = f"held-out log loss {new.logloss:.4f} vs current {current.logloss:.4f}"
        if not rise <= config.max_logloss_increase:  # NaN is a regression
            problems.append(f"{text}: a rise of {rise:.4f} > gate_max_logloss_increase "
                            f"{config.max_logloss_increase}")
        else:
            notes.append(text)
    if problems:
        return Outcome.GATED, "; ".join(problems) + ": the current snapshot stays"
    if notes:
        return Outcome.PUBLISHED, "; ".join(notes)
    if config.max_auc_drop is None and config.max_logloss_increase is None:
        return Outcome.PUBLISHED, "the gate is off (gate_max_auc_drop and gate_max_logloss_increase are null)"
    return Outcome.PUBLISHED, "no gate limit applies: the held-out labels hold one class, so there is no AUC"


def new_scores(manifest: SnapshotManifest) -> Scores:
    """The new snapshot's held-out scores, from its validation (its manifest's metrics)."""
    return Scores(auc=manifest.metrics.get("auc_snapshot"), logloss=float(manifest.metrics["logloss_snapshot"]))


def score_snapshot(folder: str, config: PublishConfig, schema) -> Scores:
    """Score an installed snapshot (checked against its manifest first) on the held-out
    batches of `config`, in a fresh process as validation does."""
    import tempfile

    from ettflow.publish.delta_snapshot import is_delta, materialized_file
    from ettflow.publish.validate import held_out, logloss, score_in_fresh_process
    from ettflow.trainer.rank.evaluate import auc

    manifest = verify_snapshot(folder)
    data = held_out(config, schema)
    with tempfile.TemporaryDirectory(prefix="ettflow-gate-") as tmp:  # a delta snapshot: scored materialized
        model = materialized_file(Path(folder), Path(tmp)) if is_delta(manifest) else Path(folder) / MODEL_FILE
        probs = score_in_fresh_process(model, data)["probs"]
    y, p = data.labels.numpy(), probs.numpy()
    value = auc(y, p)
    return Scores(auc=None if math.isnan(value) else round(value, 6), logloss=round(logloss(y, p), 6))


def gate_snapshot(manifest: SnapshotManifest, config: PublishConfig, gate: GateConfig, *,
                  guard: Callable[[PublishOutcome], AbstractContextManager[Any]] = contextlib.nullcontext,
                  ) -> PublishOutcome:
    """Compare the installed new snapshot with the model's current one and move `current`
    only when it passes (see the module docstring). `config` is the publish config the new
    snapshot was validated with (its held-out windows and batches); `current` moves inside
    `guard(outcome)` (the outcome returned), and not at all when it raises."""
    from ettflow.trainer.data.schema import FeatureSchema

    root = config.output_root
    current = read_current(root)
    new = new_scores(manifest)
    limits = {"gate_max_auc_drop": gate.max_auc_drop, "gate_max_logloss_increase": gate.max_logloss_increase}
    metrics: dict[str, Any] = {"new": {"auc": new.auc, "logloss": new.logloss}, **limits}
    if current is not None and current.path == manifest.path:
        return PublishOutcome(snapshot=manifest.path, outcome=Outcome.PUBLISHED, metrics=metrics, current=current.path,
                              reason="this snapshot is already the current one (a retry)")
    incomparable = _incomparable(current, manifest)
    if incomparable is not None:
        return _moved(root, manifest, guard, PublishOutcome(
            snapshot=manifest.path, outcome=Outcome.PUBLISHED, reason=incomparable, metrics=metrics,
            current=manifest.path))
    assert current is not None
    theirs = score_snapshot(current.path, config, FeatureSchema.from_dict(manifest.schema))
    metrics["current"] = {"snapshot": current.path, "auc": theirs.auc, "logloss": theirs.logloss}
    outcome, reason = decide(new, theirs, gate)
    if outcome is Outcome.GATED:
        return PublishOutcome(snapshot=manifest.path, outcome=outcome, metrics=metrics, current=current.path,
                              reason=f"{reason} ({current.path})")
    return _moved(root, manifest, guard, PublishOutcome(snapshot=manifest.path, outcome=outcome, metrics=metrics,
                                                        current=manifest.path, reason=reason))


def _moved(root: Path, manifest: SnapshotManifest, guard: Callable[[PublishOutcome], AbstractContextManager[Any]],
           outcome: PublishOutcome) -> PublishOutcome:
    """`outcome`, once `current` points at the new snapshot (moved inside `guard(outcome)`)."""
    with guard(outcome):
        move_current(root, manifest)
    return outcome


def _incomparable(current: CurrentPointer | None, manifest: SnapshotManifest) -> str | None:
    """Why the new snapshot is published without a comparison, or None when it is compared."""
    from ettflow.publish.delta_snapshot import chain_of

    if current is None:
        return "the model's first snapshot: nothing to compare with"
    try:  # a delta current is scored materialized: every link of its chain verified
        theirs = chain_of(Path(current.path))[-1][1]
    except PublishError as e:
        return f"the current snapshot {current.path} cannot be compared ({e})"
    if theirs.schema != manifest.schema:
        return f"the current snapshot {current.path} has another feature schema: not comparable"
    return None
