"""A host reads only its part of the plan (issue 34, item 2), on sqlite and a real etcd.

A signed plan of 20,000 placements on 5,000 nodes is published through the
real adapter; a host's read (`plan_read`) then fetches the index and its
own parts and nothing else: every etcd Range request and every sqlite
statement of the read is recorded, and no other part's key or digest is
asked for. The read is the index's (its signature verifies, the plan is
the index's to the byte) and holds exactly the host's placements. A part
of this host that is garbled, missing or replaced by another's is refused
and named; another host's part garbled does not touch this host's read.
The watcher's glance (`plan_glance`) fetches the index alone.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

import pytest

from reconciler.adapters import registry_etcd
from reconciler.adapters.registry_etcd import EtcdRegistry
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.model import PlanKey
from reconciler.core.live.models import FleetPlan, Placement
from reconciler.core.live.plan_parts import PlanIndex, host_part_names, partial_problem, plan_index
from reconciler.core.live.records import Leadership
from reconciler.core.live.signing import canonical_plan, verify_index, with_signature
from reconciler.ports import Registry, RegistryError
from tests.support.harness.etcd import EtcdCluster
from tests.support.plan_keys import TestKey
from tests.support.registry_store import Store

pytestmark = pytest.mark.integration

LUX = TestKey("lux", "lux-test")
KEYS = [PlanKey(host=LUX.host, id=LUX.id, public_key=LUX.public_b64)]
T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
HOST = "node-00042"


def twenty_thousand() -> FleetPlan:
    # 5,000 nodes, 4 services on each: 20,000 placements.
    placements = [Placement(service=f"svc-{s}", replica=n, node=f"node-{n:05d}", tier="cpu_ffmpeg") for s in range(4) for n in range(5000)]
    return FleetPlan(epoch=0, leader="lux", created=T0, placements=placements)


def publish_signed(registry: Registry, plan: FleetPlan) -> tuple[Leadership, FleetPlan]:
    leadership = registry.campaign("lux", 600)
    assert leadership is not None
    numbered = plan.model_copy(update={"epoch": registry.epoch() + 1, "leader": "lux", "term": leadership.term})
    signed = with_signature(numbered, LUX.id, LUX.private.sign(canonical_plan(numbered)))
    return leadership, registry.publish_plan(leadership, signed)


@contextmanager
def keys_read(registry: Registry) -> Iterator[list[str]]:
    """What the registry asks its store for inside the block: etcd's Range
    keys (every request at the client stub), sqlite's statements."""
    seen: list[str] = []
    if isinstance(registry, SqliteRegistry):
        registry._db.set_trace_callback(seen.append)
        try:
            yield seen
        finally:
            registry._db.set_trace_callback(None)
        return
    assert isinstance(registry, EtcdRegistry)
    original = registry_etcd._read_range

    async def recording(c, start, end, revision, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(f"{start.decode()}..{end.decode(errors='replace')}")
        return await original(c, start, end, revision, **kwargs)

    registry_etcd._read_range = recording  # type: ignore[assignment]
    try:
        yield seen
    finally:
        registry_etcd._read_range = original


def own(index: PlanIndex) -> list[str]:
    return host_part_names(index, HOST)


@pytest.fixture
def published(store: Store) -> Iterator[tuple[Registry, FleetPlan]]:
    registry = store.open()
    _, stored = publish_signed(registry, twenty_thousand())
    yield registry, stored


def test_a_host_reads_the_index_and_its_own_parts_and_nothing_else(published: tuple[Registry, FleetPlan]) -> None:
    registry, stored = published
    index = plan_index(stored)
    mine = {index.parts[name] for name in own(index)}
    others = set(index.parts.values()) - mine
    with keys_read(registry) as seen:
        read = registry.plan_read(own)
    assert read is not None and read.parts == ("host/node-00042/0",)
    assert sorted(read.plan.placements, key=str) == sorted((p for p in stored.placements if p.node == HOST), key=str)
    assert verify_index(read.index, KEYS) is None and partial_problem(read.plan, read.index, HOST) is None
    asked = "\n".join(seen)
    assert all(digest in asked for digest in mine)
    assert not [digest for digest in others if digest in asked], "no other host's part is read"
    if isinstance(registry, EtcdRegistry):
        # The index, then one key per own part: no range over the parts.
        assert len(seen) == 1 + len(mine), seen
        assert seen[0].startswith(f"{registry._prefix}/plan-index..")
    else:
        assert len([s for s in seen if "plan_parts" in s]) == 1, seen
    with keys_read(registry) as seen:
        index_only = registry.plan_read(lambda index: ())
    assert index_only is not None and index_only.parts == () and index_only.plan.placements == []
    assert index_only.index.parts == index.parts
    if isinstance(registry, EtcdRegistry):
        assert len(seen) == 1, seen
    # The watcher's glance: the index alone, this host's digests found in it.
    with keys_read(registry) as seen:
        glance = registry.plan_glance(HOST)
    assert glance == (stored.epoch, {name: index.parts[name] for name in own(index)})
    assert not [s for s in seen if "plan-parts" in s or "plan_parts" in s], seen


def corrupt(registry: Registry, digest: str, value: bytes | None) -> None:
    """Put `value` (None: delete) under the part key `digest`, as a hostile registry writer would."""
    if isinstance(registry, SqliteRegistry):
        with registry._tx() as db:
            if value is None:
                db.execute("DELETE FROM plan_parts WHERE digest = ?", (digest,))
            else:
                db.execute("UPDATE plan_parts SET part = ? WHERE digest = ?", (value, digest))
        return
    assert isinstance(registry, EtcdRegistry)
    key = registry._key("plan-parts", digest)

    async def op(c):  # type: ignore[no-untyped-def]
        if value is None:
            await c.delete(key)
        else:
            await c.put(key, value)

    registry._call(op, "corrupting a part")


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (b"{not json", "plan part host/node-00042/0: its digest is not the index's"),
        (None, "plan part host/node-00042/0 of epoch {epoch} is missing"),
        (b'{"placements":[]}', "plan part host/node-00042/0: its digest is not the index's"),
    ],
    ids=["garbled", "missing", "another"],
)
def test_a_bad_part_of_this_host_is_refused_and_named(published: tuple[Registry, FleetPlan], value: bytes | None, named: str) -> None:
    registry, stored = published
    index = plan_index(stored)
    corrupt(registry, index.parts["host/node-00042/0"], value)
    with pytest.raises(RegistryError, match="unreadable plan") as caught:
        registry.plan_read(own)
    assert named.format(epoch=stored.epoch) in str(caught.value)


