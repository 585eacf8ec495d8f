"""Registry reads never trust a host's bytes, on a real etcd with TLS and auth:
x86-spill's own certificate writes whatever it likes into the two keys it may
write (P/nodes/x86-spill, P/facts/x86-spill), and the leader step (lux), a
pass's plan read (a1-arm64) and the read-only commands (`fabric nodes`,
`fabric status`) still finish; the record is skipped and named
("x86-spill: unreadable heartbeat record: ...").

One TLS etcd member for the module (tests/support/harness/etcd.py), auth set up by
`fabric registry init-auth` as root, as in test_registry_auth.py. The sqlite
counterpart is tests/unit/test_registry_untrusted.py.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reconciler.adapters.registry_records import MAX_RECORD_BYTES
from reconciler.cli import EXIT_OK
from reconciler.core.desired.load import load_desired
from reconciler.core.live.records import NodeRecord
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.leader import LeaderLoop, candidate_loop
from reconciler.engine.pass_options import PlanFromRegistry
from reconciler.engine.plan_source import fleet_plan_for
from reconciler.ports import PermissionDenied, Registry, RegistryError
from reconciler.wiring import open_registry
from tests.conftest import require
from tests.support.cli import fabric_captured as run_cli
from tests.support.harness.etcd import EtcdCluster, etcd_cluster
from tests.support.hooks import NoHooks
from tests.support.plan_keys import SignedFleet, signed_example_fleet
from tests.support.probe_fixtures import fixture_facts as facts

pytestmark = pytest.mark.integration

PREFIX = f"/untrusted{uuid.uuid4().hex[:8]}"
HOSTILE = "x86-spill"
# Every command that only reads the registry.
READ_ONLY_COMMANDS = (("nodes",), ("status",), ("leader",), ("schedule",), ("registry", "export"))
IDENTITIES = ("root", "lux", "a1-arm64", "x86-spill", "racknerd", "qfox-1")


def registry_section(cluster: EtcdCluster, identity: str) -> str:
    tls = cluster.tls_settings(identity)
    endpoints = ", ".join(f'"{e}"' for e in cluster.endpoints)
    return (
        f'[registry]\nbackend = "etcd"\nendpoints = [{endpoints}]\nprefix = "{PREFIX}"\n'
        f'ca_file = "{tls["ca_file"]}"\ncert_file = "{tls["cert_file"]}"\nkey_file = "{tls["key_file"]}"\n'
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    require("etcd")
    with etcd_cluster(members=1, tls=True) as c:
        yield c


@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> SignedFleet:
    return signed_example_fleet(tmp_path_factory.mktemp("fleet"))


@pytest.fixture(scope="module")
def desired_dirs(cluster: EtcdCluster, signed: SignedFleet, tmp_path_factory) -> dict[str, Path]:
    """The example fleet as each identity's machine has it: [registry] is this
    etcd with that identity's own certificate."""
    dirs: dict[str, Path] = {}
    base = tmp_path_factory.mktemp("identities")
    for identity in IDENTITIES:
        directory = base / identity
        shutil.copytree(signed.desired, directory)
        toml = directory / "fabric.toml"
        text = re.sub(r"\[registry\]\n(?:[^\[\n][^\n]*\n|\n)*", registry_section(cluster, identity) + "\n", toml.read_text(), count=1)
        toml.write_text(text)
        dirs[identity] = directory
    return dirs


