"""Whole `fabric reconcile` passes activated for real: systemd as PID 1 in a
container (its own network namespace), nft, socat and Caddy inside it.

The edge host "racknerd" of the example fleet: two socat port maps, the table
`inet fabric`, the Caddy snippet. In the container the loopback carries
qfox-1's tailnet address with an echo server on port 22, so the port map
qfox-ssh (2222 -> qfox-1:22) carries real traffic. The passes run inside the
container (`python3 -m reconciler`, the package and its dependencies made
visible there), exactly as fabric-reconcile.service would run them:

1. the first pass starts everything and traffic flows through the port map,
   without a daemon-reload (systemd holds none of the new units: each start
   reads its file);
2. the second pass is a no-op (no unit is restarted: same InvocationID);
3. a changed port map restarts exactly that unit, after a daemon-reload
   (systemd holds the unit that runs);
4. a port map whose socat cannot start (its port taken) fails activation, the
   pass rolls back and the previous generation serves again (exit 1);
5. a port map leaving the plan is stopped, its file removed, without a
   daemon-reload, and systemd forgets the unit.

systemd's own count of its reloads (its Reloading signal,
tests.support.harness.systemd.ManagerReloads) says which passes reloaded.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.conftest import REPO
from tests.support.edge_host import DESIRED, QFOX_ADDRESS, QFOX_ECHO_UNIT, SITE, echo_through, edge_container, invocation, reconcile
from tests.support.harness.systemd import ManagerReloads, SystemdContainer
from tests.support.harness.waiting import wait_until

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


def edit_fleet(container: SystemdContainer, old: str, new: str) -> None:
    text = container.read_file(f"{DESIRED}/fabric.toml")
    assert old in text
    container.write_file(f"{DESIRED}/fabric.toml", text.replace(old, new))


def audited(result: subprocess.CompletedProcess[str], edge: SystemdContainer, cursor: str | None, action: str) -> list[dict[str, str]]:
    """The pass's audit records of `action`: journald's since `cursor` or,
    without journald in the container, the JSON lines on its stderr."""
    # --sync returns once journald has stored every message sent before it.
    edge.run("journalctl", "--sync")
    argv = ["journalctl", "--no-pager", "-t", "fabric-reconcile", "-o", "json", *([f"--after-cursor={cursor}"] if cursor else [])]
    entries = [json.loads(line) for line in edge.run(*argv).stdout.splitlines() if line.strip()]
    records = [{k.removeprefix("FABRIC_").lower(): str(v) for k, v in e.items() if k.startswith("FABRIC_")} for e in entries]
    records += [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    return [r for r in records if r.get("action") == action]


def journal_end(edge: SystemdContainer) -> str | None:
    """Where the journal ends now (None: empty, or no journald)."""
    last = edge.run("journalctl", "--no-pager", "-n", "1", "-o", "json").stdout.strip()
    return json.loads(last)["__CURSOR"] if last else None


def passes_for_real(edge: SystemdContainer, reloads: ManagerReloads) -> None:
    reloaded, cursor = reloads.count(), journal_end(edge)
    first = reconcile(edge)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "generation 1 is active" in first.stdout
    assert "daemon-reload" not in first.stdout
    assert reloads.count() == reloaded, "the first pass reloaded systemd"
    assert not audited(first, edge, cursor, "daemon-reload")
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

    # 3. One port map changes: exactly its unit restarts, systemd reloaded first.
    edit_fleet(edge, "listen_port = 2222", "listen_port = 2223")
    cursor = journal_end(edge)
    third = reconcile(edge)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "restarted the following units:\n  fabric-socat-qfox-ssh.service\n" in third.stdout
    assert "reloaded the systemd manager configuration (daemon-reload)\n" in third.stdout
    assert reloads.count() == reloaded + 1
    assert [r["outcome"] for r in audited(third, edge, cursor, "daemon-reload")] == ["ok"]
    assert invocation(edge, "fabric-socat-qfox-ssh.service") != before["fabric-socat-qfox-ssh.service"]
    assert invocation(edge, "fabric-socat-lux-smb.service") == before["fabric-socat-lux-smb.service"]
    assert echo_through(edge, 2223) == "ping"

    # 4. Its port is taken: socat exits at once, the pass rolls back to generation 2.
    edit_fleet(edge, "listen_port = 2223", "listen_port = 2300")
    fourth = reconcile(edge)
    assert fourth.returncode == 1, fourth.stdout + fourth.stderr
    assert "generation 2 is active again" in fourth.stderr
    unit_file = edge.read_file("/etc/systemd/system/fabric-socat-qfox-ssh.service")
    assert "-LISTEN:2223," in unit_file  # on loopback: the replayed probe has no Tailscale
    wait_until(lambda: edge.systemctl("is-active", "fabric-socat-qfox-ssh.service").stdout.strip() == "active", what="qfox-ssh back on generation 2")
    assert echo_through(edge, 2223) == "ping"
    listed = edge.run("env", f"PYTHONPATH={SITE}:{REPO}", "python3", "-m", "reconciler", "generations").stdout
    assert [line.split()[0] for line in listed.splitlines()[1:]] == ["1", "2", "3"]
    assert listed.splitlines()[2].endswith("current, good")

    # 5. Back to generation 2's port, and a port map leaves the plan: its unit
    # is stopped without a reload, and gone.
    edit_fleet(edge, "listen_port = 2300", "listen_port = 2223")
    reloaded, cursor = reloads.count(), journal_end(edge)
    lux_smb = '[[port_maps]]\nname = "lux-smb"\nhost = "racknerd"\nlisten_port = 4445\ntarget_host = "lux"\ntarget_port = 445\n'
    edit_fleet(edge, lux_smb, "")
    fifth = reconcile(edge)
    assert fifth.returncode == 0, fifth.stdout + fifth.stderr
    assert "stopped the following units:\n  fabric-socat-lux-smb.service\n" in fifth.stdout and "daemon-reload" not in fifth.stdout
    assert reloads.count() == reloaded, "stopping a unit that left the plan reloaded systemd"
    assert not audited(fifth, edge, cursor, "daemon-reload")
    assert not edge.host_path("/etc/systemd/system/fabric-socat-lux-smb.service").exists()
    wait_until(
        lambda: edge.systemctl("show", "fabric-socat-lux-smb.service", "-p", "LoadState", "--value").stdout.strip() == "not-found",
        what="systemd to drop fabric-socat-lux-smb.service",
    )
    assert echo_through(edge, 2223) == "ping"


def test_passes_activate_restart_and_roll_back_for_real(edge: SystemdContainer) -> None:
    with ManagerReloads(edge.bus_address) as reloads:
        passes_for_real(edge, reloads)
