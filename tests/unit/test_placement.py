"""Placement on a Ray cluster, pure: the arithmetic of which ranks fit, the elastic restart's
world size, the parameters' validation, a lost node's failure, and the driver with a group
that reports its own layout (the cluster itself: e2e/test_multinode.py)."""

from __future__ import annotations

import socket

import pytest

from ettflow.ett.event_attrs import FailureAttrs
from ettflow.ett.failures import Failure, FailureClass
from ettflow.ett.spool import read_spool
from ettflow.tasks.errors import ParameterError
from ettflow.tasks.plan import plan_refresh
from ettflow.trainer.classify import on_lost_node
from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.group.driver import TrainingDriver
from ettflow.trainer.placement import (
    Placement,
    PlacementStrategy,
    SpareBundles,
    attempt_world_size,
    ranks_that_fit,
)
from ettflow.trainer.protocol import PollStatus

from helpers.rank_results import finished


def test_ranks_that_fit_by_strategy():
    nodes = [{"CPU": 2.0, "memory": 1e9}, {"CPU": 2.0}, {"CPU": 1.0, "GPU": 1.0}]
    one = {"CPU": 1}
    assert ranks_that_fit(nodes, one, PlacementStrategy.PACK) == 5
    assert ranks_that_fit(nodes, one, PlacementStrategy.SPREAD) == 5
    assert ranks_that_fit(nodes, one, PlacementStrategy.STRICT_SPREAD) == 3
    assert ranks_that_fit(nodes, {"CPU": 2}, PlacementStrategy.PACK) == 2
    assert ranks_that_fit(nodes, {"CPU": 1, "GPU": 1}, PlacementStrategy.SPREAD) == 1
    assert ranks_that_fit([], one, PlacementStrategy.PACK) == 0
    with pytest.raises(ValueError, match="positive resources"):
        ranks_that_fit(nodes, {"CPU": 0}, PlacementStrategy.PACK)


def test_attempt_world_size_shrinks_only_a_permitted_restart():
    elastic = Placement(min_world_size=2)
    assert attempt_world_size(elastic, 4, fit=2, restart=True) == 2
    assert attempt_world_size(elastic, 4, fit=3, restart=True) == 3
    assert attempt_world_size(elastic, 4, fit=9, restart=True) == 4
    assert attempt_world_size(elastic, 4, fit=1, restart=True) == 2  # below the floor: waits for 2
    assert attempt_world_size(elastic, 4, fit=2, restart=False) == 4  # a first attempt waits for all
    assert attempt_world_size(Placement(), 4, fit=2, restart=True) == 4  # not elastic: waits


def test_placement_is_validated_where_it_is_given(flow_data):
    with pytest.raises(ValueError, match="unknown placement strategy 'RING'"):
        Placement(strategy="RING")
    with pytest.raises(ValueError, match="min_world_size must be an int >= 1"):
        Placement(min_world_size=0)
    with pytest.raises(ValueError, match=r"min_world_size \(3\) must be <= world_size \(2\)"):
        TrainerConfig(data_root=str(flow_data), schema=criteo_schema(10), work_dir="w", world_size=2,
                      placement=Placement(min_world_size=3))
    base = {"data_root": str(flow_data), "world_size": 4}
    for over, name in (({"placement_strategy": "spread"}, "placement_strategy"),
                       ({"min_world_size": 5}, "min_world_size"), ({"capacity_wait_s": 0}, "capacity_wait_s")):
        with pytest.raises(ParameterError, match=name):
            plan_refresh({**base, **over}, run_id="r")
    plan = plan_refresh({**base, "placement_strategy": "STRICT_SPREAD", "min_world_size": 2, "capacity_wait_s": 30},
                        run_id="r")
    assert plan.trainer.placement == Placement(strategy=PlacementStrategy.STRICT_SPREAD, min_world_size=2,
                                               capacity_wait_s=30.0)
    assert plan.trainer.to_dict()["placement"] == {"strategy": "STRICT_SPREAD", "min_world_size": 2,
                                                   "capacity_wait_s": 30.0}


