"""Inductor's CPU ISA check made once per host (`compile/vec_isa.py`): the decision with a
scripted check, a recorded host, a failed candidate, another host, a record that cannot be
trusted or read, and the user's own switch; then this host's real candidates."""

import json
import os

import pytest

from ettflow.trainer.compile import vec_isa
from ettflow.trainer.compile.config import CompileCacheConfig, key_parts
from ettflow.trainer.compile.vec_isa import Host, IsaCheck, settle

CANDIDATES = ("avx512 avx512_vnni amx_tile", "avx512", "avx2")
HOST = Host(candidates=CANDIDATES, digest="a" * 24)


class Inductor:
    """Inductor's side, scripted: what its check finds valid, how often it ran, its switch."""

    def __init__(self, valid=CANDIDATES):
        self.valid, self.checks, self.ok = tuple(valid), 0, False

    def check(self):
        self.checks += 1
        return self.valid

    def set_ok(self):
        self.ok = True

    def settle(self, folder, host=HOST, user_set=False):
        return settle(folder, host, check=self.check, set_ok=self.set_ok, user_set=user_set,
                      clock=iter([10.0, 11.5]).__next__)


def test_the_first_process_checks_and_records_and_the_next_takes_the_record(tmp_path):
    first, second = Inductor(), Inductor()
    out = first.settle(tmp_path / "cpu-isa")
    assert (out.check, out.valid, out.seconds, first.checks, first.ok) == (IsaCheck.CHECKED, CANDIDATES, 1.5, 1, True)
    record = json.loads((tmp_path / "cpu-isa" / f"{HOST.digest}.json").read_text())
    assert record["valid"] == list(CANDIDATES) and record["check_s"] == 1.5
    assert oct((tmp_path / "cpu-isa").stat().st_mode & 0o777) == "0o700"
    out = second.settle(tmp_path / "cpu-isa")
    # the same setting in both processes: part of inductor's cache key, so the archive still hits
    assert (out.check, out.seconds, second.checks, second.ok) == (IsaCheck.RECORDED, 0.0, 0, True)
    assert out.to_attrs() == {"cpu_isa": "recorded", "cpu_isa_s": 0.0}


def test_a_failed_candidate_keeps_inductors_own_check_in_every_process(tmp_path, caplog):
    first = Inductor(valid=CANDIDATES[1:])  # the compiler cannot build AMX code (or its probe timed out)
    out = first.settle(tmp_path)
    assert (out.check, out.valid, first.ok) == (IsaCheck.FAILED_CANDIDATE, CANDIDATES[1:], False)
    assert "avx512 avx512_vnni amx_tile" in caplog.text
    assert list(tmp_path.iterdir()) == []  # not recorded: a failure once is not the host's answer
    second = Inductor()  # the next process checks again, and this time every candidate passes
    out = second.settle(tmp_path)
    assert (out.check, second.checks, second.ok) == (IsaCheck.CHECKED, 1, True)
    assert Inductor().settle(tmp_path).check is IsaCheck.RECORDED


def test_another_host_or_another_compiler_checks_again(tmp_path):
    Inductor().settle(tmp_path)
    other = Inductor()
    out = other.settle(tmp_path, host=Host(candidates=CANDIDATES, digest="b" * 24))
    assert (out.check, other.checks) == (IsaCheck.CHECKED, 1)
    fewer = Inductor(valid=CANDIDATES[1:])  # same digest, other candidates: not this host's record
    assert fewer.settle(tmp_path, host=Host(candidates=CANDIDATES[1:], digest="a" * 24)).check is IsaCheck.CHECKED
    assert fewer.checks == 1
    other = Inductor()  # a record of another host's candidates under this digest is not taken either
    assert other.settle(tmp_path).check is IsaCheck.CHECKED and other.checks == 1


@pytest.mark.parametrize("damage", ["writable by others", "not json", "a list", "null", "candidates not a list",
                                    "valid not a list", "other format"])
def test_a_record_that_cannot_be_trusted_or_read_is_not_taken(tmp_path, damage, caplog):
    Inductor().settle(tmp_path)
    path = tmp_path / f"{HOST.digest}.json"
    record = json.loads(path.read_text())
    if damage == "writable by others":
        os.chmod(path, 0o666)
    elif damage == "not json":
        path.write_text("{")
    elif damage == "a list":
        path.write_text("[1]")
    elif damage == "null":
        path.write_text("null")
    elif damage == "candidates not a list":
        path.write_text(json.dumps({**record, "candidates": 5}))
    elif damage == "valid not a list":
        path.write_text(json.dumps({**record, "valid": "avx2"}))
    else:
        path.write_text(json.dumps({**record, "format": 99}))
    again = Inductor()
    out = again.settle(tmp_path)
    assert (out.check, again.checks, again.ok) == (IsaCheck.CHECKED, 1, True)
    if damage == "writable by others":
        assert "writable by others" in caplog.text
        assert oct(path.stat().st_mode & 0o777) == "0o600"  # replaced by a private one


def test_a_folder_that_cannot_be_written_loses_only_the_record(tmp_path, caplog, monkeypatch):
    (tmp_path / "file").write_text("")
    inductor = Inductor()
    out = inductor.settle(tmp_path / "file" / "cpu-isa")  # under a file: cannot be made
    assert (out.check, inductor.ok) == (IsaCheck.CHECKED, True) and "not written" in caplog.text

    def cannot_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(vec_isa.os, "replace", cannot_replace)  # the write fails after its temporary file
    vec_isa.write_record(tmp_path / "full", HOST, CANDIDATES, 1.0)
    assert list((tmp_path / "full").iterdir()) == []  # nothing left behind


def test_the_users_own_switch_and_a_host_without_the_check_are_left_alone(tmp_path):
    inductor = Inductor()
    assert inductor.settle(tmp_path, user_set=True).check is IsaCheck.USER
    assert inductor.settle(tmp_path, host=None).check is IsaCheck.NOT_X86
    assert (inductor.checks, inductor.ok, list(tmp_path.iterdir())) == (0, False, [])


def test_this_hosts_candidates_are_what_the_cpu_claims_and_the_archive_key_says_so(tmp_path):
    host = vec_isa.this_host()
    if host is None:
        pytest.skip("not an x86-64 host: inductor has no ISA check to make once")
    from ettflow.trainer import _torch_compat as compat

    flags = set(compat.cpu_isa_flags())
    assert host.candidates and all(set(name.split()) <= flags for name in host.candidates)
    assert host == vec_isa.this_host()  # the digest is stable within a host
    assert key_parts(CompileCacheConfig(root=tmp_path))["cpu_isa_check"] == vec_isa.ISA_CHECK
