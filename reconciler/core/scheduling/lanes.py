"""Lane health and lane dispatch (multi-compute.md): which lanes may take work, which lane takes the next job.

Pure: the desired state and a snapshot in, `LaneView`s out (`lane_views`);
lanes and a job's age and attempts in, a `LaneDecision` out (`choose_lane`).
Nothing is sent anywhere; the caller carries the decision out. Every reader of
a lane's state (`fabric dispatch --lane`, `fabric lane status`, `fabric status`
and its page and metrics, the leader's plan, the lane dispatcher) reads the
views `lane_views` makes, so they all say the same thing.

Lanes come from the desired state (kind, rank, cap: `DesiredState.lanes`); a
snapshot lane that is not declared is ignored.

Health: where a lane's jobs run (`lane_host`)
    a compute lane's on its `push_host`, by its agent, the unit
    `agent_unit(lane.id)` (the name the renderer gives it); the local lane's
    on the control host (the first host with role "control"), by phaze's own
    processing there: no agent of the fabric's runs it.

A lane is online when all of these hold (`offline_reason`, checked in this
order; the first that fails is the lane's `reason`):
    1. it has a host: a local lane in a fleet without a control host has
       none ("no host has role control");
    2. that host's node is in the snapshot: a host that never beat, or whose
       facts were dropped when it was declared dead, is "not reporting";
    3. the node is active: not offline, dead or draining (drained or not),
       and not held off (flapping) at the snapshot's `now`;
    4. a compute lane's agent unit is active there: the node's heartbeat
       carries the ActiveState of each of its fabric units
       (`SnapshotNode.units`); an explicit state other than active (or
       reloading, which is active) is down ("fabric-agent-a1-arm64.service
       failed"). A node whose `units` is empty (a pass that does not
       activate) or lacks the unit says nothing about it: not down;
    5. a SAQ worker consumes the lane's queue: phaze's broker (SAQ on
       PostgreSQL) shows a worker whose heartbeat on that queue is fresh
       (`SnapshotLane.workers`), else "no SAQ worker on
       phaze-agent-a1-arm64 for 31 s" (the seconds since the newest
       heartbeat lapsed, while the broker remembers it). Both kinds: the
       local lane's queue is consumed by phaze's own processing. A
       snapshot lane whose `queue` is None (the broker was not read) says
       nothing about workers: not down.

One account of capacity, per host (`account_load`, also the scheduler's in
reconciler.core.scheduling.placement):
    Services placed on a host and lane jobs running on the lanes hosted there
    (`lane_host`) draw from the host's one `max_concurrent_tasks`.
        lane jobs(host)  = the jobs in those lanes' queues now, queued or
                           active (`SnapshotLane.in_flight`)
        host load        = services placed on it + lane jobs(host)
                           when the node says which part of its in_flight is
                           its services (`services_running`): the rest is
                           the lane jobs it read from the queues when it
                           beat, and the queues now are newer; else
                         = max(reported in_flight,
                               services placed on it + lane jobs(host))
    A node's reported `in_flight` already counts the lane jobs of its lanes
    (and the services active there) as measured when it beat, so lane jobs
    are never added to it: the two are two measurements of one account, and
    the larger (the more recent queue count, or work the plan does not know) wins.
    Never in_flight + lane jobs: that counts every lane job twice. The
    services running are not counted either when the node names them: the
    scheduler counts the services it places (a leader with no plan in force
    must not see a host's own services as foreign load and move them off).
    A lane's free slots = min(cap - in_flight, max_concurrent_tasks - host
    load), 0 when offline; `LaneView.full` says which one ran out ("cap"
    first when both did). A lane whose host is not reporting has no host
    account (it is offline anyway).

Which lanes may take a job (`eligible_lanes`):
    compute lane  online, a free slot, the job's cloud attempts are below
                  `scheduler.cloud_attempts` (a job whose cloud attempts are
                  spent only goes local), and the job is not short: a job
                  whose duration is known and below
                  `scheduler.cloud_route_threshold_s` never goes to the
                  cloud (phaze's PHAZE_CLOUD_ROUTE_THRESHOLD_SEC: pushing a
                  short file out costs more than processing it at home).
    local lane    online, a free slot, and at least one of
                  - no compute lane is online (every one offline, or none
                    declared): immediately;
                  - the job is short (above): immediately;
                  - the job has waited >= `scheduler.local_spill_after_s`;
                  - its cloud attempts >= `scheduler.cloud_attempts`.
    The choice is the minimum of (rank, in_flight/cap, id) among them, so the
    cheapest lane fills first and equal ranks share by utilization. An offline
    lane is simply not eligible: it never stalls the others.

A hold always carries the reason, chosen by what would release the job:
    cloud_attempts_exhausted  the job's cloud attempts are spent, so only a
                              local lane may take it, and none has a free slot
                              (full or offline, or no local lane declared).
    local_spill_not_reached   every online compute lane is full and a
                              local lane has a free slot, but the job has not
                              waited `local_spill_after_s` yet: time will
                              release it.
    no_free_slots             otherwise: no lane the job may use has a free
                              slot (all full, or offline), and waiting for the
                              spill gate would not help either.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from fractions import Fraction

from reconciler.core.desired.model import DesiredState, Lane, SchedulerSettings
from reconciler.core.live.host_load import RUNNING_STATES
from reconciler.core.live.models import HoldReason, LaneView, Placement, Snapshot, SnapshotLane, SnapshotNode
from reconciler.core.timestamps import utc


@dataclass(frozen=True)
class LaneDecision:
    lane: str | None
    hold: HoldReason | None

    def as_json(self) -> dict[str, str | None]:
        return {"lane": self.lane, "hold": self.hold}


@dataclass(frozen=True)
class LaneJob:
    """One job waiting for a lane: how long it has waited, how often the cloud failed it."""

    waited_s: float = 0.0
    attempts: int = 0
    # The job's media duration in seconds, None when the job system did not
    # say (such a job may go anywhere).
    duration_s: float | None = None

    def short(self, settings: SchedulerSettings) -> bool:
        """Below the cloud route threshold: local lanes only."""
        return self.duration_s is not None and self.duration_s < settings.cloud_route_threshold_s


def agent_unit(workload_id: str) -> str:
    """The unit that runs a lane's agent (or a placed service) on its host:
    `fabric-agent-a1-arm64.service`. The renderer names the units it writes
    with this, and lane health looks the agent's state up by it."""
    return f"fabric-agent-{workload_id}.service"


