"""The node lifecycle (pure): heartbeats and drain requests in, node states and events out.

No I/O and no clock: every function takes `now`. The registry backends feed
it what they read and store what it returns; the leader is the only writer
of the stored states (its writes are fenced by the leader key).

States of one node (`NodeState.status`, the seed's vocabulary)::

    (first heartbeat) -> active
    active   --drain request------------------> draining
    draining --undrain------------------------> active
    active / draining --silent past timeout--> offline   (work is evacuated:
                                                          the scheduler re-places it)
    offline  --heartbeat again---------------> active (or draining if drained)
    offline  --offline for drain_grace_s-----> dead      (its facts are dropped)
    dead     --dead for drain_grace_s--------> forgotten (every record deleted)
    dead     --heartbeat again---------------> active

A node is alive while the backend holds a heartbeat for it that has not
expired: on etcd the heartbeat key is written under a lease whose TTL is the
node timeout; on sqlite the stored deadline is compared with the clock
(`alive_at`). The timeout is `timing.node_timeout_s` (3 missed 30 s beats),
or for a node whose Tailscale path is relayed (DERP) `relayed_heartbeat_s` x
`missed_beats` (45 s beats): a slow path must not read as a missed beat
(`heartbeat_timeout`).

Drain: status "draining" from the request on (no new placements) while the
node's existing work stays for the grace; when the grace is over `drained`
becomes True and the scheduler moves its work off. Undrain clears both.

Flap damping: every change between up (active, draining) and down (offline,
dead) is a toggle. `flap.toggles` toggles within `flap.window_s` hold the node
off new placements for `flap.hold_off_s` (`held_off_until`); it keeps what it
runs. Toggles during a hold-off start a new count.

Every change is kept with its time and reason (`NodeState.transitions`, the
newest `HISTORY` of them) and returned as a `LifecycleEvent`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from reconciler.core.desired.model import FlapSettings, TimingSettings
from reconciler.core.live.models import NodeStatus, SnapshotNode, Transition, TransitionStatus
from reconciler.core.live.records import DrainRequest, NodeRecord
from reconciler.core.timestamps import stamp, utc, utc_stamp

# Transitions kept per node (older ones are dropped first).
HISTORY = 50

UP: frozenset[str] = frozenset({"active", "draining"})


class NodeState(BaseModel):
    """What the lifecycle knows about one node; stored by the registry as JSON."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    node_id: str
    status: NodeStatus
    since: datetime
    # The last record the node sent (kept while offline, so the node still
    # shows with its tier; dropped when it is declared dead).
    record: NodeRecord | None = None
    last_seen: datetime | None = None
    toggles: tuple[datetime, ...] = ()
    held_off_until: datetime | None = None
    drain: DrainRequest | None = None
    # The drain's grace is over: the node's work must move off.
    drained: bool = False
    transitions: tuple[Transition, ...] = ()

    def held_off(self, now: datetime) -> bool:
        return self.held_off_until is not None and utc(self.held_off_until) > utc(now)


@dataclass(frozen=True)
class LifecycleEvent:
    node_id: str
    transition: Transition
    # The node's records should be deleted from the registry (garbage collection).
    forget: bool = False

    def __str__(self) -> str:
        return f"{self.node_id}: {self.transition.status}: {self.transition.reason}"


def heartbeat_timeout(timing: TimingSettings, relayed: bool) -> int:
    """Seconds of silence after which a node is offline (its heartbeat TTL)."""
    return timing.node_timeout_for(relayed=relayed)


def alive_at(records: Mapping[str, NodeRecord], now: datetime) -> set[str]:
    """Nodes whose last beat has not expired at `now` (beat_at + timeout_s).

    The sqlite backend judges liveness this way; etcd lets the lease do it
    (and `lapsed_at` catches a lease etcd has not revoked yet)."""
    return {node_id for node_id, record in records.items() if (expiry := _expiry(record)) is not None and utc(now) < expiry}


def lapsed_at(records: Mapping[str, NodeRecord], now: datetime) -> set[str]:
    """Nodes whose last beat says it has expired by `now` (a record that does
    not say when it expires is not lapsed by its own word)."""
    return {node_id for node_id, record in records.items() if (expiry := _expiry(record)) is not None and utc(now) >= expiry}


def next_lapse(states: Iterable[NodeState]) -> datetime | None:
    """The earliest moment an up node's last beat expires (its beat_at + its
    timeout_s): when the leader must step next so that the node is marked
    offline at its lapse, not at a later step. None when no up node has a beat.
    """
    earliest: datetime | None = None
    for state in states:
        if state.status not in UP or state.record is None:
            continue
        expiry = _expiry(state.record)
        if expiry is not None and (earliest is None or expiry < earliest):
            earliest = expiry
    return earliest


