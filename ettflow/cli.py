"""The `ettflow` command. Each sub-command is a thin shell over a component."""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from typing import TYPE_CHECKING

from . import paths
from .console import user_doc

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .ett.capacity import Holding
    from .ett.warehouse import Warehouse


def cmd_report(args: argparse.Namespace) -> int:
    from .ett.warehouse import Warehouse, WarehouseError

    try:
        with Warehouse.open(args.url) as wh:
            return _report(wh, args)
    except WarehouseError as exc:
        print(f"ettflow report: {exc}", file=sys.stderr)
        return 2


def _report(wh: Warehouse, args: argparse.Namespace) -> int:
    """Print the runs `args` selects from an open warehouse: one in detail, or all with a
    per-model summary. 1 when it holds none of them."""
    from .ett import report

    if getattr(args, "lineage", False):
        return _lineage(wh, args)
    if getattr(args, "intervals", False):
        return _intervals(wh, args)
    if getattr(args, "fleet", False):
        return _fleet(wh, args)
    runs = wh.runs_frame(model=args.model, run_id=args.run, limit=args.last)
    if runs.empty:
        what = f"run {args.run!r}" if args.run else (f"model {args.model!r}" if args.model else "any run")
        print(
            f"ettflow report: the warehouse at {wh.display_url} holds no data for {what}.\n"
            "Run a refresh (or `ettflow demo` for a sample run) first, or point --url / "
            "ETTFLOW_WAREHOUSE_URL at the warehouse that has your runs.",
            file=sys.stderr,
        )
        return 1
    ui_url = os.environ.get("PREFECT_UI_URL")  # the runs link their Prefect flow run pages
    if args.run:
        row = runs.iloc[0]
        detail = report.component_table(wh.components_frame(args.run), float(row["wall_s"]))
        print(report.render(report.run_table(runs, ui_url), args.format))
        if args.format == "table":
            print("\nWhere the wall time went (exposed = on the critical path):")
        print(report.render(detail, args.format))
        return 0
    print(report.render(report.run_table(runs, ui_url), args.format))
    if args.format == "table":
        print("\nPer model, over time:")
    print(report.render(report.model_summary(runs), args.format))
    if args.format == "table":
        print(report.SUMMARY_NOTE)
    _print_held(wh.holdings(args.model), args.format)
    return 0


def _print_held(holdings: Sequence[Holding], fmt: str) -> None:
    """The ledger per model, then per rule and outcome (nothing when it is empty)."""
    from .ett import report
    from .ett.capacity import held_by_model, held_by_rule

    if not holdings:
        return
    if fmt == "table":
        print("\nHeld capacity, the ledger (outside the runs' own slots):")
    print(report.render(report.held_table(held_by_model(holdings)), fmt))
    if fmt == "table":
        print(report.HELD_NOTE)
        print("\nWhich rule held what, and whether a run used it:")
    print(report.render(report.held_rule_table(held_by_rule(holdings)), fmt))
    if fmt == "table":
        print(report.HELD_RULE_NOTE)


def _lineage(wh: Warehouse, args: argparse.Namespace) -> int:
    """Print the model's chain of refreshes; 2 without --model, 1 when it has none."""
    from .ett import report

    if not args.model:
        print("ettflow report: --lineage needs --model M (the model whose refreshes to chain)", file=sys.stderr)
        return 2
    records = wh.lineage(args.model)
    if args.last is not None:
        records = records[-args.last:] if args.last > 0 else []
    if not records:
        print(f"ettflow report: the warehouse at {wh.display_url} holds no refresh of model {args.model!r}.\n"
              "Run `ettflow refresh` for it first, or point --url / ETTFLOW_WAREHOUSE_URL at its warehouse.",
              file=sys.stderr)
        return 1
    table = report.lineage_table(records, wh.runs_frame(model=args.model))
    if args.format == "table":
        mark = wh.watermark(args.model)
        print(f"Refreshes of {args.model} (watermark: {mark or 'none, nothing published yet'}):")
        table = table.astype({"ETT%": object}).fillna({"ETT%": "-"})
    print(report.render(table, args.format))
    return 0


def _intervals(wh: Warehouse, args: argparse.Namespace) -> int:
    """Print the model's checkpoint intervals, expected vs realized waste; 2 without --model,
    1 when it has no run."""
    from .ett import report
    from .ett.failure_history_db import phase_seconds

    if not args.model:
        print("ettflow report: --intervals needs --model M (the model whose refreshes to show)", file=sys.stderr)
        return 2
    runs = wh.runs_frame(model=args.model, limit=args.last)
    runs = runs[runs["status"] != report.SKIPPED]
    if runs.empty:
        print(f"ettflow report: the warehouse at {wh.display_url} holds no trained run of model {args.model!r}.\n"
              "Run `ettflow refresh` for it first, or point --url / ETTFLOW_WAREHOUSE_URL at its warehouse.",
              file=sys.stderr)
        return 1
    phases = phase_seconds(wh, list(runs["run_id"]), report.INTERVAL_PHASES)
    table = report.interval_table(runs, phases)
    if args.format == "table":
        print(f"Checkpoint intervals of {args.model} (expected vs realized wasted training, s):")
        table = table.astype(object).where(table.notna(), "-")
    print(report.render(table, args.format))
    return 0


