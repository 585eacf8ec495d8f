"""The lane dispatcher: waiting lane jobs, oldest first, into lane slots (multi-compute.md).

The job system (phaze's control plane) feeds the registry's queue
(`Registry.enqueue_jobs`); `fabric lane dispatch` runs `dispatch_pass` over it:

    for each waiting job, oldest enqueued first:
        choose_lane(lanes, LaneJob(waited_s, attempts))   (reconciler.core.scheduling.lanes, pure)
        a lane  -> Registry.start_job(job, lane, cap): one transaction that
                   takes a free slot of the lane only while the job still
                   waits, so however many dispatchers race, no lane ever has
                   more than `cap` jobs and no job runs twice
        a hold  -> the job stays queued; the event carries the hold reason

A lost race (the slot or the job taken by another dispatcher between the read
and the transaction) re-reads the lanes and decides again; a job another
dispatcher started is reported as such. Lanes come from the desired state
(kind, rank, cap) and the registry's snapshot (`lanes.lane_views`: each lane's
health from its agent host's node and agent unit, its claimed slots, and its
host's capacity left beside the services placed there; plain `claim_slot`
holders share the same caps). The lane's cap is taken atomically by
`start_job`; the host's capacity is read with the snapshot, so two dispatchers
racing for the last host slot can both win it until the next read.

Also here: `run_dispatcher` (`fabric lane dispatch`'s loop), `finish_job`
(`fabric lane done/fail`) and `lane_status` (`fabric lane status`).

Talks to the registry only through its Protocol; `reconciler.cli.lane` wires it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan, HoldReason, LaneView
from reconciler.core.live.records import QueuedJob, ScalingRecord
from reconciler.core.scheduling.lanes import LaneJob, choose_lane, lane_views, sort_key, take_slot
from reconciler.core.timestamps import utc
from reconciler.engine.scaling_step import queue_depth
from reconciler.ports import Registry, RegistryError, RegistryUnavailable

# Lost races in a row before a pass gives up on a job (each loss means another
# dispatcher made progress, so this only trips under a pathological storm).
RETRIES = 20

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

    def as_json(self) -> dict:
        return {
            "job": self.job,
            "backend": self.lane,
            "slot": self.slot,
            "hold": self.hold,
            "waited_s": round(self.waited_s, 3),
            "attempts": self.attempts,
            "taken_elsewhere": self.taken_elsewhere,
        }

    def text(self) -> str:
        seen = f"waited {self.waited_s:.0f}s, attempts {self.attempts}"
        if self.lane is not None:
            return f"{self.job} -> {self.lane} slot {self.slot} ({seen})"
        if self.taken_elsewhere:
            return f"{self.job}: started by another dispatcher"
        return f"{self.job} held: {self.hold}: {HOLD_MEANING.get(self.hold or '', '')} ({seen})"


def job_view(job: QueuedJob, now: datetime) -> LaneJob:
    return LaneJob(waited_s=max(0.0, (utc(now) - utc(job.enqueued_at)).total_seconds()), attempts=job.attempts, duration_s=job.duration_s)


def current_lanes(registry: Registry, desired: DesiredState) -> tuple[dict[str, LaneView], datetime]:
    snapshot = registry.snapshot(lanes=[lane.id for lane in desired.lanes])
    return {view.id: view for view in lane_views(desired, snapshot)}, snapshot.now


def _started(views: dict[str, LaneView], lane: str) -> dict[str, LaneView]:
    """The views after a job started in `lane` (its host's capacity shrinks for every lane on it)."""
    return {view.id: view for view in take_slot(list(views.values()), lane)}


def dispatch_pass(registry: Registry, desired: DesiredState) -> list[DispatchEvent]:
    """One pass over the waiting jobs (see the module docstring)."""
    settings = desired.fleet.scheduler
    caps = {lane.id: lane.cap for lane in desired.lanes}
    views, now = current_lanes(registry, desired)
    events: list[DispatchEvent] = []
    for job in registry.lane_jobs():
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
            claim = registry.start_job(job.job_id, decision.lane, caps[decision.lane])
            if claim is not None:
                views = _started(views, decision.lane)
                event = DispatchEvent(job.job_id, wanted.waited_s, wanted.attempts, lane=claim.lane, slot=claim.slot)
                break
            again = next((j for j in registry.lane_jobs() if j.job_id == job.job_id), None)
            if again is None or not again.waiting:
                event = DispatchEvent(job.job_id, wanted.waited_s, wanted.attempts, taken_elsewhere=True)
                break
            views, _ = current_lanes(registry, desired)
        if event is None:
            raise RegistryError(f"job {job.job_id}: lost {RETRIES} races for a lane slot in a row")
        events.append(event)
    return events


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
    registry: Registry,
    desired: DesiredState,
    *,
    emit: Callable[[DispatchEvent], None],
    stop: threading.Event,
    interval_s: float,
    once: bool = False,
    log: Callable[[str], None] = print,
) -> None:
    """`dispatch_pass` every `interval_s` until `stop` is set (or one pass with
    `once`), each event to `emit`. A long-running dispatcher outlives a registry
    outage (jobs wait meanwhile, `log` says so); with `once` it raises."""
    while True:
        try:
            for event in dispatch_pass(registry, desired):
                emit(event)
        except RegistryUnavailable as exc:
            if once:
                raise
            log(f"registry unreachable, retrying: {exc}")
        if once or stop.wait(interval_s):
            return


