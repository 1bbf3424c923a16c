"""The fleet view (`ett.fleet`): the regression rule and the summaries with exact numbers,
the threshold globs of the automations (`ett.thresholds`) against Prefect's own matcher, and
`ettflow report --fleet` over a real warehouse of spooled runs (tests/fleet_runs.py)."""

from __future__ import annotations

import fnmatch

import pandas as pd
import pytest

from ettflow.cli import main
from ettflow.ett import fleet
from ettflow.ett.events import L2_ORDER
from ettflow.ett.thresholds import ett_below_globs, ett_label, nof_above_globs, nof_label

from helpers.fleet_runs import archive_fleet

# -- the regression rule --------------------------------------------------------------------


def test_rule_flags_a_window_above_median_plus_k_mad():
    # history 10, 11, 9, 10, 12, 10: median 10; |x - 10| = 0, 1, 1, 0, 2, 0: MAD 0.5;
    # threshold 10 + max(3 x 1.4826 x 0.5 = 2.2239, 1) = 12.2239; window median 14 > it
    base = fleet.find_regression([10, 11, 9, 10, 12, 10, 14, 15, 13])
    assert base == fleet.Baseline(recent_median_s=14, history_median_s=10, mad_s=0.5, threshold_s=pytest.approx(
        12.2239))
    assert base.regressed


def test_one_slow_run_is_no_regression():
    base = fleet.find_regression([10, 11, 9, 10, 12, 10, 14, 10, 11])  # window median 11 < 12.2239
    assert base.recent_median_s == 11 and not base.regressed


def test_a_flat_history_needs_min_increase():
    flat = [5.0] * 6
    assert fleet.find_regression([*flat, 5.5, 5.6, 5.4]).threshold_s == 6.0  # MAD 0: 5 + max(0, 1)
    assert not fleet.find_regression([*flat, 5.5, 5.6, 5.4]).regressed
    assert fleet.find_regression([*flat, 6.5, 6.2, 7.0]).regressed  # median 6.5 > 6
    rule = fleet.RegressionRule(min_increase_s=2.0)
    assert not fleet.find_regression([*flat, 6.5, 6.2, 7.0], rule).regressed  # 6.5 <= 7


def test_too_short_a_history_is_not_judged():
    assert fleet.find_regression([1, 1, 1, 1, 9, 9, 9]) is None  # 4 before the window, 5 needed
    assert fleet.find_regression([1, 1, 9, 9], fleet.RegressionRule(recent=2, min_history=2)).regressed


def test_rule_refuses_nonsense():
    with pytest.raises(ValueError, match="recent must be at least 1"):
        fleet.RegressionRule(recent=0)
    with pytest.raises(ValueError, match="k > 0"):
        fleet.RegressionRule(k=0)


# -- summaries over a frame -------------------------------------------------------------------


def frame(rows: list[dict]) -> pd.DataFrame:
    """Runs frame rows: each gives run_id, deployment, wall_start, wall_s and some components;
    effective training is the rest of the wall time; ETT% follows."""
    out = []
    for r in rows:
        comps = {f"{c}_s": float(r.get(c, 0.0)) for c in L2_ORDER if c != "effective_training"}
        effective = r["wall_s"] - sum(comps.values())
        out.append({"run_id": r["run_id"], "deployment": r["deployment"], "status": r.get("status", "completed"),
                    "wall_start": float(r["wall_start"]), "wall_s": float(r["wall_s"]), "nof": r.get("nof", 0),
                    "ett_pct": 100 * effective / r["wall_s"], "flow_run_id": r.get("flow_run_id"),
                    "tags": {}, "effective_training_s": effective, **comps})
    return pd.DataFrame(out)


def nightly_and_hourly() -> pd.DataFrame:
    compile_s = [10, 10, 11, 10, 9, 10, 20, 21, 19]  # regresses in the last three runs
    rows = [{"run_id": f"n{i}", "deployment": "nightly", "wall_start": 1000 * i, "wall_s": 50, "pt2_compile": c,
             "scheduling": 2} for i, c in enumerate(compile_s)]
    rows.insert(7, {"run_id": "n-skip", "deployment": "nightly", "wall_start": 6500, "wall_s": 1, "status": "skipped",
                    "pt2_compile": 0})  # left out: the window stays n6, n7, n8
    rows += [{"run_id": f"h{i}", "deployment": "hourly", "wall_start": 1000 * i + 1, "wall_s": 100, "pt2_compile": 5,
              "wasted_training": 10 if i == 3 else 0, "nof": 1 if i == 3 else 0, "status": "failed" if i == 3
              else "completed"} for i in range(8)]
    return frame(rows)


