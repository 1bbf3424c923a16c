"""`ettflow bench checkpoints`: full vs delta checkpoints, side by side (issue 28).

A component bench, not a deployment run: both arms from the same state in one run (which a
deployment run cannot give: it takes one or the other, `switches.delta_checkpoint`), on the bench
jobs' default model (`criteo_schema(20_000)`, embedding_dim 16, 2 gloo ranks on CPU, the
trainer's sharding `model.shard`: fused Adagrad in backward, dense Adam), trained eagerly on
batches whose ids follow a power law over each table's rows (exponent 1.1, the synthetic
Criteo-like data's: `trainer.data.synthetic`), ids ranked by a fixed random permutation; or
(`--movielens DIR`) on MovieLens-100K's real interactions in time order, with its schema.

Every `steps_between` steps the same state is saved both ways, in one run:

- full: `CheckpointManager` in async mode, every row of every table (the optimized trainer's
  checkpoint: the loop blocks for the copy, the write and commit run in the background; the
  bench waits for each commit before it goes on, so the two parts are measured apart);
- delta: the rows TorchRec's tracker saw since the previous save with their optimizer state,
  and the dense state whole (`trainer.checkpoint.delta`), on the first full save as its base,
  as the optimized trainer saves it (issue 44): the loop blocks for the capture into host
  memory (`delta.capture`), the write, the ranks' agreement and the seal run after it
  (`delta.commit_captured`, on the trainer's background thread; the bench waits for it before it
  goes on, so the two parts are measured apart).

Reported per arm: bytes per save (the median, as sealed: every file but the manifest and the
COMMITTED marker; the delta's first save is the full base, not counted), the blocking and the
background seconds of a save (the slowest rank's), and the restore of the last step: the full
checkpoint vs the base plus every delta, checked bitwise equal.

Then the publish of the last step, both ways (`publisher.publish_snapshot`, int8, validated on a
held-out window: the last MovieLens window, or a synthetic Criteo-like window of the same
schema): a full snapshot, and a delta snapshot on the snapshot of the first save (the snapshot
the previous refresh would have published: every row the saves' steps changed differs).
Reported: publish seconds, the snapshot's bytes (every file but its manifest), the rows that
changed, and whether the delta materialized equals the full snapshot bitwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class DeltaBenchPlan:
    num_embeddings: int = 20_000
    embedding_dim: int = 16
    world_size: int = 2
    batch_size: int = 256
    saves: int = 8
    steps_between: int = 25
    exponent: float = 1.1  # the power law of the ids' popularity
    # MovieLens-100K windows (`ettflow data movielens --out DIR`): real interactions in time order
    # (its schema and tables, `movielens_schema`) instead of the synthetic power law; None: synthetic
    movielens: str | None = None

    def __post_init__(self) -> None:
        if min(self.num_embeddings, self.embedding_dim, self.world_size, self.batch_size, self.saves,
               self.steps_between) < 1 or not self.exponent > 0:
            raise ValueError(f"every size of DeltaBenchPlan must be >= 1 and the exponent > 0, got {self}")


@dataclass(frozen=True, kw_only=True)
class Measured:
    full_bytes: list[int]
    delta_bytes: list[int]  # the first is the base (a full save)
    full_blocking_s: list[float]
    delta_blocking_s: list[float]
    full_background_s: list[float]
    delta_background_s: list[float]  # per delta (not the base)
    touched_rows: list[int]  # per delta, summed over the ranks
    table_rows: int
    full_restore_s: float
    chain_restore_s: float
    chain_equal: bool
    first_full: str = ""  # the anchors the publish reads: the first save's and the last one's
    last_full: str = ""


@dataclass(frozen=True, kw_only=True)
class Published:
    """The last step published full, and as a delta on the first save's snapshot."""

    full_s: float
    delta_s: float
    full_bytes: int
    delta_bytes: int
    changed_rows: int
    rows: int
    materialized_equal: bool


