"""A rank's model state as checksums: what proves a restore bitwise, without shipping tensors.

`state_fingerprint(model.state_dict())` lists, for every tensor this rank holds, its key, the
offsets and sizes of the piece it holds in the whole tensor (a ShardedTensor's local shards;
a plain tensor is one piece at offset 0) and the sha256 of the piece's bytes. A warm start
records it in its `checkpoint_restore` phase, so a test (or a person) can check that the
parameters a refresh starts from are bit for bit those of its parent anchor:
`fingerprint_mismatches(entries, whole)` compares the entries with whole tensors read from
the checkpoint (e.g. `publish.anchor.load_float_model(...).state_dict()`).

Hashing costs one pass over the rank's parameters in memory, less than the sha256 `verify`
already takes over the checkpoint's files before the restore.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (any dtype; row-major)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def _pieces(value: Any) -> list[tuple[list[int], torch.Tensor]]:
    from ettflow.trainer._torch_compat import sharded_tensor_types

    _, ShardedTensor = sharded_tensor_types()
    if isinstance(value, ShardedTensor):
        return [(list(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    local = getattr(value, "to_local", None)  # a DTensor: its local piece, offsets unknown here
    if callable(local):
        return [([], local())]
    if isinstance(value, torch.Tensor):
        return [([0] * value.dim(), value)]
    return []


def state_fingerprint(state_dict: Mapping[str, Any]) -> list[dict[str, Any]]:
    """[{key, offsets, sizes, sha256}] for every tensor piece this rank holds, in key order
    (empty pieces skipped; a DTensor piece has `offsets` []: not comparable by position)."""
    out = []
    for key in sorted(state_dict):
        for offsets, piece in _pieces(state_dict[key]):
            if piece.numel() == 0:
                continue
            out.append({"key": key, "offsets": offsets, "sizes": list(piece.shape), "sha256": tensor_sha256(piece)})
    return out


def fingerprint_mismatches(entries: list[Mapping[str, Any]], whole: Mapping[str, torch.Tensor]) -> list[str]:
    """The entries whose piece of the whole tensor (by key, offsets and sizes) differs, or
    whose key is not in `whole`; [] when every piece is bitwise equal."""
    bad = []
    for e in entries:
        tensor = whole.get(e["key"])
        if tensor is None or not e["offsets"] and e["sizes"]:
            bad.append(f"{e['key']}: not in the reference state" if tensor is None else f"{e['key']}: no offsets")
            continue
        piece = tensor
        for dim, (start, size) in enumerate(zip(e["offsets"], e["sizes"])):
            piece = piece.narrow(dim, start, size)
        if tensor_sha256(piece) != e["sha256"]:
            bad.append(f"{e['key']}[{e['offsets']} +{e['sizes']}]: sha256 differs")
    return bad
