"""Backend parity: every lease and lifecycle operation, the same assertions on sqlite and a real etcd.

Each test runs on both backends (the `store` fixture). Time is a `Timeline`:
on sqlite it is an injected clock moved to exactly the configured deadline, so
the boundary itself is checked; on etcd it is real time with short TTLs, and a
deadline is a condition waited for past the configured time for as long again
as `deadline_for` allows it (etcd checks lease expiry about every 0.5 s; a
loaded machine is slow). `before` checks that something
still holds short of a deadline: on sqlite just before it, on etcd at once,
failing if the check came too late to tell. The only sleeps are cadences
(renewing, beating), never a wait for something to happen.

The timings ([timing], [flap] of the fleet) are seconds instead of minutes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import pytest

from reconciler.core.live.records import ScalingRecord
from reconciler.ports import NotLeader, Registry
from tests.support.clock import FakeClock
from tests.support.harness.waiting import deadline_for
from tests.support.registry_store import Store, a_plan, leader_name, record, status_of

pytestmark = pytest.mark.integration

NODE_TIMEOUT_S = 1
RELAYED_TIMEOUT_S = 6  # 2 s relayed beats x 3 missed
# Long enough that the few registry calls between a mark and a `before` check
# fit in it on etcd's real time on a loaded machine.
DRAIN_GRACE_S = 4
HOLD_OFF_S = 2
CONFIG = {
    "timing": {"heartbeat_s": 1, "node_timeout_s": NODE_TIMEOUT_S, "relayed_heartbeat_s": 2, "missed_beats": 3, "drain_grace_s": DRAIN_GRACE_S},
    "flap": {"window_s": 60, "toggles": 3, "hold_off_s": HOLD_OFF_S},
}
LONG_TERM_S = 120  # a leader's term that outlasts the test
# A TTL renewed (or a record re-beaten) every third of it, the leader's own
# rhythm: on etcd's real time a beat or renewal may come late by two thirds of
# a TTL on a loaded machine before the term or record lapses.
CADENCE_TTL_S = 3


class Timeline:
    def __init__(self, store: Store) -> None:
        store.config = CONFIG
        self.store = store
        self.fake = FakeClock() if store.backend == "sqlite" else None
        self.mark()

    def open(self) -> Registry:
        return self.store.open(clock=self.fake)

    def _now(self) -> float:
        return self.fake.now() if self.fake else time.monotonic()

    def _move(self, seconds: float) -> None:
        assert self.fake is not None
        target = self.t0 + seconds
        assert target >= self.fake.now(), "the injected clock only moves forward"
        self.fake.t = target

    def mark(self) -> None:
        """Deadlines from now on count from this instant."""
        self.t0 = self._now()

    def at(self, seconds: float) -> None:
        """A cadence: go on `seconds` after the mark."""
        if self.fake:
            self._move(seconds)
        else:
            time.sleep(max(0.0, self.t0 + seconds - time.monotonic()))

    def by(self, seconds: float, holds: Callable[[], bool], what: str) -> None:
        """`holds` is true `seconds` after the mark (sqlite: exactly then)."""
        if self.fake:
            self._move(seconds)
            assert holds(), f"{what}: not so at {seconds} s"
            return
        slack = deadline_for(seconds)
        deadline = self.t0 + seconds + slack
        while not holds():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not so within {seconds} s (+{slack:.0f} s)")
            time.sleep(0.05)

    def before(self, seconds: float, holds: Callable[[], bool], what: str) -> None:
        """`holds` is still true short of `seconds` after the mark."""
        if self.fake:
            self._move(seconds - 0.01)
            assert holds(), f"{what}: no longer so just before {seconds} s"
            return
        assert holds(), f"{what}: no longer so"
        assert time.monotonic() < self.t0 + seconds, f"checked {time.monotonic() - self.t0:.2f} s after the mark: too late to tell"


@pytest.fixture
def timeline(store: Store) -> Timeline:
    return Timeline(store)


class Observer:
    """The leader advancing the stored lifecycle, collecting the events."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.term = registry.campaign("lux", LONG_TERM_S)
        assert self.term is not None
        self.events: list = []

    def advance(self) -> list[tuple[str, str]]:
        events = self.registry.advance_lifecycle(self.term)
        self.events += events
        return [(e.node_id, e.transition.status) for e in events]

    def saw(self, node: str, transition: str) -> Callable[[], bool]:
        def check() -> bool:
            self.advance()
            return any(e.node_id == node and e.transition.status == transition for e in self.events)

        return check

    def state(self, node: str):
        return next(s for s in self.registry.node_states() if s.node_id == node)


