"""The Caddy adapter's requests to the admin API, as they reach a server (a one-shot socket server here).

Real Caddy: tests/integration/test_caddy.py; a proxy that relays one request
per connection and waits for the server to close it:
tests/integration/test_crash_consistency.py.
"""

from __future__ import annotations

import json
import socket
import threading

import pytest

from reconciler.adapters.caddy import CaddyAdmin
from reconciler.ports import ActivationError


class OneAnswer:
    """Accepts one connection, reads one request (head and Content-Length body), answers `answer`, closes."""

    def __init__(self, answer: bytes) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.answer = answer
        self.request = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                body += conn.recv(65536)
            self.request = head + b"\r\n\r\n" + body
            conn.sendall(self.answer)

    def headers(self) -> dict[str, str]:
        self.thread.join(timeout=30)
        lines = self.request.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")[1:]
        return {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}

    def close(self) -> None:
        self.server.close()


def test_each_request_is_one_per_connection_and_says_so() -> None:
    """Connection: close, as urllib sent it: a proxy between the pass and Caddy
    relays one request per connection and waits for the server to close it."""
    config = {"apps": {}}
    server = OneAnswer(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(json.dumps(config)), json.dumps(config).encode())
    )
    try:
        assert CaddyAdmin(None, admin_address=server.address, timeout=30).current_config() == config  # type: ignore[arg-type]
        assert server.request.startswith(b"GET /config/ HTTP/1.1\r\n")
        headers = server.headers()
        assert headers["connection"] == "close" and headers["host"] == server.address
    finally:
        server.close()


def test_a_refusal_carries_caddys_own_message() -> None:
    body = b'{"error":"adapting config using caddyfile: unknown directive: bogus"}'
    server = OneAnswer(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    try:
        with pytest.raises(ActivationError, match="caddy adapt rejected the config: adapting config using caddyfile: unknown directive: bogus"):
            CaddyAdmin(None, admin_address=server.address, timeout=30).load("bogus\n")  # type: ignore[arg-type]
        assert server.request.startswith(b"POST /adapt HTTP/1.1\r\n") and server.request.endswith(b"\r\n\r\nbogus\n")
        assert server.headers()["content-type"] == "text/caddyfile"
    finally:
        server.close()
