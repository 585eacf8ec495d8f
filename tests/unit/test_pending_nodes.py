"""Pending machines (#31 items 1, 2, 4): a machine without a host file reports
itself pending with its whole probe record, renders and activates nothing,
is never placed on, lapses when it stops reporting; `fabric nodes` and
`fabric status` list it with the admission command; the capabilities API
lists every node with its hardware and the pending ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reconciler.adapters.probe_io import CaptureDirectory
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import HostFacts
from reconciler.core.desired.registry_access import JOINING_ROLE, JOINING_USER, prefix_end, registry_access
from reconciler.core.live.pending import PendingRecord, admission_command
from reconciler.core.live.records import NodeRecord
from reconciler.core.probe import RawCapture, facts_from_capture
from reconciler.core.scheduling.placement import schedule
from reconciler.core.timestamps import from_epoch_seconds
from reconciler.core.views.capabilities import NODES_FILE, capability_documents, node_file
from reconciler.engine.pass_options import PlanFromRegistry
from reconciler.engine.reconcile import run_pass
from tests.conftest import REPO
from tests.support.clock import T_PASS, FakeClock
from tests.support.fleet import Fleet

PROBES = REPO / "tests" / "fixtures" / "probe"
NEW = "newbox"


def radeon_facts(host: str = NEW) -> HostFacts:
    """A GPU desktop's probe (GPU, two disks, VA-API encoders) on the tailnet."""
    outputs, errors = CaptureDirectory().load(str(PROBES / "radeon-desktop"))
    facts = facts_from_capture(RawCapture(outputs, errors), host=host)
    return facts.model_copy(update={"tailscale_ip": "100.101.9.9"})


@pytest.fixture
def registry(tmp_path: Path) -> SqliteRegistry:
    desired = load_desired(REPO / "hosts")
    reg = SqliteRegistry(tmp_path / "reg" / "registry.sqlite", timing=desired.fleet.timing, flap=desired.fleet.flap, clock=FakeClock(T_PASS))
    yield reg
    reg.close()


def pending_fleet(tmp_path: Path, registry: SqliteRegistry) -> Fleet:
    fleet = Fleet(tmp_path, host=NEW)
    return fleet


def run_pending_pass(fleet: Fleet, registry: SqliteRegistry, **changes: object):
    ports = fleet.ports()
    ports.probe = lambda host, replay: radeon_facts(host)
    opened: list[str] = []

    def open_pending(fleet_config):
        opened.append("pending")
        return _Unclosed(registry)

    def no_registry(fleet_config):
        raise AssertionError("a pending pass opens no registry connection but its pending report's")

    ports.open_pending = open_pending
    ports.open_registry = no_registry
    report = run_pass(fleet.options(plan=PlanFromRegistry(), **changes), ports)
    return report, opened


class _Unclosed:
    """The registry, its close left to the fixture."""

    def __init__(self, registry: SqliteRegistry) -> None:
        self._registry = registry

    def report_pending(self, record: PendingRecord, ttl_s: float) -> PendingRecord:
        return self._registry.report_pending(record, ttl_s)

    def close(self) -> None:
        pass


def test_a_machine_without_a_host_file_reports_pending_and_renders_nothing(tmp_path: Path, registry: SqliteRegistry) -> None:
    fleet = pending_fleet(tmp_path, registry)
    report, opened = run_pending_pass(fleet, registry)
    assert report.outcome == "pending" and report.ok, report
    assert opened == ["pending"]
    assert f"`{admission_command(NEW)}`" in report.stdout and "gpu_vaapi" in report.stdout
    assert any(admission_command(NEW) in note for note in fleet.notes)
    # Nothing rendered, written or activated: the root is as it was.
    assert [p for p in fleet.root.rglob("*") if p.is_file()] == []
    [audit] = fleet.audit.records
    assert (audit["action"], audit["outcome"], audit["admit"], audit["tier"]) == ("pending", "ok", "fabric admit newbox", "gpu_vaapi")
    # Its whole probe record is in the registry, apart from the nodes.
    reports, problems = registry.pending_nodes()
    assert problems == [] and [r.node_id for r in reports] == [NEW]
    hardware = reports[0].facts.hardware
    assert hardware.gpus and hardware.storage and hardware.ffmpeg
    assert reports[0].facts.tailscale_ip == "100.101.9.9"
    assert registry.snapshot().nodes == [] and registry.node_states() == []


def test_a_pass_of_an_undeclared_host_from_a_plan_file_is_still_refused(tmp_path: Path, registry: SqliteRegistry) -> None:
    fleet = pending_fleet(tmp_path, registry)
    report = fleet.reconcile()
    assert report.outcome == "bad-input"
    assert "host 'newbox' is not declared" in report.stderr[0] and "fabric admit newbox" in report.stderr[0]


def test_a_machine_whose_name_cannot_be_a_host_is_bad_input(tmp_path: Path, registry: SqliteRegistry) -> None:
    fleet = Fleet(tmp_path, host="New_Box.local")
    report, _ = run_pending_pass(fleet, registry)
    assert report.outcome == "bad-input" and "cannot be a fabric host's" in report.stderr[0]
    assert registry.pending_nodes() == ([], [])


