"""What the fabric is doing, for people: lane cards, nodes, leader, deferred work.

Pure: `fleet_status(desired, snapshot, plan, now)` folds the three models into
one `FleetStatus`, and the renderers turn that into terminal text
(`render_text`) or a JSON document (`status_document`). The HTML page
(`reconciler.core.views.page`) and the Prometheus metrics (`reconciler.core.views.metrics`)
read the same `FleetStatus`, so every surface says the same thing.

The lane cards use multi-compute.md's "Reading the lanes" vocabulary on purpose,
word for word: `COMPUTE · a1-arm64  RANK 10  1/2`, sorted rank-ascending (the
first card is the lane the scheduler tries first), and a lane whose probe failed
shows a greyed glyph and the word `offline` on that card alone, with its
reason. The cards are the lane views dispatch decides on
(`reconciler.core.scheduling.lanes.lane_views`), so a card says what dispatch
sees: offline and why, or full and which account is (the lane's cap or its
host's capacity).

Each node shows its cost class (free, owned, paid: its record's, from its
host file), its load as its record reports it (`in_flight/max N%`) and, as
a note, each declared limit the probe lowered. The paid capacity in use is
the load of the paid nodes that are up (`FleetStatus.paid_slots_in_use`). The timeline
(`reconciler.core.views.timeline`) lists what happened lately, newest first.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from reconciler.core.desired.model import DEFAULT_COST, DesiredState
from reconciler.core.live.models import FleetPlan, LeaderProblem, PhazeAgentSeen, Snapshot, SnapshotNode
from reconciler.core.live.unreadable import problem_lines
from reconciler.core.scheduling.lanes import lane_views
from reconciler.core.timestamps import display_time, utc
from reconciler.core.views.timeline import FleetHistory, TimelineEvent, timeline

# Glyphs of a lane card. The offline one is drawn greyed (dim ANSI in a
# terminal, a grey card on the page); without colour the word `offline` says it.
GLYPH_ONLINE = "●"
GLYPH_OFFLINE = "○"

# ANSI "bright black": grey on every common terminal (dim, SGR 2, is not).
_GREY = "\x1b[90m"
_RESET = "\x1b[0m"

# The status of a declared host the registry has never heard from.
NOT_REPORTING = "not reporting"


@dataclass(frozen=True)
class LaneCard:
    id: str
    kind: str
    rank: int
    cap: int
    in_flight: int
    available: bool
    # Why the lane takes no job now (offline, or full), in the lane view's words.
    reason: str | None = None
    # Which account is full when the lane has no free slot: its cap, or its host's capacity.
    full: Literal["cap", "host"] | None = None
    # The host its jobs run on (the lane view's `host`: a compute lane's push
    # host, the local lane's control host; None when there is none).
    push_host: str | None = None
    # The lane's queue on phaze's broker and the SAQ workers beating on it
    # (None: the broker was not read).
    queue: str | None = None
    workers: int | None = None
    # A phaze fleet: the lane's agent as phaze's own agents table shows it
    # (the second signal beside the workers; None: not read).
    phaze_agent: PhazeAgentSeen | None = None

    @property
    def glyph(self) -> str:
        return GLYPH_ONLINE if self.available else GLYPH_OFFLINE

    @property
    def title(self) -> str:
        """`COMPUTE · a1-arm64`: the lane's kind and id."""
        return f"{self.kind.upper()} · {self.id}"

    @property
    def capacity(self) -> str:
        """`{in_flight}/{cap}`, the card's capacity numeral."""
        return f"{self.in_flight}/{self.cap}"

    @property
    def state(self) -> str:
        """`online`, `offline`, or `full` (online, no free slot)."""
        if not self.available:
            return "offline"
        return "full" if self.full is not None else "online"

    @property
    def full_account(self) -> str | None:
        """Which account is full, said: `lane cap 2/2` or `host a1-arm64 at capacity`."""
        if self.full == "cap":
            return f"lane cap {self.capacity}"
        if self.full == "host":
            return f"host {self.push_host} at capacity" if self.push_host else "host at capacity"
        return None

    @property
    def state_line(self) -> str:
        """`offline: host x86-spill offline since 04:01:12`, `full: lane cap 2/2`, `online`."""
        if not self.available:
            return f"offline: {self.reason}" if self.reason else "offline"
        account = self.full_account
        if account is None:
            return "online"
        return f"full: {account}" + (f" ({self.reason})" if self.reason else "")

    @property
    def workers_line(self) -> str | None:
        """`2 workers on phaze-agent-a1-arm64-analyze`, when the broker was read."""
        if self.workers is None:
            return None
        return f"{self.workers} worker{'' if self.workers == 1 else 's'} on {self.queue}"

    @property
    def phaze_line(self) -> str | None:
        """`phaze cap 2 · phaze sees agent a1-arm64 alive (12 s ago)`: in a
        phaze fleet, phaze's own cap (the one backends.toml gives it) beside
        its own word on the lane's agent; None when it was not read."""
        if self.phaze_agent is None:
            return None
        return f"phaze cap {self.cap} · {self.phaze_agent.text()}"

    @property
    def text(self) -> str:
        """The card as one line, without glyph: `COMPUTE · a1-arm64  RANK 10  1/2`
        (then `· 2 workers on QUEUE` when the broker was read, `· phaze cap 2 ·
        phaze sees agent a1-arm64 alive (12 s ago)` in a phaze fleet), then
        `offline` or `full` with the reason when the lane takes no job."""
        line = f"{self.title}  RANK {self.rank}  {self.capacity}"
        if self.workers_line is not None:
            line = f"{line} · {self.workers_line}"
        if self.phaze_line is not None:
            line = f"{line} · {self.phaze_line}"
        return line if self.state == "online" else f"{line}  {self.state_line}"