@dataclass(frozen=True)
class FinishedJob:
    job: QueuedJob  # as the registry keeps it afterwards (attempts counted)
    lane: str  # the lane it ran in ('?' when its claim was gone already)
    requeued: bool


def finish_job(registry: Registry, desired: DesiredState, job_id: str, *, failed: bool) -> FinishedJob | None:
    """The job is done (or `failed`): its slot is free; a failed job waits again,
    one more cloud attempt counted if it ran in a compute lane. None when it was not running."""
    running = next((j for j in registry.lane_jobs() if j.job_id == job_id), None)
    kinds = {lane.id: lane.kind for lane in desired.lanes}
    cloud = running is not None and running.claim is not None and kinds.get(running.claim.lane) == "compute"
    finished = registry.finish_job(job_id, requeue=failed, count_attempt=failed and cloud)
    if finished is None:
        return None
    lane = running.claim.lane if running is not None and running.claim is not None else "?"
    return FinishedJob(job=finished, lane=lane, requeued=failed)


@dataclass(frozen=True)
class LaneStatus:
    """What `fabric lane status` shows: lanes, jobs with what a pass would do to
    each waiting one now, the plan's deferred work, the leader's scaling record."""

    now: datetime
    lanes: list[LaneView]  # by (rank, id)
    jobs: list[QueuedJob]
    predicted: dict[str, DispatchEvent]  # waiting job id -> its decision now
    plan: FleetPlan | None
    scaling: ScalingRecord

    @property
    def queue_depth(self) -> int:
        return queue_depth(self.jobs, self.plan)

    @property
    def running(self) -> list[QueuedJob]:
        return [j for j in self.jobs if j.claim is not None]

    @property
    def waiting(self) -> list[QueuedJob]:
        return [j for j in self.jobs if j.waiting]

    def as_json(self) -> dict:
        return {
            "now": self.now.isoformat(),
            "queue_depth": self.queue_depth,
            "lanes": [v.model_dump() for v in self.lanes],
            "waiting": [{**self.predicted[j.job_id].as_json(), "enqueued_at": j.enqueued_at.isoformat()} for j in self.waiting],
            "running": [
                {"job": j.job_id, "lane": j.claim.lane, "slot": j.claim.slot, "since": j.claim.claimed_at.isoformat(), "attempts": j.attempts}
                for j in self.running
                if j.claim is not None
            ],
            "deferred": [d.model_dump() for d in self.plan.deferred if not d.inadmissible] if self.plan else [],
            "scaling": self.scaling.model_dump(mode="json", exclude={"state"}),
        }


def lane_status(registry: Registry, desired: DesiredState) -> LaneStatus:
    views, now = current_lanes(registry, desired)
    jobs = registry.lane_jobs()
    return LaneStatus(
        now=now,
        lanes=sorted(views.values(), key=lambda v: (v.rank, v.id)),
        jobs=jobs,
        predicted=predicted_holds(jobs, views, desired, now),
        plan=registry.newest_plan(),
        scaling=registry.scaling_record(),
    )
