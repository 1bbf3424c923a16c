"""`ettflow bench refreshes`: a sequence of continuous refreshes of one model, measured.

Every refresh goes through the product path: the `refresh_model` flow (claim the windows past
the model's watermark, reserve, train from the parent's anchor, anchor, release, publish and
gate, record the lineage), with its own warehouse, spool, work and snapshot roots under the
output folder, so nothing mixes with the user's models.

- **Synthetic sequence**, per mode (optimized, then baseline, each its own data root and
  model): a root of two hourly windows; refresh 1 trains w0 with w1 held out (cold); before
  each later refresh `append_window` adds one window (what `ettflow data append` does) and the
  refresh trains the one window past the watermark, warm from its parent's anchor, the new
  window held out (the gate scores it; its limit is off here, so a noisy held-out AUC cannot
  change which windows the next refresh trains). Each refresh is measured from its spool
  (`ett.run_metrics`): TTS and ETT%, and TTS split by what the run did before its first new
  step (`tts_parts`).
- **MovieLens-100K** (`ettflow data movielens`, time-ordered windows): the windows arrive one
  at a time into a live root; refresh k trains the windows past the watermark (warm) and is
  gated on the window after them (the publish gate, `gate_max_auc_drop`). Beside it a model is
  trained from scratch (cold, gate off) on the same cumulative windows: the ones along the
  refresh's chain of parents. Both snapshots are scored on the whole next window by the
  gate's own scoring (`publish.gate.score_snapshot`).

The pure part (`tts_parts`, `measure_refresh`, `sequence_table`, `warm_tts_summary`,
`dominant_sentence`) takes events and rows, so tests check it with exact numbers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ettflow.ett.events import PhaseEvent
from ettflow.ett.run_metrics import compute_run_metrics
from ettflow.ett.timeline import faults, intervals_of, sweep
from ettflow.tasks.parameters import RefreshParameters

if TYPE_CHECKING:  # imported where a table is built: every `ettflow` command imports this module
    import pandas as pd

TTS_PARTS: tuple[str, ...] = ("scheduling", "init", "restore", "compile", "other")
MODES: tuple[str, ...] = ("optimized", "baseline")


# ---- the pure part -------------------------------------------------------------------------
def tts_parts(events: Sequence[PhaseEvent]) -> tuple[dict[str, float], dict[str, float]]:
    """TTS split into exposed seconds (they sum to TTS): scheduling, init (trainer_init without
    the checkpoint restore), restore (`checkpoint_restore`), compile (pt2_compile, cache restore
    included) and other (any other bucket, unattributed included); and the exposed seconds of
    each phase before the first new step. The sweep of `ett.timeline` over
    [wall start, wall start + TTS]."""
    metrics = compute_run_metrics(events)
    start = metrics.wall_start
    intervals, _, _ = intervals_of(events, faults(events))
    components, _, phases = sweep(intervals, start, start + metrics.tts_s)
    restore = phases["checkpoint_restore"].exposed_s if "checkpoint_restore" in phases else 0.0
    parts = {"scheduling": components["scheduling"], "init": components["trainer_init"] - restore,
             "restore": restore, "compile": components["pt2_compile"]}
    parts["other"] = max(metrics.tts_s - sum(parts.values()), 0.0)
    return parts, {name: t.exposed_s for name, t in phases.items() if t.exposed_s > 0}


@dataclass(frozen=True, kw_only=True)
class RefreshMeasure:
    """One refresh of a sequence: what it trained and how its wall clock went."""

    mode: str
    refresh: int  # 1-based position in the sequence
    run_id: str
    windows: tuple[str, ...]
    warm: bool  # started from its parent's anchor
    outcome: str  # published, gated
    wall_s: float
    tts_s: float
    ett_pct: float
    effective_s: float
    parts: dict[str, float]  # TTS_PARTS -> exposed seconds
    tts_phases: dict[str, float]  # phase -> exposed seconds before the first new step
    path: str = "in-process"  # how it ran: a deployment run ("deployed") or in this process
    held_s: float = 0.0  # slot-seconds the pool and spares held for it (`ett.capacity`)
    capacity_ett_pct: float = 0.0

    @property
    def top_phase(self) -> tuple[str, float]:
        """The phase with the most exposed time in TTS, and its seconds."""
        return max(self.tts_phases.items(), key=lambda kv: kv[1], default=("none", 0.0))


def measure_refresh(mode: str, refresh: int, result: dict[str, Any], events: Sequence[PhaseEvent], *,
                    path: str = "in-process") -> RefreshMeasure:
    """A refresh's row from the flow's result (`refresh_model`'s dict) and its spooled events."""
    metrics = compute_run_metrics(events)
    parts, phases = tts_parts(events)
    return RefreshMeasure(mode=mode, refresh=refresh, run_id=metrics.run_id, windows=tuple(result["windows"]),
                          warm=result.get("parent") is not None, outcome=str(result["outcome"]),
                          wall_s=metrics.wall_s, tts_s=metrics.tts_s, ett_pct=metrics.ett_pct,
                          effective_s=metrics.effective_s, parts=parts, tts_phases=phases, path=path,
                          held_s=metrics.held.held_s, capacity_ett_pct=metrics.capacity_ett_pct)


def sequence_table(rows: Sequence[RefreshMeasure]) -> pd.DataFrame:
    """One line per refresh, in the order given, seconds rounded to 0.01."""
    import pandas as pd

    return pd.DataFrame([{
        "mode": r.mode, "path": r.path, "refresh": r.refresh, "windows": len(r.windows), "trained": _span(r.windows),
        "start": "warm" if r.warm else "cold", "outcome": r.outcome, "TTS_s": round(r.tts_s, 2),
        "ETT%": round(r.ett_pct, 2), "capETT%": round(r.capacity_ett_pct, 2), "held_s": round(r.held_s, 1),
        "wall_s": round(r.wall_s, 2), "effective_s": round(r.effective_s, 2),
        **{f"{p}_s": round(r.parts[p], 2) for p in TTS_PARTS},
        "largest_tts_phase": f"{r.top_phase[0]} {r.top_phase[1]:.2f}"} for r in rows])


def warm_tts_summary(rows: Sequence[RefreshMeasure]) -> pd.DataFrame:
    """Per mode, the mean over its warm refreshes of TTS and of each TTS part (seconds)."""
    import pandas as pd

    out = []
    for mode in dict.fromkeys(r.mode for r in rows):
        warm = [r for r in rows if r.mode == mode and r.warm]
        if not warm:
            continue
        n = len(warm)
        mean = {p: sum(r.parts[p] for r in warm) / n for p in TTS_PARTS}
        phases = {name: sum(r.tts_phases.get(name, 0.0) for r in warm) / n
                  for name in dict.fromkeys(name for r in warm for name in r.tts_phases)}
        phase = max(phases, key=phases.__getitem__, default="none")
        out.append({"mode": mode, "warm_refreshes": n, "TTS_s": round(sum(r.tts_s for r in warm) / n, 2),
                    **{f"{p}_s": round(mean[p], 2) for p in TTS_PARTS},
                    "dominant": max(TTS_PARTS, key=mean.__getitem__), "largest_phase": phase,
                    "largest_phase_s": round(phases.get(phase, 0.0), 2)})
    return pd.DataFrame(out)


PART_WORDS = {"scheduling": "scheduling (claim, reserve the Ray placement)",
              "init": "trainer init", "restore": "the checkpoint restore", "compile": "the PT2 compile",
              "other": "time no startup phase covers"}


def dominant_sentence(summary: pd.DataFrame) -> str:
    """What dominates the warm refreshes' TTS, one sentence per mode, from `warm_tts_summary`."""
    said = []
    for row in summary.itertuples(index=False):
        part = row.dominant
        share = 100 * getattr(row, f"{part}_s") / row.TTS_s if row.TTS_s else 0.0
        said.append(f"{row.mode}: {PART_WORDS[part]}, {getattr(row, f'{part}_s'):.2f} of {row.TTS_s:.2f} s "
                    f"({share:.0f}%); its largest phase is {row.largest_phase} ({row.largest_phase_s:.2f} s)")
    return "The warm refreshes' TTS is dominated by " + "; ".join(said) + "." if said else ""


def _span(windows: Sequence[str]) -> str:
    return f"{windows[0]}..{windows[-1]}" if len(windows) > 1 else (windows[0] if windows else "-")


# ---- running refreshes through the product path ----------------------------------------------
@dataclass(frozen=True, kw_only=True)
class SequencePlan:
    """Sizes of `ettflow bench refreshes`. refreshes: per mode (the first is cold);
    movielens_windows: MovieLens-100K split into this many windows (0: that part is skipped;
    it runs movielens_windows - 1 refreshes, each with a from-scratch model beside it)."""

    refreshes: int = 5
    rows_per_window: int = 65_536
    batch_size: int = 128
    world_size: int = 2
    max_embeddings: int = 10_000
    modes: tuple[str, ...] = MODES
    movielens_windows: int = 5
    movielens_batch_size: int = 64
    seed: int = 11

    def __post_init__(self) -> None:
        for name in ("refreshes", "rows_per_window", "batch_size", "world_size", "max_embeddings",
                     "movielens_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SequencePlan.{name} must be an int >= 1, got {value!r}")
        if self.movielens_windows != 0 and self.movielens_windows < 2:
            raise ValueError(f"SequencePlan.movielens_windows is 0 (skip) or >= 2, got {self.movielens_windows}")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"SequencePlan.modes are among {MODES}, got {self.modes!r}")


