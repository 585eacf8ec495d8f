"""The registry's view of the whole fleet, read by the edge's pass after activation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import Snapshot
from reconciler.core.live.pending import PendingRecord, live_pending
from reconciler.engine.heartbeat import no_lane_broker
from reconciler.engine.lane_states import with_lane_states
from reconciler.ports import FleetViewConnection, LaneBroker, LaneBrokerError, RegistryError

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


def read_fleet_view(
    connect: Callable[[], FleetViewConnection], desired: DesiredState, open_lanes: Callable[[], LaneBroker | None] = no_lane_broker
) -> FleetView:
    """The registry's view of the whole fleet for the edge's status page:
    its snapshot with the lanes' queues (phaze's broker) and what it
    remembers, on one connection. A pass reads it after activation, so the
    edge's Caddy never waits for the page's reads (nor for the broker's
    client to load). Raises RegistryError; the broker or the history not
    answering is a note (the page goes without them)."""
    from reconciler.engine.status import fleet_history

    notes: list[str] = []
    registry = connect()
    lane_broker: LaneBroker | None = None
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
        lane_broker = open_lanes()
        try:
            snapshot = with_lane_states(snapshot, lane_broker, desired)
        except LaneBrokerError as exc:
            notes.append(f"lane queue unreachable, status page without the lanes' queues: {exc}")
    finally:
        registry.close()
        if lane_broker is not None:
            lane_broker.close()
    return FleetView(snapshot, history, tuple(notes), pending)
