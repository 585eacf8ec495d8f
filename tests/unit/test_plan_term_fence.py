"""The (term, step) fence (pure): a registry plan is applied only as the current leader's, in its current term.

One table: the plan (who signed it, for which term, fleet and prefix, its
epoch), what the registry's leader record holds now, what this host applied
last (its manifest's term, epoch and signing key), and the verdict. The plans
are really signed (tests.plan_keys keys), so a row also shows that the term,
the fleet and the prefix are under the signature. Then the leader's side over
the embedded sqlite registry: the term is the registry's, and a new term
publishes its own plan even when the placements are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

from reconciler.adapters.clock import SystemClock
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.model import PlanKey
from reconciler.core.live.fencing import AppliedFence, RegistryTrust, accept_plan
from reconciler.core.live.models import FleetPlan, Placement
from reconciler.core.live.signing import canonical_plan, verify_plan, with_signature
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.leader import STALE_MARGIN_S, LeaderLoop
from tests.support.plan_keys import TestKey
from tests.support.raw_plans import write_sqlite_plan

T0 = datetime(2026, 12, 2, 6, 0, tzinfo=UTC)
CANDIDATES = ["lux", "qfox-1"]
FLEET, PREFIX = "researchstack", "/fabric"
LUX = TestKey("lux", "lux-a")
QFOX = TestKey("qfox-1", "qfox-1-a")
KEYS = [PlanKey(host=k.host, id=k.id, public_key=k.public_b64) for k in (LUX, QFOX)]
HUGE = 10**15


def plan(*, key: TestKey = LUX, term: int = 7, epoch: int = 20, fleet: str = FLEET, prefix: str = PREFIX) -> FleetPlan:
    body = FleetPlan(
        epoch=epoch,
        leader=key.host,
        term=term,
        fleet=fleet,
        prefix=prefix,
        created=T0,
        placements=[Placement(service="lupine", replica=0, node="qfox-1", tier="gpu_cuda")],
    )
    return with_signature(body, key.id, key.private.sign(canonical_plan(body)))


def registry(candidate: str | None = "lux", term: int | None = 7) -> RegistryTrust:
    return RegistryTrust(fleet=FLEET, prefix=PREFIX, candidate=candidate, term=term)


@dataclass(frozen=True)
class Row:
    why: str
    plan: FleetPlan
    applied: AppliedFence | None
    now: RegistryTrust
    accepted: bool
    reason: str
    untrusted: bool = False
    keys: tuple[PlanKey, ...] = tuple(KEYS)


ROWS = [
    Row("the current leader's plan in its term", plan(), AppliedFence(19, 7, "lux-a"), registry(), True, "plan epoch 20 is newer than 19"),
    Row("the plan already applied", plan(), AppliedFence(20, 7, "lux-a"), registry(), True, "plan epoch 20 is the one applied"),
    Row("a new host", plan(), None, registry(), True, "plan epoch 20 is newer than none applied"),
    Row(
        "a listed candidate that does not lead, with a huge epoch",
        plan(key=QFOX, term=7, epoch=HUGE),
        AppliedFence(20, 7, "lux-a"),
        registry(),
        False,
        "is signed by 'qfox-1', but the registry names 'lux' as leader (term 7)",
        untrusted=True,
    ),
    Row(
        "the leader's plan for another fleet",
        plan(fleet="otherfleet"),
        AppliedFence(19, 7, "lux-a"),
        registry(),
        False,
        "signed for fleet 'otherfleet', not 'researchstack'",
        untrusted=True,
    ),
    Row(
        "the leader's plan for another registry prefix",
        plan(prefix="/staging"),
        AppliedFence(19, 7, "lux-a"),
        registry(),
        False,
        "signed for registry prefix '/staging', not '/fabric'",
        untrusted=True,
    ),
    Row(
        "a plan of an earlier term, whatever its epoch (a replay)",
        plan(term=6, epoch=HUGE),
        AppliedFence(19, 7, "lux-a"),
        registry(),
        False,
        "is of lux's term 6, not the registry's current term 7",
    ),
    Row(
        "a replay after a rollback lowered the host's fence",
        plan(term=6, epoch=15),
        AppliedFence(10, 6, "lux-a"),
        registry(),
        False,
        "not the registry's current term 7",
    ),
    Row(
        "a replay to a new host (no fence at all)",
        plan(term=6, epoch=15),
        None,
        registry(),
        False,
        "not the registry's current term 7",
    ),
    Row("no leader record in the registry", plan(), None, registry(None, None), False, "the registry names no leader term now"),
    Row(
        "a new term replaces a poisoned epoch of an older one",
        plan(term=8, epoch=21),
        AppliedFence(HUGE, 7, "lux-a"),
        registry("lux", 8),
        True,
        f"plan epoch 21 is newer than {HUGE} applied: its term 8 replaces term 7",
    ),
    Row(
        "an older term than the one applied (a lagging registry member)",
        plan(term=7, epoch=30),
        AppliedFence(25, 8, "lux-a"),
        registry("lux", 7),
        False,
        "is of term 7, older than the term applied (8)",
    ),
    Row(
        "an older epoch within the term",
        plan(epoch=18),
        AppliedFence(19, 7, "lux-a"),
        registry(),
        False,
        "plan epoch 18 is older than the newest applied (19)",
    ),
    Row(
        "a fence set by a key that is retired now is lifted",
        plan(key=LUX, epoch=21),
        AppliedFence(HUGE, 7, "qfox-1-a"),
        registry(),
        True,
        "plan epoch 21 is newer than none applied",
        keys=(KEYS[0],),
    ),
    Row(
        "a fence set by a key still listed stays",
        plan(key=LUX, epoch=21),
        AppliedFence(HUGE, 7, "qfox-1-a"),
        registry(),
        False,
        f"older than the newest applied ({HUGE})",
    ),
    Row(
        "a generation from before terms: its epoch alone",
        plan(epoch=21),
        AppliedFence(22),
        registry(),
        False,
        "plan epoch 21 is older than the newest applied (22)",
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.why for row in ROWS])
def test_the_term_fence(row: Row) -> None:
    verdict = accept_plan(row.applied, row.plan, leader_candidates=CANDIDATES, plan_keys=list(row.keys), registry=row.now)
    assert (verdict.accepted, verdict.untrusted) == (row.accepted, row.untrusted), verdict
    assert row.reason in verdict.reason, verdict.reason


def test_the_term_fleet_and_prefix_are_under_the_signature() -> None:
    genuine = plan()
    for field, value in (("term", 8), ("fleet", "otherfleet"), ("prefix", "/staging")):
        moved = genuine.model_copy(update={field: value})
        assert verify_plan(moved, KEYS) is not None, field
        verdict = accept_plan(None, moved, leader_candidates=CANDIDATES, plan_keys=KEYS, registry=registry("lux", 8))
        assert not verdict.accepted and verdict.untrusted and "does not match its content" in verdict.reason, (field, verdict)


def test_without_plan_keys_the_registry_term_is_not_asked() -> None:
    """Unsigned fleets take registry plans on their word (with a note); the (term, step) fence still holds."""
    unsigned = plan().model_copy(update={"signature": None})
    assert accept_plan(AppliedFence(19, 7), unsigned, leader_candidates=CANDIDATES, registry=registry(None, None)).accepted
    assert not accept_plan(AppliedFence(19, 8), unsigned, leader_candidates=CANDIDATES, registry=registry(None, None)).accepted


# --------------------------------------------------------------------------
# The leader's side, over the embedded registry


@pytest.fixture
def signed_desired(tmp_path: Path):
    from reconciler.core.desired.load import load_desired
    from tests.support.plan_keys import signed_example_fleet

    fleet = signed_example_fleet(tmp_path / "fleet")
    return fleet, load_desired(fleet.desired)


def test_the_leader_signs_its_registry_term_and_a_new_term_publishes_its_own_plan(tmp_path: Path, signed_desired) -> None:
    fleet, desired = signed_desired
    reg = SqliteRegistry(tmp_path / "registry.sqlite", timing=desired.fleet.timing, flap=desired.fleet.flap, clock=SystemClock())
    log: list[str] = []
    try:

        def leader(host: str) -> LeaderLoop:
            return LeaderLoop(
                registry=reg, host=host, load_desired=lambda: desired, schedule=schedule, lease_ttl_s=30, log=log.append, signer=fleet.signer(host)
            )

        leader("lux").step_and_resign()
        first = reg.newest_plan()
        held = reg.leader_term()
        assert first is not None and held is not None and held.resigned and reg.leader() is None
        assert (first.leader, first.term, first.fleet, first.prefix) == ("lux", held.term, desired.fleet.fleet.name, desired.fleet.registry.prefix)
        assert verify_plan(first, desired.fleet.plan_keys) is None
        trust = RegistryTrust(desired.fleet.fleet.name, desired.fleet.registry.prefix, held.candidate, held.term)
        assert accept_plan(None, first, leader_candidates=CANDIDATES, plan_keys=desired.fleet.plan_keys, registry=trust).accepted

        # lux again: a new term (the registry's counter, not lux's choice) and a plan of its own, the same placements.
        leader("lux").step_and_resign()
        second = reg.newest_plan()
        assert second is not None and second.term > first.term and second.epoch > first.epoch
        assert {(p.service, p.node) for p in second.placements} == {(p.service, p.node) for p in first.placements}
        now = reg.leader_term()
        assert now is not None and now.term == second.term
        trust = RegistryTrust(desired.fleet.fleet.name, desired.fleet.registry.prefix, now.candidate, now.term)
        replay = accept_plan(
            AppliedFence(first.epoch, first.term), first, leader_candidates=CANDIDATES, plan_keys=desired.fleet.plan_keys, registry=trust
        )
        assert not replay.accepted and "not the registry's current term" in replay.reason
    finally:
        reg.close()


def test_a_renewal_rewrites_the_record_and_a_lapsed_record_is_taken_over_with_a_new_term(tmp_path: Path, signed_desired) -> None:
    _, desired = signed_desired

    class Clock:
        t = 1_000_000.0

        def now(self) -> float:
            return self.t

        def monotonic(self) -> float:
            return self.t

    clock = Clock()
    reg = SqliteRegistry(tmp_path / "registry.sqlite", timing=desired.fleet.timing, flap=desired.fleet.flap, clock=clock)  # type: ignore[arg-type]
    try:
        term = reg.campaign("lux", 10)
        assert term is not None and term.term >= 1
        clock.t += 6
        assert reg.renew(term)
        held = reg.leader_term()
        assert held is not None and held.renewed_at is not None and held.renewed_at.timestamp() == clock.t
        clock.t += 9
        assert reg.campaign("qfox-1", 10) is None, "renewed 9 s ago, its TTL is 10 s"
        clock.t += 2
        taken = reg.campaign("qfox-1", 10)
        assert taken is not None and taken.term > term.term
        assert not reg.renew(term)
    finally:
        reg.close()


def test_a_following_candidate_wakes_when_the_leader_record_goes_stale(tmp_path: Path, signed_desired) -> None:
    """Not at its next periodic step: just after renewed_at + the record's TTL,
    so a record nobody renews is taken over within one TTL."""
    fleet, desired = signed_desired

    class Clock:
        t = 1_000_000.0

        def now(self) -> float:
            return self.t

    clock = Clock()
    reg = SqliteRegistry(tmp_path / "registry.sqlite", timing=desired.fleet.timing, flap=desired.fleet.flap, clock=clock)  # type: ignore[arg-type]
    try:
        lux = reg.campaign("lux", 10)
        assert lux is not None
        follower = LeaderLoop(
            registry=reg,
            host="qfox-1",
            load_desired=lambda: desired,
            schedule=schedule,
            lease_ttl_s=90,  # its own periodic step: every 30 s
            log=[].append,
            signer=fleet.signer("qfox-1"),
            clock=clock,  # type: ignore[arg-type]
        )
        clock.t += 4
        follower.step()
        assert follower.leadership is None
        assert follower.until_next_step_s() == pytest.approx(6 + STALE_MARGIN_S)
        clock.t += 6 + STALE_MARGIN_S
        follower.step()
        assert follower.leadership is not None and follower.leadership.term > lux.term
        follower.step_and_resign()
    finally:
        reg.close()


def test_fabric_status_refuses_a_plan_of_a_candidate_that_does_not_lead(tmp_path: Path, signed_desired) -> None:
    """The status page never shows as the fleet's a plan every host refuses."""
    import sqlite3

    from reconciler.engine.status import live_status

    fleet, desired = signed_desired
    path = tmp_path / "registry.sqlite"
    reg = SqliteRegistry(path, timing=desired.fleet.timing, flap=desired.fleet.flap, clock=SystemClock())
    try:
        lux = LeaderLoop(
            registry=reg, host="lux", load_desired=lambda: desired, schedule=schedule, lease_ttl_s=30, log=[].append, signer=fleet.signer("lux")
        )
        lux.step()
        genuine = reg.newest_plan()
        assert genuine is not None and live_status(desired, reg).plan_refused is None
        # qfox-1's key, its own name, lux's term, a huge epoch: written straight into the file.
        evil = genuine.model_copy(update={"leader": "qfox-1", "epoch": HUGE, "signature": None})
        evil = with_signature(evil, "qfox-1-test", fleet.keys["qfox-1"].private.sign(canonical_plan(evil)))
        with sqlite3.connect(path) as db:
            write_sqlite_plan(db, evil, epoch=HUGE)
        status = live_status(desired, reg)
        assert status.plan is None and status.plan_refused is not None
        assert "is signed by 'qfox-1', but the registry names 'lux' as leader" in status.plan_refused
        lux.step_and_resign()
    finally:
        reg.close()
