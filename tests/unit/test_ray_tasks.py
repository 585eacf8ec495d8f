"""Placing a Ray task at call time, Ray's view in the leader's snapshot, Ray workers on idle capacity (core.scheduling.ray_tasks): pure rules."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from reconciler.core.live.models import Snapshot, SnapshotNode
from reconciler.core.render.ray_node import HOST_LABEL, RAY_WORKER_UNIT
from reconciler.core.scheduling.lanes import account_load
from reconciler.core.scheduling.ray_tasks import (
    FallbackCount,
    NodeAssignment,
    RayView,
    RayWorkerAction,
    Requirement,
    decide_ray_workers,
    ray_view,
    select_assignment,
    with_ray_view,
)

NOW = datetime(2026, 6, 1, 4, 0, tzinfo=UTC)


def node(node_id: str, tier: str, limit: int = 2, **kw: object) -> SnapshotNode:
    return SnapshotNode(node_id=node_id, tier=tier, max_concurrent_tasks=limit, **kw)  # type: ignore[arg-type]


FLEET = Snapshot(
    now=NOW,
    nodes=[node("qfox-1", "gpu_cuda", 4), node("lux", "cpu_ffmpeg", 2), node("a1-arm64", "cpu_ffmpeg", 1), node("racknerd", "relay", 1)],
)
ALL = {"qfox-1", "lux", "a1-arm64", "racknerd"}


def test_the_highest_satisfying_tier_takes_the_task():
    assert select_assignment(FLEET, Requirement(min_tier="gpu_apu"), ray_hosts=ALL) == NodeAssignment("assigned", "qfox-1", "gpu_cuda")


def test_within_a_tier_the_lowest_utilization_wins():
    busy = FLEET.model_copy(update={"nodes": [node("lux", "cpu_ffmpeg", 2, in_flight=1), node("a1-arm64", "cpu_ffmpeg", 1)]})
    assert select_assignment(busy, Requirement(min_tier="cpu_ffmpeg"), ray_hosts=ALL).host == "a1-arm64"
    # The driver's own running tasks count as load: a1-arm64 is full with one.
    assert select_assignment(FLEET, Requirement(min_tier="cpu_ffmpeg"), ray_hosts={"lux", "a1-arm64"}, own_in_flight={"a1-arm64": 1}).host == "lux"


def test_a_host_without_a_live_ray_node_is_no_candidate_and_work_falls_back_one_tier():
    assignment = select_assignment(FLEET, Requirement(min_tier="gpu_apu"), ray_hosts=ALL - {"qfox-1"})
    assert (assignment.status, assignment.tier, assignment.fallback) == ("assigned", "cpu_ffmpeg", True)
    assert assignment.host == "a1-arm64"  # both idle: the node id decides


def test_fallback_goes_one_tier_at_a_time_down_to_the_floor_then_defers_with_the_reason():
    full = {"qfox-1": 4, "lux": 2, "a1-arm64": 1}
    assignment = select_assignment(FLEET, Requirement(min_tier="gpu_apu"), ray_hosts=ALL, own_in_flight=full)
    assert (assignment.host, assignment.tier, assignment.fallback) == ("racknerd", "relay", True)
    floored = select_assignment(FLEET, Requirement(min_tier="gpu_apu", floor="cpu_ffmpeg"), ray_hosts=ALL, own_in_flight=full)
    assert floored.status == "deferred" and not floored.inadmissible
    assert "qfox-1 full 4/4" in (floored.reason or "") and "lux full 2/2" in (floored.reason or "")


def test_cuda_only_work_without_a_cuda_ray_node_is_deferred_with_the_reason():
    cuda_only = Requirement(min_tier="gpu_cuda", floor="gpu_cuda")
    gone = select_assignment(FLEET, cuda_only, ray_hosts=ALL - {"qfox-1"})
    assert gone.status == "deferred"
    assert "no live Ray node on qfox-1" in (gone.reason or "")
    assert not gone.inadmissible  # qfox-1's worker may come back
    no_cuda = Snapshot(now=NOW, nodes=[n for n in FLEET.nodes if n.node_id != "qfox-1"])
    never = select_assignment(no_cuda, cuda_only, ray_hosts=ALL)
    assert never.inadmissible and (never.reason or "").startswith("inadmissible: no node in the fleet has tier gpu_cuda")


def test_a_requirement_is_checked_as_the_scheduler_checks_a_request():
    with pytest.raises(ValueError, match="not a tier"):
        Requirement(min_tier="quantum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="floor 'gpu_cuda' is above min_tier"):
        Requirement(min_tier="cpu_ffmpeg", floor="gpu_cuda")
    with pytest.raises(ValueError, match="negative"):
        Requirement(min_tier="relay", payload_size=-1)


def test_the_burst_check_counts_fallbacks_as_the_seed_prints_them():
    count = FallbackCount()
    running: dict[str, int] = {}
    for _ in range(100):
        assignment = select_assignment(FLEET, Requirement(min_tier="gpu_apu", payload_size=1024), ray_hosts=ALL, own_in_flight=running)
        count.count(assignment)
        if assignment.host is not None:
            running[assignment.host] = running.get(assignment.host, 0) + 1
    # qfox-1's 4 slots, then lux 2, a1-arm64 1, racknerd 1 below gpu_apu; the other 92 deferred.
    assert (count.dispatched, count.fallbacks) == (8, 4)
    assert count.line() == "8 tasks dispatched, fallback tiers used: 4"


def test_ray_tasks_join_a_nodes_load_in_the_leaders_snapshot():
    reported = FLEET.model_copy(update={"nodes": [node("qfox-1", "gpu_cuda", 4, in_flight=1, services_running=1)]})
    seen = with_ray_view(reported, RayView(running={"qfox-1": 2}, alive=frozenset({"qfox-1"})), worker_unit=RAY_WORKER_UNIT)
    (qfox,) = seen.nodes
    assert (qfox.in_flight, qfox.engine_tasks) == (3, 2)
    # The scheduler's account: its services, the lane jobs now, and the Ray tasks.
    assert account_load(qfox, 1, 0) == 3
    # Read again next step: the tasks replace the previous count, never add to it.
    again = with_ray_view(seen, RayView(running={"qfox-1": 1}, alive=frozenset({"qfox-1"})), worker_unit=RAY_WORKER_UNIT)
    assert (again.nodes[0].in_flight, again.nodes[0].engine_tasks) == (2, 1)


def test_a_dead_ray_node_shows_its_worker_unit_failed():
    view = RayView(running={}, alive=frozenset({"lux"}), dead=frozenset({"qfox-1", "lux"}))
    seen = {n.node_id: n for n in with_ray_view(FLEET, view, worker_unit=RAY_WORKER_UNIT).nodes}
    assert seen["qfox-1"].units == {RAY_WORKER_UNIT: "failed"}
    assert seen["lux"].units == {}  # lux's Ray node was restarted: a live one wins


def test_ray_workers_start_on_idle_capacity_and_stop_on_hosts_that_take_no_new_work():
    snapshot = Snapshot(
        now=NOW,
        nodes=[
            node("qfox-1", "gpu_cuda", 4),
            node("lux", "cpu_ffmpeg", 2, in_flight=2),
            node("a1-arm64", "cpu_ffmpeg", 1, status="offline"),
            node("x86-spill", "cpu_ffmpeg", 4, held_off_until=NOW + timedelta(minutes=5)),
            node("racknerd", "relay", 1),
        ],
    )
    view = RayView(running={}, alive=frozenset({"a1-arm64", "x86-spill", "racknerd"}), dead=frozenset({"qfox-1"}))
    actions = decide_ray_workers(snapshot, {"qfox-1", "lux", "a1-arm64", "x86-spill"}, view, NOW)
    assert [(a.kind, a.host) for a in actions] == [("stop", "a1-arm64"), ("start", "qfox-1"), ("stop", "x86-spill")]
    assert actions[1] == RayWorkerAction("start", "qfox-1", "its Ray node died while it has idle capacity (0/4, tier gpu_cuda)")
    assert "held off" in actions[2].reason and "offline" in actions[0].reason


def test_ray_view_counts_running_tasks_per_host_on_live_nodes_only():
    nodes = [
        ("n-qfox-old", False, {HOST_LABEL: "qfox-1"}),  # died with a task whose final event never came
        ("n-lux", True, {HOST_LABEL: "lux"}),
        ("n-a1", False, {HOST_LABEL: "a1-arm64"}),
        ("n-a1-new", True, {HOST_LABEL: "a1-arm64"}),  # restarted: a live node wins
        ("n-head", True, {}),  # the head: no host label, never a fabric host
    ]
    view = ray_view(nodes, ["n-lux", "n-lux", "n-qfox-old", "n-head", "n-a1-new", None], host_label=HOST_LABEL)
    assert view == RayView(running={"lux": 2, "a1-arm64": 1}, alive=frozenset({"lux", "a1-arm64"}), dead=frozenset({"qfox-1"}))
