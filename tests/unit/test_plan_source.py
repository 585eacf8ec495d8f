"""Where a pass gets its fleet plan: heartbeat, one leader step, the epoch fence, fail static.

Runs against the embedded sqlite registry (a file in tmp_path, no server) and
replayed probe captures of the example fleet.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from reconciler.adapters.clock import SystemClock
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.fencing import accept_plan
from reconciler.core.live.models import FleetPlan
from reconciler.engine import plan_fence, plan_source
from reconciler.engine.fleet_view import read_fleet_view
from reconciler.engine.heartbeat import node_record
from reconciler.engine.pass_options import PlanAlone, PlanFile, PlanFromRegistry
from reconciler.engine.plan_source import effective_facts, fleet_plan_for
from reconciler.ports import PermissionDenied, RegistryUnavailable
from tests.conftest import REPO
from tests.support.plan_keys import CANDIDATES, FakeSigner, SignedFleet, signed_example_fleet
from tests.support.probe_fixtures import fixture_facts as facts

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> SignedFleet:
    """The example fleet with throwaway plan keys: lux and qfox-1 sign what they lead."""
    return signed_example_fleet(tmp_path_factory.mktemp("fleet"))


@pytest.fixture(scope="module")
def state(fleet: SignedFleet) -> DesiredState:
    return load_desired(fleet.desired)


@pytest.fixture(scope="module")
def signers(fleet: SignedFleet) -> dict[str, FakeSigner]:
    return {host: fleet.signer(host) for host in CANDIDATES}


@pytest.fixture
def connect(tmp_path: Path, state: DesiredState):
    """Opens the registry file afresh, as each real pass does (and closes)."""
    return lambda: SqliteRegistry(tmp_path / "registry.sqlite", timing=state.fleet.timing, flap=state.fleet.flap, clock=SystemClock())


@pytest.fixture
def registry(connect):
    """The same registry file, for the test's own reads and writes."""
    reg = connect()
    yield reg
    reg.close()


SIGNERS: dict[str, FakeSigner] = {}


@pytest.fixture(autouse=True)
def _candidates_hold_their_keys(signers) -> None:
    SIGNERS.clear()
    SIGNERS.update(signers)


def source(connect, state, host, *, applied=None, has_generation=False, write=True, choice=None):
    return fleet_plan_for(
        choice or PlanFromRegistry(),
        state,
        host,
        facts(host),
        connect=connect,
        applied_epoch=applied,
        has_generation=has_generation,
        now=NOW,
        write=write,
        signer=SIGNERS.get(host),
    )


def test_a_lone_leader_candidate_heartbeats_leads_and_renders_its_own_plan(connect, registry, state) -> None:
    result = source(connect, state, "qfox-1")
    assert result.static is None
    assert result.plan.leader == "qfox-1" and result.plan.epoch >= 1
    assert {p.service for p in result.plan.services_on("qfox-1")} >= {"lupine", "vaapi-encode"}
    assert [n.node_id for n in registry.snapshot().nodes] == ["qfox-1"]
    # The pass resigned: a fabric-leader.service can take over at once.
    assert registry.leader() is None


def test_the_plan_covers_every_host_that_heartbeated(connect, registry, state) -> None:
    for host in ("a1-arm64", "x86-spill", "racknerd"):  # not leader candidates: heartbeat only
        assert source(connect, state, host).plan.epoch == 0
    # lux's pass leads, then reads only its own parts (issue 34): the fleet's plan is the registry's.
    own = source(connect, state, "lux").plan
    plan = registry.newest_plan()
    assert {p.node for p in own.placements} == {"lux"} and own.epoch == plan.epoch and own.placements == plan.services_on("lux")
    placed = {p.node for p in plan.placements}
    assert placed <= {"a1-arm64", "x86-spill", "racknerd", "lux"}
    lupine = [d for d in plan.deferred if d.service == "lupine"]
    assert lupine and "gpu_cuda" in lupine[0].reason  # CUDA-only, no CUDA node has reported


def test_a_host_that_is_not_a_candidate_renders_an_empty_plan_until_one_is_published(connect, registry, state) -> None:
    result = source(connect, state, "racknerd")
    assert result.static is None
    assert result.plan.placements == [] and result.plan.epoch == 0
    assert any("no plan published yet" in n for n in result.notes)


def test_a_running_leader_is_never_displaced_by_a_pass(connect, registry, state) -> None:
    held = registry.campaign("lux", 60)
    assert held is not None
    result = source(connect, state, "qfox-1")
    assert registry.leader().candidate == "lux"
    assert not any(n.startswith("leader step") for n in result.notes)


def test_registry_unreachable_with_a_generation_runs_static(state) -> None:
    def unreachable():
        raise RegistryUnavailable("etcd: no endpoint answers")

    result = source(unreachable, state, "racknerd", applied=4, has_generation=True)
    assert result.static == "registry unreachable (etcd: no endpoint answers): running static"


