"""The fleet's status page: the same lane cards as `fabric status`, as static HTML.

Pure: `render_status_page(desired, snapshot, plan, now)` returns the page as a
string. The edge host's reconcile pass writes it (atomically, like every other
artifact) under the directory its Caddy serves at `status.<domain>`
(`fleet.status_subdomain`); `reconciler.core.render.status_site` is that site block.

The page is self-contained (inline CSS, no external assets) so it works from a
phone on a flaky link and leaks nothing to third parties. It reloads itself
every pass interval (a meta refresh: the pass rewrites it that often) and says
when it was generated; one tiny inline script (templates/_status_age.js.j2,
allowed by its hash in the site's CSP, nothing else is) counts its age in
seconds by the reader's clock and marks it stale once no full pass can
explain its age (`FleetStatus.stale_after_s`).
"""

from __future__ import annotations

from datetime import datetime

from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.templating import PACKAGED, Templates
from reconciler.core.timestamps import display_time
from reconciler.core.views.cards import FleetStatus, NodeRow, event_time, fleet_status
from reconciler.core.views.timeline import FleetHistory

TEMPLATE_NAME = "status.html.j2"


def _node_status_class(node: NodeRow) -> str:
    if node.tier is None:
        return "status-unknown"
    return f"status-{node.status}"


def render_status_html(status: FleetStatus, templates: Templates = PACKAGED) -> str:
    """The page for an already-built `FleetStatus`."""
    # "html": every value on the page (reasons, ids) came from the registry or
    # the plan, so all of it is escaped. The environment is cached per process.
    template = templates.get("html", TEMPLATE_NAME)
    return template.render(
        status=status,
        updated=display_time(status.now),
        node_status_class=_node_status_class,
        event_time=lambda at: event_time(at, status.now),
    )


def render_status_page(
    desired: DesiredState,
    snapshot: Snapshot,
    plan: FleetPlan | None,
    now: datetime,
    *,
    plan_refused: str | None = None,
    history: FleetHistory | None = None,
    templates: Templates = PACKAGED,
) -> str:
    """The status page for one pass; reloads itself every pass interval.
    `plan_refused`: why the registry's newest plan is not the fleet's (shown).
    `history`: what the registry remembers, for the timeline (None: not shown)."""
    return render_status_html(fleet_status(desired, snapshot, plan, now, plan_refused=plan_refused, history=history), templates)
