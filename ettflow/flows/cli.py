"""`ettflow refresh`: run one refresh end to end, here, then print its ETT report
(`--refreshes N`: N back to back, each continuing from the one before, then compared).

On embedded defaults (an ephemeral Prefect API, a local Ray, the SQLite warehouse, synthetic
data sized to train about 30 s a refresh, made on first use) and, unless told otherwise, with
one induced SIGKILL so a first run shows a failure and its recovery. Progress is logged while
it works; at the end come the run's L1/L2 report, the snapshot folder and the timeline picture.

How it differs from the deployed path (`ettflow up --refreshes N`, README): here one Python
process runs every refresh, with an ephemeral Prefect API and a local Ray that it starts itself
(on the first refresh's clock) and the trainer processes one refresh leaves warm for the next;
a deployment's refresh is a new process that a Prefect worker starts, joining a Ray that
outlives it. Same flow, same tasks, same trainer: the numbers differ by what a long-lived
process keeps.

`register(subparsers)` adds the command to `ettflow`'s sub-parsers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from ettflow.console import user_doc
from ettflow.flows.env_defaults import set_env_defaults
from ettflow.tasks.parameters import RefreshParameters, SwitchParams, field_help, parameter_names_help
from ettflow.trainer.config import FAIL_AT_GRAMMAR

if TYPE_CHECKING:
    from collections.abc import Mapping

DEMO_FAILURE = "kill:rank=1:step=16"  # early in the first refresh (the default data: 3,840 steps a window)
FAIL_AT_EPILOG = f"--fail-at items:\n{FAIL_AT_GRAMMAR}"  # `refresh --help` and `up --help` end with it
PARAM_HELP = ("any flow parameter, by its name or SECTION.NAME (repeatable; values are JSON): "
              + parameter_names_help())


def parse_value(text: str) -> Any:
    """A `--param`/`--switch` value: JSON when it parses, else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def private_warehouse_url(args: argparse.Namespace) -> str | None:
    """The warehouse URL given (--warehouse-url, or --param warehouse_url=) when it holds a
    password: this process passes it in ETTFLOW_WAREHOUSE_URL, never as a flow parameter
    (Prefect stores parameters in clear)."""
    from ettflow.ett.redact import has_password

    given = [args.warehouse_url] + [parse_value(raw) for key, _, raw in (i.partition("=") for i in args.param or ())
                                    if key == "warehouse_url"]
    url = given[-1]
    return url if isinstance(url, str) and has_password(url) else None


