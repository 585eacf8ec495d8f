"""The small interfaces between the pure core and the world.

Each port is a `typing.Protocol`; `reconciler.adapters` holds the real
implementations and the tests hold fakes. The pure core depends on these
Protocols only, never on an adapter. `reconciler.cli` is the one place where
real adapters are chosen and wired in.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from reconciler.core.command_result import CommandResult

# The registry's and phaze's broker's errors are defined with the standard
# library alone (a memoized pass catches them without importing these
# Protocols); they are the ports' errors all the same.
from reconciler.port_errors import (
    LaneBrokerError,
    LaneBrokerUnavailable,
    NotLeader,
    PermissionDenied,
    RegistryError,
    RegistryUnavailable,
    StaleDispatcher,
)

__all__ = [
    "LaneBrokerError",
    "LaneBrokerUnavailable",
    "NotLeader",
    "PermissionDenied",
    "RegistryError",
    "RegistryUnavailable",
    "StaleDispatcher",
]

# Types only: a memoized pass catches RegistryError and imports no model.
if TYPE_CHECKING:
    from reconciler.core.desired.broker_access import BrokerState, RoleStep
    from reconciler.core.desired.registry_access import AccessState, AuthStep
    from reconciler.core.live.members import MemberRecord
    from reconciler.core.live.models import FleetPlan, PhazeAgentSeen, Snapshot, SnapshotLane
    from reconciler.core.live.pending import PendingRecord
    from reconciler.core.live.plan_parts import PlanIndex, PlanRead
    from reconciler.core.live.records import (
        DrainRequest,
        LeaderInfo,
        Leadership,
        NodeRecord,
        QueuedJob,
        ScalingRecord,
        SettledJob,
    )
    from reconciler.core.live.watching import EntryVersion
    from reconciler.core.render.hook_unit import HookRun, HookUnit
    from reconciler.core.scheduling.lanes import BrokerRuns, CrashedRun
    from reconciler.core.scheduling.lifecycle import LifecycleEvent, NodeState
    from reconciler.core.scheduling.ray_tasks import RayView
    from reconciler.core.scheduling.suspicion import LivenessRecord


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch (wall clock; injected so tests never sleep)."""
        ...


class CommandRunner(Protocol):
    def run(self, argv: Sequence[str], *, timeout: float = 10.0, stdin: str | None = None) -> CommandResult:
        """Run argv (never through a shell); never raises for a failing command."""
        ...


class HookRunner(Protocol):
    def run(self, hook: HookUnit) -> HookRun:
        """Run a cloud hook as its own transient unit (`hook.argv`: systemd-run
        --wait), waiting at most `hook.wait_s`; its output from the unit's
        journal. Never raises for a hook that fails, and never runs the hook
        in this process."""
        ...


# --------------------------------------------------------------------------
# Activation (render, plan and apply). Each method raises ActivationError on
# failure, with the program's own words; `apply` turns that into a rollback.


class ActivationError(Exception):
    """An activation or validation step failed; the message says which and why."""


# The kinds of unit job an activation queues, in the order it queues them.
UnitJob = Literal["stop", "reload", "restart", "start"]


@dataclass(frozen=True)
class JobOutcome:
    """How one unit's job of a batch ended: `failure` is None when the unit
    did what was asked, else systemd's reason (without the unit's name)."""

    unit: str
    failure: str | None = None
    # systemd refused the start or restart because it had not loaded the
    # unit's file (its cache of the unit directories missed a file the pass
    # had just written): the job was queued again after a daemon-reload.
    retried_after_reload: bool = False

    @property
    def ok(self) -> bool:
        return self.failure is None


class Systemd(Protocol):
    """systemd's Manager over D-Bus. Unit names are full (`fabric-agent-x.service`)."""

    def daemon_reload(self) -> None: ...

    def run_jobs(self, job: UnitJob, units: Sequence[str]) -> list[JobOutcome]:
        """Queue `job` for every unit at once (mode "replace": systemd runs
        them together, ordered by their own After=/Requires=), wait for every
        job to finish and its unit to settle, then watch the started or
        restarted services through one startup grace together. One outcome
        per unit, in the order of `units`; a unit's failure is reported, not
        raised. Raises ActivationError only when no job could be queued at all
        (systemd unreachable): then none of them ran.

        A start or restart that systemd refuses because it has no file for
        the unit (not found) is queued once more after a daemon-reload, and
        its outcome says so (`retried_after_reload`): a unit file written
        within the same tick of the kernel's coarse clock as systemd last
        scanned the unit directories is not seen without one."""
        ...

    def active_state(self, unit: str) -> str:
        """'active', 'inactive', 'failed', ... ('inactive' for an unknown unit)."""
        ...

    def enqueue_start(self, unit: str) -> str:
        """Queue a start of `unit` (StartUnit, mode "replace") and return the
        job's path at once, without waiting for it (a pass starting
        fabric-bootstrap.service, which is ordered before the pass and takes
        minutes). Raises ActivationError when systemd refuses or cannot be reached."""
        ...

    def units_held(self, units: Sequence[str]) -> dict[str, bool]:
        """For each unit, whether systemd holds its configuration in memory,
        so that a changed file takes effect only after a daemon-reload: a
        unit loaded from its file (or masked, or with a bad setting), or a
        not-found stub on a systemd older than 246, which does not retry
        those. False for a unit systemd has no file for and retries at its
        next start (systemd >= 246): that start reads the file the pass
        writes. Asking loads each unit (LoadUnit), as reading its state does.
        One answer per unit, read concurrently."""
        ...


