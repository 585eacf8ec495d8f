"""The heartbeat's load measured on a real host: systemd as PID 1 in a container.

The edge host "racknerd" of the example fleet (tests/support/edge_host.py)
with the embedded sqlite registry inside the container. A plan that places
flac-fft and vaapi-encode on racknerd is published there (unsigned: the
copy's [[plan_keys]] are cut off); their programs become `sleep`, flac-fft's
behind a switch file that makes it refuse to start. Whole `fabric reconcile`
passes run inside the container and the test reads racknerd's record back
from the registry:

1. after the first pass its in_flight equals the service units systemd runs (2);
2. flac-fft stopped and unable to start again: the next pass cannot bring it
   back (the pass fails), and the heartbeat says 1 and shows flac-fft's state;
3. once it can start, the next pass starts it and the heartbeat says 2 again.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.conftest import REPO
from tests.support.edge_host import DESIRED, REPLAYED_PROBE, SITE, edge_container
from tests.support.harness.systemd import SystemdContainer

pytestmark = pytest.mark.integration

FLAC = "fabric-agent-flac-fft.service"
VAAPI = "fabric-agent-vaapi-encode.service"
BROKEN = "/etc/fft-broken"
PYTHON = ["env", f"PYTHONPATH={SITE}:{REPO}", "PYTHONDONTWRITEBYTECODE=1", "python3"]

PUBLISH = f"""
from datetime import UTC, datetime
from reconciler.wiring import open_registry
from reconciler.core.desired.load import load_desired
from reconciler.core.live.models import FleetPlan, Placement
registry = open_registry(load_desired({DESIRED!r}).fleet)
leadership = registry.campaign("lux", 30.0)
assert leadership is not None
placements = [Placement(service=s, replica=0, node="racknerd", tier="relay") for s in ("flac-fft", "vaapi-encode")]
registry.publish_plan(leadership, FleetPlan(epoch=0, leader="lux", created=datetime.now(UTC), placements=placements))
registry.resign(leadership)
registry.close()
"""

RECORD = f"""
from reconciler.wiring import open_registry
from reconciler.core.desired.load import load_desired
registry = open_registry(load_desired({DESIRED!r}).fleet)
print([s.record.model_dump_json() for s in registry.node_states() if s.record.node_id == "racknerd"][0])
registry.close()
"""


@pytest.fixture(scope="module")
def edge() -> Iterator[SystemdContainer]:
    with edge_container() as container:
        fleet_file = f"{DESIRED}/fabric.toml"
        text = container.read_file(fleet_file)
        text = text[: text.index("[[plan_keys]]")]
        for old, new in (
            ('["/opt/researchstack/bin/encode-server", "--port", "8702"]', '["/usr/bin/sleep", "infinity"]'),
            ('["/opt/researchstack/bin/fft-server", "--port", "8703"]', f'["/bin/sh", "-c", "test ! -e {BROKEN} && exec /usr/bin/sleep infinity"]'),
        ):
            assert old in text
            text = text.replace(old, new)
        container.write_file(fleet_file, text)
        container.write_file("/etc/caddy/Caddyfile", "{\n\tadmin localhost:2019\n\tauto_https off\n}\n")
        assert container.systemctl("daemon-reload").returncode == 0
        assert container.systemctl("start", "caddy.service").returncode == 0
        published = container.run(*PYTHON, "-c", PUBLISH, timeout=120)
        assert published.returncode == 0, published.stderr
        yield container


def reconcile(container: SystemdContainer) -> subprocess.CompletedProcess[str]:
    return container.run(
        *PYTHON, "-m", "reconciler", "reconcile", "--desired", DESIRED, "--host", "racknerd", "--replay", str(REPLAYED_PROBE), timeout=300
    )


def record(container: SystemdContainer) -> dict[str, object]:
    done = container.run(*PYTHON, "-c", RECORD, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def active_service_units(container: SystemdContainer) -> int:
    return sum(container.systemctl("is-active", unit).stdout.strip() == "active" for unit in (FLAC, VAAPI))


def test_the_heartbeat_reports_the_service_units_systemd_runs(edge: SystemdContainer) -> None:
    first = reconcile(edge)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "generation 1 is active" in first.stdout
    beat = record(edge)
    assert active_service_units(edge) == 2
    assert beat["in_flight"] == 2
    units = beat["units"]
    assert isinstance(units, dict)
    assert units[FLAC] == units[VAAPI] == "active"
    assert units["fabric-socat-qfox-ssh.service"] == "active"  # every fabric unit, not only the services

    # flac-fft stops and cannot start again: the next pass tries, fails, and
    # the heartbeat after it counts one service and shows flac-fft's state.
    edge.write_file(BROKEN, "")
    assert edge.systemctl("stop", FLAC).returncode == 0
    second = reconcile(edge)
    assert second.returncode != 0, second.stdout + second.stderr
    beat = record(edge)
    assert active_service_units(edge) == 1
    assert beat["in_flight"] == 1, second.stderr
    units = beat["units"]
    assert isinstance(units, dict)
    assert units[FLAC] != "active" and units[VAAPI] == "active"

    # It can start again: the next pass starts it, the load is back.
    edge.remove_file(BROKEN)
    # (systemd keeps restarting it until its start limit: the operator stops
    # it, which ends the restarts, and clears the limit; a unit systemd has
    # already unloaded has no limit left, and reset-failed says "not loaded".)
    assert edge.systemctl("stop", FLAC).returncode == 0
    edge.systemctl("reset-failed", FLAC)
    third = reconcile(edge)
    assert third.returncode == 0, third.stdout + third.stderr
    beat = record(edge)
    assert active_service_units(edge) == 2
    assert beat["in_flight"] == 2
