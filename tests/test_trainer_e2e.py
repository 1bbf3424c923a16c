"""The real trainer: 2 Ray actors, TorchRec DMP over gloo, compiled dense step, DCP
checkpoints, a real SIGKILL, a NaN loss. Tiny sizes; one Ray instance and one compile cache for all."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ettflow.ett.run_metrics import compute_run_metrics
from ettflow.ett.spool import read_spool
from ettflow.trainer.checkpoint.anchor import read_anchor
from ettflow.trainer.config import FailAt, Switches, TrainerConfig
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows
from ettflow.trainer.driver import TrainingDriver, TrainingFailed
from ettflow.trainer.model import ModelConfig
from ettflow.trainer.ray_group import RayWorkerGroup, end_run

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

STEPS = 24  # 2 windows x 768 rows / (2 ranks x 32): every step of the data


@pytest.fixture(scope="module")
def world(tmp_path_factory, ray_session):
    root = tmp_path_factory.mktemp("trainer")
    generate_windows(root / "data", SyntheticConfig(windows=3, rows_per_window=768, files_per_window=2, seed=7))
    return root


def config(world, name: str, **over) -> TrainerConfig:
    base = dict(
        data_root=str(world / "data"), schema=criteo_schema(100), work_dir=str(world / name),
        compile_cache_root=str(world / "compile-cache"), world_size=2, batch_size=32,
        model=ModelConfig(embedding_dim=8, dense_arch=(16, 8), over_arch=(16, 1), dense_lr=0.02, sparse_lr=0.1),
        checkpoint_every_steps=5, step_timeout_s=60, eval_batches=8,
    )
    base.update(over)
    return TrainerConfig(**base)


def drive(world, cfg: TrainerConfig, run_id: str):
    spool = world / "spool"
    driver = TrainingDriver(cfg, run_id, spool, lambda a: RayWorkerGroup(cfg, run_id, a, spool))
    try:
        result = driver.run()
    finally:
        end_run(run_id)  # the run's in-memory keeper (the flow's lease does this)
    events = read_spool(spool, run_id).events
    return result, events, compute_run_metrics(events)


def model_tensors(anchor: str, out) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(anchor, out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state["model"].items()}


def by(events, phase, rank=None, attempt=None):
    return [e for e in events if e.phase == phase and (rank is None or e.rank == rank)
            and (attempt is None or e.attempt == attempt)]


@pytest.fixture(scope="module")
def clean_run(world):
    cfg = config(world, "clean", eval_at_start=True)
    return drive(world, cfg, "clean")


def test_two_ranks_train_and_held_out_loss_falls(clean_run):
    result, events, m = clean_run
    assert result.attempts == 1 and m.nof == 0
    r0 = result.rank0
    assert r0["final_step"] == STEPS and m.effective_steps == 2 * STEPS and m.replayed_steps == 0
    assert r0["eval"]["loss"] < r0["eval_start"]["loss"] - 0.01
    assert r0["eval"]["auc"] > 0.6 and r0["steps_per_s"] > 0 and r0["examples_per_s"] > 0
    assert r0["compile"]["recompiles"] == 0
    m.check_partition()


def test_steps_stalls_and_saves_tile_the_training_time(clean_run):
    # issue 12 part 5: each step's interval starts where the previous step, stall or save ended
    # (`trainer.step_clock`), so nothing between a rank's first and last step is unattributed
    _, events, _ = clean_run
    saves = ("checkpoint_save_blocking", "memory_save_blocking")
    for rank in (0, 1):
        spans = sorted((e.start, e.end, e.phase) for e in events if e.rank == rank
                       and e.phase in ("train_step", "data_stall", *saves))
        assert len(by(events, "train_step", rank)) == STEPS and len(spans) > STEPS  # saves every 5 steps
        for (_, end, _), (start, _, _) in zip(spans, spans[1:]):
            assert start == end  # a step, stall or save starts exactly where the previous interval ended


def test_fast_batch_compile_does_not_wait_for_real_data(clean_run):
    # (the overlap itself, with a DPP slower than this tiny one: test_init_pipeline.py)
    _, events, _ = clean_run
    for rank in (0, 1):
        (compile_ev,) = by(events, "pt2_compile", rank)
        (warmup,) = by(events, "get_first_batch_data", rank)
        assert compile_ev.attrs["batch"] == "synthetic fast batch"
        assert warmup.start < compile_ev.start  # the DPP warm-up started in the background first


def test_sigkill_recovers_exactly_and_restarts_warm(world, clean_run, tmp_path):
    # every rank restarts (live recovery off: the path a lost node or a hang takes, and the ablation's)
    cfg = config(world, "killed", failures=(FailAt(kind="kill", rank=1, step=12),)).with_switches(
        live_recovery=False, memory_checkpoint=False)
    result, events, m = drive(world, cfg, "killed")
    assert result.attempts == 2 and m.nof == 1 and m.failures[0].failure_class == "infrastructure"
    m.check_partition()
    # the restart resumed exactly at the restored checkpoint's cursor ...
    (restore,) = by(events, "checkpoint_restore", rank=0, attempt=1)
    first_step = min(by(events, "train_step", rank=0, attempt=1), key=lambda e: e.start)
    assert list(first_step.cursor_start) == restore.attrs["cursor"]
    assert restore.attrs["step"] in (5, 10)
    # ... replayed what the kill lost, and trained every batch as new data exactly once
    assert m.replayed_steps == 2 * (12 - restore.attrs["step"]) and m.effective_steps == 2 * STEPS
    # the restart found the compile cache: no compilation, no recompile
    compile_report = result.rank0["compile"]
    assert compile_report["cache_hit"] and compile_report["fxgraph_miss"] == 0 and compile_report["recompiles"] == 0
    # and it ends with the parameters of the run that was never killed
    killed = model_tensors(result.rank0["anchor"], tmp_path / "killed.pt")
    clean = model_tensors(clean_run[0].rank0["anchor"], tmp_path / "clean.pt")
    assert killed.keys() == clean.keys() and len(killed) > 4
    for key in clean:
        assert torch.equal(killed[key], clean[key]), key


def test_nan_loss_stops_the_attempt_as_numerics_and_is_never_trained_on(world, tmp_path):
    cfg = config(world, "nan", failures=(FailAt(kind="nan", rank=0, step=7),), eval_batches=0)
    result, events, m = drive(world, cfg, "nan")
    # the attempt ended at the NaN step with a numerics failure marker from rank 0 ...
    (marker,) = by(events, "failure", rank=0, attempt=0)
    assert marker.rank == 0 and marker.attrs["failure_class"] == "numerics" and marker.attrs["step"] == 7
    assert marker.attrs["injected"] and marker.attrs["reason"] == "non-finite loss at step 7 on rank 0"
    assert result.attempts == 2 and m.nof == 1 and m.failures[0].failure_class == "numerics"
    # ... the NaN step was never recorded as a step, on any rank, and nothing was saved after it
    assert max(e.attrs["step"] for e in by(events, "train_step", attempt=0)) == 6
    assert all(e.attrs["loss"] == e.attrs["loss"] for e in by(events, "train_step"))  # no NaN loss anywhere
    assert sorted({e.attrs["step"] for e in by(events, "checkpoint_save_blocking", attempt=0)}) == [5]
    assert by(events, "anchor_checkpoint", attempt=0) == []
    # the restart restored the last finite checkpoint, replayed 5 and 6, and trained every batch once
    (restore,) = by(events, "checkpoint_restore", rank=0, attempt=1)
    assert restore.attrs["step"] == 5
    assert m.replayed_steps == 2 * (7 - 5) and m.effective_steps == 2 * STEPS
    m.check_partition()
    anchor = model_tensors(result.rank0["anchor"], tmp_path / "nan.pt")
    assert all(torch.isfinite(t).all() for t in anchor.values() if t.is_floating_point())


def test_baseline_switches_compile_after_the_first_real_batch(world):
    switches = Switches(parallel_init=False, fast_batch=False, compile_cache=True, async_checkpoint=False)
    cfg = config(world, "baseline", switches=switches, max_steps=6, eval_batches=0)
    result, events, m = drive(world, cfg, "baseline")
    for rank in (0, 1):
        (compile_ev,) = by(events, "pt2_compile", rank)
        (warmup,) = by(events, "get_first_batch_data", rank)
        assert compile_ev.start >= warmup.end and compile_ev.attrs["batch"] == "first real batch"
        stages = sorted((e for e in events if e.rank == rank and e.phase in
                         ("process_group_init", "preproc_creation", "train_module_creation")), key=lambda e: e.start)
        assert all(a.end <= b.start for a, b in zip(stages, stages[1:]))  # sequential init
    assert result.rank0["checkpoint"]["saves"] == 1 and by(events, "checkpoint_save_background") == []
    anchor = result.rank0["anchor"]  # synchronous saves commit the anchor too
    assert anchor and read_anchor(anchor)["run_id"] == "baseline" and read_anchor(anchor)["step"] == 6


def test_bad_data_file_is_rejected_with_its_name_and_column(world):
    data = world / "bad-data"
    shutil.copytree(world / "data", data)
    window = sorted(p for p in data.iterdir() if p.is_dir())[0]
    part = sorted(window.glob("*.parquet"))[0]
    table = pq.read_table(part)
    broken = table.set_column(table.schema.get_field_index("int_3"), "int_3",
                              pa.array(["x"] * table.num_rows, type=pa.string()))
    pq.write_table(broken, part)
    cfg = config(world, "bad", data_root=str(data))
    with pytest.raises(TrainingFailed, match=rf"{part}.*int_3"):
        drive(world, cfg, "bad")


# ---- live recovery (trainer/live_recovery.py): survivors keep running, a warm spare joins ----

def beat_pid(world, run_id: str, attempt: int, rank: int) -> int:
    from ettflow.trainer.rank_heartbeat import beat_file, read_beat

    beat = read_beat(beat_file(world / "spool", run_id, attempt, rank))
    assert beat is not None, f"no heartbeat of rank {rank} in attempt {attempt}"
    return beat.pid


def assert_same_parameters(result, clean_run, tmp_path, name: str) -> None:
    got = model_tensors(result.rank0["anchor"], tmp_path / f"{name}.pt")
    clean = model_tensors(clean_run[0].rank0["anchor"], tmp_path / "clean.pt")
    assert got.keys() == clean.keys() and len(got) > 4
    for key in clean:
        assert torch.equal(got[key], clean[key]), key


def test_sigkill_is_recovered_live_by_a_spare_from_memory(world, clean_run, tmp_path):
    cfg = config(world, "live", failures=(FailAt(kind="kill", rank=1, step=12),))
    result, events, m = drive(world, cfg, "live")
    assert result.attempts == 2 and m.nof == 1 and m.failures[0].failure_class == "infrastructure"
    m.check_partition()
    # rank 0 kept its process and its compiled step: same pid, nothing compiled in attempt 1
    assert beat_pid(world, "live", 1, 0) == beat_pid(world, "live", 0, 0)
    assert beat_pid(world, "live", 1, 1) != beat_pid(world, "live", 0, 1)
    assert by(events, "pt2_compile", attempt=1) == [] and result.rank0["compile"]["recompiles"] == 0
    assert result.rank0["compile"]["frames_compiled"] == 1  # the one compile of attempt 0
    # the spare took rank 1; every rank rebuilt its group and module and restored from memory
    (handoff,) = by(events, "spare_handoff", attempt=1)
    assert handoff.attrs["rank"] == 1 and by(events, "spare_start")
    assert [e.attrs.get("spare") for e in by(events, "preproc_creation", rank=1, attempt=1)] == [True]
    for rank in (0, 1):
        for phase in ("process_group_rebuild", "module_reshard"):
            assert len(by(events, phase, rank=rank, attempt=1)) == 1, (phase, rank)
        (restore,) = by(events, "checkpoint_restore", rank=rank, attempt=1)
        assert restore.attrs["source"] == "memory" and restore.attrs["step"] <= 12
    assert by(events, "device_init", attempt=1) == []  # no process started on the critical path
    # replayed only what the kill lost since the in-memory copy, trained every batch once
    step = by(events, "checkpoint_restore", rank=0, attempt=1)[0].attrs["step"]
    assert m.replayed_steps == 2 * (12 - step) and m.effective_steps == 2 * STEPS
    assert_same_parameters(result, clean_run, tmp_path, "live")


def test_a_second_kill_before_the_new_spare_is_ready_still_recovers(world, clean_run, tmp_path):
    cfg = config(world, "live-twice", failures=(FailAt(kind="kill", rank=1, step=8),
                                                FailAt(kind="kill", rank=1, step=9, attempt=1)))
    result, events, m = drive(world, cfg, "live-twice")
    assert result.attempts == 3 and m.nof == 2
    m.check_partition()
    assert beat_pid(world, "live-twice", 2, 0) == beat_pid(world, "live-twice", 0, 0)  # rank 0 ran throughout
    handoffs = sorted(by(events, "spare_handoff"), key=lambda e: e.attempt)
    assert [h.attempt for h in handoffs] == [1, 2]
    # the second hand-off waited for the spare that started after the first one
    starts = sorted(by(events, "spare_start"), key=lambda e: e.start)
    assert len(starts) >= 2 and starts[1].start >= handoffs[0].start and starts[1].end <= handoffs[1].end + 1e-6
    assert m.effective_steps == 2 * STEPS
    assert_same_parameters(result, clean_run, tmp_path, "live-twice")


def test_a_corrupt_in_memory_copy_falls_back_to_the_durable_checkpoint(world, clean_run, tmp_path):
    # rank 1's in-memory copies are damaged from step 6 on; it is killed at step 11, while the
    # durable save of step 10 may still be in flight (nothing torn may ever be restored)
    cfg = config(world, "live-corrupt", failures=(FailAt(kind="corrupt", rank=1, step=6),
                                                  FailAt(kind="kill", rank=1, step=11)))
    result, events, m = drive(world, cfg, "live-corrupt")
    assert result.attempts == 2 and m.nof == 1
    for rank in (0, 1):
        (restore,) = by(events, "checkpoint_restore", rank=rank, attempt=1)
        assert restore.attrs["source"] == "own" and restore.attrs["step"] in (5, 10)  # the durable one
        # a committed folder (the restore verified every file's checksum before reading it), never the
        # step-10 save the kill interrupted
        assert Path(restore.attrs["path"]).name == f"step_{restore.attrs['step']:010d}"
        assert restore.attrs["memory_problem"]
    assert_same_parameters(result, clean_run, tmp_path, "live-corrupt")


# ---- the warm pool (trainer/warm_pool.py): a run's ranks start from processes prewarmed after the last ----

def test_a_run_starts_its_ranks_and_spare_from_the_pool_the_previous_run_left(world, clean_run, tmp_path):
    import ray

    from ettflow.trainer.warm_pool import POOL

    POOL.keep_warm(True)
    try:
        drive(world, config(world, "pool-first", max_steps=2, eval_batches=0), "pool-first")
        assert POOL.wait_ready(180) == 4  # its teardown started 2 ranks, a spare and its successor for the next run
        pooled = {ray.get(w.actor.ready.remote())["pid"] for w in POOL.workers}
        POOL.keep_warm(False)  # the next run takes them and leaves nothing
        result, events, m = drive(world, config(world, "pool-next", eval_at_start=True), "pool-next")
        # the ranks took two, the run's spare the third; no failure needed the spare's successor
        assert len(POOL.workers) == 1
    finally:
        POOL.close()
    assert result.attempts == 1 and m.nof == 0
    m.check_partition()
    # both ranks ran in pooled processes; what each prepared is recorded off the clock
    ranks = {beat_pid(world, "pool-next", 0, rank) for rank in (0, 1)}
    assert ranks < pooled and len(ranks) == 2
    starts = by(events, "spare_start")
    assert sorted(e.attrs["for_rank"] for e in starts) == [0, 1] and all(e.attrs["pooled"] for e in starts)
    # no process start and no compile on the run's clock: both were done before the run
    assert all(e.attrs.get("part") != "process_start" for e in by(events, "device_init"))
    for rank in (0, 1):
        (compile_ev,) = by(events, "pt2_compile", rank)
        assert compile_ev.attrs["batch"] == "prewarmed before the run (warm pool)"
    assert result.rank0["compile"]["cache_hit"] and result.rank0["compile"]["recompiles"] == 0
    # and the run is the run a fresh start makes
    assert_same_parameters(result, clean_run, tmp_path, "pool-next")
