"""Registry reads never trust a host's bytes (sqlite): whatever a host writes
into its own heartbeat record, the leader step, a pass's plan read and the
read-only commands (`fabric nodes`, `fabric status`) still finish; the record
is skipped, its node counts as not beating, and the problem is named once
("x86-spill: unreadable heartbeat record: ...").

The sqlite file has no per-host identities (whoever may write it may write
everything); its `nodes` row of a host is what that host's beat writes, so
it stands for the host's own keys here. The same attack on etcd, with the
host's own certificate, is tests/integration/test_registry_untrusted_etcd.py.
"""

from __future__ import annotations

import json
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.adapters.clock import SystemClock
from reconciler.adapters.registry_records import MAX_RECORD_BYTES, parse_record
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.cli import EXIT_OK, main
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import Snapshot
from reconciler.core.live.records import NodeRecord
from reconciler.core.live.unreadable import UnreadableRecord
from reconciler.core.scheduling.placement import schedule
from reconciler.core.views.page import render_status_page
from reconciler.engine.leader import candidate_loop
from reconciler.engine.pass_options import PlanFromRegistry
from reconciler.engine.plan_source import fleet_plan_for
from reconciler.ports import RegistryError
from tests.conftest import REPO
from tests.support.hooks import NoHooks
from tests.support.plan_keys import CANDIDATES, FakeSigner, SignedFleet, signed_example_fleet
from tests.support.probe_fixtures import fixture_facts as facts

