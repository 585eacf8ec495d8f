"""The status page as a phone sees it: rendered, served by a real Caddy, read by headless Chromium.

The page is written where the edge host writes it, Caddy serves it with the
site block `caddy_site` suggests (at http://status.researchstack.info:PORT,
resolved to loopback by Chromium's host rules only, so nothing leaves the
machine), and Chromium dumps the DOM it built and takes a screenshot (kept in
the test's tmp dir for a person to look at; its path is printed).

After a node loss the page is built as the edge's pass builds it: from a real
registry (sqlite) of the example fleet, its snapshot and `fleet_history`.
"""

from __future__ import annotations

import html.parser
import os
import re
import signal
import struct
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.live.records import NodeRecord
from reconciler.core.render.status_site import STATUS_FILE, caddy_site, content_security_policy, status_site_address
from reconciler.core.scheduling.placement import schedule
from reconciler.core.views.page import render_status_page
from reconciler.engine.status import fleet_history
from reconciler.wiring import open_registry
from tests.conftest import EXAMPLE_FLEET, REPO, require
from tests.support.clock import FakeClock
from tests.support.harness.caddy import free_port, running_caddy
from tests.support.registry_store import EXAMPLE_HOSTS

pytestmark = pytest.mark.integration

FIXTURES = REPO / "tests" / "fixtures" / "status"
PHONE = (390, 844)


