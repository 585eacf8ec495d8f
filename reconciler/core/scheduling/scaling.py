"""Bursts and scaling (self-adapting-compute-fabric.md, "Scaling Mechanisms").

Pure: `decide_scaling` takes the snapshot, the queue depth, the settings, the
time and the leader's small persisted `ScalingState`, and returns the actions
an adapter would carry out plus the next state. Nothing is run here: a cloud
hook's argv is returned, never executed.

Windows are "continuously since": a condition's start time is kept in the
state while it holds and forgotten the moment it does not, so a brief dip
restarts the window. All thresholds come from `[scaling]`:

Burst (horizontal)
    queue depth > queue_high continuously for burst_window_s ->
    1. idle capacity first: every node that takes new work (active, not
       drained, not held off, limit > 0), has nothing in flight and could
       take the queued work gets `activate_idle` (its worker group is brought
       back up); a node is not re-activated within group_interval_s. Queued
       work is lane jobs, which run only on `lane_hosts` (the hosts a lane's
       jobs run on), and replicas deferred for capacity, which an idle node
       with its own limit would already have been given: so only an idle
       lane host or a scaled-down node (activation restores its limit) is
       idle capacity. An idle relay with no lane is not, or it would stand
       between every burst and the cloud hooks for good;
    2. only when there is no idle capacity: each configured cloud hook
       (`scaling.cloud_hooks`, tier -> hook, best tier first) gets
       `run_cloud_hook`, at most one new worker group per tier per
       group_interval_s; a rate-limited tier gets a `hold` saying until when;
    3. no idle capacity and no hook configured: a `hold` (the work stays
       queued - the seed's ENQUEUE).
    Queued work that only a worker group's members could take
    (`waiting_groups`: its labels are the group's) no idle node can take:
    the hooks that start that group run whether or not there is idle
    capacity (paced the same way).
    While the queue stays high this repeats every pass, paced by the limits.
    Cost (issue 32): only the cheapest cost class among the idle nodes is
    activated (`cheapest_idle`: free, then owned, then paid), counting the
    ones activated within group_interval_s that are still idle, so paid
    groups come up only when no cheaper idle capacity is left.

Vertical
    a node's utilization (in_flight / max_concurrent_tasks) >
    scale_up_utilization continuously for scale_up_window_s ->
    `raise_concurrency` by one when max_concurrent_tasks < its ceiling
    (`max_concurrent_ceiling`; none = no headroom), else a scale-out as in
    the burst steps 1-3. Either way the node's window starts again, so the
    next step needs another full window. Hot nodes are visited cheapest
    first, and a paid node's concurrency is not raised while a cheaper node
    taking new work is hot with headroom left (`cheaper_to_raise`): that one
    is raised first; the paid node gets a `hold` and keeps its window.

Worker groups (core.scheduling.groups)
    the members a group's hook started are scaled by the group's rules
    alone (no vertical step, no scale-down of their own): with the queue
    empty and its members running nothing continuously for the group's
    idle_window_s, a group with admitted members gets `deactivate_group` (its members are refused from then on,
    its stop hook runs); a run of a hook that names the group activates it
    again.

Scale down
    a node's utilization < scale_down_utilization continuously for
    scale_down_window_s, and no burst under way (queue depth <= queue_high) ->
    `scale_down` of its worker group, once: the node is remembered as scaled
    down until it is busy again or activated by a burst.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from pydantic import BaseModel, ConfigDict

from reconciler.core.desired.model import COST_RANK, TIER_ORDER, ScalingSettings, Tier, WorkerGroup
from reconciler.core.live.models import Snapshot, SnapshotNode
from reconciler.core.scheduling.groups import decide_groups
from reconciler.core.scheduling.placement import accepts_new_work
from reconciler.core.timestamps import utc, utc_stamp

ActionKind = Literal["activate_idle", "run_cloud_hook", "raise_concurrency", "scale_down", "hold", "deactivate_group"]


class ScalingAction(BaseModel):
    """One decided action, with the reason it was decided."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: ActionKind
    reason: str
    node: str | None = None
    tier: Tier | None = None
    # run_cloud_hook: the hook's command (the engine runs the tier's hook as a transient unit, never a shell string).
    argv: list[str] = []
    # raise_concurrency: the node's new max_concurrent_tasks.
    max_concurrent_tasks: int | None = None
    # run_cloud_hook: the group its workers join (the hook's `group`); deactivate_group: the group.
    group: str | None = None


