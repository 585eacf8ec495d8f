"""The leader's in-memory view of the etcd registry (registry_etcd_view)
against a real etcd: after puts, deletes, a lease's expiry, garbage, a
compaction and a broken watch, a read from the view is the same as a full
read (a registry without the view, `informer=False`) at the same moment."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest

from reconciler.adapters.clock import SystemClock
from reconciler.adapters.registry_etcd import EtcdRegistry, _current_revision, _server_version
from reconciler.adapters.registry_etcd_view import RegistryView, progress_is_trusted
from reconciler.core.desired.model import FlapSettings, TimingSettings
from reconciler.core.live.records import NodeRecord
from tests.conftest import require
from tests.support.harness.etcd import EtcdCluster, etcd_cluster
from tests.support.harness.waiting import deadline_for, wait_until

pytestmark = pytest.mark.integration

SHORT_TTL_S = 2


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    require("etcd")
    with etcd_cluster(members=1) as c:
        yield c


@pytest.fixture
def pair(cluster) -> Iterator[tuple[EtcdRegistry, EtcdRegistry]]:
    """(a registry reading through its view, one reading whole) on one prefix."""
    prefix = f"/v{uuid.uuid4().hex[:12]}"
    kw = dict(prefix=prefix, timing=TimingSettings(), flap=FlapSettings(), clock=SystemClock())
    informed = EtcdRegistry(cluster.endpoints, **kw)
    whole = EtcdRegistry(cluster.endpoints, informer=False, **kw)
    try:
        yield informed, whole
    finally:
        informed.close()
        whole.close()


def seen(registry: EtcdRegistry) -> tuple:
    """What a leader takes from a read, without the read's own instant."""
    read = registry._read()
    return (
        read.records,
        read.alive,
        {n: s.model_dump() for n, s in read.states.items()},
        read.drains,
        read.plan,
        read.leader,
        read.epoch,
        sorted((p.key, p.reason) for p in read.problems),
    )


def same(informed: EtcdRegistry, whole: EtcdRegistry) -> None:
    assert seen(informed) == seen(whole)


def raw_put(registry: EtcdRegistry, key: str, value: bytes) -> None:
    async def op(c):
        await c.put(registry._key(key), value)

    registry._call(op)


def test_the_view_follows_puts_deletes_drains_and_the_lifecycle(pair):
    informed, whole = pair
    informed.heartbeat(NodeRecord(node_id="qfox-1", tier="gpu_cuda"), ttl_s=30)
    same(informed, whole)
    assert informed.full_reads == 1
    term = informed.campaign("lux", 30)
    assert term is not None
    informed.heartbeat(NodeRecord(node_id="qfox-2", tier="gpu_cuda"), ttl_s=30)
    whole.set_drain("qfox-1", reason="view test")
    informed.lead(term)
    same(informed, whole)
    whole.clear_drain("qfox-1")
    informed.lead(term)
    same(informed, whole)
    # Every read after the first came from the view, and each saw this leader's own writes.
    assert informed.full_reads == 1 and informed.view_reads >= 3


def test_a_lapsed_lease_is_a_delete_and_the_node_goes_offline(pair):
    informed, whole = pair
    term = informed.campaign("lux", 30)
    informed.heartbeat(NodeRecord(node_id="qfox-1", tier="gpu_cuda"), ttl_s=SHORT_TTL_S)
    informed.lead(term)
    assert informed._read().alive == {"qfox-1"}

    def offline() -> bool:
        informed.lead(term)
        return next(s.status for s in informed.node_states() if s.node_id == "qfox-1") == "offline"

    wait_until(offline, timeout=deadline_for(SHORT_TTL_S * 3), what="qfox-1 offline through the view")
    # etcd revokes the lease up to its lessor's check interval after the beat's own expiry.
    wait_until(
        lambda: informed._read() is not None and b"qfox-1" not in informed._view.beats,
        timeout=deadline_for(5),
        what="the lease's expiry reached the view as a delete",
    )
    same(informed, whole)
    assert informed.full_reads == 1


