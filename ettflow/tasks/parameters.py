"""`RefreshParameters`: every parameter of a refresh, once: its type, default, limits and help.

The `refresh-model` flow takes one argument per section (`model`, `mode`, `data`,
`architecture`, `training`, `checkpoint`, `switches`, `placement`, `gate`, `storage`,
`warehouse`, `faults`, `tags`); Prefect 3.9.1 turns each section model into a group of the
deployment's run form, with each field's description under it, its limits (`ge=1` is the
schema's `minimum`, which the server enforces when a run is created) and a toggle per switch.
Everything that names a parameter derives from here: the flow's signature and its docstring's
``Args:`` (`flows/parameter_help.py`), the CLI's `--param` names and help, the bench's jobs,
and `TrainerConfig` (`tasks/plan.trainer_config`).

Invariants:

- Every leaf name is unique across sections, so a flat name (`world_size`) names one field;
  `parse` takes flat names, dotted ones (`training.world_size`) and nested sections alike (the
  spellings of earlier releases keep working).
- Validation is the model's: a refused value is a `ParameterError` naming the leaf (`parse`),
  never a run that fails later. What needs the data (windows that exist) is the plan's.
- A switch left null takes the mode's preset (`resolved_switches`).
- A `warehouse_url` with a password is refused: Prefect stores parameters in clear.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator, model_validator

from ettflow.ett.redact import SECRET_URL_PATTERN
from ettflow.trainer.config import FailAt, Switches, fail_at_grammar
from ettflow.trainer.model_config import ModelConfig
from ettflow.trainer.placement import PlacementStrategy

from .errors import ParameterError

MODEL_PATTERN = r"^[a-z0-9]+(-[a-z0-9]+)*$"
Mode = Literal["baseline", "optimized"]
ModelName = Annotated[str, Field(pattern=MODEL_PATTERN, description=(
    "The model's name: lowercase letters, digits and dashes. Its lineage, checkpoints and snapshots go by it."))]
ModeField = Annotated[Mode, Field(description=(
    "baseline or optimized: the preset of the switches (baseline: sequential init, compile on the first real "
    "batch, synchronous checkpoints, no compile cache, no in-memory checkpoints, every rank restarted after a "
    "failure, publishing in the trainer)."))]
Tags = Annotated[dict[str, Any] | None, Field(description=(
    "Free labels stored with the run's ETT row, e.g. {\"team\": \"ads\"}."))]


def _limits_in_descriptions(schema: dict[str, Any]) -> None:
    """Each field's default and limits at the end of its description: Prefect's run form shows
    the description, not the schema's `minimum` (which the server enforces all the same)."""
    words = (("minimum", "at least"), ("exclusiveMinimum", "more than"), ("maximum", "at most"),
             ("minItems", "items: at least"), ("pattern", "matching"))
    for prop in schema.get("properties", {}).values():
        branches = [prop, *prop.get("anyOf", ())]
        said = [f"{word} {branch[key]}" for branch in branches for key, word in words if key in branch]
        if prop.get("default") is not None:
            said.insert(0, f"default {json.dumps(prop['default'])}")
        if said and prop.get("description"):
            prop["description"] = f"{prop['description']} [{'; '.join(said)}]"


