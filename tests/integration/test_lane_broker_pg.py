"""The lane queue on a real PostgreSQL with real SAQ workers: dispatch by rank and cap, holds, races, workers.

A PostgreSQL 15 started by this module (tests/support/harness/postgres.py), a fresh
database per test; the registry is a sqlite file with the example fleet's
heartbeats (its lanes' hosts are up). Lane workers are real `saq.Worker`s
(tests/support/harness/saq_workers.py) whose jobs end when the test says. The
example fleet: a1-arm64 (compute, rank 10, cap 2), x86-spill (compute, rank
20, cap 4), local (rank 99, cap 1); spill after 900 s, 3 cloud attempts,
route threshold 600 s. Time for the rules (waits, the spill gate) is an
injected clock; the broker's own (worker heartbeats) is real, waited on with
deadlines from the heartbeat timing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from reconciler.adapters.lane_broker_pg import PostgresLaneBroker
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.engine.dispatch import dispatch_pass, dispatcher_fence, lane_status, lane_targets
from reconciler.ports import DispatchFence, StaleDispatcher
from tests.support.clock import FakeClock
from tests.support.harness.own_lanes import OWN_A1, OWN_LOCAL, OWN_X86, own_lanes, own_lanes_fleet
from tests.support.harness.saq_workers import LaneWorkers
from tests.support.harness.waiting import deadline_for, wait_until
from tests.support.registry_store import beat_example_fleet

pytestmark = pytest.mark.integration

A1, X86, LOCAL = OWN_A1, OWN_X86, OWN_LOCAL
HEARTBEAT_S = 1


@pytest.fixture(scope="module")
def desired(tmp_path_factory: pytest.TempPathFactory) -> DesiredState:
    # The fabric's own lanes: the example fleet is phaze's, where phaze dispatches.
    return load_desired(own_lanes_fleet(tmp_path_factory.mktemp("own") / "fleet"))


class Lanes:
    """One test's world: the broker's database, a registry with the fleet up, its clock."""

    def __init__(self, dsn: str, tmp_path: Path, desired: DesiredState) -> None:
        self.dsn = dsn
        self.clock = FakeClock()
        fleet = desired.fleet
        self.registry = SqliteRegistry(str(tmp_path / "registry.sqlite"), timing=fleet.timing, flap=fleet.flap, clock=self.clock)
        beat_example_fleet(self.registry)
        self.queue = PostgresLaneBroker(dsn, self.clock)
        self.workers = LaneWorkers(dsn, heartbeat_s=HEARTBEAT_S)
        self.opened = [self.queue]

    def another_queue(self) -> PostgresLaneBroker:
        queue = PostgresLaneBroker(self.dsn, self.clock)
        self.opened.append(queue)
        return queue

    def close(self) -> None:
        self.workers.close()
        for queue in self.opened:
            queue.close()
        self.registry.close()


@pytest.fixture
def lanes(broker_dsn: str, tmp_path: Path, desired: DesiredState) -> Iterator[Lanes]:
    world = Lanes(broker_dsn, tmp_path, desired)
    try:
        yield world
    finally:
        world.close()


def outcome(events) -> dict[str, str]:
    return {e.job: (e.lane if e.lane else f"hold:{e.hold}") for e in events if e.outcome is None}


def in_queue(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT queue, count(*) FROM saq_jobs WHERE status IN ('new','deferred','queued','active') GROUP BY queue")
        return dict(rows.fetchall())


def test_jobs_fill_the_cheapest_lane_first_then_spill_and_reach_local_only_through_the_gates(lanes, desired):
    for queue in (A1, X86, LOCAL):
        lanes.workers.start(queue)
    lanes.queue.enqueue([(f"job-{i}", None) for i in range(8)])
    lanes.clock.advance(1)

    first = outcome(dispatch_pass(lanes.registry, lanes.queue, desired))

    assert first == {
        "job-0": "a1-arm64",
        "job-1": "a1-arm64",
        **{f"job-{i}": "x86-spill" for i in range(2, 6)},
        "job-6": "hold:local_spill_not_reached",
        "job-7": "hold:local_spill_not_reached",
    }, "rank first; a1-arm64 at its cap of 2 spills to x86-spill; local waits for the gate"
    assert in_queue(lanes.dsn) == {A1: 2, X86: 4}, "the jobs are on the lanes' SAQ queues"
    wait_until(lambda: len(lanes.workers.running()) == 6, timeout=deadline_for(HEARTBEAT_S), what="the workers took all six")
    assert {j: q for j, q in lanes.workers.running().items()} == {
        **{f"job-{i}": A1 for i in range(2)},
        **{f"job-{i}": X86 for i in range(2, 6)},
    }

    lanes.clock.advance(900)  # the spill gate opens: local takes one (its cap)
    assert outcome(dispatch_pass(lanes.registry, lanes.queue, desired)) == {"job-6": "local", "job-7": "hold:no_free_slots"}


def test_a_worker_finishing_a_job_frees_its_slot_and_a_failed_job_waits_again_with_a_cloud_attempt(lanes, desired):
    lanes.workers.start(A1, concurrency=2)
    lanes.workers.start(X86)
    lanes.workers.start(LOCAL)
    lanes.queue.enqueue([("done-job", None), ("bad-job", None), ("next-job", None)])
    assert outcome(dispatch_pass(lanes.registry, lanes.queue, desired)) == {
        "done-job": "a1-arm64",
        "bad-job": "a1-arm64",
        "next-job": "x86-spill",
    }
    wait_until(lambda: {"done-job", "bad-job"} <= set(lanes.workers.running()), timeout=deadline_for(HEARTBEAT_S), what="a1's worker runs both")
    lanes.workers.finish("done-job")
    lanes.workers.finish("bad-job", ok=False)
    wait_until(lambda: in_queue(lanes.dsn).get(A1, 0) == 0, timeout=deadline_for(HEARTBEAT_S), what="SAQ finished both")

    events = dispatch_pass(lanes.registry, lanes.queue, desired)

    settled = {e.job: (e.outcome, e.attempts) for e in events if e.outcome is not None}
    assert settled == {"done-job": ("complete", 0), "bad-job": ("failed", 1)}
    assert outcome(events) == {"bad-job": "a1-arm64"}, "the freed slot takes the failed job again"
    jobs = {j.job_id: j for j in lanes.queue.jobs()}
    assert "done-job" not in jobs, "a complete job is gone"
    assert jobs["bad-job"].attempts == 1 and jobs["bad-job"].lane == "a1-arm64"


def test_the_three_holds_with_their_labels(lanes, desired):
    for queue in (A1, X86, LOCAL):
        lanes.workers.start(queue)
    lanes.queue.enqueue([(f"fill-{i}", None) for i in range(7)])
    dispatch_pass(lanes.registry, lanes.queue, desired)  # a1 2, x86 4, local gated: fill-6 waits
    lanes.queue.enqueue([("young", None)])
    held = outcome(dispatch_pass(lanes.registry, lanes.queue, desired))
    assert held["young"] == "hold:local_spill_not_reached", "the cloud is full, local free, the job young"

    lanes.clock.advance(900)
    assert outcome(dispatch_pass(lanes.registry, lanes.queue, desired))["fill-6"] == "local"
    assert outcome(dispatch_pass(lanes.registry, lanes.queue, desired))["young"] == "hold:no_free_slots", "every lane full"

    # A job whose cloud attempts are spent may only go local, which is full.
    lanes.queue.enqueue([("spent", None)])
    with psycopg.connect(lanes.dsn) as conn:
        conn.execute("UPDATE fabric_lane_jobs SET attempts = 3 WHERE job_id = 'spent'")
    assert outcome(dispatch_pass(lanes.registry, lanes.queue, desired))["spent"] == "hold:cloud_attempts_exhausted"


def test_a_job_below_the_route_threshold_goes_local_and_a_long_one_to_the_cloud(lanes, desired):
    for queue in (A1, X86, LOCAL):
        lanes.workers.start(queue)
    assert desired.fleet.scheduler.cloud_route_threshold_s == 600
    lanes.queue.enqueue([("short-clip", 120.0), ("long-set", 3600.0)])

    assert outcome(dispatch_pass(lanes.registry, lanes.queue, desired)) == {"short-clip": "local", "long-set": "a1-arm64"}
    wait_until(
        lambda: lanes.workers.running() == {"short-clip": LOCAL, "long-set": A1}, timeout=deadline_for(HEARTBEAT_S), what="each on its lane's worker"
    )


def test_a_lane_whose_worker_stops_goes_offline_with_its_reason_and_the_next_job_spills(lanes, desired):
    for queue in (A1, X86, LOCAL):
        lanes.workers.start(queue)
    status = lane_status(lanes.registry, lanes.queue, desired)
    assert all(lane.available for lane in status.lanes), [lane.reason for lane in status.lanes]
    assert status.new_job.lane == "a1-arm64"

    lanes.workers.stop(A1)

    def a1_offline():
        seen = {lane.id: lane for lane in lane_status(lanes.registry, lanes.queue, desired).lanes}
        return seen["a1-arm64"] if not seen["a1-arm64"].available else None

    offline = wait_until(a1_offline, timeout=deadline_for(HEARTBEAT_S + 1), what="a1-arm64 offline")
    assert offline.reason is not None and offline.reason.startswith(f"no SAQ worker on {A1}")
    lanes.queue.enqueue([("after", None)])
    assert outcome(dispatch_pass(lanes.registry, lanes.queue, desired)) == {"after": "x86-spill"}
    document = lane_status(lanes.registry, lanes.queue, desired).as_json()
    a1 = next(lane for lane in document["lanes"] if lane["id"] == "a1-arm64")
    assert (a1["online"], a1["queue"], a1["hold"]) == (False, A1, f"offline: {offline.reason}")
    assert {lane["id"]: (lane["kind"], lane["rank"], lane["cap"], lane["in_flight"]) for lane in document["lanes"]} == {
        "a1-arm64": ("compute", 10, 2, 0),
        "x86-spill": ("compute", 20, 4, 1),
        "local": ("local", 99, 1, 0),
    }


def test_a_lane_without_any_worker_is_offline_and_says_so(lanes, desired):
    lanes.workers.start(X86)
    views = {lane.id: lane for lane in lane_status(lanes.registry, lanes.queue, desired).lanes}
    assert views["a1-arm64"].reason == f"no SAQ worker on {A1}"
    assert views["local"].reason == f"no SAQ worker on {LOCAL}"
    assert views["x86-spill"].available


def test_a_dispatcher_of_another_term_than_the_registrys_is_refused(lanes, desired):
    lanes.workers.start(A1)
    lanes.queue.enqueue([("j1", None), ("j2", None)])
    target = lane_targets(desired)["a1-arm64"]
    registry_term = [7]
    assert lanes.queue.dispatch("j1", target, DispatchFence(7, lambda: registry_term[0])) is not None
    with pytest.raises(StaleDispatcher, match="term 6 refused: the registry's current term is 7"):
        lanes.another_queue().dispatch("j2", target, DispatchFence(6, lambda: registry_term[0]))
    assert next(j for j in lanes.queue.jobs() if j.job_id == "j2").waiting, "the refused dispatch changed nothing"
    registry_term[0] = 8
    with pytest.raises(StaleDispatcher, match="term 7 refused: the registry's current term is 8"):
        lanes.queue.dispatch("j2", target, DispatchFence(7, lambda: registry_term[0]))
    assert lanes.queue.dispatch("j2", target, DispatchFence(8, lambda: registry_term[0])) is not None, "the registry's term goes on"


def test_the_leaders_step_dispatches_onto_the_saq_queues_fenced_by_its_term(lanes, tmp_path):
    """fabric-leader.service is the fleet's dispatcher: each step of the real
    leader loop puts the waiting jobs on the lanes' SAQ queues under its
    term's epoch, and once a newer term has dispatched, the old term's
    dispatch is refused by the broker."""
    from reconciler.core.scheduling.placement import schedule
    from reconciler.engine.leader import LeaderLoop
    from tests.support.plan_keys import signed_example_fleet

    fleet = signed_example_fleet(tmp_path / "signed")
    toml = fleet.desired / "fabric.toml"
    toml.write_text(own_lanes(toml.read_text()))
    signed = load_desired(fleet.desired)

    def leader(host: str, log: list[str]) -> LeaderLoop:
        return LeaderLoop(
            registry=lanes.registry,
            host=host,
            load_desired=lambda: signed,
            schedule=schedule,
            lease_ttl_s=30,
            log=log.append,
            signer=fleet.signer(host),
            lane_broker=lanes.queue,
        )

    for queue in (A1, X86, LOCAL):
        lanes.workers.start(queue)
    wait_until(
        lambda: all(s.workers for s in lanes.queue.lane_states({"a": A1, "x": X86, "l": LOCAL})),
        timeout=deadline_for(HEARTBEAT_S),
        what="a worker beating on every lane's queue",
    )
    lanes.queue.enqueue([("long-clip", 3600.0), ("short-clip", 30.0)])
    lux_log: list[str] = []
    lux = leader("lux", lux_log)
    lux.step()
    assert in_queue(lanes.dsn) == {A1: 1, LOCAL: 1}, lux_log
    assert any(line.startswith("lane job long-clip -> a1-arm64") for line in lux_log), lux_log
    assert lux.leadership is not None
    old_term = lux.leadership.term
    lanes.registry.resign(lux.leadership)
    lanes.queue.enqueue([("clip-2", 3600.0)])
    qfox = leader("qfox-1", [])
    qfox.step()
    assert qfox.leadership is not None and qfox.leadership.term > old_term
    lanes.queue.enqueue([("clip-3", 3600.0)])
    with pytest.raises(StaleDispatcher):
        dispatch_pass(lanes.registry, lanes.another_queue(), signed, fence=dispatcher_fence(lanes.registry, old_term))
    assert next(j for j in lanes.queue.jobs() if j.job_id == "clip-3").waiting


def test_200_racing_dispatches_from_several_dispatchers_never_exceed_a_cap(lanes, desired):
    """Eight dispatchers (threads, each with its own connection, connected
    before they start together) race to put 200 jobs into a1-arm64 (cap 2)
    and x86-spill (cap 4), while a finisher completes one queued SAQ job per
    lane at a time (as a worker would) and settles it, so slots keep freeing
    and every dispatch is contested. At every observation no lane's queue
    holds more than its cap; at the end every job ran exactly once."""
    jobs = [f"race-{i:03d}" for i in range(200)]
    lanes.queue.enqueue([(job, None) for job in jobs])
    targets = lane_targets(desired)
    dispatchers = [lanes.another_queue() for _ in range(8)]
    for queue in dispatchers:
        queue.jobs()  # connected now: the race starts at the barrier, not at connect
    finisher = lanes.another_queue()
    finisher.jobs()
    dispatched: list[tuple[str, str]] = []
    seen_max = {A1: 0, X86: 0}
    completed: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(len(dispatchers) + 1)
    done = threading.Event()

    def dispatch(n: int) -> None:
        start.wait()
        order = jobs[n * 25 :] + jobs[: n * 25]  # each starts elsewhere, all contend for the slots
        while not done.is_set():
            for i, job in enumerate(order):
                lane = ("a1-arm64", "x86-spill")[(i + n) % 2]
                if dispatchers[n].dispatch(job, targets[lane], DispatchFence.fixed(1)) is not None:
                    with lock:
                        dispatched.append((job, lane))

    def finish() -> None:
        start.wait()
        with psycopg.connect(lanes.dsn, autocommit=True) as conn:
            while len(completed) < len(jobs):
                held = in_queue(lanes.dsn)
                for queue in (A1, X86):
                    seen_max[queue] = max(seen_max[queue], held.get(queue, 0))
                conn.execute(
                    "UPDATE saq_jobs SET status = 'complete' WHERE key IN"
                    " (SELECT DISTINCT ON (queue) key FROM saq_jobs WHERE status = 'queued' ORDER BY queue, key)"
                )
                completed.extend(job.job_id for job in finisher.settle() if job.outcome == "complete")
        done.set()

    threads = [threading.Thread(target=dispatch, args=(n,)) for n in range(len(dispatchers))] + [threading.Thread(target=finish)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    done.set()
    assert not any(thread.is_alive() for thread in threads)

    assert seen_max[A1] <= 2 and seen_max[X86] <= 4, seen_max
    assert sorted(completed) == jobs, "every job ran, once"
    assert sorted(job for job, _ in dispatched) == jobs, "no job dispatched twice"
    assert lanes.queue.jobs() == []


def test_a_broker_that_accepts_but_never_answers_is_unavailable_not_a_hung_pass():
    """A pass holds its host's lock while it reads the lanes: a broker whose
    port accepts connections but never answers (a wedged server, a half-open
    path) must end in LaneBrokerUnavailable, never in a wait without end."""
    import socket

    from reconciler.ports import LaneBrokerUnavailable

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel accepts the TCP connection; nothing ever answers
    port = silent.getsockname()[1]
    outcome: list[BaseException | None] = []

    def open_queue() -> None:
        try:
            PostgresLaneBroker(f"postgresql://postgres@127.0.0.1:{port}/phaze", FakeClock(), connect_timeout_s=1)
            outcome.append(None)
        except BaseException as exc:  # the outcome is the assertion below
            outcome.append(exc)

    opener = threading.Thread(target=open_queue, daemon=True)
    try:
        opener.start()
        # libpq's connect_timeout (1 s) bounds it; the deadline only keeps a regression from hanging the suite.
        opener.join(timeout=deadline_for(HEARTBEAT_S) * 4)
        assert not opener.is_alive(), "opening the lane queue on a silent broker did not return"
        assert len(outcome) == 1 and isinstance(outcome[0], LaneBrokerUnavailable), outcome
        assert "phaze's broker" in str(outcome[0])
    finally:
        silent.close()


def test_the_saq_tables_the_lane_broker_spells_are_saqs() -> None:
    """Reading the lanes imports no saq: the adapter spells saq 0.26's table names itself."""
    from saq.queue import postgres

    from reconciler.adapters import lane_broker_pg

    assert (lane_broker_pg.JOBS_TABLE, lane_broker_pg.STATS_TABLE) == (postgres.JOBS_TABLE, postgres.STATS_TABLE)


