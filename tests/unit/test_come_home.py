"""Work comes home (issue 32): replicas leave paid hosts once a cheaper host
has had room for a stable window, one at a time per service, make-before-break.

Each leader step is `schedule` over a snapshot whose placements and
`room_since` are the previous plan's (as the registry's snapshot carries
them), at a time the test chooses.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from reconciler.adapters.clock import SystemClock
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState, FleetConfig, HostConfig
from reconciler.core.live.models import FleetPlan, Placement, Snapshot, SnapshotNode
from reconciler.core.live.plan_parts import plan_parts
from reconciler.core.live.records import NodeRecord
from reconciler.core.live.signing import canonical_plan
from reconciler.core.render.plan_part import plan_part
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.leader import LeaderLoop
from tests.support.clock import FakeClock
from tests.support.plan_keys import signed_example_fleet

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
WINDOW = 300  # [flap] window_s, the default

COSTS = {"free-a": "free", "free-b": "free", "owned-c": "owned", "paid-d": "paid", "paid-e": "paid", "edge-z": "owned"}


def desired(replicas: int = 1, cost_order: str = "within_tier") -> DesiredState:
    fleet = FleetConfig.model_validate(
        {
            "fleet": {"domain": "example.test", "leader_candidates": ["owned-c"]},
            "scheduler": {"cost_order": cost_order},
            "services": [
                {
                    "id": "web",
                    "min_tier": "cpu_ffmpeg",
                    "floor": "batch",
                    "replicas": replicas,
                    "port": 8080,
                    "route": {"host": "web.example.test"},
                    "command": {"any": ["/bin/web"]},
                }
            ],
        }
    )
    roles = {"owned-c": ["control"], "edge-z": ["edge"]}
    hosts = {
        name: HostConfig.model_validate({"host": {"name": name, "roles": roles.get(name, ["compute"]), "address": f"100.64.0.{i + 1}", "cost": cost}})
        for i, (name, cost) in enumerate(COSTS.items())
    }
    return DesiredState(fleet=fleet, hosts=hosts)


def node(name: str, *, tier: str = "cpu_ffmpeg", in_flight: int = 0, limit: int = 1, web: str | None = None, **extra) -> SnapshotNode:
    """`web`: the state of the service's unit as the node's heartbeat reports it."""
    units = {"fabric-agent-web.service": web} if web else {}
    return SnapshotNode(node_id=name, tier=tier, in_flight=in_flight, max_concurrent_tasks=limit, cost=COSTS[name], units=units, **extra)


def step(state: DesiredState, at: datetime, nodes: list[SnapshotNode], previous: FleetPlan | None = None, placements=None) -> FleetPlan:
    """One leader step at `at` over `nodes`, from the previous plan."""
    snapshot = Snapshot(
        now=at,
        nodes=nodes,
        placements=list(previous.placements) if previous is not None else list(placements or []),
        room_since=dict(previous.room_since) if previous is not None else {},
    )
    return schedule(snapshot, state)


def where(plan: FleetPlan) -> list[tuple[int, str, str | None]]:
    return [(p.replica, p.node, p.replaces) for p in plan.placements]


ON_PAID = [Placement(service="web", replica=0, node="paid-d", tier="cpu_ffmpeg")]


def test_a_replica_on_a_paid_host_moves_only_after_a_cheaper_host_had_room_for_the_window():
    state = desired()
    nodes = [node("free-a"), node("paid-d", limit=4, web="active")]
    plan = step(state, T0, nodes, placements=ON_PAID)
    assert where(plan) == [(0, "paid-d", None)]
    assert plan.room_since == {"free-a": T0}
    plan = step(state, T0 + timedelta(seconds=WINDOW - 1), nodes, plan)
    assert where(plan) == [(0, "paid-d", None)]
    assert plan.room_since == {"free-a": T0}  # remembered, not restarted
    plan = step(state, T0 + timedelta(seconds=WINDOW), nodes, plan)
    # Make: the new placement is added beside the old one, which stays.
    assert where(plan) == [(0, "paid-d", None), (0, "free-a", "paid-d")]


def test_room_that_comes_and_goes_restarts_the_window_so_nothing_flaps():
    state = desired()
    plan = step(state, T0, [node("free-a"), node("paid-d", limit=4, web="active")], placements=ON_PAID)
    # At T0+200 free-a is busy (other work): its room is forgotten.
    busy = step(state, T0 + timedelta(seconds=200), [node("free-a", in_flight=1), node("paid-d", limit=4, web="active")], plan)
    assert busy.room_since == {}
    later = T0 + timedelta(seconds=WINDOW + 50)
    plan = step(state, later, [node("free-a"), node("paid-d", limit=4, web="active")], busy)
    assert where(plan) == [(0, "paid-d", None)]
    assert plan.room_since == {"free-a": later}


def test_make_before_break_the_old_placement_stays_until_the_new_one_runs_and_the_edge_routes_to_both():
    state = desired()
    moving = FleetPlan(
        epoch=1,
        leader="owned-c",
        created=T0,
        placements=[*ON_PAID, Placement(service="web", replica=0, node="free-a", tier="cpu_ffmpeg", replaces="paid-d")],
        room_since={"free-a": T0 - timedelta(seconds=WINDOW)},
    )
    assert plan_part(state, moving, "edge-z").nodes_of("web") == ("free-a", "paid-d")
    assert plan_part(state, moving, "free-a").services_here == ("web",)
    assert plan_part(state, moving, "paid-d").services_here == ("web",)
    # free-a has not started it yet (or is still starting it): both stay, its slot held.
    for state_of_new in (None, "activating"):
        plan = step(state, T0, [node("free-a", web=state_of_new), node("paid-d", limit=4, web="active")], moving)
        assert where(plan) == [(0, "paid-d", None), (0, "free-a", "paid-d")]
    # It runs: break. The old placement leaves the plan; the edge routes to the new one only.
    plan = step(state, T0, [node("free-a", in_flight=1, web="active"), node("paid-d", limit=4, web="active")], moving)
    assert where(plan) == [(0, "free-a", None)]
    assert plan_part(state, plan, "edge-z").nodes_of("web") == ("free-a",)
    assert plan.room_since == {}  # nothing runs on a paid host any more


def test_a_move_whose_new_unit_failed_is_given_up_and_the_old_placement_stays():
    state = desired()
    moving = FleetPlan(
        epoch=1,
        leader="owned-c",
        created=T0,
        placements=[*ON_PAID, Placement(service="web", replica=0, node="free-a", tier="cpu_ffmpeg", replaces="paid-d")],
        room_since={"free-a": T0 - timedelta(seconds=WINDOW)},
    )
    plan = step(state, T0, [node("free-a", web="failed"), node("paid-d", limit=4, web="active")], moving)
    assert where(plan) == [(0, "paid-d", None)]
    # free-a's room counts again from now: no retry before another window.
    assert plan.room_since == {"free-a": T0}


def test_one_move_at_a_time_per_service():
    state = desired(replicas=2)
    placements = [
        Placement(service="web", replica=0, node="paid-d", tier="cpu_ffmpeg"),
        Placement(service="web", replica=1, node="paid-e", tier="cpu_ffmpeg"),
    ]
    paid = [node("paid-d", limit=4, web="active"), node("paid-e", limit=4, web="active")]
    plan = step(state, T0, [node("free-a"), node("free-b"), *paid], placements=placements)
    assert plan.room_since == {"free-a": T0, "free-b": T0}
    t = T0 + timedelta(seconds=WINDOW)
    plan = step(state, t, [node("free-a"), node("free-b"), *paid], plan)
    assert where(plan) == [(0, "paid-d", None), (0, "free-a", "paid-d"), (1, "paid-e", None)]
    # While that move is under way, the other replica waits, though free-b has room.
    plan = step(state, t + timedelta(seconds=30), [node("free-a", web="activating"), node("free-b"), *paid], plan)
    assert where(plan) == [(0, "paid-d", None), (0, "free-a", "paid-d"), (1, "paid-e", None)]
    # The first move done (its new unit runs), the second starts.
    plan = step(state, t + timedelta(seconds=60), [node("free-a", in_flight=1, web="active"), node("free-b"), *paid], plan)
    assert where(plan) == [(0, "free-a", None), (1, "paid-e", None), (1, "free-b", "paid-e")]


def test_nothing_ping_pongs_work_at_home_stays_and_only_paid_hosts_are_left():
    state = desired()
    home = [Placement(service="web", replica=0, node="owned-c", tier="cpu_ffmpeg")]
    # An idle free host beside an owned host running the replica: owned is not paid, nothing moves.
    plan = step(state, T0, [node("free-a"), node("owned-c", limit=4, web="active"), node("paid-d", limit=4)], placements=home)
    assert plan.room_since == {}
    plan = step(state, T0 + timedelta(seconds=10 * WINDOW), [node("free-a"), node("owned-c", limit=4, web="active"), node("paid-d", limit=4)], plan)
    assert where(plan) == [(0, "owned-c", None)]
    # A replica back home stays there however idle the paid host is.
    back = [Placement(service="web", replica=0, node="free-a", tier="cpu_ffmpeg")]
    plan = step(state, T0, [node("free-a", in_flight=1, web="active"), node("paid-d", limit=8)], placements=back)
    assert where(plan) == [(0, "free-a", None)]


def test_tier_first_a_replica_does_not_come_home_to_a_worse_tier_unless_cost_comes_first():
    nodes = [node("free-a", tier="batch"), node("paid-d", limit=4, web="active")]
    state = desired()
    plan = step(state, T0, nodes, placements=ON_PAID)
    assert plan.room_since == {}  # free-a is no place for it: a fallback tier
    plan = step(state, T0 + timedelta(seconds=2 * WINDOW), nodes, plan)
    assert where(plan) == [(0, "paid-d", None)]
    state = desired(cost_order="before_tier")
    plan = step(state, T0, nodes, placements=ON_PAID)
    plan = step(state, T0 + timedelta(seconds=WINDOW), nodes, plan)
    assert where(plan) == [(0, "paid-d", None), (0, "free-a", "paid-d")]
    assert plan.placements[1].fallback


def test_a_held_off_host_is_no_place_to_come_home_to():
    state = desired()
    held = node("free-a", held_off_until=T0 + timedelta(hours=1))
    plan = step(state, T0, [held, node("paid-d", limit=4, web="active")], placements=ON_PAID)
    plan = step(state, T0 + timedelta(seconds=2 * WINDOW), [held, node("paid-d", limit=4, web="active")], plan)
    assert where(plan) == [(0, "paid-d", None)]
    assert plan.room_since == {}


def test_a_plan_without_moves_signs_as_before_the_come_home_fields():
    """A plan that uses none of the new fields has parts that do not name them
    (the signature covers the parts' digests: the same parts, the same digests
    as before the fields existed); a move puts them in, signed."""
    plan = FleetPlan(epoch=3, leader="owned-c", created=T0, placements=ON_PAID)
    every_part = b"".join(plan_parts(plan).values())
    assert b"room_since" not in every_part and b"replaces" not in every_part
    moving = plan.model_copy(update={"room_since": {"free-a": T0}})
    assert b"room_since" in b"".join(plan_parts(moving).values())
    assert canonical_plan(moving) != canonical_plan(plan)


def test_a_forged_plans_room_memory_starts_no_move(tmp_path: Path):
    """A registry writer who republishes the leader's placements with a
    come-home memory of its own (unsigned) must not make the leader move
    work: the leader schedules from its last verified plan, memory included."""
    fleet = signed_example_fleet(tmp_path / "fleet")
    state = load_desired(fleet.desired)
    registry = SqliteRegistry(tmp_path / "registry.sqlite", timing=state.fleet.timing, flap=state.fleet.flap, clock=SystemClock())
    try:
        registry.heartbeat(NodeRecord(node_id="x86-spill", tier="cpu_ffmpeg", arch="x86_64", max_concurrent_tasks=4, cost="paid"), ttl_s=300)
        leader = LeaderLoop(
            registry=registry,
            host="lux",
            load_desired=lambda: state,
            schedule=schedule,
            lease_ttl_s=30,
            log=lambda _: None,
            signer=fleet.signer("lux"),
        )
        leader.step()
        genuine = registry.newest_plan()
        assert genuine is not None and {p.node for p in genuine.placements} == {"x86-spill"}
        # The free box joins; the forger claims it has had room for an hour.
        registry.heartbeat(NodeRecord(node_id="a1-arm64", tier="cpu_ffmpeg", arch="aarch64", max_concurrent_tasks=2, cost="free"), ttl_s=300)
        assert leader.leadership is not None
        long_ago = datetime.now(UTC) - timedelta(hours=1)
        registry.publish_plan(leader.leadership, genuine.model_copy(update={"room_since": {"a1-arm64": long_ago}, "signature": None}))
        leader.step()
        healed = registry.newest_plan()
        assert healed is not None and healed.signature is not None
        assert [p for p in healed.placements if p.replaces is not None] == []
        assert healed.room_since["a1-arm64"] > long_ago  # counted from the leader's own step
        leader.step_and_resign()
    finally:
        registry.close()


def test_only_the_replica_on_the_paid_host_comes_home_not_the_one_on_an_owned_host():
    state = desired(replicas=2)
    placements = [
        Placement(service="web", replica=0, node="owned-c", tier="cpu_ffmpeg"),
        Placement(service="web", replica=1, node="paid-d", tier="cpu_ffmpeg"),
    ]
    nodes = [node("free-a"), node("free-b"), node("owned-c", limit=4, web="active"), node("paid-d", limit=4, web="active")]
    plan = step(state, T0, nodes, placements=placements)
    assert plan.room_since == {"free-a": T0, "free-b": T0, "owned-c": T0}
    plan = step(state, T0 + timedelta(seconds=WINDOW), nodes, plan)
    assert where(plan) == [(0, "owned-c", None), (1, "paid-d", None), (1, "free-a", "paid-d")]


def test_a_move_never_goes_where_a_sibling_was_just_placed():
    """Found by the property test: replica 1 is placed new on the only free
    host in the same step; replica 0 must not come home on top of it."""
    state = desired(replicas=2)
    nodes = [node("free-a", limit=4), node("paid-d", limit=4, web="active")]
    plan = step(state, T0, nodes, placements=ON_PAID)
    plan = plan.model_copy(update={"placements": ON_PAID, "room_since": {"free-a": T0 - timedelta(seconds=WINDOW)}})
    plan = step(state, T0, nodes, plan)
    assert where(plan) == [(0, "paid-d", None), (1, "free-a", None)]


def test_the_leader_brings_work_home_through_the_registry(tmp_path: Path):
    """The whole rule at the leader, over a real sqlite registry on a hand-moved
    clock: lux (owned) is full, so the services spill to x86-spill (paid);
    lux frees up; after [flap] window_s the leader publishes each service's
    move beside its old placement; once lux's heartbeat shows the units
    active, the old placements leave the plan."""
    fleet = signed_example_fleet(tmp_path / "fleet")
    state = load_desired(fleet.desired)
    clock = FakeClock()
    registry = SqliteRegistry(tmp_path / "registry.sqlite", timing=state.fleet.timing, flap=state.fleet.flap, clock=clock)

    def beat(host: str, **record) -> None:
        base = {"lux": ("cpu_ffmpeg", "owned"), "x86-spill": ("cpu_ffmpeg", "paid")}[host]
        registry.heartbeat(NodeRecord(node_id=host, tier=base[0], arch="x86_64", max_concurrent_tasks=4, cost=base[1], **record), ttl_s=86_400)

    def placements() -> list[tuple[str, int, str, str | None]]:
        plan = registry.newest_plan()
        assert plan is not None
        return [(p.service, p.replica, p.node, p.replaces) for p in plan.placements]

    try:
        leader = LeaderLoop(
            registry=registry,
            host="lux",
            load_desired=lambda: state,
            schedule=schedule,
            lease_ttl_s=30,
            log=lambda _: None,
            signer=fleet.signer("lux"),
        )
        beat("lux", in_flight=4)  # full of work of its own
        beat("x86-spill")
        leader.step()
        spilled = [("braid", 0, "x86-spill", None), ("flac-fft", 0, "x86-spill", None), ("vaapi-encode", 0, "x86-spill", None)]
        assert placements() == spilled
        beat("lux", in_flight=0)  # lux frees up
        leader.step()
        assert placements() == [*spilled[:2], ("flac-fft", 1, "lux", None), spilled[2]]  # new work goes to lux at once
        clock.advance(state.fleet.flap.window_s - 1)
        leader.step()
        assert [p for p in placements() if p[3]] == []  # not yet a stable window
        clock.advance(1)
        leader.step()
        assert placements() == [
            ("braid", 0, "x86-spill", None),
            ("braid", 0, "lux", "x86-spill"),
            ("flac-fft", 0, "x86-spill", None),  # lux runs flac-fft's other replica
            ("flac-fft", 1, "lux", None),
            ("vaapi-encode", 0, "x86-spill", None),
            ("vaapi-encode", 0, "lux", "x86-spill"),
        ]
        # lux started braid, not yet vaapi-encode: only braid's old placement goes.
        beat("lux", in_flight=2, services_running=2, units={"fabric-agent-braid.service": "active", "fabric-agent-flac-fft.service": "active"})
        leader.step()
        assert placements() == [
            ("braid", 0, "lux", None),
            ("flac-fft", 0, "x86-spill", None),
            ("flac-fft", 1, "lux", None),
            ("vaapi-encode", 0, "x86-spill", None),
            ("vaapi-encode", 0, "lux", "x86-spill"),
        ]
        leader.step_and_resign()
    finally:
        registry.close()


def test_a_replica_placed_new_never_goes_where_a_sibling_is_moving_to():
    """Replica 0 is moving from paid-d to free-a (make-before-break, not
    running there yet): replica 1, new, must not be placed on free-a too,
    though free-a has room (the service's nodes count the move's new node)."""
    state = desired(replicas=2)
    moving = FleetPlan(
        epoch=1,
        leader="owned-c",
        created=T0,
        placements=[*ON_PAID, Placement(service="web", replica=0, node="free-a", tier="cpu_ffmpeg", replaces="paid-d")],
        room_since={"free-a": T0 - timedelta(seconds=WINDOW)},
    )
    # free-b is busier than free-a: only the rule sends replica 1 there.
    plan = step(state, T0, [node("free-a", limit=4), node("paid-d", limit=4, web="active"), node("free-b", limit=4, in_flight=3)], moving)
    assert sorted(where(plan)) == [(0, "free-a", "paid-d"), (0, "paid-d", None), (1, "free-b", None)]