def test_a_lost_process_on_a_dead_node_names_the_node():
    died = Failure(failure_class=FailureClass.INFRASTRUCTURE, rank=3, attempt=0, reason="rank 3: process died")
    lost = on_lost_node(died, node="abc123", address="10.0.0.7")
    assert lost.failure_class is FailureClass.INFRASTRUCTURE and lost.node == "abc123" and lost.rank == 3
    assert lost.reason == "rank 3: node abc123 (10.0.0.7) lost"
    assert FailureAttrs.parse(lost.to_attrs()).failure(0) == lost  # the spool keeps the node
    with pytest.raises(ValueError, match="only a lost process"):
        on_lost_node(Failure(failure_class=FailureClass.USER, rank=1), node="n", address="a")


def test_a_listed_node_whose_raylet_refuses_connections_is_lost_one_that_listens_is_not():
    # CI: the ranks' deaths reached the driver before the GCS's health checks declared the node dead
    from ettflow.trainer.group.ray_group import raylet_refuses

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        alive = {"address": "127.0.0.1", "port": listening.getsockname()[1]}
        assert not raylet_refuses(alive)
    assert raylet_refuses(alive)  # the same port, closed: the raylet is gone
    assert not raylet_refuses({"address": "127.0.0.1", "port": None})  # no port listed: no proof


class PlacedScriptedGroup:
    """Runs `world_size` ranks on `nodes` (fewer than the config asks: an elastic attempt);
    every rank finishes at the first poll."""

    def __init__(self, nodes: tuple[str, ...]) -> None:
        self.nodes, self.torn_down = nodes, False

    @property
    def world_size(self) -> int:
        return len(self.nodes)

    @property
    def placement(self) -> tuple[str, ...]:
        return self.nodes

    def reserve(self) -> None:
        pass

    def launch(self) -> None:
        pass

    def poll(self, timeout_s: float):
        return PollStatus(finished={r: finished(r, at=5.0) for r in range(self.world_size)})

    def kill(self, rank: int) -> None:
        raise AssertionError("nothing is killed here")

    def teardown(self) -> None:
        self.torn_down = True


def test_the_driver_runs_the_attempt_at_the_groups_world_size(tmp_path, flow_data):
    cfg = TrainerConfig(data_root=str(flow_data), schema=criteo_schema(10), work_dir=str(tmp_path), world_size=4,
                        placement=Placement(min_world_size=2))
    group = PlacedScriptedGroup(("node-a", "node-a"))
    clock = iter(float(t) for t in range(100))
    result = TrainingDriver(cfg, "r", tmp_path, lambda attempt: group, clock=lambda: next(clock)).run()
    assert sorted(result.ranks) == [0, 1] and group.torn_down  # two ranks finished: the attempt is done
    (sched,) = [e for e in read_spool(tmp_path, "r").events if e.phase == "scheduling"]
    assert sched.attrs == {"world_size": 2, "nodes": ["node-a", "node-a"]}


def test_a_gpu_spare_bundle_follows_the_hand_offs():
    bundles = SpareBundles.plan(3, spare=True)
    assert (bundles.total, bundles.spare, bundles.of_rank) == (4, 3, [0, 1, 2])
    assert bundles.hand_off(1) == 1 and bundles.of_rank == [0, 3, 2]  # the next spare: rank 1's old device
    assert bundles.hand_off(1) == 3 and bundles.of_rank == [0, 1, 2]  # the same rank fails again
    assert bundles.hand_off(0) == 0 and bundles.of_rank == [3, 1, 2]
    none = SpareBundles.plan(2, spare=False)
    assert none.total == 2 and none.spare is None
    with pytest.raises(ValueError, match="no spare bundle"):
        none.hand_off(0)
