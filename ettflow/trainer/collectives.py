"""ettflow's own collectives and the process groups they run on: every collective ettflow's code
calls goes through here (`tests/unit/test_layering.py` finds none outside; TorchRec's own, the
sharded embeddings' all-to-alls and its planner's broadcast on the training group, are TorchRec's).

A rank has three groups, formed together on every rank in the same order (`Groups.form`):

    group       backend                     its tensors          what goes on it
    training    nccl on CUDA, else gloo     the model's device   the model's state only: the dense
                                                                 parameters' broadcast and their
                                                                 gradients' average (and TorchRec's)
    control     gloo                        CPU                  flags, measurements, agreements,
                                                                 evaluation gathers, the stop flag
    checkpoint  gloo                        CPU                  the checkpoint manager's, from its
                                                                 background thread

The checkpoint group is not the control group: an async save runs its collectives from a
background thread while the loop runs its own, and two streams on one gloo group interleave
(gloo aborts: "Is there a distributed collective mismatch?").

Every call checks that its tensors are where its group's backend serves them and raises
`CollectiveDeviceError` naming the group, the call and the tensor's device otherwise: NCCL serves
CUDA tensors only (a CPU tensor on it raises inside NCCL, or hangs its peers), gloo's control
groups take CPU tensors. On a CPU run the training group is gloo, so a control value sent on it
would pass unnoticed; `check="as_nccl"` makes that run's training group refuse CPU tensors in
every call but the model-state ones (`broadcast_params`, `average_grads`: tensors of the model,
CUDA on a GPU run by construction), as NCCL would. The tests' trainer runs use it.

Where gloo and NCCL differ (`Groups.teardown`, `nccl_env`): after a peer's failure NCCL's
communicators are aborted before the groups are destroyed (a communicator with a collective in
flight would otherwise block the destroy), and NCCL's async error handling is on in "clean up
only" mode (TORCH_NCCL_ASYNC_ERROR_HANDLING=2): a collective past its timeout aborts its
communicators and raises in the rank, which keeps its process (live recovery's survivors keep
their CUDA context, modules and compiled step). gloo needs neither: a lost peer's connection
fails the collective at once, and destroying the group is enough.

torch only (no TorchRec, Ray or Prefect): `scripts/gpu_check.sh --part 1` uses it on a bare GPU host.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

Check = Literal["backend", "as_nccl"]
CHECKS: tuple[str, ...] = ("backend", "as_nccl")
NCCL_ERROR_HANDLING = "2"  # CleanUpOnly: abort the communicators and raise; the process lives on


class CollectiveDeviceError(RuntimeError):
    """A collective was called with a tensor its group's backend does not serve."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def nccl_env() -> None:
    """NCCL's async error handling, set before an NCCL group forms (a user's own setting stays)."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ERROR_HANDLING)


@dataclass
class Group:
    """One process group and the device its tensors must be on. `pg` None: a single process
    without torch.distributed (every call is the identity)."""

    name: str
    pg: Any
    backend: str
    device: torch.device
    refuses_cpu: bool = False  # as NCCL does (check="as_nccl" on a CPU run's training group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.pg) if self.pg is not None else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.pg) if self.pg is not None else 0

    def check(self, call: str, tensors: Sequence[torch.Tensor], *, model_state: bool = False) -> None:
        for t in tensors:
            wrong = t.device.type != self.device.type
            refused = self.refuses_cpu and not model_state and t.device.type == "cpu"
            if wrong or refused:
                why = ("it refuses CPU tensors outside the model's state, as NCCL does (check='as_nccl')"
                       if refused and not wrong else f"its tensors live on {self.device.type}")
                raise CollectiveDeviceError(
                    f"{call} on the {self.name} group ({self.backend}) got a {t.device.type} tensor, "
                    f"but {why}: send flags, measurements and gathers on the control group (CPU), "
                    "the model's state on the training group (its device)")

    # ---- any tensor, checked --------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        self.check("all_reduce", [tensor])
        if self.pg is not None:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.pg)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on every rank), by rank."""
        self.check("all_gather", [tensor])
        if self.pg is None:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor, group=self.pg)
        return out

    def barrier(self) -> None:
        if self.pg is not None:
            # gloo's barrier is an all-reduce of a CPU tensor; NCCL's a device one: the backend chooses
            dist.barrier(group=self.pg)

    # ---- objects (pickled to CPU byte tensors: gloo groups only) ----------------------------
    def all_gather_object(self, obj: Any) -> list[Any]:
        self._objects("all_gather_object")
        if self.pg is None:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self._objects("broadcast_object")
        if self.pg is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.pg, group_src=src)
        return box[0]

    def _objects(self, call: str) -> None:
        if self.device.type != "cpu":
            raise CollectiveDeviceError(f"{call} on the {self.name} group ({self.backend}): objects go on a gloo "
                                        "group (control or checkpoint), never on the training group")

    # ---- the model's state (training group) -------------------------------------------------
    def broadcast_params(self, params: Sequence[torch.Tensor], src: int = 0) -> None:
        """Every rank's `params` become `src`'s."""
        self.check("broadcast_params", params, model_state=True)
        if self.pg is None:
            return
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=src, group=self.pg)

    def average_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Average `params`' gradients over the ranks in one flat all-reduce; each gradient
        becomes a view of the reduced buffer (a missing one counts as zeros)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        self.check("average_grads", grads, model_state=True)
        if self.pg is None:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.pg)
        flat /= self.size
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset: offset + n].view_as(p)
            offset += n

    # ---- control values (control group) -----------------------------------------------------
    def all_ok(self, ok: bool) -> bool:
        """True when `ok` holds on every rank (one all-reduce)."""
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
        return int(self.all_reduce(flag, "max").item()) == 0

    def max_of(self, values: Sequence[float]) -> list[float]:
        """Each of `values`' maximum over the ranks (every rank passes as many)."""
        return self.all_reduce(torch.tensor(list(values), dtype=torch.float64), "max").tolist()


