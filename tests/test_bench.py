"""`ettflow bench --quick` at tiny sizes, so the command cannot rot: real baseline and
optimized jobs (Ray, TorchRec, two SIGKILLs each), tables, CSV, PNG and the warehouse rows.
The compile ablation (three cold compiles in fresh processes) is left to the real runs."""

import json

import pandas as pd
import pytest

from ettflow.cli import main
from ettflow.ett.warehouse import Warehouse

# two baseline jobs compile cold three times each: minutes on two shared cores
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore"), pytest.mark.timeout(1200)]


def test_quick_bench_at_tiny_sizes(tmp_path, ray_session, capsys):
    url = f"sqlite:///{tmp_path / 'wh.db'}"
    rc = main(["bench", "--quick", "--out", str(tmp_path / "results"), "--url", url, "--lengths", "1",
               "--rows-per-window", "2048", "--batch-size", "32", "--num-embeddings", "200",
               "--checkpoint-every", "4", "--skip", "ablation"])
    assert rc == 0
    out = capsys.readouterr().out
    results = tmp_path / "results"
    for name in ("ett_pair", "attribution", "job_length", "checkpoint_blocking", "wasted_vs_interval",
                 "shutdown", "overhead", "targets"):
        assert (results / f"{name}.csv").is_file() and f"== {name} ==" in out, name
    for picture in ("components.png", "ett_vs_length.png", "wasted_vs_interval.png"):
        assert (results / picture).stat().st_size > 1000
    pair = pd.read_csv(results / "ett_pair.csv").set_index("mode")
    assert list(pair["NoF"][["baseline", "optimized"]]) == [2, 2]
    blocking = pd.read_csv(results / "checkpoint_blocking.csv").set_index("mode")
    assert set(blocking.index) == {"sync", "async"} and (blocking["saves"] > 0).all()
    shutdown = pd.read_csv(results / "shutdown.csv").set_index("mode")
    assert shutdown.loc["baseline", "publish_s"] > 0  # published inside the trainer
    runs = Warehouse.open(url).runs_frame()  # the pair's jobs (not the cache warm-up or overhead runs)
    assert sorted(runs["mode"]) == ["baseline", "optimized"] and list(runs["nof"]) == [2, 2]
    assert all((json.loads(t) if isinstance(t, str) else t)["benchmark"] for t in runs["tags"])
    assert "Command: `ettflow bench --quick" in (results / "results.md").read_text()
