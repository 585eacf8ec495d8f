"""Whole `fabric reconcile` passes activated for real: systemd as PID 1 in a
container (its own network namespace), nft, socat and Caddy inside it.

The edge host "racknerd" of the example fleet: two socat port maps, the table
`inet fabric`, the Caddy snippet. In the container the loopback carries
qfox-1's tailnet address with an echo server on port 22, so the port map
qfox-ssh (2222 -> qfox-1:22) carries real traffic. The passes run inside the
container (`python3 -m reconciler`, the package and its dependencies made
visible there), exactly as fabric-reconcile.service would run them:

1. the first pass starts everything and traffic flows through the port map;
2. the second pass is a no-op (no unit is restarted: same InvocationID);
3. a changed port map restarts exactly that unit;
4. a port map whose socat cannot start (its port taken) fails activation, the
   pass rolls back and the previous generation serves again (exit 1).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import annotated_types
import dbus_fast
import jinja2
import markupsafe
import pydantic
import pydantic_core
import pytest
import typing_extensions
import typing_inspection

from tests.conftest import EXAMPLE_FLEET, REPO, require, require_root
from tests.harness.systemd import SystemdContainer, systemd_container
from tests.harness.waiting import wait_until

pytestmark = pytest.mark.integration

SITE = "/opt/fabric-test/site"
DESIRED = "/var/lib/fabric/desired"
QFOX_ADDRESS = "100.88.57.96"


def _copy_dependencies(container: SystemdContainer) -> None:
    """The reconciler's runtime dependencies, from this venv into the container
    (its /tmp, where the venv lives, is the container's own)."""
    target = container.host_path(SITE)
    target.mkdir(parents=True)
    for module in (pydantic, pydantic_core, jinja2, markupsafe, dbus_fast, annotated_types, typing_inspection):
        source = Path(module.__file__).parent  # type: ignore[arg-type]
        shutil.copytree(source, target / source.name)
    shutil.copy(typing_extensions.__file__, target)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def edge() -> Iterator[SystemdContainer]:
    require_root()
    require("unshare", "nsenter", "chroot", "python3", "nft", "socat", "caddy", "ip")
    with systemd_container(hostname="racknerd", private_network=True) as container:
        _copy_dependencies(container)
        for toml in sorted(EXAMPLE_FLEET.glob("*.toml")):
            container.write_file(f"{DESIRED}/{toml.name}", toml.read_text())
        # qfox-1, as far as this edge can tell: its address on the container's
        # loopback, an echo server on its port 22.
        done = container.run("ip", "addr", "add", f"{QFOX_ADDRESS}/32", "dev", "lo")
        assert done.returncode == 0, done.stderr
        container.write_file(
            "/etc/systemd/system/qfox-echo.service",
            f"[Service]\nExecStart=/usr/bin/socat TCP-LISTEN:22,bind={QFOX_ADDRESS},fork,reuseaddr EXEC:/bin/cat\n",
        )
        # Something else on this edge already uses port 2300.
        container.write_file("/etc/systemd/system/squatter.service", "[Service]\nExecStart=/usr/bin/socat TCP-LISTEN:2300,reuseaddr EXEC:/bin/cat\n")
        container.write_file("/etc/caddy/Caddyfile", "{\n\tadmin localhost:2019\n\tauto_https off\n}\n")
        assert container.systemctl("daemon-reload").returncode == 0
        for unit in ("qfox-echo.service", "squatter.service", "caddy.service"):
            started = container.systemctl("start", unit)
            assert started.returncode == 0, f"{unit}: {started.stderr}"
        yield container


def reconcile(container: SystemdContainer) -> subprocess.CompletedProcess[str]:
    return container.run(
        "env",
        f"PYTHONPATH={SITE}:{REPO}",
        "PYTHONDONTWRITEBYTECODE=1",
        "python3",
        "-m",
        "reconciler",
        "reconcile",
        "--desired",
        DESIRED,
        "--host",
        "racknerd",
        "--replay",
        str(REPO / "tests" / "golden" / "probe" / "x86_64"),
        "--plan-file",
        str(REPO / "tests" / "golden" / "fleet-plan.json"),
        timeout=300,
    )


def invocation(container: SystemdContainer, unit: str) -> str:
    return container.systemctl("show", unit, "-p", "InvocationID", "--value").stdout.strip()


def echo_through(container: SystemdContainer, port: int) -> str:
    done = container.run("socat", "-T", "2", "-", f"TCP:127.0.0.1:{port}", input="ping\n", timeout=30)
    return done.stdout.strip()


def edit_fleet(container: SystemdContainer, old: str, new: str) -> None:
    text = container.read_file(f"{DESIRED}/fabric.toml")
    assert old in text
    container.write_file(f"{DESIRED}/fabric.toml", text.replace(old, new))


def test_passes_activate_restart_and_roll_back_for_real(edge: SystemdContainer) -> None:
    first = reconcile(edge)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "generation 1 is active" in first.stdout
    for unit in ("fabric-socat-qfox-ssh.service", "fabric-socat-lux-smb.service", "fabric-nftables.service"):
        assert edge.systemctl("is-active", unit).stdout.strip() == "active", unit
    assert echo_through(edge, 2222) == "ping"
    assert "tcp dport { 2222, 4445 } drop" in edge.run("nft", "list", "table", "inet", "fabric").stdout
    sites = edge.run(
        "socat", "-T", "2", "-", "TCP:127.0.0.1:2019", input="GET /config/apps/http/servers HTTP/1.0\r\nHost: localhost:2019\r\n\r\n"
    ).stdout
    assert "fft.researchstack.info" in sites
    # Every action is in the journal (the container's journald may be off:
    # then the records went to stderr as JSON lines).
    assert '"action": "start"' in first.stderr or edge.journal("-t", "fabric-reconcile").strip()

    # 2. Nothing to do: nothing restarted.
    before = {u: invocation(edge, u) for u in ("fabric-socat-qfox-ssh.service", "fabric-socat-lux-smb.service")}
    second = reconcile(edge)
    assert second.returncode == 0 and second.stdout.strip() == "nothing to do (generation 1)", second.stdout + second.stderr
    assert {u: invocation(edge, u) for u in before} == before

    # 3. One port map changes: exactly its unit restarts.
    edit_fleet(edge, "listen_port = 2222", "listen_port = 2223")
    third = reconcile(edge)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "restarted the following units:\n  fabric-socat-qfox-ssh.service\n" in third.stdout
    assert invocation(edge, "fabric-socat-qfox-ssh.service") != before["fabric-socat-qfox-ssh.service"]
    assert invocation(edge, "fabric-socat-lux-smb.service") == before["fabric-socat-lux-smb.service"]
    assert echo_through(edge, 2223) == "ping"

    # 4. Its port is taken: socat exits at once, the pass rolls back to generation 2.
    edit_fleet(edge, "listen_port = 2223", "listen_port = 2300")
    fourth = reconcile(edge)
    assert fourth.returncode == 1, fourth.stdout + fourth.stderr
    assert "generation 2 is active again" in fourth.stderr
    unit_file = edge.read_file("/etc/systemd/system/fabric-socat-qfox-ssh.service")
    assert "TCP-LISTEN:2223," in unit_file
    wait_until(lambda: edge.systemctl("is-active", "fabric-socat-qfox-ssh.service").stdout.strip() == "active", what="qfox-ssh back on generation 2")
    assert echo_through(edge, 2223) == "ping"
    listed = edge.run("env", f"PYTHONPATH={SITE}:{REPO}", "python3", "-m", "reconciler", "generations").stdout
    assert [line.split()[0] for line in listed.splitlines()[1:]] == ["1", "2", "3"]
    assert listed.splitlines()[2].endswith("current, good")
