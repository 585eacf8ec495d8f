"""The node lifecycle (pure), driven with an injected clock: no sleeping.

A `Fleet` plays the registry: it keeps the stored states, each node's newest
record, the drains, and judges liveness like the sqlite backend
(`alive_at`: beat time + timeout against `now`).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import pairwise
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.core.desired.model import FlapSettings, TimingSettings
from reconciler.core.live.fencing import accept_plan
from reconciler.core.live.models import FleetPlan, SnapshotNode
from reconciler.core.live.records import DrainRequest, NodeRecord
from reconciler.core.scheduling import lifecycle
from reconciler.core.scheduling.lifecycle import HISTORY, NodeState, alive_at, heartbeat_timeout, observe, snapshot_node, stored_state, with_facts

T0 = datetime(2026, 6, 1, 4, 0, tzinfo=UTC)
TIMING = TimingSettings()  # 30 s beats, 90 s timeout, 45 s relayed beats, 300 s drain grace
FLAP = FlapSettings()  # 3 toggles in 300 s -> held off 600 s


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class Fleet:
    def __init__(self, timing: TimingSettings = TIMING, flap: FlapSettings = FLAP) -> None:
        self.timing, self.flap = timing, flap
        self.states: dict = {}
        self.records: dict[str, NodeRecord] = {}
        self.drains: dict[str, DrainRequest] = {}
        self.events: list = []

    def beat(self, node: str, t: float, *, relayed: bool = False, tier: str = "cpu_ffmpeg") -> None:
        self.records[node] = NodeRecord(
            node_id=node,
            tier=tier,
            max_concurrent_tasks=4,
            in_flight=1,
            relayed=relayed,
            beat_at=at(t),
            timeout_s=heartbeat_timeout(self.timing, relayed),
        )

    def drain(self, node: str, t: float, grace: float) -> None:
        self.drains[node] = DrainRequest(node_id=node, requested_at=at(t), grace_s=grace)

    def undrain(self, node: str) -> None:
        del self.drains[node]

    def tick(self, t: float) -> list:
        now = at(t)
        self.states, events = observe(self.states, self.records, alive_at(self.records, now), self.drains, now, self.timing, self.flap)
        # The backend drops a dead node's facts and a forgotten node's everything.
        for node_id in list(self.records):
            state = self.states.get(node_id)
            if state is None or state.status == "dead":
                del self.records[node_id]
        self.events += events
        return events

    def status(self, node: str) -> str:
        return self.states[node].status


def test_first_heartbeat_makes_a_node_active_with_the_reason_recorded():
    fleet = Fleet()
    fleet.beat("qfox-1", 0)
    events = fleet.tick(0)
    assert fleet.status("qfox-1") == "active"
    assert [(e.node_id, e.transition.status, e.transition.reason) for e in events] == [("qfox-1", "active", "first heartbeat")]
    assert fleet.states["qfox-1"].transitions[0].at == at(0)
    assert fleet.states["qfox-1"].last_seen == at(0)


def test_a_node_stays_active_while_beats_arrive_and_is_offline_after_three_missed_beats():
    fleet = Fleet()
    for t in range(0, 301, 30):
        fleet.beat("qfox-1", t)
        fleet.tick(t)
        assert fleet.status("qfox-1") == "active"
    fleet.tick(300 + 89)
    assert fleet.status("qfox-1") == "active", "89 s of silence is fewer than 3 missed beats"
    events = fleet.tick(300 + 90)
    assert fleet.status("qfox-1") == "offline"
    (event,) = events
    assert event.transition.status == "offline"
    assert "evacuate" in event.transition.reason and "90 s" in event.transition.reason
    assert fleet.states["qfox-1"].last_seen == at(300)


def test_a_relayed_node_gets_45_s_beats_before_it_is_offline():
    assert heartbeat_timeout(TIMING, relayed=False) == 90
    assert heartbeat_timeout(TIMING, relayed=True) == 135
    fleet = Fleet()
    fleet.beat("racknerd", 0, relayed=True)
    fleet.beat("lux", 0, relayed=False)
    fleet.tick(0)
    fleet.tick(100)
    assert fleet.status("lux") == "offline"
    assert fleet.status("racknerd") == "active", "a DERP-relayed path is slow, not silent"
    fleet.tick(134)
    assert fleet.status("racknerd") == "active"
    events = fleet.tick(135)
    assert fleet.status("racknerd") == "offline"
    assert "relayed path" in events[0].transition.reason


@pytest.mark.parametrize(
    "node_timeout_s, relayed_heartbeat_s, missed_beats, relayed_timeout",
    [
        (90, 45, 3, 135),  # 3 relayed beats outlast the node timeout
        (200, 45, 3, 200),  # a node timeout longer than 3 relayed beats still holds for a relayed node
        (90, 30, 3, 90),  # relayed beats no slower than the plain ones: the node timeout
    ],
    ids=["relayed beats longer", "node timeout longer", "equal"],
)
def test_a_relayed_nodes_timeout_is_never_shorter_than_the_node_timeout(node_timeout_s, relayed_heartbeat_s, missed_beats, relayed_timeout):
    timing = TimingSettings(node_timeout_s=node_timeout_s, relayed_heartbeat_s=relayed_heartbeat_s, missed_beats=missed_beats)
    assert heartbeat_timeout(timing, relayed=False) == node_timeout_s
    assert heartbeat_timeout(timing, relayed=True) == relayed_timeout
    fleet = Fleet(timing=timing)
    fleet.beat("racknerd", 0, relayed=True)
    fleet.beat("lux", 0)
    fleet.tick(0)
    fleet.tick(node_timeout_s - 1)
    assert fleet.status("racknerd") == fleet.status("lux") == "active"
    fleet.tick(relayed_timeout - 1)
    assert fleet.status("racknerd") == "active", "a relayed path is never judged sooner than a direct one"
    fleet.tick(relayed_timeout)
    assert fleet.status("racknerd") == "offline"


def test_offline_node_is_dead_after_the_drain_grace_then_forgotten():
    fleet = Fleet()
    fleet.beat("a1-arm64", 0)
    fleet.tick(0)
    fleet.tick(90)
    assert fleet.status("a1-arm64") == "offline"
    assert snapshot_node(fleet.states["a1-arm64"]).status == "offline", "an offline node still shows, with its tier"
    fleet.tick(90 + 299)
    assert fleet.status("a1-arm64") == "offline"
    events = fleet.tick(90 + 300)
    assert fleet.status("a1-arm64") == "dead"
    assert "garbage-collected" in events[0].transition.reason
    assert fleet.states["a1-arm64"].record is None and "a1-arm64" not in fleet.records
    assert snapshot_node(fleet.states["a1-arm64"]) is None
    # Dead for a second less than the drain grace: still remembered (its
    # transitions, its hold-off), nothing forgotten yet.
    events = fleet.tick(90 + 300 + 299)
    assert fleet.status("a1-arm64") == "dead" and not any(e.forget for e in events)
    events = fleet.tick(90 + 600)
    assert "a1-arm64" not in fleet.states
    assert [e.forget for e in events] == [True]


def test_a_dead_node_that_beats_again_is_active():
    fleet = Fleet()
    fleet.beat("x86-spill", 0)
    fleet.tick(0)
    fleet.tick(90)
    fleet.tick(400)
    assert fleet.status("x86-spill") == "dead"
    fleet.beat("x86-spill", 450)
    fleet.tick(450)
    assert fleet.status("x86-spill") == "active"
    assert fleet.states["x86-spill"].record is not None


def _flap_once(fleet: Fleet, node: str, t: float) -> float:
    """Offline at t + 90 (one toggle), back at t + 100 (another). Returns the time it came back."""
    fleet.tick(t + 90)
    assert fleet.status(node) == "offline"
    fleet.beat(node, t + 100)
    fleet.tick(t + 100)
    assert fleet.status(node) == "active"
    return t + 100


def test_three_toggles_within_the_window_hold_a_node_off_for_600_s():
    fleet = Fleet()
    fleet.beat("qfox-1", 0)
    fleet.tick(0)
    back = _flap_once(fleet, "qfox-1", 0)  # toggles at 90 and 100
    assert fleet.states["qfox-1"].held_off_until is None, "two toggles are not a flap"
    events = fleet.tick(back + 90)  # third toggle at 190, within 300 s of the first
    assert fleet.status("qfox-1") == "offline"
    held = fleet.states["qfox-1"].held_off_until
    assert held == at(190 + 600)
    assert any(e.transition.status == "held_off" and "3 toggles within 300 s" in e.transition.reason for e in events)
    # Back again: active, but no new placements until the hold-off ends.
    fleet.beat("qfox-1", 200)
    fleet.tick(200)
    node = snapshot_node(fleet.states["qfox-1"])
    assert node.status == "active" and node.held_off_until == at(790)
    for t in range(230, 790, 30):
        fleet.beat("qfox-1", t)
        fleet.tick(t)
        assert fleet.states["qfox-1"].held_off(at(t))
    fleet.beat("qfox-1", 790)
    events = fleet.tick(790)
    assert fleet.states["qfox-1"].held_off_until is None
    assert [e.transition.status for e in events] == ["released"]


def test_toggles_spread_wider_than_the_window_are_not_a_flap():
    fleet = Fleet()
    fleet.beat("qfox-1", 0)
    fleet.tick(0)
    fleet.tick(90)  # toggle 1
    fleet.beat("qfox-1", 250)
    fleet.tick(250)  # toggle 2
    fleet.tick(400)  # toggle 3 at 400: toggle 1 (at 90) left the 300 s window
    assert fleet.status("qfox-1") == "offline"
    assert fleet.states["qfox-1"].held_off_until is None


@pytest.mark.parametrize(
    "first_offline_at, held",
    [(91, True), (90, False)],
    ids=["3 toggles within 299 s: held off", "3 toggles exactly 300 s apart: not a flap"],
)
def test_the_flap_window_is_shorter_than_window_s(first_offline_at, held):
    """Toggles at first_offline_at (offline), 100 (back), 390 (offline): the
    window holds toggles younger than window_s, so one exactly 300 s old has left it."""
    fleet = Fleet()
    fleet.beat("qfox-1", 0)
    fleet.tick(0)
    fleet.tick(first_offline_at)  # toggle 1: its beat at 0 expired at 90
    assert fleet.status("qfox-1") == "offline"
    for t in range(100, 301, 50):  # toggle 2 at 100, then beats until 300
        fleet.beat("qfox-1", t)
        fleet.tick(t)
    assert fleet.status("qfox-1") == "active" and fleet.states["qfox-1"].held_off_until is None
    events = fleet.tick(390)  # toggle 3: the beat at 300 expired
    assert fleet.status("qfox-1") == "offline"
    assert (fleet.states["qfox-1"].held_off_until == at(390 + 600)) is held
    assert any(e.transition.status == "held_off" for e in events) is held


def test_flap_settings_are_honoured():
    fleet = Fleet(flap=FlapSettings(window_s=60, toggles=2, hold_off_s=30))
    fleet.beat("lux", 0)
    fleet.tick(0)
    fleet.tick(90)
    fleet.beat("lux", 100)
    fleet.tick(100)  # 2 toggles within 60 s
    assert fleet.states["lux"].held_off_until == at(130)


def test_drain_with_grace_stops_new_work_at_once_and_moves_work_off_after_the_grace():
    fleet = Fleet()
    fleet.beat("qfox-1", 0)
    fleet.tick(0)
    fleet.drain("qfox-1", 10, grace=60)
    events = fleet.tick(10)
    state = fleet.states["qfox-1"]
    assert state.status == "draining" and not state.drained
    assert [e.transition.status for e in events] == ["drain", "draining"]
    fleet.beat("qfox-1", 40)
    fleet.tick(69)
    assert not fleet.states["qfox-1"].drained, "its work stays during the grace"
    events = fleet.tick(70)
    assert fleet.states["qfox-1"].drained and fleet.status("qfox-1") == "draining"
    assert "grace of 60 s over" in events[0].transition.reason
    assert snapshot_node(fleet.states["qfox-1"]).drained
    fleet.undrain("qfox-1")
    events = fleet.tick(71)
    state = fleet.states["qfox-1"]
    assert state.status == "active" and not state.drained and state.drain is None
    assert [e.transition.status for e in events] == ["undrain", "active"]


def test_drain_without_grace_is_drained_at_once():
    fleet = Fleet()
    fleet.beat("lux", 0)
    fleet.tick(0)
    fleet.drain("lux", 5, grace=0)
    fleet.tick(5)
    assert fleet.states["lux"].drained


def test_a_drained_node_that_goes_offline_and_returns_is_still_draining():
    fleet = Fleet()
    fleet.beat("lux", 0)
    fleet.tick(0)
    fleet.drain("lux", 1, grace=0)
    fleet.tick(1)
    fleet.tick(90)
    assert fleet.status("lux") == "offline"
    fleet.beat("lux", 100)
    fleet.tick(100)
    assert fleet.status("lux") == "draining" and fleet.states["lux"].drained


def test_transitions_keep_time_and_reason_and_are_bounded():
    fleet = Fleet(flap=FlapSettings(window_s=1, toggles=100, hold_off_s=1))
    fleet.beat("lux", 0)
    fleet.tick(0)
    t = 0
    for _ in range(HISTORY):
        t = _flap_once(fleet, "lux", t)
    transitions = fleet.states["lux"].transitions
    assert len(transitions) == HISTORY
    assert transitions[-1].at == at(t) and transitions[-1].reason.startswith("heartbeat again")
    assert all(a.at <= b.at for a, b in pairwise(transitions))


def test_a_node_the_registry_saw_but_the_lifecycle_never_did_shows_offline():
    fleet = Fleet()
    fleet.beat("x86-spill", 0)
    fleet.tick(200)
    assert fleet.status("x86-spill") == "offline"
    assert fleet.states["x86-spill"].since == at(90), "it went offline when its last beat expired"
    fleet.tick(390)
    assert fleet.status("x86-spill") == "dead", "and is dead 300 s after that"


def test_snapshot_node_carries_the_facts_and_the_lifecycle():
    fleet = Fleet()
    fleet.beat("qfox-1", 0, tier="gpu_cuda")
    fleet.tick(0)
    node = snapshot_node(fleet.states["qfox-1"])
    assert (node.node_id, node.tier, node.status, node.in_flight, node.max_concurrent_tasks) == ("qfox-1", "gpu_cuda", "active", 1, 4)
    assert node.last_seen == at(0) and node.held_off_until is None and not node.drained


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=40))
def test_a_node_that_never_misses_its_timeout_is_never_offline_or_held_off(steps):
    """Beats at arbitrary gaps shorter than the timeout: always active, never damped."""
    fleet = Fleet()
    t = 0
    fleet.beat("lux", t)
    fleet.tick(t)
    for gap in steps:
        gap = min(gap, 89)
        t += gap
        fleet.tick(t)
        fleet.beat("lux", t)
        fleet.tick(t)
        assert fleet.status("lux") == "active"
        assert fleet.states["lux"].held_off_until is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 400), st.booleans()), min_size=1, max_size=40))
def test_hold_off_only_follows_enough_toggles_within_the_window(steps):
    fleet = Fleet()
    t = 0
    fleet.beat("lux", 0)
    fleet.tick(0)
    toggles: list[float] = []
    for gap, beat in steps:
        t += gap
        before = fleet.status("lux")
        if beat:
            fleet.beat("lux", t)
        events = fleet.tick(t)
        if "lux" not in fleet.states:  # dead long enough to be forgotten
            break
        after = fleet.status("lux")
        if (before in ("active", "draining")) != (after in ("active", "draining")):
            toggles.append(t)
        if any(e.transition.status == "held_off" for e in events):
            recent = [x for x in toggles if t - x < FLAP.window_s]
            assert len(recent) >= FLAP.toggles
            toggles.clear()


# -- fencing ------------------------------------------------------------------


def plan(epoch: int, leader: str = "lux") -> FleetPlan:
    return FleetPlan(epoch=epoch, leader=leader, created=T0)


def test_a_host_applies_a_plan_only_if_it_is_not_older_than_the_newest_applied():
    assert accept_plan(None, plan(1)).accepted
    assert accept_plan(4, plan(5)).accepted
    assert accept_plan(5, plan(5)).accepted, "the plan already applied may be applied again"
    verdict = accept_plan(6, plan(5))
    assert not verdict and "older than the newest applied (6)" in verdict.reason


def test_fencing_refuses_a_plan_from_a_host_that_is_not_a_leader_candidate():
    verdict = accept_plan(1, plan(9, leader="racknerd"), leader_candidates=["lux", "qfox-1"])
    assert not verdict.accepted and "not a leader candidate" in verdict.reason
    assert accept_plan(1, plan(9, leader="qfox-1"), leader_candidates=["lux", "qfox-1"]).accepted


def test_no_plan_is_not_accepted():
    assert not accept_plan(3, None).accepted


# -- what a registry stores, and the shortcut for a node that only beat --------

ACTIONS = st.lists(
    st.tuples(st.integers(1, 400), st.sampled_from(["a", "b", "c"]), st.sampled_from(["beat", "beat", "beat", "silent", "drain", "undrain"])),
    min_size=1,
    max_size=40,
)


def play(actions, *, stored_form: bool) -> list:
    """Every tick's states and events over `actions`. With `stored_form` the
    states are kept as the etcd registry keeps them (`stored_state`) and
    restored from the facts before each tick (`with_facts`), as its read does."""
    fleet = Fleet()
    seen = []
    t = 0
    for gap, node, action in actions:
        t += gap
        if action == "beat":
            fleet.beat(node, t)
        elif action == "drain":
            fleet.drain(node, t, grace=gap % 3 * 100)
        elif action == "undrain" and node in fleet.drains:
            fleet.undrain(node)
        if stored_form:
            fleet.states = {n: with_facts(stored_state(s), fleet.records.get(n)) for n, s in fleet.states.items()}
        events = fleet.tick(t)
        seen.append((dict(fleet.states), [str(e) for e in events]))
    return seen


@settings(max_examples=150, deadline=None)
@given(ACTIONS)
def test_a_state_stored_without_its_facts_comes_back_whole(actions):
    """The etcd registry stores a state without its record and an up node's
    last_seen (so a beat alone rewrites nothing); restored from the facts, the
    lifecycle goes exactly as with the whole state kept."""
    assert play(actions, stored_form=True) == play(actions, stored_form=False)


@settings(max_examples=150, deadline=None)
@given(ACTIONS)
def test_the_shortcut_for_a_node_that_only_beat_decides_as_the_general_path(actions):
    with patch.object(lifecycle, "_settled", lambda state: False):
        general = play(actions, stored_form=False)
    assert play(actions, stored_form=False) == general


@settings(max_examples=150, deadline=None)
@given(ACTIONS)
def test_the_shortcut_for_a_node_that_joins_decides_as_the_general_path(actions):
    with patch.object(lifecycle, "_joins_undrained", lambda is_alive, drain: False):
        general = play(actions, stored_form=False)
    assert play(actions, stored_form=False) == general


def test_a_beat_alone_changes_no_stored_state():
    fleet = Fleet()
    fleet.beat("lux", 0)
    fleet.tick(0)
    before = stored_state(fleet.states["lux"])
    fleet.beat("lux", 30)
    fleet.tick(30)
    assert fleet.states["lux"].last_seen == at(30)
    assert stored_state(fleet.states["lux"]) == before


def _revalidated(model):
    """`model` parsed again from its own fields, with every validation."""
    return type(model).model_validate(model.model_dump())


def test_states_and_snapshot_nodes_built_without_validation_equal_validated_ones():
    """observe, with_facts, stored_state and snapshot_node build their models
    unvalidated (`trusted`, `updated`): each must be exactly what validating
    the same fields gives (types included: a tuple stays a tuple)."""
    fleet = Fleet()
    fleet.beat("qfox-1", 0, tier="gpu_cuda")
    fleet.beat("x86-spill", 0)
    fleet.tick(0)
    fleet.beat("qfox-1", 30, tier="gpu_cuda")
    fleet.tick(200)  # x86-spill new to nothing, silent: offline; qfox-1 beat again
    fleet.beat("lux", 200)
    fleet.tick(200)  # lux new and alive
    for state in fleet.states.values():
        assert _revalidated(state) == state
        stored = stored_state(state)
        assert _revalidated(stored) == stored
        back = with_facts(stored, state.record)
        assert _revalidated(back) == back == state
        node = snapshot_node(state)
        assert node is not None and _revalidated(node) == node


def test_a_model_built_unvalidated_must_name_every_field():
    node = snapshot_node(NodeState(node_id="qfox-1", status="active", since=T0, record=NodeRecord(node_id="qfox-1", tier="gpu_cuda")))
    assert node is not None
    values = dict(node.__dict__)
    del values["labels"]
    with pytest.raises(ValueError, match="labels"):
        lifecycle.trusted(SnapshotNode, values)
    with pytest.raises(ValueError, match="colour"):
        lifecycle.trusted(SnapshotNode, {**node.__dict__, "colour": "red"})


def test_the_next_lapse_is_the_first_up_nodes_last_beat_plus_its_timeout():
    fleet = Fleet()
    fleet.beat("qfox-1", 0)
    fleet.beat("lux", 10)
    fleet.beat("racknerd", 5, relayed=True)  # 135 s: a relayed node's longer timeout
    fleet.tick(10)
    assert lifecycle.next_lapse(fleet.states.values()) == at(90), "qfox-1's: beat at 0 s, 90 s timeout"
    fleet.beat("qfox-1", 40)
    fleet.tick(40)
    assert lifecycle.next_lapse(fleet.states.values()) == at(100), "lux's now: qfox-1's beat moved its lapse"
    fleet.tick(100)  # lux lapsed at 100 s (it is offline: no lapse of its own any more)
    assert fleet.status("lux") == "offline"
    assert lifecycle.next_lapse(fleet.states.values()) == at(130)
    fleet.drain("qfox-1", 100, grace=0)
    fleet.tick(101)
    assert fleet.status("qfox-1") == "draining"
    assert lifecycle.next_lapse(fleet.states.values()) == at(130), "a draining node is still up: its lapse counts"
    assert lifecycle.next_lapse([]) is None


def test_a_beat_is_alive_before_its_expiry_and_lapsed_from_it_and_an_unstamped_one_is_neither():
    fleet = Fleet()
    fleet.beat("qfox-1", 0)  # expires at 90 s
    fleet.beat("racknerd", 0, relayed=True)  # 135 s
    unstamped = {"lux": NodeRecord(node_id="lux", tier="cpu_ffmpeg")}
    records = {**fleet.records, **unstamped}
    assert (alive_at(records, at(89.9)), lifecycle.lapsed_at(records, at(89.9))) == ({"qfox-1", "racknerd"}, set())
    assert (alive_at(records, at(90)), lifecycle.lapsed_at(records, at(90))) == ({"racknerd"}, {"qfox-1"})
    assert (alive_at(records, at(135)), lifecycle.lapsed_at(records, at(135))) == (set(), {"qfox-1", "racknerd"})
