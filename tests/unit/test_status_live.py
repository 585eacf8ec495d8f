"""The status as a live view: lane cards with their reason and full account,
lowered limits on a node, the timeline of recent events, the pass interval.

Lifecycle transitions come from the real `lifecycle.observe` (the registry's
own history), so the timeline reads the words the lifecycle writes. Lane
views are built by hand: `lane_views` is what dispatch reads, and the cards
must show whatever it says.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState, FlapSettings, TimingSettings
from reconciler.core.live.models import FleetPlan, LaneView, Snapshot, SnapshotLane, SnapshotNode
from reconciler.core.live.records import LeaderInfo, NodeRecord, ScalingAudit, ScalingRecord
from reconciler.core.scheduling.lifecycle import alive_at, heartbeat_timeout, observe
from reconciler.core.views import cards
from reconciler.core.views.cards import fleet_status, lane_card_line, render_text, status_document
from reconciler.core.views.page import render_status_page
from reconciler.core.views.timeline import TIMELINE_LENGTH, FleetHistory, timeline
from tests.conftest import EXAMPLE_FLEET

T0 = datetime(2026, 11, 29, 18, 0, tzinfo=UTC)
TIMING = TimingSettings()  # 30 s beats, 90 s timeout
FLAP = FlapSettings()  # 3 toggles in 300 s -> held off 600 s


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture(scope="module")
def desired() -> DesiredState:
    return load_desired(EXAMPLE_FLEET)


class Lifecycle:
    """The registry's lifecycle memory, advanced by the real `observe`."""

    def __init__(self) -> None:
        self.states: dict = {}
        self.records: dict[str, NodeRecord] = {}

    def beat(self, node: str, t: float) -> None:
        self.records[node] = NodeRecord(node_id=node, tier="cpu_ffmpeg", beat_at=at(t), timeout_s=heartbeat_timeout(TIMING, False))

    def tick(self, t: float) -> None:
        self.states, _ = observe(self.states, self.records, alive_at(self.records, at(t)), {}, at(t), TIMING, FLAP)

    def history(self, **kw: object) -> FleetHistory:
        return FleetHistory(nodes=tuple(self.states.values()), **kw)  # type: ignore[arg-type]


def node_loss() -> Lifecycle:
    """lux and a1-arm64 join at 0; a1-arm64 stops beating and is lost at 120."""
    fleet = Lifecycle()
    for node in ("lux", "a1-arm64"):
        fleet.beat(node, 0)
    fleet.tick(0)
    fleet.beat("lux", 60)
    fleet.beat("lux", 120)
    fleet.tick(120)
    return fleet


# --------------------------------------------------------------------------
# The timeline


def test_timeline_is_newest_first_across_nodes_leader_plan_and_hook_runs():
    fleet = node_loss()
    scaling = ScalingRecord(
        recent=[
            ScalingAudit(at=at(30), kind="run_cloud_hook", reason="queue depth 12 > 8", tier="BATCH", outcome="ran, exit 0"),
            # Not a hook run: left to `fabric lane status`.
            ScalingAudit(at=at(40), kind="scale_down", reason="idle 900 s", node="lux", outcome="lux max_concurrent_tasks 2 -> 1"),
        ]
    )
    leader = LeaderInfo(candidate="lux", epoch=3, since=at(5), token="t")
    plan = FleetPlan(epoch=4, leader="lux", created=at(10))

    events = timeline(fleet.history(leader=leader, scaling=scaling), plan)

    assert [(e.kind, e.title) for e in events] == [
        ("node_lost", "a1-arm64 lost"),
        ("hook", "BATCH cloud hook ran, exit 0"),
        ("plan", "plan epoch 4"),
        ("leader", "lux leads"),
        # Same instant: by kind, then subject.
        ("node_joined", "a1-arm64 joined"),
        ("node_joined", "lux joined"),
    ]
    assert [e.at for e in events] == sorted((e.at for e in events), reverse=True)
    lost = events[0]
    assert lost.at == at(120) and lost.at.tzinfo == UTC
    assert lost.detail.startswith("no heartbeat for 90 s") and lost.detail.endswith(": evacuate")
    assert events[1].detail == "queue depth 12 > 8"
    assert events[2].detail == "published by lux: 0 placements, 0 deferred"


