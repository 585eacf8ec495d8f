"""What `fabric status` shows, gathered by the engine (reconciler.engine.status): a saved snapshot, or the live registry."""

from __future__ import annotations

from reconciler.core.desired.load import load_desired
from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.live.records import NodeRecord
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.leader import plan_in_term, sign_plan, signing_key
from reconciler.engine.status import live_status, saved_status
from reconciler.wiring import open_registry
from tests.conftest import EXAMPLE_FLEET, REPO
from tests.support.clock import FakeClock

SNAPSHOT = REPO / "tests" / "fixtures" / "status" / "snapshot.json"


def test_a_saved_snapshot_is_shown_as_of_its_instant_with_the_schedulers_plan_unless_one_is_given():
    desired = load_desired(EXAMPLE_FLEET)
    snapshot = Snapshot.model_validate_json(SNAPSHOT.read_text())

    what_if = saved_status(desired, snapshot)
    assert what_if.now == snapshot.now
    assert what_if.plan == schedule(snapshot, desired)

    saved = FleetPlan(epoch=7, leader="lux", created=snapshot.now)
    assert saved_status(desired, snapshot, saved).plan is saved


def test_the_live_registry_gives_every_declared_lane_and_the_newest_published_plan(tmp_path, signed_fleet):
    desired = load_desired(signed_fleet.desired)
    signer = signed_fleet.signer("lux")
    registry = open_registry(desired.fleet, clock=FakeClock(), sqlite_path=tmp_path / "registry.sqlite")
    try:
        registry.heartbeat(NodeRecord(node_id="lux", tier="cpu_ffmpeg", arch="x86_64", max_concurrent_tasks=2))
        assert live_status(desired, registry).plan is None, "nothing published yet"
        leadership = registry.campaign("lux", ttl_s=60)
        assert leadership is not None
        plan = schedule(registry.snapshot(), desired, leader="lux", epoch=registry.epoch() + 1)
        published = registry.publish_plan(
            leadership, sign_plan(plan_in_term(plan, leadership, desired), signer, signing_key(signer, desired.fleet.plan_keys, "lux"))
        )

        inputs = live_status(desired, registry)
    finally:
        registry.close()

    assert {lane.id for lane in inputs.snapshot.lanes} == {lane.id for lane in desired.lanes}, "a lane nobody reported still shows"
    assert inputs.plan is not None and inputs.plan.epoch == published.epoch and inputs.plan_refused is None
    assert inputs.now == inputs.snapshot.now
