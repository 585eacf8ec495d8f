"""The leader's suspicion and hedges (issue 30) through a real sqlite registry
on a hand-moved clock: fabric-watch's liveness record lapses long before the
node timeout, the leader's step hedges the node's single-replica service,
and the hedge goes after a stable window when the node comes back, or becomes
the placement when it goes offline. With the fast sources off, the node
timeout alone decides, as before."""

from __future__ import annotations

from pathlib import Path

from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.records import NodeRecord
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.leader import LeaderLoop
from tests.support.clock import FakeClock
from tests.support.enc_fleet import enc_fleet

TIERS = {"lead": "cpu_ffmpeg", "gpu-a": "gpu_vaapi", "gpu-b": "gpu_vaapi"}
LIVENESS_TTL_S = 6


def desired(liveness_s: int = 2, singleton: bool = False, candidates: tuple[str, ...] = ("lead",)) -> DesiredState:
    return enc_fleet(TIERS, candidates=candidates, liveness_s=liveness_s, liveness_ttl_s=LIVENESS_TTL_S, singleton=singleton)


class Fleet:
    def __init__(self, tmp_path: Path, state: DesiredState) -> None:
        self.clock = FakeClock()
        self.state = state
        self.registry = SqliteRegistry(tmp_path / "registry.sqlite", timing=state.fleet.timing, flap=state.fleet.flap, clock=self.clock)
        self.log: list[str] = []
        self.leader = LeaderLoop(
            registry=self.registry,
            host="lead",
            load_desired=lambda: state,
            schedule=schedule,
            lease_ttl_s=30,
            log=self.log.append,
            clock=self.clock,
        )

    def beat(self, *hosts: str) -> None:
        for host in hosts:
            record = NodeRecord(node_id=host, tier=TIERS[host], arch="x86_64", max_concurrent_tasks=4, units={"fabric-agent-enc.service": "active"})
            self.registry.heartbeat(record)
            if self.state.fleet.timing.liveness_s:
                self.registry.keep_alive(host, LIVENESS_TTL_S)

    def placements(self) -> list[tuple[str, str | None]]:
        plan = self.registry.newest_plan()
        assert plan is not None
        return [(p.node, p.hedge) for p in plan.placements]

    def close(self) -> None:
        self.registry.close()


def started(tmp_path: Path, **kw) -> Fleet:
    fleet = Fleet(tmp_path, desired(**kw))
    fleet.beat("lead", "gpu-a", "gpu-b")
    fleet.leader.step()
    assert fleet.placements() == [("gpu-a", None)]
    return fleet


def test_a_lapsed_liveness_record_hedges_the_service_long_before_the_node_timeout(tmp_path: Path):
    fleet = started(tmp_path)
    try:
        fleet.clock.advance(2)
        fleet.beat("lead", "gpu-b")  # gpu-a is powered off: no keep-alive, no beat
        fleet.clock.advance(LIVENESS_TTL_S)
        fleet.beat("lead", "gpu-b")
        fleet.leader.step()
        assert fleet.placements() == [("gpu-a", None), ("gpu-b", "gpu-a")], "its own placement stays until the node timeout"
        assert any("gpu-a suspicion: liveness lapsed" in line for line in fleet.log)
        assert any("gpu-a hedge: enc also placed on gpu-b" in line for line in fleet.log)
        # The node timeout (90 s) passes: the hedge is the placement.
        for _ in range(10):
            fleet.clock.advance(10)
            fleet.beat("lead", "gpu-b")
            fleet.leader.step()
        assert fleet.placements() == [("gpu-b", None)]
        assert any("gpu-a offline" in line for line in fleet.log)
    finally:
        fleet.close()