def test_another_hosts_bad_part_does_not_touch_this_hosts_read(published: tuple[Registry, FleetPlan]) -> None:
    registry, stored = published
    index = plan_index(stored)
    corrupt(registry, index.parts["host/node-00043/0"], b"garbage")
    read = registry.plan_read(own)
    assert read is not None and len(read.plan.placements) == 4
    with pytest.raises(RegistryError, match="host/node-00043/0"):
        registry.newest_plan()  # the whole plan's reader still refuses it


def test_a_garbled_index_is_refused_and_named(store: Store) -> None:
    registry = store.open()
    publish_signed(registry, twenty_thousand())
    if isinstance(registry, SqliteRegistry):
        with registry._tx() as db:
            db.execute("UPDATE plan_index SET plan_index = ? WHERE id = 1", (f"garbage {uuid.uuid4()}",))
    else:
        assert isinstance(registry, EtcdRegistry)
        key = registry._key("plan-index")

        async def op(c):  # type: ignore[no-untyped-def]
            await c.put(key, b"garbage")

        registry._call(op, "corrupting the index")
    with pytest.raises(RegistryError, match="unreadable plan"):
        registry.plan_read(own)
    with pytest.raises(RegistryError, match="unreadable plan"):
        registry.plan_glance(HOST)


def test_a_hosts_read_takes_its_parts_at_the_indexs_revision_even_once_a_newer_epoch_dropped_them(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd, deterministic: a new epoch that moves this host's work (its part
    rewritten, the old one deleted) is published between the host's read of
    the index and its read of its part: the host still reads the part of the
    index it read, never a mix of two epochs."""
    store = Store("etcd", {"backend": "etcd", "endpoints": etcd.endpoints, "prefix": f"/t{uuid.uuid4().hex[:12]}"}, None)
    try:
        race_the_read(store, monkeypatch)
    finally:
        store.close()


def race_the_read(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = store.open()
    reader = store.open()
    assert isinstance(registry, EtcdRegistry) and isinstance(reader, EtcdRegistry)
    a = FleetPlan(epoch=0, leader="lux", created=T0, placements=[Placement(service="a", replica=0, node=HOST, tier="cpu_ffmpeg")])
    b = a.model_copy(update={"placements": [Placement(service="b", replica=0, node=HOST, tier="cpu_ffmpeg")]})
    leadership, first = publish_signed(registry, a)
    original = registry_etcd._read_range
    published: list[FleetPlan] = []

    async def index_then_publish(c, start, end, revision, **kwargs):  # type: ignore[no-untyped-def]
        result = await original(c, start, end, revision, **kwargs)
        if c is reader._client and start.endswith(b"/plan-index") and not published:
            numbered = b.model_copy(update={"epoch": first.epoch + 1, "leader": "lux", "term": leadership.term})
            signed = with_signature(numbered, LUX.id, LUX.private.sign(canonical_plan(numbered)))
            published.append(await asyncio.to_thread(registry.publish_plan, leadership, signed))
        return result

    monkeypatch.setattr(registry_etcd, "_read_range", index_then_publish)
    try:
        read = reader.plan_read(own)
    finally:
        monkeypatch.setattr(registry_etcd, "_read_range", original)
    assert len(published) == 1
    assert read is not None and read.index.epoch == first.epoch and [p.service for p in read.plan.placements] == ["a"]
    assert partial_problem(read.plan, read.index, HOST) is None
    again = reader.plan_read(own)
    assert again is not None and again.index.epoch == published[0].epoch and [p.service for p in again.plan.placements] == ["b"]
