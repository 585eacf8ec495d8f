"""fabric schedule: the plan the scheduler makes, as a what-if tool.

    fabric schedule [--desired DIR] [--snapshot FILE | --registry-path FILE] [--json]

Schedules the desired state's services over a snapshot and prints the plan:
placements (with fallbacks), deferred replicas with their reasons, the lanes
in dispatch order and any snapshot node that is not a declared host. With
`--snapshot FILE` the snapshot is a saved one (`fabric registry export`, or
hand-written: `{"now", "nodes": [{"node_id", "tier", "status", "in_flight",
"max_concurrent_tasks", "arch", "labels", "units"}], "lanes": [{"id",
"in_flight"}]}`: a lane's health is its agent host's); without it, the live registry's. Nothing is published: the
leader does that. `--json` prints the FleetPlan JSON.

Exit status: 0 a plan was made (deferred work included); 1 the registry could
not be read; 2 bad input (desired state, snapshot file), with file, key path
and reason.
"""

from __future__ import annotations

import argparse

from reconciler.cli import EXIT_OK
from reconciler.cli.registry_options import add_snapshot_options, desired_and_snapshot
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan
from reconciler.core.scheduling.placement import schedule


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schedule", help="print the plan the scheduler makes for a snapshot (a what-if)")
    add_snapshot_options(p)
    p.add_argument("--json", action="store_true", help="print the plan as FleetPlan JSON")
    p.set_defaults(func=run)


# --------------------------------------------------------------------------
# Output


def render_plan(plan: FleetPlan, desired: DesiredState) -> str:
    """The plan as text for a person."""
    services = {s.id: s for s in desired.fleet.services}
    lines = [
        f"plan at {plan.created.strftime('%Y-%m-%dT%H:%M:%SZ')}, epoch {plan.epoch}, leader {plan.leader}, "
        f"strategy {desired.fleet.scheduler.strategy}"
        + (f", cost {desired.fleet.scheduler.cost_order}" if desired.fleet.scheduler.cost_order != "within_tier" else "")
    ]
    lines.append(f"placements ({len(plan.placements)}):")
    width = max([len(f"{p.service}[{p.replica}]") for p in plan.placements] + [0])
    node_width = max([len(p.node) for p in plan.placements] + [0])
    tier_width = max([len(p.tier) for p in plan.placements] + [0])
    for p in plan.placements:
        note = ""
        if p.fallback and p.service in services:
            note = f"  fallback from {services[p.service].min_tier}"
        if p.replaces is not None:
            note += f"  coming home from {p.replaces} (both run until it starts here)"
        if p.hedge is not None:
            note += f"  hedge for {p.hedge} (suspected: both run until {p.hedge} recovers for a stable window or goes offline)"
        lines.append(f"  {f'{p.service}[{p.replica}]':<{width}}  {p.node:<{node_width}}  {p.tier:<{tier_width}}{note}".rstrip())
    if not plan.placements:
        lines.append("  none")
    lines.append(f"deferred ({len(plan.deferred)}):")
    for d in plan.deferred:
        lines.append(f"  {d.service}[{d.replica}]: {d.reason}")
    if not plan.deferred:
        lines.append("  none")
    lines.append("lanes (dispatch order):")
    for lane in plan.lanes:
        state = "online" if lane.available else f"offline: {lane.reason}"
        if lane.available and lane.full:
            state = f"online, full: {'lane cap' if lane.full == 'cap' else f'host {lane.host} at capacity'}"
        lines.append(f"  {lane.kind:<7}  {lane.id:<{max(len(x.id) for x in plan.lanes)}}  rank {lane.rank:<3}  {lane.in_flight}/{lane.cap}  {state}")
    if plan.ignored_nodes:
        lines.append(f"ignored nodes (not declared hosts): {', '.join(plan.ignored_nodes)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    desired, snapshot = desired_and_snapshot(args)
    plan = schedule(snapshot, desired)
    print(plan.model_dump_json(indent=2) if args.json else render_plan(plan, desired))
    return EXIT_OK
