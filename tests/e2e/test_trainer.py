"""The real trainer: 2 Ray actors, TorchRec DMP over gloo, compiled dense step (from the
session's compile cache), DCP checkpoints, real SIGKILLs, a NaN loss, a bad data file, the
baseline's switches and the warm pool. Tiny sizes; the reference run (`clean_run`, e2e/conftest.py)
is the one every interrupted run must end bitwise equal to."""

from __future__ import annotations

import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ettflow.trainer.checkpoint.anchor import read_anchor
from ettflow.trainer.config import FailAt, Switches
from ettflow.trainer.group.driver import TrainingFailed

from helpers.trainer_runs import (
    STEPS,
    assert_same_parameters,
    at_step,
    beat_pid,
    by,
    config,
    drive,
    model_tensors,
    session_compile_cache,
)

pytestmark = [pytest.mark.slow]


def test_two_ranks_train_and_held_out_loss_falls(clean_run):
    result, events, m = clean_run
    assert result.attempts == 1 and m.nof == 0
    r0 = result.rank0
    assert r0.final_step == STEPS and m.effective_steps == 2 * STEPS and m.replayed_steps == 0
    assert r0.eval.loss < r0.eval_start.loss - 0.01
    assert r0.eval.auc > 0.6 and r0.steps_per_s > 0 and r0.examples_per_s > 0
    # the session's archive (conftest `compile_cache`) was restored: nothing compiled cold
    assert r0.compile.cache_hit and r0.compile.stats.recompiles == 0
    m.check_partition()


def test_steps_stalls_and_saves_tile_the_training_time(clean_run):
    # each step's interval starts where the previous step, stall or save ended (`trainer.step_clock`),
    # so nothing between a rank's first and last step is unattributed
    _, events, _ = clean_run
    saves = ("checkpoint_save_blocking", "memory_save_blocking")
    for rank in (0, 1):
        spans = sorted((e.start, e.end, e.phase) for e in events if e.rank == rank
                       and e.phase in ("train_step", "data_stall", *saves))
        assert len(by(events, "train_step", rank)) == STEPS and len(spans) > STEPS  # saves every 5 steps
        for (_, end, _), (start, _, _) in zip(spans, spans[1:]):
            assert start == end  # a step, stall or save starts exactly where the previous interval ended


def test_fast_batch_compile_does_not_wait_for_real_data(clean_run):
    # (the overlap itself, with a DPP slower than this tiny one: unit/test_init_pipeline.py)
    _, events, _ = clean_run
    for rank in (0, 1):
        (compile_ev,) = by(events, "pt2_compile", rank)
        (warmup,) = by(events, "get_first_batch_data", rank)
        assert compile_ev.attrs["batch"] == "synthetic fast batch"
        assert warmup.start < compile_ev.start  # the DPP warm-up started in the background first


