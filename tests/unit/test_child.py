"""Measurements in a fresh process (ettflow/child.py: the benches and the compile probe): the
parent takes the last result the child emitted, and a child that failed or emitted nothing is an
error naming it, with its stderr."""

from __future__ import annotations

import pytest

from ettflow.child import run_child


@pytest.fixture
def module(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))

    def write(body: str) -> str:
        (tmp_path / "bench_child_probe.py").write_text(body)
        return "bench_child_probe"
    return write


def test_the_last_result_the_child_emitted_is_taken(module):
    name = module("import sys\nfrom ettflow.child import emit\n"
                  "print('noise'); emit('R ', {'n': 1}); emit('R ', {'n': int(sys.argv[1])})\n")
    assert run_child(name, ["7"], "R ", "the probe") == {"n": 7}


@pytest.mark.parametrize("body", ["import sys\nsys.stderr.write('boom')\nsys.exit(3)\n",
                                  "import sys\nsys.stderr.write('boom')\n"])
def test_a_child_that_failed_or_emitted_nothing_is_an_error_with_its_stderr(module, body):
    with pytest.raises(RuntimeError, match=r"the probe failed \(exit \d\):\nboom"):
        run_child(module(body), [], "R ", "the probe")
