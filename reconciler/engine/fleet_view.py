"""The registry's view of the whole fleet, read by the edge's pass after activation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.live.pending import PendingRecord, live_pending
from reconciler.core.scheduling.lanes import lanes_of_plan
from reconciler.ports import FleetViewConnection, RegistryError

if TYPE_CHECKING:
    # The fleet's view is read after activation (read_fleet_view): its reader
    # and the timeline's models are imported then, not on the way to it.
    from reconciler.core.views.timeline import FleetHistory


@dataclass(frozen=True)
class FleetView:
    """The registry's view of the whole fleet, for the edge's status page and
    fleet metrics (`read_fleet_view`)."""

    snapshot: Snapshot
    # What the registry remembers (node transitions, leader, hook runs), read
    # on the snapshot's connection, for the page's timeline (None: it could
    # not be read: a note says so).
    history: FleetHistory | None = None
    notes: tuple[str, ...] = ()
    # The machines waiting for admission (live, not declared): the
    # capabilities API lists them with status "pending"; never placed on.
    pending: list[PendingRecord] = field(default_factory=list)


def read_fleet_view(connect: Callable[[], FleetViewConnection], desired: DesiredState, plan: FleetPlan | None = None) -> FleetView:
    """The registry's view of the whole fleet for the edge's status page: its
    snapshot and what it remembers, on one connection, with the lanes' queues
    of `plan` (the plan the pass took: the leader's, signed), so the edge
    needs no access to phaze's broker. A pass reads it after activation, so
    the edge's Caddy never waits for the page's reads. Raises RegistryError;
    the history not answering is a note (the page goes without it)."""
    from reconciler.engine.status import fleet_history

    notes: list[str] = []
    registry = connect()
    try:
        snapshot = registry.snapshot(lanes=[lane.id for lane in desired.lanes])
        history: FleetHistory | None = None
        try:
            history = fleet_history(registry)
        except RegistryError as exc:  # the page goes without its timeline
            notes.append(f"status page without its timeline: {exc}")
        pending: list[PendingRecord] = []
        try:
            reports, unreadable = registry.pending_nodes()
            pending = live_pending(reports, snapshot.now, set(desired.hosts) | {n.node_id for n in snapshot.nodes})
            notes += [f"pending report skipped: {line}" for line in unreadable]
        except RegistryError as exc:  # the API goes without the pending machines
            notes.append(f"capabilities without the pending machines: {exc}")
    finally:
        registry.close()
    if plan is not None and plan.lanes:
        declared = {lane.id for lane in desired.lanes}
        snapshot = snapshot.model_copy(update={"lanes": [lane for lane in lanes_of_plan(plan.lanes) if lane.id in declared]})
    return FleetView(snapshot, history, tuple(notes), pending)
