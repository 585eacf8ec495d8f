"""A leader candidate takes a live term over when the leader's host's fast
liveness record lapsed (issue 30), instead of waiting for the leader record
to go stale: two leader loops over one real sqlite registry on a hand-moved
clock. The takeover is the registry's compare-and-swap; the old leader, if
alive, loses its term and the plan fence refuses its plans; the new leader's
first step suspects the dead host and hedges its service. No takeover while
the leader's host keeps its record alive, while the leader renews, or when
no record of that host was ever seen (a fleet without fabric-watch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.fencing import term_problem
from reconciler.core.live.models import FleetPlan
from reconciler.core.live.records import NodeRecord
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.leader import LeaderLoop
from reconciler.engine.plan_fence import registry_trust
from reconciler.ports import NotLeader
from tests.support.clock import FakeClock
from tests.support.enc_fleet import enc_fleet

# gpu-a leads and serves enc (both GPU hosts tie; gpu-a sorts first); gpu-b is the other candidate.
TIERS = {"gpu-a": "gpu_vaapi", "gpu-b": "gpu_vaapi", "cpu": "cpu_ffmpeg"}
LIVENESS_S = 2
LIVENESS_TTL_S = 6
LEASE_TTL_S = 30
# From gpu-a's last keep-alive to a takeover: its record's TTL, then the minimum age of the lapse.
LAPSE_OLD_ENOUGH_S = LIVENESS_TTL_S + LIVENESS_S + 1


def desired(liveness_s: int = LIVENESS_S) -> DesiredState:
    return enc_fleet(TIERS, candidates=("gpu-a", "gpu-b"), liveness_s=liveness_s, liveness_ttl_s=LIVENESS_TTL_S)


class Fleet:
    def __init__(self, tmp_path: Path, state: DesiredState) -> None:
        self.clock = FakeClock()
        self.state = state
        self.registry = SqliteRegistry(tmp_path / "registry.sqlite", timing=state.fleet.timing, flap=state.fleet.flap, clock=self.clock)
        self.log: list[str] = []
        self.old = self.candidate("gpu-a")
        self.new = self.candidate("gpu-b")

    def candidate(self, host: str) -> LeaderLoop:
        return LeaderLoop(
            registry=self.registry,
            host=host,
            load_desired=lambda: self.state,
            schedule=schedule,
            lease_ttl_s=LEASE_TTL_S,
            log=self.log.append,
            clock=self.clock,
        )

    def beat(self, *hosts: str, watchers: bool = True) -> None:
        for host in hosts:
            self.registry.heartbeat(NodeRecord(node_id=host, tier=TIERS[host], arch="x86_64", max_concurrent_tasks=4))
        if watchers:
            self.keep_alive(*hosts)

    def keep_alive(self, *hosts: str) -> None:
        for host in hosts:
            self.registry.keep_alive(host, LIVENESS_TTL_S)

    def plan(self) -> FleetPlan:
        plan = self.registry.newest_plan()
        assert plan is not None
        return plan

    def close(self) -> None:
        self.registry.close()


@pytest.fixture
def fleet(tmp_path: Path):
    fleet = Fleet(tmp_path, desired())
    yield fleet
    fleet.close()


def leading(fleet: Fleet, *, watchers: bool = True) -> FleetPlan:
    """gpu-a leads (renewed once, so its record says when its host's record
    lapses) and runs enc; gpu-b follows."""
    fleet.beat(*TIERS, watchers=watchers)
    fleet.old.step()
    fleet.clock.advance(1)
    if watchers:
        fleet.keep_alive(*TIERS)
    fleet.old.step()  # a renewal: the record names its host's liveness expiry
    fleet.new.step()
    assert fleet.old.leadership is not None and fleet.new.leadership is None
    plan = fleet.plan()
    assert [(p.node, p.hedge) for p in plan.placements] == [("gpu-a", None)]
    return plan


def gpu_a_dies(fleet: Fleet, seconds: float, *, others_keep_alive: bool = True) -> None:
    """gpu-a's host goes silent: no keep-alive, no beat, no renewal; the others keep theirs."""
    fleet.clock.advance(seconds)
    if others_keep_alive:
        fleet.keep_alive("gpu-b", "cpu")


