"""Waiting for something to happen, with a bound and a message that says what never came."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.1,
             detail: Callable[[], object] | None = None) -> T:
    """`predicate()`'s first truthy value, polled every `poll_s`; the test fails after
    `timeout_s` naming `what` (and what `detail()` says of the state it was left in)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            said = f": {detail()}" if detail is not None else ""
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}{said}")
        time.sleep(poll_s)
