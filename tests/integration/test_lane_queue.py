"""The lane job queue, the dispatcher and the scaling record on both registry backends.

Every test runs twice (`store` = sqlite, etcd): a sqlite file, or a real etcd
member started by this module (tests/harness/etcd.py) with a key prefix of
its own. Time is an injected clock (enqueue times, the spill gate); only the
racing-dispatchers test uses real processes and real time, and it asserts
what they did (no lane over its cap, each job started once), never how fast.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.records import ScalingRecord
from reconciler.engine.dispatch import dispatch_pass, finish_job, lane_status, run_dispatcher
from reconciler.ports import NotLeader, RegistryUnavailable
from tests.conftest import EXAMPLE_FLEET, REPO
from tests.fakes import T0, FakeClock
from tests.integration.registry_store import beat_example_fleet, example_record

pytestmark = pytest.mark.integration

FABRIC = [sys.executable, "-m", "reconciler"]


@pytest.fixture
def store_clock() -> FakeClock:
    """Queue ages and scaling windows move by hand here."""
    return FakeClock()


@pytest.fixture(scope="module")
def desired() -> DesiredState:
    # The example fleet: a1-arm64 (compute, rank 10, cap 2), x86-spill
    # (compute, rank 20, cap 4), local (rank 99, cap 1); spill after 900 s, 3 cloud attempts.
    return load_desired(EXAMPLE_FLEET)


def outcome(events) -> dict[str, str]:
    return {e.job: (e.lane if e.lane else f"hold:{e.hold}") for e in events}


# -- the queue itself -----------------------------------------------------------


def test_jobs_wait_oldest_first_and_enqueueing_a_known_job_changes_nothing(store):
    registry = store.open()
    registry.enqueue_jobs(["j-b", "j-a"])
    store.clock.advance(5)
    stored = registry.enqueue_jobs(["j-c", "j-a"])
    assert [j.job_id for j in registry.lane_jobs()] == ["j-b", "j-a", "j-c"], "enqueue order, then time"
    again = next(j for j in stored if j.job_id == "j-a")
    assert again.enqueued_at.timestamp() == T0, "a known job keeps its enqueue time"
    assert all(j.waiting and j.attempts == 0 for j in registry.lane_jobs())


def test_a_started_job_holds_one_slot_until_done_and_a_failed_one_waits_again(store):
    registry = store.open()
    registry.enqueue_jobs(["j1", "j2", "j3"])
    first = registry.start_job("j1", "a1-arm64", 2)
    assert first is not None and first.holder == "j1" and first.lane == "a1-arm64"
    assert registry.start_job("j1", "a1-arm64", 2) is None, "a running job cannot start twice"
    assert registry.start_job("j2", "a1-arm64", 2) is not None
    assert registry.start_job("j3", "a1-arm64", 2) is None, "the lane is full"
    assert registry.lane_in_flight() == {"a1-arm64": 2}
    # Plain slot claims and jobs share the caps.
    assert registry.claim_slot("a1-arm64", 2, "someone") is None

    done = registry.finish_job("j1")
    assert done is not None and done.job_id == "j1"
    assert "j1" not in {j.job_id for j in registry.lane_jobs()}
    assert registry.finish_job("j1") is None, "a finished job is gone"
    assert registry.lane_in_flight() == {"a1-arm64": 1}

    store.clock.advance(10)
    failed = registry.finish_job("j2", requeue=True, count_attempt=True)
    assert failed is not None and failed.waiting and failed.attempts == 1
    assert failed.enqueued_at.timestamp() == T0, "a requeued job keeps its age"
    assert registry.lane_in_flight() in ({}, {"a1-arm64": 0})
    assert registry.finish_job("j3") is None, "a waiting job is not running"


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


# -- the dispatcher ------------------------------------------------------------------


def test_jobs_fill_the_cheapest_lane_then_spill_and_reach_local_only_through_the_gates(store, desired):
    registry = store.open()
    beat_example_fleet(registry)
    jobs = [f"job-{i}" for i in range(8)]
    registry.enqueue_jobs(jobs)
    store.clock.advance(1)
    first = outcome(dispatch_pass(registry, desired))
    assert first == {
        "job-0": "a1-arm64",
        "job-1": "a1-arm64",
        "job-2": "x86-spill",
        "job-3": "x86-spill",
        "job-4": "x86-spill",
        "job-5": "x86-spill",
        "job-6": "hold:local_spill_not_reached",
        "job-7": "hold:local_spill_not_reached",
    }
    assert registry.lane_in_flight() == {"a1-arm64": 2, "x86-spill": 4}

    # Past the staleness gate the oldest waiting job spills to local; local
    # then has no slot either.
    store.clock.advance(desired.fleet.scheduler.local_spill_after_s)
    assert outcome(dispatch_pass(registry, desired)) == {"job-6": "local", "job-7": "hold:no_free_slots"}

    # A job whose cloud attempts are spent may only go local: with a cloud
    # slot free on each compute lane and local full, it holds.
    registry.enqueue_jobs(["spent"])
    assert registry.finish_job("job-0") is not None and registry.finish_job("job-2") is not None
    for _ in range(desired.fleet.scheduler.cloud_attempts):
        assert registry.start_job("spent", "a1-arm64", 2) is not None
        registry.finish_job("spent", requeue=True, count_attempt=True)
    events = {e.job: e for e in dispatch_pass(registry, desired)}
    assert events["job-7"].lane == "a1-arm64", "the oldest job first, to the cheapest free lane"
    assert events["spent"].hold == "cloud_attempts_exhausted" and events["spent"].attempts == 3
    assert registry.lane_in_flight()["x86-spill"] == 3, "the spent job did not take the free cloud slot"

    # An offline lane stalls nobody: with x86-spill's agent failed and a slot
    # free on a1-arm64, a fresh job goes there.
    registry.heartbeat(example_record("x86-spill", units={"fabric-agent-x86-spill.service": "failed"}), 86_400)
    assert registry.finish_job("job-1") is not None
    registry.enqueue_jobs(["fresh"])
    assert outcome(dispatch_pass(registry, desired)) == {"fresh": "a1-arm64", "spent": "hold:cloud_attempts_exhausted"}


def test_a_failed_job_waits_again_with_one_more_attempt_only_after_a_cloud_lane(store, desired):
    registry = store.open()
    registry.enqueue_jobs(["cloudy", "homely", "tidy"])
    assert registry.start_job("cloudy", "a1-arm64", 2) is not None
    assert registry.start_job("homely", "local", 1) is not None
    assert registry.start_job("tidy", "x86-spill", 4) is not None

    cloudy = finish_job(registry, desired, "cloudy", failed=True)
    homely = finish_job(registry, desired, "homely", failed=True)
    tidy = finish_job(registry, desired, "tidy", failed=False)

    assert cloudy is not None and (cloudy.lane, cloudy.requeued, cloudy.job.attempts) == ("a1-arm64", True, 1)
    assert homely is not None and (homely.lane, homely.job.attempts) == ("local", 0), "a local run spends no cloud attempt"
    assert tidy is not None and tidy.lane == "x86-spill"
    assert {j.job_id: j.waiting for j in registry.lane_jobs()} == {"cloudy": True, "homely": True}, "done is gone, failed waits"
    assert registry.lane_in_flight() == {}
    assert finish_job(registry, desired, "tidy", failed=False) is None, "not running any more"


def test_lane_status_shows_what_a_pass_would_do_to_each_waiting_job_now(store, desired):
    registry = store.open()
    beat_example_fleet(registry)
    registry.enqueue_jobs([f"job-{i}" for i in range(8)])
    assert registry.start_job("job-0", "a1-arm64", 2) is not None
    store.clock.advance(1)

    status = lane_status(registry, desired)

    assert [lane.id for lane in status.lanes] == ["a1-arm64", "x86-spill", "local"], "by rank"
    assert [j.job_id for j in status.running] == ["job-0"]
    assert {job: event.lane or f"hold:{event.hold}" for job, event in status.predicted.items()} == {
        "job-1": "a1-arm64",
        **{f"job-{i}": "x86-spill" for i in range(2, 6)},
        "job-6": "hold:local_spill_not_reached",
        "job-7": "hold:local_spill_not_reached",
    }
    assert status.queue_depth == 7, "waiting jobs (no plan published)"
    document = status.as_json()
    assert [w["job"] for w in document["waiting"]] == [f"job-{i}" for i in range(1, 8)]
    assert document["running"][0]["lane"] == "a1-arm64" and document["deferred"] == []
    assert registry.lane_in_flight() == {"a1-arm64": 1}, "looking starts nothing"


class OutageFirst:
    """The registry, whose first snapshot fails as if it were unreachable."""

    def __init__(self, registry) -> None:
        self._registry = registry
        self.failed = False

    def __getattr__(self, name):
        return getattr(self._registry, name)

    def snapshot(self, lanes=()):
        if not self.failed:
            self.failed = True
            raise RegistryUnavailable("connection refused")
        return self._registry.snapshot(lanes)


def test_the_dispatcher_outlives_a_registry_outage_and_stops_when_asked(store, desired):
    registry = store.open()
    beat_example_fleet(registry)
    registry.enqueue_jobs(["j1"])
    stop = threading.Event()
    events, logs = [], []

    def emit(event) -> None:
        events.append(event)
        stop.set()  # one successful pass is enough

    run_dispatcher(OutageFirst(registry), desired, emit=emit, stop=stop, interval_s=0.01, log=logs.append)

    assert logs == ["registry unreachable, retrying: connection refused"]
    assert [(e.job, e.lane) for e in events] == [("j1", "a1-arm64")]
    with pytest.raises(RegistryUnavailable):
        run_dispatcher(OutageFirst(registry), desired, emit=emit, stop=threading.Event(), interval_s=0.01, once=True)


def test_racing_dispatcher_processes_never_put_more_than_its_cap_in_a_lane(store, tmp_path, desired):
    """Three real `fabric lane dispatch` processes loop over the same queue
    while this test finishes whatever runs; a1-arm64 (cap 2) is the only lane
    that takes work (x86-spill's agent failed, local gated), and at no observation
    does it hold more than two jobs. Every job is started exactly once."""
    desired_dir = store.desired_dir(tmp_path)
    registry = store.open(clock=_RealClock())
    beat_example_fleet(registry)
    registry.heartbeat(example_record("x86-spill", units={"fabric-agent-x86-spill.service": "failed"}), 86_400)
    jobs = [f"race-{i:02d}" for i in range(12)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("FABRIC_REGISTRY", None)
    logs = [tmp_path / f"dispatcher-{n}.log" for n in range(3)]
    procs = []
    for log in logs:
        with open(log, "w") as out:  # the child keeps its own descriptor
            procs.append(
                subprocess.Popen(
                    [*FABRIC, "lane", "dispatch", "--desired", str(desired_dir), "--interval", "0.05", "--json"],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    most = 0
    finished: list[str] = []
    try:
        # Enqueue once every dispatcher is up and looping (it says so on stderr).
        deadline = time.monotonic() + 60
        while _read(logs).count("fabric lane dispatch: every") < len(procs):
            assert time.monotonic() < deadline, f"dispatchers did not start: {_read(logs)}"
            for p in procs:
                assert p.poll() is None, f"a dispatcher died: {_read(logs)}"
            time.sleep(0.05)
        registry.enqueue_jobs(jobs)
        deadline = time.monotonic() + 90
        while len(finished) < len(jobs):
            assert time.monotonic() < deadline, f"not every job ran; finished {finished}"
            for p in procs:
                assert p.poll() is None, f"a dispatcher died: {_read(logs)}"
            running = [j for j in registry.lane_jobs() if j.claim is not None]
            in_flight = registry.lane_in_flight().get("a1-arm64", 0)
            assert {j.claim.lane for j in running} <= {"a1-arm64"}
            assert len(running) <= 2 and in_flight <= 2, f"over the cap: {running}"
            most = max(most, len(running))
            for j in running:
                assert registry.finish_job(j.job_id) is not None
                finished.append(j.job_id)
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=15)
    assert sorted(finished) == jobs and most >= 1
    started = [json.loads(line) for line in _read(logs).splitlines() if line.startswith("{")]
    starts = [e["job"] for e in started if e["backend"]]
    assert sorted(starts) == jobs, "each job started exactly once, by one of the dispatchers"
    holds = [e for e in started if e["hold"]]
    assert holds and {e["hold"] for e in holds} == {"local_spill_not_reached"}, "a hold always says why"
    assert [p.returncode for p in procs] == [0, 0, 0], f"SIGTERM stops a dispatcher cleanly: {_read(logs)[-2000:]}"


class _RealClock:
    def now(self) -> float:
        return time.time()


def _read(logs: list[Path]) -> str:
    return "".join(log.read_text() for log in logs)
