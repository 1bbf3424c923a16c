"""Delta snapshots: a published snapshot that holds only what changed since its base snapshot.

A refresh changes the rows its windows looked up, so most rows of a snapshot's int8 tables are
the same bytes as in the current snapshot's. A delta snapshot (`PublishConfig.delta_on`: the
current snapshot's folder) is the full snapshot validated as always, then stored as:

- for each table of each quantized TBE buffer (`...tbes.<i>.weights_host`, `_dev` or `_uvm`: a flat
  uint8 buffer, each table's rows at its `weights_offsets`, each row its int8 values and fp16 scale and bias,
  quantized as the snapshot is), the ids of the rows whose bytes differ from the base's and those
  rows' bytes (`ids/<buffer>/<table>`, `rows/<buffer>/<table>`);
- every other tensor of the module's state that differs from the base's, whole (`whole/<key>`:
  the MLPs, the traced constants);

in `delta-0.bin` + `delta-0.json` (raw bytes and a JSON index: no pickle, `delta.write_pack`),
beside its manifest, whose `delta` names the base folder, the sha256 of the base's model file
and the sizes. A base may itself be a delta: `materialize` resolves the chain down to a full
snapshot, verifies every folder against its manifest and every link's base checksum, applies
each delta in order onto the base module's state, and saves the full module (`model.pt`).
Materializing reproduces the full snapshot's state exactly (the rows are copied bytes): the
publish checks that the materialized model's held-out predictions equal the full one's before
it stores the delta (`publisher.publish_snapshot`).

A snapshot is stored full instead, the first of a new chain, when its base is `REBASE_AFTER`
deltas deep (`NewBase`) or when the base's chain cannot be materialized (a link damaged or
gone: `DeltaSnapshotRefused`); otherwise a chain would grow past `MAX_CHAIN`, or one bad link
would fail every later publish.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ettflow.publish.config import PublishError, SnapshotValidationError
from ettflow.publish.manifest import SnapshotManifest, install, read_manifest, staging_dir, verify_snapshot
from ettflow.publish.snapshot import MODEL_FILE
from ettflow.trainer.checkpoint.verify import sha256_file

PACK = "delta"  # delta-0.bin, delta-0.json
# a quantized TBE's flat row buffers (torchrec's int8 inference tables), by fbgemm's
# EmbeddingLocation of each table (`weights_placements`): DEVICE, MANAGED, MANAGED_CACHING, HOST
BUFFER_OF = {0: "weights_dev", 1: "weights_uvm", 2: "weights_uvm", 3: "weights_host"}
ROW_ALIGNMENT = 16  # fbgemm's int-n-bit rows (torchrec's quantized tables' default), in bytes
CACHELINE = 128  # fbgemm pads each table's rows to this (`align_to_cacheline`)
MAX_CHAIN = 32  # deltas on deltas a materialization follows at most
# a snapshot whose base is this many deltas deep is stored full (a new base): every
# materialization (the gate's at each publish, a user's) reads and verifies the whole chain, and
# retention keeps every base a kept snapshot needs, so a chain stays short and bounded; a
# continuous refresh that went on delta after delta would reach MAX_CHAIN and fail to publish
REBASE_AFTER = 16


class DeltaSnapshotRefused(PublishError):
    """The new snapshot cannot be a delta on the base (another architecture or schema, a base
    whose chain cannot be materialized): publish it full."""

    retryable = False


class NewBase(DeltaSnapshotRefused):
    """The base is REBASE_AFTER deltas deep: the new snapshot is stored full, as planned."""


def _tables(state: Mapping[str, torch.Tensor], key: str) -> list[tuple[int, int, int, int]]:
    """(table, byte offset, rows, row bytes) of each table that lies in the flat buffer `key`
    (a TBE's `weights_dev`, `weights_host` or `weights_uvm`, as each table's placement says).
    A row's bytes are fbgemm's for the table's dim and type (`rounded_row_size_in_bytes`, rows
    aligned to `ROW_ALIGNMENT`); a table's region is its rows padded to a cache line
    (`CACHELINE`), so the offsets alone do not give the row size of a small table."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import rounded_row_size_in_bytes

    prefix, buffer = key.rsplit(".", 1)
    placements = [int(x) for x in state[f"{prefix}.weights_placements"]]
    offsets = [int(x) for x in state[f"{prefix}.weights_offsets"]]
    rows = [int(x) for x in state[f"{prefix}.rows_per_table"]]
    dims = [int(b) - int(a) for a, b in zip(state[f"{prefix}.D_offsets"][:-1], state[f"{prefix}.D_offsets"][1:])]
    types = [int(x) for x in state[f"{prefix}.weights_tys"]]
    mine = [t for t, where in enumerate(placements) if BUFFER_OF.get(where) == buffer]
    total, ends = state[key].numel(), sorted({offsets[t] for t in mine})
    out = []
    for t in mine:
        off, n = offsets[t], rows[t]
        later = [e for e in ends if e > off]
        end = later[0] if later else total
        width = rounded_row_size_in_bytes(dims[t], SparseType.from_int(types[t]), ROW_ALIGNMENT)
        if n <= 0 or not n * width <= end - off < n * width + CACHELINE:
            raise DeltaSnapshotRefused(f"{key}: table {t} at byte {off} with {n} rows of {width} bytes does not "
                                       f"fill its {end - off} bytes (rows padded to a {CACHELINE}-byte line): "
                                       "its rows cannot be diffed")
        out.append((t, off, n, width))
    return out