class EtcdFleet:
    """Every host with its own identity: a1-arm64, x86-spill and racknerd beat, lux leads."""

    def __init__(self, dirs: dict[str, Path], signed: SignedFleet) -> None:
        self.dirs = dirs
        self.states = {identity: load_desired(directory) for identity, directory in dirs.items()}
        self.signed = signed
        self.log: list[str] = []
        self.hostile = self.connect(HOSTILE)
        for host in ("a1-arm64", HOSTILE, "racknerd"):
            result = self.pass_of(host)
            assert result.static is None, result.notes
        self.leader_registry = self.connect("lux")
        self.leader: LeaderLoop = candidate_loop(
            self.leader_registry,
            "lux",
            lambda: self.states["lux"],
            schedule,
            lease_ttl_s=30,
            hooks=NoHooks(),
            audit=None,
            log=self.log.append,
            signer=signed.signer("lux"),
        )
        self.leader.step()
        assert self.leader.leadership is not None, self.log

    def connect(self, identity: str) -> Registry:
        return open_registry(self.states[identity].fleet)

    def pass_of(self, host: str):
        return fleet_plan_for(
            PlanFromRegistry(),
            self.states[host],
            host,
            facts(host),
            connect=lambda: self.connect(host),
            applied_epoch=None,
            has_generation=True,
            now=datetime.now(UTC),
            write=True,
        )

    def write_own_keys(self, value: bytes) -> None:
        """With x86-spill's own certificate: both keys it may write, its beat
        under a lease of its own (as a beat is)."""
        for kind in ("nodes", "facts"):
            key = f"{PREFIX}/{kind}/{HOSTILE}".encode()

            async def op(c, key=key, kind=kind):
                lease = (await c.lease(60)).id if kind == "nodes" else None
                await c.put(key, value, lease=lease)

            self.hostile._call(op, f"a put of {key.decode()}")  # type: ignore[attr-defined]

    def close(self) -> None:
        if self.leader.leadership is not None:
            self.leader_registry.resign(self.leader.leadership)
        self.leader_registry.close()
        self.hostile.close()


@pytest.fixture(scope="module")
def fleet(cluster, desired_dirs, signed) -> Iterator[EtcdFleet]:
    status, out, err = run_cli("registry", "init-auth", "--desired", str(desired_dirs["root"]))
    assert status == EXIT_OK, out + err
    fleet = EtcdFleet(desired_dirs, signed)
    try:
        yield fleet
    finally:
        fleet.close()


def test_the_hostile_identity_may_write_only_its_own_keys(fleet: EtcdFleet) -> None:
    async def op(c):
        await c.put(f"{PREFIX}/facts/lux".encode(), b"not json")

    with pytest.raises(PermissionDenied):
        fleet.hostile._call(op, "a put of facts/lux")  # type: ignore[attr-defined]


def test_garbage_in_its_own_keys_is_skipped_named_and_every_reader_finishes(fleet: EtcdFleet) -> None:
    fleet.write_own_keys(b"not json")
    fleet.log.clear()
    fleet.leader.step()
    assert fleet.leader.leadership is not None
    assert any(line.startswith("x86-spill: unreadable heartbeat record: not JSON") for line in fleet.log), fleet.log
    result = fleet.pass_of("a1-arm64")
    assert result.static is None and result.plan.epoch >= 1 and not result.plan.services_on(HOSTILE)
    for identity in ("a1-arm64", "lux"):
        status, out, err = run_cli("nodes", "--desired", str(fleet.dirs[identity]))
        assert status == EXIT_OK and "Traceback" not in err, err
        assert "x86-spill: unreadable heartbeat record: not JSON (expected ident at line 1 column 2)" in out, out
        status, out, err = run_cli("status", "--desired", str(fleet.dirs[identity]))
        assert status == EXIT_OK, err
        assert "x86-spill: unreadable heartbeat record: not JSON" in out, out
    # The host's own next beat replaces the garbage: readable again.
    assert fleet.pass_of(HOSTILE).static is None
    fleet.leader.step()
    assert any(line.startswith("no longer unreadable: x86-spill") for line in fleet.log), fleet.log


VALID = NodeRecord(node_id=HOSTILE, tier="batch").model_dump(mode="json")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)