def test_a_nan_loss_and_a_sigkill_each_restart_every_rank_exactly_and_warm(trainer_world, compile_cache, clean_run,
                                                                           tmp_path):
    """A NaN loss on rank 0 at step 7 (attempt 0), then a SIGKILL of rank 1 at step 12
    (attempt 1), then a SIGKILL of rank 0 between the anchor checkpoint's commit and its
    `anchor.json` (attempt 2); live recovery off, so every rank restarts each time (the path a
    lost node, a hang or a numerics failure takes, and the ablation's)."""
    cfg = config(trainer_world, "nan-kill", compile_cache,
                 failures=(FailAt(kind="nan", rank=0, step=7), FailAt(kind="kill", rank=1, step=12),
                           FailAt.parse("kill:rank=0:phase=anchor_commit"))).with_switches(
        live_recovery=False, memory_checkpoint=False, release_before_seal=False)  # the ranks write the anchor
    result, events, m = drive(trainer_world, cfg, "nan-kill")
    assert result.attempts == 4 and m.nof == 3
    assert [f.failure_class for f in m.failures] == ["numerics", "infrastructure", "infrastructure"]
    # the last restart found the committed final checkpoint without its marker: it is the anchor,
    # with its cursor, and nothing was trained again
    (last,) = by(events, "checkpoint_restore", rank=0, attempt=3)
    assert last.attrs["step"] == STEPS and by(events, "train_step", attempt=3) == []
    assert result.rank0.anchor == last.attrs["path"]
    marker, uninterrupted = read_anchor(result.rank0.anchor), read_anchor(clean_run[0].rank0.anchor)
    assert marker["step"] == STEPS and marker["cursor"] == uninterrupted["cursor"] is not None
    m.check_partition()
    # the NaN ended attempt 0 with a numerics marker from rank 0 ...
    (marker,) = by(events, "failure", rank=0, attempt=0)
    assert marker.attrs["failure_class"] == "numerics" and marker.attrs["step"] == 7
    assert marker.attrs["injected"] and marker.attrs["reason"] == "non-finite loss at step 7 on rank 0"
    # ... the NaN step was never recorded as a step, on any rank, and nothing was saved after it
    assert max(e.attrs["step"] for e in by(events, "train_step", attempt=0)) == 6
    assert all(e.attrs["loss"] == e.attrs["loss"] for e in by(events, "train_step"))  # no NaN loss anywhere
    assert sorted({e.attrs["step"] for e in by(events, "checkpoint_save_blocking", attempt=0)}) == [5]
    assert by(events, "anchor_checkpoint", attempt=0) == []
    (first_restore,) = by(events, "checkpoint_restore", rank=0, attempt=1)
    assert first_restore.attrs["step"] == 5  # the last finite checkpoint
    # the kill's restart resumed exactly at the restored checkpoint's cursor ...
    (restore,) = by(events, "checkpoint_restore", rank=0, attempt=2)
    first_step = min(by(events, "train_step", rank=0, attempt=2), key=lambda e: e.start)
    assert list(first_step.cursor_start) == restore.attrs["cursor"]
    assert restore.attrs["step"] in (5, 10)  # the step-10 save may still have been in flight at the kill
    # ... both restarts replayed only what each failure lost, and every batch was new data exactly once.
    # What the kill lost is what each rank had recorded past the restored step: the killed rank
    # recorded up to step 11; its peer finished step 11 too, but may be torn down before it records it
    lost = {r: [e.attrs["step"] for e in by(events, "train_step", rank=r, attempt=1)
                if e.attrs["step"] >= restore.attrs["step"]] for r in (0, 1)}
    assert max(lost[1]) == 11 and max(lost[0]) in (10, 11)
    assert all(sorted(s) == list(range(restore.attrs["step"], max(s) + 1)) for s in lost.values())
    assert m.replayed_steps == 2 * (7 - 5) + len(lost[0]) + len(lost[1]) and m.effective_steps == 2 * STEPS
    # the restarts found the compile cache: no compilation, no recompile
    compiled = result.rank0.compile
    assert compiled.cache_hit and compiled.stats.fxgraph_miss == 0 and compiled.stats.recompiles == 0
    # and it ends with the parameters of the run that was never interrupted, all finite
    anchor = model_tensors(result.rank0.anchor, tmp_path / "anchor.pt")
    assert all(torch.isfinite(t).all() for t in anchor.values() if t.is_floating_point())
    assert_same_parameters(result.rank0.anchor, clean_run[0].rank0.anchor, tmp_path)


def test_the_sessions_cold_compile_ran_in_one_rank_and_the_other_restored_its_archive(compile_cache,
                                                                                       tmp_path_factory):
    """The session's archive was built by a run whose two ranks both missed it: one claimed the
    key, compiled cold and saved; the other waited for that archive, restored it and compiled warm
    (compile/cold_claim.py), and no claim is left behind."""
    from ettflow.ett.spool import read_spool

    shared = session_compile_cache(tmp_path_factory)
    events = read_spool(shared.with_name("compile-cache-build") / "spool", "compile-cache-build").events
    turns = {e.rank: e.attrs for e in by(events, "pt2_compile", attempt=0)}
    assert sorted(a.get("cold_turn", "none") for a in turns.values()) == ["compile", "restore"], turns
    (owner,) = [r for r, a in turns.items() if a["cold_claimed"]]
    (waiter,) = [r for r, a in turns.items() if not a["cold_claimed"]]
    assert turns[waiter]["cold_turn"] == "restore" and turns[waiter]["cold_why"] == "its archive was saved", turns
    assert turns[owner]["cold_why"] == "first to miss", turns
    assert [e.rank for e in by(events, "compile_cache_save")] == [owner]  # the waiter had nothing to add
    assert not list(shared.glob("*.compiling"))


