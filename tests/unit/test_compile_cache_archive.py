"""The PT2 compile cache's parts that need no fresh process: what the key holds, config
errors, archives (pack, unpack, the size bound, pruning), the recompile counter and the sweep
of dead processes' working folders. (Compiling, restoring and trusting archives, each in a
fresh interpreter: tests/integration/test_compile_cache.py.)"""

import os
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest

from ettflow.trainer.compile import CompileCacheConfig, RecompileCounter, cache_key, key_parts
from ettflow.trainer.compile.archive import (
    UNPACK_ERRORS,
    ArchiveTooLarge,
    ArchiveUnverified,
    find_archive,
    pack,
    prune,
    unpack,
    verify,
)
from ettflow.trainer.compile.probe_cold_warm import DenseSize

SIZE = DenseSize(batch=32, sparse=4, dim=8, dense_arch=(16, 8), over_arch=(16, 1))


def test_key_changes_with_what_the_graphs_depend_on(tmp_path):
    base = CompileCacheConfig(root=tmp_path, model=asdict(SIZE))
    key = cache_key(key_parts(base))
    assert key == cache_key(key_parts(CompileCacheConfig(root=tmp_path / "x", model=asdict(SIZE))))
    other_model = {**asdict(SIZE), "batch": 64}
    assert key != cache_key(key_parts(CompileCacheConfig(root=tmp_path, model=other_model)))
    threads = CompileCacheConfig(root=tmp_path, model=asdict(SIZE), threads=2)
    assert key != cache_key(key_parts(threads))
    parts = key_parts(base)
    assert parts["device"] == "cpu" and parts["torch"] and parts["python"]
    # inductor's precompiled-header switch is in its own graph key: archives made with the header
    # (before env.skip_precompiled_headers) have another key, and are not restored to miss
    assert parts["cpp_precompiled_headers"] == "off"
    # dynamo's stored frames drop identity guards and bundle the AOT entries: another key without
    assert parts["dynamo_precompile"] is True
    assert key != cache_key(key_parts(CompileCacheConfig(root=tmp_path, model=asdict(SIZE), precompile=False)))
    assert key_parts(CompileCacheConfig(root=tmp_path, model=asdict(SIZE), enabled=False))["dynamo_precompile"] is False


@pytest.mark.parametrize("bad, match", [
    (dict(max_bytes=0), "max_bytes"),
    (dict(threads=0), "threads"),
    (dict(device="tpu"), "device"),
    (dict(codec="zip"), "codec"),
    (dict(model={"f": object()}), "JSON"),
    (dict(mega_cache=False), "precompile=True stores dynamo's traced frames"),
])
def test_config_errors_say_what_to_fix(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        CompileCacheConfig(root=tmp_path, **bad)


def test_pack_unpack_round_trip_bound_and_prune(tmp_path):
    src = tmp_path / "src"
    (src / "fxgraph" / "ab").mkdir(parents=True)
    (src / "fxgraph" / "ab" / "entry").write_bytes(b"x" * 1000)
    (src / "locks").mkdir()
    (src / "locks" / "k.lock").write_bytes(b"")
    root = tmp_path / "root"
    packed = pack(src, "inductor", root / "pt2-k1.tar.gz", codec="gz", compresslevel=1,
                  max_bytes=10_000, mega_cache=b"mega")
    assert packed.files == 1 and find_archive(root, "k1") == packed.path
    files, mega = unpack(packed.path, tmp_path / "out")
    assert files == 1 and mega == b"mega"
    assert verify(packed.path)["sha256"] == packed.sha256 and len(packed.sha256) == 64
    assert (tmp_path / "out" / "inductor" / "fxgraph" / "ab" / "entry").read_bytes() == b"x" * 1000
    with pytest.raises(ArchiveTooLarge):
        pack(src, "inductor", root / "pt2-k2.tar", codec="none", compresslevel=0, max_bytes=500)
    assert sorted(p.name for p in root.iterdir()) == ["pt2-k1.manifest.json", "pt2-k1.tar.gz"]
    (root / "pt2-bad.tar.gz").write_bytes(b"not an archive")
    with pytest.raises(UNPACK_ERRORS):
        unpack(root / "pt2-bad.tar.gz", tmp_path / "out2")
    for k in ("k3", "k4", "k5"):
        shutil.copy(packed.path, root / f"pt2-{k}.tar.gz")
    killed_save = root / ".pt2-k6.tar.gz.x1.tmp"
    killed_save.write_bytes(b"partial")
    os.utime(killed_save, (1, 1))
    removed = prune(root, keep=2, protect=root / "pt2-k5.tar.gz")
    assert len(removed) == 4 and killed_save in removed and (root / "pt2-k5.tar.gz").exists()
    assert len(list(root.glob("pt2-*"))) == 2  # the pruned k1's manifest went with it


def test_recompile_counter_counts_only_recompiles():
    import torch

    counter = RecompileCounter().install()
    try:
        fn = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
        fn(torch.ones(2))
        fn(torch.ones(2))
        fn(torch.ones(3))
        assert counter.compiles == 2 and counter.recompiles == 1
    finally:
        counter.uninstall()
        torch.compiler.reset()


def _a_pid_no_process_has() -> int:
    """A pid no process or thread holds now (from the top of the pid range: the least likely to
    be reused soon). A thread's id answers `kill(id, 0)` like a pid, though psutil lists only
    processes: /proc/<id> exists for both."""
    import psutil

    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text()) if Path("/proc/sys/kernel/pid_max").exists() \
        else 2**22
    return next(pid for pid in range(pid_max - 1, 1, -1)
                if not psutil.pid_exists(pid) and not Path(f"/proc/{pid}").exists())


