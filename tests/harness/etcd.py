"""Real etcd servers on loopback for the registry tests: one member, or a cluster of three.

Usage::

    from tests.harness.etcd import etcd_cluster

    @pytest.fixture(scope="module")
    def etcd():
        require("etcd")
        with etcd_cluster(members=1) as cluster:
            yield cluster

    def test_something(etcd):
        settings = RegistrySettings(backend="etcd", endpoints=etcd.endpoints, prefix="/t1")

What the object offers:

- `endpoints`: the client URLs (`http://127.0.0.1:PORT`), one per member.
- `members`: one `EtcdMember` per member (`name`, `client_url`, `peer_url`,
  `data_dir`, `process`).
- `stop(name)`: stop one member by PID (SIGTERM, then SIGKILL) and wait for it;
  the others keep serving (a three-member cluster keeps its quorum).
- `start(name)`: start a stopped member again on the same ports and data
  directory; it rejoins the cluster.
- `log(name)`: that member's output so far (for assertion messages).

Ports are taken free from the kernel (bind to port 0) just before start; every
member gets its own data directory under a temporary directory that is removed
at the end. Every process started here is stopped by its PID in a `finally`, so
a failing test leaves nothing behind. etcd 3.4 is healthy in about 0.3 s.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EtcdMember:
    name: str
    client_url: str
    peer_url: str
    data_dir: Path
    log_path: Path
    process: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class EtcdCluster:
    members: list[EtcdMember]
    initial_cluster: str
    base: Path
    _log_files: list = field(default_factory=list)

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    def member(self, name: str) -> EtcdMember:
        return next(m for m in self.members if m.name == name)

    def log(self, name: str) -> str:
        return self.member(name).log_path.read_text(errors="replace")

    def _argv(self, m: EtcdMember, state: str) -> list[str]:
        return [
            "etcd",
            "--name",
            m.name,
            "--data-dir",
            str(m.data_dir),
            "--listen-client-urls",
            m.client_url,
            "--advertise-client-urls",
            m.client_url,
            "--listen-peer-urls",
            m.peer_url,
            "--initial-advertise-peer-urls",
            m.peer_url,
            "--initial-cluster",
            self.initial_cluster,
            "--initial-cluster-state",
            state,
            "--initial-cluster-token",
            "fabric-test",
            # Short election timings: a stopped member's loss is noticed fast.
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
        ]

    def start(self, name: str, state: str = "new") -> None:
        m = self.member(name)
        if m.running:
            return
        log = open(m.log_path, "ab")
        self._log_files.append(log)
        m.process = subprocess.Popen(
            self._argv(m, state),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def stop(self, name: str) -> None:
        m = self.member(name)
        proc = m.process
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)
        m.process = None

    def wait_healthy(self, names: list[str] | None = None, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until each named member (default: every running one) answers /health with true."""
        names = names or [m.name for m in self.members if m.running]
        deadline = time.monotonic() + timeout
        pending = set(names)
        while pending:
            for name in sorted(pending):
                m = self.member(name)
                if m.process is not None and m.process.poll() is not None:
                    raise RuntimeError(f"etcd member {name} exited with {m.process.returncode}:\n{self.log(name)[-3000:]}")
                try:
                    with urllib.request.urlopen(f"{m.client_url}/health", timeout=1) as resp:
                        if b'"health":"true"' in resp.read():
                            pending.discard(name)
                except OSError:
                    pass
            if pending and time.monotonic() > deadline:
                logs = "\n".join(f"--- {n}\n{self.log(n)[-2000:]}" for n in sorted(pending))
                raise RuntimeError(f"etcd members not healthy after {timeout} s: {sorted(pending)}\n{logs}")
            if pending:
                time.sleep(0.05)

    def stop_all(self) -> None:
        for m in self.members:
            try:
                self.stop(m.name)
            except Exception:  # keep stopping the others
                if m.process is not None and m.process.poll() is None:
                    m.process.kill()
        for f in self._log_files:
            f.close()


@contextmanager
def etcd_cluster(members: int = 1) -> Iterator[EtcdCluster]:
    """Start `members` etcd processes forming one cluster on loopback; stop them all on exit."""
    base = Path(tempfile.mkdtemp(prefix="fabric-etcd-"))
    cluster: EtcdCluster | None = None
    try:
        ms = []
        for i in range(members):
            name = f"m{i}"
            ms.append(
                EtcdMember(
                    name=name,
                    client_url=f"http://127.0.0.1:{free_port()}",
                    peer_url=f"http://127.0.0.1:{free_port()}",
                    data_dir=base / name,
                    log_path=base / f"{name}.log",
                )
            )
        initial = ",".join(f"{m.name}={m.peer_url}" for m in ms)
        cluster = EtcdCluster(members=ms, initial_cluster=initial, base=base)
        for m in ms:
            cluster.start(m.name)
        cluster.wait_healthy()
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop_all()
        shutil.rmtree(base, ignore_errors=True)


def etcdctl_env(cluster: EtcdCluster) -> dict[str, str]:
    """Environment for running `etcdctl` (v3 API) against the cluster."""
    return {**os.environ, "ETCDCTL_API": "3", "ETCDCTL_ENDPOINTS": ",".join(cluster.endpoints)}
