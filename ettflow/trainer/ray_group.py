"""The real worker group: N Ray actors reserved together through a placement group.

One bundle per rank ({CPU: threads} or {CPU, GPU: 1}), so the group starts whole or waits
whole; the wait is the run's scheduling phase. The actors form one process group (gloo on
CPU, nccl on GPU). Actors never restart on their own (max_restarts=0): the driver decides,
and a new attempt restores from the checkpoint, since no state lives in actor memory.
A rank's outcome is a typed `Failure`, mapped from the exception's type (`classify.py`).
`info` holds each rank's pid and node (a test or an operator can signal a rank by it).
The ranks get the run's config less the scripted faults that already fired (`pending_faults`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ettflow.ett.failures import Failure, FailureClass, FailureError

from .classify import failure_from_exception
from .config import TrainerConfig
from .faults import pending_faults


def ensure_ray(num_cpus: int | None = None) -> None:
    """Join RAY_ADDRESS when set, else start a local Ray sized for this machine (always a new
    one: `address="local"`, so a cluster someone else started on this host is never joined by
    accident)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(address="local", num_cpus=num_cpus or max(os.cpu_count() or 1, 4), include_dashboard=False,
                 log_to_driver=True)


def wants_gpu(config: TrainerConfig) -> bool:
    if config.device == "cpu":
        return False
    gpus = ray.cluster_resources().get("GPU", 0)
    if config.device == "cuda" and gpus < config.world_size:
        raise RuntimeError(
            f"device='cuda' needs {config.world_size} GPUs in the Ray cluster, it has {gpus:g}; "
            "use device='auto' or 'cpu', or a smaller world_size"
        )
    return gpus >= config.world_size


class RayWorkerGroup:
    def __init__(self, config: TrainerConfig, run_id: str, attempt: int, spool_root: Path | str,
                 *, reserve_timeout_s: float = 600.0) -> None:
        self.config, self.run_id, self.attempt = config, run_id, attempt
        self.spool_root = str(spool_root)
        self.reserve_timeout_s = reserve_timeout_s
        self.pg = None
        self.actors: list = []
        self.info: list[dict] = []
        self.refs: dict = {}

    def reserve(self) -> None:
        from .actor import TrainerActor

        gpu = wants_gpu(self.config)
        bundle = {"CPU": self.config.threads_per_rank, **({"GPU": 1} if gpu else {})}
        self.pg = placement_group([dict(bundle) for _ in range(self.config.world_size)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=self.reserve_timeout_s)
        except GetTimeoutError as exc:
            raise FailureError(Failure(
                failure_class=FailureClass.INFRASTRUCTURE, attempt=self.attempt,
                reason=f"could not reserve {self.config.world_size} x {bundle} within "
                       f"{self.reserve_timeout_s:.0f} s: the Ray cluster has {ray.cluster_resources()}")) from exc
        config = pending_faults(self.config, self.spool_root, self.run_id)  # each fault fires once per run
        remote = ray.remote(TrainerActor)
        requested_at = time.time()
        self.actors = [
            remote.options(
                num_cpus=self.config.threads_per_rank, num_gpus=1 if gpu else 0, max_restarts=0,
                max_concurrency=2,  # a second thread answers calls while `train` runs
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
            ).remote(config, self.run_id, self.attempt, rank, self.spool_root, requested_at)
            for rank in range(self.config.world_size)
        ]
        self.info = ray.get([a.ready.remote() for a in self.actors])

    def launch(self) -> None:
        addr, port = ray.get(self.actors[0].rendezvous.remote())
        self.refs = {a.train.remote(addr, port): rank for rank, a in enumerate(self.actors)}

    def poll(self, timeout_s: float) -> tuple[dict[int, dict], list[Failure]]:
        done, _ = ray.wait(list(self.refs), num_returns=len(self.refs), timeout=timeout_s)
        finished: dict[int, dict] = {}
        failed: list[Failure] = []
        for ref in done:
            rank = self.refs.pop(ref)
            try:
                finished[rank] = ray.get(ref)
            except (RayActorError, RayTaskError) as exc:  # the process died, or the rank raised
                failed.append(failure_from_exception(exc, rank=rank, attempt=self.attempt))
        return finished, failed

    def kill(self, rank: int) -> None:
        info = self.info[rank]
        if info["node_ip"] == ray.util.get_node_ip_address():
            os.kill(info["pid"], signal.SIGKILL)
        else:
            ray.kill(self.actors[rank], no_restart=True)

    def teardown(self) -> None:
        # SIGKILL first where the pid is ours to signal: `ray.kill` may deliver SIGTERM, which
        # a rank takes for a preemption (preemption.py), and the group's end is not one
        for rank, actor in enumerate(self.actors):
            info = self.info[rank] if rank < len(self.info) else None
            if info is not None and info["node_ip"] == ray.util.get_node_ip_address():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(info["pid"], signal.SIGKILL)
            ray.kill(actor, no_restart=True)
        self.actors, self.refs = [], {}
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

