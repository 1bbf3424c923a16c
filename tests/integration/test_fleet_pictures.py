"""The fleet view's pictures (`tasks/fleet_report.py`, matplotlib): the ETT axis scaled to the
data (issue 27: fixed at 0-100, runs at 1.6-4.5% drew a flat line), drawn without error."""

from __future__ import annotations

import pandas as pd

from ettflow.tasks.fleet_report import ett_axis, ett_over_time_png


def test_the_ett_axis_is_scaled_to_the_data_and_the_goal():
    assert ett_axis([1.6, 4.5]) == (0.0, 10.0)
    assert ett_axis([1.6, 4.5], goal=50) == (0.0, 65.0)
    assert ett_axis([42.6, 6.4]) == (0.0, 55.0)
    assert ett_axis([80.0, 93.0]) == (0.0, 100.0)
    assert ett_axis([0.2]) == (0.0, 5.0)
    assert ett_axis([]) == (0.0, 100.0) and ett_axis([float("nan")]) == (0.0, 100.0)


def test_the_picture_draws_low_ett_runs_with_a_goal():
    runs = pd.DataFrame({
        "run_id": ["r1", "r2", "r3"], "deployment": ["a", "a", "b"], "wall_start": [1.7e9, 1.7e9 + 60, 1.7e9 + 30],
        "ett_pct": [1.6, 4.5, 3.0], "status": ["completed", "failed", "completed"], "outcome": ["published"] * 3})
    png = ett_over_time_png(runs, "ETT", goal=5.0)
    assert png.startswith(b"\x89PNG")


def test_the_picture_draws_capett_beside_ett_where_runs_recorded_it(monkeypatch):
    """Issue 43: capETT over time (dotted, the deployment's colour), not only its mean; rows
    archived before it existed (NaN) draw no capETT line."""
    import matplotlib.pyplot as plt

    drawn = []
    real = plt.Axes.plot

    def plot(ax, *args, **kw):
        drawn.append((kw.get("label"), kw.get("linestyle")))
        return real(ax, *args, **kw)

    monkeypatch.setattr(plt.Axes, "plot", plot)
    runs = pd.DataFrame({
        "run_id": ["r1", "r2", "r3"], "deployment": ["a", "a", "b"], "wall_start": [1.7e9, 1.7e9 + 60, 1.7e9 + 30],
        "ett_pct": [40.0, 45.0, 30.0], "capacity_ett_pct": [20.0, 25.0, float("nan")],
        "status": ["completed"] * 3, "outcome": ["published"] * 3})
    assert ett_over_time_png(runs, "ETT").startswith(b"\x89PNG")
    assert ("a ETT", None) in drawn and ("a capETT", ":") in drawn and ("b ETT", None) in drawn
    assert ("b capETT", ":") not in drawn


def test_the_worst_runs_table_labels_runs_short_enough_to_read_without_scrolling():
    from ettflow.ett.events import L2_ORDER
    from ettflow.tasks.fleet_report import _worst_md

    run_id = "0e4f1c98-cd0d-400d-8e6c-e1f091e0e806"
    runs = pd.DataFrame([{"run_id": run_id, "flow_run_id": run_id, "deployment": "nightly", "wall_start": 1.7e9,
                          "status": "completed", "ett_pct": 30.0, "nof": 1, "wall_s": 100.0,
                          **{f"{c}_s": 10.0 for c in L2_ORDER}, "pt2_compile_s": 50.0}])
    table = _worst_md(runs, 5)
    assert "[0e4f1c98](" in table and run_id not in table.split("](")[0]
    assert "| pt2_compile | compiler | 50.0 |" in table



def test_the_goal_line_is_the_automations_threshold_of_the_deployment():
    """Issue 27: the goal line is wired to what the shipped automations alert on (`ett_below`),
    per deployment, `*` for the rest and the fleet's view."""
    from ettflow.flows.fleet import ett_goals
    from ettflow.tasks.automations import AutomationsConfig
    from ettflow.tasks.fleet_report import goal_of

    goals = {"nightly": 70.0, "*": 50.0}
    assert goal_of(goals, "nightly") == 70.0 and goal_of(goals, "adhoc") == 50.0 and goal_of(goals, None) == 50.0
    assert goal_of({"nightly": 70.0}, "adhoc") is None
    assert dict(AutomationsConfig.load().ett_below) == ett_goals()