class PassStarter(Protocol):
    """fabric-reconcile.service as `fabric watch` starts it (systemd over D-Bus).
    Both raise ActivationError when systemd cannot be reached or refuses."""

    def pass_running(self) -> bool:
        """Whether a pass runs now (the unit is activating or deactivating)."""
        ...

    def start_pass(self) -> None:
        """Queue a start of the unit (StartUnit, mode "replace") and return
        once systemd began the run (or its job still waits for the unit's
        dependencies), without waiting for the pass to end. A job that ended
        without a run (the start limit hit, a dependency failed) raises
        ActivationError."""
        ...


class Nftables(Protocol):
    """The table `inet fabric` only; never the whole ruleset."""

    def check(self, ruleset: str) -> None:
        """`nft -c -f`: raise ActivationError if the ruleset would not load."""
        ...

    def apply(self, ruleset: str) -> None:
        """Load the ruleset as one atomic transaction (`nft -f`)."""
        ...

    def table_loaded(self) -> bool:
        """Whether `table inet fabric` is in the kernel now: a distro's
        ruleset reload (flush ruleset) can drop it behind the fabric's back."""
        ...


class Caddy(Protocol):
    def validate(self, caddyfile: str) -> None:
        """`caddy validate` of the complete config that will be loaded."""
        ...

    def load(self, caddyfile: str) -> None:
        """Hand the config to the running Caddy (admin API); keep the old one on rejection."""
        ...


class NodeLabelsUnavailable(Exception):
    """The k3s Node's labels could not be read or set: the reason (never a credential)."""


class NodeLabels(Protocol):
    """This host's k3s Node, spoken to as its kubelet (reconciler.core.render.k3s_node)."""

    def labels(self, node: str) -> dict[str, str]:
        """The Node's labels; raises NodeLabelsUnavailable."""
        ...

    def patch(self, node: str, changes: Mapping[str, str | None]) -> None:
        """Set (value) and remove (None) labels in one merge patch; raises NodeLabelsUnavailable."""
        ...

    def command_line(self) -> list[str]:
        """The argv of the k3s process running here (empty when none runs)."""
        ...

    def ready(self, node: str) -> bool:
        """Whether the Node's Ready condition is True; raises NodeLabelsUnavailable."""
        ...


class UnitVerifier(Protocol):
    def verify(self, unit_paths: Sequence[str]) -> None:
        """`systemd-analyze verify` the rendered units; raise ActivationError on a problem."""
        ...


class Audit(Protocol):
    def record(self, action: str, outcome: str, **fields: str) -> None:
        """One audit entry: the journal (SYSLOG_IDENTIFIER=fabric-reconcile) or JSON on stderr."""
        ...


# --------------------------------------------------------------------------
# Registry (live state): see reconciler.ports for the Protocol and backends.


# --------------------------------------------------------------------------
# Probe: reading the machine's own files (/proc, /sys, /dev/dri) and keeping
# raw captures. The live adapters are in reconciler.adapters.probe_io.


class FileReader(Protocol):
    """Read-only access to the machine's files. Each method raises OSError
    (with its strerror) when the path cannot be read."""

    def read_text(self, path: str) -> str: ...

    def list_dir(self, path: str) -> list[str]:
        """Names in a directory, sorted."""
        ...

    def read_link(self, path: str) -> str:
        """The target of a symbolic link, as stored (often relative)."""
        ...


class ProbeFiles(FileReader, Protocol):
    """The live probe's files, and what says a command's inputs are unchanged
    (reconciler.core.probe.facts.Inputs): a memoized pass's probe."""

    def stat(self, path: str) -> str:
        """The identity of what is at `path` (links followed): size, mtime,
        ctime, inode; raises OSError when nothing is there."""
        ...

    def program(self, name: str) -> str | None:
        """The real path of the program `name` as a command runner finds it
        on PATH, with its stat; None when it is not there."""
        ...


class CaptureError(Exception):
    """The capture directory cannot be used; the message names it and says why."""


