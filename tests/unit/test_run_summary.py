"""What a finished refresh shows in the Prefect UI, as exact strings (pure, no Prefect server):
the state message, the run's name and tags, the artifacts' description head, the failure log
line, the progress texts, the snapshot manifest artifact, the parameter help of the run form,
and `ettflow report`'s status, deployment and run link columns."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

from ettflow.ett.failures import Failure, FailureClass
from ettflow.ett.run_metrics import compute_run_metrics
from ettflow.ett.run_summary import (
    FailureNote,
    FinalState,
    RunSummary,
    description_head,
    failure_line,
    measured_name,
    run_name,
    run_tags,
    state_message,
    summarize,
)
from ettflow.ett.sample import write_sample_run
from ettflow.ett.spool import read_spool

KILL = FailureNote("infrastructure", "rank 1 killed at step 16")


def summary(**over) -> RunSummary:
    base = dict(run_id="r1", model="dlrm", mode="optimized", state=FinalState.COMPLETED, outcome="published",
                windows=("window=2024010100", "window=2024010101"), ett_pct=91.24, nof=1, tts_s=8.26, wall_s=60.0,
                failures=(KILL,))
    return RunSummary(**{**base, **over})


def test_the_state_message_says_ett_nof_with_its_failures_and_tts():
    # the numbers first: the UI cuts a long message at "See More" (issue 27)
    assert state_message(summary()) == "ETT 91.2% · NoF 1 · TTS 8.3 s · infrastructure: rank 1 killed at step 16"
    assert state_message(summary(nof=0, failures=())) == "ETT 91.2% · NoF 0 · TTS 8.3 s"


def test_the_state_message_says_how_a_refresh_that_did_not_publish_ended():
    gated = summary(outcome="gated", reason="AUC dropped 0.02 > gate_max_auc_drop 0.01", nof=0, failures=())
    assert state_message(gated) == "ETT 91.2% · NoF 0 · TTS 8.3 s · gated: AUC dropped 0.02 > gate_max_auc_drop 0.01"
    data = FailureNote("data", "window=2024010101/part-00001.parquet: column c3 missing")
    failed = summary(state=FinalState.FAILED, outcome="failed", ett_pct=12.04, tts_s=30.0, nof=4,
                     failures=(KILL, data, data, data), reason="TrainingFailed: stopped after 4 failures")
    assert state_message(failed) == (
        "ETT 12.0% · NoF 4 · TTS 30.0 s · failed: TrainingFailed: stopped after 4 failures · infrastructure: rank 1 "
        "killed at step 16; data: window=2024010101/part-00001.parquet: column c3 missing; data: "
        "window=2024010101/part-00001.parquet: column c3 missing; and 1 more")
    crashed = summary(state=FinalState.CRASHED, outcome="crashed", reason="Execution was cancelled by the runtime")
    assert state_message(crashed) == ("ETT 91.2% · NoF 1 · TTS 8.3 s · crashed: Execution was cancelled by the runtime"
                                      " · infrastructure: rank 1 killed at step 16")
    # one reason, once: the crash's orchestrator failure says what the outcome says
    said_twice = summary(state=FinalState.CRASHED, outcome="crashed", reason="process killed", nof=2,
                         failures=(KILL, FailureNote("orchestrator", "process killed")))
    assert state_message(said_twice) == ("ETT 91.2% · NoF 2 · TTS 8.3 s · crashed: process killed · "
                                         "infrastructure: rank 1 killed at step 16")
    nothing = summary(state=FinalState.CRASHED, outcome="crashed", ett_pct=None, tts_s=None, nof=0, failures=(),
                      reason="process killed")
    assert state_message(nothing) == "no ETT: the run recorded no phase · crashed: process killed"


def test_a_skipped_refresh_says_only_why_and_long_reasons_are_cut():
    skipped = summary(outcome="skipped", ett_pct=None, tts_s=None, nof=0, failures=(),
                      reason="nothing new to train for model dlrm: the watermark is the newest window")
    assert state_message(skipped) == "nothing new to train for model dlrm: the watermark is the newest window"
    assert description_head(skipped) == "skipped · Completed"
    long = FailureNote("user", "x" * 200)
    assert long.text == "user: " + "x" * 117 + "..."


def test_name_tags_and_description_head():
    s = summary()
    assert run_name("dlrm", "optimized", s.windows) == "dlrm-optimized 2024010100..2024010101 (2)"
    assert run_name("dlrm", "baseline", ("window=2024010105",)) == "dlrm-baseline 2024010105"
    assert run_name("dlrm", "baseline") == "dlrm-baseline"
    # once archived, the runs list shows the result in the name (issue 27)
    assert measured_name(s) == "dlrm-optimized 2024010100..2024010101 (2) · ETT 91.2%"
    assert measured_name(summary(outcome="skipped", ett_pct=None, windows=())) == "dlrm-optimized · skipped"
    assert measured_name(summary(state=FinalState.CRASHED, ett_pct=None)).endswith(" · no ETT")
    assert run_tags(s, ["ettflow", "adhoc", "outcome:failed", "failures:3", "ettflow"]) == [
        "ettflow", "adhoc", "model:dlrm", "mode:optimized", "failures:1", "outcome:published"]
    assert description_head(s) == "ETT 91.2% · NoF 1 · Completed"
    assert description_head(summary(state=FinalState.CRASHED, ett_pct=None)) == "no ETT · Crashed"
    # refused before it recorded anything (a parameter, the warehouse): said so, no failure count (issue 43)
    refused = summary(state=FinalState.FAILED, outcome="failed", ett_pct=None, nof=0, failures=(), windows=())
    assert measured_name(refused) == "dlrm-optimized · refused"
    assert run_tags(refused, ["adhoc"]) == ["adhoc", "model:dlrm", "mode:optimized", "outcome:refused"]
    assert state_message(refused) == "refused"  # not "no ETT: the run recorded no phase"
    assert state_message(replace(refused, reason="the input data cannot be trained on: x.parquet: column 'c' is "
                                                 "missing")) == ("refused: the input data cannot be trained on: "
                                                                 "x.parquet: column 'c' is missing")


def test_the_failure_line_puts_ettflows_words_before_rays_detail():
    f = Failure(failure_class=FailureClass.INFRASTRUCTURE, rank=1, attempt=0, step=16,
                reason="rank 1 killed at step 16",
                detail="The actor died unexpectedly before finishing this task.\n  class_name: TrainerActor")
    assert failure_line(f) == ("attempt 0 ended with an infrastructure failure: rank 1 killed at step 16 "
                               "(rank 1, step 16); detail: The actor died unexpectedly before finishing this task. "
                               "class_name: TrainerActor")
    driver = Failure(failure_class="data", attempt=2, reason="bad file")
    assert failure_line(driver) == "attempt 2 ended with a data failure: bad file"


def test_summarize_takes_the_runs_metrics(tmp_path):
    write_sample_run(tmp_path, "s1", seed=1)
    m = compute_run_metrics(read_spool(tmp_path, "s1").events)
    s = summarize(m, run_id="s1", model="dlrm", mode="baseline", state=FinalState.COMPLETED, outcome="published",
                  windows=("window=2024010100",))
    assert (s.ett_pct, s.nof, s.tts_s, s.wall_s) == (m.ett_pct, 1, m.tts_s, m.wall_s)
    assert s.failures == (FailureNote("infrastructure", "sample kill of rank 0"),)
    assert set(s.components) == set(m.components) and s.payload()["failures"][0]["reason"] == "sample kill of rank 0"
    skipped = summarize(m, run_id="s1", model="dlrm", mode="baseline", state=FinalState.COMPLETED,
                        outcome="skipped", reason="nothing new")
    assert skipped.ett_pct is None and not skipped.measured


# ---- progress texts ---------------------------------------------------------------------------


def test_progress_says_the_startup_phase_not_waiting():
    from ettflow.tasks.progress import restart_text, startup_text, step_text
    from ettflow.trainer.rank_heartbeat import RankBeat

    beats = {0: RankBeat(rank=0, pid=1, beat=140.0, phases={"pt2_compile": 100.0, "pre_train": 90.0}),
             1: RankBeat(rank=1, pid=2, beat=140.0, phases={"train_module_creation": 95.0})}
    assert startup_text(0, beats, now=135.4) == "attempt 0 starting: pt2_compile for 35 s"
    assert startup_text(1, {0: None, 1: None}, now=5.0) == "attempt 1 starting: launching the rank processes"
    kill = Failure(failure_class="infrastructure", rank=1, attempt=0, step=16, reason="rank 1 killed at step 16")
    assert restart_text(kill, 1) == ("attempt 0 failed (infrastructure: rank 1 killed at step 16); "
                                     "attempt 1 restarts from the newest good copy")
    assert step_text(12, 60, 1, 0.69314, 512.4) == "step 12/60 (20%), attempt 1, loss 0.6931, 512 examples/s"


# ---- the snapshot manifest artifact -----------------------------------------------------------


def test_the_snapshot_artifact_shows_its_manifest(tmp_path):
    from ettflow.publish.manifest import SnapshotManifest
    from ettflow.tasks.artifacts import manifest_markdown, snapshot_markdown

    m = SnapshotManifest(run_id="r1", step=40, path="/snap/r1", created_at=1.0, model={}, schema={}, data={},
                         source={"checkpoint": "/work/r1/step_40.final"}, quantization={}, signature={},
                         validation={"passed": True}, metrics={"auc_float": 0.71234, "n_examples": 256},
                         timings_s={}, versions={},
                         lineage={"windows": ["window=2024010100"], "held_out": ["window=2024010102"],
                                  "parent_snapshot": "/snap/r0", "parent_anchor": None},
                         files={"model.pt": {"size": 10, "sha256": "ab" * 32}})
    text = manifest_markdown(m, "cd" * 32)
    # the table names each folder (a cell is cut at the page's edge: issue 43), the list below has
    # the whole paths (a list item wraps); the header row is not empty (issue 27)
    for row in ("| field | value |", "| snapshot | r1 |", "| step | 40 |",
                "| windows trained | window=2024010100 |", "| held out | window=2024010102 |",
                "| validation | passed |", "| parent snapshot | r0 |",
                "| parent anchor | - |", "| anchor checkpoint | step_40.final |",
                "- snapshot: `/snap/r1`", "- anchor checkpoint: `/work/r1/step_40.final`",
                "- parent snapshot: `/snap/r0`",
                f"| manifest.json sha256 | `{'cd' * 32}` |", f"| model.pt sha256 | `{'ab' * 32}` (10 bytes) |",
                "| auc_float | 0.7123 |", "| n_examples | 256 |"):
        assert row in text.splitlines(), (row, text)
    assert "file://" not in text and "- parent anchor" not in text  # none: not listed
    broken = snapshot_markdown(str(tmp_path / "gone"))
    assert broken.startswith("### Inference snapshot\n\n`") and "manifest cannot be read" in broken


# ---- the run form ----------------------------------------------------------------------------


def test_every_flow_parameter_is_described_in_the_parameter_schema():
    from prefect.utilities.callables import parameter_schema

    from ettflow.flows.refresh import refresh_model
    from ettflow.tasks.parameters import RefreshParameters
    from ettflow.trainer.config import fail_at_grammar

    schema = parameter_schema(refresh_model).model_dump()
    leaves = {leaf: schema["definitions"][RefreshParameters.sections()[section].__name__]["properties"][leaf]
              for leaf, section in RefreshParameters.LEAVES.items()}
    assert len(leaves) >= 44  # the flat flow's 26 leaves before it, its 12 switches and 6 architecture fields
    assert [name for name, p in leaves.items() if not p.get("description")] == []
    assert [name for name, p in schema["properties"].items() if name not in RefreshParameters.sections()
            and not p.get("description")] == []
    fail_at = leaves["fail_at"]["description"]
    assert "kill:rank=1:step=16" in fail_at
    for line in fail_at_grammar(markdown=True).splitlines():  # markdown: the UI keeps one item per line
        assert line.strip() in fail_at, line
    assert "\n- `kill`: SIGKILL" in fail_at and "\n- `rank=R`: the rank" in fail_at
    assert "spare" in leaves["live_recovery"]["description"] and "prewarmed" in leaves["warm_pool"]["description"]


def test_a_flow_whose_parameters_are_not_the_model_s_is_refused():
    from ettflow.flows.parameter_help import with_parameter_help
    from ettflow.tasks.parameters import field_help

    def f(model: str = "dlrm", surprise: int = 1):
        """Doc."""

    with pytest.raises(TypeError, match=r"must be RefreshParameters' fields"):
        with_parameter_help(f)
    with pytest.raises(KeyError):
        field_help("surprise")


# ---- ettflow report ---------------------------------------------------------------------------


def test_the_report_shows_status_deployment_and_the_run_link_and_counts_failed_runs_apart():
    from ettflow.ett import report
    from ettflow.ett.warehouse import COMPONENT_COLUMNS

    runs = pd.DataFrame({"run_id": list("abcd"), "flow_run_id": ["fa", "fb", None, "fd"], "model": "m",
                         "mode": "optimized", "status": ["completed", "failed", "skipped", "crashed"],
                         "tags": [{"deployment": "refresh-adhoc"}, {}, None, {"deployment": "refresh-scheduled"}],
                         "wall_start": [0.0, 10.0, 20.0, 30.0], "wall_s": [100.0, 50.0, 1.0, 40.0],
                         "ett_pct": [80.0, 20.0, 0.0, 50.0], "tts_s": [10.0, 5.0, 0.5, 4.0], "nof": [1, 3, 0, 1],
                         "ttr_mean_s": 0.0, **{c: 1.0 for c in COMPONENT_COLUMNS}})
    table = report.run_table(runs, "http://127.0.0.1:4200/")
    assert list(table["deployment"]) == ["refresh-adhoc", "-", "-", "refresh-scheduled"]
    assert list(table["prefect_run"]) == ["http://127.0.0.1:4200/runs/flow-run/fa",
                                          "http://127.0.0.1:4200/runs/flow-run/fb", "-",
                                          "http://127.0.0.1:4200/runs/flow-run/fd"]
    assert "prefect_run" not in report.run_table(runs).columns
    (day,) = report.model_summary(runs).to_dict("records")
    got = (day["runs"], day["skipped"], day["failed"], day["crashed"], day["ett_mean"], day["ett_completed_mean"],
           day["failures"])
    assert got == (3, 1, 1, 1, 50.0, 80.0, 5)
    assert "skipped runs" in report.SUMMARY_NOTE and "Failed and crashed runs count" in report.SUMMARY_NOTE


def test_the_progress_history_keeps_what_the_run_went_through():
    """Issue 27: after the run only "Progress: 100%" was left; the phases it went through were gone."""
    from ettflow.ett.run_metrics import compute_run_metrics
    from ettflow.ett.run_summary import progress_history

    from helpers import timelines

    assert progress_history(compute_run_metrics(timelines.two_failures().events)) == [
        "attempt 0, 0.0-40.0 s: failed (infrastructure: SIGKILL rank 0), recovered in 27.0 s; steps 15.0 s, "
        "pt2_compile 10.0 s, scheduling 5.0 s",
        "attempt 1, 40.0-75.0 s: failed (user: ValueError in model), recovered in 13.0 s; steps 12.0 s, "
        "pt2_compile 8.0 s, scheduling 5.0 s",
        "attempt 2, 75.0-100.0 s: completed; steps 10.0 s, pt2_compile 4.0 s, device_init 4.0 s"]
    t = timelines.long_shutdown()
    t.ev("publish_standalone", 50, 80, rank=-1, outcome="failed").ev("publish_standalone", 82, 90, rank=-1)
    assert progress_history(compute_run_metrics(t.events))[-1] == (
        "after the release: publish_standalone 38.0 s, 1 failed publish try")



def test_a_restart_says_what_it_really_restored():
    """Issue 26 #6: the console said "attempt 1 restores the last checkpoint" while, every
    checkpoint damaged, training restarted at step 0. Once the attempt trains, its own spool
    says what it started from."""
    from ettflow.ett.events import PhaseEvent
    from ettflow.tasks.progress import restored_text

    def ev(phase, attempt, rank=0, **attrs):
        return PhaseEvent(run_id="r", attempt=attempt, rank=rank, phase=phase, start=1.0 + attempt,
                          end=(1.0 if phase == "checkpoint_fallback" else 2.0) + attempt,
                          attrs=attrs)

    events = [ev("checkpoint_restore", 1, source="own", step=20), ev("checkpoint_restore", 1, rank=1, source="own",
                                                                       step=20),
              ev("checkpoint_fallback", 1, damaged_step=25, restored_step=20),
              ev("checkpoint_restore", 2, source="memory", step=31),
              ev("checkpoint_fallback", 3, damaged_step=5, restored_step=None),
              ev("checkpoint_restore", 4, source="parent", parent_step=600)]
    assert restored_text(events, 1) == ("attempt 1 restored step 20 from the durable checkpoint; damaged "
                                        "checkpoint(s) of step 25 skipped")
    assert restored_text(events, 2) == "attempt 2 restored step 31 from the in-memory copies"
    assert restored_text(events, 3) == ("attempt 3 started from step 0: no copy of this run could be restored; "
                                        "damaged checkpoint(s) of step 5 skipped")
    assert restored_text(events, 4) == ("attempt 4 started from step 0 on the parent refresh's anchor: no copy of "
                                        "this run could be restored")


def test_how_a_run_ended_is_one_bounded_line_in_its_state_message():
    """Issue 42 #8: a full disk's state message ran to 2,202 characters (the whole exception).
    The message keeps the reason's first line, cut at OUTCOME_CHARS; the archive logs all of it."""
    from ettflow.ett.run_summary import OUTCOME_CHARS, reason_is_cut, short_reason

    long = "OSError: [Errno 28] No space left on device: '/spool/x' " + "x" * 3000 + "\nTraceback ..."
    failed = summary(state=FinalState.FAILED, outcome="failed", reason=long, nof=0, failures=())
    message = state_message(failed)
    assert message.startswith("ETT 91.2% · NoF 0 · TTS 8.3 s · failed: OSError: [Errno 28] No space left")
    assert len(message) < OUTCOME_CHARS + 60 and message.endswith("…") and "Traceback" not in message
    assert reason_is_cut(long) and len(short_reason(long)) == OUTCOME_CHARS
    assert not reason_is_cut("rank 1 killed") and short_reason("rank 1 killed") == "rank 1 killed"
    assert short_reason("two\nlines") == "two" and reason_is_cut("two\nlines")
    skipped = summary(state=FinalState.COMPLETED, outcome="skipped", reason="nothing new\nsince " + "y" * 400)
    assert state_message(skipped) == "nothing new"
