"""fabric status's view: lane cards in multi-compute.md's words, nodes, deferred work.

The seed's three lanes (hosts/fabric.toml): a1-arm64 rank 10 cap 2, x86-spill
rank 20 cap 4, local rank 99 cap 1. A lane is as healthy as its agent host
(reconciler.core.scheduling.lanes): in the fixture snapshot x86-spill's host is
held off (flapping) and lux, the control host the local lane follows, is
drained, so both lanes are offline; a1-arm64 runs one job.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import Deferred, FleetPlan, LaneView, Snapshot, SnapshotLane, SnapshotNode
from reconciler.core.views.cards import (
    fleet_status,
    format_duration,
    lane_card_line,
    render_text,
    status_document,
)
from tests.conftest import EXAMPLE_FLEET, REPO

FIXTURES = REPO / "tests" / "fixtures" / "status"
NOW = datetime(2026, 11, 29, 18, 30, tzinfo=UTC)


@pytest.fixture(scope="module")
def desired() -> DesiredState:
    return load_desired(EXAMPLE_FLEET)


@pytest.fixture(scope="module")
def snapshot() -> Snapshot:
    return Snapshot.model_validate_json((FIXTURES / "snapshot.json").read_text())


@pytest.fixture(scope="module")
def plan() -> FleetPlan:
    return FleetPlan.model_validate_json((FIXTURES / "plan.json").read_text())


def lanes_block(text: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index("LANES") + 1
    return lines[start : lines.index("", start)]


def hosts_up(*changes: tuple[str, dict]) -> list[SnapshotNode]:
    """The lanes' agent hosts, active (limit 8), with `changes` per host."""
    changed = dict(changes)
    return [
        SnapshotNode(node_id=h, tier="cpu_ffmpeg", max_concurrent_tasks=8, last_seen=NOW, **changed.get(h, {}))
        for h in ("a1-arm64", "x86-spill", "lux")
    ]


def with_backends(desired: DesiredState, backends: list) -> DesiredState:
    return desired.model_copy(update={"fleet": desired.fleet.model_copy(update={"lanes": backends})})


# --------------------------------------------------------------------------
# Lane cards


def test_seed_lanes_read_as_multi_compute_describes_them_with_one_offline(desired, snapshot, plan):
    text = render_text(fleet_status(desired, snapshot, plan, NOW))

    assert lanes_block(text) == [
        "● COMPUTE · a1-arm64  RANK 10  1/2  full: host a1-arm64 at capacity",
        "○ COMPUTE · x86-spill  RANK 20  0/4  offline: host x86-spill held off until 18:38:20 (flapping)",
        "○ LOCAL · local  RANK 99  0/1  offline: host lux drained",
    ]


def test_every_lane_online_shows_no_offline_word(desired):
    snapshot = Snapshot(
        now=NOW,
        nodes=hosts_up(),
        lanes=[
            SnapshotLane(id="a1-arm64", in_flight=2),
            SnapshotLane(id="x86-spill", in_flight=3),
            SnapshotLane(id="local", in_flight=0),
        ],
    )
    text = render_text(fleet_status(desired, snapshot, None, NOW))

    assert lanes_block(text) == [
        "● COMPUTE · a1-arm64  RANK 10  2/2  full: lane cap 2/2",
        "● COMPUTE · x86-spill  RANK 20  3/4",
        "● LOCAL · local  RANK 99  0/1",
    ]


def test_an_offline_lane_greys_that_card_alone_with_its_reason(desired):
    failed = ("a1-arm64", {"units": {"fabric-agent-a1-arm64.service": "failed"}})
    snapshot = Snapshot(now=NOW, nodes=hosts_up(failed), lanes=[SnapshotLane(id="a1-arm64", in_flight=1)])
    cards = fleet_status(desired, snapshot, None, NOW).lanes

    assert [(c.id, c.available) for c in cards] == [("a1-arm64", False), ("x86-spill", True), ("local", True)]
    lines = [lane_card_line(c, color=True) for c in cards]
    assert lines[0] == "\x1b[90m○ COMPUTE · a1-arm64  RANK 10  1/2  offline: fabric-agent-a1-arm64.service failed\x1b[0m"
    # The other cards carry neither the grey nor the word.
    assert lines[1:] == ["● COMPUTE · x86-spill  RANK 20  0/4", "● LOCAL · local  RANK 99  0/1"]