@dataclass(frozen=True)
class NodeRow:
    node_id: str
    # None for a declared host that has never reported.
    tier: str | None
    status: str
    in_flight: int
    max_concurrent_tasks: int
    last_seen: datetime | None
    # Seconds since last_seen at `now` (None when never seen).
    last_seen_ago_s: float | None
    held_off_until: datetime | None
    # Seconds of hold-off left at `now`; None when not held off.
    held_off_for_s: float | None
    draining: bool
    services: tuple[str, ...]
    # False for a node the registry reports but git does not declare: the
    # scheduler gives it no work (a registry writer cannot add a target).
    declared: bool = True
    # Each declared limit the probe lowered, one sentence each (the node's record).
    lowered_limits: tuple[str, ...] = ()
    # The node's cost class (its record's; a host not reporting: its host file's).
    cost: str = DEFAULT_COST

    @property
    def paid_up(self) -> bool:
        """A paid node that is up (active or draining): its load is paid capacity in use."""
        return self.cost == "paid" and self.tier is not None and self.status in ("active", "draining")

    @property
    def utilization(self) -> float:
        if self.max_concurrent_tasks <= 0:
            return 1.0 if self.in_flight else 0.0
        return self.in_flight / self.max_concurrent_tasks

    @property
    def status_id(self) -> str:
        """The status as an identifier (JSON, metrics): `not_reporting` has no space."""
        return self.status.replace(" ", "_")

    @property
    def load(self) -> str:
        """`1/4 25%`, or `-` for a host that has never reported."""
        if self.tier is None:
            return "-"
        return f"{self.in_flight}/{self.max_concurrent_tasks} {round(self.utilization * 100)}%"

    @property
    def seen(self) -> str:
        if self.last_seen_ago_s is None:
            return "never" if self.tier is None else "-"
        return f"{format_duration(self.last_seen_ago_s)} ago"

    @property
    def status_note(self) -> str:
        """Held off (flapping) and/or draining, or not declared, else empty."""
        notes = []
        if self.held_off_for_s is not None:
            notes.append(f"held off {format_duration(self.held_off_for_s)}")
        if self.draining:
            notes.append("draining")
        if not self.declared:
            notes.append("not declared: ignored")
        return ", ".join(notes)

    @property
    def note(self) -> str:
        """The status note, then each declared limit the probe lowered."""
        return ", ".join(n for n in (self.status_note, *self.lowered_limits) if n)


