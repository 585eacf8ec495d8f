"""What happened lately in the fleet, newest first: the status page's timeline.

Pure: `timeline(history, plan, limit)` turns what the registry remembers into
a short list of `TimelineEvent`s. The registry remembers:

- each node's lifecycle transitions (`NodeState.transitions`, the newest
  `lifecycle.HISTORY` per node): joined, lost, back, dead, held off for
  flapping, hold-off over, drain requested, draining, drain lifted;
- who leads and since when (`LeaderInfo`): a new term raises the epoch;
- the newest published plan (`FleetPlan.created`, its epoch): only the newest
  is kept, so older epochs are not in the timeline;
- the newest changes of what phaze may choose (`FleetPlan.steering.recent`):
  a dead compute lane left out of phaze's backends.toml, a healthy one put
  back, each with its reason;
- the newest events of the nodes the leader suspects or suspected lately
  (`FleetPlan.suspects`, issue 30): suspicion (with its sources), hedge,
  recovery, offline at the node timeout;
- the cloud hook runs the leader carried out (`ScalingRecord.recent`, kind
  `run_cloud_hook`, with how each ended and its transient unit; no argv; the
  last line it printed, screened for secrets, in the detail).

A node the lifecycle forgot takes its history with it. Every time is UTC.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from reconciler.core.live.models import FleetPlan, Transition
from reconciler.core.live.records import LeaderInfo, ScalingRecord
from reconciler.core.scheduling.lifecycle import NodeState
from reconciler.core.timestamps import utc

# Events on the page: enough for "what just happened", not an audit log.
TIMELINE_LENGTH = 12

# The lifecycle's reason for a node's first transition (lifecycle.observe).
FIRST_HEARTBEAT = "first heartbeat"

# What each transition of a node is called on the timeline.
_NODE_EVENTS: dict[str, tuple[str, str]] = {
    # status -> (kind, words after the node's name)
    "offline": ("node_lost", "lost"),
    "dead": ("node_dead", "dead"),
    "held_off": ("held_off", "held off (flapping)"),
    "released": ("released", "hold-off over"),
    "drain": ("drain", "drain requested"),
    "draining": ("draining", "draining"),
    "undrain": ("undrain", "drain lifted"),
}


@dataclass(frozen=True)
class FleetHistory:
    """What the registry remembers, read in one go (`reconciler.engine.status.fleet_history`)."""

    nodes: tuple[NodeState, ...] = ()
    leader: LeaderInfo | None = None
    scaling: ScalingRecord | None = None


@dataclass(frozen=True)
class TimelineEvent:
    at: datetime
    # An identifier: node_joined, node_lost, node_back, node_dead, held_off,
    # released, drain, draining, undrain, leader, plan, lane_out, lane_in, hook,
    # suspicion, hedge, recovery, offline.
    kind: str
    # The node, the leader candidate, or the hook's tier.
    subject: str
    # `x86-spill lost`: the subject and what happened to it.
    title: str
    # Why, in the registry's words (may be empty).
    detail: str


def _node_event(node_id: str, t: Transition) -> TimelineEvent:
    if t.status == "active":
        if t.reason == FIRST_HEARTBEAT:
            kind, words = "node_joined", "joined"
        else:
            kind, words = "node_back", "back"
    else:
        kind, words = _NODE_EVENTS.get(t.status, (t.status, t.status))
    return TimelineEvent(at=utc(t.at), kind=kind, subject=node_id, title=f"{node_id} {words}", detail=t.reason)


def _hook_events(scaling: ScalingRecord) -> list[TimelineEvent]:
    events = []
    for audit in scaling.recent:
        if audit.kind != "run_cloud_hook":
            continue
        tier = audit.tier or "fleet"
        detail = audit.reason + (f"; output: {audit.output[-1]}" if audit.output else "")
        events.append(TimelineEvent(at=utc(audit.at), kind="hook", subject=tier, title=f"{tier} cloud hook {audit.outcome}", detail=detail))
    return events


def _steering_events(plan: FleetPlan) -> list[TimelineEvent]:
    return [
        TimelineEvent(
            at=utc(change.at),
            kind="lane_out" if change.out else "lane_in",
            subject=change.lane,
            title=f"{change.lane} {'left out of' if change.out else 'back in'} phaze's backends.toml",
            detail=change.reason,
        )
        for change in plan.steering.recent
    ]


# What each event of a suspected node is called on the timeline (issue 30).
_SUSPECT_WORDS = {"suspicion": "suspected", "hedge": "hedged", "recovery": "recovered", "offline": "offline at the node timeout"}


def _suspect_events(plan: FleetPlan) -> list[TimelineEvent]:
    return [
        TimelineEvent(at=utc(e.at), kind=e.kind, subject=node, title=f"{node} {_SUSPECT_WORDS.get(e.kind, e.kind)}", detail=e.detail)
        for node, state in plan.suspects.items()
        for e in state.events
    ]


def timeline(history: FleetHistory, plan: FleetPlan | None, *, limit: int = TIMELINE_LENGTH) -> tuple[TimelineEvent, ...]:
    """The newest `limit` events, newest first (ties: by kind, then subject).

    `plan` is the plan the view shows (a plan the hosts refuse is not given,
    so its publication is not an event of this fleet)."""
    events = [_node_event(state.node_id, t) for state in history.nodes for t in state.transitions]
    if history.leader is not None:
        leader = history.leader
        events.append(
            TimelineEvent(
                at=utc(leader.since), kind="leader", subject=leader.candidate, title=f"{leader.candidate} leads", detail=f"from epoch {leader.epoch}"
            )
        )
    if plan is not None and plan.leader:
        events.append(
            TimelineEvent(
                at=utc(plan.created),
                kind="plan",
                subject=plan.leader,
                title=f"plan epoch {plan.epoch}",
                detail=f"published by {plan.leader}: {len(plan.placements)} placements, {len(plan.deferred)} deferred",
            )
        )
    if plan is not None:
        events += _steering_events(plan)
        events += _suspect_events(plan)
    if history.scaling is not None:
        events += _hook_events(history.scaling)
    events.sort(key=lambda e: (e.kind, e.subject))
    events.sort(key=lambda e: e.at, reverse=True)
    return tuple(events[: max(0, limit)])
