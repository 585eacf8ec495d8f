"""Live-state models shared by the registry, the scheduler, rendering and status.

Pure pydantic. Three shapes cross process boundaries as JSON:

- `Snapshot`: what the registry knows at one instant (nodes, lanes). The leader
  schedules over it; `fabric registry export` writes it; `fabric schedule
  --snapshot FILE` reads it, so any saved snapshot is a what-if input.
- `FleetPlan`: what the leader publishes, fenced by `epoch`. It carries only
  placements (service ids, host names, counts) and never commands, paths or
  config text: a host checks every entry against its own desired state.
- `NodeRecord`: one node as the registry stores it (facts + lifecycle).

A node is named by its fabric host name (the desired state's host, e.g.
"qfox-1") everywhere in these models, so a host can check any plan entry
against its own desired state; the probe's Tailscale FQDN is only a fact.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from reconciler.core.desired.model import DEFAULT_COST, Cost, Hardware, Limitations, Tier
from reconciler.core.live.unreadable import UnreadableRecord
from reconciler.core.timestamps import utc_now

NodeStatus = Literal["active", "draining", "offline", "dead"]

# What a lifecycle transition records: a new status, or an event that does not change it.
TransitionStatus = NodeStatus | Literal["held_off", "released", "drain", "undrain"]

HoldReason = Literal["no_free_slots", "local_spill_not_reached", "cloud_attempts_exhausted"]


class _Live(BaseModel):
    # Unknown keys are ignored so an older host can read a newer leader's JSON.
    model_config = ConfigDict(extra="ignore", frozen=True)


# How long a leader problem's text may be (the leader truncates it): it is
# rewritten into the leader record at every renewal.
LEADER_PROBLEM_CHARS = 600


class LeaderProblem(_Live):
    """Why the leader's step keeps failing (`reconciler.engine.leader`): the
    registry refused or could not do a read or a write, or the plan could not
    be signed or published. The leader keeps its term and its last good plan,
    retries with backoff, and writes this into its record at each renewal, so
    `fabric status`, the edge's page and its metrics say why the plan does not
    move. Cleared by the first step that succeeds."""

    kind: str = Field(description="the error's class (RegistryError, RegistryUnavailable, PermissionDenied, PlanSigningError, ...)")
    what: str = Field(description="the error's message, as the journal says it")
    since: datetime = Field(description="when the first failure of this run of failures happened")
    attempts: int = Field(default=1, ge=1, description="failed attempts in a row")
    plan_epoch: int | None = Field(default=None, description="the epoch of the last plan this leader published, which stays in force")

    def text(self) -> str:
        """`RegistryError since 2026-12-02 10:20:03 UTC (12 attempts), plan epoch 7 stays in force: ...`"""
        kept = f"plan epoch {self.plan_epoch}" if self.plan_epoch is not None else "the plan in force"
        return f"{self.kind} since {self.since:%Y-%m-%d %H:%M:%S %Z} ({self.attempts} attempts), {kept} stays in force: {self.what}"


class SnapshotNode(_Live):
    node_id: str
    tier: Tier
    status: NodeStatus = "active"
    in_flight: int = Field(default=0, ge=0)
    max_concurrent_tasks: int = Field(default=1, ge=0)
    arch: str | None = None
    labels: dict[str, str] = {}
    # Lifecycle extras (absent in hand-written snapshots: defaults apply).
    drained: bool = False
    held_off_until: datetime | None = None
    last_seen: datetime | None = None
    # Why the leader suspects this node (empty: it does not): it takes no new work.
    suspected: list[str] = []
    # Highest concurrency vertical scaling may raise this node to.
    max_concurrent_ceiling: int | None = None
    # From the node's record (NodeRecord.units, NodeRecord.lowered_limits).
    units: dict[str, str] = {}
    lowered_limits: list[str] = []
    services_running: int | None = Field(default=None, ge=0)
    # Tasks other engines run there (Ray's, as the leader reads Ray's state
    # API: core.scheduling.ray_tasks.with_ray_view); part of in_flight.
    engine_tasks: int = Field(default=0, ge=0)
    # The host's cost class, from its record (NodeRecord.cost).
    cost: Cost = DEFAULT_COST
    # From its record, for the capabilities API (never for placement).
    tailscale_ip: str | None = None
    hardware: Hardware | None = None
    limitations: Limitations | None = None

    @property
    def utilization(self) -> float:
        if self.max_concurrent_tasks <= 0:
            return 1.0
        return self.in_flight / self.max_concurrent_tasks


# phaze's own liveness of an agent (phaze a3fd169, services/agent_liveness.py
# `classify`, thresholds from constants.py): alive under 90 s since its
# agents.last_seen_at, stale under 300 s, dead after; never seen; revoked.
PHAZE_AGENT_ALIVE_S = 90
PHAZE_AGENT_STALE_S = 300
PhazeAgentStatus = Literal["alive", "stale", "dead", "never", "revoked", "unknown"]


class PhazeAgentSeen(_Live):
    """A lane's agent as phaze itself last saw it: its row of phaze's `agents`
    table (models/agent.py: last_seen_at, set to now() by each heartbeat the
    agent POSTs to phaze's API, routers/agent_heartbeat.py; revoked_at). A
    second signal beside the SAQ workers on the lane's queue: what phaze's
    own routing believes (it treats an agent ever seen as available)."""

    agent_id: str
    status: PhazeAgentStatus = "unknown"
    # Seconds since its last_seen_at, by the database's clock (None: never
    # seen, or not known).
    seen_ago_s: float | None = Field(default=None, ge=0)
    # Why the status is unknown (phaze's agents table not in the broker's
    # database, not readable, a value that makes no sense).
    reason: str | None = None

    def text(self) -> str:
        """`phaze sees agent a1-arm64 alive (12 s ago)`, `... unknown: <reason>`."""
        if self.status == "unknown":
            return f"phaze's agent {self.agent_id} unknown: {self.reason or 'not read'}"
        ago = f" ({self.seen_ago_s:.0f} s ago)" if self.seen_ago_s is not None and self.status != "never" else ""
        return f"phaze sees agent {self.agent_id} {self.status}{ago}"


def phaze_agent_status(agent_id: str, *, seen_ago_s: float | None, revoked: bool) -> PhazeAgentSeen:
    """phaze's `classify` (revoked, then never, then alive/stale/dead by the
    thresholds above) of an agent seen `seen_ago_s` ago (None: never). A
    last_seen ahead of the database's clock makes no sense: unknown."""
    if revoked:
        return PhazeAgentSeen(agent_id=agent_id, status="revoked", seen_ago_s=None if seen_ago_s is None else max(0.0, seen_ago_s))
    if seen_ago_s is None:
        return PhazeAgentSeen(agent_id=agent_id, status="never")
    if seen_ago_s < -1.0:
        return PhazeAgentSeen(agent_id=agent_id, reason=f"its last_seen_at is {-seen_ago_s:.0f} s ahead of the database's clock")
    ago = max(0.0, seen_ago_s)
    status: PhazeAgentStatus = "alive" if ago < PHAZE_AGENT_ALIVE_S else ("stale" if ago < PHAZE_AGENT_STALE_S else "dead")
    return PhazeAgentSeen(agent_id=agent_id, status=status, seen_ago_s=ago)