@dataclass(frozen=True)
class DeferredRow:
    service: str
    replica: int
    reason: str
    inadmissible: bool

    @property
    def label(self) -> str:
        return f"{self.service}#{self.replica}"


@dataclass(frozen=True)
class ExposureRow:
    """A port map open beyond the tailnet: fabric.toml's `allow_from`, said."""

    port_map: str
    host: str
    protocol: str
    port: int
    allow_from: tuple[str, ...]
    everyone: bool

    @property
    def where(self) -> str:
        return f"{self.host} {self.protocol} {self.port}"

    @property
    def to(self) -> str:
        """`everyone (0.0.0.0/0, ::/0)` or the CIDRs."""
        cidrs = ", ".join(self.allow_from)
        return f"everyone ({cidrs})" if self.everyone else cidrs


@dataclass(frozen=True)
class FleetStatus:
    fleet: str
    domain: str
    now: datetime
    lanes: tuple[LaneCard, ...]
    nodes: tuple[NodeRow, ...]
    leader: str | None
    epoch: int
    # False when no plan was given: deferred work is then unknown, not none.
    plan_known: bool
    waiting: tuple[DeferredRow, ...]
    inadmissible: tuple[DeferredRow, ...]
    # Why the registry's newest plan is not the fleet's (forged, or signed by
    # a key fabric.toml does not list): hosts refuse it, so it is not shown.
    plan_refused: str | None = None
    # Registry records that did not parse or validate, one line each
    # ("x86-spill: unreadable heartbeat record: ..."): skipped, their nodes not beating.
    unreadable: tuple[str, ...] = ()
    # Why the live leader's steps keep failing (its record's problem): its
    # plan does not move until they succeed again.
    leader_problem: LeaderProblem | None = None
    # Port maps open beyond the tailnet (their allow_from); empty: tailnet only.
    exposure: tuple[ExposureRow, ...] = ()
    # Recent events, newest first; `timeline_known` False when no registry
    # history was read (a saved snapshot): unknown, not "nothing happened".
    timeline: tuple[TimelineEvent, ...] = ()
    timeline_known: bool = False
    # Seconds between two passes (timing.heartbeat_s: each pass beats once):
    # how often the page is rewritten, so how often it reloads itself.
    pass_interval_s: int = 30
    # A page older than this is stale: the edge rewrites it on every full
    # pass, and a memoized pass still makes a full one within the node
    # timeout (reconciler.engine.memoized_pass), then one interval to reload.
    stale_after_s: int = 120

    @property
    def paid_slots_in_use(self) -> int:
        """Slots of paid capacity in use: the load of the paid nodes that are up."""
        return sum(n.in_flight for n in self.nodes if n.paid_up)

    @property
    def paid_slots(self) -> int:
        """The paid nodes' capacity (those up)."""
        return sum(n.max_concurrent_tasks for n in self.nodes if n.paid_up)

    @property
    def paid_line(self) -> str:
        """`paid capacity: 3/8 slots in use (x86-spill 3/8)`, or that no paid node is up."""
        paid = [n for n in self.nodes if n.paid_up]
        if not paid:
            return "paid capacity: no paid node up"
        each = ", ".join(f"{n.node_id} {n.in_flight}/{n.max_concurrent_tasks}" for n in paid)
        return f"paid capacity: {self.paid_slots_in_use}/{self.paid_slots} slots in use ({each})"

    @property
    def headline(self) -> str:
        leader = f"leader {self.leader}" if self.leader else "no leader"
        return f"{self.fleet} · {leader} · plan epoch {self.epoch} · {display_time(self.now)}"


# --------------------------------------------------------------------------
# Building the view


