"""`ettflow demo` and `ettflow report` through the real spool and warehouse."""

import json

import pytest

from ettflow.cli import main


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ETTFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("ETTFLOW_WAREHOUSE_URL", raising=False)
    monkeypatch.delenv("ETTFLOW_SPOOL", raising=False)
    return tmp_path


def test_empty_warehouse_says_what_to_do(home, capsys):
    assert main(["report"]) == 1
    err = capsys.readouterr().err
    assert "holds no data" in err and "ettflow demo" in err


def test_unreachable_warehouse_names_it(home, capsys):
    assert main(["report", "--url", "postgresql+psycopg://nobody@127.0.0.1:1/none"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the ettflow warehouse at postgresql+psycopg://nobody@127.0.0.1:1/none" in err


def test_demo_then_report_in_every_format(home, capsys, warehouse_url):
    assert main(["demo", "--run-id", "s1", "--url", warehouse_url, "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "s1" in out and "effective_training" in out and (home / "spool" / "s1").is_dir()
    assert main(["demo", "--run-id", "s2", "--url", warehouse_url, "--seed", "4"]) == 0
    capsys.readouterr()

    assert main(["report", "--url", warehouse_url, "--format", "json"]) == 0
    text = capsys.readouterr().out
    runs_json = text[: text.index("]") + 1]
    runs = json.loads(runs_json)
    assert [r["run"] for r in runs] == ["s1", "s2"]
    for r in runs:
        shares = sum(r[k] for k in ("effective%", "wasted%", "compile%", "init%", "sched%", "shutdown%", "unattr%"))
        assert shares == pytest.approx(100, abs=0.5) and r["NoF"] == 1

    assert main(["report", "--url", warehouse_url, "--format", "csv", "--run", "s2"]) == 0
    csv = capsys.readouterr().out
    assert csv.startswith("run,model,mode,") and "component,effective_training,trainer" in csv

    assert main(["report", "--url", warehouse_url, "--model", "sample-dlrm", "--last", "1"]) == 0
    table = capsys.readouterr().out
    assert "s2" in table and "s1" not in table.split("Per model")[0] and "Per model, over time" in table


def test_a_report_piped_to_a_reader_that_left_ends_quietly(home, warehouse_url):
    import os
    import subprocess
    import sys
    from pathlib import Path

    assert main(["demo", "--run-id", "s1", "--url", warehouse_url, "--seed", "3"]) == 0
    ettflow = Path(sys.executable).with_name("ettflow")
    for args in (["report", "--url", warehouse_url], ["report", "--url", warehouse_url, "--run", "s1"]):
        read, write = os.pipe()
        os.close(read)  # `| head -1` that has already gone: every write to the pipe fails
        try:
            done = subprocess.run([str(ettflow), *args], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
        finally:
            os.close(write)
        assert (done.returncode, done.stderr) == (0, ""), done.stderr