# -- heartbeats and TTL expiry ---------------------------------------------------------


def test_a_heartbeat_stores_the_record_under_the_timeout_of_its_path(timeline):
    registry, other = timeline.open(), timeline.open()
    direct = registry.heartbeat(record("lux", "gpu_cuda"))
    relayed = registry.heartbeat(record("racknerd", "relay", relayed=True))
    assert (direct.timeout_s, relayed.timeout_s) == (NODE_TIMEOUT_S, RELAYED_TIMEOUT_S)
    assert direct.beat_at is not None and relayed.beat_at is not None
    explicit = registry.heartbeat(record("qfox-1"), ttl_s=30)
    assert explicit.timeout_s == 30
    nodes = {n.node_id: n for n in other.snapshot().nodes}
    assert {n: (v.status, v.tier) for n, v in nodes.items()} == {
        "lux": ("active", "gpu_cuda"),
        "racknerd": ("active", "relay"),
        "qfox-1": ("active", "cpu_ffmpeg"),
    }


def test_ttl_expiry_takes_a_direct_node_offline_before_a_relayed_one(timeline):
    registry = timeline.open()
    timeline.mark()
    registry.heartbeat(record("lux", "gpu_cuda"))
    registry.heartbeat(record("racknerd", relayed=True))
    timeline.by(NODE_TIMEOUT_S, lambda: status_of(registry, "lux") == "offline", "lux offline after its TTL")
    lux = next(n for n in registry.snapshot().nodes if n.node_id == "lux")
    assert (lux.status, lux.tier) == ("offline", "gpu_cuda"), "an offline node keeps its facts"
    timeline.before(RELAYED_TIMEOUT_S, lambda: status_of(registry, "racknerd") == "active", "a relayed node outlasts the node timeout")
    timeline.by(RELAYED_TIMEOUT_S, lambda: status_of(registry, "racknerd") == "offline", "racknerd offline after its TTL")


def test_beats_within_the_ttl_keep_a_node_active_past_it(timeline):
    registry = timeline.open()
    ttl = CADENCE_TTL_S
    timeline.mark()
    for i in range(7):  # a beat every third of the TTL for twice the TTL
        timeline.at(i * ttl / 3)
        registry.heartbeat(record("lux"), ttl_s=ttl)
        assert status_of(registry, "lux") == "active"
    timeline.mark()
    timeline.by(ttl, lambda: status_of(registry, "lux") == "offline", "offline one TTL after the last beat")
    registry.heartbeat(record("lux"), ttl_s=ttl)
    assert status_of(registry, "lux") == "active", "a beat brings it back"


# -- leadership: renewals, campaigns, epochs and the fence ---------------------------------


