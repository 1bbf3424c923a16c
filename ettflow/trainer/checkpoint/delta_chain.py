"""Delta checkpoint chains, pure: which save is a base, what a restore reads, what retention keeps.

A durable checkpoint is either a **base** (every row of every table, the whole model and
optimizer state: today's DCP checkpoint) or a **delta** on its parent (the embedding rows
touched since the parent, with their optimizer state, and the dense parameters and dense
optimizer state whole: `delta.py`). A chain is a base followed by deltas, each on the one
before it:

    base@10 <- delta@20 <- delta@30 <- delta@40      restore of step 40 reads all four, in order

Invariants this module keeps (`Link`s are what the checkpoints folder holds, committed):

- **A restore reads a base and its deltas in order** (`restore_chain`): the newest committed
  link whose whole chain is present and undamaged; a damaged or missing link ends the chain
  at the link before it (`restore_chain(..., damaged=...)` says which and why: the caller
  logs it and records `checkpoint_fallback`).
- **A base is taken** when the chain's deltas add up to more than `max_chain_share` of the
  base's bytes (a restore would read more deltas than a base is worth), when the chain
  reaches `max_chain_length`, when there is no base to build on, and at an anchor
  (`next_kind(..., anchor=True)`): a published model's anchor never depends on a chain
  retention may break.
- **Retention never deletes a link a kept link needs** (`needed`): keeping a delta keeps its
  parent, and so on down to its base.
- **A delta belongs to the parent it was written on**: it names the parent's commit digest
  (`parent_digest`), and a chain through a parent rewritten since (a restart that replayed to
  the same step and saved it again) is not whole: the delta is skipped, never applied onto
  another state of that step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["base", "delta"]


@dataclass(frozen=True, kw_only=True)
class Link:
    """One committed checkpoint of a chain: its step, whether it is a base or a delta (then on
    `parent`, the step of the link it applies to), and its size on disk."""

    step: int
    kind: Kind
    parent: int | None = None
    bytes: int = 0
    digest: str = ""  # its commit digest ("": not known, not checked)
    parent_digest: str = ""  # a delta's parent's digest when it was written ("": not checked)

    def __post_init__(self) -> None:
        if self.kind not in ("base", "delta"):
            raise ValueError(f"Link.kind must be 'base' or 'delta', got {self.kind!r}")
        if (self.kind == "delta") != (self.parent is not None):
            raise ValueError(f"a delta names its parent step and a base none (step {self.step}, {self.kind}, "
                             f"parent {self.parent})")
        if self.parent is not None and self.parent >= self.step:
            raise ValueError(f"delta of step {self.step} on a later or equal parent {self.parent}")


@dataclass(frozen=True, kw_only=True)
class ChainPolicy:
    """When a save is a base rather than a delta (see the module's docstring)."""

    max_chain_share: float = 1.0  # the chain's deltas may add up to this share of its base's bytes
    max_chain_length: int = 16  # deltas after a base at most

    def __post_init__(self) -> None:
        if not self.max_chain_share > 0:
            raise ValueError(f"ChainPolicy.max_chain_share must be > 0, got {self.max_chain_share!r}")
        if self.max_chain_length < 1:
            raise ValueError(f"ChainPolicy.max_chain_length must be >= 1, got {self.max_chain_length!r}")


def chain_of(links: Mapping[int, Link], step: int) -> list[Link]:
    """The chain that ends at `step`, base first; raises KeyError naming the first missing link."""
    out: list[Link] = []
    at: int | None = step
    while at is not None:
        if at not in links:
            raise KeyError(f"the chain of step {step} needs step {at}, which is not there")
        link = links[at]
        if out and out[-1].parent_digest and link.digest and out[-1].parent_digest != link.digest:
            raise KeyError(f"the chain of step {step} needs step {at} as its delta of step {out[-1].step} was "
                           f"written on, and step {at} was saved again since")
        out.append(link)
        at = link.parent
    return out[::-1]


def next_kind(links: Sequence[Link], head: int | None, delta_bytes_estimate: int, *, anchor: bool,
              policy: ChainPolicy) -> tuple[Kind, str]:
    """Whether the next save (on `head`, the step the training state was saved or restored at
    last; None: nothing to build on) is a base or a delta, and why (for the log)."""
    if anchor:
        return "base", "an anchor is a base: the published model never depends on a chain"
    by_step = {link.step: link for link in links}
    if head is None or head not in by_step:
        return "base", "no committed checkpoint to build on"
    try:
        chain = chain_of(by_step, head)
    except KeyError as exc:
        return "base", f"the chain is broken ({exc.args[0]})"
    base, deltas = chain[0], chain[1:]
    if len(deltas) >= policy.max_chain_length:
        return "base", f"the chain has {len(deltas)} deltas (max_chain_length {policy.max_chain_length})"
    total = sum(d.bytes for d in deltas) + delta_bytes_estimate
    if base.bytes and total > policy.max_chain_share * base.bytes:
        return "base", (f"the chain's deltas would add up to {total} bytes, over {policy.max_chain_share:g} of its "
                        f"base's {base.bytes}")
    return "delta", f"on step {head} (chain of {len(deltas) + 1} after base {base.step})"


@dataclass(frozen=True)
class RestorePlan:
    """What a restore reads (`links`, base first) and, when it could not restore the newest
    link, which one was skipped and why."""

    links: tuple[Link, ...]
    skipped: int | None = None  # the newest step that could not be restored
    why: str = ""

    @property
    def step(self) -> int | None:
        return self.links[-1].step if self.links else None


def restore_chain(links: Sequence[Link], *, damaged: Mapping[int, str] | None = None) -> RestorePlan:
    """The newest step whose whole chain is present and undamaged (`damaged`: step -> what is
    wrong with it), and the chain to read for it; an empty plan when no chain is whole."""
    damaged = dict(damaged or {})
    by_step = {link.step: link for link in links}
    newest = max(by_step, default=None)
    for step in sorted(by_step, reverse=True):
        try:
            chain = chain_of(by_step, step)
        except KeyError:
            continue
        if any(link.step in damaged for link in chain):
            continue
        if step == newest:
            return RestorePlan(tuple(chain))
        return RestorePlan(tuple(chain), skipped=newest, why=_why(by_step, newest, damaged))
    return RestorePlan((), skipped=newest, why=_why(by_step, newest, damaged) if newest is not None else "")


def _why(by_step: Mapping[int, Link], step: int, damaged: Mapping[int, str]) -> str:
    try:
        chain = chain_of(by_step, step)
    except KeyError as exc:
        return str(exc.args[0])
    broken = [link.step for link in chain if link.step in damaged]
    return f"its chain's step {broken[-1]} is damaged ({damaged[broken[-1]]})" if broken else ""


def needed(links: Iterable[Link], keep: Iterable[int]) -> set[int]:
    """Every step retention must keep so that each step in `keep` can still be restored: the
    kept ones and the links their chains need (a missing link is skipped: nothing can mend it)."""
    by_step = {link.step: link for link in links}
    out: set[int] = set()
    for step in keep:
        at: int | None = step
        while at is not None and at in by_step and at not in out:
            out.add(at)
            at = by_step[at].parent
    return out
