"""`ettflow bench --quick --path in-process` at tiny sizes, so the command cannot rot: every job
a real `refresh_model` flow run (Prefect, Ray, TorchRec, two SIGKILLs each), tables, CSV, PNG
and the warehouse rows. (The default path, deployment runs on the local stack, shares every
part but the runner, bench/deployed.py; it is measured in BENCHMARKS.md and not run here: a
stack of its own and worker-started runs cost the suite over two minutes.) Its pure parts:
unit/test_bench_jobs.py."""

import json

import pandas as pd
import pytest


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quick_bench_at_tiny_sizes(tmp_path, prefect_harness, ray_session, capsys):
    """The command end to end at the smallest sizes that exercise its path: the warm-up, the
    pair (baseline and optimized, two SIGKILLs each) as real `refresh_model` flow runs, one
    interleaved pair of recording-overhead runs, every table, CSV, picture and warehouse row.
    A smoke run: no PT2 compile in any job (`--switch compile=false`: the baseline's cold
    compile on every attempt alone would take minutes here), the ablation rows and the compile
    ablation left out (the rows' flow parameters: `test_rows_are_refresh_parameters_the_flow_s_plan_accepts`;
    the warm pool's pooled ranks: e2e/test_trainer.py)."""
    from ettflow.cli import main
    from ettflow.ett.warehouse import Warehouse

    url = f"sqlite:///{tmp_path / 'wh.db'}"
    rc = main(["bench", "--quick", "--path", "in-process", "--out", str(tmp_path / "results"), "--url", url,
               "--lengths", "1",
               "--rows-per-window", "2048", "--batch-size", "32", "--num-embeddings", "200",
               "--overhead-repeats", "1", "--switch", "compile=false", "--skip", "ablation,rows"])
    assert rc == 0
    out = capsys.readouterr().out
    results = tmp_path / "results"
    for name in ("ett_pair", "ett_rows", "ttr_per_failure", "attribution", "job_length", "checkpoint_blocking",
                 "wasted_vs_interval", "shutdown", "overhead", "targets"):
        assert (results / f"{name}.csv").is_file() and f"== {name} ==" in out, name
    assert not (results / "ttr_live_recovery.csv").exists()  # its row (live recovery off) did not run
    for picture in ("components.png", "ett_vs_length.png", "wasted_vs_interval.png"):
        assert (results / picture).stat().st_size > 1000
    pair = pd.read_csv(results / "ett_pair.csv").set_index("mode")
    assert list(pair["NoF"][["baseline", "optimized"]]) == [2, 2]
    rows = pd.read_csv(results / "ett_rows.csv").set_index("row")
    assert list(rows.index) == ["baseline", "optimized"] and list(rows["interval"]) == ["probe", "probe"]
    assert list(rows["path"]) == ["in-process"] * 2 and list(rows["pool_used"]) == [False, True]
    assert list(rows["NoF"]) == [2, 2]
    # the warm-up (the previous refresh) leaves the optimized job's ranks prewarmed; the baseline has no pool
    assert list(rows["pooled_ranks"]) == [0, 2]
    per_failure = pd.read_csv(results / "ttr_per_failure.csv")
    assert list(per_failure["row"]) == ["baseline"] * 2 + ["optimized"] * 2 and (per_failure["TTR_s"] > 0).all()
    blocking = pd.read_csv(results / "checkpoint_blocking.csv").set_index("mode")
    assert set(blocking.index) == {"sync", "async"} and (blocking["saves"] > 0).all()
    shutdown = pd.read_csv(results / "shutdown.csv").set_index("mode")
    assert shutdown.loc["baseline", "publish_s"] > 0  # published while the lease held the devices
    assert shutdown.loc["baseline", "device_held_after_last_step_s"] > shutdown.loc["baseline", "publish_s"]
    overhead = pd.read_csv(results / "overhead.csv").set_index("what")
    assert overhead.loc["recording overhead, interleaved pairs", "value"] == 1
    runs = Warehouse.open(url).runs_frame()  # the pair's jobs (not the warm-up or overhead runs)
    assert sorted(runs["mode"]) == ["baseline", "optimized"] and list(runs["nof"]) == [2, 2]
    assert all((json.loads(t) if isinstance(t, str) else t)["benchmark"] for t in runs["tags"])
    assert list(runs["pt2_compile_s"]) == [0.0, 0.0]  # every job ran with the switch the command set
    # the fleet simulator, fed each job's measured costs and its own failure times, reproduces
    # its ETT and capETT within 3 points (issue 41's validation)
    from ettflow.ett.simulate_inputs import measure_run
    from ettflow.simulate_cli import validation_rows

    with Warehouse.open(url) as wh:
        replayed = validation_rows([measure_run(wh.events_for(r)) for r in runs["run_id"]])
    assert all(abs(r["d_ETT"]) <= 3 and abs(r["d_capETT"]) <= 3 for r in replayed), "\n".join(map(str, replayed))
    assert sorted(r["NoF"] for r in replayed) == [2, 2]
    results_md = (results / "results.md").read_text()
    assert "Command: `ettflow bench --quick" in results_md and "--switch compile=false" in results_md
