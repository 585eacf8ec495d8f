"""The Audit adapter against the real systemd-journald (systemd as PID 1 in a
container): entries sent over the native protocol are found by
`journalctl -t fabric-reconcile` and by field matches."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from reconciler.adapters.journal import JournalAudit
from tests.conftest import require, require_root
from tests.support.harness.systemd import SystemdContainer, systemd_container
from tests.support.harness.waiting import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def container() -> Iterator[SystemdContainer]:
    require_root()
    require("unshare", "nsenter", "chroot", "journalctl")
    with systemd_container() as c:
        started = c.systemctl("start", "systemd-journald.socket", "systemd-journald.service")
        assert started.returncode == 0, started.stderr
        yield c


def test_audit_entries_are_in_the_journal_with_their_fields(container: SystemdContainer) -> None:
    socket_path = str(container.host_path("/run/systemd/journal/socket"))
    audit = JournalAudit(socket_path=socket_path)
    assert audit.to_journal
    audit.record("restart", "ok", unit="fabric-socat-qfox-ssh.service", generation="3", hash="ab" * 32, reason="settings changed")
    audit.record("write", "ok", file="etc/fabric/fabric.nft", generation="3", hash="cd" * 32)
    audit.record("validate", "failed", generation="4", reason="nft check failed:\nline 3: syntax error")
    audit.close()

    def entries(*match: str) -> list[dict[str, str]]:
        out = container.journal("-t", "fabric-reconcile", "-o", "json", *match)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    wait_until(lambda: len(entries()) == 3, what="three fabric-reconcile entries in the journal")
    [restart] = entries("FABRIC_ACTION=restart")
    assert restart["FABRIC_UNIT"] == "fabric-socat-qfox-ssh.service"
    assert restart["FABRIC_GENERATION"] == "3" and restart["FABRIC_HASH"] == "ab" * 32
    assert restart["FABRIC_OUTCOME"] == "ok" and restart["PRIORITY"] == "6"
    assert restart["MESSAGE"] == "restart fabric-socat-qfox-ssh.service: ok (generation 3): settings changed"
    [write] = entries("FABRIC_FILE=etc/fabric/fabric.nft")
    assert write["FABRIC_ACTION"] == "write"
    [failed] = entries("FABRIC_OUTCOME=failed")
    assert failed["FABRIC_REASON"] == "nft check failed:\nline 3: syntax error" and failed["PRIORITY"] == "3"
