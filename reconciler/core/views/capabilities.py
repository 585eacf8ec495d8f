"""The capabilities API: a read-only JSON view of the fleet in the seed's data model (pure).

    GET /api/capabilities/nodes          {"nodes": [node, ...]}
    GET /api/capabilities/nodes/<host>   node

one object per node: node_id (its host name), tailscale_ip, hardware (arch,
cpu_cores, memory_mib, gpus, storage, ffmpeg, framebuffer), tier, limitations,
last_seen and status (active, draining, offline, dead; "pending" for a
machine that waits for admission: its probe record, no authority). The
nodes come from the leader's snapshot as the registry gives it (their
heartbeats keep the whole hardware record) and the live pending reports.
The edge's pass writes these documents beside the status page
(engine.pass_records) and its Caddy serves them (core.render.status_site);
`fabric nodes --json` prints the same list.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from reconciler.core.live.models import Snapshot, SnapshotNode
from reconciler.core.live.pending import PENDING, PendingRecord, admission_command, hardware_summary, waited_s, waited_text, waits_note

# Where the documents go, relative to the status site's root.
CAPABILITIES_DIR = "api/capabilities"
NODES_FILE = f"{CAPABILITIES_DIR}/nodes.json"


def node_file(host: str) -> str:
    return f"{CAPABILITIES_DIR}/nodes/{host}.json"


def _stamp(moment: datetime | None) -> str | None:
    return moment.isoformat().replace("+00:00", "Z") if moment is not None else None


def _node(node: SnapshotNode) -> dict[str, Any]:
    hardware = node.hardware.model_dump(mode="json") if node.hardware is not None else {"arch": node.arch, "gpus": [], "storage": [], "ffmpeg": []}
    limitations = (
        node.limitations.model_dump(mode="json")
        if node.limitations is not None
        else {"max_concurrent_tasks": node.max_concurrent_tasks, "max_concurrent_ceiling": node.max_concurrent_ceiling}
    )
    return {
        "node_id": node.node_id,
        "tailscale_ip": node.tailscale_ip,
        "hardware": hardware,
        "tier": node.tier,
        "limitations": limitations,
        "labels": dict(node.labels),
        "last_seen": _stamp(node.last_seen),
        "status": node.status,
    }


def _pending(record: PendingRecord, now: datetime) -> dict[str, Any]:
    facts = record.facts
    return {
        "node_id": record.node_id,
        "tailscale_ip": facts.tailscale_ip,
        "hardware": facts.hardware.model_dump(mode="json"),
        "tier": facts.tier,
        "limitations": facts.limitations.model_dump(mode="json"),
        "labels": dict(facts.labels),
        "last_seen": _stamp(record.reported_at),
        "status": PENDING,
        "waiting_s": round(waited_s(record, now)),
        "admit": admission_command(record.node_id),
    }


def capability_nodes(snapshot: Snapshot, pending: Sequence[PendingRecord]) -> list[dict[str, Any]]:
    """Every node of the snapshot, then every pending machine not among them, by name."""
    known = {n.node_id for n in snapshot.nodes}
    nodes = [_node(n) for n in sorted(snapshot.nodes, key=lambda n: n.node_id)]
    nodes += [_pending(r, snapshot.now) for r in sorted(pending, key=lambda r: r.node_id) if r.node_id not in known]
    return nodes


def capability_documents(snapshot: Snapshot, pending: Sequence[PendingRecord]) -> dict[str, str]:
    """The files of the API (path under the site's root -> JSON text)."""
    nodes = capability_nodes(snapshot, pending)
    files = {NODES_FILE: json.dumps({"nodes": nodes}, indent=2, sort_keys=True) + "\n"}
    for node in nodes:
        files[node_file(node["node_id"])] = json.dumps(node, indent=2, sort_keys=True) + "\n"
    return files


def pending_rows(pending: Sequence[PendingRecord], now: datetime) -> list[tuple[str, str, str, str, str]]:
    """(machine, probed tier, hardware summary, waited, admission command) per pending machine."""
    return [
        (r.node_id, r.facts.tier, hardware_summary(r.facts.hardware), waited_text(waited_s(r, now)), admission_command(r.node_id))
        for r in sorted(pending, key=lambda r: r.node_id)
    ]


def pending_lines(pending: Sequence[PendingRecord], now: datetime, this_host: str | None = None) -> list[str]:
    """The PENDING section of `fabric nodes` and `fabric status` (empty: none),
    and, on a machine that is itself pending, what it waits for."""
    if not pending:
        return []
    rows = [("MACHINE", "PROBED TIER", "HARDWARE", "WAITED", "ADMIT WITH"), *pending_rows(pending, now)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = ["", f"PENDING · machines without a host file, waiting for admission; they get no work, routes or secrets ({len(pending)})"]
    out += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    mine = next((r for r in pending if r.node_id == this_host), None)
    if mine is not None:
        out += ["", f"this machine: {waits_note(mine.node_id, mine.facts.tier)}"]
    return out
