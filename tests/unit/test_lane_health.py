"""Lane health and one account of capacity (reconciler.core.scheduling.lanes.lane_views), on the example fleet.

a1-arm64 (compute, rank 10, cap 2, pushed to host a1-arm64, limit 2),
x86-spill (compute, rank 20, cap 4, host x86-spill, limit 4), local (rank 99,
cap 1, follows the control host lux, limit 2; phaze runs it there, no agent). Every rule of the module
docstring has a case here; the property over random fleets is in
test_scheduler_properties.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import SchedulerSettings
from reconciler.core.live.models import LaneView, Placement, Snapshot, SnapshotLane, SnapshotNode
from reconciler.core.render.artifacts import Layout
from reconciler.core.scheduling.lanes import LaneDecision, LaneJob, agent_unit, choose_lane, free_slots, lane_views, take_slot
from reconciler.core.scheduling.placement import schedule
from tests.conftest import EXAMPLE_FLEET
from tests.support.render import files

NOW = datetime(2026, 11, 30, 4, 5, 0, tzinfo=UTC)
SETTINGS = SchedulerSettings(local_spill_after_s=900, cloud_attempts=3)
DESIRED = load_desired(EXAMPLE_FLEET)
LIMITS = {"qfox-1": 4, "a1-arm64": 2, "x86-spill": 4, "lux": 2, "racknerd": 1}


def node(host: str, **kw) -> SnapshotNode:
    values = {"node_id": host, "tier": "cpu_ffmpeg", "max_concurrent_tasks": LIMITS[host], "last_seen": NOW - timedelta(seconds=5), **kw}
    return SnapshotNode(**values)


def snapshot(changed: dict[str, dict] | None = None, lanes: dict[str, int] | None = None, placements=(), absent=()) -> Snapshot:
    """Every example host active, except the changes; `lanes`: jobs running per lane."""
    changed = changed or {}
    nodes = [node(h, **changed.get(h, {})) for h in LIMITS if h not in absent]
    return Snapshot(now=NOW, nodes=nodes, lanes=[SnapshotLane(id=k, in_flight=v) for k, v in (lanes or {}).items()], placements=list(placements))


def view(snap: Snapshot, lane: str) -> LaneView:
    return next(v for v in lane_views(DESIRED, snap) if v.id == lane)


def test_every_lane_online_when_its_host_is_active():
    views = lane_views(DESIRED, snapshot())
    assert [(v.id, v.available, v.reason, v.host, v.host_free) for v in views] == [
        ("a1-arm64", True, None, "a1-arm64", 2),
        ("x86-spill", True, None, "x86-spill", 4),
        ("local", True, None, "lux", 2),
    ]


HEALTH = [
    # (id, node changes, lane, reason)
    (
        "host offline",
        {"a1-arm64": {"status": "offline", "last_seen": datetime(2026, 11, 30, 4, 1, 12, tzinfo=UTC)}},
        "a1-arm64",
        "host a1-arm64 offline since 04:01:12",
    ),
    (
        "host dead",
        {"x86-spill": {"status": "dead", "last_seen": datetime(2026, 11, 30, 3, 0, 0, tzinfo=UTC)}},
        "x86-spill",
        "host x86-spill dead since 03:00:00",
    ),
    ("host draining", {"a1-arm64": {"status": "draining"}}, "a1-arm64", "host a1-arm64 draining"),
    ("host drained", {"a1-arm64": {"status": "draining", "drained": True}}, "a1-arm64", "host a1-arm64 drained"),
    (
        "host held off",
        {"x86-spill": {"held_off_until": NOW + timedelta(seconds=60)}},
        "x86-spill",
        "host x86-spill held off until 04:06:00 (flapping)",
    ),
    ("agent unit failed", {"a1-arm64": {"units": {"fabric-agent-a1-arm64.service": "failed"}}}, "a1-arm64", "fabric-agent-a1-arm64.service failed"),
    (
        "agent unit inactive",
        {"x86-spill": {"units": {"fabric-agent-x86-spill.service": "inactive"}}},
        "x86-spill",
        "fabric-agent-x86-spill.service inactive",
    ),
    (
        "local follows control: lux offline",
        {"lux": {"status": "offline", "last_seen": datetime(2026, 11, 30, 4, 0, 0, tzinfo=UTC)}},
        "local",
        "host lux offline since 04:00:00",
    ),
]


@pytest.mark.parametrize("changes, lane, reason", [r[1:] for r in HEALTH], ids=[r[0] for r in HEALTH])
def test_an_offline_lane_carries_its_reason(changes, lane, reason):
    seen = view(snapshot(changes), lane)
    assert (seen.available, seen.reason, free_slots(seen)) == (False, reason, 0)
    # Only that lane: the others stay online.
    others = [v for v in lane_views(DESIRED, snapshot(changes)) if v.id != lane]
    assert all(v.available for v in others)


def test_a_host_that_does_not_report_takes_its_lane_offline():
    seen = view(snapshot(absent=["a1-arm64"]), "a1-arm64")
    assert (seen.available, seen.reason, seen.host_free) == (False, "host a1-arm64 not reporting", None)


@pytest.mark.parametrize(
    "units",
    [
        {},  # a pass without activation says nothing about the agent
        {"fabric-agent-qbit.service": "active"},  # the agent's unit not listed: nothing said either
        {"fabric-agent-a1-arm64.service": "active"},
        {"fabric-agent-a1-arm64.service": "reloading"},
    ],
)
def test_only_an_explicit_non_active_agent_state_is_down(units):
    assert view(snapshot({"a1-arm64": {"units": units}}), "a1-arm64").available


def test_a_hold_off_that_ran_out_is_no_longer_one():
    assert view(snapshot({"x86-spill": {"held_off_until": NOW - timedelta(seconds=1)}}), "x86-spill").available


def test_the_reason_names_the_unit_the_renderer_writes_for_the_lane():
    # The renderer and lane health share agent_unit: the unit a1-arm64's host
    # gets for its lane is the one whose state lane health reads.
    for host in ("a1-arm64", "x86-spill"):
        texts = files(DESIRED, host, schedule(snapshot(), DESIRED))
        assert f"{Layout().unit_dir}/{agent_unit(host)}" in texts


def test_the_local_lane_has_no_agent_unit_of_the_fabrics_to_fail():
    # phaze's own processing on lux runs it: a unit named like an agent says nothing.
    assert view(snapshot({"lux": {"units": {agent_unit("local"): "failed"}}}), "local").available


def test_local_lane_offline_without_a_control_host():
    desired = DESIRED.model_copy(update={"hosts": {h: c for h, c in DESIRED.hosts.items() if h != "lux"}})
    seen = next(v for v in lane_views(desired, snapshot()) if v.id == "local")
    assert (seen.available, seen.reason) == (False, "no host has role control to run the local lane")


def test_every_compute_lane_offline_sends_a_job_to_local_at_once():
    off = {h: {"status": "offline"} for h in ("a1-arm64", "x86-spill")}
    views = lane_views(DESIRED, snapshot(off))
    assert choose_lane(views, LaneJob(), SETTINGS) == LaneDecision("local", None)
    # One compute host back: the spill gate applies again.
    back = lane_views(DESIRED, snapshot({"a1-arm64": {"status": "offline"}}))
    assert choose_lane(back, LaneJob(), SETTINGS) == LaneDecision("x86-spill", None)


def test_an_agent_failed_on_the_first_lane_sends_the_job_to_the_next():
    views = lane_views(DESIRED, snapshot({"a1-arm64": {"units": {"fabric-agent-a1-arm64.service": "failed"}}}))
    assert choose_lane(views, LaneJob(), SETTINGS).lane == "x86-spill"


# --------------------------------------------------------------------------
# One account of capacity


def placed(host: str, count: int) -> list[Placement]:
    return [Placement(service=f"s{i}", replica=0, node=host, tier="cpu_ffmpeg") for i in range(count)]


def test_full_by_cap():
    seen = view(snapshot(lanes={"a1-arm64": 2}, changed={"a1-arm64": {"in_flight": 2}}), "a1-arm64")
    assert (seen.available, seen.full, free_slots(seen), seen.reason) == (True, "cap", 0, None)


def test_full_by_host_when_services_fill_it():
    # x86-spill: cap 4, one job running; its host (limit 4) runs 3 services.
    seen = view(snapshot(lanes={"x86-spill": 1}, placements=placed("x86-spill", 3)), "x86-spill")
    assert (seen.full, seen.host_free, free_slots(seen), seen.reason) == ("host", 0, 0, None)
    views = lane_views(DESIRED, snapshot(lanes={"x86-spill": 1, "a1-arm64": 2}, placements=placed("x86-spill", 3)))
    # Cloud full one way or the other: the spill gate holds the job.
    assert choose_lane(views, LaneJob(), SETTINGS) == LaneDecision(None, "local_spill_not_reached")


def test_free_slots_are_the_smaller_of_cap_left_and_host_left():
    seen = view(snapshot(placements=placed("x86-spill", 1), lanes={"x86-spill": 1}), "x86-spill")
    # cap left 3, host left 4 - (1 service + 1 job) = 2
    assert (seen.host_free, free_slots(seen), seen.full) == (2, 2, None)


def test_lane_jobs_in_the_nodes_in_flight_are_not_counted_twice():
    # The node measured 2 = its 2 lane jobs; the registry counts the same 2.
    seen = view(snapshot({"x86-spill": {"in_flight": 2}}, lanes={"x86-spill": 2}), "x86-spill")
    assert (seen.host_free, free_slots(seen)) == (2, 2)
    # A measured load the plan does not know (a service not yet stopped) counts.
    busier = view(snapshot({"x86-spill": {"in_flight": 3}}, lanes={"x86-spill": 2}), "x86-spill")
    assert busier.host_free == 1


def test_the_scheduler_counts_lane_jobs_against_the_host():
    # a1-arm64 (limit 2) runs 2 lane jobs and reports them: no service goes there.
    snap = snapshot({"a1-arm64": {"in_flight": 2, "arch": "aarch64"}}, lanes={"a1-arm64": 2})
    plan = schedule(snap, DESIRED)
    assert "a1-arm64" not in {p.node for p in plan.placements}
    # ... nor when its beat predates the jobs (in_flight 0): the registry's claims count.
    plan = schedule(snapshot({"a1-arm64": {"arch": "aarch64"}}, lanes={"a1-arm64": 2}), DESIRED)
    assert "a1-arm64" not in {p.node for p in plan.placements}
    # Only a1-arm64 up, one job running: one service goes there, and the
    # plan's lane view says the host is full (its cap is not).
    only_a1 = {h: {"status": "offline"} for h in LIMITS if h != "a1-arm64"} | {"a1-arm64": {"arch": "aarch64"}}
    plan = schedule(snapshot(only_a1, lanes={"a1-arm64": 1}), DESIRED)
    assert sum(p.node == "a1-arm64" for p in plan.placements) == 1
    lane = next(v for v in plan.lanes if v.id == "a1-arm64")
    assert (lane.in_flight, lane.full, free_slots(lane)) == (1, "host", 0)


def test_a_kept_service_moves_when_lane_jobs_fill_its_host():
    # Three services in force on x86-spill (limit 4) while its lane runs two
    # jobs: two services stay (in (service, replica) order), the third moves.
    old = [Placement(service=s, replica=0, node="x86-spill", tier="cpu_ffmpeg") for s in ("braid", "flac-fft", "vaapi-encode")]
    plan = schedule(snapshot({"x86-spill": {"arch": "x86_64"}}, lanes={"x86-spill": 2}, placements=old), DESIRED)
    on_x86 = sorted(p.service for p in plan.placements if p.node == "x86-spill")
    assert on_x86 == ["braid", "flac-fft"]
    assert any(p.service == "vaapi-encode" for p in plan.placements)


def test_a_started_job_shrinks_its_hosts_capacity_for_every_lane_there():
    views = [
        LaneView(id="a", kind="compute", rank=10, cap=4, in_flight=0, available=True, host="h", host_free=2),
        LaneView(id="b", kind="compute", rank=20, cap=4, in_flight=0, available=True, host="h", host_free=2),
        LaneView(id="c", kind="compute", rank=30, cap=4, in_flight=0, available=True, host="g", host_free=2),
    ]
    after = take_slot(take_slot(views, "a"), "a")
    assert [(v.id, v.in_flight, v.host_free, v.full) for v in after] == [("a", 2, 0, "host"), ("b", 0, 0, "host"), ("c", 0, 2, None)]
    assert choose_lane(after, LaneJob(), SETTINGS).lane == "c"


def test_a_leader_without_a_plan_in_force_does_not_count_a_hosts_own_services_twice():
    """After a forged plan a new leader schedules with no placements in force:
    qfox-1 (limit 4) runs its four services and says so (services_running).
    Those are the scheduler's own placements, counted as it places them, so
    the plan is the one it makes for an idle qfox-1; without that split the
    record's in_flight alone fills qfox-1 and its work would move off it."""
    cuda = {"tier": "gpu_cuda", "arch": "x86_64"}
    idle = schedule(snapshot({"qfox-1": cuda}), DESIRED)
    busy = schedule(snapshot({"qfox-1": {**cuda, "in_flight": 4, "services_running": 4}}), DESIRED)
    placed = sorted((p.service, p.node) for p in busy.placements)
    assert placed == sorted((p.service, p.node) for p in idle.placements)
    assert ("lupine", "qfox-1") in placed
    # Unsaid (a hand-written record): the reported in_flight is work the
    # scheduler does not know, and qfox-1 takes nothing more.
    unsaid = schedule(snapshot({"qfox-1": {**cuda, "in_flight": 4}}), DESIRED)
    assert "qfox-1" not in {p.node for p in unsaid.placements}


def test_the_rest_of_a_hosts_in_flight_is_its_lane_jobs_counted_by_the_claims_now():
    # x86-spill (limit 4) runs one service and two lane jobs: 3 in flight. Its
    # lane's room is the limit less the two jobs and the services placed
    # there, not less the running service a second time.
    node = {"x86-spill": {"in_flight": 3, "services_running": 1}}
    placed = [Placement(service="braid", replica=0, node="x86-spill", tier="cpu_ffmpeg")]
    seen = view(snapshot(node, lanes={"x86-spill": 2}, placements=placed), "x86-spill")
    assert seen.host_free == 1
    # Both jobs finished since the beat: their slots are free at once, not at
    # the host's next pass (the node read its lane jobs from these claims).
    assert view(snapshot(node, lanes={}, placements=placed), "x86-spill").host_free == 3