def table(m: Measured, p: Published | None = None) -> str:
    full = statistics.median(m.full_bytes)
    delta = statistics.median(m.delta_bytes[1:])
    fb, db = statistics.median(m.full_blocking_s), statistics.median(m.delta_blocking_s[1:])
    fg = statistics.median(m.full_background_s)
    dg = statistics.median(m.delta_background_s) if m.delta_background_s else 0.0
    touched = statistics.median(m.touched_rows)
    rows = ["| arm | saves | median bytes per save | of full | median blocking s | of full | median background s "
            "| restore of the last step s |", "|---|---|---|---|---|---|---|---|",
            f"| full (every row, async) | {len(m.full_bytes)} | {full:,.0f} | 100% | {fb:.4f} | 100% | {fg:.4f} | "
            f"{m.full_restore_s:.3f} |",
            f"| delta (rows touched since the last save: median {touched:,.0f} of {m.table_rows:,}) | "
            f"{len(m.delta_bytes) - 1} + base | "
            f"{delta:,.0f} | {100 * delta / full:.1f}% (1/{full / delta:.1f}) | {db:.4f} | {100 * db / fb:.1f}% | "
            f"{dg:.4f} | "
            f"{m.chain_restore_s:.3f} (base + {len(m.delta_bytes) - 1} deltas, bitwise equal: {m.chain_equal}) |"]
    if p is not None:
        rows += ["", "| snapshot of the last step | bytes | of full | publish s | of full |", "|---|---|---|---|---|",
                 f"| full (every row, int8) | {p.full_bytes:,} | 100% | {p.full_s:.1f} | 100% |",
                 f"| delta on the first save's snapshot ({p.changed_rows:,} of {p.rows:,} rows changed; "
                 f"materialized bitwise equal: {p.materialized_equal}) | {p.delta_bytes:,} | "
                 f"{100 * p.delta_bytes / p.full_bytes:.1f}% (1/{p.full_bytes / p.delta_bytes:.1f}) | "
                 f"{p.delta_s:.1f} | {100 * p.delta_s / p.full_s:.0f}% |"]
    return "\n".join(rows)


def _skewed_batch(schema, batch_size: int, *, seed, perms):
    """A batch whose ids follow the power law over each table's rows (`perms`: rank -> id)."""
    import numpy as np
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from ettflow.trainer.data.batch import DENSE_DTYPE, LABEL_DTYPE, LENGTHS_DTYPE, VALUES_DTYPE, Batch

    rng = np.random.default_rng(seed)
    values = []
    for perm, cdf in perms:  # one per sparse feature, in the schema's order
        ranks = np.searchsorted(cdf, rng.random(batch_size))
        values.append(torch.from_numpy(perm[np.minimum(ranks, len(perm) - 1)].astype(np.int64)))
    kjt = KeyedJaggedTensor(keys=list(schema.sparse_names), values=torch.cat(values).to(VALUES_DTYPE),
                            lengths=torch.ones(batch_size * len(schema.sparse), dtype=LENGTHS_DTYPE),
                            stride=batch_size)
    return Batch(dense=torch.from_numpy(rng.random((batch_size, len(schema.dense)))).to(DENSE_DTYPE), sparse=kjt,
                 labels=torch.from_numpy(rng.integers(0, 2, batch_size)).to(LABEL_DTYPE))