def test_the_archive_a_rank_saved_holds_no_precompiled_header(compile_cache):
    """The session's archive, saved by the rank that compiled it, in its init thread: compiled without
    inductor's precompiled header (~150 MB the archive carried), though the process set that in
    another thread, the actor's start (torch keeps the setting per thread: cache.apply_settings)."""
    import tarfile

    from ettflow.trainer.compile.archive import SUFFIX

    (archive,) = [p for p in compile_cache.iterdir() if p.name.endswith(tuple(SUFFIX.values()))]
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert any(n.endswith(".so") for n in names)  # the kernels a warm restart loads
    assert not [n for n in names if n.endswith((".gch", ".pch")) or "precompiled_headers/" in n], names
    assert archive.stat().st_size < 20 * 2**20, archive.stat().st_size


def test_baseline_switches_compile_after_the_first_real_batch(trainer_world, compile_cache):
    switches = Switches(parallel_init=False, fast_batch=False, compile_cache=True, async_checkpoint=False)
    cfg = config(trainer_world, "baseline", compile_cache, switches=switches, max_steps=6, eval_batches=0)
    result, events, m = drive(trainer_world, cfg, "baseline")
    for rank in (0, 1):
        (compile_ev,) = by(events, "pt2_compile", rank)
        (warmup,) = by(events, "get_first_batch_data", rank)
        assert compile_ev.start >= warmup.end and compile_ev.attrs["batch"] == "first real batch"
        stages = sorted((e for e in events if e.rank == rank and e.phase in
                         ("process_group_init", "preproc_creation", "train_module_creation")), key=lambda e: e.start)
        assert all(a.end <= b.start for a, b in zip(stages, stages[1:]))  # sequential init
    assert result.rank0.checkpoint.saves == 1 and by(events, "checkpoint_save_background") == []
    anchor = result.rank0.anchor  # synchronous saves commit the anchor too
    assert anchor and read_anchor(anchor)["run_id"] == "baseline" and read_anchor(anchor)["step"] == 6


def test_bad_data_file_is_rejected_with_its_name_and_column(trainer_world, compile_cache):
    data = trainer_world / "bad-data"
    shutil.copytree(trainer_world / "data", data)
    window = sorted(p for p in data.iterdir() if p.is_dir())[0]
    part = sorted(window.glob("*.parquet"))[0]
    table = pq.read_table(part)
    broken = table.set_column(table.schema.get_field_index("int_3"), "int_3",
                              pa.array(["x"] * table.num_rows, type=pa.string()))
    pq.write_table(broken, part)
    cfg = config(trainer_world, "bad", compile_cache, data_root=str(data)).with_switches(
        compile=False, live_recovery=False, memory_checkpoint=False)
    with pytest.raises(TrainingFailed, match=rf"{part}.*int_3"):
        drive(trainer_world, cfg, "bad")


# ---- the warm pool (trainer/group/warm_pool.py): a run's ranks start from processes prewarmed after the last ----

