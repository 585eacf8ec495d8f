"""Where a pass gets its fleet plan: the registry (the normal case), a file, or nobody.

    PlanFile(path)       a saved FleetPlan (what-if, tests); the registry is not touched
    PlanAlone()          a plan the scheduler computes over this host alone
                         (a one-host fleet: what it could run if it were alone)
    PlanFromRegistry()   the registry of fabric.toml [registry] (or --registry-path):
                           1 heartbeat this host's facts (its record lives for the
                             node timeout, longer for a DERP-relayed path)
                           2 a leader candidate with nobody leading takes one
                             leader step (campaign, lifecycle, schedule, publish
                             if the plan changed) and resigns, so a single host
                             with the embedded registry schedules itself and a
                             running fabric-leader.service is never displaced
                           3 the newest published plan

Whatever the source offers then passes the one fence (`admit`, which calls
`reconciler.core.live.fencing.accept_plan` once): for the registry's plans,
made by a declared leader candidate and, when fabric.toml lists plan keys,
validly signed by one of that candidate's keys (`reconciler.core.live.signing`);
then not older than what this host applied. A plan file or --no-registry's
own plan is the operator's choice: neither check applies to it. Without plan
keys every registry plan is taken on its word, and each pass notes that.

Fail static: when the registry cannot be reached, or has no plan this host
may apply while it runs placements from an earlier one, a host that already
runs a generation keeps it untouched and says why (`PlanSource.static`): it
never tears down work because it cannot see the leader. A host with no
generation yet, or one that has only ever run the empty plan, renders from an
empty plan, so its host-local units (lanes, port maps, nftables) converge.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import ValidationError

from reconciler.core.desired.model import TIER_SCORE, DesiredState, NodeFacts
from reconciler.core.desired.problems import Problem, ProblemsError, problems_from_validation
from reconciler.core.live.fencing import accept_plan
from reconciler.core.live.host_limits import effective_limits
from reconciler.core.live.host_load import HostLoad, host_load
from reconciler.core.live.models import FleetPlan, Snapshot, SnapshotNode
from reconciler.core.live.records import NodeRecord
from reconciler.core.probe.tiering import LABEL_PREFIX
from reconciler.core.render.ray_units import ray_role
from reconciler.core.scheduling.lanes import lane_views
from reconciler.core.scheduling.lifecycle import NodeState
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.lane_states import with_lane_states
from reconciler.engine.pass_options import PlanAlone, PlanChoice, PlanFile
from reconciler.ports import LaneQueue, LaneQueueError, PermissionDenied, PlanSigner, Registry, RegistryError

if TYPE_CHECKING:
    # The fleet's view is read after activation (read_fleet_view): its reader
    # and the timeline's models are imported then, not on the way to it.
    from reconciler.core.views.timeline import FleetHistory

TIER_LABEL = f"{LABEL_PREFIX}tier"


@dataclass(frozen=True)
class PlanSource:
    """The plan a pass renders from, or why it keeps its current generation."""

    plan: FleetPlan
    # Set when the host must keep what it runs (fail static); the reason says why.
    static: str | None = None
    # What happened on the way (heartbeat, leadership), for the log.
    notes: tuple[str, ...] = ()
    # Why the registry's newest plan was refused as not the leader's (forged,
    # or signed by a key fabric.toml does not list), for the status page.
    refused: str | None = None
    # The registry's plan epoch, read before its newest plan (None: no registry).
    # The pass memo keeps it: a later epoch means a new plan, so a full pass.
    registry_epoch: int | None = None
    # This host's lifecycle as the registry holds it (drained, held off), read
    # only when the host runs a Ray node: a node that takes no new work is
    # rendered closed to new Ray tasks (reconciler.core.render.ray_units).
    own_state: NodeState | None = None
    # The record this pass's heartbeat sent before activation (None: none sent).
    heartbeat: NodeRecord | None = None

    @property
    def epoch_read(self) -> int | None:
        """The registry's epoch this plan is the newest plan at: the newer of
        the epoch read before it and its own (a plan published between the
        two reads is newer than the first). None: not from the registry, or
        the host runs static (it took no plan)."""
        if self.registry_epoch is None or self.static is not None:
            return None
        return max(self.registry_epoch, self.plan.epoch)


@dataclass(frozen=True)
class FleetView:
    """The registry's view of the whole fleet, for the edge's status page and
    fleet metrics (`read_fleet_view`)."""

    snapshot: Snapshot
    # What the registry remembers (node transitions, leader, hook runs), read
    # on the snapshot's connection, for the page's timeline (None: it could
    # not be read: a note says so).
    history: FleetHistory | None = None
    notes: tuple[str, ...] = ()


def effective_facts(desired: DesiredState, host: str, facts: NodeFacts) -> NodeFacts:
    """The probe as the fabric uses it: the host file's tier pin applied.

    An override can only lower the probe's tier (a typo must not send CUDA
    work to a CPU box); the tier label follows, so k3s and the registry see
    the tier the scheduler uses.
    """
    override = desired.hosts[host].overrides.tier
    if override is None or TIER_SCORE[override] >= TIER_SCORE[facts.tier]:
        return facts
    labels = {**facts.labels, TIER_LABEL: override}
    notes = [*facts.limitations.notes, f"tier pinned to {override} by the host file (the probe found {facts.tier})"]
    return facts.model_copy(update={"tier": override, "labels": labels, "limitations": facts.limitations.model_copy(update={"notes": notes})})


@dataclass(frozen=True)
class UnitsSeen:
    """This host's fabric units as a pass reads them (reconcile.py, through the systemd port)."""

    placed: tuple[str, ...]  # the placed service units of the generation that runs
    # Every fabric unit of that generation and its ActiveState; None when the
    # pass does not activate (--no-activate: systemd is not asked).
    states: dict[str, str] | None


