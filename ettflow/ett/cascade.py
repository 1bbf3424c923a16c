"""Cascade attribution: where a baseline run and an optimized run of the same job differ.

- Direct attribution: saved exposed seconds per L2 component, and by cause: startup (TTS),
  recovery (sum of TTR), checkpointing (exposed save blocking), shutdown.
- A recovery repeats startup, so startup work saved once is saved up to (1 + NoF) times:
  the bound (1 + NoF) x dTTS.
- The fast batch overlaps the DPP warm-up with PT2 compilation, so per startup it can save at
  most min(DPP warm-up, PT2 compile) of the baseline.
Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from .events import COMPONENTS, UNATTRIBUTED
from .run_metrics import RunMetrics


@dataclass(frozen=True)
class CascadeAttribution:
    baseline_run: str
    optimized_run: str
    nof: int
    nof_matches: bool  # a fair pair fails the same number of times
    saved_lost_s: float  # (wall - effective) of baseline minus that of optimized
    saved_by_component: dict[str, float]  # exposed seconds, positive = saved
    saved_startup_s: float  # dTTS
    saved_recovery_s: float  # d(sum TTR)
    saved_checkpointing_s: float  # d(exposed checkpoint save blocking)
    saved_shutdown_s: float
    startup_cascade_bound_s: float  # (1 + NoF) x dTTS
    fast_batch_saving_per_startup_s: float  # min(DPP warm-up, PT2 compile) of the baseline
    fast_batch_saving_bound_s: float  # summed over the baseline's startups
    ett_gain_pts: float

    @property
    def ttr_to_tts_ratio(self) -> float | None:
        """How much recovery time was saved per second of startup saved."""
        if abs(self.saved_startup_s) < 1e-12:
            return None
        return self.saved_recovery_s / self.saved_startup_s


def _fast_batch_window(run: RunMetrics) -> tuple[float, float]:
    """min(DPP warm-up, PT2 compile) for the first startup, and summed over all startups."""
    per = [
        min(a.phase_raw_s.get("get_first_batch_data", 0.0), a.phase_raw_s.get("pt2_compile", 0.0))
        for a in run.attempts
    ]
    return (per[0] if per else 0.0), sum(per)


def attribute(baseline: RunMetrics, optimized: RunMetrics) -> CascadeAttribution:
    d_tts = baseline.tts_s - optimized.tts_s
    first, total = _fast_batch_window(baseline)
    return CascadeAttribution(
        baseline_run=baseline.run_id,
        optimized_run=optimized.run_id,
        nof=baseline.nof,
        nof_matches=baseline.nof == optimized.nof,
        saved_lost_s=baseline.lost_s - optimized.lost_s,
        saved_by_component={
            c: baseline.components[c] - optimized.components[c]
            for c in (*COMPONENTS, UNATTRIBUTED)
            if c != "effective_training"
        },
        saved_startup_s=d_tts,
        saved_recovery_s=baseline.ttr_total_s - optimized.ttr_total_s,
        saved_checkpointing_s=baseline.exposed("checkpoint_save_blocking")
        - optimized.exposed("checkpoint_save_blocking"),
        saved_shutdown_s=baseline.components["shutdown"] - optimized.components["shutdown"],
        startup_cascade_bound_s=(1 + baseline.nof) * d_tts,
        fast_batch_saving_per_startup_s=first,
        fast_batch_saving_bound_s=total,
        ett_gain_pts=optimized.ett_pct - baseline.ett_pct,
    )
