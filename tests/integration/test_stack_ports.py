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
