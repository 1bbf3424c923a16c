"""The one table of known third-party noise (`ettflow.console.KNOWN_NOISE`), pure: every entry
names one kind of source and has a real sample text, and Ray's skip regex matches every
sample and no ettflow line (installing the table in a process: integration/test_console_quiet.py;
the real command's console: e2e/test_console.py)."""

from __future__ import annotations

import re

import pytest

from ettflow.console import KNOWN_NOISE, Noise, ray_skip_regex

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
