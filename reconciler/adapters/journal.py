"""Audit to the systemd journal through its native protocol, or JSON lines on stderr.

The native protocol (systemd.journal-fields(7), "Native Journal Protocol"): one
datagram to /run/systemd/journal/socket holding `FIELD=value` lines; a value
that contains a newline is sent as `FIELD\\n`, its length as a 64-bit
little-endian integer, the bytes, `\\n`. No `systemd-cat`, no libsystemd.

Every entry carries SYSLOG_IDENTIFIER=fabric-reconcile and FABRIC_ACTION,
FABRIC_OUTCOME, plus FABRIC_<NAME> for each field given (unit, file,
generation, hash, reason), so
    journalctl -t fabric-reconcile FABRIC_ACTION=restart
shows every restart and why. Without a journal socket (a container, a sandbox
run) the same record goes to stderr as one JSON object per line.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from typing import TextIO

JOURNAL_SOCKET = "/run/systemd/journal/socket"
IDENTIFIER = "fabric-reconcile"

# syslog priorities
_INFO = 6
_ERR = 3


def encode_field(name: str, value: str) -> bytes:
    data = value.encode("utf-8", "replace")
    if b"\n" in data:
        return name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return name.encode() + b"=" + data + b"\n"


def _message(action: str, outcome: str, fields: dict[str, str]) -> str:
    subject = fields.get("unit") or fields.get("file") or ""
    text = f"{action} {subject}".strip() + f": {outcome}"
    if fields.get("generation"):
        text += f" (generation {fields['generation']})"
    if fields.get("reason"):
        text += f": {fields['reason']}"
    return text


class JournalAudit:
    """The Audit port: native journal if its socket exists, else JSON on stderr."""

    def __init__(
        self,
        socket_path: str = JOURNAL_SOCKET,
        stream: TextIO | None = None,
        identifier: str = IDENTIFIER,
    ) -> None:
        self.socket_path = socket_path
        self.stream = stream if stream is not None else sys.stderr
        self.identifier = identifier
        self._socket: socket.socket | None = None
        if os.path.exists(socket_path):
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.connect(socket_path)
                self._socket = sock
            except OSError:
                self._socket = None

    @property
    def to_journal(self) -> bool:
        return self._socket is not None

    def record(self, action: str, outcome: str, **fields: str) -> None:
        present = {k: str(v) for k, v in fields.items() if v not in (None, "")}
        message = _message(action, outcome, present)
        if self._socket is not None:
            payload = b"".join(
                [
                    encode_field("MESSAGE", message),
                    encode_field("PRIORITY", str(_ERR if outcome == "failed" else _INFO)),
                    encode_field("SYSLOG_IDENTIFIER", self.identifier),
                    encode_field("FABRIC_ACTION", action),
                    encode_field("FABRIC_OUTCOME", outcome),
                    *(encode_field(f"FABRIC_{k.upper()}", v) for k, v in sorted(present.items())),
                ]
            )
            try:
                self._socket.send(payload)
                return
            except OSError:
                # journald gone (or the entry too large for a datagram): do not
                # lose the record, write it to stderr instead.
                pass
        entry = {"identifier": self.identifier, "action": action, "outcome": outcome, **present, "message": message}
        self.stream.write(json.dumps(entry, sort_keys=True) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
