"""CaddyAdmin against a real Caddy proxying real HTTP traffic on loopback.

Two upstreams answer with their own names; which name comes back through
Caddy's site shows which config Caddy is serving. Last, the status page's site
as the edge renders it, served by a real Caddy in a network namespace and
asked from a tailnet address and from outside the tailnet.
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import jinja2
import pytest

from reconciler.adapters.caddy import CaddyAdmin
from reconciler.adapters.commands import SubprocessRunner
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import EdgeSettings
from reconciler.core.render.artifacts import TEMPLATES_DIR
from reconciler.core.render.edge_proxy import proxy_timings
from reconciler.core.render.status_site import TAILNET_ONLY_ANSWER
from reconciler.core.render.status_site import caddy_site as status_caddy_site
from reconciler.ports import ActivationError
from tests.conftest import EXAMPLE_FLEET, require, require_root
from tests.support.harness.caddy import RunningCaddy, Upstream, caddy_server, caddyfile_for, free_port, http_get, http_upstream
from tests.support.harness.netns import Namespace, network_lab

pytestmark = pytest.mark.integration


@dataclass
class Edge:
    caddy: RunningCaddy
    one: Upstream
    two: Upstream
    admin: CaddyAdmin

    def config_to(self, *upstreams: Upstream) -> str:
        return caddyfile_for(
            admin_address=self.caddy.admin_address,
            site_port=self.caddy.site_port,
            upstreams=[u.address for u in upstreams],
        )

    def served_by(self) -> str:
        return http_get(self.caddy.site_url)


@pytest.fixture
def edge() -> Iterator[Edge]:
    require_root()
    require("caddy")
    with http_upstream("one") as one, http_upstream("two") as two:
        with caddy_server(site_port=free_port(), upstream=one.address) as caddy:
            admin = CaddyAdmin(SubprocessRunner(caddy.env), admin_address=caddy.admin_address)
            yield Edge(caddy, one, two, admin)


def test_reload_switches_real_traffic_between_upstreams(edge: Edge) -> None:
    assert edge.served_by() == "one"

    to_two = edge.config_to(edge.two)
    edge.admin.validate(to_two)
    edge.admin.load(to_two)
    assert edge.served_by() == "two"

    edge.admin.load(edge.config_to(edge.one))
    assert edge.served_by() == "one"


def test_loading_the_same_config_again_keeps_serving(edge: Edge) -> None:
    same = edge.config_to(edge.one)
    edge.admin.load(same)
    edge.admin.load(same)
    assert edge.served_by() == "one"


def test_syntax_error_is_rejected_by_validate_and_load_and_the_old_config_keeps_serving(edge: Edge) -> None:
    broken = edge.config_to(edge.two).replace("reverse_proxy", "reverse_proxi")

    with pytest.raises(ActivationError, match="unrecognized directive: reverse_proxi"):
        edge.admin.validate(broken)
    with pytest.raises(ActivationError, match="unrecognized directive: reverse_proxi"):
        edge.admin.load(broken)

    assert edge.served_by() == "one"


def test_config_listening_on_a_port_another_program_holds_is_refused_before_loading(edge: Edge) -> None:
    # Adapts fine, but one listener could not bind. Caddy 2.6 itself would
    # reject it only half-way (servers already started keep answering beside the
    # old config), so the adapter must catch it before /load: every request
    # afterwards is answered by the old config.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken_port = squatter.getsockname()[1]
        occupied = edge.config_to(edge.two) + f'\nhttp://127.0.0.1:{taken_port} {{\n\tbind 127.0.0.1\n\trespond "squat"\n}}\n'

        with pytest.raises(ActivationError, match=rf"listens on 127\.0\.0\.1:{taken_port}, which is already in use"):
            edge.admin.load(occupied)

    assert {edge.served_by() for _ in range(20)} == {"one"}


def test_config_adding_a_free_listener_loads(edge: Edge) -> None:
    extra_port = free_port()
    with_extra_site = edge.config_to(edge.two) + f'\nhttp://127.0.0.1:{extra_port} {{\n\tbind 127.0.0.1\n\trespond "extra"\n}}\n'
    edge.admin.load(with_extra_site)
    assert edge.served_by() == "two"
    assert http_get(f"http://127.0.0.1:{extra_port}/") == "extra"


def test_config_that_would_move_the_admin_endpoint_is_refused(edge: Edge) -> None:
    elsewhere = edge.config_to(edge.two).replace(edge.caddy.admin_address, f"127.0.0.1:{free_port()}")
    with pytest.raises(ActivationError, match="moves the admin endpoint"):
        edge.admin.load(elsewhere)

    no_admin_option = edge.config_to(edge.two).replace(f"\tadmin {edge.caddy.admin_address}\n", "")
    with pytest.raises(ActivationError, match="moves the admin endpoint .* to localhost:2019"):
        edge.admin.load(no_admin_option)

    assert edge.served_by() == "one"
    assert edge.admin.current_config()["admin"]["listen"] == edge.caddy.admin_address


def test_unreachable_admin_api_is_an_activation_error() -> None:
    require("caddy")
    admin = CaddyAdmin(SubprocessRunner(), admin_address=f"127.0.0.1:{free_port()}", timeout=2)
    with pytest.raises(ActivationError, match="cannot reach the admin API"):
        admin.load("{\n\tadmin off\n}\n")


def test_missing_caddy_program_is_an_activation_error() -> None:
    admin = CaddyAdmin(SubprocessRunner(), caddy="/nonexistent/caddy")
    with pytest.raises(ActivationError, match="not installed"):
        admin.validate("{\n\tauto_https off\n}\n")


def test_rendered_edge_snippet_passes_validate(tmp_path) -> None:
    """templates/fabric.caddy.j2 as the renderer fills it: a routed service with
    retried, passively checked upstreams and one with nowhere to run yet."""
    require("caddy")
    environment = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)), undefined=jinja2.StrictUndefined)
    snippet = environment.get_template("fabric.caddy.j2").render(
        host="racknerd",
        sites=[
            {
                "service": "braid",
                "host": "braid.researchstack.info",
                "path": "/",
                "upstreams": ["100.88.57.96:8080", "100.101.7.21:8080"],
            },
            {"service": "api", "host": "api.researchstack.info", "path": "/v1/", "upstreams": []},
        ],
        proxy=proxy_timings(EdgeSettings()),
        status_site=status_caddy_site(load_desired(EXAMPLE_FLEET)),
    )
    runner = SubprocessRunner({"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_DATA_HOME": str(tmp_path / "data")})
    admin = CaddyAdmin(runner)
    admin.validate(snippet)
    with pytest.raises(ActivationError, match="caddy validate rejected the config"):
        admin.validate(snippet.replace("lb_policy round_robin", "lb_policy round_robn"))


# --------------------------------------------------------------------------
# The status page: tailnet only unless [fleet] status_access = "public"


EDGE_TAILNET = "100.101.7.2"
EDGE_PUBLIC = "203.0.113.2"
PAGE = "<!doctype html><title>fleet</title><p>the fleet's hosts and load</p>\n"


def status_get(client: Namespace, address: str, port: int) -> tuple[int, str]:
    """GET http://status.researchstack.info:PORT/ sent to `address` from `client`: (status, body)."""
    done = client.run(
        "curl", "--silent", "--max-time", "5", "--noproxy", "*", "--resolve", f"status.researchstack.info:{port}:{address}",
        "--write-out", "\n%{http_code}", f"http://status.researchstack.info:{port}/",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    body, _, code = done.stdout.rpartition("\n")
    return int(code), body


def test_the_status_page_is_refused_outside_the_tailnet_unless_public(tmp_path) -> None:
    """The site block render() puts in the edge's snippet (`caddy_site`, the
    example's status.researchstack.info, here on plain HTTP ports): a peer on
    the tailnet (100.101.7.1) reads the page, a client outside it
    (203.0.113.1, whichever of the edge's addresses it asks) gets 403 and
    nothing of the page; the same site with status_access = "public" serves
    it to both."""
    require_root()
    require("caddy", "curl", "ip")
    public_desired = tmp_path / "public"
    shutil.copytree(EXAMPLE_FLEET, public_desired)
    fleet = (public_desired / "fabric.toml").read_text()
    (public_desired / "fabric.toml").write_text(
        fleet.replace('domain = "researchstack.info"\n', 'domain = "researchstack.info"\nstatus_access = "public"\n', 1)
    )
    root = tmp_path / "status"
    root.mkdir()
    (root / "index.html").write_text(PAGE)
    config = tmp_path / "Caddyfile"
    config.write_text(
        "{\n\tadmin off\n\tauto_https off\n}\n\n"
        + status_caddy_site(load_desired(EXAMPLE_FLEET), str(root), address="http://status.researchstack.info:8080")
        + "\n"
        + status_caddy_site(load_desired(public_desired), str(root), address="http://status.researchstack.info:8081")
    )
    home = tmp_path / "home"
    with network_lab() as lab:
        peer, outsider, edge = lab.namespace("peer"), lab.namespace("outsider"), lab.namespace("edge")
        lab.link(peer, "100.101.7.1/24", edge, f"{EDGE_TAILNET}/24", b_name="tailscale0")
        lab.link(outsider, "203.0.113.1/24", edge, f"{EDGE_PUBLIC}/24")
        outsider.check("ip", "route", "add", f"{EDGE_TAILNET}/32", "via", EDGE_PUBLIC)
        edge.spawn(
            "env", f"HOME={home}", f"XDG_CONFIG_HOME={home}/config", f"XDG_DATA_HOME={home}/data",
            "caddy", "run", "--adapter", "caddyfile", "--config", str(config),
        )  # fmt: skip
        edge.wait_listening(8080)
        edge.wait_listening(8081)

        assert status_get(peer, EDGE_TAILNET, 8080) == (200, PAGE)
        for address in (EDGE_PUBLIC, EDGE_TAILNET):
            assert status_get(outsider, address, 8080) == (403, TAILNET_ONLY_ANSWER)
        # status_access = "public": the same page to both.
        assert status_get(peer, EDGE_TAILNET, 8081) == (200, PAGE)
        assert status_get(outsider, EDGE_PUBLIC, 8081) == (200, PAGE)
