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

import subprocess
from collections.abc import Iterator

import pytest

from tests.conftest import REPO
from tests.harness.systemd import SystemdContainer
from tests.harness.waiting import wait_until
from tests.integration.edge_host import DESIRED, QFOX_ADDRESS, QFOX_ECHO_UNIT, SITE, echo_through, edge_container, invocation, reconcile_argv

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def edge() -> Iterator[SystemdContainer]:
    with edge_container() as container:
        # qfox-1, as far as this edge can tell: its address on the container's
        # loopback, an echo server on its port 22.
        done = container.run("ip", "addr", "add", f"{QFOX_ADDRESS}/32", "dev", "lo")
        assert done.returncode == 0, done.stderr
        container.write_file("/etc/systemd/system/qfox-echo.service", QFOX_ECHO_UNIT)
        # Something else on this edge already uses port 2300.
        container.write_file("/etc/systemd/system/squatter.service", "[Service]\nExecStart=/usr/bin/socat TCP-LISTEN:2300,reuseaddr EXEC:/bin/cat\n")
        container.write_file("/etc/caddy/Caddyfile", "{\n\tadmin localhost:2019\n\tauto_https off\n}\n")
        assert container.systemctl("daemon-reload").returncode == 0
        for unit in ("qfox-echo.service", "squatter.service", "caddy.service"):
            started = container.systemctl("start", unit)
            assert started.returncode == 0, f"{unit}: {started.stderr}"
        yield container


def reconcile(container: SystemdContainer) -> subprocess.CompletedProcess[str]:
    return container.run(*reconcile_argv(), timeout=300)


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
