"""`ettflow bench`: run the paired evaluation, print the tables, save CSV/PNG/markdown and
archive every job to the warehouse tagged as a benchmark run.

Every job is a run of the `refresh_model` flow (`bench.jobs`): by default (`--path deployed`)
a run of the `refresh-adhoc` deployment that the local stack's process worker executes in a
new process, joining the stack's Ray head, its ranks and spares from the cluster's warm pool
(`ettflow up`'s stack, brought up when it is not; bench/deployed.py); with `--path in-process`
on Prefect's ephemeral API in this process and one local Ray started before the first job.
Parts: the ETT pairs (baseline and optimized) at each length, with the ablation rows beside
the default pair (`rows`: the baseline on a fresh host, the fixed checkpoint interval, live
recovery off, the warm pool off), the compile ablation (`ablation`: fresh processes) and the
orchestration overhead (`overhead`: the trainer alone, in this process); `--skip` leaves the
last three out. The baseline is an untuned job restarting on the same host (PyTorch's local
compile cache kept); the row "baseline, fresh host" restarts with none, as the study's fleet."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

    from .jobs import JobResult
    from .suite import Bench


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="paired baseline vs optimized benchmark (tables, CSV, PNG)")
    p.add_argument("--quick", action="store_true", help="small sizes: a few minutes")
    p.add_argument("--out", default="results", help="results folder (default: ./results)")
    p.add_argument("--url", help="warehouse URL for the benchmark runs (default: the per-user warehouse)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: rows (the ablation rows beside the "
                   "default pair), ablation (compile), overhead")
    p.add_argument("--verbose", action="store_true", help="show every library's warnings and logs too")
    from .refreshes import add_path_argument

    add_path_argument(p)
    p.add_argument("--no-warm-pool", dest="warm_pool", action="store_false",
                   help="every job starts its ranks cold (default: the bench keeps a warm pool between jobs, as "
                   "a long-lived driver of refreshes does, and adds the row 'optimized, warm pool off')")
    sizes = p.add_argument_group("sizes (override the quick/full plan)")
    sizes.add_argument("--lengths", help="training windows per job, comma-separated, e.g. 2,8,32")
    sizes.add_argument("--rows-per-window", type=int)
    sizes.add_argument("--batch-size", type=int, help="per rank")
    sizes.add_argument("--num-embeddings", type=int, help="rows of each embedding table")
    sizes.add_argument("--fixed-interval", type=int, dest="fixed_interval_steps",
                       help="steps between saves of the ablation row 'optimized, fixed N-step interval' (the "
                       "other jobs take the interval the flow's plan picks)")
    sizes.add_argument("--overhead-repeats", type=int, help="interleaved pairs of the recording-overhead runs")
    p.add_argument("--switch", action="append", default=[], metavar="NAME=BOOL", dest="switches",
                   help="set a trainer switch on every job, both modes and every row (repeatable), e.g. "
                   "compile=false for a smoke run of the command; results.md names it")
    p.set_defaults(func=main)
    parts = p.add_subparsers(dest="part", metavar="{refreshes,intervals,checkpoints}",
                             help="a measurement of its own (without one: the paired evaluation above)")
    from . import refreshes

    r = parts.add_parser("refreshes", help="a sequence of continuous refreshes per mode, and MovieLens",
                         description=refreshes.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    refreshes.add_arguments(r)
    r.set_defaults(func=refreshes.main)
    from . import intervals

    i = parts.add_parser("intervals", help="checkpoint-interval policies: fixed vs per-job probe vs history-fed",
                         description=intervals.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    intervals.add_arguments(i)
    i.set_defaults(func=intervals.main)
    from . import delta_checkpoints

    c = parts.add_parser("checkpoints", help="full vs delta checkpoints of the same state: bytes, blocking, restore",
                         description=delta_checkpoints.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    delta_checkpoints.add_arguments(c)
    c.set_defaults(func=delta_checkpoints.main)


def plan_from(args: argparse.Namespace):
    from dataclasses import replace

    from .suite import BenchPlan

    plan = BenchPlan.quick() if args.quick else BenchPlan.full()
    changes = {k: getattr(args, k) for k in ("rows_per_window", "batch_size", "num_embeddings",
                                              "fixed_interval_steps", "overhead_repeats") if getattr(args, k, None)}
    if getattr(args, "switches", None):
        changes["switches"] = parse_switches(args.switches)
    if not getattr(args, "warm_pool", True):
        changes["warm_pool"] = False
    if getattr(args, "lengths", None):
        changes["lengths"] = tuple(int(x) for x in args.lengths.split(","))
    return replace(plan, **changes)


def parse_switches(items: list[str]) -> dict[str, bool]:
    """`NAME=BOOL` items (true/false, 1/0, on/off) -> {name: bool}; a malformed one says so."""
    out: dict[str, bool] = {}
    for item in items:
        name, sep, value = item.partition("=")
        flag = {"true": True, "1": True, "on": True, "false": False, "0": False, "off": False}.get(value.lower())
        if not sep or not name or flag is None:
            raise SystemExit(f"ettflow bench: --switch takes NAME=BOOL (true or false), got {item!r}")
        out[name] = flag
    return out


def _targets(pairs, ablation, checkpoints, shutdown, overhead, ttr_ratio=None) -> pd.DataFrame:
    import pandas as pd

    first = pairs[min(pairs)]
    longest = pairs[max(pairs)]
    gain = first[1].metrics.ett_pct - first[0].metrics.ett_pct
    rows = [("optimized ETT% - baseline ETT% (default pair; untuned same-host baseline), points", gain, ">= 20"),
            ("optimized ETT% at the longest length", longest[1].metrics.ett_pct, ">= 93")]
    if ttr_ratio is not None and len(ttr_ratio):
        rows.append(("TTR of a single-rank kill, live recovery on / off (mean)", ttr_ratio["on/off"].iloc[-1],
                     "<= 0.3"))
    if ablation is not None:
        warm = ablation.loc[ablation["mode"] == "warm-restart", "compile_vs_cold_%"].iloc[0]
        rows.append(("warm-restart compile, % of cold", warm, "<= 10"))
    if len(checkpoints) == 2:
        sync, asyn = checkpoints.set_index("mode").loc["sync", "median_s"], checkpoints.set_index("mode").loc[
            "async", "median_s"]
        rows.append(("async save blocking, % of sync (median)", 100 * asyn / sync, "<= 10"))
    s = shutdown.set_index("mode")["device_held_after_last_step_s"]
    rows.append(("device-held shutdown standalone, % of in-trainer", 100 * s["optimized"] / s["baseline"], "<= 5"))
    m = first[1].metrics
    rows.append(("unattributed, % of wall (optimized, default pair)", 100 * m.components["unattributed"] / m.wall_s,
                 "<= 0.2"))
    if overhead is not None:
        rows.append(("ETT recording overhead, % of throughput", overhead.set_index("what").loc[
            "recording overhead %", "value"], "<= 3"))
    frame = pd.DataFrame(rows, columns=["target", "measured", "goal"])
    frame["measured"] = frame["measured"].astype(float).round(2)
    frame["met"] = [_meets(m, g) for m, g in zip(frame["measured"], frame["goal"])]
    return frame


def _meets(measured: float, goal: str) -> bool:
    op, bound = goal.split()
    return measured >= float(bound) if op == ">=" else measured <= float(bound)


@dataclass(frozen=True)
class Measured:
    """What the suite measured: the ETT pair per job length (shortest first), the ablation
    rows' jobs at the default length (empty when skipped), and the compile ablation and
    orchestration overhead tables (None when skipped)."""

    pairs: dict[int, tuple[JobResult, JobResult]]
    rows: list[JobResult]
    ablation: pd.DataFrame | None
    overhead: pd.DataFrame | None


def measure(bench: Bench, skip: set[str]) -> Measured:
    """Run every measurement of the plan (ETT pairs and the ablation rows, then the compile
    ablation and the overhead unless skipped) on a local Ray started once, before the first
    job (as a long-lived worker has it)."""
    from ettflow.trainer.group.ray_group import ensure_ray

    windows = bench.prepare_data()
    t0 = time.time()
    if bench.runner.path == "in-process":  # its jobs run in this process, on a local Ray started once
        ensure_ray(num_cpus=4)
    ray_s = time.time() - t0
    pairs, rows = bench.pairs(windows)
    if bench.runner.path != "in-process":  # the parts in this process join the cluster the deployment runs
        t0 = time.time()      # used (waiting for its pool joined it already)
        ensure_ray(num_cpus=4)
        ray_s = time.time() - t0
    ablation = None if "ablation" in skip else bench.ablation()
    overhead = None if "overhead" in skip else bench.overhead(windows)
    if overhead is not None:
        overhead.loc[len(overhead)] = {"what": "Ray: local start (ray.init), s", "value": round(ray_s, 2)}
        first = pairs[min(pairs)][1]
        init = min(e.start for e in first.events if e.phase == "device_init")
        overhead.loc[len(overhead)] = {"what": "job submission -> first trainer init event, s",
                                       "value": round(init - first.metrics.wall_start, 2)}
    return Measured(pairs=pairs, rows=rows, ablation=ablation, overhead=overhead)


def build_tables(jobs: list[JobResult], measured: Measured) -> tuple[dict[str, pd.DataFrame], pd.DataFrame, dict]:
    """Every results table by name (in print order), and the sync wasted-training curve with
    its optimal interval (for the picture)."""
    import pandas as pd

    from .suite import (
        attribution_table,
        checkpoint_table,
        pair_table,
        rows_table,
        shutdown_table,
        ttr_tables,
        wasted_curve,
    )

    pairs = measured.pairs
    tables: dict[str, pd.DataFrame] = {}
    default = pairs[min(pairs)]
    tables["ett_pair"] = pair_table(default)
    side_by_side = [*default, *measured.rows]
    tables["ett_rows"] = rows_table(side_by_side)
    tables["ttr_per_failure"], ratio = ttr_tables(side_by_side)
    if ratio is not None:
        tables["ttr_live_recovery"] = ratio
    tables["attribution"] = attribution_table(default)
    tables["job_length"] = pd.DataFrame([
        {"windows": length, "mode": j.mode, "train_s": round(j.metrics.effective_s, 1),
         "wall_s": round(j.metrics.wall_s, 1), "ETT%": round(j.metrics.ett_pct, 1)}
        for length, pair in pairs.items() for j in pair])
    if measured.ablation is not None:
        tables["compile_ablation"] = measured.ablation.round(2)
    tables["checkpoint_blocking"] = checkpoint_table(jobs)
    by_mode = tables["checkpoint_blocking"].set_index("mode")
    blocking = {m: float(by_mode.loc[m, "median_s"]) for m in by_mode.index}
    curve, choice = wasted_curve(default[0].metrics.effective_s, blocking.get("sync", 1.0))
    _, choice_async = wasted_curve(default[1].metrics.effective_s, blocking.get("async", 0.1))
    tables["wasted_vs_interval"] = curve.round(2)
    tables["interval_choice"] = pd.DataFrame([{"mode": "sync", **choice}, {"mode": "async", **choice_async}]).round(2)
    tables["shutdown"] = shutdown_table(default)
    if measured.overhead is not None:
        tables["overhead"] = measured.overhead
    tables["targets"] = _targets(pairs, measured.ablation, tables["checkpoint_blocking"], tables["shutdown"],
                                 measured.overhead, ratio)
    return tables, curve, choice


def save_results(out: Path, tables: dict[str, pd.DataFrame], pairs: dict[int, tuple[JobResult, JobResult]],
                 curve: pd.DataFrame, choice: dict, *, header: str) -> None:
    """Print every table, and write it as CSV and into `results.md`; draw the pictures."""
    from . import plots
    from .output import write_tables

    plots.components_bars(pairs, out / "components.png")
    plots.ett_vs_length(tables["job_length"], out / "ett_vs_length.png")
    plots.wasted_vs_interval(curve, choice, out / "wasted_vs_interval.png")
    write_tables(out, tables, header=header)


def archive_jobs(url: str | None, jobs: list[JobResult], *, quick: bool) -> str:
    """Archive every job to the warehouse, tagged as a benchmark run; return where (no password)."""
    from ettflow.ett.warehouse import Warehouse
    from ettflow.ett.warehouse_rows import RunInfo

    from .jobs import MODEL

    with Warehouse.open(url) as wh:
        for job in jobs:
            wh.archive_run(RunInfo(run_id=job.run_id, model=MODEL, mode=job.mode,
                                   tags={"benchmark": True, "quick": quick, "row": job.row}), job.events, job.metrics)
        return wh.display_url


PATH_WORDS = {"deployed": "every ETT job a run of the refresh-adhoc deployment, executed by the local stack's "
                            "process worker in a new process, ranks and spares from the cluster's pool",
              "in-process": "every ETT job a flow run in the bench's own process (its own warm pool, a local Ray)"}


def main(args: argparse.Namespace) -> int:
    from .refreshes import flow_environment

    flow_environment()
    from .deployed import prepare_environment

    prepare_environment(getattr(args, "path", "in-process"))  # before Ray is imported
    from ettflow.console import quiet_third_party

    quiet_third_party(verbose=getattr(args, "verbose", False))  # before Prefect and Ray are imported
    from .output import Clock, command_line
    from .suite import Bench

    plan = plan_from(args)
    skip = set(filter(None, args.skip.split(",")))
    unknown = skip - {"rows", "ablation", "overhead"}
    if unknown:
        raise SystemExit(f"ettflow bench: --skip takes rows, ablation, overhead; got {sorted(unknown)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    clock = Clock()
    from .deployed import runner

    bench = Bench(plan, out, clock.say, rows="rows" not in skip, runner=runner(args.path, say=clock.say))
    measured = measure(bench, skip)
    tables, curve, choice = build_tables(bench.jobs, measured)
    header = (f"# ettflow bench ({'quick' if args.quick else 'full'})\n\n"
              f"Path: {PATH_WORDS[args.path]}. Baseline: an untuned job restarting on the same host (PyTorch's "
              "local compile cache kept); the row 'baseline, fresh host' restarts with none (the study's fleet).\n\n"
              f"Command: `{command_line(args)}`; "
              f"machine: {platform.machine()}, {platform.processor() or ''} {os.cpu_count()} cores, "
              f"Python {sys.version.split()[0]}; took {clock.elapsed():.0f} s.")
    save_results(out, tables, measured.pairs, curve, choice, header=header)
    (out / "plan.json").write_text(json.dumps(plan.__dict__, default=list, indent=1))
    where = archive_jobs(args.url, bench.jobs, quick=bool(args.quick))
    clock.say(f"done: {len(bench.jobs)} jobs archived to {where}; tables, CSV and PNG in {out}")
    met = tables["targets"]["met"]
    gain = statistics.median(p[1].metrics.ett_pct - p[0].metrics.ett_pct for p in measured.pairs.values())
    clock.say(f"targets met: {int(met.sum())}/{len(met)}; median ETT gain {gain:.1f} points")
    return 0
