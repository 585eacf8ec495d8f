"""The leader's loop (fabric-leader.service): campaign, keep the lease, watch, reschedule, publish.

Talks to the world only through the `Registry` Protocol and the callables it is
given, so tests drive it with any backend and a fake scheduler.

One `step()`:
  1. reload the desired state (an invalid push keeps the last good one);
  2. not leading: campaign once. Leading: renew the lease; a failed renewal
     means the term is over (another candidate may lead already);
  3. leading: advance the node lifecycle (fenced by the term), take a
     snapshot, run the scheduler and publish the plan when it differs from
     the newest one (so the epoch moves only when the plan does);
  4. leading, with a `scaling` step: decide bursts and scaling over the
     snapshot, the queue depth (waiting lane jobs + replicas deferred for
     capacity) and the persisted state, and carry the actions out
     (`reconciler.engine.scaling_step`: the only place they are executed).
`run()` repeats it, waiting between steps on `Registry.wait_for_change`: a node
lost or joined, a drain, or the leader key changing wakes it at once; else it
wakes every third of the lease TTL, in time to renew.

If the registry is unreachable the loop says so and retries; it never acts on
a plan it could not publish. On stop it resigns, so a successor need not wait
for the lease to lapse.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.live.records import Leadership
from reconciler.engine.scaling_step import ScalingStep
from reconciler.ports import Audit, CommandRunner, NotLeader, Registry, RegistryUnavailable

# schedule(snapshot, desired, *, leader, epoch) -> FleetPlan (reconciler.core.scheduling.placement.schedule)
Scheduler = Callable[..., FleetPlan]


def same_plan(a: FleetPlan | None, b: FleetPlan | None) -> bool:
    """Equal apart from who made it, when and under which epoch."""
    if a is None or b is None:
        return a is b
    ignore = {"epoch", "leader", "created"}
    return a.model_dump(exclude=ignore) == b.model_dump(exclude=ignore)


@dataclass
class LeaderLoop:
    registry: Registry
    host: str
    load_desired: Callable[[], DesiredState]
    schedule: Scheduler
    lease_ttl_s: float
    log: Callable[[str], None] = print
    leadership: Leadership | None = None
    desired: DesiredState | None = None
    published: FleetPlan | None = None
    # Bursts and scaling; None: the leader only schedules (a one-shot leader
    # step of a reconcile pass, or tests of the plan alone).
    scaling: ScalingStep | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def _reload(self) -> None:
        try:
            self.desired = self.load_desired()
        except Exception as exc:  # DesiredStateError or an unreadable directory
            if self.desired is None:
                raise
            self.log(f"desired state invalid, keeping the last good one: {exc}")

    def step(self) -> None:
        self._reload()
        assert self.desired is not None
        if self.host not in self.desired.fleet.fleet.leader_candidates:
            if self.leadership is not None:
                self.log(f"{self.host} is no longer a leader candidate: resigning")
                self.registry.resign(self.leadership)
                self.leadership = None
            return
        if self.leadership is None:
            self.leadership = self.registry.campaign(self.host, self.lease_ttl_s)
            if self.leadership is None:
                return
            self.log(f"{self.host} leads from epoch {self.leadership.epoch}")
        elif not self.registry.renew(self.leadership):
            self.log(f"{self.host} lost the lease of epoch {self.leadership.epoch}")
            self.leadership = None
            return
        try:
            for event in self.registry.advance_lifecycle(self.leadership):
                self.log(f"node {event}")
            self._publish()
        except NotLeader as exc:
            self.log(str(exc))
            self.leadership = None

    def _publish(self) -> None:
        assert self.desired is not None and self.leadership is not None
        snapshot: Snapshot = self.registry.snapshot(lanes=[lane.id for lane in self.desired.lanes])
        newest = self.registry.newest_plan()
        plan = self.schedule(snapshot, self.desired, leader=self.host, epoch=snapshot.epoch)
        if not same_plan(plan, newest):
            self.published = self.registry.publish_plan(self.leadership, plan)
            self.log(
                f"published plan epoch {self.published.epoch}: {len(self.published.placements)} placements, {len(self.published.deferred)} deferred"
            )
        if self.scaling is not None:
            # After the plan: its deferred replicas are part of the queue depth,
            # and what scaling changes shows in the next pass's snapshot.
            self.scaling.run(self.leadership, self.desired, snapshot, plan)

    def step_and_resign(self) -> None:
        """One step, then resign: the next one-shot process (`fabric leader run
        --once`) campaigns anew instead of waiting for this lease to lapse."""
        try:
            self.step()
        finally:
            if self.leadership is not None:
                self.registry.resign(self.leadership)
                self.leadership = None

    def wait_s(self) -> float:
        # Leading: renew three times per TTL. Following: the watch wakes us
        # when the leader key goes; the timeout is the fallback (sqlite).
        return max(0.1, self.lease_ttl_s / 3)

    def _wait(self) -> None:
        """Until a change or `wait_s`, in slices of at most half a second so a
        stop request (SIGTERM) is honoured quickly."""
        slices = max(1, math.ceil(self.wait_s() / 0.5))
        for _ in range(slices):
            if self._stop.is_set() or self.registry.wait_for_change(self.wait_s() / slices):
                return

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        self.registry.wait_for_change(0)  # arm the watch before the first step
        backoff = 0.5
        while not self._stop.is_set():
            try:
                self.step()
                backoff = 0.5
                self._wait()
            except RegistryUnavailable as exc:
                self.log(f"registry unreachable, retrying in {backoff:g} s: {exc}")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.wait_s())
        if self.leadership is not None:
            try:
                self.registry.resign(self.leadership)
                self.log(f"{self.host} resigned")
            except RegistryUnavailable as exc:
                self.log(f"could not resign (the lease will lapse): {exc}")
            self.leadership = None


def candidate_loop(
    registry: Registry,
    host: str,
    load_desired: Callable[[], DesiredState],
    schedule: Scheduler,
    *,
    lease_ttl_s: float,
    runner: CommandRunner,
    audit: Audit | None,
    log: Callable[[str], None],
) -> LeaderLoop:
    """fabric-leader.service's loop: the plan, then bursts and scaling, whose
    actions go to `log` and (when given) as audit entries of their own."""
    scaling = ScalingStep(
        registry=registry,
        runner=runner,
        log=log,
        audit=audit,
        # Hooks run inside the step: they must leave time to renew the lease.
        hook_budget_s=lease_ttl_s / 2,
    )
    return LeaderLoop(
        registry=registry,
        host=host,
        load_desired=load_desired,
        schedule=schedule,
        lease_ttl_s=lease_ttl_s,
        log=log,
        scaling=scaling,
    )