class Refresher:
    """Runs `refresh_model` with this bench's roots (under `state`) and reads each run back."""

    def __init__(self, state: Path, plan: SequencePlan, runner: Any = None) -> None:
        from .deployed import InProcessRunner

        self.state, self.plan = state, plan
        self.spool = state / "spool"
        self.url = f"sqlite:///{state / 'warehouse.db'}"
        self.runner = runner if runner is not None else InProcessRunner()  # bench/deployed.py

    def params(self, model: str, data_root: Path, **over: Any) -> RefreshParameters:
        """The refresh's parameters: this bench's roots and sizes, `over` (any spelling) on top."""
        return RefreshParameters.parse({"model": model, "data_root": str(data_root), "world_size": self.plan.world_size,
                "batch_size": self.plan.batch_size, "max_embeddings": self.plan.max_embeddings, "fail_at": [],
                "work_root": str(self.state / "work"), "snapshot_root": str(self.state / "snapshots" / model),
                "spool_root": str(self.spool), "warehouse_url": self.url,
                "tags": {"benchmark": True, "bench": "refreshes"}, "bootstrap_windows": 1}, **over)

    def run(self, params: RefreshParameters) -> tuple[dict[str, Any], list[PhaseEvent]]:
        """One refresh on the runner's path (a deployment run, or the flow in this process)."""
        result, events = self.runner.run(params)
        if result.get("outcome") not in ("published", "gated"):
            raise RuntimeError(f"refresh {result.get('run_id')} of {params.model} trained nothing: "
                               f"{result.get('outcome')}")
        return result, events


