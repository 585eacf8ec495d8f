"""Worker groups: admitting a hook's workers as ephemeral members, and deactivating a group (pure).

Admission (`admit_members`), each leader step, over the live member records:

- a member is admitted only for a group fabric.toml declares (`[groups.<name>]`):
  the declaration in git is what admits it, no operator step; its record's
  group names the group, and the registry's key proves it (etcd: only the
  group's identity may write P/members/<group>/);
- its tier, labels, limits and cost are the group's, never what the member
  reports (its probe's tier is ignored);
- at most the group's `max_members` at once, the earliest joined first (then
  by name); the rest are refused with the reason;
- an expired record (the worker stopped) is gone; a name of a declared host
  is refused (a member never speaks for a host); a deactivated group's
  members are refused until its hook runs again.

Admitted members become nodes of the snapshot and hosts of the desired state
the leader schedules over (`with_members`), so they take work by the usual
rules (tier, labels, limits, cost).

Deactivation (`decide_groups`, called by `decide_scaling`), the seed's
"Deactivate BATCH tier if queue empty": a group with admitted members is
deactivated once the queue depth has been 0, and its members have run
nothing, continuously for its `idle_window_s` (a window as every scaling
window: work queued or running restarts it; a group is never deactivated
under work its members still run). A deactivated group's members are refused (they leave the snapshot, and
their work is planned elsewhere), its stop hook runs if it has one, and its
members' records expire once the workers stop. A run of the group's hook (a
new burst) activates it again.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from reconciler.core.desired.model import DesiredState, HostConfig, HostLimits, HostSettings, WorkerGroup
from reconciler.core.live.members import MemberRecord
from reconciler.core.live.models import Snapshot, SnapshotNode
from reconciler.core.timestamps import utc


@dataclass(frozen=True)
class Refusal:
    """A live member record the leader did not admit, and why."""

    node_id: str
    group: str
    reason: str


@dataclass(frozen=True)
class Admission:
    """The members admitted (with their group's settings) and those refused."""

    admitted: tuple[MemberRecord, ...] = ()
    refused: tuple[Refusal, ...] = ()

    def by_group(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for member in self.admitted:
            counts[member.group] = counts.get(member.group, 0) + 1
        return counts


def _joined(record: MemberRecord) -> tuple[datetime, str]:
    first = record.first_seen or record.reported_at
    return (utc(first) if first is not None else datetime.max.replace(tzinfo=UTC), record.node_id)


def _why_not(record: MemberRecord, groups: Mapping[str, WorkerGroup], declared_hosts: Collection[str], deactivated: Collection[str]) -> str | None:
    if record.group not in groups:
        return f"group {record.group!r} is not declared in fabric.toml ([groups.<name>])"
    if record.node_id in declared_hosts:
        return f"{record.node_id!r} is a declared host's name: a member never speaks for a host"
    if record.group in deactivated:
        return f"group {record.group!r} is deactivated (the queue stayed empty); its hook activates it again"
    if record.address is None:
        return "it reports no address to be reached at"
    return None


def admit_members(
    records: Sequence[MemberRecord],
    groups: Mapping[str, WorkerGroup],
    declared_hosts: Collection[str],
    deactivated: Collection[str],
    now: datetime,
) -> Admission:
    """Which live member records join the fleet (see the module docstring)."""
    admitted: list[MemberRecord] = []
    refused: list[Refusal] = []
    seen: set[str] = set()
    counts: dict[str, int] = {}
    for record in sorted((r for r in records if r.live_at(now)), key=_joined):
        if record.node_id in seen:
            refused.append(Refusal(record.node_id, record.group, "another live member record has this name"))
            continue
        seen.add(record.node_id)
        reason = _why_not(record, groups, declared_hosts, deactivated)
        if reason is None and counts.get(record.group, 0) >= groups[record.group].max_members:
            reason = f"group {record.group!r} already has its max_members {groups[record.group].max_members}"
        if reason is not None:
            refused.append(Refusal(record.node_id, record.group, reason))
            continue
        counts[record.group] = counts.get(record.group, 0) + 1
        admitted.append(record)
    return Admission(tuple(sorted(admitted, key=lambda r: r.node_id)), tuple(refused))


def member_node(record: MemberRecord, group: WorkerGroup) -> SnapshotNode:
    """An admitted member as the scheduler sees it: the group's tier, labels,
    limit and cost; its arch from its probe; its load as it reports."""
    facts = record.facts
    return SnapshotNode(
        node_id=record.node_id,
        tier=group.tier,
        status="active",
        in_flight=record.in_flight,
        services_running=record.services_running,
        max_concurrent_tasks=group.max_concurrent_tasks,
        arch=facts.hardware.arch if facts is not None else None,
        labels=dict(group.labels),
        last_seen=record.reported_at,
        units=dict(record.units),
        cost=group.cost,
        tailscale_ip=record.address,
    )


def member_host(record: MemberRecord, group: WorkerGroup) -> HostConfig:
    """The host file a member runs its pass with: the group's settings under its own name."""
    assert record.address is not None
    return HostConfig(
        host=HostSettings(name=record.node_id, roles=["compute"], address=record.address, cost=group.cost),
        labels=dict(group.labels),
        limits=HostLimits(max_concurrent_tasks=group.max_concurrent_tasks),
    )


def with_members(snapshot: Snapshot, desired: DesiredState, admission: Admission) -> tuple[Snapshot, DesiredState]:
    """The snapshot and desired state the leader schedules over: the admitted
    members as nodes and hosts (a node of the same name already in the
    snapshot, a stale beat, gives way)."""
    if not admission.admitted:
        return snapshot, desired
    groups = desired.fleet.groups
    names = {m.node_id for m in admission.admitted}
    nodes = [n for n in snapshot.nodes if n.node_id not in names]
    nodes += [member_node(m, groups[m.group]) for m in admission.admitted]
    hosts = dict(desired.hosts)
    hosts.update({m.node_id: member_host(m, groups[m.group]) for m in admission.admitted})
    return snapshot.model_copy(update={"nodes": nodes}), desired.model_copy(update={"hosts": hosts})


@dataclass(frozen=True)
class GroupDecision:
    """What `decide_groups` decided: the groups to deactivate (with why) and the state to keep."""

    deactivate: tuple[tuple[str, str], ...]
    empty_since: dict[str, datetime]
    deactivated: tuple[str, ...]


def decide_groups(
    groups: Mapping[str, WorkerGroup],
    members: Mapping[str, int],
    queue_depth: int,
    empty_since: Mapping[str, datetime],
    deactivated: Collection[str],
    activated: Collection[str],
    now: datetime,
    busy: Mapping[str, int] | None = None,
) -> GroupDecision:
    """Deactivate a group whose members have had an empty queue, and nothing
    to run (`busy`: the tasks in flight on each group's members), for its
    idle window; a group whose hook runs now (`activated`) is active again."""
    now = utc(now)
    still_off = {g for g in deactivated if g in groups and g not in activated}
    since: dict[str, datetime] = {}
    deactivate: list[tuple[str, str]] = []
    for name in sorted(groups):
        running = (busy or {}).get(name, 0)
        if name in still_off or name in activated or members.get(name, 0) == 0 or queue_depth > 0 or running > 0:
            continue
        start = utc(empty_since[name]) if name in empty_since else now
        held = (now - start).total_seconds()
        if held < groups[name].idle_window_s:
            since[name] = start
            continue
        deactivate.append(
            (name, f"queue empty and its {members[name]} member(s) idle for {held:.0f}s (>= idle_window_s {groups[name].idle_window_s})")
        )
        still_off.add(name)
    return GroupDecision(tuple(deactivate), since, tuple(sorted(still_off)))