class CaptureStore(Protocol):
    """Raw probe outputs kept under fixed file names in one directory."""

    def save(self, directory: str, outputs: dict[str, str], errors: dict[str, str]) -> None:
        """Write every output as DIRECTORY/<name> at once (all or nothing)."""
        ...

    def load(self, directory: str) -> tuple[dict[str, str], dict[str, str]]:
        """(outputs, errors) as saved; a file that is not there is not in outputs."""
        ...


# --------------------------------------------------------------------------
# Files of a pass (render, plan and apply): the root the artifacts go to (the
# host's / or a sandbox) and the generations under its state directory. The
# adapter is reconciler.adapters.files.LocalTree.


class FileTree(Protocol):
    """Files under one root. Paths are relative to the root, '/'-separated,
    never absolute and never containing '..'."""

    def read(self, path: str) -> bytes | None:
        """The file's bytes, or None if there is no such file."""
        ...

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Atomically: temp file in the same directory, fsync, rename, fsync the directory."""
        ...

    def mode(self, path: str) -> int | None:
        """The file's permission bits (0o644), or None if there is no such file."""
        ...

    def remove(self, path: str) -> None:
        """Remove a file (absent is fine) and fsync its directory."""
        ...

    def list_dir(self, path: str) -> list[str]:
        """Names in a directory, sorted; [] if there is no such directory."""
        ...

    def rename(self, source: str, target: str) -> None:
        """Atomic rename (a file or a whole directory), then fsync the directory."""
        ...

    def remove_tree(self, path: str) -> None:
        """Remove a directory and everything in it (absent is fine)."""
        ...

    def real_path(self, path: str) -> str:
        """The absolute path of `path` on this machine (for programs like systemd-analyze)."""
        ...


class PassLock(Protocol):
    """One pass at a time per host (flock on a lock file in the state directory)."""

    def acquire(self) -> None:
        """Take the lock or raise LockBusy at once."""
        ...

    def release(self) -> None: ...


class BootstrapError(Exception):
    """A bootstrap step failed; the message names it and says why."""


class LockBusy(Exception):
    """Another pass holds the lock; the message names it."""


class PlanSigningError(Exception):
    """The plan signing key cannot be used (missing, unreadable, readable by
    others, not an ed25519 key); the message names the file, never the key."""


class PlanSigner(Protocol):
    """A leader candidate's private plan key (`reconciler.adapters.plan_signing`
    reads it from its key file). The key itself never crosses this port: only
    its public half and signatures. Both raise `PlanSigningError`."""

    def public_key(self) -> bytes:
        """The raw 32-byte ed25519 public key (matched against fabric.toml's plan_keys)."""
        ...

    def sign(self, message: bytes) -> bytes:
        """The 64-byte ed25519 signature of `message`."""
        ...

    def describe(self) -> str:
        """Where the key comes from, for messages (the file's path)."""
        ...


# --------------------------------------------------------------------------
# The registry: the fleet's live state (who is alive, what it can do, who leads, the plan).
#
# The desired state lives in git; the live state lives here. Two backends
# implement the `Registry` Protocol below:
#
# - `reconciler.adapters.registry_sqlite.SqliteRegistry`: one sqlite file (WAL),
#   the embedded default for a single host and the demo. Several processes may
#   use it at once: every write is a transaction with a busy timeout. TTLs are
#   emulated with stored deadlines compared against the injected clock.
# - `reconciler.adapters.registry_etcd.EtcdRegistry`: an etcd cluster through
#   aetcd. Heartbeats live under a lease whose TTL is the node timeout, the
#   leader key under the leader's lease, plans are published in
#   transactions, and a watch wakes `wait_for_change` at once.
#
# `reconciler.wiring.open_registry(fleet_config)` picks one from
# fabric.toml's [registry] (only `reconciler.cli` calls it).
#
# The API is synchronous: every method blocks until the registry answered and
# raises `RegistryUnavailable` when it cannot be reached (the reconcile pass then
# keeps its last good generation: fail static). The etcd backend runs aetcd's
# asyncio client on a private event-loop thread, so callers never see asyncio.
#
# Epochs: one counter per registry, raised by every won campaign and by every
# published plan, in the same transaction as the write it numbers. So plans
# carry strictly increasing epochs, a new leader's first plan is newer than
# anything its predecessor published, and a host that applies only plans not
# older than its newest (`reconciler.core.live.fencing.accept_plan`) can never be
# rolled back by a deposed leader.
#
# Trust: the registry holds facts and placements (host names, service ids,
# counts), never commands, paths or configuration text. Lane jobs are not here:
# they live on phaze's broker (`LaneBroker` below); the leader's scaling record
# keeps windows, concurrency overrides and how each cloud hook last ended (exit
# status only: the hook's argv stays in the desired state, its output in the log).


