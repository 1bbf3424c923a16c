"""`ettflow refresh --refreshes N` pieces: new data arrives on the default data exactly when a
refresh would have nothing new; the comparison table of refreshes (exact numbers)."""

from __future__ import annotations

import pandas as pd
import pytest

from ettflow.ett.events import L2_ORDER
from ettflow.ett.lineage import LineageRecord, Outcome
from ettflow.ett.refresh_comparison import comparison_table
from ettflow.ett.warehouse import Warehouse


def test_a_window_arrives_on_the_default_data_only_when_nothing_is_new(tmp_path, monkeypatch):
    from ettflow.tasks import plan
    from ettflow.tasks.arrivals import ensure_new_window
    from ettflow.tasks.plan import default_data_root as demo_root
    from ettflow.trainer.data.windows import list_windows

    monkeypatch.setenv("ETTFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("ETTFLOW_WAREHOUSE_URL", raising=False)
    monkeypatch.setitem(plan.DEMO_DATA, "rows_per_window", 512)  # the demo's windows, tiny
    params = {"model": "m"}
    assert ensure_new_window(params) is None  # first refresh: the bootstrap range is there
    known = list_windows(demo_root())
    assert len(known) == 3
    with Warehouse.open(None) as wh:  # it trained all but the held-out window
        wh.record_lineage(LineageRecord(model="m", run_id="r1", windows=tuple(known[:2]), outcome=Outcome.PUBLISHED,
                                        created_at=1.0, finished_at=2.0))
    arrived = ensure_new_window(params)
    assert arrived is not None and list_windows(demo_root()) == [*known, arrived] and arrived > known[-1]
    assert ensure_new_window(params) is None  # known[-1] is new now (arrived is held out)
    assert ensure_new_window({"model": "other"}) is None  # never refreshed: bootstrap
    assert ensure_new_window({"model": "m", "data_root": str(tmp_path / "mine")}) is None  # the user's data
    assert ensure_new_window({"model": "m", "windows": known[:1]}) is None
    assert len(list_windows(demo_root())) == 4


def test_the_comparison_gives_each_component_its_share_of_the_wall():
    row = {"run_id": "aaaaaaaa-1", "wall_s": 50.0, "tts_s": 40.0, "ett_pct": 10.0, "nof": 1}
    row.update({f"{n}_s": 0.0 for n in L2_ORDER})
    row.update(effective_training_s=5.0, pt2_compile_s=30.0, trainer_init_s=10.0, scheduling_s=4.0,
               unattributed_s=1.0)
    warm = {**row, "run_id": "bbbbbbbb-2", "wall_s": 20.0, "tts_s": 8.0, "ett_pct": 25.0, "nof": 0,
            "effective_training_s": 5.0, "pt2_compile_s": 4.0, "trainer_init_s": 6.0, "scheduling_s": 5.0,
            "unattributed_s": 0.0}
    table = comparison_table(pd.DataFrame([row, warm]), {"bbbbbbbb-2": "warm from aaaaaaaa"},
                             {"aaaaaaaa-1": ("w0", "w1"), "bbbbbbbb-2": ("w2",)})
    assert table[["refresh", "run", "start", "windows", "TTS s", "ETT %", "NoF"]].values.tolist() == [
        [1, "aaaaaaaa", "?", "w0, w1", 40.0, 10.0, 1], [2, "bbbbbbbb", "warm from aaaaaaaa", "w2", 8.0, 25.0, 0]]
    assert table[["effective_training %", "pt2_compile %", "trainer_init %", "scheduling %",
                  "unattributed %"]].values.tolist() == [[10.0, 60.0, 20.0, 8.0, 2.0], [25.0, 20.0, 30.0, 25.0, 0.0]]
    shares = [c for c in table.columns if c.endswith(" %") and c != "ETT %"]
    assert len(shares) == len(L2_ORDER)
    assert table[shares].sum(axis=1).tolist() == pytest.approx([100.0, 100.0])


def test_each_refresh_but_the_last_leaves_its_trainer_processes_warm_for_the_next(tmp_path, monkeypatch):
    # (what the pool then does on the real stack: test_trainer_e2e.py's warm-pool test)
    from ettflow.cli import build_parser
    from ettflow.flows import cli
    from ettflow.trainer.group.warm_pool import POOL

    monkeypatch.setenv("ETTFLOW_HOME", str(tmp_path))
    monkeypatch.setattr("ettflow.tasks.arrivals.ensure_new_window", lambda params: None)
    calls: list[tuple] = []

    def refresh_once(params, args):
        calls.append(("refresh", POOL.keeping))
        return 0, f"r{sum(c[0] == 'refresh' for c in calls)}"

    monkeypatch.setattr(cli, "_refresh_once", refresh_once)
    monkeypatch.setattr(cli, "wait_for_warm_pool", lambda pool: calls.append(("wait", pool is POOL)))
    monkeypatch.setattr(cli, "print_comparison", lambda run_ids, params: calls.append(("compare", run_ids)))
    args = build_parser().parse_args(["refresh", "--refreshes", "3", "--no-failure"])  # in process: no argv
    assert cli.cmd_refresh(args) == 0
    assert calls == [("refresh", True), ("wait", True), ("refresh", True), ("wait", True), ("refresh", False),
                     ("compare", ["r1", "r2", "r3"])]
    assert not POOL.keeping and POOL.workers == []  # closed at the end


def test_one_refresh_keeps_no_pool(tmp_path, monkeypatch):
    from ettflow.cli import build_parser
    from ettflow.flows import cli
    from ettflow.trainer.group.warm_pool import POOL

    monkeypatch.setenv("ETTFLOW_HOME", str(tmp_path))
    monkeypatch.setattr("ettflow.tasks.arrivals.ensure_new_window", lambda params: None)
    seen = []
    monkeypatch.setattr(cli, "_refresh_once", lambda params, args: (seen.append(POOL.keeping), (0, "r1"))[1])
    assert cli.cmd_refresh(build_parser().parse_args(["refresh", "--no-failure"])) == 0
    assert seen == [False]
