"""`ettflow archive`: archive runs from their spool (the spool is the source of truth).

    ettflow archive --run ID [--run ID2 ...]   # these runs, whatever their state
    ettflow archive --pending                  # every run whose row is missing, stale or pending,
                                               # and every lineage record waiting in the spool

A run whose driver died (its heartbeat stopped, no final status) is archived as ``crashed``
with an ``orchestrator`` failure at its last heartbeat, detected at the last heartbeat + the
heartbeat bound (see `ettflow.tasks.reconcile`). Idempotent: running it again writes nothing new.

Exit status: 0 when every run named or found is archived or needs nothing; 1 when some row is
still pending (the warehouse failed while writing) or a run cannot be archived; 2 when the
warehouse cannot be opened at all.

`register(subparsers)` adds the command to `ettflow`'s sub-parsers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ettflow.console import user_doc


def cmd_archive(args: argparse.Namespace) -> int:
    from ettflow import paths
    from ettflow.ett.archive import OUTAGES, describe_problems, outage_reason, shown_url

    from .reconcile import reconcile, settle_pending_lineage, summary

    spool = Path(args.spool) if args.spool else paths.spool_root()
    try:
        done = [] if args.run else settle_pending_lineage(spool, args.url)
        done += reconcile(spool, args.url, run_ids=args.run if args.run else None)
    except OUTAGES as exc:
        print(f"ettflow archive: cannot open the warehouse at {shown_url(args.url)}: {outage_reason(exc, args.url)}\n"
              "Nothing was archived; the spool keeps every run. Check the URL (--url or ETTFLOW_WAREHOUSE_URL) "
              "and run this again.", file=sys.stderr)
        return 2
    if not done:
        print(f"ettflow archive: no run to archive under {spool}")
        return 0
    for r in done:
        line = f"run {r.run_id}: {r.action}"
        if r.status:
            line += f" ({r.status})"
        res = r.result
        if r.action == "archived" and res is not None:
            m = res.metrics
            line += (f": ETT {m.ett_pct:.1f}%, NoF {m.nof}, wall {m.wall_s:.1f} s, {res.events} events -> "
                     f"{res.warehouse} [{r.note}]")
            if res.problems:
                line += f"; {describe_problems(res.problems)}"
        else:
            line += f": {r.note}"
        print(line, file=sys.stderr if r.action in ("pending", "error") else sys.stdout)
    counts = summary(done)
    print("ettflow archive: " + ", ".join(f"{n} {action}" for action, n in sorted(counts.items())))
    return 1 if counts.get("pending") or counts.get("error") else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `archive` to `ettflow`'s sub-parsers."""
    p = subparsers.add_parser("archive", help="archive runs from their spool: one run, or every pending one",
                              description=user_doc(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--run", action="append", metavar="ID", help="a run id (the flow run id); repeatable")
    which.add_argument("--pending", action="store_true",
                       help="every run of the spool whose row is missing, stale or pending (live runs are left)")
    p.add_argument("--url", help="warehouse URL (default: ETTFLOW_WAREHOUSE_URL or the per-user SQLite file)")
    p.add_argument("--spool", help="spool folder (default: ETTFLOW_SPOOL or the per-user spool)")
    p.set_defaults(func=cmd_archive)