def test_without_colour_there_is_no_escape_sequence(desired, snapshot, plan):
    text = render_text(fleet_status(desired, snapshot, plan, NOW), color=False)

    assert "\x1b" not in text
    assert "○ COMPUTE · x86-spill  RANK 20  0/4  offline: host x86-spill held off until 18:38:20 (flapping)" in text


def test_cards_are_sorted_rank_ascending_whatever_the_declaration_order(desired, snapshot):
    shuffled = with_backends(desired, list(reversed(desired.fleet.lanes)))

    cards = fleet_status(shuffled, snapshot, None, NOW).lanes

    assert [(c.id, c.rank) for c in cards] == [("a1-arm64", 10), ("x86-spill", 20), ("local", 99)]


def test_equal_ranks_order_by_utilization_then_id(desired):
    lanes = [b.model_copy(update={"rank": 10}) for b in desired.fleet.lanes[:2]]
    snapshot = Snapshot(now=NOW, nodes=hosts_up(), lanes=[SnapshotLane(id="a1-arm64", in_flight=2), SnapshotLane(id="x86-spill", in_flight=1)])

    cards = fleet_status(with_backends(desired, lanes), snapshot, None, NOW).lanes

    # x86-spill at 1/4 is less loaded than a1-arm64 at 2/2: it is tried first.
    assert [c.text for c in cards] == ["COMPUTE · x86-spill  RANK 10  1/4", "COMPUTE · a1-arm64  RANK 10  2/2  full: lane cap 2/2"]


def test_no_backends_declared_means_the_implicit_local_lane(desired):
    cards = fleet_status(with_backends(desired, []), Snapshot(now=NOW, nodes=hosts_up()), None, NOW).lanes

    assert [c.text for c in cards] == ["LOCAL · local  RANK 99  0/1"]


def test_the_snapshot_is_fresher_than_the_plans_lane_view(desired, snapshot, plan):
    # The plan was made while x86-spill was held off and lux drained; both are back now.
    back = [n.model_copy(update={"held_off_until": None, "drained": False}) for n in snapshot.nodes]
    now_online = snapshot.model_copy(update={"nodes": back})

    cards = fleet_status(desired, now_online, plan, NOW).lanes

    assert [c.available for c in cards] == [True, True, True]


def test_a_lane_whose_host_does_not_report_is_offline_whatever_the_plan_said(desired, plan):
    cards = fleet_status(desired, Snapshot(now=NOW), plan, NOW).lanes

    assert [c.text for c in cards] == [
        "COMPUTE · a1-arm64  RANK 10  0/2  offline: host a1-arm64 not reporting",
        "COMPUTE · x86-spill  RANK 20  0/4  offline: host x86-spill not reporting",
        "LOCAL · local  RANK 99  0/1  offline: host lux not reporting",
    ]


def test_a_lane_full_by_its_hosts_capacity_says_so(desired, snapshot, plan):
    # a1-arm64 (limit 2) runs braid#0 and one lane job: its host is full, its cap (2) is not.
    a1 = next(c for c in fleet_status(desired, snapshot, plan, NOW).lanes if c.id == "a1-arm64")

    assert (a1.available, a1.full, a1.reason, a1.state_line) == (True, "host", None, "full: host a1-arm64 at capacity")


