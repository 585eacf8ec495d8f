"""Attacks on phaze's broker, each made with exactly the DSN of the identity
that could make it, against a real PostgreSQL with `fabric lane init-roles`'
roles (reconciler.core.desired.broker_access): the lane host's reader DSN
and an agent's own DSN try to raise the dispatch fence, fill a lane's cap
(rows on another queue), fake a live worker for a dead lane (saq_stats of
another queue), rewrite another agent's jobs and hold the dispatch lock.
PostgreSQL refuses each (permission denied, or row-level security: the row
is not there for that role), and dispatch goes on with the dispatcher's DSN,
fenced by the registry's term, whatever number the fence row holds.

A real saq.Worker with an agent's DSN takes and finishes jobs on its own
lane, and beats there: saq's worker makes no table, and runs under its role.
init-roles is idempotent: a second run prints "nothing to do" and changes
nothing. The example fleet's own lanes (tests/support/harness/own_lanes.py),
a sqlite registry with the fleet beating and lux leading.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from reconciler.adapters.lane_broker_pg import PostgresLaneBroker
from reconciler.adapters.lane_broker_roles import PostgresBrokerRoles
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.broker_access import DISPATCHER, READER, agent_role, broker_roles, role_steps
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.engine.dispatch import dispatch_pass, dispatcher_fence, lane_status
from reconciler.engine.lane_states import lane_targets
from reconciler.ports import LaneBrokerError
from tests.support.cli import fabric
from tests.support.clock import FakeClock
from tests.support.harness.own_lanes import OWN_A1, OWN_X86, own_lanes_fleet
from tests.support.harness.saq_workers import LaneWorkers
from tests.support.harness.waiting import deadline_for, wait_until
from tests.support.registry_store import beat_example_fleet

pytestmark = pytest.mark.integration

HEARTBEAT_S = 1
BIG = 2**63 - 1


def as_role(dsn: str, role: str) -> str:
    """`dsn` (the owner's, postgres@ on the harness's socket) as `role`."""
    assert "postgres@" in dsn
    return dsn.replace("postgres@", f"{role}@", 1)


def secret_file(path: Path, text: str) -> Path:
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return own_lanes_fleet(tmp_path_factory.mktemp("own") / "fleet")


@pytest.fixture(scope="module")
def desired(fleet: Path) -> DesiredState:
    return load_desired(fleet)


class World:
    """The broker's database with init-roles' roles, the registry (lux leading), a DSN per identity."""

    def __init__(self, dsn: str, tmp_path: Path, fleet: Path, desired: DesiredState, capsys: pytest.CaptureFixture[str]) -> None:
        self.owner = dsn
        self.fleet = fleet
        self.desired = desired
        self.admin_file = secret_file(tmp_path / "admin-url", dsn)
        code, out, err = fabric(capsys, "lane", "init-roles", "--desired", str(fleet), "--admin-url-file", str(self.admin_file))
        assert code == 0, err
        self.first_run = out
        self.reader = as_role(dsn, READER)
        self.dispatcher = as_role(dsn, DISPATCHER)
        self.agent = {lane.id: as_role(dsn, agent_role(lane.id)) for lane in desired.lanes}
        fleet_settings = desired.fleet
        self.clock = FakeClock()
        self.registry = SqliteRegistry(str(tmp_path / "registry.sqlite"), timing=fleet_settings.timing, flap=fleet_settings.flap, clock=self.clock)
        beat_example_fleet(self.registry)
        leadership = self.registry.campaign("lux", 30)
        assert leadership is not None
        self.term = leadership.term
        self.opened: list[PostgresLaneBroker] = []
        self.workers: list[LaneWorkers] = []

    def broker(self, dsn: str) -> PostgresLaneBroker:
        broker = PostgresLaneBroker(dsn, self.clock)
        self.opened.append(broker)
        return broker

    def lane_workers(self, dsn: str) -> LaneWorkers:
        workers = LaneWorkers(dsn, heartbeat_s=HEARTBEAT_S)
        self.workers.append(workers)
        return workers

    def dispatch(self) -> list[tuple[str, str | None]]:
        """One dispatch pass with the dispatcher's DSN, fenced by lux's term: (job, lane) of each start."""
        events = dispatch_pass(self.registry, self.broker(self.dispatcher), self.desired, fence=dispatcher_fence(self.registry, self.term))
        return [(e.job, e.lane) for e in events if e.lane is not None and e.outcome is None]

    def close(self) -> None:
        for workers in self.workers:
            workers.close()
        for broker in self.opened:
            broker.close()
        self.registry.close()


@pytest.fixture
def world(broker_dsn: str, tmp_path: Path, fleet: Path, desired: DesiredState, capsys: pytest.CaptureFixture[str]) -> Iterator[World]:
    made = World(broker_dsn, tmp_path, fleet, desired, capsys)
    try:
        yield made
    finally:
        made.close()


def refused(dsn: str, statement: str, params: tuple[object, ...] = ()) -> str:
    """What PostgreSQL says when `statement` is made with `dsn` (it must refuse)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as caught:
            conn.execute(statement, params)
    return str(caught.value).splitlines()[0]