@dataclass(frozen=True)
class Measured:
    """What a pass measured of this host for its heartbeat."""

    load: HostLoad
    units: dict[str, str]
    lanes: tuple[str, ...]  # the lanes whose jobs run here (a memoized pass re-reads them)


def lanes_here(desired: DesiredState, host: str) -> tuple[str, ...]:
    return tuple(lane.id for lane in desired.lanes_on(host))


def lane_in_flight(desired: DesiredState, lane_queue: LaneQueue | None, lanes: Sequence[str]) -> dict[str, int]:
    """Jobs queued or active on each of `lanes`' queues ({} without a lane queue)."""
    if lane_queue is None or not lanes:
        return {}
    queues = {lane.id: queue for lane in desired.lanes if lane.id in lanes and (queue := desired.queue_for(lane)) is not None}
    return {seen.id: seen.in_flight for seen in lane_queue.lane_states(queues)}


def measure(
    desired: DesiredState, host: str, seen: UnitsSeen, lane_queue: LaneQueue | None, note: Callable[[str], None] = lambda _: None
) -> Measured:
    """The host's load from its units and, for the lanes whose jobs run
    here, the lane queue (asked only when there is such a lane). A broker
    that stops answering is a note: the load is then the services alone."""
    lanes = lanes_here(desired, host)
    try:
        in_flight = lane_in_flight(desired, lane_queue, lanes)
    except LaneQueueError as exc:
        note(f"lane queue unreachable, heartbeat without the lane jobs: {exc}")
        in_flight = {}
    return Measured(host_load(seen.placed, seen.states, lanes, in_flight), dict(seen.states or {}), lanes)


def no_lane_queue() -> LaneQueue | None:
    return None


