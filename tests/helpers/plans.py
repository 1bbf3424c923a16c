"""The parameters of a refresh as `ettflow.tasks.plan.plan_refresh` takes them, for the tests
that plan a refresh without running it (no Prefect, no Ray)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def params(data: str | Path, tmp_path: Path, **over: Any) -> dict[str, Any]:
    """A 2-rank refresh of the data under `data`: its work, spool and snapshot folders under
    `tmp_path`, tables of 100 rows, batch 32; `over` on top."""
    base = dict(data_root=str(data), work_root=str(tmp_path / "work"), spool_root=str(tmp_path / "spool"),
                snapshot_root=str(tmp_path / "snap"), max_embeddings=100, world_size=2, batch_size=32)
    base.update(over)
    return base
