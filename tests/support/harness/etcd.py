"""Real etcd servers on loopback for the registry tests: one member, or a cluster of three.

Usage::

    from tests.support.harness.etcd import etcd_cluster

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

TLS mode, `etcd_cluster(members=1, tls=True)`: the members serve clients on
`https://127.0.0.1:PORT` with a server certificate for 127.0.0.1/localhost
(`--cert-file --key-file`) and require a client certificate signed by the
test CA (`--client-cert-auth --trusted-ca-file`); once etcd's auth is enabled
the certificate's CN is the user name. `cluster.pki` is that CA
(`TestPki`, made with `cryptography`): `cluster.pki.client(name)` issues (once)
a client certificate with CN=name and returns its (cert, key) paths, and
`cluster.tls_settings(name)` gives the [registry] ca_file/cert_file/key_file of
that identity. Peers stay on plain http (loopback only). Auth itself is not
enabled here: that is `fabric registry init-auth`'s job.

Ports are taken free from the kernel (bind to port 0) just before start; every
member gets its own data directory under a temporary directory that is removed
at the end. Every process started here is stopped by its PID in a `finally`, so
a failing test leaves nothing behind. etcd 3.4 is healthy in about 0.3 s.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import signal
import socket
import ssl
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


class TestPki:
    """A throwaway CA in `directory` and the certificates it signs (EC P-256, valid one day).

    Keys are written 0600, as a host keeps its registry key. The server
    certificate covers localhost, 127.0.0.1 and `server_ips` (an etcd on
    another address, as the e2e fleet's on its bridge)."""

    __test__ = False  # a helper, not a test class, wherever it is imported

    def __init__(self, directory: Path, server_ips: tuple[str, ...] = ()) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        self._ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fabric-test-ca")])
        self._ca_cert = (
            self._builder(self._ca_name, self._ca_key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)  # key_cert_sign, crl_sign
            .sign(self._ca_key, _sha256())
        )
        self.ca_file = directory / "ca.crt"
        self.ca_file.write_bytes(_pem(self._ca_cert))
        self._issued: dict[str, tuple[Path, Path]] = {}
        self._server_ips = ("127.0.0.1", *server_ips)
        self.server_cert, self.server_key = self._issue("server", server=True)

    def _builder(self, subject, public_key):
        from cryptography import x509

        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._ca_name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def _issue(self, common_name: str, *, server: bool = False) -> tuple[Path, Path]:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        builder = self._builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]), key.public_key())
        builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("localhost"), *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in self._server_ips)]),
                critical=False,
            ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        else:
            builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        cert = builder.sign(self._ca_key, _sha256())
        cert_path, key_path = self.directory / f"{common_name}.crt", self.directory / f"{common_name}.key"
        cert_path.write_bytes(_pem(cert))
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        key_path.chmod(0o600)
        return cert_path, key_path

    def server_argv(self) -> list[str]:
        """etcd's options to serve clients over TLS with this CA's server
        certificate and to require a client certificate of this CA: once
        init-auth enabled auth, a client's CN is the user it acts as."""
        return [
            "--cert-file",
            str(self.server_cert),
            "--key-file",
            str(self.server_key),
            "--trusted-ca-file",
            str(self.ca_file),
            "--client-cert-auth",
        ]

    def client(self, common_name: str) -> tuple[Path, Path]:
        """The (cert, key) paths of a client certificate with CN=common_name, issued on first use."""
        if common_name not in self._issued:
            # One directory per identity, as each host keeps its own pair at
            # the fleet-wide [registry] cert_file/key_file paths.
            directory = self.directory / "clients" / common_name
            directory.mkdir(parents=True, exist_ok=True)
            cert, key = self._issue(common_name)
            self._issued[common_name] = (cert.rename(directory / "client.crt"), key.rename(directory / "client.key"))
        return self._issued[common_name]

    def ssl_context(self, common_name: str) -> ssl.SSLContext:
        """A client-side TLS context presenting CN=common_name (for /health)."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        cert, key = self.client(common_name)
        context.load_cert_chain(str(cert), str(key))
        return context


def _sha256():
    from cryptography.hazmat.primitives import hashes

    return hashes.SHA256()


def _pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


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
    pki: TestPki | None = None
    # More etcd flags, for every member (a lowered --max-request-bytes).
    extra_args: tuple[str, ...] = ()
    _log_files: list = field(default_factory=list)

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    def tls_settings(self, identity: str) -> dict[str, str]:
        """[registry] ca_file/cert_file/key_file of the client identity CN=identity (TLS mode)."""
        assert self.pki is not None, "etcd_cluster(tls=True) has a PKI"
        cert, key = self.pki.client(identity)
        return {"ca_file": str(self.pki.ca_file), "cert_file": str(cert), "key_file": str(key)}

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
            *self.extra_args,
        ] + self._tls_argv()

    def _tls_argv(self) -> list[str]:
        return [] if self.pki is None else self.pki.server_argv()

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
        # /health over TLS needs a client certificate (any CN: it checks no permission).
        context = self.pki.ssl_context("root") if self.pki is not None else None
        while pending:
            for name in sorted(pending):
                m = self.member(name)
                if m.process is not None and m.process.poll() is not None:
                    raise RuntimeError(f"etcd member {name} exited with {m.process.returncode}:\n{self.log(name)[-3000:]}")
                try:
                    with urllib.request.urlopen(f"{m.client_url}/health", timeout=1, context=context) as resp:
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
def etcd_cluster(members: int = 1, *, tls: bool = False, extra_args: tuple[str, ...] = ()) -> Iterator[EtcdCluster]:
    """Start `members` etcd processes forming one cluster on loopback; stop them all on exit.
    `tls`: clients on https with client certificates of `cluster.pki` required.
    `extra_args`: more flags for every member (e.g. a lowered --max-request-bytes)."""
    base = Path(tempfile.mkdtemp(prefix="fabric-etcd-"))
    cluster: EtcdCluster | None = None
    try:
        pki = TestPki(base / "pki") if tls else None
        scheme = "https" if tls else "http"
        ms = []
        for i in range(members):
            name = f"m{i}"
            ms.append(
                EtcdMember(
                    name=name,
                    client_url=f"{scheme}://127.0.0.1:{free_port()}",
                    peer_url=f"http://127.0.0.1:{free_port()}",
                    data_dir=base / name,
                    log_path=base / f"{name}.log",
                )
            )
        initial = ",".join(f"{m.name}={m.peer_url}" for m in ms)
        cluster = EtcdCluster(members=ms, initial_cluster=initial, base=base, pki=pki, extra_args=extra_args)
        for m in ms:
            cluster.start(m.name)
        cluster.wait_healthy()
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop_all()
        shutil.rmtree(base, ignore_errors=True)


def etcdctl_env(cluster: EtcdCluster, identity: str = "root") -> dict[str, str]:
    """Environment for running `etcdctl` (v3 API) against the cluster (as CN=`identity` in TLS mode)."""
    env = {**os.environ, "ETCDCTL_API": "3", "ETCDCTL_ENDPOINTS": ",".join(cluster.endpoints)}
    if cluster.pki is not None:
        tls = cluster.tls_settings(identity)
        env.update(ETCDCTL_CACERT=tls["ca_file"], ETCDCTL_CERT=tls["cert_file"], ETCDCTL_KEY=tls["key_file"])
    return env
