"""`ettflow simulate`: a model's ETT and capacity-inclusive ETT at fleet scale (`ett.simulate`).

    ettflow simulate [--model M] [--gpus 1024,4096,16384] [--failures hpca25|llama3 | --mttf-h H]
                     [--train-h 4] [--replications 100] [--max-spares 4] [--out PNG]

Costs: a model's runs in the warehouse (`ett.simulate_inputs`: the baseline's from its baseline
runs, the optimized settings' from its optimized runs), each cost no run measured assumed
(`ett.simulate.ASSUMED_COSTS`); without --model, all assumed. The window (`--train-h`, hours of
training per refresh) and the failure model are the job shape's. For each GPU count: the
untuned baseline and the optimized settings with the number of spare nodes (0..--max-spares)
that maximizes capETT, each over --replications seeded refreshes (mean and 95% half-width),
then capETT against the number of spares; a PNG of both.

`register(subparsers)` adds the command to `ettflow`'s sub-parsers.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from ettflow.console import user_doc

SPARE_NOTE = "spares: spare nodes held per run (each --gpus-per-node GPUs), used by live recovery"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="a model's ETT and capETT at 1k-16k GPUs from its measured costs and "
                                        "published failure rates (baseline vs optimized, spares that pay)",
                       description=user_doc(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="read this model's costs from its runs in the warehouse (default: all assumed)")
    p.add_argument("--url", help="warehouse URL (default: ETTFLOW_WAREHOUSE_URL or the per-user SQLite file)")
    p.add_argument("--gpus", default="1024,4096,16384", help="GPU counts, comma-separated (default: %(default)s)")
    p.add_argument("--failures", default="hpca25", choices=("hpca25", "llama3"),
                   help="published failure model (default: %(default)s)")
    p.add_argument("--mttf-h", type=float, help="instead: a job MTTF in hours at --mttf-gpus GPUs (constant per GPU)")
    p.add_argument("--mttf-gpus", type=int, default=1024, help="the GPU count --mttf-h is for (default: %(default)s)")
    p.add_argument("--train-h", type=float, default=4.0,
                   help="hours of training on new data per refresh, the window (default: %(default)s)")
    p.add_argument("--replications", type=int, default=100, help="refreshes per row (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-spares", type=int, default=4, help="spare nodes tried, 0..N (default: %(default)s)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs a failure takes and a spare holds")
    p.add_argument("--out", help="the picture's path (default: simulate-<model>.png here)")
    p.add_argument("--validate", action="store_true",
                   help="with --model: replay each of its runs (its measured costs, its own failure times) and "
                        "print its measured ETT and capETT beside the simulated ones")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")
    p.set_defaults(func=cmd_simulate)


def validation_rows(measured) -> list[dict]:
    """Each measured run replayed (`ett.simulate_inputs.MeasuredRun`): its ETT and capETT, measured
    and simulated, and the differences in points."""
    import random

    from ettflow.ett.run_metrics import compute_run_metrics
    from ettflow.ett.simulate import simulate_refresh

    rows = []
    for r in measured:
        sim = compute_run_metrics(simulate_refresh(r.costs, r.policy, None, r.gpus, random.Random(0),
                                                   run_id=r.run_id, failure_times=r.failure_times))
        m = r.metrics
        rows.append({"run": r.run_id[:12], "NoF": m.nof, "wall_s": round(m.wall_s, 1),
                     "ETT%": round(m.ett_pct, 1), "sim_ETT%": round(sim.ett_pct, 1),
                     "capETT%": round(m.capacity_ett_pct, 1), "sim_capETT%": round(sim.capacity_ett_pct, 1),
                     "d_ETT": round(sim.ett_pct - m.ett_pct, 2),
                     "d_capETT": round(sim.capacity_ett_pct - m.capacity_ett_pct, 2),
                     "most_off": _most_off(m.components, sim.components)})
    return rows


def _most_off(measured: dict[str, float], simulated: dict[str, float]) -> str:
    """The component whose simulated seconds differ most from the measured ones: where a
    replay's difference comes from ("wasted_training +1.2 s")."""
    deltas = {c: simulated.get(c, 0.0) - measured.get(c, 0.0) for c in {*measured, *simulated}}
    worst = max(sorted(deltas), key=lambda c: abs(deltas[c]))
    return f"{worst} {deltas[worst]:+.1f} s"