def test_timeline_keeps_only_the_newest_events():
    fleet = Lifecycle()
    fleet.beat("x86-spill", 0)
    fleet.tick(0)
    # Down and up every 200 s: lost, back, ..., and held off when it flaps.
    for cycle in range(10):
        fleet.tick(200 * cycle + 100)
        fleet.beat("x86-spill", 200 * cycle + 150)
        fleet.tick(200 * cycle + 150)
    every = timeline(fleet.history(), None, limit=1000)
    assert len(every) > TIMELINE_LENGTH

    shown = timeline(fleet.history(), None)

    assert len(shown) == TIMELINE_LENGTH
    assert shown == every[:TIMELINE_LENGTH]
    assert shown[0].at == max(e.at for e in every)
    assert timeline(fleet.history(), None, limit=3) == every[:3]


def test_timeline_names_the_lifecycles_transitions():
    fleet = Lifecycle()
    fleet.beat("x86-spill", 0)
    fleet.tick(0)
    # Three toggles within 300 s: lost, back, lost -> held off.
    fleet.tick(100)
    fleet.beat("x86-spill", 110)
    fleet.tick(110)
    fleet.tick(210)

    events = timeline(fleet.history(), None)

    assert [(e.kind, e.title, e.at) for e in events] == [
        # The third toggle and the hold-off it starts share an instant: by kind.
        ("held_off", "x86-spill held off (flapping)", at(210)),
        ("node_lost", "x86-spill lost", at(210)),
        ("node_back", "x86-spill back", at(110)),
        ("node_lost", "x86-spill lost", at(100)),
        ("node_joined", "x86-spill joined", at(0)),
    ]
    assert events[0].detail.startswith("3 toggles within 300 s: no new work until")


def test_a_refused_or_unpublished_plan_is_no_event():
    history = node_loss().history()

    assert "plan" not in {e.kind for e in timeline(history, None)}
    # The empty plan a pass renders from when nothing is published has no leader.
    assert "plan" not in {e.kind for e in timeline(history, FleetPlan(epoch=0, leader="", created=at(500)))}


def test_without_history_the_timeline_is_unknown_not_empty(desired):
    status = fleet_status(desired, Snapshot(now=at(200)), None, at(200))
    known = fleet_status(desired, Snapshot(now=at(200)), None, at(200), history=FleetHistory())

    assert (status.timeline_known, known.timeline_known) == (False, True)
    assert status_document(status)["timeline"] is None
    assert status_document(known)["timeline"] == []
    assert "RECENT" not in render_text(status)
    assert "RECENT · newest first, times in UTC\n  (nothing recorded)" in render_text(known)
    assert "no registry history (a saved snapshot)" in render_status_page(desired, Snapshot(now=at(200)), None, at(200))


def test_the_timeline_on_every_surface(desired):
    history = node_loss().history()
    status = fleet_status(desired, Snapshot(now=at(200)), None, at(200), history=history)

    text = render_text(status)
    doc = json.loads(json.dumps(status_document(status)))
    page = render_status_page(desired, Snapshot(now=at(200)), None, at(200), history=history)

    assert "  18:02:00  a1-arm64 lost  no heartbeat for 90 s" in text
    (lost,) = [state.transitions[-1] for state in history.nodes if state.node_id == "a1-arm64"]
    assert doc["timeline"][0] == {
        "at": "2026-11-29T18:02:00+00:00",
        "kind": "node_lost",
        "subject": "a1-arm64",
        "title": "a1-arm64 lost",
        "detail": lost.reason,
    }
    items = re.findall(r'<li class="([a-z_]+)" data-kind="[a-z_]+"><time datetime="([^"]+)">([^<]+)</time> <span class="what">([^<]+)</span>', page)
    assert items[0] == ("node_lost", "2026-11-29T18:02:00+00:00", "18:02:00", "a1-arm64 lost")
    assert [i[3] for i in items] == [e.title for e in status.timeline]