def node_record(desired: DesiredState, host: str, facts: NodeFacts, measured: Measured | None = None) -> NodeRecord:
    """What this host reports: its (effective) facts with the host file's
    limits bounded by the probe (core.live.host_limits), its declared labels
    (the operator's win, so services can be constrained to labels an operator
    declared) and, when measured, its load and unit states."""
    declared = desired.hosts[host]
    limits = effective_limits(declared, facts.limitations)
    return NodeRecord.from_facts(
        host,
        facts,
        max_concurrent_tasks=limits.max_concurrent_tasks,
        max_concurrent_ceiling=limits.max_concurrent_ceiling,
        labels={**facts.labels, **declared.labels},
        in_flight=measured.load.in_flight if measured is not None else 0,
        services_running=measured.load.services if measured is not None else None,
        units=measured.units if measured is not None else None,
        lowered_limits=list(limits.lowered),
    )


def empty_plan(desired: DesiredState, now: datetime) -> FleetPlan:
    return FleetPlan(epoch=0, leader="", created=now, lanes=lane_views(desired, Snapshot(now=now)))


def plan_from_file(path: Path) -> FleetPlan:
    """Raises ProblemsError (`FILE: key.path: reason`, every one) for an unreadable or invalid plan."""
    try:
        return FleetPlan.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise ProblemsError([Problem(str(path), "(file)", f"cannot read: {exc.strerror or exc}")]) from None
    except ValidationError as exc:
        raise ProblemsError(problems_from_validation(str(path), exc, FleetPlan)) from None


def plan_alone(desired: DesiredState, host: str, facts: NodeFacts, now: datetime) -> FleetPlan:
    """The scheduler over a fleet of this host alone."""
    record = node_record(desired, host, facts)
    node = SnapshotNode(
        node_id=host,
        tier=record.tier,
        max_concurrent_tasks=record.max_concurrent_tasks,
        max_concurrent_ceiling=record.max_concurrent_ceiling,
        arch=record.arch,
        labels=dict(record.labels),
    )
    return schedule(Snapshot(now=now, nodes=[node]), desired, leader=host, epoch=0)


# Said once per pass when a registry plan is taken without a signature to check.
UNSIGNED_NOTE = "fleet plans are not signed: any registry client can forge them (list [[plan_keys]] in fabric.toml; see README 'Signed plans')"


def lead_once(
    registry: Registry,
    desired: DesiredState,
    host: str,
    signer: PlanSigner | None = None,
    open_lanes: Callable[[], LaneQueue | None] = no_lane_queue,
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
        lane_queue=open_lanes(),
    ).step_and_resign()
    return "; ".join(notes) or None


# Why a plan older than the applied one comes from each source.
STALE_CAUSE = {
    "registry": "stale leader or lagging registry",
    "file": "the plan file is older than the plan this host runs",
    "alone": "this host's own plan does not replace the fleet's",
}


@dataclass(frozen=True)
class Offer:
    """What a plan source offers, before the fence."""

    origin: Literal["file", "alone", "registry"]
    plan: FleetPlan | None
    notes: tuple[str, ...] = ()
    # Why the registry gave no answer: unreachable, or it refused this host (then there is no plan to fence).
    registry_failed: str | None = None
    registry_epoch: int | None = None
    heartbeat: NodeRecord | None = None
    own_state: NodeState | None = None


