"""A refresh's parameters -> a `RefreshPlan`: everything the tasks need, checked up front.

The flow's parameters are one validated model (`tasks.parameters.RefreshParameters`: its
sections are the groups of the Prefect run form); `plan_refresh` adds what follows from them
and the data (the windows that exist, the schema, the folders) and builds the `TrainerConfig`
(`trainer_config`, the one place one is made from parameters). A value the model refuses is a
`ParameterError` (a `ValueError`) that names the parameter. The plan holds the parameters
as given beside what is derived (the checkpoint interval planned from history has a field of
its own). The plan lives with the tasks (it is what they take), so the flow imports the tasks
and nothing here imports a flow. Nothing is reserved or trained before this
returns. Where things go (per user, `ettflow.paths.data_home()` unless a parameter says):

- data: `data/synthetic` (synthetic windows sized by `DEMO_DATA`, generated on first use);
- checkpoints: `checkpoints/<model>/runs/<run_id>` (per run: restarts and flow retries of the
  run find them; the anchor's `anchor.json` names the run), compile cache
  `checkpoints/<model>/compile-cache` (shared by every run of the model);
- snapshots: `snapshots/<model>/<run_id>`; spool and warehouse: `ettflow.paths`; the
  warehouse URL from a Prefect `Secret` block named by `warehouse_secret`, else the
  `warehouse_url` parameter, else `ETTFLOW_WAREHOUSE_URL` (`tasks.warehouse_url`). Parameters
  are stored in clear by Prefect, so a `warehouse_url` holding a password is refused.

Which windows a refresh trains depends on the model's lineage (`tasks.window_choice`): the
plan `plan_refresh` returns is the first refresh's (no watermark: the bootstrap range, cold);
`with_lineage(plan, watermark, parent)` re-chooses the windows past the model's watermark and
warm-starts from the parent's anchor. The `claim-windows` task calls it with what it read
from the warehouse while it claims those windows (`tasks.claims`), then `with_interval(plan,
estimate)` with the model's failure history read in the same visit: the checkpoint interval
for those windows (`ett.interval_plan`), in steps when the model has history (no probe save).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ettflow import paths
from ettflow.ett.interval_plan import IntervalSource, PlannedInterval, expected_steps, plan_interval
from ettflow.ett.simulate import ASSUMED_COSTS, spare_inputs
from ettflow.ett.spare_sizing import (
    DEFAULT_RATE_PER_H,
    DEFAULT_REPLACE_S,
    DEFAULT_TTR_WITH_S,
    DEFAULT_TTR_WITHOUT_S,
    DEFAULT_WALL_S,
    SpareDecision,
    SpareShare,
    size_spares,
)
from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.data.schema import FeatureSchema, criteo_schema
from ettflow.trainer.placement import Placement

from .errors import ParameterError
from .parameters import EVAL_BATCHES_PRESET, PublishFaults, RefreshParameters, WarehouseParams, parse_failures
from .run_spool import RunRecorder
from .window_choice import WindowChoice, explicit_choice, select_windows

if TYPE_CHECKING:
    from ettflow.ett.failure_history import HistoryEstimate
    from ettflow.ett.lineage import LineageRecord

__all__ = ["ParameterError", "RefreshParameters", "RefreshPlan", "WindowChoice", "plan_refresh", "parse_failures",
           "select_windows", "slug", "trainer_config", "with_interval", "with_lineage", "with_spares"]

# The embedded default data: windows sized so that each refresh trains at least about 30 s on a
# 2-core CPU host (3,840 steps of 2 ranks x 128 rows a window: 38.7-51.4 s on the 2026-12-05
# host, which trained the earlier 737,280-row windows in 26.8-29.8 s, under the 30 s; the first
# refresh trains two; a real hourly window is millions of rows and trains for tens of minutes on
# accelerators), so ETT means what it means for a real refresh (issue 40 #5: at 368,640 rows the
# warm refresh trained 15.6 s). Tests keep their sizes tiny through the parameters (`max_steps`)
# or data of their own.
DEMO_DATA = {"windows": 3, "rows_per_window": 983_040, "files_per_window": 2, "seed": 0}


@dataclass(frozen=True, kw_only=True)
class RefreshPlan:
    run_id: str  # the Prefect flow run id: the spool's and the warehouse's run id
    params: RefreshParameters  # as the run was given them (validated)
    trainer: TrainerConfig
    publish_in_trainer: bool
    delta_snapshot: bool = False  # the snapshot is stored as a delta on the current one (tasks/publish.py)
    publish_faults: PublishFaults  # injected: publish tries that fail, and how long each first waits
    snapshot_root: Path
    spool_root: Path
    submitted_at: float | None
    artifact_slug: str
    # when the run's process started, where that was before `submitted_at` (a worker's
    # prefetch of a scheduled run): held for the run, off its clock (`flow_prestart`)
    prestarted_at: float | None = None
    # lineage (`with_lineage`): the windows chosen, the parent refresh (None: cold start)
    known_windows: tuple[str, ...] = ()
    windows_choice: WindowChoice | None = None
    parent: LineageRecord | None = None
    watermark: str | None = None
    # the checkpoint interval planned from the model's history with its inputs (`with_interval`;
    # None: not planned yet); the refresh's own is `params.checkpoint.checkpoint_every_steps`
    interval: PlannedInterval | None = None
    # the hot spares the run holds, sized by their expected saving (`with_spares`; None: not sized,
    # the trainer's default of one)
    spares: SpareDecision | None = None
    # its part in the spares a cluster's pool holds for the model's training runs together
    # (`ett.spare_sizing.SpareShare`: the same inputs per second; used where the run joins one)
    spare_share: SpareShare | None = None

    @property
    def model(self) -> str:
        return self.params.model

    @property
    def mode(self) -> str:
        return self.params.mode

    @property
    def tags(self) -> dict[str, Any]:
        return dict(self.params.tags or {})

    @property
    def recorder(self) -> RunRecorder:
        """The run's spool, as the tasks read and write it."""
        return RunRecorder(self.spool_root, self.run_id)

    @property
    def warehouse(self) -> WarehouseParams:
        """Where the warehouse is named (`tasks.warehouse_url.resolve_warehouse_url`)."""
        return self.params.warehouse

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.work_dir)

    @property
    def runs_root(self) -> Path:
        return self.run_dir.parent

    @property
    def labels(self) -> dict[str, Any]:
        """What the run's heartbeat keeps, so an orphaned run is archived under its own names."""
        return {"model": self.model, "mode": self.mode, "world_size": self.trainer.world_size,
                "switches": asdict(self.trainer.switches), "tags": self.tags, "flow_run_id": self.run_id}


