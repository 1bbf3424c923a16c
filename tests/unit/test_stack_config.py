"""The local stack's settings and records: checked when made, kept on disk as written, and the
parameters `ettflow up --refreshes` gives its deployment runs."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import stat
import subprocess
import time

import pytest

from ettflow.stack.cli import refresh_parameters
from ettflow.stack.config import StackConfig, StackError
from ettflow.stack.records import Service, StackRecord, start_ticks


def test_config_refuses_what_cannot_work(tmp_path):
    with pytest.raises(StackError, match="worker ports"):
        StackConfig(home=tmp_path, ray_client_port=12000)
    with pytest.raises(StackError, match="ports must differ"):
        StackConfig(home=tmp_path, api_port=6390)
    with pytest.raises(StackError, match="at least 30"):
        StackConfig(home=tmp_path, heartbeat_s=10)
    with pytest.raises(StackError, match="TCP port"):
        StackConfig(home=tmp_path, api_port=70000)
    with pytest.raises(StackError, match="no deployments file"):
        StackConfig(home=tmp_path, prefect_file=tmp_path / "missing.yaml")
    cfg = StackConfig(home=tmp_path, api_port=4300)
    assert (cfg.api_url, cfg.ui_url, cfg.head_address) == ("http://127.0.0.1:4300/api", "http://127.0.0.1:4300",
                                                           "127.0.0.1:6390")
    assert StackConfig(home=tmp_path, ray_address="10.0.0.1:6379").head_address == "10.0.0.1:6379"
    assert len(str(cfg.ray_temp_dir("f" * 32))) < 40  # Ray puts unix sockets under it (107 bytes at most)


def test_record_round_trip_and_replace(tmp_path):
    rec = StackRecord(stack_id="abc", api_url="http://x/api", ui_url="http://x", ray_address="h:1", pool="p")
    rec = rec.with_service(Service(name="worker", address="p", pid=123, create_time=1.5, log="/l"))
    rec = rec.with_service(Service(name="worker", address="p", pid=456, create_time=2.5))
    rec.write(tmp_path / "stack.json")
    back = StackRecord.read(tmp_path / "stack.json")
    assert back == rec and [s.pid for s in back.services] == [456]
    assert StackRecord.read(tmp_path / "none.json") is None
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not a stack record"):
        StackRecord.read(tmp_path / "bad.json")


def test_a_recorded_pid_is_the_same_process_only_while_its_start_time_matches():
    import psutil

    me = psutil.Process()
    assert Service(name="x", address="", pid=os.getpid(), create_time=me.create_time()).process() is not None
    assert Service(name="x", address="", pid=os.getpid(), create_time=me.create_time() - 100).process() is None
    assert Service(name="x", address="", pid=None).process() is None  # found, not started


def test_a_recorded_process_stays_ours_when_the_wall_clock_is_set(tmp_path):
    # psutil's create_time() is the ticks since boot plus a boot time read from the wall clock now:
    # an NTP step moves it (psutil #2526). The record's ticks are what identify the process
    import psutil

    me = Service.of_process("x", "", psutil.Process())
    assert me.start_ticks == _ticks_by_psutil(os.getpid())
    stepped = dataclasses.replace(me, create_time=me.create_time - 30.0)  # as read before a 30 s step
    assert stepped.process() is not None
    assert dataclasses.replace(me, start_ticks=me.start_ticks - 1).process() is None  # a reused pid
    # a command name with spaces and a closing parenthesis does not shift the fields
    odd = tmp_path / "a) b (c"
    shutil.copy(shutil.which("sleep"), odd)
    child = subprocess.Popen([str(odd), "30"])
    try:
        for _ in range(500):  # until it has exec'd (its name is its file's)
            if psutil.Process(child.pid).name() == odd.name:
                break
            time.sleep(0.01)
        assert psutil.Process(child.pid).name() == odd.name
        assert start_ticks(child.pid) == _ticks_by_psutil(child.pid)
    finally:
        child.kill()
        child.wait()
    assert start_ticks(child.pid) is None  # gone


def _ticks_by_psutil(pid: int) -> int:
    import psutil

    return round(psutil.Process(pid)._proc.create_time(monotonic=True) * os.sysconf("SC_CLK_TCK"))


def _args(**kw):
    base = {"param": None, "no_failure": False, "fail_at": None, "fail_on": 1}
    return argparse.Namespace(**{**base, **kw})


def test_refresh_parameters_fail_the_first_run_only_and_refuse_a_password():
    first = refresh_parameters(_args(param=["max_steps=24", 'training.device="cpu"']), 0)
    assert first.to_json() == {"training": {"max_steps": 24, "device": "cpu"},
                               "faults": {"fail_at": ["kill:rank=1:step=16"]}}
    assert refresh_parameters(_args(param=["max_steps=24"]), 1).faults.fail_at == []
    assert refresh_parameters(_args(no_failure=True), 0).faults.fail_at == []
    assert refresh_parameters(_args(fail_on=3), 0).faults.fail_at == []  # the failure goes to the third run
    assert refresh_parameters(_args(fail_on=3), 2).faults.fail_at == ["kill:rank=1:step=16"]
    assert refresh_parameters(_args(fail_at=["hang:step=5"]), 0).faults.fail_at == ["hang:step=5"]
    with pytest.raises(StackError, match="ETTFLOW_WAREHOUSE_URL"):
        refresh_parameters(_args(param=['warehouse_url="postgresql+psycopg://u:secret@h/db"']), 0)
    with pytest.raises(StackError, match="KEY=JSON"):
        refresh_parameters(_args(param=["max_steps"]), 0)
    with pytest.raises(StackError, match="parameter 'world_size' must be >= 1, got 0"):  # before the stack starts
        refresh_parameters(_args(param=["world_size=0"]), 0)


def test_the_ray_token_is_private_and_named_never_given(tmp_path):
    from ettflow.stack.services import ray_token, service_env

    cfg = StackConfig(home=tmp_path)
    env = service_env(cfg, "s1")
    token = ray_token(cfg)
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == str(token)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64
    assert token.read_text() not in "".join(env.values())  # the path travels, never the token
    assert ray_token(cfg).read_text() == token.read_text()  # made once
    theirs = service_env(StackConfig(home=tmp_path, ray_address="10.0.0.1:6379"), "s1")
    assert "RAY_AUTH_TOKEN_PATH" not in theirs or theirs["RAY_AUTH_TOKEN_PATH"] != str(token)
    assert env["ETTFLOW_STACK_ID"] == "s1" and env["RAY_ADDRESS"] == "127.0.0.1:6390"
