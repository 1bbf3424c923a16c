"""`replace_json(path, data)`: write a small JSON file so a reader sees the old file or the
new one, never a part (a temporary file beside it, then `os.replace`). `durable` also fsyncs
the file before the rename, for records that must survive a machine crash. Raises OSError."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def replace_json(path: Path, data: Mapping[str, Any], *, durable: bool = False,
                 default: Callable[[Any], Any] | None = None) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, sort_keys=True, default=default)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