def _fmt(seconds: float) -> str:
    return f"{seconds:g} s"


# NodeState's fields, looked up once (pydantic's model_fields is a property).
_FIELDS: tuple[str, ...] = tuple(NodeState.model_fields)

_Model = TypeVar("_Model", bound=BaseModel)
_FIELD_SETS: dict[type[BaseModel], frozenset[str]] = {}


def trusted(cls: type[_Model], values: dict[str, Any]) -> _Model:
    """A `cls` holding `values` (a new dict of every one of its fields, each
    already of its field's type), built without validating: the leader builds
    a state and a snapshot node per node per step, and pydantic's
    `model_construct` (which also fills defaults) or `model_copy` cost several
    times more. A missing or unknown field is refused (ValueError), so a field
    added to the model later cannot be left out silently."""
    fields = _FIELD_SETS.get(cls)
    if fields is None:
        fields = _FIELD_SETS[cls] = frozenset(cls.model_fields)
    if values.keys() != fields:
        raise ValueError(f"{cls.__name__} built without {sorted(fields - values.keys())} / with unknown {sorted(values.keys() - fields)}")
    model = cls.__new__(cls)
    object.__setattr__(model, "__dict__", values)
    object.__setattr__(model, "__pydantic_fields_set__", set(fields))
    object.__setattr__(model, "__pydantic_extra__", None)
    object.__setattr__(model, "__pydantic_private__", None)
    return model


def updated(model: _Model, update: dict[str, Any]) -> _Model:
    """`model` with the fields in `update` replaced (values of their fields'
    types, not validated): `model_copy(update=...)` without its deep machinery."""
    values = dict(model.__dict__)
    values.update(update)
    return trusted(type(model), values)


class _Node:
    """A mutable working copy of one NodeState during `observe`."""

    def __init__(self, state: NodeState) -> None:
        # Shallow: nested records stay models.
        self.values: dict[str, Any] = {name: getattr(state, name) for name in _FIELDS}
        self.values["transitions"] = list(state.transitions)
        self.values["toggles"] = list(state.toggles)
        self.events: list[LifecycleEvent] = []

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def record_transition(self, now: datetime, status: TransitionStatus, reason: str, *, forget: bool = False) -> None:
        t = Transition(at=now, status=status, reason=reason)
        self.values["transitions"] = (self.values["transitions"] + [t])[-HISTORY:]
        self.events.append(LifecycleEvent(self.values["node_id"], t, forget=forget))

    def set_status(self, now: datetime, status: NodeStatus, reason: str) -> None:
        self.values["status"] = status
        self.values["since"] = now
        self.record_transition(now, status, reason)

    def freeze(self) -> NodeState:
        values = {k: self.values[k] for k in _FIELDS}
        values["transitions"] = tuple(values["transitions"])
        values["toggles"] = tuple(values["toggles"])
        # Every value is already of its field's type (from a validated state,
        # a validated record or request, or a UTC `now` computed here), so the
        # state is built without validating it again: observe runs over every
        # node on every leader step.
        return trusted(NodeState, values)


