"""The registry: the fleet's live state (who is alive, what it can do, who leads, the plan).

The desired state lives in git; the live state lives here. Two backends
implement the `Registry` Protocol below:

- `reconciler.adapters.registry_sqlite.SqliteRegistry`: one sqlite file (WAL),
  the embedded default for a single host and the demo. Several processes may
  use it at once: every write is a transaction with a busy timeout. TTLs are
  emulated with stored deadlines compared against the injected clock.
- `reconciler.adapters.registry_etcd.EtcdRegistry`: an etcd cluster through
  aetcd. Heartbeats live under a lease whose TTL is the node timeout, the
  leader key under the leader's lease, plans are published and lane slots
  claimed in transactions, and a watch wakes `wait_for_change` at once.

`reconciler.registry.factory.open_registry(fleet_config)` picks one from
fabric.toml's [registry] (only `reconciler.cli` calls it).

The API is synchronous: every method blocks until the registry answered and
raises `RegistryUnavailable` when it cannot be reached (the reconcile pass then
keeps its last good generation: fail static). The etcd backend runs aetcd's
asyncio client on a private event-loop thread, so callers never see asyncio.

Epochs: one counter per registry, raised by every won campaign and by every
published plan, in the same transaction as the write it numbers. So plans
carry strictly increasing epochs, a new leader's first plan is newer than
anything its predecessor published, and a host that applies only plans not
older than its newest (`reconciler.registry.fencing.accept_plan`) can never be
rolled back by a deposed leader.

Trust: the registry holds facts and placements (host names, service ids,
counts), never commands, paths or configuration text. Lane jobs are an id, an
enqueue time and an attempts count (`QueuedJob`); the leader's scaling record
keeps windows, concurrency overrides and how each cloud hook last ended (exit
status only: the hook's argv stays in the desired state, its output in the log).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from reconciler.registry.records import (
    DrainRequest,
    LeaderInfo,
    Leadership,
    NodeRecord,
    QueuedJob,
    ScalingRecord,
    SlotClaim,
)

if TYPE_CHECKING:  # reconciler.lifecycle imports reconciler.registry.records
    from reconciler.lifecycle import LifecycleEvent, NodeState
    from reconciler.live import FleetPlan, Snapshot

__all__ = [
    "DrainRequest",
    "LeaderInfo",
    "Leadership",
    "NodeRecord",
    "NotLeader",
    "QueuedJob",
    "Registry",
    "RegistryError",
    "RegistryUnavailable",
    "ScalingRecord",
    "SlotClaim",
]


class RegistryError(Exception):
    """Something the registry refused or could not do."""


class RegistryUnavailable(RegistryError):
    """The registry cannot be reached (no etcd endpoint answers, the sqlite file
    cannot be opened or stays locked). Callers fail static: keep what runs."""


class NotLeader(RegistryError):
    """A write that needs leadership was refused: the caller's term is over
    (its lease lapsed, or another candidate leads now)."""


class Registry(Protocol):
    # -- nodes ------------------------------------------------------------
    def heartbeat(self, record: NodeRecord, ttl_s: float | None = None) -> NodeRecord:
        """Store `record` as the node's newest beat, alive for `ttl_s` seconds
        (default: the node timeout of fabric.toml [timing], the relayed one when
        `record.relayed`). Returns the record as stored (with beat_at, timeout_s)."""
        ...

    def node_states(self) -> list[NodeState]:
        """Every known node's lifecycle state as of now (computed from the stored
        states, the live heartbeats and the drains; nothing is written)."""
        ...

    def advance_lifecycle(self, leadership: Leadership) -> list[LifecycleEvent]:
        """Leader only: compute the lifecycle as of now and store it (states,
        garbage collection). Raises NotLeader if `leadership` is over."""
        ...

    def set_drain(self, node_id: str, grace_s: float = 0, reason: str = "operator drain") -> DrainRequest: ...

    def clear_drain(self, node_id: str) -> bool:
        """Lift a drain; False when the node was not drained."""
        ...

    # -- leadership and the plan -------------------------------------------
    def campaign(self, candidate: str, ttl_s: float) -> Leadership | None:
        """Try once to become leader for `ttl_s` seconds; None if someone leads."""
        ...

    def renew(self, leadership: Leadership) -> bool:
        """Keep the term alive for another `ttl_s`; False when it is over."""
        ...

    def resign(self, leadership: Leadership) -> None: ...

    def leader(self) -> LeaderInfo | None: ...

    def epoch(self) -> int:
        """The newest epoch handed out (0 for a new registry)."""
        ...

    def publish_plan(self, leadership: Leadership, plan: FleetPlan) -> FleetPlan:
        """Store `plan` under the next epoch, only while `leadership` holds.
        Returns the plan as stored (its `epoch` and `leader` set here).
        Raises NotLeader otherwise."""
        ...

    def newest_plan(self) -> FleetPlan | None: ...

    # -- lanes ---------------------------------------------------------------
    def claim_slot(self, lane: str, cap: int, holder: str, ttl_s: float | None = None) -> SlotClaim | None:
        """Claim one of the lane's `cap` slots, or None when all are taken.
        With `ttl_s`, the claim lapses if not released in time (a dispatcher
        that died frees its slot)."""
        ...

    def release_slot(self, claim: SlotClaim) -> bool:
        """Release a claim; False when it was no longer held."""
        ...

    def lane_in_flight(self) -> dict[str, int]:
        """Claimed slots per lane."""
        ...

    def report_lane(self, lane: str, available: bool) -> None:
        """Record a lane's probe result (offline lanes take no new work)."""
        ...

    # -- the lane job queue (fed by the job system; see reconciler.cli.lane) ----
    def enqueue_jobs(self, job_ids: Sequence[str]) -> list[QueuedJob]:
        """Add each job as waiting (enqueued now, no attempts); a job already
        known is left as it is. Returns the jobs as stored."""
        ...

    def lane_jobs(self) -> list[QueuedJob]:
        """Every known job, waiting or running, oldest enqueued first."""
        ...

    def start_job(self, job_id: str, lane: str, cap: int) -> SlotClaim | None:
        """In one transaction: the job must still be waiting and the lane have
        one of its `cap` slots free; claim that slot for the job. None when the
        job is no longer waiting or the lane is full (another dispatcher won)."""
        ...

    def finish_job(self, job_id: str, *, requeue: bool = False, count_attempt: bool = False) -> QueuedJob | None:
        """Free the running job's slot; with `requeue` it waits again (its
        enqueue time kept, one more attempt with `count_attempt`), else it is
        gone. None when the job was not running."""
        ...

    # -- scaling (written by the leader only) -----------------------------------
    def scaling_record(self) -> ScalingRecord:
        """The leader's scaling memory and overrides (empty for a new registry)."""
        ...

    def store_scaling(self, leadership: Leadership, record: ScalingRecord) -> None:
        """Store `record` only while `leadership` holds; raises NotLeader otherwise."""
        ...

    # -- reading it all -------------------------------------------------------
    def snapshot(self, lanes: Sequence[str] = ()) -> Snapshot:
        """The scheduler's input: nodes, lanes (every lane in `lanes` plus any
        with claims or a report), the newest plan's placements, leader, epoch.
        A node's max_concurrent_tasks is the scaling override when there is one."""
        ...

    def wait_for_change(self, timeout_s: float) -> bool:
        """Block until a node joins or goes silent, a drain changes or the
        leader changes, or `timeout_s` passes. True if something changed."""
        ...

    def close(self) -> None: ...
