"""Publishing: anchor checkpoint -> validated inference snapshot, on the CPU.

- config: PublishConfig, PublishError / AnchorError / SnapshotValidationError
- anchor: open_anchor (verify + anchor.json), load_float_model (DCP, N ranks -> one DLRM)
- snapshot: int8 tables, the (dense, values, lengths) TorchScript module
- validate: held-out batches, scoring in a process without ettflow/torchrec, compare
- manifest: SnapshotManifest, atomic install, verify_snapshot
- publisher: publish_snapshot, is_retryable; cli: `ettflow publish`
- current: the model's `current` snapshot pointer (read_current, move_current)
- gate: GateConfig, PublishOutcome, gate_snapshot (compare with the current snapshot)
- retention: what a model's snapshot root keeps (doomed_snapshots, remove_snapshot)

Names are imported lazily, so `ettflow --help` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PublishConfig": "config", "PublishError": "config", "AnchorError": "config",
    "SnapshotValidationError": "config", "DEFAULT_TOLERANCE": "config",
    "AnchorCheckpoint": "anchor", "open_anchor": "anchor", "load_float_model": "anchor",
    "SnapshotManifest": "manifest", "read_manifest": "manifest", "verify_snapshot": "manifest",
    "publish_snapshot": "publisher", "is_retryable": "publisher",
    "CurrentPointer": "current", "read_current": "current", "move_current": "current",
    "GateConfig": "gate", "PublishOutcome": "gate", "gate_snapshot": "gate",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
