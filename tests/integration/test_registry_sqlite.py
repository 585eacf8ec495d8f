"""The sqlite registry with an injected clock (no sleeping), its failure mode,
several processes racing for lane slots, and the CLI commands over it."""

from __future__ import annotations

import json
import os
import stat
from datetime import UTC, datetime

import pytest

from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.cli import EXIT_FAILED, EXIT_INVALID, EXIT_OK
from reconciler.core.desired.model import FlapSettings, TimingSettings
from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.live.records import NodeRecord
from reconciler.engine.leader import LeaderLoop
from reconciler.ports import NotLeader, RegistryUnavailable
from tests.conftest import EXAMPLE_FLEET, require_root
from tests.support.cli import fabric
from tests.support.clock import FakeClock

pytestmark = pytest.mark.integration


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(tmp_path, clock):
    r = SqliteRegistry(tmp_path / "registry.sqlite", timing=TimingSettings(), flap=FlapSettings(), clock=clock)
    yield r
    r.close()


def beat(registry, node: str, *, relayed: bool = False, tier: str = "cpu_ffmpeg") -> None:
    registry.heartbeat(NodeRecord(node_id=node, tier=tier, relayed=relayed, max_concurrent_tasks=2))


def statuses(registry) -> dict[str, str]:
    return {s.node_id: s.status for s in registry.node_states()}


def test_default_ttl_is_the_node_timeout_and_relayed_nodes_get_the_longer_one(registry, clock):
    beat(registry, "lux")
    beat(registry, "racknerd", relayed=True)
    clock.advance(89)
    assert statuses(registry) == {"lux": "active", "racknerd": "active"}
    clock.advance(1)
    assert statuses(registry) == {"lux": "offline", "racknerd": "active"}
    clock.advance(44)
    assert statuses(registry)["racknerd"] == "active"
    clock.advance(1)
    assert statuses(registry)["racknerd"] == "offline"


def test_flap_damping_and_drain_grace_through_the_registry(registry, clock):
    term = registry.campaign("lux", 3600)
    beat(registry, "qfox-1")
    registry.advance_lifecycle(term)
    clock.advance(90)  # offline: toggle 1
    registry.advance_lifecycle(term)
    clock.advance(10)  # back: toggle 2
    beat(registry, "qfox-1")
    registry.advance_lifecycle(term)
    assert registry.snapshot().nodes[0].held_off_until is None, "two toggles are not a flap"
    clock.advance(90)  # offline again: toggle 3 within 300 s
    events = registry.advance_lifecycle(term)
    assert [e.transition.status for e in events] == ["offline", "held_off"]
    clock.advance(10)
    beat(registry, "qfox-1")
    registry.advance_lifecycle(term)
    node = registry.snapshot().nodes[0]
    assert node.status == "active"
    assert node.held_off_until.timestamp() == clock.now() - 10 + 600

    registry.set_drain("qfox-1", grace_s=120)
    registry.advance_lifecycle(term)
    assert registry.snapshot().nodes[0].status == "draining" and not registry.snapshot().nodes[0].drained
    clock.advance(60)
    beat(registry, "qfox-1")
    assert not registry.snapshot().nodes[0].drained
    clock.advance(60)
    beat(registry, "qfox-1")
    events = registry.advance_lifecycle(term)
    assert registry.snapshot().nodes[0].drained
    assert "grace of 120 s over" in events[0].transition.reason


def test_dead_nodes_are_garbage_collected(registry, clock):
    term = registry.campaign("lux", 3600)
    beat(registry, "a1-arm64")
    registry.advance_lifecycle(term)
    clock.advance(90)
    registry.advance_lifecycle(term)
    clock.advance(300)
    registry.advance_lifecycle(term)
    assert statuses(registry) == {"a1-arm64": "dead"}
    assert registry.snapshot().nodes == [], "a dead node's facts are gone"
    clock.advance(300)
    registry.advance_lifecycle(term)
    assert statuses(registry) == {}


def test_lease_expiry_by_the_clock_and_the_epoch_fence(registry, clock):
    old = registry.campaign("lux", 30)
    assert registry.campaign("qfox-1", 30) is None
    clock.advance(29)
    assert registry.renew(old)
    clock.advance(30)
    assert registry.leader() is None, "not renewed for one TTL: the term is over"
    new = registry.campaign("qfox-1", 30)
    assert new.epoch > old.epoch
    with pytest.raises(NotLeader, match="qfox-1 leads"):
        registry.publish_plan(old, FleetPlan(epoch=99, leader="lux", created=datetime.now(UTC)))
    stored = registry.publish_plan(new, FleetPlan(epoch=0, leader="x", created=datetime.now(UTC)))
    assert (stored.epoch, stored.leader) == (new.epoch + 1, "qfox-1"), "the registry numbers plans"