def test_a_follower_takes_over_when_the_leaders_host_lapsed_and_suspects_it_at_its_first_step(fleet: Fleet):
    old_plan = leading(fleet)
    old_term = fleet.old.leadership
    assert old_term is not None
    gpu_a_dies(fleet, LAPSE_OLD_ENOUGH_S)
    assert fleet.registry.leader() is not None, "the old term is still live: a campaign alone would wait"
    fleet.new.step()
    assert fleet.new.leadership is not None, fleet.log
    assert fleet.new.leadership.term > old_term.term
    assert any("gpu-b takes over from gpu-a" in line and "liveness record lapsed" in line for line in fleet.log), fleet.log
    plan = fleet.plan()
    assert plan.leader == "gpu-b"
    suspect = plan.suspects.get("gpu-a")
    assert suspect is not None and suspect.since is not None, plan.suspects
    assert ("gpu-b", "gpu-a") in [(p.node, p.hedge) for p in plan.placements], "the dead leader's service is hedged at once"
    # The old leader, were it alive, has lost its term: its writes are refused,
    # its next step sees it, and hosts refuse its plans (the fence by term).
    with pytest.raises(NotLeader):
        fleet.registry.publish_plan(old_term, old_plan)
    problem = term_problem(old_plan, registry_trust(fleet.state, fleet.registry.leader_term()))
    assert problem is not None and problem[0].startswith("refused:"), problem
    fleet.old.step()
    assert fleet.old.leadership is None and any("gpu-a lost the lease" in line for line in fleet.log), fleet.log


def test_a_candidate_started_after_the_lapse_takes_over_and_suspects_at_its_first_step(fleet: Fleet):
    """It never read gpu-a's record alive: what the registry holds now is
    what it knows (sqlite: the lapsed row; the leader record's
    liveness_until, what etcd keeps once it deleted the key:
    tests/integration/test_registry_takeover.py)."""
    leading(fleet)
    held = fleet.registry.leader_term()
    assert held is not None and held.liveness_until is not None, "the renewal names the leader's host's liveness expiry"
    gpu_a_dies(fleet, LAPSE_OLD_ENOUGH_S)
    late = fleet.candidate("gpu-b")
    late.step()
    assert late.leadership is not None, fleet.log
    plan = fleet.plan()
    assert "gpu-a" in plan.suspects and ("gpu-b", "gpu-a") in [(p.node, p.hedge) for p in plan.placements]


def test_no_takeover_before_the_lapse_is_old_enough(fleet: Fleet):
    leading(fleet)
    gpu_a_dies(fleet, LIVENESS_TTL_S + LIVENESS_S - 1)
    fleet.new.step()
    assert fleet.new.leadership is None, "a lapse younger than liveness_s deposed the leader"
    # The follower wakes when it is old enough, not a periodic step later.
    assert fleet.new.until_next_step_s() <= LIVENESS_S
    gpu_a_dies(fleet, 2)
    fleet.new.step()
    assert fleet.new.leadership is not None


def test_no_takeover_while_the_leaders_host_keeps_its_record_alive(fleet: Fleet):
    """The leader process hangs (no renewal) but its host's watcher is fine:
    the ordinary stale campaign decides, as before."""
    leading(fleet)
    for _ in range(5):
        gpu_a_dies(fleet, LIVENESS_S)
        fleet.keep_alive("gpu-a")
        fleet.new.step()
        assert fleet.new.leadership is None, fleet.log
    assert not any("takes over" in line for line in fleet.log)


def test_no_takeover_while_the_leader_renews_though_its_hosts_record_lapsed(fleet: Fleet):
    """gpu-a's watcher died but its leader lives: it wakes at its host's
    lapse and renews, and a term renewed since the lapse is not taken over."""
    leading(fleet)
    gpu_a_dies(fleet, LIVENESS_TTL_S)
    fleet.old.step()  # at the lapse: renews (and suspects its own host)
    assert fleet.old.leadership is not None
    gpu_a_dies(fleet, LIVENESS_S + 1)
    fleet.new.step()
    assert fleet.new.leadership is None, fleet.log
    assert fleet.old.leadership is not None


