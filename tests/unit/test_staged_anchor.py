"""A parent anchor staged in memory ahead of its warm start (checkpoint/staged_anchor.py): the
restore reads the staged bytes (never the disk), every file was checked against the manifest,
and each way it cannot be used says why. One process, DCP without a process group."""

from __future__ import annotations

import json

import pytest
import torch

from ettflow.trainer.checkpoint import CheckpointError, TornCheckpointError
from ettflow.trainer.checkpoint.layout import COMMITTED, DCP_METADATA, MANIFEST, atomic_write_text, final_dir
from ettflow.trainer.checkpoint.staged_anchor import AnchorStaging, stage_anchor
from ettflow.trainer.checkpoint.verify import _canonical_sha
from ettflow.trainer.protocol import StageRequest, StagingState, StagingStatus
from ettflow.trainer.rank.restore_report import RestoreReport
from tests.unit.test_checkpoint_protocol import make_state, manager, snapshot, train

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
BIG = 1 << 30


@pytest.fixture
def anchor(tmp_path):
    """A committed checkpoint of a trained state, and that state's weights."""
    state = make_state()
    train(state, range(3))
    with manager(tmp_path / "ckpt") as mgr:
        mgr.save(3, state)
    return final_dir(tmp_path / "ckpt", 3), snapshot(state)


def test_a_staged_anchor_restores_the_same_weights_from_memory_with_its_disk_files_gone(anchor, tmp_path):
    path, saved = anchor
    staged = stage_anchor(path, max_bytes=BIG, wait_s=0)
    listed = json.loads((path / MANIFEST).read_text())["files"]
    assert sorted(staged.files) == sorted(listed) and staged.nbytes == sum(f["size"] for f in listed.values())
    for rel in listed:  # the restore cannot have read the disk: its data is gone (the seal stays)
        (path / rel).unlink()
    fresh = make_state(seed=1)
    with manager(tmp_path / "other") as mgr:
        restored = mgr.load_parent(fresh, path, staged=staged)
    assert restored.checkpoint.step == 3 and restored.checkpoint.path == path
    assert_weights(saved, fresh)
    with manager(tmp_path / "other") as mgr, pytest.raises(CheckpointError):  # from the disk it would fail
        mgr.load_parent(make_state(seed=1), path)


def assert_weights(saved: dict, state) -> None:
    got = snapshot(state)
    for k, v in saved["model"].items():
        assert torch.equal(v, got["model"][k]), k
    for i, st in saved["optim"].items():
        for k, v in st.items():
            assert torch.equal(v, got["optim"][i][k]), (i, k)


