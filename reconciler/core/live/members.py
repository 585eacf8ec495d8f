"""Group members: the ephemeral workers a cloud hook starts, as the registry holds them (pure).

A worker a hook starts (a GitHub Actions runner, a spot box) has no host
file. It joins as a member of a worker group that fabric.toml declares
(`[groups.<name>]`), with the group's registry identity, which the hook hands
it as a credential file (etcd: the user `fabric-group-<group>`, which may
write only P/members/<group>/; `fabric registry init-auth` makes it). Its
`MemberRecord` says which group and what it is and runs; it is kept alive
while the worker runs (a lease of the node timeout on etcd, a stored
deadline on sqlite) and expires when it stops.

The record carries no authority of its own: the leader admits a member only
for a group declared in git, with the group's tier, labels, limits and cost
(`reconciler.core.scheduling.groups`), and caps the group's member count; a
record whose key names another group than the record is unreadable.
"""

from __future__ import annotations

from pydantic import Field

from reconciler.core.desired.model import HostFacts
from reconciler.core.live.pending import ExpiringReport
from reconciler.core.live.records import MAX_BEAT_TIMEOUT_S, MAX_COUNT, NodeId, PlausibleTime, _Record


class MemberRecord(_Record, ExpiringReport):
    """One member's report: its group, what its probe found, what it runs."""

    node_id: NodeId = Field(description="The member's name (unique in the fleet; never a declared host's).")
    group: NodeId = Field(description="The group it joins (its registry key's group must be the same).")
    address: str | None = Field(None, description="Where the fleet reaches it (its tailnet IP), as it reports it.")
    facts: HostFacts | None = Field(None, description="Its probe record (arch, hardware); its tier is never taken from here.")
    in_flight: int = Field(0, ge=0, le=MAX_COUNT, description="The placed units active there when it reported.")
    services_running: int | None = Field(
        None, ge=0, le=MAX_COUNT, description="The part of in_flight that is the placed service units running there."
    )
    units: dict[str, str] = Field({}, description="The ActiveState of each fabric unit it runs.")
    first_seen: PlausibleTime | None = Field(None, description="When it first reported (kept across its reports); set by the registry.")
    reported_at: PlausibleTime | None = Field(None, description="When it last reported; set by the registry.")
    timeout_s: float | None = Field(None, gt=0, le=MAX_BEAT_TIMEOUT_S, allow_inf_nan=False, description="It expires this long after its last report.")