@dataclass(frozen=True)
class LeaderView:
    """What one leader step reads from the registry (`Registry.lead`): the
    lifecycle events just stored, the snapshot of the states just stored, the
    newest plan as it was at that read, and when the first up node's last
    beat expires (`lifecycle.next_lapse`: the leader steps again then)."""

    events: list[LifecycleEvent]
    snapshot: Snapshot
    plan: FleetPlan | None
    next_lapse: datetime | None = None


# The Registry port is split by role: small Protocols, each a group of methods
# one kind of user needs, and `Registry`, their union, which the adapters
# implement. The engine takes the narrowest role it uses, so a fake implements
# only that:
#
#   Heartbeats    a host's pass (and bootstrap) sends its beat
#   EpochReads    the fence: the newest epoch handed out
#   PlanReads     the newest published plan (a pass, the watcher, status)
#   FleetReads    the fleet now and its recent past: snapshot, node states,
#                 who leads (and the leader record's term), the scaling record
#                 (read-only commands, the page)
#   Candidacy     a leader candidate's term: campaign, take_over, renew, resign
#   LeaderWrites  the leader's step: lifecycle, plans, scaling, waiting for change
#   Drains        the operator's drain and undrain
#   HostWatch     the watcher's wait on a host's entries
#   Liveness      fabric-watch's fast liveness record (the leader reads them
#                 all through FleetReads.liveness); on the edge, its Caddy's
#                 failed upstreams too (FleetReads.edge_upstreams)
#   PendingReports  a machine without a host file reports itself pending
#   PendingReads    the pending machines (fabric nodes, status, the edge's capabilities)
#   RegistryConnection  close, for whoever opened the connection
#
# and the roles made of them, one per user: BeatConnection, LivenessConnection, EpochConnection,
# FleetViewConnection, RegistryReads, WatchRegistry, LeaderRegistry, PassRegistry,
# PendingConnection.


class RegistryConnection(Protocol):
    def close(self) -> None: ...


class Heartbeats(Protocol):
    def heartbeat(self, record: NodeRecord, ttl_s: float | None = None) -> NodeRecord:
        """Store `record` as the node's newest beat, alive for `ttl_s` seconds
        (default: the node timeout of fabric.toml [timing], the relayed one when
        `record.relayed`). Returns the record as stored (with beat_at, timeout_s)."""
        ...


class EpochReads(Protocol):
    def epoch(self) -> int:
        """The newest epoch handed out (0 for a new registry)."""
        ...


class PlanReads(Protocol):
    def newest_plan(self) -> FleetPlan | None:
        """The plan of the newest index, its parts read at the index's
        revision and each checked against the index's digest; RegistryError
        naming the part when one is missing, another epoch's or tampered."""
        ...

    def plan_read(self, choose: Callable[[PlanIndex], Collection[str]]) -> PlanRead | None:
        """A host's read of the newest plan (issue 34): the index, then only
        the parts `choose(index)` names (none: the index alone), read at the
        index's revision (never a part of another epoch) and each checked
        against the index's digest; the plan of those parts alone
        (`plan_parts.join_plan(..., only=...)`). None: no plan published.
        RegistryError naming the index or the part when it is unreadable,
        missing, another epoch's or tampered. Reads no other part: its cost
        does not grow with the plan."""
        ...

    def plan_glance(self, host: str) -> tuple[int, dict[str, str]] | None:
        """The newest index's epoch and the names and digests of `host`'s
        parts in it, found in the index's bytes without parsing it whole
        (`plan_parts.glance_digests`) and without reading a part; None: no
        plan published. Nothing verified: what `fabric watch` follows (the
        pass verifies what it takes). RegistryError for an index that is
        neither found into nor parses."""
        ...


class FleetReads(Protocol):
    def snapshot(self, lanes: Sequence[str] = ()) -> Snapshot:
        """The scheduler's input: nodes, lanes (every lane in `lanes`, with no
        load: the lane queue's `lane_states` replaces them, see
        reconciler.engine.dispatch.with_lane_states), the newest plan's
        placements, leader, epoch. A node's max_concurrent_tasks is the
        scaling override when there is one."""
        ...

    def node_states(self) -> list[NodeState]:
        """Every known node's lifecycle state as of now (computed from the stored
        states, the live heartbeats and the drains; nothing is written)."""
        ...

    def leader(self) -> LeaderInfo | None:
        """The live leader (not resigned, renewed within its TTL), or None."""
        ...

    def leader_term(self) -> LeaderInfo | None:
        """The leader record as the registry holds it, live, stale or
        resigned, its `term` the registry's own (never read from a value a
        writer chose); None: no record (or none that parses)."""
        ...

    def scaling_record(self) -> ScalingRecord:
        """The leader's scaling memory and overrides (empty for a new registry)."""
        ...

    def edge_upstreams(self) -> dict[str, bytes]:
        """Each edge's record of its Caddy's upstreams (issue 30), raw: edge
        host -> the stored bytes, parsed one by one by the leader
        (`core.scheduling.edge_upstreams.edge_records`), so a garbage record
        is skipped and named, never the end of the read."""
        ...

    def liveness(self) -> list[LivenessRecord]:
        """The fast liveness records fabric-watch keeps alive (issue 30), one
        per host, each with when it lapses unless kept alive (etcd: a lapsed
        one is gone, its lease expired; sqlite: its row stays, expired)."""
        ...


