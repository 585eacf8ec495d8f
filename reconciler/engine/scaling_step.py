"""The leader's scaling step: queue depth in, `decide_scaling`, its actions carried out.

`reconciler.core.scheduling.scaling.decide_scaling` is pure and only decides; this module is
where the leader loop (the only place scaling actions are executed) carries
them out, through the registry's `LeaderRegistry` role and the CommandRunner / Audit ports.
It imports no adapter: `reconciler.wiring.leader_ports` builds the real ones.

Queue depth (what the burst rule compares with `scaling.queue_high`):

    lane jobs waiting in the registry (enqueued, not yet in a slot)
  + replicas the plan defers for want of capacity (not the inadmissible ones:
    no amount of capacity would place those, so they must not start a burst)

Both are work that exists and has nowhere to run right now, which is what the
seed's "queue_depth > THRESHOLD_HIGH" means; running jobs are not counted (they
have a slot), and lane jobs that are only held by the local spill gate are
(they are waiting for a cloud slot, which is the capacity a burst adds).

What each action does (all registry-held, in the `ScalingRecord`, which only
the leader writes, under its fence):

    raise_concurrency  the node's concurrency override becomes the decided
                       value (checked again against its ceiling); the
                       registry's snapshot reports it as max_concurrent_tasks,
                       so the next plan may place more there.
    scale_down         the node's worker group goes to its minimum: the
                       override becomes max(1, what it runs now: in-flight
                       tasks + the replicas the plan keeps there), so nothing
                       that runs has to move; the node is marked scaled down.
    activate_idle      a scaled-down group is brought back: its override is
                       dropped (its own declared limit again). An idle node
                       that was not scaled down already takes work; that is
                       logged as such. Besides bursts, every scaled-down group
                       is brought back as soon as the plan defers a replica
                       for capacity (a lost node's work needs a home): scaling
                       down never keeps work waiting.
    run_cloud_hook     the tier's hook runs as a transient systemd unit of
                       its own (`core.render.hook_unit`: systemd-run --wait,
                       a dynamic user, no capabilities, only the credentials
                       it names, its own budget as RuntimeMaxSec=) through the
                       HookRunner port, never in the leader's process. The
                       leader waits for it at most its budget, and no more
                       than its share of `hook_budget_s` (it must renew its
                       lease): a hook still running then runs on, bounded by
                       its own budget. How it ended (its unit, exit status,
                       timed out, missing, its last lines of output screened
                       for secrets) is stored per tier and in `recent` (the
                       timeline); all it printed is in its unit's journal.
    hold               logged: why the burst added nothing this pass.

Order: the new record (decided state + overrides) is stored first, fenced by
the leader's term, and only then are hooks run. A leader that lost its fence
gets NotLeader from that write and runs nothing; a leader that dies after the
write but before a hook ran loses one group (the next burst window asks
again), never runs a tier's hook twice within the interval.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from pydantic import ValidationError

from reconciler.core.desired.confinement import DEFAULT_ALLOWED_PREFIXES, allowed, tier_hook_paths
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan, Snapshot, SnapshotNode
from reconciler.core.live.records import HookOutcome, Leadership, QueuedJob, ScalingAudit, ScalingRecord
from reconciler.core.render.hook_unit import HookRun, hook_unit
from reconciler.core.scheduling.groups import Admission
from reconciler.core.scheduling.placement import waits_for_group
from reconciler.core.scheduling.scaling import ScalingAction, ScalingState, decide_scaling
from reconciler.ports import Audit, HookRunner, LaneBroker, LaneBrokerError, LeaderRegistry

# The leader waits for the cloud hooks of one pass this many seconds at most
# (each its share, and never more than its own budget and a grace).
# `engine.leader.candidate_loop` sets it to half the lease TTL: a slow hook
# must not keep the leader from renewing its lease.
HOOK_BUDGET_S = 120.0
# How many carried-out actions the record keeps for `fabric lane status`.
RECENT_ACTIONS = 50


def queue_depth(jobs: Sequence[QueuedJob], plan: FleetPlan | None) -> int:
    """Waiting lane jobs + replicas deferred for capacity (see the module docstring)."""
    waiting = sum(1 for job in jobs if job.waiting)
    deferred = sum(1 for d in plan.deferred if not d.inadmissible) if plan is not None else 0
    return waiting + deferred


def _minimum(node_id: str, snapshot: Snapshot, plan: FleetPlan | None) -> int:
    node = next(n for n in snapshot.nodes if n.node_id == node_id)
    kept = len(plan.services_on(node_id)) if plan is not None else 0
    return max(1, node.in_flight + kept)


@dataclass(frozen=True)
class Carried:
    """What `carry_out` decided: the record to store, the hooks to run, the lines to log."""

    record: ScalingRecord
    hooks: list[ScalingAction]
    lines: list[tuple[ScalingAction, str]]


@dataclass
class _Overrides:
    """The record's overrides as `carry_out` changes them, and what it logs and keeps."""

    concurrency: dict[str, int]
    scaled_down: set[str]
    lines: list[tuple[ScalingAction, str]]
    recent: list[ScalingAudit]