def test_regressions_name_component_owner_and_window():
    found = fleet.regressions(nightly_and_hourly())
    assert found == [fleet.Regression(deployment="nightly", component="pt2_compile", owner="compiler",
                                      baseline=fleet.Baseline(20, 10, 0, 11), runs=("n6", "n7", "n8"))]


def test_deployment_summary_leaves_skipped_runs_out():
    summary = fleet.deployment_summary(nightly_and_hourly()).set_index("deployment")
    assert summary.loc["nightly", "runs"] == 9 and summary.loc["nightly", "skipped"] == 1
    assert summary.loc["nightly", "ETT_last%"] == 58.0  # (50 - 19 - 2) / 50
    assert summary.loc["nightly", "ETT_min%"] == 54.0  # n7: (50 - 21 - 2) / 50
    assert summary.loc["hourly", "ETT_mean%"] == pytest.approx(93.8, abs=0.05)  # 95 x 7 + 85, / 8 = 93.75
    assert summary.loc["hourly", "NoF"] == 1 and summary.loc["hourly", "not_completed"] == 1


def test_component_shares_sum_to_the_wall():
    runs = frame([{"run_id": "a", "deployment": "d", "wall_start": 0, "wall_s": 100, "pt2_compile": 20,
                   "scheduling": 5},
                  {"run_id": "b", "deployment": "d", "wall_start": 1, "wall_s": 60, "pt2_compile": 4,
                   "wasted_training": 12}])
    shares = fleet.component_shares(runs).set_index("component")
    assert shares.loc["pt2_compile", "share_%"] == 15.0 and shares.loc["pt2_compile", "owner"] == "compiler"
    assert shares.loc["wasted_training", "share_%"] == 7.5 and shares.loc["scheduling", "seconds"] == 5.0
    assert shares.loc["effective_training", "share_%"] == 74.4  # (75 + 44) / 160
    assert shares["seconds"].sum() == pytest.approx(160)


def test_worst_runs_name_where_they_lost_most():
    worst = fleet.worst_runs(nightly_and_hourly(), n=2)
    assert worst["run"].tolist() == ["n7", "n6"]
    assert worst.iloc[0][["ETT%", "lost_most", "owner", "lost_%"]].tolist() == [54.0, "pt2_compile", "compiler", 42.0]


def test_deployment_from_tag_then_prefect_then_none():
    runs = pd.DataFrame({"run_id": ["a", "b", "c"], "flow_run_id": ["fa", "fb", None],
                         "tags": [{"deployment": "tagged"}, {}, {}]})
    assert fleet.with_deployment(runs, {"fa": "x", "fb": "known"})["deployment"].tolist() == [
        "tagged", "known", fleet.NO_DEPLOYMENT]


# -- threshold globs, checked with Prefect's own matcher ---------------------------------------


def prefect_match(globs: list[str], value: str) -> bool:
    from prefect.server.events.schemas.events import ResourceSpecification

    return ResourceSpecification({"x": globs}).matches({"x": value})


def test_threshold_examples():
    assert ett_label(73.44) == "073.4" and ett_label(100) == "100.0" and ett_label(-1) == "000.0"
    assert nof_label(2) == "002" and nof_label(5000) == "999"
    assert ett_below_globs(70) == ["0[0-6]?.?"]
    assert ett_below_globs(82.5) == ["0[0-7]?.?", "08[0-1].?", "082.[0-4]"]
    assert nof_above_globs(1) == ["[1-9]??", "0[1-9]?", "00[2-9]"]


@pytest.mark.parametrize("threshold", [0.1, 40, 60, 82.5, 99.9, 100])
def test_ett_globs_match_exactly_the_labels_below(threshold):
    globs = ett_below_globs(threshold)
    for tenths in range(0, 1001):
        label = ett_label(tenths / 10)
        assert prefect_match(globs, label) == (tenths < round(threshold * 10)), (threshold, label)
        assert any(fnmatch.fnmatchcase(label, g) for g in globs) == (tenths < round(threshold * 10))


@pytest.mark.parametrize("threshold", [0, 1, 9, 10, 99, 123])
def test_nof_globs_match_exactly_the_labels_above(threshold):
    globs = nof_above_globs(threshold)
    assert all(prefect_match(globs, nof_label(n)) == (n > threshold) for n in range(0, 1000))


# -- `ettflow report --fleet` over a warehouse of spooled runs -----------------------------------