class ScalingState(BaseModel):
    """What the leader keeps between passes (JSON in the registry)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    # Since when the queue depth has been above queue_high (None: it is not).
    queue_high_since: datetime | None = None
    # node -> since when its utilization has been above / below the thresholds.
    hot_since: dict[str, datetime] = {}
    cold_since: dict[str, datetime] = {}
    # tier -> when its cloud hook was last returned (one group per interval);
    # entries older than the interval are dropped, they pace nothing.
    last_group_at: dict[str, datetime] = {}
    # node -> when it was last activated as idle capacity (same pruning).
    last_activation_at: dict[str, datetime] = {}
    # Nodes whose worker group was scaled down and has not been busy since.
    scaled_down: list[str] = []
    # group -> since when the queue has been empty while it had members (core.scheduling.groups).
    group_empty_since: dict[str, datetime] = {}
    # Groups deactivated (their members refused) until their hook runs again.
    deactivated_groups: list[str] = []
    # group -> its members admitted in this pass (the next pass tells who joined and who left).
    members: dict[str, list[str]] = {}


class ScalingDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    actions: list[ScalingAction]
    state: ScalingState


def _utilization(node: SnapshotNode) -> float | None:
    if node.max_concurrent_tasks <= 0:
        return None
    return node.in_flight / node.max_concurrent_tasks


def _since(previous: datetime | None, now: datetime) -> datetime:
    return utc(previous) if previous is not None else now


def _held_for(since: datetime | None, now: datetime) -> float:
    return (now - since).total_seconds() if since is not None else -1.0


def by_cost(node_ids: Collection[str], nodes: dict[str, SnapshotNode]) -> list[str]:
    """`node_ids` cheapest cost class first, then by id."""
    return sorted(node_ids, key=lambda n: (COST_RANK[nodes[n].cost], n))


def cheapest_idle(idle: Collection[str], nodes: dict[str, SnapshotNode]) -> list[str]:
    """The idle nodes of the cheapest cost class among them (sorted): a burst
    activates free capacity before owned, and owned before paid."""
    if not idle:
        return []
    cheapest = min(COST_RANK[nodes[n].cost] for n in idle)
    return sorted(n for n in idle if COST_RANK[nodes[n].cost] == cheapest)


def cheaper_to_raise(node: SnapshotNode, hot: Collection[str], nodes: dict[str, SnapshotNode], now: datetime) -> list[str]:
    """For a paid node: the cheaper nodes taking new work that are hot and
    whose concurrency can still be raised (they go first); [] otherwise."""
    if node.cost != "paid":
        return []
    return [
        n
        for n in by_cost(hot, nodes)
        if COST_RANK[nodes[n].cost] < COST_RANK[node.cost]
        and accepts_new_work(nodes[n], now)
        and nodes[n].max_concurrent_tasks < (nodes[n].max_concurrent_ceiling or nodes[n].max_concurrent_tasks)
    ]


@dataclass
class _Windows:
    """The state being built for the next pass: open windows and pacing."""

    hot: dict[str, datetime]
    cold: dict[str, datetime]
    queue_high_since: datetime | None
    scaled_down: set[str]
    last_group_at: dict[str, datetime]
    last_activation_at: dict[str, datetime]

    def state(self) -> ScalingState:
        return ScalingState(
            queue_high_since=self.queue_high_since,
            hot_since=self.hot,
            cold_since=self.cold,
            last_group_at=self.last_group_at,
            last_activation_at=self.last_activation_at,
            scaled_down=sorted(self.scaled_down),
        )


def _running(snapshot: Snapshot) -> dict[str, SnapshotNode]:
    running: dict[str, SnapshotNode] = {}
    for node in snapshot.nodes:
        if node.status == "active" and not node.drained:
            running.setdefault(node.node_id, node)
    return running


def _windows(running: dict[str, SnapshotNode], queue_depth: int, settings: ScalingSettings, state: ScalingState, now: datetime) -> _Windows:
    """Keep a start time while its condition holds, drop it otherwise; keep
    the pacing marks while they still pace something."""
    interval = timedelta(seconds=settings.group_interval_s)
    hot: dict[str, datetime] = {}
    cold: dict[str, datetime] = {}
    for node_id, node in running.items():
        busy = _utilization(node)
        if busy is None:
            continue
        if busy > settings.scale_up_utilization:
            hot[node_id] = _since(state.hot_since.get(node_id), now)
        if busy < settings.scale_down_utilization:
            cold[node_id] = _since(state.cold_since.get(node_id), now)
    return _Windows(
        hot=hot,
        cold=cold,
        queue_high_since=_since(state.queue_high_since, now) if queue_depth > settings.queue_high else None,
        scaled_down={n for n in state.scaled_down if n in cold},
        last_group_at={tier: utc(at) for tier, at in state.last_group_at.items() if now - utc(at) < interval},
        # Kept while they still pace something, whatever the node did meanwhile
        # (a node that blinks offline and back is not activated again sooner).
        last_activation_at={n: utc(at) for n, at in state.last_activation_at.items() if now - utc(at) < interval},
    )


def _vertical(running: dict[str, SnapshotNode], w: _Windows, settings: ScalingSettings, now: datetime, actions: list[ScalingAction]) -> list[str]:
    """Hot nodes: more concurrency where there is headroom; the reasons to
    scale out for those at their ceiling."""
    scale_out_reasons: list[str] = []
    for node_id in by_cost(list(w.hot), running):
        held = _held_for(w.hot[node_id], now)
        if held < settings.scale_up_window_s:
            continue
        node = running[node_id]
        how_busy = f"{node_id} {node.in_flight}/{node.max_concurrent_tasks} busy for {held:.0f}s (> {settings.scale_up_utilization:.0%})"
        ceiling = node.max_concurrent_ceiling or node.max_concurrent_tasks
        first = cheaper_to_raise(node, w.hot, running, now)
        if first and node.max_concurrent_tasks < ceiling:
            actions.append(ScalingAction(kind="hold", node=node_id, tier=node.tier, reason=f"{how_busy}; paid: {', '.join(first)} raised first"))
            continue  # its window stays: raised once no cheaper node can be
        if node.max_concurrent_tasks < ceiling:
            actions.append(
                ScalingAction(
                    kind="raise_concurrency",
                    node=node_id,
                    tier=node.tier,
                    max_concurrent_tasks=node.max_concurrent_tasks + 1,
                    reason=f"{how_busy}; ceiling {ceiling} leaves headroom",
                )
            )
        else:
            scale_out_reasons.append(f"{how_busy} and at its ceiling {ceiling}")
        w.hot[node_id] = now  # the next step needs another full window
    return scale_out_reasons


def _activate_idle(
    idle: list[str], running: dict[str, SnapshotNode], w: _Windows, why: str, interval: timedelta, now: datetime
) -> list[ScalingAction]:
    """Burst step 1: idle capacity first, each node at most once per interval."""
    actions = []
    for node_id in idle:
        last = w.last_activation_at.get(node_id)
        if last is not None and now - last < interval:
            continue
        actions.append(ScalingAction(kind="activate_idle", node=node_id, tier=running[node_id].tier, reason=why))
        w.last_activation_at[node_id] = now
        w.scaled_down.discard(node_id)
        w.cold.pop(node_id, None)
    return actions


def _cloud_hooks(
    w: _Windows, settings: ScalingSettings, why: str, interval: timedelta, now: datetime, tiers: Collection[str] | None = None
) -> list[ScalingAction]:
    """Burst step 2: each configured cloud hook (of `tiers`; None: all), best
    tier first, one group per tier per interval."""
    actions = []
    for tier in sorted(settings.cloud_hooks, key=TIER_ORDER.index):
        if tiers is not None and tier not in tiers:
            continue
        last = w.last_group_at.get(tier)
        if last is not None and now - last < interval:
            actions.append(
                ScalingAction(
                    kind="hold",
                    tier=tier,
                    reason=f"{why}; one {tier} group per {settings.group_interval_s}s: last at {utc_stamp(last)}, next from {utc_stamp(last + interval)}",
                )
            )
            continue
        hook = settings.cloud_hooks[tier]
        actions.append(ScalingAction(kind="run_cloud_hook", tier=tier, argv=list(hook.command), group=hook.group, reason=f"{why}; no idle capacity"))
        w.last_group_at[tier] = now
    return actions


def _scale_out(
    reasons: list[str],
    running: dict[str, SnapshotNode],
    w: _Windows,
    settings: ScalingSettings,
    state: ScalingState,
    lane_hosts: Collection[str] | None,
    now: datetime,
    waiting_groups: Collection[str] = (),
) -> list[ScalingAction]:
    """Horizontal: idle capacity first, else the cloud hooks, else a hold.
    Work that only a worker group's members could take (`waiting_groups`)
    no idle node can: the hooks that start those groups run beside it."""
    why = "; ".join(reasons)
    interval = timedelta(seconds=settings.group_interval_s)
    idle = cheapest_idle(
        [
            node_id
            for node_id, node in running.items()
            if node.in_flight == 0 and accepts_new_work(node, now) and (lane_hosts is None or node_id in lane_hosts or node_id in state.scaled_down)
        ],
        running,
    )
    for_groups = {tier for tier, hook in settings.cloud_hooks.items() if hook.group in waiting_groups}
    if idle:
        activated = _activate_idle(idle, running, w, why, interval, now)
        if not for_groups:
            return activated
        waits = f"{why}; work waits for a member of {', '.join(sorted(waiting_groups))}, which no idle node can be"
        return activated + _cloud_hooks(w, settings, waits, interval, now, tiers=for_groups)
    if not settings.cloud_hooks:
        return [ScalingAction(kind="hold", reason=f"{why}; no idle capacity and no cloud hook configured: work stays queued")]
    return _cloud_hooks(w, settings, why, interval, now)


def _scale_down(running: dict[str, SnapshotNode], w: _Windows, queue_depth: int, settings: ScalingSettings, now: datetime) -> list[ScalingAction]:
    """Scale down groups idle for the whole window, unless a burst is on."""
    if queue_depth > settings.queue_high:
        return []
    actions = []
    for node_id in sorted(w.cold):
        held = _held_for(w.cold[node_id], now)
        if held < settings.scale_down_window_s or node_id in w.scaled_down:
            continue
        node = running[node_id]
        actions.append(
            ScalingAction(
                kind="scale_down",
                node=node_id,
                tier=node.tier,
                reason=(
                    f"{node_id} {node.in_flight}/{node.max_concurrent_tasks} busy for {held:.0f}s "
                    f"(< {settings.scale_down_utilization:.0%}), queue depth {queue_depth}"
                ),
            )
        )
        w.scaled_down.add(node_id)
    return actions


def decide_scaling(
    snapshot: Snapshot,
    queue_depth: int,
    settings: ScalingSettings,
    state: ScalingState,
    now: datetime | None = None,
    lane_hosts: Collection[str] | None = None,
    groups: Mapping[str, WorkerGroup] | None = None,
    members: Mapping[str, Collection[str]] | None = None,
    waiting_groups: Collection[str] = (),
) -> ScalingDecision:
    """The scaling actions for this pass and the state to keep for the next.
    `lane_hosts`: the hosts lane jobs run on (None: every node may take queued work).
    `groups`: the declared worker groups; `members`: each group's admitted
    members (nodes of the snapshot that only the group's rules scale).
    `waiting_groups`: the groups some queued work waits for (only their members could take it)."""
    now = utc(now if now is not None else snapshot.now)
    member_ids = {m for names in (members or {}).values() for m in names}
    running = {n: node for n, node in _running(snapshot).items() if n not in member_ids}
    # 1. Windows: keep a start time while its condition holds, drop it otherwise.
    w = _windows(running, queue_depth, settings, state, now)
    # 2. Vertical: more concurrency where there is headroom, else scale out.
    actions: list[ScalingAction] = []
    scale_out_reasons = _vertical(running, w, settings, now, actions)
    # 3. Horizontal: a sustained burst, or a hot node without headroom.
    burst_for = _held_for(w.queue_high_since, now)
    if burst_for >= settings.burst_window_s:
        scale_out_reasons.insert(0, f"queue depth {queue_depth} > {settings.queue_high} for {burst_for:.0f}s")
    if scale_out_reasons:
        actions += _scale_out(scale_out_reasons, running, w, settings, state, lane_hosts, now, waiting_groups)
    # 4. Scale down groups idle for the whole window, unless a burst is on.
    actions += _scale_down(running, w, queue_depth, settings, now)
    # 5. Worker groups: deactivated once the queue stayed empty for their window.
    activated = {a.group for a in actions if a.kind == "run_cloud_hook" and a.group is not None}
    in_flight = {n.node_id: n.in_flight for n in snapshot.nodes}
    groups_decided = decide_groups(
        groups or {},
        {g: len(names) for g, names in (members or {}).items()},
        queue_depth,
        state.group_empty_since,
        state.deactivated_groups,
        activated,
        now,
        busy={g: sum(in_flight.get(m, 0) for m in names) for g, names in (members or {}).items()},
    )
    actions += [ScalingAction(kind="deactivate_group", group=g, tier=(groups or {})[g].tier, reason=why) for g, why in groups_decided.deactivate]
    kept = w.state().model_copy(
        update={
            "group_empty_since": groups_decided.empty_since,
            "deactivated_groups": list(groups_decided.deactivated),
            "members": {g: sorted(names) for g, names in sorted((members or {}).items()) if names},
        }
    )
    return ScalingDecision(actions=actions, state=kept)
