"""DCP's save into host memory: the anchor handed off by the ranks, written by the driver.

At the end of a run each rank takes part in an ordinary `dcp.save` whose storage is this
process's memory (`HostWriter`): DCP plans collectively as always (rank 0's global plan and
`.metadata`), serializes every rank's items exactly as `FileSystemWriter` does, and each rank
ends with the bytes of its own files (`__<rank>_0.distcp`; rank 0 also `.metadata`). Those
bytes are the whole checkpoint: written into a folder as they are, they are the folder
`FileSystemWriter` would have written. So the ranks can hand them off (`AnchorHandOff`),
release their devices, and a CPU process (the driver, `anchor_seal.py`) writes, hashes,
seals and marks the anchor while no device waits for the disk.

What stays on the ranks' clock is the copy out of the devices and the serialization in
memory; the disk write, its fsyncs and the checksums leave it.
"""

from __future__ import annotations

import io
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from pathlib import PurePosixPath

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystemBase

HOST_PREFIX = "host-memory"  # the checkpoint id of a save into memory (never a real path)


class _KeptOnClose(io.BytesIO):
    """A stream whose bytes become the file when it closes (DCP's writer closes it itself)."""

    def __init__(self, files: dict[str, bytes], name: str) -> None:
        super().__init__()
        self._files, self._file = files, name

    def close(self) -> None:
        if not self.closed:
            self._files[self._file] = self.getvalue()
        super().close()


class HostFiles(FileSystemBase):
    """A flat folder of files in this process's memory, as DCP's writer uses a file system:
    streams, renames, existence. Names are relative to the save's folder."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    @staticmethod
    def _name(path: str | os.PathLike) -> str:
        return PurePosixPath(str(path)).name

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            raise ValueError(f"HostFiles only writes (mode 'wb'), got {mode!r}")
        stream = _KeptOnClose(self.files, self._name(path))
        with stream:
            yield stream

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{path}/{suffix}"

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.files[self._name(new_path)] = self.files.pop(self._name(path))

    def init_path(self, path: str | os.PathLike) -> str:
        return str(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return str(checkpoint_id).startswith(HOST_PREFIX)

    def exists(self, path: str | os.PathLike) -> bool:
        return self._name(path) in self.files

    def rm_file(self, path: str | os.PathLike) -> None:
        del self.files[self._name(path)]


class HostWriter(FileSystemWriter):
    """`FileSystemWriter` writing into `HostFiles` (no fsync: memory has nothing to flush; the
    process that writes the files to disk fsyncs them). `files` after the save: this rank's
    files by name."""

    def __init__(self, step: int) -> None:
        super().__init__(f"{HOST_PREFIX}/step_{step}", sync_files=False, overwrite=True)
        self.fs = HostFiles()

    @property
    def files(self) -> Mapping[str, bytes]:
        return dict(self.fs.files)
