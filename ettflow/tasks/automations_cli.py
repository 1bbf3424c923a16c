"""`ettflow automations`: create ettflow's Prefect automations from their file.

    ettflow automations apply [--file automations/ettflow.yaml] [--webhook-url URL]
    ettflow automations show  [--file ...]     # the Prefect automations it compiles to, as JSON

`apply` talks to the server PREFECT_API_URL names. `--webhook-url` creates (or updates) the
file's webhook block first, pointed at URL. Exit status: 0 applied, 2 the file or the server
refused (the message says what to fix).

`register(subparsers)` adds the command to `ettflow`'s sub-parsers.
"""

from __future__ import annotations

import argparse
import json
import sys


def cmd_automations(args: argparse.Namespace) -> int:
    from .automations import DEFAULT_FILE, AutomationsConfig, apply_automations, compile_automations, save_webhook_block

    path = args.file or DEFAULT_FILE
    try:
        config = AutomationsConfig.load(path)
    except (OSError, ValueError) as exc:
        print(f"ettflow automations: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    if args.action == "show":
        from uuid import UUID

        specs = [a.model_dump(mode="json") for a in compile_automations(config, UUID(int=0))]
        print(json.dumps(specs, indent=2))
        print(f"(block_document_id {UUID(int=0)} stands for the id of the Webhook block "
              f"{config.webhook_block!r}, which `apply` looks up)", file=sys.stderr)
        return 0
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        print("ettflow automations: PREFECT_API_URL is not set: point it at your Prefect server "
              "(e.g. http://127.0.0.1:4200/api)", file=sys.stderr)
        return 2
    try:
        if args.webhook_url:
            save_webhook_block(config.webhook_block, args.webhook_url)
            print(f"webhook block {config.webhook_block!r} -> POST (url set)")
        done = apply_automations(config)
    except ValueError as exc:
        print(f"ettflow automations: {exc}", file=sys.stderr)
        return 2
    for verb, names in (("created", done.created), ("updated", done.updated), ("deleted", done.deleted)):
        for name in names:
            print(f"{verb}: {name}")
    print(f"ettflow automations: {len(done.created)} created, {len(done.updated)} updated, "
          f"{len(done.deleted)} deleted on {PREFECT_API_URL.value()}")
    if not done.webhook:
        print(f"no Webhook block {config.webhook_block!r} on the server: the automations have no action; each "
              "trigger is listed in the Event Feed (prefect.automation.triggered). `--webhook-url URL` adds the POST")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("automations", help="create ettflow's Prefect automations (ETT, NoF, regressions)")
    p.add_argument("action", choices=("apply", "show"),
                   help="apply: create or update them on the server; show: print them")
    p.add_argument("--file", help="the automations file (default: automations/ettflow.yaml of this repository)")
    p.add_argument("--webhook-url", help="create or update the file's webhook block, pointed at this URL")
    p.set_defaults(func=cmd_automations)
