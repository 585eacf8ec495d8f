"""Chaos on the fabric's own lanes: agents SIGKILLed and restarted at random, a broker restart, a leader change; no job lost.

A PostgreSQL of this module's own (it is restarted once) and real SAQ
workers, each its own process (tests/support/harness/saq_agent.py): one agent on
a1-arm64 (cap 2), two on x86-spill (cap 4), one on the local lane (cap 1),
the example fleet's lanes on the fabric's own queues
(tests/integration/own_lanes.py). JOBS jobs are enqueued, a fifth of them
short (local only); each run lasts 0.2-0.8 s (from its job id) and touches
its SAQ heartbeat every 0.5 s. Workers beat every second, grace 2 s.

Dispatcher A (term 1) runs passes every PASS_S (sooner when a run's worker
lapses first, as `fabric lane dispatch` does); once a third of the jobs
completed, the registry's term becomes 2 and dispatcher B (term 2) starts
beside it (a new leader's term), and A must be refused. Once half completed, the broker restarts. Meanwhile
KILLS agents are SIGKILLed at random moments (random.Random(SEED)) and
restarted a little later; an agent that dies by itself is restarted too.

Asserted:
  - no lane's queue ever held more than its cap (sampled every 100 ms);
  - no job ran on two agents at once (each run from its start line to its
    end line, or to its agent's death);
  - every job completed exactly once from the job system's point of view
    (one `complete` settle event per job across both dispatchers, and the
    lane queue empty at the end);
  - A was refused (StaleDispatcher) after B started; B never was.
Deadlines come from those timings; the test asserts no duration. It prints
how many runs crashed and were settled, and the kill-to-running-again
times it saw.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from reconciler.adapters.lane_broker_pg import PostgresLaneBroker
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.model import DesiredState
from reconciler.core.scheduling.lanes import crash_timing
from reconciler.engine.dispatch import DispatchEvent, dispatch_once
from reconciler.engine.lane_states import lane_targets
from reconciler.ports import DispatchFence, LaneBrokerUnavailable, StaleDispatcher
from tests.support.clock import FakeClock
from tests.support.harness.postgres import PostgresServer, postgres_server
from tests.support.harness.saq_agent import AgentProcess, read_log
from tests.support.harness.waiting import deadline_for, wait_until
from tests.support.lane_crash_fleet import own_lanes_fleet
from tests.support.registry_store import beat_example_fleet

pytestmark = pytest.mark.integration

SEED = 33
JOBS = int(os.environ.get("FABRIC_CHAOS_JOBS", "300"))  # fewer only to try the test out by hand
KILLS = 12
PASS_S = 0.25
SAMPLE_S = 0.1
SPREAD = (0.2, 0.8)
TOUCH_S = 0.5
BEAT_S, GRACE_S, JOB_HEARTBEAT_S = 1, 2, 3
# lane -> (agents, concurrency of each)
AGENTS = {"a1-arm64": (1, 2), "x86-spill": (2, 2), "local": (1, 1)}


@pytest.fixture(scope="module")
def server() -> Iterator[PostgresServer]:
    with postgres_server() as pg:
        yield pg


class Dispatcher(threading.Thread):
    """One dispatcher (a leader's term): passes every PASS_S until stopped or refused."""

    def __init__(
        self, name: str, fence: DispatchFence, dsn: str, registry_path: str, desired: DesiredState, clock: FakeClock, stop: threading.Event
    ) -> None:
        super().__init__(name=name, daemon=True)
        self.fence, self.dsn, self.registry_path, self.desired, self.clock, self.stop = fence, dsn, registry_path, desired, clock, stop
        self.events: list[DispatchEvent] = []
        self.heard_at: list[float] = []  # epoch s each event was told
        self.refused: StaleDispatcher | None = None
        self.outages = 0
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def run(self) -> None:
        fleet = self.desired.fleet
        registry = SqliteRegistry(self.registry_path, timing=fleet.timing, flap=fleet.flap, clock=self.clock)
        broker: PostgresLaneBroker | None = None
        try:
            while not self.stop.is_set():
                wait_s = PASS_S
                try:
                    if broker is None:
                        broker = PostgresLaneBroker(self.dsn, self.clock, connect_timeout_s=2)
                    # As run_dispatcher waits: PASS_S, or less when a run's worker lapses first
                    # (counted from the pass's start, where it read the runs).
                    started = time.monotonic()
                    outcome = dispatch_once(registry, broker, self.desired, fence=self.fence, emit=self.heard)
                    wait_s = max(0.0, outcome.wake_in_s(PASS_S) - (time.monotonic() - started)) if outcome.crash_check_in_s is not None else PASS_S
                except StaleDispatcher as exc:
                    self.refused = exc
                    return
                except LaneBrokerUnavailable:
                    self.outages += 1
                self.stop.wait(wait_s)
        except BaseException as exc:  # the test reports it
            self.error = exc
        finally:
            if broker is not None:
                broker.close()
            registry.close()

    def heard(self, event: DispatchEvent) -> None:
        """The job system's ear: every event as the dispatcher tells it."""
        with self.lock:
            self.events.append(event)
            self.heard_at.append(time.time())

    def completed(self) -> list[str]:
        with self.lock:
            return [e.job for e in self.events if e.outcome == "complete"]


class Sampler(threading.Thread):
    """Every SAMPLE_S: the jobs each lane's queue holds (saq_jobs rows not finished); the most seen."""

    def __init__(self, dsn: str, queues: list[str], stop: threading.Event) -> None:
        super().__init__(name="sampler", daemon=True)
        self.dsn, self.queues, self.stop = dsn, queues, stop
        self.most: Counter[str] = Counter()
        self.samples = 0

    def run(self) -> None:
        conn: psycopg.Connection | None = None
        while not self.stop.wait(SAMPLE_S):
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=2)
                rows = conn.execute(
                    "SELECT queue, count(*) FROM saq_jobs WHERE queue = ANY(%s) AND status IN ('new','deferred','queued','active') GROUP BY queue",
                    (self.queues,),
                ).fetchall()
            except psycopg.Error:
                conn = None  # the broker restarting
                continue
            self.samples += 1
            for queue, held in rows:
                self.most[queue] = max(self.most[queue], int(held))
        if conn is not None:
            conn.close()