def _fleet(wh: Warehouse, args: argparse.Namespace) -> int:
    """Print the fleet view (`ett.fleet`: per deployment, components per owner, worst runs,
    regressions); 1 when the warehouse holds no run."""
    from .ett import fleet
    from .tasks.fleet_report import deployment_names

    runs = wh.runs_frame(limit=args.last)
    if runs.empty:
        print(f"ettflow report: the warehouse at {wh.display_url} holds no run.", file=sys.stderr)
        return 1
    try:  # the runs' deployments as Prefect knows them, when PREFECT_API_URL names a server
        names = deployment_names([str(f) for f in runs["flow_run_id"].dropna()])
    except Exception:  # noqa: BLE001 - without Prefect the rows' own tags name them
        names = {}
    print(fleet.fleet_text(fleet.with_deployment(runs, names)))
    _print_held(wh.holdings(), "table")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Write a sample run through the spool, archive it, and print its report."""
    from .ett.archive import archive_spooled_run
    from .ett.sample import write_sample_run
    from .ett.warehouse import RunInfo, Warehouse

    run_id = args.run_id or f"sample-{uuid.uuid4().hex[:8]}"
    spool = paths.spool_root()
    write_sample_run(spool, run_id, seed=args.seed, start=time.time() - 3600)
    with Warehouse.open(args.url) as wh:
        archived = archive_spooled_run(
            wh, spool, RunInfo(run_id=run_id, model="sample-dlrm", mode="sample", tags={"sample": True})
        )
        where = wh.display_url
    print(f"sample run {run_id}: {archived.events} events spooled under {spool / run_id}")
    print(f"archived to {where}\n")
    return cmd_report(argparse.Namespace(url=args.url, run=run_id, model=None, last=None, format="table"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ettflow", description=user_doc(__doc__))
    sub = parser.add_subparsers(dest="command", required=True)

    rep = sub.add_parser("report", help="per-run L1/L2 and a per-model summary from the warehouse")
    rep.add_argument("--url", help="warehouse URL (default: ETTFLOW_WAREHOUSE_URL or the per-user SQLite file)")
    rep.add_argument("--run", help="one run in detail: every component and phase, exposed and raw")
    rep.add_argument("--model", help="only this model's runs")
    rep.add_argument("--last", type=int, help="only the N most recent runs")
    rep.add_argument("--lineage", action="store_true",
                     help="with --model: the chain of its refreshes (run, windows, parent, outcome, ETT%%)")
    rep.add_argument("--intervals", action="store_true",
                     help="with --model: per refresh the checkpoint interval chosen, expected and realized "
                          "wasted training")
    rep.add_argument("--fleet", action="store_true",
                     help="the fleet view: ETT per deployment, components per owner, worst runs, regressions")
    rep.add_argument("--format", choices=("table", "csv", "json"), default="table")
    rep.set_defaults(func=cmd_report)

    demo = sub.add_parser("demo", help="write and archive a sample run, then report it")
    demo.add_argument("--url", help="warehouse URL")
    demo.add_argument("--run-id", help="id for the sample run (default: random)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_demo)

    from . import simulate_cli
    from .bench import cli as bench_cli
    from .flows import cli as flows_cli
    from .publish import cli as publish_cli
    from .stack import cli as stack_cli
    from .tasks import archive_cli, automations_cli
    from .trainer.data import cli as data_cli

    stack_cli.register(sub)
    flows_cli.register(sub)
    archive_cli.register(sub)
    automations_cli.register(sub)
    data_cli.register(sub)
    publish_cli.register(sub)
    bench_cli.register(sub)
    simulate_cli.register(sub)
    return parser


def _warn_password_in_argv(command: str, argv: list[str]) -> None:
    """A URL with a password among the arguments (`--url`, `--warehouse-url`, `--param`): ettflow
    hides it everywhere it writes, but the process list shows every command line to every user
    of the host while the command runs. Said once, on stderr, without the password."""
    from .ett.redact import redact_argv

    if redact_argv(argv) != argv:
        print(f"ettflow {command}: a URL on the command line holds a password, and every user of this host can "
              "read it in the process list while this runs. Put the URL in ETTFLOW_WAREHOUSE_URL instead, or "
              "leave the password out of it and keep it in ~/.pgpass (mode 0600), where PostgreSQL finds it.",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command as given, for reports that print how to reproduce them
    _warn_password_in_argv(args.command, argv)
    try:
        rc = int(args.func(args) or 0)
    except BrokenPipeError:  # `ettflow report | head`: the reader had enough, if it was stdout's
        if not _stdout_reader_gone():
            raise  # another pipe broke (a socket, a subprocess): a real error
        return _reader_left(0)
    except Exception as exc:
        from .console import is_explained

        if not is_explained(exc) or getattr(args, "verbose", False):
            raise
        print(f"ettflow {args.command}: {exc}", file=sys.stderr)  # its message says what to do
        return 1
    try:
        sys.stdout.flush()  # here, where a reader that left is caught, not at the interpreter's exit
    except BrokenPipeError:
        return _reader_left(rc)
    return rc


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader closed it (poll reports an error on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _reader_left(rc: int) -> int:
    """Our stdout's reader closed it: point stdout at /dev/null, so the interpreter's final
    flush does not raise again, and end with the command's own code (what was read was what
    was asked for)."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