def read_registry(
    connect: Callable[[], Registry],
    desired: DesiredState,
    host: str,
    facts: NodeFacts,
    *,
    write: bool,
    signer: PlanSigner | None = None,
    units_now: Callable[[], UnitsSeen] | None = None,
    open_lanes: Callable[[], LaneQueue | None] = no_lane_queue,
) -> Offer:
    """Connect, heartbeat (when `write`), maybe lead, then the newest plan.

    The heartbeat's load is measured from `units_now` (the generation that
    runs as the pass starts); the pass beats again after activation
    (`beat_after_activation`)."""
    notes: list[str] = []
    registry: Registry | None = None
    opened: list[LaneQueue | None] = []

    def lanes() -> LaneQueue | None:
        # Opened at most once, and only by what reads it: the lanes whose
        # jobs run here, or a leader step actually taken.
        if not opened:
            opened.append(open_lanes())
        return opened[0]

    sent: NodeRecord | None = None
    try:
        registry = connect()
        if write:
            lane_queue = lanes() if lanes_here(desired, host) else None
            measured = measure(desired, host, units_now(), lane_queue, notes.append) if units_now is not None else None
            sent = node_record(desired, host, facts, measured)
            stored = registry.heartbeat(sent)
            notes.append(stored.heartbeat_note())
            led = lead_once(registry, desired, host, signer, lanes)
            if led:
                notes.append(f"leader step: {led}")
        # The epoch before the plan: a plan published in between makes the
        # epoch kept older than the plan, never newer (the next pass is full).
        epoch = registry.epoch()
        newest = registry.newest_plan()
        own_state = next((s for s in registry.node_states() if s.node_id == host), None) if ray_role(desired.fleet.ray, host) else None
    except PermissionDenied as exc:  # this host's identity may not do that: fail static, and say it is not an outage
        return Offer("registry", None, tuple(notes), registry_failed=f"registry refused this host ({exc})")
    except RegistryError as exc:  # RegistryUnavailable above all
        return Offer("registry", None, tuple(notes), registry_failed=f"registry unreachable ({exc})")
    finally:
        if registry is not None:
            registry.close()
        if opened and opened[0] is not None:
            opened[0].close()
    return Offer("registry", newest, tuple(notes), registry_epoch=epoch, heartbeat=sent, own_state=own_state)


def epoch_moved_past(connect: Callable[[], Registry], source: PlanSource) -> int | None:
    """The registry's epoch now, when it moved past the plan `source` was
    read with: a plan published (or a leader elected) since this pass read
    its own. None when it did not, when `source` read no registry plan
    (`PlanSource.epoch_read`: none, or the host static), or when the registry
    cannot be read now: then the next pass (the watcher's or the timer's) sees it."""
    seen = source.epoch_read
    if seen is None:
        return None
    try:
        registry = connect()
        try:
            epoch = registry.epoch()
        finally:
            registry.close()
    except RegistryError:
        return None
    return epoch if epoch > seen else None


def read_fleet_view(connect: Callable[[], Registry], desired: DesiredState, open_lanes: Callable[[], LaneQueue | None] = no_lane_queue) -> FleetView:
    """The registry's view of the whole fleet for the edge's status page:
    its snapshot with the lanes' queues (phaze's broker) and what it
    remembers, on one connection. A pass reads it after activation, so the
    edge's Caddy never waits for the page's reads (nor for the broker's
    client to load). Raises RegistryError; the broker or the history not
    answering is a note (the page goes without them)."""
    from reconciler.engine.status import fleet_history

    notes: list[str] = []
    registry = connect()
    lane_queue: LaneQueue | None = None
    try:
        snapshot = registry.snapshot(lanes=[lane.id for lane in desired.lanes])
        history: FleetHistory | None = None
        try:
            history = fleet_history(registry)
        except RegistryError as exc:  # the page goes without its timeline
            notes.append(f"status page without its timeline: {exc}")
        lane_queue = open_lanes()
        try:
            snapshot = with_lane_states(snapshot, lane_queue, desired)
        except LaneQueueError as exc:
            notes.append(f"lane queue unreachable, status page without the lanes' queues: {exc}")
    finally:
        registry.close()
        if lane_queue is not None:
            lane_queue.close()
    return FleetView(snapshot, history, tuple(notes))


def beat_after_activation(
    connect: Callable[[], Registry],
    desired: DesiredState,
    host: str,
    facts: NodeFacts,
    seen: UnitsSeen,
    sent: NodeRecord,
    open_lanes: Callable[[], LaneQueue | None] = no_lane_queue,
) -> tuple[Measured, NodeRecord, str | None]:
    """The heartbeat again, with the load measured after activation: the
    measurement, the record the registry now holds from this pass, and a note.

    Sent only when it differs from the pass's first beat (`sent`): a pass
    that changed nothing (and no lane job started or ended) writes once.
    Raises RegistryError when the registry cannot be reached."""
    registry = connect()
    lane_queue = open_lanes() if lanes_here(desired, host) else None
    try:
        measured = measure(desired, host, seen, lane_queue)  # a broker outage: the services alone
        record = node_record(desired, host, facts, measured)
        if record == sent:
            return measured, record, None
        stored = registry.heartbeat(record)
    finally:
        registry.close()
        if lane_queue is not None:
            lane_queue.close()
    load = measured.load
    return measured, record, f"after activation, {stored.heartbeat_note()} ({load.services} services, {load.lane_jobs} lane jobs)"


