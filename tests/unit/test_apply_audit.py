"""The Audit adapter (reconciler.adapters.journal): the native journal protocol
spoken to a datagram socket, decoded back by the protocol's rules, and the
JSON-lines fallback when there is no journal. The same adapter against the
real systemd-journald is in tests/integration/test_audit_journal.py."""

from __future__ import annotations

import io
import json
import socket
import struct
from pathlib import Path

from reconciler.adapters.journal import JournalAudit, encode_field


def decode_native(datagram: bytes) -> dict[str, str]:
    """systemd's native protocol, decoded: FIELD=value\\n, or FIELD\\n<u64 le length><bytes>\\n."""
    fields: dict[str, str] = {}
    i = 0
    while i < len(datagram):
        newline = datagram.index(b"\n", i)
        line = datagram[i:newline]
        if b"=" in line:
            name, _, value = line.partition(b"=")
            fields[name.decode()] = value.decode()
            i = newline + 1
        else:
            (length,) = struct.unpack("<Q", datagram[newline + 1 : newline + 9])
            start = newline + 9
            fields[line.decode()] = datagram[start : start + length].decode()
            assert datagram[start + length : start + length + 1] == b"\n"
            i = start + length + 1
    return fields


def test_entries_reach_the_journal_socket_with_structured_fields(tmp_path: Path) -> None:
    path = str(tmp_path / "journal.socket")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    try:
        stderr = io.StringIO()
        audit = JournalAudit(socket_path=path, stream=stderr)
        assert audit.to_journal
        audit.record("restart", "ok", unit="fabric-socat-qfox-ssh.service", generation="3", hash="ab" * 32, reason="settings changed")
        audit.record("validate", "failed", generation="4", reason="line 1\nline 2")
        first = decode_native(server.recv(65536))
        second = decode_native(server.recv(65536))
        audit.close()
    finally:
        server.close()
    assert first == {
        "MESSAGE": "restart fabric-socat-qfox-ssh.service: ok (generation 3): settings changed",
        "PRIORITY": "6",
        "SYSLOG_IDENTIFIER": "fabric-reconcile",
        "FABRIC_ACTION": "restart",
        "FABRIC_OUTCOME": "ok",
        "FABRIC_UNIT": "fabric-socat-qfox-ssh.service",
        "FABRIC_GENERATION": "3",
        "FABRIC_HASH": "ab" * 32,
        "FABRIC_REASON": "settings changed",
    }
    # A multi-line value goes in the length-prefixed form; failures are errors.
    assert second["FABRIC_REASON"] == "line 1\nline 2" and second["PRIORITY"] == "3"
    assert stderr.getvalue() == ""


def test_without_a_journal_entries_are_json_lines_on_stderr(tmp_path: Path) -> None:
    stderr = io.StringIO()
    audit = JournalAudit(socket_path=str(tmp_path / "absent"), stream=stderr)
    assert not audit.to_journal
    audit.record("write", "ok", file="etc/fabric/fabric.nft", generation="1", hash="cd" * 32, unit="")
    audit.record("noop", "ok")
    lines = [json.loads(line) for line in stderr.getvalue().splitlines()]
    assert lines[0] == {
        "identifier": "fabric-reconcile",
        "action": "write",
        "outcome": "ok",
        "file": "etc/fabric/fabric.nft",
        "generation": "1",
        "hash": "cd" * 32,
        "message": "write etc/fabric/fabric.nft: ok (generation 1)",
    }
    assert lines[1]["action"] == "noop" and "unit" not in lines[1]


def test_a_journal_that_went_away_falls_back_to_stderr(tmp_path: Path) -> None:
    path = str(tmp_path / "journal.socket")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    stderr = io.StringIO()
    audit = JournalAudit(socket_path=path, stream=stderr)
    server.close()
    audit.record("start", "ok", unit="fabric-agent-local.service")
    assert json.loads(stderr.getvalue())["unit"] == "fabric-agent-local.service"


def test_encode_field_forms() -> None:
    assert encode_field("A", "b") == b"A=b\n"
    assert encode_field("A", "b\nc") == b"A\n" + struct.pack("<Q", 3) + b"b\nc\n"
