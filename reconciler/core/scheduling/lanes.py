"""Lane dispatch (multi-compute.md): which lane takes the next job.

Pure: lanes and a job's age and attempts in, a `LaneDecision` out. Nothing is
sent anywhere; the caller carries the decision out.

Lanes come from the desired state (kind, rank, cap: `DesiredState.lanes`) and
the live view from the snapshot (available, in_flight); a declared lane that is
missing from the snapshot counts as available with nothing in flight, and a
snapshot lane that is not declared is ignored.

Which lanes may take a job (`eligible_lanes`):
    compute lane  available, in_flight < cap, and the job's cloud attempts are
                  below `scheduler.cloud_attempts` (a job whose cloud attempts
                  are spent only goes local).
    local lane    available, in_flight < cap, and at least one of
                  - no compute lane is available (every one offline, or none
                    declared): immediately;
                  - the job has waited >= `scheduler.local_spill_after_s`;
                  - its cloud attempts >= `scheduler.cloud_attempts`.
    The choice is the minimum of (rank, in_flight/cap, id) among them, so the
    cheapest lane fills first and equal ranks share by utilization. An offline
    lane is simply not eligible: it never stalls the others.

A hold always carries the reason, chosen by what would release the job:
    cloud_attempts_exhausted  the job's cloud attempts are spent, so only a
                              local lane may take it, and none has a free slot
                              (full or offline, or no local lane declared).
    local_spill_not_reached   every available compute lane is full and a
                              local lane has a free slot, but the job has not
                              waited `local_spill_after_s` yet: time will
                              release it.
    no_free_slots             otherwise: no lane the job may use has a free
                              slot (all full, or offline), and waiting for the
                              spill gate would not help either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from reconciler.core.desired.model import DesiredState, SchedulerSettings
from reconciler.core.live.models import HoldReason, LaneView, Snapshot, SnapshotLane


@dataclass(frozen=True)
class LaneDecision:
    lane: str | None
    hold: HoldReason | None

    def as_json(self) -> dict[str, str | None]:
        return {"backend": self.lane, "hold": self.hold}


@dataclass(frozen=True)
class LaneJob:
    """One job waiting for a lane: how long it has waited, how often the cloud failed it."""

    waited_s: float = 0.0
    attempts: int = 0


def lane_views(desired: DesiredState, snapshot: Snapshot) -> list[LaneView]:
    """Declared lanes with their live state, in sort-key order."""
    live: dict[str, SnapshotLane] = {}
    for seen_lane in snapshot.lanes:
        live.setdefault(seen_lane.id, seen_lane)
    views = []
    for lane in desired.lanes:
        seen = live.get(lane.id)
        views.append(
            LaneView(
                id=lane.id,
                kind=lane.kind,
                rank=lane.rank,
                cap=lane.cap,
                in_flight=seen.in_flight if seen else 0,
                available=seen.available if seen else True,
            )
        )
    return sorted(views, key=sort_key)


def sort_key(lane: LaneView) -> tuple[int, Fraction, str]:
    """multi-compute.md's SCHED-04 key: rank, then utilization, then id."""
    return (lane.rank, Fraction(lane.in_flight, lane.cap), lane.id)


def has_free_slot(lane: LaneView) -> bool:
    return lane.available and lane.in_flight < lane.cap


def eligible_lanes(lanes: Sequence[LaneView], job: LaneJob, settings: SchedulerSettings) -> list[LaneView]:
    """The lanes that may take `job` now (see the module docstring)."""
    attempts_spent = job.attempts >= settings.cloud_attempts
    every_compute_offline = not any(lane.available for lane in lanes if lane.kind != "local")
    local_open = every_compute_offline or attempts_spent or job.waited_s >= settings.local_spill_after_s
    out = []
    for lane in lanes:
        if not has_free_slot(lane):
            continue
        if lane.kind == "local" and local_open:
            out.append(lane)
        elif lane.kind != "local" and not attempts_spent:
            out.append(lane)
    return out


def choose_lane(lanes: Sequence[LaneView], job: LaneJob, settings: SchedulerSettings) -> LaneDecision:
    """The lane for `job`, or a hold with its reason."""
    eligible = eligible_lanes(lanes, job, settings)
    if eligible:
        return LaneDecision(lane=min(eligible, key=sort_key).id, hold=None)
    if job.attempts >= settings.cloud_attempts:
        return LaneDecision(lane=None, hold="cloud_attempts_exhausted")
    compute_available = any(lane.available for lane in lanes if lane.kind != "local")
    local_free = any(has_free_slot(lane) for lane in lanes if lane.kind == "local")
    if compute_available and local_free and job.waited_s < settings.local_spill_after_s:
        return LaneDecision(lane=None, hold="local_spill_not_reached")
    return LaneDecision(lane=None, hold="no_free_slots")
