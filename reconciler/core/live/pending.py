"""Pending machines: a machine with the fabric installed and no host file (pure).

Such a machine's pass runs restricted (reconciler.engine.pending): it probes,
reports itself here as *pending* with its whole probe record, renders and
activates nothing, and says what to run. A pending record carries no
authority: it lives apart from the nodes' heartbeats (etcd P/pending/<host>,
sqlite table `pending`), no snapshot, plan, route or secret is ever made from
it, and it expires when the machine stops reporting (a TTL lease on etcd, a
stored deadline on sqlite). `fabric admit HOST` turns it into a host file,
and only the commit of that file makes the machine a host.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from pydantic import Field

from reconciler.core.desired.model import Hardware, HostFacts
from reconciler.core.live.records import MAX_BEAT_TIMEOUT_S, NodeId, PlausibleTime, _Record
from reconciler.core.timestamps import utc

# The status every view gives a pending machine.
PENDING = "pending"


class ExpiringReport:
    """A report that lapses `timeout_s` after the registry stamped it
    (`reported_at`): a pending machine's, a group member's."""

    # The models' own fields (declared for the type checker only: as
    # annotations here, pydantic would take them for fields of this base).
    if TYPE_CHECKING:
        reported_at: datetime | None
        timeout_s: float | None

    def expires_at(self) -> datetime | None:
        if self.reported_at is None or self.timeout_s is None:
            return None
        return utc(self.reported_at) + timedelta(seconds=self.timeout_s)

    def live_at(self, now: datetime) -> bool:
        expiry = self.expires_at()
        return expiry is None or utc(now) < expiry


class PendingRecord(_Record, ExpiringReport):
    """One machine's report that it waits for admission (no authority)."""

    node_id: NodeId = Field(description="The machine's host name (the name its host file will have).")
    facts: HostFacts = Field(description="Its whole probe record (the seed's data model).")
    first_seen: PlausibleTime | None = Field(None, description="When it first reported pending (kept across its reports); set by the registry.")
    reported_at: PlausibleTime | None = Field(None, description="When it last reported; set by the registry.")
    timeout_s: float | None = Field(None, gt=0, le=MAX_BEAT_TIMEOUT_S, allow_inf_nan=False, description="It expires this long after its last report.")


def admission_command(host: str) -> str:
    """The exact command an operator runs in the desired-state checkout."""
    return f"fabric admit {host}"


def waits_note(host: str, tier: str) -> str:
    """What a pending machine's pass says (journal, stderr, `fabric status`)."""
    return (
        f"{host} has no host file: reported pending (probed tier {tier}); it renders and runs nothing until admitted: "
        f"run `{admission_command(host)}` in the desired-state checkout, then push"
    )


def undeclared_note(host: str) -> str:
    """What `fabric status` says on a machine whose host name has no host file."""
    return (
        f"this machine ({host}) has no host file: its passes report it pending and it waits for admission: "
        f"run `{admission_command(host)}` in the desired-state checkout, then push"
    )


def _gib(mib: int) -> str:
    return f"{mib / 1024:.0f} GiB" if mib >= 1024 else f"{mib} MiB"


def hardware_summary(hardware: Hardware) -> str:
    """One line: arch, cores, memory, GPUs, disks, encoders."""
    parts = [hardware.arch or "arch ?"]
    parts.append(f"{hardware.cpu_cores} cores" if hardware.cpu_cores is not None else "cores ?")
    parts.append(_gib(hardware.memory_mib) if hardware.memory_mib is not None else "memory ?")
    for gpu in hardware.gpus:
        vram = f" {_gib(gpu.vram_mib)}" if gpu.vram_mib else ""
        parts.append(f"GPU {gpu.vendor} {gpu.model}{vram}")
    if hardware.storage:
        total = sum(s.size_gib for s in hardware.storage)
        parts.append(f"{len(hardware.storage)} disk{'s' if len(hardware.storage) != 1 else ''} ({total} GiB)")
    if hardware.ffmpeg:
        parts.append(f"{len(hardware.ffmpeg)} encoders")
    if hardware.framebuffer is not None:
        parts.append(f"framebuffer {hardware.framebuffer.resolution}")
    return ", ".join(parts)


def waited_s(record: PendingRecord, now: datetime) -> float:
    """How long the machine has waited for admission (0 when not known)."""
    if record.first_seen is None:
        return 0.0
    return max(0.0, (utc(now) - utc(record.first_seen)).total_seconds())


def waited_text(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def live_pending(records: list[PendingRecord], now: datetime, declared: set[str]) -> list[PendingRecord]:
    """The pending machines to show: not expired, not declared yet (an
    admitted machine's record lapses by itself once it beats as a host)."""
    return sorted((r for r in records if r.live_at(now) and r.node_id not in declared), key=lambda r: r.node_id)