class Candidacy(Protocol):
    def campaign(self, candidate: str, ttl_s: float) -> Leadership | None:
        """Try once to become leader for `ttl_s` seconds; None if someone leads.
        A leader record that is resigned, or stale (not renewed within its
        TTL, whoever keeps its lease alive), is taken over with a
        compare-and-swap; the new term is one the registry assigns
        (`Leadership.term`)."""
        ...

    def take_over(self, candidate: str, ttl_s: float, held: LeaderInfo) -> Leadership | None:
        """Take the live term `held` over at once (issue 30: its leader's
        host's fast liveness record lapsed, `core.scheduling.suspicion.leader_lapse`):
        a compare-and-swap that replaces the leader record only if it is
        still `held` (not renewed since) and the liveness record of its host
        has lapsed now (etcd: its key gone; sqlite: its row's deadline
        passed; no row is no lapse), then a new term as `campaign` makes
        it, whose fence refuses every write of the old term. None: the
        record changed, the host's record is alive, or another won."""
        ...

    def renew(self, leadership: Leadership) -> bool:
        """Keep the term alive for another `ttl_s` and rewrite the record's
        `renewed_at`; False when it is over."""
        ...

    def resign(self, leadership: Leadership) -> None:
        """End the term: the record stays, marked resigned (its term is still
        the current one until a candidate campaigns)."""
        ...


class LeaderWrites(Protocol):
    """Leader only: each raises NotLeader when `leadership` is over."""

    def advance_lifecycle(self, leadership: Leadership) -> list[LifecycleEvent]:
        """Compute the lifecycle as of now and store it (states, garbage collection)."""
        ...

    def lead(self, leadership: Leadership, lanes: Sequence[str] = ()) -> LeaderView:
        """`advance_lifecycle`, then `snapshot(lanes)` of the states it
        stored, and the newest plan, all from one read of the registry (the
        leader's step reads the whole registry once)."""
        ...

    def publish_plan(self, leadership: Leadership, plan: FleetPlan) -> FleetPlan:
        """Store `plan` under the next epoch, only while `leadership` holds,
        in parts: its signed index and the parts it names
        (`reconciler.core.live.plan_parts`; a part already stored is not
        written again). Returns the plan as stored and as `newest_plan` gives
        it back (its `epoch`, `leader` and `term` set here, its placements in
        the scheduler's order). Raises RegistryError when the index or a part
        is over one request's budget."""
        ...

    def store_scaling(self, leadership: Leadership, record: ScalingRecord) -> None:
        """Store `record` only while `leadership` holds."""
        ...

    def wait_for_change(self, timeout_s: float) -> bool:
        """Block until a node joins or goes silent, a drain changes or the
        leader changes, or `timeout_s` passes. True if something changed."""
        ...


class Drains(Protocol):
    def set_drain(self, node_id: str, grace_s: float = 0, reason: str = "operator drain") -> DrainRequest: ...

    def clear_drain(self, node_id: str) -> bool:
        """Lift a drain; False when the node was not drained."""
        ...


class Liveness(Protocol):
    def keep_alive(self, host: str, ttl_s: float) -> LivenessRecord:
        """fabric-watch: keep `host`'s fast liveness record alive for another
        `ttl_s` seconds (etcd: its key on a lease of its own, granted once
        and kept alive, granted again when it lapsed; sqlite: one row
        write). Cheap: no pass, no desired state. Raises RegistryUnavailable,
        PermissionDenied (etcd auth: a host writes only its own key)."""
        ...

    def report_edge_upstreams(self, edge: str, record: bytes) -> None:
        """fabric-watch on an edge host: store its Caddy's upstreams (an
        `EdgeUpstreams` JSON) at P/edge-upstreams/<edge> (etcd auth: an edge
        writes only its own). Raises RegistryUnavailable, PermissionDenied."""
        ...


class HostWatch(Protocol):
    def watch_host(self, host: str, timeout_s: float) -> list[EntryVersion]:
        """`fabric watch`: the entries that concern `host` (the newest plan,
        its drain request, its node state) that may have changed, with their
        versions now (`reconciler.core.live.watching`; the plan's is the
        registry's, which the watcher turns into the digest of `host`'s part). The first call, and the
        first after a failure, reports all three (the baseline); later calls
        block until one changes or `timeout_s` passes (etcd: a watch on those
        keys; sqlite: one read after `timeout_s`). Raises RegistryUnavailable."""
        ...


