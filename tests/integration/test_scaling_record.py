"""The leader's scaling record on both registry backends (lane jobs live on phaze's broker: test_lane_broker_pg.py).

Every test runs twice (`store` = sqlite, etcd): a sqlite file, or a real etcd
member started by this module (tests/support/harness/etcd.py) with a key prefix of
its own.
"""

from __future__ import annotations

import sys

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.records import ScalingRecord
from reconciler.ports import NotLeader
from tests.conftest import EXAMPLE_FLEET
from tests.support.clock import FakeClock

pytestmark = pytest.mark.integration

FABRIC = [sys.executable, "-m", "reconciler"]


@pytest.fixture
def store_clock() -> FakeClock:
    """Scaling windows move by hand here."""
    return FakeClock()


@pytest.fixture(scope="module")
def desired() -> DesiredState:
    # The example fleet: a1-arm64 (compute, rank 10, cap 2), x86-spill
    # (compute, rank 20, cap 4), local (rank 99, cap 1); spill after 900 s, 3 cloud attempts.
    return load_desired(EXAMPLE_FLEET)


def outcome(events) -> dict[str, str]:
    return {e.job: (e.lane if e.lane else f"hold:{e.hold}") for e in events}


def test_the_scaling_record_is_written_only_under_the_leaders_fence(store):
    registry = store.open()
    assert registry.scaling_record() == ScalingRecord()
    lux = registry.campaign("lux", 30)
    assert lux is not None
    registry.store_scaling(lux, ScalingRecord(concurrency={"qfox-1": 5}, leader="lux"))
    registry.resign(lux)
    qfox = store.open().campaign("qfox-1", 30)
    assert qfox is not None
    with pytest.raises(NotLeader):
        registry.store_scaling(lux, ScalingRecord(concurrency={"qfox-1": 6}, leader="lux"))
    assert registry.scaling_record().concurrency == {"qfox-1": 5}, "the deposed leader wrote nothing"


def test_the_snapshot_reports_the_concurrency_override_within_the_ceiling(store):
    from reconciler.core.live.records import NodeRecord

    registry = store.open()
    registry.heartbeat(NodeRecord(node_id="qfox-1", tier="gpu_cuda", max_concurrent_tasks=4, max_concurrent_ceiling=6), ttl_s=3600)
    registry.heartbeat(NodeRecord(node_id="lux", tier="cpu_ffmpeg", max_concurrent_tasks=2), ttl_s=3600)
    lux = registry.campaign("lux", 30)
    registry.store_scaling(lux, ScalingRecord(concurrency={"qfox-1": 9, "lux": 1}))
    limits = {n.node_id: n.max_concurrent_tasks for n in registry.snapshot().nodes}
    assert limits == {"qfox-1": 6, "lux": 1}, "raised no further than the ceiling; lowered as stored"
