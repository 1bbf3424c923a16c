"""Trainer init as a stage graph: sequential, concurrent, background; and the trainer's own
graph with its stages stubbed, so the fast batch's overlap is shown without a cluster."""

from __future__ import annotations

import threading
import time

import pytest

from ettflow.ett.spool import SpoolWriter, read_spool
from ettflow.trainer.config import Switches, TrainerConfig
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.rank.init_pipeline import InitPipeline, Stage
from ettflow.trainer.rank.rank_state import SET_BY, RankState, StateNotReady
from ettflow.trainer.rank.session import TrainerSession


def spans(tmp_path, run_id="r"):
    return {e.phase: e for e in read_spool(tmp_path, run_id).events}


def sleeper(seconds, log=None, name=None):
    def run():
        if log is not None:
            log.append((name, threading.current_thread().name))
        time.sleep(seconds)
    return run


def test_sequential_runs_in_order(tmp_path):
    with SpoolWriter(tmp_path, "r", 0, 0) as rec:
        InitPipeline([Stage("device_init", sleeper(0.05)), Stage("preproc_creation", sleeper(0.05)),
                      Stage("process_group_init", sleeper(0.05), ("device_init",))],
                     recorder=rec, concurrent=False).start().wait_all()
    ev = spans(tmp_path)
    assert ev["device_init"].end <= ev["preproc_creation"].start
    assert ev["preproc_creation"].end <= ev["process_group_init"].start


def test_concurrent_overlaps_independent_stages_and_respects_needs(tmp_path):
    with SpoolWriter(tmp_path, "r", 0, 0) as rec:
        InitPipeline([Stage("device_init", sleeper(0.2)), Stage("preproc_creation", sleeper(0.2)),
                      Stage("process_group_init", sleeper(0.05), ("device_init",))],
                     recorder=rec, concurrent=True).start().wait_all()
    ev = spans(tmp_path)
    assert ev["preproc_creation"].start < ev["device_init"].end  # overlapped
    assert ev["process_group_init"].start >= ev["device_init"].end  # waited for its need


def test_a_failing_stage_is_recorded_and_raised(tmp_path):
    def boom():
        raise ValueError("no device")
    with SpoolWriter(tmp_path, "r", 0, 0) as rec:
        pipe = InitPipeline([Stage("device_init", boom), Stage("process_group_init", sleeper(0), ("device_init",))],
                            recorder=rec, concurrent=True)
        with pytest.raises(ValueError, match="no device"):
            pipe.start().wait_all()
    assert spans(tmp_path)["device_init"].attrs["error"] == "ValueError: no device"


def test_stage_list_is_checked():
    with pytest.raises(ValueError, match="needs \\['pre_train'\\]"):
        InitPipeline([Stage("pt2_compile", sleeper(0), ("pre_train",))], recorder=None, concurrent=False)


class StubSession(TrainerSession):
    """The trainer's real stage graph with each stage replaced by a timed stub."""

    durations = {"device_init": 0.05, "process_group_init": 0.1, "preproc_creation": 0.05, "init_plugins": 0.05,
                 "train_module_creation": 0.2, "pre_train": 0.05, "get_first_batch_data": 1.2, "pt2_compile": 0.5,
                 "compile_cache_restore": 0.6, "checkpoint_restore": 0.3}

    def __init__(self, config, tmp_path):
        super().__init__(config, "r", 0, 0, tmp_path, "127.0.0.1", 0)
        for name, seconds in self.durations.items():
            setattr(self, name, sleeper(seconds))


@pytest.mark.parametrize("fast_batch", [True, False])
def test_fast_batch_compiles_while_the_dpp_warms_up(tmp_path, fast_batch):
    (tmp_path / "data").mkdir()
    switches = Switches(parallel_init=False, fast_batch=fast_batch)
    cfg = TrainerConfig(data_root=str(tmp_path / "data"), schema=criteo_schema(10), work_dir=str(tmp_path),
                        world_size=1, switches=switches)
    session = StubSession(cfg, tmp_path)
    InitPipeline(session.stages(), recorder=session.rec, concurrent=False).start().wait_all()
    session.rec.close()
    ev = spans(tmp_path)
    warmup, compile_ev = ev["get_first_batch_data"], ev["pt2_compile"]
    if fast_batch:
        assert compile_ev.start < warmup.end and warmup.start < compile_ev.end
    else:
        assert compile_ev.start >= warmup.end
    assert ev["train_module_creation"].start >= ev["process_group_init"].end  # sequential init either way


def test_the_compile_cache_unpacks_beside_the_checkpoint_restore_and_the_compile_waits_for_both(tmp_path):
    (tmp_path / "data").mkdir()
    cfg = TrainerConfig(data_root=str(tmp_path / "data"), schema=criteo_schema(10), work_dir=str(tmp_path),
                        world_size=1, switches=Switches())  # compile, its cache and parallel init on
    session = StubSession(cfg, tmp_path)
    session.parent = tmp_path / "parent-anchor"  # a warm start: the rank restores its parent's anchor
    InitPipeline(session.stages(), recorder=session.rec, concurrent=True).start().wait_all()
    session.rec.close()
    ev = spans(tmp_path)
    cache, ckpt, compile_ev = ev["compile_cache_restore"], ev["checkpoint_restore"], ev["pt2_compile"]
    assert cache.start < ckpt.end and ckpt.start < cache.end  # overlapped (was: one after the other)
    assert compile_ev.start >= max(cache.end, ckpt.end)


def test_rank_state_names_the_stage_a_field_waits_for():
    state = RankState()
    with pytest.raises(StateNotReady, match="'dmp' was read before init stage 'train_module_creation'"):
        state.dmp  # noqa: B018 - the read is the test
    assert not state.is_set("dmp") and state.compiled_step is None and state.eval_start is None
    state.eval_data = None  # a stage may set "nothing": no held-out windows
    assert state.is_set("eval_data") and state.eval_data is None
    with pytest.raises(AttributeError, match="no field 'dpm'"):
        state.is_set("dpm")
    assert set(SET_BY) <= {f for f in RankState.__dataclass_fields__}


def test_every_stage_bound_field_is_set_by_a_stage_of_the_graph(tmp_path):
    (tmp_path / "data").mkdir()
    cfg = TrainerConfig(data_root=str(tmp_path / "data"), schema=criteo_schema(10), work_dir=str(tmp_path),
                        world_size=1)
    session = TrainerSession(cfg, "r", 0, 0, tmp_path, "127.0.0.1", 0)
    session.rec.close()
    assert set(SET_BY.values()) <= {s.name for s in session.stages()}


@pytest.mark.parametrize("eval_at_start", [True, False])
def test_evaluating_at_start_waits_for_the_held_out_pipeline(tmp_path, eval_at_start):
    # concurrent init: pre_train reads eval_data, which preproc_creation sets
    (tmp_path / "data").mkdir()
    cfg = TrainerConfig(data_root=str(tmp_path / "data"), schema=criteo_schema(10), work_dir=str(tmp_path),
                        world_size=1, eval_at_start=eval_at_start)
    session = TrainerSession(cfg, "r", 0, 0, tmp_path, "127.0.0.1", 0)
    (pre_train,) = [s for s in session.stages() if s.name == "pre_train"]
    assert ("preproc_creation" in pre_train.needs) is eval_at_start
    session.rec.close()