def observe(
    states: Mapping[str, NodeState],
    records: Mapping[str, NodeRecord],
    alive: Iterable[str],
    drains: Mapping[str, DrainRequest],
    now: datetime,
    timing: TimingSettings,
    flap: FlapSettings,
) -> tuple[dict[str, NodeState], list[LifecycleEvent]]:
    """Advance every node to `now`.

    states:  the stored lifecycle states (from the previous call).
    records: the newest record of each node the registry still has facts for.
    alive:   the nodes whose heartbeat has not expired (see module docstring).
    drains:  the drain requests in force.

    Returns the new states (forgotten nodes are absent) and what changed.
    """
    now = utc(now)
    alive = set(alive)
    grace = timedelta(seconds=timing.drain_grace_s)
    out: dict[str, NodeState] = {}
    events: list[LifecycleEvent] = []
    joined: Transition | None = None

    for node_id in sorted(set(states) | set(records)):
        record = records.get(node_id)
        is_alive = node_id in alive and record is not None
        drain = drains.get(node_id)
        previous = states.get(node_id)

        if previous is None:
            if record is None:
                continue
            if _joins_undrained(is_alive, drain):
                # The common case of a fleet new to this leader: a node's
                # first heartbeat, no drain. It is active from now on, and
                # `_liveness`, `_drain` and `_flap` would leave it so; one
                # transition (frozen, the same for each) serves every node
                # joining at `now`.
                if joined is None:
                    joined = Transition(at=now, status="active", reason="first heartbeat")
                last_seen = utc(record.beat_at) if record.beat_at is not None else None
                out[node_id] = trusted(NodeState, _new_values(node_id, "active", now, record, last_seen=last_seen, transitions=(joined,)))
                events.append(LifecycleEvent(node_id, joined))
                continue
            if is_alive:
                node = _Node(_new_state(node_id, "active", now, record))
                node.record_transition(now, "active", "first heartbeat")
            else:
                # Seen by the registry but never by the lifecycle, and already
                # silent: it went offline when its last beat expired.
                went = _expiry(record) or now
                node = _Node(_new_state(node_id, "offline", went, record))
                node.record_transition(now, "offline", f"no heartbeat since {stamp(record.beat_at, absent='never')}")
        elif is_alive and drain is None and _settled(previous):
            # The common case, by far: an active node beat again and nothing
            # else happened. Its state moves only by its record and last_seen
            # (what the general path below would do, without its copies).
            assert record is not None
            out[node_id] = _beat_again(previous, record)
            continue
        else:
            node = _Node(previous)

        if record is not None:
            node.values["record"] = record
            if record.beat_at is not None and is_alive:
                node.values["last_seen"] = utc(record.beat_at)

        _liveness(node, is_alive, now, timing, grace)
        if node.values.get("_forget"):
            events.extend(node.events)
            continue
        _drain(node, drain, now)
        _flap(node, now, flap)
        out[node_id] = node.freeze()
        events.extend(node.events)
    return out, events


def _new_values(
    node_id: str,
    status: NodeStatus,
    since: datetime,
    record: NodeRecord,
    *,
    last_seen: datetime | None = None,
    transitions: tuple[Transition, ...] = (),
) -> dict[str, Any]:
    """The fields of a node new to the lifecycle (every other one at its
    default), for building it without validating: `node_id` and `record` come
    from a validated record, the times are UTC times computed here."""
    return {
        "node_id": node_id,
        "status": status,
        "since": since,
        "record": record,
        "last_seen": last_seen,
        "toggles": (),
        "held_off_until": None,
        "drain": None,
        "drained": False,
        "transitions": transitions,
    }


def _new_state(node_id: str, status: NodeStatus, since: datetime, record: NodeRecord) -> NodeState:
    return trusted(NodeState, _new_values(node_id, status, since, record))


def _joins_undrained(is_alive: bool, drain: DrainRequest | None) -> bool:
    """A node new to the lifecycle takes the shortcut in `observe` (a name of
    its own so a test can turn the shortcut off and compare)."""
    return is_alive and drain is None


def _settled(state: NodeState) -> bool:
    """Active, never drained, not held off, no toggles to age: while it stays
    alive and undrained, `_liveness`, `_drain` and `_flap` leave it as it is."""
    return state.status == "active" and state.drain is None and not state.drained and not state.toggles and state.held_off_until is None


def _beat_again(state: NodeState, record: NodeRecord) -> NodeState:
    """A settled, alive node's state with its newest record."""
    last_seen = utc(record.beat_at) if record.beat_at is not None else state.last_seen
    if (state.record is record or state.record == record) and state.last_seen == last_seen:
        return state
    return updated(state, {"record": record, "last_seen": last_seen})


def beat_expiry(record: NodeRecord) -> datetime | None:
    """When a node's last beat expires (its beat_at + its timeout_s; None
    when the record does not say): `lapsed_at`'s rule, for a caller that
    keeps each record's expiry."""
    return _expiry(record)


def _expiry(record: NodeRecord) -> datetime | None:
    if record.beat_at is None or record.timeout_s is None:
        return None
    return utc(record.beat_at) + timedelta(seconds=record.timeout_s)


def _toggle(node: _Node, now: datetime) -> None:
    node.values["toggles"] = node.values["toggles"] + [now]


def _liveness(node: _Node, is_alive: bool, now: datetime, timing: TimingSettings, grace: timedelta) -> None:
    status = node["status"]
    since = utc(node["since"])
    if is_alive:
        if status in ("offline", "dead"):
            away = (now - since).total_seconds()
            node.set_status(now, "active", f"heartbeat again after {_fmt(round(away))} {status}")
            _toggle(node, now)
        return
    if status in UP:
        record: NodeRecord | None = node["record"]
        timeout = record.timeout_s if record else None
        relayed = " (relayed path)" if record and record.relayed else ""
        node.set_status(
            now,
            "offline",
            f"no heartbeat for {_fmt(timeout or timing.node_timeout_s)}{relayed}, last seen {stamp(node['last_seen'], absent='never')}: evacuate",
        )
        _toggle(node, now)
    elif status == "offline" and now - since >= grace:
        node.set_status(now, "dead", f"offline for {_fmt(grace.total_seconds())}: garbage-collected")
        node.values["record"] = None
    elif status == "dead" and now - since >= grace:
        node.record_transition(now, "dead", f"dead for {_fmt(grace.total_seconds())}: forgotten", forget=True)
        node.values["_forget"] = True


