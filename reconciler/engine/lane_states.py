"""The lanes' load and workers, as phaze's broker shows them, in a snapshot.

The registry's snapshot carries the declared lanes with no load: lane jobs
live on phaze's broker (`LaneBroker`). Every reader of lanes (the dispatcher,
`fabric lane status`, `fabric status`, the leader's plan, a host's
heartbeat) puts the lane queue's view in with `with_lane_states` before
`lanes.lane_views` reads it. The edge's status page does not: it shows the
lanes of the leader's plan (`lanes.lanes_of_plan`), so the edge holds no DSN.
"""

from __future__ import annotations

from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import PhazeAgentSeen, Snapshot
from reconciler.ports import LaneBroker, LaneBrokerError, LaneTarget


def lane_targets(desired: DesiredState) -> dict[str, LaneTarget]:
    """Each declared lane's queue and cap (a compute lane's failures count cloud attempts)."""
    targets = {}
    for lane in desired.lanes:
        queue = desired.queue_for(lane)
        if queue is not None:
            targets[lane.id] = LaneTarget(lane=lane.id, queue=queue, cap=lane.cap, cloud=lane.kind == "compute")
    return targets


def lane_agents(desired: DesiredState) -> dict[str, str]:
    """A phaze fleet's lanes' agents in phaze (lane id -> phaze's agent id): a
    compute lane's agent_ref, the local lane's [phaze] fileserver_agent."""
    if not desired.fleet.phaze_dispatches:
        return {}
    out = {}
    for lane in desired.lanes:
        agent = lane.agent_ref if lane.kind == "compute" else desired.fleet.phaze.fileserver_agent
        if agent is not None:
            out[lane.id] = agent
    return out


def with_lane_states(snapshot: Snapshot, lane_broker: LaneBroker | None, desired: DesiredState) -> Snapshot:
    """`snapshot` whose lanes are the lane queue's now (jobs queued or active,
    SAQ workers; in a phaze fleet also each lane's agent as phaze's own
    agents table shows it, the second signal: `LaneBroker.phaze_agents`, an
    unreadable one `unknown` with the reason, never a failed read); without a
    lane queue (no [phaze] queue_url_file) the declared lanes with no load and
    no word on workers."""
    if lane_broker is None:
        return snapshot
    queues = {lane_id: target.queue for lane_id, target in lane_targets(desired).items()}
    lanes = lane_broker.lane_states(queues)
    agents = lane_agents(desired)
    if agents:
        try:
            seen = lane_broker.phaze_agents(sorted(set(agents.values())))
        except LaneBrokerError as exc:
            seen = {agent: PhazeAgentSeen(agent_id=agent, reason=f"not read: {exc}") for agent in agents.values()}
        lanes = [lane.model_copy(update={"phaze_agent": seen.get(agents[lane.id])}) if lane.id in agents else lane for lane in lanes]
    return snapshot.model_copy(update={"lanes": lanes})
