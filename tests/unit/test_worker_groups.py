"""Worker groups (reconciler.core.scheduling.groups): admission of a hook's
workers as ephemeral members, their group's settings, and deactivation when
the queue stays empty; with the desired state's rules for groups."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from reconciler.core.desired.load import DesiredStateError, load_desired
from reconciler.core.desired.model import CloudHook, HostFacts, ScalingSettings, Service, WorkerGroup
from reconciler.core.live.members import MemberRecord
from reconciler.core.live.models import Deferred, FleetPlan, Snapshot
from reconciler.core.live.records import LeaderInfo, Leadership, ScalingRecord
from reconciler.core.render.hook_unit import HookRun, HookUnit
from reconciler.core.scheduling.groups import admit_members, decide_groups, with_members
from reconciler.core.scheduling.placement import schedule
from reconciler.core.scheduling.scaling import ScalingState, decide_scaling
from reconciler.engine.reconcile import run_pass
from reconciler.engine.scaling_step import ScalingStep
from tests.support.scaling import node

EXAMPLE = Path(__file__).resolve().parents[2] / "hosts"
T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
BATCH = WorkerGroup(tier="batch", max_members=2, labels={"topology.researchstack.io/pool": "batch"}, max_concurrent_tasks=3, idle_window_s=60)
GROUPS = {"batch": BATCH}


def member(
    name: str, group: str = "batch", *, joined_s: float = 0, tier: str = "gpu_cuda", address: str | None = "100.64.250.40", **kw
) -> MemberRecord:
    facts = HostFacts.model_validate(
        {"node_id": name, "k3s_hostname": name, "hardware": {"arch": "x86_64", "cpu_cores": 4, "memory_mib": 8192}, "tier": tier}
    )
    at = T0 + timedelta(seconds=joined_s)
    return MemberRecord(node_id=name, group=group, address=address, facts=facts, first_seen=at, reported_at=at, timeout_s=90, **kw)


def admit(records, *, deactivated=(), hosts=("lux",), now=T0 + timedelta(seconds=10)):
    return admit_members(records, GROUPS, set(hosts), deactivated, now)


# --------------------------------------------------------------------------
# Admission


def test_a_member_of_a_declared_group_is_admitted():
    admission = admit([member("gh-1")])
    assert [m.node_id for m in admission.admitted] == ["gh-1"]
    assert admission.refused == ()


def test_a_member_of_an_undeclared_group_is_refused():
    admission = admit([member("gh-1", group="rogue")])
    assert admission.admitted == ()
    assert [(r.node_id, r.group) for r in admission.refused] == [("gh-1", "rogue")]
    assert "not declared in fabric.toml" in admission.refused[0].reason


def test_the_group_caps_its_members_earliest_joined_first():
    admission = admit([member("gh-c", joined_s=3), member("gh-a", joined_s=5), member("gh-b", joined_s=1)])
    assert [m.node_id for m in admission.admitted] == ["gh-b", "gh-c"]
    assert [(r.node_id, r.reason) for r in admission.refused] == [("gh-a", "group 'batch' already has its max_members 2")]


def test_a_member_never_takes_a_declared_hosts_name():
    admission = admit([member("lux")])
    assert admission.admitted == ()
    assert "declared host's name" in admission.refused[0].reason


def test_a_deactivated_groups_members_are_refused():
    admission = admit([member("gh-1")], deactivated=["batch"])
    assert admission.admitted == ()
    assert "deactivated" in admission.refused[0].reason


def test_an_expired_member_is_gone():
    assert admit([member("gh-1")], now=T0 + timedelta(seconds=91)) == admit([])


def test_a_member_without_an_address_is_refused():
    assert "no address" in admit([member("gh-1", address=None)]).refused[0].reason


def test_a_member_has_the_groups_tier_never_its_own():
    """It says gpu_cuda; the group says batch: the scheduler sees batch, the
    group's labels, limit and cost."""
    admission = admit([member("gh-1", tier="gpu_cuda")])
    snapshot, desired = with_members(Snapshot(now=T0, nodes=[node("lux")]), _desired(), admission)
    joined = next(n for n in snapshot.nodes if n.node_id == "gh-1")
    assert (joined.tier, joined.max_concurrent_tasks, joined.cost, joined.labels) == ("batch", 3, "paid", dict(BATCH.labels))
    host = desired.hosts["gh-1"]
    assert (host.host.address, host.labels, host.limits.max_concurrent_tasks) == ("100.64.250.40", dict(BATCH.labels), 3)