def test_a_registry_that_cannot_be_opened_is_unavailable(tmp_path, clock):
    (tmp_path / "a-directory").mkdir()
    with pytest.raises(RegistryUnavailable, match="a-directory"):
        SqliteRegistry(tmp_path / "a-directory", timing=TimingSettings(), flap=FlapSettings(), clock=clock)


def open_sqlite(path, clock) -> SqliteRegistry:
    return SqliteRegistry(path, timing=TimingSettings(), flap=FlapSettings(), clock=clock)


def test_a_new_registry_file_and_directory_are_root_only(tmp_path, clock):
    path = tmp_path / "made" / "here" / "registry.sqlite"
    registry = open_sqlite(path, clock)
    try:
        beat(registry, "lux")  # the WAL files appear with the first write
    finally:
        registry.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "made").stat().st_mode) == 0o700
    wal = path.with_name(path.name + "-wal")
    assert not wal.exists() or stat.S_IMODE(wal.stat().st_mode) == 0o600


def test_a_registry_file_others_can_write_is_refused_until_chmod(tmp_path, clock, capsys):
    path = tmp_path / "registry.sqlite"
    open_sqlite(path, clock).close()
    path.chmod(0o666)
    with pytest.raises(RegistryUnavailable, match=r"refused: .*registry.sqlite is writable by group or others \(mode 0666"):
        open_sqlite(path, clock)
    # Any other command than a pass (which fails static on RegistryUnavailable) exits 1.
    status, _, err = fabric(capsys, "nodes", "--desired", str(EXAMPLE_FLEET), "--registry-path", str(path))
    assert status == EXIT_FAILED and "writable by group or others" in err and "Traceback" not in err
    path.chmod(0o620)
    with pytest.raises(RegistryUnavailable, match="writable by group or others"):
        open_sqlite(path, clock)
    path.chmod(0o600)
    open_sqlite(path, clock).close()


def test_a_registry_file_of_another_user_is_refused(tmp_path, clock):
    require_root()  # chown to another user; never a skip: CI runs as root
    path = tmp_path / "registry.sqlite"
    open_sqlite(path, clock).close()
    os.chown(path, 4242, 4242)
    with pytest.raises(RegistryUnavailable, match="owned by another user \\(uid 4242"):
        open_sqlite(path, clock)
    os.chown(path, 0, 0)
    open_sqlite(path, clock).close()


def test_a_registry_in_a_directory_others_can_write_is_refused(tmp_path, clock):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(RegistryUnavailable, match="its directory .* is writable by group or others"):
        open_sqlite(shared / "registry.sqlite", clock)
    shared.chmod(0o1777)  # sticky, like /tmp: nobody else may replace our file
    open_sqlite(shared / "registry.sqlite", clock).close()


def test_a_registry_locked_past_the_busy_timeout_is_unavailable(tmp_path, clock):
    path = tmp_path / "registry.sqlite"
    holder = SqliteRegistry(path, timing=TimingSettings(), flap=FlapSettings(), clock=clock)
    waiter = SqliteRegistry(path, timing=TimingSettings(), flap=FlapSettings(), clock=clock, busy_timeout_s=0.2)
    try:
        with holder._tx():  # another writer holds the write lock
            with pytest.raises(RegistryUnavailable, match="locked"):
                beat(waiter, "lux")
        beat(waiter, "lux")
    finally:
        holder.close()
        waiter.close()


def test_leader_loop_step_schedules_and_publishes_only_when_the_plan_changes(registry, clock, signed_fleet):
    from reconciler.core.desired.load import load_desired
    from reconciler.core.scheduling.placement import schedule

    desired = load_desired(signed_fleet.desired)
    loop = LeaderLoop(registry, "lux", lambda: desired, schedule, lease_ttl_s=30, log=lambda m: None, signer=signed_fleet.signer("lux"))
    loop.step()
    first = registry.newest_plan()
    assert first is not None and first.leader == "lux"
    loop.step()
    assert registry.newest_plan().epoch == first.epoch, "same plan, same epoch"
    registry.heartbeat(NodeRecord(node_id="qfox-1", tier="gpu_cuda", arch="x86_64", max_concurrent_tasks=4))
    loop.step()
    plan = registry.newest_plan()
    assert plan.epoch > first.epoch
    assert ("lupine", "qfox-1") in {(p.service, p.node) for p in plan.placements}
    # qfox-1 goes silent: the leader marks it offline and its work is re-placed (deferred here).
    for _ in range(10):  # the loop wakes (and renews) every 10 s
        clock.advance(10)
        loop.step()
    after = registry.newest_plan()
    assert after.epoch > plan.epoch and not after.services_on("qfox-1")
    # Not a candidate any more (desired state changed): the loop resigns.
    loop.host = "racknerd"
    loop.step()
    assert loop.leadership is None


