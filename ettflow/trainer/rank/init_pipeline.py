"""Trainer init as a graph of stages, run one after another or concurrently.

Each stage names the stages it needs. Sequential mode runs them in list order (the baseline);
concurrent mode starts every stage as soon as the stages it needs are done, each on its own
thread. A stage marked `background` runs on a thread in either mode and is only waited for by
the stages that need it (the DPP warm-up under the fast batch). Every stage is recorded as a
phase, on the rank that runs it (with the attributes a stage returns as a dict). The first
error stops the pipeline and is raised as is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ettflow.ett.spool import SpoolWriter


@dataclass(frozen=True)
class Stage:
    name: str  # the phase it is recorded as
    run: Callable[[], Any]
    needs: tuple[str, ...] = ()
    background: bool = False


def _check(stages: Sequence[Stage]) -> None:
    seen: set[str] = set()
    for stage in stages:
        if stage.name in seen:
            raise ValueError(f"init stage {stage.name!r} appears twice")
        missing = [n for n in stage.needs if n not in seen]
        if missing:
            raise ValueError(
                f"init stage {stage.name!r} needs {missing}, which are not listed before it"
            )
        seen.add(stage.name)


class InitPipeline:
    def __init__(self, stages: Sequence[Stage], *, recorder: SpoolWriter, concurrent: bool) -> None:
        _check(stages)
        self.stages = list(stages)
        self.recorder = recorder
        self.concurrent = concurrent
        self.results: dict[str, Any] = {}
        self._futures: dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(stages)), thread_name_prefix="ettflow-init")
        self._lock = threading.Lock()

    def _run_stage(self, stage: Stage) -> Any:
        for name in stage.needs:
            self._futures[name].result()
        with self.recorder.span(stage.name) as attrs:
            value = stage.run()
            if isinstance(value, dict):  # a stage may describe what it did
                attrs.update(value)
        with self._lock:
            self.results[stage.name] = value
        return value

    def start(self) -> InitPipeline:
        """Start every stage; foreground stages finish before `start` returns in sequential
        mode. Call `wait(name)` for a stage's result, `wait_all()` for everything."""
        for stage in self.stages:
            if self.concurrent or stage.background:
                self._futures[stage.name] = self._pool.submit(self._run_stage, stage)
            else:
                future: Future = Future()
                self._futures[stage.name] = future
                try:
                    future.set_result(self._run_stage(stage))
                except BaseException as exc:
                    future.set_exception(exc)
                    self.close()
                    raise
        return self

    def wait(self, name: str) -> Any:
        return self._futures[name].result()

    def wait_all(self, names: Sequence[str] | None = None) -> dict[str, Any]:
        for name in names if names is not None else [s.name for s in self.stages]:
            self.wait(name)
        return self.results

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