def test_a_member_takes_work_by_the_usual_rules():
    """A service that needs the group's label is deferred without a member and
    placed on the member once it is admitted."""
    desired = _desired(service_labels=dict(BATCH.labels))
    empty = schedule(Snapshot(now=T0, nodes=[node("lux", tier="gpu_vaapi", in_flight=0)]), desired)
    assert [d.service for d in empty.deferred] == ["crunch"]
    snapshot, planned = with_members(Snapshot(now=T0, nodes=[node("lux", tier="gpu_vaapi", in_flight=0)]), desired, admit([member("gh-1")]))
    plan = schedule(snapshot, planned)
    assert [(p.service, p.node, p.tier) for p in plan.placements] == [("crunch", "gh-1", "batch")]


def test_work_only_a_groups_members_could_take_waits_for_them_and_counts_in_the_queue():
    """No node has the group's label: without the group that is inadmissible
    (no burst would help); with the group declared it waits for its members."""
    from reconciler.engine.scaling_step import queue_depth

    lux = Snapshot(now=T0, nodes=[node("lux", tier="gpu_vaapi", in_flight=0)])
    plan = schedule(lux, _desired(service_labels=dict(BATCH.labels)))
    [waiting] = plan.deferred
    assert not waiting.inadmissible and waiting.reason.startswith("waits for a member of worker group batch (inadmissible: no node")
    assert queue_depth([], plan) == 1
    no_group = _desired(service_labels=dict(BATCH.labels))
    no_group = no_group.model_copy(update={"fleet": no_group.fleet.model_copy(update={"groups": {}})})
    [never] = schedule(lux, no_group).deferred
    assert never.inadmissible and queue_depth([], schedule(lux, no_group)) == 0
    other = _desired(service_labels={"topology.researchstack.io/pool": "elsewhere"})
    assert schedule(lux, other).deferred[0].inadmissible, "a group whose labels do not fit is no capacity for it"


def _desired(service_labels=None):
    """The example fleet with GROUPS, and one service `crunch` of tier batch
    that needs `service_labels` (given)."""
    desired = load_desired(EXAMPLE)
    services = list(desired.fleet.services)
    if service_labels is not None:
        crunch = Service.model_validate(
            {"id": "crunch", "min_tier": "batch", "floor": "batch", "labels": service_labels, "command": {"any": ["/opt/crunch"]}}
        )
        services = [crunch]
    return desired.model_copy(update={"fleet": desired.fleet.model_copy(update={"groups": GROUPS, "services": services})})


def _with_hook_group(group: str, extra: str = "") -> str:
    text = (EXAMPLE / "fabric.toml").read_text()
    assert 'group = "batch"' in text
    return text.replace('group = "batch"', f"group = {group!r}") + extra


# --------------------------------------------------------------------------
# Deactivation


def _decide(seconds, *, members=1, depth=0, state=None, activated=()):
    empty_since, deactivated = state if state is not None else ({}, ())
    decision = decide_groups(GROUPS, {"batch": members}, depth, empty_since, deactivated, activated, T0 + timedelta(seconds=seconds))
    return decision, (decision.empty_since, decision.deactivated)


def test_a_group_is_deactivated_when_the_queue_stays_empty_for_its_window():
    decision, state = _decide(0)
    assert decision.deactivate == ()
    decision, state = _decide(59, state=state)
    assert decision.deactivate == ()
    decision, state = _decide(60, state=state)
    assert [g for g, _ in decision.deactivate] == ["batch"]
    assert "queue empty and its 1 member(s) idle for 60s" in decision.deactivate[0][1]
    assert state[1] == ("batch",)
    decision, state = _decide(120, state=state)
    assert decision.deactivate == ()  # once
    assert state[1] == ("batch",)


def test_work_in_the_queue_restarts_the_window():
    _, state = _decide(0)
    _, state = _decide(50, state=state, depth=1)
    decision, state = _decide(100, state=state)
    assert decision.deactivate == ()
    decision, _ = _decide(160, state=state)
    assert [g for g, _ in decision.deactivate] == ["batch"]


def test_a_group_without_members_is_not_deactivated():
    _, state = _decide(0, members=0)
    decision, _ = _decide(600, members=0, state=state)
    assert decision.deactivate == ()