def lane_host(desired: DesiredState, lane: Lane) -> str | None:
    """The host `lane`'s jobs run on: a compute lane's push host (its agent
    runs there), the local lane's control host (the first host with role
    control); None when the fleet has no control host for a local lane."""
    if lane.kind == "compute":
        return lane.push_host
    control = desired.hosts_with_role("control")
    return control[0] if control else None


def _clock_time(moment: datetime) -> str:
    return utc(moment).strftime("%H:%M:%S")


def offline_reason(lane: Lane, host: str | None, node: SnapshotNode | None, now: datetime, seen: SnapshotLane | None = None) -> str | None:
    """Why `lane` (its jobs on `host`, whose node is `node`, its queue as the
    broker shows it `seen`) is offline at `now`, or None when it is online
    (the checks of the module docstring)."""
    if host is None:
        return "no host has role control to run the local lane"
    if node is None:
        return f"host {host} not reporting"
    if node.status in ("offline", "dead"):
        since = f" since {_clock_time(node.last_seen)}" if node.last_seen is not None else ""
        return f"host {host} {node.status}{since}"
    if node.drained:
        return f"host {host} drained"
    if node.status != "active":
        return f"host {host} {node.status}"
    if node.held_off_until is not None and utc(node.held_off_until) > utc(now):
        return f"host {host} held off until {_clock_time(node.held_off_until)} (flapping)"
    if lane.kind == "compute":
        unit = agent_unit(lane.id)
        state = node.units.get(unit)
        if state is not None and state not in RUNNING_STATES:
            return f"{unit} {state}"
    if seen is not None and seen.queue is not None and seen.workers == 0:
        silent = f" for {seen.workers_silent_s:.0f} s" if seen.workers_silent_s is not None else ""
        return f"no SAQ worker on {seen.queue}{silent}"
    return None


def lane_jobs_by_host(desired: DesiredState, in_flight: Mapping[str, int]) -> Counter[str]:
    """Lane jobs per host: each declared lane's jobs (`in_flight`, lane id ->
    jobs queued or active in its queue) counted on its host (`lane_host`)."""
    jobs: Counter[str] = Counter()
    for lane in desired.lanes:
        host = lane_host(desired, lane)
        if host is not None and in_flight.get(lane.id, 0):
            jobs[host] += in_flight[lane.id]
    return jobs


def account_load(node: SnapshotNode, services: int, lane_jobs: int) -> int:
    """The host's one account (module docstring) with `services` placed on it."""
    if node.services_running is None:
        return max(node.in_flight, services + lane_jobs + node.engine_tasks)
    # The node said which part of in_flight is its services: the scheduler
    # counts the services it places instead. The rest of in_flight is the
    # jobs on its lanes, which the node read from their queues when it beat:
    # the queues now are newer, so a slot freed since is free at once. Other
    # engines' tasks (Ray's, read by the leader) join from a field of their own.
    return services + lane_jobs + node.engine_tasks


