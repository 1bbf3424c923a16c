"""Thresholds a Prefect automation can test: numbers as fixed-width labels, comparisons as globs.

Prefect's event triggers match resource labels with glob patterns (`fnmatch`, a leading `!`
negates) and nothing else: no numeric comparison. So the `ettflow.run.measured` event carries
its numbers as fixed-width decimal labels, and a threshold becomes the globs that match
exactly the labels on one side of it:

- `ett_label(pct)`: ETT% rounded to 0.1 and clamped to [0, 100], as ``DDD.D`` (``"073.4"``).
- `nof_label(n)`: the number of failures as ``DDD`` (``"002"``; 999 and more: ``"999"``).
- `ett_below_globs(t)`: globs matching every `ett_label` strictly below `t` (at 0.1 resolution:
  ``ett_below_globs(70)`` is ``["0[0-6]?.?"]``, i.e. 000.0 .. 069.9).
- `nof_above_globs(n)`: globs matching every `nof_label` strictly above `n`
  (``nof_above_globs(1)`` is ``["[1-9]??", "0[1-9]?", "00[2-9]"]``).

The globs are the classic decomposition of a range of fixed-width digit strings: for each
position where the bound's digit leaves room, the bound's prefix, a digit class on the room
side, and any digit after. Pure: no I/O.
"""

from __future__ import annotations

ETT_WIDTH = 4  # tenths of a percent, 0000 .. 1000, shown as DDD.D
NOF_WIDTH = 3
NOF_MAX = 10**NOF_WIDTH - 1


def _tenths(pct: float) -> int:
    return min(1000, max(0, round(pct * 10)))


def ett_label(pct: float) -> str:
    digits = f"{_tenths(pct):0{ETT_WIDTH}d}"
    return f"{digits[:3]}.{digits[3:]}"


def nof_label(nof: int) -> str:
    return f"{min(max(int(nof), 0), NOF_MAX):0{NOF_WIDTH}d}"


def _digit_class(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"[{lo}-{hi}]"


def digits_below(bound: str) -> list[list[str]]:
    """Glob tokens (one per character) matching every digit string of len(bound) below it."""
    out = []
    for i, ch in enumerate(bound):
        d = int(ch)
        if d > 0:
            out.append([*bound[:i], _digit_class(0, d - 1), *["?"] * (len(bound) - i - 1)])
    return out


def digits_above(bound: str) -> list[list[str]]:
    """Glob tokens (one per character) matching every digit string of len(bound) above it."""
    out = []
    for i, ch in enumerate(bound):
        d = int(ch)
        if d < 9:
            out.append([*bound[:i], _digit_class(d + 1, 9), *["?"] * (len(bound) - i - 1)])
    return out


def ett_below_globs(threshold_pct: float) -> list[str]:
    """Globs matching `ett_label(x)` exactly when round(x, 1) < threshold (at 0.1 resolution;
    a threshold of 0 matches nothing, one above 100 every label)."""
    if not 0 <= threshold_pct <= 100.0:
        raise ValueError(f"an ETT threshold is a percentage in [0, 100], not {threshold_pct}")
    bound = f"{_tenths(threshold_pct):0{ETT_WIDTH}d}"
    return ["".join(tokens[:3]) + "." + "".join(tokens[3:]) for tokens in digits_below(bound)]


def nof_above_globs(threshold: int) -> list[str]:
    """Globs matching `nof_label(n)` exactly when n > threshold."""
    if not 0 <= threshold < NOF_MAX:
        raise ValueError(f"a NoF threshold is a whole number in [0, {NOF_MAX - 1}], not {threshold}")
    return ["".join(tokens) for tokens in digits_above(f"{threshold:0{NOF_WIDTH}d}")]
