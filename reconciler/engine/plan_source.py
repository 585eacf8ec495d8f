"""Where a pass gets its fleet plan: the registry (the normal case), a file, or nobody.

    PlanFile(path)       a saved FleetPlan (what-if, tests); the registry is not touched
    PlanAlone()          a plan the scheduler computes over this host alone
                         (a one-host fleet: what it could run if it were alone)
    PlanFromRegistry()   the registry of fabric.toml [registry] (or --registry-path):
                           1 heartbeat this host's facts (engine.heartbeat: its
                             record lives for the node timeout, longer for a
                             DERP-relayed path)
                           2 a leader candidate with nobody leading takes one
                             leader step (engine.leader_step: campaign,
                             lifecycle, schedule, publish if the plan changed)
                             and resigns, so a single host with the embedded
                             registry schedules itself and a running
                             fabric-leader.service is never displaced
                           3 the newest published plan

Whatever the source offers (a `PlanOffer`) then passes the one fence
(engine.plan_fence: `admit`, which calls
`reconciler.core.live.fencing.accept_plan` once): for the registry's plans,
made by a declared leader candidate and, when fabric.toml lists plan keys,
validly signed by one of that candidate's keys (`reconciler.core.live.signing`)
for this fleet and registry prefix, by the leader the registry names now and
for its current term (the leader record is read before the plan); then not
older, by (term, epoch), than what this host applied. A plan file or --no-registry's
own plan is the operator's choice: neither check applies to it. Without plan
keys every registry plan is taken on its word, and each pass notes that.

Fail static: when the registry cannot be reached, or has no plan this host
may apply while it runs placements from an earlier one, a host that already
runs a generation keeps it untouched and says why (`PassPlan.static`): it
never tears down work because it cannot see the leader. A host with no
generation yet, or one that has only ever run the empty plan, renders from an
empty plan, so its host-local units (lanes, port maps, nftables) converge.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from pydantic import ValidationError

from reconciler.core.desired.model import TIER_SCORE, DesiredState, HostFacts
from reconciler.core.desired.problems import Problem, ProblemsError, problems_from_validation
from reconciler.core.live.fencing import AppliedFence
from reconciler.core.live.models import FleetPlan, Snapshot, SnapshotNode
from reconciler.core.live.plan_parts import PlanRead, host_part_names
from reconciler.core.live.records import NodeRecord
from reconciler.core.probe.tiering import LABEL_PREFIX
from reconciler.core.render.plan_part import reads_fleet_part, reads_whole_plan
from reconciler.core.render.ray_units import ray_role
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.heartbeat import UnitsSeen, lanes_here, measure, no_lane_broker, node_record
from reconciler.engine.leader_step import lead_once
from reconciler.engine.pass_options import PlanAlone, PlanFile, PlanSource
from reconciler.engine.plan_fence import PassPlan, PlanOffer, admit
from reconciler.ports import EpochConnection, LaneBroker, PassRegistry, PermissionDenied, PlanReads, PlanSigner, RegistryError, RegistryUnavailable

TIER_LABEL = f"{LABEL_PREFIX}tier"


def effective_facts(desired: DesiredState, host: str, facts: HostFacts) -> HostFacts:
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


def plan_from_file(path: Path) -> FleetPlan:
    """Raises ProblemsError (`FILE: key.path: reason`, every one) for an unreadable or invalid plan."""
    try:
        return FleetPlan.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise ProblemsError([Problem(str(path), "(file)", f"cannot read: {exc.strerror or exc}")]) from None
    except ValidationError as exc:
        raise ProblemsError(problems_from_validation(str(path), exc, FleetPlan)) from None


def plan_alone(desired: DesiredState, host: str, facts: HostFacts, now: datetime) -> FleetPlan:
    """The scheduler over a fleet of this host alone."""
    record = node_record(desired, host, facts)
    node = SnapshotNode(
        node_id=host,
        tier=record.tier,
        max_concurrent_tasks=record.max_concurrent_tasks,
        max_concurrent_ceiling=record.max_concurrent_ceiling,
        arch=record.arch,
        labels=dict(record.labels),
        cost=record.cost,
    )
    return schedule(Snapshot(now=now, nodes=[node]), desired, leader=host, epoch=0)


def read_registry(
    connect: Callable[[], PassRegistry],
    desired: DesiredState,
    host: str,
    facts: HostFacts,
    *,
    write: bool,
    signer: PlanSigner | None = None,
    units_now: Callable[[], UnitsSeen] | None = None,
    open_lanes: Callable[[], LaneBroker | None] = no_lane_broker,
    open_dispatcher: Callable[[], LaneBroker | None] | None = None,
) -> PlanOffer:
    """Connect, heartbeat (when `write`), maybe lead, then the newest plan.
    The lanes are read with `open_lanes` (the reader's DSN); a leader step
    dispatches with `open_dispatcher` (the dispatcher's; None: `open_lanes`).

    The heartbeat's load is measured from `units_now` (the generation that
    runs as the pass starts); the pass beats again after activation
    (`beat_after_activation`)."""
    notes: list[str] = []
    registry: PassRegistry | None = None
    opened: list[LaneBroker | None] = []

    dispatching: list[LaneBroker | None] = []

    def lanes() -> LaneBroker | None:
        # Opened at most once, and only by what reads it: the lanes whose
        # jobs run here, or a leader step actually taken.
        if not opened:
            opened.append(open_lanes())
        return opened[0]

    def dispatch_lanes() -> LaneBroker | None:
        if open_dispatcher is None:
            return lanes()
        if not dispatching:
            dispatching.append(open_dispatcher())
        return dispatching[0]

    sent: NodeRecord | None = None
    try:
        registry = connect()
        if write:
            lane_broker = lanes() if lanes_here(desired, host) else None
            measured = measure(desired, host, units_now(), lane_broker, notes.append) if units_now is not None else None
            sent = node_record(desired, host, facts, measured)
            stored = registry.heartbeat(sent)
            notes.append(stored.heartbeat_note())
            led = lead_once(registry, desired, host, signer, dispatch_lanes)
            if led:
                notes.append(f"leader step: {led}")
        # The leader record before the plan (signed fleets: a plan is applied
        # only as the current term's); a term that begins in between refuses
        # this pass's plan, and the next pass reads the new term's.
        leader = registry.leader_term() if desired.fleet.plan_keys else None
        # The epoch before the plan: a plan published in between makes the
        # epoch kept older than the plan, never newer (the next pass is full).
        epoch = registry.epoch()
        try:
            newest, read = newest_for(registry, desired, host)
        except (RegistryUnavailable, PermissionDenied):
            raise
        except RegistryError as exc:  # a part missing, garbled or not the index's: keep what runs
            return PlanOffer("registry", None, tuple(notes), registry_failed=f"the newest plan cannot be taken ({exc})")
        own_state = next((s for s in registry.node_states() if s.node_id == host), None) if ray_role(desired.fleet.ray, host) else None
    except PermissionDenied as exc:  # this host's identity may not do that: fail static, and say it is not an outage
        return PlanOffer("registry", None, tuple(notes), registry_failed=f"registry refused this host ({exc})")
    except RegistryError as exc:  # RegistryUnavailable above all
        return PlanOffer("registry", None, tuple(notes), registry_failed=f"registry unreachable ({exc})")
    finally:
        if registry is not None:
            registry.close()
        for broker in (*opened, *dispatching):
            if broker is not None:
                broker.close()
    return PlanOffer("registry", newest, tuple(notes), registry_epoch=epoch, heartbeat=sent, own_state=own_state, leader=leader, read=read, host=host)


def newest_for(registry: PlanReads, desired: DesiredState, host: str) -> tuple[FleetPlan | None, PlanRead | None]:
    """The newest plan as `host`'s pass needs it: the whole plan on the edge
    (`reads_whole_plan`), else the signed index and only this host's parts
    (and the fleet part where `reads_fleet_part`), each checked against the
    index's digest at its revision: a pass's read does not grow with the
    plan. Raises RegistryError (naming the part) as `newest_plan` does."""
    if reads_whole_plan(desired, host):
        return registry.newest_plan(), None
    fleet = reads_fleet_part(desired, host)
    read = registry.plan_read(lambda index: host_part_names(index, host, fleet=fleet))
    return (read.plan, read) if read is not None else (None, None)


def epoch_moved_past(connect: Callable[[], EpochConnection], source: PassPlan) -> int | None:
    """The registry's epoch now, when it moved past the plan `source` was
    read with: a plan published (or a leader elected) since this pass read
    its own. None when it did not, when `source` read no registry plan
    (`PassPlan.epoch_read`: none, or the host static), or when the registry
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


def fleet_plan_for(
    choice: PlanSource,
    desired: DesiredState,
    host: str,
    facts: HostFacts,
    *,
    connect: Callable[[], PassRegistry],
    applied_epoch: int | AppliedFence | None,
    has_generation: bool,
    now: datetime,
    write: bool,
    signer: PlanSigner | None = None,
    units_now: Callable[[], UnitsSeen] | None = None,
    open_lanes: Callable[[], LaneBroker | None] = no_lane_broker,
    open_dispatcher: Callable[[], LaneBroker | None] | None = None,
) -> PassPlan:
    """The pass's fleet plan from `choice`, through the fence.

    `write=False` (fabric plan) reads the registry's plan but sends no
    heartbeat and takes no leader step. Raises ProblemsError for an
    unreadable or invalid plan file."""
    if isinstance(choice, PlanFile):
        offer = PlanOffer("file", plan_from_file(choice.path))
    elif isinstance(choice, PlanAlone):
        offer = PlanOffer("alone", plan_alone(desired, host, facts, now))
    else:
        offer = read_registry(
            connect, desired, host, facts, write=write, signer=signer, units_now=units_now, open_lanes=open_lanes, open_dispatcher=open_dispatcher
        )
    source = admit(offer, desired, applied_epoch=applied_epoch, has_generation=has_generation, now=now)
    if offer.registry_epoch is None:
        return source
    return replace(source, registry_epoch=offer.registry_epoch, heartbeat=offer.heartbeat, own_state=offer.own_state)
