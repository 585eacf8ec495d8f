"""How busy a host is, as its heartbeat reports it (`NodeRecord.in_flight`): pure.

One account of the machine: the placed service units running on the host
plus the lane jobs running on the lanes whose jobs run there (a compute
lane's agent on its push host, the local lane on the control host), plus the
tasks other engines report (none on the host: Ray's join the leader's
snapshot, core.scheduling.ray_tasks). The engine reads the unit states and
the lane queue through its ports and hands them in; nothing here asks.

This module imports only the standard library: the memoized pass
(reconciler.engine.memoized_pass) recomputes the lane part on every hit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# The ActiveStates of a unit whose work runs: "reloading" is an active unit
# re-reading its configuration. "activating" is not counted: a unit stuck
# starting (or in Restart= auto-restart after a crash) runs no work.
RUNNING_STATES = frozenset({"active", "reloading"})


@dataclass(frozen=True)
class HostLoad:
    """What runs on one host, by who runs it; `in_flight` is their sum."""

    services: int  # placed service units running here
    lane_jobs: int  # jobs running on the lanes whose jobs run here
    # Tasks other engines run here, as the host itself knows them: none
    # does. Ray's tasks are read by the leader from Ray's state API (a host
    # runs no Ray client) and join the leader's snapshot as
    # SnapshotNode.engine_tasks (core.scheduling.ray_tasks.with_ray_view).
    engine_tasks: int = 0

    @property
    def in_flight(self) -> int:
        return self.services + self.lane_jobs + self.engine_tasks


def service_units(unit_names: Iterable[str], service_unit_names: Iterable[str]) -> tuple[str, ...]:
    """The placed service units among a generation's units (sorted); the
    others are lane agents, port maps and the fabric's own units."""
    services = set(service_unit_names)
    return tuple(sorted(u for u in unit_names if u in services))


def services_running(placed_units: Iterable[str], unit_states: Mapping[str, str] | None) -> int:
    """How many placed service units run. `unit_states` None: the pass does
    not activate (--no-activate), so each placement the host runs counts."""
    placed = set(placed_units)
    if unit_states is None:
        return len(placed)
    return sum(1 for unit in placed if unit_states.get(unit) in RUNNING_STATES)


def lane_jobs_running(lanes_here: Iterable[str], lane_in_flight: Mapping[str, int]) -> int:
    """The jobs running on the lanes whose jobs run on this host (the lane queue's claimed slots)."""
    return sum(max(0, lane_in_flight.get(lane, 0)) for lane in set(lanes_here))


def host_load(
    placed_units: Iterable[str],
    unit_states: Mapping[str, str] | None,
    lanes_here: Iterable[str],
    lane_in_flight: Mapping[str, int],
) -> HostLoad:
    """The host's load from its placed service units' states and the lane queue."""
    return HostLoad(services=services_running(placed_units, unit_states), lane_jobs=lane_jobs_running(lanes_here, lane_in_flight))