def lane_views(desired: DesiredState, snapshot: Snapshot, placements: Sequence[Placement] | None = None) -> list[LaneView]:
    """Every declared lane with its health and capacity at `snapshot.now`, in
    sort-key order. `placements` are the services placed (default: the
    snapshot's, the plan in force); the leader passes the plan it makes."""
    # The first record of a node or lane wins (as in the scheduler).
    nodes: dict[str, SnapshotNode] = {}
    for seen_node in snapshot.nodes:
        nodes.setdefault(seen_node.node_id, seen_node)
    seen: dict[str, SnapshotLane] = {}
    for seen_lane in snapshot.lanes:
        seen.setdefault(seen_lane.id, seen_lane)
    in_flight = {lane_id: lane.in_flight for lane_id, lane in seen.items()}
    jobs = lane_jobs_by_host(desired, in_flight)
    services = Counter(p.node for p in (snapshot.placements if placements is None else placements))
    views = []
    for lane in desired.lanes:
        host = lane_host(desired, lane)
        node = nodes.get(host) if host is not None else None
        reason = offline_reason(lane, host, node, snapshot.now, seen.get(lane.id))
        host_free = None
        slack = 0
        if node is not None and host is not None:
            host_free = max(0, node.max_concurrent_tasks - account_load(node, services[host], jobs[host]))
            if node.services_running is None:
                slack = max(0, node.in_flight - services[host] - jobs[host] - node.engine_tasks)
        views.append(
            _view(
                LaneView(
                    id=lane.id,
                    kind=lane.kind,
                    rank=lane.rank,
                    cap=lane.cap,
                    in_flight=in_flight.get(lane.id, 0),
                    available=reason is None,
                    reason=reason,
                    host=host,
                    host_free=host_free,
                    host_slack=slack,
                    queue=seen_queue(seen.get(lane.id)),
                    workers=seen_workers(seen.get(lane.id)),
                )
            )
        )
    return sorted(views, key=sort_key)


def seen_queue(seen: SnapshotLane | None) -> str | None:
    """The lane's queue on the broker; None when the broker was not read."""
    return None if seen is None else seen.queue


def seen_workers(seen: SnapshotLane | None) -> int | None:
    """The fresh SAQ workers on the lane's queue; None when the broker was not read."""
    return None if seen is None or seen.queue is None else seen.workers


def _view(view: LaneView) -> LaneView:
    """`view` with `full` set from its counts: which account a full lane ran
    out of (its `reason` stays None: it is online)."""
    full = None
    if view.in_flight >= view.cap:
        full = "cap"
    elif view.host_free is not None and view.host_free <= 0:
        full = "host"
    return view.model_copy(update={"full": full})


def take_slot(views: Sequence[LaneView], lane_id: str) -> list[LaneView]:
    """The views after one more job started in `lane_id`: that lane has one
    more in flight and every lane on the same host one slot less of it, or
    one less of the host's slack (the account, the larger of its reported
    in_flight and services + lane jobs, grows only past it)."""
    chosen = next(v for v in views if v.id == lane_id)
    out = []
    for view in views:
        update: dict[str, int] = {}
        if view.id == lane_id:
            update["in_flight"] = view.in_flight + 1
        if view.host is not None and view.host == chosen.host and view.host_free is not None:
            if chosen.host_slack > 0:
                update["host_slack"] = view.host_slack - 1
            else:
                update["host_free"] = max(0, view.host_free - 1)
        out.append(_view(view.model_copy(update=update)) if update else view)
    return out


def sort_key(lane: LaneView) -> tuple[int, Fraction, str]:
    """multi-compute.md's SCHED-04 key: rank, then utilization, then id."""
    return (lane.rank, Fraction(lane.in_flight, lane.cap), lane.id)


def free_slots(lane: LaneView) -> int:
    """Slots a job may take now: none when offline, else the smaller of the
    lane's cap left and its host's capacity left."""
    if not lane.available:
        return 0
    left = lane.cap - lane.in_flight
    if lane.host_free is not None:
        left = min(left, lane.host_free)
    return max(0, left)


def has_free_slot(lane: LaneView) -> bool:
    return free_slots(lane) > 0


def eligible_lanes(lanes: Sequence[LaneView], job: LaneJob, settings: SchedulerSettings) -> list[LaneView]:
    """The lanes that may take `job` now (see the module docstring)."""
    attempts_spent = job.attempts >= settings.cloud_attempts
    short = job.short(settings)
    every_compute_offline = not any(lane.available for lane in lanes if lane.kind != "local")
    local_open = every_compute_offline or attempts_spent or short or job.waited_s >= settings.local_spill_after_s
    out = []
    for lane in lanes:
        if not has_free_slot(lane):
            continue
        if lane.kind == "local" and local_open:
            out.append(lane)
        elif lane.kind != "local" and not attempts_spent and not short:
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
