"""Reading a DCP checkpoint without running code from it.

Anyone who can write to the checkpoint folder must not be able to run code in the trainer.
Plain DCP falls short of that in two places, both closed here:

- `FileSystemReader.read_metadata` unpickles `.metadata` with `pickle.load`.
  `SafeFileSystemReader` unpickles it with `MetadataUnpickler`, which builds only the types a
  DCP metadata file holds (DCP's metadata dataclasses, `torch.Size`, dtypes, layouts, paths)
  and refuses any other global: a pickle that names `os.system` fails before it is called.
- `DefaultLoadPlanner.load_bytes` reads every non-tensor value (an optimizer's
  `param_groups`) with `torch.load(weights_only=False)`. `SafeLoadPlanner` reads it with
  `weights_only=True` (tensors and plain containers only).

Tensors are already read with `torch.load(weights_only=True)` by DCP itself.

The order of a restore (`CheckpointManager.load`) is: `verify` first, which compares the
sha256 of every file, `.metadata` included, with the sealed manifest, and refuses a changed
file before anything reads it; only then this module, which parses `.metadata`. The checksum
catches damage (a same-size overwrite of a data file); the restricted unpickler holds even
against someone who rewrote the manifest to match a forged `.metadata`.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ettflow.trainer.checkpoint.config import CheckpointError
from ettflow.trainer.checkpoint.layout import DCP_METADATA

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# (module, name) of every global a DCP `.metadata` pickle names besides the metadata module's
# own types and torch dtypes. They are torch internals: a torch upgrade that renames one makes
# the restore refuse the file by name (tests/test_checkpoint_protocol.py catches it first).
_ALLOWED = frozenset({
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # returns a torch.layout for its name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP metadata file, building only the types such a file holds."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _DCP_METADATA_MODULE and not name.startswith("__"):
            found = super().find_class(module, name)
            if isinstance(found, type):  # its dataclasses and enums, never a function
                return found
        raise pickle.UnpicklingError(
            f"{module}.{name} is not a type a DCP metadata file holds: the file was not written by DCP "
            "(or by a DCP this ettflow does not know); refusing to load it"
        )


def read_dcp_metadata(folder: Path | str, data: bytes | None = None) -> Metadata:
    """The DCP metadata of a checkpoint folder, through `MetadataUnpickler` (`data`: the
    file's bytes, already read and checked: a staged anchor's, `staged_anchor.py`).

    Raises CheckpointError when the file is unreadable or names a global outside the list."""
    path = Path(folder) / DCP_METADATA
    try:
        with (open(path, "rb") if data is None else io.BytesIO(data)) as f:
            metadata = MetadataUnpickler(f).load()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(f"refusing to read {path}: {e}") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"refusing to read {path}: it holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """A FileSystemReader whose `.metadata` is read by `read_dcp_metadata` (no code runs)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank DCP metadata files are not used by ettflow checkpoints")
        metadata = self._metadata()
        if getattr(metadata, "storage_meta", None) is None:  # what FileSystemReader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _metadata(self) -> Metadata:
        """The checkpoint's `.metadata` (from its folder; a staged anchor's from memory)."""
        return read_dcp_metadata(Path(self.path))


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor values with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # weights_only refuses any other global: UnpicklingError and kin
            raise CheckpointError(f"refusing to load {fqn}: it is not plain data ({e})") from e
        if not self.flatten_state_dict:
            self.state_dict[fqn] = obj
            return
        # what the parent does with DCP's set_element: put it where the template had it
        path = self.mappings[fqn]
        parent: Any = self.original_state_dict
        try:
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = obj
        except (KeyError, IndexError, TypeError) as e:
            raise CheckpointError(f"the load template has no place for {fqn} ({path}): {e}") from e