def _worker(rank: int, plan: DeltaBenchPlan, work: str, out: str) -> None:
    from ettflow.console import quiet_third_party, verbose_from_env

    quiet_third_party(verbose_from_env())  # a spawned rank starts without its parent's filters
    import numpy as np
    import torch

    from ettflow.trainer.checkpoint import CheckpointConfig, CheckpointManager, TrainState, init_lazy_optimizer_state
    from ettflow.trainer.checkpoint.anchor import AnchorInfo, write_anchor
    from ettflow.trainer.checkpoint.delta import (
        RowLedger,
        apply_chain,
        capture,
        commit_captured,
        commit_digest,
        enable_tracker,
        touched_rows,
    )
    from ettflow.trainer.checkpoint.group import CheckpointGroup
    from ettflow.trainer.collectives import Groups
    from ettflow.trainer.data.schema import criteo_schema, movielens_schema
    from ettflow.trainer.model import DenseStep, ModelConfig, build_dlrm, dense_optimizer, dense_parameters, shard

    torch.set_num_threads(1)
    groups = Groups.form(torch.device("cpu"), init_method=f"file://{work}/pg", rank=rank, world_size=plan.world_size)
    schema = movielens_schema() if plan.movielens else criteo_schema(plan.num_embeddings)
    real = _window_batches(plan, schema, rank) if plan.movielens else None
    config = ModelConfig(embedding_dim=plan.embedding_dim, dense_arch=(64, plan.embedding_dim))

    def fresh() -> TrainState:
        dmp = shard(build_dlrm(config, schema, device=torch.device("cpu")), config, groups.training)
        opt = dense_optimizer(dmp, config)
        init_lazy_optimizer_state(opt)
        return TrainState(model=dmp, optimizers={"sparse": dmp.fused_optimizer, "dense": opt})

    state = fresh()
    dmp, opt = state.model, state.optimizers["dense"]
    dense_step, params = DenseStep(dmp.module), dense_parameters(dmp)
    tracker, ledger = enable_tracker(dmp), RowLedger()
    perm_rng = np.random.default_rng(7)
    perms = []
    for f in schema.sparse:
        p = np.arange(1, f.num_embeddings + 1, dtype=np.float64) ** -plan.exponent
        perms.append((perm_rng.permutation(f.num_embeddings), np.cumsum(p) / p.sum()))
    full_root, delta_root = Path(work) / "full", Path(work) / "delta"
    full = CheckpointManager(CheckpointConfig(root=full_root, mode="async", keep_last=plan.saves + 1),
                             process_group=groups.checkpoint.pg)
    base_path: Path | None = None
    parent_digest = ""
    ckpt_group = CheckpointGroup(groups.checkpoint.pg, mode="sync")
    full_bytes, delta_bytes, full_s, delta_s, touched_n, full_bg, delta_bg = [], [], [], [], [], [], []
    step = 0
    for _ in range(plan.saves):
        for _ in range(plan.steps_between):
            batch = next(real) if real is not None else _skewed_batch(schema, plan.batch_size, seed=[step, rank],
                                                                      perms=perms)
            opt.zero_grad(set_to_none=True)
            loss, _ = dense_step(batch.dense, dmp.module.sparse_arch(batch.sparse), batch.labels)
            loss.backward()
            groups.training.average_grads(params)
            opt.step()
            step += 1
        groups.control.barrier()
        t0 = time.perf_counter()
        saving = full.save(step, state)
        full_s.append(time.perf_counter() - t0)
        committed = saving.commit_result()  # the background write, commit and seal
        if not committed.committed:
            raise RuntimeError(f"the full save of step {step} did not commit: {committed.error}")
        full_bg.append(committed.background_s)
        full_bytes.append(committed.nbytes)
        last_full = committed.path
        if rank == 0:  # what the publish reads (`publish_snapshot`): an anchor marker on each full save
            write_anchor(last_full, AnchorInfo(run_id=f"step-{step}", step=step, world_size=plan.world_size,
                                               model=config, schema=schema))
        touched = ledger.add(touched_rows(tracker))
        groups.control.barrier()
        t0 = time.perf_counter()
        if base_path is None:  # the chain's base: the full save just made
            base_path = last_full
            parent_digest = commit_digest(base_path)
            delta_bytes.append(full_bytes[-1])
            ledger.committed()
            delta_s.append(full_s[-1])
            continue
        state.step = step
        captured = capture(state, step=step, parent=step - plan.steps_between, parent_digest=parent_digest,
                           touched=touched)
        delta_s.append(time.perf_counter() - t0)  # what the loop waits for; the rest runs in the background
        t0 = time.perf_counter()
        commit = commit_captured(delta_root, captured, ckpt_group)
        delta_bg.append(time.perf_counter() - t0)
        if not commit.committed:
            raise RuntimeError(f"the delta of step {step} did not commit: {commit.error}")
        ledger.committed()
        parent_digest = commit.digest
        delta_bytes.append(commit.bytes)
        touched_n.append(sum(int(v.numel()) for v in touched.values()))
    full.close()
    # restore the last step both ways, into fresh models, and compare
    groups.control.barrier()
    t0 = time.perf_counter()
    from_full = fresh()
    restore = CheckpointManager(CheckpointConfig(root=full_root, mode="sync", keep_last=plan.saves + 1),
                                process_group=groups.checkpoint.pg)
    restore.load(from_full, last_full)
    full_restore_s = time.perf_counter() - t0
    groups.control.barrier()
    t0 = time.perf_counter()
    from_chain = fresh()
    restore.load(from_chain, base_path)
    apply_chain(from_chain, sorted(Path(delta_root).glob("delta_*")), groups.control.rank)
    chain_restore_s = time.perf_counter() - t0
    restore.close()
    equal = _same_state(from_full, from_chain)
    values = groups.control.max_of(full_s + delta_s + [full_restore_s, chain_restore_s, 0.0 if equal else 1.0]
                                   + full_bg + delta_bg)
    counts = (groups.control.all_reduce(torch.tensor(touched_n, dtype=torch.float64), "sum").tolist()
              if touched_n else [])  # every rank's rows
    if groups.control.rank == 0:
        n = plan.saves
        m = Measured(full_bytes=full_bytes, delta_bytes=delta_bytes, full_blocking_s=values[:n],
                     delta_blocking_s=values[n:2 * n], touched_rows=[int(c) for c in counts],
                     table_rows=sum(f.num_embeddings for f in schema.sparse), full_restore_s=values[2 * n],
                     chain_restore_s=values[2 * n + 1], chain_equal=values[2 * n + 2] == 0.0,
                     full_background_s=values[2 * n + 3:3 * n + 3], delta_background_s=values[3 * n + 3:],
                     first_full=str(base_path), last_full=str(last_full))
        Path(out).write_text(json.dumps(asdict(m)))
    groups.control.barrier()
    groups.teardown()


