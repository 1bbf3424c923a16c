"""`ettflow up` against ports someone else holds: a clear message that names the port, who
holds it and the flag to change, and nothing started."""

from __future__ import annotations

import socket
import subprocess
import sys

from helpers.prefect_cli import REPO


def _listening() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_up_on_a_taken_port_says_which_and_what_to_do(tmp_path):
    sock, port = _listening()
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("PREFECT_", "RAY_"))}
    env["ETTFLOW_HOME"] = str(tmp_path / "home")
    try:
        out = subprocess.run([sys.executable, "-m", "ettflow", "up", "--api-port", str(port)], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    finally:
        sock.close()
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"port {port} on 127.0.0.1 is taken by pid" in out.stderr and "--api-port N" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    from ettflow.stack.records import StackRecord

    rec = StackRecord.read(tmp_path / "home" / "stack" / "stack.json")
    assert rec is None or not any(s.started for s in rec.services)  # nothing was started


def test_up_refuses_the_ports_of_another_homes_stack(tmp_path):
    """A Prefect server that answers on the port but belongs to the stack of another
    `ETTFLOW_HOME` (its process carries that stack's id and home) is not joined: a second
    worker on the same work pool, with another home and Ray token, would compete for its runs."""
    import os
    import time

    import httpx

    served = tmp_path / "served"
    (served / "api").mkdir(parents=True)
    (served / "api" / "health").write_text("true")  # what `prefect_healthy` asks for
    sock, port = _listening()
    sock.close()
    other = tmp_path / "other-home"
    fake = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=served,
                            env={**os.environ, "ETTFLOW_STACK_ID": "another-stack", "ETTFLOW_HOME": str(other)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RAY_", "ETTFLOW_STACK"))}
    env["ETTFLOW_HOME"] = str(tmp_path / "home")
    try:
        deadline = time.monotonic() + 30
        while True:  # until the fake server answers as a Prefect server would
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the stand-in server never answered"
            time.sleep(0.2)
        out = subprocess.run([sys.executable, "-m", "ettflow", "up", "--api-port", str(port)], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    finally:
        fake.kill()
        fake.wait()
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"port {port} on 127.0.0.1 is the Prefect server of another ettflow stack (home {other})" in out.stderr
    assert f"ETTFLOW_HOME={other} ettflow down" in out.stderr and "--api-port N" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    from ettflow.stack.records import StackRecord

    rec = StackRecord.read(tmp_path / "home" / "stack" / "stack.json")
    assert rec is None or not any(s.started for s in rec.services)  # nothing was started


def test_a_recorded_ray_head_that_runs_but_does_not_answer_is_reported_and_replaced(tmp_path):
    """`ray stop` by hand ends a head's GCS and raylet but leaves `ray start --block` running:
    `ettflow status` must not call that head up, and `up` stops the stale process before it
    starts a new head (else it leaks, and the record names a dead cluster)."""
    import psutil

    from ettflow.stack import lifecycle, services
    from ettflow.stack.config import StackConfig
    from ettflow.stack.records import Service, StackRecord

    sock, port = _listening()
    sock.close()  # a port nobody answers on
    stale = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        proc = psutil.Process(stale.pid)
        head = Service.of_process("ray-head", f"127.0.0.1:{port}", proc, log=str(tmp_path / "ray-head.log"))
        cfg = StackConfig(home=tmp_path / "home", ray_port=port, stop_s=2.0)
        StackRecord(stack_id="s", api_url="http://127.0.0.1:9/api", ui_url="http://127.0.0.1:9",
                    ray_address=head.address, pool="p", services=(head,)).write(cfg.record_path)
        said: list[str] = []
        assert lifecycle.status(cfg, say=said.append) is False
        [line] = [x for x in said if "ray-head" in x]
        assert f"NOT ANSWERING (pid {stale.pid} runs, its port does not answer" in line and "`ettflow up`" in line
        assert services._stop_stale(head, cfg) == f"; replaces pid {stale.pid}, which no longer answered on its port"
        assert stale.wait(timeout=10) is not None  # stopped
    finally:
        stale.kill()
        stale.wait()
