"""The lane dispatcher: waiting lane jobs, oldest first, into lane queues (multi-compute.md).

The job system (phaze's control plane) hands jobs to the lane queue
(`LaneBroker.enqueue`: an id and the file's duration); `fabric lane dispatch`
runs `dispatch_pass` over them:

    crashed: runs whose worker is gone (`settle_crashed`: the facts from
            LaneBroker.active_runs, the decision core.scheduling.lanes'
            crashed_runs) wait again, one more cloud attempt when they ran
            in a compute lane, and are dispatched again in this same pass;
            a run settled so that finished late after all is reported
            (superseded) and ignored. The pass also says when the next
            active run would count as crashed if its worker stays silent
            (`DispatchOutcome.crash_check_in_s`, core's next_crash_check_s): the
            loops (`run_dispatcher`, the leader) wake then, CRASH_WAKE_MARGIN_S
            past it, instead of at their next interval, so a killed worker's
            job runs again within its lapse plus one pass's own work
    settle: jobs whose SAQ job ended leave (complete) or wait again (failed:
            one more cloud attempt when they ran in a compute lane)
    for each waiting job, oldest enqueued first:
        choose_lane(lanes, LaneJob(waited_s, attempts, duration_s))   (reconciler.core.scheduling.lanes, pure)
        a lane  -> LaneBroker.dispatch(job, LaneTarget(lane, queue, cap), fence):
                   one transaction under the dispatch lock that puts the
                   job on the lane's SAQ queue only while the job still waits
                   and the queue holds fewer than `cap` jobs, so however many
                   dispatchers race, no lane ever holds more than `cap` jobs
                   and no job runs twice; a dispatcher whose term is not the
                   registry's current one, read inside that transaction, is
                   refused (StaleDispatcher)
        a hold  -> the job stays waiting; the event carries the hold reason

A lost race (the slot or the job taken by another dispatcher between the read
and the transaction) re-reads the lanes and decides again; a job another
dispatcher started is reported as such. Lanes come from the desired state
(kind, rank, cap, queue) and a snapshot whose lanes are the lane queue's
(`with_lane_states`: each lane's jobs queued or active and its SAQ workers;
`lanes.lane_views` adds its host's health and capacity). The lane's cap is
taken atomically by `dispatch`; the host's capacity is read with the
snapshot, so two dispatchers racing for the last host slot can both win it
until the next read.

The fence (`dispatcher_fence`): the leader's term as the registry assigned
it (`LeaderInfo.term`), read at the start of every pass, and checked against
the registry inside every fenced transaction: nothing a broker client writes
can stop dispatch, and a deposed leader's dispatch is refused as soon as the
registry names another term.

Also here: `run_dispatcher` (`fabric lane dispatch`'s loop) and
`lane_status` (`fabric lane status`).

Talks to the registry and the lane queue only through their Protocols;
`reconciler.cli.lane` wires them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime

from reconciler.core.desired.model import PHAZE_QUEUE_PREFIX, DesiredState
from reconciler.core.live.models import FleetPlan, HoldReason, LaneView, PhazeAgentSeen, Snapshot
from reconciler.core.live.records import QueuedJob, ScalingRecord, SettledJob
from reconciler.core.scheduling.lanes import LaneJob, choose_lane, crash_timing, crashed_runs, lane_views, next_crash_check_s, sort_key, take_slot
from reconciler.core.timestamps import utc
from reconciler.engine.lane_states import lane_targets, with_lane_states
from reconciler.engine.scaling_step import queue_depth
from reconciler.ports import (
    Clock,
    DispatchFence,
    FleetReads,
    LaneBroker,
    LaneBrokerError,
    LaneBrokerUnavailable,
    RegistryError,
    RegistryReads,
    RegistryUnavailable,
)

# Lost races in a row before a pass gives up on a job (each loss means another
# dispatcher made progress, so this only trips under a pathological storm).
RETRIES = 20

# How long past a run's crash moment (core's crash_due_s: the rule is
# "past", and the broker's clock is read a little after the wake) a loop
# wakes to settle it.
CRASH_WAKE_MARGIN_S = 0.05

# What would release a held job, for people reading `fabric lane` output.
HOLD_MEANING: dict[str, str] = {
    "no_free_slots": "every lane it may use is full or offline",
    "local_spill_not_reached": "the cloud lanes are full and it has not waited long enough to spill to local",
    "cloud_attempts_exhausted": "its cloud attempts are spent and the local lane has no free slot",
}


@dataclass(frozen=True)
class DispatchEvent:
    """One job's outcome in a pass: started in a lane slot, held with a reason, or taken by another dispatcher."""

    job: str
    waited_s: float
    attempts: int
    lane: str | None = None
    slot: int | None = None
    hold: HoldReason | None = None
    taken_elsewhere: bool = False
    # A settled job: how its SAQ job ended in `lane` (complete, failed, aborted,
    # vanished, crashed; superseded: a run settled as crashed finished late).
    outcome: str | None = None
    # Why it crashed, or which superseded run finished how.
    reason: str | None = None

    def as_json(self) -> dict:
        return {
            "job": self.job,
            "lane": self.lane,
            "slot": self.slot,
            "hold": self.hold,
            "waited_s": round(self.waited_s, 3),
            "attempts": self.attempts,
            "taken_elsewhere": self.taken_elsewhere,
            "outcome": self.outcome,
            **({"reason": self.reason} if self.reason is not None else {}),
        }

    def text(self) -> str:
        seen = f"waited {self.waited_s:.0f}s, attempts {self.attempts}"
        if self.outcome == "complete":
            return f"{self.job} done in {self.lane}"
        if self.outcome == "superseded":
            return f"{self.job}: {self.reason}"
        if self.outcome == "crashed":
            return f"{self.job} crashed in {self.lane} ({self.reason}): waiting again (attempts {self.attempts})"
        if self.outcome is not None:
            return f"{self.job} {self.outcome} in {self.lane}: waiting again (attempts {self.attempts})"
        if self.lane is not None:
            return f"{self.job} -> {self.lane} slot {self.slot} ({seen})"
        if self.taken_elsewhere:
            return f"{self.job}: started by another dispatcher"
        return f"{self.job} held: {self.hold}: {HOLD_MEANING.get(self.hold or '', '')} ({seen})"


