"""Group ops (trainer/collectives.py `GroupOps`) that record what forming and tearing down a
rank's groups would do to torch.distributed: the order of NCCL's abort and destroy, with no GPU."""

from __future__ import annotations


class RecordingOps:
    """Group ops that record what forming and tearing down would do to torch.distributed."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.up = False

    def init(self, backend, init_method, rank, world_size, timeout_s):
        self.calls.append(("init", backend))
        self.up = True
        return f"{backend}-world"

    def new_group(self, backend):
        self.calls.append(("new_group", backend))
        return f"{backend}-{len(self.calls)}"

    def abort(self, pg):
        self.calls.append(("abort", pg))

    def destroy(self):
        self.calls.append(("destroy",))
        self.up = False

    def initialized(self):
        return self.up
