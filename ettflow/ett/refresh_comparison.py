"""Refreshes side by side: `comparison_table(runs, starts)` (pure).

    refresh  start  windows  TTS s  ETT %  NoF  TTR s  capETT%  held s  wall s  scheduling %  ...

`runs` is the warehouse's `runs_frame` rows of the refreshes (in the order they ran); each
component's share is its exposed seconds over the run's wall time, in percent, so a row's
shares sum to 100 (with `unattributed`). TTR is the run's total; capETT% and held s are the
capacity-inclusive ETT and the slot-seconds the pool and spares held for it (`ett.capacity`).
`starts` says, per run id, how each began ("cold",
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
               "ETT %": round(float(r["ett_pct"]), 1), "NoF": int(r["nof"]),
               "TTR s": _rounded(r.get("ttr_total_s"), 2), "capETT%": _rounded(r.get("capacity_ett_pct"), 1),
               "held s": _rounded(r.get("held_s"), 1), "wall s": round(float(r["wall_s"]), 2)}
        for name in L2_ORDER:
            row[f"{name} %"] = round(100.0 * float(r.get(f"{name}_s", 0.0) or 0.0) / wall, 1)
        rows.append(row)
    return pd.DataFrame(rows)


def _rounded(value: object, digits: int) -> float:
    """A value rows archived before it existed lack (NaN then)."""
    try:
        return round(float(value), digits)
    except (TypeError, ValueError):
        return float("nan")
