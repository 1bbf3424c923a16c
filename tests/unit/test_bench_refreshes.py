"""`ettflow bench refreshes`, its pure part: each refresh's TTS split into its parts, the table,
the warm-refresh summary and its sentence, the picture and the command line, from hand-built
timelines whose answers are worked out below (no Ray, no Prefect: the sequence itself runs
through `refresh_model`, which tests/test_continuous_refresh.py covers end to end)."""

from __future__ import annotations

import pytest

from ettflow.bench.refreshes import (
    SequencePlan,
    dominant_sentence,
    measure_refresh,
    sequence_table,
    tts_parts,
    warm_tts_summary,
)

from helpers.timelines import Timeline


def cold() -> Timeline:
    """submitted 0; scheduling 3 s, device init 4 s, a cold compile of 20 s; 10 steps; shutdown."""
    t = Timeline("cold").mark("submitted", 0).ev("scheduling", 0, 3, rank=-1).ev("device_init", 3, 7)
    return t.ev("pt2_compile", 7, 27).steps(27, 0, 10).ev("shutdown", 37, 40, rank=-1)


def warm() -> Timeline:
    """A warm refresh: restore of the parent's anchor, a compile-cache restore, a warm compile that
    hides the first batch's read, and 0.5 s that no event covers (106.5 .. 107)."""
    t = Timeline("warm").mark("submitted", 100).ev("scheduling", 100, 102, rank=-1)
    t.ev("device_init", 102, 106).ev("process_group_init", 106, 106.5).ev("checkpoint_restore", 107, 108)
    t.ev("compile_cache_restore", 108, 108.5).ev("pt2_compile", 108.5, 110).ev("get_first_batch_data", 108.5, 109.5)
    return t.steps(110, 0, 10).ev("anchor_checkpoint", 120, 121).ev("shutdown", 121, 122, rank=-1)


def warm_baseline() -> Timeline:
    t = Timeline("warm-base").mark("submitted", 200).ev("scheduling", 200, 201, rank=-1).ev("device_init", 201, 206)
    t.ev("checkpoint_restore", 206, 208).ev("pt2_compile", 208, 226)
    return t.steps(226, 0, 10).ev("shutdown", 236, 240, rank=-1)


def result(windows, parent=None, outcome="published"):
    return {"windows": windows, "parent": parent, "outcome": outcome}


@pytest.fixture
def rows():
    return [measure_refresh("optimized", 1, result(["w0"]), cold().events),
            measure_refresh("optimized", 2, result(["w1"], parent="cold"), warm().events),
            measure_refresh("baseline", 2, result(["w1", "w2"], parent="x", outcome="gated"), warm_baseline().events)]


def test_tts_parts_sum_to_tts_and_name_what_the_run_did_before_its_first_new_step():
    parts, phases = tts_parts(warm().events)
    # TTS 10 s = scheduling 2 + init (device 4 + process group 0.5) + restore 1 + compile (cache 0.5
    # + compile 1.5; the first batch's read under it is not exposed) + other (the uncovered 0.5 s)
    assert parts == {"scheduling": 2.0, "init": 4.5, "restore": 1.0, "compile": 2.0, "other": 0.5}
    assert phases == {"scheduling": 2.0, "device_init": 4.0, "process_group_init": 0.5, "checkpoint_restore": 1.0,
                      "compile_cache_restore": 0.5, "pt2_compile": 1.5}
    parts, _ = tts_parts(cold().events)
    assert parts == {"scheduling": 3.0, "init": 4.0, "restore": 0.0, "compile": 20.0, "other": 0.0}


def test_the_table_has_one_line_per_refresh_with_exact_numbers(rows):
    table = sequence_table(rows)
    assert list(table["start"]) == ["cold", "warm", "warm"]
    assert list(table["trained"]) == ["w0", "w1", "w1..w2"] and list(table["windows"]) == [1, 1, 2]
    assert list(table["outcome"]) == ["published", "published", "gated"]
    assert list(table["TTS_s"]) == [27.0, 10.0, 26.0]
    assert list(table["wall_s"]) == [40.0, 22.0, 40.0]
    assert list(table["ETT%"]) == [25.0, 45.45, 25.0]  # 10 s of steps in each
    assert list(table["compile_s"]) == [20.0, 2.0, 18.0] and list(table["restore_s"]) == [0.0, 1.0, 2.0]
    assert list(table["largest_tts_phase"]) == ["pt2_compile 20.00", "device_init 4.00", "pt2_compile 18.00"]


def test_the_warm_summary_names_what_dominates_each_modes_warm_tts(rows):
    summary = warm_tts_summary(rows).set_index("mode")
    assert list(summary.index) == ["optimized", "baseline"]  # the cold refresh is left out
    assert summary.loc["optimized", "TTS_s"] == 10.0 and summary.loc["optimized", "warm_refreshes"] == 1
    assert summary.loc["optimized", "dominant"] == "init" and summary.loc["optimized", "largest_phase"] == "device_init"
    assert summary.loc["baseline", "dominant"] == "compile" and summary.loc["baseline", "compile_s"] == 18.0
    assert dominant_sentence(warm_tts_summary(rows)) == (
        "The warm refreshes' TTS is dominated by optimized: trainer init, 4.50 of 10.00 s (45%); its largest "
        "phase is device_init (4.00 s); baseline: the PT2 compile, 18.00 of 26.00 s (69%); its largest phase is "
        "pt2_compile (18.00 s).")


def test_the_picture_is_drawn_from_the_table(rows, tmp_path):
    from ettflow.bench.plots import ett_per_refresh

    ett_per_refresh(sequence_table(rows), tmp_path / "refreshes.png")
    assert (tmp_path / "refreshes.png").stat().st_size > 1000


def test_the_command_line_selects_the_part_and_checks_its_sizes():
    from ettflow.bench import cli, refreshes
    from ettflow.cli import build_parser

    args = build_parser().parse_args(["bench", "refreshes", "--refreshes", "3", "--movielens-windows", "0"])
    assert args.func is refreshes.main and (args.refreshes, args.movielens_windows) == (3, 0)
    assert build_parser().parse_args(["bench", "--quick"]).func is cli.main  # the paired evaluation stays
    with pytest.raises(ValueError, match="movielens_windows is 0"):
        SequencePlan(movielens_windows=1)
    with pytest.raises(ValueError, match="modes"):
        SequencePlan(modes=("fast",))