class Section(BaseModel):
    """A group of the run form: frozen, strict (`true` is no count, "yes" no switch), and
    refusing names it does not know."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, json_schema_extra=_limits_in_descriptions)

    @classmethod
    def of(cls, values: Mapping[str, Any]):  # noqa: ANN206 - the subclass
        """The section from a mapping; a refused value is the `ParameterError` naming it."""
        try:
            return cls.model_validate(dict(values))
        except ValidationError as exc:
            raise parameter_error(exc) from None


class DataParams(Section):
    """Which data the refresh trains and evaluates."""

    data_root: str | None = Field(None, description=(
        "The folder of hourly data windows (window=YYYYMMDDHH/*.parquet); null: synthetic data sized to train "
        "about 30 s a refresh, made on first use."))
    windows: list[str] | None = Field(None, min_length=1, description=(
        "The windows to train, explicitly (null: the ones past the model's watermark, see max_windows)."))
    eval_windows: list[str] | None = Field(None, min_length=1, description=(
        "The held-out windows for evaluation and the snapshot's validation (null: the newest window)."))
    max_windows: int = Field(4, ge=1, description=(
        "At most this many windows past the watermark per refresh (the newest is held out)."))
    bootstrap_windows: int | None = Field(None, ge=1, description=(
        "Windows the first refresh of a model trains (null: max_windows)."))
    max_embeddings: int | None = Field(10_000, ge=1, description=(
        "A cap on the rows of every embedding table (null: the data schema's sizes)."))
    claim_wait_s: float = Field(60.0, ge=0.0, description=(
        "Seconds to wait while another refresh of the model holds its windows; then this one ends Completed, "
        "skipped."))


_DEFAULT_MODEL = ModelConfig()


class ArchitectureParams(Section):
    """The DLRM's shape and learning rates (`trainer.model_config.ModelConfig`)."""

    embedding_dim: int = Field(16, ge=1, description="Width of every embedding (and of the dense tower's output).")
    dense_arch: list[int] = Field([32, 16], min_length=1, description=(
        "Layer sizes of the dense tower; the last equals embedding_dim."))
    over_arch: list[int] = Field([32, 1], min_length=1, description="Layer sizes of the over arch; the last is 1.")
    dense_lr: float = Field(_DEFAULT_MODEL.dense_lr, gt=0.0, description="Adam's learning rate of the dense part.")
    sparse_lr: float = Field(_DEFAULT_MODEL.sparse_lr, gt=0.0, description=(
        "The fused optimizer's learning rate of the embedding tables."))
    seed: int = Field(_DEFAULT_MODEL.seed, ge=0, description="The seed of the model's initial weights.")

    @model_validator(mode="after")
    def _fits(self) -> ArchitectureParams:
        self.model_config_value()  # ModelConfig's own checks (the last layers' sizes)
        return self

    def model_config_value(self) -> ModelConfig:
        return ModelConfig(embedding_dim=self.embedding_dim, dense_arch=tuple(self.dense_arch),
                           over_arch=tuple(self.over_arch), dense_lr=self.dense_lr, sparse_lr=self.sparse_lr,
                           seed=self.seed)


# held-out batches a rank evaluates after its last step, with its devices held: the untuned
# trainer evaluates; the optimized run leaves it to the publish step, which validates the snapshot
# on the same held-out windows on the CPU after the release (the rank's 0.9 s of a warm refresh
# duplicated it: BENCHMARKS.md)
EVAL_BATCHES_PRESET = {"baseline": 8, "optimized": 0}


class TrainingParams(Section):
    """The trainer's ranks and steps."""

    world_size: int = Field(2, ge=1, description="The number of trainer ranks (one Ray actor each).")
    batch_size: int = Field(128, ge=1, description="Examples per rank per step.")
    max_steps: int | None = Field(None, ge=1, description=(
        "Stop training after this many steps (null: one pass over the windows)."))
    eval_batches: int | None = Field(None, ge=0, description=(
        "Held-out batches each rank evaluates after training, its devices held (unset: the mode's preset: "
        f"{EVAL_BATCHES_PRESET['baseline']} in the baseline, {EVAL_BATCHES_PRESET['optimized']} in the optimized "
        "mode, whose snapshot the publish step validates on the held-out windows on the CPU after the release)."))
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "auto, cpu or cuda (auto: cuda when the worker has GPUs)."))
    warm_start: bool = Field(True, description="Start from the parent refresh's anchor checkpoint (false: from "
                                               "scratch).")


class CheckpointParams(Section):
    """How often the trainer checkpoints, and what is kept."""

    checkpoint_every_steps: int | None = Field(None, ge=1, description=(
        "Checkpoint interval in steps (null: computed from the model's measured save time and failure rate, "
        "Young/Daly)."))
    keep_refreshes: int = Field(3, ge=1, description=(
        "Run checkpoint folders kept, besides the current and the parent anchors (a failed run's checkpoints, "
        "without an anchor, go a day after its run ended)."))


# the flow's own switches, beside the trainer's (`trainer.config.Switches`): baseline True / off
FLOW_SWITCHES = ("publish_in_trainer", "delta_snapshot")


# A switch is a boolean toggle in the run form; left unset (null) it takes the mode's preset.
# The form is given the boolean alone (a `bool | None` would show a type picker and "Property
# is type None" in its place); the flow's own validation still takes null.
Switch = Annotated[bool | None, WithJsonSchema({"anyOf": [{"type": "null", "title": "preset"},
                                                           {"type": "boolean", "title": "on/off"}]})]


