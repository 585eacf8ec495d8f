"""The restricted pass of a machine without a host file: report pending, nothing else.

    report = pending_pass(desired, host, probe, connect, audit, note)

A machine with the fabric installed whose host name has no host file in the
(valid) desired state probes itself and reports itself pending, with its
whole probe record, through the `PendingConnection` role (with etcd's auth
on: the joining identity, which may write only P/pending/). It renders,
writes and activates nothing, takes no leader step and reads no plan: a
pending machine is never given work, routes or secrets. It says that it
waits for admission and the exact command to run (journal, stderr). The
report lapses when the machine stops reporting (the node timeout).
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

from reconciler.core.desired.model import DesiredState, HostFacts
from reconciler.core.live.pending import PendingRecord, admission_command, waits_note
from reconciler.core.scheduling.lifecycle import heartbeat_timeout
from reconciler.engine.pass_report import PassReport
from reconciler.ports import Audit, PendingConnection, PendingReports, RegistryError


def report(registry: PendingReports, desired: DesiredState, host: str, facts: HostFacts) -> PendingRecord:
    """Report `host` pending with `facts`, alive for the node timeout; the
    record as stored. Raises ValueError for a name that cannot be a host's
    (nothing sent) and RegistryError."""
    try:
        record = PendingRecord(node_id=host, facts=facts)
    except ValidationError:
        raise ValueError(f"{host!r} cannot be a fabric host's name (lowercase letters, digits, '-', '_')") from None
    return registry.report_pending(record, float(heartbeat_timeout(desired.fleet.timing, bool(facts.tailscale_relayed))))


def pending_pass(
    desired: DesiredState,
    host: str,
    facts: HostFacts,
    connect: Callable[[], PendingConnection],
    audit: Audit,
    note: Callable[[str], None],
) -> PassReport:
    """Report `host` pending with `facts`; the pass's report (outcome
    "pending", or "failed" when the registry cannot take the report,
    "bad-input" for a host name that cannot be a fabric host's)."""
    try:
        registry = connect()
        try:
            stored = report(registry, desired, host, facts)
        finally:
            registry.close()
    except ValueError:
        return PassReport(
            "bad-input",
            stderr=(
                f"{desired.fleet_file}: host {host!r} is not declared, and its name cannot be a fabric host's "
                "(lowercase letters, digits, '-', '_'): give it one (hostnamectl) or use --host NAME",
            ),
        )
    except RegistryError as exc:
        audit.record("pending", "failed", host=host, tier=facts.tier, reason=str(exc))
        return PassReport("failed", stderr=(f"fabric reconcile: {host} has no host file and its pending report failed: {exc}",))
    line = waits_note(host, stored.facts.tier)
    audit.record("pending", "ok", host=host, tier=stored.facts.tier, admit=admission_command(host), reason=line)
    note(line)
    return PassReport("pending", f"pending: {line}\n")