def test_only_declared_lanes_are_shown(desired):
    snapshot = Snapshot(now=NOW, lanes=[SnapshotLane(id="rogue", in_flight=5)])
    plan = FleetPlan(
        epoch=1,
        leader="lux",
        created=NOW,
        lanes=[LaneView(id="rogue", kind="compute", rank=1, cap=9, in_flight=5, available=True)],
    )

    cards = fleet_status(desired, snapshot, plan, NOW).lanes

    assert [c.id for c in cards] == ["a1-arm64", "x86-spill", "local"]


# --------------------------------------------------------------------------
# Nodes, leader, epoch


def test_nodes_show_tier_status_load_last_seen_and_hold_off_or_drain(desired, snapshot, plan):
    rows = {r.node_id: r for r in fleet_status(desired, snapshot, plan, NOW).nodes}

    assert list(rows) == ["a1-arm64", "lux", "qfox-1", "racknerd", "x86-spill"]
    a1 = rows["a1-arm64"]
    assert (a1.tier, a1.status, a1.load, a1.seen, a1.note, a1.services) == (
        "cpu_ffmpeg",
        "active",
        "2/2 100%",
        "12s ago",
        "",
        ("braid#0",),
    )
    assert rows["x86-spill"].note == "held off 8m 20s"
    assert rows["lux"].note == "draining"
    # qfox-1 is declared in git but the registry never heard from it.
    assert (rows["qfox-1"].status, rows["qfox-1"].seen, rows["qfox-1"].load) == ("not reporting", "never", "-")


def test_a_hold_off_that_has_run_out_is_not_shown(desired):
    node = SnapshotNode(node_id="a1-arm64", tier="batch", held_off_until=NOW - timedelta(seconds=1), last_seen=NOW)

    row = next(r for r in fleet_status(desired, Snapshot(now=NOW, nodes=[node]), None, NOW).nodes if r.node_id == "a1-arm64")

    assert row.note == ""
    assert row.held_off_for_s is None


def test_a_node_git_does_not_declare_is_marked_ignored(desired):
    node = SnapshotNode(node_id="stranger", tier="gpu_cuda", last_seen=NOW)

    row = next(r for r in fleet_status(desired, Snapshot(now=NOW, nodes=[node]), None, NOW).nodes if r.node_id == "stranger")

    assert row.note == "not declared: ignored"


def test_headline_names_leader_and_plan_epoch(desired, snapshot, plan):
    assert fleet_status(desired, snapshot, plan, NOW).headline == ("researchstack · leader lux · plan epoch 7 · 2026-11-29 18:30:00 UTC")
    leaderless = Snapshot(now=NOW, epoch=0)
    assert fleet_status(desired, leaderless, None, NOW).headline.startswith("researchstack · no leader · plan epoch 0")


def test_naive_times_in_a_snapshot_are_read_as_utc(desired):
    node = SnapshotNode(node_id="lux", tier="batch", last_seen=datetime(2026, 11, 29, 18, 29, 0))

    row = next(r for r in fleet_status(desired, Snapshot(now=NOW, nodes=[node]), None, NOW).nodes if r.node_id == "lux")

    assert row.seen == "1m 0s ago"


# --------------------------------------------------------------------------
# Deferred work


def test_deferred_work_is_split_into_waiting_and_inadmissible_with_reasons(desired, snapshot, plan):
    text = render_text(fleet_status(desired, snapshot, plan, NOW))
    lines = text.splitlines()

    waiting = lines.index("DEFERRED · waiting for capacity (1)")
    assert lines[waiting + 1].startswith("  flac-fft#1  no eligible node from gpu_cuda..relay")
    inadmissible = lines.index("DEFERRED · inadmissible (1)")
    assert lines[inadmissible + 1].startswith("  lupine#0  inadmissible: no node in the fleet has tier gpu_cuda")


def test_without_a_plan_deferred_work_is_unknown_not_none(desired, snapshot):
    status = fleet_status(desired, snapshot, None, NOW)
    text = render_text(status)

    assert "(no plan: deferred work unknown)" in text
    assert "(none)" not in text
    assert status_document(status)["deferred"] == {"waiting": None, "inadmissible": None}


