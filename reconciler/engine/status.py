"""What `fabric status` shows, gathered: the desired state, a snapshot, its plan, and the instant it is shown as of.

Two sources: the live registry (its snapshot now, every declared lane
included, and the newest published plan), or a saved snapshot shown as of the
instant it was taken, with a saved plan or the plan the scheduler makes for it
(a what-if). Talks to the registry only through its Protocol;
`reconciler.cli.status` reads the files and wires the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.scheduling.placement import schedule
from reconciler.ports import Registry


@dataclass(frozen=True)
class StatusInputs:
    desired: DesiredState
    snapshot: Snapshot
    plan: FleetPlan | None
    now: datetime


def live_status(desired: DesiredState, registry: Registry) -> StatusInputs:
    """The live registry: its snapshot now and the newest published plan."""
    # Every declared lane, so a lane nobody reported yet still gets a card.
    snapshot = registry.snapshot([lane.id for lane in desired.lanes])
    plan = registry.newest_plan()
    return StatusInputs(desired=desired, snapshot=snapshot, plan=plan, now=snapshot.now)


def saved_status(desired: DesiredState, snapshot: Snapshot, plan: FleetPlan | None = None) -> StatusInputs:
    """A saved snapshot as of the instant it was taken; without a saved plan,
    what the leader would publish for it."""
    if plan is None:
        plan = schedule(snapshot, desired)
    return StatusInputs(desired=desired, snapshot=snapshot, plan=plan, now=snapshot.now)
