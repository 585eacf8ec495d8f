"""The leader's loop (fabric-leader.service): campaign, keep the lease, watch, reschedule, publish.

Talks to the world only through the registry's `LeaderRegistry` role and the callables it is
given, so tests drive it with any backend and a fake scheduler.

One `step()`:
  1. reload the desired state (an invalid push keeps the last good one);
  2. not leading: campaign once. Leading: renew the lease; a failed renewal
     means the term is over (another candidate may lead already);
  3. leading: advance the node lifecycle (fenced by the term) and take a
     snapshot over one read of the registry (`LeaderRegistry.lead`), run the
     scheduler and publish the plan when it differs from the newest one (so
     the epoch moves only when the plan does);
  3a. suspicion (issue 30, core.scheduling.suspicion): the hosts' fast
     liveness records (`FleetReads.liveness`), Ray's dead nodes and, where
     the leader runs tailscale, its offline peers make nodes suspected; the
     suspects' memory goes on from the last plan's, and the scheduler
     hedges each single-replica service a suspected node runs. The leader
     also wakes when the first live liveness record lapses (etcd: its key's
     deletion wakes the watch at once);
  3b. with a `ray_state` port (the fleet runs Ray): Ray's state API joins the
     snapshot before scheduling (`ray_tasks.with_ray_view`: each host's Ray
     tasks in its load, a dead Ray node's worker unit failed) and the Ray
     workers to start or stop on idle capacity are decided and logged
     (`ray_tasks.decide_ray_workers`); an unreadable Ray is said and skipped;
  4. leading, with a `scaling` step: decide bursts and scaling over the
     snapshot, the queue depth (waiting lane jobs + replicas deferred for
     capacity) and the persisted state, and carry the actions out
     (`reconciler.engine.scaling_step`: the only place they are executed);
  5. leading, with a `lane_broker` (phaze's broker, `[phaze] queue_url_file`):
     the lane dispatcher's pass (`engine.dispatch.dispatch_pass`): finished
     lane jobs settled, waiting ones into lane slots by multi-compute.md's
     rules, fenced by this term (checked against the registry inside each
     dispatch's transaction), so a deposed leader's dispatch is refused by
     the broker even before its renewal fails. Jobs started and
     settled are logged; holds are not (they would repeat every step: `fabric
     lane status` shows them). `[phaze] leader_dispatches = false` leaves
     dispatching to `fabric lane dispatch` alone.
`run()` repeats it, waiting between steps on `LeaderRegistry.wait_for_change`: a node
lost or joined, a drain, or the leader key changing wakes it at once; else it
wakes every third of the lease TTL, in time to renew. Leading, it also wakes
when the first up node's last beat expires (`LeaderView.next_lapse`, by its
clock): a silent node is marked offline, and its work moved in a new plan, at
the moment its liveness lapses, not at a later step, even when the registry's
watch missed the expiry (etcd deletes the node's key when its lease lapses and
the watch reports it; sqlite only compares deadlines; both read a beat whose
own expiry has passed as lapsed). A lapse the registry does not show yet is
looked at again after `LAPSE_RECHECK_S`, twice as late each time it still
does not show. Dispatching the fabric's own lanes, it also wakes when the
next active run's worker would lapse (`engine.dispatch.DispatchOutcome`), so a
crashed run's job waits again, and is dispatched again, at that moment.

The leader never dies of a registry error. Whatever the registry raises
(`RegistryError` and its kinds: unreachable, permission denied, a request
refused, a plan too large) and a plan that could not be signed or was
numbered otherwise is a problem (`LeaderProblem`): said in the journal at
each attempt, written into the leader record at the next renewal (so `fabric
status`, the edge's page and metrics show it), and cleared, also said, by the
first step that succeeds. The loop keeps its term (it ends only when a
renewal fails or a write says `NotLeader`) and its last good plan (hosts keep
applying it), and tries again after a backoff that doubles from
`RETRY_FIRST_S` up to `wait_s` (a third of the lease: the term is renewed in
time). `run` returns only when `stop` is called (a signal). On stop it
resigns, so a successor need not wait for the lease to lapse.

Terms: the registry assigns each term (`Leadership.term`); every plan names
its term, the fleet and the registry prefix (`plan_in_term`), and a new term
publishes its own plan at its first step even when the placements are the
same (hosts apply only the current term's plan). Following, a candidate
wakes when the leader record goes stale unless renewed (`leader_term`'s
renewed_at + TTL) and campaigns, which takes over a record whose lease someone
keeps alive without renewing it.

The leader's host dead (issue 30): a follower does not wait for the record
to go stale when the leader's host's fast liveness record lapsed. Every step
(leading or following) reads the liveness records first; the leader writes
its own host's expiry into its record at each renewal
(`LeaderInfo.liveness_until`), so a candidate started after the lapse (etcd
deleted the key) knows it too. A follower takes the live term over
(`Candidacy.take_over`, a compare-and-swap on the record as read and the
host's record lapsed) when `leader_lapse` says so: a known expiry passed at
least [timing] liveness_s ago, the term not renewed since (a live leader
wakes at its own host's lapse and renews) and no full heartbeat of the host
since; it wakes for that moment (`takeover_due`). With the fast liveness off
or no record of that host ever seen, never: the stale record decides, as
before. A new term's memory of lapses starts from what it knows: the lapse
it took over on, the record it replaced (`liveness_until`) and the last
plan's suspects (`lapses_of_suspects`), so its first step suspects the dead
host and hedges its services. An old leader that was alive after all loses
its term: its renewal fails and every write and plan of its term is fenced.

Signed plans: when fabric.toml lists plan keys, every plan is signed before
it is published (`sign_plan`, through the `PlanSigner` port) under the epoch
the registry will give it, and a candidate whose key is missing or not
listed for it does not campaign (it says why and resigns if it led), so a
candidate that can sign leads instead. The newest plan is published again
when its signature does not verify (a forgery, or a retired key), so the
fleet never waits on a plan its hosts refuse.
"""

