"""The `Caddy` port: `caddy validate` and the running Caddy's admin API.

validate: `caddy validate --adapter caddyfile --config /dev/stdin`, the
Caddyfile on stdin, through the CommandRunner port: Caddy adapts the text and
provisions every module without starting a listener.

load, in two admin API calls:
1. POST /adapt (Content-Type text/caddyfile): the running Caddy turns the text
   into its JSON config, or says why it cannot (nothing changes yet).
2. POST /load with that JSON. Caddy starts the new config and only then stops
   the old one; if the new one fails (a port already taken, say) Caddy keeps
   the old one serving and answers with an error.
Either error becomes an ActivationError with Caddy's own message. The admin
API is reached with http.client, imported by the first request: a pass that
loads nothing into Caddy (any host but the edge, and the edge when its
snippet did not change) pays for no HTTP client, and a proxy in the
environment never sees the requests.

Between the two steps the adapter checks, and refuses the config if not:
- that it keeps the admin endpoint where it is now: a Caddyfile without the same
  `admin` global option would move it (to localhost:2019 by default) and the
  next pass could no longer reach Caddy;
- that every TCP address it listens on and the running config does not is free.
  Caddy 2.6 does not fully undo a config that fails while starting: servers it
  had already started keep serving on shared listeners beside the old config
  (caddyserver/caddy#7067, #7175), until Caddy is restarted. A port taken by
  another program is the usual cause, so it is caught before /load. This
  assumes Caddy runs in this host's network namespace, as its admin API does.
"""

from __future__ import annotations

import errno
import json
import socket
from typing import Any

from reconciler.ports import ActivationError, CommandRunner

# Where Caddy listens for admin requests when the config does not say.
CADDY_DEFAULT_ADMIN = "localhost:2019"


class CaddyAdmin:
    """`reconciler.ports.Caddy` for the Caddy whose admin API is at `admin_address` (host:port)."""

    def __init__(
        self,
        runner: CommandRunner,
        *,
        admin_address: str = CADDY_DEFAULT_ADMIN,
        caddy: str = "caddy",
        timeout: float = 30.0,
    ) -> None:
        self._runner = runner
        self._admin_address = admin_address
        self._caddy = caddy
        self._timeout = timeout

    def validate(self, caddyfile: str) -> None:
        result = self._runner.run(
            [self._caddy, "validate", "--adapter", "caddyfile", "--config", "/dev/stdin"],
            timeout=self._timeout,
            stdin=caddyfile,
        )
        if result.ok:
            return
        if result.missing or result.timed_out:
            raise ActivationError(f"caddy validate: {result.failure()}")
        raise ActivationError(f"caddy validate rejected the config: {_caddy_error(result.stderr or result.stdout)}")

    def load(self, caddyfile: str) -> None:
        adapted = self._post("/adapt", caddyfile.encode(), "text/caddyfile", "adapt")
        config = adapted.get("result") if isinstance(adapted, dict) else None
        if not isinstance(config, dict):
            raise ActivationError(f"caddy adapt: unexpected answer {str(adapted)[:200]}")
        new_admin = (config.get("admin") or {}).get("listen", CADDY_DEFAULT_ADMIN)
        if not _same_address(new_admin, self._admin_address):
            raise ActivationError(
                f"caddy load: the new config moves the admin endpoint from {self._admin_address} to {new_admin}; "
                f"put `admin {self._admin_address}` in its global options"
            )
        running = self.current_config()
        for address in sorted(_listen_addresses(config) - _listen_addresses(running)):
            problem = _bind_problem(address)
            if problem is not None:
                raise ActivationError(f"caddy load: the new config listens on {address}, which {problem}; not loading it")
        try:
            self._post("/load", json.dumps(config).encode(), "application/json", "load")
        except ActivationError as exc:
            if " start: " in str(exc):
                raise ActivationError(f"{exc} (Caddy 2.6 may keep serving the part of this config it had started until it is restarted)") from exc
            raise

    def upstreams(self) -> Any:
        """Each reverse_proxy upstream with its requests in flight and the
        failures Caddy remembers (GET /reverse_proxy/upstreams: a JSON list
        of {"address", "num_requests", "fails"}; issue 30's edge source)."""
        return self._request("GET", "/reverse_proxy/upstreams", None, None, "read upstreams")

    def current_config(self) -> Any:
        """The JSON config Caddy is running now (GET /config/)."""
        return self._request("GET", "/config/", None, None, "read config")

    def _post(self, path: str, body: bytes, content_type: str, what: str) -> Any:
        return self._request("POST", path, body, content_type, what)

    def _request(self, method: str, path: str, body: bytes | None, content_type: str | None, what: str) -> Any:
        import http.client

        # host:port straight to the admin API: no proxy, no redirects (Caddy's
        # admin API answers or refuses); one request per connection, said so
        # (Connection: close, as urllib sent it), so nothing between waits for more.
        headers = {"Connection": "close"} | ({"Content-Type": content_type} if content_type is not None else {})
        connection = http.client.HTTPConnection(self._admin_address, timeout=self._timeout)
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            payload = response.read()
        except (http.client.HTTPException, OSError) as exc:
            raise ActivationError(f"caddy {what}: cannot reach the admin API at {self._admin_address}: {exc}") from exc
        finally:
            connection.close()
        if not 200 <= response.status < 300:
            raise ActivationError(f"caddy {what} rejected the config: {_caddy_error(payload.decode(errors='replace'))}")
        if not payload.strip():
            return None
        try:
            return json.loads(payload)
        except ValueError as exc:
            raise ActivationError(f"caddy {what}: answer is not JSON: {payload[:200]!r}") from exc


