"""A TCP proxy in front of an HTTP server that can hold one kind of request.

    python3 held_requests_proxy.py LISTEN_PORT UPSTREAM_PORT SOURCE_ADDRESS REQUEST_LINE_PREFIX STATE_DIR

Listens on 127.0.0.1:LISTEN_PORT and relays each connection to
127.0.0.1:UPSTREAM_PORT, connecting from SOURCE_ADDRESS (so a packet filter
can tell the proxy's own connections from its clients'). Each connection
carries one HTTP/1.x request with a Content-Length body, then the answer.

While STATE_DIR/hold exists, a request whose first line starts with
REQUEST_LINE_PREFIX (e.g. `POST /load `) is read whole, then held: the proxy
writes STATE_DIR/held and waits until `hold` is removed before it forwards
the request, unless STATE_DIR/drop exists by then: the request is dropped
(the connection closed, the server never sees it). Once a held request is
done with, it writes STATE_DIR/released: the server's status line, or
`dropped`. Every other request goes through at once. The crash tests use it to kill a pass while its Caddy
load is in flight (tests/integration/test_crash_consistency.py).
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path


def read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def serve(conn: socket.socket, upstream_port: int, source: str, prefix: bytes, state: Path) -> None:
    with conn:
        request = read_request(conn)
        held = request.startswith(prefix) and (state / "hold").exists()
        if held:
            (state / "held").write_bytes(request)
            while (state / "hold").exists():
                time.sleep(0.02)
            if (state / "drop").exists():
                (state / "released").write_bytes(b"dropped")
                return
        answer = b""
        with socket.create_connection(("127.0.0.1", upstream_port), source_address=(source, 0)) as upstream:
            upstream.sendall(request)
            while chunk := upstream.recv(65536):
                answer += chunk
        if held:
            (state / "released").write_bytes(answer.split(b"\r\n", 1)[0])
        try:
            conn.sendall(answer)
        except OSError:
            pass  # the client is gone (killed while we held its request)


def main() -> None:
    listen_port, upstream_port = int(sys.argv[1]), int(sys.argv[2])
    source, prefix, state = sys.argv[3], sys.argv[4].encode(), Path(sys.argv[5])
    state.mkdir(parents=True, exist_ok=True)
    with socket.create_server(("127.0.0.1", listen_port)) as server:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=serve, args=(conn, upstream_port, source, prefix, state), daemon=True).start()


if __name__ == "__main__":
    main()
