"""`ettflow up`, `ettflow down`, `ettflow status`: the deployed path on this machine.

    ettflow up                  # Prefect server + Ray head + work pool + deployments + worker + automations
    ettflow up --refreshes 2    # ... then two refreshes as deployment runs the worker executes, compared
    ettflow status              # what of it is up
    ettflow down                # stop what `up` started; nothing of it is left running

`register(subparsers)` adds the three commands to `ettflow`'s sub-parsers.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from ettflow.console import user_doc

from .config import StackConfig, StackError, config_from

if TYPE_CHECKING:
    from ettflow.tasks.parameters import RefreshParameters

DEFAULT_DEPLOYMENT = "refresh-model/refresh-adhoc"


def refresh_parameters(args: argparse.Namespace, index: int) -> RefreshParameters:
    """The deployment run's parameters: `--param`s (a name, `section.name` or a whole section),
    and the induced failure on the run `--fail-on` names (the index-th run is 0-based)."""
    from ettflow.ett.redact import has_password
    from ettflow.flows.cli import DEMO_FAILURE, parse_value
    from ettflow.tasks.parameters import RefreshParameters

    params: dict[str, Any] = {}
    for item in args.param or ():
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise StackError(f"--param takes KEY=JSON, got {item!r}")
        params[key] = parse_value(raw)
    url = next((v for k, v in params.items() if k.rpartition(".")[2] == "warehouse_url"), None)
    if isinstance(url, str) and has_password(url):
        raise StackError("warehouse_url holds a password, and Prefect stores parameters in clear: give it to the "
                         "worker instead (`ETTFLOW_WAREHOUSE_URL=... ettflow up`: the worker inherits it)")
    from ettflow.tasks.errors import ParameterError

    induced = [] if args.no_failure else (args.fail_at or [DEMO_FAILURE])
    try:
        return RefreshParameters.parse(params, fail_at=induced if index == getattr(args, "fail_on", 1) - 1 else [])
    except ParameterError as exc:  # refused here, before the stack starts: Prefect would refuse the run
        raise StackError(str(exc)) from None


def cmd_up(args: argparse.Namespace) -> int:
    from ettflow.console import quiet_third_party
    from ettflow.flows.env_defaults import set_env_defaults

    set_env_defaults()
    quiet_third_party(verbose=args.verbose)
    from .lifecycle import up

    cfg = None
    try:
        cfg = config_from(args)
        if args.refreshes < 0:
            raise StackError(f"--refreshes must be 0 or more, got {args.refreshes}")
        if args.every < 0:
            raise StackError(f"--every must be 0 or more seconds, got {args.every}")
        if args.refreshes and not 1 <= args.fail_on <= args.refreshes:
            raise StackError(f"--fail-on must name one of the {args.refreshes} run(s), got {args.fail_on}")
        params = [refresh_parameters(args, i) for i in range(args.refreshes)]
        print(f"ettflow up: bringing the deployed path up under {cfg.home}", flush=True)
        up(cfg, say=lambda line: print(line, flush=True))
        if args.refreshes:
            return _refreshes(cfg, args, params)
    except StackError as exc:
        print(f"ettflow up: {exc}", file=sys.stderr)
        if _started_any(cfg):
            print("ettflow up: what this started keeps running: `ettflow status` shows it, `ettflow down` stops it",
                  file=sys.stderr)
        return 2
    return 0


def _started_any(cfg: StackConfig | None) -> bool:
    from .records import StackRecord

    try:
        record = StackRecord.read(cfg.record_path) if cfg is not None else None
    except ValueError:
        return False
    return record is not None and any(s.process() is not None for s in record.services)


def _refreshes(cfg: StackConfig, args: argparse.Namespace, params: list[RefreshParameters]) -> int:
    from ettflow.flows.cli import print_comparison
    from ettflow.tasks.arrivals import ensure_new_window

    from .deployed_runs import run_and_wait
    from .pool import wait_for_pool

    runs = []
    for i, these in enumerate(params):
        print(f"\nettflow up: refresh {i + 1} of {len(params)} as a run of deployment {args.deployment}, executed by "
              "the worker in a process of its own" + (f" (induced failure: {', '.join(these.faults.fail_at)})"
                                                      if these.faults.fail_at else ""), flush=True)
        if i > 0:  # back to back: what the last release left prewarming in the cluster's pool is ready first
            ready, waited = wait_for_pool(cfg, timeout_s=240.0)
            print(f"  the cluster's warm pool holds {ready} prewarmed trainer process(es) for it (waited "
                  f"{waited:.1f} s between refreshes; `ettflow pool status` lists them)", flush=True)
        # the demo's next window arrives before the run is created, as a real window arrives
        # before its refresh (the flow appends one itself only when nothing new is there, e.g. a
        # cron run), so generating it is not on the run's clock; never the user's own data
        arrived = ensure_new_window(these)
        if arrived:
            print(f"  new data arrived on the default synthetic source: {arrived}", flush=True)
        scheduled_at = time.time() + args.every if i > 0 and args.every > 0 else None
        run = run_and_wait(cfg.api_url, cfg.ui_url, args.deployment, these, timeout_s=args.run_timeout_s,
                           say=lambda line: print(line, flush=True), log_hint=f"{cfg.log_dir / 'worker.log'} or the UI",
                           scheduled_at=scheduled_at)
        print(f"  {run.state}: {run.message}", flush=True)
        runs.append(run)
    print_comparison([r.run_id for r in runs], params[0])
    print("\nEach run in the Prefect UI (state message, ETT table, timeline, snapshot, progress):")
    for i, run in enumerate(runs, 1):
        print(f"  refresh {i}: {run.url}   {run.name}: {run.state}")
    print(f"\nThe stack keeps running for the UI ({cfg.ui_url}); `ettflow down` stops it.")
    return 0 if all(r.completed for r in runs) else 1


def cmd_down(args: argparse.Namespace) -> int:
    from ettflow.console import quiet_third_party
    from ettflow.flows.env_defaults import set_env_defaults

    set_env_defaults()
    quiet_third_party(verbose=False)  # `down` joins the head to stop its pool: Ray's start-up notes stay out
    from .lifecycle import down

    try:
        down(config_from(args), say=lambda line: print(line, flush=True))
    except (StackError, ValueError) as exc:
        print(f"ettflow down: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from .lifecycle import status

    try:
        return 0 if status(config_from(args)) else 1
    except (StackError, ValueError) as exc:
        print(f"ettflow status: {exc}", file=sys.stderr)
        return 2


def _ports(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="the address every service binds (default 127.0.0.1)")
    p.add_argument("--api-port", type=int, help="the Prefect server's port (default 4200)")
    p.add_argument("--ray-port", type=int, help="the Ray head's port (default 6390)")
    p.add_argument("--ray-client-port", type=int, help="the Ray head's Ray Client port (default 10001)")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `up`, `down` and `status` to `ettflow`'s sub-parsers."""
    from ettflow.flows.cli import FAIL_AT_EPILOG, PARAM_HELP

    up = subparsers.add_parser(
        "up", help="start (or find) the deployed path here: Prefect server, Ray head, work pool, deployments, "
                   "worker, automations", description=user_doc(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=FAIL_AT_EPILOG)
    _ports(up)
    up.add_argument("--num-cpus", type=int, help="the Ray head's CPUs (default: this machine's, at least 4)")
    up.add_argument("--webhook-url", help="where the alert automations post (creates the webhook block)")
    up.add_argument("--refreshes", type=int, default=0, metavar="N",
                    help="then run N refreshes as deployment runs that the worker executes (one with the "
                         "induced failure, --fail-on; each later one on the next window) and compare them")
    up.add_argument("--deployment", default=DEFAULT_DEPLOYMENT, help="the deployment those runs are runs of")
    up.add_argument("--param", action="append", metavar="KEY=JSON", help=f"a parameter of those runs: {PARAM_HELP}")
    up.add_argument("--fail-at", action="append", metavar="SPEC", help="the induced failure instead of the "
                    "default, on the run --fail-on names (repeatable)")
    up.add_argument("--no-failure", action="store_true", help="no induced failure")
    up.add_argument("--fail-on", type=int, default=1, metavar="N",
                    help="the run (1-based) that gets the induced failure (default 1)")
    up.add_argument("--every", type=float, default=20.0, metavar="S",
                    help="each run after the first is scheduled S seconds after the previous one finished, as a "
                         "deployment's schedule creates its runs: the worker starts its process ahead (prefetch), "
                         "so its clock starts on a ready process (default 20; 0: due at once, ad hoc, each run "
                         "paying its process's start)")
    up.add_argument("--run-timeout-s", type=float, default=1800.0, help="how long to wait for each run")
    up.add_argument("--verbose", action="store_true", help="the worker's flow runs show every library's output")
    up.set_defaults(func=cmd_up)
    down = subparsers.add_parser("down", help="stop what `ettflow up` started")
    down.set_defaults(func=cmd_down)
    st = subparsers.add_parser("status", help="what of `ettflow up`'s stack is up")
    st.set_defaults(func=cmd_status)
    from .pool import register as register_pool

    register_pool(subparsers)
