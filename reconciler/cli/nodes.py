"""fabric nodes: every node with its tier, status, utilization, last beat and hold-off.

Lists what the registry knows (its lifecycle as of now), plus each host the
desired state declares that has never sent a heartbeat, and the machines
without a host file that wait for admission (pending: probed tier, hardware,
how long they waited, the command that admits them). `--json` gives the
capabilities API's document (`{"nodes": [...]}`, the seed's data model, as
the edge serves it at /api/capabilities/nodes) with, beside it, the full
lifecycle states (transitions included), the never-seen hosts and the
unreadable records.
"""

from __future__ import annotations

import argparse
import json

from reconciler.cli import EXIT_OK
from reconciler.cli.registry_options import add_registry_options, desired_and_registry
from reconciler.core.live.pending import live_pending
from reconciler.core.live.unreadable import problem_lines
from reconciler.core.scheduling.lifecycle import NodeState
from reconciler.core.timestamps import stamp
from reconciler.core.views.capabilities import capability_nodes, pending_lines


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("nodes", help="list the fleet's nodes: tier, status, utilization, last seen, hold-off")
    add_registry_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (lifecycle states with transitions)")
    p.set_defaults(func=run)


def _utilization(state: NodeState) -> str:
    record = state.record
    if record is None:
        return "-"
    if record.max_concurrent_tasks <= 0:
        return f"{record.in_flight}/0"
    return f"{record.in_flight}/{record.max_concurrent_tasks} ({100 * record.in_flight / record.max_concurrent_tasks:.0f}%)"


def run(args: argparse.Namespace) -> int:
    with desired_and_registry(args) as (desired, registry):
        snapshot = registry.snapshot()
        states = registry.node_states()
        reports, unreadable_pending = registry.pending_nodes()
    now = snapshot.now
    pending = live_pending(reports, now, set(desired.hosts) | {n.node_id for n in snapshot.nodes})
    known = {s.node_id for s in states}
    never_seen = sorted(set(desired.hosts) - known)
    # Records the registry holds that did not parse: skipped, their nodes not beating.
    unreadable = problem_lines(snapshot.unreadable) + unreadable_pending

    if args.json:
        # Each node: the capabilities API's object (the same keys and values
        # as the edge serves), with its lifecycle state beside them.
        capabilities = {node["node_id"]: node for node in capability_nodes(snapshot, pending)}
        lifecycle = [
            {
                **json.loads(s.model_dump_json()),
                "tier": s.record.tier if s.record else None,
                "utilization": (s.record.in_flight / s.record.max_concurrent_tasks) if s.record and s.record.max_concurrent_tasks > 0 else None,
                "declared": s.node_id in desired.hosts,
                **capabilities.pop(s.node_id, {}),
            }
            for s in states
        ]
        out = {
            "nodes": lifecycle + list(capabilities.values()),
            "now": now.isoformat(),
            "leader": snapshot.leader,
            "epoch": snapshot.epoch,
            "never_seen": never_seen,
            "unreadable": unreadable,
        }
        print(json.dumps(out, indent=2))
        return EXIT_OK

    rows = [("NODE", "TIER", "STATUS", "UTILIZATION", "LAST SEEN", "HELD OFF UNTIL")]
    for s in states:
        status = s.status + (" (drained)" if s.drained else "")
        if s.node_id not in desired.hosts:
            status += " [undeclared]"
        held = stamp(s.held_off_until, now) if s.held_off(now) else "-"
        rows.append((s.node_id, s.record.tier if s.record else "-", status, _utilization(s), stamp(s.last_seen, now), held))
    for host in never_seen:
        rows.append((host, "-", "never seen", "-", "-", "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    for line in pending_lines(pending, now):
        print(line)
    if unreadable:
        print()
        print("UNREADABLE RECORDS (skipped: their nodes count as not beating)")
        for line in unreadable:
            print(f"  {line}")
    return EXIT_OK
