"""The PT2 compile cache: a cold run finds a corrupt archive of its own key, reports it, compiles
cold and replaces it; a warm restart hits the new one (dynamo's stored frame loaded, nothing
traced, rebuilt or recompiled), another config misses (no archive), a too-large archive is skipped, and nothing is
loaded from a folder or archive others could have written, or that does not match its manifest.

Every process that compiles or calls prepare_env is a fresh interpreter, so no in-memory
inductor state helps the warm run and this process's environment stays untouched. One of them
compiles cold (`cold`, ~20-30 s); the warm one restores, the others compile nothing, but for
the changed-source test, which compiles a small function of its own (~20 s for its two processes).
(What needs no fresh process, archives and keys among it: tests/unit/test_compile_cache_archive.py.)
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from dataclasses import asdict

import pytest

from ettflow.trainer.compile import CompileCacheConfig, cache_key, key_parts
from ettflow.trainer.compile.archive import (
    UNPACK_ERRORS,
    ArchiveUnverified,
    archive_path,
    find_archive,
    manifest_path,
    pack,
    verify,
    write_manifest,
)
from ettflow.trainer.compile.probe_cold_warm import DenseSize, spawn

SIZE = DenseSize(batch=32, sparse=4, dim=8, dense_arch=(16, 8), over_arch=(16, 1))
PLANTED = "planted"  # the file names of the corrupt archive's entries (inductor/fxgraph/<xx>/planted-<i>)


def run_python(code: str) -> dict:
    # without the suite's OMP_NUM_THREADS (scripts/test.sh) or a header setting: a child's thread
    # count and precompiled header are what the code under test sets, not what it inherited
    dropped = ("OMP_NUM_THREADS", "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=240, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child failed (rc {proc.returncode}):\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT "):])


def plant_torn_archive(base, root, key: str):
    """A corrupt archive of `key` in `root`: torn mid-way, as if torn before its checksum was
    taken (its manifest matches, so it passes verify and fails to unpack), after entries that
    unpack whole (so a restore extracts some files before it fails)."""
    src = base / "planted-src"
    for i in range(8):
        (src / "fxgraph" / f"{i:02d}").mkdir(parents=True)
        (src / "fxgraph" / f"{i:02d}" / f"{PLANTED}-{i}").write_bytes(os.urandom(20_000))  # incompressible
    packed = pack(src, "inductor", archive_path(root, key, "gz"), codec="gz", compresslevel=1, max_bytes=10**6)
    data = packed.path.read_bytes()
    packed.path.write_bytes(data[: len(data) // 2])
    write_manifest(packed.path)
    whole = 0  # entries a reader gets whole before the tear
    with pytest.raises(UNPACK_ERRORS), tarfile.open(packed.path, mode="r:*") as tar:
        for member in tar:
            if (handle := tar.extractfile(member)) is not None:
                handle.read()
            whole += 1
    assert whole >= 1, "the torn archive must hold whole entries before its tear"
    verify(packed.path)
    return packed.path


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """Process A (the module's one cold compile): the archive root holds a corrupt archive of A's
    own key; the restore reports it and clears what it had extracted, A compiles the dense
    model cold (2 steps: compile + forward + backward), saves (replacing the corrupt archive),
    then counts a recompile of another function (eager, after the save) and tries a late
    prepare_env."""
    base = tmp_path_factory.mktemp("compile-cache")
    root = base / "archives"
    key = cache_key(key_parts(CompileCacheConfig(root=root, model=asdict(SIZE), threads=1)))
    torn = plant_torn_archive(base, root, key)
    work = base / "work-a"
    result = run_python(f"""
        import json, os
        import torch
        from ettflow.trainer import _torch_compat as compat
        from ettflow.trainer.compile import CompileCache, CompileCacheConfig, CompileEnvError
        from ettflow.trainer.compile.probe_cold_warm import DenseSize, build_dense_forward, train_steps
        size = DenseSize(**{json.dumps(asdict(SIZE))})
        cfg = CompileCacheConfig(root={str(root)!r}, work_dir={str(work)!r}, model={asdict(SIZE)!r}, threads=1)
        cache = CompileCache(cfg)
        cache.prepare_env()
        header = compat.precompile_headers_setting()
        r = cache.restore()
        left = sorted(os.listdir(cache.inductor_dir))
        steps = train_steps(build_dense_forward(size), size, steps=2)
        s = cache.stats()
        saved = cache.save()
        fn = torch.compile(lambda x: torch.relu(x) * 2 + 1, backend="eager", dynamic=False)
        fn(torch.randn(8)); fn(torch.randn(8)); fn(torch.randn(5))  # the new shape recompiles
        after = cache.stats()
        try:
            CompileCache(cfg).prepare_env()
            late = ""
        except CompileEnvError as e:
            late = str(e)
        print("RESULT " + json.dumps(dict(
            key=cache.key, hit=r.hit, miss=r.miss.value if r.miss else None, reason=r.reason, left=left,
            first_step_s=steps[0], stats=s.to_dict(), saved=saved.saved, skipped=saved.skipped_reason,
            archive_bytes=saved.bytes, save_s=saved.seconds, archive=str(saved.path),
            after_save=after.to_dict(), late=late, header=header,
            header_env=os.environ.get("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"))))
    """)
    assert result["key"] == key  # the planted archive was of A's own key
    return root, dict(result, torn=str(torn), work=str(work))


def test_cold_run_reports_a_corrupt_archive_compiles_cold_and_replaces_it(cold):
    root, a = cold
    # the corrupt archive: a miss that says so; the partly extracted files were cleared
    assert a["hit"] is False and a["miss"] == "unreadable" and "unreadable" in a["reason"]
    assert a["torn"] in a["reason"] and a["left"] == []
    s = a["stats"]
    assert s["fxgraph_miss"] > 0 and s["fxgraph_hit"] == 0 and s["aot_miss"] == 1 and s["warm"] is False
    assert s["compiles"] == 1 and s["recompiles"] == 0  # the second step reused the graph
    assert s["built_objects"] > 0
    # the save replaced the corrupt archive (same path) with what A compiled
    assert a["saved"] is True and a["skipped"] is None and a["archive_bytes"] > 0
    path = find_archive(root, a["key"])
    assert str(path) == a["archive"] == a["torn"]
    verify(path)
    with tarfile.open(path) as tar:
        names = tar.getnames()
    assert any(n.startswith("inductor/fxgraph/") for n in names)
    assert any(n.startswith("inductor/dynamo/") and n.endswith("/entry") for n in names)  # the stored frame
    assert s["frame_misses"] == 1 and s["frames_loaded"] == 0  # none stored yet: traced
    assert not any(PLANTED in n for n in names)  # nothing of the corrupt archive came along
    # compiled without inductor's precompiled header (~150 MB the archive would carry: compile/env.py)
    assert a["header"] is False and a["header_env"] == "0"
    assert not any(n.endswith((".gch", ".pch")) or "precompiled_headers/" in n for n in names)
    assert any(n.endswith(".so") for n in names) and "mega_cache.bin" in names
    assert not any(n.endswith(".lock") for n in names)
    # the process's counters go on after the save: a new shape is one recompile
    after = a["after_save"]
    assert after["compiles"] == s["compiles"] + 2 and after["recompiles"] == 1 and after["warm"] is False
    # too late for prepare_env once this process compiled
    assert "before the first torch.compile" in a["late"]


def test_warm_restart_hits_the_cache_without_recompiling(cold, tmp_path):
    root, a = cold
    b = spawn("warm", root, tmp_path / "work-b", SIZE, threads=1)  # a brand-new working folder
    assert b["key"] == a["key"] and b["hit"] is True and b["restore_bytes"] > 0
    s = b["stats"]
    # dynamo's stored frame loaded (caching precompile, compile/cache.py): nothing traced or
    # compiled, so no FX-graph or AOT lookup either
    assert s["frames_loaded"] == 1 and s["frame_misses"] == s["frame_load_errors"] == 0
    assert s["fxgraph_miss"] == s["aot_miss"] == 0
    assert s["recompiles"] == 0 and s["compiles"] == 0 and s["frames_compiled"] == 0
    assert s["built_objects"] == 0  # no kernel library and no precompiled header rebuilt
    assert s["warm"] is True
    print(f"\ncold first step {a['first_step_s']:.2f} s (+ save {a['save_s']:.2f} s); warm "
          f"restore {b['restore_s']:.2f} s + first step {b['first_step_s']:.2f} s")


def restored_in_a_child(root, tmp_path, body: str) -> dict:
    """`body` run in a fresh process after `cache` (the cold key's, on a copy of `root`: the
    module's archive stays as the other tests expect it) restored it as `r`; `size` is SIZE."""
    copy = tmp_path / "archives"
    shutil.copytree(root, copy)
    return run_python(textwrap.dedent(f"""
        import json
        from ettflow.trainer.compile import CompileCache, CompileCacheConfig
        from ettflow.trainer.compile.probe_cold_warm import DenseSize, build_dense_forward, train_steps
        size = DenseSize(**{json.dumps(asdict(SIZE))})
        cache = CompileCache(CompileCacheConfig(root={str(copy)!r}, work_dir={str(tmp_path / "work")!r},
                                                model={asdict(SIZE)!r}, threads=1))
        cache.prepare_env()
        r = cache.restore()
    """) + textwrap.dedent(body))


def test_a_stored_frame_that_fails_to_load_is_traced_again_and_stored_anew(cold, tmp_path):
    """A dynamo frame in a verified archive that torch cannot unpickle (here its bytes are
    replaced after the restore) costs a trace, never the run: torch logs it and traces,
    inductor's entries still hit, the compile is not warm, and the save stores the new frame
    instead of calling the archive up to date. (A frame whose sources changed under the same key,
    an ettflow upgrade: `test_a_stored_frame_whose_source_changed_...`.)"""
    out = restored_in_a_child(cold[0], tmp_path, """
        entries = sorted((cache.inductor_dir / "dynamo").rglob("entry"))
        for e in entries:
            e.write_bytes(b"not a pickled frame")
        train_steps(build_dense_forward(size), size, steps=1)
        stats, saved = cache.stats(), cache.save()
        print("RESULT " + json.dumps(dict(hit=r.hit, entries=len(entries), stats=stats.to_dict(), saved=saved.saved,
                                          stored=[e.read_bytes() != b"not a pickled frame" for e in entries])))
    """)
    assert out["hit"] is True and out["entries"] == 1
    s = out["stats"]
    assert s["frame_load_errors"] == 1 and s["frames_loaded"] == 0 and s["frames_compiled"] == 1
    assert s["fxgraph_hit"] > 0 and s["fxgraph_miss"] == 0 and s["built_objects"] == 0 and s["warm"] is False
    assert out["saved"] is True and out["stored"] == [True]


def test_a_stored_frame_torch_cannot_install_fails_the_compile_until_it_is_dropped(cold, tmp_path):
    """Where torch fails to install a stored frame (its `install` raising RuntimeError, scripted),
    its own fallback lets an error escape `torch.compile`, so every restart from the same archive
    would fail: `drop_stored_frames` (which `compile_dense_step` calls on a failed compile)
    removes the frames and dynamo's code caches, the second try traces, and the save stores anew."""
    out = restored_in_a_child(cold[0], tmp_path, """
        import torch._dynamo.package as package
        install = package.CompilePackage.install
        def broken(self, backends):
            raise RuntimeError("Failed to reload cache entry from disk (scripted)")
        package.CompilePackage.install = broken
        try:
            train_steps(build_dense_forward(size), size, steps=1)
            error = None
        except Exception as e:
            error = e
        package.CompilePackage.install = install
        dropped = cache.drop_stored_frames(error)
        again = cache.drop_stored_frames(error)  # none left
        train_steps(build_dense_forward(size), size, steps=1)
        stats, saved = cache.stats(), cache.save()
        print("RESULT " + json.dumps(dict(hit=r.hit, error=type(error).__name__ if error else None, dropped=dropped,
                                          again=again, stats=stats.to_dict(), saved=saved.saved,
                                          frames=len(list((cache.inductor_dir / "dynamo").rglob("entry"))))))
    """)
    assert out["hit"] is True and out["error"] is not None  # torch's fallback did not hold
    assert out["dropped"] is True and out["again"] is False
    s = out["stats"]
    assert s["frames_compiled"] == 1 and s["fxgraph_miss"] == 0 and s["built_objects"] == 0 and s["warm"] is False
    assert out["saved"] is True and out["frames"] == 1  # a new frame stored


STEP_SOURCE = """
import torch


def bump(x):
    return torch.relu(x) + {add}


def step(x):
    return bump(x) * 2
"""


def test_a_stored_frame_whose_source_changed_is_traced_again_and_never_runs_the_old_code(tmp_path):
    """An upgrade that changes a compiled function's source (here an inlined helper's, its lines
    where they were) under the same key: torch checks the stored frame's sources, refuses it and
    traces the new code, which is what runs; the compile is not warm and the save stores the new
    frame. A real file changed between two processes (the neighbour of a frame that cannot load)."""
    src, root = tmp_path / "src", tmp_path / "archives"
    src.mkdir()

    def compile_in_a_child(add: int, work: str) -> dict:
        (src / "upgraded_step.py").write_text(STEP_SOURCE.format(add=add))
        return run_python(f"""
            import json, logging, sys
            import torch
            sys.dont_write_bytecode = True  # no .pyc of the old file: Python checks one by mtime and size only
            sys.path.insert(0, {str(src)!r})
            from ettflow.trainer.compile import CompileCache, CompileCacheConfig
            refused = []  # torch's own word for a stored frame it would not use
            class Refusals(logging.Handler):
                def emit(self, record):
                    refused.append(str(record.exc_info[1]) if record.exc_info else record.getMessage())
            logging.getLogger("torch._dynamo.eval_frame").addHandler(Refusals())
            cache = CompileCache(CompileCacheConfig(root={str(root)!r}, work_dir={str(tmp_path / work)!r},
                                                    model={{"test": "source-change"}}, threads=1))
            cache.prepare_env()
            r = cache.restore()
            def frames():
                return [e.read_bytes() for e in sorted((cache.inductor_dir / "dynamo").rglob("entry"))]
            restored = frames()
            import upgraded_step
            out = torch.compile(upgraded_step.step, dynamic=False)(torch.tensor([-1.0, 0.5]))
            stats, saved = cache.stats(), cache.save()
            print("RESULT " + json.dumps(dict(hit=r.hit, out=out.tolist(), stats=stats.to_dict(), saved=saved.saved,
                                              refused=refused, restored=len(restored), stored=len(frames()),
                                              replaced=bool(restored) and frames() != restored)))
        """)

    first = compile_in_a_child(1, "work-a")
    assert first["hit"] is False and first["out"] == [2.0, 3.0] and first["saved"] is True
    assert first["refused"] == [] and first["stored"] == 1
    assert first["stats"]["frames_compiled"] == 1
    upgraded = compile_in_a_child(3, "work-b")  # same key, the helper's body changed on disk
    assert upgraded["hit"] is True
    assert upgraded["out"] == [6.0, 7.0]  # the new code ran, not the stored frame's
    s = upgraded["stats"]
    # torch counts the frame loaded before it checks its sources, then traces: `warm` reads both
    assert s["frames_loaded"] == 1 and s["frames_compiled"] == 1 and s["warm"] is False
    assert s["fxgraph_miss"] == 1  # the new code is a new graph
    assert [m for m in upgraded["refused"] if "Source code changes detected for upgraded_step" in m], upgraded
    # the archive is not "up to date": the new frame replaced the old one (same function, same place)
    assert upgraded["saved"] is True and upgraded["restored"] == upgraded["stored"] == 1 and upgraded["replaced"]


def test_without_the_archive_an_untuned_restart_keeps_pytorchs_local_cache(cold, tmp_path):
    """The honest baseline (`Switches.local_inductor_cache`): with the compile cache off and
    `isolate=False`, nothing is redirected, so a restart on the same host finds what the last
    process left in PyTorch's local cache folder (here process A's, as TORCHINDUCTOR_CACHE_DIR)."""
    root, a = cold
    local = os.path.join(a["work"], "inductor")
    out = run_python(f"""
        import json, os
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = {local!r}
        from ettflow.trainer.compile import CompileCache, CompileCacheConfig
        from ettflow.trainer.compile.probe_cold_warm import DenseSize, build_dense_forward, train_steps
        size = DenseSize(**{json.dumps(asdict(SIZE))})
        cache = CompileCache(CompileCacheConfig(root={str(tmp_path / "none")!r}, enabled=False, isolate=False,
                                                model={asdict(SIZE)!r}, threads=1))
        env = cache.prepare_env()
        from ettflow.trainer import _torch_compat as compat
        header = compat.precompile_headers_setting()
        # A compiled with the archive, so without the precompiled header (part of inductor's key);
        # an untuned job's own earlier process had the same setting as this one: match A's
        compat.set_precompile_headers(False)
        r, steps = cache.restore(), train_steps(build_dense_forward(size), size, steps=1)
        print("RESULT " + json.dumps(dict(env=env, work_dir=str(cache.work_dir), miss=r.miss.value,
                                          saved=cache.save().skipped_reason, stats=cache.stats().to_dict(),
                                          header=header)))
    """)
    assert out["env"] == {"TORCHINDUCTOR_CACHE_DIR": local} and out["work_dir"] == "None"  # not redirected
    assert out["header"] is True  # prepare_env left torch's default, as an untuned job runs it
    assert out["miss"] == "disabled" and out["saved"] == "compile cache disabled"
    assert out["stats"]["fxgraph_hit"] > 0 and out["stats"]["fxgraph_miss"] == 0  # warm without any archive
    with pytest.raises(ValueError, match="isolate=False"):
        CompileCacheConfig(root=root, enabled=True, isolate=False)


def test_an_untuned_run_never_uses_a_local_cache_folder_another_user_could_write(tmp_path):
    """The baseline's local cache (`isolate=False`) is PyTorch's folder in the shared temp folder,
    whose entries inductor unpickles: one that others (or its group: a umask of 002) can write, or
    that another user made first, is not used. The run keeps its local cache in this user's
    private `<data_home>/compile-local` instead (across restarts, as PyTorch's own would be) and
    says why; only when that one cannot be trusted either does it compile in a private folder of
    its own, cold. A folder not there yet is made by torch as this user's, and used. Nothing is
    compiled."""
    home = tmp_path / "home"
    folders = {"open to all": tmp_path / "shared", "group-writable": tmp_path / "group",
               "another user's": tmp_path / "other", "not there yet": tmp_path / "fresh" / "inductor"}
    for name, mode in (("open to all", 0o777), ("group-writable", 0o775), ("another user's", 0o755)):
        folders[name].mkdir()
        folders[name].chmod(mode)
    try:
        os.chown(folders["another user's"], os.getuid() + 4242, -1)
    except PermissionError:  # not root: that case cannot be made here
        del folders["another user's"]
    cases = {**{k: str(v) for k, v in folders.items()}, "own one open too": str(folders["open to all"])}
    out = run_python(f"""
        import json, logging, os, stat
        from ettflow.trainer.compile import CompileCache, CompileCacheConfig

        class Said(logging.Handler):
            def emit(self, record):
                seen[name]["said"].append(record.getMessage())

        logging.getLogger("ettflow.trainer.compile.cache").addHandler(Said())
        os.environ["ETTFLOW_HOME"] = {str(home)!r}
        os.umask(0o022)  # the folder torch makes is then this user's alone (002 would make it the group's)
        seen = {{}}
        for name, folder in {json.dumps(cases)}.items():
            if name == "own one open too":
                os.chmod(os.path.join({str(home)!r}, "compile-local"), 0o777)
            seen[name] = {{"said": []}}
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder  # as each case's process would start
            cache = CompileCache(CompileCacheConfig(root={str(tmp_path / "none")!r}, enabled=False, isolate=False,
                                                    threads=1))
            seen[name].update(env=cache.prepare_env()["TORCHINDUCTOR_CACHE_DIR"],
                              work_dir=str(cache.work_dir) if cache.work_dir else None,
                              mode=stat.S_IMODE(os.stat(folder).st_mode))
            cache.cleanup()
        print("RESULT " + json.dumps(seen))
    """)
    own = str(home / "compile-local" / "inductor")
    for case, why in (("open to all", "(mode 0o777)"), ("group-writable", "(mode 0o775)"),
                      ("another user's", "not by this user")):
        if case in folders:
            refused = out[case]
            assert (refused["env"], refused["work_dir"]) == (own, None), case  # kept across restarts
            assert [m for m in refused["said"] if why in m and "private local cache" in m], case
    cold = out["own one open too"]
    assert cold["work_dir"] and cold["env"].startswith(cold["work_dir"])
    assert [m for m in cold["said"] if "compile-local" in m and "compiling in a private folder of this process" in m]
    made = out["not there yet"]
    assert (made["env"], made["work_dir"], made["said"]) == (str(folders["not there yet"]), None, [])
    assert not made["mode"] & 0o022  # torch made it: this user's, nobody else can write


def test_other_config_misses_and_oversized_archive_is_skipped(cold, tmp_path):
    root, a = cold
    out = run_python(f"""
        import json, os
        import torch
        from ettflow.trainer._torch_compat import precompiled_header_dir
        from ettflow.trainer.compile import CompileCache, CompileCacheConfig
        cache = CompileCache(CompileCacheConfig(root={str(root)!r}, work_dir={str(tmp_path)!r},
                             model={{"other": 1}}, threads=1, max_bytes=50_000))
        env = cache.prepare_env()
        miss = cache.restore()
        nothing = cache.save()
        (cache.inductor_dir / "fxgraph" / "ab").mkdir(parents=True)
        (cache.inductor_dir / "fxgraph" / "ab" / "entry").write_bytes(os.urandom(200_000))
        big = cache.save()
        print("RESULT " + json.dumps(dict(
            key=cache.key, hit=miss.hit, miss=miss.miss.value, reason=miss.reason, nothing=nothing.skipped_reason,
            big=big.skipped_reason, saved=big.saved, root=sorted(os.listdir({str(root)!r})),
            inductor=os.environ["TORCHINDUCTOR_CACHE_DIR"], triton=os.environ["TRITON_CACHE_DIR"],
            header=precompiled_header_dir(), job=os.environ["TORCH_COMPILE_JOB_ID"],
            job_cfg=torch.compiler.config.job_id, threads=torch.get_num_threads(), env=env)))
    """)
    assert out["key"] != a["key"] and out["hit"] is False
    assert out["miss"] == "no_archive" and "no archive" in out["reason"]
    assert "nothing compiled" in out["nothing"]
    assert out["saved"] is False and "max_bytes" in out["big"]
    # no new archive, no temporary left
    assert out["root"] == [f"pt2-{a['key']}.manifest.json", f"pt2-{a['key']}.tar.gz"]
    work = str(tmp_path / "inductor")
    assert out["inductor"] == work and out["triton"].startswith(work)
    assert out["header"].startswith(work)  # the precompiled header lands in the archive
    assert out["job"] == out["job_cfg"] == f"ettflow-{out['key']}" and out["threads"] == 1


# -- trust: what may be loaded ----------------------------------------------------------------

TRUST_MODEL = {"trust-test": 1}
FOREIGN_UID = 4242
ENTRY = "inductor/fxgraph/ab/entry"


def _trust_cases(base):
    """Archive roots for the trust cases, each with an archive of TRUST_MODEL's key, made unsafe
    one way each (names -> root). The foreign-owned ones need root to chown."""
    key = cache_key(key_parts(CompileCacheConfig(root=base, model=TRUST_MODEL, threads=1)))
    src = base / "src"
    (src / "fxgraph" / "ab").mkdir(parents=True)
    (src / "fxgraph" / "ab" / "entry").write_bytes(b"compiled" * 100)
    names = ["good", "open_root", "open_archive", "tampered", "no_manifest"]
    if os.getuid() == 0:
        names += ["foreign_root", "foreign_archive"]
    roots = {}
    for name in names:
        root = base / name / "archives"
        packed = pack(src, "inductor", archive_path(root, key, "gz"), codec="gz", compresslevel=1,
                      max_bytes=10**6)
        if name == "open_root":
            os.chmod(root, 0o777)
        elif name == "open_archive":
            os.chmod(packed.path, 0o666)
        elif name == "tampered":  # same size, 64 bytes overwritten (the manifest is left as it was)
            data = bytearray(packed.path.read_bytes())
            mid = len(data) // 2
            data[mid:mid + 64] = b"\xff" * 64
            packed.path.write_bytes(bytes(data))
        elif name == "no_manifest":
            manifest_path(packed.path).unlink()
        elif name == "foreign_root":
            os.chown(root, FOREIGN_UID, FOREIGN_UID)
        elif name == "foreign_archive":
            os.chown(packed.path, FOREIGN_UID, FOREIGN_UID)
        roots[name] = root
    return roots


@pytest.fixture(scope="module")
def trust(tmp_path_factory):
    """One fresh interpreter restores every case (restore only: nothing compiles)."""
    base = tmp_path_factory.mktemp("trust")
    roots = _trust_cases(base)
    out = run_python(f"""
        import json, logging, os
        from pathlib import Path
        from ettflow.trainer.compile import CompileCache, CompileCacheConfig
        warnings = []
        class Keep(logging.Handler):
            def emit(self, record):
                warnings.append(record.getMessage())
        logging.getLogger("ettflow.trainer.compile.cache").addHandler(Keep())
        result = {{}}
        for name, root in {json.dumps({k: str(v) for k, v in roots.items()})}.items():
            work = Path(root).parent / "work" / "w"
            cache = CompileCache(CompileCacheConfig(root=root, work_dir=work, model={TRUST_MODEL!r},
                                                    threads=1))
            cache.prepare_env()
            r = cache.restore()
            loaded = sorted(os.path.relpath(os.path.join(d, f), work) for d, _, fs in os.walk(work)
                            for f in fs)
            result[name] = dict(hit=r.hit, miss=r.miss.value if r.miss else None, reason=r.reason,
                                files=r.files, loaded=loaded, logged=[w for w in warnings if root in w],
                                work_mode=os.stat(work).st_mode & 0o777,
                                inductor_mode=os.stat(cache.inductor_dir).st_mode & 0o777)
        print("RESULT " + json.dumps(result))
    """)
    return roots, out


def test_a_trusted_verified_archive_is_still_a_hit_and_folders_are_private(trust):
    roots, out = trust
    good = out["good"]
    assert good["hit"] is True and good["miss"] is None and good["files"] == 1
    assert good["loaded"] == [ENTRY] and good["logged"] == []
    assert os.stat(roots["good"]).st_mode & 0o777 == 0o700  # the archive root pack created
    assert good["work_mode"] == 0o700 and good["inductor_mode"] == 0o700


@pytest.mark.parametrize("case, text", [
    ("open_root", "is writable by others (mode 0o777): not loaded; fix with chmod go-w"),
    ("open_archive", "is writable by others (mode 0o666): not loaded; fix with chmod go-w"),
])
def test_a_folder_or_archive_others_can_write_is_refused(trust, case, text):
    roots, out = trust
    r = out[case]
    assert r["hit"] is False and r["miss"] == "untrusted" and text in r["reason"]
    assert r["loaded"] == [] and r["logged"] and text in r["logged"][0]  # nothing unpacked, a warning


@pytest.mark.parametrize("case", ["foreign_root", "foreign_archive"])
def test_a_folder_or_archive_owned_by_another_user_is_refused(trust, case):
    if os.getuid() != 0:
        pytest.skip("needs root to chown a file to another uid")
    roots, out = trust
    r = out[case]
    assert r["hit"] is False and r["miss"] == "untrusted"
    assert f"is owned by uid {FOREIGN_UID}, not by this user (uid 0): not loaded" in r["reason"]
    assert r["loaded"] == [] and r["logged"]


def test_a_tampered_archive_or_one_without_manifest_is_refused_before_unpacking(trust):
    roots, out = trust
    tampered, bare = out["tampered"], out["no_manifest"]
    assert tampered["hit"] is False and tampered["miss"] == "unverified"
    assert "does not match its manifest's checksum" in tampered["reason"] and tampered["loaded"] == []
    assert bare["miss"] == "unverified" and "has no manifest" in bare["reason"] and bare["loaded"] == []
    assert tampered["logged"] and bare["logged"]
    archive = next(roots["tampered"].glob("pt2-*.tar.gz"))
    with pytest.raises(ArchiveUnverified, match="checksum"):
        verify(archive)
