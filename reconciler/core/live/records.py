"""What the registry stores, as pydantic models (pure).

The registry carries facts and placements only: a node's record says what the
node is (tier, arch, labels, capacity, load) and when it last beat, never a
command, a path or configuration text. Nodes are keyed by their fabric host
name (the desired state's host, e.g. "qfox-1").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from reconciler.core.desired.model import DEFAULT_COST, NAME_PATTERN, Cost, Hardware, HostFacts, Limitations, Tier
from reconciler.core.live import beat
from reconciler.core.live.models import LeaderProblem

# Re-exported for the engine, adapters and CLI until they import them from
# reconciler.core.timestamps, where they live.
from reconciler.core.timestamps import utc

_NAME_RE = re.compile(NAME_PATTERN)


def check_node_id(value: str) -> str:
    """A node id becomes part of a registry key: only a safe host name may."""
    if not _NAME_RE.match(value):
        raise ValueError(f"{value!r} is not a fabric host name (lowercase letters, digits, '-', '_')")
    return value


NodeId = Annotated[str, AfterValidator(check_node_id)]


# Bounds on what a record may say, so no value a host writes can overflow
# the arithmetic done with it (a count as a float, a beat's expiry as a
# datetime): counts below 2**31, a beat's timeout up to a week, its time
# between 1970 and 9000.
MAX_COUNT = 2**31
MAX_BEAT_TIMEOUT_S = 7 * 86400.0


def _plausible_time(value: datetime | None) -> datetime | None:
    if value is not None and not 1970 <= value.year <= 9000:
        raise ValueError("a time between the years 1970 and 9000")
    return value


PlausibleTime = Annotated[datetime, AfterValidator(_plausible_time)]


class _Record(BaseModel):
    # Unknown keys are ignored so an older host reads a newer host's record.
    model_config = ConfigDict(extra="ignore", frozen=True)


class NodeRecord(_Record):
    """One heartbeat: what a node is and how busy it is, at `beat_at`."""

    node_id: NodeId
    tier: Tier
    arch: str | None = None
    labels: dict[str, str] = {}
    max_concurrent_tasks: int = Field(default=1, ge=0, le=MAX_COUNT)
    max_concurrent_ceiling: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    # The host file's cost class (`[host] cost`): the leader places from the
    # live record, so it travels with the beat (an older host's beat lacks
    # it: the default, as for a host file that says nothing).
    cost: Cost = DEFAULT_COST
    # Measured by the node's pass: the placed service units active here plus
    # the lane jobs running on the lanes whose jobs run here (one account).
    in_flight: int = Field(default=0, ge=0, le=MAX_COUNT)
    # The ActiveState of each fabric unit of the node's current generation
    # when it beat ("fabric-agent-a1-arm64.service": "failed"); lane health
    # reads its agent unit's here. Empty when the pass does not activate.
    units: dict[str, str] = {}
    # A declared limit the probe lowered, one sentence each
    # ("max_concurrent_tasks 4 lowered to 2 by the probe"); shown, not acted on.
    lowered_limits: list[str] = []
    # The part of in_flight that is the placed service units running here
    # (None: not said, e.g. a hand-written record). The scheduler counts the
    # services it places itself, so it must not count these again: a leader
    # with no plan in force would otherwise see a host's own services as
    # foreign load and move them off it.
    services_running: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    # True when the node's Tailscale path to the fleet is relayed (DERP): it
    # gets the longer relayed heartbeat timeout.
    relayed: bool = False
    tailscale_ip: str | None = None
    cpu_cores: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    memory_mib: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    # The whole hardware record and limitations the probe found (the seed's
    # data model: GPUs, storage, encoders, framebuffer), so the leader's
    # snapshot has them for the capabilities API (None: an older host's beat).
    # Bounded like any record (registry_records.MAX_RECORD_BYTES).
    hardware: Hardware | None = None
    limitations: Limitations | None = None
    # Set by the registry when it stores the beat (its injected clock).
    beat_at: PlausibleTime | None = None
    # The timeout the beat was stored with: silent this long = offline.
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_BEAT_TIMEOUT_S, allow_inf_nan=False)

    def heartbeat_note(self) -> str:
        """The pass's note on a beat stored as this record."""
        return beat.heartbeat_note(self.node_id, self.tier, self.in_flight, self.timeout_s)

    @classmethod
    def from_facts(
        cls,
        host: str,
        facts: HostFacts,
        *,
        tier: Tier | None = None,
        in_flight: int = 0,
        max_concurrent_tasks: int | None = None,
        max_concurrent_ceiling: int | None = None,
        labels: dict[str, str] | None = None,
        units: dict[str, str] | None = None,
        lowered_limits: list[str] | None = None,
        services_running: int | None = None,
        cost: Cost = DEFAULT_COST,
    ) -> NodeRecord:
        """The record of fabric host `host` from its probe.

        `tier`, the limits and the labels are the caller's effective values
        when the host file adds to or overrides them (a tier pin, the limits
        bounded by the probe, declared labels); by default the probe's.
        `in_flight` and `units` are what the pass measured.
        """
        limits = facts.limitations
        return cls(
            node_id=host,
            tier=tier or facts.tier,
            arch=facts.hardware.arch,
            labels=dict(facts.labels if labels is None else labels),
            max_concurrent_tasks=max_concurrent_tasks if max_concurrent_tasks is not None else limits.max_concurrent_tasks,
            max_concurrent_ceiling=(max_concurrent_ceiling if max_concurrent_ceiling is not None else limits.max_concurrent_ceiling),
            in_flight=in_flight,
            units=dict(units or {}),
            lowered_limits=list(lowered_limits or []),
            services_running=services_running,
            cost=cost,
            relayed=bool(facts.tailscale_relayed),
            tailscale_ip=facts.tailscale_ip,
            cpu_cores=facts.hardware.cpu_cores,
            memory_mib=facts.hardware.memory_mib,
            hardware=facts.hardware,
            limitations=facts.limitations,
        )