def test_renewal_before_the_lapse_keeps_the_term_and_after_it_fails(timeline):
    a, b = timeline.open(), timeline.open()
    ttl = CADENCE_TTL_S
    term = a.campaign("lux", ttl)
    assert term is not None
    timeline.mark()
    for i in range(1, 5):  # renewed every third of the TTL, past the first TTL
        timeline.at(i * ttl / 3)
        assert a.renew(term), f"renewal {i} within the term"
        assert leader_name(b) == "lux"
    assert b.campaign("qfox-1", ttl) is None
    timeline.mark()
    timeline.before(ttl, lambda: leader_name(b) == "lux", "the last renewal holds for one TTL")
    timeline.by(ttl, lambda: b.leader() is None, "the term lapsed one TTL after the last renewal")
    # Nobody else campaigned: the lapsed term itself must not be renewable.
    assert not a.renew(term), "a renewal after the lapse fails"
    assert a.leader() is None and b.leader() is None, "and does not revive the term"
    with pytest.raises(NotLeader):
        a.publish_plan(term, a_plan())
    with pytest.raises(NotLeader):
        a.advance_lifecycle(term)
    again = a.campaign("lux", ttl)
    assert again is not None and again.epoch > term.epoch, "a new campaign is a new, newer term"


def test_campaign_resign_and_campaign_again_raise_the_epoch_and_fence_the_old_terms(timeline):
    a, b = timeline.open(), timeline.open()
    first = a.campaign("lux", LONG_TERM_S)
    assert first is not None and first.epoch >= 1 and a.epoch() == first.epoch
    assert b.campaign("qfox-1", LONG_TERM_S) is None, "lux leads"
    published = a.publish_plan(first, a_plan())
    assert (published.epoch, published.leader) == (first.epoch + 1, "lux"), "the registry numbers and signs plans with the term"
    assert b.newest_plan().epoch == published.epoch and b.epoch() == published.epoch

    a.resign(first)
    assert a.leader() is None and b.leader() is None
    assert not a.renew(first), "a resigned term cannot be renewed"
    with pytest.raises(NotLeader):
        a.publish_plan(first, a_plan())

    second = b.campaign("qfox-1", LONG_TERM_S)
    assert second is not None and second.epoch > published.epoch
    assert leader_name(a) == "qfox-1"
    assert a.campaign("lux", LONG_TERM_S) is None
    for stale in (lambda: a.publish_plan(first, a_plan()), lambda: a.advance_lifecycle(first), lambda: a.store_scaling(first, ScalingRecord())):
        with pytest.raises(NotLeader):
            stale()
    assert a.newest_plan().epoch == published.epoch, "refused plans are not stored"
    epochs = [b.publish_plan(second, a_plan()).epoch for _ in range(3)]
    assert epochs == [second.epoch + 1, second.epoch + 2, second.epoch + 3]

    b.resign(second)
    third = a.campaign("lux", LONG_TERM_S)
    assert third is not None and third.epoch == epochs[-1] + 1
    assert a.publish_plan(third, a_plan()).leader == "lux"
    with pytest.raises(NotLeader):
        b.publish_plan(second, a_plan())


# -- the stored lifecycle ----------------------------------------------------------------


def test_drain_with_grace_then_undrain(timeline):
    registry = timeline.open()
    leader = Observer(registry)
    registry.heartbeat(record("qfox-1"), ttl_s=LONG_TERM_S)
    assert leader.advance() == [("qfox-1", "active")]
    timeline.mark()
    registry.set_drain("qfox-1", grace_s=DRAIN_GRACE_S, reason="kernel update")
    assert leader.advance() == [("qfox-1", "drain"), ("qfox-1", "draining")]
    state = leader.state("qfox-1")
    assert state.status == "draining" and state.drain.reason == "kernel update"
    timeline.before(DRAIN_GRACE_S, lambda: not leader.state("qfox-1").drained, "its work stays during the grace")
    timeline.by(DRAIN_GRACE_S, lambda: leader.advance() == [("qfox-1", "draining")], "the grace is over")
    node = registry.snapshot().nodes[0]
    assert node.status == "draining" and node.drained
    assert f"grace of {DRAIN_GRACE_S:g} s over" in leader.state("qfox-1").transitions[-1].reason
    assert registry.clear_drain("qfox-1") and not registry.clear_drain("qfox-1")
    assert leader.advance() == [("qfox-1", "undrain"), ("qfox-1", "active")]
    node = registry.snapshot().nodes[0]
    assert node.status == "active" and not node.drained
    assert [t.status for t in timeline.open().node_states()[0].transitions] == ["active", "drain", "draining", "draining", "undrain", "active"]