def test_a_node_that_comes_back_keeps_its_placement_and_the_hedge_leaves_after_the_stable_window(tmp_path: Path):
    fleet = started(tmp_path)
    try:
        fleet.clock.advance(LIVENESS_TTL_S + 1)
        fleet.beat("lead", "gpu-b")
        fleet.leader.step()
        assert fleet.placements() == [("gpu-a", None), ("gpu-b", "gpu-a")]
        fleet.beat("gpu-a")  # back within the timeout
        fleet.leader.step()
        assert fleet.placements() == [("gpu-a", None), ("gpu-b", "gpu-a")], "the hedge stays for the stable window"
        for _ in range(31):  # [flap] window_s = 300
            fleet.clock.advance(10)
            fleet.beat("lead", "gpu-a", "gpu-b")
            fleet.leader.step()
        assert fleet.placements() == [("gpu-a", None)], "nothing restarted on gpu-a: its placement never left"
    finally:
        fleet.close()


def test_a_paused_node_within_its_liveness_ttl_moves_nothing(tmp_path: Path):
    fleet = started(tmp_path)
    try:
        fleet.clock.advance(3)  # paused for 3 s: the record is alive for 6
        fleet.beat("lead", "gpu-b")
        fleet.leader.step()
        assert fleet.placements() == [("gpu-a", None)]
    finally:
        fleet.close()


def test_a_singleton_waits_for_the_node_timeout(tmp_path: Path):
    fleet = started(tmp_path, singleton=True)
    try:
        fleet.clock.advance(LIVENESS_TTL_S + 1)
        fleet.beat("lead", "gpu-b")
        fleet.leader.step()
        assert fleet.placements() == [("gpu-a", None)]
        for _ in range(9):
            fleet.clock.advance(10)
            fleet.beat("lead", "gpu-b")
            fleet.leader.step()
        assert fleet.placements() == [("gpu-b", None)], "moved at the node timeout"
    finally:
        fleet.close()


def test_with_the_fast_liveness_off_the_node_timeout_alone_decides(tmp_path: Path):
    fleet = started(tmp_path, liveness_s=0)
    try:
        # Records a watcher of another configuration keeps are not read.
        for host in TIERS:
            fleet.registry.keep_alive(host, LIVENESS_TTL_S)
        fleet.clock.advance(LIVENESS_TTL_S + 1)
        fleet.beat("lead", "gpu-b")
        fleet.leader.step()
        assert fleet.placements() == [("gpu-a", None)]
        assert fleet.leader.until_next_step_s() > LIVENESS_TTL_S
        for _ in range(9):
            fleet.clock.advance(10)
            fleet.beat("lead", "gpu-b")
            fleet.leader.step()
        assert fleet.placements() == [("gpu-b", None)]
        plan = fleet.registry.newest_plan()
        assert plan is not None and plan.suspects == {}
    finally:
        fleet.close()


def test_a_candidate_that_takes_over_from_a_dead_leader_suspects_the_hosts_whose_record_lapsed_meanwhile(tmp_path: Path):
    """The follower remembers the liveness expiries it read while following:
    etcd deletes a lapsed record, and the leader that saw it is gone."""
    fleet = started(tmp_path, candidates=("lead", "gpu-b"))
    try:
        follower = LeaderLoop(
            registry=fleet.registry,
            host="gpu-b",
            load_desired=lambda: fleet.state,
            schedule=schedule,
            lease_ttl_s=30,
            log=fleet.log.append,
            clock=fleet.clock,
        )
        follower.step()
        assert follower.leadership is None, "lead leads"
        # lead's host and gpu-a die together; the records lapse and go (etcd), lead's term goes stale.
        fleet.clock.advance(31)
        fleet.beat("gpu-b")
        # sqlite keeps a lapsed row; etcd deletes the key: as etcd does.
        with fleet.registry._tx() as db:
            db.execute("DELETE FROM liveness WHERE host IN ('lead', 'gpu-a')")
        follower.step()
        assert follower.leadership is not None
        plan = fleet.registry.newest_plan()
        assert plan is not None and "gpu-a" in plan.suspects, plan.suspects
        assert ("gpu-b", "gpu-a") in [(p.node, p.hedge) for p in plan.placements]
    finally:
        fleet.close()