def _switch(text: str) -> Any:
    return Field(None, description=f"{text} (unset: the mode's preset).")


class SwitchParams(Section):
    """Single optimizations over the mode's preset: each switch is "preset" (unset: the mode's) or on/off."""

    parallel_init: Switch = _switch("Independent init stages run concurrently")
    fast_batch: Switch = _switch("Compile on a synthetic batch while the data pipeline warms up")
    compile: Switch = _switch("torch.compile the dense step (false: eager)")
    compile_cache: Switch = _switch("Restore and save the compile-cache archive")
    async_checkpoint: Switch = _switch("Asynchronous checkpoints with staging (false: synchronous)")
    memory_checkpoint: Switch = _switch(
        "The in-memory checkpoint tier: a copy of each save in host memory that outlives the ranks")
    live_recovery: Switch = _switch("Survivors keep running and a warm spare takes a failed rank")
    warm_pool: Switch = _switch("Ranks and spares from trainer processes prewarmed before the run")
    local_inductor_cache: Switch = _switch(
        "Without the compile cache, keep PyTorch's own inductor cache across processes")
    delta_checkpoint: Switch = _switch(
        "Periodic checkpoints (and in-memory copies) hold only the embedding rows touched since the one before, "
        "on full bases (anchors are always full)")
    release_before_seal: Switch = _switch(
        "The ranks hand the anchor checkpoint off in host memory and release their devices; the driver writes and "
        "seals it on the CPU (false: written while the devices are held)")
    publish_in_trainer: Switch = _switch("Publish while the trainer holds its devices (the baseline's way)")
    delta_snapshot: Switch = _switch(
        "Store the snapshot as the rows that changed since the current one (checked to predict as the full one; "
        "`ettflow publish --materialize` writes it whole)")


class PlacementParams(Section):
    """How the ranks are placed on the Ray cluster (`trainer.placement`)."""

    placement_strategy: PlacementStrategy = Field(PlacementStrategy.PACK, strict=False, description=(
        "How the ranks spread over the Ray nodes: PACK (as few nodes as possible), SPREAD (over nodes where "
        "possible) or STRICT_SPREAD (one rank per node)."))
    min_world_size: int | None = Field(None, ge=1, description=(
        "A restart after lost capacity may run with as few as this many ranks, its checkpoint resharded (null: it "
        "waits for world_size ranks)."))
    capacity_wait_s: float = Field(600.0, gt=0.0, description=(
        "The longest an attempt waits for its placement (capacity) before the run fails as an infrastructure "
        "failure; the wait counts as scheduling."))


class GateParams(Section):
    """When a new snapshot is kept back (gated) against the current one."""

    gate_max_auc_drop: float | None = Field(0.01, ge=0.0, description=(
        "The most the held-out AUC may drop against the current snapshot before the new one is gated (null: no "
        "AUC gate)."))
    gate_max_logloss_increase: float | None = Field(None, ge=0.0, description=(
        "The most the held-out log loss may rise against the current snapshot before the new one is gated (null: "
        "no log-loss gate)."))


class StorageParams(Section):
    """Where the run's files go (on several Ray nodes: storage every node shares), and how many
    published snapshots stay."""

    work_root: str | None = Field(None, description=(
        "Where checkpoints and the compile cache live (null: the per-user ettflow folder)."))
    snapshot_root: str | None = Field(None, description=(
        "Where inference snapshots are published (null: the per-user ettflow folder)."))
    spool_root: str | None = Field(None, description=(
        "Where the run's phase events are spooled (null: the per-user ettflow folder)."))
    keep_snapshots: int = Field(3, ge=1, description=(
        "Published snapshots kept (the last refreshes'), besides the current one and the bases a kept delta "
        "snapshot needs; the others go, with their timeline pictures, after each refresh."))


# what a warehouse_url must `not` match (`ett.redact.SECRET_URL_PATTERN`)
NO_SECRET_SCHEMA = {"not": {"type": "string", "pattern": SECRET_URL_PATTERN}}
# a flow's own URL argument (the fleet report's), refused by the server as `WarehouseParams`'s is
NoSecretUrl = Annotated[str | None, Field(json_schema_extra=NO_SECRET_SCHEMA)]