def test_offline_then_dead_then_forgotten_and_a_dead_node_that_beats_again(timeline):
    registry = timeline.open()
    leader = Observer(registry)
    timeline.mark()
    for node in ("a1-arm64", "x86-spill"):
        registry.heartbeat(record(node))
    assert leader.advance() == [("a1-arm64", "active"), ("x86-spill", "active")]
    timeline.by(NODE_TIMEOUT_S, lambda: status_of(registry, "a1-arm64") == status_of(registry, "x86-spill") == "offline", "both offline")
    assert sorted(leader.advance()) == [("a1-arm64", "offline"), ("x86-spill", "offline")]
    timeline.mark()  # offline since now: dead one drain grace later
    timeline.before(DRAIN_GRACE_S, lambda: leader.advance() == [] and status_of(registry, "a1-arm64") == "offline", "offline for the grace")
    timeline.by(DRAIN_GRACE_S, leader.saw("a1-arm64", "dead"), "dead after the drain grace")
    assert {s.node_id: s.status for s in registry.node_states()} == {"a1-arm64": "dead", "x86-spill": "dead"}
    assert registry.snapshot().nodes == [], "a dead node's facts are dropped"
    timeline.mark()
    registry.heartbeat(record("x86-spill"), ttl_s=LONG_TERM_S)
    assert leader.advance() == [("x86-spill", "active")], "a dead node that beats again is active"
    timeline.by(DRAIN_GRACE_S, lambda: status_of(leader.registry, "a1-arm64") is None and leader.saw("a1-arm64", "dead")(), "forgotten")
    assert [e.forget for e in leader.events if e.node_id == "a1-arm64"][-1] is True
    assert {s.node_id: s.status for s in timeline.open().node_states()} == {"x86-spill": "active"}
    assert [n.node_id for n in registry.snapshot().nodes] == ["x86-spill"]


def test_three_toggles_within_the_window_hold_a_node_off_until_released(timeline):
    registry = timeline.open()
    leader = Observer(registry)
    registry.heartbeat(record("qfox-1"))
    assert leader.advance() == [("qfox-1", "active")]
    timeline.mark()
    timeline.by(NODE_TIMEOUT_S, leader.saw("qfox-1", "offline"), "toggle 1: offline")
    registry.heartbeat(record("qfox-1"))
    assert leader.advance() == [("qfox-1", "active")]  # toggle 2
    assert leader.state("qfox-1").held_off_until is None, "two toggles are not a flap"
    timeline.mark()
    timeline.by(NODE_TIMEOUT_S, leader.saw("qfox-1", "held_off"), "toggle 3: offline and held off")
    held = next(e for e in leader.events if e.transition.status == "held_off")
    until = held.transition.at + timedelta(seconds=HOLD_OFF_S)
    assert leader.state("qfox-1").held_off_until == until
    assert "3 toggles within 60 s" in held.transition.reason
    # Back (a 4th toggle, the start of a new count): active, but no new work until the hold-off ends.
    registry.heartbeat(record("qfox-1"), ttl_s=LONG_TERM_S)
    assert leader.advance() == [("qfox-1", "active")]
    node = registry.snapshot().nodes[0]
    assert node.status == "active" and node.held_off_until == until
    timeline.mark()
    timeline.by(HOLD_OFF_S, leader.saw("qfox-1", "released"), "released when the hold-off ends")
    assert registry.snapshot().nodes[0].held_off_until is None
    assert [t.status for t in leader.state("qfox-1").transitions] == ["active", "offline", "active", "offline", "held_off", "active", "released"]
