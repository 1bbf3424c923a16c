"""A rank's result as a scripted worker group returns it (the driver reads `finished_at`)."""

from __future__ import annotations

from ettflow.trainer.protocol import CheckpointReport, CompileReport, RankResult


def finished(rank: int, *, at: float, attempt: int = 0, final_step: int = 0) -> RankResult:
    """Rank `rank` finished attempt `attempt` at `at` (the rest: nothing trained, nothing saved)."""
    return RankResult(rank=rank, attempt=attempt, final_step=final_step, steps_this_attempt=0, loss=float("nan"),
                      steps_per_s=0.0, examples_per_s=0.0, step_s_median=None, record_s=0.0,
                      checkpoint=CheckpointReport(), compile=CompileReport(), finished_at=at)