def test_a_registry_that_refuses_this_host_runs_static_and_says_so(state) -> None:
    """etcd with per-host identities: a host whose certificate may not write
    its own heartbeat (init-auth not run, a wrong certificate) keeps its
    generation, and the reason says refused, not an outage."""

    def refusing():
        raise PermissionDenied("heartbeat of x86-spill: permission denied for /etc/fabric/etcd/client.crt")

    result = source(refusing, state, "x86-spill", applied=4, has_generation=True)
    assert result.static == ("registry refused this host (heartbeat of x86-spill: permission denied for /etc/fabric/etcd/client.crt): running static")


def test_registry_unreachable_on_first_boot_renders_host_local_units(state) -> None:
    def unreachable():
        raise RegistryUnavailable("etcd: no endpoint answers")

    result = source(unreachable, state, "racknerd")
    assert result.static is None
    assert result.plan.placements == []
    assert [lane.id for lane in result.plan.lanes] == ["a1-arm64", "x86-spill", "local"]


def test_the_edge_reads_the_registrys_history_with_its_snapshot(connect, registry, state) -> None:
    """The status page's timeline comes on the connection that read the snapshot (racknerd is the edge)."""
    source(connect, state, "a1-arm64")
    source(connect, state, "racknerd")
    view = read_fleet_view(connect, state)
    assert view.history is not None and view.notes == ()
    assert [(n.node_id, n.status) for n in view.history.nodes] == [(n.node_id, n.status) for n in registry.node_states()]
    assert {n.node_id for n in view.history.nodes} == {"a1-arm64", "racknerd"}
    assert {n.node_id for n in view.snapshot.nodes} == {"a1-arm64", "racknerd"}
    assert sorted(lane.id for lane in view.snapshot.lanes) == sorted(lane.id for lane in state.lanes), "every declared lane, reported or not"


def test_the_edges_page_shows_the_lanes_of_the_leaders_plan_and_reads_no_broker(connect, state) -> None:
    """What the edge's page shows of the lanes is the plan's (the leader's,
    signed): read_fleet_view takes no broker at all."""
    import inspect

    from reconciler.core.live.models import LaneView

    assert set(inspect.signature(read_fleet_view).parameters) == {"connect", "desired", "plan"}
    source(connect, state, "racknerd")
    plan = source(connect, state, "racknerd").plan.model_copy(
        update={
            "lanes": [
                LaneView(id="a1-arm64", kind="compute", rank=10, cap=2, in_flight=2, available=True, queue="phaze-agent-a1-arm64-analyze", workers=1),
                LaneView(
                    id="x86-spill", kind="compute", rank=20, cap=4, in_flight=0, available=False, queue="phaze-agent-x86-spill-analyze", workers=0
                ),
                LaneView(id="local", kind="local", rank=99, cap=1, in_flight=0, available=False),
                LaneView(id="not-declared", kind="local", rank=1, cap=1, in_flight=1, available=True),
            ]
        }
    )
    lanes = {lane.id: lane for lane in read_fleet_view(connect, state, plan).snapshot.lanes}
    assert set(lanes) == {"a1-arm64", "x86-spill", "local"}, "only declared lanes"
    assert (lanes["a1-arm64"].in_flight, lanes["a1-arm64"].queue, lanes["a1-arm64"].workers) == (2, "phaze-agent-a1-arm64-analyze", 1)
    assert (lanes["x86-spill"].queue, lanes["x86-spill"].workers) == ("phaze-agent-x86-spill-analyze", 0)
    assert lanes["local"].queue is None, "a lane the leader saw without its queue has none on the page"


def test_an_edge_that_cannot_read_the_history_writes_its_page_without_the_timeline(connect, state) -> None:
    class NoHistory:
        def __init__(self) -> None:
            self.registry = connect()

        def node_states(self):  # type: ignore[no-untyped-def]
            raise RegistryUnavailable("sqlite registry: database is locked")

        def __getattr__(self, name):  # type: ignore[no-untyped-def]
            return getattr(self.registry, name)

    assert source(NoHistory, state, "racknerd", applied=0, has_generation=True).static is None
    view = read_fleet_view(NoHistory, state)
    assert view.snapshot is not None and view.history is None
    assert view.notes == ("status page without its timeline: sqlite registry: database is locked",)


class CountingLanes:
    """A lane queue opener that counts the opens (no broker: lanes unknown)."""

    def __init__(self) -> None:
        self.opened = 0

    def __call__(self) -> None:
        self.opened += 1
        return None


