"""What a host reports to the registry: its effective facts, limits and measured load (its heartbeat)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from reconciler.core.desired.model import DesiredState, HostFacts
from reconciler.core.live.host_limits import effective_limits
from reconciler.core.live.host_load import HostLoad, host_load
from reconciler.core.live.records import NodeRecord
from reconciler.ports import BeatConnection, LaneBroker, LaneBrokerError


@dataclass(frozen=True)
class UnitsSeen:
    """This host's fabric units as a pass reads them (reconcile.py, through the systemd port)."""

    placed: tuple[str, ...]  # the placed service units of the generation that runs
    # Every fabric unit of that generation and its ActiveState; None when the
    # pass does not activate (--no-activate: systemd is not asked).
    states: dict[str, str] | None


@dataclass(frozen=True)
class Measured:
    """What a pass measured of this host for its heartbeat."""

    load: HostLoad
    units: dict[str, str]
    lanes: tuple[str, ...]  # the lanes whose jobs run here (a memoized pass re-reads them)


def lanes_here(desired: DesiredState, host: str) -> tuple[str, ...]:
    return tuple(lane.id for lane in desired.lanes_on(host))


def lane_in_flight(desired: DesiredState, lane_broker: LaneBroker | None, lanes: Sequence[str]) -> dict[str, int]:
    """Jobs queued or active on each of `lanes`' queues ({} without a lane queue)."""
    if lane_broker is None or not lanes:
        return {}
    queues = {lane.id: queue for lane in desired.lanes if lane.id in lanes and (queue := desired.queue_for(lane)) is not None}
    return {seen.id: seen.in_flight for seen in lane_broker.lane_states(queues)}


def measure(
    desired: DesiredState, host: str, seen: UnitsSeen, lane_broker: LaneBroker | None, note: Callable[[str], None] = lambda _: None
) -> Measured:
    """The host's load from its units and, for the lanes whose jobs run
    here, the lane queue (asked only when there is such a lane). A broker
    that stops answering is a note: the load is then the services alone."""
    lanes = lanes_here(desired, host)
    try:
        in_flight = lane_in_flight(desired, lane_broker, lanes)
    except LaneBrokerError as exc:
        note(f"lane queue unreachable, heartbeat without the lane jobs: {exc}")
        in_flight = {}
    return Measured(host_load(seen.placed, seen.states, lanes, in_flight), dict(seen.states or {}), lanes)


def no_lane_broker() -> LaneBroker | None:
    return None


def node_record(desired: DesiredState, host: str, facts: HostFacts, measured: Measured | None = None) -> NodeRecord:
    """What this host reports: its (effective) facts with the host file's
    limits bounded by the probe (core.live.host_limits), its declared labels
    (the operator's win, so services can be constrained to labels an operator
    declared) and, when measured, its load and unit states."""
    declared = desired.hosts[host]
    limits = effective_limits(declared, facts.limitations)
    return NodeRecord.from_facts(
        host,
        facts,
        max_concurrent_tasks=limits.max_concurrent_tasks,
        max_concurrent_ceiling=limits.max_concurrent_ceiling,
        labels={**facts.labels, **declared.labels},
        in_flight=measured.load.in_flight if measured is not None else 0,
        services_running=measured.load.services if measured is not None else None,
        units=measured.units if measured is not None else None,
        lowered_limits=list(limits.lowered),
        cost=declared.host.cost,
    )


def beat_after_activation(
    connect: Callable[[], BeatConnection],
    desired: DesiredState,
    host: str,
    facts: HostFacts,
    seen: UnitsSeen,
    sent: NodeRecord,
    open_lanes: Callable[[], LaneBroker | None] = no_lane_broker,
) -> tuple[Measured, NodeRecord, str | None]:
    """The heartbeat again, with the load measured after activation: the
    measurement, the record the registry now holds from this pass, and a note.

    Sent only when it differs from the pass's first beat (`sent`): a pass
    that changed nothing (and no lane job started or ended) writes once.
    Raises RegistryError when the registry cannot be reached."""
    registry = connect()
    lane_broker = open_lanes() if lanes_here(desired, host) else None
    try:
        measured = measure(desired, host, seen, lane_broker)  # a broker outage: the services alone
        record = node_record(desired, host, facts, measured)
        if record == sent:
            return measured, record, None
        stored = registry.heartbeat(record)
    finally:
        registry.close()
        if lane_broker is not None:
            lane_broker.close()
    load = measured.load
    return measured, record, f"after activation, {stored.heartbeat_note()} ({load.services} services, {load.lane_jobs} lane jobs)"