def test_working_folders_of_dead_processes_are_swept(tmp_path):
    from ettflow.trainer.compile.env import make_work_dir

    dead = tmp_path / f"ettflow-pt2-{_a_pid_no_process_has()}-abc"
    live = tmp_path / f"ettflow-pt2-{os.getppid()}-abc"
    other = tmp_path / "ettflow-pt2-notapid"
    for folder in (dead, live, other):
        (folder / "inductor").mkdir(parents=True)
    mine = make_work_dir(str(tmp_path))
    assert mine.name.startswith(f"ettflow-pt2-{os.getpid()}-") and mine.is_dir()
    assert not dead.exists() and live.exists() and other.exists()


def test_a_pooled_worker_replaces_a_damaged_archive_once(tmp_path):
    """Issue 42 #4: a prewarm that refused the archive as damaged compiled cold; it replaces
    the archive unless another worker of the pool already did (the archive verifies again), and
    says which (`Repair`: the run's warning and row read it)."""
    from types import SimpleNamespace

    from ettflow.trainer.compile.cache import SaveResult
    from ettflow.trainer.protocol import Repair
    from ettflow.trainer.rank.spare import _repair, repair_after

    root = tmp_path / "cache"
    src = tmp_path / "inductor"
    (src / "fxgraph").mkdir(parents=True)
    (src / "fxgraph" / "graph.py").write_text("kernels")
    dest = root / "pt2-dlrm-key.tar"
    pack(src, "inductor", dest, codec="none", compresslevel=0, max_bytes=1 << 20)
    saves, skip = [], []

    def save(*, force=False):
        saves.append(force)
        if skip:
            return SaveResult(skipped_reason=skip[0])
        pack(src, "inductor", dest, codec="none", compresslevel=0, max_bytes=1 << 20)
        return SaveResult(bytes=dest.stat().st_size, path=dest)

    cache = SimpleNamespace(config=SimpleNamespace(root=root), key="dlrm-key", save=save)
    # the archive verifies: another worker replaced it since this one's restore
    assert _repair(cache) is Repair.REPLACED_BY_ANOTHER and saves == []
    dest.write_bytes(dest.read_bytes()[:-100])  # truncated after its manifest was written
    with pytest.raises(ArchiveUnverified):
        verify(dest)
    assert _repair(cache) is Repair.REPLACED
    assert saves == [True] and verify(dest)  # replaced, whatever the restore said was up to date
    assert _repair(cache) is Repair.REPLACED_BY_ANOTHER and saves == [True]  # once
    dest.write_bytes(dest.read_bytes()[:-100])
    # a worker that restored what another process saved since its refusal replaces nothing
    assert repair_after(cache, restored_since=True) is Repair.RESTORED_REPLACEMENT and saves == [True]
    skip.append("the archive would exceed max_bytes")
    assert repair_after(cache, restored_since=False) is Repair.NOT_REPLACED and saves == [True, True]