def stuck(dsn: str, jobs: set[str]) -> str:
    """What the broker holds of `jobs` (for a failure message)."""
    with psycopg.connect(dsn, connect_timeout=5) as conn:
        waiting = conn.execute(
            "SELECT job_id, lane, saq_key, attempts, dispatches FROM fabric_lane_jobs WHERE job_id = ANY(%s)", (sorted(jobs),)
        ).fetchall()
        rows = conn.execute(
            "SELECT key, queue, status, convert_from(job, 'UTF8') FROM saq_jobs WHERE split_part(key, '.', 1) = ANY(%s) ORDER BY key", (sorted(jobs),)
        ).fetchall()
        stats = conn.execute("SELECT worker_id, queue_key, expire_at - EXTRACT(EPOCH FROM NOW()) FROM saq_stats").fetchall()
    return f"fabric_lane_jobs {waiting}; saq_jobs {rows}; saq_stats {stats}"


def runs_of(agents: list[AgentProcess]) -> dict[str, list[tuple[float, float, str]]]:
    """job -> its runs (start, end, key): from each start line to its end line, or to its agent's death."""
    runs: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for agent in agents:
        lines = read_log(agent.log)
        ends = {(e["agent"], e["key"]): e["t"] for e in lines if e["ev"] == "end"}
        for e in lines:
            if e["ev"] != "start":
                continue
            end = ends.get((e["agent"], e["key"]), agent.ended.get(e["agent"]))
            assert end is not None, f"run {e['key']} on live agent {e['agent']} never ended"
            runs[e["job"]].append((e["t"], end, e["key"]))
    return runs