def _drain(node: _Node, drain: DrainRequest | None, now: datetime) -> None:
    current = node["drain"]
    if drain is None:
        if current is not None:
            node.values["drain"] = None
            node.values["drained"] = False
            node.record_transition(now, "undrain", "drain lifted")
            if node["status"] == "draining":
                node.set_status(now, "active", "undrained")
        return
    if current != drain:
        node.values["drain"] = drain
        node.values["drained"] = False
        node.record_transition(now, "drain", f"{drain.reason} (grace {_fmt(drain.grace_s)})")
    if node["status"] == "active":
        node.set_status(now, "draining", f"{drain.reason}: no new work")
    if not node["drained"] and now >= drain.grace_ends:
        node.values["drained"] = True
        node.record_transition(now, "draining", f"grace of {_fmt(drain.grace_s)} over: work moves off")


def _flap(node: _Node, now: datetime, flap: FlapSettings) -> None:
    window = timedelta(seconds=flap.window_s)
    node.values["toggles"] = [t for t in node["toggles"] if now - utc(t) < window]
    held = node["held_off_until"]
    if held is not None and utc(held) <= now:
        node.values["held_off_until"] = None
        node.record_transition(now, "released", "hold-off over: may take new work")
    if len(node["toggles"]) >= flap.toggles:
        until = now + timedelta(seconds=flap.hold_off_s)
        node.values["held_off_until"] = until
        node.values["toggles"] = []
        node.record_transition(
            now,
            "held_off",
            f"{flap.toggles} toggles within {_fmt(flap.window_s)}: no new work until {utc_stamp(until)}",
        )


def stored_state(state: NodeState) -> NodeState:
    """What a registry that keeps each node's facts beside its state needs to
    store of `state` (`with_facts` puts the rest back): the lifecycle's own
    memory, without the node's record (its facts are that record) and, while
    the node is up, without `last_seen` (then the beat_at of that record). So a
    heartbeat alone changes no stored state: the leader rewrites only the
    states whose lifecycle moved, not every state on every step."""
    record = state.record
    update: dict[str, Any] = {"record": None}
    if state.status in UP and record is not None and record.beat_at is not None and state.last_seen == utc(record.beat_at):
        update["last_seen"] = None
    return updated(state, update)


def with_facts(stored: NodeState, record: NodeRecord | None) -> NodeState:
    """`stored` (a `stored_state`) with the node's newest record: the state
    again. An up node's `last_seen` is that record's beat; a beat newer than the
    state the leader stored (it came after the leader's step) makes it newer
    too, as `observe` would have made it had the leader stepped after it."""
    update: dict[str, Any] = {"record": record}
    if stored.status in UP and stored.last_seen is None and record is not None and record.beat_at is not None:
        update["last_seen"] = utc(record.beat_at)
    return updated(stored, update)


def snapshot_node(state: NodeState) -> SnapshotNode | None:
    """The scheduler's view of one node, or None when nothing is known of its facts."""
    record = state.record
    if record is None:
        return None
    # Built without validating again: every value comes from a validated
    # state or record (the leader builds one per node per step).
    return trusted(
        SnapshotNode,
        {
            "node_id": state.node_id,
            "tier": record.tier,
            "status": state.status,
            "in_flight": record.in_flight,
            "max_concurrent_tasks": record.max_concurrent_tasks,
            "arch": record.arch,
            "labels": dict(record.labels),
            "drained": state.drained,
            "held_off_until": state.held_off_until,
            "last_seen": state.last_seen,
            "max_concurrent_ceiling": record.max_concurrent_ceiling,
            "units": record.units,
            "lowered_limits": record.lowered_limits,
            "services_running": record.services_running,
            "cost": record.cost,
            "tailscale_ip": record.tailscale_ip,
            "hardware": record.hardware,
            "limitations": record.limitations,
            # Ray's tasks: the leader joins them from Ray's state API (ray_tasks.with_ray_view).
            "engine_tasks": 0,
            # Suspicion: the leader marks it (core.scheduling.suspicion.with_suspects).
            "suspected": [],
        },
    )
