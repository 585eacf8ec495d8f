"""The fabric's own lanes never lose a job: a run whose agent was SIGKILLed is settled as crashed and runs again.

A real PostgreSQL (the session's, a fresh database per test) and real SAQ
workers, each its own process (tests/support/harness/saq_agent.py), so an agent can
be SIGKILLed mid-job. The fleet is the example's with the fabric's own
queues (tests/integration/own_lanes.py): workers beat every second (their
stats live 2 s), grace 1 s: a killed agent's job waits again within 3 s
plus one dispatch pass. Waits are bounded by deadlines from those timings;
nothing asserts how long anything took.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from reconciler.adapters.lane_broker_pg import SUPERSEDED_QUEUE, PostgresLaneBroker
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.model import DesiredState
from reconciler.core.scheduling.lanes import ActiveRun, CrashedRun, crash_timing
from reconciler.engine.dispatch import DispatchEvent, dispatch_pass
from reconciler.engine.lane_states import lane_targets
from reconciler.ports import DispatchFence, StaleDispatcher
from tests.support.clock import FakeClock
from tests.support.harness.saq_agent import AgentProcess, read_log
from tests.support.harness.waiting import deadline_for, wait_until
from tests.support.lane_crash_fleet import own_lanes_fleet
from tests.support.registry_store import beat_example_fleet

pytestmark = pytest.mark.integration


class World:
    def __init__(self, dsn: str, tmp_path: Path) -> None:
        self.dsn = dsn
        self.tmp = tmp_path
        self.desired: DesiredState = own_lanes_fleet(tmp_path / "fleet", beat_s=1, grace_s=1)
        self.clock = FakeClock()
        fleet = self.desired.fleet
        self.registry = SqliteRegistry(str(tmp_path / "registry.sqlite"), timing=fleet.timing, flap=fleet.flap, clock=self.clock)
        beat_example_fleet(self.registry)
        self.broker = PostgresLaneBroker(dsn, self.clock)
        self.broker.jobs()  # saq's tables made before any agent starts (two agents making them at once: one finds none)
        self.agents: list[AgentProcess] = []
        self.events: list[DispatchEvent] = []

    def agent(self, lane: str, name: str, **kwargs) -> AgentProcess:
        agent = AgentProcess(self.dsn, lane_targets(self.desired)[lane].queue, self.tmp / f"{name}.log", **kwargs)
        agent.start()
        self.agents.append(agent)
        return agent

    def dispatch(self, term: int = 1) -> list[DispatchEvent]:
        events = dispatch_pass(self.registry, self.broker, self.desired, fence=DispatchFence.fixed(term))
        self.events += events
        return events

    def close(self) -> None:
        for agent in self.agents:
            agent.stop()
        self.broker.close()
        self.registry.close()


@pytest.fixture
def world(broker_dsn: str, tmp_path: Path) -> Iterator[World]:
    w = World(broker_dsn, tmp_path)
    try:
        yield w
    finally:
        w.close()


def started(agent: AgentProcess, key: str) -> dict | None:
    return next((e for e in read_log(agent.log) if e["ev"] == "start" and e["key"] == key), None)


def saq_rows(dsn: str) -> dict[str, tuple[str, str]]:
    with psycopg.connect(dsn) as conn:
        return {key: (queue, status) for key, queue, status in conn.execute("SELECT key, queue, status FROM saq_jobs")}


def test_a_killed_agents_job_is_settled_as_crashed_runs_again_and_its_late_finish_is_ignored(world: World) -> None:
    lapse = crash_timing(world.desired.fleet.scheduler).lapse_s
    first = world.agent("a1-arm64", "a1-first")
    second = world.agent("a1-arm64", "a1-second")
    wait_until(lambda: first.ready() and second.ready(), timeout=deadline_for(lapse), what="both a1 agents beating")
    world.broker.enqueue([("long-1", 3600.0)])
    assert [(e.job, e.lane) for e in world.dispatch() if e.outcome is None] == [("long-1", "a1-arm64")]
    runner = wait_until(
        lambda: next((a for a in (first, second) if started(a, "long-1.1")), None), timeout=deadline_for(lapse), what="an a1 agent runs long-1.1"
    )
    survivor = second if runner is first else first

    killed_at = runner.kill()
    crashed = wait_until(
        lambda: [e for e in world.dispatch() if e.outcome == "crashed"], timeout=deadline_for(lapse + 1), what="long-1 settled as crashed"
    )
    assert [(e.job, e.lane, e.attempts) for e in crashed] == [("long-1", "a1-arm64", 1)], "its cloud attempt counted"
    assert crashed[0].reason is not None and crashed[0].reason.startswith("run long-1.1: its worker ")
    again = wait_until(lambda: started(survivor, "long-1.2"), timeout=deadline_for(lapse), what="long-1 running again on the other agent")
    print(f"\nlong-1: SIGKILL -> running again {again['t'] - killed_at:.2f} s (goal: lapse {lapse:g} s + one dispatch pass)")

    rows = saq_rows(world.dsn)
    assert rows["long-1.1"] == (SUPERSEDED_QUEUE, "aborting"), "the crashed run is set aside, off its lane's queue"
    assert rows["long-1.2"][1] == "active"
    assert world.broker.in_flight([lane_targets(world.desired)["a1-arm64"].queue]) == {"fabric-lane-a1-arm64": 1}, "its slot is free"

    # The dead run's worker finishing it after all writes by key, as saq's finish does.
    with psycopg.connect(world.dsn) as conn:
        conn.execute("UPDATE saq_jobs SET status = 'complete' WHERE key = 'long-1.1'")
    events = world.dispatch()
    late = [e for e in events if e.outcome == "superseded"]
    assert [(e.job, e.lane) for e in late] == [("long-1", "a1-arm64")]
    assert late[0].reason == "run long-1.1 finished late (complete) after it was settled as crashed: ignored"
    assert "finished late" in late[0].text()
    assert not [e for e in events if e.outcome == "complete"], "the late finish completed nothing"
    (job,) = world.broker.jobs()
    assert (job.job_id, job.lane, job.attempts) == ("long-1", "a1-arm64", 1), "the new run goes on"
    assert "long-1.1" not in saq_rows(world.dsn)


def test_a_run_whose_agent_lives_is_never_settled(world: World) -> None:
    """Passes while a job runs on a beating agent (several lapses long) settle nothing."""
    lapse = crash_timing(world.desired.fleet.scheduler).lapse_s
    agent = world.agent("a1-arm64", "a1")
    wait_until(agent.ready, timeout=deadline_for(lapse), what="the a1 agent beating")
    world.broker.enqueue([("steady", 3600.0)])
    world.dispatch()
    wait_until(lambda: started(agent, "steady.1"), timeout=deadline_for(lapse), what="steady running")
    until = time.monotonic() + 2 * lapse
    while time.monotonic() < until:
        assert not [e for e in world.dispatch() if e.outcome is not None]
        time.sleep(0.2)
    assert world.broker.jobs()[0].lane == "a1-arm64"


def test_settling_a_crash_is_fenced_like_a_dispatch(world: World) -> None:
    world.broker.enqueue([("j1", None)])
    target = lane_targets(world.desired)["a1-arm64"]
    assert world.broker.dispatch("j1", target, DispatchFence.fixed(5)) is not None
    crashed = CrashedRun(ActiveRun(job_id="j1", lane="a1-arm64", key="j1.1"), "its worker w stopped beating")
    with pytest.raises(StaleDispatcher, match="term 4 refused: the registry's current term is 5"):
        world.broker.settle_crashed([crashed], DispatchFence(4, lambda: 5))
    assert world.broker.jobs()[0].lane == "a1-arm64", "the refused settle changed nothing"
    assert world.broker.settle_crashed([crashed], DispatchFence.fixed(5)) == [], "a run that is not active (queued, no worker) is not settled"


def test_an_unreadable_run_record_is_named_not_a_crash_of_the_pass(world: World) -> None:
    world.broker.enqueue([("j1", None)])
    assert world.broker.dispatch("j1", lane_targets(world.desired)["a1-arm64"], DispatchFence.fixed(1)) is not None
    with psycopg.connect(world.dsn) as conn:
        conn.execute("UPDATE saq_jobs SET status = 'active', job = 'not json' WHERE key = 'j1.1'")
    (run,) = world.broker.active_runs().runs
    assert (run.key, run.readable) == ("j1.1", False)


def test_a_dispatched_job_carries_the_fleets_saq_heartbeat(broker_dsn: str, tmp_path: Path) -> None:
    """scheduler.lane_job_heartbeat_s reaches the SAQ job, so saq's own sweep ends a run nobody touches."""
    import json

    world = World(broker_dsn, tmp_path)
    try:
        world.desired = own_lanes_fleet(tmp_path / "beating", beat_s=1, grace_s=1, job_heartbeat_s=30)
        with psycopg.connect(broker_dsn) as conn:  # a1-arm64 online: a worker's stats row, as saq writes it
            conn.execute(
                "INSERT INTO saq_stats (worker_id, stats, queue_key, metadata, expire_at) VALUES ('w', '{}', %s, NULL, EXTRACT(EPOCH FROM NOW()) + 3600)",
                (lane_targets(world.desired)["a1-arm64"].queue,),
            )
        world.broker.enqueue([("j1", None)])
        assert [(e.job, e.lane) for e in world.dispatch()] == [("j1", "a1-arm64")]
        with psycopg.connect(broker_dsn) as conn:
            (job,) = conn.execute("SELECT job FROM saq_jobs WHERE key = 'j1.1'").fetchone()
        assert json.loads(bytes(job))["heartbeat"] == 30
    finally:
        world.close()


def test_a_run_saqs_sweep_is_aborting_is_set_aside_not_deleted(world: World) -> None:
    """Its worker may still run it: off its queue (the slot free, the job
    waiting again), the row kept so a late finish is seen and ignored."""
    world.broker.enqueue([("j1", None)])
    assert world.broker.dispatch("j1", lane_targets(world.desired)["a1-arm64"], DispatchFence.fixed(1)) is not None
    with psycopg.connect(world.dsn) as conn:
        conn.execute("UPDATE saq_jobs SET status = 'aborting' WHERE key = 'j1.1'")
    settled = [(e.job, e.outcome) for e in world.dispatch() if e.outcome is not None]
    assert settled == [("j1", "aborted")]
    assert saq_rows(world.dsn)["j1.1"] == (SUPERSEDED_QUEUE, "aborting")
    with psycopg.connect(world.dsn) as conn:
        conn.execute("UPDATE saq_jobs SET status = 'failed' WHERE key = 'j1.1'")
    assert [(e.job, e.outcome) for e in world.dispatch() if e.outcome is not None] == [("j1", "superseded")]
