"""`fabric admit HOST`: the host file a pending machine's report becomes (pure).

The machine's pending report (core.live.pending) is its probe record; the
host file written from it sets only what an operator declares (its name,
roles, tailnet address and name, limits) and writes the probed values as
comments beside them, so the person reviewing the diff sees what the
machine said of itself. The limits are the probe's own, never higher (the
pass bounds declared limits by the probe anyway: core.live.host_limits).
The tier is not pinned: every pass probes it.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from datetime import datetime

from reconciler.core.desired.model import DesiredState, HostFacts, is_name
from reconciler.core.live.pending import PendingRecord, hardware_summary
from reconciler.core.timestamps import utc

ADMIT_ROLES = ("edge", "compute", "control", "fileserver")


class AdmissionRefused(ValueError):
    """Why a machine cannot be admitted as asked (exit 2; nothing written)."""


def _q(value: str) -> str:
    return json.dumps(value)  # a TOML basic string is JSON's for these values


def _comment(text: str) -> str:
    return "# " + "".join(c if c.isprintable() else "?" for c in text)


def _probed_lines(facts: HostFacts) -> list[str]:
    hardware = facts.hardware
    lines = [_comment(f"probed tier: {facts.tier} (not pinned: every pass probes it; [overrides] tier pins it lower)")]
    lines.append(_comment(f"probed hardware: {hardware_summary(hardware)}"))
    for gpu in hardware.gpus:
        vram = f", {gpu.vram_mib} MiB VRAM" if gpu.vram_mib else ""
        node = f", /dev/dri/{gpu.render_node}" if gpu.render_node else ""
        lines.append(_comment(f"probed GPU: {gpu.vendor} {gpu.model} ({gpu.tier}{vram}{node})"))
    for disk in hardware.storage:
        lines.append(_comment(f"probed storage: {disk.name} {disk.type} {disk.size_gib} GiB{' at ' + disk.mount if disk.mount else ''}"))
    if hardware.ffmpeg:
        lines.append(_comment(f"probed encoders: {', '.join(hardware.ffmpeg)}"))
    if hardware.framebuffer is not None:
        lines.append(_comment(f"probed framebuffer: {hardware.framebuffer.device} {hardware.framebuffer.resolution}"))
    for note in facts.limitations.notes:
        lines.append(_comment(f"probed limitation: {note}"))
    return lines


def check_admission(desired: DesiredState, host: str, record: PendingRecord | None, now: datetime) -> PendingRecord:
    """The live pending report of `host`, or AdmissionRefused naming why not."""
    if not is_name(host):
        raise AdmissionRefused(f"{host!r} is not a valid host name (lowercase letters, digits, '-', '_'; at most 63)")
    if host in desired.hosts:
        raise AdmissionRefused(f"{host!r} collides with a declared host (its host file exists): nothing to admit")
    if record is None:
        raise AdmissionRefused(
            f"no pending report of {host!r}: the machine has not reported (its pass runs `fabric reconcile`), or its report expired"
        )
    if not record.live_at(now):
        expired = record.expires_at()
        raise AdmissionRefused(
            f"the pending report of {host!r} expired{' at ' + utc(expired).isoformat() if expired else ''}: the machine stopped reporting"
        )
    address = record.facts.tailscale_ip
    if address is None:
        raise AdmissionRefused(f"the pending report of {host!r} has no tailnet address (is Tailscale up on it?): a host file needs one")
    for name, config in desired.hosts.items():
        if config.host.address == address:
            raise AdmissionRefused(f"{host!r}'s tailnet address {address} collides with host {name!r}'s")
        if record.facts.tailnet_name and config.host.tailnet_name == record.facts.tailnet_name:
            raise AdmissionRefused(f"{host!r}'s tailnet name {record.facts.tailnet_name} collides with host {name!r}'s")
    return record


def host_file_text(record: PendingRecord, roles: Sequence[str], *, admitted_at: datetime) -> str:
    """hosts/<host>.toml from the pending report (probed values as comments)."""
    facts = record.facts
    limits = facts.limitations
    lines = [
        _comment(f"hosts/{record.node_id}.toml: written by `fabric admit {record.node_id}` on {utc(admitted_at).isoformat()}"),
        _comment(f"from its pending report of {utc(record.reported_at).isoformat() if record.reported_at else 'unknown time'}"),
        *_probed_lines(facts),
        "",
        "[host]",
        f"name = {_q(record.node_id)}",
        f"roles = [{', '.join(_q(r) for r in roles)}]",
        f"address = {_q(facts.tailscale_ip or '')}  # probed tailnet address",
    ]
    tailnet = facts.tailnet_name
    if tailnet and "." in tailnet and re.fullmatch(r"[A-Za-z0-9.-]+", tailnet):
        lines.append(f"tailnet_name = {_q(tailnet.rstrip('.'))}  # probed")
    lines += [
        "",
        "[limits]",
        f"max_concurrent_tasks = {max(1, limits.max_concurrent_tasks)}  # probed: {limits.max_concurrent_tasks} (never above the probe)",
        f"max_concurrent_ceiling = {max(1, limits.max_concurrent_ceiling, limits.max_concurrent_tasks)}  # probed: {limits.max_concurrent_ceiling}",
    ]
    return "\n".join(lines) + "\n"


def with_leader_candidate(fleet_text: str, host: str) -> str:
    """fabric.toml's text with `host` added to [fleet] leader_candidates (a
    one-line list, as the example writes it); AdmissionRefused otherwise."""
    pattern = re.compile(r"^(leader_candidates\s*=\s*\[)([^\]\n]*)(\])", re.MULTILINE)
    found = list(pattern.finditer(fleet_text))
    if len(found) != 1:
        raise AdmissionRefused(
            "fabric.toml: fleet.leader_candidates is not a one-line list: add the host there by hand, then admit without --leader-candidate"
        )
    match = found[0]
    inner = match.group(2).strip().rstrip(",")
    listed = f"{inner}, {_q(host)}" if inner else _q(host)
    return fleet_text[: match.start()] + f"{match.group(1)}{listed}{match.group(3)}" + fleet_text[match.end() :]


def unified_diff(path: str, before: str | None, after: str) -> str:
    """The change as `git diff` shows it (a new file from /dev/null)."""
    old = before.splitlines(keepends=True) if before is not None else []
    return "".join(difflib.unified_diff(old, after.splitlines(keepends=True), "/dev/null" if before is None else f"a/{path}", f"b/{path}"))
