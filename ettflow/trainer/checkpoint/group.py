"""The process group checkpoint collectives run on, or a single process without one.

An async save runs DCP's collectives (planning, the final gather of write results) and the
commit's from a background thread while the training loop keeps issuing its own collectives.
On one shared gloo group the two streams interleave and gloo aborts the process ("Received
data size doesn't match expected size. Is there a distributed collective mismatch?"). So
checkpoints get a group of their own:

    ckpt_group = dist.new_group(backend="gloo")  # on EVERY rank, in the same order as the
                                                 # other new_group calls (it is collective)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ettflow.trainer.collectives import Group


class CheckpointGroup:
    def __init__(self, process_group: dist.ProcessGroup | None, *, mode: str) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if not self.distributed:
            if process_group is not None:
                raise ValueError(
                    "a process_group was given but torch.distributed is not initialized: "
                    "call dist.init_process_group first, or pass no group for one process"
                )
            self.pg, self.rank, self.world_size = None, 0, 1
            return
        if mode == "async" and (process_group is None or process_group == dist.group.WORLD):
            raise ValueError(
                "async checkpointing needs a process group of its own: the background write's "
                "collectives would interleave with training's on the default group (gloo aborts "
                "with a collective mismatch). Create one with dist.new_group(backend='gloo') on "
                "every rank, in the same order, and pass it as process_group"
            )
        pg = process_group if process_group is not None else dist.group.WORLD
        if torch.device("cpu") not in getattr(pg, "_device_types", [torch.device("cpu")]):
            raise ValueError(
                "the checkpoint process group has no CPU backend; create it with dist.new_group(backend='gloo')"
            )
        self.pg = pg
        self._group = Group("checkpoint", pg, "gloo", torch.device("cpu"))
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        return self._group.all_gather_object(obj)

    def broadcast_from_first(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        return self._group.broadcast_object(obj)
