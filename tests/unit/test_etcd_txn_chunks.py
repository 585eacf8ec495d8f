"""The etcd registry's lifecycle chunks stay within etcd's default limits at any fleet size."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from reconciler.adapters.registry_etcd import (
    ETCD_MAX_REQUEST_BYTES,
    ETCD_MAX_TXN_OPS,
    TXN_CHUNK_BYTES,
    TXN_CHUNK_OPS,
    lifecycle_chunks,
)
from reconciler.core.live.models import Transition
from reconciler.core.live.records import NodeRecord
from reconciler.core.scheduling.lifecycle import HISTORY, NodeState
from reconciler.ports import RegistryError


def state(n: int) -> NodeState:
    """A node state as large as the lifecycle lets it grow (a full history)."""
    at = datetime(2026, 1, 1, tzinfo=UTC)
    history = tuple(
        Transition(at=at + timedelta(seconds=i), status="offline", reason="no heartbeat for 30 s, last seen x: evacuate") for i in range(HISTORY)
    )
    record = NodeRecord(node_id=f"n{n}", tier="cpu_ffmpeg", arch="x86_64", labels={"zone": "a", "rack": "r12"}, beat_at=at, timeout_s=30)
    return NodeState(node_id=f"n{n}", status="offline", since=at, record=record, last_seen=at, transitions=history)


def test_chunk_limits_leave_room_for_the_fence() -> None:
    assert TXN_CHUNK_OPS + 1 < ETCD_MAX_TXN_OPS
    assert TXN_CHUNK_BYTES < ETCD_MAX_REQUEST_BYTES


def test_ten_thousand_full_states_and_deletions_in_bounded_chunks() -> None:
    value = state(0).model_dump_json().encode()
    writes = [("put", f"/fabric/state/n{i:05d}".encode(), value) for i in range(10_000)]
    writes += [("delete", f"/fabric/facts/n{i:05d}".encode(), None) for i in range(3_000)]
    chunks = lifecycle_chunks(writes)
    assert [w for chunk in chunks for w in chunk] == writes
    assert max(len(c) for c in chunks) <= TXN_CHUNK_OPS
    assert max(sum(len(k) + len(v or b"") for _, k, v in c) for c in chunks) <= TXN_CHUNK_BYTES
    # A full state is ~5.7 KiB: 126 of them fit the byte budget, so the op count cuts.
    assert len(chunks) == -(-len(writes) // TXN_CHUNK_OPS)


def test_nothing_to_write_is_one_empty_fenced_chunk() -> None:
    assert lifecycle_chunks([]) == [[]]


def test_a_single_write_over_the_budget_is_refused() -> None:
    with pytest.raises(RegistryError, match="over the"):
        lifecycle_chunks([("put", b"/fabric/state/huge", b"x" * (TXN_CHUNK_BYTES + 1))])
