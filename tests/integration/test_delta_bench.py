"""`python -m ettflow.bench.delta_checkpoints` at tiny sizes: it runs, the chain it restores is
bitwise equal to the full checkpoint, the delta snapshot materializes to the full one, and its
tables say so (the numbers: BENCHMARKS.md)."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(240)
def test_the_delta_bench_runs_and_restores_the_chain_bitwise():
    from ettflow.bench.delta_checkpoints import DeltaBenchPlan, run, table

    m, p = run(DeltaBenchPlan(num_embeddings=500, embedding_dim=8, batch_size=32, saves=3, steps_between=3))
    assert m.chain_equal and len(m.full_bytes) == len(m.delta_bytes) == 3 and len(m.touched_rows) == 2
    assert m.delta_bytes[0] == m.full_bytes[0]  # the chain's base is the first full save
    assert all(0 < d < f for d, f in zip(m.delta_bytes[1:], m.full_bytes[1:]))
    # the last step published both ways: 26 tables of 500 rows, some changed since the first save
    assert p.materialized_equal and p.rows == 26 * 500 and 0 < p.changed_rows < p.rows
    assert 0 < p.delta_bytes < p.full_bytes and p.full_s > 0 and p.delta_s > 0
    out = table(m, p)
    assert "bitwise equal: True" in out and "materialized bitwise equal: True" in out


def test_ettflow_bench_checkpoints_takes_the_plan_s_sizes():
    from ettflow.bench.delta_checkpoints import plan_of
    from ettflow.cli import build_parser

    args = build_parser().parse_args(["bench", "checkpoints", "--steps-between", "10", "--movielens", "/data/ml"])
    assert args.part == "checkpoints" and args.steps_between == 10 and args.movielens == "/data/ml"
    plan = plan_of(args)
    assert (plan.steps_between, plan.movielens, plan.saves, plan.world_size) == (10, "/data/ml", 8, 2)


@pytest.mark.timeout(240)
def test_the_delta_bench_trains_on_movielens_windows(tmp_path, capfd):
    """`--movielens DIR`: the same bench on MovieLens windows (made-up source files here, in the
    recbole wheel's layout), its schema and tables; its spawned ranks print none of the known
    third-party noise (they start without the parent's filters)."""
    from ettflow.bench.delta_checkpoints import DeltaBenchPlan, run
    from ettflow.trainer.data.movielens import movielens_windows
    from ettflow.trainer.data.schema import movielens_schema

    from helpers.movielens import fake_source

    movielens_windows(tmp_path / "ml", windows=2, cache_dir=fake_source(tmp_path / "src", n=200))
    m, p = run(DeltaBenchPlan(embedding_dim=8, batch_size=8, saves=3, steps_between=2, movielens=str(tmp_path / "ml")),
               snapshots=False)
    assert p is None
    assert m.chain_equal and m.table_rows == sum(f.num_embeddings for f in movielens_schema().sparse)
    assert all(0 < d < f for d, f in zip(m.delta_bytes[1:], m.full_bytes[1:]))
    err = capfd.readouterr().err
    for noise in ("TopologyFactory", "is_fx_tracing", "deprecating ShardedTensor"):
        assert noise not in err, err[-2000:]
