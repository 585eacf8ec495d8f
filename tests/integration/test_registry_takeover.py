"""The takeover of a live term whose leader's host's fast liveness record
lapsed (issue 30), on both real backends (a sqlite file; a private prefix of
a real etcd, its leases lapsing in real time).

`Candidacy.take_over` is a compare-and-swap: it replaces the leader record
only while it is the record the candidate read (not renewed since) and the
liveness record of its host has lapsed (etcd: the key gone with its lease;
sqlite: its row's deadline passed), then makes a new term whose fence
refuses every write of the old one. Then two leader loops: a candidate
started after the lapse (etcd deleted the key: the leader record's
liveness_until is all it knows) takes the term over, its first step
suspects the dead leader's host and hedges its service.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from reconciler.adapters.clock import SystemClock
from reconciler.adapters.registry_etcd import EtcdRegistry
from reconciler.core.desired.model import DesiredState, FleetConfig, HostConfig
from reconciler.core.live.models import FleetPlan
from reconciler.core.live.records import NodeRecord
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.leader import LeaderLoop
from reconciler.ports import NotLeader, Registry
from tests.support.harness.waiting import deadline_for, wait_until
from tests.support.registry_store import Store

pytestmark = pytest.mark.integration

LIVENESS_S = 1
LIVENESS_TTL_S = 2
LEASE_TTL_S = 60  # far longer than any wait here: only a takeover ends the term


def lapsed(registry: Registry, host: str) -> bool:
    """The host's liveness record is no longer alive (etcd: gone; sqlite: expired)."""
    now = SystemClock().now()
    return not any(r.host == host and r.expires_at.timestamp() > now for r in registry.liveness())


def record_gone(registry: Registry, host: str) -> bool:
    """`lapsed`, and on etcd the key itself deleted (its lessor revokes a
    lapsed lease up to half a second late; the takeover compares the key)."""
    if not lapsed(registry, host):
        return False
    if not isinstance(registry, EtcdRegistry):
        return True

    async def op(c):
        return await c.get(registry._key("liveness", host))

    return registry._call(op) is None


def test_the_takeover_replaces_a_live_term_only_once_its_leaders_host_lapsed(store: Store) -> None:
    registry = store.open()
    registry.keep_alive("lux", LIVENESS_TTL_S)
    old = registry.campaign("lux", LEASE_TTL_S)
    assert old is not None
    held = registry.leader_term()
    assert held is not None and held.term == old.term
    assert registry.take_over("qfox-1", LEASE_TTL_S, held) is None, "lux's record is alive"
    assert registry.leader_term() == held
    wait_until(lambda: record_gone(registry, "lux"), timeout=deadline_for(LIVENESS_TTL_S), what="lux's liveness record lapsed")
    # A record read before a renewal is not the record any more.
    assert registry.renew(old)
    assert registry.take_over("qfox-1", LEASE_TTL_S, held) is None, "the term was renewed since it was read"
    renewed = registry.leader_term()
    assert renewed is not None
    new = registry.take_over("qfox-1", LEASE_TTL_S, renewed)
    assert new is not None and new.candidate == "qfox-1" and new.term > old.term and new.epoch > old.epoch
    leader = registry.leader()
    assert leader is not None and leader.candidate == "qfox-1" and leader.term == new.term
    # The old term, were its leader alive, is over: no renewal, no plan.
    assert not registry.renew(old)
    plan = registry.newest_plan()
    with pytest.raises(NotLeader):
        registry.publish_plan(old, plan if plan is not None else FleetPlan(epoch=0, leader="lux", created=datetime.now(UTC)))
    # Nor a second takeover from the same read.
    assert registry.take_over("lux", LEASE_TTL_S, renewed) is None


def desired(store: Store) -> DesiredState:
    fleet = FleetConfig.model_validate(
        {
            "fleet": {"domain": "t.example", "leader_candidates": ["lux", "qfox-1"]},
            "registry": store.settings,
            "timing": {"liveness_s": LIVENESS_S, "liveness_ttl_s": LIVENESS_TTL_S},
            "services": [{"id": "enc", "min_tier": "gpu_vaapi", "command": {"any": ["/bin/enc"]}}],
        }
    )
    hosts = {
        name: HostConfig.model_validate({"host": {"name": name, "roles": ["compute"], "address": f"100.64.0.{i + 1}"}})
        for i, name in enumerate(("lux", "qfox-1"))
    }
    return DesiredState(fleet=fleet, hosts=hosts)


def loop(store: Store, host: str, state: DesiredState, log: list[str]) -> LeaderLoop:
    return LeaderLoop(
        registry=store.open(),
        host=host,
        load_desired=lambda: state,
        schedule=schedule,
        lease_ttl_s=LEASE_TTL_S,
        log=log.append,
        clock=SystemClock(),
    )


def test_a_candidate_started_after_the_lapse_takes_over_and_hedges_the_dead_leaders_service(store: Store, tmp_path: Path) -> None:
    state = desired(store)
    registry = store.open()
    log: list[str] = []
    for host in ("lux", "qfox-1"):
        registry.heartbeat(NodeRecord(node_id=host, tier="gpu_vaapi", max_concurrent_tasks=4), ttl_s=300)
        registry.keep_alive(host, LIVENESS_TTL_S)
    old = loop(store, "lux", state, log)
    old.step()
    registry.keep_alive("lux", LIVENESS_TTL_S)
    old.step()  # a renewal: the leader record names its host's liveness expiry
    assert old.leadership is not None
    held = registry.leader_term()
    assert held is not None and held.liveness_until is not None, held
    first = registry.newest_plan()
    assert first is not None and [(p.node, p.hedge) for p in first.placements] == [("lux", None)]

    # lux dies: no keep-alive, no renewal; qfox-1's watcher goes on.
    def lux_lapsed() -> bool:
        registry.keep_alive("qfox-1", LIVENESS_TTL_S)
        return lapsed(registry, "lux")

    wait_until(lux_lapsed, timeout=deadline_for(LIVENESS_TTL_S), what="lux's liveness record lapsed", interval=0.2)
    late = loop(store, "qfox-1", state, log)

    def took_over() -> bool:
        registry.keep_alive("qfox-1", LIVENESS_TTL_S)
        late.step()
        return late.leadership is not None

    wait_until(took_over, timeout=deadline_for(LIVENESS_TTL_S + LIVENESS_S), what="qfox-1 took lux's term over", interval=0.2)
    assert late.leadership is not None and late.leadership.term > held.term
    assert any("qfox-1 takes over from lux" in line for line in log), log
    plan = registry.newest_plan()
    assert plan is not None and plan.leader == "qfox-1"
    suspect = plan.suspects.get("lux")
    assert suspect is not None and suspect.since is not None, plan.suspects
    assert ("qfox-1", "lux") in [(p.node, p.hedge) for p in plan.placements], plan.placements
    # lux's leader, were it alive, learns at its next step that its term is over.
    old.step()
    assert old.leadership is None
