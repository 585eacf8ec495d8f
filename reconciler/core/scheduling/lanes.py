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
    if node.suspected:
        return f"suspected: {'; '.join(node.suspected)}"
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


def lanes_of_plan(lanes: Sequence[LaneView]) -> list[SnapshotLane]:
    """The lanes' queues as the leader saw them when it made a plan (the plan's
    `lanes`), as a snapshot's: what the edge's page shows of the lanes, so
    the edge needs no broker access. A lane the leader saw without its queue
    (the broker not read) has none here either."""
    return [
        SnapshotLane(id=view.id, in_flight=view.in_flight, queue=view.queue, workers=view.workers or 0)
        if view.queue is not None and view.workers is not None
        else SnapshotLane(id=view.id, in_flight=view.in_flight)
        for view in lanes
    ]


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


# -- crashed runs on the fabric's own lanes ----------------------------------
#
# A dispatched job runs as one SAQ job (a run, its key `<job id>.<n>`) on one
# SAQ worker. A worker that dies mid-job (SIGKILL, a lost host) leaves the run
# `active` for ever: no timeout, and its lock is nobody's. The dispatcher
# settles such a run as crashed (its slot freed, the job waiting again under
# the lane rules) once the facts below say the worker is gone. All times are
# the broker's (PostgreSQL's clock), in epoch seconds, except `touched_s`,
# which the worker's clock stamped.
#
#   lapse        a worker beats its stats row every `worker_beat_s`; the row
#                lives 1 s longer (saq's ttl); silence past that expiry for
#                `grace_s` more is a lapse. The goal: a killed worker's job
#                waits again within worker_beat_s + 1 + grace_s (the lapse)
#                plus one dispatch pass.
#   broker up    a broker that (re)started less than one lapse ago gave no
#                live worker the chance to beat since: nothing is crashed
#                yet (a broker restart must not end runs that go on).
#
# `crashed_reason`, checked in this order (the first that holds is the reason):
#   1. the run's record cannot be read (no SAQ worker can run it either);
#   2. its own SAQ heartbeat (when it has one) lapsed: untouched for longer
#      than heartbeat + grace since it was touched or the broker came up;
#   3. no worker began it (dequeued, then its worker died before starting
#      it) and it was dequeued more than one lapse ago;
#   4. its worker has no stats row (swept after expiry, or never written)
#      and the run was last touched more than one lapse ago;
#   5. its worker's stats row expired more than `grace_s` ago. saq writes the
#      expiry (NOW() + ttl) into a BIGINT column, so PostgreSQL rounds it to
#      the nearest whole second: the true expiry may be half a second earlier
#      than the row says (`STATS_EXPIRY_ROUNDING_S`), and the rule counts from
#      that earliest moment, so the lapse stays a bound, not a bound + 0.5 s.
#
# `crash_due_s` is the moment (broker clock) after which a run counts as
# crashed if nothing about it changes (no beat, no touch): the dispatcher
# wakes then (`next_crash_check_s`) instead of at its next interval, so a
# killed worker's job waits again within the lapse plus one pass's own work,
# not the lapse plus a whole interval plus that work.


# saq_stats.expire_at is a BIGINT: the expiry saq computes is rounded to the
# nearest second on its way in (rule 5 above).
STATS_EXPIRY_ROUNDING_S = 0.5


@dataclass(frozen=True)
class CrashTiming:
    """When a lane worker's silence means it is gone (see above)."""

    worker_beat_s: float
    grace_s: float

    @property
    def lapse_s(self) -> float:
        """From a worker's last beat to its jobs counting as crashed, at most."""
        return self.worker_beat_s + 1 + self.grace_s


def crash_timing(settings: SchedulerSettings) -> CrashTiming:
    return CrashTiming(worker_beat_s=settings.lane_worker_beat_s, grace_s=settings.lane_crash_grace_s)


