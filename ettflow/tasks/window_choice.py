"""Which data windows a refresh trains: `select_windows` (pure) and its result, `WindowChoice`.

Window names sort in time order (`trainer.data.windows.list_windows` lists them sorted), so
"newer than the watermark" is a comparison of names. By default a refresh:

- holds out the newest window for validation (evaluation and the publish gate), so it needs
  at least two windows;
- trains the windows newer than the model's watermark (the last window of its last PUBLISHED
  refresh, `ett.lineage`), the OLDEST of them first, at most `max_windows`: the rest wait for
  the next refresh, so no window is ever skipped;
- on the model's first refresh (no watermark) trains the oldest `bootstrap` windows (None:
  `max_windows`), the bootstrap range;
- trains nothing when no window is newer than the watermark (the refresh is skipped).

Explicit `windows` (a parameter) win over all of this: `WindowChoice.explicit`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class WindowChoice:
    """The windows a refresh trains, in order (empty: nothing new to train), the window held
    out for validation (None: the trainer's default, with explicit windows), and why."""

    train: tuple[str, ...]
    holdout: str | None
    reason: str
    explicit: bool = False

    @property
    def nothing_new(self) -> bool:
        return not self.train


def explicit_choice(windows: Sequence[str], eval_windows: Sequence[str] | None) -> WindowChoice:
    holdout = eval_windows[-1] if eval_windows else None
    return WindowChoice(train=tuple(windows), holdout=holdout, reason=f"explicit windows ({len(windows)})",
                        explicit=True)


def select_windows(known: Sequence[str], watermark: str | None, *, max_windows: int,
                   bootstrap: int | None = None) -> WindowChoice:
    """The default choice over the `known` windows (time order) given the model's watermark."""
    if max_windows < 1 or (bootstrap is not None and bootstrap < 1):
        raise ValueError(f"max_windows and bootstrap must be >= 1, got {max_windows} and {bootstrap}")
    known = tuple(known)
    if len(known) < 2:
        raise ValueError(f"{len(known)} window(s): the newest is held out for validation, so a refresh needs 2 or "
                         "more (or explicit windows)")
    holdout, trainable = known[-1], known[:-1]
    if watermark is None:
        train = trainable[: bootstrap or max_windows]
        return WindowChoice(train=train, holdout=holdout, reason=(
            f"first refresh: the bootstrap range, the oldest {len(train)} of {len(trainable)} window(s) "
            f"{_span(train)}, {holdout} held out"))
    newer = tuple(w for w in trainable if w > watermark)
    train = newer[:max_windows]
    if not train:
        where = "the newest window" if watermark >= holdout else f"the newest window before the held-out {holdout}"
        return WindowChoice(train=(), holdout=holdout, reason=f"watermark {watermark} is {where}")
    waiting = len(newer) - len(train)
    later = f"; {waiting} more wait for the next refresh (max_windows={max_windows})" if waiting else ""
    return WindowChoice(train=train, holdout=holdout, reason=(
        f"{len(train)} window(s) {_span(train)} newer than the watermark {watermark}, {holdout} held out{later}"))


def _span(windows: Sequence[str]) -> str:
    return f"{windows[0]}..{windows[-1]}" if len(windows) > 1 else (windows[0] if windows else "(none)")
