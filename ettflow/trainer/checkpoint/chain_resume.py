"""What an in-memory copy carries so that the durable delta chain goes on after the copy is
restored (issue 44): the chain the rank's durable saves counted from when the copy was taken,
and the rows touched since that chain's last link, up to the copy's step.

A live recovery served from the in-memory tier restores a step S newer than the last durable
save. Without this record the next durable save had to be a base (nothing tracked before a
restore counts), so each memory-served recovery cost a full save's bytes (the deployed bench:
3 bases in 10 saves, 3.0x fewer durable bytes instead of the component bench's 6x). With it,
the next durable save is a delta on the link P the copy names, holding the recorded rows and
every row touched after the restore:

    state(P) --rows touched in (P, S]--> state(S) = the copy --rows touched after S--> state(T)

Invariants:
- A delta's rows must include every row changed since its parent; more rows are harmless. The
  rows recorded are those the rank's durable ledger held at S plus those of a delta still being
  written at S (it may or may not commit): together every row touched since P.
- P is the chain's head as the rank's loop last settled it, or the base whose save began last
  (its commit ends on the checkpoint manager's thread, at a moment that differs between ranks;
  the base's step does not): the ranks' loops saw the same saves at the same steps, so they
  record the same P. A restore uses it only when every rank found the same P committed on disk
  (`Checkpointing` agrees on it), else the next save is a base, as before.
- The rows are checked against their digest before they are used: a damaged record makes the
  next save a base, never a wrong delta.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ettflow.trainer.checkpoint.delta import commit_digest
from ettflow.trainer.checkpoint.delta_chain import Link
from ettflow.trainer.checkpoint.layout import delta_dir, final_dir, folder_bytes


@dataclass(frozen=True)
class ChainResume:
    """The chain a copy's durable saves built on (base first; its last link is the parent of the
    next delta; a base whose commit was not seen yet has digest "" and bytes 0), and the rows
    touched since that link (table FQN -> row ids), with their digest."""

    links: tuple[Link, ...]
    rows: Mapping[str, np.ndarray]
    digest: str

    @classmethod
    def of(cls, links: tuple[Link, ...], rows: Mapping[str, object]) -> ChainResume:
        """A record of `links` and `rows` (tensors or arrays of row ids, copied here)."""
        if not links or links[0].kind != "base":
            raise ValueError(f"ChainResume needs a chain that starts at a base, got {links!r}")
        held = {fqn: np.array(ids.cpu().numpy() if hasattr(ids, "cpu") else ids, dtype=np.int64).reshape(-1)
                for fqn, ids in rows.items()}  # np.array copies: the record never shares the ledger's tensors
        return cls(links=tuple(links), rows=held, digest=_digest(links, held))

    def intact(self) -> bool:
        """The rows and links are those recorded (a damaged record is never used)."""
        return _digest(self.links, self.rows) == self.digest

    def on_disk(self, root: Path) -> tuple[Link, ...] | None:
        """The chain with its parent found committed under `root` (its digest filled in when it
        was not known), or None: the parent is gone, never committed, or was saved again since
        (another digest). Reads the COMMITTED markers only: a chain a delta extends is the one
        its ranks committed; a damaged link is met by the restore's verification, as always."""
        if not self.intact():
            return None
        out = list(self.links)
        for i, link in enumerate(self.links):
            folder = final_dir(root, link.step) if link.kind == "base" else delta_dir(root, link.step)
            try:
                digest = commit_digest(folder)
            except OSError:
                return None
            if link.digest and digest != link.digest:
                return None
            if not link.digest:
                out[i] = Link(step=link.step, kind=link.kind, parent=link.parent, bytes=folder_bytes(folder),
                              digest=digest, parent_digest=link.parent_digest)
        return tuple(out)


def _digest(links: tuple[Link, ...], rows: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256(repr(links).encode())
    for fqn in sorted(rows):
        h.update(fqn.encode())
        h.update(np.ascontiguousarray(rows[fqn], dtype=np.int64).tobytes())
    return h.hexdigest()
