"""The PT2 compile cache: a warm restart hits it (cache hits, nothing rebuilt, no recompile),
another config misses, a too-large archive is skipped, a corrupt one is ignored, and nothing is
loaded from a folder or archive others could have written, or that does not match its manifest.

Every process that compiles or calls prepare_env is a fresh interpreter, so no in-memory
inductor state helps the warm run and this process's environment stays untouched.
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

from ettflow.trainer.compile import CompileCacheConfig, RecompileCounter, cache_key, key_parts
from ettflow.trainer.compile.archive import (
    UNPACK_ERRORS,
    ArchiveTooLarge,
    ArchiveUnverified,
    archive_path,
    find_archive,
    manifest_path,
    pack,
    prune,
    unpack,
    verify,
    write_manifest,
)
from ettflow.trainer.compile.probe_cold_warm import DenseSize, spawn

SIZE = DenseSize(batch=32, sparse=4, dim=8, dense_arch=(16, 8), over_arch=(16, 1))


def run_python(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child failed (rc {proc.returncode}):\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """Process A: empty archive root, restore misses, compile + forward + backward, save."""
    base = tmp_path_factory.mktemp("compile-cache")
    root = base / "archives"
    result = spawn("cold", root, base / "work-a", SIZE, threads=1)
    return root, result


def test_cold_run_misses_compiles_and_saves_the_header_too(cold):
    root, a = cold
    assert a["hit"] is False and "no archive" in a["reason"]
    s = a["stats"]
    assert s["fxgraph_miss"] > 0 and s["fxgraph_hit"] == 0 and s["aot_miss"] == 1
    assert s["compiles"] == 1 and s["recompiles"] == 0  # the second step reused the graph
    assert s["built_objects"] > 0
    assert a["skipped"] is None and a["archive_bytes"] > 0
    path = find_archive(root, a["key"])
    with tarfile.open(path) as tar:
        names = tar.getnames()
    # the precompiled header was redirected into the working folder, so it is archived
    assert any(n.startswith("inductor/precompiled_headers/") and n.endswith(".gch")
               for n in names)
    assert any(n.endswith(".so") for n in names) and "mega_cache.bin" in names
    assert not any(n.endswith(".lock") for n in names)


def test_warm_restart_hits_the_cache_without_recompiling(cold, tmp_path):
    root, a = cold
    b = spawn("warm", root, tmp_path / "work-b", SIZE, threads=1)  # a brand-new working folder
    assert b["key"] == a["key"] and b["hit"] is True and b["restore_bytes"] > 0
    s = b["stats"]
    assert s["fxgraph_hit"] > 0 and s["fxgraph_miss"] == 0
    assert s["aot_hit"] > 0 and s["aot_miss"] == 0
    assert s["recompiles"] == 0 and s["compiles"] == 1
    assert s["built_objects"] == 0  # no kernel library and no precompiled header rebuilt
    assert s["warm"] is True
    print(f"\ncold first step {a['first_step_s']:.2f} s (+ save {a['save_s']:.2f} s); warm "
          f"restore {b['restore_s']:.2f} s + first step {b['first_step_s']:.2f} s")


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
            key=cache.key, hit=miss.hit, reason=miss.reason, nothing=nothing.skipped_reason,
            big=big.skipped_reason, saved=big.saved, root=sorted(os.listdir({str(root)!r})),
            inductor=os.environ["TORCHINDUCTOR_CACHE_DIR"], triton=os.environ["TRITON_CACHE_DIR"],
            header=precompiled_header_dir(), job=os.environ["TORCH_COMPILE_JOB_ID"],
            job_cfg=torch.compiler.config.job_id, threads=torch.get_num_threads(), env=env)))
    """)
    assert out["key"] != a["key"] and out["hit"] is False and "no archive" in out["reason"]
    assert "nothing compiled" in out["nothing"]
    assert out["saved"] is False and "max_bytes" in out["big"]
    # no new archive, no temporary left
    assert out["root"] == [f"pt2-{a['key']}.manifest.json", f"pt2-{a['key']}.tar.gz"]
    work = str(tmp_path / "inductor")
    assert out["inductor"] == work and out["triton"].startswith(work)
    assert out["header"].startswith(work)  # the precompiled header lands in the archive
    assert out["job"] == out["job_cfg"] == f"ettflow-{out['key']}" and out["threads"] == 1


def test_corrupt_archive_is_reported_and_training_compiles_cold(cold, tmp_path):
    root, a = cold
    bad_root = tmp_path / "archives"
    bad_root.mkdir()
    good = find_archive(root, a["key"])
    bad = bad_root / good.name
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])  # torn mid-way
    write_manifest(bad)  # as if torn before its checksum was taken: passes verify, fails to unpack
    out = run_python(f"""
        import json, os
        import torch
        torch._inductor.config.cpp_cache_precompile_headers = False  # keep the cold compile short
        from ettflow.trainer.compile import (CompileCache, CompileCacheConfig, CompileEnvError,
                                             compile_module)
        cfg = CompileCacheConfig(root={str(bad_root)!r}, work_dir={str(tmp_path / "w")!r},
                                 model={asdict(SIZE)!r}, threads=1)
        cache = CompileCache(cfg)
        cache.prepare_env()
        r = cache.restore()
        left = sorted(os.listdir(cache.inductor_dir))
        fn = compile_module(lambda x: torch.relu(x) * 2 + 1)
        fn(torch.randn(8)); fn(torch.randn(8)); fn(torch.randn(5))  # the new shape recompiles
        s = cache.stats()
        saved = cache.save()
        try:
            CompileCache(cfg).prepare_env()
            late = ""
        except CompileEnvError as e:
            late = str(e)
        print("RESULT " + json.dumps(dict(key=cache.key, hit=r.hit, reason=r.reason, left=left,
              stats=s.to_dict(), saved=saved.saved, late=late)))
    """)
    assert out["key"] == a["key"] and out["hit"] is False and "unreadable" in out["reason"]
    assert out["left"] == []  # the partly extracted files were cleared
    s = out["stats"]
    assert s["fxgraph_miss"] > 0 and s["fxgraph_hit"] == 0
    assert s["compiles"] == 2 and s["recompiles"] == 1 and s["warm"] is False
    assert out["saved"] is True  # the next save replaces the corrupt archive
    with tarfile.open(bad) as tar:
        assert any(n.startswith("inductor/fxgraph/") for n in tar.getnames())
    assert "before the first torch.compile" in out["late"]


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


@pytest.mark.parametrize("bad, match", [
    (dict(max_bytes=0), "max_bytes"),
    (dict(threads=0), "threads"),
    (dict(device="tpu"), "device"),
    (dict(codec="zip"), "codec"),
    (dict(model={"f": object()}), "JSON"),
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


def test_working_folders_of_dead_processes_are_swept(tmp_path):
    from ettflow.trainer.compile.env import make_work_dir

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)
    dead = tmp_path / f"ettflow-pt2-{done.stdout.strip()}-abc"
    live = tmp_path / f"ettflow-pt2-{os.getppid()}-abc"
    other = tmp_path / "ettflow-pt2-notapid"
    for folder in (dead, live, other):
        (folder / "inductor").mkdir(parents=True)
    mine = make_work_dir(str(tmp_path))
    assert mine.name.startswith(f"ettflow-pt2-{os.getpid()}-") and mine.is_dir()
    assert not dead.exists() and live.exists() and other.exists()


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
