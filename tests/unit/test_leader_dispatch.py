"""The leader's lane dispatcher (engine.leader step 5) on a real sqlite registry
and a fake LaneBroker: each step dispatches the waiting jobs fenced by its term,
a deposed leader's dispatch is refused, and `fabric lane dispatch` under a
leader carries the leader's term (engine.dispatch.dispatcher_fence), and
the fence is the registry's: a number in the broker stops nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import lane_queue_name
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.dispatch import PhazeDispatches, dispatch_pass, dispatcher_fence
from reconciler.engine.leader import LeaderLoop
from reconciler.ports import StaleDispatcher
from tests.support.fakes import FakeLaneBroker
from tests.support.harness.own_lanes import own_lanes
from tests.support.plan_keys import signed_example_fleet
from tests.support.registry_store import beating_registry


@pytest.fixture
def fleet(tmp_path: Path):
    # The fabric's own lanes: in the example fleet (phaze's) the leader dispatches nothing.
    signed = signed_example_fleet(tmp_path / "fleet")
    toml = signed.desired / "fabric.toml"
    toml.write_text(own_lanes(toml.read_text()))
    return signed


@pytest.fixture
def registry(tmp_path: Path, fleet):
    with beating_registry(tmp_path, fleet) as reg:
        yield reg


@pytest.fixture
def queue(fleet) -> FakeLaneBroker:
    """phaze's broker with a worker on every lane's queue."""
    desired = load_desired(fleet.desired)
    return FakeLaneBroker(workers={lane_queue_name(desired.fleet, lane): 1 for lane in desired.lanes})


def leader(registry, fleet, queue: FakeLaneBroker, log: list[str], host: str = "lux") -> LeaderLoop:
    desired = load_desired(fleet.desired)
    return LeaderLoop(
        registry=registry,
        host=host,
        load_desired=lambda: desired,
        schedule=schedule,
        lease_ttl_s=30,
        log=log.append,
        signer=fleet.signer(host),
        lane_broker=queue,
    )


def test_each_leader_step_dispatches_the_waiting_lane_jobs(registry, fleet, queue):
    log: list[str] = []
    queue.enqueue([("clip-1", 3600.0), ("clip-2", 30.0)])
    leader(registry, fleet, queue, log).step()
    lanes = {job.job_id: job.lane for job in queue.jobs()}
    # A long file goes to the cloud lane with room; a short one stays local (route threshold).
    assert lanes["clip-1"] is not None and lanes["clip-1"] != "local"
    assert lanes["clip-2"] == "local"
    assert any(line.startswith("lane job clip-1 -> ") for line in log), log


def test_the_leaders_dispatch_is_fenced_by_its_term(registry, fleet, queue):
    log: list[str] = []
    loop = leader(registry, fleet, queue, log)
    queue.enqueue([("clip-1", 3600.0)])
    loop.step()
    assert loop.leadership is not None
    # The broker records the term that dispatched: the registry's, not a plan's epoch.
    assert queue.fence == loop.leadership.term == dispatcher_fence(registry).term == registry.leader_term().term


def test_a_deposed_leaders_dispatch_is_refused(registry, fleet, queue):
    log: list[str] = []
    old = leader(registry, fleet, queue, log)
    old.step()
    assert old.leadership is not None
    registry.resign(old.leadership)
    newer = leader(registry, fleet, queue, [], host="qfox-1")
    queue.enqueue([("clip-2", 3600.0)])
    newer.step()
    assert newer.leadership is not None and newer.leadership.epoch > old.leadership.epoch
    assert next(j for j in queue.jobs() if j.job_id == "clip-2").lane is not None
    queue.enqueue([("clip-3", 3600.0)])
    # The old term still thinks it leads: its dispatch must not start the job.
    with pytest.raises(StaleDispatcher):
        dispatch_pass(registry, queue, load_desired(fleet.desired), fence=dispatcher_fence(registry, old.leadership.term))
    assert next(j for j in queue.jobs() if j.job_id == "clip-3").lane is None


def test_a_dispatcher_run_by_hand_under_a_leader_is_not_refused(registry, fleet, queue):
    loop = leader(registry, fleet, queue, [])
    loop.step()
    queue.enqueue([("clip-4", 3600.0)])
    events = dispatch_pass(registry, queue, load_desired(fleet.desired))
    assert [e.job for e in events if e.lane is not None] == ["clip-4"]
    # ...and the leader's next step is not refused after it either.
    queue.enqueue([("clip-5", 3600.0)])
    log: list[str] = []
    loop.log = log.append
    loop.step()
    assert not any("refused" in line for line in log), log
    assert next(j for j in queue.jobs() if j.job_id == "clip-5").lane is not None


def test_with_leader_dispatches_off_the_leader_leaves_the_jobs_to_fabric_lane_dispatch(registry, fleet, queue):
    desired = load_desired(fleet.desired)
    off = desired.model_copy(
        update={"fleet": desired.fleet.model_copy(update={"phaze": desired.fleet.phaze.model_copy(update={"leader_dispatches": False})})}
    )
    loop = leader(registry, fleet, queue, [])
    loop.load_desired = lambda: off
    queue.enqueue([("clip-6", 3600.0)])
    loop.step()
    assert next(j for j in queue.jobs() if j.job_id == "clip-6").waiting


def test_in_a_phaze_fleet_the_leader_and_any_dispatcher_write_no_job(tmp_path: Path, registry, queue):
    """The example fleet names phaze's agent API: phaze's control plane
    dispatches into its phaze-agent-* queues, so the leader's step starts no
    job there and a dispatch pass refuses (engine.dispatch.refuse_phaze_lanes)."""
    phaze = signed_example_fleet(tmp_path / "phaze" / "fleet")
    desired = load_desired(phaze.desired)
    assert desired.fleet.phaze_dispatches
    queue.enqueue([("clip-7", 3600.0), ("clip-8", 30.0)])
    log: list[str] = []
    loop = leader(registry, phaze, queue, log)
    loop.step()
    assert loop.leadership is not None, log
    assert all(job.waiting for job in queue.jobs()), "no job written"
    assert not any(line.startswith("lane job") for line in log), log
    with pytest.raises(PhazeDispatches, match=r"phaze\.api_url: this is a phaze fleet"):
        dispatch_pass(registry, queue, desired)
    assert all(job.waiting for job in queue.jobs())


def test_a_number_in_the_broker_does_not_stop_the_leaders_dispatch(registry, fleet, queue):
    """What a broker client may write into the fence row decides nothing: the registry's term does."""
    loop = leader(registry, fleet, queue, [])
    loop.step()
    queue.fence = 2**63 - 1  # raised by hand, as any DSN holder could before
    queue.enqueue([("clip-6", 3600.0)])
    log: list[str] = []
    loop.log = log.append
    loop.step()
    assert next(j for j in queue.jobs() if j.job_id == "clip-6").lane is not None, log
    assert loop.leadership is not None and queue.fence == loop.leadership.term