def run_sequence(refresher: Refresher, mode: str, *, bar: Any = None,
                 say: Callable[[str], None] = print) -> list[RefreshMeasure]:
    """`plan.refreshes` refreshes of model `seq-<mode>`, one window appended before each but the first."""
    from ettflow.trainer.data.synthetic import SyntheticConfig, append_window, generate_windows

    plan = refresher.plan
    data = refresher.state / f"data-{mode}"
    generate_windows(data, SyntheticConfig(windows=2, rows_per_window=plan.rows_per_window, files_per_window=1,
                                           seed=plan.seed))
    pool = refresher.runner
    rows = []
    for i in range(1, plan.refreshes + 1):
        if i > 1:
            append_window(data)
            # refreshes are hours apart in production: the processes the last one left
            # prewarming (optimized mode's warm pool) are ready before the next starts
            pool.wait_pool(120.0)
        pool.keep_warm(i < plan.refreshes)
        # the gate is off here: its scoring runs either way (same cost), but a noisy held-out
        # AUC must not change which windows the next refresh trains; MovieLens gates
        try:
            result, events = refresher.run(refresher.params(f"seq-{mode}", data, mode=mode, gate_max_auc_drop=None))
        except BaseException:
            pool.close()
            raise
        row = measure_refresh(mode, i, result, events, path=pool.path)
        rows.append(row)
        say(f"{mode} refresh {i}: {_span(row.windows)} ({'warm' if row.warm else 'cold'}), TTS {row.tts_s:.1f} s, "
            f"ETT {row.ett_pct:.1f}%, wall {row.wall_s:.1f} s")
        if bar is not None:
            bar.update()
    pool.close()
    return rows


