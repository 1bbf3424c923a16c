"""Clean console output of the real `ettflow refresh` (the README's main job, in its own
ETTFLOW_HOME): the default refresh, with its induced failure and a cold compile, prints fewer
than 40 lines and no third-party warning, and ettflow's own lines stay. (`--verbose` showing
the third-party lines again: e2e/test_refresh_process.py; the table itself: unit/test_console_noise.py.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ettflow.console import ray_skip_regex

ROOT = Path(__file__).resolve().parents[2]
ETTFLOW = Path(sys.executable).with_name("ettflow")

# What a third-party warning looks like on the console (the known ones, and the shapes of any
# other): a Python warning line, a library logger's WARNING, torch's own log prefix, Ray's notes.
THIRD_PARTY = re.compile(
    "|".join([ray_skip_regex(), r"\b\w+Warning: ", r"WARNING:(torch|torchrec|fbgemm|ray|prefect)",
              r"\[rank\d+\]:[WE]\d{4}", r"\(raylet\)", r"Ray deduplicates logs", r"auth_token"])
)


def refresh(home: Path, *args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "ETTFLOW_VERBOSE", "RAY_DEDUP_LOGS_SKIP_REGEX", "RAY_DEDUP_LOGS_ALLOW_REGEX",
                        "ETTFLOW_WAREHOUSE_URL")}
    env.update(ETTFLOW_HOME=str(home), RAY_USAGE_STATS_ENABLED="0", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")
    done = subprocess.run([str(ETTFLOW), "refresh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    out = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 0, "\n".join(out[-60:])
    return out


# The progress lines (tasks/progress.py): one a few seconds while training, one every 30 s while
# an attempt starts. How many there are follows how long the run takes on this machine, so they
# are not counted against the bound; that they are rate-limited is checked instead.
# (Their time is whole seconds and its zone, `flows/env_defaults.py`: a gap shows up to 1 s short.)
PROGRESS = re.compile(r"^(\d\d):(\d\d):(\d\d(?:\.\d+)?) \S+ \| INFO +\| Task run 'train-[^']*' - "
                      r"(training: step |attempt \d+ starting: )")
GAP_S = {"training: step ": 2.0, "starting: ": 28.0}  # ProgressReporter.every_s = 3, the 30-s start notes


def progress_gaps(lines: list[str]) -> dict[str, list[float]]:
    """The seconds between successive progress lines of each kind."""
    last: dict[str, float] = {}
    gaps: dict[str, list[float]] = {kind: [] for kind in GAP_S}
    for line in lines:
        m = PROGRESS.match(line)
        if m is None or "(100%)" in line:  # the last line comes when training ends, off the cadence
            continue
        at = int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])
        kind = "training: step " if m[4].startswith("training") else "starting: "
        if kind in last:
            gaps[kind].append(at - last[kind])
        last[kind] = at
    return gaps


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_default_refresh_is_short_and_free_of_third_party_warnings(tmp_path):
    # the default: 2 ranks, one induced SIGKILL (step 16) and its recovery; 48 steps of the demo's 7,680
    quiet = refresh(tmp_path, "--max-steps", "48")
    noisy = [line for line in quiet if THIRD_PARTY.search(line)]
    steady = [line for line in quiet if not PROGRESS.match(line)]
    assert not noisy and len(steady) < 40, (f"{len(steady)} lines besides progress, {len(noisy)} third-party:\n"
                                            + "\n".join(noisy) + "\n---- all of it:\n" + "\n".join(quiet))
    assert len(steady) < len(quiet)  # the progress lines were there, and recognised
    for kind, gaps in progress_gaps(quiet).items():
        assert all(gap >= GAP_S[kind] for gap in gaps), (kind, gaps, "\n".join(quiet))
    text = "\n".join(quiet)
    for own in ("ettflow refresh:", "trainer reserved", "attempt 0 failed", "trained to step", "published",
                "effective_training", "snapshot:"):
        assert own in text, own
