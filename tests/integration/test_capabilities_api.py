"""The capabilities API (#31 item 4) served by a real Caddy from the files the edge's pass writes.

The documents are written as the edge's pass writes them
(engine.pass_records.write_capabilities, from a real sqlite registry's
snapshot and pending reports), under the status site's root; Caddy serves
them with the site block the edge renders (core.render.status_site), and
`curl | jq` reads them as the seed's verification does.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from reconciler.adapters.files import LocalTree
from reconciler.adapters.probe_io import CaptureDirectory
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState, HostFacts
from reconciler.core.live.pending import PendingRecord
from reconciler.core.live.records import NodeRecord
from reconciler.core.probe import RawCapture, facts_from_capture
from reconciler.core.render.status_site import caddy_site, status_site_address
from reconciler.engine.fleet_view import FleetView
from reconciler.engine.pass_records import write_capabilities
from tests.conftest import REPO, require
from tests.support.clock import T_PASS, FakeClock
from tests.support.harness.caddy import free_port, running_caddy

pytestmark = pytest.mark.integration

PROBES = REPO / "tests" / "fixtures" / "probe"
# Hosts of the example fleet beating with a probe of their own, and a machine waiting for admission.
BEATING = {"qfox-1": "qfox-1", "lux": "lux", "a1-arm64": "a1-arm64", "x86-spill": "x86-spill", "racknerd": "radeon-desktop"}
PENDING = "newbox"


def probed(fixture: str, host: str) -> HostFacts:
    outputs, errors = CaptureDirectory().load(str(PROBES / fixture))
    facts = facts_from_capture(RawCapture(outputs, errors), host=host)
    # Every node shows GPUs, storage and encoders: those without a GPU of
    # their own borrow the Radeon desktop's hardware record.
    if not (facts.hardware.gpus and facts.hardware.ffmpeg and facts.hardware.storage):
        facts = facts.model_copy(update={"hardware": probed("radeon-desktop", host).hardware})
    return facts


@dataclass
class Site:
    desired: DesiredState
    port: int
    host: str

    def curl(self, path: str) -> tuple[int, str]:
        """curl on loopback with the site's Host header: (HTTP status, body)."""
        done = subprocess.run(
            ["curl", "-s", "-o", "-", "-w", "\n%{http_code}", "-H", f"Host: {self.host}:{self.port}", f"http://127.0.0.1:{self.port}{path}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        body, _, code = done.stdout.rpartition("\n")
        return int(code), body


def serve(tmp_path: Path, desired: DesiredState) -> Iterator[Site]:
    require("caddy")
    root = tmp_path / "var/lib/fabric/status"
    root.mkdir(parents=True, exist_ok=True)
    registry = SqliteRegistry(tmp_path / "registry.sqlite", timing=desired.fleet.timing, flap=desired.fleet.flap, clock=FakeClock(T_PASS))
    try:
        for host, fixture in BEATING.items():
            registry.heartbeat(NodeRecord.from_facts(host, probed(fixture, host)))
        registry.report_pending(PendingRecord(node_id=PENDING, facts=probed("radeon-desktop", PENDING)), ttl_s=90)
        view = FleetView(registry.snapshot(), pending=registry.pending_nodes()[0])
    finally:
        registry.close()
    write_capabilities(LocalTree(tmp_path), "var/lib/fabric/status", view)
    port = free_port()
    host = status_site_address(desired)
    site = caddy_site(desired, str(root), address=f"http://{host}:{port}", bind="127.0.0.1")
    with running_caddy(lambda admin: f"{{\n\tadmin {admin}\n\tauto_https off\n}}\n\n" + site, site_port=port):
        yield Site(desired, port, host)


@pytest.fixture
def open_site(tmp_path: Path) -> Iterator[Site]:
    """The API opened to loopback too (fleet.capabilities_allow_from), as the desired state may say."""
    desired = load_desired(REPO / "hosts")
    fleet = desired.fleet.model_copy(update={"fleet": desired.fleet.fleet.model_copy(update={"capabilities_allow_from": ["127.0.0.0/8"]})})
    yield from serve(tmp_path, desired.model_copy(update={"fleet": fleet}))


@pytest.fixture
def tailnet_site(tmp_path: Path) -> Iterator[Site]:
    """The default: the tailnet only (loopback is outside it)."""
    yield from serve(tmp_path, load_desired(REPO / "hosts"))


def test_every_node_with_its_gpus_storage_and_encoders(open_site: Site) -> None:
    require("curl", "jq")
    code, body = open_site.curl("/api/capabilities/nodes")
    assert code == 200, body
    length = subprocess.run(["jq", ".nodes | length"], input=body, capture_output=True, text=True, check=True).stdout.strip()
    assert int(length) == len(BEATING) + 1
    nodes = json.loads(body)["nodes"]
    assert {n["node_id"] for n in nodes} == {*BEATING, PENDING}
    for node in nodes:
        hardware = node["hardware"]
        assert hardware["gpus"] and hardware["storage"] and hardware["ffmpeg"], node["node_id"]
        assert {"tailscale_ip", "tier", "limitations", "last_seen", "status"} <= set(node)
    assert {n["node_id"]: n["status"] for n in nodes}[PENDING] == "pending"


def test_one_node_by_name_and_none_for_an_unknown_one(open_site: Site) -> None:
    require("curl")
    code, body = open_site.curl("/api/capabilities/nodes/qfox-1")
    assert code == 200, body
    node = json.loads(body)
    assert node["node_id"] == "qfox-1" and node["tier"] == "gpu_cuda" and node["hardware"]["gpus"][0]["vendor"] == "nvidia"
    code, body = open_site.curl(f"/api/capabilities/nodes/{PENDING}")
    assert code == 200 and json.loads(body)["admit"] == f"fabric admit {PENDING}"
    assert open_site.curl("/api/capabilities/nodes/nobody")[0] == 404


def test_outside_the_tailnet_it_is_refused(tailnet_site: Site) -> None:
    require("curl")
    for path in ("/api/capabilities/nodes", "/api/capabilities/nodes/qfox-1", "/api/capabilities/nodes.json"):
        code, body = tailnet_site.curl(path)
        assert code == 403 and "tailnet only" in body, (path, code, body)
    # The status page has its own matcher ([fleet] status_access, tailnet by default): refused too, with its own word.
    code, body = tailnet_site.curl("/")
    assert code == 403 and "status page is served to the tailnet only" in body, (code, body)


def test_the_caddyfile_validates(tmp_path: Path) -> None:
    require("caddy")
    desired = load_desired(REPO / "hosts")
    path = tmp_path / "Caddyfile"
    path.write_text("{\n\tauto_https off\n}\n\n" + caddy_site(desired, str(tmp_path), address="http://status.example:8080"))
    done = subprocess.run(
        [shutil.which("caddy") or "caddy", "validate", "--adapter", "caddyfile", "--config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