def parameters(args: argparse.Namespace) -> dict[str, Any]:
    """The flow's parameters; a warehouse URL with a password is left out (`private_warehouse_url`)."""
    params: dict[str, Any] = {"model": args.model, "mode": args.mode}
    for name in ("data_root", "world_size", "batch_size", "max_steps", "checkpoint_every_steps", "warehouse_url"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    if args.window:
        params["windows"] = args.window
    if args.switch:
        params["switches"] = {}
        for item in args.switch:
            key, _, raw = item.partition("=")
            params["switches"][key] = parse_value(raw or "true")
    params["fail_at"] = [] if args.no_failure else (args.fail_at or [DEMO_FAILURE])
    for item in args.param or ():
        key, _, raw = item.partition("=")
        params[key] = parse_value(raw)
    if private_warehouse_url(args) is not None:
        params.pop("warehouse_url", None)
    return params


def refresh_parameters(params: Mapping[str, Any]) -> RefreshParameters:
    """The refresh's parameters from the CLI's (flat names, `section.name`, whole sections):
    a refused value or an unknown name is a `ParameterError` that names it, before anything
    starts (Prefect's own refusal is a signature dump)."""
    from ettflow.tasks.parameters import RefreshParameters

    return RefreshParameters.parse(params)


def print_report(run_id: str, url: str | None, *, phases: bool = False) -> bool:
    """Print the run's ETT report: its L1/L2 row and its components (and each phase when `phases`)."""
    from ettflow.ett import report
    from ettflow.ett.warehouse import Warehouse

    with Warehouse.open(url) as wh:
        runs = wh.runs_frame(run_id=run_id)
        if runs.empty:
            print(f"run {run_id} is not in the warehouse at {wh.display_url}", file=sys.stderr)
            return False
        print(report.render(report.run_table(runs), "table"))
        print("\nWhere the wall time went (exposed = on the critical path):")
        print(report.render(report.component_table(wh.components_frame(run_id), float(runs.iloc[0]["wall_s"]),
                                                    phases=phases), "table"))
        tags = runs.iloc[0]["tags"] or {}
        print(f"\nwarehouse: {wh.display_url}   (`ettflow report --run {run_id}` shows each phase too)")
    if tags.get("snapshot"):
        print(f"snapshot:  {tags['snapshot']}  (model.pt + manifest.json)")
        print(f"timeline:  {tags['snapshot']}.ett-timeline.png")
    return True


def cmd_refresh(args: argparse.Namespace) -> int:
    from ettflow.flows import supervise

    if supervise.should_supervise(args):  # the `ettflow refresh` process: the work runs in a child
        return supervise.run_supervised(args.argv)
    set_env_defaults()
    from ettflow.console import quiet_third_party

    quiet_third_party(verbose=getattr(args, "verbose", False))  # before Prefect and Ray are imported
    from ettflow.ett.redact import redact_url
    from ettflow.ett.warehouse_db import ENV_URL
    from ettflow.tasks.arrivals import ensure_new_window

    params, private = refresh_parameters(parameters(args)), private_warehouse_url(args)
    if private is not None:
        os.environ[ENV_URL] = private  # for this process and its hooks only
    print(f"ettflow refresh: {json.dumps({'model': params.model, 'mode': params.mode, **params.to_json()})}",
          flush=True)
    if private is not None:
        print(f"ettflow refresh: warehouse {redact_url(private)} (holds a password: passed in {ENV_URL}, "
              "not as a flow parameter)", flush=True)
    count = args.refreshes
    if count < 1:
        print(f"ettflow refresh: --refreshes must be 1 or more, got {count}", file=sys.stderr)
        return 2
    fail_on = getattr(args, "fail_on", 1) - 1
    if not 0 <= fail_on < count:
        print(f"ettflow refresh: --fail-on must name one of the {count} refresh(es), got {fail_on + 1}",
              file=sys.stderr)
        return 2
    from ettflow.trainer.group.warm_pool import POOL

    done: list[str] = []
    code = 0
    try:
        for i in range(count):
            these = params if i == fail_on else RefreshParameters.parse(params, fail_at=[])  # failures: one refresh
            arrived = ensure_new_window(these)
            if count > 1:
                print(f"\nettflow refresh {i + 1} of {count}" + (f": new data arrived ({arrived})" if arrived else ""),
                      flush=True)
                if i > 0:
                    wait_for_warm_pool(POOL)
            elif arrived:
                print(f"ettflow refresh: new data arrived ({arrived})", flush=True)
            POOL.keep_warm(i < count - 1)  # a refresh that has a next one leaves its ranks' processes warm
            rc, run_id = _refresh_once(these, args)
            code = max(code, rc)
            if run_id is not None:
                done.append(run_id)
    finally:
        POOL.close()
    if count > 1 and done:
        print_comparison(done, params)
    return code


def wait_for_warm_pool(pool, timeout_s: float = 120.0) -> None:
    """Back to back, the next refresh waits for the processes the last one left prewarming (in
    production refreshes are hours apart and they are long ready); says how long it waited."""
    if not pool.workers:
        return
    t0 = time.monotonic()
    ready = pool.wait_ready(timeout_s)
    print(f"ettflow refresh: warm pool: {ready} trainer process(es) prewarmed for this refresh "
          f"(waited {time.monotonic() - t0:.1f} s between refreshes)", flush=True)


def _refresh_once(params: RefreshParameters, args: argparse.Namespace) -> tuple[int, str | None]:
    """One refresh and its report: (exit status, its run id; None when refused before it ran)."""
    from ettflow.ett.archive import read_pending
    from ettflow.flows.refresh import refresh_model
    from ettflow.tasks.archive import spool_of
    from ettflow.tasks.errors import ParameterError
    from ettflow.tasks.warehouse_url import WarehouseUnavailable, resolve_warehouse_url
    from ettflow.trainer.data.schema import DataError

    state = refresh_model(**params.flow_kwargs(), return_state=True)
    run_id = str(state.state_details.flow_run_id)
    print()
    if not state.is_completed():
        refused = state.result(raise_on_failure=False)
        if isinstance(refused, (ParameterError, WarehouseUnavailable)):  # refused before anything ran: no report
            print(f"ettflow refresh: {refused}", file=sys.stderr)
            return 1, None
        if isinstance(refused, DataError):  # its inputs refused before anything was reserved: no row to report
            print(f"ettflow refresh: run {run_id} refused: {state.message.removeprefix('refused: ')}", file=sys.stderr)
            return 1, run_id
        print(f"ettflow refresh: run {run_id} ended {state.name}: {state.message}", file=sys.stderr)
    else:
        result = state.result(raise_on_failure=False)
        if isinstance(result, dict) and result.get("outcome") in ("skipped", "gated"):  # continuous refresh: why
            print(f"ettflow refresh: run {run_id} {result['outcome']}: {state.message}", flush=True)
    pending = read_pending(spool_of(params), run_id)
    if pending is not None:  # the run's row waits (a warehouse outage): no report; published is success
        print(f"ettflow refresh: warning: {pending.message}", file=sys.stderr)
        return (0 if state.is_completed() else 1), run_id
    shown = print_report(run_id, resolve_warehouse_url(params.warehouse), phases=getattr(args, "verbose", False))
    return (0 if state.is_completed() and shown else 1), run_id


def print_comparison(run_ids: list[str], params: RefreshParameters) -> None:
    """The refreshes side by side: how each started, its windows, TTS, ETT% and each
    component's share of its wall time."""
    from ettflow.ett import report
    from ettflow.ett.refresh_comparison import comparison_table
    from ettflow.ett.warehouse import Warehouse
    from ettflow.tasks.warehouse_url import resolve_warehouse_url

    with Warehouse.open(resolve_warehouse_url(params.warehouse)) as wh:
        runs = wh.runs_frame(model=params.model)
        records = {r.run_id: r for r in wh.lineage(params.model)}
    runs = runs[runs["run_id"].isin(run_ids)]
    runs = runs.set_index("run_id").loc[[r for r in run_ids if r in set(runs["run_id"])]].reset_index()
    if runs.empty:
        return
    starts = {r: ("skipped" if rec.outcome.value == "skipped" else
                  f"warm from {rec.parent_run_id[:8]}" if rec.parent_run_id else "cold")
              for r, rec in records.items()}
    windows = {r: rec.windows for r, rec in records.items()}
    print("\nThe refreshes side by side (each component's share of the refresh's wall time):")
    print(report.render(comparison_table(runs, starts, windows), "table"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="dlrm", help="model name (warehouse, checkpoints, snapshots)")
    p.add_argument("--mode", choices=("baseline", "optimized"), default="optimized")
    p.add_argument("--switch", action="append", metavar="NAME=BOOL",
                   help=f"one switch over the mode (repeatable): {', '.join(SwitchParams.model_fields)}")
    p.add_argument("--data-root", help=field_help("data_root"))
    p.add_argument("--window", action="append", help=f"{field_help('windows')} (repeatable)")
    for name in ("world_size", "batch_size", "max_steps", "checkpoint_every_steps"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=field_help(name))
    p.add_argument("--fail-at", action="append", metavar="SPEC",
                   help=f"injected failure, e.g. kill:rank=1:step=16, hang:step=5, publish:times=1 "
                        f"(repeatable; default: {DEMO_FAILURE})")
    p.add_argument("--no-failure", action="store_true", help="no injected failure")
    p.add_argument("--warehouse-url", help="warehouse URL (default: ETTFLOW_WAREHOUSE_URL or the SQLite file); one "
                   "with a password is passed to the run in ETTFLOW_WAREHOUSE_URL, never as a flow parameter")
    p.add_argument("--param", action="append", metavar="KEY=JSON", help=PARAM_HELP)
    p.add_argument("--refreshes", type=int, default=1, metavar="N",
                   help="N refreshes back to back, each continuing from the one before (on the default data a new "
                        "window arrives whenever there is nothing new); injected failures apply to the first; "
                        "then a table compares them")
    p.add_argument("--fail-on", type=int, default=1, metavar="N",
                   help="with --refreshes: the refresh (1-based) that gets the injected failures (default 1)")
    p.add_argument("--verbose", action="store_true",
                   help="show every library's warnings and logs too (default: known third-party noise is "
                        "filtered, see ettflow/console.py)")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `refresh` to `ettflow`'s sub-parsers."""
    p = subparsers.add_parser("refresh", help="run one refresh end to end in this process and print its ETT report "
                                              "(the in-process convenience; `ettflow up --refreshes N` runs them "
                                              "as deployment runs)",
                              description=user_doc(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog=FAIL_AT_EPILOG)
    add_arguments(p)
    p.set_defaults(func=cmd_refresh)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ettflow")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