HOSTILE = "x86-spill"
# Every command that only reads the registry.
READ_ONLY_COMMANDS = (("nodes",), ("status",), ("leader",), ("schedule",), ("registry", "export"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> SignedFleet:
    return signed_example_fleet(tmp_path_factory.mktemp("fleet"))


@pytest.fixture(scope="module")
def state(fleet: SignedFleet) -> DesiredState:
    return load_desired(fleet.desired)


@pytest.fixture(scope="module")
def signers(fleet: SignedFleet) -> dict[str, FakeSigner]:
    return {host: fleet.signer(host) for host in CANDIDATES}


class Fleet:
    """A sqlite registry where a1-arm64, x86-spill and racknerd beat and lux leads."""

    def __init__(self, path: Path, desired: Path, state: DesiredState, signers: dict[str, FakeSigner]) -> None:
        self.path = path
        self.desired = str(desired)
        self.state = state
        self.signers = signers
        self.log: list[str] = []
        for host in ("a1-arm64", HOSTILE, "racknerd"):
            assert self.pass_of(host).static is None
        self.leader = candidate_loop(
            self.connect(),
            "lux",
            lambda: state,
            schedule,
            lease_ttl_s=30,
            hooks=NoHooks(),
            audit=None,
            log=self.log.append,
            signer=signers["lux"],
        )
        self.leader.step()
        assert self.leader.leadership is not None

    def connect(self) -> SqliteRegistry:
        return SqliteRegistry(self.path, timing=self.state.fleet.timing, flap=self.state.fleet.flap, clock=SystemClock())

    def pass_of(self, host: str):
        """A pass's plan source: its beat, then the plan it reads (and checks)."""
        return fleet_plan_for(
            PlanFromRegistry(),
            self.state,
            host,
            facts(host),
            connect=self.connect,
            applied_epoch=None,
            has_generation=True,
            now=datetime.now(UTC),
            write=True,
            signer=self.signers.get(host),
        )

    def write_own_record(self, value: bytes | str | int) -> None:
        """What x86-spill may write: its own heartbeat row, alive for a minute."""
        with sqlite3.connect(self.path) as db:
            db.execute(
                "INSERT INTO nodes (node_id, record, expires_at) VALUES (?, ?, ?) "
                "ON CONFLICT(node_id) DO UPDATE SET record = excluded.record, expires_at = excluded.expires_at",
                (HOSTILE, value, time.time() + 60),
            )


@pytest.fixture
def hostile_fleet(tmp_path: Path, fleet: SignedFleet, state, signers) -> Fleet:
    return Fleet(tmp_path / "registry.sqlite", fleet.desired, state, signers)


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


# -- what a host may write: any bytes ---------------------------------------------------

VALID = NodeRecord(node_id=HOSTILE, tier="batch", beat_at=None, timeout_s=None).model_dump(mode="json")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


def _with_field(pair: tuple[str, object]) -> str:
    field, value = pair
    return json.dumps({**VALID, field: value})


# Known attacks, each tried (the property below draws among them too).
ATTACKS: list[bytes | str | int] = [
    "",
    "not json",
    "null",
    "[]",
    "{}",
    "[" * 5000 + "]" * 5000,
    json.dumps({**VALID, "labels": {"a": ["[" * 3000]}}),  # a label that is not a string
    '{"node_id": "x86-spill", "tier": "batch", "labels": ' + "{" * 3000 + "}" * 3000 + "}",
    json.dumps({**VALID, "node_id": "lux"}),  # another host's name
    json.dumps({**VALID, "timeout_s": 1e308, "beat_at": "2026-12-01T00:00:00Z"}),
    json.dumps({**VALID, "beat_at": "9999-12-31T23:59:59Z", "timeout_s": 90}),
    json.dumps({**VALID, "in_flight": 10**400, "max_concurrent_tasks": 1}),
    json.dumps({**VALID, "labels": {f"k{i}": "v" * 100 for i in range(4000)}}),  # oversized
    "x" * (MAX_RECORD_BYTES + 1),
    b"\x00\xff\xfe",  # not text at all (a BLOB)
    12345,  # sqlite keeps an INTEGER in any column
]

hostile_values = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=300),
    json_values.map(json.dumps),
    # A record of the right shape with one field of a wrong type or out of range.
    st.tuples(st.sampled_from(sorted(VALID)), json_values | st.integers(min_value=2**31, max_value=2**200)).map(_with_field),
    st.sampled_from(ATTACKS),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(value=hostile_values)
def test_whatever_a_host_writes_into_its_own_record_every_reader_finishes(hostile_fleet: Fleet, capsys, value) -> None:
    every_reader_finishes(hostile_fleet, capsys, value)


@pytest.mark.parametrize("value", ATTACKS, ids=range(len(ATTACKS)))
def test_each_known_attack_is_skipped_and_every_reader_finishes(hostile_fleet: Fleet, capsys, value) -> None:
    every_reader_finishes(hostile_fleet, capsys, value)
    registry = hostile_fleet.connect()
    try:
        named = [p.line() for p in registry.snapshot().unreadable]
    finally:
        registry.close()
    assert len(named) == 1 and named[0].startswith("x86-spill: unreadable heartbeat record: "), named


def every_reader_finishes(hostile_fleet: Fleet, capsys, value) -> None:
    hostile_fleet.write_own_record(value)
    registry = hostile_fleet.connect()
    try:
        snapshot = registry.snapshot()
        states = registry.node_states()
    finally:
        registry.close()
    # Skipped and named, or read as a valid record of its own host: never a crash.
    named = [p for p in snapshot.unreadable if p.node == HOSTILE]
    node = {n.node_id: n for n in snapshot.nodes}.get(HOSTILE)
    if named:
        assert named[0].line().startswith(f"{HOSTILE}: unreadable heartbeat record: ")
        assert node is None or node.status != "active"
    hostile_fleet.leader.step()
    assert hostile_fleet.leader.leadership is not None
    assert hostile_fleet.pass_of("a1-arm64").static is None
    desired = hostile_fleet.desired
    for command in READ_ONLY_COMMANDS:
        code, _ = run_cli(capsys, *command, "--desired", desired, "--registry-path", str(hostile_fleet.path))
        assert code == EXIT_OK, command
    assert {s.node_id for s in states} >= {"a1-arm64", "racknerd"}


# -- named once, where an operator looks -------------------------------------------------------


def test_garbage_in_a_hosts_record_is_skipped_named_and_the_node_stops_beating(hostile_fleet: Fleet, capsys) -> None:
    hostile_fleet.write_own_record("not json")
    registry = hostile_fleet.connect()
    try:
        snapshot = registry.snapshot()
    finally:
        registry.close()
    assert [p.line() for p in snapshot.unreadable] == ["x86-spill: unreadable heartbeat record: not JSON (expected ident at line 1 column 2)"]
    assert HOSTILE not in {n.node_id for n in snapshot.nodes if n.status == "active"}
    assert {n.node_id for n in snapshot.nodes if n.status == "active"} >= {"a1-arm64", "racknerd"}

    # The leader's journal: once per change.
    hostile_fleet.log.clear()
    hostile_fleet.leader.step()
    hostile_fleet.leader.step()
    named = [line for line in hostile_fleet.log if "unreadable" in line]
    assert named == ["x86-spill: unreadable heartbeat record: not JSON (expected ident at line 1 column 2) (skipped: the node counts as not beating)"]
    assert any(line.startswith("node x86-spill") and "offline" in line for line in hostile_fleet.log)
    hostile_fleet.write_own_record("[1]")
    hostile_fleet.leader.step()
    assert hostile_fleet.log[-1:] != [] and any(
        "no longer unreadable: x86-spill: unreadable heartbeat record: not JSON" in line for line in hostile_fleet.log
    )

    desired = hostile_fleet.desired
    code, out = run_cli(capsys, "nodes", "--desired", desired, "--registry-path", str(hostile_fleet.path))
    assert code == EXIT_OK
    assert "x86-spill: unreadable heartbeat record: (top level): Input should be an object" in out
    code, out = run_cli(capsys, "nodes", "--json", "--desired", desired, "--registry-path", str(hostile_fleet.path))
    assert json.loads(out)["unreadable"] == ["x86-spill: unreadable heartbeat record: (top level): Input should be an object"]
    code, out = run_cli(capsys, "status", "--desired", desired, "--registry-path", str(hostile_fleet.path))
    assert code == EXIT_OK
    assert "UNREADABLE RECORDS" in out and "  x86-spill: unreadable heartbeat record: (top level): Input should be an object" in out
    code, out = run_cli(capsys, "status", "--json", "--desired", desired, "--registry-path", str(hostile_fleet.path))
    assert json.loads(out)["unreadable"] == ["x86-spill: unreadable heartbeat record: (top level): Input should be an object"]


def test_a_pass_still_reads_its_plan_and_the_hostile_host_gets_no_work(hostile_fleet: Fleet) -> None:
    hostile_fleet.write_own_record(b"\xff\xfe garbage")
    hostile_fleet.leader.step()
    result = hostile_fleet.pass_of("a1-arm64")
    assert result.static is None and result.plan.epoch >= 1
    assert not result.plan.services_on(HOSTILE)


def test_a_record_naming_another_host_is_not_believed(hostile_fleet: Fleet) -> None:
    hostile_fleet.write_own_record(json.dumps({**VALID, "node_id": "lux"}))
    registry = hostile_fleet.connect()
    try:
        snapshot = registry.snapshot()
    finally:
        registry.close()
    assert [p.line() for p in snapshot.unreadable] == ["x86-spill: unreadable heartbeat record: names another host (lux)"]


def test_every_other_record_that_does_not_parse_is_skipped_and_named(hostile_fleet: Fleet) -> None:
    """Not a host's to write, but read the same way: a bad node state, drain,
    plan, scaling record or epoch is skipped and named by the full read; the
    plan read alone says so as the port's error (the pass fails static)."""
    with sqlite3.connect(hostile_fleet.path) as db:
        db.execute("UPDATE node_states SET state = 'garbage' WHERE node_id = 'racknerd'")
        db.execute("INSERT INTO drains (node_id, request) VALUES ('a1-arm64', x'00ff')")
        db.execute("UPDATE plan_index SET plan_index = '{\"epoch\": -1}' WHERE id = 1")
        db.execute("INSERT INTO scaling (id, record) VALUES (1, '[') ON CONFLICT(id) DO UPDATE SET record = excluded.record")
    registry = hostile_fleet.connect()
    try:
        snapshot = registry.snapshot()
        assert sorted(p.key for p in snapshot.unreadable) == ["drains/a1-arm64", "node_states/racknerd", "plan-index", "scaling"]
        assert snapshot.placements == []
        with pytest.raises(RegistryError, match=r"unreadable plan: epoch: Input should be greater than or equal to 0"):
            registry.newest_plan()
        assert registry.scaling_record().concurrency == {}
    finally:
        registry.close()
    hostile_fleet.leader.step()  # finishes, and publishes a plan that reads again
    assert hostile_fleet.leader.leadership is not None
    result = hostile_fleet.pass_of("a1-arm64")
    assert result.static is None and result.plan.epoch >= 1


def test_an_unreadable_leader_record_is_skipped_by_the_read_and_the_registrys_error_alone(hostile_fleet: Fleet) -> None:
    with sqlite3.connect(hostile_fleet.path) as db:
        db.execute("UPDATE leader SET info = '{\"candidate\": 5}' WHERE id = 1")
    registry = hostile_fleet.connect()
    try:
        snapshot = registry.snapshot()
        assert [p.line() for p in snapshot.unreadable] == ["leader: unreadable leader record: candidate: Input should be a valid string (and 3 more)"]
        assert snapshot.leader is None
        with pytest.raises(RegistryError, match="unreadable leader record: candidate: Input should be a valid string"):
            registry.leader()
    finally:
        registry.close()


def test_an_epoch_counter_that_is_not_a_number_is_the_registrys_error(hostile_fleet: Fleet) -> None:
    with sqlite3.connect(hostile_fleet.path) as db:
        db.execute("UPDATE meta SET value = 'x' WHERE key = 'epoch'")
    registry = hostile_fleet.connect()
    try:
        assert [p.line() for p in registry.snapshot().unreadable] == ["epoch: unreadable epoch: not a decimal number"]
        with pytest.raises(RegistryError, match="unreadable epoch counter"):
            registry.epoch()
    finally:
        registry.close()
    # The pass fails static on the port's error, never a traceback.
    assert hostile_fleet.pass_of("a1-arm64").static is not None


def test_a_problem_never_quotes_the_records_bytes() -> None:
    secret = "postgresql://phaze:hunter2@db/phaze"
    for value in (secret, json.dumps({**VALID, "tier": secret}), json.dumps({**VALID, "labels": {secret: 1}}), "\x1b[31m" + secret):
        record, problem = parse_record(NodeRecord, value, key=f"facts/{HOSTILE}", node=HOSTILE)
        assert record is None and problem is not None
        assert "hunter2" not in problem.line() and "\x1b" not in problem.line(), problem.line()


def test_the_snapshot_carries_its_problems_through_a_saved_copy() -> None:
    """`fabric registry export` and `--snapshot FILE` keep what was unreadable."""
    snapshot = Snapshot(unreadable=[UnreadableRecord(key="facts/x86-spill", node="x86-spill", what="heartbeat record", reason="empty")])
    again = Snapshot.model_validate_json(snapshot.model_dump_json())
    assert [p.line() for p in again.unreadable] == ["x86-spill: unreadable heartbeat record: empty"]


def test_the_status_page_names_each_unreadable_record_once_escaped() -> None:
    desired = load_desired(REPO / "hosts")
    problem = UnreadableRecord(key="facts/x86-spill", node="x86-spill", what="heartbeat record", reason="labels[...]: <b>not</b> a string")
    snapshot = Snapshot(now=datetime(2026, 11, 29, 18, 30, tzinfo=UTC), unreadable=[problem, problem.model_copy(update={"key": "nodes/x86-spill"})])
    page = render_status_page(desired, snapshot, None, snapshot.now)
    assert page.count('<li class="unreadable">') == 1
    assert "x86-spill: unreadable heartbeat record: labels[...]: &lt;b&gt;not&lt;/b&gt; a string" in page
    assert "<b>not</b>" not in page
    assert '<ul id="unreadable"' not in render_status_page(desired, Snapshot(now=snapshot.now), None, snapshot.now)