def test_no_takeover_when_the_leaders_host_never_kept_a_record(fleet: Fleet):
    """[timing] liveness_s is on but no fabric-watch runs: no record is no
    lapse; the leader record going stale decides, as before."""
    leading(fleet, watchers=False)
    gpu_a_dies(fleet, LAPSE_OLD_ENOUGH_S, others_keep_alive=False)
    fleet.new.step()
    assert fleet.new.leadership is None
    gpu_a_dies(fleet, LEASE_TTL_S, others_keep_alive=False)
    fleet.new.step()
    assert fleet.new.leadership is not None and not any("takes over" in line for line in fleet.log)


def test_with_the_fast_liveness_off_the_stale_leader_record_alone_decides(tmp_path: Path):
    fleet = Fleet(tmp_path, desired(liveness_s=0))
    try:
        leading(fleet, watchers=False)
        held = fleet.registry.leader_term()
        assert held is not None and held.liveness_until is None
        # Even a record left over from when it was on does not count.
        fleet.registry.keep_alive("gpu-a", LIVENESS_TTL_S)
        gpu_a_dies(fleet, LAPSE_OLD_ENOUGH_S, others_keep_alive=False)
        fleet.new.step()
        assert fleet.new.leadership is None
        assert fleet.new.until_next_step_s() > LIVENESS_S
        gpu_a_dies(fleet, LEASE_TTL_S, others_keep_alive=False)
        fleet.new.step()
        assert fleet.new.leadership is not None
        assert fleet.plan().suspects == {}
    finally:
        fleet.close()


def test_a_full_heartbeat_after_the_lapse_is_life_too(fleet: Fleet):
    leading(fleet)
    gpu_a_dies(fleet, LAPSE_OLD_ENOUGH_S)
    fleet.beat("gpu-a", watchers=False)  # its pass beats, its watcher and leader are silent
    fleet.new.step()
    assert fleet.new.leadership is None, fleet.log


def test_a_new_term_goes_on_suspecting_the_hosts_the_last_plan_suspects_for_a_lapse(fleet: Fleet):
    """The old leader suspected cpu (its record lapsed) and resigned; etcd
    deleted cpu's record, and a candidate that never followed leads now: it
    knows the lapse from the plan, not from a record, and does not take it
    for a recovery."""
    leading(fleet)
    fleet.clock.advance(LIVENESS_TTL_S + 1)
    fleet.keep_alive("gpu-a", "gpu-b")
    fleet.old.step()
    assert fleet.plan().suspects["cpu"].since is not None
    assert fleet.old.leadership is not None
    fleet.registry.resign(fleet.old.leadership)
    with fleet.registry._tx() as db:  # as etcd does: a lapsed record is gone
        db.execute("DELETE FROM liveness WHERE host = 'cpu'")
    fresh = fleet.candidate("gpu-b")
    fresh.step()
    assert fresh.leadership is not None
    suspect = fleet.plan().suspects["cpu"]
    assert suspect.since is not None and suspect.events[-1].kind != "recovery", suspect


def test_a_candidate_that_wins_a_stale_term_suspects_the_old_leaders_host_from_its_record(fleet: Fleet):
    """Started after gpu-a's term went stale: its campaign wins at once, and
    etcd deleted gpu-a's record long ago; the leader record it replaces
    (liveness_until) is what tells it gpu-a's host lapsed."""
    leading(fleet)
    gpu_a_dies(fleet, LEASE_TTL_S + 1)
    fleet.beat("gpu-b", "cpu")
    with fleet.registry._tx() as db:  # as etcd does: a lapsed record is gone
        db.execute("DELETE FROM liveness WHERE host = 'gpu-a'")
    fresh = fleet.candidate("gpu-b")
    fresh.step()
    assert fresh.leadership is not None and not any("takes over" in line for line in fleet.log)
    plan = fleet.plan()
    assert "gpu-a" in plan.suspects and ("gpu-b", "gpu-a") in [(p.node, p.hedge) for p in plan.placements], plan.suspects
