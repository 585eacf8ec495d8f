"""Steering phaze's lanes (core.scheduling.lane_steering), a table of steps,
then the control host's backends.toml and the timeline from the plan's
steering, and the leader deciding it from its live lane views."""

from __future__ import annotations

import tomllib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.live.models import FleetPlan, LaneSteering, LaneView, SteeredLane, SteeringChange
from reconciler.core.render.artifacts import render
from reconciler.core.render.plan_part import plan_part
from reconciler.core.scheduling.lane_steering import decide_steering
from reconciler.core.views.timeline import FleetHistory, timeline
from tests.conftest import EXAMPLE_FLEET
from tests.support.render import facts, golden_plan

T0 = datetime(2026, 12, 2, 6, 0, 0, tzinfo=UTC)
WINDOW, INTERVAL = 120, 600


def view(lane: str, dead: str | None = None, *, workers: int | None = 1, kind: str = "compute") -> LaneView:
    """A lane view as lane_views gives it: offline with `dead` as its reason, else online."""
    return LaneView(id=lane, kind=kind, rank=10, cap=2, in_flight=0, available=dead is None, reason=dead, queue=f"q-{lane}", workers=workers)  # type: ignore[arg-type]


def lanes(a1: str | None = None, x86: str | None = None, *, a1_workers: int | None = 1) -> list[LaneView]:
    return [view("a1-arm64", a1, workers=a1_workers), view("x86-spill", x86), view("local", kind="local")]


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def run(steps: list[tuple[float, list[LaneView]]], start: LaneSteering | None = None) -> list[LaneSteering]:
    seen, steering = [], start or LaneSteering()
    for seconds, views in steps:
        steering = decide_steering(steering, views, at(seconds), window_s=WINDOW, interval_s=INTERVAL)
        seen.append(steering)
    return seen


DEAD = "no SAQ worker on phaze-agent-a1-arm64-analyze"

# (what happens, steps as (second, views), the lanes out after each step, changes at the last step)
TABLE = [
    ("healthy lanes: nothing watched, nothing out", [(0, lanes()), (300, lanes())], [[], []], []),
    (
        "dead for the window: left out, with the reason it died with",
        [(0, lanes(a1=DEAD)), (60, lanes(a1="host a1-arm64 offline since 05:59:40")), (120, lanes(a1=DEAD))],
        [[], [], ["a1-arm64"]],
        [("a1-arm64", True, f"dead since 06:00:00: {DEAD}")],
    ),
    ("dead shorter than the window: stays in", [(0, lanes(a1=DEAD)), (119, lanes(a1=DEAD))], [[], []], []),
    (
        "a flap restarts the window",
        [(0, lanes(a1=DEAD)), (100, lanes()), (110, lanes(a1=DEAD)), (200, lanes(a1=DEAD)), (230, lanes(a1=DEAD))],
        [[], [], [], [], ["a1-arm64"]],
        [("a1-arm64", True, f"dead since 06:01:50: {DEAD}")],
    ),
    (
        "a broker not read (no workers known) changes and starts nothing",
        [(0, lanes(a1="host a1-arm64 suspected", a1_workers=None)), (500, lanes(a1="host a1-arm64 suspected", a1_workers=None))],
        [[], []],
        [],
    ),
    (
        "every compute lane dead: left out together, the local lane stays",
        [(0, lanes(a1=DEAD, x86="fabric-agent-x86-spill.service failed")), (120, lanes(a1=DEAD, x86="fabric-agent-x86-spill.service failed"))],
        [[], ["a1-arm64", "x86-spill"]],
        [("a1-arm64", True, f"dead since 06:00:00: {DEAD}"), ("x86-spill", True, "dead since 06:00:00: fabric-agent-x86-spill.service failed")],
    ),
]


@pytest.mark.parametrize(("what", "steps", "outs", "changes"), TABLE, ids=[row[0] for row in TABLE])
def test_steering_table(what, steps, outs, changes) -> None:
    seen = run(steps)
    assert [s.out_ids() for s in seen] == outs
    last = seen[-1]
    fresh = [(c.lane, c.out, c.reason) for c in last.recent if c.at == last.changed_at] if last.changed_at == at(steps[-1][0]) else []
    assert fresh == changes


def test_a_lane_out_comes_back_when_healthy_for_the_window_but_not_before_the_restart_interval() -> None:
    start = LaneSteering(
        out=[SteeredLane(id="a1-arm64", since=at(0), reason=DEAD)],
        changed_at=at(0),
        recent=[SteeringChange(at=at(0), lane="a1-arm64", out=True, reason=DEAD)],
    )
    seen = run([(10, lanes()), (130, lanes()), (599, lanes()), (600, lanes())], start)
    # Healthy since 10 s: due at 130 s, but the last change (a restart of
    # phaze's control units) was at 0 s: it waits for 600 s, still watched.
    assert [s.out_ids() for s in seen] == [["a1-arm64"], ["a1-arm64"], ["a1-arm64"], []]
    assert [w.id for w in seen[2].watching] == ["a1-arm64"] and seen[2].changed_at == at(0)
    assert seen[3].changed_at == at(600) and seen[3].watching == []
    assert (seen[3].recent[-1].lane, seen[3].recent[-1].out, seen[3].recent[-1].reason) == ("a1-arm64", False, "healthy since 06:00:10")


