"""Network namespaces joined by veth pairs, for nft and traffic tests.

Usage::

    from tests.support.harness.netns import network_lab, tcp_probe

    with network_lab() as lab:
        client, server = lab.namespace("client"), lab.namespace("server")
        lab.link(client, "10.250.1.1/24", server, "10.250.1.2/24")
        server.spawn("socat", "TCP-LISTEN:8080,fork,reuseaddr", "EXEC:/bin/cat")
        server.wait_listening(8080)
        assert tcp_probe(client, "10.250.1.2", 8080) == "connected"

Every namespace gets a unique name (`fabric-<pid>-<n>-<label>`) and its
loopback up. `spawn` starts a program inside a namespace and registers it; on
leaving the `with`, every spawned process (with its process group) is killed by PID and waited for, then
every namespace is deleted (which removes its veth ends), even if the test
failed. Addresses live only inside the namespaces (10.250.0.0/16, and the
tailnet's 100.64.0.0/10 where a test plays the tailnet with its real range).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from tests.support.harness.waiting import wait_until

_counter = itertools.count()


class Namespace:
    def __init__(self, name: str, lab: NetworkLab) -> None:
        self.name = name
        self._lab = lab

    @property
    def exec_prefix(self) -> tuple[str, ...]:
        """argv prefix that runs a program inside this namespace."""
        return ("ip", "netns", "exec", self.name)

    def run(self, *argv: str, input: str | None = None, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.exec_prefix, *argv], input=input, capture_output=True, text=True, timeout=timeout, check=False)

    def check(self, *argv: str, input: str | None = None) -> str:
        """Run and return stdout; a failing command fails the test with its stderr."""
        done = self.run(*argv, input=input)
        if done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} in {self.name} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def spawn(self, *argv: str) -> subprocess.Popen[bytes]:
        """Start a long-running program here; the lab kills it by PID on exit."""
        # Its own process group, so the children of a forking server (socat fork)
        # go with it: the group is killed by the leader's PID.
        process = subprocess.Popen(
            [*self.exec_prefix, *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._lab._processes.append(process)
        return process

    def listening_ports(self) -> set[int]:
        out = self.check("ss", "-Hltn")
        return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}

    def wait_listening(self, port: int) -> None:
        wait_until(lambda: port in self.listening_ports(), what=f"a listener on port {port} in {self.name}")


class NetworkLab:
    def __init__(self) -> None:
        self._namespaces: list[Namespace] = []
        self._processes: list[subprocess.Popen[bytes]] = []

    def namespace(self, label: str) -> Namespace:
        name = f"fabric-{os.getpid()}-{next(_counter)}-{label}"[:64]
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
        namespace = Namespace(name, self)
        self._namespaces.append(namespace)
        namespace.check("ip", "link", "set", "lo", "up")
        return namespace

    def link(self, a: Namespace, a_address: str, b: Namespace, b_address: str, *, b_name: str | None = None) -> None:
        """A veth pair between two namespaces, addressed (CIDR) and up;
        `b_name` names b's end (a tailnet interface, "tailscale0"), which is
        created in b's namespace directly, so two labs may both use it."""
        index = next(_counter)
        a_end, b_end = f"fv{index}a", b_name or f"fv{index}b"
        subprocess.run(
            ["ip", "link", "add", a_end, "netns", a.name, "type", "veth", "peer", "name", b_end, "netns", b.name],
            check=True,
            capture_output=True,
        )
        for namespace, end, address in ((a, a_end, a_address), (b, b_end, b_address)):
            namespace.check("ip", "addr", "add", address, "dev", end)
            namespace.check("ip", "link", "set", end, "up")

    def close(self) -> None:
        for process in self._processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        self._processes.clear()
        for namespace in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", namespace.name], check=False, capture_output=True)
        self._namespaces.clear()


@contextmanager
def network_lab() -> Iterator[NetworkLab]:
    lab = NetworkLab()
    try:
        yield lab
    finally:
        lab.close()


def tcp_probe(namespace: Namespace, host: str, port: int, timeout: float = 1.0) -> str:
    """How a TCP connection from `namespace` fares: 'connected' (handshake done),
    'refused' (RST: nothing listens, or a reject rule) or 'timeout' (no answer:
    dropped). socat makes the connection: it starts in milliseconds."""
    done = namespace.run("socat", "-u", "OPEN:/dev/null", f"TCP:{host}:{port},connect-timeout={timeout}")
    if done.returncode == 0:
        return "connected"
    if "Connection refused" in done.stderr:
        return "refused"
    if "timed out" in done.stderr:
        return "timeout"
    raise AssertionError(f"tcp probe {host}:{port} from {namespace.name}: {done.stderr.strip()}")
