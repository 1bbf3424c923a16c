"""The one table of known third-party noise (`ettflow.console.KNOWN_NOISE`), pure: every entry
names one kind of source and has a real sample text, and Ray's skip regex matches every
sample and no ettflow line (installing the table in a process: integration/test_console_quiet.py;
the real command's console: e2e/test_console.py)."""

from __future__ import annotations

import os
import re

import pytest

from ettflow.console import KNOWN_NOISE, RANK_LINE, RANK_LINE_FORMAT, Noise, ray_allow_regex, ray_skip_regex

from helpers.console_samples import sample_for


def test_every_entry_names_one_kind_of_source_and_has_a_sample():
    for n in KNOWN_NOISE:
        assert not (n.category and n.logger), n
        sample_for(n)
    with pytest.raises(ValueError, match="not both"):
        Noise(source="x", message="y", category=UserWarning, logger="z")
    with pytest.raises(ValueError, match="regular expression"):
        Noise(source="x", message="(")


def test_the_ray_skip_regex_matches_every_sample_and_no_ettflow_line():
    skip = re.compile(ray_skip_regex())
    assert all(skip.search(sample_for(n)) for n in KNOWN_NOISE)
    for own in ("attempt 0 failed (infrastructure failure: rank 1: process died)", "trainer reserved in 3.1 s",
                "training: step 18/32 (56%), attempt 1, loss 0.5017", "published /tmp/x (step 32) in 7.5 s"):
        assert not skip.search(own)


def test_an_explained_error_is_logged_without_its_traceback_and_others_with_theirs():
    import logging

    from ettflow.console import ExplainedErrorFilter, is_explained
    from ettflow.tasks.errors import ParameterError

    def record(exc: BaseException, msg: str = "Task run failed with exception: %r") -> logging.LogRecord:
        try:
            raise exc
        except BaseException:  # noqa: BLE001
            import sys

            return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, msg, (exc,), sys.exc_info())

    explained, other = record(ParameterError("world_size", "must be >= 1")), record(KeyError("x"))
    assert is_explained(explained.exc_info[1]) and not is_explained(other.exc_info[1]) and not is_explained(None)
    keep = ExplainedErrorFilter()
    assert keep.filter(explained) and keep.filter(other)  # both lines stay
    assert explained.exc_info is None and other.exc_info is not None
    # the engine's echoes of a failed run: gone for an explained error (its state line says it), kept otherwise
    for echo in ("Encountered exception during execution: %r", "Engine execution exited with unexpected exception",
                 "Execution of flow run 'abc' exited with unexpected exception"):
        assert not keep.filter(record(ParameterError("world_size", "must be >= 1"), echo))
        assert keep.filter(record(KeyError("x"), echo))


def test_console_times_carry_their_zone():
    """Issue 26 #10: a console line's time is labelled with its zone (Prefect's default is a
    bare local time, beside reports in UTC)."""
    import subprocess
    import sys

    probe = (
        "from ettflow.flows.env_defaults import set_env_defaults; set_env_defaults()\n"
        "import logging\n"
        "from prefect.logging.configuration import setup_logging; setup_logging()\n"
        "handler = next(h for h in logging.getLogger().handlers if type(h).__name__ == 'PrefectConsoleHandler')\n"
        "record = logging.LogRecord('prefect.flow_runs', logging.INFO, 'probe', 1, 'hello', (), None)\n"
        "record.created, record.flow_run_name = 1796300207.5, 'probe-run'\n"  # 2026-12-03 12:16:47 UTC
        "print(handler.format(record))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_LOGGING_")}
    for tz, shown in (("America/Los_Angeles", "04:16:47 PST"), ("UTC", "12:16:47 UTC")):
        out = subprocess.run([sys.executable, "-c", probe], env={**env, "TZ": tz}, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        line = out.stdout.strip().splitlines()[-1]
        assert line.startswith(f"{shown} | INFO") and line.endswith("Flow run 'probe-run' - hello"), line


def test_no_help_page_shows_a_note_written_for_developers():
    """Issue 43: `ettflow up --help` printed "`register(subparsers)` adds the three commands...".
    Every command's and sub-command's help, walked from the parser itself."""
    import argparse

    from ettflow.cli import build_parser

    def pages(parser: argparse.ArgumentParser):
        yield parser.prog, parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from pages(sub)

    seen = dict(pages(build_parser()))
    assert len(seen) > 15 and "ettflow up" in seen and "ettflow publish" in seen
    assert not [prog for prog, text in seen.items() if "register(" in text or "main(argv)" in text]


def test_ray_never_folds_the_ranks_own_lines_and_still_drops_their_noise(monkeypatch):
    """Ray's driver folds a line that another process sent (numbers aside) into one line with its
    note on deduplication: two ranks' starvation warnings became third-party text on the console.
    Fed through Ray's own deduplicator with the table's expressions, every rank's and spare's line
    is printed as it came; a noise line still is not; without the allow expression they fold."""
    from ray._private import ray_logging
    from ray._private.ray_logging import LogDeduplicator

    monkeypatch.setattr(ray_logging, "RAY_DEDUP_LOGS", True)  # whatever this shell says

    own = [RANK_LINE_FORMAT.format(who=who) % {"message": f"{who}: its process did not run for {s} s"}
           for who, s in (("rank 0", 1.6), ("rank 1", 1.4), ("spare", 2.5), ("rank 1", 1.7))]
    noise = "[rank 0] " + sample_for(KNOWN_NOISE[0])
    clock = [0.0]

    def printed(allow: str | None) -> list[str]:
        dedup = LogDeduplicator(5, allow, ray_skip_regex(), _timesource=lambda: clock[0])
        lines = []
        for pid, line in enumerate([*own, noise]):
            clock[0] += 0.1
            for batch in dedup.deduplicate({"ip": "10.0.0.1", "pid": 100 + pid, "lines": [line]}):
                lines += batch["lines"]
        clock[0] += 10  # past the aggregation window: what was folded comes out now
        return lines + [line for batch in dedup.flush() for line in batch["lines"]]

    assert printed(ray_allow_regex(ray_skip_regex())) == own
    folded = printed(None)
    assert folded[:1] == own[:1] and len(folded) < len(own), folded  # what the console printed before
    assert re.fullmatch(RANK_LINE + ".*", own[2])
    # a skip expression of the user's own is kept: what it drops is never allowed past it
    assert not re.search(ray_allow_regex("did not run"), own[0]) and re.search(ray_allow_regex(""), own[0])