def fleet_status(
    desired: DesiredState,
    snapshot: Snapshot,
    plan: FleetPlan | None,
    now: datetime,
    *,
    plan_refused: str | None = None,
    history: FleetHistory | None = None,
) -> FleetStatus:
    """Fold desired state, live snapshot and (optionally) the plan into one view.

    Lanes come from the desired state (the only source of what lanes exist:
    a lane the registry reports but git does not declare is not shown). Their
    state (in flight, available, why not, which account is full) is the lane
    view dispatch reads (`lane_views` of the snapshot, beside the services the
    plan places): the snapshot is never older than the plan, whose own lane
    view was made from a snapshot possibly minutes ago.

    The leader is the registry's current one (the plan's when the snapshot
    names none); the epoch is the plan's, else the snapshot's.

    `plan_refused` says why the registry's newest plan is not shown (hosts
    refuse it: `reconciler.engine.status.live_status` leaves it out).
    `history` is what the registry remembers, for the timeline (None: unknown).
    """
    now = utc(now)
    return FleetStatus(
        fleet=desired.fleet.fleet.name,
        domain=desired.fleet.fleet.domain,
        now=now,
        lanes=_lane_cards(desired, snapshot, plan),
        nodes=_node_rows(desired, snapshot, plan, now),
        leader=snapshot.leader or (plan.leader if plan is not None else None),
        epoch=plan.epoch if plan is not None else snapshot.epoch,
        plan_known=plan is not None,
        waiting=_deferred(plan, inadmissible=False),
        inadmissible=_deferred(plan, inadmissible=True),
        plan_refused=plan_refused,
        unreadable=tuple(problem_lines(snapshot.unreadable)),
        leader_problem=snapshot.leader_problem,
        exposure=exposure(desired),
        timeline=timeline(history, plan) if history is not None else (),
        timeline_known=history is not None,
        pass_interval_s=int(desired.fleet.timing.heartbeat_s),
        stale_after_s=int(desired.fleet.timing.node_timeout_s + desired.fleet.timing.heartbeat_s),
    )


def exposure(desired: DesiredState) -> tuple[ExposureRow, ...]:
    """The port maps of fabric.toml open beyond the tailnet, by host and name."""
    rows = [
        ExposureRow(m.name, m.host, m.protocol, m.listen_port, tuple(m.allow_from), m.open_to_everyone)
        for m in desired.fleet.port_maps
        if m.allow_from
    ]
    return tuple(sorted(rows, key=lambda r: (r.host, r.port_map)))


def _lane_cards(desired: DesiredState, snapshot: Snapshot, plan: FleetPlan | None) -> tuple[LaneCard, ...]:
    """The lane views every reader shares (`lane_views`), beside the services the plan places."""
    placements = plan.placements if plan is not None else None
    agents = {lane.id: lane.phaze_agent for lane in reversed(snapshot.lanes)}  # the first record of a lane wins
    # lane_views gives multi-compute.md's order: rank, then the dispatch tie-break (utilization, id).
    return tuple(
        LaneCard(
            id=v.id,
            kind=v.kind,
            rank=v.rank,
            cap=v.cap,
            in_flight=v.in_flight,
            available=v.available,
            reason=v.reason,
            full=v.full,
            push_host=v.host,
            queue=v.queue,
            workers=v.workers,
            phaze_agent=agents.get(v.id),
        )
        for v in lane_views(desired, snapshot, placements)
    )


def _node_rows(desired: DesiredState, snapshot: Snapshot, plan: FleetPlan | None, now: datetime) -> tuple[NodeRow, ...]:
    placements = plan.placements if plan is not None else snapshot.placements
    services: dict[str, list[str]] = {}
    for p in sorted(placements, key=lambda p: (p.service, p.replica)):
        services.setdefault(p.node, []).append(f"{p.service}#{p.replica}")
    # A declared host's cost class is its host file's, as placement takes it
    # (core.scheduling.placement), whatever its own record says.
    nodes = [
        node.model_copy(update={"cost": desired.hosts[node.node_id].host.cost}) if node.node_id in desired.hosts else node for node in snapshot.nodes
    ]
    rows = [_node_row(node, tuple(services.get(node.node_id, ())), now, declared=node.node_id in desired.hosts) for node in nodes]
    reported = {node.node_id for node in snapshot.nodes}
    for host in sorted(set(desired.hosts) - reported):
        rows.append(
            NodeRow(
                node_id=host,
                tier=None,
                status=NOT_REPORTING,
                in_flight=0,
                max_concurrent_tasks=0,
                last_seen=None,
                last_seen_ago_s=None,
                held_off_until=None,
                held_off_for_s=None,
                draining=False,
                services=tuple(services.get(host, ())),
                cost=desired.hosts[host].host.cost,
            )
        )
    return tuple(sorted(rows, key=lambda r: r.node_id))