class PendingReports(Protocol):
    def report_pending(self, record: PendingRecord, ttl_s: float) -> PendingRecord:
        """Store `record` as the machine's pending report, alive for `ttl_s`
        seconds (etcd: P/pending/<host> under a lease of that TTL; sqlite: a
        stored deadline); its `first_seen` kept from a live earlier report.
        Returns the record as stored. With etcd's auth on, the joining
        identity may write this and nothing else."""
        ...


class PendingReads(Protocol):
    def pending_nodes(self) -> tuple[list[PendingRecord], list[str]]:
        """The live pending reports (never part of `snapshot`: they carry no
        authority), and a line for each that did not parse (skipped)."""
        ...


class MemberReports(Protocol):
    def report_member(self, record: MemberRecord, ttl_s: float) -> MemberRecord:
        """Store `record` as a group member's report, under its group
        (etcd: P/members/<group>/<member> under a lease of `ttl_s`; sqlite: a
        stored deadline), its `first_seen` kept from a live earlier report.
        Returns the record as stored. With etcd's auth on, only the group's
        identity (fabric-group-<group>) may write there."""
        ...


class MemberReads(Protocol):
    def group_members(self) -> tuple[list[MemberRecord], list[str]]:
        """The live member reports of every group (admitted or not: the
        leader decides, `core.scheduling.groups`), and a line for each that
        did not parse or names another group or member than its key (skipped)."""
        ...


# -- the roles, one per user ---------------------------------------------------


class BeatConnection(Heartbeats, RegistryConnection, Protocol):
    """A pass's heartbeat after activation, on a connection of its own."""


class LivenessConnection(Liveness, RegistryConnection, Protocol):
    """fabric-watch's fast liveness record, on a connection of its own."""


class EpochConnection(EpochReads, RegistryConnection, Protocol):
    """A pass's re-check of the epoch after it applied a plan."""


class FleetViewConnection(FleetReads, PendingReads, RegistryConnection, Protocol):
    """The edge's pass reading the fleet's view for the status page and the capabilities API."""


class PendingConnection(PendingReports, RegistryConnection, Protocol):
    """A pending machine's restricted pass: its pending report, nothing else."""


class RegistryReads(FleetReads, PlanReads, EpochReads, PendingReads, MemberReads, Protocol):
    """Everything any host may read: `fabric status`, lane status, the dispatcher's reads."""


class WatchRegistry(HostWatch, PlanReads, Protocol):
    """The watcher (`fabric watch`): a host's entries, and the plan when it moved."""


class LeaderRegistry(Candidacy, LeaderWrites, RegistryReads, Protocol):
    """The leader loop: its term, its step (lifecycle, plan, scaling), the dispatcher's reads."""


class MemberConnection(MemberReports, RegistryConnection, Protocol):
    """A group member's report, as the group's identity."""


class PassRegistry(Heartbeats, LeaderRegistry, RegistryConnection, Protocol):
    """A pass's connection: its beat, the plan and epoch, its own node state,
    and a candidate's one-shot leader step when nobody leads."""


class Registry(
    Heartbeats,
    EpochReads,
    PlanReads,
    FleetReads,
    Candidacy,
    LeaderWrites,
    Drains,
    HostWatch,
    Liveness,
    PendingReports,
    PendingReads,
    MemberReports,
    MemberReads,
    RegistryConnection,
    Protocol,
):
    """The whole port, every role: what the sqlite and etcd adapters implement."""


class RayStateUnavailable(Exception):
    """Ray's state API could not be read (no cluster at the address, a timeout)."""


class RayState(Protocol):
    """Ray's state API as the leader reads it (reconciler.adapters.ray_state): the
    tasks running per fabric host and the hosts whose Ray node died, by the
    host label the fabric rendered on each Ray node. Raises RayStateUnavailable."""

    def observe(self) -> RayView: ...


# --------------------------------------------------------------------------
# The lane queue: phaze's broker (SAQ on PostgreSQL, PHAZE_QUEUE_URL) as the
# fabric sees it. The adapter is reconciler.adapters.lane_broker_pg.
#
# Jobs the job system hands the fabric wait in a table of the fabric's own in
# the broker's database (an id, when it was enqueued, its attempts and
# duration: never what it runs). A dispatch moves one job into a lane's SAQ
# queue (`phaze-agent-<agent_ref>` for a compute lane, the local lane's
# declared `queue`), where that lane's SAQ workers take it; a lane's load is
# what its SAQ queue holds, its workers what saq's worker stats show.


