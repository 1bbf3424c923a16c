"""The fleet view: ETT over runs per deployment, where the lost time goes, and regressions.

Input is the warehouse's runs frame (`Warehouse.runs_frame`) with a ``deployment`` column
(`with_deployment`). Skipped runs (nothing trained) are left out of everything here.

**Regression rule** (`find_regression`, `RegressionRule`). For one deployment and one lost
component (every component but effective training: more effective time is no regression),
take its exposed seconds per run, oldest first. The last `recent` runs are the window; the
runs before it are the history, and at least `min_history` of them are needed. With

    m   = median(history)
    MAD = median(|x - m| for x in history)
    threshold = m + max(k * 1.4826 * MAD, min_increase_s)

the component has regressed when median(window) > threshold. The median of the window makes
one slow run no regression (it takes more than half the window); the median and MAD of the
history ignore its own outliers (1.4826 * MAD estimates the standard deviation of a normal
history, so k = 3 is "three sigmas"); `min_increase_s` keeps a flat history (MAD 0) from
flagging any noise. The regression names the component and its owner (`events.OWNERS`).

**Waste above expected** (`waste_above_expected`, `WasteRule`, issue 14). Each refresh stores
the checkpoint interval it planned with its expected wasted training (`expected_wasted_s` of
the row's ``checkpoint_interval`` tag, `ett.interval_plan`); its realized waste is its L2
``wasted_training``. For one model, over its last `recent` runs that planned one:

    flagged when median(realized) > ratio * median(expected) + min_excess_s

i.e. the interval's inputs (failure rate, save blocking) no longer describe the model: its
waste stays far above what the plan promised. The finding names the model and the owner of
wasted training (storage).

The rest is summaries: `deployment_summary` (per deployment), `component_shares` (each
component's share of the wall time, with its owner), `worst_runs` (lowest ETT%) and
`fleet_text` (all of it as text: `ettflow report --fleet`). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import median

import pandas as pd

from .events import COMPONENTS, L2_ORDER, OWNERS, UNATTRIBUTED
from .report import numeric_column, utc_minute

SKIPPED = "skipped"
NO_DEPLOYMENT = "(no deployment)"
MAD_TO_SIGMA = 1.4826
# Components whose growth is lost time: all but effective training.
LOST_COMPONENTS: tuple[str, ...] = tuple(c for c in COMPONENTS if c != "effective_training")


@dataclass(frozen=True, kw_only=True)
class RegressionRule:
    """median(last `recent` runs) > median(history) + max(k * 1.4826 * MAD, min_increase_s)."""

    recent: int = 3
    min_history: int = 5
    k: float = 3.0
    min_increase_s: float = 1.0

    def __post_init__(self) -> None:
        if self.recent < 1:
            raise ValueError(f"RegressionRule.recent must be at least 1 run, not {self.recent}")
        if self.min_history < 2:
            raise ValueError(f"RegressionRule.min_history must be at least 2 runs, not {self.min_history}")
        if self.k <= 0 or self.min_increase_s < 0:
            raise ValueError(f"RegressionRule needs k > 0 and min_increase_s >= 0 (got k={self.k}, "
                             f"min_increase_s={self.min_increase_s})")


@dataclass(frozen=True)
class Baseline:
    """What the rule computed for one series."""

    recent_median_s: float
    history_median_s: float
    mad_s: float
    threshold_s: float

    @property
    def regressed(self) -> bool:
        return self.recent_median_s > self.threshold_s


@dataclass(frozen=True)
class Regression:
    deployment: str
    component: str
    owner: str
    baseline: Baseline
    runs: tuple[str, ...]  # the window's run ids, oldest first


def find_regression(series: Sequence[float], rule: RegressionRule = RegressionRule()) -> Baseline | None:
    """The rule applied to one component's exposed seconds (oldest run first); None when the
    history is too short to judge (fewer than `rule.recent + rule.min_history` runs)."""
    if len(series) < rule.recent + rule.min_history:
        return None
    history, window = list(series[: -rule.recent]), list(series[-rule.recent:])
    m = median(history)
    mad = median(abs(x - m) for x in history)
    threshold = m + max(rule.k * MAD_TO_SIGMA * mad, rule.min_increase_s)
    return Baseline(recent_median_s=median(window), history_median_s=m, mad_s=mad, threshold_s=threshold)


@dataclass(frozen=True, kw_only=True)
class WasteRule:
    """median(realized) over the last `recent` planned runs > ratio * median(expected) + min_excess_s."""

    recent: int = 3
    ratio: float = 2.0
    min_excess_s: float = 1.0

    def __post_init__(self) -> None:
        if self.recent < 1 or not self.ratio >= 1.0 or not self.min_excess_s >= 0:
            raise ValueError(f"WasteRule needs recent >= 1, ratio >= 1 and min_excess_s >= 0, got {self}")


@dataclass(frozen=True)
class WasteFinding:
    model: str
    owner: str
    realized_median_s: float
    expected_median_s: float
    runs: tuple[str, ...]  # oldest first


def expected_waste(tags: object) -> float | None:
    """The expected wasted training a run's interval plan stored (None: no plan, or none given)."""
    plan = tags.get("checkpoint_interval") if isinstance(tags, Mapping) else None
    value = plan.get("expected_wasted_s") if isinstance(plan, Mapping) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def waste_above_expected(runs: pd.DataFrame, rule: WasteRule = WasteRule()) -> list[WasteFinding]:
    """The models whose realized wasted training over their last `rule.recent` planned runs
    stays far above the plans' expectation (see the module docstring), by model."""
    found = []
    done = trained(runs)
    expected = [expected_waste(t) for t in done["tags"]]
    planned = done.assign(expected_s=expected)[[e is not None for e in expected]]
    for model, group in planned.groupby("model", sort=True):
        last = group.tail(rule.recent)
        if len(last) < rule.recent:
            continue
        realized = median(last["wasted_training_s"].astype(float))
        promised = median(last["expected_s"].astype(float))
        if realized > rule.ratio * promised + rule.min_excess_s:
            found.append(WasteFinding(model=str(model), owner=OWNERS["wasted_training"], realized_median_s=realized,
                                      expected_median_s=promised, runs=tuple(last["run_id"])))
    return found


