"""Delta checkpoints of a sharded TorchRec model: only the embedding rows touched since the parent.

What a refresh changes in its embedding tables is the rows its batches looked up, a small and
skewed share of each table. TorchRec's tracker records those ids (`ModelDeltaTracker`,
enabled on the `DistributedModelParallel`: `enable_tracker`), and a delta (`capture_delta`)
holds, per rank:

- for every local shard of a sharded table, the touched rows (`ids/<key>/<i>`, `rows/<key>/<i>`)
  and the same rows of the fused optimizer's state (`optrows/<param>/<state>/<i>`);
- every other tensor of the model's state dict whole (`dense/<key>`: the dense arch, buffers);
- every other optimizer's state whole (`optim/<name>/...`), its param groups in the meta JSON.

Applying deltas in order onto the restored base (`apply_delta`) writes those rows and tensors
in place, so base + deltas equals the full checkpoint of the same step bit for bit: an
untouched row is not changed by the fused optimizer (its gradient is zero and the fused
kernel updates only the rows of the batch). A table sharded row-wise (a GPU plan) is refused
with `DeltaUnsupported` (its tracked ids are not checked against the shard's offsets here):
the caller takes a base and says so once.

Each rank's own step, data cursor and RNG state go in too (`own/...`, as `TrainState` saves
them in a base), so a restart resumes from the delta exactly as from a full checkpoint.

The files are written without pickle: one raw byte file per rank (`rank-<r>.bin`) and a JSON
index of its tensors (name, dtype, shape, offset), into `delta_<n>.tmp`; rank 0 seals it like
a checkpoint (`manifest.json` with the size and sha256 of every file, every rank's cursor,
the parent's step and commit digest, then `COMMITTED`) and renames it to `delta_<n>`: the
commit point. A read verifies every file before it reads a byte of tensor data. A delta names
its parent's digest, not only its step: a parent rewritten since (a restart that replayed to
the same step) does not carry deltas written on the old one. The chain around deltas (which
save is a base, what a restore reads, what retention keeps) is `delta_chain.py`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ettflow.trainer.checkpoint.config import CheckpointError, CheckpointStorageError, TornCheckpointError
from ettflow.trainer.checkpoint.layout import (
    COMMITTED,
    MANIFEST,
    atomic_write_text,
    delta_dir,
    fsync_dir,
    remove_tree,
)
from ettflow.trainer.checkpoint.save_errors import storage_error_of
from ettflow.trainer.checkpoint.state import TrainState, capture_rng, json_tensor, restore_rng, tensor_json
from ettflow.trainer.checkpoint.verify import sha256_file

DELTA_FORMAT = "ettflow-delta/1"
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                               torch.int16, torch.int8, torch.uint8, torch.bool)}


class DeltaUnsupported(CheckpointError):
    """The model's state cannot be saved as a delta (a row-wise sharded table, no tracker): take a base."""


def delta_folder(root: Path | str, step: int) -> Path:
    """The committed delta of `step` under a checkpoint root."""
    return delta_dir(Path(root), step)


def commit_digest(folder: Path | str) -> str:
    """A committed checkpoint's or delta's identity: the digest its COMMITTED marker holds."""
    return (Path(folder) / COMMITTED).read_text().strip()


# -- the tracker -------------------------------------------------------------------------------


