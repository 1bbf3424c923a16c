"""Live recovery, the rank side: healthy ranks keep running through a peer's failure, and a warm
spare takes the failed rank's place.

The protocol (the driver's side is `group/driver.py`, `group/ray_group.py` and `group/restore_choice.py`):

1. A rank's process dies. Its peers' next collective fails (gloo reports the lost connection
   at once; on NCCL the driver has each survivor abort its communicators, `Groups.interrupt`,
   which makes the collective in flight raise); their `train` call ends with that error, but
   each keeps its session on its actor, *parked* (`TrainerSession.park`): the process, its
   imports, the data pipelines, the dense modules, their optimizer and the compiled dense
   step stay; the attempt's spool file, heartbeat and checkpoint manager are closed (a save
   in flight never commits: its group is gone).
2. The driver picks a `RestorePoint`: the newest step every rank holds in the in-memory tier
   (`checkpoint/memory_tier.py`), or the newest durable checkpoint when that is newer or
   memory holds none, and hands the failed rank's place to a warm spare (`spare_handoff`,
   scheduling): a process started ahead of time with its imports done, its dense modules
   built and its dense step compiled from the compile cache (`prewarm`).
3. The next attempt: every survivor `rejoin`s and the spare `join`s with a new rendezvous.
   Each records, as its own phases:
   - `process_group_rebuild` (owner scheduler): the old groups are torn down (NCCL's
     communicators aborted first) and new ones formed over the new rendezvous
     (`Groups.teardown` / `Groups.form`, trainer/collectives.py);
   - `module_reshard` (owner trainer): the sharded embedding collection, which holds the old
     group, is built again on the new one (`rebuild_sharded`); the dense modules, their
     optimizer and the compiled step are the same objects, so nothing recompiles;
   - `checkpoint_restore` (`source` "memory": every rank copies the restore point back into its
     live tensors, the survivors from their own copy, the spare from the keeper's copy of the
     rank it replaces; a copy that is missing or fails its checksum on any rank sends every
     rank to the durable checkpoint together, with a warning; `source` "own": the durable one).
   Training then goes on from the restore point's data cursor; the steps up to the failure
   are replayed (wasted training), exactly as after a full restart.

A failure this path does not cover (a lost node, a hang, an error in the rank's own code, no
restore point, a survivor that does not park in time) restarts every rank, as before.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ettflow.trainer import _torch_compat as compat
from ettflow.trainer.model import DenseStep, build_dlrm, shard

if TYPE_CHECKING:
    from ettflow.trainer.config import TrainerConfig
    from ettflow.trainer.rank.rank_state import RankState

log = logging.getLogger("ettflow.trainer")

def rebuild_sharded(state: RankState, config: TrainerConfig) -> None:
    """The sharded module again, on the rank's new training group (`state.groups`): a DLRM whose
    dense modules are the ones `state.dense_step` holds (kept: the compiled step and the dense
    optimizer refer to them), with a new sharded embedding collection and its fused optimizer, on
    the plan rank 0 made before when it has one (same tables, same world). Its tables are
    freshly initialized: the restore that follows overwrites them."""
    dense: DenseStep = state.dense_step
    compat.forget_dmp_initialization()  # the joining spare initializes its DMP as a fresh process
    dlrm = build_dlrm(config.model, config.schema, device=state.device)
    dlrm.dense_arch, dlrm.inter_arch, dlrm.over_arch = dense.dense_arch, dense.inter_arch, dense.over_arch
    known = state.dmp.plan if state.is_set("dmp") and state.dmp.plan is not None else None  # a survivor's
    state.dmp = shard(dlrm, config.model, state.groups.training, known_plan=known)
