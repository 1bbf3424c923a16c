"""A refresh's parameters -> a `RefreshPlan`: everything the tasks need, checked up front.

The flow's parameters are plain JSON (the Prefect UI shows them as a form); the flow passes
them by name as `RefreshParams`, and `plan_refresh` turns them into a `TrainerConfig` plus
the flow-level settings, and rejects a bad one at once with a `ParameterError` (a
`ValueError`) that names the parameter. The plan lives with the tasks (it is what they
take), so the flow imports the tasks and nothing here imports a flow. Nothing is reserved or trained before this
returns. Where things go (per user, `ettflow.paths.data_home()` unless a parameter says):

- data: `data/synthetic` (tiny synthetic windows, generated on first use);
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
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ettflow import paths
from ettflow.ett.interval_plan import IntervalSource, PlannedInterval, plan_interval
from ettflow.trainer.config import FailAt, Switches, TrainerConfig
from ettflow.trainer.data.schema import FeatureSchema, criteo_schema
from ettflow.trainer.group.placement import Placement, PlacementStrategy
from ettflow.trainer.model_config import ModelConfig

from .errors import ParameterError
from .warehouse_url import check_warehouse_params
from .window_choice import WindowChoice, explicit_choice, select_windows

if TYPE_CHECKING:
    from ettflow.ett.failure_history import HistoryEstimate
    from ettflow.ett.lineage import LineageRecord

__all__ = ["ParameterError", "RefreshParams", "RefreshPlan", "WindowChoice", "plan_refresh", "parse_failures",
           "resolve_switches", "select_windows", "slug", "with_interval", "with_lineage"]

MODES = ("baseline", "optimized")
PUBLISH_IN_TRAINER = "publish_in_trainer"  # the flow's own switches: baseline True
DELTA_SNAPSHOT = "delta_snapshot"  # publish a delta on the current snapshot (publish/delta_snapshot.py): off
SWITCH_NAMES = (*(f.name for f in fields(Switches)), PUBLISH_IN_TRAINER, DELTA_SNAPSHOT)
DEMO_DATA = {"windows": 3, "rows_per_window": 4096, "files_per_window": 2, "seed": 0}
DEFAULT_MODEL_CONFIG = {"embedding_dim": 16, "dense_arch": [32, 16], "over_arch": [32, 1]}


@dataclass(frozen=True, kw_only=True)
class RefreshParams:
    """The `refresh-model` flow's parameters, by name, with the flow's defaults (see its
    docstring); `plan_refresh` checks them. A test keeps the two lists equal."""

    model: str = "dlrm"
    mode: str = "optimized"
    switches: Mapping[str, bool] | None = None
    architecture: Mapping[str, Any] | None = None
    data_root: str | None = None
    windows: Sequence[str] | None = None
    eval_windows: Sequence[str] | None = None
    max_embeddings: int | None = 10_000
    world_size: int = 2
    batch_size: int = 128
    max_steps: int | None = None
    checkpoint_every_steps: int | None = None
    eval_batches: int = 8
    device: str = "auto"
    fail_at: Sequence[str] | None = None
    work_root: str | None = None
    snapshot_root: str | None = None
    spool_root: str | None = None
    warehouse_url: str | None = None
    warehouse_secret: str | None = None
    tags: Mapping[str, Any] | None = None
    max_windows: int = 4
    bootstrap_windows: int | None = None
    warm_start: bool = True
    claim_wait_s: float = 60.0
    keep_refreshes: int = 3
    gate_max_auc_drop: float | None = 0.01
    gate_max_logloss_increase: float | None = None
    # placement on the Ray cluster (issue 13; trainer/group/placement.py)
    placement_strategy: str = "PACK"
    min_world_size: int | None = None
    capacity_wait_s: float = 600.0

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any]) -> RefreshParams:
        """The parameters given as a mapping (a deployment's, a test's); an unknown name is refused."""
        known = {f.name for f in fields(cls)}
        for name in params:
            if name not in known:
                raise ParameterError(name, f"is not a parameter of refresh-model; known: {', '.join(sorted(known))}")
        return cls(**params)


@dataclass(frozen=True, kw_only=True)
class RefreshPlan:
    run_id: str  # the Prefect flow run id: the spool's and the warehouse's run id
    model: str
    mode: str
    trainer: TrainerConfig
    publish_in_trainer: bool
    delta_snapshot: bool = False  # the snapshot is stored as a delta on the current one (tasks/publish.py)
    publish_failures: int  # injected: fail this many publish tries of the run
    snapshot_root: Path
    spool_root: Path
    warehouse_url: str | None  # never holds a password (refused by `plan_refresh`)
    warehouse_secret: str | None  # the Prefect Secret block holding the URL, if any
    submitted_at: float | None
    artifact_slug: str
    # when the run's process started, where that was before `submitted_at` (a worker's
    # prefetch of a scheduled run): held for the run, off its clock (`flow_prestart`)
    prestarted_at: float | None = None
    tags: Mapping[str, Any] = field(default_factory=dict)
    # lineage (`with_lineage`): the windows chosen, the parent refresh (None: cold start)
    known_windows: tuple[str, ...] = ()
    explicit_windows: tuple[str, ...] | None = None
    explicit_eval_windows: tuple[str, ...] | None = None
    windows_choice: WindowChoice | None = None
    parent: LineageRecord | None = None
    watermark: str | None = None
    max_windows: int = 4
    bootstrap_windows: int | None = None
    warm_start: bool = True
    claim_wait_s: float = 60.0  # how long to wait for another refresh of the model to finish
    keep_refreshes: int = 3  # retention: anchors of the last K refreshes of the model are kept
    gate_max_auc_drop: float | None = 0.01  # publish gate (tasks/publish.py)
    gate_max_logloss_increase: float | None = None
    # the checkpoint interval (`with_interval`): the refresh's own `checkpoint_every_steps`, and
    # the interval planned from the model's history with its inputs (None: not planned yet)
    explicit_interval_steps: int | None = None
    interval: PlannedInterval | None = None

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
                "switches": asdict(self.trainer.switches), "tags": dict(self.tags), "flow_run_id": self.run_id}

    @property
    def warehouse(self) -> dict[str, str | None]:
        """Where the warehouse is named, as `tasks.warehouse_url.resolve_warehouse_url` takes it."""
        return {"warehouse_url": self.warehouse_url, "warehouse_secret": self.warehouse_secret}


def slug(text: str) -> str:
    """A Prefect artifact key part: lowercase letters, digits and dashes."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-") or "refresh"