def test_a_run_of_the_groups_hook_activates_it_again():
    decision, _ = _decide(0, state=({}, ("batch",)), activated=("batch",))
    assert decision.deactivated == ()


def test_decide_scaling_runs_the_groups_hook_and_deactivates_the_group_later():
    """The whole burst in the pure rules: a queue over the mark for the window
    runs the batch hook (naming the group), the member's queue empties, and
    the group is deactivated an idle window later; the hook activates it again."""
    settings = ScalingSettings(
        queue_high=1, burst_window_s=5, cloud_hooks={"batch": {"command": ["gh", "workflow", "run", "x.yml"], "group": "batch"}}
    )
    state = ScalingState()
    fleet = [node("lux", in_flight=1)]

    def step(seconds, depth, members):
        nonlocal state
        snap = Snapshot(now=T0 + timedelta(seconds=seconds), nodes=fleet)
        decision = decide_scaling(snap, depth, settings, state, groups=GROUPS, members=members, lane_hosts=set())
        state = decision.state
        return [(a.kind, a.group) for a in decision.actions]

    assert step(0, 3, {}) == []
    assert step(5, 3, {}) == [("run_cloud_hook", "batch")]
    assert step(10, 0, {"batch": ["gh-1"]}) == []
    assert step(69, 0, {"batch": ["gh-1"]}) == []
    assert step(70, 0, {"batch": ["gh-1"]}) == [("deactivate_group", "batch")]
    assert state.deactivated_groups == ["batch"]
    assert step(200, 3, {}) == []
    assert step(205, 3, {}) == [("run_cloud_hook", "batch")]
    assert state.deactivated_groups == []


def test_members_are_not_scaled_down_as_nodes():
    settings = ScalingSettings(scale_down_window_s=1)
    state = ScalingState()
    nodes = [node("gh-1", in_flight=0)]
    for seconds in (0, 10):
        decision = decide_scaling(
            Snapshot(now=T0, nodes=nodes), 0, settings, state, T0 + timedelta(seconds=seconds), groups=GROUPS, members={"batch": ["gh-1"]}
        )
        state = decision.state
        assert decision.actions == []


# --------------------------------------------------------------------------
# The desired state's rules


@pytest.mark.parametrize(
    ("hook_group", "reason"),
    [("nope", "'nope' is not a declared group"), ("cuda", "group 'cuda' has tier 'gpu_cuda', not this hook's 'batch'")],
)
def test_a_hook_names_a_declared_group_of_its_tier(hook_group, reason):
    text = _with_hook_group(hook_group, '\n[groups.cuda]\ntier = "gpu_cuda"\n')
    with pytest.raises(DesiredStateError) as caught:
        load_desired(EXAMPLE, overlay={EXAMPLE / "fabric.toml": text})
    assert f"scaling.cloud_hooks.batch.group: {reason}" in str(caught.value)


def test_the_examples_batch_hook_is_a_real_workflow_dispatch_whose_workers_join_its_group():
    desired = load_desired(EXAMPLE)
    hook = desired.fleet.scaling.cloud_hooks["batch"]
    argv = hook.command
    assert argv[0] == "sh" and "exec gh" in argv[2]  # by PATH name, on every candidate
    assert argv[4:] == ["workflow", "run", "adaptive-compute.yml", "-R", "owner/repo", "--ref", "main", "-f", "tier=batch"]
    assert hook.credentials == {"GH_TOKEN": "/run/secrets/gh-token"}  # a file, handed over as a credential
    assert hook.group == "batch" and desired.fleet.groups["batch"].tier == "batch"


def test_each_group_has_an_etcd_identity_that_writes_only_its_members():
    from reconciler.core.desired.registry_access import group_role, registry_access

    access = registry_access(_desired())
    grants = {g.describe() for g in access.roles[group_role("batch")]}
    assert grants == {"read /fabric/* (prefix)", "readwrite /fabric/members/batch/* (prefix)"}
    assert access.users["fabric-group-batch"] == frozenset({"fabric-group-batch"})


# --------------------------------------------------------------------------
# The leader's scaling step: the timeline shows each step of a burst


class _Store:
    """The registry's scaling record, as the leader writes it."""

    def __init__(self) -> None:
        self.record = ScalingRecord()

    def scaling_record(self) -> ScalingRecord:
        return self.record

    def store_scaling(self, leadership: Leadership, record: ScalingRecord) -> None:
        self.record = record


