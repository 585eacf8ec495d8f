"""The one-shot leader step a leader candidate's pass takes when nobody leads."""

from __future__ import annotations

from collections.abc import Callable

from reconciler.core.desired.model import DesiredState
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.heartbeat import no_lane_broker
from reconciler.ports import LaneBroker, LeaderRegistry, PlanSigner


def lead_once(
    registry: LeaderRegistry,
    desired: DesiredState,
    host: str,
    signer: PlanSigner | None = None,
    open_lanes: Callable[[], LaneBroker | None] = no_lane_broker,
) -> str | None:
    """One leader step if this host is a candidate and nobody leads; a note or None.
    With plan keys, the step signs with `signer` (or, without a usable key, does not lead).
    The lane queue is opened only for a step taken: a candidate's pass under
    a running fabric-leader.service does not pay for the broker."""
    if host not in desired.fleet.fleet.leader_candidates or registry.leader() is not None:
        return None
    # Imported only for a step taken: the leader's machinery (the dispatcher,
    # the scaling step) is nothing the pass of any other host needs.
    from reconciler.engine.leader import LeaderLoop

    notes: list[str] = []
    LeaderLoop(
        registry=registry,
        host=host,
        load_desired=lambda: desired,
        schedule=schedule,
        lease_ttl_s=float(desired.fleet.timing.heartbeat_s),
        log=notes.append,
        signer=signer,
        lane_broker=open_lanes(),
    ).step_and_resign()
    return "; ".join(notes) or None
