"""Suspected nodes and their hedges (issue 30): routing around a dead node in seconds.

Pure. The node timeout (three missed full heartbeats) still decides when a
node is offline and its work moves; suspicion only *adds* work elsewhere.

- Fast liveness: fabric-watch keeps a short record alive every couple of
  seconds (`Liveness.keep_alive`); the leader reads when each record
  expires (`LivenessRecord`) and remembers the newest expiry it saw per host
  (`remember_liveness`), so a record etcd deleted at its lapse still counts.
- `suspected(nodes, liveness, sources, now)`: an active node is suspected when
  its liveness lapsed and no full heartbeat came since (a host that never
  published one is judged by the node timeout alone), or when two
  independent sources agree (Ray's dead node, tailscale's offline peer).
- `advance_suspects`: the leader's memory of suspected nodes, carried in the
  plan: when each suspicion began and ended, the events for the timeline,
  and flap damping (suspicions count as flaps: [flap] toggles of them within
  window_s hold the node off new work for hold_off_s, its hedges kept).
- `hedging(state, now, window)`: whether a node's hedges stay: while it is
  suspected, for a stable window ([flap] window_s) after it recovered, and
  while it is held off for blinking.
- `hedged_nodes`, `may_hedge`: which placements get a hedge (the scheduler,
  core.scheduling.placement, places them by the usual tier rules): the
  replica of a single-replica service that is not `singleton`.
- `leader_lapse(held, liveness, last_seen, now, min_age_s)`: when a
  candidate takes over a live term at once instead of waiting for it to go
  stale: the leader's host's liveness record lapsed by the rule above (a
  known expiry passed, no full heartbeat since), at least `min_age_s` ago,
  and the leader has not renewed its term since (a leader that renews is
  alive, whatever its host's watcher does). No known expiry (the host never
  kept a record: a fleet without fabric-watch) is no lapse.
- `lapses_of_suspects`: a new term's first step goes on from the last
  plan's suspects: a host suspected for a lapse counts as lapsed at its
  suspicion's start while no record says otherwise (the expiries the old
  leader read are in its memory only, and etcd deletes a lapsed record).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from reconciler.core.desired.model import FlapSettings, Service
from reconciler.core.live.models import FleetPlan, Placement, Snapshot, SnapshotNode, SuspectEvent, SuspectState
from reconciler.core.live.records import LeaderInfo
from reconciler.core.timestamps import utc, utc_stamp

# Events each suspect keeps for the timeline.
HISTORY = 8

# Independent sources (beside the fast liveness) that must agree on a node.
AGREEING_SOURCES = 2

# The first words of a suspicion's reason when the liveness record lapsed.
LAPSE_REASON = "liveness lapsed at"


@dataclass(frozen=True)
class LivenessRecord:
    """One host's fast liveness record as the registry holds it: alive until
    `expires_at` unless fabric-watch keeps it alive (`ttl_s` each time)."""

    host: str
    expires_at: datetime
    ttl_s: float


def remember_liveness(seen: Mapping[str, datetime], records: Sequence[LivenessRecord]) -> dict[str, datetime]:
    """The newest expiry of each host's liveness record: the records read now
    over those remembered (etcd deletes a lapsed record, sqlite keeps it)."""
    newest = dict(seen)
    for record in records:
        at = utc(record.expires_at)
        if record.host not in newest or at > utc(newest[record.host]):
            newest[record.host] = at
    return newest


def next_liveness_lapse(liveness: Mapping[str, datetime], now: datetime) -> datetime | None:
    """When the first liveness record still alive lapses (the leader wakes then)."""
    ahead = [utc(at) for at in liveness.values() if utc(at) > utc(now)]
    return min(ahead, default=None)


def suspected(
    nodes: Sequence[SnapshotNode],
    liveness: Mapping[str, datetime],
    sources: Mapping[str, Mapping[str, str]],
    now: datetime,
) -> dict[str, list[str]]:
    """host -> why it is suspected, for the active nodes suspected now.

    `liveness`: each host's newest liveness expiry (`remember_liveness`);
    `sources`: source name -> {host: what it says} (e.g. "ray" -> {"qfox-1":
    "Ray node dead"}). A lapse counts only while no full heartbeat came after
    it (`SnapshotNode.last_seen`): a host whose pass beats again is alive,
    whatever its watcher does."""
    now = utc(now)
    out: dict[str, list[str]] = {}
    for node in nodes:
        if node.status != "active":
            continue
        reasons: list[str] = []
        lapsed = liveness.get(node.node_id)
        if lapsed is not None and liveness_lapsed(lapsed, node.last_seen, now):
            reasons.append(f"{LAPSE_REASON} {utc_stamp(lapsed)}")
        said = [f"{source}: {words[node.node_id]}" for source, words in sorted(sources.items()) if node.node_id in words]
        if reasons or len(said) >= AGREEING_SOURCES:
            out[node.node_id] = reasons + said
    return out


def liveness_lapsed(expiry: datetime | None, last_seen: datetime | None, now: datetime) -> bool:
    """The lapse rule of `suspected` for one host: its newest known liveness
    expiry has passed and no full heartbeat came after it."""
    if expiry is None or utc(expiry) > utc(now):
        return False
    return last_seen is None or utc(last_seen) < utc(expiry)


def leader_lapse(
    held: LeaderInfo,
    liveness: Mapping[str, datetime],
    last_seen: datetime | None,
    now: datetime,
    min_age_s: float,
) -> datetime | None:
    """When the host of the leader `held` names lapsed, if a candidate may
    take its live term over now; else None.

    `liveness`: each host's newest known liveness expiry (the candidate's
    memory and the registry's records, `remember_liveness`); the leader
    record's own `liveness_until` counts too (what the leader read of its
    host just before its last renewal). The lapse must be `min_age_s` old
    (a live leader wakes at its host's lapse and renews: time for that),
    the term not renewed since the lapse, and no full heartbeat of the host
    since (`last_seen`). A resigned or stale record is the ordinary
    campaign's; a host with no known expiry is never taken as lapsed."""
    now = utc(now)
    if held.resigned or not held.live_at(now) or held.renewed_at is None:
        return None
    known = [utc(t) for t in (liveness.get(held.candidate), held.liveness_until) if t is not None]
    if not known:
        return None
    expiry = max(known)
    if not liveness_lapsed(expiry, last_seen, now - timedelta(seconds=min_age_s)):
        return None
    return expiry if utc(held.renewed_at) < expiry else None


def takeover_due(held: LeaderInfo | None, liveness: Mapping[str, datetime], min_age_s: float) -> datetime | None:
    """When a follower looks again at whether to take `held`'s live term
    over: the known expiry of its host's liveness record plus `min_age_s`
    (None: no live term, or no known expiry)."""
    if held is None or held.resigned or held.renewed_at is None:
        return None
    known = [utc(t) for t in (liveness.get(held.candidate), held.liveness_until) if t is not None]
    return max(known) + timedelta(seconds=min_age_s) if known else None


def lapses_of_suspects(seen: Mapping[str, datetime], suspects: Mapping[str, SuspectState]) -> dict[str, datetime]:
    """`seen` with each host the last plan suspects for a lapse (and still
    suspected) that `seen` knows no expiry of: lapsed at its suspicion's
    start. A record kept alive since shows a newer expiry (`remember_liveness`
    keeps the newest), so the host recovers as usual."""
    out = dict(seen)
    for host, state in suspects.items():
        if host in out or state.since is None or not any(r.startswith(LAPSE_REASON) for r in state.reasons):
            continue
        out[host] = utc(state.since)
    return out


def hedging(state: SuspectState, now: datetime, window_s: float) -> bool:
    """Whether the node's hedges stay: suspected, recovered less than a
    stable window ago, or held off for blinking."""
    now = utc(now)
    if state.since is not None:
        return True
    if state.held_off_until is not None and utc(state.held_off_until) > now:
        return True
    return state.cleared_at is not None and (now - utc(state.cleared_at)).total_seconds() < window_s


def _event(state: SuspectState, at: datetime, kind: str, detail: str) -> list[SuspectEvent]:
    return [*state.events, SuspectEvent(at=at, kind=kind, detail=detail)][-HISTORY:]  # type: ignore[arg-type]


def _suspect(state: SuspectState, reasons: list[str], now: datetime, flap: FlapSettings) -> SuspectState:
    if state.since is not None:
        return state.model_copy(update={"reasons": reasons})
    window = timedelta(seconds=flap.window_s)
    suspicions = [t for t in state.suspicions if now - utc(t) < window] + [now]
    held = state.held_off_until
    events = _event(state, now, "suspicion", "; ".join(reasons))
    if len(suspicions) >= flap.toggles:
        held = now + timedelta(seconds=flap.hold_off_s)
        events = _event(
            state.model_copy(update={"events": events}), now, "suspicion", f"{len(suspicions)} suspicions within {flap.window_s:g} s: held off"
        )
    return state.model_copy(
        update={"since": now, "reasons": reasons, "cleared_at": None, "suspicions": suspicions, "held_off_until": held, "events": events}
    )


def _settle(state: SuspectState, status: str | None, now: datetime, flap: FlapSettings) -> SuspectState | None:
    """A node not suspected now: recovered (its hedges stay a stable
    window), offline at the node timeout (its hedges become its placements:
    nothing is hedged any more), or its memory over (None: nothing hedged,
    no suspicion and no event within the window)."""
    window = timedelta(seconds=flap.window_s)
    if state.since is not None:
        if status in (None, "offline", "dead"):
            words = "the node timeout passed: its hedges are its placements"
            return state.model_copy(
                update={"since": None, "cleared_at": None, "held_off_until": None, "events": _event(state, now, "offline", words)}
            )
        after = f"after {(now - utc(state.since)).total_seconds():.1f} s"
        return state.model_copy(update={"since": None, "cleared_at": now, "events": _event(state, now, "recovery", after)})
    recent = [t for t in state.suspicions if now - utc(t) < window]
    if status in (None, "offline", "dead"):
        state = state.model_copy(update={"cleared_at": None, "held_off_until": None})
    if not recent and not hedging(state, now, flap.window_s) and not any(now - utc(e.at) < window for e in state.events):
        return None
    return state.model_copy(update={"suspicions": recent})


@dataclass(frozen=True)
class SuspectChange:
    """One thing the step changed, to log and show: kind, node, detail."""

    kind: str
    node: str
    detail: str


def advance_suspects(
    previous: Mapping[str, SuspectState],
    now_suspected: Mapping[str, list[str]],
    status: Mapping[str, str],
    now: datetime,
    flap: FlapSettings,
) -> tuple[dict[str, SuspectState], list[SuspectChange]]:
    """The leader's memory of suspects after this step, and what changed.
    `status`: each known node's lifecycle status now."""
    now = utc(now)
    out: dict[str, SuspectState] = {}
    changes: list[SuspectChange] = []
    for node in sorted(set(previous) | set(now_suspected)):
        state = previous.get(node, SuspectState())
        if node in now_suspected:
            after: SuspectState | None = _suspect(state, list(now_suspected[node]), now, flap)
            if state.since is None:
                changes.append(SuspectChange("suspicion", node, "; ".join(now_suspected[node])))
        else:
            after = _settle(state, status.get(node), now, flap)
            if state.since is not None and after is not None:
                changes.append(SuspectChange(after.events[-1].kind, node, after.events[-1].detail))
        if after is not None:
            out[node] = after
    return out, changes


def with_suspects(snapshot: Snapshot, suspects: Mapping[str, SuspectState]) -> Snapshot:
    """The snapshot the leader schedules over: each suspected node marked
    (`SnapshotNode.suspected`: no new work), a node held off for blinking
    held off, and the suspects the scheduler's hedges follow."""
    nodes = []
    for node in snapshot.nodes:
        state = suspects.get(node.node_id)
        if state is None:
            nodes.append(node)
            continue
        update: dict[str, object] = {"suspected": list(state.reasons) if state.since is not None else []}
        if state.held_off_until is not None and (node.held_off_until is None or utc(node.held_off_until) < utc(state.held_off_until)):
            update["held_off_until"] = state.held_off_until
        nodes.append(node.model_copy(update=update))
    return snapshot.model_copy(update={"nodes": nodes, "suspects": dict(suspects)})


def hedged_nodes(snapshot: Snapshot, window_s: float) -> frozenset[str]:
    """The nodes whose placements are hedged in this step's plan."""
    return frozenset(n for n, state in snapshot.suspects.items() if hedging(state, snapshot.now, window_s))


def may_hedge(service: Service) -> bool:
    """A hedge is an extra replica: only of a single-replica service that may run twice."""
    return service.replicas == 1 and not service.singleton


def note_hedges(plan: FleetPlan, before: Sequence[Placement], now: datetime) -> tuple[FleetPlan, list[SuspectChange]]:
    """`plan` with a hedge event on each suspect for each hedge new since
    `before` (the last plan's placements), and those changes."""
    old = {(p.service, p.replica, p.node) for p in before if p.hedge is not None}
    new = [p for p in plan.placements if p.hedge is not None and (p.service, p.replica, p.node) not in old]
    if not new:
        return plan, []
    suspects = dict(plan.suspects)
    changes = []
    for p in new:
        assert p.hedge is not None
        detail = f"{p.service} also placed on {p.node}"
        state = suspects.get(p.hedge)
        if state is not None:
            suspects[p.hedge] = state.model_copy(update={"events": _event(state, utc(now), "hedge", detail)})
        changes.append(SuspectChange("hedge", p.hedge, detail))
    return plan.model_copy(update={"suspects": suspects}), changes