def run_movielens(refresher: Refresher, source_cache: Path, *, bar: Any = None,
                  say: Callable[[str], None] = print) -> pd.DataFrame:
    """Refreshes over time-ordered MovieLens windows arriving one at a time, each gated on the
    window after it, and a from-scratch model on the same cumulative windows; held-out AUC and
    log loss of both on the whole next window (the gate's scoring), and the AUC there of the
    snapshot that was current before the refresh (what the gate compared with, on its sample)."""
    import pandas as pd

    from ettflow.publish import PublishConfig, read_current, read_manifest
    from ettflow.publish.gate import score_snapshot
    from ettflow.trainer.data.movielens import movielens_windows
    from ettflow.trainer.data.schema import FeatureSchema
    from ettflow.trainer.data.windows import list_windows

    plan = refresher.plan
    full, live = refresher.state / "movielens-all", refresher.state / "movielens"
    movielens_windows(full, windows=plan.movielens_windows, cache_dir=source_cache)
    names = list_windows(full)
    live.mkdir(parents=True)
    shutil.copy2(full / "_schema.json", live / "_schema.json")
    chain: dict[str | None, tuple[str, ...]] = {None: ()}  # run -> the windows its model has trained
    rows = []
    for k in range(len(names) - 1):
        for name in names[: k + 2]:  # the windows known so far; the newest is held out
            if not (live / name).exists():
                shutil.copytree(full / name, live / name)
        held = names[k + 1]
        common = {"batch_size": plan.movielens_batch_size, "max_embeddings": None}
        params = refresher.params("ml-refresh", live, **common)
        before = read_current(params.storage.snapshot_root)
        ref, _ = refresher.run(params)
        chain[ref["run_id"]] = chain[ref["parent"]] + tuple(ref["windows"])
        seen = list(chain[ref["run_id"]])
        scratch, _ = refresher.run(refresher.params("ml-scratch", live, windows=seen, eval_windows=[held],
                                                    warm_start=False, gate_max_auc_drop=None, **common))
        snapshots = {"refresh": ref["snapshot"], "scratch": scratch["snapshot"],
                     "current": before.path if before is not None else None}
        scores = {}
        for side, folder in snapshots.items():
            if folder is None:
                continue
            manifest = read_manifest(folder)
            config = PublishConfig(anchor=ref["anchor"], output_root=refresher.state / "scored", data_root=live,
                                   windows=(held,), batch_size=512, validation_batches=10_000)
            scores[side] = score_snapshot(folder, config, FeatureSchema.from_dict(manifest.schema))
        rows.append({"refresh": k + 1, "trained": _span(ref["windows"]), "start": "warm" if ref["parent"] else "cold",
                     "outcome": ref["outcome"], "cumulative": _span(seen), "n_windows": len(seen), "held_out": held,
                     "refresh_auc": scores["refresh"].auc, "scratch_auc": scores["scratch"].auc,
                     "current_auc": scores["current"].auc if "current" in scores else None,
                     "refresh_logloss": scores["refresh"].logloss, "scratch_logloss": scores["scratch"].logloss})
        say(f"movielens refresh {k + 1}: trained {_span(ref['windows'])} ({ref['outcome']}), held out {held}: "
            f"AUC refresh {scores['refresh'].auc} vs scratch {scores['scratch'].auc}")
        if bar is not None:
            bar.update()
    frame = pd.DataFrame(rows)
    frame["auc_diff"] = (frame["refresh_auc"] - frame["scratch_auc"]).round(4)
    return frame


