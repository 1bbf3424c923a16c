"""Detection and preemption on the real trainer (2 Ray actors, gloo, TorchRec, DCP), tiny sizes:
a hang before the first step and one in pt2_compile are found by the phase watchdog within
their bound (not by gloo's timeout); a scripted and a real external SIGTERM are recorded as
preemption, stop both ranks at one step boundary with an emergency checkpoint, and the restart
ends with the parameters of a run that was never interrupted. Detection times are measured
from the spool (failure_detected - failure) and printed."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from test_trainer_e2e import STEPS, by, config, drive, model_tensors

from ettflow.ett.run_metrics import compute_run_metrics
from ettflow.ett.spool import read_spool
from ettflow.trainer.config import FailAt
from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows
from ettflow.trainer.driver import TrainingDriver
from ettflow.trainer.ray_group import RayWorkerGroup

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

SLACK_S = 10.0  # polling, a loaded 2-core machine; gloo's timeout (the old detector) was 300 s


@pytest.fixture(scope="module")
def world(tmp_path_factory, ray_session):
    root = tmp_path_factory.mktemp("detection")
    generate_windows(root / "data", SyntheticConfig(windows=3, rows_per_window=768, files_per_window=2, seed=7))
    return root


@pytest.fixture(scope="module")
def clean_run(world):
    return drive(world, config(world, "clean", eval_batches=0), "clean")  # also warms the compile cache


def detection_s(events) -> float:
    (fault,) = by(events, "failure")
    (detected,) = by(events, "failure_detected")
    return detected.start - fault.start


def assert_same_parameters(result, clean_result, tmp_path, name: str) -> None:
    ours = model_tensors(result.rank0["anchor"], tmp_path / f"{name}.pt")
    clean = model_tensors(clean_result.rank0["anchor"], tmp_path / "clean.pt")
    assert ours.keys() == clean.keys() and len(ours) > 4
    for key in clean:
        assert torch.equal(ours[key], clean[key]), key


def test_hang_at_step_0_is_detected_within_the_step_bound(world, clean_run):
    cfg = config(world, "hang0", failures=(FailAt.parse("hang:rank=1:step=0"),), step_timeout_s=3.0,
                 eval_batches=0)
    result, events, m = drive(world, cfg, "hang0")
    (failure,) = result.failures
    assert result.attempts == 2 and m.nof == 1 and m.failures[0].failure_class == "infrastructure"
    assert (failure.rank, failure.step) == (1, 0) and failure.reason.startswith("rank 1 hung in train_step for ")
    took = detection_s(events)
    print(f"\nhang at step 0: detected {took:.2f} s after it began (bound 3 s)")
    assert took <= 3.0 + SLACK_S
    assert result.rank0["final_step"] == STEPS
    m.check_partition()


def test_hang_in_compile_is_detected_within_the_compile_bound(world, clean_run):
    cfg = config(world, "hangc", failures=(FailAt.parse("hang:rank=1:phase=pt2_compile"),),
                 compile_timeout_s=15.0, eval_batches=0)
    result, events, m = drive(world, cfg, "hangc")
    (failure,) = result.failures
    assert result.attempts == 2 and m.nof == 1 and m.failures[0].failure_class == "infrastructure"
    assert failure.rank == 1 and failure.reason.startswith("rank 1 hung in pt2_compile for ")
    took = detection_s(events)
    print(f"\nhang in pt2_compile: detected {took:.2f} s after it began (bound 15 s)")
    assert took <= 15.0 + SLACK_S
    assert by(events, "train_step", attempt=0) == []  # it never trained
    m.check_partition()


def assert_preempted(result, events, m, *, injected: bool) -> int:
    """One preemption of rank 1, its emergency checkpoint restored exactly; returns its step."""
    (failure,) = result.failures
    assert result.attempts == 2 and m.nof == 1 and m.failures[0].failure_class == "preemption"
    assert failure.rank == 1 and failure.failure_class.value == "preemption" and failure.injected is injected
    (marker,) = by(events, "failure", attempt=0)
    saved = marker.attrs["emergency_checkpoint"]
    assert marker.rank == 1 and saved == marker.attrs["step"] == failure.step
    assert {e.attrs["step"] for e in by(events, "checkpoint_save_blocking", attempt=0)} >= {saved}
    (restore,) = by(events, "checkpoint_restore", rank=0, attempt=1)
    assert restore.attrs["step"] == saved
    assert m.replayed_steps == 0 and m.effective_steps == 2 * STEPS  # nothing lost, nothing replayed
    print(f"\npreemption at step {saved}: detected {detection_s(events):.2f} s after SIGTERM "
          f"(emergency checkpoint included)")
    m.check_partition()
    return saved


def test_scripted_preemption_takes_an_emergency_checkpoint_and_resumes_exactly(world, clean_run, tmp_path):
    cfg = config(world, "preempt", failures=(FailAt.parse("preempt:rank=1:step=9"),), eval_batches=0)
    result, events, m = drive(world, cfg, "preempt")
    assert assert_preempted(result, events, m, injected=True) == 9
    assert_same_parameters(result, clean_run[0], tmp_path, "preempt")


def test_external_sigterm_is_a_preemption(world, clean_run, tmp_path):
    cfg = config(world, "sigterm", eval_batches=0)
    spool, groups = world / "spool", []

    def factory(attempt: int):
        groups.append(RayWorkerGroup(cfg, "sigterm", attempt, spool))
        return groups[-1]

    sent: list[int] = []

    def preempt_rank_1_in_training() -> None:
        deadline = time.time() + 300
        while time.time() < deadline and not sent:
            try:
                steps = [e for e in read_spool(spool, "sigterm").events
                         if e.phase == "train_step" and e.attempt == 0 and e.rank == 1]
            except FileNotFoundError:
                steps = []
            if len(steps) >= 6:
                os.kill(groups[0].info[1]["pid"], signal.SIGTERM)  # what a scheduler sends
                sent.append(len(steps))
            time.sleep(0.05)

    killer = threading.Thread(target=preempt_rank_1_in_training, daemon=True)
    killer.start()
    result = TrainingDriver(cfg, "sigterm", spool, factory).run()
    killer.join()
    events = read_spool(spool, "sigterm").events
    m = compute_run_metrics(events)
    assert sent, "rank 1 never trained 6 steps"
    assert assert_preempted(result, events, m, injected=False) >= 6
    assert_same_parameters(result, clean_run[0], tmp_path, "sigterm")