def _gpus(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"ettflow simulate: --gpus must be positive integers, comma-separated; got {text!r}")
    return values


def _measured(args: argparse.Namespace) -> dict:
    """The model's trained runs measured (`ett.simulate_inputs.measure_run`), by mode."""
    from ettflow.ett.simulate_inputs import measure_run
    from ettflow.ett.warehouse import Warehouse

    measured: dict[str, list] = {}
    with Warehouse.open(args.url) as wh:
        runs = wh.runs_frame(model=args.model)
        if runs.empty:
            raise SystemExit(f"ettflow simulate: the warehouse at {wh.display_url} holds no run of model "
                             f"{args.model!r}; run a refresh first or leave out --model (assumed costs)")
        for run_id, mode, trained in zip(runs["run_id"], runs["mode"], runs["started_training"], strict=True):
            if trained:
                try:
                    measured.setdefault(mode, []).append(measure_run(wh.events_for(run_id)))
                except ValueError:  # nothing trained on new data: no costs to read
                    continue
    return measured


def _model_costs(args: argparse.Namespace):
    """(baseline costs, optimized costs, a line per mode saying what was measured)."""
    from ettflow.ett.simulate import ASSUMED_COSTS
    from ettflow.ett.simulate_inputs import model_costs

    if not args.model:
        return ASSUMED_COSTS, ASSUMED_COSTS, ["costs: all assumed (no --model): ett.simulate.ASSUMED_COSTS"]
    measured = _measured(args)
    lines, out = [], []
    for mode in ("baseline", "optimized"):
        costs = model_costs(measured.get(mode, []))
        out.append(costs)
        assumed = sorted({"cold", "warm", "prewarm_s", "save_blocking_s", "detect_s", "restart_s", "live_recovery_s",
                          "spare_start_s", "shutdown_s"} - costs.measured)
        lines.append(f"{mode} costs: {len(measured.get(mode, []))} run(s) of {args.model}; measured "
                     f"{', '.join(sorted(costs.measured - {'train_s'})) or 'nothing'}; assumed "
                     f"{', '.join(assumed) or 'nothing'}")
    return out[0], out[1], lines