def test_a_pass_opens_the_lane_broker_only_for_what_reads_it(connect, state) -> None:
    """The broker's client costs a pass its import and a connection: the
    edge's plan read (its page's view comes after activation), a worker host
    without lanes, and a leader candidate under a running leader never open it."""
    opens = CountingLanes()

    def offer(host: str) -> plan_fence.PlanOffer:
        return plan_source.read_registry(connect, state, host, facts(host), write=True, signer=SIGNERS.get(host), open_lanes=opens)

    offer("qfox-1")  # a candidate (running no lane's jobs) with nobody leading: its one leader step reads the lanes
    assert opens.opened == 1
    opens.opened = 0
    with_leader = connect()
    try:
        assert with_leader.campaign("lux", ttl_s=60) is not None
        for host in ("racknerd", "qfox-1"):  # the edge; a candidate under lux's lease
            offer(host)
        assert opens.opened == 0
        offer("a1-arm64")  # its compute lane's jobs run here: its heartbeat counts them
        assert opens.opened == 1
    finally:
        with_leader.close()


def test_a_leader_step_dispatches_with_the_dispatchers_dsn_and_a_heartbeat_reads_with_the_readers(connect, state) -> None:
    """[phaze] dispatcher_url_file for the one-shot leader step, queue_url_file
    (the reader's) for a lane host's heartbeat: a pass opens each for its own use."""
    reads, dispatches = CountingLanes(), CountingLanes()

    def offer(host: str) -> plan_fence.PlanOffer:
        return plan_source.read_registry(
            connect, state, host, facts(host), write=True, signer=SIGNERS.get(host), open_lanes=reads, open_dispatcher=dispatches
        )

    offer("qfox-1")  # a candidate with nobody leading: its leader step dispatches
    assert (reads.opened, dispatches.opened) == (0, 1)
    offer("a1-arm64")  # its lane's jobs run here: its heartbeat reads their in_flight
    assert (reads.opened, dispatches.opened) == (1, 1)


def test_no_published_plan_keeps_a_generation_that_runs_placements(connect, registry, state) -> None:
    result = source(connect, state, "racknerd", applied=3, has_generation=True)
    assert result.static == "no plan published yet: running static"


def test_no_published_plan_converges_a_host_that_only_ever_ran_the_empty_plan(connect, registry, state) -> None:
    result = source(connect, state, "racknerd", applied=0, has_generation=True)
    assert result.static is None and result.plan.placements == []


def test_a_plan_older_than_the_applied_one_keeps_the_generation(connect, registry, state) -> None:
    published = source(connect, state, "lux").plan
    result = source(connect, state, "racknerd", applied=published.epoch + 5, has_generation=True)
    assert result.static is not None and "older than the newest applied" in result.static


def test_a_plan_signed_by_a_host_that_is_not_a_candidate_is_refused(connect, registry, state) -> None:
    rogue = registry.campaign("racknerd", 60)  # a registry writer making itself leader
    registry.publish_plan(rogue, FleetPlan(epoch=0, leader="racknerd", created=NOW))
    result = source(connect, state, "x86-spill", has_generation=True)
    assert result.static is not None and "not a leader candidate" in result.static


def test_fabric_plan_reads_without_writing(connect, registry, state) -> None:
    source(connect, state, "racknerd", write=False)
    assert registry.snapshot().nodes == []


def test_a_tier_pin_in_the_host_file_lowers_the_tier_and_its_label(state) -> None:
    probed = facts("lux")
    assert probed.tier == "gpu_apu"  # an Intel iGPU, kept for the file server's own transcoding
    pinned = effective_facts(state, "lux", probed)
    assert pinned.tier == "cpu_ffmpeg"
    assert pinned.labels["topology.researchstack.io/tier"] == "cpu_ffmpeg"
    assert node_record(state, "lux", pinned).tier == "cpu_ffmpeg"
    # A host without a pin keeps its probe as it is.
    assert effective_facts(state, "qfox-1", facts("qfox-1")) == facts("qfox-1")


def test_the_record_carries_declared_limits_lowered_tier_and_declared_labels(state) -> None:
    record = node_record(state, "qfox-1", facts("qfox-1"))
    # qfox-1 declares 4/6; its probe says 5/5, which bounds the ceiling.
    assert (record.tier, record.max_concurrent_tasks, record.max_concurrent_ceiling) == ("gpu_cuda", 4, 5)
    assert record.lowered_limits == ["max_concurrent_ceiling 6 lowered to 5 by the probe"]
    # The host file's role label wins over the probe's auto-detected one.
    assert facts("qfox-1").labels["topology.researchstack.io/role"] == "auto:qfox-1"
    assert record.labels["topology.researchstack.io/role"] == "foxtop"
    assert record.labels["topology.researchstack.io/tier"] == "gpu_cuda"


