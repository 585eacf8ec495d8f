"""Worker group members in the sqlite registry, and the leader that admits them.

The registry keeps each member's report under its group with a deadline (it
expires when the worker stops); the leader loop over a real sqlite registry
admits the members of the example's declared group `batch` with the group's
tier, places work that needs the group's label on them, caps the group and
refuses a member of an undeclared group. (etcd, with the group's identity:
tests/integration/test_registry_auth.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState, FlapSettings, Hardware, HostFacts, Service, TimingSettings
from reconciler.core.live.members import MemberRecord
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.leader import LeaderLoop
from tests.support.clock import FakeClock

pytestmark = pytest.mark.integration

POOL = {"topology.researchstack.io/pool": "batch"}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(tmp_path: Path, clock: FakeClock):
    r = SqliteRegistry(tmp_path / "registry.sqlite", timing=TimingSettings(), flap=FlapSettings(), clock=clock)
    yield r
    r.close()


def member(name: str, group: str = "batch", tier: str = "gpu_cuda", address: str = "100.64.250.40") -> MemberRecord:
    facts = HostFacts(node_id=name, k3s_hostname=name, hardware=Hardware(arch="x86_64", cpu_cores=4), tier=tier, tailscale_ip=address)
    return MemberRecord(node_id=name, group=group, address=address, facts=facts)


def with_crunch(desired: DesiredState, max_members: int = 4) -> DesiredState:
    """The example fleet whose only service needs the batch group's label, and the group capped at `max_members`."""
    crunch = Service.model_validate(
        {"id": "crunch", "min_tier": "batch", "floor": "batch", "replicas": 3, "labels": POOL, "command": {"any": ["/opt/c"]}}
    )
    groups = {"batch": desired.fleet.groups["batch"].model_copy(update={"max_members": max_members})}
    return desired.model_copy(update={"fleet": desired.fleet.model_copy(update={"services": [crunch], "groups": groups})})


def test_a_member_report_is_kept_under_its_group_until_it_expires(registry, clock):
    first = registry.report_member(member("gh-1"), ttl_s=30)
    clock.advance(10)
    again = registry.report_member(member("gh-1"), ttl_s=30)
    assert again.first_seen == first.first_seen and again.reported_at > first.reported_at
    records, problems = registry.group_members()
    assert [(r.group, r.node_id) for r in records] == [("batch", "gh-1")] and problems == []
    assert "gh-1" not in {n.node_id for n in registry.snapshot().nodes}, "a member report is never a heartbeat"
    clock.advance(31)
    assert registry.group_members() == ([], [])


def test_a_record_that_names_another_group_than_its_row_is_skipped(registry):
    registry.report_member(member("gh-1"), ttl_s=30)
    with registry._tx() as db:  # a writer that put the record of group spot under batch
        db.execute("UPDATE members SET record = ? WHERE node_id = 'gh-1'", (member("gh-1", group="spot").model_dump_json(),))
    records, problems = registry.group_members()
    assert records == []
    assert problems and "names another group or member (spot/gh-1)" in problems[0]


def test_the_leader_admits_the_groups_members_with_its_tier_and_gives_them_work(registry, clock, signed_fleet):
    desired = with_crunch(load_desired(signed_fleet.desired), max_members=2)
    logged: list[str] = []
    loop = LeaderLoop(registry, "lux", lambda: desired, schedule, lease_ttl_s=30, log=logged.append, signer=signed_fleet.signer("lux"))
    loop.step()
    assert {d.service for d in registry.newest_plan().deferred} == {"crunch"}, "no member yet: the work waits"

    for name in ("gh-1", "gh-2", "gh-3"):  # three join, the group takes two (the earliest)
        registry.report_member(member(name, tier="gpu_cuda"), ttl_s=30)
        clock.advance(1)
    registry.report_member(member("rogue-1", group="rogue"), ttl_s=30)
    loop.step()
    plan = registry.newest_plan()
    placed = sorted((p.node, p.tier) for p in plan.placements if p.service == "crunch")
    assert placed == [("gh-1", "batch"), ("gh-2", "batch")], "the group's tier, never the gpu_cuda a member claims"
    assert len([d for d in plan.deferred if d.service == "crunch"]) == 1

    # The members stop reporting: their records expire and their work waits again.
    for _ in range(4):  # the loop wakes (and renews its lease) every 10 s
        clock.advance(10)
        loop.step()
    assert not [p for p in registry.newest_plan().placements if p.service == "crunch"]
