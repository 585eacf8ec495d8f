"""A port map for real: socat forwarding TCP and UDP on loopback.

First the bare command, shaped as the renderer builds it
(`socat TCP-LISTEN:<listen>,fork,reuseaddr TCP4:<target>:<port>`), started and
killed by PID. Then the real `templates/socat.service.j2` unit, with its
hardening (DynamicUser, ProtectSystem, RestrictAddressFamilies, ...), started
through D-Bus by systemd as PID 1 in a container that shares the host's
network, and checked with traffic from the host. Last, where the rendered
port map listens: racknerd's units as render() writes them, run in a network
namespace with a tailnet address and another one (tests/support/harness/netns.py).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import jinja2
import pytest

from reconciler.adapters.commands import SubprocessRunner
from reconciler.adapters.systemd_dbus import SystemdDbus
from reconciler.adapters.unit_verify import SystemdAnalyzeVerifier
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import Hardware, HostFacts
from reconciler.core.live.models import FleetPlan
from reconciler.core.render.artifacts import TEMPLATES_DIR, render, systemd_quote
from reconciler.ports import ActivationError
from tests.conftest import EXAMPLE_FLEET, REPO, require, require_root
from tests.support.harness.caddy import free_port, http_get, http_upstream
from tests.support.harness.netns import Namespace, network_lab, tcp_probe
from tests.support.harness.systemd import SystemdContainer, run_job, systemd_container
from tests.support.harness.waiting import deadline_for, wait_until

pytestmark = pytest.mark.integration

SOCAT = "/usr/bin/socat"


def socat_argv(protocol: str, listen_port: int, target: str, target_port: int) -> list[str]:
    proto = protocol.upper()
    return [SOCAT, f"{proto}-LISTEN:{listen_port},fork,reuseaddr", f"{proto}4:{target}:{target_port}"]


def listening(port: int, protocol: str = "tcp") -> bool:
    flag = "-Hltn" if protocol == "tcp" else "-Hlun"
    out = subprocess.run(["ss", flag, f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return bool(out.strip())


@contextmanager
def running(argv: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    # Own process group: the children socat forks per connection go with it.
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield process
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


@contextmanager
def udp_echo() -> Iterator[int]:
    """A UDP server on loopback that answers every datagram with 'echo:' + it."""
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    server.settimeout(0.05)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                data, peer = server.recvfrom(2048)
            except TimeoutError:
                continue
            server.sendto(b"echo:" + data, peer)

    thread = threading.Thread(target=serve, name="udp-echo", daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        server.close()


def udp_ask(port: int, payload: bytes) -> bytes:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
        client.settimeout(5)
        client.sendto(payload, ("127.0.0.1", port))
        return client.recvfrom(2048)[0]


def test_tcp_port_map_forwards_and_serves_connections_concurrently() -> None:
    require_root()
    require("socat", "ss")
    listen_port = free_port()
    with http_upstream("behind-the-map") as upstream, running(socat_argv("tcp", listen_port, "127.0.0.1", upstream.port)):
        wait_until(lambda: listening(listen_port), what="socat to listen")
        # `fork`: a held-open connection does not block the next one.
        with socket.create_connection(("127.0.0.1", listen_port), timeout=5):
            assert http_get(f"http://127.0.0.1:{listen_port}/") == "behind-the-map"
        assert http_get(f"http://127.0.0.1:{listen_port}/") == "behind-the-map"


def test_tcp_port_map_recovers_when_the_target_comes_back() -> None:
    require_root()
    require("socat", "ss")
    listen_port, target_port = free_port(), free_port()
    with running(socat_argv("tcp", listen_port, "127.0.0.1", target_port)):
        wait_until(lambda: listening(listen_port), what="socat to listen")
        # Nobody at the target: socat accepts, fails to connect and closes.
        with socket.create_connection(("127.0.0.1", listen_port), timeout=5) as client:
            client.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert client.recv(100) == b""
        with running(["python3", "-m", "http.server", "--bind", "127.0.0.1", str(target_port)]):
            wait_until(lambda: listening(target_port), what="the target to listen")
            assert "Directory listing" in http_get(f"http://127.0.0.1:{listen_port}/")


def test_udp_port_map_forwards_datagrams() -> None:
    require_root()
    require("socat", "ss")
    listen_port = free_port()
    with udp_echo() as target_port, running(socat_argv("udp", listen_port, "127.0.0.1", target_port)):
        wait_until(lambda: listening(listen_port, "udp"), what="socat to listen on UDP")
        assert udp_ask(listen_port, b"ping") == b"echo:ping"


def rendered_socat_unit(name: str, listen_port: int, target_port: int) -> str:
    """templates/socat.service.j2 as the renderer fills it, aimed at loopback."""
    environment = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)), undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return environment.get_template("socat.service.j2").render(
        source=f"test_socat.py {name}",
        name=name,
        protocol="tcp",
        listen_port=listen_port,
        target_host="loopback",
        target_address="127.0.0.1",
        target_port=target_port,
        listen_address="every address",
        listen_why=("A test's port map, asked from this host.",),
        exec_start=" ".join(systemd_quote(a) for a in socat_argv("tcp", listen_port, "127.0.0.1", target_port)),
    )


@pytest.fixture(scope="module")
def container() -> Iterator[SystemdContainer]:
    require_root()
    require("unshare", "nsenter", "chroot")
    with systemd_container() as booted:
        yield booted


def test_rendered_socat_unit_forwards_under_systemd(container: SystemdContainer, tmp_path) -> None:
    require("socat", "ss", "systemd-analyze")
    listen_port = free_port()
    unit = "fabric-socat-loopback.service"
    with http_upstream("through-the-unit") as upstream:
        text = rendered_socat_unit("loopback", listen_port, upstream.port)
        unit_file = tmp_path / unit
        unit_file.write_text(text)
        SystemdAnalyzeVerifier(SubprocessRunner()).verify([str(unit_file)])

        with SystemdDbus(container.bus_address) as systemd:
            container.write_file(f"/etc/systemd/system/{unit}", text)
            systemd.daemon_reload()
            run_job(systemd, "start", unit)
            properties = systemd.unit_properties(unit)
            assert properties["ActiveState"] == "active"
            wait_until(lambda: listening(listen_port), what="the unit's socat to listen")
            assert http_get(f"http://127.0.0.1:{listen_port}/") == "through-the-unit"
            # DynamicUser: the forwarder does not run as root.
            owner = container.run("ps", "-o", "user=", "-p", str(properties["MainPID"])).stdout.strip()
            assert owner not in ("", "root")

            run_job(systemd, "stop", unit)
            assert systemd.active_state(unit) != "active"
            wait_until(lambda: not listening(listen_port), what="the port to close")


def test_stopping_the_socat_unit_is_a_clean_stop(container: SystemdContainer) -> None:
    require("socat")
    unit = "fabric-socat-cleanstop.service"
    with SystemdDbus(container.bus_address) as systemd:
        container.write_file(f"/etc/systemd/system/{unit}", rendered_socat_unit("cleanstop", free_port(), free_port()))
        systemd.daemon_reload()
        run_job(systemd, "start", unit)
        run_job(systemd, "stop", unit)
        assert systemd.active_state(unit) == "inactive"


def test_socat_unit_with_a_port_already_taken_fails_to_start(container: SystemdContainer) -> None:
    require("socat")
    unit = "fabric-socat-clash.service"
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        text = rendered_socat_unit("clash", taken, free_port()).replace("reuseaddr", "reuseaddr,bind=127.0.0.1")
        # The grace must outlast socat's start, its failed bind and exit (and
        # the restart RestartSec= later) on a loaded machine: the watch ends at
        # the first crash it sees, so a long grace costs nothing here.
        restart_sec = float(re.search(r"^RestartSec=(\d+)s$", text, re.MULTILINE).group(1))
        with SystemdDbus(container.bus_address, startup_grace=deadline_for(restart_sec)) as systemd:
            container.write_file(f"/etc/systemd/system/{unit}", text)
            systemd.daemon_reload()
            # Caught in the grace period, or (on a busy machine, its properties
            # read late: socat already dead, restarting every RestartSec= until
            # systemd's start limit) already failed once its state settles.
            # Either way the start fails, naming the unit.
            with pytest.raises(ActivationError, match=r"fabric-socat-clash\.service: unit (did not stay up|failed after its job finished)"):
                run_job(systemd, "start", unit)
            run_job(systemd, "stop", unit)


# --------------------------------------------------------------------------
# Where the rendered port map listens


EDGE_TAILNET_ADDRESS = "100.101.7.2"  # racknerd's, as its probe would find it
OTHER_ADDRESS = "10.250.2.2"  # another address of the same host (its public one, say)
QFOX = "100.88.57.96"  # qfox-ssh's target: qfox-1:22


def rendered_exec_start(desired_dir, tailscale_ip: str | None, unit: str = "fabric-socat-qfox-ssh.service") -> list[str]:  # type: ignore[no-untyped-def]
    """The argv of racknerd's rendered port map unit."""
    facts = HostFacts(node_id="racknerd", k3s_hostname="racknerd", hardware=Hardware(arch="x86_64"), tier="relay", tailscale_ip=tailscale_ip)
    plan = FleetPlan.model_validate_json((REPO / "tests" / "golden" / "fleet-plan.json").read_text())
    [text] = [a.content for a in render(load_desired(desired_dir), "racknerd", facts, plan).artifacts if a.path.endswith(unit)]
    [line] = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart="))