def describe_waste_rule(rule: WasteRule) -> str:
    return (f"a model's realized wasted training is far above its checkpoint plans' expectation when its median "
            f"over its last {rule.recent} planned runs exceeds {rule.ratio:g} x the expected median + "
            f"{rule.min_excess_s:g} s")


def waste_table(found: Sequence[WasteFinding]) -> pd.DataFrame:
    rows = [{"model": f.model, "owner": f.owner, "realized_median_s": round(f.realized_median_s, 3),
             "expected_median_s": round(f.expected_median_s, 3), "runs": ", ".join(f.runs)} for f in found]
    return pd.DataFrame(rows, columns=["model", "owner", "realized_median_s", "expected_median_s", "runs"])


def with_deployment(runs: pd.DataFrame, names: Mapping[str, str] | None = None) -> pd.DataFrame:
    """`runs` with a ``deployment`` column: the row's ``deployment`` tag, else the name `names`
    gives its flow run id (e.g. read from Prefect), else NO_DEPLOYMENT."""
    names = names or {}

    def one(tags: object, flow_run_id: object) -> str:
        tagged = tags.get("deployment") if isinstance(tags, Mapping) else None
        return str(tagged or names.get(str(flow_run_id)) or NO_DEPLOYMENT)

    return runs.assign(deployment=[one(t, f) for t, f in zip(runs["tags"], runs["flow_run_id"], strict=True)])