def slug(text: str) -> str:
    """A Prefect artifact key part: lowercase letters, digits and dashes."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-") or "refresh"


def load_schema(data_root: Path, max_embeddings: int | None) -> FeatureSchema:
    declared = data_root / "_schema.json"
    schema = FeatureSchema.from_dict(json.loads(declared.read_text())) if declared.is_file() else criteo_schema()
    if max_embeddings is None:
        return schema
    capped = tuple(replace(f, num_embeddings=min(f.num_embeddings, max_embeddings)) for f in schema.sparse)
    return replace(schema, sparse=capped)


def demo_data(root: Path) -> Path:
    """The default data: synthetic windows sized by `DEMO_DATA`, written once per user (an existing
    root keeps the size it was written with)."""
    from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows

    if not (root / "_schema.json").is_file():
        generate_windows(root, SyntheticConfig(overwrite=True, **DEMO_DATA))
    return root


def default_data_root() -> Path:
    """The per-user default data (`demo_data`): what a refresh without `data_root` trains."""
    return demo_data(paths.data_home() / "data" / "synthetic")


def _windows(name: str, value: Sequence[str] | None, known: Sequence[str]) -> tuple[str, ...] | None:
    if value is None:
        return None
    missing = [w for w in value if w not in known]
    if missing:
        raise ParameterError(name, f"names windows that are not in the data: {missing}; available: {list(known)}")
    return tuple(value)


def trainer_config(params: RefreshParameters, *, data_root: Path, work_dir: Path, compile_cache_root: Path | None,
                   schema: FeatureSchema | None = None, **extra: Any) -> TrainerConfig:
    """The trainer's config of a refresh with `params` (the one place one is made from them);
    `extra`: `TrainerConfig` fields no parameter sets (the bench's `record_steps`, say)."""
    t = params.training
    switches, _ = params.resolved_switches()
    return TrainerConfig(
        data_root=str(data_root), schema=schema or load_schema(data_root, params.data.max_embeddings),
        windows=tuple(params.data.windows) if params.data.windows else None,
        eval_windows=tuple(params.data.eval_windows) if params.data.eval_windows else None,
        work_dir=str(work_dir), compile_cache_root=str(compile_cache_root) if compile_cache_root else None,
        model=params.architecture.model_config_value(), switches=switches, world_size=t.world_size,
        batch_size=t.batch_size, max_steps=t.max_steps,
        checkpoint_every_steps=params.checkpoint.checkpoint_every_steps, failures=params.faults.parsed()[0],
        device=t.device, eval_batches=EVAL_BATCHES_PRESET[params.mode] if t.eval_batches is None else t.eval_batches,
        placement=Placement(strategy=params.placement.placement_strategy,
                            min_world_size=params.placement.min_world_size,
                            capacity_wait_s=params.placement.capacity_wait_s), **extra)


def with_lineage(plan: RefreshPlan, watermark: str | None, parent: LineageRecord | None) -> RefreshPlan:
    """The plan for the model's lineage: the windows past `watermark` (explicit windows win),
    warm-started from `parent`'s anchor unless the plan asks for a cold start (`warm_start`
    false) or the parent has no anchor."""
    data = plan.params.data
    explicit_eval = tuple(data.eval_windows) if data.eval_windows else None
    if data.windows is not None:
        choice = explicit_choice(data.windows, explicit_eval)
    else:
        choice = select_windows(plan.known_windows, watermark, max_windows=data.max_windows,
                                bootstrap=data.bootstrap_windows)
    warm = parent if plan.params.training.warm_start and parent is not None and parent.anchor else None
    eval_windows = explicit_eval or ((choice.holdout,) if choice.holdout else None)
    trainer = replace(plan.trainer, windows=choice.train, eval_windows=eval_windows,
                      warm_start_from=warm.anchor if warm is not None else None)
    return replace(plan, trainer=trainer, windows_choice=choice, parent=warm, watermark=watermark)


def with_interval(plan: RefreshPlan, estimate: HistoryEstimate | None) -> RefreshPlan:
    """The checkpoint interval of the refresh, from its model's history (`ett.interval_plan`):
    sized for the windows the plan trains (and its `max_steps`). With history the trainer gets
    the interval in steps and takes no probe save; without, it probes, and its interval after
    the probe uses the estimated failure rate. A `checkpoint_every_steps` of the refresh wins
    (recorded as `fixed`, with its expected waste). `estimate` None: nothing is known."""
    t = plan.trainer
    own = plan.params.checkpoint.checkpoint_every_steps
    planned = plan_interval(estimate, windows=len(t.windows) if t.windows else None, max_steps=t.max_steps,
                            fixed_steps=own)
    steps = planned.interval_steps if planned.source is not IntervalSource.PROBE else None
    rate = planned.rate_per_h / 3600.0 if planned.rate_per_h is not None else None
    return replace(plan, interval=planned,
                   trainer=replace(t, checkpoint_every_steps=steps if steps else own, failure_rate_per_s=rate))


def with_spares(plan: RefreshPlan, estimate: HistoryEstimate | None) -> RefreshPlan:
    """The spares the refresh holds (`ett.spare_sizing`): its expected failures (the model's
    rate over its expected training, from the history the interval reads, plus the kills its
    parameters script) against one spare's slot-seconds, priced by the simulator's recovery model
    (`ett.simulate.spare_inputs`) on the model's measured TTRs. Nothing to size without live recovery."""
    t = plan.trainer
    if not t.switches.live_recovery:
        return plan
    sources = []
    if estimate is not None:  # the model's posterior rate (the fleet's prior until it has hours of its own)
        rate = estimate.rate_per_s
        sources = [f"failure rate {estimate.rate_per_h:.2g}/h (own weight {estimate.own_weight:.2f})"]
    else:
        rate, sources = DEFAULT_RATE_PER_H / 3600.0, [f"no history: {DEFAULT_RATE_PER_H:g} failure/h assumed"]
    steps = expected_steps(estimate, windows=len(t.windows) if t.windows else None, max_steps=t.max_steps) \
        if estimate is not None else None
    if steps and estimate.step_s:
        wall = steps * estimate.step_s
        sources.append(f"expected training {wall:.1f} s")
    else:
        wall = DEFAULT_WALL_S
        sources.append(f"wall {wall:g} s assumed")
    kills = sum(1 for f in t.failures if f.kind == "kill")
    if kills:
        sources.append(f"{kills} scripted kill(s)")
    # the measured TTRs hold their detection; a spare started at the loss takes DEFAULT_REPLACE_S
    ready, restart = DEFAULT_TTR_WITH_S, DEFAULT_TTR_WITHOUT_S
    if estimate is not None and estimate.ttr_ready_spare_s is not None and estimate.ttr_restart_s is not None:
        ready, restart = estimate.ttr_ready_spare_s, estimate.ttr_restart_s
        sources.append(f"TTRs {ready:.1f} s with a ready spare, {restart:.1f} s restarting, measured over "
                       f"{estimate.recoveries} recoveries")
    else:
        sources.append("TTRs: this machine's measured defaults (the model has not recovered both ways yet)")
    at_loss = _recovers_live_without_spare(t)
    spare_start = DEFAULT_REPLACE_S
    if estimate is not None and estimate.spare_start_s is not None:
        spare_start = estimate.spare_start_s
        measured = f"{spare_start:.1f} s, measured over {estimate.spare_starts}"
    else:
        measured = f"{spare_start:g} s assumed"
    sources.append("without a spare: " + (f"a spare started at the loss ({measured})" if at_loss
                                          else "every rank restarts"))
    costs = replace(ASSUMED_COSTS, detect_s=0.0, live_recovery_s=ready, restart_s=restart, spare_start_s=spare_start)
    inputs = spare_inputs(costs, world_size=t.world_size, wall_s=wall, rate_per_s=rate, scripted_failures=kills,
                          live_at_loss=at_loss, sources="; ".join(sources))
    decision = size_spares(inputs)
    return replace(plan, spares=decision, spare_share=SpareShare.of(plan.run_id, inputs),
                   trainer=replace(t, spares=decision.spares))


def _recovers_live_without_spare(t: TrainerConfig) -> bool:
    """Whether a lost rank is replaced live by a spare started at the loss when none is held (a
    CPU placement) or every rank restarts (a GPU placement holds no spare device: ray_group.py).
    The placement is known only once the group joins Ray: a device left to `auto` counts as a
    GPU one where this host has the NVIDIA driver."""
    return t.device == "cpu" or (t.device != "cuda" and not os.path.exists("/proc/driver/nvidia/version"))


def plan_refresh(params: RefreshParameters | Mapping[str, Any], *, run_id: str, submitted_at: float | None = None,
                 artifact_slug: str = "refresh-model", prestarted_at: float | None = None) -> RefreshPlan:
    """The plan of a refresh with `params` (any spelling `RefreshParameters.parse` takes):
    what the parameters say, checked against the data, and where everything goes."""
    from ettflow.trainer.data.windows import list_windows

    if not isinstance(params, RefreshParameters):
        params = RefreshParameters.parse(params)
    home = paths.data_home()
    data_root = Path(params.data.data_root) if params.data.data_root else default_data_root()
    if not data_root.is_dir():
        raise ParameterError("data_root", f"is not a folder of data windows: {str(data_root)!r}")
    known = list_windows(data_root)
    _windows("windows", params.data.windows, known)
    _windows("eval_windows", params.data.eval_windows, known)
    if params.data.windows is None and len(known) < 2:
        raise ParameterError("windows", f"is needed: {data_root} has {len(known)} window(s), and without "
                             "`windows` the last one is held out")
    storage = params.storage
    work_root = Path(storage.work_root or home / "checkpoints") / params.model
    trainer = trainer_config(params, data_root=data_root, work_dir=work_root / "runs" / run_id,
                             compile_cache_root=work_root / "compile-cache")
    _, flow_switches = params.resolved_switches()
    plan = RefreshPlan(
        run_id=run_id, params=params, trainer=trainer, publish_in_trainer=flow_switches["publish_in_trainer"],
        delta_snapshot=flow_switches["delta_snapshot"], publish_faults=params.faults.parsed()[1],
        snapshot_root=Path(storage.snapshot_root or home / "snapshots" / params.model),
        spool_root=Path(storage.spool_root) if storage.spool_root else paths.spool_root(),
        submitted_at=submitted_at,
        prestarted_at=prestarted_at if submitted_at is not None and prestarted_at is not None
        and prestarted_at < submitted_at else None, artifact_slug=slug(artifact_slug), known_windows=tuple(known))
    return with_lineage(plan, None, None)