def changed(dsn: str, statement: str, params: tuple[object, ...] = ()) -> int:
    """How many rows `statement` touched with `dsn` (row-level security hides what is not the role's)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(statement, params).rowcount


def waiting_worker(world: World, lane: str, queue: str) -> LaneWorkers:
    """A real SAQ worker with the lane's own agent DSN, beating on its queue (seen with the reader's)."""
    workers = world.lane_workers(world.agent[lane])
    workers.start(queue)
    reader = world.broker(world.reader)
    wait_until(lambda: reader.lane_states({lane: queue})[0].workers > 0, timeout=deadline_for(HEARTBEAT_S, at_least=10), what=f"a worker on {queue}")
    return workers


def test_init_roles_says_what_it_did_and_a_second_run_does_nothing(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    first = world.first_run
    assert "made saq's tables" in first and "made the fabric's tables" in first
    for line in (
        f"created role {READER}",
        f"created role {DISPATCHER}",
        f"created role {agent_role('a1-arm64')}",
        f"granted SELECT on fabric_lane_fence to {READER}",
        f"granted UPDATE on fabric_lane_fence to {DISPATCHER}",
        "enabled row-level security on saq_jobs",
        "enabled row-level security on saq_stats",
        f"made policy {agent_role('a1-arm64')} on saq_stats: queue_key in {OWN_A1}",
        f"made schema {agent_role('a1-arm64')}",
    ):
        assert line in first, first
    admin = PostgresBrokerRoles(world.owner)
    try:
        before = admin.role_state()
        assert role_steps(broker_roles(world.desired), before) == []
        code, again, err = fabric(capsys, "lane", "init-roles", "--desired", str(world.fleet), "--admin-url-file", str(world.admin_file))
        assert (code, err) == (0, "")
        assert again.startswith("nothing to do"), again
        assert admin.role_state() == before
    finally:
        admin.close()


def test_no_lane_host_or_agent_can_raise_the_fence_and_dispatch_goes_on(world: World) -> None:
    for who in (world.reader, world.agent["a1-arm64"], world.agent["local"]):
        reason = refused(who, "UPDATE fabric_lane_fence SET epoch = %s WHERE id = 1", (BIG,))
        assert "permission denied for table fabric_lane_fence" in reason
    # The dispatcher's own DSN may write the row: the number decides nothing, the registry's term does.
    assert changed(world.dispatcher, "UPDATE fabric_lane_fence SET epoch = %s WHERE id = 1", (BIG,)) == 1
    waiting_worker(world, "a1-arm64", OWN_A1)
    world.broker(world.dispatcher).enqueue([("clip-1", 3600.0)])
    assert world.dispatch() == [("clip-1", "a1-arm64")]
    with psycopg.connect(world.owner) as conn:
        assert conn.execute("SELECT epoch FROM fabric_lane_fence").fetchone() == (world.term,), "the row records the term that dispatched"


def test_no_lane_host_or_agent_can_hold_the_dispatch_lock(world: World) -> None:
    """The dispatch lock is the fence row (FOR UPDATE needs UPDATE on it); an
    advisory lock anyone may take is no longer one."""
    for who in (world.reader, world.agent["a1-arm64"]):
        reason = refused(who, "SELECT epoch FROM fabric_lane_fence FOR UPDATE")
        assert "permission denied for table fabric_lane_fence" in reason
    waiting_worker(world, "a1-arm64", OWN_A1)
    with psycopg.connect(world.agent["a1-arm64"], autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(4011, hashtext(%s))", (OWN_A1,))  # the old dispatch lock's key
        world.broker(world.dispatcher).enqueue([("clip-2", 3600.0)])
        assert world.dispatch() == [("clip-2", "a1-arm64")]


def test_no_lane_host_or_agent_can_fill_a_lanes_cap(world: World) -> None:
    row = (
        "INSERT INTO saq_jobs (key, job, queue, status, priority, group_key, scheduled)"
        " VALUES (%s, '\\x7b7d'::bytea, %s, 'queued', 0, NULL, EXTRACT(EPOCH FROM NOW())::BIGINT)"
    )
    for n, who in enumerate((world.reader, world.agent["a1-arm64"], world.agent["local"])):
        assert "permission denied for table saq_jobs" in refused(who, row, (f"filler-{n}", OWN_X86))
    assert "permission denied for table fabric_lane_jobs" in refused(
        world.agent["a1-arm64"], "INSERT INTO fabric_lane_jobs (job_id, enqueued_at) VALUES ('x', 0)"
    )
    waiting_worker(world, "x86-spill", OWN_X86)
    assert world.broker(world.reader).in_flight([OWN_X86]) == {OWN_X86: 0}, "no filler row is in x86-spill's queue"
    world.broker(world.dispatcher).enqueue([("clip-3", 3600.0)])
    # a1-arm64 has no worker (offline): the job goes to x86-spill, whose cap nobody filled.
    assert world.dispatch() == [("clip-3", "x86-spill")]


def test_no_lane_host_or_agent_can_fake_a_worker_for_a_dead_lane(world: World) -> None:
    beat = "INSERT INTO saq_stats (worker_id, stats, queue_key, metadata, expire_at) VALUES (%s, '{}', %s, '{}', EXTRACT(EPOCH FROM NOW()) + 3600)"
    assert "permission denied for table saq_stats" in refused(world.reader, beat, ("fake-reader", OWN_X86))
    with psycopg.connect(world.agent["a1-arm64"], autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
            conn.execute(beat, ("fake-agent", OWN_X86))
    # ... and it cannot move its own beat onto another queue either.
    assert changed(world.agent["a1-arm64"], beat, ("own-beat", OWN_A1)) == 1
    with psycopg.connect(world.agent["a1-arm64"], autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
            conn.execute("UPDATE saq_stats SET queue_key = %s WHERE worker_id = 'own-beat'", (OWN_X86,))
    views = {v.id: v for v in lane_status(world.registry, world.broker(world.reader), world.desired).lanes}
    assert not views["x86-spill"].available and views["x86-spill"].reason == f"no SAQ worker on {OWN_X86}"


def test_an_agent_cannot_rewrite_another_agents_jobs(world: World) -> None:
    broker = world.broker(world.dispatcher)
    broker.enqueue([("clip-4", 3600.0)])
    # A job on x86-spill's queue (no worker there: it stays queued).
    target = lane_targets(world.desired)["x86-spill"]
    assert broker.dispatch("clip-4", target, dispatcher_fence(world.registry, world.term)) is not None
    intruder = world.agent["a1-arm64"]
    assert changed(intruder, "UPDATE saq_jobs SET status = 'complete' WHERE queue = %s", (OWN_X86,)) == 0
    assert changed(intruder, "UPDATE saq_jobs SET status = 'aborted' WHERE key = 'clip-4.1'") == 0
    assert changed(intruder, "DELETE FROM saq_jobs WHERE key = 'clip-4.1'") == 0
    with psycopg.connect(intruder, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM saq_jobs").fetchone() == (0,), "another lane's jobs are not there for it"
    assert "permission denied for table saq_jobs" in refused(world.reader, "UPDATE saq_jobs SET status = 'complete' WHERE key = 'clip-4.1'")
    with psycopg.connect(world.owner, autocommit=True) as conn:
        assert conn.execute("SELECT queue, status FROM saq_jobs WHERE key = 'clip-4.1'").fetchone() == (OWN_X86, "queued")


def test_an_agent_takes_finishes_and_beats_on_its_own_lane_with_its_own_role(world: World) -> None:
    """saq's worker (its migrations check, dequeue, finish, stats) under the
    lane's role; the dispatcher settles what it finished; the reader sees it all."""
    workers = waiting_worker(world, "a1-arm64", OWN_A1)
    world.broker(world.dispatcher).enqueue([("clip-5", 3600.0)])
    assert world.dispatch() == [("clip-5", "a1-arm64")]
    wait_until(lambda: "clip-5" in workers.running(), timeout=deadline_for(HEARTBEAT_S, at_least=10), what="clip-5 taken by a1-arm64's worker")
    workers.finish("clip-5")
    dispatcher = world.broker(world.dispatcher)
    wait_until(lambda: [(s.job_id, s.outcome) for s in dispatcher.settle()] == [("clip-5", "complete")], timeout=10, what="clip-5 settled")
    assert world.broker(world.reader).jobs() == []