def job_view(job: QueuedJob, now: datetime) -> LaneJob:
    return LaneJob(waited_s=max(0.0, (utc(now) - utc(job.enqueued_at)).total_seconds()), attempts=job.attempts, duration_s=job.duration_s)


def current_lanes(registry: FleetReads, lane_broker: LaneBroker, desired: DesiredState) -> tuple[dict[str, LaneView], datetime]:
    views, snapshot = _current(registry, lane_broker, desired)
    return views, snapshot.now


def _current(registry: FleetReads, lane_broker: LaneBroker, desired: DesiredState) -> tuple[dict[str, LaneView], Snapshot]:
    snapshot = with_lane_states(registry.snapshot(lanes=[lane.id for lane in desired.lanes]), lane_broker, desired)
    return {view.id: view for view in lane_views(desired, snapshot)}, snapshot


def _started(views: dict[str, LaneView], lane: str) -> dict[str, LaneView]:
    """The views after a job started in `lane` (its host's capacity shrinks for every lane on it)."""
    return {view.id: view for view in take_slot(list(views.values()), lane)}


def _settled_event(job: SettledJob) -> DispatchEvent:
    return DispatchEvent(job.job_id, 0.0, job.attempts, lane=job.lane, outcome=job.outcome, reason=job.reason)


@dataclass(frozen=True)
class DispatchOutcome:
    """One dispatch pass: its events, and in how many seconds (from its read
    of the active runs) the next active run would count as crashed if its
    worker stays silent (None: no such run)."""

    events: list[DispatchEvent]
    crash_check_in_s: float | None = None

    def wake_in_s(self, interval_s: float) -> float:
        """How long a loop waits before its next pass: `interval_s`, or less
        when a run's crash moment comes first (CRASH_WAKE_MARGIN_S past it)."""
        if self.crash_check_in_s is None:
            return interval_s
        return min(interval_s, self.crash_check_in_s + CRASH_WAKE_MARGIN_S)


