"""A real Caddy on loopback, and tiny HTTP upstreams for it to proxy to.

Usage::

    from tests.support.harness.caddy import caddy_server, http_upstream, free_port, http_get

    with http_upstream("one") as one, caddy_server(site_port=free_port(), upstream=one.address) as caddy:
        assert http_get(caddy.site_url) == "one"
        CaddyAdmin(SubprocessRunner(caddy.env), admin_address=caddy.admin_address).load(...)

`caddy_server` writes a Caddyfile (admin API on a free loopback port,
`auto_https off`, XDG/HOME in a temp dir so nothing under the real home is
touched), starts `caddy run`, waits for the admin API and stops Caddy by PID
(SIGTERM, then SIGKILL) on the way out. `caddyfile_for(...)` renders the same
shape of config with another upstream, which is what a reload test loads.

`http_upstream(name)` serves `name` as the body of every GET from a thread in
this process, on a free loopback port; it is shut down on the way out.
"""

from __future__ import annotations

import http.server
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.harness.waiting import stop_process, wait_until


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> str:
    # Straight to loopback, whatever http_proxy the environment has.
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=timeout) as response:
        return response.read().decode()


def caddyfile_for(*, admin_address: str, site_port: int, upstreams: list[str]) -> str:
    """A complete Caddyfile: one site on 127.0.0.1:site_port proxying to `upstreams`."""
    return f"""\
{{
	admin {admin_address}
	auto_https off
}}

http://127.0.0.1:{site_port} {{
	bind 127.0.0.1
	reverse_proxy {" ".join(upstreams)} {{
		lb_policy first
		health_uri /
		health_interval 10s
	}}
}}
"""


@dataclass
class RunningCaddy:
    pid: int
    admin_address: str
    site_port: int
    env: dict[str, str]  # XDG_*/HOME to pass to `caddy validate` and friends
    log_path: Path

    @property
    def site_url(self) -> str:
        return f"http://127.0.0.1:{self.site_port}/"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def running_caddy(config_for: Callable[[str], str], *, stop_timeout: float = 10.0, site_port: int = 0) -> Iterator[RunningCaddy]:
    """A real Caddy with its admin API on a free loopback port; `config_for(admin_address)`
    is its whole Caddyfile. Its HOME and XDG dirs are a temp dir; stopped by PID."""
    work = Path(tempfile.mkdtemp(prefix="fabric-caddy-"))
    env = {
        "HOME": str(work),
        "XDG_CONFIG_HOME": str(work / "config"),
        "XDG_DATA_HOME": str(work / "data"),
    }
    admin_address = f"127.0.0.1:{free_port()}"
    config = work / "Caddyfile"
    config.write_text(config_for(admin_address))
    log_path = work / "caddy.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            ["caddy", "run", "--adapter", "caddyfile", "--config", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )
    try:
        running = RunningCaddy(process.pid, admin_address, site_port, env, log_path)

        def admin_up() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"caddy exited with {process.returncode}: {running.log()[-2000:]}")
            try:
                http_get(f"http://{admin_address}/config/", timeout=1)
                return True
            except OSError:
                return False

        wait_until(admin_up, what="caddy's admin API")
        yield running
    finally:
        stop_process(process, timeout=stop_timeout)
        shutil.rmtree(work, ignore_errors=True)


@contextmanager
def caddy_server(*, site_port: int, upstream: str, stop_timeout: float = 10.0) -> Iterator[RunningCaddy]:
    """`running_caddy` serving one reverse-proxy site on `site_port`."""
    with running_caddy(
        lambda admin: caddyfile_for(admin_address=admin, site_port=site_port, upstreams=[upstream]),
        stop_timeout=stop_timeout,
        site_port=site_port,
    ) as running:
        yield running


@dataclass
class Upstream:
    name: str
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextmanager
def http_upstream(name: str) -> Iterator[Upstream]:
    body = name.encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # keep test output clean
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=f"upstream-{name}", daemon=True)
    thread.start()
    try:
        yield Upstream(name, server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
