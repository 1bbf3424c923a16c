"""`ettflow pool status` and `ettflow pool stop`: the cluster's warm pool (trainer/group/pool_service.py).

Both join the cluster flow runs join: `RAY_ADDRESS` when set, else the Ray head of `ettflow up`
(with the stack's token). `status` lists what the pool holds (workers by model and shape,
prewarming or ready, since when; keepers; ledger lines not yet in the warehouse); `stop`
stops all of it and the pool itself (the next run that joins starts a new, empty one), after
writing what it held unclaimed to the warehouse's held-capacity ledger
(`ETTFLOW_WAREHOUSE_URL`, else the per-user SQLite file, as the worker's runs use).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ettflow.console import user_doc

from .config import StackError, config_from
from .records import StackRecord


def join_cluster(cfg) -> str:
    """Join the cluster flow runs join (`RAY_ADDRESS`, else the head `ettflow up` recorded, with
    the stack's token); its address."""
    address = cfg.ray_address
    if not address:
        from .services import ray_auth_env

        record = StackRecord.read(cfg.record_path)
        if record is None:
            raise StackError("no cluster to ask: set RAY_ADDRESS, or start the local stack with `ettflow up`")
        address = record.ray_address
        os.environ.update(ray_auth_env(cfg))  # before Ray is imported: it reads its authentication mode then
    import ray

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    return address


def wait_for_pool(cfg, timeout_s: float) -> tuple[int, float]:
    """Back to back (`ettflow up --refreshes N`), wait for what the last run's release left
    prewarming in the cluster's pool: (workers ready, seconds waited). A schedule's refreshes
    are hours apart, and the pool is long ready by then."""
    join_cluster(cfg)
    import ray

    from ettflow.trainer.group.pool_service import service

    pool = service(create=False)
    if pool is None:
        return 0, 0.0
    t0 = time.monotonic()
    ready = int(ray.get(pool.wait_ready.remote(timeout_s)))
    return ready, time.monotonic() - t0


def cmd_pool(args: argparse.Namespace) -> int:
    from ettflow.console import quiet_third_party
    from ettflow.flows.env_defaults import set_env_defaults

    set_env_defaults()
    quiet_third_party(verbose=False)
    try:
        address = join_cluster(config_from(args))
    except (StackError, ConnectionError, ValueError) as exc:
        print(f"ettflow pool: {exc}", file=sys.stderr)
        return 2
    import ray

    from ettflow.trainer.group.pool_service import NAME, NAMESPACE, service

    pool = service(create=False)
    if pool is None:
        print(f"ettflow pool: the cluster at {address} has no pool ({NAMESPACE}/{NAME}): "
              "a run that joins it starts one")
        return 0
    if args.action == "stop":
        return stop_pool(pool, say=print)
    held = ray.get(pool.status.remote())
    pending = ray.get(pool.drain.remote())
    now = time.time()
    print(f"ettflow pool {NAMESPACE}/{NAME} on {address}: {sum(h.holds_actor for h in held)} process(es) held; "
          f"{len(pending)} released unclaimed "
          f"({sum(h.held_s for h in pending):.0f} s held) not yet in the warehouse's ledger")
    for line in pending:
        print(f"  ledger  {line.kind:<16} model {line.model:<10} run {(line.run_id or '-')[:8]:<8} held "
              f"{line.held_s:.0f} s ({line.reason}{', ' + line.rule if line.rule else ''})")
    for h in held:
        since = f"ready for {now - h.ready_at:.0f} s" if h.ready_at else f"requested {now - h.requested_at:.0f} s ago"
        if h.kind == "planned":  # nothing held yet: prewarmed ahead of the model's next scheduled run
            since = f"in {max(h.requested_at - now, 0):.0f} s (before its next scheduled run)"
        elif h.kind == "decided":  # the last release decided that holding would not pay
            since = f"since {now - h.requested_at:.0f} s"
        elif h.kind.startswith("run's"):  # taken by a run: the pool stops it if the run's process dies
            since = f"run {h.key}, its process seen alive {now - h.requested_at:.0f} s ago"
        elif h.kind == "lost":  # this service replaced one that died holding things (pool_journal.py)
            since = (f"the previous pool service last answered {now - h.requested_at:.0f} s ago: its holdings are "
                     "in the ledger as pool_lost")
        print(f"  {h.kind:<7} model {h.model:<10} shape {h.key:<10} {h.state:<10} {since}"
              + (f" on node {h.node[:12]}" if h.node else "") + (f" [{h.rule}]" if h.rule else "")
              + (f", actor {h.actor}" if h.actor else "") + (f"; {h.staging}" if h.staging else ""))
    for model, why in sorted({(h.model, h.why) for h in held if h.why}):
        print(f"  rule    model {model:<10} {why}")
    return 0


def stop_pool(pool, say) -> int:
    """Stop what the pool holds, record it in the warehouse's ledger, stop the pool. A ledger
    that cannot be written keeps the pool (and its lines) alive: exit 1, saying why."""
    import ray

    from ettflow.ett.warehouse import Warehouse
    from ettflow.ett.warehouse_db import WarehouseError
    from ettflow.trainer.group.pool_service import drain_ledger

    stopped = ray.get(pool.stop.remote())

    def write(lines):
        with Warehouse.open(None) as wh:
            wh.record_holdings(lines)

    try:
        moved = drain_ledger(pool, write)
    except WarehouseError as exc:
        say(f"ettflow pool: stopped {stopped} pooled actor(s), but their held capacity could not be recorded "
            f"({exc}); the pool keeps the ledger: fix the warehouse and run `ettflow pool stop` again")
        return 1
    ray.kill(pool, no_restart=True)
    say(f"ettflow pool: stopped {stopped} pooled actor(s) and the pool itself; {moved} ledger line(s) of what it "
        "held unclaimed recorded in the warehouse")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("pool", help="the cluster's warm pool: what it holds, or stop it",
                              description=user_doc(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("status", "stop"))
    p.set_defaults(func=cmd_pool)
