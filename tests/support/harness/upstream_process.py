"""An HTTP upstream in its own process, for tests that kill and restart one.

Usage::

    from tests.support.harness.upstream_process import upstream_process

    with upstream_process("one", port) as one:
        ...           # answers every request with 200 "one" on 127.0.0.1:port
        one.kill()    # SIGKILL by PID: the port refuses connections at once
        one.start()   # a new process on the same port

Run as a program (`python -m tests.support.harness.upstream_process NAME PORT STATUS`)
it answers every request on 127.0.0.1:PORT with STATUS and NAME as the body
(reading the request's body first) until it is killed. `start()` returns once
the port accepts connections; the context manager stops the process by PID.
"""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.harness.waiting import stop_process, wait_until

_REPOSITORY = Path(__file__).resolve().parents[3]


class UpstreamProcess:
    def __init__(self, name: str, port: int, status: int = 200) -> None:
        self.name = name
        self.port = port
        self.status = status
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, "already running"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.harness.upstream_process", self.name, str(self.port), str(self.status)],
            cwd=_REPOSITORY,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        wait_until(self._accepting, what=f"upstream {self.name} on {self.address}")

    def kill(self) -> None:
        """SIGKILL, as a crash: no graceful close of the connections Caddy holds."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, timeout=5)

    def _accepting(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            stderr = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
            raise AssertionError(f"upstream {self.name} exited with {self.process.returncode}: {stderr[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False


@contextmanager
def upstream_process(name: str, port: int, *, status: int = 200, started: bool = True) -> Iterator[UpstreamProcess]:
    upstream = UpstreamProcess(name, port, status)
    try:
        if started:
            upstream.start()
        yield upstream
    finally:
        upstream.stop()


def _serve(name: str, port: int, status: int) -> None:
    body = name.encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as real upstreams: Caddy pools connections to it

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_PUT = do_DELETE = do_GET  # noqa: N815 (http.server's naming)

        def log_message(self, format: str, *args: object) -> None:
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