@dataclass(frozen=True)
class ActiveRun:
    """A dispatched job's SAQ job while `active`, as the broker shows it."""

    job_id: str
    lane: str
    key: str
    readable: bool = True
    # The SAQ worker that began it (None: dequeued, not begun yet).
    worker: str | None = None
    touched_s: float | None = None
    heartbeat_s: float = 0.0
    # Its worker's stats row's expire_at (None: no row).
    worker_expires_s: float | None = None


@dataclass(frozen=True)
class BrokerRuns:
    """The active runs of the fabric's jobs and the broker's clock, read in one transaction."""

    now_s: float
    broker_up_s: float
    runs: tuple[ActiveRun, ...] = ()


@dataclass(frozen=True)
class CrashedRun:
    run: ActiveRun
    reason: str


def crashed_reason(run: ActiveRun, *, now_s: float, broker_up_s: float, timing: CrashTiming) -> str | None:
    """Why `run` counts as crashed at `now_s`, or None while it may still run (the rules above)."""
    lapse = timing.lapse_s
    if now_s - broker_up_s <= lapse:
        return None
    if not run.readable:
        return "its SAQ job record is unreadable"
    if run.heartbeat_s > 0 and run.touched_s is not None:
        silent = now_s - max(run.touched_s, broker_up_s)
        if silent > run.heartbeat_s + timing.grace_s:
            return f"its SAQ heartbeat lapsed: untouched for {silent:.0f} s (heartbeat {run.heartbeat_s:g} s)"
    idle = None if run.touched_s is None else now_s - run.touched_s
    if run.worker is None:
        if idle is None or idle > lapse:
            return "dequeued but never begun: its worker is gone"
        return None
    if run.worker_expires_s is None:
        if idle is None or idle > lapse:
            return f"its worker {run.worker} is gone (no stats)"
        return None
    lapsed = now_s - run.worker_expires_s
    if lapsed + STATS_EXPIRY_ROUNDING_S > timing.grace_s:
        return f"its worker {run.worker} stopped beating ({lapsed:.0f} s past its stats' expiry)"
    return None


def crash_due_s(run: ActiveRun, *, broker_up_s: float, timing: CrashTiming) -> float:
    """The broker-clock moment after which `run` counts as crashed (for every
    `now_s` past it `crashed_reason` names a reason) when nothing about it
    changes: its worker beats no more and nobody touches it. Never before
    the broker has been up one lapse (rule "broker up")."""
    lapse = timing.lapse_s
    dues = []
    if not run.readable:
        dues.append(float("-inf"))
    else:
        if run.heartbeat_s > 0 and run.touched_s is not None:
            dues.append(max(run.touched_s, broker_up_s) + run.heartbeat_s + timing.grace_s)
        if run.worker is not None and run.worker_expires_s is not None:
            dues.append(run.worker_expires_s - STATS_EXPIRY_ROUNDING_S + timing.grace_s)
        else:
            dues.append(float("-inf") if run.touched_s is None else run.touched_s + lapse)
    return max(broker_up_s + lapse, min(dues))


def next_crash_check_s(seen: BrokerRuns, timing: CrashTiming) -> float | None:
    """Seconds from `seen.now_s` until the first of its runs that does not
    count as crashed yet would, if its worker stays silent (`crash_due_s`);
    None when there is none (no run active, or every one already due: those
    are settled by the pass that read `seen`)."""
    dues = [crash_due_s(run, broker_up_s=seen.broker_up_s, timing=timing) for run in seen.runs]
    ahead = [due for due in dues if due > seen.now_s]
    return min(ahead) - seen.now_s if ahead else None


def crashed_runs(seen: BrokerRuns, timing: CrashTiming) -> list[CrashedRun]:
    """The runs of `seen` that count as crashed, with their reasons, in `seen`'s order."""
    out = []
    for run in seen.runs:
        reason = crashed_reason(run, now_s=seen.now_s, broker_up_s=seen.broker_up_s, timing=timing)
        if reason is not None:
            out.append(CrashedRun(run=run, reason=reason))
    return out
