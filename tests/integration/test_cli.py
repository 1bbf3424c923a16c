"""`ettflow demo` and `ettflow report` through the real spool and warehouse."""

import json
import os

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


@pytest.fixture
def in_process_refresh(home, monkeypatch):
    """`ettflow refresh` run by `main` in this process (as its supervised worker would)."""
    from ettflow.console import RAY_SKIP_ENV, VERBOSE_ENV
    from ettflow.flows.supervise import SUPERVISOR_ENV

    for name in (SUPERVISOR_ENV, VERBOSE_ENV, RAY_SKIP_ENV):
        monkeypatch.setenv(name, os.environ.get(name, "0"))
    return home


def test_a_refresh_refused_before_it_starts_says_so_in_one_line(in_process_refresh, capsys):
    """Issue 26 #8: an unknown --param and an unreachable warehouse are one line each, with
    what to do, and no traceback (before: Prefect's signature dump, a 120-line chained one)."""
    assert main(["refresh", "--param", "nosuch=1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ettflow refresh: parameter 'nosuch' is not a parameter of refresh-model")
    assert "world_size" in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert main(["refresh", "--warehouse-url", "postgresql+psycopg://nobody@127.0.0.1:1/none"]) == 1
    err = capsys.readouterr().err
    assert "ettflow refresh: cannot reach the ettflow warehouse at postgresql+psycopg://nobody@127.0.0.1:1/none" in err
    assert "Check that PostgreSQL is running" in err and "Traceback" not in err