def _caddy_error(text: str) -> str:
    """Caddy's message from its JSON error body or its last log line."""
    text = text.strip()
    for line in reversed(text.splitlines()):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("error"):
            return str(entry["error"])
    lines = text.splitlines()
    return lines[-1] if lines else "no detail given"


def _listen_addresses(config: Any) -> set[str]:
    """Every listen address of the config's HTTP servers."""
    if not isinstance(config, dict):
        return set()
    servers = ((config.get("apps") or {}).get("http") or {}).get("servers") or {}
    return {address for server in servers.values() for address in (server.get("listen") or [])}


def _bind_problem(address: str) -> str | None:
    """Why a TCP listener on a Caddy listen address could not be opened, or None.

    Only plain `[tcp/]host:port` addresses are tried; unix sockets, UDP and port
    ranges are left to Caddy.
    """
    network, _, rest = address.rpartition("/")
    if network not in ("", "tcp", "tcp4", "tcp6"):
        return None
    host, _, port = rest.rpartition(":")
    if not port.isdigit():
        return None
    host = host.strip("[]")
    family = {"tcp4": socket.AF_INET, "tcp6": socket.AF_INET6}.get(network, socket.AF_UNSPEC)
    try:
        candidates = socket.getaddrinfo(host or None, int(port), family, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot be resolved ({exc})"
    # AI_PASSIVE with no host lists the IPv4 and IPv6 wildcard; Caddy (Go) binds
    # the IPv6 one dual-stack, so trying IPv6 first matches what it would do.
    candidates.sort(key=lambda c: c[0] != socket.AF_INET6)
    af, kind, proto, _, sockaddr = candidates[0]
    with socket.socket(af, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Go's listeners do
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "is already in use by another program"
            if exc.errno == errno.EADDRNOTAVAIL:
                return "is not an address of this host"
            return f"cannot be bound ({exc.strerror})"
    return None


def _same_address(a: str, b: str) -> bool:
    def normal(address: str) -> str:
        address = address.removeprefix("tcp/")
        return address.replace("localhost:", "127.0.0.1:") if address.startswith("localhost:") else address

    return normal(a) == normal(b)
