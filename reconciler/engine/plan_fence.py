"""The one fence every plan passes before a pass renders from it, and fail static."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from reconciler.core.desired.model import DesiredState
from reconciler.core.live.fencing import AppliedFence, RegistryTrust, accept_plan
from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.live.plan_parts import PlanRead
from reconciler.core.live.records import LeaderInfo, NodeRecord
from reconciler.core.scheduling.lanes import lane_views
from reconciler.core.scheduling.lifecycle import NodeState


@dataclass(frozen=True)
class PassPlan:
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


# Said once per pass when a registry plan is taken without a signature to check.
UNSIGNED_NOTE = "fleet plans are not signed: any registry client can forge them (list [[plan_keys]] in fabric.toml; see README 'Signed plans')"


# Why a plan older than the applied one comes from each source.
STALE_CAUSE = {
    "registry": "stale leader or lagging registry",
    "file": "the plan file is older than the plan this host runs",
    "alone": "this host's own plan does not replace the fleet's",
}


@dataclass(frozen=True)
class PlanOffer:
    """What a plan source offers, before the fence."""

    origin: Literal["file", "alone", "registry"]
    plan: FleetPlan | None
    notes: tuple[str, ...] = ()
    # Why the registry gave no answer: unreachable, or it refused this host (then there is no plan to fence).
    registry_failed: str | None = None
    registry_epoch: int | None = None
    heartbeat: NodeRecord | None = None
    own_state: NodeState | None = None
    # The registry's leader record, read before its newest plan (live, stale
    # or resigned: its term is the current one until a candidate campaigns);
    # None: the registry holds none.
    leader: LeaderInfo | None = None
    # `plan` is this host's read of the newest plan (its signed index and
    # only the parts it needs, `plan_parts.PlanRead`); None: the whole plan.
    read: PlanRead | None = None
    # Whose read it is (the host of the pass), for the fence's check that
    # every part the index names for it was read.
    host: str | None = None


def registry_trust(desired: DesiredState, leader: LeaderInfo | None) -> RegistryTrust:
    """What a registry plan must name to be applied here (`accept_plan`)."""
    return RegistryTrust(
        fleet=desired.fleet.fleet.name,
        prefix=desired.fleet.registry.prefix,
        candidate=leader.candidate if leader is not None else None,
        term=leader.term if leader is not None else None,
    )


def empty_plan(desired: DesiredState, now: datetime) -> FleetPlan:
    return FleetPlan(epoch=0, leader="", created=now, lanes=lane_views(desired, Snapshot(now=now)))


def admit(offer: PlanOffer, desired: DesiredState, *, applied_epoch: int | AppliedFence | None, has_generation: bool, now: datetime) -> PassPlan:
    """The plan this pass renders from: the offer if the fence admits it,
    else the empty plan or (a host that runs a generation) fail static."""
    notes = list(offer.notes)
    if offer.registry_failed is not None:
        if has_generation:
            return PassPlan(empty_plan(desired, now), static=f"{offer.registry_failed}: running static", notes=tuple(notes))
        notes.append(f"{offer.registry_failed}: no generation yet, rendering host-local units from an empty plan")
        return PassPlan(empty_plan(desired, now), notes=tuple(notes))
    # Only the registry's plans must come from a declared candidate and carry
    # its signature: a plan file or --no-registry's own plan is the operator's choice.
    from_registry = offer.origin == "registry"
    signers = desired.fleet.fleet.leader_candidates if from_registry else None
    keys = desired.fleet.plan_keys if from_registry else None
    if from_registry and not keys and offer.plan is not None:
        notes.append(UNSIGNED_NOTE)
    trust = registry_trust(desired, offer.leader) if from_registry else None
    verdict = accept_plan(
        applied_epoch,
        offer.plan,
        leader_candidates=signers,
        plan_keys=keys,
        stale_cause=STALE_CAUSE[offer.origin],
        registry=trust,
        read=offer.read,
        host=offer.host,
    )
    if verdict.accepted and offer.plan is not None:
        if offer.origin == "registry":
            notes.append(verdict.reason)
        return PassPlan(offer.plan, notes=tuple(notes))
    if offer.plan is None and not (applied_epoch.epoch if isinstance(applied_epoch, AppliedFence) else applied_epoch):
        # Nothing published and nothing applied from a published plan: the
        # empty plan is what runs, so host-local changes still converge.
        notes.append(f"{verdict.reason}: rendering host-local units from an empty plan")
        return PassPlan(empty_plan(desired, now), notes=tuple(notes))
    refused = verdict.reason if verdict.untrusted else None
    if has_generation:
        return PassPlan(empty_plan(desired, now), static=f"{verdict.reason}: running static", notes=tuple(notes), refused=refused)
    notes.append(f"{verdict.reason}: rendering host-local units from an empty plan")
    return PassPlan(empty_plan(desired, now), notes=tuple(notes), refused=refused)
