"""Driving the real trainer (Ray actors, TorchRec over gloo) without Prefect: one config for
the tiny model, one driver call, and the checks several trainer tests make."""

from __future__ import annotations

from pathlib import Path

import torch

from ettflow.ett.run_metrics import compute_run_metrics
from ettflow.ett.spool import read_spool

from .flows import BATCH, TINY

STEPS = 24  # 2 windows x 768 rows / (2 ranks x 32): every step of the trainer tests' data


def model_config():
    from ettflow.trainer.model import ModelConfig

    return ModelConfig(**TINY)


def config(world: Path, name: str, compile_cache: Path, **over):
    """The trainer config of run `name`: the 3 windows under `world/data` (the third held out
    by the tests that evaluate), its own work dir, the session's compile cache."""
    from ettflow.trainer.config import TrainerConfig
    from ettflow.trainer.data.schema import criteo_schema

    base = dict(
        data_root=str(world / "data"), schema=criteo_schema(100), work_dir=str(world / name),
        compile_cache_root=str(compile_cache), world_size=2, batch_size=BATCH, model=model_config(),
        checkpoint_every_steps=5, step_timeout_s=60, eval_batches=8,
        collective_check="as_nccl",  # a control value on the training group fails here as on NCCL
    )
    base.update(over)
    return TrainerConfig(**base)


def session_compile_cache(tmp_path_factory) -> Path:
    """Where the session's compile-cache archive is built (`conftest.compile_cache`): under xdist,
    in the folder that holds every worker's temp folder (the first worker builds it; its run's
    folder is `compile-cache-build` beside it)."""
    import os

    session_tmp = tmp_path_factory.getbasetemp()
    return (session_tmp.parent if os.environ.get("PYTEST_XDIST_WORKER") else session_tmp) / "compile-cache"


def drive(world: Path, cfg, run_id: str, group_factory=None):
    """Run the driver to the end: (result, spooled events, metrics). The run's in-memory
    keeper is freed afterwards, as the flow's lease does."""
    from ettflow.trainer.group.driver import TrainingDriver
    from ettflow.trainer.group.ray_group import RayWorkerGroup, end_run
    from ettflow.trainer.rank.actor import TrainerActor

    spool = world / "spool"
    factory = group_factory or (lambda a: RayWorkerGroup(cfg, run_id, a, spool, actor_cls=TrainerActor))
    try:
        result = TrainingDriver(cfg, run_id, spool, factory).run()
    finally:
        end_run(run_id)
    events = read_spool(spool, run_id).events
    return result, events, compute_run_metrics(events)


def by(events, phase, rank=None, attempt=None):
    return [e for e in events if e.phase == phase and (rank is None or e.rank == rank)
            and (attempt is None or e.attempt == attempt)]


def model_tensors(anchor: str, out: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of an anchor checkpoint, read whole in this process (test side only)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(anchor, out)
    return dict(torch.load(out, weights_only=False)["model"])


def assert_same_parameters(anchor: str, reference: str, tmp_path: Path) -> None:
    """The two anchors hold bitwise the same model."""
    got = model_tensors(anchor, tmp_path / "got.pt")
    want = model_tensors(reference, tmp_path / "want.pt")
    assert got.keys() == want.keys() and len(got) > 4
    for key in want:
        assert torch.equal(got[key], want[key]), key


def beat_pid(world: Path, run_id: str, attempt: int, rank: int) -> int:
    from ettflow.trainer.rank_heartbeat import beat_file, read_beat

    beat = read_beat(beat_file(world / "spool", run_id, attempt, rank))
    assert beat is not None, f"no heartbeat of rank {rank} in attempt {attempt}"
    return beat.pid


def at_step(world: Path, run_id: str, rank: int, step: int, action, timeout_s: float = 300.0):
    """A started thread that calls `action(beat)` once, when `rank` of attempt 0 beats at `step`
    or later (its heartbeat file, rewritten every half second); and the list it appends what
    `action` returned to."""
    import threading
    import time

    from ettflow.trainer.rank_heartbeat import beat_file, read_beat

    done: list = []

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            beat = read_beat(beat_file(world / "spool", run_id, 0, rank))
            if beat is not None and beat.step is not None and beat.step >= step:
                done.append(action(beat))
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, done