def test_a_pending_report_keeps_its_first_sighting_and_expires_when_the_machine_stops(registry: SqliteRegistry) -> None:
    clock: FakeClock = registry._clock  # type: ignore[attr-defined]
    first = registry.report_pending(PendingRecord(node_id=NEW, facts=radeon_facts()), ttl_s=90)
    clock.advance(60)
    again = registry.report_pending(PendingRecord(node_id=NEW, facts=radeon_facts()), ttl_s=90)
    assert again.first_seen == first.first_seen and again.reported_at == from_epoch_seconds(T_PASS + 60)
    clock.advance(89)
    assert [r.node_id for r in registry.pending_nodes()[0]] == [NEW]
    clock.advance(2)
    assert registry.pending_nodes() == ([], [])


def test_the_leader_never_places_on_a_pending_machine(registry: SqliteRegistry) -> None:
    """A GPU machine that reports pending is the best node there is, and gets nothing."""
    desired = load_desired(REPO / "hosts")
    registry.report_pending(PendingRecord(node_id=NEW, facts=radeon_facts()), ttl_s=90)
    registry.heartbeat(NodeRecord(node_id="racknerd", tier="relay", max_concurrent_tasks=4))
    leadership = registry.campaign("lux", ttl_s=30)
    assert leadership is not None
    view = registry.lead(leadership)
    assert NEW not in {n.node_id for n in view.snapshot.nodes}
    plan = schedule(view.snapshot, desired)
    assert NEW not in {p.node for p in plan.placements}
    assert NEW not in json.dumps(plan.model_dump(mode="json"))


def test_the_capabilities_documents_hold_every_node_with_its_hardware_and_the_pending_ones(registry: SqliteRegistry) -> None:
    qfox = radeon_facts("qfox-1")
    registry.heartbeat(NodeRecord.from_facts("qfox-1", qfox))
    registry.heartbeat(NodeRecord.from_facts("racknerd", radeon_facts("racknerd")))
    registry.report_pending(PendingRecord(node_id=NEW, facts=radeon_facts()), ttl_s=90)
    snapshot = registry.snapshot()
    files = capability_documents(snapshot, registry.pending_nodes()[0])
    nodes = json.loads(files[NODES_FILE])["nodes"]
    assert [(n["node_id"], n["status"]) for n in nodes] == [("qfox-1", "active"), ("racknerd", "active"), (NEW, "pending")]
    for node in nodes:
        assert set(node) >= {"node_id", "tailscale_ip", "hardware", "tier", "limitations", "last_seen", "status"}
        assert node["hardware"]["gpus"] and node["hardware"]["storage"] and node["hardware"]["ffmpeg"]
        assert json.loads(files[node_file(node["node_id"])]) == node
    assert nodes[2]["admit"] == "fabric admit newbox" and nodes[0]["tailscale_ip"] == "100.101.9.9"


def test_the_joining_identity_may_write_the_pending_reports_and_nothing_else() -> None:
    access = registry_access(load_desired(REPO / "hosts"))
    [grant] = access.roles[JOINING_ROLE]
    assert (grant.key, grant.range_end, grant.access) == ("/fabric/pending/", prefix_end("/fabric/pending/"), "readwrite")
    assert access.users[JOINING_USER] == frozenset({JOINING_ROLE})


def test_a_pending_report_is_bounded_in_size_and_read_one_by_one(registry: SqliteRegistry) -> None:
    from reconciler.adapters.registry_records import MAX_RECORD_BYTES
    from reconciler.ports import RegistryError

    huge = radeon_facts()
    huge = huge.model_copy(update={"hardware": huge.hardware.model_copy(update={"ffmpeg": [f"enc{i:07d}" for i in range(MAX_RECORD_BYTES // 10)]})})
    with pytest.raises(RegistryError, match="over the .*-byte limit"):
        registry.report_pending(PendingRecord(node_id=NEW, facts=huge), ttl_s=90)
    # A broken report among good ones is skipped and named; the others are read.
    registry.report_pending(PendingRecord(node_id="good", facts=radeon_facts("good")), ttl_s=90)
    with registry._tx() as db:  # type: ignore[attr-defined]
        db.execute("INSERT INTO pending (node_id, record, expires_at) VALUES ('bad', 'not json', ?)", (T_PASS + 90,))
        db.execute(
            "INSERT INTO pending (node_id, record, expires_at) VALUES ('liar', ?, ?)",
            (PendingRecord(node_id="good", facts=radeon_facts()).model_dump_json(), T_PASS + 90),
        )
    reports, problems = registry.pending_nodes()
    assert [r.node_id for r in reports] == ["good"]
    assert len(problems) == 2 and any(p.startswith("bad: unreadable pending report: not JSON") for p in problems), problems
    assert any("liar" in p and "names another host" in p for p in problems), problems
