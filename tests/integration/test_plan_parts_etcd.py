"""The plan in parts on a real etcd with its default limits (issue 34, item 1).

A plan of 20,000 placements and a plan with 30,000 replicas of one service
(nearly all deferred) are published through the real adapter, signed, and
read back identically (`newest_plan` and the full read's snapshot); every
request the adapter sends stays within etcd's defaults (a transaction of at
most 128 operations, a request under 1.5 MiB: recorded at the client stub);
a second epoch that changes one node's placements rewrites only that part
(every other part keeps its etcd mod revision); a part that is not the
index's (a part of another epoch, or tampered) is refused and named; and a
reader never sees a mix of two epochs while a leader alternates two plans.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from aetcd import utils

from reconciler.adapters import registry_etcd
from reconciler.adapters.registry_etcd import EtcdRegistry, _read_range
from reconciler.core.desired.model import PlanKey
from reconciler.core.live.models import Deferred, FleetPlan, Placement
from reconciler.core.live.plan_parts import plan_index, plan_parts
from reconciler.core.live.records import Leadership
from reconciler.core.live.signing import canonical_plan, verify_plan, with_signature
from reconciler.ports import RegistryError
from tests.support.harness.etcd import EtcdCluster
from tests.support.harness.etcd_requests import recording_requests
from tests.support.plan_keys import TestKey
from tests.support.registry_store import Store

pytestmark = pytest.mark.integration

ETCD_MAX_TXN_OPS = 128
ETCD_MAX_REQUEST_BYTES = 1536 * 1024
LUX = TestKey("lux", "lux-test")
KEYS = [PlanKey(host=LUX.host, id=LUX.id, public_key=LUX.public_b64)]
T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


@pytest.fixture
def registry(etcd: EtcdCluster) -> Iterator[EtcdRegistry]:
    store = Store("etcd", {"backend": "etcd", "endpoints": etcd.endpoints, "prefix": f"/t{uuid.uuid4().hex[:12]}"}, None)
    opened = store.open()
    assert isinstance(opened, EtcdRegistry)
    try:
        yield opened
    finally:
        opened.close()


def lead(registry: EtcdRegistry) -> Leadership:
    leadership = registry.campaign("lux", 600)
    assert leadership is not None
    return leadership


def publish_signed(registry: EtcdRegistry, leadership: Leadership, plan: FleetPlan) -> FleetPlan:
    """As the leader does: signed under the epoch the registry will give it."""
    numbered = plan.model_copy(update={"epoch": registry.epoch() + 1, "leader": "lux", "term": leadership.term})
    signed = with_signature(numbered, LUX.id, LUX.private.sign(canonical_plan(numbered)))
    stored = registry.publish_plan(leadership, signed)
    assert stored.epoch == numbered.epoch and verify_plan(stored, KEYS) is None
    return stored


def twenty_thousand() -> FleetPlan:
    # 5,000 nodes, 4 replicas of 4 services each: 20,000 placements.
    placements = [Placement(service=f"svc-{s}", replica=n, node=f"node-{n:05d}", tier="cpu_ffmpeg") for s in range(4) for n in range(5000)]
    return FleetPlan(epoch=0, leader="lux", created=T0, placements=placements)


def thirty_thousand_replicas() -> FleetPlan:
    placed = [Placement(service="transcode", replica=r, node=f"node-{r:03d}", tier="cpu_ffmpeg") for r in range(40)]
    deferred = [Deferred(service="transcode", replica=r, reason="no node with a free slot at tier cpu_ffmpeg or above") for r in range(40, 30_000)]
    return FleetPlan(epoch=0, leader="lux", created=T0, placements=placed, deferred=deferred)


def assert_within_limits(seen) -> None:  # type: ignore[no-untyped-def]
    assert seen.largest_txn_ops <= ETCD_MAX_TXN_OPS, seen
    assert seen.largest_txn_compares_plus_writes <= ETCD_MAX_TXN_OPS, seen
    assert seen.largest_request_bytes < ETCD_MAX_REQUEST_BYTES, seen


@pytest.mark.parametrize("make", [twenty_thousand, thirty_thousand_replicas], ids=["20000-placements", "30000-replicas-deferred"])
def test_a_large_plan_is_published_within_the_defaults_and_read_back_identically(registry: EtcdRegistry, make) -> None:  # type: ignore[no-untyped-def]
    plan = make()
    whole = len(plan.model_dump_json())
    assert whole > ETCD_MAX_REQUEST_BYTES, f"the plan ({whole} bytes) would not fit one request"
    with recording_requests() as seen:
        leadership = lead(registry)
        stored = publish_signed(registry, leadership, plan)
        read = registry.newest_plan()
        snapshot = registry.snapshot()
    assert read == stored
    assert read is not None and verify_plan(read, KEYS) is None
    assert sorted(read.placements, key=str) == sorted(plan.placements, key=str) and read.deferred == plan.deferred
    assert sorted(snapshot.placements, key=str) == sorted(plan.placements, key=str)
    assert_within_limits(seen)
    print(
        f"\n{make.__name__}: whole plan {whole} bytes; {len(plan_parts(plan))} parts; largest request {seen.largest_request_bytes} bytes ({seen.largest_request}), largest txn {seen.largest_txn_ops} ops, {seen.transactions} transactions"
    )


def part_revisions(registry: EtcdRegistry) -> dict[str, int]:
    start = f"{registry._prefix}/plan-parts/".encode()

    async def op(c):  # type: ignore[no-untyped-def]
        kvs, _ = await _read_range(c, start, utils.prefix_range_end(start), 0, keys_only=True)
        return kvs

    return {kv.key[len(start) :].decode(): kv.mod_revision for kv in registry._call(op, "reading the parts")}


def test_an_epoch_rewrites_only_the_parts_that_changed(registry: EtcdRegistry) -> None:
    plan = twenty_thousand()
    leadership = lead(registry)
    first = publish_signed(registry, leadership, plan)
    before = part_revisions(registry)
    assert len(before) == len(plan_index(first).parts)
    moved = [p.model_copy(update={"node": "node-00001"}) if p.node == "node-00000" else p for p in plan.placements]
    with recording_requests() as seen:
        second = publish_signed(registry, leadership, plan.model_copy(update={"placements": moved}))
    after = part_revisions(registry)
    assert registry.newest_plan() == second
    rewritten = {d for d, rev in after.items() if before.get(d) != rev}
    assert len(rewritten) == 1, "only node-00001's part is new (node-00000 has none any more)"
    assert set(before) - set(after) == {plan_index(first).parts["host/node-00000/0"], plan_index(first).parts["host/node-00001/0"]}, (
        "the parts no index names are gone"
    )
    assert_within_limits(seen)
    assert seen.transactions <= 4, f"one part put, the index, the drop of two parts: {seen}"


def test_a_part_not_the_indexs_is_refused_and_named(registry: EtcdRegistry) -> None:
    leadership = lead(registry)
    stored = publish_signed(registry, leadership, twenty_thousand())
    digest = plan_index(stored).parts["host/node-00042/0"]
    key = f"{registry._prefix}/plan-parts/{digest}".encode()
    other = stored.model_copy(
        update={"placements": [p.model_copy(update={"replica": p.replica + 1}) for p in stored.placements if p.node == "node-00042"]}
    )

    async def put(c):  # type: ignore[no-untyped-def]
        await c.put(key, plan_parts(other)["host/node-00042/0"])

    registry._call(put, "a part of another plan under this one's digest")
    with pytest.raises(
        RegistryError, match=r"plan part host/node-00042/0: its digest is not the index's \(a part of another epoch, or tampered\): refused"
    ):
        registry.newest_plan()
    snapshot = registry.snapshot()
    assert snapshot.placements == []
    assert [p.line() for p in snapshot.unreadable if p.what == "plan"][0].endswith(
        "its digest is not the index's (a part of another epoch, or tampered): refused"
    )

    async def delete(c):  # type: ignore[no-untyped-def]
        await c.delete(key)

    registry._call(delete, "a part gone")
    with pytest.raises(RegistryError, match=r"plan part host/node-00042/0 of epoch \d+ is missing"):
        registry.newest_plan()


def test_a_reader_never_sees_a_mix_of_two_epochs(registry: EtcdRegistry, etcd: EtcdCluster) -> None:
    """A leader alternates two plans of 3,000 placements that differ on every
    node (each publish several transactions of parts); a second connection
    reads all along: every read is one of the two, whole."""
    a = FleetPlan(
        epoch=0, leader="lux", created=T0, placements=[Placement(service="a", replica=n, node=f"n{n:04d}", tier="cpu_ffmpeg") for n in range(3000)]
    )
    b = a.model_copy(update={"placements": [p.model_copy(update={"service": "b"}) for p in a.placements]})
    leadership = lead(registry)
    publish_signed(registry, leadership, a)
    reader = EtcdRegistry(endpoints=etcd.endpoints, prefix=registry._prefix, timing=registry.timing, flap=registry.flap, clock=registry._clock)
    stop = threading.Event()
    seen: list[str] = []
    failures: list[str] = []

    def read() -> None:
        while not stop.is_set():
            try:
                plan = reader.newest_plan()
            except RegistryError as exc:
                failures.append(str(exc))
                continue
            assert plan is not None
            kinds = {p.service for p in plan.placements}
            seen.append("".join(sorted(kinds)) if len(plan.placements) == 3000 else f"partial {len(plan.placements)}")

    thread = threading.Thread(target=read)
    thread.start()
    try:
        for i in range(6):
            publish_signed(registry, leadership, b if i % 2 == 0 else a)
    finally:
        stop.set()
        thread.join(timeout=60)
        reader.close()
    assert not failures, failures[:3]
    assert seen and set(seen) <= {"a", "b"}, sorted(set(seen))


def test_a_reader_takes_the_parts_at_its_indexs_revision_even_once_a_newer_epoch_dropped_them(
    registry: EtcdRegistry, etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deterministic: a new epoch is published (its parts put, the old ones
    deleted) between the reader's read of the index and its read of the
    parts. The reader still gets the whole plan of the index it read."""
    a = FleetPlan(
        epoch=0, leader="lux", created=T0, placements=[Placement(service="a", replica=n, node=f"n{n:03d}", tier="cpu_ffmpeg") for n in range(300)]
    )
    b = a.model_copy(update={"placements": [p.model_copy(update={"service": "b"}) for p in a.placements]})
    leadership = lead(registry)
    first = publish_signed(registry, leadership, a)
    reader = EtcdRegistry(endpoints=etcd.endpoints, prefix=registry._prefix, timing=registry.timing, flap=registry.flap, clock=registry._clock)
    original = registry_etcd._read_range
    reads = {"reader": 0}
    published: list[FleetPlan] = []

    async def index_then_publish(c, start, end, revision, **kwargs):  # type: ignore[no-untyped-def]
        result = await original(c, start, end, revision, **kwargs)
        if c is reader._client and start.endswith(b"/plan-index"):
            reads["reader"] += 1
            # The index was read: a new epoch lands before the parts are read.
            published.append(await asyncio.to_thread(publish_signed, registry, leadership, b))
        return result

    monkeypatch.setattr(registry_etcd, "_read_range", index_then_publish)
    try:
        read = reader.newest_plan()
    finally:
        monkeypatch.setattr(registry_etcd, "_read_range", original)
        reader.close()
    assert reads["reader"] == 1 and len(published) == 1
    assert read == first, "the plan of the index it read, whole"
    assert registry.newest_plan() == published[0]
    only_a = set(plan_index(first).parts.values()) - set(plan_index(published[0]).parts.values())
    assert len(only_a) == 300 and not only_a & set(part_revisions(registry)), "a's host parts were deleted meanwhile"