from __future__ import annotations

import gc
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime

from pydantic import ValidationError

from reconciler.core.desired.model import DesiredState, PlanKey
from reconciler.core.live.models import LEADER_PROBLEM_CHARS, FleetPlan, LaneSteering, LeaderProblem, Snapshot
from reconciler.core.live.plan_parts import PartsMemo, same_parts
from reconciler.core.live.records import LeaderInfo, Leadership
from reconciler.core.live.signing import canonical_plan, listed_key, verify_plan, with_signature
from reconciler.core.live.unreadable import problem_lines
from reconciler.core.probe.parsers import offline_peers
from reconciler.core.render.ray_node import RAY_WORKER_UNIT
from reconciler.core.scheduling.edge_upstreams import SOURCE as EDGE_SOURCE
from reconciler.core.scheduling.edge_upstreams import edge_failing, edge_records
from reconciler.core.scheduling.groups import Admission, admit_members, with_members
from reconciler.core.scheduling.lane_steering import decide_steering
from reconciler.core.scheduling.placement import running_placements
from reconciler.core.scheduling.ray_tasks import RayWorkerAction, decide_ray_workers, with_ray_view
from reconciler.core.scheduling.scaling import ScalingState
from reconciler.core.scheduling.suspicion import (
    advance_suspects,
    lapses_of_suspects,
    leader_lapse,
    next_liveness_lapse,
    note_hedges,
    remember_liveness,
    suspected,
    takeover_due,
    with_suspects,
)
from reconciler.core.timestamps import from_epoch_seconds, utc, utc_now, utc_stamp
from reconciler.engine.dispatch import DispatchEvent, dispatch_once, dispatcher_fence
from reconciler.engine.lane_states import with_lane_states
from reconciler.engine.scaling_step import ScalingStep
from reconciler.ports import (
    Audit,
    Clock,
    HookRunner,
    LaneBroker,
    LaneBrokerError,
    LeaderRegistry,
    NotLeader,
    PlanSigner,
    PlanSigningError,
    RayState,
    RayStateUnavailable,
    RegistryError,
    StaleDispatcher,
)

# schedule(snapshot, desired, *, leader, epoch) -> FleetPlan (reconciler.core.scheduling.placement.schedule)
Scheduler = Callable[..., FleetPlan]

# A lapse that is due but not shown by the registry yet is looked at again
# this soon (etcd checks for expired leases twice a second).
LAPSE_RECHECK_S = 0.25
# A follower campaigns this long after the leader record's stale time.
STALE_MARGIN_S = 0.05
# The first wait after a failed step; it doubles up to `LeaderLoop.wait_s`.
RETRY_FIRST_S = 0.5
# One settle in this many collects every generation (`LeaderLoop.settle`).
FULL_COLLECTION_EVERY = 20


def same_plan(a: FleetPlan | None, b: FleetPlan | None, memo: PartsMemo | None = None) -> bool:
    """Equal apart from who made it, when, under which epoch and signature:
    the same parts (`plan_parts.same_parts`), whatever the order the
    registry gives the placements back in."""
    if a is None or b is None:
        return a is b
    return same_parts(a, b, memo)


class PlanNotPublished(Exception):
    """The registry stored the plan under another epoch than it was signed for."""


def signing_key(signer: PlanSigner | None, keys: list[PlanKey], host: str) -> PlanKey:
    """The plan key of fabric.toml that `signer` holds for `host`; raises
    PlanSigningError when there is no signer, its key cannot be read, or
    fabric.toml does not list it for `host`."""
    if signer is None:
        raise PlanSigningError(f"fabric.toml lists plan keys but {host} has no plan signing key (--plan-key-file)")
    key = listed_key(keys, host, signer.public_key())
    if key is None:
        listed = ", ".join(k.id for k in keys if k.host == host) or "none"
        raise PlanSigningError(f"the {signer.describe()} is not one of {host}'s plan keys in fabric.toml (listed: {listed})")
    return key


def plan_in_term(plan: FleetPlan, leadership: Leadership, desired: DesiredState) -> FleetPlan:
    """`plan` naming its term (the registry's, `Leadership.term`), the fleet
    and the registry prefix: what the leader signs, so hosts apply it only as
    the plan of the registry's current term in this fleet and registry."""
    return plan.model_copy(update={"term": leadership.term, "fleet": desired.fleet.fleet.name, "prefix": desired.fleet.registry.prefix})