def test_reading_the_lanes_of_a_broker_nobody_used_yet_makes_saqs_tables_first(broker_dsn: str) -> None:
    """Opening the queue makes no table any more: a read that finds saq's
    tables missing makes them (saq's migrations), then reads; a dispatch's
    first use makes the fabric's own."""
    queue = PostgresLaneBroker(broker_dsn, FakeClock())
    try:
        with psycopg.connect(broker_dsn) as conn:
            assert conn.execute("SELECT to_regclass('saq_jobs'), to_regclass('fabric_lane_jobs')").fetchone() == (None, None)
        (lane,) = queue.lane_states({"a1-arm64": A1})
        assert (lane.in_flight, lane.workers, lane.workers_silent_s) == (0, 0, None)
        assert queue.in_flight([A1, X86]) == {A1: 0, X86: 0}
        with psycopg.connect(broker_dsn) as conn:
            assert conn.execute("SELECT to_regclass('saq_versions') IS NOT NULL").fetchone() == (True,)
        assert queue.jobs() == []
    finally:
        queue.close()


READER = """
import json, sys
from reconciler.adapters.clock import SystemClock
from reconciler.adapters.lane_broker_pg import PostgresLaneBroker

heavy = ("saq", "croniter", "dateutil", "psycopg_pool", "pydantic")
queue = PostgresLaneBroker(sys.argv[1], SystemClock())
seen = {"in_flight": queue.in_flight(["fabric-lane-a1-arm64"])}
seen["after in_flight"] = sorted(m for m in heavy if m in sys.modules)
seen["lanes"] = [lane.in_flight for lane in queue.lane_states({"a1-arm64": "fabric-lane-a1-arm64"})]
seen["after lane_states"] = sorted(m for m in heavy if m in sys.modules)
queue.close()
print(json.dumps(seen))
"""


def test_reading_the_lanes_imports_no_saq_and_the_in_flight_alone_no_model(lanes: Lanes, desired: DesiredState) -> None:
    """What a pass does with the broker: open, read the lanes' states (the
    full pass) or their in_flight alone (a memoized pass): no saq (nor its
    worker's croniter and dateutil), no pool; the in_flight alone builds no model."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    lanes.queue.enqueue([("job-1", None)])
    assert lanes.queue.dispatch("job-1", lane_targets(desired)["a1-arm64"], DispatchFence.fixed(1)) is not None
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", READER, lanes.dsn], capture_output=True, text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"in_flight": {A1: 1}, "after in_flight": [], "lanes": [1], "after lane_states": ["pydantic"]}, seen
