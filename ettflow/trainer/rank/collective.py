"""Small collectives the rank side agrees through."""

from __future__ import annotations

import torch
import torch.distributed as dist


def agree_all_ok(ok: bool, pg: dist.ProcessGroup) -> bool:
    """True when `ok` holds on every rank of `pg` (one all-reduce)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg)
    return int(flag.item()) == 0