def test_an_event_of_another_day_shows_its_date(desired):
    history = node_loss().history()

    text = render_text(fleet_status(desired, Snapshot(now=at(86_400)), None, at(86_400), history=history))

    assert "  2026-11-29 18:02:00  a1-arm64 lost" in text


# --------------------------------------------------------------------------
# Lane cards: what dispatch's lane view says


def hand_built(views: list[LaneView]):
    def lane_views(desired: DesiredState, snapshot: Snapshot, placements=None) -> list[LaneView]:
        return views

    return lane_views


SPILL_OFFLINE = LaneView(id="x86-spill", kind="compute", rank=20, cap=4, in_flight=0, available=False, reason="host x86-spill offline since 04:01:12")
ARM_HOST_FULL = LaneView(id="a1-arm64", kind="compute", rank=10, cap=2, in_flight=1, available=True, full="host", host="a1-arm64")
LOCAL_CAP_FULL = LaneView(id="local", kind="local", rank=99, cap=1, in_flight=1, available=True, full="cap")


def test_lane_cards_show_the_offline_reason_and_which_account_is_full(desired, monkeypatch):
    monkeypatch.setattr(cards, "lane_views", hand_built([ARM_HOST_FULL, SPILL_OFFLINE, LOCAL_CAP_FULL]))

    status = fleet_status(desired, Snapshot(now=T0), None, T0)

    assert [lane_card_line(c) for c in status.lanes] == [
        "● COMPUTE · a1-arm64  RANK 10  1/2  full: host a1-arm64 at capacity",
        "○ COMPUTE · x86-spill  RANK 20  0/4  offline: host x86-spill offline since 04:01:12",
        "● LOCAL · local  RANK 99  1/1  full: lane cap 1/1",
    ]
    doc = status_document(status)["lanes"]
    assert [(d["id"], d["state"], d["reason"], d["full"]) for d in doc] == [
        ("a1-arm64", "full", None, "host"),
        ("x86-spill", "offline", "host x86-spill offline since 04:01:12", None),
        ("local", "full", None, "cap"),
    ]


def test_the_page_greys_the_offline_lane_alone_with_its_reason_and_marks_the_full_ones(desired, monkeypatch):
    monkeypatch.setattr(cards, "lane_views", hand_built([ARM_HOST_FULL, SPILL_OFFLINE, LOCAL_CAP_FULL]))

    page = render_status_page(desired, Snapshot(now=T0), None, T0)

    articles = re.findall(r'<article class="([^"]+)" data-lane="([^"]+)" data-state="([^"]+)"(?: data-full="([^"]+)")?>(.*?)</article>', page, re.S)
    assert [(a[0], a[1], a[2], a[3]) for a in articles] == [
        ("card full", "a1-arm64", "online", "host"),
        ("card offline", "x86-spill", "offline", ""),
        ("card full", "local", "online", "cap"),
    ]
    body = {a[1]: a[4] for a in articles}
    assert '<div class="state">offline</div>' in body["x86-spill"]
    assert '<p class="reason">host x86-spill offline since 04:01:12</p>' in body["x86-spill"]
    assert '<div class="state">full: host a1-arm64 at capacity</div>' in body["a1-arm64"]
    assert '<div class="state">full: lane cap 1/1</div>' in body["local"]


def test_lane_cards_are_the_lane_view_dispatch_reads(desired):
    # Without a hand-built view: lane_views of the snapshot (x86-spill's host offline).
    hosts = [SnapshotNode(node_id=h, tier="cpu_ffmpeg", max_concurrent_tasks=4, last_seen=T0) for h in ("a1-arm64", "lux")]
    spill = SnapshotNode(node_id="x86-spill", tier="cpu_ffmpeg", status="offline", last_seen=T0)
    snapshot = Snapshot(now=T0, nodes=[*hosts, spill], lanes=[SnapshotLane(id="x86-spill")])
    plan = FleetPlan(epoch=1, leader="lux", created=T0, lanes=[SPILL_OFFLINE.model_copy(update={"available": True, "reason": None})])

    (card,) = [c for c in fleet_status(desired, snapshot, plan, T0).lanes if c.id == "x86-spill"]

    # The snapshot's view wins over the plan's older copy.
    assert (card.available, card.state, card.reason) == (False, "offline", f"host x86-spill offline since {T0.strftime('%H:%M:%S')}")


