"""What both registry backends share: the lifecycle and the snapshot over one consistent read (pure).

A backend reads everything it holds at one instant (`LiveRead`: sqlite in one
transaction, etcd in pages at one revision) and stores the leader's lifecycle
fenced by the term (`_store_lifecycle`: sqlite in one transaction, etcd in
chunks of bounded size, each fenced, since etcd caps a transaction); this
mixin turns those into `node_states`, `advance_lifecycle`, `snapshot` and the
leader's `lead` (both of the latter over one read) with
the pure `reconciler.core.scheduling.lifecycle.observe`, so both backends follow exactly the
same rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from reconciler.core.desired.model import FlapSettings, TimingSettings
from reconciler.core.live.models import FleetPlan, Snapshot, SnapshotLane, SnapshotNode
from reconciler.core.live.records import DrainRequest, LeaderInfo, Leadership, NodeRecord
from reconciler.core.live.unreadable import UnreadableRecord
from reconciler.core.scheduling.lifecycle import UP, LifecycleEvent, NodeState, beat_expiry, observe, snapshot_node, updated
from reconciler.ports import LeaderView


@dataclass(frozen=True)
class LiveRead:
    """Everything a backend holds, read at one instant."""

    now: datetime
    # The newest record of every node the registry has facts for.
    records: dict[str, NodeRecord] = field(default_factory=dict)
    # Nodes whose heartbeat has not expired.
    alive: frozenset[str] = frozenset()
    states: dict[str, NodeState] = field(default_factory=dict)
    drains: dict[str, DrainRequest] = field(default_factory=dict)
    plan: FleetPlan | None = None
    leader: LeaderInfo | None = None
    epoch: int = 0
    # The leader's scaling overrides of max_concurrent_tasks (ScalingRecord.concurrency).
    concurrency: dict[str, int] = field(default_factory=dict)
    # The records that did not parse or validate, skipped by this read
    # (reconciler.adapters.registry_records): the snapshot names them.
    problems: tuple[UnreadableRecord, ...] = ()


def with_override(node: SnapshotNode, override: int | None) -> SnapshotNode:
    """`node` with the scaling override as its max_concurrent_tasks.

    Never above the node's ceiling (or its own limit when it declares none),
    so an override left from an older record cannot oversubscribe a node whose
    limits have shrunk since."""
    if override is None:
        return node
    highest = max(node.max_concurrent_tasks, node.max_concurrent_ceiling or 0)
    return updated(node, {"max_concurrent_tasks": max(0, min(override, highest))})


class LifecycleMixin:
    """Needs `timing`, `flap`, `_read()` and `_store_lifecycle()` from the backend."""

    timing: TimingSettings
    flap: FlapSettings

    def _read(self, with_plan: bool = True) -> LiveRead:  # pragma: no cover - provided by the backend
        """Everything at one instant; without `with_plan`, no plan (`plan`
        None, none of its parts read: a host's own state costs no plan)."""
        raise NotImplementedError

    def _store_lifecycle(
        self,
        leadership: Leadership,
        changed: dict[str, NodeState],
        dead: set[str],
        forgotten: set[str],
    ) -> None:  # pragma: no cover - provided by the backend
        """Fenced by `leadership` (every transaction it takes compares the
        term; NotLeader when it is over): store the changed states, drop the
        facts of dead nodes, delete every record of forgotten ones."""
        raise NotImplementedError

    def _observe(self, read: LiveRead) -> tuple[dict[str, NodeState], list[LifecycleEvent]]:
        return observe(read.states, read.records, read.alive, read.drains, read.now, self.timing, self.flap)

    def node_states(self) -> list[NodeState]:
        # No plan: a host's pass asks this (its own state, on a Ray node) and
        # must not pay for every part of a large plan.
        states, _ = self._observe(self._read(with_plan=False))
        return [states[k] for k in sorted(states)]

    def _advance(self, leadership: Leadership, read: LiveRead) -> tuple[dict[str, NodeState], list[LifecycleEvent]]:
        states, events = self._observe(read)
        # `is not` first: most states are the very ones read (observe kept them).
        changed = {k: v for k, v in states.items() if (old := read.states.get(k)) is not v and old != v}
        dead = {k for k, v in states.items() if v.status == "dead" and k in read.records}
        forgotten = set(read.states) - set(states)
        # Stored even when nothing changed: the fenced write is also the check
        # that `leadership` still holds.
        self._store_lifecycle(leadership, changed, dead, forgotten)
        return states, events

    def advance_lifecycle(self, leadership: Leadership) -> list[LifecycleEvent]:
        _, events = self._advance(leadership, self._read())
        return events

    def lead(self, leadership: Leadership, lanes: Sequence[str] = ()) -> LeaderView:
        # One read serves both halves: the states just stored are the ones the
        # snapshot shows (what `snapshot()` would compute from a read taken now,
        # less whatever changed in between, which the next step sees).
        read = self._read()
        states, events = self._advance(leadership, read)
        return LeaderView(events=events, snapshot=self._snapshot(read, states, lanes), plan=read.plan, next_lapse=self._next_lapse(states))

    def _next_lapse(self, states: dict[str, NodeState]) -> datetime | None:
        """`next_lapse` of `states`, each up node's expiry computed once per
        record object (its beat: the same record, the same expiry)."""
        before: dict[str, tuple[NodeRecord, datetime | None]] = getattr(self, "_lapses", {})
        lapses: dict[str, tuple[NodeRecord, datetime | None]] = {}
        for node, state in states.items():
            record = state.record
            if state.status in UP and record is not None:
                held = before.get(node)
                lapses[node] = held if held is not None and held[0] is record else (record, beat_expiry(record))
        self._lapses = lapses
        return min((expiry for _, expiry in lapses.values() if expiry is not None), default=None)

    def snapshot(self, lanes: Sequence[str] = ()) -> Snapshot:
        read = self._read()
        states, _ = self._observe(read)
        return self._snapshot(read, states, lanes)

    def _snapshot(self, read: LiveRead, states: dict[str, NodeState], lanes: Sequence[str]) -> Snapshot:
        """The snapshot of `states`; a node's scheduler view is made once per
        state (the same state object as the last snapshot's: the same node)."""
        before: dict[str, tuple[NodeState, SnapshotNode | None]] = getattr(self, "_snapshot_nodes", {})
        made: dict[str, tuple[NodeState, SnapshotNode | None]] = {}
        for key in sorted(states):
            state = states[key]
            held = before.get(key)
            made[key] = held if held is not None and held[0] is state else (state, snapshot_node(state))
        self._snapshot_nodes = made
        return _snapshot(read, [node for _, node in made.values() if node is not None], lanes)


def _snapshot(read: LiveRead, made: list[SnapshotNode], lanes: Sequence[str]) -> Snapshot:
    nodes = [with_override(n, read.concurrency.get(n.node_id)) for n in made]
    # Lane load is not the registry's: it lives on phaze's broker, and the
    # engine puts the lane queue's view in (engine.dispatch.with_lane_states).
    return Snapshot(
        now=read.now,
        nodes=nodes,
        lanes=[SnapshotLane(id=lane) for lane in sorted(set(lanes))],
        placements=list(read.plan.placements) if read.plan else [],
        room_since=dict(read.plan.room_since) if read.plan else {},
        suspects=dict(read.plan.suspects) if read.plan else {},
        # A resigned or stale record names nobody who leads (its term stays current: `Registry.leader_term`).
        leader=read.leader.candidate if read.leader and read.leader.live_at(read.now) else None,
        leader_problem=read.leader.problem if read.leader and read.leader.live_at(read.now) else None,
        epoch=read.epoch,
        unreadable=list(read.problems),
    )
