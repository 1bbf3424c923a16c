"""The benchmarks' output: progress lines stamped with the time since the start, and tables
printed, saved as CSV and gathered into one markdown file (`ettflow bench` and its
`intervals` and `refreshes` parts write theirs the same way)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pandas as pd


class Clock:
    """The benchmark's progress lines, each stamped with the seconds since it started;
    written above any progress bar (tqdm), so the bar stays at the bottom."""

    def __init__(self) -> None:
        self.started = time.time()

    def elapsed(self) -> float:
        return time.time() - self.started

    def say(self, msg: str) -> None:
        from tqdm import tqdm

        tqdm.write(f"[{self.elapsed():7.1f} s] {msg}", file=sys.stdout)
        sys.stdout.flush()


def command_line(args) -> str:
    """The command that made a report, as written in it: `ettflow <argv>` with the secret of
    any URL argument (`--url postgresql://u:pw@...`) shown as `***`."""
    from ettflow.ett.redact import redact_argv

    return "ettflow " + " ".join(redact_argv(getattr(args, "argv", sys.argv[1:])))


def markdown(frame: pd.DataFrame) -> str:
    cells = [[str(c) for c in frame.columns]] + [[f"{v:g}" if isinstance(v, float) else str(v) for v in row]
                                                  for row in frame.itertuples(index=False)]
    lines = ["| " + " | ".join(r) + " |" for r in cells]
    lines.insert(1, "|" + "---|" * len(frame.columns))
    return "\n".join(lines)


def write_tables(out: Path, tables: dict[str, pd.DataFrame], *, header: str, footer: str | None = None) -> None:
    """Print every table, and write each as `<name>.csv` and all of them into `results.md`
    (after `header`, before `footer`)."""
    md = [header, ""]
    for name, frame in tables.items():
        frame.to_csv(out / f"{name}.csv", index=False)
        print(f"\n== {name} ==\n{frame.to_string(index=False)}")
        md += [f"## {name}", "", markdown(frame), ""]
    if footer is not None:
        md += [footer, ""]
    (out / "results.md").write_text("\n".join(md))
