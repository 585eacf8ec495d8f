"""The etcd backend against a real three-member cluster on loopback, an
unreachable cluster, and a TLS member with client certificates."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from reconciler.adapters.clock import SystemClock
from reconciler.adapters.registry_etcd import TXN_CHUNK_OPS, TXN_IN_FLIGHT, EtcdRegistry
from reconciler.core.desired.model import FlapSettings, TimingSettings
from reconciler.core.live.models import FleetPlan
from reconciler.core.live.records import NodeRecord
from reconciler.core.scheduling.lifecycle import NodeState
from reconciler.ports import NotLeader, RegistryUnavailable
from tests.conftest import require
from tests.support.harness.etcd import EtcdCluster, etcd_cluster, free_port
from tests.support.harness.etcd_requests import recording_requests
from tests.support.harness.waiting import deadline_for, wait_until

pytestmark = pytest.mark.integration

# A record's or a term's TTL that must outlast the few calls a test makes
# after setting it, on a loaded machine and while a client fails over.
SHORT_TTL_S = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    require("etcd")
    with etcd_cluster(members=3) as c:
        yield c


def open_etcd(endpoints: list[str], **kw) -> EtcdRegistry:
    return EtcdRegistry(
        endpoints,
        prefix=kw.pop("prefix", f"/t{uuid.uuid4().hex[:12]}"),
        timing=TimingSettings(),
        flap=FlapSettings(),
        clock=SystemClock(),
        **kw,
    )


def a_plan() -> FleetPlan:
    return FleetPlan(epoch=0, leader="whoever", created=datetime.now(UTC))


def status_of(registry: EtcdRegistry, node: str) -> str | None:
    return next((s.status for s in registry.node_states() if s.node_id == node), None)


def test_stopping_one_of_three_members_keeps_the_registry_working(cluster):
    # The first endpoint is the member that will be stopped: the client must move on.
    registry = open_etcd(cluster.endpoints, op_timeout_s=2.0)
    try:
        term = registry.campaign("lux", 10)
        registry.heartbeat(NodeRecord(node_id="qfox-1", tier="gpu_cuda"), ttl_s=30)
        before = registry.publish_plan(term, a_plan())
        registry.wait_for_change(0)

        cluster.stop("m0")
        assert not cluster.member("m0").running

        # Reads, beats, fenced writes, drains and the watch all still work.
        registry.heartbeat(NodeRecord(node_id="qfox-1", tier="gpu_cuda"), ttl_s=30)
        registry.heartbeat(NodeRecord(node_id="lux", tier="cpu_ffmpeg"), ttl_s=SHORT_TTL_S)
        assert registry.renew(term)
        after = registry.publish_plan(term, a_plan())
        assert after.epoch > before.epoch
        assert registry.set_drain("qfox-1", reason="quorum test") is not None and registry.clear_drain("qfox-1")
        assert {s.node_id: s.status for s in registry.node_states()} == {"qfox-1": "active", "lux": "active"}
        # A record still expires by its lease on the two-member quorum, and the watch sees it.
        wait_until(lambda: status_of(registry, "lux") == "offline", timeout=deadline_for(SHORT_TTL_S), what="lux offline on the remaining members")
        assert registry.leader().candidate == "lux"
        # A second client given only the stopped member and one live one also works.
        other = open_etcd([cluster.member("m0").client_url, cluster.member("m2").client_url], prefix=registry._prefix)
        try:
            assert other.leader().candidate == "lux"
            assert other.newest_plan().epoch == after.epoch
        finally:
            other.close()
    finally:
        registry.close()
        cluster.start("m0")
        cluster.wait_healthy(["m0"])


def test_a_leader_elected_on_three_members_fails_over_after_its_lease(cluster):
    a = open_etcd(cluster.endpoints)
    b = open_etcd(list(reversed(cluster.endpoints)), prefix=a._prefix)
    try:
        old = a.campaign("lux", SHORT_TTL_S)
        assert b.campaign("qfox-1", SHORT_TTL_S) is None
        b.wait_for_change(0)
        assert b.wait_for_change(deadline_for(SHORT_TTL_S)), "the leader key's expiry wakes the follower"
        new = b.campaign("qfox-1", 5)
        assert new is not None and new.epoch > old.epoch
    finally:
        a.close()
        b.close()


def test_an_unreachable_registry_raises_registry_unavailable():
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    registry = open_etcd(dead, op_timeout_s=1.0)
    try:
        for call in (
            lambda: registry.heartbeat(NodeRecord(node_id="lux", tier="relay")),
            registry.snapshot,
            registry.leader,
            lambda: registry.campaign("lux", 5),
            lambda: registry.set_drain("lux"),
        ):
            with pytest.raises(RegistryUnavailable, match="no etcd endpoint answers"):
                call()
    finally:
        registry.close()


def _closing_its_channel(registry: EtcdRegistry, times: int) -> tuple[Callable[[Any], Awaitable[Any]], list[object]]:
    """A read during which, the first `times` times, the client is dropped
    (its gRPC channel closed) as another call's failover does: the read in
    flight is cancelled by gRPC under the request."""
    clients: list[object] = []

    async def read(client: Any) -> Any:
        clients.append(client)
        if len(clients) <= times:
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(registry._drop_client()))
        return await client.get(b"/fabric-test/nothing")

    return read, clients


def test_a_request_whose_connection_another_call_closes_is_tried_again_on_a_fresh_one(cluster: EtcdCluster) -> None:
    """Seen in the fleet: etcd stopped, one call's failover closed the channel
    another was reading on, and gRPC's cancellation reached `fabric leader
    run` as a CancelledError that killed it."""
    registry = open_etcd(cluster.endpoints)
    try:
        read, clients = _closing_its_channel(registry, times=1)
        assert registry._call(read) is None
        assert len(clients) == 2 and clients[0] is not clients[1], clients
        # Closed under it again and again: an outage to the caller, never a CancelledError.
        read, clients = _closing_its_channel(registry, times=10)
        with pytest.raises(RegistryUnavailable, match="closed under the request"):
            registry._call(read)
        assert len(clients) == 2
        assert registry.leader() is None  # and the next request is served (no leader under this prefix)
    finally:
        registry.close()


# -- TLS -----------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_pki(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "1", "-subj", "/CN=fabric-test-ca", cwd=d)  # fmt: skip
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"), ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=fabric-{name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "1", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    (d / "client.key").chmod(0o600)


def test_tls_with_client_certificates(tmp_path):
    require("etcd", "openssl")
    _make_pki(tmp_path)
    client_port, peer_port = free_port(), free_port()
    url = f"https://127.0.0.1:{client_port}"
    log = open(tmp_path / "etcd.log", "wb")
    proc = subprocess.Popen(
        [
            "etcd",
            "--name",
            "tls",
            "--data-dir",
            str(tmp_path / "data"),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer_port}",
            "--initial-cluster",
            f"tls=http://127.0.0.1:{peer_port}",
            "--cert-file",
            str(tmp_path / "server.crt"),
            "--key-file",
            str(tmp_path / "server.key"),
            "--trusted-ca-file",
            str(tmp_path / "ca.crt"),
            "--client-cert-auth",
        ],  # fmt: skip
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        registry = open_etcd(
            [url],
            ca_file=str(tmp_path / "ca.crt"),
            cert_file=str(tmp_path / "client.crt"),
            key_file=str(tmp_path / "client.key"),
        )
        try:
            wait_until(lambda: _answers(registry), timeout=30, what="the TLS member answers")
            registry.heartbeat(NodeRecord(node_id="lux", tier="relay"), ttl_s=30)
            assert [s.node_id for s in registry.node_states()] == ["lux"]
        finally:
            registry.close()
        # Without the client certificate the member refuses the connection.
        anonymous = open_etcd([url], ca_file=str(tmp_path / "ca.crt"), op_timeout_s=1.0)
        try:
            with pytest.raises(RegistryUnavailable):
                anonymous.leader()
        finally:
            anonymous.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def _answers(registry: EtcdRegistry) -> bool:
    try:
        registry.leader()
        return True
    except RegistryUnavailable:
        return False


def test_heartbeat_lease_ttl_is_the_node_timeout_and_longer_for_relayed_nodes(cluster):
    registry = open_etcd(cluster.endpoints)
    try:
        direct = registry.heartbeat(NodeRecord(node_id="lux", tier="cpu_ffmpeg"))
        relayed = registry.heartbeat(NodeRecord(node_id="racknerd", tier="relay", relayed=True))
        assert (direct.timeout_s, relayed.timeout_s) == (90, 135)

        async def granted(c, node: str) -> tuple[int, int]:
            kv = await c.get(registry._key("nodes", node))
            info = await c.get_lease_info(kv.lease, keys=False)
            return kv.lease, info.grantedTTL

        lux_lease, lux_ttl = registry._call(lambda c: granted(c, "lux"))
        _, racknerd_ttl = registry._call(lambda c: granted(c, "racknerd"))
        assert (lux_ttl, racknerd_ttl) == (90, 135)
        registry.heartbeat(NodeRecord(node_id="lux", tier="cpu_ffmpeg"))
        assert registry._call(lambda c: granted(c, "lux"))[0] == lux_lease, "a live node keeps its lease"
    finally:
        registry.close()


def test_a_deposed_leader_sends_no_lifecycle_chunk_after_its_fence_failed(cluster: EtcdCluster) -> None:
    """The lifecycle goes in chunks, TXN_IN_FLIGHT at a time: once a fence
    fails (the term is over), no further chunk is sent and nothing is stored."""
    registry = open_etcd(cluster.endpoints)
    try:
        leadership = registry.campaign("lux", 30)
        assert leadership is not None
        registry.resign(leadership)
        now = datetime.now(UTC)
        many = TXN_CHUNK_OPS * TXN_IN_FLIGHT * 3
        states = {f"n{i:05d}": NodeState(node_id=f"n{i:05d}", status="active", since=now) for i in range(many)}
        with recording_requests() as seen:
            fenced = open_etcd(cluster.endpoints, prefix=registry._prefix)
            try:
                with pytest.raises(NotLeader):
                    fenced._store_lifecycle(leadership, states, set(), set())
            finally:
                fenced.close()
        assert 0 < seen.transactions <= TXN_IN_FLIGHT, seen
        assert registry._read().states == {}
    finally:
        registry.close()
