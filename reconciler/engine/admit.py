"""`fabric admit HOST`: a pending machine's report becomes its host file, committed.

    result = admit(request, pending, checkout, now)

Reads the machine's live pending report (the `PendingReads` role), writes
hosts/HOST.toml from it (core.install.admission: the probed values as
comments, the limits no higher than the probe), validates the whole desired
state with that file (and fabric.toml's new candidate) in place before
anything is written (core.desired.load's overlay), and commits exactly those
files to the checkout (the `DesiredCheckout` port; signed when the checkout
requires signed commits), then pushes when asked. Any refusal raises
`AdmissionRefused` (bad input: exit 2) with nothing written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from reconciler.core.desired.load import FLEET_FILE, DesiredStateError, load_desired
from reconciler.core.install.admission import AdmissionRefused, check_admission, host_file_text, unified_diff, with_leader_candidate
from reconciler.core.live.pending import PendingRecord
from reconciler.ports import DesiredCheckout, PendingReads


@dataclass(frozen=True)
class AdmitRequest:
    host: str
    directory: Path  # the desired state's directory (fabric.toml); the checkout's paths are relative to it
    host_dir: str = "hosts/"  # where its host files are: "hosts/", or "" (beside fabric.toml)
    roles: Sequence[str] = ("compute",)
    leader_candidate: bool = False
    push: bool = False
    dry_run: bool = False


@dataclass(frozen=True)
class AdmitResult:
    diff: str
    commit: str | None  # None: --dry-run
    signed: bool
    pushed: str | None


def _find(pending: PendingReads, host: str) -> PendingRecord | None:
    """The host's report among the live ones (expired ones are not listed by the registry)."""
    reports, _ = pending.pending_nodes()
    return next((r for r in reports if r.node_id == host), None)


def admit(request: AdmitRequest, pending: PendingReads, checkout: DesiredCheckout, now: datetime) -> AdmitResult:
    """See the module docstring. Raises AdmissionRefused (nothing written) and
    CheckoutError (git failed; nothing written stays)."""
    try:
        desired = load_desired(request.directory)
    except DesiredStateError as exc:
        raise AdmissionRefused("the desired state does not validate as it is: " + "; ".join(str(p) for p in exc.problems)) from None
    record = check_admission(desired, request.host, _find(pending, request.host), now)
    host_path = f"{request.host_dir}{request.host}.toml"
    for taken in {host_path, f"{request.host}.toml", f"hosts/{request.host}.toml"}:
        if checkout.read(taken) is not None:
            raise AdmissionRefused(f"{taken} exists already: the name collides")
    files = {host_path: host_file_text(record, list(request.roles), admitted_at=now)}
    before: dict[str, str | None] = {host_path: None}
    if request.leader_candidate:
        fleet_text = checkout.read(FLEET_FILE)
        if fleet_text is None:
            raise AdmissionRefused(f"{FLEET_FILE} is not in the checkout")
        files[FLEET_FILE] = with_leader_candidate(fleet_text, request.host)
        before[FLEET_FILE] = fleet_text
    try:
        load_desired(request.directory, overlay={request.directory / path: text for path, text in files.items()})
    except DesiredStateError as exc:
        raise AdmissionRefused(f"the desired state with {host_path} does not validate: " + "; ".join(str(p) for p in exc.problems)) from None
    diff = "".join(unified_diff(path, before[path], text) for path, text in files.items())
    if request.dry_run:
        return AdmitResult(diff, None, False, None)
    why_sign = checkout.signing_required()
    message = f"Admit {request.host} ({record.facts.tier}) from its pending report: {', '.join(request.roles) or 'no roles'}"
    if request.leader_candidate:
        message += ", leader candidate"
    commit = checkout.commit(files, message, sign=why_sign is not None)
    pushed = checkout.push() if request.push else None
    return AdmitResult(diff, commit, why_sign is not None, pushed)