@dataclass(frozen=True)
class DispatchFence:
    """The fence of a dispatch: the term the dispatcher runs in (the leader's,
    as the registry assigned it: `LeaderInfo.term`) and how to read the
    registry's current term. The broker reads `current_term` inside each
    fenced transaction, with the fence row locked, and refuses the dispatch
    (StaleDispatcher) unless it equals `term`: nothing stored in the broker
    decides, so no broker client can stop dispatch by writing a number.
    `current_term` raises LaneBrokerUnavailable when the registry cannot say."""

    term: int
    current_term: Callable[[], int]

    @classmethod
    def fixed(cls, term: int) -> DispatchFence:
        """A fence whose registry always names `term` (tests and benches without a registry)."""
        return cls(term, lambda: term)

    def refusal(self) -> str | None:
        """Why a dispatch under this fence is refused now (the registry's term
        is another), or None."""
        current = self.current_term()
        if current != self.term:
            return f"dispatcher of term {self.term} refused: the registry's current term is {current}"
        return None


@dataclass(frozen=True)
class LaneTarget:
    """Where a dispatch puts a job: the lane, its SAQ queue and cap, and
    whether a failure there counts a cloud attempt (a compute lane)."""

    lane: str
    queue: str
    cap: int
    cloud: bool
    # The SAQ heartbeat the job carries (scheduler.lane_job_heartbeat_s; 0: none).
    heartbeat_s: int = 0


class LaneBroker(Protocol):
    def enqueue(self, jobs: Sequence[tuple[str, float | None]]) -> list[QueuedJob]:
        """Add each (job id, duration in seconds or None) as waiting, enqueued
        now with no attempts; a job already known is left as it is. Returns
        the jobs as stored, in the order given."""
        ...

    def jobs(self) -> list[QueuedJob]:
        """Every known job, waiting or dispatched, oldest enqueued first (then in enqueue order)."""
        ...

    def dispatch(self, job_id: str, target: LaneTarget, fence: DispatchFence) -> QueuedJob | None:
        """In one transaction, under the dispatch lock (the fence's row): the
        registry's current term must be the fence's, the job must still wait
        and the lane's queue hold fewer than `cap` jobs (queued or active);
        then it is put on the lane's SAQ queue. None when the job no longer
        waits or the lane is full (another dispatcher won). Raises
        StaleDispatcher when the fence's term is not the registry's."""
        ...

    def settle(self) -> list[SettledJob]:
        """Dispatched jobs whose SAQ job ended: a complete one is gone, any
        other waits again (its enqueue time kept, one more attempt when it
        ran in a compute lane)."""
        ...

    def active_runs(self) -> BrokerRuns:
        """In one transaction: the broker's clock and start time, and each
        dispatched job's SAQ job that is active, with the worker that began
        it and when that worker's stats row expires (core.scheduling.lanes
        decides which of them crashed)."""
        ...

    def settle_crashed(self, crashed: Sequence[CrashedRun], fence: DispatchFence) -> list[SettledJob]:
        """Each run of `crashed` that is still its job's active run: its SAQ
        job set aside (aborting, off its queue: its slot is free and a late
        finish of it changes nothing), the job waiting again (its enqueue
        time kept, one more attempt when it ran in a compute lane). Raises
        StaleDispatcher when the fence's term is not the registry's."""
        ...

    def sweep_superseded(self) -> list[SettledJob]:
        """Runs set aside by `settle_crashed` whose worker finished them
        after all (outcome superseded: ignored, to be logged), cleared; those
        their worker aborted, cleared silently."""
        ...

    def lane_states(self, queues: Mapping[str, str]) -> list[SnapshotLane]:
        """Each lane (lane id -> its queue) as the broker shows it now: jobs
        queued or active on its queue, its workers with a fresh heartbeat,
        and how long ago the newest heartbeat lapsed when none is fresh."""
        ...

    def phaze_agents(self, agent_ids: Sequence[str]) -> dict[str, PhazeAgentSeen]:
        """Each of `agent_ids` as phaze's own `agents` table shows it (its
        last_seen_at and revoked_at, classified as phaze does), read where the
        broker's database holds that table (phaze's default: its queue_url and
        database_url name one database). Never raises for what the table holds
        or lacks: an agent without a row, a table that is not there or not as
        phaze makes it, is `unknown` with the reason. Raises
        LaneBrokerUnavailable when the broker cannot be reached."""
        ...

    def close(self) -> None: ...


class CheckoutError(Exception):
    """The desired-state checkout refused a change (git failed, a signing key
    is missing); the message says what and why."""


