"""Lane dispatch (reconciler.core.scheduling.lanes): multi-compute.md's rank-tiered drain.

The worked fleet: a1-arm64 (compute, rank 10, cap 2), x86-spill (compute,
rank 20, cap 4), local (rank 99, cap 1); spill after 900 s, 3 cloud attempts.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import SchedulerSettings
from reconciler.core.live.models import LaneView, Snapshot, SnapshotLane, SnapshotNode
from reconciler.core.scheduling.lanes import LaneDecision, LaneJob, choose_lane, eligible_lanes, lane_views, sort_key
from tests.conftest import EXAMPLE_FLEET

SETTINGS = SchedulerSettings(local_spill_after_s=900, cloud_attempts=3)


def lanes(a1=(0, True), x86=(0, True), local=(0, True)) -> list[LaneView]:
    """(in_flight, available) per lane of the worked fleet."""
    return [
        LaneView(id="a1-arm64", kind="compute", rank=10, cap=2, in_flight=a1[0], available=a1[1]),
        LaneView(id="x86-spill", kind="compute", rank=20, cap=4, in_flight=x86[0], available=x86[1]),
        LaneView(id="local", kind="local", rank=99, cap=1, in_flight=local[0], available=local[1]),
    ]


FULL_A1, FULL_X86, FULL_LOCAL = (2, True), (4, True), (1, True)
OFF = (0, False)

TABLE = [
    # (id, lanes, waited_s, attempts, lane, hold)
    ("cheapest lane first", lanes(), 0, 0, "a1-arm64", None),
    ("spill to the next rank when full", lanes(a1=FULL_A1), 0, 0, "x86-spill", None),
    ("an offline lane never stalls the others", lanes(a1=OFF), 0, 0, "x86-spill", None),
    ("cloud full, spill gate not reached: hold", lanes(a1=FULL_A1, x86=FULL_X86), 0, 0, None, "local_spill_not_reached"),
    ("just short of the spill gate", lanes(a1=FULL_A1, x86=FULL_X86), 899.9, 0, None, "local_spill_not_reached"),
    ("cloud full and waited long enough: local", lanes(a1=FULL_A1, x86=FULL_X86), 900, 0, "local", None),
    ("every cloud lane offline: local at once", lanes(a1=OFF, x86=OFF), 0, 0, "local", None),
    ("one cloud lane offline, the other full: gate applies", lanes(a1=OFF, x86=FULL_X86), 0, 0, None, "local_spill_not_reached"),
    ("every cloud lane offline and local full", lanes(a1=OFF, x86=OFF, local=FULL_LOCAL), 0, 0, None, "no_free_slots"),
    ("everything offline", lanes(a1=OFF, x86=OFF, local=OFF), 0, 0, None, "no_free_slots"),
    ("everything full, waiting would not help", lanes(a1=FULL_A1, x86=FULL_X86, local=FULL_LOCAL), 0, 0, None, "no_free_slots"),
    ("everything full after the gate", lanes(a1=FULL_A1, x86=FULL_X86, local=FULL_LOCAL), 5000, 0, None, "no_free_slots"),
    ("cloud full, local offline", lanes(a1=FULL_A1, x86=FULL_X86, local=OFF), 0, 0, None, "no_free_slots"),
    ("waited past the gate but a cloud slot is free: rank wins", lanes(a1=FULL_A1), 5000, 0, "x86-spill", None),
    ("attempts spent: local even with cloud slots free", lanes(), 0, 3, "local", None),
    ("attempts spent and local full", lanes(local=FULL_LOCAL), 0, 3, None, "cloud_attempts_exhausted"),
    ("attempts spent and local offline", lanes(local=OFF), 5000, 7, None, "cloud_attempts_exhausted"),
    ("attempts not yet spent", lanes(a1=FULL_A1, x86=FULL_X86), 0, 2, None, "local_spill_not_reached"),
]


@pytest.mark.parametrize("views, waited, attempts, lane, hold", [r[1:] for r in TABLE], ids=[r[0] for r in TABLE])
def test_choose_lane(views, waited, attempts, lane, hold):
    decision = choose_lane(views, LaneJob(waited_s=waited, attempts=attempts), SETTINGS)
    assert decision == LaneDecision(lane=lane, hold=hold)


def test_equal_ranks_share_by_utilization_then_id():
    views = [
        LaneView(id="b", kind="compute", rank=10, cap=4, in_flight=1, available=True),
        LaneView(id="a", kind="compute", rank=10, cap=2, in_flight=1, available=True),
        LaneView(id="c", kind="compute", rank=10, cap=4, in_flight=1, available=True),
    ]
    # b and c at 1/4 beat a at 1/2; b beats c by id.
    assert choose_lane(views, LaneJob(), SETTINGS).lane == "b"


@pytest.mark.parametrize("order", ["ids ascending", "ids descending"])
def test_a_tie_on_rank_and_utilization_goes_to_the_smallest_id_whatever_the_input_order(order):
    views = [
        LaneView(id="a1-arm64", kind="compute", rank=10, cap=2, in_flight=1, available=True),
        LaneView(id="b-spill", kind="compute", rank=10, cap=4, in_flight=2, available=True),
        LaneView(id="c-spill", kind="compute", rank=10, cap=6, in_flight=3, available=True),
    ]
    if order == "ids descending":
        views.reverse()
    assert choose_lane(views, LaneJob(), SETTINGS).lane == "a1-arm64"
    assert [v.id for v in sorted(views, key=sort_key)] == ["a1-arm64", "b-spill", "c-spill"]


def test_only_the_implicit_local_lane_takes_work_at_once():
    views = [LaneView(id="local", kind="local", rank=99, cap=1, in_flight=0, available=True)]
    assert choose_lane(views, LaneJob(), SETTINGS) == LaneDecision("local", None)
    full = [views[0].model_copy(update={"in_flight": 1})]
    assert choose_lane(full, LaneJob(), SETTINGS) == LaneDecision(None, "no_free_slots")


def test_without_a_local_lane():
    views = lanes()[:2]
    assert choose_lane(views, LaneJob(attempts=3), SETTINGS) == LaneDecision(None, "cloud_attempts_exhausted")
    full = lanes(a1=FULL_A1, x86=FULL_X86)[:2]
    assert choose_lane(full, LaneJob(waited_s=5000), SETTINGS) == LaneDecision(None, "no_free_slots")


def test_a_local_lane_ranked_below_the_cloud_wins_once_its_gate_opens():
    views = [
        LaneView(id="cloud", kind="compute", rank=50, cap=1, in_flight=0, available=True),
        LaneView(id="local", kind="local", rank=5, cap=1, in_flight=0, available=True),
    ]
    assert choose_lane(views, LaneJob(), SETTINGS).lane == "cloud"
    assert choose_lane(views, LaneJob(waited_s=900), SETTINGS).lane == "local"


def dispatch_jobs(views, jobs, settings):
    """Jobs in order through choose_lane, each taking a slot of the lane it gets
    (what the dispatcher does): the decisions and the lanes afterwards."""
    current = {view.id: view for view in views}
    decisions = []
    for job in jobs:
        decision = choose_lane(list(current.values()), job, settings)
        decisions.append(decision)
        if decision.lane is not None:
            lane = current[decision.lane]
            current[decision.lane] = lane.model_copy(update={"in_flight": lane.in_flight + 1})
    return decisions, list(current.values())


def test_dispatching_a_queue_fills_by_rank_then_holds():
    decisions, after = dispatch_jobs(lanes(), [LaneJob()] * 8, SETTINGS)
    assert [d.lane or d.hold for d in decisions] == (["a1-arm64"] * 2 + ["x86-spill"] * 4 + ["local_spill_not_reached"] * 2)
    assert [(v.id, v.in_flight) for v in after] == [("a1-arm64", 2), ("x86-spill", 4), ("local", 0)]
    # A stale job then takes the local slot; the next one finds nothing.
    decisions, after = dispatch_jobs(after, [LaneJob(waited_s=901)] * 2, SETTINGS)
    assert [d.lane or d.hold for d in decisions] == ["local", "no_free_slots"]


def test_lane_views_join_declared_lanes_with_the_snapshot():
    desired = load_desired(EXAMPLE_FLEET)
    hosts = [SnapshotNode(node_id=h, tier="cpu_ffmpeg", max_concurrent_tasks=4) for h in ("a1-arm64", "x86-spill", "lux")]
    snap = Snapshot(nodes=hosts, lanes=[SnapshotLane(id="x86-spill", in_flight=3), SnapshotLane(id="not-declared", in_flight=9)])
    views = lane_views(desired, snap)
    assert [(v.id, v.kind, v.rank, v.cap, v.in_flight, v.available) for v in views] == [
        ("a1-arm64", "compute", 10, 2, 0, True),  # missing from the snapshot's lanes: idle
        ("x86-spill", "compute", 20, 4, 3, True),
        ("local", "local", 99, 1, 0, True),
    ]


# --------------------------------------------------------------------------
# Property: the choice is the minimum of the sort key among eligible lanes


@st.composite
def lane_sets(draw):
    count = draw(st.integers(1, 5))
    ids = draw(st.lists(st.sampled_from(["a", "b", "c", "d", "e", "f"]), min_size=count, max_size=count, unique=True))
    out = []
    for lane_id in ids:
        cap = draw(st.integers(1, 4))
        out.append(
            LaneView(
                id=lane_id,
                kind=draw(st.sampled_from(["compute", "compute", "local"])),
                rank=draw(st.sampled_from([10, 20, 20, 99])),
                cap=cap,
                in_flight=draw(st.integers(0, cap)),
                available=draw(st.booleans()),
            )
        )
    return out


@settings(max_examples=300, deadline=None)
@given(
    views=lane_sets(),
    waited=st.sampled_from([0, 10, 899, 900, 5000]),
    attempts=st.integers(0, 4),
)
def test_choice_is_the_minimum_sort_key_among_eligible_lanes(views, waited, attempts):
    job = LaneJob(waited_s=waited, attempts=attempts)
    decision = choose_lane(views, job, SETTINGS)

    # The rules, restated independently of the implementation.
    spent = attempts >= SETTINGS.cloud_attempts
    cloud_online = any(v.available for v in views if v.kind == "compute")
    gate_open = (not cloud_online) or spent or waited >= SETTINGS.local_spill_after_s
    free = [v for v in views if v.available and v.in_flight < v.cap]
    eligible = [v for v in free if (v.kind == "local" and gate_open) or (v.kind == "compute" and not spent)]
    assert {v.id for v in eligible} == {v.id for v in eligible_lanes(views, job, SETTINGS)}

    if eligible:
        best = min(eligible, key=lambda v: (v.rank, Fraction(v.in_flight, v.cap), v.id))
        assert decision == LaneDecision(best.id, None)
        assert all(sort_key(best) <= sort_key(v) for v in eligible)
    else:
        assert decision.lane is None
        if spent:
            assert decision.hold == "cloud_attempts_exhausted"
        elif any(v.kind == "local" for v in free) and cloud_online and waited < SETTINGS.local_spill_after_s:
            assert decision.hold == "local_spill_not_reached"
        else:
            assert decision.hold == "no_free_slots"


ROUTED = SchedulerSettings(local_spill_after_s=900, cloud_attempts=3, cloud_route_threshold_s=600)
ROUTE_TABLE = [
    # (id, lanes, duration_s, lane, hold)
    ("a short job goes local at once, cloud slots free or not", lanes(), 599.9, "local", None),
    ("a job at the threshold may go to the cloud", lanes(), 600, "a1-arm64", None),
    ("a job of unknown duration may go to the cloud", lanes(), None, "a1-arm64", None),
    ("a short job never spills to the cloud when local is full", lanes(local=FULL_LOCAL), 30, None, "no_free_slots"),
    ("a short job waits for a local lane that is offline", lanes(local=OFF), 30, None, "no_free_slots"),
    ("a long job still waits for the spill gate", lanes(a1=FULL_A1, x86=FULL_X86), 3600, None, "local_spill_not_reached"),
]


@pytest.mark.parametrize("views, duration, lane, hold", [r[1:] for r in ROUTE_TABLE], ids=[r[0] for r in ROUTE_TABLE])
def test_the_cloud_route_threshold_keeps_short_jobs_local(views, duration, lane, hold):
    assert choose_lane(views, LaneJob(duration_s=duration), ROUTED) == LaneDecision(lane=lane, hold=hold)


def test_without_a_threshold_every_job_may_go_to_the_cloud():
    assert choose_lane(lanes(), LaneJob(duration_s=1), SETTINGS) == LaneDecision(lane="a1-arm64", hold=None)


def test_a_short_job_is_never_eligible_for_a_compute_lane():
    assert [v.id for v in eligible_lanes(lanes(), LaneJob(duration_s=10), ROUTED)] == ["local"]