def _raise_concurrency(o: _Overrides, action: ScalingAction, node: SnapshotNode) -> tuple[str, bool]:
    assert action.max_concurrent_tasks is not None
    ceiling = node.max_concurrent_ceiling or node.max_concurrent_tasks
    if action.max_concurrent_tasks > ceiling:
        return f"refused: {action.max_concurrent_tasks} is above {action.node}'s ceiling {ceiling}", False
    o.concurrency[node.node_id] = action.max_concurrent_tasks
    o.scaled_down.discard(node.node_id)
    return f"{node.node_id} max_concurrent_tasks {node.max_concurrent_tasks} -> {action.max_concurrent_tasks}", True


def _scale_down(o: _Overrides, node: SnapshotNode, snapshot: Snapshot, plan: FleetPlan | None) -> str:
    floor = _minimum(node.node_id, snapshot, plan)
    o.scaled_down.add(node.node_id)
    if floor >= node.max_concurrent_tasks:
        return f"{node.node_id} already at its minimum {node.max_concurrent_tasks} (what it runs)"
    o.concurrency[node.node_id] = floor
    return f"{node.node_id} max_concurrent_tasks {node.max_concurrent_tasks} -> {floor} (what it runs)"


def _activate_idle(o: _Overrides, node: SnapshotNode) -> str:
    if node.node_id not in o.scaled_down:
        return f"{node.node_id} is idle and already takes work"
    o.scaled_down.discard(node.node_id)
    o.concurrency.pop(node.node_id, None)
    return f"{node.node_id} scaled-down group back to its own limit"


def _node_action(o: _Overrides, action: ScalingAction, node: SnapshotNode | None, snapshot: Snapshot, plan: FleetPlan | None) -> tuple[str, bool]:
    """What a node's action does to the overrides: its log line, and whether it is kept in `recent`."""
    if node is None:
        # decide_scaling names only nodes of this snapshot; say so rather than guess.
        return f"skipped: {action.node!r} is not in the snapshot", False
    if action.kind == "raise_concurrency":
        return _raise_concurrency(o, action, node)
    if action.kind == "scale_down":
        return _scale_down(o, node, snapshot, plan), True
    return _activate_idle(o, node), True


def _safety_valve(o: _Overrides, nodes: dict[str, SnapshotNode], plan: FleetPlan | None, now: datetime) -> None:
    """Scaling down must never be why work waits. While the plan defers
    replicas for capacity (a node was lost, a service added), every
    scaled-down group gets its own limit back at once, burst or not."""
    waiting = [d for d in plan.deferred if not d.inadmissible] if plan is not None else []
    if not (waiting and o.scaled_down):
        return
    why = f"{len(waiting)} replica(s) deferred for capacity ({', '.join(sorted({d.service for d in waiting}))})"
    for node_id in sorted(o.scaled_down):
        valve = ScalingAction(kind="activate_idle", node=node_id, tier=nodes[node_id].tier, reason=why)
        o.concurrency.pop(node_id, None)
        o.lines.append((valve, f"{node_id} scaled-down group back to its own limit"))
        o.recent.append(ScalingAudit(at=now, kind=valve.kind, reason=why, node=node_id, tier=valve.tier, outcome=o.lines[-1][1]))
    o.scaled_down.clear()


