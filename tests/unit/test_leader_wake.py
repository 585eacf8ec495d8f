"""When the leader's loop steps next: at the first lapse it read, sooner when
one is due but not shown yet (rechecked, twice as late each time), never later
than its renewal. A registry stand-in that answers `lead` with a chosen lapse
and an injected clock: nothing waits."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from reconciler.core.desired.load import load_desired
from reconciler.core.live.models import FleetPlan, Snapshot, SnapshotNode
from reconciler.core.live.records import LeaderInfo, Leadership
from reconciler.core.scheduling.suspicion import LivenessRecord
from reconciler.engine.leader import LAPSE_RECHECK_S, LeaderLoop
from reconciler.ports import LeaderView
from tests.support.clock import FakeClock
from tests.support.plan_keys import signed_example_fleet

LEASE_TTL_S = 30.0  # a renewal every 10 s


class LapseRegistry:
    """Leads at once and reports `lapse` as the first up node's lapse."""

    def __init__(self) -> None:
        self.lapse: datetime | None = None
        # Fast liveness records (issue 30) and the nodes the snapshot shows.
        self.records: list[LivenessRecord] = []
        self.nodes: list[SnapshotNode] = []
        self.now: datetime | None = None

    def liveness(self) -> list[LivenessRecord]:
        return list(self.records)

    def edge_upstreams(self) -> dict[str, bytes]:
        return {}  # no edge reports any upstream failing

    def group_members(self) -> tuple[list, list[str]]:
        return [], []  # no worker group member reports

    def campaign(self, candidate: str, ttl_s: float) -> Leadership:
        return Leadership(LeaderInfo(candidate=candidate, epoch=1, since=datetime.now(UTC), token="t"), ttl_s)

    def leader_term(self) -> LeaderInfo | None:
        return None  # nobody led before

    def renew(self, leadership: Leadership) -> bool:
        return True

    def lead(self, leadership: Leadership, lanes=()) -> LeaderView:
        return LeaderView(
            events=[], snapshot=Snapshot(epoch=1, nodes=self.nodes, **({"now": self.now} if self.now else {})), plan=None, next_lapse=self.lapse
        )

    def publish_plan(self, leadership: Leadership, plan: FleetPlan) -> FleetPlan:
        return plan

    def epoch(self) -> int:
        return 1


def a_loop(tmp_path: Path) -> tuple[LeaderLoop, LapseRegistry, FakeClock]:
    signed = signed_example_fleet(tmp_path)
    desired = load_desired(signed.desired)
    registry, clock = LapseRegistry(), FakeClock()
    loop = LeaderLoop(
        registry=registry,  # type: ignore[arg-type]
        host="lux",
        load_desired=lambda: desired,
        schedule=lambda snapshot, desired, *, leader, epoch: FleetPlan(epoch=epoch, leader=leader, created=snapshot.now),
        lease_ttl_s=LEASE_TTL_S,
        log=lambda _: None,
        signer=signed.signer("lux"),
        clock=clock,
    )
    return loop, registry, clock


def at(clock: FakeClock, seconds: float) -> datetime:
    return datetime.fromtimestamp(clock.now() + seconds, UTC)


def test_the_loop_steps_at_the_first_lapse_and_at_least_every_renewal(tmp_path):
    loop, registry, clock = a_loop(tmp_path)
    loop.step()
    assert loop.until_next_step_s() == loop.wait_s() == LEASE_TTL_S / 3, "no lapse ahead: the renewal"
    registry.lapse = at(clock, 4)
    loop.step()
    assert loop.until_next_step_s() == 4
    registry.lapse = at(clock, 25)
    loop.step()
    assert loop.until_next_step_s() == loop.wait_s(), "a lapse after the renewal waits for the renewal's step"


def test_a_due_lapse_the_registry_does_not_show_yet_is_rechecked_ever_later_up_to_the_renewal(tmp_path):
    loop, registry, clock = a_loop(tmp_path)
    registry.lapse = at(clock, 2)
    loop.step()
    clock.t += 2
    waits = []
    for _ in range(8):
        loop.step()  # the node still shows alive: the same lapse, due
        waits.append(loop.until_next_step_s())
        clock.t += waits[-1]
    assert waits[:4] == [LAPSE_RECHECK_S * 2**i for i in range(4)]
    assert max(waits) == loop.wait_s()
    registry.lapse = at(clock, 3)  # it beat again: a new lapse ahead, waited for from scratch
    loop.step()
    assert loop.until_next_step_s() == 3
    clock.t += 3
    loop.step()
    assert loop.until_next_step_s() == LAPSE_RECHECK_S


def test_a_follower_waits_only_for_the_leader_key(tmp_path):
    loop, registry, clock = a_loop(tmp_path)
    registry.lapse = at(clock, 1)
    loop.step()
    loop.leadership = None
    assert loop.until_next_step_s() == loop.wait_s()


def test_the_loop_steps_when_a_fast_liveness_record_lapses_not_at_its_tick(tmp_path):
    """Issue 30: the leader wakes at the first live liveness record's lapse
    (etcd's watch also wakes it when the record's key goes)."""
    loop, registry, clock = a_loop(tmp_path)
    registry.nodes = [SnapshotNode(node_id="qfox-1", tier="gpu_vaapi")]
    registry.now = at(clock, 0)
    registry.records = [LivenessRecord("qfox-1", at(clock, 6), 6)]
    loop.step()
    assert loop.until_next_step_s() == 6, "not the renewal's 10 s"
    registry.records = [LivenessRecord("ghost", at(clock, 2), 6)]
    loop.step()
    assert loop.until_next_step_s() == 6, "a record of no known node wakes nothing; the remembered expiry still counts"
