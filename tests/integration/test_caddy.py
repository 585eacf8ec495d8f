"""CaddyAdmin against a real Caddy proxying real HTTP traffic on loopback.

Two upstreams answer with their own names; which name comes back through
Caddy's site shows which config Caddy is serving.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from reconciler.adapters.caddy import CaddyAdmin
from reconciler.adapters.commands import SubprocessRunner
from reconciler.ports import ActivationError
from tests.conftest import require, require_root
from tests.harness.caddy import RunningCaddy, Upstream, caddy_server, caddyfile_for, free_port, http_get, http_upstream

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


def test_config_that_fails_to_start_is_rolled_back_by_caddy(edge: Edge) -> None:
    # Adapts fine, but its listener cannot bind: Caddy refuses it at /load time.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken_port = squatter.getsockname()[1]
        occupied = edge.config_to(edge.two) + f"\nhttp://127.0.0.1:{taken_port} {{\n\tbind 127.0.0.1\n\trespond \"squat\"\n}}\n"

        with pytest.raises(ActivationError, match="caddy load rejected the config: .*address already in use"):
            edge.admin.load(occupied)

    assert edge.served_by() == "one"


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