def sign_plan(plan: FleetPlan, signer: PlanSigner, key: PlanKey, memo: PartsMemo | None = None) -> FleetPlan:
    """`plan` signed over its canonical form by `key`'s private half."""
    return with_signature(plan, key.id, signer.sign(canonical_plan(plan, memo)))


@dataclass
class LeaderLoop:
    registry: LeaderRegistry
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
    # The candidate's plan signing key; needed when fabric.toml lists plan keys.
    signer: PlanSigner | None = None
    # Ray's state API (None: the fleet runs no Ray, or this leader cannot see it).
    ray_state: RayState | None = None
    # The Ray worker actions decided last step, logged only when they change.
    ray_workers: list[RayWorkerAction] = field(default_factory=list)
    # phaze's broker: the lanes' jobs and workers in the snapshot the plan is
    # made from (None: no [phaze] queue_url_file, the lanes carry no load).
    lane_broker: LaneBroker | None = None
    # The registry's clock (lapses are its times); None: no wake at a lapse,
    # only the registry's own (a one-shot leader step never waits).
    clock: Clock | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _cannot_sign: str | None = None
    # When the first up node's beat expires, as the last step read it, and
    # how long to wait before looking again while that lapse does not show.
    _next_lapse: datetime | None = None
    _recheck_s: float = LAPSE_RECHECK_S
    _lapse_was_due: bool = False
    # The registry's unreadable records as the last step's read named them
    # (`problem_lines`): each is logged once, when it appears or goes.
    _unreadable: tuple[str, ...] = ()
    # Leading: when (by `clock`) the next active run of the fabric's own
    # lanes would count as crashed, as the last dispatch read it (None: none).
    _crash_check_at: float | None = None
    # Following: when the leader record goes stale unless renewed (None: unknown, or no record),
    # and when its leader's host's liveness lapse would be old enough for a takeover (None: none known).
    _held_stale_at: datetime | None = None
    _takeover_at: datetime | None = None
    # `tailscale status --json` where the leader runs tailscale: a source of
    # suspicion (issue 30); None: none. Raises OSError or ValueError.
    tailscale_status: Callable[[], str] | None = None
    # The newest expiry of each host's fast liveness record seen (etcd
    # deletes a lapsed one), the hosts whose Ray node died as Ray said last,
    # and when the first live record lapses (the leader wakes then).
    _liveness_seen: dict[str, datetime] = field(default_factory=dict)
    _ray_dead: frozenset[str] = frozenset()
    _next_liveness: datetime | None = None
    # The edge upstream records last skipped (key, reason): each said once.
    _edge_problems: set[tuple[str, str]] = field(default_factory=set)
    _tailscale_problem: str | None = None
    # Why the steps keep failing (None: the last one succeeded), and whether
    # the step under way noted a problem.
    problem: LeaderProblem | None = None
    _noted: bool = False
    # The member reports last skipped as unreadable (each said once).
    _member_problems: set[str] = field(default_factory=set)
    # The parts' bytes and digests of the plans made, compared, signed and
    # verified before (plan_parts.PartsMemo): each step's plan is mostly the
    # last one's, so only the parts that changed are made again.
    parts_memo: PartsMemo = field(default_factory=PartsMemo)
    # The last plan verified (by identity: plans are frozen), the keys, and what verify_plan said.
    _verified: tuple[FleetPlan, list[PlanKey], str | None] | None = None
    # Settles so far (`settle`: every FULL_COLLECTION_EVERY-th collects every generation).
    _settles: int = 0

    def _reload(self) -> None:
        try:
            self.desired = self.load_desired()
        except Exception as exc:  # DesiredStateError or an unreadable directory
            if self.desired is None:
                raise
            self.log(f"desired state invalid, keeping the last good one: {exc}")

    def step(self) -> None:
        # A step over a large fleet allocates hundreds of thousands of short-lived
        # objects (parsed records, states, snapshot nodes), freed as they go
        # by their reference counts; left on, the cyclic collector would
        # traverse every live object several times per step (a good part of
        # a second at 10,000 nodes). It is held off for the step, and `run`
        # collects in `settle`, while the leader waits.
        collecting = gc.isenabled()
        gc.disable()
        self._noted = False
        try:
            self._step()
        finally:
            if collecting:
                gc.enable()
        if not self._noted:
            self._clear_problem()

    def _step(self) -> None:
        self._reload()
        assert self.desired is not None
        if self.host not in self.desired.fleet.fleet.leader_candidates:
            if self.leadership is not None:
                self.log(f"{self.host} is no longer a leader candidate: resigning")
                self.registry.resign(self.leadership)
                self.leadership = None
            return
        if not self._can_sign():
            if self.leadership is not None:
                self.registry.resign(self.leadership)
                self.leadership = None
            return
        self._read_liveness()
        if self.leadership is None:
            if not self._campaign():
                return
        elif not self.registry.renew(self._with_own_liveness(self.leadership)):
            self.log(f"{self.host} lost the lease of epoch {self.leadership.epoch}")
            self.leadership = None
            return
        try:
            # One read of the whole registry: the lifecycle is advanced and
            # stored, and the snapshot shows the states just stored.
            view = self.registry.lead(self.leadership, lanes=[lane.id for lane in self.desired.lanes])
            try:
                view = replace(view, snapshot=with_lane_states(view.snapshot, self.lane_broker, self.desired))
            except LaneBrokerError as exc:
                # The plan goes on without the lanes' load (the next step reads it again).
                self.log(f"lane queue unreachable, planning without the lanes' jobs: {exc}")
            self._note_unreadable(view.snapshot)
            for event in view.events:
                self.log(f"node {event}")
            snapshot = self._with_suspicion(self._with_ray(view.snapshot), view.plan)
            self._note_lapse(min((t for t in (view.next_lapse, self._next_liveness) if t is not None), default=None))
            snapshot, planned, admission = self._with_members(snapshot)
            self._publish(snapshot, view.plan, planned, admission)
            self._dispatch()
        except NotLeader as exc:
            self.log(str(exc))
            self.leadership = None
        except (PlanSigningError, PlanNotPublished) as exc:
            # The key became unreadable or the plan was numbered otherwise:
            # nothing valid was published; keep the term and try next step.
            self.log(f"plan not published: {exc}")
            self._note_problem(exc)

    def _now(self) -> datetime:
        return from_epoch_seconds(self.clock.now()) if self.clock is not None else utc_now()

    def _campaign(self) -> bool:
        """Not leading: campaign once; held by a live term, take it over when
        its leader's host's liveness record lapsed (`_take_over`). True: this
        candidate leads now, its memory of lapses seeded from the record it
        replaced (the old leader's host's, which that leader never suspected)."""
        held = self.registry.leader_term()
        self.leadership = self.registry.campaign(self.host, self.lease_ttl_s)
        if self.leadership is None:
            self.leadership = self._take_over(held)
        if self.leadership is None:
            self._note_held(held)
            return False
        self._held_stale_at = None
        self._takeover_at = None
        if held is not None and held.candidate != self.host and held.liveness_until is not None and self._liveness_on():
            seen = self._liveness_seen.get(held.candidate)
            if seen is None or utc(seen) < utc(held.liveness_until):
                self._liveness_seen[held.candidate] = utc(held.liveness_until)
        self.log(f"{self.host} leads from epoch {self.leadership.epoch} (term {self.leadership.term})")
        self._show_problem()
        return True

    def _take_over(self, held: LeaderInfo | None) -> Leadership | None:
        """Issue 30: the live term `held` taken over at once when its
        leader's host's fast liveness record lapsed at least [timing]
        liveness_s ago, the term not renewed since and no full heartbeat of
        that host since (`leader_lapse`); the registry's compare-and-swap
        (`Candidacy.take_over`) checks the record and the lapse again. With
        the fast liveness off, or no expiry of that host known, never."""
        assert self.desired is not None
        if held is None or held.candidate == self.host or not self._liveness_on():
            return None
        min_age = float(self.desired.fleet.timing.liveness_s)
        now = self._now()
        if leader_lapse(held, self._liveness_seen, None, now, min_age) is None:
            return None
        # Only now the node states: a full heartbeat since the lapse is life too.
        beat = next((n.last_seen for n in self.registry.node_states() if n.node_id == held.candidate), None)
        lapse = leader_lapse(held, self._liveness_seen, beat, now, min_age)
        if lapse is None:
            return None
        won = self.registry.take_over(self.host, self.lease_ttl_s, held)
        if won is not None:
            self._liveness_seen[held.candidate] = lapse
            renewed = f"{held.renewed_at:%H:%M:%S}" if held.renewed_at is not None else "never"
            self.log(
                f"{self.host} takes over from {held.candidate} (term {held.term}): its host's liveness record lapsed at "
                f"{utc_stamp(lapse)}, the term not renewed since {renewed}"
            )
        return won

    def _liveness_on(self) -> bool:
        assert self.desired is not None
        return bool(self.desired.fleet.timing.liveness_s)

    def _read_liveness(self) -> None:
        """Each step, leading or following: the newest expiry of each host's
        liveness record (`remember_liveness`: etcd deletes a lapsed one, so
        what a follower read before a lapse is what it knows of it). Read
        before the renewal, which writes the leader's own host's into the
        leader record (`LeaderInfo.liveness_until`)."""
        if not self._liveness_on():
            self._liveness_seen = {}
            return
        self._liveness_seen = remember_liveness(self._liveness_seen, self.registry.liveness())

    def _with_own_liveness(self, leadership: Leadership) -> Leadership:
        """`leadership` whose record says when its host's liveness record
        lapses, as just read (what a candidate started after that lapse knows of it)."""
        own = self._liveness_seen.get(self.host) if self._liveness_on() else None
        if leadership.info.liveness_until != own:
            leadership = replace(leadership, info=leadership.info.model_copy(update={"liveness_until": own}))
            self.leadership = leadership
        return leadership

    def _note_problem(self, exc: Exception) -> None:
        """A failed step (module docstring): the problem, counted, put into
        the leader record the next renewal writes (when leading)."""
        kind, what = type(exc).__name__, str(exc)[:LEADER_PROBLEM_CHARS]
        before = self.problem
        self.problem = LeaderProblem(
            kind=kind,
            what=what,
            since=before.since if before is not None else self._now(),
            attempts=before.attempts + 1 if before is not None else 1,
            plan_epoch=self.published.epoch if self.published is not None else None,
        )
        self._noted = True
        self._show_problem()

    def _clear_problem(self) -> None:
        if self.problem is None:
            return
        self.log(f"the registry works again after {self.problem.attempts} failed attempts ({self.problem.kind}: {self.problem.what})")
        self.problem = None
        self._show_problem()

    def _show_problem(self) -> None:
        """The leader record's problem, as the next renewal writes it."""
        if self.leadership is not None and self.leadership.info.problem != self.problem:
            self.leadership = replace(self.leadership, info=self.leadership.info.model_copy(update={"problem": self.problem}))

    def _note_unreadable(self, snapshot: Snapshot) -> None:
        """Log each record the registry's read skipped once per change: when it
        becomes unreadable (or for another reason) and when it no longer is."""
        lines = tuple(problem_lines(snapshot.unreadable))
        if lines == self._unreadable:
            return
        for line in lines:
            if line not in self._unreadable:
                self.log(f"{line} (skipped: the node counts as not beating)")
        for line in self._unreadable:
            if line not in lines:
                self.log(f"no longer unreadable: {line}")
        self._unreadable = lines

    def _dispatch(self) -> None:
        """Step 5: the lane jobs, fenced by this term (module docstring)."""
        assert self.desired is not None and self.leadership is not None
        if self.lane_broker is None or not self.desired.fleet.phaze.leader_dispatches:
            return
        if self.desired.fleet.phaze_dispatches:
            return  # phaze's control plane dispatches its lanes (engine.dispatch.refuse_phaze_lanes)

        def told(event: DispatchEvent) -> None:
            # Each event as its change commits: a pass that fails halfway
            # (a broker restart, a newer term) has told what it did.
            if event.hold is None:
                self.log(f"lane job {event.text()}")

        self._crash_check_at = None
        started = self.clock.now() if self.clock is not None else 0.0  # the pass reads the runs first
        try:
            done = dispatch_once(
                self.registry, self.lane_broker, self.desired, fence=dispatcher_fence(self.registry, self.leadership.term), emit=told
            )
            if done.crash_check_in_s is not None and self.clock is not None:
                self._crash_check_at = started + done.wake_in_s(done.crash_check_in_s)
        except StaleDispatcher as exc:
            # A newer term dispatches: this one's lease is gone or going.
            self.log(f"lane dispatch refused, a newer leader dispatches: {exc}")
            return
        except LaneBrokerError as exc:
            self.log(f"lane queue unreachable, no dispatch this step: {exc}")

    def _with_ray(self, snapshot: Snapshot) -> Snapshot:
        """The snapshot with Ray's view joined (step 3b), or as it is without one."""
        if self.ray_state is None:
            return snapshot
        try:
            view = self.ray_state.observe()
        except RayStateUnavailable as exc:
            self.log(f"ray state unreadable, scheduling without Ray's tasks: {exc}")
            return snapshot
        self._ray_dead = view.dead
        snapshot = with_ray_view(snapshot, view, worker_unit=RAY_WORKER_UNIT)
        # The hosts that run a Ray node: the [ray] section's head and workers
        # (without one, those Ray has seen: a cluster the fabric did not render).
        assert self.desired is not None
        ray = self.desired.fleet.ray
        actions = decide_ray_workers(snapshot, set(ray.hosts()) if ray is not None else view.alive | view.dead, view, snapshot.now)
        if actions != self.ray_workers:
            for action in actions:
                self.log(f"ray worker {action.kind} {action.host}: {action.reason}")
            self.ray_workers = actions
        return snapshot

    def _with_suspicion(self, snapshot: Snapshot, newest: FleetPlan | None) -> Snapshot:
        """Issue 30: the nodes suspected now (a fast liveness lapse, or two
        sources agreeing), the suspects' memory advanced from the last plan
        (`advance_suspects`: flap damping, recovery, offline), each change
        logged, and the snapshot marked for the scheduler's hedges. With
        [timing] liveness_s = 0, no Ray and no tailscale nothing is read and
        the snapshot is as it was: the node timeout alone decides."""
        assert self.desired is not None
        keys = self.desired.fleet.plan_keys
        # A forged plan's memory does not count (it would choose hedges): this leader's own plan then.
        trusted = newest if newest is not None and (not keys or self._verify(newest, keys) is None) else self.published
        previous = trusted.suspects if trusted is not None else {}
        if self._liveness_on():
            # The step read the records (`_read_liveness`); a host the last
            # plan suspects for a lapse that this leader has no expiry of
            # (a new term: the old leader's memory is gone) lapsed then.
            known = {n.node_id for n in snapshot.nodes}
            seen = lapses_of_suspects(self._liveness_seen, previous)
            self._liveness_seen = {h: t for h, t in seen.items() if h in known}
        self._next_liveness = next_liveness_lapse(self._liveness_seen, snapshot.now)
        sources: dict[str, dict[str, str]] = {}
        if self._ray_dead:
            sources["ray"] = {h: "Ray node dead" for h in self._ray_dead}
        offline = self._tailscale_offline([n.node_id for n in snapshot.nodes])
        if offline:
            sources["tailscale"] = offline
        failing = self._edge_failing(snapshot.now)
        if failing:
            sources[EDGE_SOURCE] = failing
        now_suspected = suspected(snapshot.nodes, self._liveness_seen, sources, snapshot.now)
        if not previous and not now_suspected:
            return snapshot.model_copy(update={"suspects": {}}) if snapshot.suspects else snapshot
        status = {n.node_id: n.status for n in snapshot.nodes}
        suspects, changes = advance_suspects(previous, now_suspected, status, snapshot.now, self.desired.fleet.flap)
        for change in changes:
            self.log(f"node {change.node} {change.kind}: {change.detail}")
        return with_suspects(snapshot, suspects)

    def _edge_failing(self, now: datetime) -> dict[str, str]:
        """The hosts an edge's Caddy sees every upstream of failing (its
        record younger than a heartbeat); each record parsed on its own, a
        bad one skipped and named once (`core.scheduling.edge_upstreams`)."""
        assert self.desired is not None
        edges = self.desired.hosts_with_role("edge")
        if not edges or not self.desired.fleet.timing.liveness_s:
            return {}
        try:
            raw = self.registry.edge_upstreams()
        except RegistryError as exc:
            self.log(f"edge upstreams unreadable, suspecting without them: {exc}")
            return {}
        records, problems = edge_records(raw, edges)
        said = {(p.key, p.reason) for p in problems}
        for key, reason in sorted(said - self._edge_problems):
            self.log(f"edge upstreams record of {key} skipped: {reason}")
        self._edge_problems = said
        addresses = {name: config.host.address for name, config in self.desired.hosts.items()}
        return edge_failing(records, addresses, now, float(self.desired.fleet.timing.heartbeat_s))

    def _tailscale_offline(self, hosts: list[str]) -> dict[str, str]:
        """The hosts tailscale shows offline; a status that cannot be read is said once."""
        if self.tailscale_status is None:
            return {}
        try:
            offline = offline_peers(self.tailscale_status(), hosts)
        except (OSError, ValueError) as exc:
            if str(exc) != self._tailscale_problem:
                self.log(f"tailscale status unreadable, suspecting without it: {exc}")
                self._tailscale_problem = str(exc)
            return {}
        self._tailscale_problem = None
        return offline

    def _can_sign(self) -> bool:
        """With plan keys listed: whether this candidate holds one of its keys.
        A candidate that cannot sign must not lead (its hosts would refuse
        every plan); it says why once, not every step."""
        assert self.desired is not None
        keys = self.desired.fleet.plan_keys
        if not keys:
            return True
        try:
            signing_key(self.signer, keys, self.host)
        except PlanSigningError as exc:
            reason = f"{self.host} cannot sign plans, so it does not lead: {exc}"
            if reason != self._cannot_sign:
                self.log(reason)
            self._cannot_sign = reason
            return False
        self._cannot_sign = None
        return True

    def _verify(self, plan: FleetPlan, keys: list[PlanKey]) -> str | None:
        """`verify_plan`, once per plan and keys: the newest plan is checked
        by the suspicion and by the publish of each step (the registry gives
        the same plan object back while its index is the same)."""
        held = self._verified
        if held is not None and held[0] is plan and held[1] == keys:
            return held[2]
        problem = verify_plan(plan, keys, self.parts_memo)
        self._verified = (plan, list(keys), problem)
        return problem

    def _publish_signed(self, plan: FleetPlan) -> FleetPlan:
        """Publish `plan`, signed when fabric.toml lists plan keys. The registry
        numbers the plan as it stores it, and the signature covers the epoch,
        so the plan is signed under the epoch it will get: the next one (only
        this leader raises the epoch while its term holds)."""
        assert self.desired is not None and self.leadership is not None
        keys = self.desired.fleet.plan_keys
        # The plan names its term (the registry's), the fleet and the registry
        # prefix, all under the signature (`plan_in_term`).
        scoped = plan_in_term(plan, self.leadership, self.desired)
        if not keys:
            return self.registry.publish_plan(self.leadership, scoped)
        key = signing_key(self.signer, keys, self.host)
        assert self.signer is not None
        expected = self.registry.epoch() + 1
        signed = sign_plan(scoped.model_copy(update={"epoch": expected, "leader": self.host}), self.signer, key, self.parts_memo)
        stored = self.registry.publish_plan(self.leadership, signed)
        if stored.epoch != expected or self._verify(stored, keys) is not None:
            # The registry numbered it otherwise: hosts would refuse it. Say so;
            # the next step sees an invalid newest plan and publishes again.
            raise PlanNotPublished(f"plan stored as epoch {stored.epoch}, signed for epoch {expected}: publishing again next step")
        return stored

    def _with_members(self, snapshot: Snapshot) -> tuple[Snapshot, DesiredState, Admission]:
        """The worker groups' members the leader admits (core.scheduling.groups),
        joined to the snapshot as nodes and to the desired state it schedules
        over as hosts with their group's settings. No groups declared: as it is."""
        assert self.desired is not None
        desired = self.desired
        if not desired.fleet.groups:
            return snapshot, desired, Admission()
        records, problems = self.registry.group_members()
        for line in sorted(set(problems) - self._member_problems):
            self.log(f"member report skipped: {line}")
        self._member_problems = set(problems)
        deactivated: list[str] = []
        if records:  # which groups are deactivated: the scaling state's word
            try:
                deactivated = ScalingState.model_validate(self.registry.scaling_record().state).deactivated_groups
            except ValidationError:
                pass
        admission = admit_members(records, desired.fleet.groups, set(desired.hosts), deactivated, snapshot.now)
        joined, planned = with_members(snapshot, desired, admission)
        return joined, planned, admission

    def _publish(self, snapshot: Snapshot, newest: FleetPlan | None, planned: DesiredState | None = None, admission: Admission | None = None) -> None:
        """Schedule over `planned` (the desired state with the admitted
        group members; None: the desired state as loaded) and publish."""
        assert self.desired is not None and self.leadership is not None
        desired = planned if planned is not None else self.desired
        keys = self.desired.fleet.plan_keys
        # A newest plan whose signature does not verify (forged, or by a
        # retired key) is replaced even when its placements are the same, and
        # its placements are not the ones in force: the scheduler keeps work
        # where it is, and a forger must not choose where that is. What hosts
        # run is this leader's last verified plan (they refused the forgery),
        # so the schedule keeps those placements: a forgery moves nothing. A
        # leader without a verified plan of its own (new to the term) keeps
        # what the hosts report running instead (their heartbeats' units).
        untrusted = newest is not None and bool(keys) and self._verify(newest, keys) is not None
        if untrusted:
            in_force = self.published if self.published is not None and self._verify(self.published, keys) is None else None
            kept = list(in_force.placements) if in_force is not None else running_placements(desired, snapshot)
            # Nor does its come-home memory count: a forger must not start moves.
            room = dict(in_force.room_since) if in_force is not None else {}
            snapshot = snapshot.model_copy(update={"placements": kept, "room_since": room})
        plan = self.schedule(snapshot, desired, leader=self.host, epoch=snapshot.epoch)
        plan = self._steered(plan, self.published if untrusted else newest, snapshot)
        before = self.published if untrusted else newest
        plan, hedged = note_hedges(plan, before.placements if before is not None else [], snapshot.now)
        for change in hedged:
            self.log(f"node {change.node} {change.kind}: {change.detail}")
        # A newest plan of another term (the one before this, or a replay) is
        # refused by every host: this term publishes its own even when the
        # placements are the same.
        other_term = newest is not None and (newest.term != self.leadership.term or newest.leader != self.host)
        if untrusted or other_term or not same_plan(plan, newest, self.parts_memo):
            self.published = self._publish_signed(plan)
            self.log(
                f"published plan epoch {self.published.epoch}: {len(self.published.placements)} placements, {len(self.published.deferred)} deferred"
            )
        if self.scaling is not None:
            # After the plan: its deferred replicas are part of the queue depth,
            # and what scaling changes shows in the next pass's snapshot.
            self.scaling.run(self.leadership, desired, snapshot, plan, admission)

    def _steered(self, plan: FleetPlan, previous: FleetPlan | None, snapshot: Snapshot) -> FleetPlan:
        """A phaze fleet: `plan` with the lanes phaze may choose decided from
        its live lane views (`core.scheduling.lane_steering`), going on from
        the steering in force; each change is logged with its reason."""
        assert self.desired is not None
        if not self.desired.fleet.phaze_dispatches:
            return plan
        settings = self.desired.fleet.phaze
        before = previous.steering if previous is not None else LaneSteering()
        steering = decide_steering(before, plan.lanes, snapshot.now, window_s=settings.steering_window_s, interval_s=settings.restart_interval_s)
        new = [c for c in steering.recent if c.at == steering.changed_at] if steering.changed_at != before.changed_at else []
        for change in new:
            self.log(f"lane {change.lane} {'left out of' if change.out else 'back in'} phaze's backends.toml: {change.reason}")
        return plan.model_copy(update={"steering": steering})

    def step_and_resign(self) -> None:
        """One step, then resign: the next one-shot process (`fabric leader run
        --once`) campaigns anew instead of waiting for this lease to lapse."""
        try:
            self.step()
        finally:
            if self.leadership is not None:
                self.registry.resign(self.leadership)
                self.leadership = None

    def settle(self) -> None:
        """Between two steps, while the leader waits: the cyclic garbage
        collection that `step` holds off (see there). Of the young
        generations only (what the step allocated; at 10,000 nodes a
        hundredth of a second where a full collection takes a quarter of
        one, each time before the next change is looked at), and of every
        generation at one settle in `FULL_COLLECTION_EVERY` (the long-lived
        objects: the desired state, the registry view, the memos)."""
        self._settles += 1
        if self._settles % FULL_COLLECTION_EVERY == 0:
            gc.collect()
        else:
            gc.collect(1)

    def wait_s(self) -> float:
        # Leading: renew three times per TTL. Following: the watch wakes us
        # when the leader key goes; the timeout is the fallback (sqlite).
        return max(0.1, self.lease_ttl_s / 3)

    def _note_held(self, held: LeaderInfo | None) -> None:
        """Following: when the leader record goes stale unless renewed, so
        this candidate campaigns then (and takes over a record someone keeps
        alive without renewing it) instead of at its next periodic step; and
        when its leader's host's liveness record, as known now, would have
        lapsed long enough for a takeover (`takeover_due`)."""
        self._held_stale_at = held.stale_at() if held is not None and not held.resigned else None
        due = None
        if held is not None and held.candidate != self.host and self._liveness_on():
            assert self.desired is not None
            due = takeover_due(held, self._liveness_seen, float(self.desired.fleet.timing.liveness_s))
        self._takeover_at = due

    def _note_lapse(self, lapse: datetime | None) -> None:
        """After a step: a lapse still ahead, or a new one, is waited for from
        scratch; a due one (the node still showed alive) is looked at again
        after `LAPSE_RECHECK_S`, then twice as late each time it still is."""
        due = lapse is not None and self.clock is not None and lapse.timestamp() <= self.clock.now()
        same = lapse == self._next_lapse
        if due and same and self._lapse_was_due:
            self._recheck_s = min(self._recheck_s * 2, self.wait_s())
        elif not (due and same):
            self._recheck_s = LAPSE_RECHECK_S
        self._lapse_was_due = due
        self._next_lapse = lapse

    def until_next_step_s(self) -> float:
        """`wait_s`, or less: until the next lapse (leading), or the recheck
        of one that is due."""
        periodic = self.wait_s()
        if self.leadership is None and self.clock is not None:
            # Just past the moment the record goes stale, or its leader's
            # host's lapse is old enough for a takeover (STALE_MARGIN_S).
            moments = [t.timestamp() for t in (self._held_stale_at, self._takeover_at) if t is not None]
            if moments:
                return max(STALE_MARGIN_S, min(periodic, min(moments) - self.clock.now() + STALE_MARGIN_S))
        if self.leadership is not None and self._crash_check_at is not None and self.clock is not None:
            # A lane run's worker lapses (engine.dispatch.DispatchOutcome): the step's dispatch settles it then.
            periodic = min(periodic, max(0.0, self._crash_check_at - self.clock.now()))
        if self.leadership is None or self._next_lapse is None or self.clock is None:
            return periodic
        until = self._next_lapse.timestamp() - self.clock.now()
        if until <= 0:
            return min(periodic, self._recheck_s)
        return min(periodic, until)

    def _wait(self) -> None:
        """Until a change or `until_next_step_s`, in slices of at most half a
        second so a stop request (SIGTERM) is honoured quickly."""
        total = self.until_next_step_s()
        slices = max(1, math.ceil(total / 0.5))
        for _ in range(slices):
            if self._stop.is_set() or self.registry.wait_for_change(total / slices):
                return

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Step and wait until `stop`: a registry error of any kind is said,
        noted (`problem`) and tried again after a backoff; the term and the
        last good plan are kept (module docstring)."""
        backoff = min(RETRY_FIRST_S, self.wait_s())
        armed = False
        while not self._stop.is_set():
            try:
                if not armed:
                    self.registry.wait_for_change(0)  # arm the watch before the first step
                    armed = True
                self.step()
                backoff = min(RETRY_FIRST_S, self.wait_s())
                self.settle()
                self._wait()
            except NotLeader as exc:
                # A term that ended between the renewal and a write.
                self.log(str(exc))
                self.leadership = None
            except RegistryError as exc:
                self._say_retry(exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.wait_s())
        if self.leadership is not None:
            try:
                self.registry.resign(self.leadership)
                self.log(f"{self.host} resigned")
            except RegistryError as exc:
                self.log(f"could not resign (the lease will lapse): {exc}")
            self.leadership = None

    def _say_retry(self, exc: RegistryError, backoff: float) -> None:
        """The journal's line of a failed step: what failed, since when, what is kept."""
        self._note_problem(exc)
        assert self.problem is not None
        plan = f"plan epoch {self.problem.plan_epoch}" if self.problem.plan_epoch is not None else "the plan in force"
        kept = f"keeping term {self.leadership.term} and {plan}" if self.leadership is not None else "not leading"
        self.log(
            f"registry error ({self.problem.kind}, attempt {self.problem.attempts} since {self.problem.since:%H:%M:%S}), "
            f"{kept}, retrying in {backoff:g} s: {exc}"
        )


