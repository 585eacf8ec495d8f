"""The leader with Ray's state API (engine.leader step 3b) on a real sqlite registry and a fake RayState port:
Ray's tasks join the snapshot the scheduler and the scaling step get, a dead Ray node's worker shows failed,
and an unreadable Ray is said and skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.render.ray_node import RAY_WORKER_UNIT
from reconciler.core.scheduling.placement import schedule
from reconciler.core.scheduling.ray_tasks import RayView
from reconciler.engine.leader import LeaderLoop
from reconciler.ports import RayStateUnavailable
from tests.support.plan_keys import signed_example_fleet
from tests.support.registry_store import beating_registry


class FakeRayState:
    def __init__(self, view: RayView | None) -> None:
        self.view = view

    def observe(self) -> RayView:
        if self.view is None:
            raise RayStateUnavailable("ray state at 10.0.0.1:6379: connection refused")
        return self.view


def signed_fleet(tmp_path: Path):
    """The example fleet with throwaway plan keys (its candidates can sign)."""
    return signed_example_fleet(tmp_path / "fleet")


@pytest.fixture
def fleet(tmp_path: Path):
    return signed_fleet(tmp_path)


@pytest.fixture
def registry(tmp_path: Path, fleet):
    with beating_registry(tmp_path, fleet) as reg:
        yield reg


def leader(registry, fleet, ray_state: FakeRayState, seen: list[Snapshot], log: list[str]) -> LeaderLoop:
    desired = load_desired(fleet.desired)

    def recording(snapshot: Snapshot, desired, **kw) -> FleetPlan:
        seen.append(snapshot)
        return schedule(snapshot, desired, **kw)

    return LeaderLoop(
        registry=registry,
        host="lux",
        load_desired=lambda: desired,
        schedule=recording,
        lease_ttl_s=30,
        log=log.append,
        signer=fleet.signer("lux"),
        ray_state=ray_state,
    )


def nodes(snapshot: Snapshot) -> dict:
    return {n.node_id: n for n in snapshot.nodes}


def test_ray_tasks_are_in_the_snapshot_the_scheduler_gets(registry, fleet):
    seen: list[Snapshot] = []
    log: list[str] = []
    view = RayView(running={"x86-spill": 3}, alive=frozenset({"x86-spill", "qfox-1"}), dead=frozenset({"a1-arm64"}))
    leader(registry, fleet, FakeRayState(view), seen, log).step()
    (snapshot,) = seen
    by_id = nodes(snapshot)
    assert (by_id["x86-spill"].engine_tasks, by_id["x86-spill"].in_flight) == (3, 3)
    assert by_id["qfox-1"].engine_tasks == 0
    assert by_id["a1-arm64"].units == {RAY_WORKER_UNIT: "failed"}
    assert "ray worker start a1-arm64: its Ray node died while it has idle capacity (0/2, tier cpu_ffmpeg)" in log


def test_a_ray_host_full_of_tasks_gets_no_new_service_and_keeps_the_ones_it_runs(registry, fleet):
    """qfox-1 (limit 4) runs 4 Ray tasks: the plan places no service there; once
    they end it does, and a later burst of Ray tasks does not move them (a
    Ray task is short, a service moving is not)."""
    seen: list[Snapshot] = []
    full = FakeRayState(RayView(running={"qfox-1": 4}, alive=frozenset({"qfox-1"})))
    loop = leader(registry, fleet, full, seen, [])
    loop.step()
    assert nodes(seen[-1])["qfox-1"].in_flight == 4
    assert loop.published is not None and loop.published.services_on("qfox-1") == []
    loop.ray_state = FakeRayState(RayView(running={}, alive=frozenset({"qfox-1"})))
    loop.step()
    placed = loop.published.services_on("qfox-1")
    assert placed != []
    loop.ray_state = full
    loop.step()
    assert loop.published.services_on("qfox-1") == placed


def test_an_unreadable_ray_is_said_and_the_plan_made_without_it(registry, fleet):
    seen: list[Snapshot] = []
    log: list[str] = []
    loop = leader(registry, fleet, FakeRayState(None), seen, log)
    loop.step()
    assert "ray state unreadable, scheduling without Ray's tasks: ray state at 10.0.0.1:6379: connection refused" in log
    assert loop.published is not None
    assert all(n.engine_tasks == 0 for n in seen[0].nodes)


def test_the_ray_hosts_are_the_ray_tables_so_a_worker_that_never_joined_is_started(registry, fleet):
    # lux is [ray]'s head; Ray has never seen it (its unit never came up):
    # the leader says its Ray node should start, and names no host outside [ray].
    log: list[str] = []
    view = RayView(running={}, alive=frozenset({"x86-spill", "qfox-1", "a1-arm64"}), dead=frozenset())
    leader(registry, fleet, FakeRayState(view), [], log).step()
    starts = [line for line in log if line.startswith("ray worker start")]
    assert len(starts) == 1 and starts[0].startswith("ray worker start lux: it runs no Ray node"), log
    assert not any("racknerd" in line for line in log if line.startswith("ray worker")), log
