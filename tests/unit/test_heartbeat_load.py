"""The heartbeat's load, unit states and limits from a whole pass (engine.reconcile), with fakes.

x86-spill of the example fleet: the golden plan places flac-fft there and
its lane x86-spill's agent runs there. systemd, nft and Caddy are
test_apply's FakeMachine; the registry is `RecordingRegistry` (every beat
kept); the lane queue is tests.support.fakes.FakeLaneBroker, the jobs its queues hold
set by hand; the registry's plan is the golden one, unsigned (the copy's
[[plan_keys]] are cut off).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from datetime import UTC, datetime
from pathlib import Path

from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.live.plan_parts import PlanIndex, PlanRead
from reconciler.core.live.records import LeaderInfo, NodeRecord
from reconciler.core.render.ray_node import RAY_WORKER_UNIT
from reconciler.core.scheduling.lifecycle import NodeState
from reconciler.engine.pass_options import PlanFromRegistry
from reconciler.ports import RegistryUnavailable
from tests.support.fakes import FakeLaneBroker
from tests.support.fleet import GOLDEN, Fleet
from tests.support.plan_reads import read_of

SERVICE = "fabric-agent-flac-fft.service"
AGENT = "fabric-agent-x86-spill.service"


class RecordingRegistry:
    """The part of the Registry port a non-leading pass uses; every open is the same registry."""

    def __init__(self) -> None:
        self.beats: list[NodeRecord] = []
        self.plan = FleetPlan.model_validate_json((GOLDEN / "fleet-plan.json").read_bytes())
        self.reachable = True
        self.states: list[NodeState] = []

    def heartbeat(self, record: NodeRecord, ttl_s: float | None = None) -> NodeRecord:
        if not self.reachable:
            raise RegistryUnavailable("the test cut the registry off")
        self.beats.append(record)
        return record.model_copy(update={"beat_at": datetime(2026, 11, 30, tzinfo=UTC), "timeout_s": 90.0})

    def leader(self) -> LeaderInfo:
        return LeaderInfo(candidate="lux", epoch=self.plan.epoch, since=datetime(2026, 11, 30, tzinfo=UTC), token="t")

    def epoch(self) -> int:
        return self.plan.epoch

    def newest_plan(self) -> FleetPlan:
        return self.plan

    def plan_read(self, choose: Callable[[PlanIndex], Collection[str]]) -> PlanRead | None:
        return read_of(self.plan, choose)

    def snapshot(self, lanes: object = ()) -> Snapshot:
        return Snapshot(now=datetime(2026, 11, 30, tzinfo=UTC))

    def node_states(self) -> list[NodeState]:
        """What the lifecycle knows (x86-spill runs a Ray worker, so its pass asks)."""
        return list(self.states)

    def close(self) -> None:
        pass


class SpillFleet(Fleet):
    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path, host="x86-spill")
        fleet_file = self.desired / "fabric.toml"
        text = fleet_file.read_text()
        fleet_file.write_text(text[: text.index("[[plan_keys]]")])
        self.registry = RecordingRegistry()
        self.lanes = FakeLaneBroker()
        self.lanes.held = {"phaze-agent-x86-spill-analyze": 3, "phaze-agent-a1-arm64-analyze": 2}

    def reconcile(self, **changes: object):  # type: ignore[no-untyped-def]
        from reconciler.engine.reconcile import run_pass

        options = self.options(plan=PlanFromRegistry(), **changes)
        ports = self.ports(activate=not options.no_activate)
        ports.open_registry = lambda fleet: self.registry  # type: ignore[assignment,return-value]
        ports.open_lane_broker = lambda fleet: self.lanes  # type: ignore[assignment,return-value]
        return run_pass(options, ports)


def test_the_pass_beats_again_after_activation_with_the_units_it_started(tmp_path: Path) -> None:
    fleet = SpillFleet(tmp_path)
    report = fleet.reconcile()
    assert report.outcome == "applied", report
    before, after = fleet.registry.beats
    # Before activation nothing of the fabric ran: only the lane's jobs.
    assert (before.in_flight, before.services_running, before.units) == (3, 0, {})
    # After it: flac-fft's unit runs (1) plus the three jobs of lane x86-spill
    # (a1-arm64's two run elsewhere); every unit of the generation is reported.
    # Which part of it is the services: the scheduler counts its own placements instead.
    assert (after.in_flight, after.services_running) == (4, 1)
    # (the agent's account unit too: a oneshot that stays active, no service of the scheduler's).
    assert after.units == {
        SERVICE: "active",
        AGENT: "active",
        "fabric-account-x86-spill.service": "active",
        "fabric-nftables.service": "active",
        RAY_WORKER_UNIT: "active",
    }
    assert "after activation, heartbeat: x86-spill tier relay, in_flight 4, alive for 90 s (1 services, 3 lane jobs)" in fleet.notes
    # The memo stands for this pass with the record after activation.
    assert report.memo_seed is not None and report.memo_seed.node_record == after.model_dump_json()
    assert (report.memo_seed.load_services, report.memo_seed.lanes_here) == (1, ("x86-spill",))


def test_a_stopped_service_unit_drops_the_load_and_shows_in_the_units(tmp_path: Path) -> None:
    fleet = SpillFleet(tmp_path)
    fleet.reconcile()
    assert fleet.machine.run_jobs("stop", [SERVICE])[0].ok  # stopped by hand
    fleet.lanes.held = {"phaze-agent-x86-spill-analyze": 1}
    fleet.registry.beats.clear()
    report = fleet.reconcile()
    assert report.outcome == "applied", report  # the pass starts it again
    before, after = fleet.registry.beats
    assert before.in_flight == 1 and before.units[SERVICE] == "inactive"
    assert after.in_flight == 2 and after.units[SERVICE] == "active"


def test_a_pass_that_changes_nothing_beats_once(tmp_path: Path) -> None:
    fleet = SpillFleet(tmp_path)
    fleet.reconcile()
    fleet.registry.beats.clear()
    assert fleet.reconcile().outcome == "noop"
    assert [b.in_flight for b in fleet.registry.beats] == [4]


def test_without_activation_the_placements_the_host_runs_count(tmp_path: Path) -> None:
    fleet = SpillFleet(tmp_path)
    report = fleet.reconcile(no_activate=True)
    assert report.outcome == "written", report
    before, after = fleet.registry.beats
    assert (before.in_flight, after.in_flight) == (3, 4)  # generation 1 (flac-fft) written between them
    assert after.units == {}


def test_the_heartbeat_carries_the_limits_bounded_by_the_probe_and_the_pass_says_so(tmp_path: Path) -> None:
    fleet = SpillFleet(tmp_path)
    fleet.reconcile()
    record = fleet.registry.beats[-1]
    # x86-spill's host file declares 4/8; the golden x86_64 probe says 2/4.
    assert (record.max_concurrent_tasks, record.max_concurrent_ceiling) == (2, 4)
    assert record.lowered_limits == ["max_concurrent_tasks 4 lowered to 2 by the probe", "max_concurrent_ceiling 8 lowered to 4 by the probe"]
    lowered = [n for n in fleet.notes if n.startswith("limits bounded by the probe")]
    assert lowered == [
        "limits bounded by the probe: max_concurrent_tasks 4 lowered to 2 by the probe; max_concurrent_ceiling 8 lowered to 4 by the probe"
        " (overrides.limits_above_probe = true keeps the declared ones)"
    ]
    # The host file may keep its limits above the probe.
    spill = fleet.desired / "x86-spill.toml"
    spill.write_text(spill.read_text() + "\n[overrides]\nlimits_above_probe = true\n")
    fleet.notes.clear()
    fleet.reconcile()
    record = fleet.registry.beats[-1]
    assert (record.max_concurrent_tasks, record.max_concurrent_ceiling, record.lowered_limits) == (4, 8, [])
    assert not [n for n in fleet.notes if n.startswith("limits bounded")]


def test_a_registry_lost_after_the_first_beat_leaves_a_memo_that_cannot_stand_for_the_pass(tmp_path: Path) -> None:
    fleet = SpillFleet(tmp_path)
    registry = fleet.registry
    original = registry.heartbeat

    def first_beat_only(record: NodeRecord, ttl_s: float | None = None) -> NodeRecord:
        stored = original(record, ttl_s)
        registry.reachable = False
        return stored

    registry.heartbeat = first_beat_only  # type: ignore[method-assign]
    report = fleet.reconcile()
    assert report.outcome == "applied" and report.memo_seed is not None
    assert any(n.startswith("heartbeat after activation: registry unreachable") for n in fleet.notes)
    # No epoch: the next memoized pass, once the registry answers, is a full one.
    assert report.memo_seed.registry_epoch is None


def test_a_drained_hosts_pass_renders_its_ray_worker_closed_and_restarts_only_it(tmp_path: Path) -> None:
    fleet = SpillFleet(tmp_path)
    assert fleet.reconcile().ok
    fleet.machine.forget_calls()
    since = datetime(2026, 11, 30, tzinfo=UTC)
    fleet.registry.states = [NodeState(node_id="x86-spill", status="active", since=since, record=fleet.registry.beats[-1], drained=True)]
    report = fleet.reconcile()
    assert report.ok
    assert [c for c in fleet.machine.calls if c[1]] == [("restart", RAY_WORKER_UNIT)]
    worker = (fleet.root / "etc/systemd/system" / RAY_WORKER_UNIT).read_text()
    assert '"--num-cpus=0" "--num-gpus=0"' in worker and '"--resources={}"' in worker
    assert f"{RAY_WORKER_UNIT}: closed to new Ray tasks (drained): no CPUs, GPUs or tiers offered" in fleet.notes


class BrokerDown(FakeLaneBroker):
    def lane_states(self, queues):  # type: ignore[no-untyped-def]
        from reconciler.ports import LaneBrokerUnavailable

        raise LaneBrokerUnavailable("phaze's broker: connection refused")


def test_a_broker_outage_leaves_the_pass_going_and_the_heartbeat_without_the_lane_jobs(tmp_path: Path) -> None:
    fleet = SpillFleet(tmp_path)
    fleet.lanes = BrokerDown()
    report = fleet.reconcile()
    assert report.outcome == "applied", report  # not fail static: the plan does not depend on the broker
    before, after = fleet.registry.beats
    assert (before.in_flight, after.in_flight) == (0, 1), "the services alone"
    assert any("lane queue unreachable, heartbeat without the lane jobs: phaze's broker: connection refused" in note for note in fleet.notes)
