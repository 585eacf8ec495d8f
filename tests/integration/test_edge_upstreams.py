"""The edge's Caddy as a source of suspicion (issue 30, item 2), against a
real Caddy running the rendered edge snippet (passive health checks:
fail_duration) in front of real upstream processes killed by PID.

Caddy's admin API (`GET /reverse_proxy/upstreams`) shows each upstream's
remembered failures; fabric-watch's keeper on the edge stores them in a
real sqlite registry (P/edge-upstreams/<edge>), and the leader's rule
(`edge_failing`) reports a host only when every one of its upstreams fails.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest

from reconciler.adapters.caddy import CaddyAdmin
from reconciler.adapters.commands import SubprocessRunner
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.model import EdgeSettings, FlapSettings, TimingSettings
from reconciler.core.render.edge_proxy import proxy_timings
from reconciler.core.scheduling.edge_upstreams import caddy_upstreams, edge_failing, edge_records
from reconciler.core.templating import environment
from reconciler.engine.watch import LivenessKeeper
from tests.conftest import require
from tests.support.clock import FakeClock
from tests.support.harness.caddy import free_port, running_caddy
from tests.support.harness.upstream_process import upstream_process
from tests.support.harness.waiting import deadline_for, wait_until

pytestmark = pytest.mark.integration

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
EDGE = "edge-1"


def edge_caddyfile(admin_address: str, site_port: int, upstreams: list[str]) -> str:
    snippet = (
        environment("text")
        .get_template("fabric.caddy.j2")
        .render(
            host=EDGE,
            sites=[{"service": "svc", "host": f"http://127.0.0.1:{site_port}", "path": "/", "upstreams": upstreams}],
            proxy=proxy_timings(EdgeSettings()),
            status_site="",
        )
    )
    return f"{{\n\tadmin {admin_address}\n\tauto_https off\n}}\n\n{snippet}\n"


def ask(url: str) -> int | None:
    try:
        with _DIRECT.open(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def test_caddys_failed_upstreams_reach_the_registry_and_a_host_counts_only_when_all_of_its_upstreams_fail(tmp_path: Path) -> None:
    require("caddy")
    site = free_port()
    with upstream_process("one", free_port()) as one, upstream_process("two", free_port()) as two:
        with running_caddy(lambda admin: edge_caddyfile(admin, site, [one.address, two.address]), site_port=site) as caddy:
            admin = CaddyAdmin(SubprocessRunner(caddy.env), admin_address=caddy.admin_address)
            clock = FakeClock()
            registry = SqliteRegistry(tmp_path / "r.sqlite", timing=TimingSettings(), flap=FlapSettings(), clock=clock)
            keeper = LivenessKeeper(registry, EDGE, 2.0, 6.0, log=lambda _: None, edge_upstreams=admin.upstreams, clock=clock)
            try:
                wait_until(lambda: ask(f"http://127.0.0.1:{site}/") == 200, what="the site answering")
                listed = {u.address: u for u in caddy_upstreams(admin.upstreams())}
                assert set(listed) == {one.address, two.address} and all(u.fails == 0 for u in listed.values()), listed

                def fails_of(address: str) -> int:
                    return next(u.fails for u in caddy_upstreams(admin.upstreams()) if u.address == address)

                one.kill()
                wait_until(
                    lambda: ask(f"http://127.0.0.1:{site}/") != 0 and fails_of(one.address) > 0,
                    timeout=deadline_for(EdgeSettings().fail_memory_ms / 1000),
                    what="Caddy remembering a failure of the killed upstream",
                )
                assert keeper.step()
                records, problems = edge_records(registry.edge_upstreams(), [EDGE])
                assert problems == [] and len(records) == 1
                stored = {u.address: u.fails for u in records[0].upstreams}
                assert stored[one.address] > 0 and stored[two.address] == 0, stored
                now = datetime.fromtimestamp(clock.now(), UTC)
                # Both upstreams are on one address (loopback): one still answers, so the host does not count.
                assert edge_failing(records, {"loop": "127.0.0.1"}, now, 30) == {}

                two.kill()
                wait_until(
                    # A request with no upstream left may get no answer in time: it still counts at Caddy.
                    lambda: ask(f"http://127.0.0.1:{site}/") != 0 and fails_of(one.address) > 0 and fails_of(two.address) > 0,
                    timeout=deadline_for((EdgeSettings().fail_memory_ms + EdgeSettings().retry_window_ms) / 1000),
                    what="Caddy remembering failures of both upstreams",
                )
                clock.advance(1)
                assert keeper.step()
                records, _ = edge_records(registry.edge_upstreams(), [EDGE])
                now = datetime.fromtimestamp(clock.now(), UTC)
                assert edge_failing(records, {"loop": "127.0.0.1"}, now, 30) == {"loop": f"{EDGE} sees all 2 upstream(s) failing"}
            finally:
                registry.close()