class _Unwrapped:
    """The DMP's module as TorchRec's tracker expects to find it (`model.module`): the trainer's
    DMP wraps its dense part in no DDP (`model._Replicated`), so the wrapped module is the DLRM
    itself. Its FQNs are the DLRM's, as the state dict's are."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def named_modules(self, *args: Any, **kwargs: Any):
        return self.module.named_modules(*args, **kwargs)


def enable_tracker(dmp: Any) -> Any:
    """TorchRec's delta tracker on `dmp`, recording the ids every lookup touches (ID_ONLY: the
    rows themselves are read at the save, from the model)."""
    from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, Trackers, TrackingMode

    config = DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, delete_on_read=True)
    wrapped = dmp._dmp_wrapped_module
    if hasattr(wrapped, "module"):  # a DDP-wrapped dense part: TorchRec's own path
        return dmp.init_torchrec_delta_tracker(config)
    tracker = ModelDeltaTrackerTrec(model=_Unwrapped(wrapped), consumers=config.consumers,
                                    delete_on_read=config.delete_on_read, auto_compact=config.auto_compact,
                                    mode=config.tracking_mode, fqns_to_skip=config.fqns_to_skip)
    dmp.model_trackers[Trackers.DELTA_TRACKER.name] = tracker
    return tracker


def touched_rows(tracker: Any) -> dict[str, torch.Tensor]:
    """Table module FQN -> the sorted unique ids its lookups touched since the last call
    (consumed: the caller keeps them until its delta commits, `RowLedger`). The tracker's
    batch index moves on after each read (`step`): the trainer's loop calls the sharded
    module directly, not the DMP's forward, which is what moves it otherwise, and a lookup
    recorded under an index already read would be deleted unseen."""
    try:
        got = tracker.get_unique_ids()
    except ValueError:  # torchrec 1.8: torch.cat of an empty list when nothing was looked up since
        got = {}
    tracker.step()
    return {fqn: torch.unique(ids.to(torch.int64)) for fqn, ids in got.items()}


class RowLedger:
    """The rows touched since the last committed save, by table: what the tracker gave since
    (`add`), kept until a save of them commits (`committed`), so a failed or torn delta loses
    no row for the next one."""

    def __init__(self) -> None:
        self._rows: dict[str, torch.Tensor] = {}

    def add(self, rows: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for fqn, ids in rows.items():
            had = self._rows.get(fqn)
            self._rows[fqn] = ids if had is None else torch.unique(torch.cat([had, ids]))
        return self.rows()

    def rows(self) -> dict[str, torch.Tensor]:
        """Every row held now, by table."""
        return dict(self._rows)

    def committed(self) -> None:
        self._rows = {}


# -- capture and apply ---------------------------------------------------------------------------


def _table_of(key: str) -> str:
    """The tracker's FQN of a table parameter's state-dict key (`...embedding_bags.t0.weight`)."""
    return key.removesuffix(".weight")


def _local_shards(value: Any) -> list[Any] | None:
    shards = getattr(value, "local_shards", None)
    return list(shards()) if callable(shards) else None


def _rows_of(key: str, shard: Any, table_rows: int, touched: Mapping[str, torch.Tensor]) -> torch.Tensor:
    offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
    if offsets[0] != 0 or sizes[0] != table_rows:
        raise DeltaUnsupported(f"{key} is sharded by rows (a shard of rows {offsets[0]}..{offsets[0] + sizes[0]} of "
                               f"{table_rows}): delta checkpoints serve table- and column-wise shards only")
    return touched.get(_table_of(key), torch.empty(0, dtype=torch.int64)).to(shard.tensor.device)


def capture_delta(model: torch.nn.Module, optimizers: Mapping[str, Any], touched: Mapping[str, torch.Tensor], *,
                  sparse: str = "sparse") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, meta) of this rank's delta: see the module's docstring. `optimizers[sparse]`
    is the fused embedding optimizer (its state sharded like the tables); every other
    optimizer is saved whole."""
    out: dict[str, torch.Tensor] = {}
    rows_by_param: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for key, value in model.state_dict().items():
            shards = _local_shards(value)
            if shards is None:
                out[f"dense/{key}"] = value.detach().clone()
                continue
            rows_by_param[key] = []
            for i, shard in enumerate(shards):
                ids = _rows_of(key, shard, value.size(0), touched)
                rows_by_param[key].append(ids)
                out[f"ids/{key}/{i}"] = ids.clone()
                out[f"rows/{key}/{i}"] = shard.tensor.index_select(0, ids).clone()
        for param, states in optimizers[sparse].state_dict()["state"].items():
            for name, value in states.items():
                shards = _local_shards(value)
                if shards is None:
                    raise DeltaUnsupported(f"the fused optimizer's state {name} of {param} is not sharded like its "
                                           "table: delta checkpoints need it row by row")
                for i, shard in enumerate(shards):
                    ids = rows_by_param.get(param, [])
                    if i >= len(ids):
                        raise DeltaUnsupported(f"{param}: optimizer shard {i} has no table shard to match")
                    out[f"optrows/{param}/{name}/{i}"] = shard.tensor.index_select(0, ids[i]).clone()
        groups: dict[str, Any] = {}
        for name, opt in optimizers.items():
            if name == sparse:
                continue
            sd = opt.state_dict()
            groups[name] = sd["param_groups"]
            for idx, states in sd["state"].items():
                for k, v in states.items():
                    if not isinstance(v, torch.Tensor):
                        raise DeltaUnsupported(f"optimizer {name}'s state {k} of parameter {idx} is not a tensor")
                    out[f"optim/{name}/{idx}/{k}"] = v.detach().clone()
    return out, {"param_groups": groups, "sparse": sparse}