def settle_crashed(
    lane_broker: LaneBroker, desired: DesiredState, fence: DispatchFence, emit: Callable[[DispatchEvent], None] | None = None
) -> list[DispatchEvent]:
    """The runs whose worker is gone settled as crashed (their jobs wait
    again), then the late finishes of runs settled so before (superseded,
    ignored); each event also to `emit` as soon as its change committed.
    The facts are the broker's (`active_runs`, one transaction), the
    decision core's (`crashed_runs`); raises StaleDispatcher when a newer
    dispatcher runs."""
    return _settle_crashed(lane_broker, desired, fence, emit).events


def _settle_crashed(
    lane_broker: LaneBroker, desired: DesiredState, fence: DispatchFence, emit: Callable[[DispatchEvent], None] | None
) -> DispatchOutcome:
    events: list[DispatchEvent] = []
    out = _emitting(events, emit)
    timing = crash_timing(desired.fleet.scheduler)
    seen = lane_broker.active_runs()
    crashed = crashed_runs(seen, timing)
    for job in lane_broker.settle_crashed(crashed, fence) if crashed else []:
        out(_settled_event(job))
    for job in lane_broker.sweep_superseded():
        out(_settled_event(job))
    return DispatchOutcome(events, next_crash_check_s(seen, timing))


def _emitting(events: list[DispatchEvent], emit: Callable[[DispatchEvent], None] | None) -> Callable[[DispatchEvent], None]:
    """Append to `events` and hand to `emit` at once (`dispatch_pass`'s and
    `settle_crashed`'s `emit`): a pass that fails after a change committed
    (a job settled complete, then the broker gone or a newer dispatcher)
    has already told it, though it returns nothing."""

    def out(event: DispatchEvent) -> None:
        events.append(event)
        if emit is not None:
            emit(event)

    return out


class PhazeDispatches(ValueError):
    """The fabric was asked to write jobs where phaze's control plane
    dispatches: a phaze fleet's lanes, or a phaze-agent-* queue."""


def refuse_phaze_lanes(desired: DesiredState) -> None:
    """The division of labour: in a phaze fleet ([phaze] api_url) phaze's
    control plane selects a lane and dispatches into its phaze-agent-*
    queues, so the fabric enqueues and dispatches nothing; the fabric's own
    lanes never write into a phaze-agent-* queue. Raises PhazeDispatches."""
    if desired.fleet.phaze_dispatches:
        raise PhazeDispatches(
            f"{desired.fleet_file}: phaze.api_url: this is a phaze fleet: phaze's control plane selects the lanes and dispatches "
            f"into its {PHAZE_QUEUE_PREFIX}* queues; the fabric writes no job there (it deploys, watches and steers)"
        )
    for target in lane_targets(desired).values():
        if target.queue.startswith(PHAZE_QUEUE_PREFIX):
            raise PhazeDispatches(f"lane {target.lane}: its queue {target.queue} is phaze's ({PHAZE_QUEUE_PREFIX}*): the fabric writes no job there")


def registry_term(registry: FleetReads) -> int:
    """The registry's current term: its leader record's (live, stale or
    resigned: the term is current until a candidate campaigns), 0 with no
    record. Raises LaneBrokerUnavailable when the registry cannot be read
    (a dispatch waits for it: no term, no dispatch)."""
    try:
        held = registry.leader_term()
    except RegistryError as exc:
        raise LaneBrokerUnavailable(f"the registry cannot confirm the dispatcher's term: {exc}") from None
    return held.term if held is not None else 0


def dispatcher_fence(registry: FleetReads, term: int | None = None) -> DispatchFence:
    """The fence a dispatcher runs under: `term` (the leader's own, `engine.leader`
    step 5) or, by hand, the registry's current term now, so a dispatcher run
    under that leader is not refused and a deposed leader's is; the broker
    checks it against the registry inside each fenced transaction."""
    return DispatchFence(registry_term(registry) if term is None else term, lambda: registry_term(registry))


def dispatch_pass(
    registry: RegistryReads,
    lane_broker: LaneBroker,
    desired: DesiredState,
    *,
    fence: DispatchFence | None = None,
    emit: Callable[[DispatchEvent], None] | None = None,
) -> list[DispatchEvent]:
    """One pass over the waiting jobs (see the module docstring); `fence`
    defaults to `dispatcher_fence(registry)`. Raises StaleDispatcher when the
    registry names another term."""
    return dispatch_once(registry, lane_broker, desired, fence=fence, emit=emit).events


