"""A stub of phaze's agent API: the one call its agent worker makes at start.

phaze's agent_worker (phaze a3fd169, tasks/agent_worker.py `startup`) asks
`GET /api/internal/agent/whoami` with `Authorization: Bearer <token>` and
checks its PHAZE_AGENT_QUEUE against the agent id the token resolves to
(routers/agent_auth.py: a missing or malformed header is 401, an unknown
token 403 `{"detail":"Forbidden"}`; the answer is AgentIdentity:
agent_id, name, scan_roots, created_at). Nothing else is served.

    serve(tokens) -> (server, url)     in this process, on a thread (tests)
    python3 phaze_api_stub.py PORT TOKENS_JSON     ({"<token>": "<agent id>"})

Standard library only. `asked` records the agent ids answered, in order.
"""

from __future__ import annotations

import http.server
import json
import sys
import threading
from collections.abc import Mapping

WHOAMI = "/api/internal/agent/whoami"
CREATED_AT = "2026-11-01T00:00:00+00:00"


def handler(tokens: Mapping[str, str], asked: list[str]) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path != WHOAMI:
                return self._answer(404, {"detail": "Not Found"})
            scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
            if scheme != "Bearer" or not token:
                return self._answer(401, {"detail": "Not authenticated"})
            agent_id = tokens.get(token.strip())
            if agent_id is None:
                return self._answer(403, {"detail": "Forbidden"})
            asked.append(agent_id)
            return self._answer(200, {"agent_id": agent_id, "name": agent_id, "scan_roots": [], "created_at": CREATED_AT})

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


def serve(tokens: Mapping[str, str], host: str = "127.0.0.1", port: int = 0) -> tuple[http.server.ThreadingHTTPServer, str, list[str]]:
    """The stub on a thread: (its server, its base URL, the agent ids it answered). Stop it with server.shutdown()."""
    asked: list[str] = []
    server = http.server.ThreadingHTTPServer((host, port), handler(dict(tokens), asked))
    threading.Thread(target=server.serve_forever, name="phaze-api-stub", daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}", asked


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[0].isdigit():
        print("usage: phaze_api_stub.py PORT TOKENS_JSON", file=sys.stderr)
        return 2
    tokens = json.loads(open(argv[1]).read())
    server = http.server.ThreadingHTTPServer(("0.0.0.0", int(argv[0])), handler(tokens, []))
    print(f"phaze API stub: serving {WHOAMI} on port {argv[0]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