class DrainRequest(_Record):
    """`fabric drain HOST --grace S`: no new work at once; existing work moves off after the grace."""

    node_id: NodeId
    requested_at: datetime
    grace_s: float = Field(default=0, ge=0, le=MAX_BEAT_TIMEOUT_S * 52 * 10, allow_inf_nan=False)
    reason: str = "operator drain"

    @property
    def grace_ends(self) -> datetime:
        return utc(self.requested_at) + timedelta(seconds=self.grace_s)


class LeaderInfo(_Record):
    """Who leads, since when, and the epoch its term began with.

    The record outlives its term: a resigned term's record stays (marked
    `resigned`), so its term is still the registry's current one until a
    candidate campaigns, and hosts keep applying that term's plan. A record
    is live while it is neither resigned nor stale (`renewed_at` + `ttl_s`
    passed): the leader rewrites `renewed_at` at every renewal, so a record
    whose lease someone else keeps alive still goes stale, and a candidate
    takes it over (`live_at`)."""

    candidate: str
    epoch: int
    since: datetime
    # Opaque per-term token (the etcd lease id, or a random one on sqlite):
    # two terms of the same candidate never share it.
    token: str
    # The term, as the registry assigned it (etcd: the leader key's create
    # revision, set by the adapter from the key, never from its value; sqlite:
    # a counter the campaign's transaction raises). 0: not known (an older record).
    term: int = 0
    # When the leader last renewed its term (None: an older record, never stale by it).
    renewed_at: datetime | None = None
    # The term's TTL: stale once renewed_at + ttl_s has passed.
    ttl_s: float | None = None
    resigned: bool = False
    # When the fast liveness record of the leader's host lapses unless kept
    # alive, as the leader read it just before this renewal (issue 30; None:
    # its host keeps none, the fast liveness is off, or an older record).
    # The evidence a candidate started after that record lapsed (etcd
    # deletes it) has that the leader's host kept one: a candidate takes
    # over a live term whose host's record lapsed
    # (`core.scheduling.suspicion.leader_lapse`).
    liveness_until: PlausibleTime | None = None
    # Why this leader's steps keep failing (None: they do not); the leader
    # writes it at its renewals (reconciler.engine.leader).
    problem: LeaderProblem | None = None

    def stale_at(self) -> datetime | None:
        """When the record goes stale unless renewed (None: never by itself)."""
        if self.renewed_at is None or self.ttl_s is None:
            return None
        return self.renewed_at + timedelta(seconds=self.ttl_s)

    def live_at(self, now: datetime) -> bool:
        """Whether this record still names a leader at `now`: not resigned,
        and renewed within its TTL."""
        stale = self.stale_at()
        return not self.resigned and (stale is None or utc(now) < utc(stale))


