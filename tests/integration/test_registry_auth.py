"""Per-host identities in a real etcd: TLS client certificates (CN = host name)
and etcd's auth, set up by `fabric registry init-auth`
(reconciler.core.desired.registry_access).

One etcd member for the module, started by tests/support/harness/etcd.py in TLS mode
(`--client-cert-auth`, certificates of a test CA made with `cryptography`).
The module's first test runs init-auth through the CLI, twice; the others
act as each host with that host's own certificate.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from reconciler.cli import EXIT_FAILED, EXIT_OK
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.members import MemberRecord
from reconciler.core.live.models import FleetPlan
from reconciler.core.live.pending import PendingRecord
from reconciler.core.live.records import LeaderInfo, Leadership, NodeRecord
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.leader import LeaderLoop
from reconciler.ports import PermissionDenied, Registry
from reconciler.wiring import open_registry
from tests.conftest import EXAMPLE_FLEET, REPO, require
from tests.support.cli import fabric_captured
from tests.support.harness.etcd import EtcdCluster, etcd_cluster
from tests.support.harness.waiting import deadline_for, wait_until

pytestmark = pytest.mark.integration

PREFIX = f"/auth{uuid.uuid4().hex[:8]}"
# "x86" is a prefix of "x86-spill": its permissions must not reach x86-spill's keys.
HOSTS = {"lux": "lux", "qfox-1": "qfox-1", "x86-spill": "x86-spill", "x86": "x86-spill", "racknerd": "racknerd"}


def fabric_toml(cluster: EtcdCluster, identity: str) -> str:
    tls = cluster.tls_settings(identity)
    endpoints = ", ".join(f'"{e}"' for e in cluster.endpoints)
    return f"""
[fleet]
name = "authtest"
domain = "auth.example"
leader_candidates = ["lux", "qfox-1"]

[timing]
heartbeat_s = 1
node_timeout_s = 3
relayed_heartbeat_s = 2
missed_beats = 3
drain_grace_s = 30

# Worker groups: each has an identity (fabric-group-<group>) that writes only its members' keys.
[groups.batch]
tier = "batch"
labels = {{ "topology.researchstack.io/pool" = "batch" }}

[groups.batch-x]
tier = "cpu_ffmpeg"

[registry]
backend = "etcd"
endpoints = [{endpoints}]
prefix = "{PREFIX}"
ca_file = "{tls["ca_file"]}"
cert_file = "{tls["cert_file"]}"
key_file = "{tls["key_file"]}"
"""


def write_desired(directory: Path, cluster: EtcdCluster, identity: str) -> Path:
    """The desired state as seen on the machine of `identity`: [registry]'s
    cert_file/key_file are that identity's (fleet-wide paths, per-host files)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "fabric.toml").write_text(fabric_toml(cluster, identity))
    for host, model in HOSTS.items():
        text = (EXAMPLE_FLEET / f"{model}.toml").read_text()
        if host != model:  # a second host made from the same file: its own name, address and tailnet name
            text = text.replace(f'"{model}', f'"{host}').replace('address = "100.101.7.22"', 'address = "100.101.7.23"')
        (directory / f"{host}.toml").write_text(text)
    return directory


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    require("etcd")
    with etcd_cluster(members=1, tls=True) as c:
        yield c