def _int(name: str, value: Any, low: int, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ParameterError(name, f"must be an int >= {low}{' or null' if optional else ''}, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class FlowSwitches:
    """The flow's own switches, beside the trainer's (`Switches`)."""

    publish_in_trainer: bool
    delta_snapshot: bool = False


def resolve_switches(mode: str, overrides: Mapping[str, Any] | None) -> tuple[Switches, FlowSwitches]:
    if mode not in MODES:
        raise ParameterError("mode", f"must be one of {', '.join(MODES)}, got {mode!r}")
    values: dict[str, bool] = {PUBLISH_IN_TRAINER: mode == "baseline", DELTA_SNAPSHOT: False}
    values.update({f.name: getattr(Switches.preset(mode), f.name) for f in fields(Switches)})
    for key, value in (overrides or {}).items():
        if key not in SWITCH_NAMES:
            raise ParameterError("switches", f"has unknown switch {key!r}; known: {', '.join(SWITCH_NAMES)}")
        if not isinstance(value, bool):
            raise ParameterError("switches", f"switch {key!r} must be true or false, got {value!r}")
        values[key] = value
    flow = FlowSwitches(publish_in_trainer=values.pop(PUBLISH_IN_TRAINER), delta_snapshot=values.pop(DELTA_SNAPSHOT))
    return Switches(**values), flow


def parse_failures(specs: Sequence[str] | None) -> tuple[tuple[FailAt, ...], int]:
    """Trainer faults ('kill:rank=1:step=30', 'hang:step=5', 'kill:after_s=8') and publish
    failures ('publish' or 'publish:times=2': the first N publish tries of the run fail)."""
    faults: list[FailAt] = []
    publish = 0
    for spec in specs or ():
        if not isinstance(spec, str):
            raise ParameterError("fail_at", f"items must be strings like 'kill:rank=1:step=30', got {spec!r}")
        try:
            if spec.split(":")[0] == "publish":
                times = dict(p.partition("=")[::2] for p in spec.split(":")[1:])
                unknown = set(times) - {"times"}
                if unknown:
                    raise ValueError(f"unknown field {sorted(unknown)[0]!r} (publish takes times=N)")
                publish += int(times.get("times", 1))
            else:
                faults.append(FailAt.parse(spec))
        except ValueError as exc:
            raise ParameterError("fail_at", f"item {spec!r}: {exc}") from None
    return tuple(faults), publish


def load_schema(data_root: Path, max_embeddings: int | None) -> FeatureSchema:
    declared = data_root / "_schema.json"
    schema = FeatureSchema.from_dict(json.loads(declared.read_text())) if declared.is_file() else criteo_schema()
    if max_embeddings is None:
        return schema
    capped = tuple(replace(f, num_embeddings=min(f.num_embeddings, max_embeddings)) for f in schema.sparse)
    return replace(schema, sparse=capped)


def demo_data(root: Path) -> Path:
    """The default data: tiny synthetic windows, written once per user."""
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
    if isinstance(value, str) or not value:
        raise ParameterError(name, f"must be a non-empty list of window names, got {value!r}")
    missing = [w for w in value if w not in known]
    if missing:
        raise ParameterError(name, f"names windows that are not in the data: {missing}; available: {list(known)}")
    return tuple(value)


def _float(name: str, value: Any, low: float, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < low:
        raise ParameterError(name, f"must be a number >= {low}{' or null' if optional else ''}, got {value!r}")
    return float(value)


def with_lineage(plan: RefreshPlan, watermark: str | None, parent: LineageRecord | None) -> RefreshPlan:
    """The plan for the model's lineage: the windows past `watermark` (explicit windows win),
    warm-started from `parent`'s anchor unless the plan asks for a cold start (`warm_start`
    false) or the parent has no anchor."""
    if plan.explicit_windows is not None:
        choice = explicit_choice(plan.explicit_windows, plan.explicit_eval_windows)
    else:
        choice = select_windows(plan.known_windows, watermark, max_windows=plan.max_windows,
                                bootstrap=plan.bootstrap_windows)
    warm = parent if plan.warm_start and parent is not None and parent.anchor else None
    eval_windows = plan.explicit_eval_windows or ((choice.holdout,) if choice.holdout else None)
    trainer = replace(plan.trainer, windows=choice.train, eval_windows=eval_windows,
                      warm_start_from=warm.anchor if warm is not None else None)
    return replace(plan, trainer=trainer, windows_choice=choice, parent=warm, watermark=watermark)


def _placement(p: Mapping[str, Any], world_size: int) -> Placement:
    """The ranks' placement on the Ray cluster (trainer/group/placement.py), from the flow's parameters."""
    strategy = p.get("placement_strategy", "PACK")
    names = [s.value for s in PlacementStrategy]
    if strategy not in names:
        raise ParameterError("placement_strategy", f"must be {', '.join(names[:-1])} or {names[-1]}, got {strategy!r}")
    low = _int("min_world_size", p.get("min_world_size"), 1, optional=True)
    if low is not None and low > world_size:
        raise ParameterError("min_world_size", f"must be <= world_size ({world_size}), got {low}")
    wait = _float("capacity_wait_s", p.get("capacity_wait_s", 600.0), 0.0)
    if not wait > 0:
        raise ParameterError("capacity_wait_s", f"must be > 0 seconds, got {wait!r}")
    return Placement(strategy=strategy, min_world_size=low, capacity_wait_s=wait)


def with_interval(plan: RefreshPlan, estimate: HistoryEstimate | None) -> RefreshPlan:
    """The checkpoint interval of the refresh, from its model's history (`ett.interval_plan`):
    sized for the windows the plan trains (and its `max_steps`). With history the trainer gets
    the interval in steps and takes no probe save; without, it probes, and its interval after
    the probe uses the estimated failure rate. A `checkpoint_every_steps` of the refresh wins
    (recorded as `fixed`, with its expected waste). `estimate` None: nothing is known."""
    t = plan.trainer
    planned = plan_interval(estimate, windows=len(t.windows) if t.windows else None, max_steps=t.max_steps,
                            fixed_steps=plan.explicit_interval_steps)
    steps = planned.interval_steps if planned.source is not IntervalSource.PROBE else None
    rate = planned.rate_per_h / 3600.0 if planned.rate_per_h is not None else None
    return replace(plan, interval=planned,
                   trainer=replace(t, checkpoint_every_steps=steps if steps else plan.explicit_interval_steps,
                                   failure_rate_per_s=rate))


def plan_refresh(params: RefreshParams | Mapping[str, Any], *, run_id: str, submitted_at: float | None = None,
                 artifact_slug: str = "refresh-model", prestarted_at: float | None = None) -> RefreshPlan:
    """Check every parameter and build the plan; `params` are the flow's parameters."""
    from ettflow.trainer.data.windows import list_windows

    if not isinstance(params, RefreshParams):
        params = RefreshParams.from_mapping(params)
    p = asdict(params)
    check_warehouse_params(p["warehouse_url"], p["warehouse_secret"])
    model = p.get("model") or "dlrm"
    if not isinstance(model, str) or slug(model) != model:
        raise ParameterError("model", f"must be a name of lowercase letters, digits and dashes, got {model!r}")
    mode = p.get("mode", "optimized")
    switches, flow_switches = resolve_switches(mode, p.get("switches"))
    try:
        model_config = ModelConfig(**{**DEFAULT_MODEL_CONFIG, **(p.get("architecture") or {})})
    except (TypeError, ValueError) as exc:
        raise ParameterError("architecture", f"is invalid: {exc}") from None
    home = paths.data_home()
    data_root = Path(p["data_root"]) if p.get("data_root") else default_data_root()
    if not data_root.is_dir():
        raise ParameterError("data_root", f"is not a folder of data windows: {str(data_root)!r}")
    known = list_windows(data_root)
    windows = _windows("windows", p.get("windows"), known)
    eval_windows = _windows("eval_windows", p.get("eval_windows"), known)
    if windows is None and len(known) < 2:
        raise ParameterError("windows", f"is needed: {data_root} has {len(known)} window(s), and without "
                             "`windows` the last one is held out")
    faults, publish_failures = parse_failures(p.get("fail_at"))
    world_size = _int("world_size", p.get("world_size", 2), 1)
    for f in faults:
        if f.rank >= world_size:
            raise ParameterError("fail_at", f"targets rank {f.rank} but world_size is {world_size}")
    device = p.get("device") or "auto"
    if device not in ("auto", "cpu", "cuda"):
        raise ParameterError("device", f"must be auto, cpu or cuda, got {device!r}")
    work_root = Path(p.get("work_root") or home / "checkpoints") / model
    placement = _placement(p, world_size)
    trainer = TrainerConfig(
        data_root=str(data_root), schema=load_schema(data_root, _int("max_embeddings", p.get("max_embeddings"), 1,
                                                                     optional=True)),
        windows=windows, eval_windows=eval_windows, work_dir=str(work_root / "runs" / run_id),
        compile_cache_root=str(work_root / "compile-cache"), model=model_config, switches=switches,
        world_size=world_size, batch_size=_int("batch_size", p.get("batch_size", 128), 1),
        max_steps=_int("max_steps", p.get("max_steps"), 1, optional=True),
        checkpoint_every_steps=_int("checkpoint_every_steps", p.get("checkpoint_every_steps"), 1, optional=True),
        failures=faults, device=device, eval_batches=_int("eval_batches", p.get("eval_batches", 8), 0),
        placement=placement,
    )
    if not isinstance(p.get("warm_start", True), bool):
        raise ParameterError("warm_start", f"must be true or false, got {p.get('warm_start')!r}")
    tags = p.get("tags") or {}
    if not isinstance(tags, Mapping):
        raise ParameterError("tags", f"must be an object, got {tags!r}")
    plan = RefreshPlan(
        run_id=run_id, model=model, mode=mode, trainer=trainer, publish_in_trainer=flow_switches.publish_in_trainer,
        delta_snapshot=flow_switches.delta_snapshot,
        publish_failures=publish_failures,
        snapshot_root=Path(p.get("snapshot_root") or home / "snapshots" / model),
        spool_root=Path(p["spool_root"]) if p.get("spool_root") else paths.spool_root(),
        warehouse_url=p["warehouse_url"], warehouse_secret=p["warehouse_secret"], submitted_at=submitted_at,
        prestarted_at=prestarted_at if submitted_at is not None and prestarted_at is not None
        and prestarted_at < submitted_at else None, artifact_slug=slug(artifact_slug),
        tags=dict(tags), known_windows=tuple(known), explicit_windows=windows, explicit_eval_windows=eval_windows,
        max_windows=_int("max_windows", p.get("max_windows", 4), 1),
        bootstrap_windows=_int("bootstrap_windows", p.get("bootstrap_windows"), 1, optional=True),
        warm_start=p.get("warm_start", True), claim_wait_s=_float("claim_wait_s", p.get("claim_wait_s", 60.0), 0.0),
        keep_refreshes=_int("keep_refreshes", p.get("keep_refreshes", 3), 1),
        gate_max_auc_drop=_float("gate_max_auc_drop", p.get("gate_max_auc_drop", 0.01), 0.0, optional=True),
        gate_max_logloss_increase=_float("gate_max_logloss_increase", p.get("gate_max_logloss_increase"), 0.0,
                                         optional=True),
        explicit_interval_steps=trainer.checkpoint_every_steps,
    )
    return with_lineage(plan, None, None)