def dispatch_once(
    registry: RegistryReads,
    lane_broker: LaneBroker,
    desired: DesiredState,
    *,
    fence: DispatchFence | None = None,
    emit: Callable[[DispatchEvent], None] | None = None,
) -> DispatchOutcome:
    """`dispatch_pass`, with when the next crash check is due (`DispatchOutcome`)."""
    refuse_phaze_lanes(desired)
    settings = desired.fleet.scheduler
    targets = {lane: replace(target, heartbeat_s=settings.lane_job_heartbeat_s) for lane, target in lane_targets(desired).items()}
    fence = dispatcher_fence(registry) if fence is None else fence
    crashes = _settle_crashed(lane_broker, desired, fence, emit)
    events = crashes.events
    out = _emitting(events, emit)
    for settled in lane_broker.settle():
        out(_settled_event(settled))
    views, now = current_lanes(registry, lane_broker, desired)
    for job in lane_broker.jobs():
        if not job.waiting:
            continue
        wanted = job_view(job, now)
        event: DispatchEvent | None = None
        # A lost race re-reads the job and the lanes and decides again.
        for _ in range(RETRIES):
            decision = choose_lane(sorted(views.values(), key=sort_key), wanted, settings)
            if decision.lane is None:
                event = DispatchEvent(job.job_id, wanted.waited_s, wanted.attempts, hold=decision.hold)
                break
            slot = views[decision.lane].in_flight
            started = lane_broker.dispatch(job.job_id, targets[decision.lane], fence)
            if started is not None:
                views = _started(views, decision.lane)
                event = DispatchEvent(job.job_id, wanted.waited_s, wanted.attempts, lane=decision.lane, slot=slot)
                break
            again = next((j for j in lane_broker.jobs() if j.job_id == job.job_id), None)
            if again is None or not again.waiting:
                event = DispatchEvent(job.job_id, wanted.waited_s, wanted.attempts, taken_elsewhere=True)
                break
            views, _ = current_lanes(registry, lane_broker, desired)
        if event is None:
            raise LaneBrokerError(f"job {job.job_id}: lost {RETRIES} races for a lane slot in a row")
        out(event)
    return crashes


def predicted_holds(jobs: list[QueuedJob], views: dict[str, LaneView], desired: DesiredState, now: datetime) -> dict[str, DispatchEvent]:
    """What a pass would decide now for each waiting job (read-only, for `fabric lane status`)."""
    settings = desired.fleet.scheduler
    current = dict(views)
    out = {}
    for job in jobs:
        if not job.waiting:
            continue
        wanted = job_view(job, now)
        decision = choose_lane(sorted(current.values(), key=sort_key), wanted, settings)
        if decision.lane is not None:
            current = _started(current, decision.lane)
        out[job.job_id] = DispatchEvent(job.job_id, wanted.waited_s, wanted.attempts, lane=decision.lane, hold=decision.hold)
    return out


def run_dispatcher(
    registry: RegistryReads,
    lane_broker: LaneBroker,
    desired: DesiredState,
    *,
    emit: Callable[[DispatchEvent], None],
    stop: threading.Event,
    interval_s: float,
    once: bool = False,
    log: Callable[[str], None] = print,
    clock: Clock | None = None,
) -> None:
    """`dispatch_pass` every `interval_s` until `stop` is set (or one pass with
    `once`), each event to `emit`; sooner when an active run's worker would
    lapse first (`DispatchOutcome.wake_in_s`, counted with `clock` from the
    pass's start, where it read the runs; without one from its end). A
    long-running dispatcher outlives an outage of the registry or the broker
    (jobs wait meanwhile, `log` says so); with `once` it raises. A
    StaleDispatcher always ends it."""
    while True:
        wait_s = interval_s
        started = clock.now() if clock is not None else None
        try:
            outcome = dispatch_once(registry, lane_broker, desired, emit=emit)
            wait_s = outcome.wake_in_s(interval_s)
            if started is not None and clock is not None and outcome.crash_check_in_s is not None:
                wait_s = max(0.0, min(wait_s, outcome.crash_check_in_s + CRASH_WAKE_MARGIN_S - (clock.now() - started)))
        except (RegistryUnavailable, LaneBrokerUnavailable) as exc:
            if once:
                raise
            log(f"unreachable, retrying: {exc}")
        if once or stop.wait(wait_s):
            return