@dataclass
class StatusSite:
    desired: DesiredState
    root: Path
    url: str
    host: str
    port: int

    def publish(self, page: str) -> None:
        """As the edge's pass does: a temp file in the same directory, then rename."""
        temp = self.root / f".{STATUS_FILE}.tmp"
        temp.write_text(page, encoding="utf-8")
        os.replace(temp, self.root / STATUS_FILE)

    def get(self) -> tuple[dict[str, str], str]:
        """Straight from Caddy on loopback, with the site's Host header."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/", headers={"Host": f"{self.host}:{self.port}"})
        with urllib.request.urlopen(request, timeout=5) as response:
            return dict(response.headers), response.read().decode()


@pytest.fixture
def status_site(tmp_path: Path) -> Iterator[StatusSite]:
    require("caddy")
    desired = load_desired(EXAMPLE_FLEET)
    root = tmp_path / "var/lib/fabric/status"
    root.mkdir(parents=True)
    port = free_port()
    host = status_site_address(desired)
    # Loopback plays the tailnet (the page is tailnet only; test_caddy.py asks from outside it).
    site = caddy_site(desired, str(root), address=f"http://{host}:{port}", bind="127.0.0.1", tailnet=("127.0.0.0/8",))
    with running_caddy(lambda admin: f"{{\n\tadmin {admin}\n\tauto_https off\n}}\n\n" + site, site_port=port):
        yield StatusSite(desired, root, f"http://{host}:{port}/", host, port)


def chromium(tmp_path: Path, site: StatusSite, *args: str) -> str:
    """Run headless Chromium once against the site; its stdout. Stopped by PID/process group."""
    require("chromium")
    profile = tmp_path / "chromium-profile"
    argv = [
        "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        # The site's real name, resolved to loopback here and nowhere else.
        f"--host-resolver-rules=MAP {site.host} 127.0.0.1",
        *args,
        site.url,
    ]
    # Its own session, so the renderer and zygote children go with it.
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, text=True)
    try:
        out, err = process.communicate(timeout=90)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    assert process.returncode == 0, f"chromium exited {process.returncode}: {err[-2000:]}"
    return out


class PageReader(html.parser.HTMLParser):
    """The lane cards, node rows, deferred sections, timeline and age of a DOM, as text."""

    def __init__(self) -> None:
        super().__init__()
        self.cards: list[dict[str, str]] = []
        self.nodes: dict[str, list[str]] = {}
        self.sections: dict[str, str] = {}
        self.leader = ""
        self.external: list[str] = []
        self.scripts = 0
        # (data-kind, text) of each timeline entry, top to bottom.
        self.timeline: list[tuple[str, str]] = []
        self.age: dict[str, str] = {}
        self._open: list[tuple[str, dict[str, str], list[str]]] = []
        self._cells: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        for key in ("src", "href"):
            if key in a:
                self.external.append(f"{tag} {key}={a[key]}")
        if tag in ("link", "img", "iframe"):
            self.external.append(tag)
        self.scripts += tag == "script"
        if (
            tag == "article"
            or (tag == "section" and a.get("id", "").startswith("deferred-"))
            or a.get("id") in ("leader", "age")
            or (tag == "li" and "data-kind" in a)
        ):
            self._open.append((tag, a, []))
        if tag == "tr" and "data-node" in a:
            self._cells = []
            self.nodes[a["data-node"]] = self._cells
        if tag == "td" and self._cells is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None and self._cells is not None:
            self._cells.append(" ".join("".join(self._cell).split()))
            self._cell = None
        if tag == "tr":
            self._cells = None
        if self._open and self._open[-1][0] == tag:
            _, a, text = self._open.pop()
            content = " ".join("".join(text).split())
            if tag == "article":
                self.cards.append({"lane": a.get("data-lane", ""), "class": a.get("class", ""), "text": content})
            elif tag == "section":
                self.sections[a["id"]] = content
            elif tag == "li":
                self.timeline.append((a["data-kind"], content))
            elif a.get("id") == "age":
                self.age = {"class": a.get("class", ""), "text": content}
            else:
                self.leader = content

    def handle_data(self, data: str) -> None:
        for _, _, text in self._open:
            text.append(data)
        if self._cell is not None:
            self._cell.append(data)


def read(dom: str) -> PageReader:
    reader = PageReader()
    reader.feed(dom)
    reader.close()
    return reader


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def fixture_inputs() -> tuple[Snapshot, FleetPlan]:
    snapshot = Snapshot.model_validate_json((FIXTURES / "snapshot.json").read_text())
    plan = FleetPlan.model_validate_json((FIXTURES / "plan.json").read_text())
    return snapshot, plan


def test_chromium_on_a_phone_sees_the_cards_nodes_and_deferred_work(status_site, fixture_inputs, tmp_path):
    snapshot, plan = fixture_inputs
    status_site.publish(render_status_page(status_site.desired, snapshot, plan, snapshot.now))

    dom = chromium(tmp_path, status_site, "--dump-dom", f"--window-size={PHONE[0]},{PHONE[1]}")
    page = read(dom)

    assert [(c["lane"], c["text"]) for c in page.cards] == [
        # braid#0 and one lane job fill a1-arm64's limit of 2.
        ("a1-arm64", "● COMPUTE · a1-arm64 RANK 10 1/2 full: host a1-arm64 at capacity"),
        ("x86-spill", "○ COMPUTE · x86-spill RANK 20 0/4 offline host x86-spill held off until 18:38:20 (flapping)"),
        ("local", "○ LOCAL · local RANK 99 0/1 offline host lux drained"),
    ]
    # Greyed: the offline cards alone (x86-spill's host held off, lux, the local lane's control host, drained).
    assert [c["lane"] for c in page.cards if "offline" in c["class"].split()] == ["x86-spill", "local"]
    assert page.leader == "leader lux · plan epoch 7"
    # Its cost class is its host file's: x86-spill is the paid spill box.
    assert page.nodes["x86-spill"][:7] == ["x86-spill", "cpu_ffmpeg", "paid", "active", "1/4 25%", "5s ago", "held off 8m 20s"]
    assert page.nodes["lux"][6] == "draining"
    assert page.nodes["qfox-1"][3] == "not reporting"
    assert page.sections["deferred-waiting"].startswith("Waiting for capacity (1) flac-fft#1 no eligible node")
    assert page.sections["deferred-inadmissible"].startswith("Inadmissible (1) lupine#0 inadmissible: no node in the fleet")
    assert page.external == []
    assert page.scripts == 1

    screenshot = tmp_path / "status-phone.png"
    chromium(tmp_path, status_site, f"--screenshot={screenshot}", f"--window-size={PHONE[0]},{PHONE[1]}")
    assert png_size(screenshot) == PHONE
    # A real picture, not an empty canvas (a blank 390x844 PNG is a few hundred bytes).
    assert screenshot.stat().st_size > 10_000


def test_caddy_serves_the_newest_pass_with_no_store(status_site, fixture_inputs):
    snapshot, plan = fixture_inputs
    status_site.publish(render_status_page(status_site.desired, snapshot, plan, snapshot.now))
    headers, first = status_site.get()

    # Next pass: x86-spill's hold-off is over and lux undrained: their lanes are back.
    back = snapshot.model_copy(update={"nodes": [n.model_copy(update={"held_off_until": None, "drained": False}) for n in snapshot.nodes]})
    status_site.publish(render_status_page(status_site.desired, back, plan, back.now))
    _, second = status_site.get()

    assert headers["Cache-Control"] == "no-store"
    assert headers["Content-Security-Policy"] == content_security_policy()
    assert headers["Content-Security-Policy"].startswith("default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-")
    assert headers["Content-Type"].startswith("text/html")
    assert [c["class"] for c in read(first).cards] == ["card full", "card offline", "card offline"]
    assert [c["class"] for c in read(second).cards] == ["card full", "card", "card"]


# -- after a node loss -------------------------------------------------------

DESKTOP = (1280, 1800)
# What each host of the example fleet reports running (its record's in_flight).
LOAD = {"qfox-1": 3, "a1-arm64": 1, "x86-spill": 1, "lux": 0, "racknerd": 1}
LOWERED = "max_concurrent_tasks 4 lowered to 2 by the probe"


def test_chromium_after_a_node_loss_sees_real_load_the_lanes_reason_and_the_event(status_site, tmp_path):
    desired = status_site.desired
    # Near the reader's clock, so the page's own age counter reads a few seconds.
    clock = FakeClock(start=time.time() - desired.fleet.timing.node_timeout_s - 20)
    registry = open_registry(desired.fleet, clock=clock, sqlite_path=tmp_path / "registry.sqlite")
    lanes = [lane.id for lane in desired.lanes]
    try:

        def beat(*hosts: str) -> None:
            for host in hosts:
                tier, arch, limit = EXAMPLE_HOSTS[host]
                lowered = [LOWERED] if host == "x86-spill" else []
                limit = 2 if host == "x86-spill" else limit
                registry.heartbeat(
                    NodeRecord(node_id=host, tier=tier, arch=arch, max_concurrent_tasks=limit, in_flight=LOAD[host], lowered_limits=lowered)
                )

        beat(*EXAMPLE_HOSTS)
        leadership = registry.campaign("lux", ttl_s=3600)
        assert leadership is not None
        registry.advance_lifecycle(leadership)
        plan = registry.publish_plan(leadership, schedule(registry.snapshot(lanes), desired, leader="lux"))

        # a1-arm64's host goes silent; the others beat on past its node timeout.
        clock.advance(desired.fleet.timing.node_timeout_s + 10)
        beat(*(h for h in EXAMPLE_HOSTS if h != "a1-arm64"))
        registry.advance_lifecycle(leadership)
        snapshot = registry.snapshot(lanes)
        history = fleet_history(registry)
    finally:
        registry.close()
    (lost,) = [s for s in history.nodes if s.node_id == "a1-arm64"]
    assert lost.status == "offline"
    # The lane's reason, from its host's state (reconciler.core.scheduling.lanes): silent since its last beat.
    assert lost.last_seen is not None
    reason = f"host a1-arm64 offline since {lost.last_seen.strftime('%H:%M:%S')}"
    status_site.publish(render_status_page(desired, snapshot, plan, snapshot.now, history=history))

    size = f"--window-size={DESKTOP[0]},{DESKTOP[1]}"
    page = read(chromium(tmp_path, status_site, "--dump-dom", size))
    screenshot = tmp_path / "status-after-node-loss.png"
    chromium(tmp_path, status_site, f"--screenshot={screenshot}", size)
    print(f"status page screenshot: {screenshot}")

    assert png_size(screenshot) == DESKTOP
    assert screenshot.stat().st_size > 10_000
    # Real load: what each host reported.
    assert page.nodes["qfox-1"][:5] == ["qfox-1", "gpu_cuda", "owned", "active", "3/4 75%"]
    assert page.nodes["a1-arm64"][3] == "offline"
    assert page.nodes["x86-spill"][4:7] == ["1/2 50%", "0s ago", LOWERED]
    # The offline lane, greyed alone, with its reason.
    (arm,) = [c for c in page.cards if c["lane"] == "a1-arm64"]
    assert arm["class"] == "card offline"
    assert arm["text"].endswith(f"offline {reason}")
    assert [c["lane"] for c in page.cards if "offline" in c["class"].split()] == ["a1-arm64"]
    # The node loss tops the timeline.
    kind, text = page.timeline[0]
    assert kind == "node_lost"
    assert text.startswith(f"{lost.since.strftime('%H:%M:%S')} a1-arm64 lost no heartbeat for 90 s")
    assert {k for k, _ in page.timeline} >= {"node_joined", "leader", "plan"}
    # The age counter ran (the CSP allowed the page's one script) and the page is fresh.
    assert re.fullmatch(r"\d+ s ago", page.age["text"]), page.age
    assert page.age["class"] == "age"
    assert page.external == []
