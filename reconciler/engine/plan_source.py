"""Where a pass gets its fleet plan: the registry (the normal case), a file, or nobody.

    --plan-file FILE   a saved FleetPlan (what-if, tests); the registry is not touched
    --no-registry      a plan the scheduler computes over this host alone
                       (a one-host fleet: what it could run if it were alone)
    otherwise          the registry of fabric.toml [registry] (or --registry-path):
                         1 heartbeat this host's facts (its record lives for the
                           node timeout, longer for a DERP-relayed path)
                         2 a leader candidate with nobody leading takes one
                           leader step (campaign, lifecycle, schedule, publish
                           if the plan changed) and resigns, so a single host
                           with the embedded registry schedules itself and a
                           running fabric-leader.service is never displaced
                         3 the newest published plan, checked by the fence
                           (`accept_plan`): not older than what this host
                           applied, signed by a declared leader candidate

Fail static: when the registry cannot be reached, or has no plan this host
may apply while it runs placements from an earlier one, a host that already
runs a generation keeps it untouched and says why (`PlanSource.static`): it
never tears down work because it cannot see the leader. A host with no
generation yet, or one that has only ever run the empty plan, renders from an
empty plan, so its host-local units (lanes, port maps, nftables) converge.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from pydantic import ValidationError

from reconciler.cli.registry_options import add_registry_path
from reconciler.core.desired.model import TIER_SCORE, DesiredState, NodeFacts
from reconciler.core.live.fencing import accept_plan
from reconciler.core.live.models import FleetPlan, Snapshot, SnapshotNode
from reconciler.core.live.records import NodeRecord
from reconciler.core.probe.tiering import LABEL_PREFIX
from reconciler.core.scheduling.lanes import lane_views
from reconciler.core.scheduling.placement import schedule
from reconciler.ports import Registry, RegistryError

TIER_LABEL = f"{LABEL_PREFIX}tier"


def add_plan_source_options(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument("--plan-file", metavar="FILE", type=Path, help="render from this FleetPlan JSON; do not touch the registry")
    source.add_argument(
        "--no-registry",
        action="store_true",
        help="do not touch the registry: plan over this host alone (what it would run by itself)",
    )
    add_registry_path(p, otherwise="with --root and the sqlite backend, [registry].path under the root")


@dataclass(frozen=True)
class PlanSource:
    """The plan a pass renders from, or why it keeps its current generation."""

    plan: FleetPlan
    # Set when the host must keep what it runs (fail static); the reason says why.
    static: str | None = None
    # What happened on the way (heartbeat, leadership), for the log.
    notes: tuple[str, ...] = ()
    # The registry's view of the fleet, read on edge hosts for the status page.
    snapshot: Snapshot | None = None


def effective_facts(state: DesiredState, host: str, facts: NodeFacts) -> NodeFacts:
    """The probe as the fabric uses it: the host file's tier pin applied.

    An override can only lower the probe's tier (a typo must not send CUDA
    work to a CPU box); the tier label follows, so k3s and the registry see
    the tier the scheduler uses.
    """
    override = state.hosts[host].overrides.tier
    if override is None or TIER_SCORE[override] >= TIER_SCORE[facts.tier]:
        return facts
    labels = {**facts.labels, TIER_LABEL: override}
    notes = [*facts.limitations.notes, f"tier pinned to {override} by the host file (the probe found {facts.tier})"]
    return facts.model_copy(update={"tier": override, "labels": labels, "limitations": facts.limitations.model_copy(update={"notes": notes})})


def node_record(state: DesiredState, host: str, facts: NodeFacts) -> NodeRecord:
    """What this host reports: its (effective) facts with the host file's
    limits and declared labels (the operator's win), so services can be
    constrained to labels an operator declared."""
    declared = state.hosts[host]
    return NodeRecord.from_facts(
        host,
        facts,
        max_concurrent_tasks=declared.limits.max_concurrent_tasks,
        max_concurrent_ceiling=declared.limits.max_concurrent_ceiling,
        labels={**facts.labels, **declared.labels},
    )


def empty_plan(state: DesiredState, now: datetime) -> FleetPlan:
    return FleetPlan(epoch=0, leader="", created=now, lanes=lane_views(state, Snapshot(now=now)))


def plan_from_file(path: Path) -> FleetPlan:
    """Raises ValueError naming the file and key for an unreadable or invalid plan."""
    try:
        return FleetPlan.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise ValueError(f"{path}: {where}: {first['msg']}") from None


def plan_alone(state: DesiredState, host: str, facts: NodeFacts, now: datetime) -> FleetPlan:
    """The scheduler over a fleet of this host alone."""
    record = node_record(state, host, facts)
    node = SnapshotNode(
        node_id=host,
        tier=record.tier,
        max_concurrent_tasks=record.max_concurrent_tasks,
        max_concurrent_ceiling=record.max_concurrent_ceiling,
        arch=record.arch,
        labels=dict(record.labels),
    )
    return schedule(Snapshot(now=now, nodes=[node]), state, leader=host, epoch=0)


def registry_path(args: argparse.Namespace, state: DesiredState) -> Path | None:
    """--registry-path, or the sqlite file under a sandbox root."""
    if args.registry_path is not None:
        return args.registry_path
    if state.fleet.registry.backend == "sqlite" and Path(args.root) != Path("/"):
        return Path(args.root) / state.fleet.registry.path.lstrip("/")
    return None


def lead_once(registry: Registry, state: DesiredState, host: str) -> str | None:
    """One leader step if this host is a candidate and nobody leads; a note or None."""
    from reconciler.engine.leader import LeaderLoop

    if host not in state.fleet.fleet.leader_candidates or registry.leader() is not None:
        return None
    notes: list[str] = []
    loop = LeaderLoop(
        registry=registry,
        host=host,
        load_desired=lambda: state,
        schedule=schedule,
        lease_ttl_s=float(state.fleet.timing.heartbeat_s),
        log=notes.append,
    )
    try:
        loop.step()
    finally:
        if loop.leadership is not None:
            registry.resign(loop.leadership)
    return "; ".join(notes) or None


def from_registry(
    connect: Callable[[], Registry],
    state: DesiredState,
    host: str,
    facts: NodeFacts,
    *,
    applied_epoch: int | None,
    has_generation: bool,
    now: datetime,
    write: bool,
) -> PlanSource:
    """Connect, heartbeat (when `write`), maybe lead, then the newest plan behind the fence."""
    notes: list[str] = []
    registry: Registry | None = None
    try:
        registry = connect()
        if write:
            stored = registry.heartbeat(node_record(state, host, facts))
            notes.append(f"heartbeat: {host} tier {stored.tier}, alive for {stored.timeout_s:g} s")
            led = lead_once(registry, state, host)
            if led:
                notes.append(f"leader step: {led}")
        newest = registry.newest_plan()
        # The edge serves the fleet's status page, so it reads the whole view.
        snapshot = registry.snapshot(lanes=[lane.id for lane in state.lanes]) if "edge" in state.hosts[host].host.roles else None
    except RegistryError as exc:  # RegistryUnavailable above all
        reason = f"registry unreachable ({exc})"
        if has_generation:
            return PlanSource(empty_plan(state, now), static=f"{reason}: running static", notes=tuple(notes))
        notes.append(f"{reason}: no generation yet, rendering host-local units from an empty plan")
        return PlanSource(empty_plan(state, now), notes=tuple(notes))
    finally:
        if registry is not None:
            registry.close()
    verdict = accept_plan(applied_epoch, newest, leader_candidates=state.fleet.fleet.leader_candidates)
    if verdict.accepted and newest is not None:
        return PlanSource(newest, notes=(*notes, verdict.reason), snapshot=snapshot)
    if newest is None and not applied_epoch:
        # Nothing published and nothing applied from a published plan: the
        # empty plan is what runs, so host-local changes still converge.
        notes.append(f"{verdict.reason}: rendering host-local units from an empty plan")
        return PlanSource(empty_plan(state, now), notes=tuple(notes), snapshot=snapshot)
    if has_generation:
        return PlanSource(empty_plan(state, now), static=f"{verdict.reason}: running static", notes=tuple(notes), snapshot=snapshot)
    notes.append(f"{verdict.reason}: rendering host-local units from an empty plan")
    return PlanSource(empty_plan(state, now), notes=tuple(notes), snapshot=snapshot)


def print_notes(source: PlanSource) -> None:
    for note in source.notes:
        print(f"note: {note}", file=sys.stderr)