class DesiredCheckout(Protocol):
    """The operator's desired-state git checkout (`fabric admit`; the adapter
    is reconciler.adapters.desired_checkout). Paths are relative to its top."""

    def read(self, path: str) -> str | None:
        """The file's text, None when it is not there."""
        ...

    def signing_required(self) -> str | None:
        """Why commits here must be signed (None: they need not be)."""
        ...

    def commit(self, files: Mapping[str, str], message: str, *, sign: bool) -> str:
        """Write the files, commit exactly them (signed when `sign`) and
        return the commit id; on failure nothing written stays (CheckoutError)."""
        ...

    def push(self) -> str:
        """Push the branch to its upstream; what git said (CheckoutError)."""
        ...


class RegistryAuth(Protocol):
    """etcd's users, roles and auth switch (`fabric registry init-auth`); the
    client must act as root (or auth must still be off). Failures raise
    RegistryError (PermissionDenied for a non-root identity)."""

    def access_state(self) -> AccessState:
        """The users with their roles, the roles with their key permissions,
        and whether auth is enabled."""
        ...

    def apply_auth_step(self, step: AuthStep) -> None: ...

    def close(self) -> None: ...


class BrokerRoleAdmin(Protocol):
    """phaze's broker's roles (`fabric lane init-roles`), reached with the
    tables' owner's DSN. Failures raise LaneBrokerError (LaneBrokerUnavailable
    when PostgreSQL does not answer)."""

    def make_tables(self) -> list[str]:
        """saq's tables and the fabric's, made where missing; what was made, said."""
        ...

    def role_state(self) -> BrokerState:
        """The fabric-* roles, their privileges on the broker's tables, row
        security, the fabric-* policies, the agents' schemas and search paths."""
        ...

    def apply_role_step(self, step: RoleStep) -> None: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------
# The pass memo (reconciler.engine.memoized_pass). Their adapters
# (reconciler.adapters.memo_io) use the standard library only: a memoized
# pass imports no model, and the engine names these Protocols for types only.


class BeatRegistry(Protocol):
    """What a memoized pass asks of the registry: its heartbeat, re-sent as
    the JSON object of the record the last full pass measured and validated
    (a Registry's `heartbeat` stores through the same rule) and the plan
    epoch. The embedded backend's adapter imports no model."""

    def heartbeat_json(self, record: dict[str, Any], ttl_s: float) -> dict[str, Any]:
        """Store `record` (NodeRecord JSON) as the node's newest beat, alive for
        `ttl_s` seconds; the record as stored (beat_at, timeout_s set)."""
        ...

    def epoch(self) -> int: ...

    def close(self) -> None: ...


class BeatLaneBroker(Protocol):
    """What a memoized pass asks of the lane queue: the in_flight of the
    lanes whose jobs run here (jobs queued or active on each queue, 0 for one
    with none), counted as `LaneBroker.lane_states` counts it, no model built."""

    def in_flight(self, queues: Sequence[str]) -> dict[str, int]: ...

    def close(self) -> None: ...


class MemoStore(Protocol):
    """Small files of the pass (the memo, the pass counters, the metrics
    textfile) by absolute path, and the pass lock."""

    def read(self, path: Path) -> bytes | None:
        """The file's bytes, None when it is not there."""
        ...

    def write(self, path: Path, data: bytes) -> None:
        """Replace the file whole or not at all."""
        ...

    def remove(self, path: Path) -> None:
        """Gone afterwards (no error when it was not there)."""
        ...

    def rewrite_head(self, path: Path, edit: Callable[[str], str]) -> bool:
        """Replace the file with its first lines passed through `edit` and the
        rest copied as it is (an edge's textfile holds the whole fleet's series);
        False when there is no file."""
        ...

    def lock(self, lock_file: Path) -> AbstractContextManager[bool]:
        """The pass lock (the same file as PassLock) if free (True), without waiting."""
        ...


class MemoReader(Protocol):
    """What the pass memo is checked against and its inputs key computed from."""

    def read(self, path: str) -> bytes | None:
        """A file under the root, None when it is not there."""
        ...

    def unit_state(self) -> Callable[[str], str] | None:
        """A unit's ActiveState by name; None without activation (nothing to ask)."""
        ...

    def nft_digest(self) -> Callable[[], str | None] | None:
        """sha256 of the fabric table's listing (None: not loaded); None without activation."""
        ...

    def fingerprint(self, paths: Sequence[Path | str]) -> str:
        """A digest of files and directory trees from names and stat alone."""
        ...

    def git_commit(self, directory: Path) -> str | None:
        """The commit checked out at the top of `directory` and its index's stat; None: not a checkout."""
        ...

    def tree_stamp(self, directory: Path, files: Sequence[str], since: float | None = None) -> str | None:
        """A desired state that is not a git checkout, from a few stats: its
        Nix store path, or the stat of the directory, its hosts/ and `files`
        (relative to it); None when `since` is given and one of them changed
        at or after it (`reconciler.adapters.memo_io.tree_stamp`)."""
        ...

    def which(self, program: str) -> str | None:
        """Where `program` is on PATH."""
        ...
