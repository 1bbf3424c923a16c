"""The anchor handed off in host memory and sealed by the driver (`trainer/group/anchor_seal.py`,
`checkpoint/host_writer.py`), in one process: DCP's save into memory gives the files a folder
save gives; sealed, the folder verifies, reads back the same state and carries its marker; a
disk that fails a try leaves nothing torn and the host copy seals on the next; parts that do
not make one checkpoint are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ettflow.trainer.checkpoint.anchor import ANCHOR_FILE, AnchorInfo
from ettflow.trainer.checkpoint.host_writer import HostWriter
from ettflow.trainer.checkpoint.verify import verify
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.group.anchor_seal import SEALED_UNMARKED, HandOffError, check_handoffs, seal_anchor
from ettflow.trainer.model_config import ModelConfig
from ettflow.trainer.protocol import AnchorHandOff

STATE = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}, "step": 7}


def handoff(root: Path, *, rank: int = 0, step: int = 7, anchor: bool = True) -> AnchorHandOff:
    writer = HostWriter(step)
    dcp.save(STATE, storage_writer=writer, no_dist=True)
    info = AnchorInfo(run_id="r1", step=step, world_size=1, model=ModelConfig(), schema=criteo_schema(10),
                      cursor={"w0": [0, 5]}) if anchor else None
    return AnchorHandOff(rank=rank, step=step, world_size=1, root=str(root), files=tuple(sorted(writer.files.items())),
                         cursor=json.dumps({"w0": [0, 5]}), anchor=info)


def test_a_host_memory_save_sealed_is_the_checkpoint_a_folder_save_writes(tmp_path):
    part = handoff(tmp_path)
    assert {name for name, _ in part.files} == {".metadata", "__0_0.distcp"} and part.nbytes > 0
    sealed = seal_anchor([part], keep_last=2)
    assert sealed.path == tmp_path / "step_0000000007" and sealed.step == 7
    info = verify(sealed.path)  # sha256 of every file, the manifest, COMMITTED
    assert info.step == 7 and sealed.nbytes == part.nbytes  # the data files, as DCP wrote them
    assert json.loads((sealed.path / ANCHOR_FILE).read_text())["run_id"] == "r1"
    back = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)}, "step": 0}
    dcp.load(back, checkpoint_id=str(sealed.path), no_dist=True)
    assert torch.equal(back["model"]["w"], STATE["model"]["w"]) and back["step"] == 7
    assert not list(tmp_path.glob("*.tmp"))


def test_a_failed_write_leaves_nothing_torn_and_the_host_copy_seals_on_the_next_try(tmp_path):
    part = handoff(tmp_path)

    def full_disk(phase: str) -> None:
        if phase == "anchor_seal":
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        seal_anchor([part], keep_last=2, fault=full_disk)
    assert list(tmp_path.iterdir()) == []  # neither a .tmp folder nor a committed one
    assert verify(seal_anchor([part], keep_last=2).path).step == 7


def test_a_death_after_the_commit_leaves_the_folder_committed_without_its_marker(tmp_path):
    part = handoff(tmp_path)

    def killed(phase: str) -> None:
        if phase == SEALED_UNMARKED:
            raise KeyboardInterrupt  # stands for the process's end: nothing after it runs

    with pytest.raises(KeyboardInterrupt):
        seal_anchor([part], keep_last=2, fault=killed)
    (folder,) = tmp_path.iterdir()
    assert verify(folder).step == 7 and not (folder / ANCHOR_FILE).exists()  # a restart anchors it


def test_parts_that_do_not_make_one_checkpoint_are_refused(tmp_path):
    part = handoff(tmp_path)
    with pytest.raises(HandOffError, match="no rank"):
        check_handoffs([])
    with pytest.raises(HandOffError, match="ranks 0..0, got hand-offs of ranks \\[1\\]"):
        check_handoffs([handoff(tmp_path, rank=1)])
    with pytest.raises(HandOffError, match="no anchor marker"):
        check_handoffs([handoff(tmp_path, anchor=False)])
    two = [part, AnchorHandOff(rank=1, step=8, world_size=2, root=part.root, files=(("x", b""),), cursor="{}")]
    with pytest.raises(HandOffError, match="ranks 0..0|different checkpoints"):
        check_handoffs(two)
    bad = AnchorHandOff(rank=0, step=7, world_size=1, root=part.root, files=(("../escape", b""),), cursor="{}",
                        anchor=part.anchor)
    with pytest.raises(HandOffError, match="not one folder's"):
        check_handoffs([bad])