def candidate_loop(
    registry: LeaderRegistry,
    host: str,
    load_desired: Callable[[], DesiredState],
    schedule: Scheduler,
    *,
    lease_ttl_s: float,
    hooks: HookRunner,
    audit: Audit | None,
    log: Callable[[str], None],
    signer: PlanSigner | None = None,
    ray_state: RayState | None = None,
    lane_broker: LaneBroker | None = None,
    clock: Clock | None = None,
    allowed_prefixes: tuple[str, ...] | None = None,
) -> LeaderLoop:
    """fabric-leader.service's loop: the plan (with Ray's view when the fleet
    runs Ray), then bursts and scaling, whose actions go to `log` and (when
    given) as audit entries of their own."""
    scaling = ScalingStep(
        registry=registry,
        hooks=hooks,
        log=log,
        audit=audit,
        # Hooks run inside the step: they must leave time to renew the lease.
        hook_budget_s=lease_ttl_s / 2,
        lane_broker=lane_broker,
    )
    if allowed_prefixes is not None:
        scaling.allowed_prefixes = allowed_prefixes
    return LeaderLoop(
        registry=registry,
        host=host,
        load_desired=load_desired,
        schedule=schedule,
        lease_ttl_s=lease_ttl_s,
        log=log,
        scaling=scaling,
        signer=signer,
        ray_state=ray_state,
        lane_broker=lane_broker,
        clock=clock,
    )