def lane_hold(view: LaneView, queue: str | None, new_job: DispatchEvent) -> str | None:
    """Why `view` would not take a new job now (None: it would take one,
    though a lane of a better rank may take it first)."""
    if not view.available:
        return f"offline: {view.reason}"
    if view.full == "cap":
        return f"full: {view.in_flight}/{view.cap} jobs in {queue or 'its queue'}"
    if view.full == "host":
        return f"full: host {view.host} at capacity"
    if view.kind == "local" and new_job.lane != view.id and new_job.hold is not None:
        return new_job.hold
    return None


@dataclass(frozen=True)
class LaneStatus:
    """What `fabric lane status` shows: lanes, jobs with what a pass would do to
    each waiting one now, what a new job would get, the plan's deferred work,
    the leader's scaling record."""

    now: datetime
    lanes: list[LaneView]  # by (rank, id)
    queues: dict[str, str]  # lane id -> its SAQ queue
    jobs: list[QueuedJob]
    predicted: dict[str, DispatchEvent]  # waiting job id -> its decision now
    new_job: DispatchEvent  # what a job enqueued now (no duration, no attempts) would get
    plan: FleetPlan | None
    scaling: ScalingRecord
    # A phaze fleet: each lane's agent as phaze's own agents table shows it
    # (lane id -> it; the second signal beside the workers).
    agents: dict[str, PhazeAgentSeen] = field(default_factory=dict)

    @property
    def queue_depth(self) -> int:
        return queue_depth(self.jobs, self.plan)

    @property
    def running(self) -> list[QueuedJob]:
        return [j for j in self.jobs if not j.waiting]

    @property
    def waiting(self) -> list[QueuedJob]:
        return [j for j in self.jobs if j.waiting]

    def lane_json(self, view: LaneView) -> dict:
        return {
            "id": view.id,
            "kind": view.kind,
            "rank": view.rank,
            "cap": view.cap,
            "in_flight": view.in_flight,
            "queue": self.queues.get(view.id),
            "online": view.available,
            "reason": view.reason,
            "full": view.full,
            "host": view.host,
            "host_free": view.host_free,
            "workers": view.workers,
            "phaze_agent": self.agents[view.id].model_dump() if view.id in self.agents else None,
            "hold": lane_hold(view, self.queues.get(view.id), self.new_job),
        }

    def as_json(self) -> dict:
        return {
            "now": self.now.isoformat(),
            "queue_depth": self.queue_depth,
            "lanes": [self.lane_json(v) for v in self.lanes],
            "new_job": {"lane": self.new_job.lane, "hold": self.new_job.hold},
            "waiting": [{**self.predicted[j.job_id].as_json(), "enqueued_at": j.enqueued_at.isoformat()} for j in self.waiting],
            "running": [
                {
                    "job": j.job_id,
                    "lane": j.lane,
                    "queue": self.queues.get(j.lane or ""),
                    "since": j.dispatched_at.isoformat() if j.dispatched_at else None,
                    "attempts": j.attempts,
                }
                for j in self.running
            ],
            "deferred": [d.model_dump() for d in self.plan.deferred if not d.inadmissible] if self.plan else [],
            "scaling": self.scaling.model_dump(mode="json", exclude={"state"}),
        }


def lane_status(registry: RegistryReads, lane_broker: LaneBroker, desired: DesiredState) -> LaneStatus:
    views, snapshot = _current(registry, lane_broker, desired)
    now = snapshot.now
    jobs = lane_broker.jobs()
    decision = choose_lane(sorted(views.values(), key=sort_key), LaneJob(), desired.fleet.scheduler)
    return LaneStatus(
        now=now,
        lanes=sorted(views.values(), key=lambda v: (v.rank, v.id)),
        queues={lane_id: target.queue for lane_id, target in lane_targets(desired).items()},
        jobs=jobs,
        predicted=predicted_holds(jobs, views, desired, now),
        new_job=DispatchEvent("(new)", 0.0, 0, lane=decision.lane, hold=decision.hold),
        plan=registry.newest_plan(),
        scaling=registry.scaling_record(),
        agents={lane.id: lane.phaze_agent for lane in reversed(snapshot.lanes) if lane.phaze_agent is not None},
    )
