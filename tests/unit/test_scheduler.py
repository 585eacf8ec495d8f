"""Node placement rules (reconciler.core.scheduling.placement), table by table.

Each table row is one situation: the nodes of a snapshot, what is asked, and
the node (or deferral) the rules imply. The seed's edge cases and its burst
check are at the end.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta, timezone

import pytest

from reconciler.core.desired.model import DesiredState, FleetConfig, HostConfig
from reconciler.core.live.models import Placement, Snapshot, SnapshotNode
from reconciler.core.scheduling.placement import Choice, NoChoice, Placer, Request, schedule, tier_sequence

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def node(node_id: str, tier: str, **kw) -> SnapshotNode:
    kw.setdefault("max_concurrent_tasks", 4)
    kw.setdefault("arch", "x86_64")
    return SnapshotNode(node_id=node_id, tier=tier, **kw)


def service(sid: str, min_tier: str, floor: str | None = None, **kw) -> dict:
    out = {"id": sid, "min_tier": min_tier, "command": {"any": ["/bin/true"]}}
    if floor is not None:
        out["floor"] = floor
    out.update(kw)
    return out


def desired(services: list[dict], hosts: list[str], strategy: str = "highest_tier") -> DesiredState:
    fleet = FleetConfig.model_validate(
        {
            "fleet": {"domain": "example.test", "leader_candidates": [hosts[0]]},
            "scheduler": {"strategy": strategy},
            "services": services,
        }
    )
    host_configs = {
        name: HostConfig.model_validate({"host": {"name": name, "roles": ["compute", "control"], "address": f"10.250.0.{i + 1}"}})
        for i, name in enumerate(hosts)
    }
    return DesiredState(fleet=fleet, hosts=host_configs)


def plan_for(services, nodes, placements=(), strategy="highest_tier", hosts=None):
    state = desired(services, hosts or [n.node_id for n in nodes], strategy)
    snap = Snapshot(now=NOW, nodes=nodes, placements=list(placements))
    return schedule(snap, state)


def where(plan, sid: str) -> list[str]:
    return [p.node for p in sorted(plan.placements, key=lambda p: p.replica) if p.service == sid]


def place_one(nodes, request: Request, strategy="highest_tier"):
    return Placer(nodes, NOW, strategy).place(request)


# --------------------------------------------------------------------------
# Tier order


@pytest.mark.parametrize(
    "min_tier, floor, strategy, satisfying, fallback",
    [
        ("gpu_apu", "batch", "highest_tier", ["gpu_cuda", "gpu_vaapi", "gpu_apu"], ["cpu_ffmpeg", "batch"]),
        ("gpu_apu", "batch", "best_fit", ["gpu_apu", "gpu_vaapi", "gpu_cuda"], ["cpu_ffmpeg", "batch"]),
        ("gpu_cuda", "gpu_cuda", "highest_tier", ["gpu_cuda"], []),
        (
            "relay",
            "relay",
            "best_fit",
            list(reversed(["gpu_cuda", "gpu_vaapi", "gpu_apu", "cpu_ffmpeg", "batch", "ethernet", "framebuffer", "wasm", "dsp", "esp32", "relay"])),
            [],
        ),
    ],
)
def test_tier_sequence(min_tier, floor, strategy, satisfying, fallback):
    assert tier_sequence(min_tier, floor, strategy) == (satisfying, fallback)


def test_request_rejects_floor_above_min_tier_and_unknown_tiers():
    with pytest.raises(ValueError, match="above min_tier"):
        Request(min_tier="cpu_ffmpeg", floor="gpu_cuda")
    with pytest.raises(ValueError, match="not a tier"):
        Request(min_tier="gpu_quantum", floor="relay")


# --------------------------------------------------------------------------
# Choosing one node


HELD_FUTURE = NOW + timedelta(seconds=600)
HELD_PAST = NOW - timedelta(seconds=1)

CHOICE_TABLE = [
    # (id, nodes, request, strategy, expected node or None, expected fallback)
    (
        "highest tier wins over lower load",
        [node("cpu", "cpu_ffmpeg"), node("cuda", "gpu_cuda", in_flight=3)],
        Request("cpu_ffmpeg", "relay"),
        "highest_tier",
        "cuda",
        False,
    ),
    (
        "best_fit takes the lowest satisfying tier",
        [node("cpu", "cpu_ffmpeg", in_flight=3), node("cuda", "gpu_cuda"), node("vaapi", "gpu_vaapi")],
        Request("cpu_ffmpeg", "relay"),
        "best_fit",
        "cpu",
        False,
    ),
    (
        "best_fit climbs when the lowest satisfying tier is full",
        [node("cpu", "cpu_ffmpeg", in_flight=4), node("cuda", "gpu_cuda"), node("vaapi", "gpu_vaapi")],
        Request("cpu_ffmpeg", "relay"),
        "best_fit",
        "vaapi",
        False,
    ),
    (
        "same tier: lowest utilization",
        [node("a", "cpu_ffmpeg", in_flight=2), node("b", "cpu_ffmpeg", in_flight=1)],
        Request("cpu_ffmpeg", "relay"),
        "highest_tier",
        "b",
        False,
    ),
    (
        "utilization is relative to the limit",
        [node("a", "cpu_ffmpeg", in_flight=1, max_concurrent_tasks=2), node("b", "cpu_ffmpeg", in_flight=2, max_concurrent_tasks=8)],
        Request("cpu_ffmpeg", "relay"),
        "highest_tier",
        "b",
        False,
    ),
    (
        "same tier and utilization: node id",
        [node("b", "cpu_ffmpeg", in_flight=1), node("a", "cpu_ffmpeg", in_flight=1)],
        Request("cpu_ffmpeg", "relay"),
        "highest_tier",
        "a",
        False,
    ),
    (
        "no candidate at min_tier: one tier down",
        [node("batch", "batch"), node("cpu", "cpu_ffmpeg")],
        Request("gpu_apu", "relay"),
        "highest_tier",
        "cpu",
        True,
    ),
    ("fallback skips empty tiers down to the floor", [node("wasm", "wasm")], Request("gpu_apu", "wasm"), "highest_tier", "wasm", True),
    (
        "fallback takes the highest fallback tier even under best_fit",
        [node("batch", "batch"), node("cpu", "cpu_ffmpeg")],
        Request("gpu_apu", "relay"),
        "best_fit",
        "cpu",
        True,
    ),
    ("never below the floor", [node("batch", "batch")], Request("gpu_apu", "cpu_ffmpeg"), "highest_tier", None, None),
    (
        "full node is skipped",
        [node("cuda", "gpu_cuda", in_flight=4), node("cpu", "cpu_ffmpeg")],
        Request("cpu_ffmpeg", "relay"),
        "highest_tier",
        "cpu",
        False,
    ),
    (
        "node with limit 0 takes nothing",
        [node("cuda", "gpu_cuda", max_concurrent_tasks=0), node("cpu", "cpu_ffmpeg")],
        Request("cpu_ffmpeg", "relay"),
        "highest_tier",
        "cpu",
        False,
    ),
    (
        "offline node is skipped",
        [node("cuda", "gpu_cuda", status="offline"), node("cpu", "cpu_ffmpeg")],
        Request("cpu_ffmpeg", "relay"),
        "highest_tier",
        "cpu",
        False,
    ),
    (
        "draining node is skipped",
        [node("cuda", "gpu_cuda", status="draining"), node("cpu", "cpu_ffmpeg")],
        Request("cpu_ffmpeg", "relay"),
        "highest_tier",
        "cpu",
        False,
    ),
    (
        "dead node is skipped",
        [node("cuda", "gpu_cuda", status="dead"), node("cpu", "cpu_ffmpeg")],
        Request("cpu_ffmpeg", "relay"),
        "highest_tier",
        "cpu",
        False,
    ),
    (
        "drained node is skipped",
        [node("cuda", "gpu_cuda", drained=True), node("cpu", "cpu_ffmpeg")],
        Request("cpu_ffmpeg", "relay"),
        "highest_tier",
        "cpu",
        False,
    ),
    (
        "held-off node is skipped until the hold ends",
        [node("cuda", "gpu_cuda", held_off_until=HELD_FUTURE), node("cpu", "cpu_ffmpeg")],
        Request("cpu_ffmpeg", "relay"),
        "highest_tier",
        "cpu",
        False,
    ),
    (
        "a hold that has ended does not matter",
        [node("cuda", "gpu_cuda", held_off_until=HELD_PAST), node("cpu", "cpu_ffmpeg")],
        Request("cpu_ffmpeg", "relay"),
        "highest_tier",
        "cuda",
        False,
    ),
    (
        "a hold without a zone is read as UTC",
        [node("cuda", "gpu_cuda", held_off_until=HELD_FUTURE.replace(tzinfo=None)), node("cpu", "cpu_ffmpeg")],
        Request("cpu_ffmpeg", "relay"),
        "highest_tier",
        "cpu",
        False,
    ),
    (
        "arch restriction",
        [node("arm", "gpu_cuda", arch="aarch64"), node("x86", "cpu_ffmpeg")],
        Request("cpu_ffmpeg", "relay", arch=frozenset({"x86_64"})),
        "highest_tier",
        "x86",
        False,
    ),
    (
        "unknown arch matches only unrestricted work",
        [node("unknown", "gpu_cuda", arch=None), node("x86", "cpu_ffmpeg")],
        Request("cpu_ffmpeg", "relay", arch=frozenset({"x86_64"})),
        "highest_tier",
        "x86",
        False,
    ),
    (
        "unknown arch takes unrestricted work",
        [node("unknown", "gpu_cuda", arch=None), node("x86", "cpu_ffmpeg")],
        Request("cpu_ffmpeg", "relay"),
        "highest_tier",
        "unknown",
        False,
    ),
    (
        "labels: node must carry every requested label",
        [node("a", "gpu_cuda", labels={"zone": "b"}), node("b", "cpu_ffmpeg", labels={"zone": "a", "disk": "nvme"})],
        Request("cpu_ffmpeg", "relay", labels=(("zone", "a"),)),
        "highest_tier",
        "b",
        False,
    ),
    (
        "labels: a missing key does not match",
        [node("a", "gpu_cuda", labels={}), node("b", "cpu_ffmpeg", labels={"zone": "a"})],
        Request("cpu_ffmpeg", "relay", labels=(("zone", "a"),)),
        "highest_tier",
        "b",
        False,
    ),
]


@pytest.mark.parametrize(
    "nodes, request_, strategy, expected, fallback",
    [row[1:] for row in CHOICE_TABLE],
    ids=[row[0] for row in CHOICE_TABLE],
)
def test_choice(nodes, request_, strategy, expected, fallback):
    outcome = place_one(nodes, request_, strategy)
    if expected is None:
        assert isinstance(outcome, NoChoice)
    else:
        assert outcome == Choice(expected, next(n.tier for n in nodes if n.node_id == expected), fallback)


def test_loads_carry_over_between_decisions_and_spread_by_utilization():
    placer = Placer([node("a", "cpu_ffmpeg", max_concurrent_tasks=2), node("b", "cpu_ffmpeg", max_concurrent_tasks=4)], NOW)
    picks = [placer.place(Request("cpu_ffmpeg", "cpu_ffmpeg")) for _ in range(7)]
    # a 0/2 b 0/4 -> a; a 1/2 b 0/4 -> b; 1/2 vs 1/4 -> b; 1/2 vs 2/4 -> a (id);
    # a full -> b, b; then both full.
    assert [p.node if isinstance(p, Choice) else None for p in picks] == ["a", "b", "b", "a", "b", "b", None]


def test_avoid_prefers_other_nodes_but_never_forces_a_fallback():
    nodes = [node("cuda", "gpu_cuda"), node("apu", "gpu_apu"), node("cpu", "cpu_ffmpeg")]
    placer = Placer(nodes, NOW)
    assert placer.place(Request("gpu_apu", "relay"), avoid={"cuda"}) == Choice("apu", "gpu_apu", False)
    assert placer.place(Request("gpu_apu", "relay"), avoid={"cuda", "apu"}) == Choice("cuda", "gpu_cuda", False)


# --------------------------------------------------------------------------
# Deferral reasons


def test_deferral_names_each_tier_tried_and_why():
    nodes = [
        node("qfox-1", "gpu_cuda", status="offline"),
        node("deck", "gpu_apu", in_flight=4),
        node("pi", "cpu_ffmpeg", arch="aarch64"),
        node("lux", "batch"),
    ]
    outcome = place_one(nodes, Request("gpu_vaapi", "cpu_ffmpeg", arch=frozenset({"x86_64"})))
    assert isinstance(outcome, NoChoice) and not outcome.inadmissible
    assert outcome.reason.startswith("no eligible node from gpu_cuda..cpu_ffmpeg (min_tier gpu_vaapi, floor cpu_ffmpeg; arch [x86_64])")
    assert "gpu_cuda: qfox-1 offline" in outcome.reason
    assert "gpu_apu: deck full 4/4" in outcome.reason
    assert "cpu_ffmpeg: pi arch aarch64 not in [x86_64]" in outcome.reason
    assert "no node at gpu_vaapi" in outcome.reason
    assert "lux" not in outcome.reason  # batch is below the floor: not tried


def test_deferral_gives_the_end_of_a_hold_off_in_utc():
    plus_two = timezone(timedelta(hours=2))
    nodes = [node("flappy", "cpu_ffmpeg", held_off_until=datetime(2026, 11, 29, 14, 10, tzinfo=plus_two))]
    outcome = place_one(nodes, Request("cpu_ffmpeg", "cpu_ffmpeg"))
    assert isinstance(outcome, NoChoice)
    assert outcome.reason.endswith("cpu_ffmpeg: flappy held off until 2026-11-29T12:10:00Z; no node at gpu_cuda, gpu_vaapi, gpu_apu")


def test_deferral_reason_counts_instead_of_listing_a_large_fleet():
    nodes = [node(f"n{i:03d}", "cpu_ffmpeg", status="offline") for i in range(50)]
    outcome = place_one(nodes, Request("cpu_ffmpeg", "cpu_ffmpeg"))
    assert isinstance(outcome, NoChoice)
    assert "cpu_ffmpeg: 50 nodes offline" in outcome.reason
    assert "n049" not in outcome.reason


@pytest.mark.parametrize(
    "nodes, request_, inadmissible",
    [
        ([node("cpu", "cpu_ffmpeg")], Request("gpu_cuda", "gpu_cuda"), True),
        ([node("cuda", "gpu_cuda", status="offline")], Request("gpu_cuda", "gpu_cuda"), False),
        ([node("cuda", "gpu_cuda", status="dead")], Request("gpu_cuda", "gpu_cuda"), False),
        ([node("cuda", "gpu_cuda", in_flight=4)], Request("gpu_cuda", "gpu_cuda"), False),
        ([node("cuda", "gpu_cuda", arch="aarch64")], Request("gpu_cuda", "gpu_cuda", arch=frozenset({"x86_64"})), True),
        ([node("cuda", "gpu_cuda")], Request("gpu_cuda", "gpu_cuda", labels=(("zone", "a"),)), True),
        ([], Request("relay", "relay"), True),
    ],
    ids=["no cuda in the fleet", "cuda offline", "cuda dead", "cuda full", "cuda of the wrong arch", "cuda without the label", "empty fleet"],
)
def test_inadmissible_only_when_no_node_could_ever_take_it(nodes, request_, inadmissible):
    outcome = place_one(nodes, request_)
    assert isinstance(outcome, NoChoice)
    assert outcome.inadmissible is inadmissible
    assert outcome.reason.startswith("inadmissible: ") is inadmissible


# --------------------------------------------------------------------------
# Whole plans: replicas, order, existing placements, trust


def test_replicas_go_to_distinct_nodes_when_possible():
    plan = plan_for(
        [service("fft", "cpu_ffmpeg", replicas=3)],
        [node("cuda", "gpu_cuda"), node("cpu-a", "cpu_ffmpeg"), node("cpu-b", "cpu_ffmpeg", in_flight=1)],
    )
    assert where(plan, "fft") == ["cuda", "cpu-a", "cpu-b"]


def test_replicas_never_share_a_node():
    # A host runs one unit per service: a second replica there would be none.
    plan = plan_for([service("fft", "cpu_ffmpeg", replicas=3)], [node("cuda", "gpu_cuda")])
    assert where(plan, "fft") == ["cuda"]
    assert [(d.replica, d.inadmissible) for d in plan.deferred] == [(1, False), (2, False)]
    assert "cuda runs a replica already" in plan.deferred[0].reason


def test_a_replica_falls_back_to_a_lower_tier_rather_than_share_a_node():
    plan = plan_for(
        [service("fft", "gpu_cuda", "cpu_ffmpeg", replicas=2)],
        [node("cuda", "gpu_cuda"), node("cpu", "cpu_ffmpeg")],
    )
    assert where(plan, "fft") == ["cuda", "cpu"]
    assert [p.fallback for p in sorted(plan.placements, key=lambda p: p.replica)] == [False, True]


def test_replicas_beyond_capacity_are_deferred_not_oversubscribed():
    plan = plan_for(
        [service("fft", "cpu_ffmpeg", replicas=3)],
        [node("busy", "cpu_ffmpeg", max_concurrent_tasks=1, in_flight=1), node("a", "cpu_ffmpeg"), node("b", "cpu_ffmpeg")],
    )
    assert where(plan, "fft") == ["a", "b"]
    assert [(d.replica, d.inadmissible) for d in plan.deferred] == [(2, False)]
    assert "busy full 1/1" in plan.deferred[0].reason and "a runs a replica already" in plan.deferred[0].reason


def test_most_demanding_service_is_placed_first():
    # Declared first, flac could take the only CUDA slot; CUDA-only lupine
    # goes first and gets it, flac runs on the CPU box.
    plan = plan_for(
        [service("flac", "cpu_ffmpeg"), service("lupine", "gpu_cuda", "gpu_cuda")],
        [node("qfox-1", "gpu_cuda", max_concurrent_tasks=1), node("cpu", "cpu_ffmpeg")],
    )
    assert where(plan, "lupine") == ["qfox-1"]
    assert where(plan, "flac") == ["cpu"]


def test_undeclared_nodes_are_ignored_and_listed():
    plan = plan_for(
        [service("fft", "cpu_ffmpeg")],
        [node("intruder", "gpu_cuda"), node("cpu", "cpu_ffmpeg")],
        hosts=["cpu"],
    )
    assert where(plan, "fft") == ["cpu"]
    assert plan.ignored_nodes == ["intruder"]


def test_plan_carries_epoch_leader_and_snapshot_time():
    state = desired([service("fft", "cpu_ffmpeg")], ["cpu"])
    snap = Snapshot(now=NOW, nodes=[node("cpu", "cpu_ffmpeg")], leader="lux", epoch=7)
    assert (schedule(snap, state).epoch, schedule(snap, state).leader, schedule(snap, state).created) == (7, "lux", NOW)
    plan = schedule(snap, state, leader="qfox-1", epoch=8)
    assert (plan.epoch, plan.leader) == (8, "qfox-1")


def kept(sid, replica, node_id, tier="cpu_ffmpeg"):
    return Placement(service=sid, replica=replica, node=node_id, tier=tier)


EXISTING_TABLE = [
    # (id, nodes, existing placements, expected nodes of service "svc" by replica)
    (
        "feasible placement stays although a better node exists",
        [node("cpu", "cpu_ffmpeg", in_flight=1), node("cuda", "gpu_cuda")],
        [kept("svc", 0, "cpu")],
        ["cpu"],
    ),
    ("work on a lost node is placed again", [node("cuda", "gpu_cuda")], [kept("svc", 0, "gone")], ["cuda"]),
    (
        "work on an offline node is placed again",
        [node("old", "cpu_ffmpeg", status="offline"), node("new", "cpu_ffmpeg")],
        [kept("svc", 0, "old")],
        ["new"],
    ),
    (
        "a draining node keeps its work through the drain grace",
        [node("old", "cpu_ffmpeg", status="draining"), node("new", "cpu_ffmpeg")],
        [kept("svc", 0, "old")],
        ["old"],
    ),
    (
        "work on a drained node (grace over) is placed again",
        [node("old", "cpu_ffmpeg", status="draining", drained=True), node("new", "cpu_ffmpeg")],
        [kept("svc", 0, "old")],
        ["new"],
    ),
    (
        "work on a drained node is placed again",
        [node("old", "cpu_ffmpeg", drained=True), node("new", "cpu_ffmpeg")],
        [kept("svc", 0, "old")],
        ["new"],
    ),
    (
        "a held-off node keeps its work",
        [node("old", "cpu_ffmpeg", held_off_until=HELD_FUTURE), node("new", "gpu_cuda")],
        [kept("svc", 0, "old")],
        ["old"],
    ),
    ("a node demoted below the floor loses the work", [node("old", "batch"), node("new", "cpu_ffmpeg")], [kept("svc", 0, "old")], ["new"]),
    (
        "a node demoted to a fallback tier still above the floor keeps it",
        [node("old", "gpu_apu"), node("new", "gpu_cuda")],
        [kept("svc", 0, "old")],
        ["old"],
    ),
    (
        "kept placements beyond a lowered limit move",
        [node("old", "cpu_ffmpeg", max_concurrent_tasks=1, in_flight=2), node("new", "cpu_ffmpeg")],
        [kept("svc", 0, "old"), kept("svc", 1, "old")],
        ["old", "new"],
    ),
    (
        "a duplicate placement record keeps the first",
        [node("a", "cpu_ffmpeg"), node("b", "cpu_ffmpeg")],
        [kept("svc", 0, "a"), kept("svc", 0, "b")],
        ["a"],
    ),
]


@pytest.mark.parametrize("nodes, existing, expected", [row[1:] for row in EXISTING_TABLE], ids=[row[0] for row in EXISTING_TABLE])
def test_existing_placements(nodes, existing, expected):
    replicas = len(expected)
    plan = plan_for([service("svc", "gpu_cuda", "cpu_ffmpeg", replicas=replicas)], nodes, existing)
    assert where(plan, "svc") == expected
    assert not plan.deferred


def test_existing_placements_of_removed_services_and_replicas_are_dropped():
    plan = plan_for(
        [service("svc", "cpu_ffmpeg", replicas=1)],
        [node("a", "cpu_ffmpeg"), node("b", "cpu_ffmpeg")],
        [kept("svc", 0, "b"), kept("svc", 1, "a"), kept("retired", 0, "a")],
    )
    assert [(p.service, p.replica, p.node) for p in plan.placements] == [("svc", 0, "b")]


def test_kept_placement_reports_the_nodes_current_tier_and_fallback():
    plan = plan_for(
        [service("svc", "gpu_cuda", "cpu_ffmpeg")],
        [node("old", "gpu_apu")],
        [kept("svc", 0, "old", tier="gpu_cuda")],
    )
    assert [(p.tier, p.fallback) for p in plan.placements] == [("gpu_apu", True)]


# --------------------------------------------------------------------------
# The seed's edge cases


SEED_SERVICES = [
    service("lupine", "gpu_cuda", "gpu_cuda"),  # CUDA-only: hard fail
    service("vaapi-encode", "gpu_vaapi", "cpu_ffmpeg"),  # falls back to CPU ffmpeg
    service("flac-fft", "cpu_ffmpeg", "relay"),  # anything can do FFT
]


def test_all_gpu_nodes_offline_vaapi_falls_to_cpu_ffmpeg_and_cuda_only_hard_fails():
    nodes = [
        node("qfox-1", "gpu_cuda", status="offline"),
        node("vaapi-box", "gpu_vaapi", status="offline"),
        node("steamdeck", "cpu_ffmpeg"),
        node("lux", "batch"),
    ]
    plan = plan_for(SEED_SERVICES, nodes)
    by_service = {p.service: p for p in plan.placements}
    assert (by_service["vaapi-encode"].node, by_service["vaapi-encode"].tier, by_service["vaapi-encode"].fallback) == (
        "steamdeck",
        "cpu_ffmpeg",
        True,
    )
    assert by_service["flac-fft"].node == "steamdeck"
    assert [d.service for d in plan.deferred] == ["lupine"]
    # The CUDA box exists, it is offline: waiting may help, so not inadmissible.
    assert plan.deferred[0].inadmissible is False
    assert "gpu_cuda: qfox-1 offline" in plan.deferred[0].reason


def test_cuda_only_work_in_a_fleet_without_cuda_is_inadmissible():
    plan = plan_for(SEED_SERVICES, [node("steamdeck", "cpu_ffmpeg"), node("vaapi-box", "gpu_vaapi")])
    assert [(d.service, d.inadmissible) for d in plan.deferred] == [("lupine", True)]
    assert "no node in the fleet has tier gpu_cuda or better" in plan.deferred[0].reason


def test_vaapi_work_never_drops_below_cpu_ffmpeg():
    plan = plan_for(SEED_SERVICES, [node("lux", "batch")])
    deferred = {d.service: d for d in plan.deferred}
    assert set(deferred) == {"lupine", "vaapi-encode"}
    assert deferred["vaapi-encode"].inadmissible is True
    assert where(plan, "flac-fft") == ["lux"]


def test_new_node_appearing_before_the_old_one_drains():
    # Two separate nodes: the running work stays on the old node, new work
    # (a second replica) goes to the new one.
    existing = [kept("flac-fft", 0, "qfox-1-old", tier="gpu_cuda")]
    nodes = [node("qfox-1-old", "gpu_cuda", in_flight=1), node("qfox-1-new", "gpu_cuda")]
    plan = plan_for([service("flac-fft", "cpu_ffmpeg", replicas=2)], nodes, existing)
    assert where(plan, "flac-fft") == ["qfox-1-old", "qfox-1-new"]
    # ...and once the old node is lost, its replica waits for a distinct node:
    # the new node already runs the other one.
    nodes = [node("qfox-1-old", "gpu_cuda", status="offline"), node("qfox-1-new", "gpu_cuda", in_flight=1)]
    plan = plan_for(
        [service("flac-fft", "cpu_ffmpeg", replicas=2)],
        nodes,
        existing + [kept("flac-fft", 1, "qfox-1-new", tier="gpu_cuda")],
    )
    assert where(plan, "flac-fft") == ["qfox-1-new"]
    assert [d.replica for d in plan.deferred] == [0]


def test_kept_placements_hold_their_slots_before_the_node_reports_them():
    # "old" reports nothing in flight yet, but its one slot is another
    # service's kept placement: the CUDA-preferring service goes elsewhere.
    plan = plan_for(
        [service("svc", "gpu_cuda", "cpu_ffmpeg"), service("other", "cpu_ffmpeg")],
        [node("old", "gpu_cuda", max_concurrent_tasks=1, in_flight=0), node("cpu", "cpu_ffmpeg")],
        [kept("other", 0, "old")],
    )
    assert where(plan, "other") == ["old"] and where(plan, "svc") == ["cpu"]


@pytest.mark.parametrize(
    "limit, in_flight, stays",
    [(1, 0, ["a"]), (2, 0, ["a", "b"]), (2, 2, ["a", "b"]), (2, 3, ["a", "b"])],
    ids=["limit 1: one of three kept", "limit 2: both kept", "limit 2, both reported in flight", "reported over its limit: still at most limit kept"],
)
def test_kept_placements_of_different_services_never_push_a_node_over_its_limit(limit, in_flight, stays):
    """Different services (so no sibling rule moves them) kept on one node:
    only as many stay as max_concurrent_tasks allows; the rest move."""
    services = [service(s, "cpu_ffmpeg") for s in ("a", "b", "c")]
    nodes = [node("old", "cpu_ffmpeg", max_concurrent_tasks=limit, in_flight=in_flight), node("new", "cpu_ffmpeg", max_concurrent_tasks=8)]
    plan = plan_for(services, nodes, [kept("a", 0, "old"), kept("b", 0, "old"), kept("c", 0, "old")])
    on_old = sorted(p.service for p in plan.placements if p.node == "old")
    assert on_old == stays
    assert len(on_old) <= limit
    assert sorted(p.service for p in plan.placements if p.node == "new") == sorted({"a", "b", "c"} - set(stays))
    assert not plan.deferred


def test_a_kept_replica_sharing_a_node_with_a_sibling_moves_to_a_distinct_node():
    existing = [kept("flac-fft", 0, "a"), kept("flac-fft", 1, "a")]
    plan = plan_for([service("flac-fft", "cpu_ffmpeg", replicas=2)], [node("a", "cpu_ffmpeg"), node("b", "cpu_ffmpeg")], existing)
    assert where(plan, "flac-fft") == ["a", "b"]


def test_oversubscription_never_happens():
    nodes = [node("a", "gpu_cuda", max_concurrent_tasks=2, in_flight=1), node("b", "cpu_ffmpeg", max_concurrent_tasks=3)]
    services = [service(f"s{i}", "cpu_ffmpeg", replicas=3) for i in range(3)]
    plan = plan_for(services, nodes)
    per_node = Counter(p.node for p in plan.placements)
    assert per_node == {"a": 1, "b": 3}  # a: 1 in flight + 1 new = 2; b: 3
    assert len(plan.deferred) == 9 - 4


def test_burst_of_100_tasks_over_a_small_fleet():
    """The seed's burst check: 100 requests at min_tier gpu_apu, falling back
    as far as relay, over a five-node fleet with room for 104."""
    fleet = [
        node("qfox-1", "gpu_cuda", max_concurrent_tasks=24),
        node("steamdeck", "gpu_apu", max_concurrent_tasks=16),
        node("x86-spill", "cpu_ffmpeg", max_concurrent_tasks=32),
        node("a1-arm64", "cpu_ffmpeg", max_concurrent_tasks=16, arch="aarch64"),
        node("lux", "batch", max_concurrent_tasks=16),
    ]
    placer = Placer(fleet, NOW)
    outcomes = []
    for i in range(100):
        if i == 50:
            # Mid-burst health check: every node within its limit, and the
            # 40 gpu slots were used before anything fell back.
            assert all(placer.load(n.node_id) <= n.max_concurrent_tasks for n in fleet)
            assert [o.tier for o in outcomes[:40]] == ["gpu_cuda"] * 24 + ["gpu_apu"] * 16
        outcomes.append(placer.place(Request(min_tier="gpu_apu", floor="relay")))
    assert all(isinstance(o, Choice) for o in outcomes)
    fallback_count = sum(o.fallback for o in outcomes)
    by_tier = Counter(o.tier for o in outcomes if o.fallback)
    print(f"100 tasks dispatched, fallback tiers used: {fallback_count} ({dict(by_tier)})")
    # The rules imply: 24 + 16 at or above gpu_apu; the other 60 fall back,
    # 48 to cpu_ffmpeg (x86-spill 32 + a1-arm64 16), then 12 to batch.
    assert fallback_count == 60
    assert by_tier == {"cpu_ffmpeg": 48, "batch": 12}
    assert {n.node_id: placer.load(n.node_id) for n in fleet} == {
        "qfox-1": 24,
        "steamdeck": 16,
        "x86-spill": 32,
        "a1-arm64": 16,
        "lux": 12,
    }
