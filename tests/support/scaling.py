"""A leader's scaling passes over an injected clock, for the scaling tests
(tests/unit/test_scaling.py, test_cost_scaling.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from reconciler.core.desired.model import ScalingSettings
from reconciler.core.live.models import Snapshot, SnapshotNode
from reconciler.core.scheduling.scaling import ScalingState, decide_scaling

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
HOOKS = {
    "wasm": ["/bin/wrangler", "deploy", "--name", "fabric-wasm-worker"],
    "batch": ["/bin/gh", "workflow", "run", "adaptive-compute.yml"],
}
SETTINGS = ScalingSettings(
    cloud_hooks={tier: {"command": argv} for tier, argv in HOOKS.items()}
)  # the defaults: 10 / 30 s / 60 s / 80 % 5 min / 10 % 15 min


def node(node_id, tier="cpu_ffmpeg", in_flight=1, limit=4, **kw) -> SnapshotNode:
    return SnapshotNode(node_id=node_id, tier=tier, in_flight=in_flight, max_concurrent_tasks=limit, **kw)


class Leader:
    """Runs passes and keeps the state between them."""

    def __init__(self, settings=SETTINGS):
        self.settings = settings
        self.state = ScalingState()

    def at(self, seconds, nodes, queue_depth=0, lane_hosts=None):
        at = T0 + timedelta(seconds=seconds)
        decision = decide_scaling(Snapshot(now=T0, nodes=nodes), queue_depth, self.settings, self.state, at, lane_hosts=lane_hosts)
        self.state = decision.state
        return decision.actions


def kinds(actions):
    return [(a.kind, a.node or a.tier) for a in actions]