@pytest.mark.parametrize("damaged", [DCP_METADATA, "__0_0.distcp"])
def test_a_file_that_does_not_match_its_manifest_is_never_staged_and_the_error_names_it(anchor, damaged):
    path, _ = anchor
    data = bytearray((path / damaged).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum sees it
    (path / damaged).write_bytes(bytes(data))
    with pytest.raises(TornCheckpointError, match=f"{damaged} sha256 mismatch"):
        stage_anchor(path, max_bytes=BIG, wait_s=0)


def test_an_anchor_over_the_bound_is_not_staged_and_says_its_size(anchor):
    path, _ = anchor
    with pytest.raises(CheckpointError, match=r"holds \d+ bytes, over the staging bound of 100"):
        stage_anchor(path, max_bytes=100, wait_s=0)
    with open(path / "__0_0.distcp", "ab") as f:  # a file grown on disk is refused by its size, before any read
        f.write(b"x" * 4096)
    with pytest.raises(TornCheckpointError, match=r"__0_0.distcp has \d+ bytes, the manifest recorded"):
        stage_anchor(path, max_bytes=BIG, wait_s=0)


def test_a_discarded_staging_stops_and_keeps_nothing(anchor):
    import threading

    path, _ = anchor
    gone = threading.Event()
    gone.set()
    with pytest.raises(CheckpointError, match="was given up"):
        stage_anchor(path, max_bytes=BIG, wait_s=0, cancelled=gone)
    staging = AnchorStaging.start(StageRequest(path=str(path), max_bytes=BIG))
    staging.discard()
    staging._thread.join()
    assert staging._staged is None


def test_only_a_warm_start_keeps_a_staged_parent(tmp_path):
    """Checkpointing drops the staging of a run that restores its own checkpoint or starts cold
    (its memory and its reading), keeps it for a warm start, and drops it at its close."""
    from ettflow.ett.spool import SpoolWriter
    from ettflow.trainer.config import TrainerConfig
    from ettflow.trainer.data.schema import criteo_schema
    from ettflow.trainer.rank.checkpointing import Checkpointing

    class Staging:
        discarded = 0

        def discard(self):
            self.discarded += 1

    cfg = TrainerConfig(data_root=str(tmp_path), schema=criteo_schema(10), work_dir=str(tmp_path / "w"))
    rec = SpoolWriter(tmp_path / "spool", "r", 0, 0)
    cold, warm = Staging(), Staging()
    assert Checkpointing(cfg, 0, rec, None, None, staging=cold).staging is None and cold.discarded == 1
    kept = Checkpointing(cfg, 0, rec, None, tmp_path / "step_0000000003", staging=warm)
    assert kept.staging is warm and warm.discarded == 0
    kept.close()
    assert kept.staging is None and warm.discarded == 1


def test_staging_waits_for_the_seal_and_gives_up_at_its_bound(anchor):
    path, _ = anchor
    sealed = (path / COMMITTED).read_text()
    (path / COMMITTED).unlink()  # the driver has not sealed it yet (release before seal)
    now = [0.0]

    def sleep(s):
        now[0] += s
        if now[0] >= 1.0:  # the seal lands a second later
            (path / COMMITTED).write_text(sealed)

    staged = stage_anchor(path, max_bytes=BIG, wait_s=5, clock=lambda: now[0], sleep=sleep)
    assert staged.digest == sealed.strip() and 1.0 <= now[0] < 1.2
    (path / COMMITTED).unlink()
    now[0] = 0.0

    def wait(s):
        now[0] += s

    with pytest.raises(CheckpointError, match="was not sealed within 0.5 s"):
        stage_anchor(path, max_bytes=BIG, wait_s=0.5, clock=lambda: now[0], sleep=wait)


def test_a_staging_says_how_far_it_got_reading_staged_refused_dropped_or_handed_over(anchor):
    path, _ = anchor
    sealed = (path / COMMITTED).read_text()
    (path / COMMITTED).unlink()  # not sealed yet: the staging waits for the seal
    waiting = AnchorStaging.start(StageRequest(path=str(path), max_bytes=BIG, wait_s=30))
    assert waiting.status() == StagingStatus(path=str(path), state=StagingState.WAITING)
    assert waiting.status().describe() == f"stages {path}: waiting for its seal"
    # as the driver seals it: whole or not at all (a plain write_text let the staging thread, which
    # polls for the marker, read it empty: CI saw "COMMITTED does not name this manifest.json")
    atomic_write_text(path / COMMITTED, sealed)
    waiting._thread.join(30)
    staged = waiting.status()
    assert staged.state is StagingState.STAGED and staged.nbytes > 0 and staged.read_s >= 0
    assert staged.describe() == (f"stages {path} ({staged.nbytes / 2**20:.1f} MiB in memory, read and checked in "
                                 f"{staged.read_s:.2f} s)")
    waiting.take(path)
    assert waiting.status().state is StagingState.TAKEN

    refused = AnchorStaging.start(StageRequest(path=str(path), max_bytes=10))
    refused._thread.join(30)
    assert refused.status().state is StagingState.FAILED
    assert refused.status().describe().startswith(f"staging {path} failed: ") and "staging bound of 10" in \
        refused.status().describe()
    dropped = AnchorStaging.start(StageRequest(path=str(path), max_bytes=BIG))
    dropped.discard()
    assert dropped.status() == StagingStatus(path=str(path), state=StagingState.DISCARDED)


def test_take_gives_the_staged_parent_once_and_says_why_when_it_cannot(anchor, tmp_path):
    path, _ = anchor
    staging = AnchorStaging.start(StageRequest(path=str(path), max_bytes=BIG))
    got, miss = staging.take(path)
    assert got is not None and got.path == path and miss is None
    assert staging.take(path) == (None, "the staged copy was already handed to a restore")  # once: the memory went
    linked = tmp_path / "current"  # the run names its parent by another spelling: its restore names it so
    linked.symlink_to(path)
    got, miss = AnchorStaging.start(StageRequest(path=str(path), max_bytes=BIG)).take(linked)
    assert miss is None and got.path == linked and got.info.path == linked

    other = AnchorStaging.start(StageRequest(path=str(path), max_bytes=BIG))
    assert other.take(tmp_path / "step_0000000009") == (
        None, f"staged {path}, the run warm starts from {tmp_path / 'step_0000000009'}")

    refused = AnchorStaging.start(StageRequest(path=str(path), max_bytes=10))
    assert refused.take(path)[1].endswith("over the staging bound of 10")

    resealed = AnchorStaging.start(StageRequest(path=str(path), max_bytes=BIG))
    resealed._thread.join()
    manifest = json.loads((path / MANIFEST).read_text())
    manifest.pop("manifest_sha256")
    manifest["created_at"] += 1  # the same step sealed again (a retry wrote it anew)
    digest = _canonical_sha(manifest)
    (path / MANIFEST).write_text(json.dumps({**manifest, "manifest_sha256": digest}))
    (path / COMMITTED).write_text(digest)
    assert resealed.take(path) == (None, f"{path} was sealed again since it was staged")


def test_the_restore_event_says_whether_the_parent_was_read_from_memory_and_why_not():
    base = dict(source="parent", path="/c/step_0000000003", parent_step=3)
    assert RestoreReport(**base, staged=True).to_attrs()["staged"] is True
    missed = RestoreReport(**base, staged=False, staged_miss="staged /c/a, the run warm starts from /c/b").to_attrs()
    assert missed["staged"] is False and missed["staged_miss"].startswith("staged /c/a")
    assert "staged" not in RestoreReport(**base).to_attrs()  # nothing was staged: no attribute


def test_the_pools_workers_for_a_models_next_run_stage_the_releasing_runs_anchor(tmp_path, monkeypatch):
    """The workers a release prewarms for the next run's ranks (now, or just in time for a
    scheduled run) are asked to stage the releasing run's anchor, bounded by the policy; workers
    kept from an earlier release stage the newer one instead; the run's spares stage nothing, and
    a take gives the staged ones to ranks, an unstaged one to a spare; a policy of 0 bytes stages
    nothing (a fake start: no Ray)."""
    import time
    from types import SimpleNamespace

    from ettflow.trainer.config import TrainerConfig
    from ettflow.trainer.data.schema import criteo_schema
    from ettflow.trainer.group import pool_service
    from ettflow.trainer.group.hold_rule import MAX_EXPLORATIONS
    from ettflow.trainer.group.pool_service import PoolPolicy, PoolService
    from ettflow.trainer.group.pooled_worker import PooledWorker, model_name, warm_key
    from ettflow.trainer.protocol import PrewarmTimings, StartSample

    asked: list[tuple[str, object]] = []
    monkeypatch.setattr(pool_service, "stop", lambda worker: None)  # fake actors (ray.kill would start a Ray)

    started = iter(range(100))

    def start(config, run_id, spool_root, *, actor_cls):
        n = next(started)
        actor = SimpleNamespace(prewarm=SimpleNamespace(remote=lambda *a: asked.append((f"prewarm {n}", a))),
                                stage=SimpleNamespace(remote=lambda r: asked.append((f"stage {n}", r))),
                                unstage=SimpleNamespace(remote=lambda: asked.append((f"unstage {n}", None))))
        worker = PooledWorker(actor, None, time.time(), warm_key(config), model_name(config))
        worker.timings = PrewarmTimings(build_s=0, compile_s=0, cache_hit=True, footers_s=0, ready_at=time.time())
        return worker

    cfg = TrainerConfig(data_root=str(tmp_path), schema=criteo_schema(10), work_dir=str(tmp_path / "w"),
                        compile_cache_root=str(tmp_path / "dlrm" / "compile-cache")).with_switches(
                            memory_checkpoint=False)
    t0 = time.time()
    pays = dict(actor_cls=object, now=t0)

    def answers(actors):  # each worker says how its staging stands (TrainerActor.staging_status)
        asked.append(("status", sorted(actors)))
        return {key: StagingStatus(path="/c/step_0000000010", state=StagingState.STAGED, nbytes=(n + 1) << 20,
                                   read_s=0.25).describe() for n, key in enumerate(sorted(actors))}

    def pool_of(policy: PoolPolicy) -> PoolService:
        pool = PoolService(policy, start=start, ask_staging=answers)
        pool.explored["dlrm"] = MAX_EXPLORATIONS
        pool.starts[("dlrm", False)], pool.starts[("dlrm", True)] = [60.0], [1.0]  # a pooled start pays
        return pool

    pool = pool_of(PoolPolicy(reap_every_s=3600.0, stage_max_bytes=1000))
    assert pool.fill(cfg, 2, str(tmp_path), None, anchor="/c/step_0000000010", **pays) == 2
    want = StageRequest(path="/c/step_0000000010", max_bytes=1000)
    assert asked == [("prewarm 0", (want,)), ("prewarm 1", (want,))]
    assert [e.staging for e in pool.entries] == ["/c/step_0000000010"] * 2
    # the pool's status says what each worker answered it holds, not what it was asked to: each
    # worker's own answer (by its holding id), asked only of the workers that stage
    asked.clear()
    by_id = sorted(e.holding_id for e in pool.entries)
    workers = [w for w in pool.status() if w.kind == "worker"]  # in the pool's order
    assert asked == [("status", by_id)]
    assert [w.staging for w in workers] == [
        f"stages /c/step_0000000010 ({by_id.index(e.holding_id) + 1}.0 MiB in memory, read and checked in 0.25 s)"
        for e in pool.entries]
    asked.clear()  # the next run released without taking them: they stage its anchor, none restarts
    assert pool.fill(cfg, 2, str(tmp_path), None, anchor="/c/step_0000000020",
                     start=StartSample(seconds=1.0, pooled=True), **pays) == 0
    newer = StageRequest(path="/c/step_0000000020", max_bytes=1000)
    assert [r for _, r in asked] == [newer, newer] and [e.staging for e in pool.entries] == [newer.path] * 2

    asked.clear()  # the next run's spare too (2 ranks + 1): it joins a live recovery, so it stages nothing
    assert pool.fill(cfg, 3, str(tmp_path), None, anchor="/c/step_0000000020", **pays) == 1
    assert asked == [("prewarm 2", ())] and [e.staging for e in pool.entries] == [newer.path] * 2 + [None]
    asked.clear()  # the status asks only the workers that stage
    assert [w.staging == "" for w in pool.status() if w.kind == "worker"] == [False, False, True]
    assert asked == [("status", sorted(e.holding_id for e in pool.entries[:2]))]
    # the ranks take the staged workers, a lost rank's spare the other (whatever their order)
    spare = pool.entries[2]
    assert pool.take(cfg, [None], spare=True) == [spare]
    pool.entries.insert(0, spare)
    assert {w.staging for w in pool.take(cfg, [None, None])} == {newer.path}
    assert pool.entries == [spare]

    # the kept spare (worker 2) stages for a rank now, and one of the 2 new workers (3, 4)
    asked.clear()
    pool.fill(cfg, 3, str(tmp_path), None, anchor="/c/step_0000000020", **pays)
    assert [e.staging for e in pool.entries] == [newer.path, newer.path, None]
    assert [a for a, _ in asked] == ["stage 2", "prewarm 3", "prewarm 4"] and asked[2][1] == ()
    # kept workers: one staging an older anchor restages before an unstaged one; those beyond the
    # ranks drop what they stage, and one already staging this anchor keeps its copy
    pool.entries[1].staging = "/c/step_0000000010"
    asked.clear()
    pool.fill(cfg, 3, str(tmp_path), None, anchor="/c/step_0000000020", **pays)
    assert asked == [("stage 3", newer)] and pool.entries[2].staging is None
    pool.entries[2].staging = "/c/step_0000000010"
    asked.clear()
    pool.fill(cfg, 3, str(tmp_path), None, anchor="/c/step_0000000020", **pays)
    assert asked == [("unstage 4", None)] and [e.staging for e in pool.entries] == [newer.path, newer.path, None]

    pool.stop()
    started = iter(range(100))
    asked.clear()  # a run far ahead: its planned prewarm stages the anchor of the release that planned it
    pool = pool_of(PoolPolicy(reap_every_s=3600.0, stage_max_bytes=1000))
    pool.starts[("dlrm", False)] = [600.0]
    assert pool.fill(cfg, 1, str(tmp_path), t0 + 3600, anchor="/c/step_0000000030", **pays) == 0
    assert pool.start_planned(now=pool.planned["dlrm"].at) == 1
    assert asked == [("prewarm 0", (StageRequest(path="/c/step_0000000030", max_bytes=1000),))]

    pool.stop()
    started = iter(range(100))
    asked.clear()
    pool = pool_of(PoolPolicy(reap_every_s=3600.0, stage_max_bytes=0))
    assert pool.fill(cfg, 1, str(tmp_path), None, anchor="/c/step_0000000040", **pays) == 1
    assert asked == [("prewarm 0", ())] and pool.entries[0].staging is None
    pool.stop()
