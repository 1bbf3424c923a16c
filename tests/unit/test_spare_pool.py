"""The run's spare pool replaces a spare that died while it waited (spare_pool.py), stepped
with a scripted Ray: each call's result is decided by the test, nothing runs. The real spare's
death and replacement run on the real stack in e2e/test_trainer_faults.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ray.exceptions import ActorDiedError

from ettflow.ett.spool import read_spool
from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.group import spare_pool
from ettflow.trainer.group.pooled_worker import PooledWorker
from ettflow.trainer.model import ModelConfig
from ettflow.trainer.protocol import WorkerInfo


@dataclass(eq=False)
class Call:
    """A remote call's result: `value`, or `error` raised by `ray.get`; `done` once answered."""
    value: object = None
    error: BaseException | None = None
    done: bool = False


@dataclass(eq=False)
class Actor:
    name: str
    calls: list[tuple[str, Call]] = field(default_factory=list)
    killed: bool = False

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        actor = self

        class Method:
            @staticmethod
            def remote(*_args):
                call = Call()
                actor.calls.append((method, call))
                return call
        return Method


class ScriptedRay:
    """`wait` answers what the test marked done; `get` returns or raises what it scripted."""

    def wait(self, refs, timeout=None, **_):
        return [r for r in refs if r.done], [r for r in refs if not r.done]

    def get(self, ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def kill(self, actor, no_restart=True):
        actor.killed = True


class NoPool:
    def take(self, config, ranks, run_id, *, spare=False):
        return [None for _ in ranks]


def config(tmp_path: Path) -> TrainerConfig:
    return TrainerConfig(data_root=str(tmp_path), schema=criteo_schema(100), work_dir=str(tmp_path / "work"),
                         world_size=2, batch_size=32,
                         model=ModelConfig(embedding_dim=8, dense_arch=(16, 8), over_arch=(16, 1)))


@pytest.fixture
def started(monkeypatch, tmp_path):
    """A spare pool whose spares are scripted actors (`started`, in start order)."""
    actors: list[Actor] = []

    def start_worker(cfg, run_id, spool_root, *, actor_cls, bundle=None):
        actors.append(Actor(f"spare{len(actors)}"))
        return PooledWorker(actors[-1], None, requested_at=100.0 + len(actors), key="k", cpus=1.0)

    monkeypatch.setattr(spare_pool, "ray", ScriptedRay())
    monkeypatch.setattr(spare_pool, "start_worker", start_worker)
    monkeypatch.setattr(spare_pool, "PING_S", 0.0)
    pool = spare_pool.SparePool(config(tmp_path), "r", tmp_path / "spool", actor_cls=object, pool=NoPool())
    return pool, actors


def call(actor: Actor, method: str) -> Call:
    (found,) = [c for m, c in actor.calls if m == method]
    return found


def test_a_spare_whose_prewarm_reports_its_death_while_a_ping_is_in_flight_is_replaced_once(started, tmp_path):
    # CI (2026-12-05): the dead spare's prewarm was read first; its ping, still in flight, was
    # read at the next poll as the new spare's death, and the new spare was killed too
    pool, actors = started
    pool.prewarm()
    assert pool.watch(0) is False  # a ping to spare0 goes out
    died = ActorDiedError()
    for method in ("prewarm", "ready"):
        call(actors[0], method).error, call(actors[0], method).done = died, True
    assert pool.watch(0) is True and actors[0].killed and len(actors) == 2  # replaced, spare1 prewarms
    assert pool.watch(0) is False  # a ping to spare1 goes out, not spare0's read again
    assert not actors[1].killed and pool.has_spare and pool.replaced == 1
    answer = call(actors[1], "ready")
    answer.value, answer.done = WorkerInfo(pid=4242, node_ip="h", node_id="n", created_at=1.0, ready_at=2.0), True
    assert pool.watch(0) is False and pool.spare_pid == 4242
    lost = [e for e in read_spool(tmp_path / "spool", "r").events if e.phase == "spare_start"]
    assert [(e.attrs["lost"], e.attrs["used"]) for e in lost] == [(True, False)]


def test_a_spare_whose_ping_reports_its_death_is_replaced_and_the_new_one_pinged(started):
    pool, actors = started
    pool.prewarm()
    pool.watch(0)
    call(actors[0], "ready").error, call(actors[0], "ready").done = ActorDiedError(), True
    assert pool.watch(0) is True and actors[0].killed
    assert pool.watch(0) is False and [m for m, _ in actors[1].calls] == ["prewarm", "ready"]
    assert not actors[1].killed and pool.replaced == 1