def test_compile_settings_apply_in_the_thread_that_compiles(tmp_path, monkeypatch):
    """torch 2.13 keeps a config setting per context: a rank set them at its start, in the
    actor's thread, and compiled in an init thread with torch's defaults (the archive carried the
    ~150 MB precompiled header, the PGO job id was unset). `apply_settings`, which every compile
    calls first (`compile_dense_step`), sets them where it runs, and only there."""
    import threading

    import torch

    from ettflow.trainer import _torch_compat as compat
    from ettflow.trainer.compile import CompileCache

    for var in ("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "TORCH_COMPILE_JOB_ID"):
        monkeypatch.setenv(var, "")  # so that the undo removes what apply_settings sets for children
        monkeypatch.delenv(var)
    cache = CompileCache(CompileCacheConfig(root=tmp_path, model=asdict(SIZE)))
    before = compat.precompile_headers_setting(), torch.compiler.config.job_id, compat.caching_precompile_setting()
    seen = {}

    def compiling_thread():
        cache.apply_settings()
        seen.update(header=compat.precompile_headers_setting(), job=torch.compiler.config.job_id,
                    precompile=compat.caching_precompile_setting())

    t = threading.Thread(target=compiling_thread)
    t.start()
    t.join()
    assert seen == {"header": False, "job": f"ettflow-{cache.key}", "precompile": True}
    assert (compat.precompile_headers_setting(), torch.compiler.config.job_id,
            compat.caching_precompile_setting()) == before  # not this thread's


def test_the_thread_that_trains_applies_the_settings_its_step_was_compiled_with(tmp_path, monkeypatch):
    """A rank compiles its step in an init thread and trains in another, where dynamo recompiles
    by itself on a guard failure: `apply_compile_settings` (called by the compile and by the
    training loop) gives that thread the job id, the header switch and the ISA switch; with the
    compile cache off it leaves torch's defaults, as an untuned job has them."""
    import threading
    from dataclasses import replace

    import torch

    from ettflow.trainer import _torch_compat as compat
    from ettflow.trainer.compile import CompileCache, process_cache, vec_isa
    from ettflow.trainer.config import TrainerConfig
    from ettflow.trainer.data.schema import criteo_schema

    for var in ("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "TORCH_COMPILE_JOB_ID", "TORCHINDUCTOR_VEC_ISA_OK"):
        monkeypatch.setenv(var, "")  # so that the undo removes what apply_settings sets for children
        monkeypatch.delenv(var)
    config = TrainerConfig(data_root=str(tmp_path), schema=criteo_schema(10), work_dir=str(tmp_path / "w"))
    cache = CompileCache(process_cache.cache_config(config))  # the process's handle, not prepared:
    monkeypatch.setattr(process_cache, "_CACHE", cache)  # this test's process keeps its own folders
    monkeypatch.setattr(vec_isa, "_SETTLED", vec_isa.Outcome(vec_isa.IsaCheck.RECORDED))  # decided earlier

    def seen_in_a_new_thread(cfg: TrainerConfig) -> tuple:
        seen = []

        def training_thread():
            process_cache.apply_compile_settings(cfg)
            seen.append((compat.precompile_headers_setting(), torch.compiler.config.job_id,
                         compat.vec_isa_ok_setting(), compat.caching_precompile_setting()))

        t = threading.Thread(target=training_thread)
        t.start()
        t.join()
        return seen[0]

    defaults = (compat.precompile_headers_setting(), torch.compiler.config.job_id, compat.vec_isa_ok_setting(),
                compat.caching_precompile_setting())
    assert seen_in_a_new_thread(config) == (False, f"ettflow-{cache.key}", True, True)
    off = replace(config, switches=replace(config.switches, compile_cache=False))
    assert seen_in_a_new_thread(off) == defaults
    assert (compat.precompile_headers_setting(), torch.compiler.config.job_id,
            compat.vec_isa_ok_setting(), compat.caching_precompile_setting()) == defaults  # nothing leaked


def test_one_process_compiles_for_one_key(tmp_path, monkeypatch):
    """Dynamo's stored frames drop the identity guards that tell two models of the same shapes
    apart (which activation), so the process's compile cache refuses a compile for another key
    rather than share a frame across models; a run without the cache is not keyed."""
    from dataclasses import replace

    from ettflow.trainer.compile import CompileCache, CompileEnvError, process_cache
    from ettflow.trainer.config import TrainerConfig
    from ettflow.trainer.data.schema import criteo_schema

    config = TrainerConfig(data_root=str(tmp_path), schema=criteo_schema(10), work_dir=str(tmp_path / "w"))
    cache = CompileCache(process_cache.cache_config(config))
    monkeypatch.setattr(process_cache, "_CACHE", cache)  # prepared earlier in the process
    assert process_cache.prepare_compile_env(replace(config, work_dir=str(tmp_path / "other"))) is cache
    other = replace(config, model=replace(config.model, over_arch=(48, 1)))  # same shapes in and out
    with pytest.raises(CompileEnvError, match="cannot share its process"):
        process_cache.prepare_compile_env(other)
    off = replace(other, switches=replace(other.switches, compile_cache=False))
    assert process_cache.prepare_compile_env(off) is cache


def test_a_stored_frame_loaded_is_a_warm_compile():
    from ettflow.trainer.compile.stats import CompileStats

    assert CompileStats(fxgraph_hit=2, aot_hit=1).warm  # no stored frame (precompile off)
    assert CompileStats(frames_loaded=1).warm  # the frame loaded: no FX-graph or AOT hit, no compile
    assert not CompileStats(frames_loaded=1, frame_load_errors=1).warm
    assert not CompileStats(fxgraph_hit=2, aot_hit=1, frame_misses=1).warm  # traced again
    assert not CompileStats(frames_loaded=1, built_objects=1).warm
    assert not CompileStats(frames_loaded=1, frames_compiled=1).warm  # loaded, its sources rejected, traced


def test_the_probe_table_shows_a_frame_loaded_then_traced_as_both():
    from ettflow.trainer.compile.probe_cold_warm import table
    from ettflow.trainer.compile.stats import CompileStats

    rows = [{"mode": mode, "restore_s": 0.5, "first_step_s": 1.0, "stats": stats.to_dict()} for mode, stats in (
        ("cold", CompileStats(frame_misses=1, frames_compiled=1)), ("warm", CompileStats(frames_loaded=1)),
        ("upgraded", CompileStats(frames_loaded=1, frames_compiled=1)))]
    head, *lines = table(rows).splitlines()
    assert "frames loaded/traced" in head
    assert [line.split()[6] for line in lines] == ["0/1", "1/0", "1/1"]  # after fx and aot hit/miss


def test_a_prewarmed_worker_that_stored_its_cold_compile_does_not_save_it_again(tmp_path, monkeypatch):
    """A pool's worker that compiled cold before the run and stored it (its turn's save, a repair,
    or another's archive found after it) is taken as rank 0: the run does not save again (a
    second save rewrote the archive while the other ranks restored it); one that did not store
    it (its save skipped, an orphaned turn) saves at the run."""
    from ettflow.ett.spool import SpoolWriter, read_spool
    from ettflow.trainer.compile import CompileCache, process_cache
    from ettflow.trainer.compile.cache import SaveResult
    from ettflow.trainer.config import TrainerConfig
    from ettflow.trainer.data.schema import criteo_schema
    from ettflow.trainer.protocol import PrewarmTimings
    from ettflow.trainer.rank.compile_plugin import CompilePlugin

    config = TrainerConfig(data_root=str(tmp_path), schema=criteo_schema(10), work_dir=str(tmp_path / "w"))
    cache = CompileCache(process_cache.cache_config(config))
    saves = []
    monkeypatch.setattr(cache, "save", lambda **kw: saves.append(kw) or SaveResult(bytes=1))
    monkeypatch.setattr(process_cache, "_CACHE", cache)
    compiled = object()
    for stored in (True, False):
        warm = PrewarmTimings(build_s=0, compile_s=1, cache_hit=False, footers_s=0, cache_stored=stored)
        run_id = f"stored-{stored}"
        with SpoolWriter(tmp_path / "spool", run_id, 0, 0) as rec:
            assert CompilePlugin(config, 0, rec, warm=warm).compile(None, None, None, compiled=compiled) is compiled
        phases = [e.phase for e in read_spool(tmp_path / "spool", run_id).events]
        assert ("compile_cache_save" in phases) is (not stored)
        assert warm.spool_attrs().get("cache_stored", False) is stored
    assert len(saves) == 1


def test_a_compile_that_fails_on_a_stored_frame_is_tried_once_more_without_it(tmp_path, monkeypatch):
    """`compile_dense_step`: a failed compile where the archive gave dynamo stored frames drops
    them and tries once more; with none, or failing again, the error is the compile's own."""
    import threading
    from dataclasses import replace

    from ettflow.trainer.compile import CompileCache, compiled, process_cache, vec_isa
    from ettflow.trainer.config import TrainerConfig
    from ettflow.trainer.data.schema import criteo_schema

    for var in ("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "TORCH_COMPILE_JOB_ID", "TORCHINDUCTOR_VEC_ISA_OK"):
        monkeypatch.setenv(var, "")  # so that the undo removes what apply_settings sets for children
        monkeypatch.delenv(var)
    config = TrainerConfig(data_root=str(tmp_path), schema=criteo_schema(10), work_dir=str(tmp_path / "w"))
    cache = CompileCache(replace(process_cache.cache_config(config), work_dir=tmp_path / "work"))
    monkeypatch.setattr(process_cache, "_CACHE", cache)
    monkeypatch.setattr(vec_isa, "_SETTLED", vec_isa.Outcome(vec_isa.IsaCheck.RECORDED))
    frame = tmp_path / "work" / "inductor" / "dynamo" / "abc" / "entry"
    tries: list[int] = []

    def one_step(fails: int):
        def step(*args):
            tries.append(1)
            if len(tries) <= fails:
                raise AssertionError("CompilePackage is already initialized")  # what torch 2.13 lets escape
            return "compiled"
        return step

    def in_a_thread(fn):  # the compile settings are per thread: none leak into this one
        out = {}

        def run():
            try:
                out["value"] = fn()
            except Exception as e:  # noqa: BLE001 - handed to the test
                out["error"] = e
        t = threading.Thread(target=run)
        t.start()
        t.join()
        return out

    frame.parent.mkdir(parents=True)
    frame.write_bytes(b"frame")
    monkeypatch.setattr(compiled, "_compiled_by_one_step", one_step(fails=1))
    assert in_a_thread(lambda: compiled.compile_dense_step(None, None, config, None)) == {"value": "compiled"}
    assert len(tries) == 2 and not frame.parent.parent.exists()  # dropped, then traced

    tries.clear()  # no stored frame left: the compile's own error, not tried again
    out = in_a_thread(lambda: compiled.compile_dense_step(None, None, config, None))
    assert isinstance(out["error"], AssertionError) and len(tries) == 1

    tries.clear()
    frame.parent.mkdir(parents=True)
    frame.write_bytes(b"frame")
    monkeypatch.setattr(compiled, "_compiled_by_one_step", one_step(fails=2))  # fails without it too
    out = in_a_thread(lambda: compiled.compile_dense_step(None, None, config, None))
    assert isinstance(out["error"], AssertionError) and len(tries) == 2