def test_report_fleet_over_a_warehouse(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    url = f"sqlite:///{tmp_path / 'warehouse.db'}"
    archive_fleet(url, tmp_path / "spool", 1_750_000_000.0)
    assert main(["report", "--fleet", "--url", url]) == 0
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.splitlines()]
    # a nightly run: 20 s effective of 2 + compile + 20 + 2 s wall (compile 10: 58.8%); mean 54.4
    assert any(line.split()[:4] == ["nightly", "9", "0", "54.4"] for line in lines), out
    assert "nightly: ETT% of its last 9 runs, oldest first: 58.8, 58.8, 57.1, 58.8, 60.6, 58.8, 45.5, 44.4, 46.5" \
        in out
    regression = next(line for line in lines if line.startswith("nightly ") and "pt2_compile" in line)
    assert regression.split()[:7] == ["nightly", "pt2_compile", "compiler", "20.0", "10.0", "0.0", "11.0"]
    assert "nightly-6, nightly-7, nightly-8" in regression
    worst = lines[lines.index("Worst 5 runs by ETT%:") + 2]
    assert worst.split()[:2] == ["nightly-7", "nightly"] and "pt2_compile" in worst
    assert sum("hourly" in line and "pt2_compile" in line for line in lines) == 0  # hourly did not regress
    assert "Held capacity" not in out  # nothing was held outside the runs' slots
    # what a cluster pool held for a next run that never came: in the fleet view, as cost
    from ettflow.ett.capacity import UNCLAIMED_WORKER, Holding
    from ettflow.ett.warehouse import Warehouse

    with Warehouse.open(url) as wh:
        wh.record_holdings([Holding(holding_id="h1", model="nightly", kind=UNCLAIMED_WORKER, run_id=None, used=False,
                                    requested_at=100.0, released_at=1900.0, reason="idle", gpus=1.0,
                                    rule="keep-alive")])
    assert main(["report", "--fleet", "--url", url]) == 0
    out = capsys.readouterr().out
    held, by_rule = [line.split() for line in out.splitlines() if line.strip().startswith("nightly ")][-2:]
    assert held == ["nightly", "1", "1800.0", "1800.0", "1800.0", "1800.0", "0.0", "0.0"], out[-1500:]
    # and which rule held it, with its outcome
    assert by_rule == ["nightly", "unclaimed_worker", "keep-alive", "released", "unused", "1", "1800.0", "1800"]
    assert "keep-alive (kept after a release" in out
    # the fleet artifact's ledger: per model, then per rule and outcome
    from ettflow.tasks.fleet_report import held_markdown, read_held

    md = held_markdown(read_held(url))
    assert "Which rule held what" in md and "keep-alive (kept after a release" in md
    assert md.count("| nightly |") == 2 and "| unclaimed_worker | keep-alive | released unused | 1 |" in md, md


# -- realized waste far above the checkpoint plan (issue 14) ----------------------------------


def planned_runs(model: str, realized: list[float], expected: list[float | None]) -> list[dict]:
    return [{"run_id": f"{model}{i}", "deployment": "d", "wall_start": 100 * i + len(model), "wall_s": 60,
             "wasted_training": w, "model": model} for i, w in enumerate(realized)], expected


def with_plans(rows_and_plans) -> pd.DataFrame:
    rows, plans = [], []
    for r, p in rows_and_plans:
        rows += r
        plans += p
    runs = frame(rows)
    runs["model"] = [r["model"] for r in rows]
    runs["tags"] = [{} if e is None else {"checkpoint_interval": {"source": "history", "expected_wasted_s": e}}
                    for e in plans]
    return runs


def test_a_model_whose_waste_stays_far_above_its_plan_is_named():
    runs = with_plans([
        planned_runs("drift", [1.0, 1.2, 6.0, 7.0, 5.5], [1.0, 1.0, 1.5, 1.5, 1.0]),  # median 6.0 > 2 x 1.5 + 1
        planned_runs("steady", [1.0, 3.0, 2.0, 2.5], [1.0, 1.0, 1.0, 1.0]),  # median 2.5 > 2 x 1 + 1? no
        planned_runs("oneoff", [0.5, 9.0, 0.4, 0.6], [0.5, 0.5, 0.5, 0.5]),  # one bad run: median 0.6
        planned_runs("noplan", [9.0, 9.0, 9.0], [None, None, None]),  # no plan: not judged
        planned_runs("short", [9.0, 9.0], [1.0, 1.0]),  # fewer than `recent` planned runs
    ])
    assert fleet.waste_above_expected(runs) == [fleet.WasteFinding(
        model="drift", owner="storage", realized_median_s=6.0, expected_median_s=1.5,
        runs=("drift2", "drift3", "drift4"))]
    assert fleet.waste_above_expected(runs, fleet.WasteRule(ratio=1.0, min_excess_s=1.0))[1].model == "steady"
    text = fleet.fleet_text(runs)
    assert "Wasted training far above the checkpoint plan" in text and "drift2, drift3, drift4" in text
    with pytest.raises(ValueError, match="ratio"):
        fleet.WasteRule(ratio=0.5)