# ---- the command ---------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SequencePlan()
    p.add_argument("--out", default="results/refreshes", help="results folder (default: ./results/refreshes)")
    p.add_argument("--refreshes", type=int, default=d.refreshes, help="refreshes per mode (the first is cold)")
    p.add_argument("--rows-per-window", type=int, default=d.rows_per_window)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per rank")
    p.add_argument("--modes", default=",".join(d.modes), help="comma-separated, run in this order")
    p.add_argument("--movielens-windows", type=int, default=d.movielens_windows,
                   help="MovieLens-100K split into this many time-ordered windows (0: skip MovieLens)")
    p.add_argument("--movielens-batch-size", type=int, default=d.movielens_batch_size, help="per rank")
    p.add_argument("--verbose", action="store_true", help="show every library's warnings and logs too")
    add_path_argument(p)


def add_path_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", choices=("deployed", "in-process"), default="deployed",
                   help="deployed (default): every job a run of the refresh-adhoc deployment that the local "
                   "stack's process worker executes in a new process (`ettflow up`'s stack, brought up if it is "
                   "not; it keeps running), ranks and spares from the cluster's pool; in-process: the flow in "
                   "this process, as before (its own warm pool, a local Ray)")


def flow_environment() -> None:
    """Settings for running flows in this process on Prefect's ephemeral API (a cold machine
    needs more than its default start timeout) and a local Ray; before either is imported."""
    for key, value in (("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180"),
                       ("PREFECT_SERVER_ANALYTICS_ENABLED", "false"), ("RAY_USAGE_STATS_ENABLED", "0")):
        os.environ.setdefault(key, value)


def main(args: argparse.Namespace) -> int:
    flow_environment()
    from .deployed import prepare_environment

    prepare_environment(getattr(args, "path", "in-process"))  # before Ray is imported
    from ettflow.console import quiet_third_party

    quiet_third_party(verbose=getattr(args, "verbose", False))  # before Prefect and Ray are imported
    import ray
    from tqdm import tqdm

    from . import plots
    from .output import Clock, command_line, write_tables

    plan = SequencePlan(refreshes=args.refreshes, rows_per_window=args.rows_per_window, batch_size=args.batch_size,
                        modes=tuple(filter(None, args.modes.split(","))), movielens_windows=args.movielens_windows,
                        movielens_batch_size=args.movielens_batch_size)
    out = Path(args.out).resolve()
    state = out / f"state-{time.strftime('%Y%m%d-%H%M%S')}"  # fresh lineages: a new warehouse every run
    state.mkdir(parents=True)
    clock = Clock()
    from .deployed import runner

    if args.path == "in-process" and not os.environ.get("RAY_ADDRESS"):  # once, as a long-lived worker has
        # it: not in refresh 1's TTS. A new local Ray even where /tmp/ray names another cluster
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=True)
    refresher = Refresher(state, plan, runner(args.path, say=clock.say))
    clock.say(f"{args.path} path up; refreshes under {state}")
    total = plan.refreshes * len(plan.modes) + max(plan.movielens_windows - 1, 0)
    rows: list[RefreshMeasure] = []
    with tqdm(total=total, desc="refreshes", unit="refresh") as bar:
        for mode in plan.modes:
            rows += run_sequence(refresher, mode, bar=bar, say=clock.say)
        movielens = (run_movielens(refresher, out / "_movielens-source", bar=bar, say=clock.say)
                     if plan.movielens_windows else None)
    tables = {"refreshes": sequence_table(rows), "warm_tts": warm_tts_summary(rows)}
    if movielens is not None:
        tables["movielens"] = movielens
    plots.ett_per_refresh(tables["refreshes"], out / "refreshes.png")
    sentence = dominant_sentence(tables["warm_tts"])
    header = (f"# ettflow bench refreshes\n\nCommand: `{command_line(args)}`; "
              f"path: {args.path}; plan: {asdict(plan)}; took {clock.elapsed():.0f} s; warehouse {refresher.url}.")
    write_tables(out, tables, header=header, footer=sentence)
    print(f"\n{sentence}")
    clock.say(f"done: tables, CSV and refreshes.png in {out}; `ettflow report --url {refresher.url} --model "
              f"seq-optimized --lineage` shows a chain")
    return 0