# --------------------------------------------------------------------------
# Nodes: real load and lowered limits


LOWERED = "max_concurrent_tasks 4 lowered to 2 by the probe"


def test_a_node_shows_its_reported_load_and_each_limit_the_probe_lowered(desired):
    node = SnapshotNode(node_id="x86-spill", tier="cpu_ffmpeg", in_flight=1, max_concurrent_tasks=2, lowered_limits=[LOWERED], last_seen=T0)
    status = fleet_status(desired, Snapshot(now=T0, nodes=[node]), None, T0)
    (row,) = [r for r in status.nodes if r.node_id == "x86-spill"]

    assert row.load == "1/2 50%"
    assert row.note == LOWERED
    assert status_document(status)["nodes"][-1]["lowered_limits"] == [LOWERED]
    page = render_status_page(desired, Snapshot(now=T0, nodes=[node]), None, T0)
    assert f'<td data-label="Note" class="status-held"><span class="lowered">{LOWERED}</span></td>' in page
    assert (
        '<td data-label="Load" class="num load"><span>1/2 50%<span class="meter" aria-hidden="true"><span style="width: 50%"></span></span></span></td>'
        in page
    )


def test_the_lowered_limit_follows_the_status_note(desired):
    node = SnapshotNode(node_id="lux", tier="cpu_ffmpeg", status="draining", lowered_limits=[LOWERED, "ceiling 8 lowered to 3 by the probe"])
    (row,) = [r for r in fleet_status(desired, Snapshot(now=T0, nodes=[node]), None, T0).nodes if r.node_id == "lux"]

    assert row.note == f"draining, {LOWERED}, ceiling 8 lowered to 3 by the probe"


# --------------------------------------------------------------------------
# Refresh and age


def test_the_page_reloads_every_pass_interval_of_the_desired_state(desired):
    slower = desired.model_copy(
        update={"fleet": desired.fleet.model_copy(update={"timing": desired.fleet.timing.model_copy(update={"heartbeat_s": 40})})}
    )

    page = render_status_page(slower, Snapshot(now=T0), None, T0)

    assert fleet_status(slower, Snapshot(now=T0), None, T0).pass_interval_s == 40
    assert '<meta http-equiv="refresh" content="40">' in page
    assert "refreshes every 40 s" in page
    # Stale once older than a memoized edge may leave it (node timeout) plus one reload.
    assert fleet_status(slower, Snapshot(now=T0), None, T0).stale_after_s == 90 + 40
    assert 'data-stale-after-s="130"' in page


def test_the_page_says_when_it_was_generated_without_script(desired):
    page = render_status_page(desired, Snapshot(now=T0), None, T0)
    without_script = re.sub(r"<script>.*?</script>", "", page, flags=re.S)

    assert 'generated <time id="generated" datetime="2026-11-29T18:00:00+00:00">2026-11-29 18:00:00 UTC</time>' in without_script


# --------------------------------------------------------------------------
# Escaping: names and reasons come from the registry


HOSTILE = '<img src=x onerror="alert(1)">'
ESCAPED = "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;"


def test_reasons_limits_and_events_from_the_registry_are_escaped(desired, monkeypatch):
    monkeypatch.setattr(cards, "lane_views", hand_built([ARM_HOST_FULL, SPILL_OFFLINE.model_copy(update={"reason": HOSTILE}), LOCAL_CAP_FULL]))
    node = SnapshotNode(node_id="lux", tier="cpu_ffmpeg", lowered_limits=[HOSTILE])
    scaling = ScalingRecord(recent=[ScalingAudit(at=T0, kind="run_cloud_hook", reason=HOSTILE, tier="BATCH", outcome=HOSTILE)])
    plan = FleetPlan(epoch=2, leader=HOSTILE, created=T0)

    page = render_status_page(desired, Snapshot(now=T0, nodes=[node]), plan, T0, history=FleetHistory(scaling=scaling))

    assert HOSTILE not in page
    # The lane reason, the lowered limit, the hook's title and detail, the plan's publisher.
    assert page.count(ESCAPED) >= 5
