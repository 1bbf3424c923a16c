"""Hand-built timelines whose answers are worked out by hand in test_metrics.py."""

from __future__ import annotations

from ettflow.ett.events import PhaseEvent


class Timeline:
    def __init__(self, run_id: str = "run") -> None:
        self.run_id = run_id
        self.events: list[PhaseEvent] = []
        self.attempt = 0
        self.rank = 0

    def ev(self, phase: str, start: float, end: float, *, rank: int | None = None, **attrs) -> Timeline:
        self.events.append(
            PhaseEvent(
                run_id=self.run_id,
                attempt=self.attempt,
                rank=self.rank if rank is None else rank,
                phase=phase,
                start=start,
                end=end,
                attrs=attrs,
            )
        )
        return self

    def mark(self, phase: str, at: float, **attrs) -> Timeline:
        return self.ev(phase, at, at, rank=-1, **attrs)

    def steps(self, start: float, cursor: int, n: int, dt: float = 1.0, *, rank: int | None = None) -> Timeline:
        """n steps of dt seconds from `start`, each advancing the cursor by one batch."""
        for i in range(n):
            self.ev("train_step", start + i * dt, start + (i + 1) * dt, rank=rank,
                    cursor_start=cursor + i, cursor_end=cursor + i + 1)
        return self

    def fail(self, at: float, detected: float, **attrs) -> Timeline:
        self.mark("failure", at, **attrs)
        return self.mark("failure_detected", detected, **attrs)

    def next_attempt(self) -> Timeline:
        self.attempt += 1
        return self


def sequential_init() -> Timeline:
    t = Timeline("sequential")
    t.mark("submitted", 0).ev("scheduling", 0, 10)
    for stage, s, e in [
        ("device_init", 10, 12), ("process_group_init", 12, 15), ("preproc_creation", 15, 16),
        ("train_module_creation", 16, 20), ("init_plugins", 20, 21), ("pre_train", 21, 22),
        ("get_first_batch_data", 22, 30),
    ]:
        t.ev(stage, s, e)
    t.ev("pt2_compile", 30, 40).steps(40, 0, 5).ev("checkpoint_save_blocking", 45, 47, step=5)
    t.ev("checkpoint_save_background", 47, 55, step=5)
    return t.steps(47, 5, 5).ev("shutdown", 52, 60)


def fast_batch() -> Timeline:
    t = Timeline("fast_batch")
    t.mark("submitted", 0).ev("scheduling", 0, 10)
    for stage, s, e in [
        ("device_init", 10, 12), ("process_group_init", 10, 13), ("preproc_creation", 10, 11),
        ("train_module_creation", 12, 16), ("init_plugins", 16, 17), ("pre_train", 17, 18),
        ("get_first_batch_data", 18, 26),
    ]:
        t.ev(stage, s, e)
    return t.ev("pt2_compile", 18, 28, fast_batch=True).steps(28, 0, 10).ev("shutdown", 38, 40)


def two_failures() -> Timeline:
    t = Timeline("two_failures")
    t.mark("submitted", 0).ev("scheduling", 0, 5).ev("device_init", 5, 10).ev("pt2_compile", 10, 20)
    t.steps(20, 0, 10).ev("checkpoint_save_blocking", 30, 31, step=10).steps(31, 10, 5)
    t.fail(36.5, 38, reason="SIGKILL rank 0", failure_class="infrastructure").ev("shutdown", 38, 40, rank=-1)
    t.next_attempt()
    t.ev("scheduling", 40, 45, rank=-1).ev("device_init", 45, 50).ev("checkpoint_restore", 50, 52)
    t.ev("pt2_compile", 52, 60).steps(60, 10, 5).steps(65, 15, 5)
    t.ev("checkpoint_save_blocking", 70, 71, step=20).steps(71, 20, 2)
    t.fail(73.2, 74, reason="ValueError in model", failure_class="user").ev("shutdown", 74, 75, rank=-1)
    t.next_attempt()
    t.ev("scheduling", 75, 76, rank=-1).ev("device_init", 76, 80).ev("checkpoint_restore", 80, 81)
    t.ev("pt2_compile", 81, 85).steps(85, 20, 2).steps(87, 22, 8)
    return t.ev("anchor_checkpoint", 95, 97).ev("shutdown", 97, 100, rank=-1)


def cascade() -> Timeline:
    t = Timeline("cascade")
    t.mark("submitted", 0).ev("scheduling", 0, 5).ev("device_init", 5, 10).ev("pt2_compile", 10, 15)
    t.steps(15, 0, 10).ev("checkpoint_save_blocking", 25, 26).steps(26, 10, 4)
    t.fail(30.5, 31).ev("shutdown", 31, 32, rank=-1)
    t.next_attempt()  # dies while compiling, before its first step
    t.ev("scheduling", 32, 35, rank=-1).ev("device_init", 35, 40).ev("checkpoint_restore", 40, 42)
    t.fail(45, 47).ev("shutdown", 47, 48, rank=-1)
    t.next_attempt()
    t.ev("scheduling", 48, 50, rank=-1).ev("device_init", 50, 53).ev("checkpoint_restore", 53, 54)
    t.ev("pt2_compile", 54, 58).steps(58, 10, 4).steps(62, 14, 8)
    return t.ev("shutdown", 70, 72, rank=-1)


def long_shutdown() -> Timeline:
    t = Timeline("long_shutdown")
    t.mark("submitted", 0).ev("scheduling", 0, 2).ev("device_init", 2, 4).ev("pt2_compile", 4, 6)
    t.steps(6, 0, 10).ev("anchor_checkpoint", 16, 18).ev("publish", 18, 48)
    return t.ev("shutdown", 48, 50, rank=-1)


def queued() -> Timeline:
    t = Timeline("queued")
    t.mark("submitted", 0).ev("scheduling", 2, 30, rank=-1).ev("device_init", 30, 32)
    return t.ev("pt2_compile", 32, 34).steps(34, 0, 10).ev("shutdown", 44, 45, rank=-1)