def own_tensors(state: TrainState, step: int) -> dict[str, torch.Tensor]:
    """This rank's step, data cursor and RNG state, as a base holds them (`state.py`)."""
    plain, rng_torch, rng_cuda = capture_rng()
    out = {"own/state": json_tensor({"step": step, "cursor": json.loads(state.cursor_json()), "rng": plain}),
           "own/rng_torch": rng_torch}
    if rng_cuda is not None:
        out["own/rng_cuda"] = rng_cuda
    return out


def apply_own(state: TrainState, tensors: Mapping[str, torch.Tensor]) -> None:
    """Set the step, data cursor and RNG state the delta's rank saved."""
    mine = tensor_json(_need(tensors, "own/state"))
    if not isinstance(mine, dict) or not isinstance(mine.get("step"), int) or not isinstance(mine.get("cursor"), dict):
        raise CheckpointError(f"the delta's own/state must hold {{'step': int, 'cursor': dict, 'rng': dict}}, "
                              f"got {str(mine)[:200]}")
    state.step, state.cursor = mine["step"], mine["cursor"]
    restore_rng(mine["rng"], tensors["own/rng_torch"], tensors.get("own/rng_cuda"))


def apply_delta(model: torch.nn.Module, optimizers: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                meta: Mapping[str, Any]) -> int:
    """Write one delta into the restored state, in place; the rows written (all tables)."""
    sparse = meta["sparse"]
    written = 0
    with torch.no_grad():
        sd = model.state_dict()
        for key, value in sd.items():
            shards = _local_shards(value)
            if shards is None:
                value.copy_(_need(tensors, f"dense/{key}"))
                continue
            for i, shard in enumerate(shards):  # (read on the CPU: onto the shard's device)
                ids = _need(tensors, f"ids/{key}/{i}").to(shard.tensor.device)
                shard.tensor.index_copy_(0, ids, _need(tensors, f"rows/{key}/{i}").to(shard.tensor.device))
                written += int(ids.numel())
        for param, states in optimizers[sparse].state_dict()["state"].items():
            for name, value in states.items():
                for i, shard in enumerate(_local_shards(value) or []):
                    ids = _need(tensors, f"ids/{param}/{i}").to(shard.tensor.device)
                    rows = _need(tensors, f"optrows/{param}/{name}/{i}").to(shard.tensor.device)
                    shard.tensor.index_copy_(0, ids, rows)
    for name, opt in optimizers.items():
        if name == sparse:
            continue
        state: dict[int, dict[str, torch.Tensor]] = {}
        prefix = f"optim/{name}/"
        for key, value in tensors.items():
            if key.startswith(prefix):
                idx, k = key[len(prefix):].split("/", 1)
                state.setdefault(int(idx), {})[k] = value
        opt.load_state_dict({"state": state, "param_groups": _as_groups(meta["param_groups"][name], opt)})
    return written


def _as_groups(saved: Sequence[Mapping[str, Any]], opt: Any) -> list[dict[str, Any]]:
    """Param groups read back from JSON: a value the optimizer holds as a tuple (Adam's betas)
    is a tuple again, so the restored state equals the saved one exactly."""
    current = opt.param_groups
    out = []
    for i, group in enumerate(saved):
        now = current[i] if i < len(current) else {}
        out.append({k: tuple(v) if isinstance(now.get(k), tuple) and isinstance(v, list) else v
                    for k, v in group.items()})
    return out