def echo(namespace: Namespace, host: str, port: int) -> str:
    done = namespace.run("socat", "-T", "2", "-", f"TCP:{host}:{port},connect-timeout=2", input="ping\n")
    return done.stdout.strip()


def edge_lab(lab, argv: list[str]) -> tuple[Namespace, Namespace]:  # type: ignore[no-untyped-def]
    """The edge with its tailnet link (tailscale0) and another link to the
    same client, qfox-1's address on its loopback with an echo on port 22,
    and the port map's socat running: (client, edge)."""
    client, edge = lab.namespace("client"), lab.namespace("edge")
    lab.link(client, "100.101.7.1/24", edge, f"{EDGE_TAILNET_ADDRESS}/24", b_name="tailscale0")
    lab.link(client, "10.250.2.1/24", edge, f"{OTHER_ADDRESS}/24")
    edge.check("ip", "addr", "add", f"{QFOX}/32", "dev", "lo")
    edge.spawn("socat", f"TCP-LISTEN:22,bind={QFOX},fork,reuseaddr", "EXEC:/bin/cat")
    edge.spawn(*argv)
    edge.wait_listening(22)
    edge.wait_listening(2222)
    return client, edge


def test_the_rendered_port_map_answers_on_the_tailnet_address_only() -> None:
    require_root()
    require("ip", "socat", "ss")
    argv = rendered_exec_start(EXAMPLE_FLEET, EDGE_TAILNET_ADDRESS)
    assert argv[1] == f"TCP4-LISTEN:2222,bind={EDGE_TAILNET_ADDRESS},ip-freebind=1,fork,reuseaddr"
    with network_lab() as lab:
        client, edge = edge_lab(lab, argv)
        assert echo(client, EDGE_TAILNET_ADDRESS, 2222) == "ping"
        assert tcp_probe(client, OTHER_ADDRESS, 2222) == "refused"


