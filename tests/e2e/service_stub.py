"""The stand-in for one of the example fleet's services in the end-to-end fleet.

The example fleet's services run programs under /opt/researchstack/bin that do
not exist on this machine. The e2e desired state (tests/e2e/fleet.py) replaces
each service's command with this script, so the agent unit the fabric renders
starts a real HTTP server on the service's port. Every GET (the health path
included) answers 200 with `<service id> on <host name>`: a request through
the edge therefore says which service it reached and where it runs.

    python3 service_stub.py SERVICE_ID PORT

Standard library only: it runs under the system python3 with DynamicUser=.
"""

from __future__ import annotations

import http.server
import socket
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: service_stub.py SERVICE_ID PORT", file=sys.stderr)
        return 2
    service_id, port = argv[0], int(argv[1])
    body = f"{service_id} on {socket.gethostname()}\n".encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # the journal would fill with Caddy's health checks

    server = http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler)
    print(f"{service_id}: serving on port {port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