# Known attacks, each tried (the property below draws among them too).
ATTACKS: list[bytes] = [
    b"",
    b"[" * 5000 + b"]" * 5000,
    b'{"node_id": "x86-spill", "tier": "batch", "labels": ' + b"{" * 3000 + b"}" * 3000 + b"}",
    json.dumps({**VALID, "node_id": "lux"}).encode(),
    json.dumps({**VALID, "timeout_s": 1e308, "beat_at": "2026-12-01T00:00:00Z"}).encode(),
    json.dumps({**VALID, "beat_at": "9999-12-31T23:59:59Z", "timeout_s": 90}).encode(),
    json.dumps({**VALID, "in_flight": 10**400}).encode(),
    b"x" * (MAX_RECORD_BYTES + 1),
    json.dumps({**VALID, "labels": {f"k{i}": "v" * 100 for i in range(4000)}}).encode(),
    b"not json",
    json.dumps({**VALID, "labels": {"a": ["[" * 3000]}}).encode(),
]

hostile_values = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.tuples(st.sampled_from(sorted(VALID)), json_values | st.integers(min_value=2**31, max_value=2**200)).map(
        lambda pair: json.dumps({**VALID, pair[0]: pair[1]}).encode()
    ),
    st.sampled_from(ATTACKS),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(value=hostile_values)
def test_whatever_a_host_writes_into_its_own_keys_every_reader_finishes(fleet: EtcdFleet, value: bytes) -> None:
    every_reader_finishes(fleet, value)


@pytest.mark.parametrize("value", ATTACKS, ids=range(len(ATTACKS)))
def test_each_known_attack_is_skipped_named_and_every_reader_finishes(fleet: EtcdFleet, value: bytes) -> None:
    fleet.write_own_keys(value)
    registry = fleet.connect("a1-arm64")
    try:
        named = {p.line() for p in registry.snapshot().unreadable}
    finally:
        registry.close()
    assert len(named) == 1 and next(iter(named)).startswith("x86-spill: unreadable heartbeat record: "), named
    every_reader_finishes(fleet, value)


def every_reader_finishes(fleet: EtcdFleet, value: bytes) -> None:
    fleet.write_own_keys(value)
    fleet.leader.step()
    assert fleet.leader.leadership is not None, fleet.log[-5:]
    assert fleet.pass_of("a1-arm64").static is None
    for command in READ_ONLY_COMMANDS:
        status, _, err = run_cli(*command, "--desired", str(fleet.dirs["a1-arm64"]))
        assert status == EXIT_OK and "Traceback" not in err, (command, err)
    # The hostile host's own pass still beats over whatever it left there.
    assert fleet.pass_of(HOSTILE).static is None


def test_every_other_key_that_does_not_parse_is_skipped_named_or_the_registrys_error(fleet: EtcdFleet) -> None:
    """Keys only a candidate (or root) writes, read the same way: the full read
    skips and names each; a read of one key alone raises the port's
    RegistryError, never a parse error (here root's identity, under a prefix
    of its own, so the module's fleet is not touched)."""
    root_fleet = fleet.states["root"].fleet
    other = f"{PREFIX}-other"
    registry = open_registry(root_fleet.model_copy(update={"registry": root_fleet.registry.model_copy(update={"prefix": other})}))
    try:
        garbage = {"state/lux": b"[", "drain/lux": b"{}", "plan-index": b"not json", "leader": b"\x00", "epoch": b"ten", "scaling": b"[]"}
        for key, value in garbage.items():

            async def op(c, key=key, value=value):
                await c.put(f"{other}/{key}".encode(), value)

            registry._call(op, f"a put of {key}")  # type: ignore[attr-defined]
        snapshot = registry.snapshot()
        assert sorted(p.key for p in snapshot.unreadable) == sorted(garbage)
        assert snapshot.leader is None and snapshot.epoch == 0 and snapshot.placements == []
        for read, what in ((registry.newest_plan, "plan"), (registry.leader, "leader record"), (registry.epoch, "epoch")):
            with pytest.raises(RegistryError, match=f"etcd {other}/.*: unreadable {what}: "):
                read()
        assert registry.scaling_record().concurrency == {}
        assert registry.node_states() == []
    finally:
        registry.close()
