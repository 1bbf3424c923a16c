"""Where ettflow keeps its files, per user.

- ``ETTFLOW_HOME`` if set; else ``$XDG_DATA_HOME/ettflow``; else ``~/.local/share/ettflow``.
- Inside it: ``warehouse.db`` (the default SQLite warehouse; ``ETTFLOW_WAREHOUSE_URL``
  selects another database), ``spool/`` (phase events per run, ``ETTFLOW_SPOOL`` overrides),
  ``data/``, ``checkpoints/`` and ``snapshots/``.
"""

from __future__ import annotations

import os
from pathlib import Path


def data_home() -> Path:
    if os.environ.get("ETTFLOW_HOME"):
        home = Path(os.environ["ETTFLOW_HOME"])
    else:
        xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        home = Path(xdg) / "ettflow"
    home.mkdir(parents=True, exist_ok=True)
    return home


def spool_root() -> Path:
    root = Path(os.environ["ETTFLOW_SPOOL"]) if os.environ.get("ETTFLOW_SPOOL") else data_home() / "spool"
    root.mkdir(parents=True, exist_ok=True)
    return root