@pytest.fixture(scope="module")
def desired_root(cluster: EtcdCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fabric.toml with root's certificate at [registry] cert_file (an operator's machine)."""
    return write_desired(tmp_path_factory.mktemp("root"), cluster, "root")


@pytest.fixture(scope="module")
def init_auth(desired_root: Path) -> list[tuple[int, str, str]]:
    """`fabric registry init-auth` run twice as root (the module's tests need auth on)."""
    return [fabric_captured("registry", "init-auth", "--desired", str(desired_root)) for _ in range(2)]


@pytest.fixture
def as_host(init_auth, cluster: EtcdCluster, tmp_path: Path) -> Iterator:
    """Open the registry as `identity`, with its own certificate; all closed afterwards."""
    opened: list[Registry] = []

    def open_as(identity: str) -> Registry:
        desired = load_desired(write_desired(tmp_path / identity, cluster, identity))
        registry = open_registry(desired.fleet)
        opened.append(registry)
        return registry

    yield open_as
    for registry in opened:
        registry.close()


def desired_of(cluster: EtcdCluster, tmp: Path, identity: str) -> DesiredState:
    return load_desired(write_desired(tmp / f"desired-{identity}", cluster, identity))


def raw_put(registry: Registry, key: str, value: bytes = b"x") -> None:
    async def op(c):
        await c.put(f"{PREFIX}/{key}".encode(), value)

    registry._call(op, f"a put of {PREFIX}/{key}")  # type: ignore[attr-defined]


# -- init-auth -------------------------------------------------------------------------


def test_init_auth_creates_every_identity_then_has_nothing_to_do(init_auth):
    (first_status, first, first_err), (second_status, second, second_err) = init_auth
    assert first_status == EXIT_OK, first_err
    lines = first.splitlines()
    for expected in (
        "created role fabric-host-lux",
        f"granted fabric-host-lux readwrite {PREFIX}/nodes/lux",
        f"granted fabric-host-lux readwrite {PREFIX}/liveness/lux",
        f"granted fabric-host-lux read {PREFIX}/* (prefix)",
        f"granted fabric-leader readwrite {PREFIX}/* (prefix)",
        f"granted fabric-admin readwrite {PREFIX}/drain/* (prefix)",
        "granted role fabric-leader to user lux",
        "granted role fabric-leader to user qfox-1",
        "granted role fabric-host-x86-spill to user x86-spill",
        "granted role root to user root",
        f"granted fabric-host-racknerd readwrite {PREFIX}/edge-upstreams/racknerd",
    ):
        assert expected in lines, f"{expected!r} not in:\n{first}"
    assert "granted role fabric-leader to user x86-spill" not in lines
    assert lines[-1] == "enabled auth", "auth goes on last, once every identity can work"
    assert second_status == EXIT_OK, second_err
    assert second.startswith("nothing to do"), second


def test_init_auth_with_a_host_certificate_is_refused(init_auth, cluster, tmp_path):
    desired = write_desired(tmp_path / "x86-spill", cluster, "x86-spill")
    status, out, err = fabric_captured("registry", "init-auth", "--desired", str(desired))
    assert status == EXIT_FAILED
    assert "permission denied" in err and "Traceback" not in err, err


def test_init_auth_takes_an_admin_certificate_on_the_command_line(init_auth, cluster, tmp_path):
    """On a host (its own certificate in [registry]), --cert-file/--key-file name root's."""
    desired = write_desired(tmp_path / "lux", cluster, "lux")
    cert, key = cluster.pki.client("root")
    status, out, err = fabric_captured("registry", "init-auth", "--desired", str(desired), "--cert-file", str(cert), "--key-file", str(key))
    assert (status, out.startswith("nothing to do")) == (EXIT_OK, True), out + err


# -- what a plain host may do ------------------------------------------------------------


def test_a_host_writes_only_its_own_heartbeat_and_reads_everything(as_host):
    spill = as_host("x86-spill")
    spill.heartbeat(NodeRecord(node_id="x86-spill", tier="cpu_ffmpeg"))
    spill.heartbeat(NodeRecord(node_id="x86-spill", tier="cpu_ffmpeg"))  # keeps its lease alive
    assert "x86-spill" in {s.node_id for s in spill.node_states()}
    spill.leader(), spill.newest_plan(), spill.epoch(), spill.snapshot()

    with pytest.raises(PermissionDenied, match="the heartbeat of lux to the identity of .*: permission denied"):
        spill.heartbeat(NodeRecord(node_id="lux", tier="gpu_cuda"))
    # Exact keys, not prefixes: x86's identity does not reach x86-spill's keys.
    x86 = as_host("x86")
    for key in ("nodes/x86-spill", "facts/x86-spill"):
        with pytest.raises(PermissionDenied):
            raw_put(x86, key, NodeRecord(node_id="x86-spill", tier="gpu_cuda").model_dump_json().encode())
    x86.heartbeat(NodeRecord(node_id="x86", tier="cpu_ffmpeg"))


def test_a_host_keeps_only_its_own_liveness_record_alive(as_host):
    """Issue 30: fabric-watch's fast liveness record, P/liveness/<host>, is
    the host's own key like its beat: exact, not a prefix."""
    spill = as_host("x86-spill")
    spill.keep_alive("x86-spill", 3)
    spill.keep_alive("x86-spill", 3)  # the same lease kept alive
    assert "x86-spill" in {r.host for r in as_host("lux").liveness()}
    with pytest.raises(PermissionDenied, match="the liveness of lux to the identity of .*: permission denied"):
        spill.keep_alive("lux", 3)
    with pytest.raises(PermissionDenied):
        as_host("x86").keep_alive("x86-spill", 3)


def test_an_edge_reports_only_its_own_caddy_upstreams(as_host):
    """Issue 30: an edge's record of its Caddy's failed upstreams,
    P/edge-upstreams/<edge>, is its own exact key; a host that is no edge
    writes none, and every host reads them (the leader does)."""
    edge = as_host("racknerd")
    edge.report_edge_upstreams("racknerd", b'{"edge":"racknerd"}')
    assert as_host("lux").edge_upstreams() == {"racknerd": b'{"edge":"racknerd"}'}
    with pytest.raises(PermissionDenied, match="the edge upstreams of lux to the identity of .*: permission denied"):
        edge.report_edge_upstreams("lux", b"{}")
    with pytest.raises(PermissionDenied):
        as_host("x86-spill").report_edge_upstreams("x86-spill", b"{}")


def test_a_host_cannot_write_the_leaders_keys_or_drains(as_host):
    spill = as_host("x86-spill")
    for key in (
        "plan-index",
        "plan-parts/x",
        "plan",
        "leader",
        "epoch",
        "nodes/lux",
        "facts/lux",
        "state/x86-spill",
        "drain/x86-spill",
        "scaling",
        "jobs/j1",
    ):
        with pytest.raises(PermissionDenied, match="permission denied"):
            raw_put(spill, key)
    with pytest.raises(PermissionDenied, match="the campaign of x86-spill"):
        spill.campaign("x86-spill", ttl_s=2)
    fake = Leadership(info=LeaderInfo(candidate="x86-spill", epoch=1, since=datetime.now(UTC), token="1"), ttl_s=2)
    with pytest.raises(PermissionDenied, match="publishing x86-spill's plan"):
        spill.publish_plan(fake, FleetPlan(epoch=0, leader="x86-spill", created=datetime.now(UTC)))
    with pytest.raises(PermissionDenied, match="the drain of x86-spill"):
        spill.set_drain("x86-spill")


def test_the_operator_identity_drains_but_does_not_beat(as_host):
    admin = as_host("fabric-admin")
    admin.set_drain("x86-spill", grace_s=5)
    assert admin.clear_drain("x86-spill")
    with pytest.raises(PermissionDenied):
        admin.heartbeat(NodeRecord(node_id="lux", tier="gpu_cuda"))
    with pytest.raises(PermissionDenied):
        raw_put(admin, "plan")


def test_a_record_under_another_hosts_key_is_not_believed(as_host):
    """A host writes only its own keys; what it writes there cannot speak for another host."""
    x86 = as_host("x86")
    forged = NodeRecord(node_id="lux", tier="gpu_cuda").model_dump_json().encode()
    raw_put(x86, "nodes/x86", forged)
    raw_put(x86, "facts/x86", forged)
    states = x86.node_states()
    assert all(s.record is None or s.record.node_id == s.node_id for s in states), [(s.node_id, s.record) for s in states]
    assert not [n for n in x86.snapshot().nodes if n.node_id == "lux" and n.tier == "gpu_cuda"]


# -- the fleet over per-host identities ------------------------------------------------------


def test_heartbeats_election_publish_and_failover(as_host, cluster, tmp_path):
    desired = {name: desired_of(cluster, tmp_path, name) for name in ("lux", "qfox-1")}
    timing = desired["lux"].fleet.timing
    ttl = float(timing.heartbeat_s * 2)
    registries = {name: as_host(name) for name in ("lux", "qfox-1", "x86-spill")}
    for name, registry in registries.items():
        registry.heartbeat(NodeRecord(node_id=name, tier="cpu_ffmpeg"))

    loops = {name: LeaderLoop(registries[name], name, lambda d=desired[name]: d, schedule, lease_ttl_s=ttl, log=lambda m: None) for name in desired}
    loops["lux"].step()
    assert loops["lux"].leadership is not None, "lux campaigns with its own certificate"
    first = registries["x86-spill"].newest_plan()
    assert first is not None and first.leader == "lux", "the leader publishes; a plain host reads it"
    loops["qfox-1"].step()
    assert loops["qfox-1"].leadership is None, "qfox-1 waits while lux leads"

    # lux resigns: qfox-1 takes over and publishes under its own identity.
    registries["lux"].resign(loops["lux"].leadership)
    loops["lux"].leadership = None
    loops["qfox-1"].step()
    term = loops["qfox-1"].leadership
    assert term is not None and term.epoch > first.epoch
    published = registries["qfox-1"].publish_plan(term, FleetPlan(epoch=0, leader="qfox-1", created=datetime.now(UTC)))
    assert registries["x86-spill"].newest_plan().epoch == published.epoch > term.epoch

    # qfox-1 goes silent (no renewal): its lease lapses and lux leads again.
    def lux_leads() -> bool:
        loops["lux"].step()
        return loops["lux"].leadership is not None

    wait_until(lux_leads, timeout=ttl * 3 + 5, interval=0.2, what="lux to lead after qfox-1's lease lapsed")
    info = registries["x86-spill"].leader()
    assert info is not None and info.candidate == "lux" and info.epoch > published.epoch


def test_the_leaders_watch_sees_a_join_and_a_lapse_under_auth(as_host):
    """The leader wakes at a node's lapse (its heartbeat key deleted with its
    lease) with its own identity, over TLS, as it does without auth."""
    lux = as_host("lux")
    spill = as_host("x86-spill")
    lux.wait_for_change(0)  # arm the watch
    spill.heartbeat(NodeRecord(node_id="x86-spill", tier="cpu_ffmpeg"), ttl_s=2)
    assert lux.wait_for_change(deadline_for(2)), "a join wakes the leader"
    assert lux.wait_for_change(deadline_for(2)), "the lapse of x86-spill's heartbeat wakes the leader"


# -- a machine without a host file (#31): the joining identity -----------------------------------


def pending_record(host: str = "newbox") -> PendingRecord:
    from reconciler.core.desired.model import Hardware, HostFacts

    facts = HostFacts(node_id=host, k3s_hostname=host, hardware=Hardware(arch="x86_64", cpu_cores=8), tier="cpu_ffmpeg", tailscale_ip="100.101.9.9")
    return PendingRecord(node_id=host, facts=facts)


def test_the_joining_identity_writes_its_pending_report_and_nothing_else(as_host):
    joining = as_host("fabric-joining")
    first = joining.report_pending(pending_record(), ttl_s=30)
    again = joining.report_pending(pending_record(), ttl_s=30)  # its next pass: a new lease, the old one revoked
    assert again.first_seen == first.first_seen
    # Nothing else: no heartbeat, no leader's key, no drain, no other host's keys, not even a read.
    for key in ("nodes/newbox", "facts/newbox", "nodes/lux", "facts/lux", "plan", "leader", "epoch", "state/newbox", "drain/newbox", "scaling"):
        with pytest.raises(PermissionDenied, match="permission denied"):
            raw_put(joining, key, NodeRecord(node_id="newbox", tier="gpu_cuda").model_dump_json().encode())
    with pytest.raises(PermissionDenied):
        joining.heartbeat(NodeRecord(node_id="newbox", tier="gpu_cuda"))
    with pytest.raises(PermissionDenied):
        joining.snapshot()
    with pytest.raises(PermissionDenied):
        joining.campaign("newbox", ttl_s=2)
    with pytest.raises(PermissionDenied):
        joining.set_drain("lux")
    # A declared host reads the pending reports (the live state is no secret) and cannot write one.
    spill = as_host("x86-spill")
    assert [r.node_id for r in spill.pending_nodes()[0]] == ["newbox"]
    with pytest.raises(PermissionDenied):
        spill.report_pending(pending_record("x86-spill"), ttl_s=30)
    # A pending report is never a node.
    assert "newbox" not in {n.node_id for n in spill.snapshot().nodes}


def test_a_pending_report_lapses_when_the_machine_stops(as_host):
    joining, lux = as_host("fabric-joining"), as_host("lux")
    joining.report_pending(pending_record("lapsing"), ttl_s=2)
    assert "lapsing" in {r.node_id for r in lux.pending_nodes()[0]}
    wait_until(
        lambda: "lapsing" not in {r.node_id for r in lux.pending_nodes()[0]}, timeout=deadline_for(2) + 2, interval=0.2, what="the lease to lapse"
    )


def test_a_pass_without_a_host_file_reports_pending_as_the_joining_identity(init_auth, cluster, tmp_path):
    """`fabric reconcile` on a machine with no host file: [registry] cert_file is
    a host's (which may not write pending reports), joining_cert_file the joining
    identity's; the pass reports pending with the latter and writes nothing."""
    desired = write_desired(tmp_path / "desired", cluster, "x86-spill")
    cert, key = cluster.pki.client("fabric-joining")
    fabric_toml_path = desired / "fabric.toml"
    fabric_toml_path.write_text(fabric_toml_path.read_text() + f'joining_cert_file = "{cert}"\njoining_key_file = "{key}"\n')
    root = tmp_path / "root"
    root.mkdir()
    replay = str(REPO / "tests" / "fixtures" / "probe" / "radeon-desktop")
    status, out, err = fabric_captured(
        "reconcile", "--desired", str(desired), "--host", "joiner", "--root", str(root), "--no-activate", "--replay", replay
    )
    assert status == EXIT_OK, out + err
    assert "fabric admit joiner" in out and "gpu_vaapi" in out
    written = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert not [p for p in written if "generations" in p or p.startswith("etc/")], written
    host = load_desired(write_desired(tmp_path / "host", cluster, "lux"))
    registry = open_registry(host.fleet)
    try:
        [report] = [r for r in registry.pending_nodes()[0] if r.node_id == "joiner"]
        assert report.facts.tier == "gpu_vaapi" and report.facts.hardware.gpus
    finally:
        registry.close()


def test_a_pending_report_is_read_one_by_one_and_never_speaks_for_another_name(as_host):
    joining, lux = as_host("fabric-joining"), as_host("lux")
    joining.report_pending(pending_record("honest"), ttl_s=30)
    raw_put(joining, "pending/liar", pending_record("honest").model_dump_json().encode())
    raw_put(joining, "pending/garbage", b"\xff\xfe not json")
    reports, problems = lux.pending_nodes()
    names = {r.node_id for r in reports}
    assert "honest" in names and "liar" not in names and "garbage" not in names
    assert any(p.startswith("liar: unreadable pending report: names another host") for p in problems), problems
    assert any(p.startswith("garbage: unreadable pending report: not JSON") for p in problems), problems


# -- a worker group's members: the group's identity ---------------------------------------------


def member_record(name: str, group: str = "batch") -> MemberRecord:
    from reconciler.core.desired.model import Hardware, HostFacts

    facts = HostFacts(node_id=name, k3s_hostname=name, hardware=Hardware(arch="x86_64", cpu_cores=4), tier="gpu_cuda", tailscale_ip="100.101.9.10")
    return MemberRecord(node_id=name, group=group, address="100.101.9.10", facts=facts)


def test_init_auth_gives_each_group_an_identity_for_its_members_keys(init_auth):
    (status, out, err), _ = init_auth
    lines = out.splitlines()
    for expected in (
        "created role fabric-group-batch",
        f"granted fabric-group-batch readwrite {PREFIX}/members/batch/* (prefix)",
        f"granted fabric-group-batch read {PREFIX}/* (prefix)",
        "granted role fabric-group-batch to user fabric-group-batch",
    ):
        assert expected in lines, f"{expected!r} not in:\n{out}"


def test_a_groups_identity_writes_only_its_own_groups_members(as_host):
    batch = as_host("fabric-group-batch")
    first = batch.report_member(member_record("gh-1"), ttl_s=30)
    again = batch.report_member(member_record("gh-1"), ttl_s=30)  # its next report: a new lease, the old one revoked
    assert again.first_seen == first.first_seen
    # Not another group's members ("batch" is a prefix of "batch-x": the grant ends in a slash).
    with pytest.raises(PermissionDenied, match="permission denied"):
        batch.report_member(member_record("gh-2", group="batch-x"), ttl_s=30)
    # Nothing else: no heartbeat, no leader's key, no pending report, no drain.
    for key in ("nodes/gh-1", "facts/gh-1", "plan", "leader", "epoch", "scaling", "pending/gh-1", "drain/lux", "members/batch-x/gh-1"):
        with pytest.raises(PermissionDenied, match="permission denied"):
            raw_put(batch, key, member_record("gh-1").model_dump_json().encode())
    with pytest.raises(PermissionDenied):
        batch.heartbeat(NodeRecord(node_id="gh-1", tier="gpu_cuda"))
    with pytest.raises(PermissionDenied):
        batch.campaign("gh-1", ttl_s=2)
    # A host cannot write a member report, the joining identity neither; both are read by the leader.
    with pytest.raises(PermissionDenied):
        as_host("x86-spill").report_member(member_record("gh-9"), ttl_s=30)
    with pytest.raises(PermissionDenied):
        as_host("fabric-joining").report_member(member_record("gh-9"), ttl_s=30)
    records, _ = as_host("lux").group_members()
    assert ("batch", "gh-1") in {(r.group, r.node_id) for r in records}
    assert "gh-1" not in {n.node_id for n in as_host("lux").snapshot().nodes}, "a member report is never a heartbeat"


def test_a_member_report_that_names_another_group_is_skipped_and_one_lapses(as_host):
    batch, lux = as_host("fabric-group-batch"), as_host("lux")
    raw_put(batch, "members/batch/liar", member_record("liar", group="batch-x").model_dump_json().encode())
    records, problems = lux.group_members()
    assert "liar" not in {r.node_id for r in records}
    assert any("names another group or member (batch-x/liar)" in p for p in problems), problems
    batch.report_member(member_record("lapsing"), ttl_s=2)
    assert "lapsing" in {r.node_id for r in lux.group_members()[0]}
    wait_until(
        lambda: "lapsing" not in {r.node_id for r in lux.group_members()[0]}, timeout=deadline_for(2) + 2, interval=0.2, what="the lease to lapse"
    )


def test_the_leader_admits_a_member_with_its_groups_tier_under_auth(as_host, cluster, tmp_path):
    """lux leads with its own identity, reads the member the group's identity
    reported, and places work that needs the group's label there, at the group's tier."""
    from reconciler.core.desired.model import Service

    desired = desired_of(cluster, tmp_path, "lux")
    crunch = Service.model_validate(
        {"id": "crunch", "min_tier": "batch", "floor": "batch", "labels": {"topology.researchstack.io/pool": "batch"}, "command": {"any": ["/opt/c"]}}
    )
    desired = desired.model_copy(update={"fleet": desired.fleet.model_copy(update={"services": [crunch]})})
    as_host("fabric-group-batch").report_member(member_record("gh-7"), ttl_s=30)
    lux = as_host("lux")
    loop = LeaderLoop(lux, "lux", lambda: desired, schedule, lease_ttl_s=3, log=lambda m: None)

    def placed() -> list[tuple[str, str]]:
        loop.step()
        plan = lux.newest_plan()
        return [(p.node, p.tier) for p in plan.placements if p.service == "crunch"] if plan is not None and plan.leader == "lux" else []

    wait_until(lambda: placed() == [("gh-7", "batch")], timeout=deadline_for(10), interval=0.5, what="crunch placed on the member at batch")
    if loop.leadership is not None:
        lux.resign(loop.leadership)
