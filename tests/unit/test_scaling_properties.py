"""Property tests of the scaling decisions over random runs of passes (hypothesis).

A run is a sequence of passes at increasing instants, each with its own queue
depth and node loads, carrying the state as the leader does. Whatever happens:
- a tier's cloud hook is never returned twice within group_interval_s;
- a node is never activated as idle capacity twice within group_interval_s,
  and only when it takes work and has nothing in flight;
- raise_concurrency is one step and never past the node's ceiling;
- nothing is scaled down while the queue is above its high mark;
- a scale-up or scale-down only follows a condition that held for its whole
  window (checked against the run's own history).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.core.desired.model import ScalingSettings
from reconciler.core.live.models import Snapshot, SnapshotNode
from reconciler.core.scheduling.placement import accepts_new_work
from reconciler.core.scheduling.scaling import ScalingState, decide_scaling

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
SETTINGS = ScalingSettings(
    queue_high=5,
    burst_window_s=30,
    group_interval_s=60,
    scale_up_window_s=120,
    scale_down_window_s=240,
    cloud_hooks={"batch": {"command": ["gh", "workflow", "run"]}, "wasm": {"command": ["wrangler", "deploy"]}},
)
NODE_IDS = ["a", "b", "c"]


@st.composite
def passes(draw):
    count = draw(st.integers(1, 20))
    out = []
    for _ in range(count):
        step = draw(st.sampled_from([5, 10, 30, 60, 120]))
        queue = draw(st.sampled_from([0, 3, 5, 6, 40]))
        nodes = []
        for node_id in NODE_IDS:
            limit = draw(st.integers(1, 4))
            nodes.append(
                SnapshotNode(
                    node_id=node_id,
                    tier="cpu_ffmpeg",
                    status=draw(st.sampled_from(["active", "active", "active", "offline"])),
                    in_flight=draw(st.sampled_from([0, 0, limit, limit, 1])),
                    max_concurrent_tasks=limit,
                    max_concurrent_ceiling=draw(st.sampled_from([None, limit, limit + 2])),
                )
            )
        out.append((step, queue, nodes))
    return out


def held_since(history, now, window_s, condition) -> bool:
    """Did `condition` hold at every pass in the last window_s (and at one at least window_s ago)?"""
    start = now - timedelta(seconds=window_s)
    relevant = [h for h in history if h[0] >= start]
    earlier = [h for h in history if h[0] <= start]
    return bool(earlier) and condition(earlier[-1]) and all(condition(h) for h in relevant)


@settings(max_examples=80, deadline=None)
@given(run=passes())
def test_scaling_invariants(run):
    state = ScalingState()
    now = T0
    last_hook: dict[str, datetime] = {}
    last_activation: dict[str, datetime] = {}
    history = []  # (time, queue depth, {node: (in_flight, limit, active)})
    for step, queue, nodes in run:
        now += timedelta(seconds=step)
        history.append((now, queue, {n.node_id: (n.in_flight, n.max_concurrent_tasks, n.status == "active") for n in nodes}))
        decision = decide_scaling(Snapshot(now=now, nodes=nodes), queue, SETTINGS, state, now)
        state = decision.state
        by_id = {n.node_id: n for n in nodes}
        for action in decision.actions:
            if action.kind == "run_cloud_hook":
                assert action.argv == SETTINGS.cloud_hooks[action.tier].command
                if action.tier in last_hook:
                    assert (now - last_hook[action.tier]).total_seconds() >= SETTINGS.group_interval_s
                last_hook[action.tier] = now
            elif action.kind == "activate_idle":
                node = by_id[action.node]
                assert node.in_flight == 0 and accepts_new_work(node, now)
                if action.node in last_activation:
                    assert (now - last_activation[action.node]).total_seconds() >= SETTINGS.group_interval_s
                last_activation[action.node] = now
            elif action.kind == "raise_concurrency":
                node = by_id[action.node]
                assert action.max_concurrent_tasks == node.max_concurrent_tasks + 1
                assert action.max_concurrent_tasks <= (node.max_concurrent_ceiling or 0)
                assert held_since(
                    history,
                    now,
                    SETTINGS.scale_up_window_s,
                    lambda h, n=action.node: h[2][n][2] and h[2][n][0] / h[2][n][1] > SETTINGS.scale_up_utilization,
                )
            elif action.kind == "scale_down":
                assert queue <= SETTINGS.queue_high
                assert held_since(
                    history,
                    now,
                    SETTINGS.scale_down_window_s,
                    lambda h, n=action.node: h[2][n][2] and h[2][n][0] / h[2][n][1] < SETTINGS.scale_down_utilization,
                )
        if any(a.kind in ("run_cloud_hook", "activate_idle") for a in decision.actions):
            # Scaling out needs a sustained burst or a node hot for its window.
            burst = held_since(history, now, SETTINGS.burst_window_s, lambda h: h[1] > SETTINGS.queue_high)
            hot = any(
                held_since(
                    history,
                    now,
                    SETTINGS.scale_up_window_s,
                    lambda h, n=n: h[2][n][2] and h[2][n][0] / h[2][n][1] > SETTINGS.scale_up_utilization,
                )
                for n in NODE_IDS
            )
            assert burst or hot