def trained(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs that trained (not skipped), oldest first."""
    return runs[runs["status"] != SKIPPED].sort_values(["wall_start", "run_id"], ignore_index=True)


def regressions(runs: pd.DataFrame, rule: RegressionRule = RegressionRule()) -> list[Regression]:
    """Every (deployment, lost component) whose recent runs regressed, by deployment then
    component priority."""
    found = []
    for deployment, group in trained(runs).groupby("deployment", sort=True):
        for component in LOST_COMPONENTS:
            base = find_regression(group[f"{component}_s"].astype(float).tolist(), rule)
            if base is not None and base.regressed:
                found.append(Regression(deployment=str(deployment), component=component, owner=OWNERS[component],
                                        baseline=base, runs=tuple(group["run_id"].iloc[-rule.recent:])))
    return found


def deployment_summary(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per deployment: runs trained, skipped, ETT% (mean, min, last), the
    capacity-inclusive ETT% (mean) and the slot-seconds held for its runs by the pool and
    spares, failures (NoF summed), runs that did not complete, and when the last one started."""
    rows = []
    for deployment, group in runs.sort_values(["wall_start", "run_id"]).groupby("deployment", sort=True):
        done = trained(group)
        rows.append({
            "deployment": deployment,
            "runs": len(done),
            "skipped": int((group["status"] == SKIPPED).sum()),
            "ETT_mean%": round(float(done["ett_pct"].mean()), 1) if len(done) else None,
            "ETT_min%": round(float(done["ett_pct"].min()), 1) if len(done) else None,
            "ETT_last%": round(float(done["ett_pct"].iloc[-1]), 1) if len(done) else None,
            "capETT_mean%": _mean(numeric_column(done, "capacity_ett_pct")),  # held capacity counted
            "held_s": round(float(numeric_column(done, "held_s").sum()), 1),
            "NoF": int(done["nof"].sum()),
            "not_completed": int((done["status"] != "completed").sum()),
            "last_started": _when(group["wall_start"].iloc[-1]),
        })
    return pd.DataFrame(rows, columns=["deployment", "runs", "skipped", "ETT_mean%", "ETT_min%", "ETT_last%",
                                       "capETT_mean%", "held_s", "NoF", "not_completed", "last_started"])


def _mean(values: pd.Series) -> float | None:
    """The mean of the values there are (None: none, e.g. rows archived before the column)."""
    values = values.dropna()
    return round(float(values.mean()), 1) if len(values) else None


def component_shares(runs: pd.DataFrame) -> pd.DataFrame:
    """Each L2 bucket's share of the summed wall time of the trained runs, grouped by owner
    (owners by name, unattributed last; the shares sum to 100): owner, component, seconds, share_%."""
    done = trained(runs)
    wall = float(done["wall_s"].sum())
    rows = [{"owner": OWNERS.get(c, "-"), "component": c, "seconds": round(float(done[f"{c}_s"].sum()), 3),
             "share_%": round(100 * float(done[f"{c}_s"].sum()) / wall, 1) if wall > 0 else 0.0}
            for c in L2_ORDER]
    rows.sort(key=lambda r: (r["owner"] == "-", r["owner"]))  # stable: L2 order within an owner
    return pd.DataFrame(rows, columns=["owner", "component", "seconds", "share_%"])


def worst_lost(row: Mapping[str, object]) -> str:
    """The lost component that took the most of a run's wall time (unattributed included)."""
    return max((*LOST_COMPONENTS, UNATTRIBUTED), key=lambda c: float(row[f"{c}_s"]))  # type: ignore[arg-type]


def worst_runs(runs: pd.DataFrame, n: int = 5) -> pd.DataFrame:
    """The `n` trained runs with the lowest ETT%: where each lost most, and its flow run."""
    done = trained(runs).sort_values(["ett_pct", "wall_start"], ignore_index=True).head(n)
    rows = []
    for _, r in done.iterrows():
        lost = worst_lost(r)
        rows.append({"run": r["run_id"], "deployment": r["deployment"], "started": _when(r["wall_start"]),
                     "status": r["status"], "ETT%": round(float(r["ett_pct"]), 1), "NoF": int(r["nof"]),
                     "lost_most": lost, "owner": OWNERS.get(lost, "-"),
                     "lost_%": round(100 * float(r[f"{lost}_s"]) / float(r["wall_s"]), 1) if r["wall_s"] else 0.0,
                     "flow_run_id": r["flow_run_id"]})
    return pd.DataFrame(rows, columns=["run", "deployment", "started", "status", "ETT%", "NoF", "lost_most", "owner",
                                       "lost_%", "flow_run_id"])


def regression_table(found: Sequence[Regression]) -> pd.DataFrame:
    rows = [{"deployment": r.deployment, "component": r.component, "owner": r.owner,
             "recent_median_s": round(r.baseline.recent_median_s, 3),
             "history_median_s": round(r.baseline.history_median_s, 3), "MAD_s": round(r.baseline.mad_s, 3),
             "threshold_s": round(r.baseline.threshold_s, 3), "runs": ", ".join(r.runs)} for r in found]
    return pd.DataFrame(rows, columns=["deployment", "component", "owner", "recent_median_s", "history_median_s",
                                       "MAD_s", "threshold_s", "runs"])


def describe_rule(rule: RegressionRule) -> str:
    return (f"a lost component regressed when the median of its exposed seconds over the last {rule.recent} runs "
            f"exceeds median(history) + max({rule.k:g} x 1.4826 x MAD, {rule.min_increase_s:g} s), "
            f"history being the runs before them (at least {rule.min_history})")


def fleet_text(runs: pd.DataFrame, rule: RegressionRule = RegressionRule(), *, worst: int = 5) -> str:
    """`ettflow report --fleet`: per deployment, the component shares, the worst runs, and the
    regressions, as text tables."""
    found = regressions(runs, rule)
    parts = ["Fleet: ETT per deployment (skipped runs left out of the ETT columns)",
             deployment_summary(runs).fillna("-").to_string(index=False), ""]
    for deployment, group in runs.groupby("deployment", sort=True):
        done = trained(group)
        if done.empty:
            continue
        series = ", ".join(f"{v:.1f}" for v in done["ett_pct"].tail(20))
        parts += [f"{deployment}: ETT% of its last {min(len(done), 20)} runs, oldest first: {series}"]
    parts += ["", "Where the wall time went (all deployments, share of summed wall time, by owner):",
              component_shares(runs).to_string(index=False), "",
              f"Worst {worst} runs by ETT%:", _or_none(worst_runs(runs, worst).drop(columns="flow_run_id")), "",
              "Regressions (" + describe_rule(rule) + "):"]
    parts.append(_or_none(regression_table(found)) if found else "(none)")
    waste = waste_above_expected(runs) if "model" in runs.columns else []
    parts += ["", "Wasted training far above the checkpoint plan (" + describe_waste_rule(WasteRule()) + "):",
              _or_none(waste_table(waste)) if waste else "(none)"]
    return "\n".join(parts)


def _or_none(frame: pd.DataFrame) -> str:
    return "(none)" if frame.empty else frame.to_string(index=False)


def _when(epoch: float) -> str:
    return utc_minute(epoch)
