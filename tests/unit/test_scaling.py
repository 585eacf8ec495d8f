"""Bursts and scaling (reconciler.core.scheduling.scaling) over an injected clock.

Each test runs passes at chosen instants, carrying the state from one pass to
the next as the leader does, and checks the decided actions.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from reconciler.core.desired.model import ScalingSettings
from reconciler.core.live.models import Snapshot
from reconciler.core.scheduling.scaling import ScalingState, decide_scaling
from tests.support.scaling import HOOKS, SETTINGS, T0, Leader, kinds, node  # noqa: F401

# --------------------------------------------------------------------------
# Bursts


def test_a_burst_activates_idle_capacity_first_and_only_after_the_window():
    leader = Leader()
    fleet = [node("busy", in_flight=2), node("idle-b", in_flight=0), node("idle-a", in_flight=0)]
    assert leader.at(0, fleet, queue_depth=11) == []
    assert leader.at(29, fleet, queue_depth=11) == []
    actions = leader.at(30, fleet, queue_depth=11)
    assert kinds(actions) == [("activate_idle", "idle-a"), ("activate_idle", "idle-b")]
    assert actions[0].reason == "queue depth 11 > 10 for 30s"


def test_queue_depth_at_the_mark_is_not_a_burst():
    leader = Leader()
    fleet = [node("idle", in_flight=0)]
    assert leader.at(0, fleet, queue_depth=10) == []
    assert leader.at(100, fleet, queue_depth=10) == []


def test_a_dip_restarts_the_burst_window():
    leader = Leader()
    fleet = [node("idle", in_flight=0)]
    leader.at(0, fleet, queue_depth=20)
    leader.at(20, fleet, queue_depth=5)
    assert leader.at(40, fleet, queue_depth=20) == []
    assert leader.at(69, fleet, queue_depth=20) == []
    assert kinds(leader.at(70, fleet, queue_depth=20)) == [("activate_idle", "idle")]


def test_an_idle_node_is_not_activated_again_within_the_group_interval():
    leader = Leader()
    fleet = [node("idle", in_flight=0)]
    leader.at(0, fleet, queue_depth=20)
    assert kinds(leader.at(30, fleet, queue_depth=20)) == [("activate_idle", "idle")]
    assert leader.at(60, fleet, queue_depth=20) == []
    assert kinds(leader.at(90, fleet, queue_depth=20)) == [("activate_idle", "idle")]


def test_a_node_that_blinks_offline_is_not_activated_again_sooner():
    leader = Leader()
    leader.at(0, [node("idle", in_flight=0)], queue_depth=20)
    assert kinds(leader.at(30, [node("idle", in_flight=0)], queue_depth=20)) == [("activate_idle", "idle")]
    leader.at(40, [node("idle", in_flight=0, status="offline")], queue_depth=20)
    assert leader.at(50, [node("idle", in_flight=0)], queue_depth=20) == []
    assert kinds(leader.at(90, [node("idle", in_flight=0)], queue_depth=20)) == [("activate_idle", "idle")]


@pytest.mark.parametrize(
    "unusable",
    [
        node("x", in_flight=0, status="offline"),
        node("x", in_flight=0, status="draining"),
        node("x", in_flight=0, drained=True),
        node("x", in_flight=0, held_off_until=T0 + timedelta(hours=1)),
        node("x", in_flight=0, limit=0),
    ],
    ids=["offline", "draining", "drained", "held off", "limit 0"],
)
def test_only_nodes_that_take_work_count_as_idle_capacity(unusable):
    leader = Leader()
    leader.at(0, [unusable], queue_depth=20)
    assert [a.kind for a in leader.at(30, [unusable], queue_depth=20)] == ["run_cloud_hook", "run_cloud_hook"]


def test_only_an_idle_lane_host_or_a_scaled_down_node_is_idle_capacity_for_queued_work():
    """Queued work is lane jobs (they run only on the lane hosts) and replicas
    deferred for capacity (an idle node at its own limit would have them
    already). An idle relay with no lane cannot take any of it: counted as
    idle capacity it would hold every burst off the cloud hooks for good."""
    relay = node("racknerd", tier="relay", in_flight=0, limit=1)
    busy_lane_host = node("x86-spill", in_flight=2, limit=2)
    leader = Leader()
    leader.at(0, [relay, busy_lane_host], queue_depth=20)
    actions = leader.at(30, [relay, busy_lane_host], queue_depth=20, lane_hosts={"x86-spill", "lux"})
    assert kinds(actions) == [("run_cloud_hook", "batch"), ("run_cloud_hook", "wasm")]

    idle_lane_host = node("lux", in_flight=0, limit=2)
    leader = Leader()
    leader.at(0, [relay, idle_lane_host], queue_depth=20)
    assert kinds(leader.at(30, [relay, idle_lane_host], queue_depth=20, lane_hosts={"lux"})) == [("activate_idle", "lux")]

    # A scaled-down group is capacity again once activated, lane or not.
    leader = Leader()
    leader.at(0, [relay])
    assert kinds(leader.at(900, [relay])) == [("scale_down", "racknerd")]
    leader.at(1000, [relay], queue_depth=20)
    assert kinds(leader.at(1030, [relay], queue_depth=20, lane_hosts=set())) == [("activate_idle", "racknerd")]


def test_without_idle_capacity_the_cloud_hooks_run_once_per_tier_per_interval():
    leader = Leader()
    fleet = [node("busy", in_flight=4)]
    leader.at(0, fleet, queue_depth=50)
    actions = leader.at(30, fleet, queue_depth=50)
    # Best tier first: batch (GitHub Actions) before wasm (Cloudflare).
    assert kinds(actions) == [("run_cloud_hook", "batch"), ("run_cloud_hook", "wasm")]
    assert actions[0].argv == HOOKS["batch"] and actions[1].argv == HOOKS["wasm"]
    assert actions[0].reason == "queue depth 50 > 10 for 30s; no idle capacity"

    held = leader.at(60, fleet, queue_depth=50)
    assert kinds(held) == [("hold", "batch"), ("hold", "wasm")]
    assert "next from 2026-11-29T12:01:30Z" in held[0].reason
    assert kinds(leader.at(89, fleet, queue_depth=50)) == [("hold", "batch"), ("hold", "wasm")]
    assert kinds(leader.at(90, fleet, queue_depth=50)) == [("run_cloud_hook", "batch"), ("run_cloud_hook", "wasm")]


def test_without_idle_capacity_or_hooks_the_work_stays_queued():
    leader = Leader(ScalingSettings())
    fleet = [node("busy", in_flight=4)]
    leader.at(0, fleet, queue_depth=50)
    [action] = leader.at(30, fleet, queue_depth=50)
    assert action.kind == "hold"
    assert "no cloud hook configured: work stays queued" in action.reason


# --------------------------------------------------------------------------
# Vertical scaling


def test_sustained_high_utilization_raises_concurrency_within_the_ceiling():
    leader = Leader()
    hot = [node("qfox-1", in_flight=4, limit=4, max_concurrent_ceiling=6)]
    assert leader.at(0, hot) == []
    assert leader.at(299, hot) == []
    [action] = leader.at(300, hot)
    assert (action.kind, action.node, action.max_concurrent_tasks) == ("raise_concurrency", "qfox-1", 5)
    assert action.reason == "qfox-1 4/4 busy for 300s (> 80%); ceiling 6 leaves headroom"
    # The window starts again: the next step needs another five minutes.
    hotter = [node("qfox-1", in_flight=5, limit=5, max_concurrent_ceiling=6)]
    assert leader.at(310, hotter) == []
    assert [a.max_concurrent_tasks for a in leader.at(600, hotter)] == [6]


def test_utilization_at_the_threshold_is_not_high():
    leader = Leader()
    exactly = [node("n", in_flight=4, limit=5, max_concurrent_ceiling=8)]  # 80 %
    leader.at(0, exactly)
    assert leader.at(1000, exactly) == []


def test_a_dip_restarts_the_utilization_window():
    leader = Leader()
    hot = [node("n", in_flight=4, limit=4, max_concurrent_ceiling=8)]
    leader.at(0, hot)
    leader.at(200, [node("n", in_flight=2, limit=4, max_concurrent_ceiling=8)])
    assert leader.at(400, hot) == []
    assert [a.kind for a in leader.at(700, hot)] == ["raise_concurrency"]


@pytest.mark.parametrize("ceiling", [4, None], ids=["at its ceiling", "no ceiling known"])
def test_a_hot_node_without_headroom_scales_out(ceiling):
    leader = Leader()
    fleet = [node("qfox-1", in_flight=4, limit=4, max_concurrent_ceiling=ceiling), node("spare", in_flight=0)]
    leader.at(0, fleet)
    actions = leader.at(300, fleet)
    assert kinds(actions) == [("activate_idle", "spare")]
    assert actions[0].reason == "qfox-1 4/4 busy for 300s (> 80%) and at its ceiling 4"
    # No idle capacity left: the cloud hooks.
    busy = [fleet[0], node("spare", in_flight=1)]
    assert kinds(leader.at(600, busy)) == [("run_cloud_hook", "batch"), ("run_cloud_hook", "wasm")]


# --------------------------------------------------------------------------
# Scaling down


def test_sustained_low_utilization_scales_a_group_down_once():
    leader = Leader()
    quiet = [node("a1-arm64", in_flight=0, limit=2), node("busy", in_flight=2, limit=4)]
    assert leader.at(0, quiet) == []
    assert leader.at(899, quiet) == []
    [action] = leader.at(900, quiet)
    assert (action.kind, action.node) == ("scale_down", "a1-arm64")
    assert action.reason == "a1-arm64 0/2 busy for 900s (< 10%), queue depth 0"
    assert leader.at(2000, quiet) == []  # already down
    # Busy again, then quiet again for a full window: down again.
    leader.at(2100, [node("a1-arm64", in_flight=1, limit=2)])
    assert leader.at(2200, quiet) == []
    assert kinds(leader.at(3100, quiet)) == [("scale_down", "a1-arm64")]


def test_no_scale_down_during_a_burst_and_activation_restarts_the_window():
    leader = Leader()
    quiet = [node("a1-arm64", in_flight=0, limit=2)]
    leader.at(0, quiet)
    leader.at(880, quiet, queue_depth=40)
    assert kinds(leader.at(910, quiet, queue_depth=40)) == [("activate_idle", "a1-arm64")]
    # The burst is over, the node is still idle: a fresh 15-minute window.
    assert leader.at(920, quiet) == []
    assert leader.at(1819, quiet) == []
    assert kinds(leader.at(1820, quiet)) == [("scale_down", "a1-arm64")]


def test_a_scaled_down_node_is_activated_by_the_next_burst():
    leader = Leader()
    quiet = [node("a1-arm64", in_flight=0, limit=2)]
    leader.at(0, quiet)
    assert kinds(leader.at(900, quiet)) == [("scale_down", "a1-arm64")]
    leader.at(1000, quiet, queue_depth=30)
    assert kinds(leader.at(1030, quiet, queue_depth=30)) == [("activate_idle", "a1-arm64")]
    assert leader.state.scaled_down == []


# --------------------------------------------------------------------------
# State


def test_state_forgets_nodes_that_left_and_survives_json():
    leader = Leader()
    leader.at(0, [node("gone", in_flight=0), node("hot", in_flight=4, limit=4, max_concurrent_ceiling=5)], queue_depth=20)
    assert set(leader.state.cold_since) == {"gone"} and set(leader.state.hot_since) == {"hot"}
    leader.at(10, [node("hot", in_flight=4, limit=4, max_concurrent_ceiling=5)], queue_depth=20)
    assert leader.state.cold_since == {}
    restored = ScalingState.model_validate_json(leader.state.model_dump_json())
    assert restored == leader.state
    assert restored.queue_high_since == T0


def test_the_time_defaults_to_the_snapshot_time():
    state = ScalingState(queue_high_since=T0)
    decision = decide_scaling(Snapshot(now=T0 + timedelta(seconds=30), nodes=[node("idle", in_flight=0)]), 20, SETTINGS, state)
    assert kinds(decision.actions) == [("activate_idle", "idle")]


@pytest.mark.parametrize(
    "burst_at, expected_during",
    [
        (880, [("hold", None)]),  # the burst window (30 s) passed: a hold, never a scale-down
        (895, []),  # the queue is high but the burst window has not passed yet: still no scale-down
    ],
    ids=["burst under way", "queue high within the burst window"],
)
def test_a_queue_above_the_mark_blocks_scale_down_of_a_node_cold_for_the_whole_window(burst_at, expected_during):
    """1 of 20 busy (5 % < 10 %) is cold but not idle, so the burst activates
    nothing and the cold window is not restarted: only the guard against
    scaling down during a burst keeps the node up."""
    leader = Leader(ScalingSettings())
    cold = [node("a1-arm64", in_flight=1, limit=20)]
    assert leader.at(0, cold) == []
    leader.at(burst_at, cold, queue_depth=40)
    assert kinds(leader.at(910, cold, queue_depth=40)) == expected_during
    assert leader.state.scaled_down == []
    # The queue is back at the mark (not above it): the window, held since 0, scales it down.
    assert kinds(leader.at(920, cold, queue_depth=10)) == [("scale_down", "a1-arm64")]
