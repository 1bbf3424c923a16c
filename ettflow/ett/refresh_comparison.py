"""Refreshes side by side: `comparison_table(runs, starts)` (pure).

    refresh  start  windows  TTS s  ETT %  NoF  wall s  scheduling %  trainer_init %  ...

`runs` is the warehouse's `runs_frame` rows of the refreshes (in the order they ran); each
component's share is its exposed seconds over the run's wall time, in percent, so a row's
shares sum to 100 (with `unattributed`). `starts` says, per run id, how each began ("cold",
"warm from <run>"), and `windows` which windows it trained.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd

from .events import L2_ORDER


def comparison_table(runs: pd.DataFrame, starts: Mapping[str, str],
                     windows: Mapping[str, Sequence[str]]) -> pd.DataFrame:
    rows = []
    for i, r in enumerate(runs.to_dict("records"), start=1):
        wall = float(r["wall_s"]) or float("nan")
        row = {"refresh": i, "run": str(r["run_id"])[:8], "start": starts.get(r["run_id"], "?"),
               "windows": ", ".join(windows.get(r["run_id"], ())) or "-", "TTS s": round(float(r["tts_s"]), 2),
               "ETT %": round(float(r["ett_pct"]), 1), "NoF": int(r["nof"]), "wall s": round(float(r["wall_s"]), 2)}
        for name in L2_ORDER:
            row[f"{name} %"] = round(100.0 * float(r.get(f"{name}_s", 0.0) or 0.0) / wall, 1)
        rows.append(row)
    return pd.DataFrame(rows)