def _node_row(node: SnapshotNode, services: tuple[str, ...], now: datetime, *, declared: bool) -> NodeRow:
    last_seen = utc(node.last_seen) if node.last_seen is not None else None
    held_off_until = utc(node.held_off_until) if node.held_off_until is not None else None
    held_off_for = (held_off_until - now).total_seconds() if held_off_until is not None else None
    return NodeRow(
        node_id=node.node_id,
        tier=node.tier,
        status=node.status,
        in_flight=node.in_flight,
        max_concurrent_tasks=node.max_concurrent_tasks,
        last_seen=last_seen,
        last_seen_ago_s=max(0.0, (now - last_seen).total_seconds()) if last_seen is not None else None,
        held_off_until=held_off_until,
        # A hold-off that has run out is no longer one.
        held_off_for_s=held_off_for if held_off_for is not None and held_off_for > 0 else None,
        draining=node.drained or node.status == "draining",
        services=services,
        declared=declared,
        lowered_limits=tuple(node.lowered_limits),
        cost=node.cost,
    )


def _deferred(plan: FleetPlan | None, *, inadmissible: bool) -> tuple[DeferredRow, ...]:
    if plan is None:
        return ()
    rows = [
        DeferredRow(service=d.service, replica=d.replica, reason=d.reason, inadmissible=d.inadmissible)
        for d in plan.deferred
        if d.inadmissible == inadmissible
    ]
    return tuple(sorted(rows, key=lambda r: (r.service, r.replica)))


# --------------------------------------------------------------------------
# Small formatters shared by the text, the page and the JSON


def format_duration(seconds: float) -> str:
    """`42s`, `3m 5s`, `2h 4m`, `3d 1h`: two units at most, rounded down."""
    total = int(seconds)
    days, rest = divmod(total, 86_400)
    hours, rest = divmod(rest, 3_600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"


def event_time(at: datetime, now: datetime) -> str:
    """`18:29:40` on the day of `now` (UTC), else `2026-11-28 18:29:40`."""
    at = utc(at)
    return at.strftime("%H:%M:%S") if at.date() == utc(now).date() else at.strftime("%Y-%m-%d %H:%M:%S")


# --------------------------------------------------------------------------
# Terminal text


def lane_card_line(card: LaneCard, *, color: bool = False) -> str:
    """`● COMPUTE · a1-arm64  RANK 10  1/2`; an offline card greyed when `color`."""
    line = f"{card.glyph} {card.text}"
    if color and not card.available:
        return f"{_GREY}{line}{_RESET}"
    return line


def render_text(status: FleetStatus, *, color: bool = False) -> str:
    """The whole status for a terminal. `color` only when stdout is a tty."""
    out = [status.headline]
    if status.plan_refused:
        out.append(f"PLAN REFUSED · hosts keep their generations: {status.plan_refused}")
    if status.leader_problem is not None:
        out.append(f"LEADER FAILING · it keeps its term and retries: {status.leader_problem.text()}")
    if status.unreadable:
        out += ["", f"UNREADABLE RECORDS · skipped, their nodes count as not beating ({len(status.unreadable)})"]
        out += [f"  {line}" for line in status.unreadable]
    out += ["", "LANES"]
    out += [lane_card_line(card, color=color) for card in status.lanes]
    out += ["", "NODES"]
    out += _table(
        ("NODE", "TIER", "COST", "STATUS", "LOAD", "LAST SEEN", "NOTE", "SERVICES"),
        [(n.node_id, n.tier or "-", n.cost, n.status, n.load, n.seen, n.note, " ".join(n.services)) for n in status.nodes],
    )
    out.append(f"  {status.paid_line}")
    for title, rows in (("waiting for capacity", status.waiting), ("inadmissible", status.inadmissible)):
        out += ["", f"DEFERRED · {title} ({len(rows)})" if status.plan_known else f"DEFERRED · {title}"]
        if not status.plan_known:
            out.append("  (no plan: deferred work unknown)")
        elif not rows:
            out.append("  (none)")
        else:
            width = max(len(r.label) for r in rows)
            out += [f"  {r.label.ljust(width)}  {r.reason}" for r in rows]
    if status.timeline_known:
        out += ["", "RECENT · newest first, times in UTC"]
        if not status.timeline:
            out.append("  (nothing recorded)")
        out += [f"  {event_time(e.at, status.now)}  {e.title}" + (f"  {e.detail}" if e.detail else "") for e in status.timeline]
    out += ["", f"EXPOSURE · port maps open beyond the tailnet ({len(status.exposure)})"]
    if not status.exposure:
        out.append("  (none: every port map is reachable from the tailnet only)")
    else:
        out += ["  " + line for line in _table(("PORT MAP", "ON", "OPEN TO"), [(e.port_map, e.where, e.to) for e in status.exposure])]
    return "\n".join(out) + "\n"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    if not rows:
        return ["  (no nodes)"]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    # Every row has a cell per header column: a short row is a bug, not a blank.
    return ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]]


