"""A group member's pass: a worker a hook started runs the pass with its group's settings as its host file.

    fabric reconcile --host gh-1 --member-of batch --address 100.64.250.40

A machine with no host file whose pass names a worker group
(`--member-of GROUP`, `[groups.<name>]` in fabric.toml) runs the usual pass
with `core.scheduling.groups.member_host` as its host file: the group's
labels, limit and cost, role compute, its own name and `--address`. Its
heartbeat is its member report (`MemberReports.report_member`, under
P/members/<group>/ with the group's registry identity, which may write
nothing else) alive for the node timeout, so it expires when the worker
stops. It reads the plan as any host and renders and activates what the
plan places on it: the leader placed that only after admitting it (the
group declared in git, the group's tier, the member cap). A group not
declared is bad input (exit 2), nothing is reported.

The pass memo is not used (its early stop beats as a host).
"""

from __future__ import annotations

from typing import Any

from reconciler.core.desired.model import DesiredState, FleetConfig, Hardware, HostFacts
from reconciler.core.live.members import MemberRecord
from reconciler.core.live.records import NodeRecord
from reconciler.core.scheduling.groups import member_host
from reconciler.core.scheduling.lifecycle import heartbeat_timeout
from reconciler.ports import PassRegistry


class NotAMember(ValueError):
    """The pass names a group fabric.toml does not declare, or gives no usable address."""


def as_member(desired: DesiredState, host: str, group: str, address: str | None) -> DesiredState:
    """`desired` with `host` declared by its group's settings. Raises NotAMember."""
    declared = desired.fleet.groups.get(group)
    if declared is None:
        known = ", ".join(sorted(desired.fleet.groups)) or "none"
        raise NotAMember(f"{desired.fleet_file}: groups: {group!r} is not a declared group (declared: {known}): this machine cannot join it")
    if address is None:
        raise NotAMember(f"{host} joins group {group!r} without an address: give --address (its tailnet IP)")
    try:
        record = MemberRecord(node_id=host, group=group, address=address)
        config = member_host(record, declared)
    except ValueError as exc:
        raise NotAMember(f"{host} cannot join group {group!r}: {exc}") from None
    return desired.model_copy(update={"hosts": {**desired.hosts, host: config}})


class MemberRegistry:
    """A pass's registry connection for a group member: its beat is its member
    report (the group's identity writes nothing else); everything else as the
    connection it wraps (reads)."""

    def __init__(self, inner: PassRegistry, fleet: FleetConfig, group: str, address: str) -> None:
        self._inner = inner
        self._fleet = fleet
        self._group = group
        self._address = address

    def heartbeat(self, record: NodeRecord, ttl_s: float | None = None) -> NodeRecord:
        ttl = ttl_s if ttl_s is not None else float(heartbeat_timeout(self._fleet.timing, bool(record.relayed)))
        hardware = (
            record.hardware if record.hardware is not None else Hardware(arch=record.arch, cpu_cores=record.cpu_cores, memory_mib=record.memory_mib)
        )
        facts = HostFacts(node_id=record.node_id, k3s_hostname=record.node_id, hardware=hardware, tier=record.tier, tailscale_ip=record.tailscale_ip)
        report = MemberRecord(
            node_id=record.node_id,
            group=self._group,
            address=self._address,
            facts=facts,
            in_flight=record.in_flight,
            services_running=record.services_running,
            units=dict(record.units),
        )
        stored = self._inner.report_member(report, ttl)
        return record.model_copy(update={"beat_at": stored.reported_at, "timeout_s": stored.timeout_s})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