# -- the CLI ---------------------------------------------------------------------------------


def test_cli_nodes_drain_undrain_leader_and_export(tmp_path, capsys, monkeypatch, signed_fleet):
    path = tmp_path / "registry.sqlite"
    monkeypatch.setenv("FABRIC_REGISTRY", str(path))
    common = ["--desired", str(EXAMPLE_FLEET)]

    from reconciler.adapters.clock import SystemClock

    r = SqliteRegistry(path, timing=TimingSettings(), flap=FlapSettings(), clock=SystemClock())
    r.heartbeat(NodeRecord(node_id="qfox-1", tier="gpu_cuda", in_flight=1, max_concurrent_tasks=4))
    r.heartbeat(NodeRecord(node_id="intruder", tier="gpu_cuda"))
    r.close()

    status, out, _ = fabric(capsys, "nodes", *common)
    assert status == EXIT_OK
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "active" in lines["qfox-1"] and "1/4 (25%)" in lines["qfox-1"]
    assert "[undeclared]" in lines["intruder"]
    assert "never seen" in lines["lux"]

    status, out, _ = fabric(capsys, "drain", "qfox-1", "--grace", "60", *common)
    assert status == EXIT_OK and "60 s" in out
    status, out, _ = fabric(capsys, "nodes", "--json", *common)
    data = json.loads(out)
    qfox = next(n for n in data["nodes"] if n["node_id"] == "qfox-1")
    assert (qfox["status"], qfox["drained"], qfox["utilization"], qfox["tier"]) == ("draining", False, 0.25, "gpu_cuda")
    assert [t["status"] for t in qfox["transitions"]][-2:] == ["drain", "draining"]
    assert "lux" in data["never_seen"]

    status, out, _ = fabric(capsys, "undrain", "qfox-1", *common)
    assert status == EXIT_OK and "undrained" in out

    status, _, err = fabric(capsys, "drain", "nonexistent", *common)
    assert status == EXIT_INVALID and "not a host of the desired state" in err

    status, out, _ = fabric(capsys, "leader", *common)
    assert status == EXIT_OK and "no leader" in out
    status, _, err = fabric(capsys, "leader", "run", "--host", "racknerd", *common)
    assert status == EXIT_INVALID and "not in fleet.leader_candidates" in err
    status, _, err = fabric(capsys, "leader", "run", "--host", "lux", "--once", *common)
    assert status == 1 and "lux cannot sign plans" in err, "hosts/ lists lux's real key: its private half is on lux alone"
    common = ["--desired", str(signed_fleet.desired)]
    status, _, err = fabric(capsys, "leader", "run", "--host", "lux", "--once", "--plan-key-file", str(signed_fleet.key_file("lux")), *common)
    assert status == EXIT_OK and "published plan epoch" in err
    status, out, _ = fabric(capsys, "leader", "--json", *common)
    shown = json.loads(out)
    assert shown["leader"] is None, "--once resigns"
    assert shown["plan_epoch"] == shown["epoch"] >= 2
    assert shown["term"] == shown["plan_term"] >= 1, "the resigned term stays the registry's current one, its plan with it"

    status, out, _ = fabric(capsys, "registry", "export", *common)
    assert status == EXIT_OK
    snapshot = Snapshot.model_validate_json(out)
    assert {lane.id for lane in snapshot.lanes} == {"a1-arm64", "x86-spill", "local"}
    assert {n.node_id for n in snapshot.nodes} == {"qfox-1", "intruder"}
    assert snapshot.epoch == shown["epoch"] and snapshot.placements


def test_cli_bad_desired_state_exits_2_and_writes_nothing(tmp_path, capsys, monkeypatch):
    path = tmp_path / "registry.sqlite"
    monkeypatch.setenv("FABRIC_REGISTRY", str(path))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "fabric.toml").write_text("[fleet]\nname = 'x'\n")
    status, _, err = fabric(capsys, "drain", "lux", "--desired", str(bad))
    assert status == EXIT_INVALID and "fabric.toml" in err
    assert not path.exists()


def test_cli_unreachable_registry_exits_1(tmp_path, capsys, monkeypatch):
    blocked = tmp_path / "dir"
    blocked.mkdir()
    monkeypatch.setenv("FABRIC_REGISTRY", str(blocked))
    status, _, err = fabric(capsys, "nodes", "--desired", str(EXAMPLE_FLEET))
    assert status == EXIT_FAILED and "registry" in err
