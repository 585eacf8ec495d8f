"""What every pass leaves for people and monitoring, beside its generation.

- the probe's damping history (a device missed once does not demote the node),
- the Prometheus textfile for node_exporter (every host),
- the fleet status page served by the edge's Caddy (edge hosts), and beside
  it the capabilities API's JSON documents (core.views.capabilities).

These are rewritten every pass, atomically, and are not part of a generation:
a status page that changes every 30 s must not make a new generation or
reload Caddy. Failing to write one is a note for the log, never fails the pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from reconciler.core.desired.model import DesiredState, HostFacts
from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.pass_files import PASS_COUNTERS, TEXTFILE_PATH
from reconciler.core.probe.damping import ProbeHistory, damp
from reconciler.core.render.status_site import STATUS_FILE, STATUS_ROOT
from reconciler.core.templating import PACKAGED, Templates
from reconciler.engine.desired_load import named_hosts
from reconciler.engine.fleet_view import FleetView
from reconciler.engine.plan_fence import PassPlan
from reconciler.ports import FileTree

PROBE_HISTORY = "probe-history.json"


def damped_facts(tree: FileTree, state_dir: str, desired: DesiredState, observed: HostFacts, now: datetime) -> tuple[HostFacts, ProbeHistory]:
    """The facts this pass uses (a lower tier only after `missed_beats` passes
    in a row) and the history to keep; `save_probe_history` keeps it once the
    pass's inputs all checked out, so bad input still changes nothing."""
    raw = tree.read(f"{state_dir}/{PROBE_HISTORY}")
    try:
        history = ProbeHistory.model_validate_json(raw) if raw else ProbeHistory()
    except ValueError:
        # A history from another version or a torn disk: start afresh rather
        # than refuse to run (the worst case is one undamped pass).
        history = ProbeHistory()
    return damp(history, observed, now, passes=desired.fleet.timing.missed_beats)


def save_probe_history(tree: FileTree, state_dir: str, history: ProbeHistory) -> None:
    tree.write(f"{state_dir}/{PROBE_HISTORY}", history.model_dump_json().encode())


@dataclass(frozen=True)
class PassFigures:
    succeeded: bool
    rolled_back: bool
    generation: int | None
    duration_s: float


def write_pass_records(
    tree: FileTree,
    state_dir: str,
    desired: DesiredState,
    host: str,
    source: PassPlan,
    outcome: PassFigures,
    now: datetime,
    view: FleetView | None = None,
    templates: Templates = PACKAGED,
) -> str | None:
    """Write them; a note for the log when they cannot be written (the pass still counts).
    `view`: the registry's view of the fleet, read by an edge's pass
    (`fleet_view.read_fleet_view`): the fleet's metrics and the status page."""
    try:
        _write(tree, state_dir, desired, host, source, outcome, now, view, templates)
    except OSError as exc:
        return f"could not write metrics or the status page: {exc}"
    return None


def shows_fleet(desired: DesiredState, host: str, source: PassPlan) -> bool:
    """This pass reads the fleet's view and writes its status page: an edge
    host whose pass reached the registry (its plan came from it, or was
    refused there)."""
    return source.registry_epoch is not None and "edge" in desired.hosts[host].host.roles


def page_hosts(desired: DesiredState, host: str, plan: FleetPlan, snapshot: Snapshot) -> DesiredState:
    """The declared hosts the edge's page and fleet metrics list: the nodes the
    registry knows (its snapshot), the hosts the plan places services on, and
    those a pass of the edge reads (engine.desired_load.named_hosts: control,
    lanes, leader candidates, port-map targets). A declared host outside them
    that never reported is left out, so the page is the same whether the pass
    loaded the whole tree (a new commit) or a few files, and costs the same at
    five or ten thousand declared hosts; `fabric status` lists every declared host."""
    names = named_hosts(desired.fleet, host, desired.hosts_with_role("control"), edge=True)
    names |= {p.node for p in plan.placements} | {n.node_id for n in snapshot.nodes}
    if set(desired.hosts) <= names:
        return desired
    return desired.model_copy(update={"hosts": {name: config for name, config in desired.hosts.items() if name in names}})


def _write(
    tree: FileTree,
    state_dir: str,
    desired: DesiredState,
    host: str,
    source: PassPlan,
    outcome: PassFigures,
    now: datetime,
    view: FleetView | None,
    templates: Templates,
) -> None:
    # The metrics and the page are written once the pass has activated: their
    # views are imported here, not by a pass on its way to activation.
    from reconciler.core.views.metrics import PassMetrics, render_metrics
    from reconciler.core.views.page import render_status_page

    counters_path = f"{state_dir}/{PASS_COUNTERS}"
    raw = tree.read(counters_path)
    try:
        counters = json.loads(raw) if raw else {}
    except ValueError:
        counters = {}
    rollbacks = int(counters.get("rollbacks_total", 0)) + (1 if outcome.rolled_back else 0)
    last_success = now.isoformat() if outcome.succeeded else counters.get("last_success")
    tree.write(counters_path, json.dumps({"rollbacks_total": rollbacks, "last_success": last_success}).encode())

    stats = PassMetrics(
        duration_s=outcome.duration_s,
        succeeded=outcome.succeeded,
        last_success=datetime.fromisoformat(last_success) if last_success else None,
        generation=outcome.generation,
        plan_epoch=source.plan.epoch if source.static is None else None,
        rollbacks_total=rollbacks,
    )
    snapshot = view.snapshot if view is not None else None
    if snapshot is not None:
        desired = page_hosts(desired, host, source.plan, snapshot)
    tree.write(
        TEXTFILE_PATH,
        render_metrics(stats, desired=desired if snapshot else None, snapshot=snapshot, plan=source.plan if snapshot else None).encode(),
    )
    if view is not None and snapshot is not None:
        plan = source.plan if source.plan.leader else None
        page = render_status_page(desired, snapshot, plan, now, plan_refused=source.refused, history=view.history, templates=templates)
        tree.write(f"{STATUS_ROOT.strip('/')}/{STATUS_FILE}", page.encode())
        write_capabilities(tree, STATUS_ROOT.strip("/"), view)


def write_capabilities(tree: FileTree, root: str, view: FleetView) -> None:
    """The capabilities API's documents under `root` (the status site's),
    each written atomically; a node's document that is no longer in the
    fleet's view is removed."""
    from reconciler.core.views.capabilities import CAPABILITIES_DIR, capability_documents

    files = capability_documents(view.snapshot, view.pending)
    for path, text in files.items():
        tree.write(f"{root}/{path}", text.encode())
    node_dir = f"{root}/{CAPABILITIES_DIR}/nodes"
    for name in tree.list_dir(node_dir):
        if f"{CAPABILITIES_DIR}/nodes/{name}" not in files:
            tree.remove(f"{node_dir}/{name}")