class SnapshotLane(_Live):
    """A lane as its queue on phaze's broker (SAQ on PostgreSQL) shows it: the
    jobs in it and its workers. Its health is also its host's
    (reconciler.core.scheduling.lanes.lane_views)."""

    id: str
    # Jobs the lane holds: queued on its SAQ queue (dispatched, not yet taken
    # by a worker) plus active (a worker runs them). Both hold one of its
    # `cap` slots: a queued job is committed to the lane.
    in_flight: int = Field(default=0, ge=0)
    # The lane's SAQ queue; None when the broker was not read (a snapshot
    # file, a fleet without [phaze] queue_url_file): then nothing is known
    # about its workers and only the host decides its health.
    queue: str | None = None
    # SAQ workers whose heartbeat on `queue` is fresh (saq's worker stats).
    workers: int = Field(default=0, ge=0)
    # Seconds since the newest worker heartbeat on `queue` lapsed, when the
    # broker still remembers one (saq sweeps lapsed stats away).
    workers_silent_s: float | None = Field(default=None, ge=0)
    # A phaze fleet: the lane's agent as phaze's own `agents` table shows it
    # (a compute lane's agent_ref, the local lane's [phaze] fileserver_agent);
    # None when not read (not a phaze fleet, no broker).
    phaze_agent: PhazeAgentSeen | None = None