def test_every_plan_source_passes_the_one_fence_exactly_once(connect, registry, state, tmp_path, monkeypatch) -> None:
    calls = []

    def counting_fence(*args, **kwargs):
        verdict = accept_plan(*args, **kwargs)
        calls.append(verdict)
        return verdict

    monkeypatch.setattr(plan_fence, "accept_plan", counting_fence)
    saved = tmp_path / "plan.json"
    saved.write_text(FleetPlan(epoch=3, leader="lux", created=NOW).model_dump_json())
    for choice in (PlanFromRegistry(), PlanFile(saved), PlanAlone()):
        calls.clear()
        source(connect, state, "lux", applied=0, has_generation=True, choice=choice)
        assert len(calls) == 1, choice
    # A plan file older than the applied plan is fenced off like the registry's.
    result = source(connect, state, "lux", applied=5, has_generation=True, choice=PlanFile(saved))
    assert result.static == "plan epoch 3 is older than the newest applied (5): the plan file is older than the plan this host runs: running static"
    # Only the registry's plans must be signed by a leader candidate.
    saved.write_text(FleetPlan(epoch=3, leader="racknerd", created=NOW).model_dump_json())
    assert source(connect, state, "lux", applied=3, has_generation=True, choice=PlanFile(saved)).static is None


def test_the_example_fleets_declared_limits_bounded_by_each_hosts_probe(state) -> None:
    """What the example fleet's hosts report, each from its fixture probe."""
    got = {host: node_record(state, host, facts(host)) for host in sorted(state.hosts)}
    assert {host: (r.max_concurrent_tasks, r.max_concurrent_ceiling, r.lowered_limits) for host, r in got.items()} == {
        "a1-arm64": (1, 2, ["max_concurrent_tasks 2 lowered to 1 by the probe"]),
        "lux": (2, 12, []),
        "qfox-1": (4, 5, ["max_concurrent_ceiling 6 lowered to 5 by the probe"]),
        "racknerd": (1, 1, []),
        "x86-spill": (2, 3, ["max_concurrent_tasks 4 lowered to 2 by the probe", "max_concurrent_ceiling 8 lowered to 3 by the probe"]),
    }


def test_a_ray_node_reads_its_own_lifecycle_and_a_drained_one_is_closed(connect, registry, state) -> None:
    from reconciler.core.render.ray_units import closed_reason

    first = source(connect, state, "qfox-1")
    assert first.own_state is not None and first.own_state.node_id == "qfox-1"
    assert closed_reason(first.own_state, NOW) is None
    registry.set_drain("qfox-1", grace_s=0)
    # qfox-1's own pass leads (a candidate): its lifecycle step marks the drain done.
    drained = source(connect, state, "qfox-1")
    assert drained.own_state is not None and drained.own_state.drained
    assert closed_reason(drained.own_state, NOW) == "drained"
    registry.clear_drain("qfox-1")
    # racknerd runs no Ray node: its pass does not read the lifecycle.
    assert source(connect, state, "racknerd").own_state is None


class LoggedRegistry:
    """A registry whose reads of the fleet's view land in the machine's call
    log, beside the activation steps FakeMachine logs there."""

    def __init__(self, registry, calls: list) -> None:  # type: ignore[no-untyped-def]
        self.registry, self.calls = registry, calls

    def snapshot(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls.append(["registry", "snapshot"])
        return self.registry.snapshot(*args, **kwargs)

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        return getattr(self.registry, name)


def test_the_edge_loads_caddy_before_it_reads_the_fleets_view_for_its_page(tmp_path, fleet, connect, state) -> None:
    """A new plan's upstreams reach Caddy without waiting for the status
    page's reads (the snapshot, the history, the broker's lanes): the view is
    read once activation is over, and the page still shows it."""
    from reconciler.engine.reconcile import PassOptions, run_pass
    from tests.support.audit import RecordingAudit
    from tests.support.fleet import fake_pass_ports
    from tests.support.machine import FakeMachine, FakeVerifier

    plan_source.read_registry(connect, state, "lux", facts("lux"), write=True, signer=SIGNERS["lux"])  # lux leads once: a signed plan
    root = tmp_path / "root"
    root.mkdir()
    machine = FakeMachine(root, tmp_path / "machine.json")
    ports = fake_pass_ports(root, machine, FakeVerifier(), RecordingAudit())
    ports.open_registry = lambda _fleet: LoggedRegistry(connect(), machine.state["calls"])
    options = PassOptions(
        desired=fleet.desired, host="racknerd", root=root, replay=str(REPO / "tests/fixtures/probe/racknerd"), plan=PlanFromRegistry()
    )
    report = run_pass(options, ports)
    assert report.outcome == "applied", report
    steps = [call[0] for call in machine.state["calls"]]
    assert "caddy-load" in steps and steps.index("caddy-load") < steps.index("registry")
    page = (root / "var/lib/fabric/status/index.html").read_text()
    assert "lux" in page and "racknerd" in page
