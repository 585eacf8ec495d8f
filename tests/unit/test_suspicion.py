"""Suspected nodes and their hedges (issue 30, reconciler.core.scheduling.suspicion
and the hedges of core.scheduling.placement), rule by rule, on pure inputs."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from reconciler.core.desired.model import DesiredState, FlapSettings, FleetConfig, HostConfig
from reconciler.core.live.models import FleetPlan, Placement, Snapshot, SnapshotNode, SuspectState
from reconciler.core.live.records import LeaderInfo
from reconciler.core.probe.parsers import ParseError, offline_peers
from reconciler.core.scheduling.lanes import offline_reason
from reconciler.core.scheduling.placement import schedule
from reconciler.core.scheduling.ray_tasks import Requirement, select_assignment
from reconciler.core.scheduling.suspicion import (
    LivenessRecord,
    advance_suspects,
    hedging,
    leader_lapse,
    next_liveness_lapse,
    note_hedges,
    remember_liveness,
    suspected,
    with_suspects,
)
from reconciler.core.views.timeline import FleetHistory, timeline

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
FLAP = FlapSettings(window_s=300, toggles=3, hold_off_s=600)


def node(node_id: str, tier: str, **kw) -> SnapshotNode:
    kw.setdefault("max_concurrent_tasks", 4)
    kw.setdefault("arch", "x86_64")
    return SnapshotNode(node_id=node_id, tier=tier, **kw)


def service(sid: str, min_tier: str, **kw) -> dict:
    return {"id": sid, "min_tier": min_tier, "command": {"any": ["/bin/true"]}, **kw}


def desired(services: list[dict], hosts: list[str]) -> DesiredState:
    fleet = FleetConfig.model_validate({"fleet": {"domain": "example.test", "leader_candidates": [hosts[0]]}, "services": services})
    host_configs = {
        name: HostConfig.model_validate({"host": {"name": name, "roles": ["compute", "control"], "address": f"10.250.0.{i + 1}"}})
        for i, name in enumerate(hosts)
    }
    return DesiredState(fleet=fleet, hosts=host_configs)


def at(seconds: float) -> datetime:
    return NOW + timedelta(seconds=seconds)


def active(node_id: str, last_seen: float = -10) -> SnapshotNode:
    return node(node_id, "cpu_ffmpeg", last_seen=at(last_seen))


# -- suspected(nodes, liveness, sources, now) ------------------------------------------


def test_a_lapsed_liveness_record_makes_an_active_node_suspected():
    got = suspected([active("a"), active("b")], {"a": at(-2), "b": at(3)}, {}, NOW)
    assert list(got) == ["a"]
    assert got["a"] == ["liveness lapsed at 2026-11-29T11:59:58Z"]


def test_a_full_heartbeat_after_the_lapse_clears_it():
    assert suspected([active("a", last_seen=-1)], {"a": at(-2)}, {}, NOW) == {}, "its pass beats: alive"


def test_a_host_that_never_published_a_liveness_record_is_judged_by_the_node_timeout_alone():
    assert suspected([active("a", last_seen=-80)], {}, {}, NOW) == {}


def test_one_source_alone_is_not_enough_two_agreeing_are():
    nodes = [active("a"), active("b")]
    one = {"ray": {"a": "Ray node dead"}}
    assert suspected(nodes, {}, one, NOW) == {}
    two = {"ray": {"a": "Ray node dead", "b": "Ray node dead"}, "tailscale": {"a": "peer offline"}}
    assert suspected(nodes, {}, two, NOW) == {"a": ["ray: Ray node dead", "tailscale: peer offline"]}


def test_only_active_nodes_are_suspected():
    offline = node("a", "cpu_ffmpeg", status="offline", last_seen=at(-100))
    assert suspected([offline], {"a": at(-95)}, {"ray": {"a": "x"}, "tailscale": {"a": "y"}}, NOW) == {}


def test_the_leader_remembers_the_newest_expiry_and_wakes_at_the_first_ahead():
    seen = remember_liveness({"a": at(-1)}, [LivenessRecord("b", at(4), 6), LivenessRecord("a", at(-5), 6)])
    assert seen == {"a": at(-1), "b": at(4)}, "a record etcd deleted still counts; an older read never moves it back"
    assert next_liveness_lapse(seen, NOW) == at(4)


# -- advance_suspects: memory, recovery, offline, flap damping --------------------------


def test_a_suspicion_recovery_and_the_stable_window():
    states, changes = advance_suspects({}, {"a": ["liveness lapsed"]}, {"a": "active"}, NOW, FLAP)
    assert [c.kind for c in changes] == ["suspicion"] and states["a"].since == NOW
    states, changes = advance_suspects(states, {}, {"a": "active"}, at(20), FLAP)
    assert [c.kind for c in changes] == ["recovery"] and states["a"].cleared_at == at(20)
    assert hedging(states["a"], at(20 + 299), FLAP.window_s), "hedges stay for a stable window"
    assert not hedging(states["a"], at(20 + 300), FLAP.window_s), "then go"


def test_a_suspect_that_goes_offline_keeps_no_hedges_of_its_own():
    states, _ = advance_suspects({}, {"a": ["liveness lapsed"]}, {"a": "active"}, NOW, FLAP)
    states, changes = advance_suspects(states, {}, {"a": "offline"}, at(90), FLAP)
    assert [c.kind for c in changes] == ["offline"]
    assert not hedging(states["a"], at(90), FLAP.window_s)
    assert [e.kind for e in states["a"].events] == ["suspicion", "offline"]


def test_suspicions_count_as_flaps_and_hold_a_blinking_node_off():
    states: dict[str, SuspectState] = {}
    for i in range(3):
        states, _ = advance_suspects(states, {"a": ["liveness lapsed"]}, {"a": "active"}, at(40 * i), FLAP)
        states, _ = advance_suspects(states, {}, {"a": "active"}, at(40 * i + 10), FLAP)
    assert states["a"].held_off_until == at(80 + 600)
    assert hedging(states["a"], at(80 + 599), FLAP.window_s), "its hedges stay while it is held off: no churn"
    marked = with_suspects(Snapshot(now=at(100), nodes=[active("a")]), states)
    assert marked.nodes[0].held_off_until == at(680) and marked.nodes[0].suspected == []


def test_two_suspicions_are_not_yet_flapping():
    states: dict[str, SuspectState] = {}
    for i in range(2):
        states, _ = advance_suspects(states, {"a": ["x"]}, {"a": "active"}, at(40 * i), FLAP)
        states, _ = advance_suspects(states, {}, {"a": "active"}, at(40 * i + 10), FLAP)
    assert states["a"].held_off_until is None


# -- hedges in the plan -----------------------------------------------------------------


def fleet(*services: dict) -> DesiredState:
    return desired(list(services), ["a", "b", "c"])


def nodes3() -> list[SnapshotNode]:
    return [node("a", "gpu_vaapi"), node("b", "cpu_ffmpeg"), node("c", "gpu_vaapi")]


def placed(sid: str, at_node: str, tier: str = "gpu_vaapi", **kw) -> Placement:
    return Placement(service=sid, replica=0, node=at_node, tier=tier, **kw)


def suspect(since: datetime | None = NOW, cleared_at: datetime | None = None, **kw) -> dict[str, SuspectState]:
    return {"a": SuspectState(since=since, cleared_at=cleared_at, reasons=["liveness lapsed"] if since else [], **kw)}


def plan_over(state: DesiredState, placements, suspects, now=NOW, nodes=None) -> FleetPlan:
    snap = with_suspects(Snapshot(now=now, nodes=nodes or nodes3(), placements=list(placements)), suspects)
    return schedule(snap, state)


def test_a_suspected_nodes_single_replica_service_gets_a_hedge_on_the_best_other_node():
    plan = plan_over(fleet(service("enc", "gpu_vaapi")), [placed("enc", "a")], suspect())
    assert [(p.node, p.hedge) for p in plan.placements] == [("a", None), ("c", "a")], "its own placement stays; the hedge by tier rules"
    assert plan.suspects["a"].since == NOW


def test_no_hedge_without_a_suspect():
    plan = plan_over(fleet(service("enc", "gpu_vaapi")), [placed("enc", "a")], {})
    assert [(p.node, p.hedge) for p in plan.placements] == [("a", None)]


def test_a_singleton_service_is_never_hedged():
    plan = plan_over(fleet(service("enc", "gpu_vaapi", singleton=True)), [placed("enc", "a")], suspect())
    assert [(p.node, p.hedge) for p in plan.placements] == [("a", None)]


def test_a_service_of_several_replicas_is_not_hedged():
    state = fleet(service("web", "cpu_ffmpeg", replicas=2))
    plan = plan_over(state, [placed("web", "a", "gpu_vaapi"), Placement(service="web", replica=1, node="b", tier="cpu_ffmpeg")], suspect())
    assert all(p.hedge is None for p in plan.placements)


def test_the_hedge_stays_where_it_is_and_leaves_after_the_stable_window():
    state = fleet(service("enc", "gpu_vaapi"))
    hedge = placed("enc", "b", "cpu_ffmpeg", fallback=True, hedge="a")
    recovered = suspect(since=None, cleared_at=NOW)
    within = plan_over(state, [placed("enc", "a"), hedge], recovered, now=at(299))
    assert [(p.node, p.hedge) for p in within.placements] == [("a", None), ("b", "a")], "kept on b, not moved to the better c"
    after = plan_over(state, [placed("enc", "a"), hedge], recovered, now=at(300))
    assert [(p.node, p.hedge) for p in after.placements] == [("a", None)], "the node's own placement never moved"


def test_when_the_suspect_goes_offline_its_hedge_becomes_the_placement():
    state = fleet(service("enc", "gpu_vaapi"))
    nodes = [node("a", "gpu_vaapi", status="offline"), node("b", "cpu_ffmpeg"), node("c", "gpu_vaapi")]
    gone, _ = advance_suspects(suspect(), {}, {"a": "offline"}, at(90), FLAP)
    hedge = placed("enc", "b", "cpu_ffmpeg", fallback=True, hedge="a")  # c had no room when it was placed
    plan = plan_over(state, [placed("enc", "a"), hedge], gone, now=at(90), nodes=nodes)
    assert [(p.node, p.hedge) for p in plan.placements] == [("b", None)], "it stays where it runs: no second move to c"


def test_a_suspected_node_takes_no_new_work_and_its_lanes_are_offline():
    state = fleet(service("enc", "gpu_vaapi"))
    plan = plan_over(state, [], suspect())
    assert [p.node for p in plan.placements] == ["c"], "a (first by id) is suspected"
    marked = with_suspects(Snapshot(now=NOW, nodes=nodes3()), suspect())
    lane = state.lanes[0]
    assert offline_reason(lane, "a", marked.nodes[0], NOW) == "suspected: liveness lapsed"


def test_ray_select_worker_skips_a_suspected_node():
    snap = Snapshot(now=NOW, nodes=nodes3(), suspects=suspect())
    got = select_assignment(snap, Requirement(min_tier="gpu_vaapi"), ray_hosts={"a", "c"})
    assert got.host == "c"


def test_with_every_fast_source_off_the_plan_is_todays():
    state = fleet(service("enc", "gpu_vaapi"), service("web", "cpu_ffmpeg", replicas=2))
    nodes = [node("a", "gpu_vaapi", last_seen=at(-80)), node("b", "cpu_ffmpeg", last_seen=at(-5)), node("c", "gpu_vaapi")]
    placements = [placed("enc", "a")]
    now_suspected = suspected(nodes, {}, {}, NOW)
    states, changes = advance_suspects({}, now_suspected, {n.node_id: n.status for n in nodes}, NOW, FLAP)
    assert now_suspected == {} and states == {} and changes == []
    today = schedule(Snapshot(now=NOW, nodes=nodes, placements=placements), state)
    assert schedule(with_suspects(Snapshot(now=NOW, nodes=nodes, placements=placements), states), state) == today


def test_the_timeline_shows_suspicion_hedge_and_recovery_with_their_sources():
    state = fleet(service("enc", "gpu_vaapi"))
    states, _ = advance_suspects({}, {"a": ["liveness lapsed at 11:59:58Z", "ray: Ray node dead"]}, {"a": "active"}, NOW, FLAP)
    plan = plan_over(state, [placed("enc", "a")], states)
    plan, changes = note_hedges(plan, [placed("enc", "a")], NOW)
    assert [(c.kind, c.node, c.detail) for c in changes] == [("hedge", "a", "enc also placed on c")]
    states, _ = advance_suspects(plan.suspects, {}, {"a": "active"}, at(20), FLAP)
    plan = plan.model_copy(update={"suspects": states})
    events = timeline(FleetHistory(), plan)
    assert [(e.kind, e.title) for e in events if e.subject == "a"] == [
        ("recovery", "a recovered"),
        ("hedge", "a hedged"),
        ("suspicion", "a suspected"),
    ]
    assert "ray: Ray node dead" in next(e.detail for e in events if e.kind == "suspicion")


# -- tailscale status --json as a source -------------------------------------------------


def test_tailscale_names_the_hosts_whose_peer_is_offline():
    status = {
        "BackendState": "Running",
        "Self": {"DNSName": "lux.tail-abc.ts.net.", "TailscaleIPs": ["100.64.0.1"]},
        "Peer": {
            "k1": {"DNSName": "qfox-1.tail-abc.ts.net.", "HostName": "qfox-1", "Online": False, "LastSeen": "2026-11-29T11:59:50Z"},
            "k2": {"DNSName": "a1-arm64.tail-abc.ts.net.", "HostName": "a1-arm64", "Online": True},
            "k3": {"DNSName": "phone.tail-abc.ts.net.", "HostName": "phone", "Online": False},
            "k4": {"HostName": "X86-Spill", "Online": False},
            "k5": {"DNSName": "racknerd.tail-abc.ts.net.", "HostName": "racknerd"},
        },
    }
    got = offline_peers(json.dumps(status), ["qfox-1", "a1-arm64", "x86-spill", "racknerd"])
    assert got == {"qfox-1": "peer offline (last seen 2026-11-29T11:59:50Z)", "x86-spill": "peer offline"}, "unknown Online says nothing"
    with pytest.raises(ParseError):
        offline_peers(json.dumps({"BackendState": "Stopped"}), ["qfox-1"])


# -- leader_lapse: when a candidate takes a live term over (pure) --------------

_T = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def _held(**kw) -> LeaderInfo:
    values = {"candidate": "lux", "epoch": 3, "since": _T, "token": "t", "term": 7, "renewed_at": _T, "ttl_s": 30.0, **kw}
    return LeaderInfo(**values)


@pytest.mark.parametrize(
    ("why", "held", "seen", "last_seen", "at", "lapse"),
    [
        ("lapsed 3 s ago, not renewed since: taken over", _held(), {"lux": _T + timedelta(seconds=5)}, None, 8, 5),
        ("the record's own expiry counts too", _held(liveness_until=_T + timedelta(seconds=5)), {}, None, 8, 5),
        ("the newest known expiry counts", _held(liveness_until=_T + timedelta(seconds=5)), {"lux": _T + timedelta(seconds=7)}, None, 8, None),
        ("lapsed 1 s ago: too young", _held(), {"lux": _T + timedelta(seconds=5)}, None, 6, None),
        ("no known expiry: no lapse", _held(), {"qfox-1": _T}, None, 8, None),
        ("renewed after the lapse: alive", _held(renewed_at=_T + timedelta(seconds=6)), {"lux": _T + timedelta(seconds=5)}, None, 8, None),
        ("a full heartbeat after the lapse", _held(), {"lux": _T + timedelta(seconds=5)}, _T + timedelta(seconds=6), 8, None),
        ("a heartbeat before it counts for nothing", _held(), {"lux": _T + timedelta(seconds=5)}, _T, 8, 5),
        ("resigned: the ordinary campaign's", _held(resigned=True), {"lux": _T + timedelta(seconds=5)}, None, 8, None),
        ("stale: the ordinary campaign's", _held(), {"lux": _T + timedelta(seconds=5)}, None, 31, None),
    ],
)
def test_leader_lapse(why, held, seen, last_seen, at, lapse):
    got = leader_lapse(held, seen, last_seen, _T + timedelta(seconds=at), min_age_s=2)
    assert got == (_T + timedelta(seconds=lapse) if lapse is not None else None), why