class _Hooks:
    def __init__(self) -> None:
        self.ran: list[str] = []

    def run(self, unit: HookUnit) -> HookRun:
        self.ran.append(unit.unit)
        return HookRun(unit.unit, "ok", returncode=0)


def test_the_timeline_shows_the_burst_the_join_and_the_deactivation():
    stop = {"command": ["/usr/bin/true"]}
    group = BATCH.model_copy(update={"stop_hook": CloudHook.model_validate(stop)})
    desired = _desired()
    scaling = desired.fleet.scaling.model_copy(
        update={
            "queue_high": 1,
            "burst_window_s": 5,
            "cloud_hooks": {"batch": CloudHook.model_validate({"command": ["/usr/bin/true"], "group": "batch"})},
        }
    )
    desired = desired.model_copy(update={"fleet": desired.fleet.model_copy(update={"groups": {"batch": group}, "scaling": scaling})})
    store, hooks = _Store(), _Hooks()
    step = ScalingStep(registry=store, hooks=hooks, log=lambda line: None)  # type: ignore[arg-type]
    leadership = Leadership(info=LeaderInfo(candidate="lux", epoch=1, since=T0, token="t", term=1), ttl_s=30)
    queued = FleetPlan(
        epoch=1, leader="lux", created=T0, deferred=[Deferred(service="crunch", replica=i, reason="no node with the labels") for i in range(2)]
    )
    idle = FleetPlan(epoch=1, leader="lux", created=T0)
    lux = [node("lux", in_flight=1)]

    def at(seconds, plan, records=()):
        now = T0 + timedelta(seconds=seconds)
        admission = admit_members(
            list(records), desired.fleet.groups, set(desired.hosts), ScalingState.model_validate(store.record.state).deactivated_groups, now
        )
        snapshot, planned = with_members(Snapshot(now=now, nodes=lux), desired, admission)
        step.run(leadership, planned, snapshot, plan, admission)

    at(0, queued)
    at(5, queued)  # the burst: the batch hook runs
    at(10, idle, [member("gh-1", joined_s=8)])  # the member joined and its work was placed
    at(70, idle, [member("gh-1", joined_s=69)])  # the queue stayed empty for the idle window
    at(75, idle, [member("gh-1", joined_s=74)])  # refused from now on
    timeline = [(e.kind, e.node or e.tier) for e in store.record.recent]
    assert timeline == [
        ("run_cloud_hook", "batch"),
        ("member_joined", "gh-1"),
        ("deactivate_group", "batch"),
        ("run_stop_hook", "batch"),
        ("member_left", "gh-1"),
        ("member_refused", "gh-1"),
    ]
    assert [u.split("-2026")[0] for u in hooks.ran] == ["fabric-hook-batch", "fabric-hook-batch-stop"]
    assert "batch-stop" in store.record.hooks


# --------------------------------------------------------------------------
# A member's pass (engine.member): the group's settings as its host file, its beat a member report

CRUNCH = """
[[services]]
id = "crunch"
min_tier = "batch"
floor = "batch"
port = 8790
labels = { "topology.researchstack.io/pool" = "batch" }
command = { any = ["/opt/researchstack/bin/crunch", "--port", "8790"] }
"""


class _Kept:
    """The registry, its close left to the test."""

    def __init__(self, registry) -> None:
        self._registry = registry

    def close(self) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._registry, name)


