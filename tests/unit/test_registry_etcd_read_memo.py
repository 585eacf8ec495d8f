"""The leader's read keeps what it parsed and joined (registry_etcd: a
fact or state whose key holds the very value of the last read is not parsed
again, a state is joined with its facts once, a record's expiry is computed
once; registry_common: a node's snapshot view is made once per state): over
randomized churn (beats, silence, drains, unreadable and misnamed records,
the leader's own state writes and deletions), every read, lifecycle write,
snapshot and leader view of a registry that keeps them is the one a new
registry (nothing kept) makes from the same registry contents.

The registry's contents are fakes handed to `_read` as the view hands them
(a value unchanged keeps its bytes object; a changed one is new bytes);
nothing here talks to etcd.
"""

from __future__ import annotations

import json
import random

from reconciler.adapters.registry_etcd import EtcdRegistry
from reconciler.core.desired.model import FlapSettings, TimingSettings
from reconciler.core.live.beat import stamped
from reconciler.core.live.records import DrainRequest, LeaderInfo, Leadership
from reconciler.core.scheduling.lifecycle import stored_state
from reconciler.core.timestamps import from_epoch_seconds
from tests.support.clock import FakeClock

NODES = [f"n{i:02d}" for i in range(24)]
TIMING = TimingSettings(heartbeat_s=10, node_timeout_s=30, drain_grace_s=20)
LEADERSHIP = Leadership(
    info=LeaderInfo(candidate="lux", epoch=1, since=from_epoch_seconds(0), token="1", renewed_at=from_epoch_seconds(0), ttl_s=30, term=1), ttl_s=30
)


class Store:
    """The registry's contents under the prefix, as the view holds them."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {b"epoch": b"3"}
        self.beats: set[bytes] = set()

    def registry(self, clock: FakeClock, writes: list) -> EtcdRegistry:
        registry = EtcdRegistry(["http://127.0.0.1:9"], prefix="/t", timing=TIMING, flap=FlapSettings(), clock=clock, informer=False)
        registry._call = lambda op, what="": (list(self.values.items()), sorted(self.beats), {})  # type: ignore[method-assign]
        # A live beat without readable facts: no record read from the beat either.
        registry._beats_of = lambda nodes: [(None, None) for _ in nodes]  # type: ignore[method-assign]
        registry._store_lifecycle = lambda leadership, changed, dead, forgotten: writes.append((changed, dead, forgotten))  # type: ignore[method-assign]
        return registry

    def beat(self, node: str, now: float, ttl: float, in_flight: int = 0) -> None:
        record = stamped(
            {"node_id": node, "tier": "cpu_ffmpeg", "arch": "x86_64", "max_concurrent_tasks": 2, "in_flight": in_flight}, now=now, ttl_s=ttl
        )
        self.values[f"facts/{node}".encode()] = json.dumps(record).encode()
        self.beats.add(node.encode())

    def store(self, changed: dict, dead: set[str], forgotten: set[str]) -> None:
        """What the leader's lifecycle write does to the contents."""
        for node, state in changed.items():
            self.values[f"state/{node}".encode()] = stored_state(state).model_dump_json().encode()
        for node in dead | forgotten:
            self.values.pop(f"facts/{node}".encode(), None)
        for node in forgotten:
            self.values.pop(f"state/{node}".encode(), None)
            self.values.pop(f"drain/{node}".encode(), None)


def churn(store: Store, rng: random.Random, now: float) -> None:
    for _ in range(rng.randint(0, 8)):
        node = rng.choice(NODES)
        kind = rng.choice(("beat", "beat", "beat", "silence", "drain", "undrain", "garbage", "misnamed", "short"))
        if kind == "beat":
            store.beat(node, now, 30, rng.randint(0, 2))
        elif kind == "short":
            store.beat(node, now - 25, 30)
        elif kind == "silence":
            store.beats.discard(node.encode())
        elif kind == "drain":
            drain = DrainRequest(node_id=node, requested_at=from_epoch_seconds(now), grace_s=rng.choice((0, 10)), reason="test")
            store.values[f"drain/{node}".encode()] = drain.model_dump_json().encode()
        elif kind == "undrain":
            store.values.pop(f"drain/{node}".encode(), None)
        elif kind == "garbage":
            store.values[f"facts/{node}".encode()] = b'{"node_id": 7'
            store.beats.add(node.encode())
        elif kind == "misnamed":
            store.beat(node, now, 30)
            store.values[f"facts/{node}".encode()] = store.values[f"facts/{node}".encode()].replace(node.encode(), b"someone")


def test_a_registry_that_keeps_what_it_read_reads_what_a_new_one_reads() -> None:
    for seed in range(6):
        rng = random.Random(seed)
        clock = FakeClock()
        store = Store()
        for node in NODES[:16]:
            store.beat(node, clock.now(), 30)
        kept_writes: list = []
        kept = store.registry(clock, kept_writes)
        try:
            for step in range(40):
                clock.advance(rng.choice((0.0, 0.5, 3.0, 11.0, 31.0)))
                churn(store, rng, clock.now())
                fresh_writes: list = []
                fresh = store.registry(clock, fresh_writes)
                try:
                    assert kept._read() == fresh._read(), (seed, step)
                    assert kept.snapshot(lanes=["l"]) == fresh.snapshot(lanes=["l"]), (seed, step)
                    view, expected = kept.lead(LEADERSHIP), fresh.lead(LEADERSHIP)
                finally:
                    fresh.close()
                assert view == expected, (seed, step)
                assert kept_writes[-1] == fresh_writes[-1], (seed, step)
                store.store(*kept_writes[-1])
        finally:
            kept.close()
