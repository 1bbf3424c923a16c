"""`python -m ettflow.bench.save_blocking`: how long a checkpoint save blocks training, side by side.

The bench jobs' default model (`criteo_schema(20_000)`, embedding_dim 16, 2 gloo ranks on
CPU, DMP with the fused row-wise Adagrad applied in backward and a dense Adam; see
`jobs.trainer_config`) trains on synthetic batches, and saves through three managers in one
run, their repetitions interleaved (the arm order rotates every repetition):

- sync: `CheckpointManager` in sync mode (the baseline): the whole DCP write and commit;
- async, copy in save: async mode with synchronous staging (`async_staging=False`, today's
  path): `save` returns once the state is copied into host memory;
- async, staged hand-off: async mode with async staging (`async_staging=True`): `save` hands
  the state to the staging thread and returns; the next step waits for the copy
  (`CheckpointManager.wait_staged`) right before its backward pass, the first point where
  the fused sparse optimizer mutates parameters. Its blocking is `save` + that wait.

A save's blocking is the slowest rank's (the ranks meet in the next step's collectives).
Every step mirrors `TrainLoop.train_step` (sparse lookup, dense step, backward, dense
all-reduce, Adam step), eager. After a save and the step behind it, the bench waits for the
background write (untimed), so no arm's write overlaps another arm's measurement. The
columns "step after save" and "plain step" show what the overlap costs the step that
carries the copy. Every arm's first save (buffers allocated) is a warm-up and not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ARMS = ("sync", "async_copy", "async_staged")
LABELS = {
    "sync": "sync (baseline)",
    "async_copy": "async, copy inside save (today)",
    "async_staged": "async, staged hand-off + wait before backward",
}


@dataclass(frozen=True, kw_only=True)
class SaveBlockingPlan:
    num_embeddings: int = 20_000
    embedding_dim: int = 16
    world_size: int = 2
    batch_size: int = 256
    repetitions: int = 40
    steps_between: int = 4  # plain steps before each save

    def __post_init__(self) -> None:
        if min(self.num_embeddings, self.embedding_dim, self.world_size, self.batch_size,
               self.repetitions, self.steps_between) < 1:
            raise ValueError(f"every size of SaveBlockingPlan must be >= 1, got {self}")


@dataclass(frozen=True, kw_only=True)
class ArmStats:
    arm: str
    saves: int
    median_s: float
    p10_s: float
    p90_s: float
    max_s: float
    median_save_call_s: float  # the `save` call alone
    median_wait_s: float  # wait_staged before the next backward
    median_step_after_s: float  # the step that follows the save (carries the async copy)
    median_plain_step_s: float


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(arm: str, save_s: list[float], wait_s: list[float], after_s: list[float],
              plain_s: list[float]) -> ArmStats:
    """Per-save blocking = the save call + the wait before the next backward."""
    blocking = [s + w for s, w in zip(save_s, wait_s, strict=True)]
    return ArmStats(arm=arm, saves=len(blocking), median_s=statistics.median(blocking),
                    p10_s=_quantile(blocking, 0.1), p90_s=_quantile(blocking, 0.9), max_s=max(blocking),
                    median_save_call_s=statistics.median(save_s), median_wait_s=statistics.median(wait_s),
                    median_step_after_s=statistics.median(after_s), median_plain_step_s=statistics.median(plain_s))


def table(stats: list[ArmStats]) -> str:
    sync = next(s for s in stats if s.arm == "sync").median_s
    rows = ["| arm | saves | median blocking s | p10 | p90 | max | % of sync | save call s | wait before "
            "backward s | step after save s | plain step s |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in stats:
        rows.append(f"| {LABELS[s.arm]} | {s.saves} | {s.median_s:.4f} | {s.p10_s:.4f} | {s.p90_s:.4f} | "
                    f"{s.max_s:.4f} | {100 * s.median_s / sync:.1f}% | {s.median_save_call_s:.4f} | "
                    f"{s.median_wait_s:.4f} | {s.median_step_after_s:.4f} | {s.median_plain_step_s:.4f} |")
    return "\n".join(rows)


# ---- one rank ---------------------------------------------------------------------------

def _worker(rank: int, plan: SaveBlockingPlan, work: str, out: str) -> None:
    from ettflow.console import quiet_third_party, verbose_from_env

    quiet_third_party(verbose_from_env())  # a spawned rank starts without its parent's filters
    import torch

    from ettflow.trainer.checkpoint import CheckpointConfig, CheckpointManager, TrainState, init_lazy_optimizer_state
    from ettflow.trainer.collectives import Groups
    from ettflow.trainer.data.batch import synthetic_batch
    from ettflow.trainer.data.schema import criteo_schema
    from ettflow.trainer.model import (
        DenseStep,
        ModelConfig,
        build_dlrm,
        dense_optimizer,
        dense_parameters,
        shard,
    )

    torch.set_num_threads(1)  # TrainerConfig.threads_per_rank's default
    groups = Groups.form(torch.device("cpu"), init_method=f"file://{work}/pg", rank=rank, world_size=plan.world_size)
    ckpt_pg = groups.checkpoint.pg
    schema = criteo_schema(plan.num_embeddings)
    dim = plan.embedding_dim
    config = ModelConfig(embedding_dim=dim, dense_arch=(64, dim))
    dmp = shard(build_dlrm(config, schema, device=torch.device("cpu")), config, groups.training)
    dense_step, opt = DenseStep(dmp.module), dense_optimizer(dmp, config)
    params = dense_parameters(dmp)
    init_lazy_optimizer_state(opt)
    state = TrainState(model=dmp, optimizers={"sparse": dmp.fused_optimizer, "dense": opt})
    batches = [synthetic_batch(schema, plan.batch_size, seed=1000 * rank + i) for i in range(8)]
    managers = {
        "sync": CheckpointManager(CheckpointConfig(root=f"{work}/sync", mode="sync", keep_last=1),
                                  process_group=ckpt_pg),
        "async_copy": CheckpointManager(CheckpointConfig(root=f"{work}/copy", mode="async", keep_last=1),
                                        process_group=ckpt_pg, async_staging=False),
        "async_staged": CheckpointManager(CheckpointConfig(root=f"{work}/staged", mode="async", keep_last=1),
                                          process_group=ckpt_pg, async_staging=True),
    }
    step = 0

    def train_step(manager: CheckpointManager | None) -> tuple[float, float]:
        """TrainLoop.train_step with the hook; returns (step seconds, seconds waited for staging)."""
        nonlocal step
        t0 = time.perf_counter()
        batch = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        embedded = dmp.module.sparse_arch(batch.sparse)
        loss, _ = dense_step(batch.dense, embedded, batch.labels)
        float(loss.detach())
        staged = manager.wait_staged() if manager is not None else None
        loss.backward()
        groups.training.average_grads(params)
        opt.step()
        step += 1
        return time.perf_counter() - t0, staged.waited_s if staged is not None else 0.0

    def measured_save(arm: str) -> tuple[float, float, float]:
        manager = managers[arm]
        groups.control.barrier()
        result = manager.save(step, state)
        after, waited = train_step(manager)
        manager.wait()
        return result.blocking_s, waited, after

    plain: list[float] = []
    samples: dict[str, list[tuple[float, float, float]]] = {arm: [] for arm in ARMS}
    for _ in range(3):
        train_step(None)
    for arm in ARMS:  # warm-up: the first save allocates the staging buffers
        measured_save(arm)
    for rep in range(plan.repetitions):
        for k in range(len(ARMS)):
            arm = ARMS[(rep + k) % len(ARMS)]
            for _ in range(plan.steps_between):
                plain.append(train_step(None)[0])
            samples[arm].append(measured_save(arm))
    for manager in managers.values():
        manager.close()
    # the slowest rank's value of every sample
    values = groups.control.max_of([v for arm in ARMS for s in samples[arm] for v in s] + plain)
    if rank == 0:
        n = plan.repetitions
        stats = []
        for i, arm in enumerate(ARMS):
            rows = values[3 * n * i: 3 * n * (i + 1)]
            stats.append(summarize(arm, rows[0::3], rows[1::3], rows[2::3], values[3 * n * len(ARMS):]))
        Path(out).write_text(json.dumps([asdict(s) for s in stats]))
    groups.control.barrier()
    groups.teardown()


def run(plan: SaveBlockingPlan) -> list[ArmStats]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ettflow-save-blocking-") as work:
        out = f"{work}/stats.json"
        mp.spawn(_worker, args=(plan, work, out), nprocs=plan.world_size, join=True)
        return [ArmStats(**s) for s in json.loads(Path(out).read_text())]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ettflow.bench.save_blocking", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repetitions", type=int, default=SaveBlockingPlan.repetitions)
    p.add_argument("--steps-between", type=int, default=SaveBlockingPlan.steps_between)
    p.add_argument("--num-embeddings", type=int, default=SaveBlockingPlan.num_embeddings)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    plan = SaveBlockingPlan(repetitions=args.repetitions, steps_between=args.steps_between,
                            num_embeddings=args.num_embeddings)
    start = time.time()
    stats = run(plan)
    print(table(stats))
    staged = next(s for s in stats if s.arm == "async_staged").median_s
    sync = next(s for s in stats if s.arm == "sync").median_s
    print(f"\nasync staged hand-off / sync: {100 * staged / sync:.1f}%  ({plan}, {time.time() - start:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(s) for s in stats], indent=1))


if __name__ == "__main__":
    main()
