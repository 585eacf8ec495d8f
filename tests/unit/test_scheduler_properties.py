"""Property tests of node placement (hypothesis), over random fleets.

- The indexed placer makes exactly the decision of the naive reference that
  scans every node (bench/scheduler/reference.py), so its heaps implement the
  rules and not something close to them.
- A deferral's reason is the one a fresh scan gives over the loads of that
  moment (`explain_deferral`, and the naive scan of every node in
  bench/scheduler/reference.py), however placements, keeps and deferrals interleave.
- No node is ever given work past its max_concurrent_tasks.
- A placement is never below its floor, and `fallback` says exactly whether
  it is below min_tier.
- A whole plan accounts for every replica once, and kept placements plus new
  ones respect every node's limit.
- Services placed on a host plus the lane jobs of its lanes (running, and
  started by the dispatcher over the plan's lane view) never exceed its limit.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from reconciler.core.desired.model import TIER_ORDER, TIER_SCORE, DesiredState, FleetConfig, HostConfig, Lane, SchedulerSettings
from reconciler.core.live.models import Placement, Snapshot, SnapshotLane, SnapshotNode
from reconciler.core.scheduling.lanes import LaneJob, choose_lane, lane_host, take_slot
from reconciler.core.scheduling.placement import Choice, NoChoice, Placer, Request, accepts_new_work, explain_deferral, schedule

_REFERENCE = Path(__file__).resolve().parents[2] / "bench" / "scheduler" / "reference.py"
_spec = importlib.util.spec_from_file_location("scheduler_reference", _REFERENCE)
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
NAMES = [f"n{i}" for i in range(12)]
SETTINGS_LANES = SchedulerSettings(local_spill_after_s=900, cloud_attempts=3)
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Few tiers per fleet make ties and fallbacks between them common.
tiers = st.sampled_from(["gpu_cuda", "gpu_vaapi", "gpu_apu", "cpu_ffmpeg", "batch", "relay"])
costs = st.sampled_from(["free", "owned", "paid"])


@st.composite
def nodes_strategy(draw, min_size=0):
    names = draw(st.lists(st.sampled_from(NAMES), min_size=min_size, max_size=10, unique=True))
    out = []
    for name in names:
        out.append(
            SnapshotNode(
                node_id=name,
                tier=draw(tiers),
                # Mostly usable nodes, so decisions have several candidates.
                status=draw(st.sampled_from(["active"] * 6 + ["offline", "draining", "dead"])),
                drained=draw(st.integers(0, 4)) == 0,
                held_off_until=draw(st.sampled_from([None] * 4 + [NOW - timedelta(seconds=5), NOW + timedelta(seconds=5)])),
                in_flight=draw(st.integers(0, 3)),
                max_concurrent_tasks=draw(st.integers(0, 6)),
                arch=draw(st.sampled_from(["x86_64", "x86_64", "aarch64", None])),
                labels=draw(st.sampled_from([{}, {"zone": "a"}, {"zone": "b"}, {"zone": "a", "gpu": "yes"}])),
                cost=draw(costs),
            )
        )
    return out


@st.composite
def requests_strategy(draw):
    top = draw(st.integers(0, 4))
    bottom = draw(st.integers(top, len(TIER_ORDER) - 1))
    return Request(
        min_tier=TIER_ORDER[top],
        floor=TIER_ORDER[bottom],
        arch=frozenset(draw(st.sets(st.sampled_from(["x86_64", "aarch64"]), max_size=1))),
        labels=draw(st.sampled_from([(), (), (("zone", "a"),), (("gpu", "yes"),)])),
        cost_first=draw(st.booleans()),
    )


strategies = st.sampled_from(["highest_tier", "best_fit"])


@FAST
@given(
    nodes=nodes_strategy(),
    work=st.lists(st.tuples(requests_strategy(), st.sets(st.sampled_from(NAMES), max_size=3)), min_size=1, max_size=25),
    strategy=strategies,
)
def test_indexed_placer_decides_exactly_like_the_full_scan(nodes, work, strategy):
    fast = Placer(nodes, NOW, strategy)
    naive = reference.ScanningPlacer(nodes, NOW, strategy)
    for request, avoid in work:
        outcome = fast.place(request, avoid)
        expected = naive.place(request, avoid)
        got = (outcome.node, outcome.tier, outcome.fallback) if isinstance(outcome, Choice) else None
        assert got == expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=nodes_strategy(),
    shapes=st.lists(requests_strategy(), min_size=1, max_size=3),
    work=st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 2), st.sets(st.sampled_from(NAMES[:6]), max_size=2), st.sampled_from(NAMES[:6])),
        min_size=1,
        max_size=40,
    ),
    strategy=strategies,
)
def test_a_deferral_says_what_a_fresh_scan_says(nodes, shapes, work, strategy):
    """Few shapes, so the same one is deferred again after placements, keeps
    and other exclusions (what the deferral cache must get right)."""
    placer = Placer(nodes, NOW, strategy)
    for action, shape, exclude, kept_on in work:
        request = shapes[shape % len(shapes)]
        if action == 0:
            placer.keep(kept_on, request)
            continue
        outcome = placer.place(request, exclude=exclude)
        if isinstance(outcome, NoChoice):
            assert outcome == explain_deferral(request, nodes, placer.load, NOW, frozenset(exclude))
            # The scan once per request shape says what a scan of every node at every deferral says.
            assert (outcome.reason, outcome.inadmissible) == reference.explain_deferral(request, nodes, placer.load, NOW, frozenset(exclude))


@FAST
@given(nodes=nodes_strategy(), work=st.lists(requests_strategy(), min_size=1, max_size=40), strategy=strategies)
def test_no_node_over_its_limit_and_never_below_the_floor(nodes, work, strategy):
    placer = Placer(nodes, NOW, strategy)
    by_id = {n.node_id: n for n in nodes}
    given_work = Counter()
    for request in work:
        outcome = placer.place(request)
        if isinstance(outcome, NoChoice):
            assert outcome.reason
            continue
        chosen = by_id[outcome.node]
        given_work[chosen.node_id] += 1
        assert accepts_new_work(chosen, NOW)
        assert request.matches(chosen)
        assert chosen.tier == outcome.tier
        assert TIER_SCORE[outcome.tier] >= TIER_SCORE[request.floor]
        assert outcome.fallback == (TIER_SCORE[outcome.tier] < TIER_SCORE[request.min_tier])
    for node_id, count in given_work.items():
        assert by_id[node_id].in_flight + count <= by_id[node_id].max_concurrent_tasks


def _desired(services, hosts) -> DesiredState:
    fleet = FleetConfig.model_validate({"fleet": {"domain": "example.test", "leader_candidates": [hosts[0]]}, "services": services})
    return DesiredState(
        fleet=fleet,
        hosts={
            h: HostConfig.model_validate({"host": {"name": h, "roles": ["control"], "address": f"10.250.1.{i + 1}"}}) for i, h in enumerate(hosts)
        },
    )


@st.composite
def services_strategy(draw):
    count = draw(st.integers(1, 4))
    out = []
    for i in range(count):
        top = draw(st.integers(0, len(TIER_ORDER) - 1))
        bottom = draw(st.integers(top, len(TIER_ORDER) - 1))
        out.append(
            {
                "id": f"svc{i}",
                "min_tier": TIER_ORDER[top],
                "floor": TIER_ORDER[bottom],
                "replicas": draw(st.integers(1, 4)),
                "command": {"any": ["/bin/true"]},
            }
        )
    return out


@FAST
@given(
    nodes=nodes_strategy(min_size=1),
    services=services_strategy(),
    existing=st.lists(st.tuples(st.sampled_from([f"svc{i}" for i in range(5)]), st.integers(0, 4), st.sampled_from(NAMES)), max_size=8),
)
def test_plans_respect_limits_and_floors_and_account_for_every_replica(nodes, services, existing):
    state = _desired(services, NAMES)
    old = [Placement(service=s, replica=r, node=n, tier="relay") for s, r, n in existing]
    plan = schedule(Snapshot(now=NOW, nodes=nodes, placements=old), state)
    by_id = {n.node_id: n for n in nodes}
    floors = {s["id"]: s["floor"] for s in services}

    slots = [(p.service, p.replica) for p in plan.placements] + [(d.service, d.replica) for d in plan.deferred]
    assert sorted(slots) == sorted((s["id"], r) for s in services for r in range(s["replicas"]))

    old_keys = {(p.service, p.replica, p.node) for p in old}
    kept_on = Counter()
    new_on = Counter()
    for p in plan.placements:
        assert TIER_SCORE[p.tier] >= TIER_SCORE[floors[p.service]]
        assert p.tier == by_id[p.node].tier
        (kept_on if (p.service, p.replica, p.node) in old_keys else new_on)[p.node] += 1
    for node_id in set(kept_on) | set(new_on):
        limit = by_id[node_id].max_concurrent_tasks
        assert kept_on[node_id] <= limit
        if new_on[node_id]:
            assert max(by_id[node_id].in_flight, kept_on[node_id]) + new_on[node_id] <= limit


# --------------------------------------------------------------------------
# One account of capacity: services placed + lane jobs on a host


@st.composite
def lanes_strategy(draw):
    """Compute lanes pushed to random hosts and the local lane (on n0, the
    first control host of `_desired`), each with the jobs running on it."""
    lanes, running = [], {}
    for i in range(draw(st.integers(0, 3))):
        cap = draw(st.integers(1, 4))
        lane_id = f"lane{i}"
        lanes.append(
            {
                "kind": "compute",
                "id": lane_id,
                "rank": draw(st.sampled_from([10, 20])),
                "cap": cap,
                "agent_ref": lane_id,
                "push_host": draw(st.sampled_from(NAMES[:4])),
                "scratch_dir": "/var/lib/scratch",
                "ssh_user": "phaze",
            }
        )
        running[lane_id] = draw(st.integers(0, cap))
    cap = draw(st.integers(1, 2))
    lanes.append({"kind": "local", "id": "local", "rank": 99, "cap": cap})
    running["local"] = draw(st.integers(0, cap))
    return lanes, running


@st.composite
def lane_hosts_strategy(draw):
    """Nodes for most of the hosts lanes are pushed to (n0..n3) and a few
    others: every lane host that is present is a place where services and lane
    jobs meet."""
    return [node for node in draw(nodes_strategy(min_size=1)) if node.node_id not in NAMES[:4]] + [
        SnapshotNode(
            node_id=name,
            tier=draw(tiers),
            status=draw(st.sampled_from(["active"] * 8 + ["offline", "draining"])),
            held_off_until=draw(st.sampled_from([None] * 6 + [NOW + timedelta(seconds=5)])),
            in_flight=draw(st.integers(0, 3)),
            max_concurrent_tasks=draw(st.integers(0, 6)),
        )
        for name in NAMES[:4]
        if draw(st.integers(0, 5))
    ]


@FAST
@given(
    nodes=lane_hosts_strategy(),
    services=services_strategy(),
    lanes=lanes_strategy(),
    # Placements in force on the hosts lanes are pushed to, so kept work meets lane jobs.
    existing=st.lists(st.tuples(st.sampled_from([f"svc{i}" for i in range(4)]), st.integers(0, 1), st.sampled_from(NAMES[:4])), max_size=8),
    waited=st.sampled_from([0, 5000]),
)
# A host whose reported in_flight (2) is above its services (1) and lane jobs
# (0): the first lane job is absorbed by that slack, so its lane takes two
# jobs within the limit of 3 (take_slot once spent the host's room on it).
@example(
    nodes=[SnapshotNode(node_id="n2", tier="gpu_cuda", status="active", in_flight=2, max_concurrent_tasks=3)],
    services=[{"id": "svc0", "min_tier": "gpu_cuda", "floor": "gpu_cuda", "replicas": 1, "command": {"any": ["/bin/true"]}}],
    lanes=(
        [
            {
                "kind": "compute",
                "id": "lane0",
                "rank": 10,
                "cap": 2,
                "agent_ref": "lane0",
                "push_host": "n2",
                "scratch_dir": "/var/lib/scratch",
                "ssh_user": "phaze",
            },
            {"kind": "local", "id": "local", "rank": 99, "cap": 1},
        ],
        {"lane0": 0, "local": 0},
    ),
    existing=[],
    waited=0,
)
def test_services_and_lane_jobs_on_a_host_never_exceed_its_limit(nodes, services, lanes, existing, waited):
    """The scheduler places services beside the lane jobs running, then the
    dispatcher starts jobs until it holds: on every host whose running lane
    jobs alone fit its limit, services placed + lane jobs <= the limit; and
    a node's reported in_flight (which counts its lane jobs) is never added
    to them, so a host is never refused work it has room for by that count."""
    declared, running = lanes
    state = _desired(services, NAMES)
    state = state.model_copy(update={"fleet": state.fleet.model_copy(update={"lanes": [Lane.model_validate(b) for b in declared]})})
    old = [Placement(service=s, replica=r, node=n, tier="relay") for s, r, n in existing]
    snap = Snapshot(now=NOW, nodes=nodes, placements=old, lanes=[SnapshotLane(id=k, in_flight=v) for k, v in running.items()])
    plan = schedule(snap, state)
    by_id = {n.node_id: n for n in nodes}
    host_of = {lane.id: lane_host(state, lane) for lane in state.lanes}

    def lane_jobs(jobs: dict[str, int]) -> Counter:
        out: Counter = Counter()
        for lane_id, count in jobs.items():
            out[host_of[lane_id]] += count
        return out

    placed = Counter(p.node for p in plan.placements)
    before = lane_jobs(running)
    for node_id, count in placed.items():
        if before[node_id] <= by_id[node_id].max_concurrent_tasks:
            assert count + before[node_id] <= by_id[node_id].max_concurrent_tasks

    # The dispatcher over the plan's lane view: start jobs until it holds.
    views = plan.lanes
    after = dict(running)
    for _ in range(20):
        decision = choose_lane(views, LaneJob(waited_s=waited), SETTINGS_LANES)
        if decision.lane is None:
            break
        after[decision.lane] += 1
        views = take_slot(views, decision.lane)
    else:
        raise AssertionError("the lanes never filled")
    jobs = lane_jobs(after)
    for node_id, node in by_id.items():
        started = jobs[node_id] - before[node_id]
        if started:
            # A job started on a host only while its one account had room.
            assert max(node.in_flight, placed[node_id] + jobs[node_id]) <= node.max_concurrent_tasks
            assert accepts_lane_work(node)
    for lane in state.lanes:
        assert after[lane.id] <= max(lane.cap, running[lane.id])
        # A compute lane on an active host stopped short of its cap only when
        # its host's one account was full: lane jobs are counted once.
        node = by_id.get(host_of[lane.id])
        if lane.kind == "compute" and node is not None and accepts_lane_work(node) and after[lane.id] < lane.cap:
            assert max(node.in_flight, placed[node.node_id] + jobs[node.node_id]) >= node.max_concurrent_tasks


def accepts_lane_work(node: SnapshotNode) -> bool:
    held = node.held_off_until is not None and node.held_off_until > NOW
    return node.status == "active" and not node.drained and not held


# --------------------------------------------------------------------------
# Work comes home (issue 32): moves off paid hosts, make-before-break


@FAST
@given(nodes=nodes_strategy(min_size=1), services=services_strategy(), data=st.data())
def test_moves_come_home_one_per_service_and_keep_every_limit(nodes, services, data):
    """Whatever the plan in force (moves under way included) and the room
    remembered: each replica is placed once, or twice while it moves (the new
    placement names the old one's node); at most one move per service; a new
    move leaves a paid host for a cheaper one; no node over its limit, the
    moves' slots counted."""
    running = data.draw(st.sampled_from([None, "active", "activating", "failed"]))
    nodes = [n.model_copy(update={"units": {f"fabric-agent-svc{i}.service": running for i in range(5)} if running else {}}) for n in nodes]
    # Placements in force mostly on paid hosts, some of them moves under way.
    paid = [n.node_id for n in nodes if n.cost == "paid"] or [nodes[0].node_id]
    on = st.sampled_from(paid * 3 + [n.node_id for n in nodes])
    existing = data.draw(
        st.lists(
            st.tuples(st.sampled_from([f"svc{i}" for i in range(4)]), st.integers(0, 3), on, st.sampled_from([None] * 4 + NAMES[:4])), max_size=10
        )
    )
    roomy = data.draw(st.one_of(st.just(set(NAMES)), st.sets(st.sampled_from(NAMES))))
    state = _desired(services, NAMES)
    old = [Placement(service=s, replica=r, node=n, tier="relay", replaces=m) for s, r, n, m in existing]
    long_ago = NOW - timedelta(hours=1)
    plan = schedule(Snapshot(now=NOW, nodes=nodes, placements=old, room_since=dict.fromkeys(roomy, long_ago)), state)
    by_id = {n.node_id: n for n in nodes}
    ranks = {"free": 0, "owned": 1, "paid": 2}

    slots = Counter((p.service, p.replica) for p in plan.placements)
    movers = [p for p in plan.placements if p.replaces is not None]
    for p in movers:
        assert slots[(p.service, p.replica)] == 2
        [source] = [q for q in plan.placements if (q.service, q.replica) == (p.service, p.replica) and q is not p]
        assert source.node == p.replaces and source.replaces is None
    assert all(count == 1 for key, count in slots.items() if key not in {(p.service, p.replica) for p in movers})
    assert len({p.service for p in movers}) == len(movers)
    started = {(p.service, p.replica, p.node) for p in movers} - {(p.service, p.replica, p.node) for p in old if p.replaces is not None}
    for service, replica, node_id in started:
        source = next(q for q in plan.placements if (q.service, q.replica) == (service, replica) and q.replaces is None)
        assert by_id[source.node].cost == "paid"
        assert ranks[by_id[node_id].cost] < ranks["paid"]
    # One host, one replica of a service: moves included.
    assert len({(p.service, p.node) for p in plan.placements}) == len(plan.placements)
    placed = Counter(p.node for p in plan.placements)
    for node_id, count in placed.items():
        assert count <= by_id[node_id].max_concurrent_tasks


def test_a_deferral_after_a_placement_or_a_keep_sees_the_new_loads():
    """The placer groups a shape's deferral problems once per set of loads:
    a node excluded (not full) when a service deferred, then filled by
    another service's placement, or a node that takes no new work but keeps
    one more placement, shows its new load when the next service defers
    (what the naive scan of every node says)."""
    nodes = [SnapshotNode(node_id=n, tier="cpu_ffmpeg", max_concurrent_tasks=1) for n in ("a", "b")]
    nodes.append(SnapshotNode(node_id="s", tier="cpu_ffmpeg", max_concurrent_tasks=2, suspected=["liveness lapsed"]))
    request = Request(min_tier="cpu_ffmpeg", floor="cpu_ffmpeg")
    placer = Placer(nodes, NOW)

    def deferred(exclude: set[str]) -> str:
        outcome = placer.place(request, exclude=exclude)
        assert isinstance(outcome, NoChoice)
        assert (outcome.reason, outcome.inadmissible) == reference.explain_deferral(request, nodes, placer.load, NOW, frozenset(exclude))
        return outcome.reason

    assert placer.place(request, exclude={"a"}) == Choice("b", "cpu_ffmpeg", False)
    assert "a runs a replica already" in deferred({"a"})
    assert placer.place(request, exclude={"b"}) == Choice("a", "cpu_ffmpeg", False)
    assert "a full 1/1" in deferred({"b"})
    assert placer.keep("s", request)
    assert "s full 1/2" in deferred({"a", "x"})