def diff_state(base: Mapping[str, torch.Tensor],
               new: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, stats) of the delta that turns the `base` module state into `new`."""
    if base.keys() != new.keys():
        raise DeltaSnapshotRefused(f"the snapshots' modules differ (keys {sorted(set(base) ^ set(new))[:5]})")
    out: dict[str, torch.Tensor] = {}
    changed = total = 0
    for key, value in new.items():
        was = base[key]
        if was.shape != value.shape or was.dtype != value.dtype:
            raise DeltaSnapshotRefused(f"{key} is {tuple(was.shape)} {was.dtype} in the base and "
                                       f"{tuple(value.shape)} {value.dtype} now")
        if key.rsplit(".", 1)[-1] in BUFFER_OF.values() and value.dtype == torch.uint8 and value.numel():
            if not torch.equal(_layout(base, key), _layout(new, key)):
                raise DeltaSnapshotRefused(f"{key}: the tables are laid out differently in the base")
            for t, off, n, width in _tables(new, key):
                a, b = was[off:off + n * width].view(n, width), value[off:off + n * width].view(n, width)
                ids = (a != b).any(dim=1).nonzero().flatten()
                out[f"ids/{key}/{t}"], out[f"rows/{key}/{t}"] = ids, b.index_select(0, ids).clone()
                changed, total = changed + int(ids.numel()), total + n
        elif not torch.equal(was, value):
            out[f"whole/{key}"] = value.detach().clone()
    return out, {"changed_rows": changed, "rows": total}


def _layout(state: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    prefix = key.rsplit(".", 1)[0]
    return torch.cat([state[f"{prefix}.{name}"].to(torch.int64)
                      for name in ("weights_offsets", "rows_per_table", "weights_placements")])


def apply_state(state: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """Write a delta into a module's state tensors, in place."""
    with torch.no_grad():
        for name, value in tensors.items():
            kind, rest = name.split("/", 1)
            if kind == "whole":
                state[rest].copy_(value)
            elif kind == "ids":
                key, t = rest.rsplit("/", 1)
                (off, n, width), = [(o, n, w) for i, o, n, w in _tables(state, key) if i == int(t)]
                state[key][off:off + n * width].view(n, width).index_copy_(0, value, tensors[f"rows/{key}/{t}"])


def write_delta_snapshot(base_folder: Path, new_model: Path, folder: Path, *, rebuilt: Path) -> dict[str, Any]:
    """Write the delta of `new_model` (a full snapshot's module file) on the snapshot in
    `base_folder` into `folder`, and as `rebuilt` the module that delta, read back from
    `folder`, makes of the base (what a materialization of it gives: the publish scores it);
    the manifest's `delta` section. The base's chain is loaded and verified once for both."""
    from ettflow.trainer.checkpoint.delta import read_pack, write_pack

    try:
        depth = delta_depth(Path(base_folder))
        if depth >= REBASE_AFTER:
            raise NewBase(f"the base is {depth} deltas deep (a full snapshot every {REBASE_AFTER + 1} publishes): "
                          "this one is the chain's new base")
        base_module, chain = _materialized(Path(base_folder))
    except DeltaSnapshotRefused:
        raise
    except PublishError as exc:  # a damaged or missing link: the next snapshots start a new chain
        raise DeltaSnapshotRefused(f"the base cannot be materialized ({exc})") from exc
    base = chain[-1][1]
    base_state = base_module.state_dict()  # the module's own tensors
    tensors, stats = diff_state(base_state, _state(new_model))
    nbytes = write_pack(folder, 0, tensors, {"format": "ettflow-snapshot-delta/1"}, stem=PACK)
    written, _meta = read_pack(folder, 0, stem=PACK)
    apply_state(base_state, written)
    torch.jit.save(base_module, str(rebuilt))
    return {"base": str(Path(base_folder).resolve()), "base_run_id": base.run_id,
            "base_sha256": _model_sha(base_folder, base), "base_step": base.step, **stats, "bytes": nbytes,
            "full_bytes": new_model.stat().st_size}


