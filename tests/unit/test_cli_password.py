"""A warehouse URL with a password on `ettflow`'s command line: every user of the host can read
it in the process list while the command runs, so the command says so (once, on stderr, the
password never printed) and how to keep it off the command line."""

from __future__ import annotations

import pytest

from ettflow.cli import _warn_password_in_argv

SECRET = "s3cret-pw"


@pytest.mark.parametrize("argv", [
    ["report", "--url", f"postgresql+psycopg://u:{SECRET}@db.example/ett"],
    ["report", f"--url=postgresql+psycopg://u:{SECRET}@db.example/ett"],
    ["refresh", "--warehouse-url", f"postgresql://u:{SECRET}@db.example/ett"],
    ["refresh", "--param", f'warehouse_url="postgresql://u:{SECRET}@db.example/ett"'],
    ["archive", "--url", f"postgresql://u@db.example/ett?password={SECRET}"],
])
def test_a_password_on_the_command_line_is_warned_about_without_showing_it(argv, capsys):
    _warn_password_in_argv(argv[0], argv)
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and SECRET not in err
    assert err.startswith(f"ettflow {argv[0]}: a URL on the command line holds a password")
    assert "ETTFLOW_WAREHOUSE_URL" in err and "~/.pgpass" in err


@pytest.mark.parametrize("argv", [
    ["report", "--url", "postgresql+psycopg://u@db.example/ett"],
    ["report", "--url", "sqlite:////tmp/w.db"],
    ["refresh", "--data-root", "/data/criteo", "--param", "max_steps=10"],
])
def test_a_command_line_without_a_password_is_not_warned_about(argv, capsys):
    _warn_password_in_argv(argv[0], argv)
    assert capsys.readouterr() == ("", "")