class WarehouseParams(Section):
    """Which warehouse the run's ETT row goes to (`tasks.warehouse_url`)."""

    warehouse_url: str | None = Field(None, min_length=1, description=(
        "The warehouse's SQLAlchemy URL, without a password (parameters are stored in clear); null: "
        "warehouse_secret, else the worker's ETTFLOW_WAREHOUSE_URL, else the per-user SQLite file."),
        # in the deployment's parameter schema: the Prefect server refuses a run whose URL holds a
        # password before it stores the parameters (the validator below cannot: it runs after)
        json_schema_extra=NO_SECRET_SCHEMA)
    warehouse_secret: str | None = Field(None, min_length=1, description=(
        "The name of a Prefect Secret block that holds the warehouse URL (with its password)."))

    @field_validator("warehouse_url")
    @classmethod
    def _no_password(cls, url: str | None) -> str | None:
        from ettflow.ett.redact import has_password

        if url and has_password(url):
            raise ParameterError("warehouse_url", "holds a password, and flow parameters are stored in clear: put "
                                 "the URL in ETTFLOW_WAREHOUSE_URL, or in a Prefect Secret block named by "
                                 "`warehouse_secret`")
        return url


class FaultParams(Section):
    """Injected failures, to see and measure a recovery."""

    fail_at: list[str] | None = Field(None, description=(
        "Injected failures, e.g. [\"kill:rank=1:step=16\"].\n\n" + fail_at_grammar(markdown=True)))

    @field_validator("fail_at")
    @classmethod
    def _parses(cls, specs: list[str] | None) -> list[str] | None:
        parse_failures(specs)
        return specs

    def parsed(self) -> tuple[tuple[FailAt, ...], PublishFaults]:
        """(the trainer's faults, the publish's)."""
        return parse_failures(self.fail_at)


@dataclass(frozen=True)
class PublishFaults:
    """Scripted faults of the run's publish: the first `times` tries fail; each try first waits
    `slow_s` (a slow snapshot store: what a stop that lands while the run publishes needs)."""

    times: int = 0
    slow_s: float = 0.0


def parse_failures(specs: Sequence[str] | None) -> tuple[tuple[FailAt, ...], PublishFaults]:
    """Trainer faults ('kill:rank=1:step=30', 'hang:step=5', 'kill:after_s=8') and publish
    faults ('publish' or 'publish:times=2': the first N publish tries of the run fail;
    'publish:slow_s=30': each try first waits 30 s, and none fails unless times is given too)."""
    faults: list[FailAt] = []
    times, slow_s = 0, 0.0
    for spec in specs or ():
        try:
            if spec.split(":")[0] == "publish":
                fields = dict(p.partition("=")[::2] for p in spec.split(":")[1:])
                unknown = set(fields) - {"times", "slow_s"}
                if unknown:
                    raise ValueError(f"unknown field {sorted(unknown)[0]!r} (publish takes times=N, slow_s=T)")
                times += int(fields.get("times", 0 if "slow_s" in fields else 1))
                slow_s = max(slow_s, float(fields.get("slow_s", 0.0)))
                if times < 0 or slow_s < 0:
                    raise ValueError("times and slow_s must be >= 0")
            else:
                faults.append(FailAt.parse(spec))
        except ValueError as exc:
            raise ParameterError("fail_at", f"item {spec!r}: {exc}") from None
    return tuple(faults), PublishFaults(times, slow_s)


