"""A bootstrap its first boot left pending, started by the first pass after admission.

    line = start_after_admission(tree, state_dir, systemd, audit, declared=..., dry_run=...)

A machine without a host file at its first boot gets a pending bootstrap
(no k3s join: core.install.bootstrap.pending_boot_steps) and a stamp that
says so. Once `fabric admit` has reached it, its first normal pass starts
fabric-bootstrap.service (the decision: core.install.bootstrap.after_admission):
it removes the stamp (the unit's condition skips it while the stamp is there),
records that it asked (BOOTSTRAP_ASKED in the state directory) and queues the
start through the Systemd port without waiting for it: the unit is ordered
before fabric-reconcile.service, runs the declared host's steps (the k3s join
with the labels), writes the complete stamp and queues a pass itself. A start
systemd refuses puts the stamp back (the next full pass tries again). Passes
never start it twice: a bootstrap that fails leaves no stamp and the next
boot runs it; one that leaves the stamp pending again is only reported.
"""

from __future__ import annotations

import json

from reconciler.core.install.bootstrap import BOOTSTRAP_ASKED, BOOTSTRAP_STAMP, LEFT_PENDING, after_admission
from reconciler.core.install.units import BOOTSTRAP_SERVICE
from reconciler.ports import ActivationError, Audit, FileTree, Systemd


def _text(tree: FileTree, path: str) -> str | None:
    data = tree.read(path)
    return None if data is None else data.decode("utf-8", errors="replace")


def start_after_admission(
    tree: FileTree, state_dir: str, systemd: Systemd | None, audit: Audit, *, declared: bool, dry_run: bool = False
) -> tuple[str | None, str | None, bool]:
    """(a line for the pass's actions, a note, whether the next pass must
    look again: a start systemd refused), the first two None or not. `systemd` None:
    the pass activates nothing (--no-activate), so it starts nothing either.
    `dry_run` (fabric plan): what the pass would do, nothing changed."""
    stamp = _text(tree, BOOTSTRAP_STAMP)
    asked_path = f"{state_dir}/{BOOTSTRAP_ASKED}"
    asked = tree.read(asked_path) is not None
    unit_failed = False
    if stamp is None and asked and systemd is not None:
        try:
            unit_failed = systemd.active_state(BOOTSTRAP_SERVICE) == "failed"
        except ActivationError:
            unit_failed = False
    decision = after_admission(stamp=stamp, declared=declared, asked=asked, unit_failed=unit_failed)
    if decision is None:
        return None, None, False
    if not decision.start:
        return None, decision.line, False
    if dry_run:
        return f"would {decision.line}\n", None, False
    if systemd is None:
        return None, f"{BOOTSTRAP_SERVICE} not started: {LEFT_PENDING}, and this pass activates nothing (--no-activate)", False
    assert stamp is not None
    tree.write(asked_path, (json.dumps({"unit": BOOTSTRAP_SERVICE, "reason": LEFT_PENDING, "stamp": stamp}) + "\n").encode())
    tree.remove(BOOTSTRAP_STAMP)
    try:
        systemd.enqueue_start(BOOTSTRAP_SERVICE)
    except ActivationError as exc:
        # Put it back as it was: the next full pass tries again.
        tree.write(BOOTSTRAP_STAMP, stamp.encode())
        tree.remove(asked_path)
        audit.record("start", "failed", unit=BOOTSTRAP_SERVICE, reason=f"{LEFT_PENDING}: {exc}")
        return None, f"{BOOTSTRAP_SERVICE} could not be started ({LEFT_PENDING}): {exc}; the next pass tries again", True
    audit.record("start", "ok", unit=BOOTSTRAP_SERVICE, reason=LEFT_PENDING)
    return f"started {BOOTSTRAP_SERVICE} ({LEFT_PENDING}; not waited for)\n", None, False