def test_the_last_lane_of_backends_toml_is_never_left_out() -> None:
    only = [view("a1-arm64", DEAD)]
    seen = run([(0, only), (500, only)])
    assert seen[-1].out_ids() == [] and [w.id for w in seen[-1].watching] == ["a1-arm64"]


def test_a_lane_no_longer_declared_is_forgotten() -> None:
    start = LaneSteering(out=[SteeredLane(id="gone", since=at(0), reason=DEAD)], changed_at=at(0))
    assert run([(5, lanes())], start)[-1].out_ids() == []


# --------------------------------------------------------------------------
# The control host renders what the plan's steering says; the timeline says why.


def steered_plan(*out: str, reason: str = DEAD) -> FleetPlan:
    return golden_plan(
        steering=LaneSteering(
            out=[SteeredLane(id=lane, since=at(120), reason=reason) for lane in out],
            changed_at=at(120),
            recent=[SteeringChange(at=at(120), lane=lane, out=True, reason=f"dead since 06:00:00: {reason}") for lane in out],
        )
    )


def backends(plan: FleetPlan) -> list[str]:
    rendered = {a.path: a for a in render(load_desired(EXAMPLE_FLEET), "lux", facts("lux"), plan).artifacts}
    return [b["id"] for b in tomllib.loads(rendered["etc/phaze/backends.toml"].content)["backends"]]


def test_the_control_hosts_backends_toml_leaves_out_the_lanes_the_plan_steers_out_and_only_its_part_changes() -> None:
    desired = load_desired(EXAMPLE_FLEET)
    assert backends(golden_plan()) == ["a1-arm64", "x86-spill", "local"]
    assert backends(steered_plan("a1-arm64")) == ["x86-spill", "local"]
    # Only the control host's part moves, so only its pass starts (fabric watch).
    moved = {h for h in desired.hosts if plan_part(desired, golden_plan(), h).digest != plan_part(desired, steered_plan("a1-arm64"), h).digest}
    assert moved == {"lux"}
    # The restart of phaze's control units rides on the file's change.
    artifact = next(a for a in render(desired, "lux", facts("lux"), steered_plan("a1-arm64")).artifacts if a.path == "etc/phaze/backends.toml")
    assert artifact.restarts == ("phaze-api.service", "phaze-worker.service")


def test_a_plan_naming_no_declared_compute_lane_or_every_lane_changes_nothing() -> None:
    notes: list[str] = []
    desired = load_desired(EXAMPLE_FLEET)
    assert plan_part(desired, steered_plan("local", "nope"), "lux", notes).lanes_out == ()
    assert any("'nope'" in n for n in notes) and any("'local'" in n for n in notes)
    assert backends(steered_plan("a1-arm64", "x86-spill")) == ["local"]


def test_each_change_is_an_event_on_the_timeline_with_its_reason() -> None:
    events = timeline(FleetHistory(), steered_plan("a1-arm64"))
    steering = [e for e in events if e.kind == "lane_out"]
    assert [(e.subject, e.title, e.detail) for e in steering] == [
        ("a1-arm64", "a1-arm64 left out of phaze's backends.toml", f"dead since 06:00:00: {DEAD}")
    ]


# --------------------------------------------------------------------------
# The leader decides it from the lane views of its live snapshot.


def test_the_leader_leaves_a_lane_without_a_worker_out_after_the_window(tmp_path: Path) -> None:
    """The leader's step: a1-arm64's queue has no SAQ worker (the broker's
    saq_stats, through the LaneBroker port) -> its lane view is offline ->
    after the steering window the published plan leaves it out, and the log
    says why. Liveness comes only from the leader's snapshot (registry
    heartbeats and unit states) and the broker's lane states."""
    from reconciler.core.desired.model import lane_queue_name
    from reconciler.core.scheduling.placement import schedule
    from reconciler.engine.leader import LeaderLoop
    from tests.support.fakes import FakeLaneBroker
    from tests.support.plan_keys import signed_example_fleet
    from tests.support.registry_store import beating_registry

    fleet = signed_example_fleet(tmp_path / "fleet")
    toml = fleet.desired / "fabric.toml"
    toml.write_text(toml.read_text().replace('push_ssh_user = "phaze"\n', 'push_ssh_user = "phaze"\nsteering_window_s = 0\n'))
    desired = load_desired(fleet.desired)
    assert desired.fleet.phaze_dispatches and desired.fleet.phaze.steering_window_s == 0
    broker = FakeLaneBroker(workers={lane_queue_name(desired.fleet, lane): 1 for lane in desired.lanes if lane.id != "a1-arm64"})
    log: list[str] = []
    with beating_registry(tmp_path, fleet) as registry:
        loop = LeaderLoop(
            registry=registry,
            host="lux",
            load_desired=lambda: desired,
            schedule=schedule,
            lease_ttl_s=30,
            log=log.append,
            signer=fleet.signer("lux"),
            lane_broker=broker,
        )
        loop.step()
        plan = registry.newest_plan()
    assert plan is not None
    assert plan.steering.out_ids() == ["a1-arm64"], log
    assert any(
        line.startswith("lane a1-arm64 left out of phaze's backends.toml: dead since") and "no SAQ worker on phaze-agent-a1-arm64-analyze" in line
        for line in log
    ), log
    assert backends(plan) == ["x86-spill", "local"]
