"""The cluster's pool (`trainer/group/pool_service.py`) of a test's own Ray head, driven from a
subprocess: the test's process already belongs to the session's Ray, and joining a second
cluster in it would be a second Ray session in one process.

    python -m helpers.cluster_pool fill PARAMS_JSON HOME SPOOL COUNT   # prints {"started": n, "ready": n}
    python -m helpers.cluster_pool kill                                 # the pool's service, as a node loss would

`fill` prewarms COUNT workers of the run PARAMS_JSON describes (the refresh's parameters, as a
deployment run is given them) for the model's next run, under the pool's own rule: measured
starts (cold 2,000 s, pooled 1 s: a fleet job's compile) make a just-in-time prewarm for a run
scheduled now pay, its unclaimed workers kept 600 s. The service journals in HOME/pool, where
the flow processes of a worker with ETTFLOW_HOME=HOME find it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from helpers.prefect_cli import REPO


def run(env: dict[str, str], *args: str, timeout: float = 300.0) -> str:
    """Run this module with `args` in a process that joins the head `env` names; its stdout."""
    tests = str(REPO / "tests")
    out = subprocess.run([sys.executable, "-m", "helpers.cluster_pool", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=timeout, env={**env, "PYTHONPATH": tests})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _fill(params_json: str, home: str, spool: str, count: int) -> dict[str, int]:
    import ray

    from ettflow.tasks.parameters import RefreshParameters
    from ettflow.tasks.plan import trainer_config
    from ettflow.trainer.group.pool_service import PoolPolicy, service
    from ettflow.trainer.protocol import StartSample
    from ettflow.trainer.rank.actor import TrainerActor

    params = RefreshParameters.parse(json.loads(params_json))
    work_root = Path(params.storage.work_root) / params.model  # where the flow's plan puts them
    cfg = trainer_config(params, data_root=Path(params.data.data_root), work_dir=work_root / "runs" / "pool-seed",
                         compile_cache_root=work_root / "compile-cache")
    pool = service(policy=PoolPolicy(margin_s=600.0), journal=str(Path(home) / "pool" / "journal.json"))
    ray.get(pool.fill.remote(cfg, 0, spool, actor_cls=TrainerActor, start=StartSample(2000.0, False)))
    started = ray.get(pool.fill.remote(cfg, count, spool, time.time() + 1.0, actor_cls=TrainerActor,
                                       start=StartSample(1.0, True)))
    return {"started": int(started), "ready": int(ray.get(pool.wait_ready.remote(240.0)))}


def _kill() -> None:
    import ray

    from ettflow.trainer.group.pool_service import NAME, NAMESPACE

    ray.kill(ray.get_actor(NAME, namespace=NAMESPACE), no_restart=True)


if __name__ == "__main__":
    import ray

    from ettflow.console import quiet_third_party

    quiet_third_party(verbose=False)
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    if sys.argv[1] == "fill":
        print(json.dumps(_fill(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))))
    elif sys.argv[1] == "kill":
        _kill()
    else:
        raise SystemExit(f"unknown action {sys.argv[1]!r}: fill or kill")
