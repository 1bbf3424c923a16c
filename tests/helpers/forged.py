"""A checkpoint folder rewritten by someone who can write it: its DCP `.metadata` replaced by a
pickle that runs code, and (`reseal`) its manifest recomputed to match, so the checksums pass
and only the restricted reader (`trainer/checkpoint/reading.py`) stands between the file and
the code it names.

    forge_metadata(folder, marker)  # unpickling `.metadata` would create `marker`
    ...                             # the reader under test must refuse it
    assert not Path(marker).exists()
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path


class Exploit:
    """Unpickling this creates `marker`: stands for any code a forged pickle would run."""

    def __init__(self, marker: Path | str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def reseal(path: Path) -> None:
    """What an attacker who can write the folder does: recompute the manifest to match."""
    from ettflow.trainer.checkpoint.layout import COMMITTED, MANIFEST
    from ettflow.trainer.checkpoint.verify import _canonical_sha

    manifest = json.loads((path / MANIFEST).read_text())
    manifest.pop("manifest_sha256")
    for rel, entry in manifest["files"].items():
        entry["size"] = (path / rel).stat().st_size
        entry["sha256"] = hashlib.sha256((path / rel).read_bytes()).hexdigest()
    digest = _canonical_sha(manifest)
    (path / MANIFEST).write_text(json.dumps({**manifest, "manifest_sha256": digest}))
    (path / COMMITTED).write_text(digest)


def forge_metadata(path: Path, marker: Path | str, *, resealed: bool = True) -> None:
    """Replace `.metadata` with a pickle that creates `marker`; re-seal the manifest unless told not."""
    from ettflow.trainer.checkpoint.layout import DCP_METADATA

    (Path(path) / DCP_METADATA).write_bytes(pickle.dumps(Exploit(marker)))
    if resealed:
        reseal(Path(path))