class RefreshParameters(BaseModel):
    """Every parameter of one refresh; `parse` builds it from any spelling."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    model: ModelName = "dlrm"
    mode: ModeField = "optimized"
    data: DataParams = DataParams()
    architecture: ArchitectureParams = ArchitectureParams()
    training: TrainingParams = TrainingParams()
    checkpoint: CheckpointParams = CheckpointParams()
    switches: SwitchParams = SwitchParams()
    placement: PlacementParams = PlacementParams()
    gate: GateParams = GateParams()
    storage: StorageParams = StorageParams()
    warehouse: WarehouseParams = WarehouseParams()
    faults: FaultParams = FaultParams()
    tags: Tags = None

    # leaf name -> its section (every leaf name is unique: `_leaves` checks)
    LEAVES: ClassVar[dict[str, str]]

    @model_validator(mode="after")
    def _consistent(self) -> RefreshParameters:
        world = self.training.world_size
        low = self.placement.min_world_size
        if low is not None and low > world:
            raise ParameterError("min_world_size", f"must be <= world_size ({world}), got {low}")
        for fault in self.faults.parsed()[0]:
            if fault.rank >= world:
                raise ParameterError("fail_at", f"targets rank {fault.rank} but world_size is {world}")
        return self

    @classmethod
    def parse(cls, given: Mapping[str, Any] | RefreshParameters | None = None, **over: Any) -> RefreshParameters:
        """The parameters from a mapping of section names (nested), leaf names (`world_size`)
        or dotted ones (`training.world_size`), in any mix, `over` on top; `architecture` and
        `switches` may be whole objects as before. A refused value or an unknown name raises a
        `ParameterError` that names it."""
        try:
            return cls.model_validate(cls.nest(given, **over))
        except ValidationError as exc:
            raise parameter_error(exc) from None

    @classmethod
    def nest(cls, given: Mapping[str, Any] | RefreshParameters | None = None, **over: Any) -> dict[str, Any]:
        """`parse`'s spellings as the flow's arguments, one object per section given, not yet
        validated (the flow validates them); an unknown name is a `ParameterError`."""
        if isinstance(given, RefreshParameters):
            given = given.to_json()
        nested: dict[str, Any] = {}
        for name, value in {**(given or {}), **over}.items():
            section, _, leaf = name.partition(".")
            if not leaf and section in cls.LEAVES:
                section, leaf = cls.LEAVES[section], section
            if leaf:
                if section not in cls.sections() or leaf not in cls.sections()[section].model_fields:
                    raise ParameterError(name, f"is not a parameter of refresh-model; known: {known_names()}")
                nested.setdefault(section, {})
                if not isinstance(nested[section], dict):
                    nested[section] = dict(nested[section])
                nested[section][leaf] = value
            elif section in cls.sections() and value is None:
                continue  # a whole section null (`architecture: null` before): its defaults
            elif section in cls.model_fields:
                if isinstance(value, BaseModel):
                    value = value.model_dump(exclude_unset=True)
                nested[section] = {**nested.get(section, {}), **value} \
                    if isinstance(value, Mapping) and section in cls.sections() else value
            else:
                raise ParameterError(name, f"is not a parameter of refresh-model; known: {known_names()}")
        return nested

    @classmethod
    def lenient(cls, given: Mapping[str, Any] | None) -> RefreshParameters:
        """The parameters as far as they are valid, for the hooks of a run Prefect refused
        (its spool, warehouse and names are needed all the same): each section that does not
        validate, and each unknown name, is left at its default."""
        try:
            return cls.parse(given)
        except ParameterError:
            pass
        leaves: dict[str, Any] = {}
        for name, value in (given or {}).items():  # sections as their leaves: a bad one costs only itself
            if name in cls.sections() and isinstance(value, Mapping):
                leaves.update({f"{name}.{leaf}": v for leaf, v in value.items()})
            else:
                leaves[name] = value
        kept: dict[str, Any] = {}
        for name, value in leaves.items():
            try:
                cls.parse({**kept, name: value})
            except ParameterError:
                continue
            kept[name] = value
        return cls.parse(kept)

    @classmethod
    def sections(cls) -> dict[str, type[Section]]:
        return {name: f.annotation for name, f in cls.model_fields.items()
                if isinstance(f.annotation, type) and issubclass(f.annotation, Section)}

    def to_json(self) -> dict[str, Any]:
        """The flow's parameters as JSON, only what differs from the defaults (a deployment run's,
        the CLI's): each section as an object."""
        return self.model_dump(mode="json", exclude_defaults=True)

    def flow_kwargs(self) -> dict[str, Any]:
        """The flow function's arguments (its signature is this model's fields)."""
        return {name: getattr(self, name) for name in type(self).model_fields}

    def resolved_switches(self) -> tuple[Switches, dict[str, bool]]:
        """The trainer's switches and the flow's own (`FLOW_SWITCHES`): the mode's preset, each
        switch set here on top."""
        preset = Switches.preset(self.mode)
        chosen = {name: value for name, value in self.switches.model_dump().items() if value is not None}
        trainer = Switches(**{f.name: chosen.get(f.name, getattr(preset, f.name)) for f in dataclass_fields(Switches)})
        flow = {"publish_in_trainer": chosen.get("publish_in_trainer", self.mode == "baseline"),
                "delta_snapshot": chosen.get("delta_snapshot", False)}
        return trainer, flow


