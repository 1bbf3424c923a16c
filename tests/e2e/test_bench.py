"""`ettflow bench --quick` at tiny sizes, so the command cannot rot: every job a run of the
`refresh-adhoc` deployment that a process worker executes in a new process (the deployed path,
on a stack of its own: `ettflow up`), two SIGKILLs each; tables, CSV, PNG and the warehouse
rows. Its pure parts: unit/test_bench_jobs.py."""

import json

import pandas as pd
import pytest

from helpers.stack import ettflow, free_ports, port_flags, stack_env


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quick_bench_at_tiny_sizes_through_deployment_runs(tmp_path):
    """The command end to end at the smallest sizes that exercise its path: the warm-up, the
    pair (baseline and optimized, two SIGKILLs each) as deployment runs the stack's worker
    executes, one interleaved pair of recording-overhead runs (in the bench's process, on the
    stack's cluster), every table, CSV, picture and warehouse row. A smoke run: no PT2 compile
    in any job (`--switch compile=false`: the baseline's cold compile on every attempt alone
    would take minutes here), the ablation rows and the compile ablation left out (the rows'
    flow parameters: `test_rows_are_refresh_parameters_the_flow_s_plan_accepts`)."""
    from ettflow.ett.warehouse import Warehouse

    env = stack_env(tmp_path / "home")
    up = ettflow(env, "up", *port_flags(*free_ports(3)), "--num-cpus", "4", timeout=600)
    assert up.returncode == 0, (up.stdout + up.stderr)[-4000:]
    try:
        url = f"sqlite:///{tmp_path / 'wh.db'}"
        bench = ettflow(env, "bench", "--quick", "--out", str(tmp_path / "results"), "--url", url, "--lengths", "1",
                        "--rows-per-window", "2048", "--batch-size", "32", "--num-embeddings", "200",
                        "--overhead-repeats", "1", "--switch", "compile=false", "--skip", "ablation,rows",
                        timeout=1100)
    finally:
        down = ettflow(env, "down", timeout=300)
    out = bench.stdout
    assert bench.returncode == 0, (bench.stdout + bench.stderr)[-6000:]
    assert down.returncode == 0, down.stdout + down.stderr
    assert "the local stack under" in out  # it found the stack `up` started (on its own ports)
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
    # every job a deployment run; the optimized one took its ranks and a spare from the cluster's pool
    assert list(rows["path"]) == ["deployed"] * 2 and list(rows["deployment"]) == ["refresh-model/refresh-adhoc"] * 2
    assert list(rows["pool_used"]) == [False, True] and (rows["spares"] >= [0, 1]).all()
    assert rows.loc["optimized", "held_s"] > 0 and rows.loc["optimized", "capETT%"] < rows.loc["optimized", "ETT%"]
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
    results_md = (results / "results.md").read_text()
    assert "Command: `ettflow bench --quick" in results_md and "--switch compile=false" in results_md
    assert "Path: every ETT job a run of the refresh-adhoc deployment" in results_md
    assert "Baseline: an untuned job restarting on the same host" in results_md