def cmd_simulate(args: argparse.Namespace) -> int:
    import pandas as pd

    from ettflow.ett import report
    from ettflow.ett.simulate import BASELINE, FAILURE_MODELS, OPTIMIZED, constant_mttf, replicate

    gpus = _gpus(args.gpus)
    if args.replications < 2 or args.max_spares < 0 or args.train_h <= 0:
        print("ettflow simulate: --replications must be >= 2, --max-spares >= 0 and --train-h > 0", file=sys.stderr)
        return 2
    if args.validate:
        if not args.model:
            print("ettflow simulate: --validate needs --model M (the model whose runs to replay)", file=sys.stderr)
            return 2
        runs = validation_rows([r for rs in _measured(args).values() for r in rs])
        print(report.render(pd.DataFrame(runs), args.format))
        return 0
    failures = constant_mttf(args.mttf_h, args.mttf_gpus) if args.mttf_h else FAILURE_MODELS[args.failures]
    base_costs, opt_costs, lines = _model_costs(args)
    train_s = args.train_h * 3600.0
    base_costs, opt_costs = replace(base_costs, train_s=train_s), replace(opt_costs, train_s=train_s)
    node = args.gpus_per_node
    # prewarm only on a warm start someone measured (or all assumed): the pool's own pay test
    # holds none where no pooled start was ever seen, and an assumed warm start would be a guess
    prewarm = "warm" in opt_costs.measured or not args.model
    lines.append(f"optimized: prewarmed workers {'held' if prewarm else 'not held (no pooled start measured)'}, "
                 "live recovery, Young's checkpoint interval; baseline: cold start, every rank restarts, "
                 f"a checkpoint every {BASELINE.interval_s:g} s")
    optimized = replace(OPTIMIZED, gpus_per_node=node, prewarm=prewarm)
    rows, sweep = [], []
    for g in gpus:
        kw = {"replications": args.replications, "seed": args.seed}
        tried = [replicate(opt_costs, replace(optimized, spares=k), failures, g, **kw)
                 for k in range(args.max_spares + 1)]
        best = max(tried, key=lambda s: s.cap_ett.mean)
        sweep += [{"gpus": g, "spares": s.policy.spares, "capETT%": round(s.cap_ett.mean, 1),
                   "ETT%": round(s.ett.mean, 1), "best": s is best} for s in tried]
        for s in (replicate(base_costs, replace(BASELINE, gpus_per_node=node), failures, g, **kw), best):
            lost = {k: v for k, v in s.components.items() if k != "effective_training"}
            top = max(lost, key=lost.get)
            rows.append({"gpus": g, "policy": s.policy.name, "spares": s.policy.spares,
                         "MTTF_h": round(s.mttf_h, 2), "interval_s": round(s.interval_s), "NoF": round(s.nof, 2),
                         "ETT%": round(s.ett.mean, 1), "ETT_ci": round(s.ett.half_width, 1),
                         "capETT%": round(s.cap_ett.mean, 1), "capETT_ci": round(s.cap_ett.half_width, 1),
                         "top_loss": f"{top} {100 * lost[top] / sum(s.components.values()):.1f}%"})
    table, spares = pd.DataFrame(rows), pd.DataFrame(sweep)
    if args.format != "table":
        print(report.render(table, args.format))
        print(report.render(spares, args.format))
        return 0
    print(f"ettflow simulate: {args.train_h:g} h of training per refresh; failures: {failures.source}; "
          f"{args.replications} replications per row (seed {args.seed}); ETT_ci, capETT_ci: 95% half-widths")
    for line in lines:
        print("  " + line)
    print(report.render(table, "table"))
    print(f"\ncapETT% against the number of spares ({SPARE_NOTE}):")
    by_spares = spares.pivot(index="spares", columns="gpus", values="capETT%")
    by_spares.columns = [f"{g} GPUs" for g in by_spares.columns]
    print(report.render(by_spares.reset_index(), "table"))
    picked = spares[spares["best"]]
    print("capETT peaks at: " + ", ".join(f"{g} GPUs {k} spare(s)" for g, k in zip(picked["gpus"], picked["spares"],
                                                                                   strict=True)))
    out = Path(args.out or f"simulate-{args.model or 'assumed'}.png")
    out.write_bytes(_picture(table, spares))
    print(f"picture: {out}")
    return 0


def _picture(table, spares) -> bytes:
    """ETT and capETT against GPUs (both policies), capETT against spares (one line per GPU count)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy, style in (("baseline", "--"), ("optimized", "-")):
        rows = table[table["policy"] == policy]
        left.plot(rows["gpus"], rows["ETT%"], style, marker="o", label=f"{policy} ETT")
        left.plot(rows["gpus"], rows["capETT%"], style, marker="s", label=f"{policy} capETT")
    left.set_xscale("log", base=2)
    left.set(xlabel="GPUs", ylabel="%", title="ETT and capacity-inclusive ETT")
    left.legend(fontsize=8)
    for g, rows in spares.groupby("gpus"):
        right.plot(rows["spares"], rows["capETT%"], marker="o", label=f"{g} GPUs")
    right.set(xlabel="spare nodes held", ylabel="capETT %", title="optimized: capETT against spares")
    right.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()
