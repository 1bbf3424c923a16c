"""A training run's config: data, model, the optimization switches, checkpoints, failures.

Baseline and optimized are the same code with switches; each switch can be set alone so every
optimization is measured by itself. A run's config is data (JSON-able through `to_dict`); the
CLI and the flows only select and override it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ettflow.trainer.checkpoint.delta_chain import ChainPolicy
from ettflow.trainer.placement import Placement

from .data.schema import FeatureSchema
from .model_config import ModelConfig

# nan: a dense parameter turns NaN (trainer/rank/loop.py); corrupt: the rank's in-memory copies are corrupted
FAULT_KINDS = ("kill", "raise", "hang", "nan", "preempt", "corrupt")
# phases a scripted `hang` may stop in instead of a step (`hang:rank=1:phase=pt2_compile`)
HANG_PHASES = ("device_init", "process_group_init", "preproc_creation", "train_module_creation", "init_plugins",
               "pre_train", "get_first_batch_data", "checkpoint_restore", "pt2_compile")
# the instant a scripted `kill` may take instead of a step: the anchor checkpoint committed, its
# `anchor.json` not yet written (`kill:rank=0:phase=anchor_commit`; rank 0 writes the marker)
ANCHOR_COMMIT = "anchor_commit"
ANCHOR_SEAL = "anchor_seal"  # the devices released, the anchor's files half written by the driver
KILL_PHASES = (ANCHOR_COMMIT, ANCHOR_SEAL)


@dataclass(frozen=True, kw_only=True)
class Switches:
    parallel_init: bool = True  # independent init stages run concurrently
    fast_batch: bool = True  # compile on a synthetic batch while the DPP warms up
    compile: bool = True  # torch.compile the dense step (False: eager)
    compile_cache: bool = True  # restore / save the compile-cache archive
    async_checkpoint: bool = True  # DCP async_save with staging (False: synchronous save)
    # in-memory checkpoint tier: every save also stages each rank's shards into host memory that
    # outlives the rank (trainer/checkpoint/memory_tier.py); a live recovery's restore reads it
    # when it is intact, and so does a restart of every rank when its copies are newer than the
    # durable checkpoint. Copies are taken only with live_recovery on and a place for the spare
    # (on a GPU placement, room for its bundle)
    memory_checkpoint: bool = True
    # live recovery: when one rank fails, the healthy ranks keep their processes (imports, compiled
    # step), a pre-started warm spare takes the failed rank's place, and all restore from memory
    # (trainer/rank/live_recovery.py); False: every rank restarts (today's recovery)
    live_recovery: bool = True
    # warm pool: a run's ranks (and its spare) come from trainer processes prewarmed after the
    # previous run of this process ended (trainer/group/warm_pool.py), when the process keeps a pool
    warm_pool: bool = True
    # without the compile cache, keep PyTorch's own local inductor cache, which outlives the
    # process (what an untuned job restarting on the same host has: the honest baseline);
    # False: every process compiles in a fresh folder (a restart on a fresh host, the study's
    # fleet). No effect with `compile_cache` on (its archive restores into a fresh folder).
    local_inductor_cache: bool = True
    # delta checkpoints: a periodic checkpoint holds only the embedding rows touched since the one
    # before (TorchRec's tracker), on a full base taken as `delta_max_chain_*` say; anchors are
    # always bases (trainer/checkpoint/delta.py, delta_chain.py); the in-memory tier's copies
    # likewise, on a whole copy (memory_tier.py). On in the optimized preset (issue 44: 6.9x fewer
    # durable bytes through deployment runs, BENCHMARKS.md); off in a bare TrainerConfig, whose
    # tests name their checkpoint folders `step_<n>`
    delta_checkpoint: bool = False
    # the anchor leaves the devices in host memory: every rank serializes its part of the final
    # checkpoint into memory and hands it to the driver, the devices are released, and the driver
    # writes, seals and marks the anchor on the CPU (trainer/group/anchor_seal.py); False: the
    # ranks write and commit it to disk while holding their devices
    release_before_seal: bool = True

    @classmethod
    def baseline(cls) -> Switches:
        return cls(parallel_init=False, fast_batch=False, compile_cache=False, async_checkpoint=False,
                   memory_checkpoint=False, live_recovery=False, warm_pool=False, release_before_seal=False)

    @classmethod
    def optimized(cls) -> Switches:
        return cls(delta_checkpoint=True)

    @classmethod
    def preset(cls, mode: str) -> Switches:
        if mode not in ("baseline", "optimized"):
            raise ValueError(f"mode must be 'baseline' or 'optimized', got {mode!r}")
        return cls.baseline() if mode == "baseline" else cls.optimized()


# the grammar of `fail_at` items, as data: the CLI's help prints it as text, the run form as markdown
FAULT_KIND_HELP: tuple[tuple[str, str], ...] = (
    ("kill", "SIGKILL the rank's process (infrastructure)"),
    ("raise", "raise an exception before the step (user)"),
    ("hang", "stop making steps until the watchdog catches it (infrastructure)"),
    ("nan", "a dense parameter turns NaN, so the step's loss is not finite (numerics)"),
    ("preempt", "the rank sends itself SIGTERM, as a scheduler taking the devices back (preemption)"),
    ("corrupt", "from this step on, the rank's in-memory checkpoint copies are corrupted in the keeper (not a "
                "failure: a later recovery must notice and use the durable one)"),
    ("publish", "fail a publish try (publish; training is not touched)"),
)
FAULT_FIELD_HELP: tuple[tuple[str, str], ...] = (
    ("rank=R", "the rank (default 0)"),
    ("step=S", "at training step S, before it is trained"),
    ("phase=P", "instead of step: a hang in init stage P (e.g. pt2_compile, pre_train), or a kill at anchor_commit "
                "(the rank's part of the final checkpoint committed, or handed off to the driver, anchor.json not yet "
                "written) or at anchor_seal (the devices released, the anchor half written: SIGKILL of the driver's "
                "process, with switch release_before_seal)"),
    ("after_s=T", "kill only: T seconds after an attempt started training (sent by the driver)"),
    ("attempt=A", "only in attempt A (default: whichever attempt reaches it first)"),
    ("times=N", "publish only: the first N publish tries fail (default 1; 0 with slow_s alone)"),
    ("slow_s=T", "publish only: each publish try first waits T seconds (a slow snapshot store)"),
)
FAULT_RULE = ("Each item fires once per run: the first time the run reaches its step (or its after_s), in whichever "
              "attempt; a restart that replays that step does not fire it again.")
FAULT_EXAMPLES = ("kill:rank=1:step=30", "hang:step=5", "raise:rank=0:step=12:attempt=1", "kill:after_s=12.5",
                  "nan:step=40", "publish:times=2", "hang:rank=1:phase=pt2_compile", "preempt:rank=1:step=9",
                  "kill:rank=0:phase=anchor_commit")


def fail_at_grammar(*, markdown: bool = False) -> str:
    """The grammar of `fail_at` items: plain text (the CLI's help), or markdown lists (the run
    form: Prefect's UI joins plain lines into one paragraph)."""
    if markdown:
        return "\n".join([
            "Scripted faults, one item each: `KIND[:FIELD=VALUE]...`", "", "Kinds:", "",
            *(f"- `{k}`: {t}" for k, t in FAULT_KIND_HELP), "", "Fields:", "",
            *(f"- `{f}`: {t}" for f, t in FAULT_FIELD_HELP), "", FAULT_RULE, "",
            "Examples: " + ", ".join(f"`{e}`" for e in FAULT_EXAMPLES)])
    width = max(len(k) for k, _ in FAULT_KIND_HELP) + 2
    fwidth = max(len(f) for f, _ in FAULT_FIELD_HELP) + 2
    lines = ["Scripted faults, one item each: KIND[:FIELD=VALUE]..."]
    lines += [f"  {'kinds:' if i == 0 else '':<9}{k:<{width}}{t}" for i, (k, t) in enumerate(FAULT_KIND_HELP)]
    lines += [f"  {'fields:' if i == 0 else '':<9}{f:<{fwidth}}{t}" for i, (f, t) in enumerate(FAULT_FIELD_HELP)]
    lines += [f"  {FAULT_RULE}", "  Examples: " + "   ".join(FAULT_EXAMPLES)]
    return "\n".join(lines) + "\n"


FAIL_AT_GRAMMAR = fail_at_grammar()



@dataclass(frozen=True, kw_only=True)
class FailAt:
    """Scripted fault: `kind` on `rank` at training step `step` (or `after_s` seconds after an
    attempt started training: a SIGKILL sent by the driver; or, for a hang, in init stage
    `phase`). It fires once per run, the first time the run reaches it, in any attempt, or only
    in `attempt` when given (FAIL_AT_GRAMMAR).
    `index`: the item's place in the run's list, numbered by `TrainerConfig`; the `failure`
    marker of a fired item records it, and later attempts drop the items that fired."""

    kind: str = "kill"
    rank: int = 0
    step: int | None = None
    after_s: float | None = None
    phase: str | None = None  # a hang's init stage, or a kill's ANCHOR_COMMIT / ANCHOR_SEAL
    attempt: int | None = None  # None: any attempt
    index: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"FailAt.kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if sum(v is not None for v in (self.step, self.after_s, self.phase)) != 1:
            raise ValueError("FailAt needs exactly one of step (a training step), after_s (seconds) or phase "
                             f"(a hang's init stage, or a kill's {ANCHOR_COMMIT})")
        if self.phase is not None and not ((self.kind == "hang" and self.phase in HANG_PHASES)
                                           or (self.kind == "kill" and self.phase in KILL_PHASES)):
            raise ValueError(f"FailAt.phase is for kind='hang' in one of {HANG_PHASES}, or kind='kill' in one of "
                             f"{KILL_PHASES}; got {self.kind}:{self.phase}")
        if self.after_s is not None and self.kind != "kill":
            raise ValueError("FailAt.after_s is a SIGKILL from the driver: use kind='kill'")
        if any(v is not None and v < 0 for v in (self.rank, self.attempt, self.step, self.index)):
            raise ValueError(f"FailAt rank, attempt, step and index must be >= 0, got {self}")

    @property
    def spec(self) -> str:
        """The item in FAIL_AT_GRAMMAR (what `parse` reads back)."""
        fields_ = [("rank", self.rank), ("step", self.step), ("after_s", self.after_s), ("phase", self.phase),
                   ("attempt", self.attempt)]
        return ":".join([self.kind, *(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in fields_ if v is not None)])

    @classmethod
    def parse(cls, text: str) -> FailAt:
        """'kill:rank=1:step=30', 'hang:step=5', 'kill:after_s=12.5:attempt=1' (FAIL_AT_GRAMMAR)."""
        kind, *parts = text.split(":")
        values: dict[str, Any] = {}
        for part in parts:
            key, _, raw = part.partition("=")
            if key not in ("rank", "step", "after_s", "attempt", "phase"):
                raise ValueError(f"failure spec {text!r}: unknown field {key!r} (fields: rank, step, after_s, "
                                 "phase, attempt)")
            if key == "phase":
                values[key] = raw
                continue
            try:
                values[key] = float(raw) if key == "after_s" else int(raw)
            except ValueError:
                raise ValueError(f"failure spec {text!r}: {key} must be a number, got {raw!r}") from None
        return cls(kind=kind, **values)


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    data_root: str
    schema: FeatureSchema
    windows: tuple[str, ...] | None = None  # None: every window but the last, held out
    eval_windows: tuple[str, ...] | None = None
    work_dir: str  # checkpoints and compile cache live here, shared by attempts and runs
    compile_cache_root: str | None = None  # None: <work_dir>/compile-cache
    model: ModelConfig = field(default_factory=ModelConfig)
    switches: Switches = field(default_factory=Switches)
    world_size: int = 2
    batch_size: int = 256  # per rank
    max_steps: int | None = None  # None: every full batch of the windows
    device: str = "auto"  # auto: cuda when available, else cpu
    # "as_nccl": the training group refuses CPU tensors outside the model's state, as NCCL does,
    # even on a CPU run (gloo): control values never go on it (trainer/collectives.py; the tests use it)
    collective_check: str = "backend"
    threads_per_rank: int = 1  # same on every rank: the compile-cache key holds it
    checkpoint_every_steps: int | None = None  # None: from the metric core's optimizer
    # steps between in-memory copies (None: chosen from the copies' measured cost after a few steps)
    memory_every_steps: int | None = None
    expected_failures: float = 1.0  # per job, for the interval optimizer (when failure_rate_per_s is None)
    # the model's estimated failures per second of training (ett.failure_history), for the interval
    # chosen after the probe save; the plan sets it (and checkpoint_every_steps, when the model has history)
    failure_rate_per_s: float | None = None
    # hot spares held for live recovery (`ett.spare_sizing`: the plan sizes them by their expected
    # saving); None: one, as a run with no plan has. 0 on a CPU placement: a spare is started when a
    # rank is lost (live recovery still, its start in the TTR); on a GPU placement: no spare device
    spares: int | None = None
    keep_checkpoints: int = 2
    # with switches.delta_checkpoint: a base is taken once a chain's deltas would add up to more than
    # this share of its base's bytes, or after this many deltas (`delta_chain.ChainPolicy`)
    delta_max_chain_share: float = 1.0
    delta_max_chain_length: int = 16
    failures: tuple[FailAt, ...] = ()
    warm_start_from: str | None = None  # the parent refresh's anchor checkpoint (None: cold start)
    max_failures: int = 3  # failure budget of the driver
    placement: Placement = field(default_factory=Placement)  # ranks over the Ray nodes, elastic restarts
    # the watchdog: a rank that stays longer than its bound in one phase is hung (trainer/rank_heartbeat.py)
    # (a collective outwaits them all: `process_group_timeout_s`; raise a bound, it follows)
    startup_timeout_s: float = 240.0  # each init stage, and the launch until the rank's first beat
    compile_timeout_s: float = 240.0  # pt2_compile (a cold compile of a large model takes minutes)
    restore_timeout_s: float = 240.0  # checkpoint_restore
    step_timeout_s: float = 60.0  # a step, or the time between two steps (was `watchdog_s`)
    save_timeout_s: float = 240.0  # a checkpoint save the loop waits for (periodic, emergency, anchor)
    preemption_grace_s: float = 30.0  # from SIGTERM until the scheduler kills the rank (emergency checkpoint)
    eval_batches: int = 8  # held-out batches per rank for loss and AUC
    eval_at_start: bool = False  # also evaluate before training (in pre_train)
    log_every: int = 10
    record_steps: bool = True  # False: no train_step events (to measure the recording's cost;
    # the metric then sees no steps; the watchdog reads the ranks' heartbeats, not the steps)

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.batch_size < 1 or self.threads_per_rank < 1:
            raise ValueError("world_size, batch_size and threads_per_rank must be >= 1")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.collective_check not in ("backend", "as_nccl"):
            raise ValueError(f"collective_check must be 'backend' or 'as_nccl', got {self.collective_check!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.checkpoint_every_steps is not None and self.checkpoint_every_steps < 1:
            raise ValueError("checkpoint_every_steps must be >= 1 (or None for the optimizer)")
        if self.memory_every_steps is not None and self.memory_every_steps < 1:
            raise ValueError("memory_every_steps must be >= 1 (or None for the optimizer)")
        if self.failure_rate_per_s is not None and not (0 <= self.failure_rate_per_s < float("inf")):
            raise ValueError(f"failure_rate_per_s must be >= 0 failures per second, got {self.failure_rate_per_s!r}")
        if self.spares is not None and not 0 <= self.spares <= 1:
            raise ValueError(f"spares must be 0 or 1 (one spare per placement), got {self.spares!r}")
        if not (0 <= self.expected_failures < float("inf")):
            raise ValueError(f"expected_failures must be >= 0 per job, got {self.expected_failures!r}")
        if self.keep_checkpoints < 1 or self.max_failures < 0:
            raise ValueError("keep_checkpoints >= 1 and max_failures >= 0 required")
        self.delta_policy  # noqa: B018 - validates delta_max_chain_share and delta_max_chain_length
        self.placement.check(self.world_size)
        for name in ("startup_timeout_s", "compile_timeout_s", "restore_timeout_s", "step_timeout_s",
                     "save_timeout_s", "preemption_grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        numbered = tuple(f if f.index is not None else replace(f, index=i) for i, f in enumerate(self.failures))
        if len({f.index for f in numbered}) != len(numbered):
            raise ValueError(f"failures need distinct indexes, got {[f.index for f in numbered]}")
        object.__setattr__(self, "failures", numbered)
        for f in self.failures:
            if f.rank >= self.world_size:
                raise ValueError(f"failure {f} targets rank {f.rank} but world_size is {self.world_size}")
        for name in ("windows", "eval_windows"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if not Path(self.data_root).is_dir():
            raise ValueError(
                f"data_root {self.data_root!r} is not a folder of data windows: create one with "
                "`ettflow data generate --out DIR` or point at your Parquet windows"
            )

    @property
    def process_group_timeout_s(self) -> float:
        """The collectives' timeout: past the longest phase bound, so a rank waiting in a
        collective for a slow peer is never aborted by gloo/nccl before the watchdog judged
        the peer; the watchdog (a few seconds of polling) always speaks first."""
        return max(self.startup_timeout_s, self.compile_timeout_s, self.restore_timeout_s,
                   self.step_timeout_s, self.save_timeout_s) + 30.0

    @property
    def delta_policy(self) -> ChainPolicy:
        return ChainPolicy(max_chain_share=self.delta_max_chain_share, max_chain_length=self.delta_max_chain_length)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.work_dir) / "checkpoints"

    @property
    def compile_cache_dir(self) -> Path:
        return Path(self.compile_cache_root or Path(self.work_dir) / "compile-cache")

    @property
    def holds_spare(self) -> bool:
        """A spare is held ahead of a failure: live recovery is on and `spares` is not 0."""
        return self.switches.live_recovery and self.spares != 0

    def with_switches(self, **changes: bool) -> TrainerConfig:
        return replace(self, switches=replace(self.switches, **changes))

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["schema"] = self.schema.to_dict()
        out["model"] = asdict(self.model)
        out["switches"] = asdict(self.switches)
        out["placement"] = {**asdict(self.placement), "strategy": self.placement.strategy.value}
        out["failures"] = [asdict(f) for f in self.failures]
        return out