def test_a_run_starts_its_ranks_and_spare_from_the_pool_the_previous_run_left(trainer_world, compile_cache, clean_run,
                                                                               tmp_path):
    import ray

    from ettflow.trainer.group.warm_pool import POOL

    POOL.keep_warm(True)
    try:
        drive(trainer_world, config(trainer_world, "pool-first", compile_cache, max_steps=2, eval_batches=0),
              "pool-first")
        assert POOL.wait_ready(180) == 4  # its teardown started 2 ranks, a spare and its successor for the next run
        pooled = {ray.get(w.actor.ready.remote()).pid for w in POOL.workers}
        POOL.keep_warm(False)  # the next run takes them and leaves nothing
        result, events, m = drive(trainer_world, config(trainer_world, "pool-next", compile_cache, eval_at_start=True),
                                  "pool-next")
        # the ranks took two, the run's spare the third; no failure needed the spare's successor
        assert len(POOL.workers) == 1
    finally:
        POOL.close()
    assert result.attempts == 1 and m.nof == 0
    m.check_partition()
    # both ranks ran in pooled processes; what each prepared is recorded off the clock
    ranks = {beat_pid(trainer_world, "pool-next", 0, rank) for rank in (0, 1)}
    assert ranks < pooled and len(ranks) == 2
    starts = by(events, "spare_start")
    ranks_started = [e for e in starts if e.attrs.get("for_rank") is not None]
    assert sorted(e.attrs["for_rank"] for e in ranks_started) == [0, 1] and all(e.attrs["pooled"] for e in starts)
    # the run's spare (from the pool, never needed) is recorded at its release: capacity held for the run
    (spare,) = [e for e in starts if e.attrs.get("for_rank") is None]
    assert spare.attrs["used"] is False and spare.end == spare.attrs["released_at"]
    assert m.held.unused_spare_s > 0 and m.held.pooled_s > 0 and m.capacity_ett_pct < m.ett_pct
    # no process start and no compile on the run's clock: both were done before the run
    assert all(e.attrs.get("part") != "process_start" for e in by(events, "device_init"))
    for rank in (0, 1):
        (compile_ev,) = by(events, "pt2_compile", rank)
        assert compile_ev.attrs["batch"] == "prewarmed before the run (warm pool)"
    assert result.rank0.compile.cache_hit and result.rank0.compile.stats.recompiles == 0
    # and the run is the run a fresh start makes
    assert_same_parameters(result.rank0.anchor, clean_run[0].rank0.anchor, tmp_path)


def test_a_run_whose_cluster_pool_dies_mid_training_restarts_on_fresh_workers_and_finishes(
        trainer_world, compile_cache, tmp_path, caplog):
    """Issue 42 #1: the cluster's pool service (a detached actor) prewarmed the run's ranks, its
    spare and its in-memory keeper; it is killed at step 6, and everything it owned dies with it.
    The run restarts on fresh ranks and a new keeper (never the dead one's cached handle), the
    dead service is not asked again, and the run finishes. The hold is the rule's own: a
    scheduled next run and measured starts (cold 2,000 s, pooled 1 s: a fleet job's compile) make a
    just-in-time prewarm pay, its unclaimed workers kept 300 s past the scheduled time."""
    import time

    import ray

    from ettflow.trainer.group.pool_service import PoolPolicy, PoolService
    from ettflow.trainer.group.warm_pool import POOL
    from ettflow.trainer.protocol import StartSample
    from ettflow.trainer.rank.actor import TrainerActor

    cfg = config(trainer_world, "pool-lost", compile_cache, eval_batches=0, max_steps=24)
    spool = trainer_world / "spool"
    service = ray.remote(PoolService).options(num_cpus=0, max_restarts=0, max_concurrency=8).remote(
        PoolPolicy(margin_s=300.0), journal=str(tmp_path / "journal.json"))
    ray.get(service.fill.remote(cfg, 0, str(spool), actor_cls=TrainerActor, start=StartSample(2000.0, False)))
    started = ray.get(service.fill.remote(cfg, 3, str(spool), time.time() + 1.0, actor_cls=TrainerActor,
                                          start=StartSample(1.0, True)))
    assert started == 3, ray.get(service.status.remote())
    assert ray.get(service.wait_ready.remote(180)) == 3
    POOL.close()
    POOL.service, POOL.keeping = service, False
    killer, killed = at_step(trainer_world, "pool-lost", 0, 6, lambda beat: ray.kill(service, no_restart=True))
    try:
        with caplog.at_level("WARNING", logger="ettflow"):
            result, events, m = drive(trainer_world, cfg, "pool-lost")
    finally:
        killer.join()
        POOL.close()
    assert killed, "the pool's service was never killed"
    starts = by(events, "spare_start")
    assert sorted(e.attrs["for_rank"] for e in starts if e.attrs.get("for_rank") is not None) == [0, 1]
    assert result.rank0.final_step == 24 and m.nof >= 1 and result.attempts >= 2, result.failures
    m.check_partition()
    last = result.attempts - 1  # the attempt that finished started its own ranks: nothing pooled
    assert not [e for e in starts if e.attempt == last and e.attrs.get("for_rank") is not None]
    # the keeper the pool had started is named by its pool's name (issue 42 #8), and replaced
    assert re.search(r"keeper \(actor ettflow-keeper-pool-\S+\) died: a new one starts", caplog.text), \
        caplog.text[-3000:]