def _need(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in tensors:
        raise CheckpointError(f"the delta has no tensor {key}: it was written for another model or sharding plan; "
                              "restore from a base")
    return tensors[key]


# -- files: raw bytes and a JSON index, sealed ---------------------------------------------------


def write_pack(folder: Path, rank: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], *,
               stem: str = "rank") -> int:
    """Write this rank's tensors (raw bytes, `<stem>-<rank>.bin`) and their index with `meta`
    (JSON, `<stem>-<rank>.json`); the bytes written."""
    folder.mkdir(parents=True, exist_ok=True)
    index, offset = [], 0
    with open(folder / f"{stem}-{rank}.bin", "wb") as f:
        for name, t in tensors.items():
            if str(t.dtype) not in _DTYPES:
                raise CheckpointError(f"delta tensor {name} has dtype {t.dtype}, which the delta format does not hold")
            data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
            f.write(data)
            index.append({"name": name, "dtype": str(t.dtype), "shape": list(t.shape), "offset": offset,
                          "length": len(data)})
            offset += len(data)
    atomic_write_text(folder / f"{stem}-{rank}.json", json.dumps({"tensors": index, "meta": dict(meta)}))
    return offset


def read_pack(folder: Path, rank: int, *, stem: str = "rank") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors and meta (verify the folder first: nothing here checks checksums)."""
    index = json.loads((folder / f"{stem}-{rank}.json").read_text())
    data = (folder / f"{stem}-{rank}.bin").read_bytes()
    out: dict[str, torch.Tensor] = {}
    for entry in index["tensors"]:
        dtype = _DTYPES.get(entry["dtype"])
        start, length = int(entry["offset"]), int(entry["length"])
        if dtype is None or start < 0 or start + length > len(data):
            raise TornCheckpointError(folder, f"{stem}-{rank}.json describes tensor {entry.get('name')!r} outside its "
                                      "data or of an unknown dtype", file=f"{stem}-{rank}.json")
        raw = torch.frombuffer(bytearray(data[start:start + length]), dtype=torch.uint8) if length else \
            torch.empty(0, dtype=torch.uint8)
        out[entry["name"]] = raw.view(dtype).reshape(entry["shape"])
    return out, index["meta"]


@dataclass(frozen=True, kw_only=True)
class DeltaInfo:
    """A committed, verified delta."""

    step: int
    parent: int
    parent_digest: str  # the COMMITTED digest of the parent it was written on
    digest: str  # its own COMMITTED digest (a child names it)
    path: Path
    world_size: int
    bytes: int
    cursors: tuple[Mapping[str, Any], ...]  # per rank, in rank order (as a base's manifest)


def _canonical_sha(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal_delta(folder: Path, *, step: int, parent: int, parent_digest: str, world_size: int) -> int:
    """Seal a delta every rank finished writing: manifest (size and sha256 of every file, every
    rank's cursor, the parent's step and digest) then COMMITTED. Rank 0 calls it once the
    others are done. Its size in bytes."""
    files = {}
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.name not in (MANIFEST, COMMITTED):
            files[f.name] = {"size": f.stat().st_size, "sha256": sha256_file(f)}
    missing = [r for r in range(world_size) if f"rank-{r}.bin" not in files or f"rank-{r}.json" not in files]
    if missing:
        raise CheckpointError(f"{folder}: rank(s) {missing} did not write their part of the delta")
    cursors = [json.loads((folder / f"rank-{r}.json").read_text())["meta"].get("cursor", {})
               for r in range(world_size)]
    body = {"format": DELTA_FORMAT, "step": step, "parent": parent, "parent_digest": parent_digest,
            "world_size": world_size, "cursors": cursors, "created_at": time.time(), "files": files}
    digest = _canonical_sha(body)
    atomic_write_text(folder / MANIFEST, json.dumps({**body, "manifest_sha256": digest}, indent=1))
    atomic_write_text(folder / COMMITTED, digest + "\n")
    return sum(f["size"] for f in files.values())


def verify_delta(folder: Path | str) -> DeltaInfo:
    """Verify a committed delta: marker, manifest, and the size and sha256 of every file.
    Raises TornCheckpointError saying what is wrong."""
    folder = Path(folder)
    if not (folder / COMMITTED).is_file():
        raise TornCheckpointError(folder, f"no {COMMITTED} marker: the delta never committed", file=COMMITTED)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        recorded = manifest.pop("manifest_sha256")
    except (OSError, ValueError, KeyError) as e:
        raise TornCheckpointError(folder, f"{MANIFEST} is missing or unreadable ({e})", file=MANIFEST) from e
    if _canonical_sha(manifest) != recorded or (folder / COMMITTED).read_text().strip() != recorded:
        raise TornCheckpointError(folder, f"{MANIFEST} does not match its sha256 or {COMMITTED}", file=MANIFEST)
    if manifest.get("format") != DELTA_FORMAT:
        raise TornCheckpointError(folder, f"unknown format {manifest.get('format')!r}", file=MANIFEST)
    for name, expect in sorted(manifest["files"].items()):
        f = folder / name
        if "/" in name or not f.is_file() or f.stat().st_size != expect["size"]:
            raise TornCheckpointError(folder, f"{name} is missing or not the size the manifest recorded", file=name)
        if sha256_file(f) != expect["sha256"]:
            raise TornCheckpointError(folder, f"{name} sha256 mismatch (its bytes changed after the commit)",
                                      file=name)
    return DeltaInfo(step=int(manifest["step"]), parent=int(manifest["parent"]),
                     parent_digest=str(manifest.get("parent_digest", "")), digest=recorded, path=folder,
                     world_size=int(manifest["world_size"]), bytes=sum(e["size"] for e in manifest["files"].values()),
                     cursors=tuple(dict(c) for c in manifest.get("cursors", ())))


# -- a delta's save and a chain's restore, on every rank ----------------------------------------


@dataclass(frozen=True, kw_only=True)
class DeltaCommit:
    """The outcome of one delta save, the same on every rank. `unsupported`: a rank could not
    express its state as a delta (`DeltaUnsupported`): the caller takes bases from now on."""

    step: int
    parent: int
    committed: bool
    path: Path | None = None
    digest: str = ""
    bytes: int = 0  # the whole delta's (every rank's files)
    error: str | None = None
    unsupported: bool = False
    errno: int | None = None  # a storage fault behind `error` (ENOSPC, EIO, ...) and the path it hit
    error_path: str | None = None

    def failure(self) -> CheckpointError:
        """The error a failed delta raises: a CheckpointStorageError (errno, path: a classifier
        sorts it as `storage`) when a storage fault is behind it, else a CheckpointError."""
        message = f"delta checkpoint of step {self.step} failed: {self.error}"
        if self.errno is not None:
            return CheckpointStorageError(self.errno, message, self.error_path or "")
        return CheckpointError(message)


@dataclass(frozen=True)
class CapturedDelta:
    """This rank's part of the delta of `step` on `parent`, copied off the live state into host
    memory (what the loop waits for): training may go on while `commit_captured` writes it.
    `problem`: why it cannot be written (`unsupported`: it cannot be a delta at all)."""

    step: int
    parent: int
    parent_digest: str
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    problem: str | None = None
    unsupported: bool = False


def capture(state: TrainState, *, step: int, parent: int, parent_digest: str,
            touched: Mapping[str, torch.Tensor]) -> CapturedDelta:
    """The blocking part of a delta save: the touched rows, their optimizer state and the dense
    state gathered (on the device: `capture_delta` copies them), then moved to host memory in
    one copy each; the step, cursor and RNG state as a base holds them. Not collective."""
    try:
        tensors, meta = capture_delta(state.model, state.optimizers, touched)
        tensors.update(own_tensors(state, step))
    except DeltaUnsupported as exc:
        return CapturedDelta(step, parent, parent_digest, {}, {}, problem=str(exc), unsupported=True)
    host = {name: t if t.device.type == "cpu" else t.to("cpu") for name, t in tensors.items()}
    return CapturedDelta(step, parent, parent_digest, host, {**meta, "step": step, "parent": parent,
                                                             "cursor": json.loads(state.cursor_json())})


def write_delta(root: Path | str, *, step: int, parent: int, parent_digest: str, state: TrainState,
                touched: Mapping[str, torch.Tensor], group: Any) -> DeltaCommit:
    """`capture` then `commit_captured`, while the caller waits: the synchronous delta save."""
    return commit_captured(root, capture(state, step=step, parent=parent, parent_digest=parent_digest,
                                         touched=touched), group)


def commit_captured(root: Path | str, captured: CapturedDelta, group: Any) -> DeltaCommit:
    """Every rank writes its captured part of the delta of `step` on `parent` into
    `delta_<n>.tmp`; once every rank reported (`group`: all_gather and broadcast_from_first, the
    checkpoint group), rank 0 seals it and renames it to `delta_<n>` (replacing a stale one of
    the same step), or removes the `.tmp` folder when any rank failed. Collective: every rank
    calls it for the same step, in the same order as its other checkpoint-group collectives (the
    background save's thread runs them one at a time). The caller's `RowLedger` is
    `committed()` only when the outcome is."""
    step, parent, parent_digest = captured.step, captured.parent, captured.parent_digest
    tmp, final = delta_dir(Path(root), step, tmp=True), delta_dir(Path(root), step)
    problem, unsupported = captured.problem, captured.unsupported
    storage: tuple[int, str | None] | None = None
    if problem is None:
        try:
            write_pack(tmp, group.rank, captured.tensors, captured.meta)
        except (OSError, CheckpointError) as exc:
            problem = f"rank {group.rank}: {type(exc).__name__}: {exc}"
            storage = storage_error_of(exc, tmp)
    reports = group.all_gather((problem, unsupported, storage))
    outcome: tuple = (None, "", 0, None, False, None)
    if group.rank == 0:
        outcome = _commit_delta(tmp, final, reports, step=step, parent=parent, parent_digest=parent_digest,
                                world_size=group.world_size)
    path, digest, size, error, unsupported, storage = group.broadcast_from_first(outcome)
    return DeltaCommit(step=step, parent=parent, committed=path is not None, path=Path(path) if path else None,
                       digest=digest, bytes=size, error=error, unsupported=unsupported,
                       errno=storage[0] if storage else None, error_path=(storage[1] or str(tmp)) if storage else None)


def _commit_delta(tmp: Path, final: Path, reports: Sequence[tuple[str | None, bool, tuple | None]], *, step: int,
                  parent: int, parent_digest: str, world_size: int) -> tuple:
    """Rank 0: seal and rename, or clean up; (path, digest, bytes, error, unsupported, storage):
    `storage` the (errno, path) of a storage fault behind the failure (a rank's, or the seal's)."""
    failed = [why for why, _, _ in reports if why]
    if failed:
        _remove_quietly(tmp)
        storage = next((found for _, _, found in reports if found), None)
        return None, "", 0, "; ".join(failed), any(flag for _, flag, _ in reports), storage
    try:
        size = seal_delta(tmp, step=step, parent=parent, parent_digest=parent_digest, world_size=world_size)
        if final.exists():  # a stale delta of this step (an attempt before a restart wrote it)
            remove_tree(final)
        tmp.replace(final)
        fsync_dir(final.parent)
        return str(final), commit_digest(final), size, None, False, None
    except (OSError, CheckpointError) as exc:
        _remove_quietly(tmp)
        return (None, "", 0, f"sealing the delta of step {step} failed: {type(exc).__name__}: {exc}", False,
                storage_error_of(exc, tmp))


def _remove_quietly(folder: Path) -> None:
    try:
        if folder.exists():
            remove_tree(folder)
    except OSError:  # the next start's cleanup removes it (`catalog.remove_uncommitted`)
        pass


def apply_chain(state: TrainState, folders: Iterable[Path], rank: int) -> int:
    """Onto a state its chain's base was just restored into, each delta in order: verified
    (`verify_delta` raises on damage, before anything is read), then applied; the step, data
    cursor and RNG state are the last delta's. The rows written."""
    written, last = 0, None
    for folder in folders:
        verify_delta(folder)
        tensors, meta = read_pack(folder, rank)
        written += apply_delta(state.model, state.optimizers, tensors, meta)
        last = tensors
    if last is not None:
        apply_own(state, last)
    return written