def test_an_empty_split_says_none(desired):
    plan = FleetPlan(
        epoch=3,
        leader="lux",
        created=NOW,
        deferred=[Deferred(service="lupine", replica=0, reason="no CUDA", inadmissible=True)],
    )
    lines = render_text(fleet_status(desired, Snapshot(now=NOW), plan, NOW)).splitlines()

    assert lines[lines.index("DEFERRED · waiting for capacity (0)") + 1] == "  (none)"
    assert lines[lines.index("DEFERRED · inadmissible (1)") + 1] == "  lupine#0  no CUDA"


# --------------------------------------------------------------------------
# The whole text and the JSON


def test_whole_text_of_the_fixture(desired, snapshot, plan):
    text = render_text(fleet_status(desired, snapshot, plan, NOW))

    assert text.splitlines()[:15] == [
        "researchstack · leader lux · plan epoch 7 · 2026-11-29 18:30:00 UTC",
        "",
        "LANES",
        "● COMPUTE · a1-arm64  RANK 10  1/2  full: host a1-arm64 at capacity",
        "○ COMPUTE · x86-spill  RANK 20  0/4  offline: host x86-spill held off until 18:38:20 (flapping)",
        "○ LOCAL · local  RANK 99  0/1  offline: host lux drained",
        "",
        "NODES",
        "NODE       TIER        COST   STATUS         LOAD      LAST SEEN  NOTE             SERVICES",
        # Each host's cost class is its host file's (a1-arm64 free, x86-spill paid), as placement takes it.
        "a1-arm64   cpu_ffmpeg  free   active         2/2 100%  12s ago                     braid#0",
        "lux        cpu_ffmpeg  owned  active         0/2 0%    20s ago    draining",
        "qfox-1     -           owned  not reporting  -         never",
        "racknerd   relay       owned  active         1/1 100%  3s ago                      flac-fft#0",
        "x86-spill  cpu_ffmpeg  paid   active         1/4 25%   5s ago     held off 8m 20s  vaapi-encode#0",
        "  paid capacity: 1/4 slots in use (x86-spill 1/4)",
    ]


def test_json_document_carries_cards_nodes_and_the_split(desired, snapshot, plan):
    doc = json.loads(json.dumps(status_document(fleet_status(desired, snapshot, plan, NOW))))

    assert (doc["version"], doc["leader"], doc["epoch"]) == (1, "lux", 7)
    assert [(lane["id"], lane["available"], lane["full"], lane["card"]) for lane in doc["lanes"]] == [
        ("a1-arm64", True, "host", "COMPUTE · a1-arm64  RANK 10  1/2  full: host a1-arm64 at capacity"),
        ("x86-spill", False, None, "COMPUTE · x86-spill  RANK 20  0/4  offline: host x86-spill held off until 18:38:20 (flapping)"),
        ("local", False, None, "LOCAL · local  RANK 99  0/1  offline: host lux drained"),
    ]
    x86 = next(n for n in doc["nodes"] if n["node"] == "x86-spill")
    assert x86["held_off_until"] == "2026-11-29T18:38:20+00:00"
    assert x86["utilization"] == 0.25
    assert [d["service"] for d in doc["deferred"]["waiting"]] == ["flac-fft"]
    assert [d["service"] for d in doc["deferred"]["inadmissible"]] == ["lupine"]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (59.9, "59s"), (60, "1m 0s"), (500, "8m 20s"), (3_600, "1h 0m"), (7_440, "2h 4m"), (90_000, "1d 1h")],
)
def test_durations_use_two_units_at_most(seconds, text):
    assert format_duration(seconds) == text


def test_fixture_files_are_the_example_fleet(snapshot, plan, desired):
    # Guard against the fixtures drifting from hosts/: every node is a declared host.
    assert {n.node_id for n in snapshot.nodes} <= set(desired.hosts)
    assert {lane.id for lane in plan.lanes} == {b.id for b in desired.lanes}
