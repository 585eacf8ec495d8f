"""The status page as a phone sees it: rendered, served by a real Caddy, read by headless Chromium.

The page is written where the edge host writes it, Caddy serves it with the
site block `caddy_site` suggests (at http://status.researchstack.info:PORT,
resolved to loopback by Chromium's host rules only, so nothing leaves the
machine), and Chromium dumps the DOM it built and takes a phone-sized
screenshot (kept in the test's tmp dir for a person to look at).
"""

from __future__ import annotations

import html.parser
import os
import signal
import struct
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.render.status_site import STATUS_FILE, caddy_site, status_site_address
from reconciler.core.views.page import render_status_page
from tests.conftest import EXAMPLE_FLEET, REPO, require
from tests.harness.caddy import free_port, running_caddy

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
    site = caddy_site(desired, str(root), address=f"http://{host}:{port}", bind="127.0.0.1")
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
    """The lane cards, node rows and deferred sections of a DOM, as text."""

    def __init__(self) -> None:
        super().__init__()
        self.cards: list[dict[str, str]] = []
        self.nodes: dict[str, list[str]] = {}
        self.sections: dict[str, str] = {}
        self.leader = ""
        self.external: list[str] = []
        self._open: list[tuple[str, dict[str, str], list[str]]] = []
        self._cells: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        for key in ("src", "href"):
            if key in a:
                self.external.append(f"{tag} {key}={a[key]}")
        if tag in ("script", "link", "img", "iframe"):
            self.external.append(tag)
        if tag == "article" or (tag == "section" and a.get("id", "").startswith("deferred-")) or a.get("id") == "leader":
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
        ("a1-arm64", "● COMPUTE · a1-arm64 RANK 10 1/2 online"),
        ("x86-spill", "○ COMPUTE · x86-spill RANK 20 0/4 offline"),
        ("local", "● LOCAL · local RANK 99 0/1 online"),
    ]
    # Greyed: the offline card alone.
    assert [c["lane"] for c in page.cards if "offline" in c["class"].split()] == ["x86-spill"]
    assert page.leader == "leader lux · plan epoch 7"
    assert page.nodes["x86-spill"][:6] == ["x86-spill", "cpu_ffmpeg", "active", "1/4 25%", "5s ago", "held off 8m 20s"]
    assert page.nodes["lux"][5] == "draining"
    assert page.nodes["qfox-1"][2] == "not reporting"
    assert page.sections["deferred-waiting"].startswith("Waiting for capacity (1) flac-fft#1 no eligible node")
    assert page.sections["deferred-inadmissible"].startswith("Inadmissible (1) lupine#0 inadmissible: no node in the fleet")
    assert page.external == []

    screenshot = tmp_path / "status-phone.png"
    chromium(tmp_path, status_site, f"--screenshot={screenshot}", f"--window-size={PHONE[0]},{PHONE[1]}")
    assert png_size(screenshot) == PHONE
    # A real picture, not an empty canvas (a blank 390x844 PNG is a few hundred bytes).
    assert screenshot.stat().st_size > 10_000


def test_caddy_serves_the_newest_pass_with_no_store(status_site, fixture_inputs):
    snapshot, plan = fixture_inputs
    status_site.publish(render_status_page(status_site.desired, snapshot, plan, snapshot.now))
    headers, first = status_site.get()

    # Next pass: x86-spill's probe answers again.
    back = snapshot.model_copy(update={"lanes": [lane.model_copy(update={"available": True}) for lane in snapshot.lanes]})
    status_site.publish(render_status_page(status_site.desired, back, plan, back.now))
    _, second = status_site.get()

    assert headers["Cache-Control"] == "no-store"
    assert headers["Content-Security-Policy"] == "default-src 'none'; style-src 'unsafe-inline'"
    assert headers["Content-Type"].startswith("text/html")
    assert [c["class"] for c in read(first).cards] == ["card", "card offline", "card"]
    assert [c["class"] for c in read(second).cards] == ["card", "card", "card"]