def admit(offer: Offer, desired: DesiredState, *, applied_epoch: int | None, has_generation: bool, now: datetime) -> PlanSource:
    """The plan this pass renders from: the offer if the fence admits it,
    else the empty plan or (a host that runs a generation) fail static."""
    notes = list(offer.notes)
    if offer.registry_failed is not None:
        if has_generation:
            return PlanSource(empty_plan(desired, now), static=f"{offer.registry_failed}: running static", notes=tuple(notes))
        notes.append(f"{offer.registry_failed}: no generation yet, rendering host-local units from an empty plan")
        return PlanSource(empty_plan(desired, now), notes=tuple(notes))
    # Only the registry's plans must come from a declared candidate and carry
    # its signature: a plan file or --no-registry's own plan is the operator's choice.
    from_registry = offer.origin == "registry"
    signers = desired.fleet.fleet.leader_candidates if from_registry else None
    keys = desired.fleet.plan_keys if from_registry else None
    if from_registry and not keys and offer.plan is not None:
        notes.append(UNSIGNED_NOTE)
    verdict = accept_plan(applied_epoch, offer.plan, leader_candidates=signers, plan_keys=keys, stale_cause=STALE_CAUSE[offer.origin])
    if verdict.accepted and offer.plan is not None:
        if offer.origin == "registry":
            notes.append(verdict.reason)
        return PlanSource(offer.plan, notes=tuple(notes))
    if offer.plan is None and not applied_epoch:
        # Nothing published and nothing applied from a published plan: the
        # empty plan is what runs, so host-local changes still converge.
        notes.append(f"{verdict.reason}: rendering host-local units from an empty plan")
        return PlanSource(empty_plan(desired, now), notes=tuple(notes))
    refused = verdict.reason if verdict.untrusted else None
    if has_generation:
        return PlanSource(empty_plan(desired, now), static=f"{verdict.reason}: running static", notes=tuple(notes), refused=refused)
    notes.append(f"{verdict.reason}: rendering host-local units from an empty plan")
    return PlanSource(empty_plan(desired, now), notes=tuple(notes), refused=refused)


def fleet_plan_for(
    choice: PlanChoice,
    desired: DesiredState,
    host: str,
    facts: NodeFacts,
    *,
    connect: Callable[[], Registry],
    applied_epoch: int | None,
    has_generation: bool,
    now: datetime,
    write: bool,
    signer: PlanSigner | None = None,
    units_now: Callable[[], UnitsSeen] | None = None,
    open_lanes: Callable[[], LaneQueue | None] = no_lane_queue,
) -> PlanSource:
    """The pass's fleet plan from `choice`, through the fence.

    `write=False` (fabric plan) reads the registry's plan but sends no
    heartbeat and takes no leader step. Raises ProblemsError for an
    unreadable or invalid plan file."""
    if isinstance(choice, PlanFile):
        offer = Offer("file", plan_from_file(choice.path))
    elif isinstance(choice, PlanAlone):
        offer = Offer("alone", plan_alone(desired, host, facts, now))
    else:
        offer = read_registry(connect, desired, host, facts, write=write, signer=signer, units_now=units_now, open_lanes=open_lanes)
    source = admit(offer, desired, applied_epoch=applied_epoch, has_generation=has_generation, now=now)
    if offer.registry_epoch is None:
        return source
    return replace(source, registry_epoch=offer.registry_epoch, heartbeat=offer.heartbeat, own_state=offer.own_state)