def carry_out(
    record: ScalingRecord,
    actions: Sequence[ScalingAction],
    state: ScalingState,
    snapshot: Snapshot,
    plan: FleetPlan | None,
    *,
    leader: str,
    now: datetime,
    stop_hooks: Collection[str] = (),
) -> Carried:
    """Pure: the overrides after `actions`, which hooks to run (`stop_hooks`:
    the groups that have a stop hook), and what to log."""
    nodes = {n.node_id: n for n in snapshot.nodes}
    # Overrides of nodes the registry no longer knows at all are dropped.
    o = _Overrides(
        concurrency={n: v for n, v in record.concurrency.items() if n in nodes},
        scaled_down={n for n in record.scaled_down if n in nodes},
        lines=[],
        recent=list(record.recent),
    )
    hooks: list[ScalingAction] = []
    for action in actions:
        if action.kind == "run_cloud_hook":
            hooks.append(action)  # logged with its outcome once run
            continue
        if action.kind == "deactivate_group":
            line = f"group {action.group} deactivated: its members are refused until its hook runs again"
            o.lines.append((action, line))
            o.recent.append(ScalingAudit(at=now, kind=action.kind, reason=action.reason, tier=action.tier, node=action.group, outcome=line))
            if action.group is not None and action.group in stop_hooks:
                hooks.append(action)  # the group's stop hook, logged with its outcome once run
            continue
        if action.kind == "hold":
            o.lines.append((action, "held"))  # holds repeat every pass: logged, not kept
            continue
        line, kept = _node_action(o, action, nodes.get(action.node) if action.node else None, snapshot, plan)
        o.lines.append((action, line))
        if kept:
            o.recent.append(ScalingAudit(at=now, kind=action.kind, reason=action.reason, node=action.node, tier=action.tier, outcome=line))
    _safety_valve(o, nodes, plan, now)
    updated = record.model_copy(
        update={
            "state": state.model_dump(mode="json"),
            "concurrency": dict(sorted(o.concurrency.items())),
            "scaled_down": sorted(o.scaled_down),
            "recent": o.recent[-RECENT_ACTIONS:],
            "leader": leader,
            "updated_at": now,
        }
    )
    return Carried(record=updated, hooks=hooks, lines=o.lines)


def membership_audit(before: Mapping[str, Sequence[str]], admission: Admission, now: datetime, refused_before: Collection[str]) -> list[ScalingAudit]:
    """The timeline's entries for the members who joined or left a group
    since the last step, and for each member newly refused (with why)."""
    entries: list[ScalingAudit] = []
    was = {(g, m) for g, names in before.items() for m in names}
    now_in = {(m.group, m.node_id) for m in admission.admitted}
    for group, member in sorted(now_in - was):
        entries.append(
            ScalingAudit(
                at=now,
                kind="member_joined",
                reason=f"group {group} is declared in git",
                node=member,
                tier=group,
                outcome=f"{member} admitted to group {group}",
            )
        )
    for group, member in sorted(was - now_in):
        entries.append(
            ScalingAudit(
                at=now,
                kind="member_left",
                reason="its record expired or it is refused",
                node=member,
                tier=group,
                outcome=f"{member} left group {group}",
            )
        )
    for refusal in admission.refused:
        if refusal.node_id not in refused_before:
            entries.append(
                ScalingAudit(at=now, kind="member_refused", reason=refusal.reason, node=refusal.node_id, tier=refusal.group, outcome="refused")
            )
    return entries


def hook_outcome(run: HookRun, now: datetime) -> HookOutcome:
    return HookOutcome(
        at=now,
        ok=run.ok,
        returncode=run.returncode,
        timed_out=run.end == "timeout",
        missing=run.end == "missing",
        unit=run.unit,
        end=run.end,
        detail=run.detail,
        output=run.output,
    )


def _hook_key(action: ScalingAction) -> str:
    """What a hook's run is stored and named under: its tier, or <group>-stop for a group's stop hook."""
    if action.kind == "deactivate_group":
        return f"{action.group}-stop"
    assert action.tier is not None
    return action.tier


def _same(a: ScalingRecord, b: ScalingRecord) -> bool:
    return a.model_dump(exclude={"updated_at"}) == b.model_dump(exclude={"updated_at"})