# --------------------------------------------------------------------------
# JSON for scripts

STATUS_DOCUMENT_VERSION = 1


def status_document(status: FleetStatus) -> dict[str, Any]:
    """A JSON-ready dict; `version` changes only when a key changes meaning."""

    def when(moment: datetime | None) -> str | None:
        return moment.isoformat() if moment is not None else None

    def deferred(rows: tuple[DeferredRow, ...]) -> list[dict[str, Any]] | None:
        if not status.plan_known:
            return None
        return [{"service": r.service, "replica": r.replica, "reason": r.reason} for r in rows]

    return {
        "version": STATUS_DOCUMENT_VERSION,
        "fleet": status.fleet,
        "domain": status.domain,
        "now": when(status.now),
        "leader": status.leader,
        "epoch": status.epoch,
        "plan_refused": status.plan_refused,
        "unreadable": list(status.unreadable),
        # Why the live leader's steps keep failing (kind, what, since, attempts,
        # plan_epoch); null: they do not.
        "leader_problem": status.leader_problem.model_dump(mode="json") if status.leader_problem is not None else None,
        "lanes": [
            {
                "id": c.id,
                "kind": c.kind,
                "rank": c.rank,
                "cap": c.cap,
                "in_flight": c.in_flight,
                "available": c.available,
                "state": c.state,
                "reason": c.reason,
                "full": c.full,
                "queue": c.queue,
                "workers": c.workers,
                "phaze_agent": None if c.phaze_agent is None else c.phaze_agent.model_dump(),
                "card": c.text,
            }
            for c in status.lanes
        ],
        "nodes": [
            {
                "node": n.node_id,
                "tier": n.tier,
                "cost": n.cost,
                "status": n.status_id,
                "in_flight": n.in_flight,
                "max_concurrent_tasks": n.max_concurrent_tasks,
                "utilization": round(n.utilization, 4),
                "last_seen": when(n.last_seen),
                "held_off_until": when(n.held_off_until) if n.held_off_for_s is not None else None,
                "draining": n.draining,
                "declared": n.declared,
                "lowered_limits": list(n.lowered_limits),
                "services": list(n.services),
            }
            for n in status.nodes
        ],
        # Slots of paid capacity in use, and the paid nodes' capacity (those up).
        "paid_slots": {"in_use": status.paid_slots_in_use, "total": status.paid_slots},
        # null (not []) when no plan was available: unknown is not "none".
        "deferred": {"waiting": deferred(status.waiting), "inadmissible": deferred(status.inadmissible)},
        # Port maps open beyond the tailnet; [] when every one is tailnet only.
        "exposure": [
            {
                "port_map": e.port_map,
                "host": e.host,
                "protocol": e.protocol,
                "port": e.port,
                "allow_from": list(e.allow_from),
                "everyone": e.everyone,
            }
            for e in status.exposure
        ],
        # Newest first; null when no registry history was read (a saved snapshot).
        "timeline": [{"at": when(e.at), "kind": e.kind, "subject": e.subject, "title": e.title, "detail": e.detail} for e in status.timeline]
        if status.timeline_known
        else None,
    }
