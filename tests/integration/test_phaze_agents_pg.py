"""The second health signal of a phaze fleet's lanes: each lane's agent as phaze's own `agents` table shows it.

phaze a3fd169 exposes an agent's last_seen in no JSON route of its API
(routers/admin_agents.py renders HTML; whoami's AgentIdentity has no
last_seen): it lives in its `agents` table (models/agent.py), set to now()
by each heartbeat an agent POSTs (routers/agent_heartbeat.py). By phaze's
default its queue_url and database_url name one database, so the fabric
reads the row on phaze's broker (`PostgresLaneBroker.phaze_agents`).

A real PostgreSQL (a fresh database per test), the table made from
tests/fixtures/phaze/agents.sql (phaze's declaration, recorded), the example
fleet (a phaze fleet) and its real lane status and cards. Who writes the
table: phaze's API (an agent's beat refreshes its own row), so what it holds
is checked as untrusted: a missing table, a table of another shape, a value
that makes no sense, an unreachable broker: each lane's agent is `unknown`
with the reason and the read goes on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from reconciler.adapters.lane_broker_pg import PostgresLaneBroker
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.core.views.cards import fleet_status, status_document
from reconciler.engine.dispatch import lane_status
from reconciler.engine.lane_states import with_lane_states
from tests.conftest import EXAMPLE_FLEET
from tests.support.clock import FakeClock
from tests.support.registry_store import beat_example_fleet

pytestmark = pytest.mark.integration

AGENTS_SQL = Path(__file__).resolve().parents[1] / "fixtures" / "phaze" / "agents.sql"

# (id, kind, seconds since last seen or None, revoked)
ROWS = [
    ("a1-arm64", "compute", 12, False),
    ("x86-spill", "compute", 200, False),
    ("lux", "fileserver", 1000, False),
    ("never-seen", "compute", None, False),
    ("gone", "compute", 5, True),
]


def phaze_table(dsn: str, rows=ROWS) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(AGENTS_SQL.read_text())
        for agent_id, kind, ago, revoked in rows:
            conn.execute(
                "INSERT INTO agents (id, name, kind, last_seen_at, revoked_at) VALUES (%s, %s, %s,"
                " CASE WHEN %s::float8 IS NULL THEN NULL ELSE now() - make_interval(secs => %s::float8) END,"
                " CASE WHEN %s THEN now() ELSE NULL END)",
                (agent_id, agent_id, kind, ago, ago, revoked),
            )


class World:
    def __init__(self, dsn: str, tmp_path: Path) -> None:
        self.desired: DesiredState = load_desired(EXAMPLE_FLEET)
        assert self.desired.fleet.phaze_dispatches, "the example fleet is a phaze fleet"
        self.clock = FakeClock()
        fleet = self.desired.fleet
        self.registry = SqliteRegistry(str(tmp_path / "registry.sqlite"), timing=fleet.timing, flap=fleet.flap, clock=self.clock)
        beat_example_fleet(self.registry)
        self.broker = PostgresLaneBroker(dsn, self.clock)

    def lanes(self) -> dict[str, dict]:
        return {lane["id"]: lane for lane in lane_status(self.registry, self.broker, self.desired).as_json()["lanes"]}

    def cards(self) -> dict[str, dict]:
        snapshot = with_lane_states(self.registry.snapshot(lanes=[lane.id for lane in self.desired.lanes]), self.broker, self.desired)
        document = status_document(fleet_status(self.desired, snapshot, None, snapshot.now))
        return {lane["id"]: lane for lane in document["lanes"]}

    def close(self) -> None:
        self.broker.close()
        self.registry.close()


@pytest.fixture
def world(broker_dsn: str, tmp_path: Path) -> Iterator[World]:
    w = World(broker_dsn, tmp_path)
    try:
        yield w
    finally:
        w.close()


def test_phaze_agents_are_classified_as_phaze_classifies_them(world: World, broker_dsn: str) -> None:
    phaze_table(broker_dsn)
    seen = world.broker.phaze_agents(["a1-arm64", "x86-spill", "lux", "never-seen", "gone", "ghost"])
    assert {a: s.status for a, s in seen.items()} == {
        "a1-arm64": "alive",
        "x86-spill": "stale",
        "lux": "dead",
        "never-seen": "never",
        "gone": "revoked",
        "ghost": "unknown",
    }
    assert 12 <= (seen["a1-arm64"].seen_ago_s or 0) < 90
    assert seen["ghost"].reason == "no row in phaze's agents table (not registered with phaze)"


def test_lane_status_and_cards_show_phazes_word_beside_its_cap(world: World, broker_dsn: str) -> None:
    phaze_table(broker_dsn)
    lanes = world.lanes()
    assert lanes["a1-arm64"]["phaze_agent"]["status"] == "alive"
    assert lanes["x86-spill"]["phaze_agent"]["status"] == "stale"
    assert lanes["local"]["phaze_agent"]["agent_id"] == "lux", "the local lane's agent is phaze's file server agent"
    assert lanes["local"]["queue"] == "phaze-agent-lux-analyze"
    cards = world.cards()
    assert "phaze cap 2 · phaze sees agent a1-arm64 alive (" in cards["a1-arm64"]["card"]
    assert "phaze cap 4 · phaze sees agent x86-spill stale (" in cards["x86-spill"]["card"]
    assert cards["local"]["phaze_agent"]["status"] == "dead"


def test_no_agents_table_in_the_brokers_database_is_unknown_not_a_failed_read(world: World) -> None:
    lanes = world.lanes()
    assert {lane["phaze_agent"]["status"] for lane in lanes.values()} == {"unknown"}
    assert lanes["a1-arm64"]["phaze_agent"]["reason"] == "phaze's agents table is not in the broker's database"
    assert lanes["a1-arm64"]["workers"] == 0, "the queue's own signal is read as before"


@pytest.mark.parametrize(
    ("case", "ddl", "reason_starts"),
    [
        (
            "no last_seen_at column",
            "CREATE TABLE agents (id TEXT PRIMARY KEY, revoked_at TIMESTAMPTZ)",
            "phaze's agents table is not as phaze makes it",
        ),
        (
            "last_seen_at as text",
            "CREATE TABLE agents (id TEXT PRIMARY KEY, last_seen_at TEXT, revoked_at TIMESTAMPTZ)",
            "phaze's agents table is not as phaze makes it",
        ),
        (
            "id as a number",
            "CREATE TABLE agents (id INTEGER PRIMARY KEY, last_seen_at TIMESTAMPTZ, revoked_at TIMESTAMPTZ)",
            "phaze's agents table is not as phaze makes it",
        ),
    ],
)
def test_a_table_of_another_shape_is_unknown_with_the_reason(world: World, broker_dsn: str, case: str, ddl: str, reason_starts: str) -> None:
    with psycopg.connect(broker_dsn, autocommit=True) as conn:
        conn.execute(ddl)
    lanes = world.lanes()
    assert all(lane["phaze_agent"]["status"] == "unknown" for lane in lanes.values()), case
    assert lanes["a1-arm64"]["phaze_agent"]["reason"].startswith(reason_starts), case
    assert world.lanes()["a1-arm64"]["phaze_agent"]["status"] == "unknown", "the session is still good for the next read"


def test_values_that_make_no_sense_are_unknown_for_that_agent_alone(world: World, broker_dsn: str) -> None:
    phaze_table(broker_dsn, [("a1-arm64", "compute", -3600, False), ("x86-spill", "compute", 3, False)])
    lanes = world.lanes()
    assert lanes["a1-arm64"]["phaze_agent"]["status"] == "unknown"
    assert "ahead of the database's clock" in lanes["a1-arm64"]["phaze_agent"]["reason"]
    assert lanes["x86-spill"]["phaze_agent"]["status"] == "alive"


@pytest.mark.parametrize("when", ["-infinity", "infinity"])
def test_an_infinite_last_seen_is_unknown_for_that_agent_alone(world: World, broker_dsn: str, when: str) -> None:
    phaze_table(broker_dsn, [("x86-spill", "compute", 3, False)])
    with psycopg.connect(broker_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO agents (id, name, kind, last_seen_at) VALUES ('a1-arm64', 'a1-arm64', 'compute', %s)", (when,))
    lanes = world.lanes()
    assert lanes["a1-arm64"]["phaze_agent"] == {
        "agent_id": "a1-arm64",
        "status": "unknown",
        "seen_ago_s": None,
        "reason": "its last_seen_at is not a finite time",
    }
    assert lanes["x86-spill"]["phaze_agent"]["status"] == "alive"