class Placement(_Live):
    service: str
    replica: int = Field(ge=0)
    node: str
    tier: Tier
    fallback: bool = False
    # A move in progress, make-before-break (the come-home rule,
    # core.scheduling.placement): this is the replica's new placement, and
    # its placement on node `replaces` stays in the plan beside it until the
    # service runs here; the edge routes to both meanwhile.
    replaces: str | None = None
    # A hedge (issue 30): an extra replica of a single-replica service while
    # node `hedge`, which runs the replica's own placement, is suspected
    # (core.scheduling.suspicion). Both stay in the plan and the edge routes
    # to both; when node `hedge` goes offline the hedge becomes the
    # placement, when it recovers the hedge leaves after a stable window.
    hedge: str | None = None


class SuspectEvent(_Live):
    """One event of a suspected node, for the timeline: suspicion, hedge,
    recovery, offline, each with its sources."""

    at: datetime
    kind: Literal["suspicion", "hedge", "recovery", "offline"]
    detail: str = ""


class SuspectState(_Live):
    """The leader's memory of one node it suspects or suspected lately
    (core.scheduling.suspicion.advance_suspects), carried in the plan so a
    successor goes on from it and status shows it."""

    # Suspected since (None: not suspected now, recovered at `cleared_at`).
    since: datetime | None = None
    reasons: list[str] = []
    cleared_at: datetime | None = None
    # When each suspicion within [flap] window_s began: they count as flaps.
    suspicions: list[datetime] = []
    # Held off new work for blinking (as many suspicions as [flap] toggles within its window).
    held_off_until: datetime | None = None
    # The newest events, oldest first (at most suspicion.HISTORY).
    events: list[SuspectEvent] = []


class Deferred(_Live):
    service: str
    replica: int = Field(ge=0)
    reason: str
    # True when nothing in the fleet could ever satisfy it (inadmissible), as
    # opposed to waiting for capacity.
    inadmissible: bool = False


class LaneView(_Live):
    id: str
    kind: Literal["compute", "local"]
    rank: int
    cap: int
    in_flight: int
    available: bool
    # Why the lane is offline ("host x86-spill offline since 04:01:12"); a
    # full lane says which account in `full`.
    reason: str | None = None
    # Which account is full when the lane has no free slot: its own cap, or
    # its push host's capacity (services and lane jobs draw from one account).
    full: Literal["cap", "host"] | None = None
    # The host its jobs run on (a compute lane's push host, the local lane's
    # control host) and that host's capacity left for new work (services and
    # lane jobs, one account); None when the host is not reporting.
    host: str | None = None
    host_free: int | None = None
    # How many more lane jobs the host's account absorbs before it grows:
    # its reported in_flight above services + lane jobs (the larger of the
    # two is the account; `lanes.account_load`). 0 when the node names its
    # services (then the account is services + lane jobs).
    host_slack: int = Field(default=0, ge=0)
    # The lane's queue on phaze's broker and the SAQ workers beating on it
    # now (saq_stats rows of that queue not yet expired); both None when the
    # broker was not read.
    queue: str | None = None
    workers: int | None = None


