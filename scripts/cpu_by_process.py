"""Where a command's CPU goes, by the kind of process (the test suite's profile in BENCHMARKS.md).

    python3 scripts/cpu_by_process.py sample /tmp/cpu.json &   # every second, until SIGTERM
    bash .ci/run; kill %1
    python3 scripts/cpu_by_process.py report /tmp/cpu.json     # a Markdown table, by kind

`sample` reads every process's user + system time and command line from /proc once a second
(keyed by pid and start time, so a reused pid is a new process); a process that lived less than
a second between two samples is missed, and one already running at the first sample counts
only what it used after it. `report` sums the last reading of each by the first
kind whose expression its command line matches. Linux only; standard library only.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import sys
import time

KINDS = (
    ("rank processes (`ray::TrainerActor`)", r"TrainerAct"),
    ("pytest's workers", r"exec\(eval\(sys\.stdin"),
    ("other Ray actors (in-memory keepers, pool services, run owners)", r"^\[?ray::(?!Dashboard|RuntimeEnv)"),
    ("Ray services (raylet, GCS, agents, log monitor, idle workers)",
     r"raylet|gcs_server|log_monitor|dashboard|runtime_env|RuntimeEnvAgent|DashboardAgent|monitor\.py|"
     r"default_worker|ray start|\[ray\]|ray/_private"),
    ("C++ compiler (inductor's cold compiles)", r"cc1plus|\bg\+\+|\bgcc\b|\bcollect2\b|/\bld\b|\bas\b"),
    ("Prefect servers", r"prefect server|uvicorn|\[prefect\]"),
    ("Prefect workers and flow processes", r"prefect worker|flow-run|prefect\.engine|flow_engine|prefect\.flow"),
    ("`ettflow` command processes (CLI, `up`, their children)", r"ettflow"),
    ("setup (pip)", r"\bpip\b"),
    ("chromium (the browser test)", r"chrom"),
    ("PostgreSQL", r"postgres"),
    ("spawned Python children (publish checks, DCP, tests' own)", r"python|multiprocessing"),
)
OTHER = "the host's own services and kernel threads"


def sample(out: str) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    seen: dict[tuple[int, str], list] = {}
    before: dict[tuple[int, str], float] = {}  # what the processes running at the first sample had used
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))

    def dump() -> None:
        with open(out + ".part", "w") as f:
            json.dump([[key[0], cpu - before.get(key, 0.0), cmd] for key, (cpu, cmd) in seen.items()], f)
        os.replace(out + ".part", out)

    n = 0
    while not stopped:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
                fields = stat[stat.rindex(")") + 2:].split()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
            except (OSError, ValueError):
                continue  # gone meanwhile
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            key, used = (int(pid), fields[19]), (int(fields[11]) + int(fields[12])) / tick
            if n == 0:
                before[key] = used
            seen[key] = [used, cmd or f"[{name}]"]
        n += 1
        if n % 30 == 0:
            dump()
        time.sleep(1.0)
    dump()


def report(path: str) -> None:
    with open(path) as f:
        rows = json.load(f)
    cpu: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for _, seconds, cmd in rows:
        kind = next((k for k, rx in KINDS if re.search(rx, cmd)), OTHER)
        cpu[kind] += seconds
        count[kind] += 1
    total = sum(cpu.values())
    print("| where | CPU s | share | processes |\n|---|---|---|---|")
    for kind, seconds in cpu.most_common():
        print(f"| {kind} | {seconds:.0f} | {100 * seconds / total:.1f}% | {count[kind]} |")
    print(f"| all | {total:.0f} | 100% | {sum(count.values())} |")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("sample", "report"):
        sys.exit("usage: cpu_by_process.py sample OUT.json | report OUT.json")
    (sample if sys.argv[1] == "sample" else report)(sys.argv[2])
