"""Between two leader steps (`LeaderLoop.settle`): the young generations are
collected at every settle, every generation at one in FULL_COLLECTION_EVERY,
so the long-lived objects (desired state, registry view, memos) are not
traversed before every next step, yet a cycle among them is still freed."""

from __future__ import annotations

from unittest.mock import patch

from reconciler.engine import leader
from reconciler.engine.leader import FULL_COLLECTION_EVERY, LeaderLoop


def test_settle_collects_the_young_generations_and_every_generation_now_and_then() -> None:
    loop = LeaderLoop(registry=None, host="lux", load_desired=lambda: None, schedule=None, lease_ttl_s=30)  # type: ignore[arg-type]
    calls: list[tuple] = []
    with patch.object(leader.gc, "collect", lambda *generation: calls.append(generation)):
        for _ in range(2 * FULL_COLLECTION_EVERY):
            loop.settle()
    full = [i for i, generation in enumerate(calls, 1) if generation == ()]
    assert full == [FULL_COLLECTION_EVERY, 2 * FULL_COLLECTION_EVERY]
    assert all(generation == (1,) for i, generation in enumerate(calls, 1) if i not in full)