def _leaves() -> dict[str, str]:
    leaves: dict[str, str] = {}
    for section, model in RefreshParameters.sections().items():
        for leaf in model.model_fields:
            if leaf in leaves or leaf in RefreshParameters.model_fields:
                raise TypeError(f"parameter name {leaf!r} is in two sections: every leaf name must be unique")
            leaves[leaf] = section
    return leaves


RefreshParameters.LEAVES = _leaves()
_trainer_switches = {f.name for f in dataclass_fields(Switches)}
if set(SwitchParams.model_fields) != _trainer_switches | set(FLOW_SWITCHES):  # a switch cannot go unlisted
    raise TypeError(f"SwitchParams and trainer.config.Switches disagree: "
                    f"{sorted(set(SwitchParams.model_fields) ^ (_trainer_switches | set(FLOW_SWITCHES)))}")


def known_names() -> str:
    return ", ".join([*(n for n in RefreshParameters.model_fields if n not in RefreshParameters.sections()),
                      *RefreshParameters.LEAVES])


def parameter_names_help() -> str:
    """Every parameter's name by section, for the CLI's `--param` help."""
    return "; ".join([*(n for n in RefreshParameters.model_fields if n not in RefreshParameters.sections()),
                      *(f"{section}: {', '.join(model.model_fields)}"
                        for section, model in RefreshParameters.sections().items())])


def field_help(name: str) -> str:
    """The description of a leaf or top-level parameter (the run form's, the CLI's)."""
    if name in RefreshParameters.sections():
        return " ".join((RefreshParameters.sections()[name].__doc__ or "").split())
    section = RefreshParameters.LEAVES.get(name)
    info = (RefreshParameters.sections()[section] if section else RefreshParameters).model_fields[name]
    text = info.description
    for meta in info.metadata:  # Annotated aliases keep their Field in the metadata
        text = text or getattr(meta, "description", None)
    if not text:
        raise TypeError(f"parameter {name!r} has no description: the run form and the CLI show it")
    return text


def _problem(err: Mapping[str, Any]) -> str:
    """One pydantic error as the rest of ettflow says it: what it must be, what it got."""
    kind, ctx, got = err["type"], err.get("ctx") or {}, err.get("input")
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[kind]
        bound = next(iter(ctx.values()))
        return f"must be {op} {bound}, got {got!r}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"must be an int, got {got!r}"
    if kind in ("float_type", "float_parsing"):
        return f"must be a number, got {got!r}"
    if kind in ("bool_type", "bool_parsing"):
        return f"must be true or false, got {got!r}"
    if kind in ("literal_error", "enum"):
        return f"must be one of {ctx.get('expected', '')}, got {got!r}".replace("'", "")
    if kind == "string_pattern_mismatch":
        return f"must match {ctx.get('pattern')}, got {got!r}"
    if kind == "too_short":
        return f"must not be empty, got {got!r}"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    return f"{err['msg'][0].lower()}{err['msg'][1:]}, got {got!r}"


def parameter_error(exc: ValidationError) -> ParameterError:
    """The first error of a validation as the `ParameterError` that names its parameter."""
    err = exc.errors()[0]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ParameterError):
        return cause
    loc = [str(part) for part in err["loc"] if isinstance(part, str)]
    if err["type"] == "extra_forbidden" and len(loc) >= 2 and loc[0] == "switches":
        known = ", ".join(SwitchParams.model_fields)
        return ParameterError("switches", f"has unknown switch {loc[1]!r}; known: {known}")
    if err["type"] == "extra_forbidden":
        return ParameterError(".".join(loc), f"is not a parameter of refresh-model; known: {known_names()}")
    if loc and loc[0] == "switches" and err["type"] == "bool_type":
        return ParameterError("switches", f"switch {loc[-1]!r} must be true or false, got {err.get('input')!r}")
    if loc and loc[0] == "architecture" and err["type"] == "value_error":
        return ParameterError("architecture", f"is invalid: {_problem(err)}")
    name = next((part for part in reversed(loc) if part in RefreshParameters.LEAVES
                 or part in RefreshParameters.model_fields), ".".join(loc) or "parameters")
    problem = _problem(err)
    if err["type"] == "string_pattern_mismatch":
        problem += f" ({field_help(name)})"
    return ParameterError(name, problem)