def test_the_reader_reads_the_lanes_and_can_dispatch_nothing(world: World) -> None:
    reader = world.broker(world.reader)
    assert reader.in_flight([OWN_A1, OWN_X86]) == {OWN_A1: 0, OWN_X86: 0}
    world.broker(world.dispatcher).enqueue([("clip-6", 3600.0)])
    assert [j.job_id for j in reader.jobs()] == ["clip-6"]
    with pytest.raises(LaneBrokerError, match="permission denied"):
        reader.enqueue([("clip-7", None)])
    with pytest.raises(LaneBrokerError, match="permission denied"):
        reader.dispatch("clip-6", lane_targets(world.desired)["local"], dispatcher_fence(world.registry, world.term))


def test_the_fleets_commands_take_each_roles_dsn_from_fabric_toml(world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """[phaze] queue_url_file is the reader's, dispatcher_url_file the
    dispatcher's: `fabric lane enqueue` and `dispatch` work with the
    dispatcher's, `fabric lane status` reads with the reader's; a dispatcher
    handed the reader's DSN is refused by PostgreSQL and changes nothing."""
    import shutil

    fleet = tmp_path / "fleet"
    shutil.copytree(world.fleet, fleet)
    reader_file = secret_file(tmp_path / "reader.url", world.reader)
    dispatcher_file = secret_file(tmp_path / "dispatcher.url", world.dispatcher)
    toml = fleet / "fabric.toml"
    toml.write_text(
        toml.read_text().replace("[phaze]\n", f'[phaze]\nqueue_url_file = "{reader_file}"\ndispatcher_url_file = "{dispatcher_file}"\n', 1)
    )
    registry = ("--desired", str(fleet), "--registry-path", str(tmp_path / "cli-registry.sqlite"))
    code, out, err = fabric(capsys, "lane", "enqueue", "clip-8", "--duration", "3600", *registry)
    assert code == 0, err
    code, out, err = fabric(capsys, "lane", "dispatch", "--once", "--queue-url-file", str(reader_file), *registry)
    assert code == 1 and "permission denied" in err, (out, err)
    assert world.reader not in out + err
    code, out, err = fabric(capsys, "lane", "dispatch", "--once", "--json", *registry)
    assert code == 0, err  # no host reports in this registry: the job is held, by the dispatcher's own DSN
    assert json.loads(out.splitlines()[-1])["hold"] == "no_free_slots", out
    code, out, err = fabric(capsys, "lane", "status", "--json", *registry)
    assert code == 0, err
    assert [job["job"] for job in json.loads(out)["waiting"]] == ["clip-8"]
    with psycopg.connect(world.owner) as conn:
        assert conn.execute("SELECT lane FROM fabric_lane_jobs WHERE job_id = 'clip-8'").fetchone() == (None,)


def test_init_roles_makes_again_what_was_taken_away(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    """A view dropped from an agent's schema, a policy dropped, a privilege
    granted by hand: the next run says what it changes back, and only that."""
    agent = agent_role("a1-arm64")
    with psycopg.connect(world.owner, autocommit=True) as conn:
        conn.execute(f'DROP VIEW "{agent}".saq_versions')
        conn.execute(f'DROP POLICY "{agent}" ON saq_stats')
        conn.execute(f'GRANT UPDATE ON fabric_lane_fence TO "{READER}"')
    code, out, err = fabric(capsys, "lane", "init-roles", "--desired", str(world.fleet), "--admin-url-file", str(world.admin_file))
    assert (code, err) == (0, ""), err
    changes = [line for line in out.splitlines() if not line.startswith("the roles have no password")]
    assert changes == [
        f"made schema {agent} (saq's version view; the role may create only there)",
        f"revoked UPDATE on fabric_lane_fence from {READER}",
        f"made policy {agent} on saq_stats: queue_key in {OWN_A1}",
    ], out
    assert "permission denied for table fabric_lane_fence" in refused(world.reader, "UPDATE fabric_lane_fence SET epoch = 0")