@dataclass
class ScalingStep:
    """Run by LeaderLoop.step while it leads, after the plan."""

    registry: LeaderRegistry
    hooks: HookRunner
    log: Callable[[str], None]
    audit: Audit | None = None
    hook_budget_s: float = HOOK_BUDGET_S
    # phaze's broker: its waiting lane jobs count in the queue depth (None: none known).
    lane_broker: LaneBroker | None = None
    # Where a hook's credentials and working directory may lie on this host
    # (its node.toml's [node] allowed_path_prefixes), as for every unit.
    allowed_prefixes: tuple[str, ...] = DEFAULT_ALLOWED_PREFIXES
    # The members refused last step (each refusal enters the timeline once).
    _refused: frozenset[str] = frozenset()

    def _say(self, action: ScalingAction, outcome: str, ok: bool = True) -> None:
        where = action.node or action.group or action.tier or "fleet"
        self.log(f"scaling {action.kind} {where}: {outcome} ({action.reason})")
        if self.audit is not None:
            self.audit.record(f"scaling-{action.kind}", "ok" if ok else "failed", unit=where, reason=f"{outcome}: {action.reason}")

    def run(
        self, leadership: Leadership, desired: DesiredState, snapshot: Snapshot, plan: FleetPlan | None, admission: Admission | None = None
    ) -> list[ScalingAction]:
        """Decide and carry out this pass's scaling; raises NotLeader (nothing run) when the term is over.
        `admission`: the group members the leader admitted this step (core.scheduling.groups)."""
        record = self.registry.scaling_record()
        try:
            state = ScalingState.model_validate(record.state)
        except ValidationError as exc:
            self.log(f"scaling state unreadable, starting afresh: {exc.errors()[0]['msg']}")
            state = ScalingState()
        try:
            waiting = self.lane_broker.jobs() if self.lane_broker is not None else []
        except LaneBrokerError as exc:
            self.log(f"lane queue unreachable, queue depth without lane jobs: {exc}")
            waiting = []
        depth = queue_depth(waiting, plan)
        now = snapshot.now
        lane_hosts = desired.lane_hosts()
        admission = admission or Admission()
        members: dict[str, list[str]] = {}
        for member in admission.admitted:
            members.setdefault(member.group, []).append(member.node_id)
        groups = desired.fleet.groups
        waiting_groups = {g for d in (plan.deferred if plan is not None else []) if (g := waits_for_group(d)) is not None}
        decision = decide_scaling(
            snapshot,
            depth,
            desired.fleet.scaling,
            state,
            now=now,
            lane_hosts=lane_hosts,
            groups=groups,
            members=members,
            waiting_groups=waiting_groups,
        )
        stop_hooks = {name for name, group in groups.items() if group.stop_hook is not None}
        carried = carry_out(record, decision.actions, decision.state, snapshot, plan, leader=leadership.candidate, now=now, stop_hooks=stop_hooks)
        joined = membership_audit(state.members, admission, now, self._refused)
        self._refused = frozenset(r.node_id for r in admission.refused)
        if joined:
            for entry in joined:
                self.log(f"scaling {entry.kind} {entry.node}: {entry.outcome} ({entry.reason})")
            recent_with = [*carried.record.recent, *joined][-RECENT_ACTIONS:]
            carried = replace(carried, record=carried.record.model_copy(update={"recent": recent_with}))
        if not _same(carried.record, record):
            self.registry.store_scaling(leadership, carried.record)  # the fence: NotLeader stops here
        for action, outcome in carried.lines:
            self._say(action, outcome)
        if not carried.hooks:
            return decision.actions

        outcomes = self._run_hooks(carried.hooks, desired, now)
        hooks = dict(carried.record.hooks)
        recent = list(carried.record.recent)
        for action, run in outcomes:
            assert action.tier is not None
            hooks[_hook_key(action)] = hook_outcome(run, now)
            # The registry keeps no command or path: how it ended, its unit, its last lines (screened).
            kind = "run_stop_hook" if action.kind == "deactivate_group" else action.kind
            recent.append(
                ScalingAudit(at=now, kind=kind, reason=action.reason, node=action.group, tier=action.tier, outcome=run.summary(), output=run.output)
            )
        self.registry.store_scaling(leadership, carried.record.model_copy(update={"hooks": hooks, "recent": recent[-RECENT_ACTIONS:]}))
        return decision.actions

    def _run_hooks(self, actions: list[ScalingAction], desired: DesiredState, now: datetime) -> list[tuple[ScalingAction, HookRun]]:
        """Each hook as its own transient unit; the leader waits its share at most.
        A hook that names a path outside this host's allowed prefixes is not run."""
        share = self.hook_budget_s / len(actions)
        runs = []
        for action in actions:
            assert action.tier is not None
            name = _hook_key(action)
            if action.kind == "deactivate_group":
                assert action.group is not None
                hook = desired.fleet.groups[action.group].stop_hook
                assert hook is not None
                key = f"groups.{action.group}.stop_hook"
            else:
                hook, key = desired.fleet.scaling.cloud_hooks[action.tier], ""
            unit = hook_unit(name, hook, now)
            outside = [(key, path) for key, path in tier_hook_paths(name, hook, key=key) if not allowed(path, self.allowed_prefixes)]
            if outside:
                where = ", ".join(f"{key} {path!r}" for key, path in outside)
                run = HookRun(unit.unit, "refused", detail=f"{where} outside {', '.join(self.allowed_prefixes)} ([node] allowed_path_prefixes)")
            else:
                run = self.hooks.run(replace(unit, wait_s=min(unit.wait_s, share)))
            said = run.summary() + (f": {run.detail}" if run.detail else "") + (f"; output: {run.output[-1]}" if run.output else "")
            self._say(action, said, ok=run.ok)
            runs.append((action, run))
        return runs