@dataclass(frozen=True)
class Leadership:
    """Held by the process that won a campaign; required to publish plans and
    to write the lifecycle. Worthless once the lease lapses: every write made
    with it is a transaction that compares the leader key with `info`."""

    info: LeaderInfo
    ttl_s: float

    @property
    def candidate(self) -> str:
        return self.info.candidate

    @property
    def epoch(self) -> int:
        return self.info.epoch

    @property
    def term(self) -> int:
        return self.info.term


class QueuedJob(_Record):
    """One lane job of the job system (phaze's control plane), as the lane queue keeps it.

    Only an id, when it was enqueued, how many cloud attempts failed and its
    duration; what the job does stays with the job system. `lane` is set from
    its dispatch into a lane's SAQ queue until a worker finished it (then it
    is gone) or it failed (then it waits again).
    """

    job_id: NodeId
    enqueued_at: datetime
    attempts: int = Field(default=0, ge=0)
    # The media duration the job system gave, in seconds (None: not given);
    # below `scheduler.cloud_route_threshold_s` the job goes local only.
    duration_s: float | None = Field(default=None, ge=0)
    lane: str | None = None
    dispatched_at: datetime | None = None

    @property
    def waiting(self) -> bool:
        return self.lane is None


class SettledJob(_Record):
    """A dispatched job whose SAQ job ended: `complete` (the job is gone) or
    failed, aborted, vanished from the broker or crashed (its worker gone:
    it waits again, one more cloud attempt counted when it ran in a compute
    lane). `superseded`: a run the dispatcher had settled as crashed
    finished late; it changed nothing (the job went on as it was)."""

    job_id: NodeId
    lane: str
    outcome: Literal["complete", "failed", "aborted", "vanished", "crashed", "superseded"]
    attempts: int = Field(ge=0)
    # Why (crashed: which fact; superseded: the run and how it ended).
    reason: str | None = None

    @property
    def requeued(self) -> bool:
        return self.outcome not in ("complete", "superseded")


class HookOutcome(_Record):
    """How the last run of a tier's cloud hook ended: its transient unit (whose
    journal has all it printed), its exit status, and its last lines of output,
    screened for secrets (`core.render.hook_unit.output_tail`). No argv."""

    at: datetime
    ok: bool
    returncode: int | None = None
    timed_out: bool = False
    missing: bool = False
    # The transient unit it ran as (journalctl _SYSTEMD_UNIT=<unit>), and how
    # that ended: ok, exit, timeout, missing, start_failed, detached.
    unit: str | None = None
    end: str | None = None
    detail: str = ""
    output: tuple[str, ...] = ()


class ScalingAudit(_Record):
    """One scaling action the leader carried out, with its reason."""

    at: datetime
    kind: str
    reason: str
    node: str | None = None
    tier: str | None = None
    outcome: str = "done"
    # run_cloud_hook: the last lines its unit printed (screened for secrets).
    output: tuple[str, ...] = ()


class ScalingRecord(_Record):
    """The leader's scaling memory and decisions, written only under its fence.

    `state` is `reconciler.core.scheduling.scaling.ScalingState` as JSON (kept as a plain
    object here so the records stay below the scheduler). `concurrency` is the
    override of a node's max_concurrent_tasks that the snapshot reports
    instead of the node's own limit (raised within its ceiling, or lowered
    while its group is scaled down); `scaled_down` names the nodes whose
    group is at its minimum until a burst activates it again.
    """

    state: dict[str, Any] = {}
    concurrency: dict[NodeId, int] = {}
    scaled_down: list[NodeId] = []
    hooks: dict[str, HookOutcome] = {}
    # The newest actions, newest last (bounded: see reconciler.engine.scaling_step).
    recent: list[ScalingAudit] = []
    leader: str | None = None
    updated_at: datetime | None = None
