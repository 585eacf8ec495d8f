"""The status page's HTML, without a browser: self-contained, escaped, phone-ready.

tests/integration/test_status_page.py serves it through Caddy into Chromium.
"""

from __future__ import annotations

import base64
import hashlib
import re
from datetime import UTC, datetime

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import Deferred, FleetPlan, Snapshot, SnapshotLane
from reconciler.core.render.status_site import caddy_site, content_security_policy, status_site_address
from reconciler.core.views.page import render_status_page
from tests.conftest import EXAMPLE_FLEET, REPO

FIXTURES = REPO / "tests" / "fixtures" / "status"
NOW = datetime(2026, 11, 29, 18, 30, tzinfo=UTC)


@pytest.fixture(scope="module")
def desired() -> DesiredState:
    return load_desired(EXAMPLE_FLEET)


@pytest.fixture(scope="module")
def page(desired) -> str:
    snapshot = Snapshot.model_validate_json((FIXTURES / "snapshot.json").read_text())
    plan = FleetPlan.model_validate_json((FIXTURES / "plan.json").read_text())
    return render_status_page(desired, snapshot, plan, snapshot.now)


def test_the_page_is_self_contained(page):
    # No stylesheet link, no image, no URL anywhere: nothing to fetch.
    assert not re.search(r"<(link|img|iframe|object|embed)\b", page, re.I)
    assert not re.search(r"\b(src|href)\s*=", page, re.I)
    assert "://" not in page
    assert "@import" not in page and "url(" not in page
    assert page.count("<style>") == 1
    # One inline script (the age counter), nothing else.
    assert len(re.findall(r"<script\b", page, re.I)) == 1


def test_the_sites_csp_allows_the_pages_one_script_by_its_hash_and_nothing_else(page, desired):
    (script,) = re.findall(r"<script>(.*?)</script>", page, re.S)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()

    assert content_security_policy() == f"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{digest}'"
    assert f'\t\tContent-Security-Policy "{content_security_policy()}"' in caddy_site(desired)


def test_the_page_is_ready_for_a_phone_and_refreshes_every_heartbeat(page, desired):
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in page
    assert f'<meta http-equiv="refresh" content="{desired.fleet.timing.heartbeat_s}">' in page
    # The narrow layout exists: the node table turns into one block per node.
    assert "@media (max-width: 40rem)" in page


def test_cards_come_in_rank_order_and_only_the_offline_lanes_are_greyed(page):
    cards = re.findall(r'<article class="([^"]+)" data-lane="([^"]+)" data-state="([^"]+)"', page)

    # x86-spill's host is held off; lux, the local lane's control host, drained;
    # a1-arm64's host is at capacity (braid#0 and one lane job, limit 2).
    assert cards == [
        ("card full", "a1-arm64", "online"),
        ("card offline", "x86-spill", "offline"),
        ("card offline", "local", "offline"),
    ]
    assert "<span>COMPUTE · a1-arm64</span>" in page
    assert '<div class="rank">RANK 10</div>' in page
    assert '<div class="capacity num">1/2</div>' in page


def test_values_from_the_registry_are_escaped(desired):
    hostile = '<script>alert("x")</script>'
    plan = FleetPlan(
        epoch=2,
        leader="lux",
        created=NOW,
        deferred=[Deferred(service="braid", replica=0, reason=hostile, inadmissible=False)],
    )

    page = render_status_page(desired, Snapshot(now=NOW), plan, NOW)

    assert hostile not in page
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in page


def test_the_capacity_bar_never_overflows_its_card(desired):
    # A lane reporting more in flight than its cap (cap lowered in git mid-flight).
    snapshot = Snapshot(now=NOW, lanes=[SnapshotLane(id="local", in_flight=3)])

    page = render_status_page(desired, snapshot, None, NOW)

    assert '<div class="capacity num">3/1</div>' in page
    assert re.findall(r'style="width: (\d+)%"', page) == ["0", "0", "100"]


def test_without_a_plan_the_page_says_deferred_work_is_unknown(desired):
    page = render_status_page(desired, Snapshot(now=NOW), None, NOW)

    assert page.count("no plan: deferred work unknown") == 2
    assert "no leader" in page


def test_caddy_site_serves_the_status_root_at_the_status_subdomain(desired):
    assert status_site_address(desired) == "status.researchstack.info"
    site = caddy_site(desired)

    lines = site.splitlines()
    # Tailnet only by default (tests/unit/test_edge_tailnet.py, tests/integration/test_caddy.py).
    assert lines[0] == "status.researchstack.info {"
    assert lines[3] == "\troot * /var/lib/fabric/status"
    # The capabilities API next (its own handle: tailnet only), then the page's files.
    assert lines[4:6] == ["\t@capabilities path /api/*", "\thandle @capabilities {"]
    assert "\t\t@outside not remote_ip 100.64.0.0/10 fd7a:115c:a1e0::/48" in lines
    assert lines.index("\tfile_server") > lines.index("\thandle @capabilities {")
    assert '\t\tCache-Control "no-store"' in site