def _window_batches(plan: DeltaBenchPlan, schema, rank: int):
    """This rank's batches of the windows under `plan.movielens`, in time order, over and over."""
    from ettflow.trainer.data.pipeline import DataConfig, DataPipeline

    config = DataConfig(root=plan.movielens, schema=schema, batch_size=plan.batch_size, rank=rank,
                        world_size=plan.world_size)
    while True:
        yield from DataPipeline(config).batches()


def _same_state(a, b) -> bool:
    """Every tensor of the model's and the optimizers' state dicts (local shards) equal."""
    import torch

    def flat(obj, prefix=""):
        shards = getattr(obj, "local_shards", None)
        if isinstance(obj, dict):
            return {k: v for key, sub in obj.items() for k, v in flat(sub, f"{prefix}/{key}").items()}
        if callable(shards):
            return {prefix: [s.tensor for s in shards()]}
        if isinstance(obj, torch.Tensor):
            return {prefix: [obj]}
        return {}

    x = flat({"model": a.model.state_dict(), **{n: o.state_dict()["state"] for n, o in a.optimizers.items()}})
    y = flat({"model": b.model.state_dict(), **{n: o.state_dict()["state"] for n, o in b.optimizers.items()}})
    return x.keys() == y.keys() and all(len(x[k]) == len(y[k]) and all(map(torch.equal, x[k], y[k])) for k in x)


def publish(plan: DeltaBenchPlan, m: Measured, work: Path) -> Published:
    """The last step's snapshot, full and as a delta on the first save's (see the docstring)."""
    import torch

    from ettflow.publish import PublishConfig, publish_snapshot
    from ettflow.publish.delta_snapshot import load_module, materialize
    from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows
    from ettflow.trainer.data.windows import list_windows

    if plan.movielens:
        data_root = Path(plan.movielens)
    else:
        data_root = work / "held-out"
        generate_windows(data_root, SyntheticConfig(windows=1, rows_per_window=4 * plan.batch_size, files_per_window=1))
    out = work / "snapshots"

    def config(anchor: str, run_id: str, **kw) -> PublishConfig:
        return PublishConfig(anchor=anchor, output_root=out, data_root=data_root, run_id=run_id,
                             windows=tuple(list_windows(data_root)[-1:]), batch_size=plan.batch_size,
                             validation_batches=4, **kw)

    base = publish_snapshot(config(m.first_full, "first"))
    full = publish_snapshot(config(m.last_full, "full"))
    delta = publish_snapshot(config(m.last_full, "delta", delta_on=base.path))
    made = materialize(delta.path, work / "materialized")
    want = load_module(Path(full.path) / "model.pt").state_dict()
    got = load_module(Path(made.path) / "model.pt").state_dict()
    return Published(full_s=full.timings_s["total"], delta_s=delta.timings_s["total"],
                     full_bytes=sum(f["size"] for f in full.files.values()),
                     delta_bytes=sum(f["size"] for f in delta.files.values()),
                     changed_rows=delta.delta["changed_rows"], rows=delta.delta["rows"],
                     materialized_equal=want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want))


def run(plan: DeltaBenchPlan, *, snapshots: bool = True) -> tuple[Measured, Published | None]:
    """Both arms of the checkpoints, then (`snapshots`) of the last step's snapshot."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ettflow-delta-bench-") as work:
        out = f"{work}/measured.json"
        mp.spawn(_worker, args=(plan, work, out), nprocs=plan.world_size, join=True)
        measured = Measured(**json.loads(Path(out).read_text()))
        return measured, publish(plan, measured, Path(work)) if snapshots else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    defaults = DeltaBenchPlan()
    for name in ("num_embeddings", "embedding_dim", "batch_size", "saves", "steps_between"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    p.add_argument("--exponent", type=float, default=defaults.exponent)
    p.add_argument("--movielens", metavar="DIR", help="train on MovieLens-100K windows (`ettflow data movielens "
                   "--out DIR`) instead of synthetic power-law ids")
    p.add_argument("--no-snapshots", action="store_true", help="checkpoints only: skip publishing the last step "
                   "full and as a delta snapshot")


def plan_of(args: argparse.Namespace) -> DeltaBenchPlan:
    """The plan the command's arguments give (the rest: the plan's defaults)."""
    return DeltaBenchPlan(**{k: getattr(args, k) for k in DeltaBenchPlan.__dataclass_fields__ if hasattr(args, k)})


def main(args: argparse.Namespace) -> int:
    from ettflow.console import quiet_third_party

    quiet_third_party(verbose=getattr(args, "verbose", False))  # the snapshots' publish runs here
    plan = plan_of(args)
    started = time.perf_counter()
    measured, published = run(plan, snapshots=not args.no_snapshots)
    print(f"delta vs full checkpoints and snapshots: {plan} ({time.perf_counter() - started:.0f} s)\n")
    print(table(measured, published))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m ettflow.bench.delta_checkpoints", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
