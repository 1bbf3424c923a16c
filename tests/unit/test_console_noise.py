"""The one table of known third-party noise (`ettflow.console.KNOWN_NOISE`), pure: every entry
names one kind of source and has a real sample text, and Ray's skip regex matches every
sample and no ettflow line (installing the table in a process: integration/test_console_quiet.py;
the real command's console: e2e/test_console.py)."""

from __future__ import annotations

import logging
import os
import re

import pytest

from ettflow.console import KNOWN_NOISE, RANK_LINE, Noise, RankLineFormatter, ray_allow_regex, ray_skip_regex

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

    monkeypatch.setattr(ray_logging, "RAY_DEDUP_LOGS", True)  # whatever this shell says

    own = [RankLineFormatter(who).format(_record(f"{who}: its process did not run for {s} s"))
           for who, s in (("rank 0", 1.6), ("rank 1", 1.4), ("spare", 2.5), ("rank 1", 1.7))]
    noise = "[rank 0] " + sample_for(KNOWN_NOISE[0])
    assert printed([*own, noise], ray_allow_regex(ray_skip_regex())) == own
    folded = printed([*own, noise], None)
    assert folded[:1] == own[:1] and len(folded) < len(own), folded  # what the console printed before
    assert re.fullmatch(RANK_LINE + ".*", own[2])
    # a skip expression of the user's own is kept: what it drops is never allowed past it
    assert not re.search(ray_allow_regex("did not run"), own[0]) and re.search(ray_allow_regex(""), own[0])


def _record(message: str, exc_info=None) -> logging.LogRecord:
    return logging.makeLogRecord({"msg": message, "levelno": logging.WARNING, "levelname": "WARNING",
                                  "exc_info": exc_info})


def printed(lines: list[str], allow: str | None, pids: list[int] | None = None) -> list[str]:
    """What Ray's driver prints of `lines` (each from its own process, or from `pids`), sent a
    tenth of a second apart through its own deduplicator with the table's skip expression."""
    from ray._private.ray_logging import LogDeduplicator

    clock = [0.0]
    dedup = LogDeduplicator(5, allow, ray_skip_regex(), _timesource=lambda: clock[0])
    out = []
    for i, line in enumerate(lines):
        clock[0] += 0.1
        pid = 100 + (pids[i] if pids is not None else i)
        for batch in dedup.deduplicate({"ip": "10.0.0.1", "pid": pid, "lines": [line]}):
            out += batch["lines"]
    clock[0] += 10  # past the aggregation window: what was folded comes out now
    return out + [line for batch in dedup.flush() for line in batch["lines"]]


def test_two_ranks_tracebacks_of_one_error_each_come_out_whole_and_prefixed(monkeypatch):
    """A record's traceback lines carry their process's prefix too (as torchrun prefixes every
    line of a rank's output): two ranks failing at one place print two whole tracebacks, each
    line saying whose it is, where Ray's deduplication folded the second's frames before (they
    differ from the first's in numbers only)."""
    from ray._private import ray_logging

    monkeypatch.setattr(ray_logging, "RAY_DEDUP_LOGS", True)

    def failed(rank: int) -> list[str]:
        try:
            raise RuntimeError(f"step {10 + rank}: the loss is not finite")
        except RuntimeError:
            import sys

            text = RankLineFormatter(f"rank {rank}").format(_record(f"rank {rank}: attempt 0 failed", sys.exc_info()))
        return text.split("\n")

    traces = [failed(rank) for rank in range(3)]
    lines = [line for trace in traces for line in trace]
    pids = [rank for rank, trace in enumerate(traces) for _ in trace]
    assert len(traces[0]) >= 4 and traces[0][1] == "[rank 0] Traceback (most recent call last):"
    assert all(re.match(RANK_LINE, line) for line in lines), traces[0]
    assert printed(lines, ray_allow_regex(ray_skip_regex()), pids) == lines
    # unprefixed, as the frames were before: the later ranks' frames fold into one line each,
    # printed after Ray's aggregation window, away from their headers
    bare = [line if i == 0 else line.split("] ", 1)[1] for trace in traces for i, line in enumerate(trace)]
    kept = printed(bare, ray_allow_regex(ray_skip_regex()), pids)
    assert len(kept) < len(bare) and any("[repeated 2x across cluster]" in line for line in kept), kept
