"""`ettflow bench`: run the paired evaluation, print the tables, save CSV/PNG/markdown and
archive every job to the warehouse tagged as a benchmark run."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import pandas as pd


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="paired baseline vs optimized benchmark (tables, CSV, PNG)")
    p.add_argument("--quick", action="store_true", help="small sizes: a few minutes")
    p.add_argument("--out", default="results", help="results folder (default: ./results)")
    p.add_argument("--url", help="warehouse URL for the benchmark runs (default: the per-user warehouse)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: ablation,overhead")
    sizes = p.add_argument_group("sizes (override the quick/full plan)")
    sizes.add_argument("--lengths", help="training windows per job, comma-separated, e.g. 2,8,32")
    sizes.add_argument("--rows-per-window", type=int)
    sizes.add_argument("--batch-size", type=int, help="per rank")
    sizes.add_argument("--num-embeddings", type=int, help="rows of each embedding table")
    sizes.add_argument("--checkpoint-every", type=int, dest="checkpoint_every_steps")
    p.set_defaults(func=main)


def plan_from(args: argparse.Namespace):
    from dataclasses import replace

    from .suite import BenchPlan

    plan = BenchPlan.quick() if args.quick else BenchPlan.full()
    changes = {k: getattr(args, k) for k in ("rows_per_window", "batch_size", "num_embeddings",
                                              "checkpoint_every_steps") if getattr(args, k, None)}
    if getattr(args, "lengths", None):
        changes["lengths"] = tuple(int(x) for x in args.lengths.split(","))
    return replace(plan, **changes)


def _targets(pairs, ablation, checkpoints, shutdown, overhead) -> pd.DataFrame:
    first = pairs[min(pairs)]
    longest = pairs[max(pairs)]
    gain = first[1].metrics.ett_pct - first[0].metrics.ett_pct
    rows = [("optimized ETT% - baseline ETT% (default pair), points", gain, ">= 20"),
            ("optimized ETT% at the longest length", longest[1].metrics.ett_pct, ">= 93")]
    if ablation is not None:
        warm = ablation.loc[ablation["mode"] == "warm-restart", "compile_vs_cold_%"].iloc[0]
        rows.append(("warm-restart compile, % of cold", warm, "<= 10"))
    if len(checkpoints) == 2:
        sync, asyn = checkpoints.set_index("mode").loc["sync", "median_s"], checkpoints.set_index("mode").loc[
            "async", "median_s"]
        rows.append(("async save blocking, % of sync (median)", 100 * asyn / sync, "<= 10"))
    s = shutdown.set_index("mode")["device_held_after_last_step_s"]
    rows.append(("device-held shutdown standalone, % of in-trainer", 100 * s["optimized"] / s["baseline"], "<= 5"))
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


def markdown(frame: pd.DataFrame) -> str:
    cells = [[str(c) for c in frame.columns]] + [[f"{v:g}" if isinstance(v, float) else str(v) for v in row]
                                                  for row in frame.itertuples(index=False)]
    lines = ["| " + " | ".join(r) + " |" for r in cells]
    lines.insert(1, "|" + "---|" * len(frame.columns))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from ettflow.ett.warehouse import Warehouse
    from ettflow.ett.warehouse_rows import RunInfo
    from ettflow.trainer.ray_group import ensure_ray

    from . import plots
    from .suite import Bench, attribution_table, checkpoint_table, pair_table, shutdown_table, wasted_curve

    plan = plan_from(args)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    started = time.time()

    def say(msg: str) -> None:
        print(f"[{time.time() - started:7.1f} s] {msg}", flush=True)

    bench = Bench(plan, out, say)
    windows = bench.prepare_data()
    t0 = time.time()
    ensure_ray(num_cpus=4)
    ray_s = time.time() - t0
    pairs = bench.pairs(windows)
    ablation = None if "ablation" in skip else bench.ablation()
    overhead = None if "overhead" in skip else bench.overhead(windows)
    if overhead is not None:
        overhead.loc[len(overhead)] = {"what": "Ray: local start (ray.init), s", "value": round(ray_s, 2)}
        first = pairs[min(pairs)][1]
        init = min(e.start for e in first.events if e.phase == "device_init")
        overhead.loc[len(overhead)] = {"what": "job submission -> first trainer init event, s",
                                       "value": round(init - first.metrics.wall_start, 2)}

    tables: dict[str, pd.DataFrame] = {}
    default = pairs[min(pairs)]
    tables["ett_pair"] = pair_table(default)
    tables["attribution"] = attribution_table(default)
    tables["job_length"] = pd.DataFrame([
        {"windows": length, "mode": j.mode, "train_s": round(j.metrics.effective_s, 1),
         "wall_s": round(j.metrics.wall_s, 1), "ETT%": round(j.metrics.ett_pct, 1)}
        for length, pair in pairs.items() for j in pair])
    if ablation is not None:
        tables["compile_ablation"] = ablation.round(2)
    tables["checkpoint_blocking"] = checkpoint_table(bench.jobs)
    sync_blocking = tables["checkpoint_blocking"].set_index("mode")
    blocking = {m: float(sync_blocking.loc[m, "median_s"]) for m in sync_blocking.index}
    curve, choice = wasted_curve(default[0].metrics.effective_s, blocking.get("sync", 1.0))
    curve_async, choice_async = wasted_curve(default[1].metrics.effective_s, blocking.get("async", 0.1))
    tables["wasted_vs_interval"] = curve.round(2)
    tables["interval_choice"] = pd.DataFrame([{"mode": "sync", **choice}, {"mode": "async", **choice_async}]).round(2)
    tables["shutdown"] = shutdown_table(default)
    if overhead is not None:
        tables["overhead"] = overhead
    tables["targets"] = _targets(pairs, ablation, tables["checkpoint_blocking"], tables["shutdown"], overhead)

    plots.components_bars(pairs, out / "components.png")
    plots.ett_vs_length(tables["job_length"], out / "ett_vs_length.png")
    plots.wasted_vs_interval(curve, choice, out / "wasted_vs_interval.png")
    md = [f"# ettflow bench ({'quick' if args.quick else 'full'})", "",
          f"Command: `ettflow {' '.join(getattr(args, 'argv', sys.argv[1:]))}`; "
          f"machine: {platform.machine()}, {platform.processor() or ''} {__import__('os').cpu_count()} cores, "
          f"Python {sys.version.split()[0]}; took {time.time() - started:.0f} s.", ""]
    for name, frame in tables.items():
        frame.to_csv(out / f"{name}.csv", index=False)
        print(f"\n== {name} ==\n{frame.to_string(index=False)}")
        md += [f"## {name}", "", markdown(frame), ""]
    (out / "results.md").write_text("\n".join(md))
    (out / "plan.json").write_text(json.dumps(plan.__dict__, default=list, indent=1))

    wh = Warehouse.open(args.url)
    for job in bench.jobs:
        wh.archive_run(RunInfo(run_id=job.run_id, model="bench-dlrm", mode=job.mode,
                               tags={"benchmark": True, "quick": bool(args.quick)}), job.events, job.metrics)
    say(f"done: {len(bench.jobs)} jobs archived to {wh.display_url}; tables, CSV and PNG in {out}")
    met = tables["targets"]["met"]
    say(f"targets met: {int(met.sum())}/{len(met)}; median ETT gain "
        f"{statistics.median(p[1].metrics.ett_pct - p[0].metrics.ett_pct for p in pairs.values()):.1f} points")
    return 0