def training_group(pg: Any, device: torch.device) -> Group:
    """The training group over a process group someone else formed (a test's, a tool's)."""
    return Group("training", pg, backend_for(device), device)


class GroupOps(Protocol):
    """What forming and tearing down groups does to torch.distributed (a test records it)."""

    def init(self, backend: str, init_method: str, rank: int, world_size: int, timeout_s: float) -> Any: ...
    def new_group(self, backend: str) -> Any: ...
    def abort(self, pg: Any) -> None: ...
    def destroy(self) -> None: ...
    def initialized(self) -> bool: ...


class TorchGroupOps:
    def init(self, backend: str, init_method: str, rank: int, world_size: int, timeout_s: float) -> Any:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return dist.group.WORLD

    def new_group(self, backend: str) -> Any:
        return dist.new_group(backend=backend)

    def abort(self, pg: Any) -> None:
        pg.abort()  # ProcessGroup.abort: every backend's communicators (torch >= 2.6)

    def destroy(self) -> None:
        dist.destroy_process_group()

    def initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized()


TORCH_OPS = TorchGroupOps()


@dataclass
class Groups:
    """A rank's three groups (module docstring)."""

    training: Group
    control: Group
    checkpoint: Group
    ops: GroupOps = field(default=TORCH_OPS, repr=False)
    _aborted: bool = field(default=False, repr=False)

    @classmethod
    def form(cls, device: torch.device, *, init_method: str, rank: int, world_size: int, timeout_s: float = 1800.0,
             check: Check = "backend", ops: GroupOps = TORCH_OPS) -> Groups:
        """Form the groups over the rendezvous `init_method` ("tcp://addr:port", "file://path";
        collective: every rank calls it)."""
        if check not in CHECKS:
            raise ValueError(f"collective check must be one of {CHECKS}, got {check!r}")
        backend = backend_for(device)
        if backend == "nccl":
            nccl_env()
        training = ops.init(backend, init_method, rank, world_size, timeout_s)
        control = ops.new_group("gloo")  # each new_group is collective: same order on every rank
        checkpoint = ops.new_group("gloo")
        cpu = torch.device("cpu")
        return cls(training=Group("training", training, backend, device,
                                  refuses_cpu=check == "as_nccl"),
                   control=Group("control", control, "gloo", cpu),
                   checkpoint=Group("checkpoint", checkpoint, "gloo", cpu), ops=ops)

    def interrupt(self) -> None:
        """A peer failed: unblock this rank's collective in flight. NCCL: abort the training
        group's communicators (from any thread: the collective waiting on them raises); gloo:
        nothing, the lost peer's connection already failed it."""
        if self.training.backend == "nccl" and not self._aborted and self.ops.initialized():
            self._aborted = True
            self.ops.abort(self.training.pg)

    def teardown(self, *, failed: bool = False) -> None:
        """Destroy the groups; after a peer's failure (`failed`) `interrupt` first (NCCL aborts
        its communicators before the destroy, module docstring). Safe to call twice."""
        if not self.ops.initialized():
            return
        if failed:
            self.interrupt()
        self.ops.destroy()


def teardown_any(ops: GroupOps = TORCH_OPS) -> None:
    """Destroy whatever groups this process has (a rank closing without its `Groups`)."""
    if ops.initialized():
        ops.destroy()