def test_a_port_map_opened_by_allow_from_answers_on_every_address(tmp_path) -> None:
    require_root()
    require("ip", "socat", "ss")
    desired = tmp_path / "desired"
    shutil.copytree(EXAMPLE_FLEET, desired)
    fleet = (desired / "fabric.toml").read_text()
    (desired / "fabric.toml").write_text(fleet.replace("target_port = 22\n", 'target_port = 22\nallow_from = ["10.250.2.0/24"]\n', 1))
    argv = rendered_exec_start(desired, EDGE_TAILNET_ADDRESS)
    assert argv[1] == "TCP-LISTEN:2222,fork,reuseaddr"
    with network_lab() as lab:
        client, edge = edge_lab(lab, argv)
        assert echo(client, EDGE_TAILNET_ADDRESS, 2222) == "ping"
        assert echo(client, OTHER_ADDRESS, 2222) == "ping"


def test_a_port_map_without_a_known_tailnet_address_answers_on_loopback_only() -> None:
    require_root()
    require("ip", "socat", "ss")
    argv = rendered_exec_start(EXAMPLE_FLEET, None)
    with network_lab() as lab:
        client, edge = edge_lab(lab, argv)
        assert tcp_probe(client, EDGE_TAILNET_ADDRESS, 2222) == "refused"
        assert tcp_probe(client, OTHER_ADDRESS, 2222) == "refused"
        assert echo(edge, "127.0.0.1", 2222) == "ping"
