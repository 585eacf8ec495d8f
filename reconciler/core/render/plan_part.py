"""This host's part of a fleet plan: all that `render()` takes from the plan (pure).

A fleet plan is the fleet's (every placement, the deferred replicas, the
lanes' views); a host's artifacts depend on only a little of it:

- the services placed on this host (their agent units, their ports in its
  nftables);
- on an edge host, for each routed service, the nodes it is placed on (its
  Caddy site's upstreams);
- on a control host of a phaze fleet, the compute lanes the leader left out of
  phaze's backends.toml (`FleetPlan.steering`, names of declared compute
  lanes only).

`render()` reads the plan only through `plan_part`, so the part is by
construction what a pass installs from the plan; `fabric watch` starts a pass
on a new plan only when this part's `digest` changed (an epoch that moves
work between two other hosts is none of this host's business).

Placements are checked against the desired state first, as render always
did: one naming a service or a host the desired state does not know is left
out of the part and reported in `notes` (the plan comes from a registry any
host may write; it only selects names, never supplies text).

Left out on purpose: the edge's status page and fleet metrics show the whole
plan (epoch, every placement, the deferred replicas), but they are files the
edge's every timer pass rewrites from the registry (`engine.pass_records`),
not artifacts of the plan; the generation's manifest records the epoch it
was rendered at, which installs nothing. A new epoch whose part is the same
reaches them at the next timer tick.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan


@dataclass(frozen=True)
class PlanPart:
    """What `render()` of one host takes from a fleet plan."""

    host: str
    # The services placed on this host, sorted, each once (however many replicas).
    services_here: tuple[str, ...]
    # Edge only (empty elsewhere): each routed service's id with the sorted
    # nodes it is placed on, by service id; a routed service placed nowhere
    # has no nodes (its site answers 503 until it is placed).
    upstreams: tuple[tuple[str, tuple[str, ...]], ...]
    # Control host only (empty elsewhere): the compute lanes left out of
    # phaze's backends.toml, sorted.
    lanes_out: tuple[str, ...] = ()

    def nodes_of(self, service_id: str) -> tuple[str, ...]:
        """The nodes a routed service is placed on (edge only)."""
        return next((nodes for sid, nodes in self.upstreams if sid == service_id), ())

    def canonical(self) -> str:
        """The part as canonical JSON (sorted keys, no spaces)."""
        part: dict[str, object] = {
            "host": self.host,
            "services_here": list(self.services_here),
            "upstreams": {sid: list(nodes) for sid, nodes in self.upstreams},
        }
        if self.lanes_out:  # absent when empty: a part without steering keeps its digest
            part["lanes_out"] = list(self.lanes_out)
        return json.dumps(part, sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> str:
        """sha256 of `canonical()`: equal parts, equal digests, whatever the epoch."""
        return hashlib.sha256(self.canonical().encode()).hexdigest()


def is_edge(desired: DesiredState, host_name: str) -> bool:
    host = desired.hosts.get(host_name)
    return host is not None and "edge" in host.host.roles


def plan_part(desired: DesiredState, plan: FleetPlan, host_name: str, notes: list[str] | None = None) -> PlanPart:
    """`host_name`'s part of `plan` under `desired`. Placements naming a
    service or host `desired` does not declare are left out and, when `notes`
    is given, said there (every one of the plan, as a pass reports them)."""
    service_ids = {s.id for s in desired.fleet.services}
    here: set[str] = set()
    routed = {s.id for s in desired.fleet.services if s.route} if is_edge(desired, host_name) else set()
    nodes: dict[str, set[str]] = {sid: set() for sid in routed}
    for p in plan.placements:
        if p.service not in service_ids:
            if notes is not None:
                notes.append(f"plan epoch {plan.epoch}: unknown service {p.service!r} ignored")
            continue
        if p.node not in desired.hosts:
            if notes is not None:
                notes.append(f"plan epoch {plan.epoch}: service {p.service!r} placed on unknown host {p.node!r}; ignored")
            continue
        if p.node == host_name:
            here.add(p.service)
        if p.service in nodes:
            nodes[p.service].add(p.node)
    return PlanPart(
        host=host_name,
        services_here=tuple(sorted(here)),
        upstreams=tuple((sid, tuple(sorted(nodes[sid]))) for sid in sorted(nodes)),
        lanes_out=lanes_left_out(desired, plan, host_name, notes),
    )


def lanes_left_out(desired: DesiredState, plan: FleetPlan, host_name: str, notes: list[str] | None = None) -> tuple[str, ...]:
    """On a control host of a phaze fleet, the declared compute lanes the plan
    leaves out of backends.toml (others it names are ignored and said); never
    every declared lane (phaze refuses a file without backends)."""
    host = desired.hosts.get(host_name)
    if host is None or "control" not in host.host.roles or not desired.fleet.phaze_dispatches:
        return ()
    compute = {lane.id for lane in desired.fleet.lanes if lane.kind == "compute"}
    out = set()
    for lane_id in plan.steering.out_ids():
        if lane_id in compute:
            out.add(lane_id)
        elif notes is not None:
            notes.append(f"plan epoch {plan.epoch}: lane {lane_id!r} to leave out of backends.toml is no declared compute lane; ignored")
    if out and len(out) >= len(desired.fleet.lanes):
        if notes is not None:
            notes.append(f"plan epoch {plan.epoch}: leaving out every lane would leave phaze no backend; all kept")
        return ()
    return tuple(sorted(out))


def reads_whole_plan(desired: DesiredState, host_name: str) -> bool:
    """Whether `host_name`'s pass reads the whole plan: the edge (its routed
    services' nodes, and its status page shows every placement and deferred
    replica). Any other host reads only its own parts (`plan_parts.PlanRead`)
    and, with `reads_fleet_part`, the fleet part: all `plan_part` takes."""
    return is_edge(desired, host_name)


def reads_fleet_part(desired: DesiredState, host_name: str) -> bool:
    """Whether `host_name`'s part takes the plan's steering (`lanes_left_out`:
    a control host of a phaze fleet), which the fleet part holds."""
    host = desired.hosts.get(host_name)
    return host is not None and "control" in host.host.roles and desired.fleet.phaze_dispatches


def hosts_the_part_reads(desired: DesiredState, plan: FleetPlan, host_name: str) -> set[str]:
    """The hosts whose files must be loaded to compute `host_name`'s part from
    a partly loaded desired state (fabric.toml and this host's own file): on
    the edge, the nodes its routed services are placed on (a placement on an
    undeclared host is left out, so declared-ness must be known); elsewhere
    none beside this host."""
    if not is_edge(desired, host_name):
        return {host_name}
    routed = {s.id for s in desired.fleet.services if s.route}
    return {host_name} | {p.node for p in plan.placements if p.service in routed}
