"""Small fakes of the ports shared by several test modules (the clock's: tests/support/clock.py)."""

from __future__ import annotations

from tests.support.clock import FakeClock


class FakeLaneBroker:
    """The `LaneBroker` port in memory, with the adapter's rules: a dispatch
    takes a waiting job into a lane only below its cap (counting what the
    lane's queue holds, `held`), refuses a term the registry does not name, and
    `settle` turns what the test's "workers" finished (`finish`) into gone
    jobs or waiting ones with one more cloud attempt. `workers[queue]` is how
    many SAQ workers beat on a queue (`silent_s[queue]`: since the last lapsed)."""

    def __init__(self, clock: FakeClock | None = None, workers: dict[str, int] | None = None) -> None:
        from reconciler.core.live.records import QueuedJob

        self.clock = clock or FakeClock()
        self._jobs: dict[str, QueuedJob] = {}
        self._queue_of: dict[str, str] = {}  # dispatched job -> its queue
        self._cloud: dict[str, bool] = {}
        self._ended: dict[str, bool] = {}  # dispatched job -> finished ok
        self.held: dict[str, int] = {}  # queue -> jobs queued or active there
        self.workers: dict[str, int] = dict(workers or {})
        self.silent_s: dict[str, float] = {}
        # phaze's agents table: agent id -> (seconds since last_seen_at or None, revoked)
        self.agents: dict[str, tuple[float | None, bool]] = {}
        self.fence = 0
        self.closed = False

    def phaze_agents(self, agent_ids):
        from reconciler.core.live.models import PhazeAgentSeen, phaze_agent_status

        out = {}
        for agent_id in agent_ids:
            if agent_id in self.agents:
                ago, revoked = self.agents[agent_id]
                out[agent_id] = phaze_agent_status(agent_id, seen_ago_s=ago, revoked=revoked)
            else:
                out[agent_id] = PhazeAgentSeen(agent_id=agent_id, reason="no row in phaze's agents table (not registered with phaze)")
        return out

    def enqueue(self, jobs):
        from reconciler.core.live.records import QueuedJob
        from reconciler.core.timestamps import from_epoch_seconds

        for job_id, duration in jobs:
            self._jobs.setdefault(job_id, QueuedJob(job_id=job_id, enqueued_at=from_epoch_seconds(self.clock.now()), duration_s=duration))
        return [self._jobs[job_id] for job_id in dict.fromkeys(j for j, _ in jobs)]

    def jobs(self):
        return sorted(self._jobs.values(), key=lambda j: j.enqueued_at)  # stable: enqueue order within a time

    def _fenced(self, fence):
        """The adapter's fence: the registry's current term must be the fence's; the row records it."""
        from reconciler.ports import StaleDispatcher

        refused = fence.refusal()
        if refused is not None:
            raise StaleDispatcher(refused)
        self.fence = fence.term

    def dispatch(self, job_id, target, fence):
        from reconciler.core.timestamps import from_epoch_seconds

        self._fenced(fence)
        job = self._jobs.get(job_id)
        if job is None or not job.waiting or self.held.get(target.queue, 0) >= target.cap:
            return None
        self.held[target.queue] = self.held.get(target.queue, 0) + 1
        self._queue_of[job_id] = target.queue
        self._cloud[job_id] = target.cloud
        self._jobs[job_id] = job.model_copy(update={"lane": target.lane, "dispatched_at": from_epoch_seconds(self.clock.now())})
        return self._jobs[job_id]

    def finish(self, job_id: str, *, ok: bool = True) -> None:
        """A worker ended the job: its slot is free now, `settle` reports it."""
        queue = self._queue_of[job_id]
        self.held[queue] -= 1
        self._ended[job_id] = ok

    def settle(self):
        from reconciler.core.live.records import SettledJob

        out = []
        for job_id, ok in sorted(self._ended.items()):
            job = self._jobs[job_id]
            assert job.lane is not None
            if ok:
                del self._jobs[job_id]
                out.append(SettledJob(job_id=job_id, lane=job.lane, outcome="complete", attempts=job.attempts))
            else:
                again = job.model_copy(update={"lane": None, "dispatched_at": None, "attempts": job.attempts + int(self._cloud[job_id])})
                self._jobs[job_id] = again
                out.append(SettledJob(job_id=job_id, lane=job.lane, outcome="failed", attempts=again.attempts))
            del self._queue_of[job_id]
        self._ended.clear()
        return out

    def active_runs(self):
        """No run of this fake ever crashes (tests/integration/test_lane_crash_pg.py has real ones)."""
        from reconciler.core.scheduling.lanes import BrokerRuns

        return BrokerRuns(now_s=self.clock.now(), broker_up_s=0.0)

    def settle_crashed(self, crashed, fence):
        self._fenced(fence)
        return []

    def sweep_superseded(self):
        return []

    def lane_states(self, queues):
        from reconciler.core.live.models import SnapshotLane

        return [
            SnapshotLane(
                id=lane_id,
                in_flight=self.held.get(queue, 0),
                queue=queue,
                workers=self.workers.get(queue, 0),
                workers_silent_s=None if self.workers.get(queue, 0) else self.silent_s.get(queue),
            )
            for lane_id, queue in queues.items()
        ]

    def close(self) -> None:
        self.closed = True