def materialized_file(folder: Path, out_dir: Path) -> Path:
    """The full module file the snapshot in `folder` stands for, in `out_dir` (a delta:
    materialized there; a full snapshot: its own model file)."""
    module, chain = _materialized(Path(folder))
    if len(chain) == 1:
        return Path(folder) / MODEL_FILE
    out = Path(out_dir) / MODEL_FILE
    torch.jit.save(module, str(out))
    return out


def materialize(folder: Path | str, output_root: Path | str, *, run_id: str | None = None) -> SnapshotManifest:
    """A full snapshot (`model.pt`) of the delta snapshot in `folder`, installed as
    `<output_root>/<run_id or its run id>/`: its chain resolved down to a full snapshot, each
    folder verified, each link's base checksum checked, the deltas applied in order."""
    module, chain = _materialized(Path(folder))
    top = chain[-1][1]
    final = Path(output_root) / (run_id or top.run_id)
    tmp = staging_dir(Path(output_root), final.name)
    try:
        torch.jit.save(module, str(tmp / MODEL_FILE))
        draft = SnapshotManifest(**{**asdict(top), "path": str(final), "files": {},
                                    "delta": {"materialized_from": str(Path(folder).resolve()),
                                              "chain": [str(f) for f, _ in chain]}})
        return install(tmp, draft, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _materialized(folder: Path) -> tuple[torch.jit.ScriptModule, list[tuple[Path, SnapshotManifest]]]:
    """The full module the snapshot in `folder` stands for (a delta: its chain applied), and the chain."""
    from ettflow.trainer.checkpoint.delta import read_pack

    chain = chain_of(folder)
    root_folder, root = chain[0]
    module = load_module(root_folder / _model_of(root))
    state = module.state_dict()  # the module's own tensors: written in place
    for link_folder, _ in chain[1:]:
        tensors, _meta = read_pack(link_folder, 0, stem=PACK)
        apply_state(state, tensors)
    return module, chain


def chain_of(folder: Path) -> list[tuple[Path, SnapshotManifest]]:
    """(folder, manifest) from the full snapshot at the root of `folder`'s chain up to it,
    every folder verified and every delta's base checksum matching; raises saying which link is wrong."""
    out: list[tuple[Path, SnapshotManifest]] = []
    at: Path | None = folder
    while at is not None:
        if len(out) > MAX_CHAIN:
            raise PublishError(f"{folder}: a chain of over {MAX_CHAIN} delta snapshots: materialize an older one first")
        manifest = verify_snapshot(at)
        if out and _model_sha(at, manifest) != out[-1][1].delta.get("base_sha256"):
            raise SnapshotValidationError(f"{out[-1][0]} is a delta on {at}, whose model file changed since (its "
                                          "sha256 is not the one the delta recorded): it cannot be materialized")
        out.append((at, manifest))
        at = Path(manifest.delta["base"]) if is_delta(manifest) else None
    return out[::-1]


def delta_depth(folder: Path) -> int:
    """How many deltas the snapshot in `folder` lies above the full snapshot at its chain's
    root (0: a full snapshot), read from the manifests alone (nothing verified: `chain_of`
    does); raises PublishError for an unreadable link or a chain over MAX_CHAIN."""
    depth, manifest = 0, read_manifest(folder)
    while is_delta(manifest):
        depth += 1
        if depth > MAX_CHAIN:
            raise PublishError(f"{folder}: a chain of over {MAX_CHAIN} delta snapshots")
        manifest = read_manifest(manifest.delta["base"])
    return depth


def is_delta(manifest: SnapshotManifest) -> bool:
    return bool(manifest.delta.get("base"))


def _model_of(manifest: SnapshotManifest) -> str:
    if is_delta(manifest):
        raise PublishError(f"{manifest.path} is a delta snapshot: materialize it (`ettflow publish --materialize`)")
    return MODEL_FILE


def _model_sha(folder: Path | str, manifest: SnapshotManifest) -> str:
    """The identity a delta on this snapshot records: its model file's sha256, or a delta's own pack's."""
    name = f"{PACK}-0.bin" if is_delta(manifest) else MODEL_FILE
    recorded = manifest.files.get(name, {}).get("sha256")
    return recorded or sha256_file(Path(folder) / name)


def _state(model_file: Path) -> dict[str, torch.Tensor]:
    return dict(load_module(model_file).state_dict())


def load_module(model_file: Path | str) -> torch.jit.ScriptModule:
    """A snapshot's TorchScript module, on the CPU. (TorchScript is the snapshot's format by
    design, `snapshot.py`: torch 2.13's deprecation note on `torch.jit.load` is not shown.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`torch.jit.load` is deprecated", category=DeprecationWarning)
        return torch.jit.load(str(model_file), map_location="cpu")
