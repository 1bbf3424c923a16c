"""Window selection (`tasks.window_choice.select_windows`) and the plan it shapes."""

from __future__ import annotations

import pytest

from ettflow.ett.lineage import LineageRecord, Outcome
from ettflow.tasks.plan import plan_refresh, select_windows, with_lineage

W = tuple(f"window={2024010100 + i}" for i in range(8))


def test_first_refresh_trains_the_bootstrap_range_and_holds_out_the_newest():
    c = select_windows(W[:3], None, max_windows=4)
    assert c.train == W[:2] and c.holdout == W[2] and not c.nothing_new and "first refresh" in c.reason
    c = select_windows(W, None, max_windows=4, bootstrap=2)
    assert c.train == W[:2] and c.holdout == W[-1]
    assert select_windows(W, None, max_windows=3).train == W[:3]  # no bootstrap: max_windows
    assert select_windows(W, None, max_windows=2, bootstrap=6).train == W[:6]  # its own cap


def test_later_refreshes_train_the_oldest_windows_past_the_watermark():
    c = select_windows(W, W[1], max_windows=3)
    assert c.train == W[2:5] and c.holdout == W[-1] and "2 more wait" in c.reason
    c = select_windows(W, W[4], max_windows=3)
    assert c.train == W[5:7] and "wait" not in c.reason
    # a watermark between names (data pruned, or renamed) compares by name: time order
    assert select_windows(W, "window=2024010103x", max_windows=8).train == W[4:7]


def test_nothing_new_to_train():
    c = select_windows(W[:3], W[1], max_windows=4)
    assert c.nothing_new and c.train == () and c.holdout == W[2]
    assert c.reason == f"watermark {W[1]} is the newest window before the held-out {W[2]}"
    assert select_windows(W[:3], W[2], max_windows=4).reason == f"watermark {W[2]} is the newest window"


def test_bad_arguments():
    with pytest.raises(ValueError, match="needs 2 or more"):
        select_windows(W[:1], None, max_windows=4)
    with pytest.raises(ValueError, match=">= 1"):
        select_windows(W, None, max_windows=0)


def params(data, tmp_path, **over):
    return {"data_root": str(data), "work_root": str(tmp_path / "work"), "spool_root": str(tmp_path / "spool"),
            "snapshot_root": str(tmp_path / "snap"), "max_embeddings": 100, **over}


def test_the_plan_follows_the_lineage(flow_data, tmp_path):
    from ettflow.trainer.data.windows import list_windows

    known = tuple(list_windows(flow_data))
    plan = plan_refresh(params(flow_data, tmp_path), run_id="r2")
    assert plan.trainer.windows == known[:2] and plan.trainer.eval_windows == known[2:]
    assert plan.parent is None and plan.trainer.warm_start_from is None and plan.windows_choice.holdout == known[2]
    parent = LineageRecord(model="dlrm", run_id="r1", windows=known[:1], outcome=Outcome.PUBLISHED, anchor="/a1")
    warm = with_lineage(plan, known[0], parent)
    assert warm.trainer.windows == known[1:2] and warm.trainer.warm_start_from == "/a1" and warm.parent == parent
    assert warm.watermark == known[0]
    done = with_lineage(plan, known[1], parent)
    assert done.windows_choice.nothing_new and done.trainer.windows == ()
    cold = with_lineage(plan_refresh(params(flow_data, tmp_path, warm_start=False), run_id="r2"), known[0], parent)
    assert cold.parent is None and cold.trainer.warm_start_from is None and cold.trainer.windows == known[1:2]
    explicit = with_lineage(plan_refresh(params(flow_data, tmp_path, windows=[known[0]]), run_id="r2"),
                            known[1], parent)
    assert explicit.trainer.windows == known[:1] and explicit.windows_choice.explicit
    assert explicit.trainer.eval_windows is None and explicit.trainer.warm_start_from == "/a1"


@pytest.mark.parametrize(("over", "name"), [({"max_windows": 0}, "max_windows"),
                                            ({"bootstrap_windows": 0}, "bootstrap_windows"),
                                            ({"warm_start": "yes"}, "warm_start"),
                                            ({"claim_wait_s": -1}, "claim_wait_s"),
                                            ({"keep_refreshes": 0}, "keep_refreshes")])
def test_bad_lineage_parameters_are_named(flow_data, tmp_path, over, name):
    from ettflow.tasks.plan import ParameterError

    with pytest.raises(ParameterError, match=rf"parameter '{name}'"):
        plan_refresh(params(flow_data, tmp_path, **over), run_id="r1")
