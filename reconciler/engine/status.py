"""What `fabric status` shows, gathered: the desired state, a snapshot, its plan, and the instant it is shown as of.

Two sources: the live registry (its snapshot now, every declared lane
included, the newest published plan, and what it remembers for the timeline:
`fleet_history`), or a saved snapshot shown as of the
instant it was taken, with a saved plan or the plan the scheduler makes for it
(a what-if). A live plan that hosts would refuse is left out and the reason
kept (`plan_refused`); a saved plan is the operator's what-if, not checked.
Talks to the registry only through its Protocol;
`reconciler.cli.status` reads the files and wires the registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from reconciler.core.desired.model import DesiredState
from reconciler.core.live.fencing import authorship_problem, term_problem
from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.live.pending import PendingRecord, live_pending
from reconciler.core.scheduling.placement import schedule
from reconciler.core.views.timeline import FleetHistory
from reconciler.engine.lane_states import with_lane_states
from reconciler.engine.plan_fence import registry_trust
from reconciler.ports import FleetReads, LaneBroker, RegistryReads


@dataclass(frozen=True)
class StatusInputs:
    desired: DesiredState
    snapshot: Snapshot
    plan: FleetPlan | None
    now: datetime
    # Why the registry's newest plan was left out: hosts refuse it (forged,
    # not from a candidate, or signed by a key fabric.toml does not list).
    plan_refused: str | None = None
    # What the registry remembers, for the timeline (None: a saved snapshot).
    history: FleetHistory | None = None
    # The machines waiting for admission (live, not declared; none for a saved snapshot).
    pending: list[PendingRecord] = field(default_factory=list)


def fleet_history(registry: FleetReads) -> FleetHistory:
    """What the registry remembers of the fleet's recent past: every node's
    lifecycle transitions, who leads since when, and the leader's scaling
    record (the cloud hook runs). Reads only."""
    return FleetHistory(nodes=tuple(registry.node_states()), leader=registry.leader(), scaling=registry.scaling_record())


def refused_plan(desired: DesiredState, registry: FleetReads, plan: FleetPlan) -> str | None:
    """Why every host refuses `plan` as not the leader's (the fence's own
    checks: a candidate's valid signature and, with plan keys, the registry's
    current leader and term, this fleet and prefix), or None."""
    keys = desired.fleet.plan_keys
    refused = authorship_problem(plan, leader_candidates=desired.fleet.fleet.leader_candidates, plan_keys=keys)
    if refused is None and keys:
        problem = term_problem(plan, registry_trust(desired, registry.leader_term()))
        if problem is not None and problem[1]:
            refused = problem[0]
    return refused


def live_status(desired: DesiredState, registry: RegistryReads, lane_broker: LaneBroker | None = None) -> StatusInputs:
    """The live registry: its snapshot now and the newest published plan;
    the lanes' jobs and workers from phaze's broker (`lane_broker`)."""
    # Every declared lane, so a lane nobody reported yet still gets a card.
    snapshot = with_lane_states(registry.snapshot([lane.id for lane in desired.lanes]), lane_broker, desired)
    plan = registry.newest_plan()
    history = fleet_history(registry)
    pending = pending_machines(desired, registry, snapshot)
    # The same check as every host's fence: a plan they refuse is not the fleet's.
    refused = refused_plan(desired, registry, plan) if plan is not None else None
    if refused is not None:
        # The snapshot's placements are that plan's: left out with it.
        snapshot = snapshot.model_copy(update={"placements": []})
        return StatusInputs(desired=desired, snapshot=snapshot, plan=None, now=snapshot.now, plan_refused=refused, history=history, pending=pending)
    return StatusInputs(desired=desired, snapshot=snapshot, plan=plan, now=snapshot.now, history=history, pending=pending)


def pending_machines(desired: DesiredState, registry: RegistryReads, snapshot: Snapshot) -> list[PendingRecord]:
    """The live pending reports of machines neither declared nor known as nodes."""
    reports, _ = registry.pending_nodes()
    return live_pending(reports, snapshot.now, set(desired.hosts) | {n.node_id for n in snapshot.nodes})


def saved_status(desired: DesiredState, snapshot: Snapshot, plan: FleetPlan | None = None) -> StatusInputs:
    """A saved snapshot as of the instant it was taken; without a saved plan,
    what the leader would publish for it."""
    if plan is None:
        plan = schedule(snapshot, desired)
    return StatusInputs(desired=desired, snapshot=snapshot, plan=plan, now=snapshot.now)