def test_300_jobs_through_kills_a_broker_restart_and_a_leader_change_each_complete_once_never_over_cap(
    server: PostgresServer, tmp_path: Path
) -> None:
    rng = random.Random(SEED)
    desired = own_lanes_fleet(tmp_path / "fleet", beat_s=BEAT_S, grace_s=GRACE_S, job_heartbeat_s=JOB_HEARTBEAT_S)
    lapse = crash_timing(desired.fleet.scheduler).lapse_s
    targets = lane_targets(desired)
    dsn = server.database("chaos")
    clock = FakeClock()
    registry_path = str(tmp_path / "registry.sqlite")
    fleet = desired.fleet
    registry = SqliteRegistry(registry_path, timing=fleet.timing, flap=fleet.flap, clock=clock)
    beat_example_fleet(registry)
    registry.close()
    jobs = [f"chaos-{i:03d}" for i in range(JOBS)]
    broker = PostgresLaneBroker(dsn, clock)
    try:
        broker.enqueue([(job, 60.0 if i % 5 == 0 else None) for i, job in enumerate(jobs)])
    finally:
        broker.close()

    agents = [
        AgentProcess(dsn, targets[lane].queue, tmp_path / f"{lane}-{n}.log", concurrency=concurrency, beat=BEAT_S, touch=TOUCH_S, spread=SPREAD)
        for lane, (count, concurrency) in AGENTS.items()
        for n in range(count)
    ]
    stop = threading.Event()
    sampler = Sampler(dsn, [t.queue for t in targets.values()], stop)
    registry_term = [1]  # the registry's current term, as the dispatchers' fences read it
    first = Dispatcher("dispatcher-a", DispatchFence(1, lambda: registry_term[0]), dsn, registry_path, desired, clock, stop)
    second = Dispatcher("dispatcher-b", DispatchFence(2, lambda: registry_term[0]), dsn, registry_path, desired, clock, stop)
    kills: list[tuple[float, AgentProcess]] = []
    restarted_on_its_own = 0
    try:
        for agent in agents:
            agent.start()
        wait_until(lambda: all(a.ready() for a in agents), timeout=deadline_for(lapse, at_least=30), what="every agent beating")
        sampler.start()
        first.start()

        def completed() -> Counter[str]:
            return Counter(first.completed() + second.completed())

        # Chaos: KILLS SIGKILLs at random moments, each agent back a little later;
        # B takes over at a third, the broker restarts at half.
        restart_at: dict[int, float] = {}
        next_kill = time.monotonic() + rng.uniform(0.3, 0.8) * lapse
        broker_restarted = False
        next_note = time.monotonic()
        deadline = time.monotonic() + deadline_for(JOBS * SPREAD[1] / sum(c * n for n, c in AGENTS.values()) + KILLS * lapse, at_least=120)
        while sum(completed().values()) < JOBS:
            assert time.monotonic() < deadline, f"only {sum(completed().values())} of {JOBS} jobs completed; " + stuck(
                dsn, set(jobs) - set(completed())
            )
            assert first.error is None and second.error is None, (first.error, second.error)
            now = time.monotonic()
            done = sum(completed().values())
            if not second.is_alive() and second.ident is None and done >= JOBS // 3:
                registry_term[0] = 2  # a new leader's term
                second.start()
            if not broker_restarted and done >= JOBS // 2:
                server.restart()
                broker_restarted = True
            if len(kills) < KILLS and now >= next_kill:
                alive = [i for i, a in enumerate(agents) if a.alive()]
                if alive:
                    victim = rng.choice(alive)
                    kills.append((agents[victim].kill(), agents[victim]))
                    restart_at[victim] = now + rng.uniform(0.2, 1.0) * lapse
                next_kill = now + rng.uniform(0.3, 0.8) * lapse
            for i, agent in enumerate(agents):
                if agent.alive():
                    continue
                if i not in restart_at:  # died by itself (not killed by the test): back at once
                    agent.stop()
                    restarted_on_its_own += 1
                    restart_at[i] = now
                if now >= restart_at[i]:
                    agent.start()
                    del restart_at[i]
            if now >= next_note:
                print(f"chaos: {done}/{JOBS} completed, {len(kills)} kills, agents alive {sum(a.alive() for a in agents)}", flush=True)
                next_note = now + 10
            stop.wait(SAMPLE_S)
    finally:
        stop.set()
        for thread in (first, second, sampler):
            if thread.ident is not None:
                thread.join(deadline_for(PASS_S))
        for agent in agents:
            agent.stop()

    broker = PostgresLaneBroker(dsn, clock)  # a new session: the restart ended the first
    try:
        left = broker.jobs()
    finally:
        broker.close()
    events = first.events + second.events
    runs = runs_of(agents)
    crashed = [e for e in events if e.outcome == "crashed"]
    late = [e for e in events if e.outcome == "superseded"]
    # From a SIGKILL to the dispatcher telling the run crashed (the goal), and to the job's next run (that also waits for a free slot).
    began = {e["key"]: (e["agent"], agent) for agent in agents for e in read_log(agent.log) if e["ev"] == "start"}
    settled, again = [], []
    for event, at in zip(first.events + second.events, first.heard_at + second.heard_at, strict=True):
        if event.outcome != "crashed" or event.reason is None:
            continue
        key = event.reason.split(":", 1)[0].removeprefix("run ")
        pid, agent = began.get(key, (None, None))
        if agent is not None and pid in agent.ended:
            killed_at = agent.ended[pid]
            settled.append(at - killed_at)
            later = [r[0] for r in runs[event.job] if r[0] > at]
            if later:
                again.append(min(later) - killed_at)
    print(
        f"\nchaos: {JOBS} jobs, {len(kills)} kills, {restarted_on_its_own} agents died by themselves, {len(crashed)} runs settled as crashed,"
        f" {len(late)} late finishes ignored, {sum(len(r) for r in runs.values())} runs, {sampler.samples} samples,"
        f" dispatcher outages A {first.outages} B {second.outages}"
    )
    if settled:
        print(
            f"chaos: SIGKILL -> settled as crashed: max {max(settled):.2f} s, median {sorted(settled)[len(settled) // 2]:.2f} s"
            f" (goal: lapse {lapse:g} s + one pass {PASS_S:g} s); -> running again (a free slot too):"
            f" max {max(again, default=0):.2f} s, median {sorted(again)[len(again) // 2] if again else 0:.2f} s"
        )

    over = {q: n for q, n in sampler.most.items() if n > next(t.cap for t in targets.values() if t.queue == q)}
    assert not over, f"a lane's queue held more than its cap: {over}"
    assert sampler.samples > 0
    for job, job_runs in runs.items():
        ordered = sorted(job_runs)
        for before, after in zip(ordered, ordered[1:], strict=False):
            assert after[0] >= before[1], f"{job} ran twice at once: {before} and {after}"
    done = Counter(e.job for e in events if e.outcome == "complete")
    assert sorted(done) == jobs, f"jobs never completed: {sorted(set(jobs) - set(done))[:10]}"
    assert set(done.values()) == {1}, f"completed more than once: {[j for j, n in done.items() if n > 1]}"
    assert left == [], "the lane queue holds no job at the end"
    assert first.refused is not None and "term 1 refused: the registry's current term is 2" in str(first.refused), (
        "the old term's dispatcher was refused"
    )
    assert second.refused is None
    assert len(kills) == KILLS and broker_restarted
    assert crashed, "the chaos hit running jobs, which were settled as crashed"