class Snapshot(_Live):
    # A hand-written snapshot without `now` means now: the one clock read of
    # the core, at the edge where a file becomes a model.
    now: datetime = Field(default_factory=utc_now)
    nodes: list[SnapshotNode] = []
    lanes: list[SnapshotLane] = []
    # Placements currently in force (the last published plan), so the
    # scheduler keeps work where it is while still feasible.
    placements: list[Placement] = []
    leader: str | None = None
    epoch: int = 0
    # Registry records that did not parse or validate, skipped by the read
    # (reconciler.core.live.unreadable): their nodes count as not beating.
    unreadable: list[UnreadableRecord] = []
    # The last plan's `room_since` (the come-home rule's memory).
    room_since: dict[str, datetime] = {}
    # The nodes the leader suspects or suspected lately (the last plan's
    # `suspects`, advanced by this step: core.scheduling.suspicion).
    suspects: dict[str, SuspectState] = {}
    # The live leader's problem (`LeaderProblem`): why its plan does not move.
    leader_problem: LeaderProblem | None = None


class PlanSignature(_Live):
    """The leader's ed25519 signature over the plan's canonical form
    (`reconciler.core.live.signing`), by the plan key `key_id` of fabric.toml."""

    key_id: str
    # base64 of the 64-byte signature
    value: str


class SteeredLane(_Live):
    """A compute lane the fabric left out of phaze's backends.toml (dead for
    the steering window), since when and why (the lane view's reason then)."""

    id: str
    since: datetime
    reason: str


class LaneWatch(_Live):
    """A lane whose health differs from its steering (dead but in, healthy but
    out), since when: it changes once that lasts the steering window."""

    id: str
    dead: bool
    since: datetime
    reason: str | None = None


class SteeringChange(_Live):
    """One change of what phaze may choose: a lane left out or put back."""

    at: datetime
    lane: str
    out: bool
    reason: str


class LaneSteering(_Live):
    """What the leader decided about phaze's lanes (core.scheduling.lane_steering):
    the lanes left out of backends.toml, the lanes being watched, when it last
    changed (a change restarts phaze's control units: at most one per
    interval), and the newest changes (the timeline's)."""

    out: list[SteeredLane] = []
    watching: list[LaneWatch] = []
    changed_at: datetime | None = None
    recent: list[SteeringChange] = []

    def out_ids(self) -> list[str]:
        return sorted(s.id for s in self.out)


class FleetPlan(_Live):
    # The step within the term: the registry's epoch counter when published.
    epoch: int = Field(ge=0)
    leader: str
    # The leader's term as the registry assigned it (LeaderInfo.term), the
    # fleet's name and the registry prefix it was published under: all signed,
    # so a plan of another term, fleet or registry never verifies here.
    term: int = Field(default=0, ge=0)
    fleet: str = ""
    prefix: str = ""
    created: datetime
    placements: list[Placement] = []
    deferred: list[Deferred] = []
    lanes: list[LaneView] = []
    # Nodes of the snapshot that are not declared hosts of the desired state:
    # never given work (a registry writer cannot add a target), listed so an
    # operator sees them.
    ignored_nodes: list[str] = []
    # The come-home rule's memory, kept only while work runs on paid hosts:
    # each cheaper node that could take some of it, with the time since when
    # it has had room (continuously, as the leader's steps saw it). A
    # replica moves off a paid host only to a node with room for a stable
    # window ([flap] window_s).
    room_since: dict[str, datetime] = {}
    # A phaze fleet: the compute lanes left out of phaze's backends.toml (names
    # of declared lanes only; the control host checks them against its desired state).
    steering: LaneSteering = LaneSteering()
    # Nodes suspected now or lately, whose hedges this plan holds (issue 30).
    suspects: dict[str, SuspectState] = {}
    # None: unsigned (no plan keys in the desired state, a --plan-file, or a forgery).
    signature: PlanSignature | None = None

    def services_on(self, node: str) -> list[Placement]:
        return [p for p in self.placements if p.node == node]


class Transition(_Live):
    at: datetime
    status: TransitionStatus
    reason: str