def test_garbage_is_still_skipped_and_named_through_the_view(pair):
    informed, whole = pair
    informed.heartbeat(NodeRecord(node_id="qfox-1", tier="gpu_cuda"), ttl_s=30)
    informed._read()
    raw_put(whole, "facts/qfox-9", b"{not json")
    raw_put(whole, "state/qfox-1", b'{"node_id": 7}')
    problems = {p.key: p.reason for p in informed._read().problems}
    assert "facts/qfox-9" in problems and "state/qfox-1" in problems, problems
    same(informed, whole)
    assert informed.full_reads == 1


def test_a_compaction_past_the_view_makes_the_next_read_whole(pair):
    informed, whole = pair
    informed.heartbeat(NodeRecord(node_id="qfox-1", tier="gpu_cuda"), ttl_s=30)
    informed._read()
    view = informed._view
    assert view is not None

    # The watch breaks (here: cancelled, as a dropped client ends it) and
    # changes happen while no watch follows them.
    async def stop(c):
        await view.stop()

    informed._call(stop)
    whole.heartbeat(NodeRecord(node_id="qfox-2", tier="gpu_cuda"), ttl_s=30)
    raw_put(whole, "state/qfox-3", b"garbage")

    # etcd compacts the history past them: a watch from the view's revision cannot resume.
    async def compact(c):
        await c.compact(await _current_revision(c, informed._key("epoch")), physical=True)

    informed._call(compact)
    same(informed, whole)
    assert informed.full_reads == 2, "a broken view is never read: the next read is whole"
    assert informed._view is not view and informed._view.failure is None


def test_a_watch_that_etcd_refuses_as_compacted_leaves_no_stale_view(pair):
    informed, whole = pair
    informed.heartbeat(NodeRecord(node_id="qfox-1", tier="gpu_cuda"), ttl_s=30)
    informed._read()
    whole.heartbeat(NodeRecord(node_id="qfox-2", tier="gpu_cuda"), ttl_s=30)

    # A view that fell behind a compaction (here: one from revision 1, its
    # keys as of then): etcd refuses its watch, the view fails and is not read.
    async def behind(c):
        await informed._view.stop()
        await c.compact(await _current_revision(c, informed._key("epoch")), physical=True)
        view = informed._view = RegistryView(informed._prefix.encode() + b"/", [], [], 1, informed._preparse)
        view.task = asyncio.get_running_loop().create_task(view.follow(c.channel, c.metadata))
        return view

    view = informed._call(behind)
    wait_until(lambda: view.failure is not None, timeout=deadline_for(5), what="the compacted watch refused")
    assert "compacted" in view.failure, view.failure
    same(informed, whole)
    assert informed.full_reads == 2


def test_a_read_sees_every_write_made_before_it(pair):
    """Read-your-writes, and anyone's: each read waits until the view reached
    etcd's revision at the read, so a value put just before is always there."""
    informed, whole = pair
    informed.heartbeat(NodeRecord(node_id="qfox-1", tier="gpu_cuda"), ttl_s=30)
    informed._read()
    for n in range(40):
        whole.set_drain("qfox-1", reason=f"drain {n}")
        assert informed._read().drains["qfox-1"].reason == f"drain {n}", f"read {n} missed the write before it"
    assert informed.full_reads == 1


def test_a_new_view_sees_the_writes_made_right_after_its_full_read(pair):
    """The race behind etcd issue 15220 (test_registry_parity's drain test saw
    it once): a view's watch is new, the leader and a host write at once, and
    the next read asks for progress while those events are still queued. An
    etcd that answers out of band (before 3.4.31 / 3.5.13) is not asked."""
    informed, whole = pair
    informed.heartbeat(NodeRecord(node_id="qfox-1", tier="gpu_cuda"), ttl_s=30)
    informed._read()
    version = informed._call(_server_version)
    assert version, "etcd's Status names its version"
    assert informed._view.progress_trusted is progress_is_trusted(version)

    async def drop(c):
        await informed._view.stop()

    for n in range(40):
        informed._call(drop)
        informed._read()  # whole: a new view, its watch just created
        whole.set_drain("qfox-1", reason=f"drain {n}")
        raw_put(whole, "state/qfox-1", f'{{"node_id": "qfox-1", "status": "draining", "n": {n}}}'.encode())
        read = informed._read()
        assert read.drains["qfox-1"].reason == f"drain {n}", f"round {n}: the view served a state older than the writes before the read"
    assert informed.view_reads >= 40
