"""ettflow's collectives (trainer/collectives.py): each call's device check, where gloo and NCCL
differ (recorded with scripted group ops, no GPU), and no collective called outside the module."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

import ettflow
from ettflow.trainer.collectives import CollectiveDeviceError, Group, Groups

from helpers.group_ops import RecordingOps

PACKAGE = Path(ettflow.__file__).parent
MODULE = "trainer/collectives.py"
# torch.distributed's collectives and group management: only trainer/collectives.py calls them
COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv",
    "isend", "irecv", "batch_isend_irecv", "init_process_group", "new_group", "destroy_process_group",
})
CPU = torch.device("cpu")


def form(device: str, ops: RecordingOps, check="backend") -> Groups:
    return Groups.form(torch.device(device), init_method="tcp://127.0.0.1:1", rank=0, world_size=2, timeout_s=5,
                       check=check, ops=ops)


# ---- the device check ---------------------------------------------------------------------------
def test_an_nccl_training_group_refuses_cpu_tensors_and_objects():
    training = Group("training", None, "nccl", torch.device("cuda"))
    for call in (lambda: training.all_reduce(torch.ones(2)), lambda: training.all_gather(torch.ones(2)),
                 lambda: training.all_ok(True), lambda: training.max_of([1.0])):
        with pytest.raises(CollectiveDeviceError, match=r"training group \(nccl\) got a cpu tensor.*control group"):
            call()
    with pytest.raises(CollectiveDeviceError, match=r"average_grads on the training group \(nccl\) got a cpu"):
        training.average_grads([torch.nn.Parameter(torch.ones(2))])  # a CPU model on an NCCL group: wrong too
    with pytest.raises(CollectiveDeviceError, match="objects go on a gloo group"):
        training.all_gather_object({"step": 1})


def test_as_nccl_refuses_control_values_on_a_cpu_training_group_but_not_the_models_state():
    training = Group("training", None, "gloo", CPU, refuses_cpu=True)
    with pytest.raises(CollectiveDeviceError, match="refuses CPU tensors outside the model's state"):
        training.max_of([1.0, 2.0])
    with pytest.raises(CollectiveDeviceError, match="refuses CPU tensors"):
        training.all_gather(torch.zeros(3))
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    training.average_grads([p])  # the model's own state passes (a single process: unchanged)
    training.broadcast_params([p])
    assert p.grad.tolist() == [2.0, 2.0, 2.0]


def test_the_control_group_takes_cpu_values_only():
    control = Group("control", None, "gloo", CPU)
    assert control.all_ok(True) and control.max_of([1.5, -2.0]) == [1.5, -2.0]
    assert control.all_gather_object("x") == ["x"]
    meta = torch.ones(1, device="meta")
    with pytest.raises(CollectiveDeviceError, match="control group .gloo. got a meta tensor"):
        control.all_reduce(meta)


# ---- forming and tearing down: where gloo and NCCL differ ---------------------------------------
def test_gloo_groups_form_three_and_tear_down_without_abort():
    ops = RecordingOps()
    groups = form("cpu", ops)
    assert ops.calls == [("init", "gloo"), ("new_group", "gloo"), ("new_group", "gloo")]
    assert (groups.training.backend, groups.control.device, groups.checkpoint.device) == ("gloo", CPU, CPU)
    assert not groups.training.refuses_cpu
    groups.interrupt()  # gloo: the lost peer already failed the collective
    groups.teardown(failed=True)
    groups.teardown(failed=True)  # twice: nothing more
    assert ops.calls[3:] == [("destroy",)]


def test_nccl_groups_abort_their_communicators_before_the_destroy(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    ops = RecordingOps()
    groups = form("cuda", ops)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # clean up only: the rank's process lives on
    assert ops.calls[:3] == [("init", "nccl"), ("new_group", "gloo"), ("new_group", "gloo")]
    assert groups.training.device.type == "cuda" and groups.control.device == CPU
    groups.interrupt()  # from the actor's second thread, while a collective waits
    groups.teardown(failed=True)  # the rebuild: already aborted, not again
    assert ops.calls[3:] == [("abort", "nccl-world"), ("destroy",)]
    ops2 = RecordingOps()
    form("cuda", ops2).teardown(failed=False)  # a clean end: no abort
    assert ops2.calls[3:] == [("destroy",)]


def test_a_users_nccl_error_handling_is_kept(monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    form("cuda", RecordingOps())
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_as_nccl_marks_the_training_group_only():
    groups = form("cpu", RecordingOps(), check="as_nccl")
    assert groups.training.refuses_cpu and not groups.control.refuses_cpu and not groups.checkpoint.refuses_cpu
    with pytest.raises(ValueError, match="collective check must be one of"):
        form("cpu", RecordingOps(), check="strict")


# ---- layering: no collective outside the module ---------------------------------------------------
def collective_calls(root: Path) -> list[str]:
    """`file:line name` for each torch.distributed collective called (or imported by name)
    outside trainer/collectives.py."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == MODULE:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases = {"torch.distributed"}  # names bound to torch.distributed in this file
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
            elif isinstance(node, ast.ImportFrom) and node.module == "torch":
                aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
            elif isinstance(node, ast.ImportFrom) and node.module in ("torch.distributed",
                                                                      "torch.distributed.distributed_c10d"):
                found += [f"{rel}:{node.lineno} imports {a.name}" for a in node.names if a.name in COLLECTIVES]
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
                owner = ast.unparse(node.func.value)
                if owner in aliases or owner.startswith("torch.distributed"):
                    found.append(f"{rel}:{node.lineno} calls {owner}.{node.func.attr}")
    return found


def test_no_collective_is_called_outside_the_module():
    assert collective_calls(PACKAGE) == []


@pytest.mark.parametrize("line", [
    "import torch.distributed as dist\ndist.all_reduce(x, group=pg)\n",
    "import torch\ntorch.distributed.barrier()\n",
    "from torch import distributed as d\nd.broadcast(t, src=0)\n",
    "from torch.distributed import all_gather_object\n",
])
def test_the_layering_scan_finds_a_stray_collective(tmp_path, line):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "stray.py").write_text(line)
    (tmp_path / MODULE).write_text(line)  # the module itself may
    (found,) = collective_calls(tmp_path)
    assert found.startswith("trainer/stray.py:")