def test_a_member_pass_reports_under_its_group_and_runs_what_the_plan_places_on_it(tmp_path):
    from reconciler.adapters.registry_sqlite import SqliteRegistry
    from reconciler.engine.leader import LeaderLoop
    from reconciler.engine.pass_options import PlanFromRegistry
    from tests.support.clock import T_PASS, FakeClock
    from tests.support.fleet import Fleet
    from tests.support.plan_keys import signed_example_fleet

    signed = signed_example_fleet(tmp_path / "signed")
    (signed.desired / "fabric.toml").write_text((signed.desired / "fabric.toml").read_text() + CRUNCH)
    (tmp_path / "member").mkdir()
    fleet = Fleet(tmp_path / "member", host="gh-1")
    for path in signed.desired.glob("*.toml"):
        (fleet.desired / path.name).write_text(path.read_text())
    desired = load_desired(fleet.desired)
    registry = SqliteRegistry(tmp_path / "registry.sqlite", timing=desired.fleet.timing, flap=desired.fleet.flap, clock=FakeClock(T_PASS))
    try:
        ports = fleet.ports()
        ports.open_registry = lambda fleet_config: _Kept(registry)
        options = fleet.options(plan=PlanFromRegistry(), member_of="batch", member_address="100.64.250.40")
        first = run_pass(options, ports)
        assert first.outcome == "applied", first.stderr
        [record] = registry.group_members()[0]
        assert (record.node_id, record.group, record.address) == ("gh-1", "batch", "100.64.250.40")
        assert "gh-1" not in {n.node_id for n in registry.snapshot().nodes}, "its beat is a member report, never a node's"

        leader = LeaderLoop(registry, "lux", lambda: desired, schedule, lease_ttl_s=30, log=lambda m: None, signer=signed.signer("lux"))
        leader.step()
        assert [(p.node, p.tier) for p in registry.newest_plan().placements if p.service == "crunch"] == [("gh-1", "batch")]

        second = run_pass(options, ports)
        assert second.outcome == "applied", second.stderr
        unit = (fleet.root / "etc/systemd/system/fabric-agent-crunch.service").read_text()
        assert "/opt/researchstack/bin/crunch" in unit
        assert "fabric-agent-crunch.service" in second.stdout
        [record] = registry.group_members()[0]
        assert record.in_flight >= 1, "its beat after activation counts what it runs"
    finally:
        registry.close()


def test_a_member_pass_of_an_undeclared_group_is_bad_input_and_reports_nothing(tmp_path):
    from reconciler.engine.pass_options import PlanFromRegistry
    from tests.support.fleet import Fleet

    fleet = Fleet(tmp_path, host="gh-1")
    ports = fleet.ports()

    def no_registry(fleet_config):
        raise AssertionError("nothing is reported for an undeclared group")

    ports.open_registry = no_registry
    report = run_pass(fleet.options(plan=PlanFromRegistry(), member_of="rogue", member_address="100.64.250.40"), ports)
    assert report.outcome == "bad-input"
    assert "'rogue' is not a declared group (declared: batch)" in report.stderr[0]


def test_a_group_whose_members_still_run_work_is_not_deactivated():
    """The queue is empty because the members took the work: the window waits until they are idle."""
    busy = {"batch": 2}
    empty, off = {}, ()
    for seconds in (0, 60, 600):
        decision = decide_groups(GROUPS, {"batch": 1}, 0, empty, off, (), T0 + timedelta(seconds=seconds), busy=busy)
        empty, off = decision.empty_since, decision.deactivated
        assert decision.deactivate == ()
    decision = decide_groups(GROUPS, {"batch": 1}, 0, empty, off, (), T0 + timedelta(seconds=601), busy={"batch": 0})
    decision = decide_groups(GROUPS, {"batch": 1}, 0, decision.empty_since, (), (), T0 + timedelta(seconds=661), busy={"batch": 0})
    assert [g for g, _ in decision.deactivate] == ["batch"]


def test_work_waiting_for_a_group_runs_its_hook_even_beside_idle_capacity():
    """An idle lane host cannot take work that needs the group's label: the
    group's hook runs beside the activation, once per interval."""
    settings = ScalingSettings(
        queue_high=1, burst_window_s=5, cloud_hooks={"batch": {"command": ["gh", "workflow", "run", "x.yml"], "group": "batch"}}
    )
    state = ScalingState()
    fleet = [node("a1-arm64", in_flight=0)]

    def step(seconds, waiting):
        nonlocal state
        snap = Snapshot(now=T0 + timedelta(seconds=seconds), nodes=fleet)
        decision = decide_scaling(snap, 2, settings, state, lane_hosts={"a1-arm64"}, groups=GROUPS, waiting_groups=waiting)
        state = decision.state
        return [(a.kind, a.node or a.group) for a in decision.actions]

    assert step(0, {"batch"}) == []
    assert step(5, {"batch"}) == [("activate_idle", "a1-arm64"), ("run_cloud_hook", "batch")]
    assert step(10, {"batch"}) == [("hold", None)]
    state = ScalingState()
    step(0, set())
    assert step(5, set()) == [("activate_idle", "a1-arm64")], "work any node could take: idle capacity first, as before"
