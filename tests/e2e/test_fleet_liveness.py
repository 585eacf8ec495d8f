"""Route around a dead node in seconds (issue 30's fleet Done-when, in part).

The harness of tests/e2e/conftest.py with the production timer (every
host's fabric-reconcile.timer at 30 s, a beat per pass; a node timeout of
two intervals, 60 s, as bench/convergence's default: the seed's 90 s adds
nothing a scenario checks but half a minute of waiting for the singleton)
and every host's fabric-watch.service on, keeping its fast liveness record
alive every [timing] liveness_s. In order:

    liveness      every host's watcher keeps its record alive in the
                  registry (etcd: P/liveness/<host> on a lease of its own)
    power-off     the host serving vaapi-encode, made the leader first
                  (a candidate: lux), powers off: the other candidate takes
                  its live term over once its host's liveness record lapsed
                  (not when the term goes stale), its first step suspects
                  the dead host and hedges the service on another host, and
                  the edge answers from there while the lost node is still
                  only suspected (active in the registry, its own placement
                  still in the plan); how long after the power-off is
                  printed beside the goal (10 s; the figures of every
                  phase: bench/convergence --victim leader)

    paused 3 s    the host serving vaapi-encode is frozen for 3 s (its
                  container's cgroup, every process): its liveness record
                  (lapsing liveness_ttl_s after the last keep-alive) never
                  lapses, so no plan published meanwhile hedges anything,
                  the leader remembers no suspicion, nothing restarts
    back in time  frozen until the leader hedges vaapi-encode, then thawed:
                  the node recovers, the hedge stays [flap] window_s (short
                  here) and then leaves; the service's unit on the node kept
                  its InvocationID (nothing restarted)
    blinking      the host serving vaapi-encode is frozen and thawed [flap]
                  toggles times within window_s: the third suspicion holds
                  it off, its hedge is added once and kept (not removed and
                  added again on every blink: the plans are counted)
    singleton     braid, declared `singleton = true` here: its host powers
                  off, is suspected, and braid is never hedged; it moves
                  only once the node is offline at the node timeout (last:
                  vaapi-encode's hedge then becomes its placement, often on
                  the leader, which the freezing scenarios avoid)

The scenarios share one fleet; each begins from a quiet fleet (no suspect,
no hedge: `wait_quiet`) and thaws or restarts what it froze or powered off.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan
from reconciler.core.scheduling.lanes import agent_unit
from reconciler.core.timestamps import utc
from tests.e2e.fleet import (
    HOST_OCTETS,
    Fleet,
    FleetSettings,
    converged,
    first_answer,
    lead_on,
    node_status,
    placed,
    span_seconds,
    unit_invocation,
    wait_for,
)
from tests.support.harness.waiting import deadline_for

# A short [flap] window (the stable window of a recovered node's hedges, and
# the window its suspicions count as flaps in), so the scenarios of a node
# back in time and a blinking one fit a test; braid may never run twice.
FLEET_SETTINGS = FleetSettings(
    pass_interval="30s",
    heartbeat_s=30,
    node_timeout_s=60,
    watcher=True,
    flap_window_s=45,
    flap_toggles=3,
    hold_off_s=60,
    singletons=("braid",),
)
INTERVAL_S = span_seconds(FLEET_SETTINGS.pass_interval)
HOSTS = tuple(HOST_OCTETS)
SERVICE = "vaapi-encode"
SINGLETON = "braid"
ROUTE = "encode.researchstack.info"
CONVERGE_S = deadline_for(3 * INTERVAL_S)
# The leader's periodic step while it leads (three per lease TTL, the heartbeat).
LEADER_STEP_S = FLEET_SETTINGS.heartbeat_s / 3
# From a node's last keep-alive to the leader's plan that suspects it.
SUSPECT_S = deadline_for(FLEET_SETTINGS.liveness_ttl_s + LEADER_STEP_S)
# Until a node's memory in the plan is over: hold-off, then a window with no event.
QUIET_S = deadline_for(FLEET_SETTINGS.flap_window_s + FLEET_SETTINGS.hold_off_s + LEADER_STEP_S)
PAUSE_S = 3.0
# Issue 30's goal, printed beside the figure (tests assert behaviour).
SERVED_AFTER_POWER_OFF_S = 10.0


def wait_converged(fleet: Fleet, desired: DesiredState) -> FleetPlan:
    def one_placement() -> FleetPlan | None:
        plan = converged(fleet, desired, HOSTS)
        return plan if plan is not None and len(placed(plan).get(SERVICE, [])) == 1 else None

    return wait_for(one_placement, timeout=CONVERGE_S, what="convergence, one placement of vaapi-encode", interval=0.5)


def test_every_hosts_watcher_keeps_its_liveness_record_alive(fleet: Fleet, desired: DesiredState) -> None:
    def records() -> set[str] | None:
        with fleet.registry() as registry:
            hosts = {r.host for r in registry.liveness()}
        return hosts if hosts == set(HOSTS) else None

    wait_for(records, timeout=deadline_for(FLEET_SETTINGS.liveness_ttl_s, at_least=60), what="a liveness record of every host", interval=0.5)


def test_a_powered_off_leader_is_served_from_another_host_while_it_is_still_only_suspected(fleet: Fleet, desired: DesiredState) -> None:
    plan = wait_converged(fleet, desired)
    (victim,) = placed(plan)[SERVICE]
    candidates = desired.fleet.fleet.leader_candidates
    assert victim in candidates, f"{SERVICE} runs on {victim}, not a leader candidate: the scenario powers off the leader's host"
    lead_on(fleet, victim, timeout=deadline_for(FLEET_SETTINGS.heartbeat_s))
    with fleet.registry() as registry:
        held = registry.leader_term()
    assert held is not None and held.candidate == victim
    powered_off = datetime.now(UTC)
    fleet.stop_host(victim)

    def from_another_host(status: int, body: str) -> bool:
        return status == 200 and body.strip().startswith(f"{SERVICE} on ") and not body.strip().endswith(f" on {victim}")

    try:
        served = first_answer(
            lambda: fleet.request(ROUTE, timeout=1.0),
            from_another_host,
            timeout=deadline_for(FLEET_SETTINGS.node_timeout_s),
            what=f"{ROUTE} served by another host than {victim}",
        )
        with fleet.registry() as registry:
            state = next(s for s in registry.node_states() if s.node_id == victim)
            hedged = registry.newest_plan()
        assert hedged is not None
        offline = [utc(t.at) for t in state.transitions if t.status == "offline" and utc(t.at) >= powered_off]
        assert not offline or offline[0] > served, f"{victim} went offline before the answer from elsewhere: not served while suspected"
        suspect = hedged.suspects.get(victim)
        assert suspect is not None and any(e.kind == "suspicion" and "liveness lapsed" in e.detail for e in suspect.events), hedged.suspects
        assert any(e.kind == "hedge" for e in suspect.events)
        hedges = [p for p in hedged.placements if p.service == SERVICE and p.hedge == victim]
        assert len(hedges) == 1 and hedges[0].node != victim, hedged.placements
        assert (SERVICE, victim) in {(p.service, p.node) for p in hedged.placements if p.hedge is None} or state.status != "active", (
            "the suspect's own placement stays while it is only suspected"
        )
        # The successor took the live term over at the lapse: it did not wait
        # for the record to go stale (the lease TTL, the heartbeat).
        successor = hedged.leader
        assert successor != victim and successor in candidates, hedged.leader
        said = fleet.journal(successor, "-u", "fabric-leader.service", "-o", "cat")
        assert f"takes over from {victim}" in said, f"{successor} did not take {victim}'s term over at its host's lapse"
        after = (served - powered_off).total_seconds()
        print(
            f"served by {hedges[0].node} {after:.1f} s after the power-off of {victim}, the leader's host; "
            f"{successor} took its term over (goal {SERVED_AFTER_POWER_OFF_S:g} s; lease TTL {FLEET_SETTINGS.heartbeat_s} s)"
        )
    finally:
        fleet.start_host(victim)


# --------------------------------------------------------------------------
# The other scenarios: a pause, a recovery, a singleton, a blinking node


class Plans:
    """Every plan seen while a scenario runs (the newest, read every `every` s)
    in epoch order: what the scenarios count and search for hedges."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.seen: dict[int, FleetPlan] = {}

    def newest(self) -> FleetPlan | None:
        with self.fleet.registry() as registry:
            plan = registry.newest_plan()
        if plan is not None:
            self.seen.setdefault(plan.epoch, plan)
        return plan

    def until(self, accept: Callable[[FleetPlan], bool], *, timeout: float, what: str) -> FleetPlan:
        def accepted() -> FleetPlan | None:
            plan = self.newest()
            return plan if plan is not None and accept(plan) else None

        return wait_for(accepted, timeout=timeout, what=what, interval=0.2)

    def watch(self, seconds: float) -> FleetPlan | None:
        """Read the plans for `seconds` (a window in which nothing may happen)."""
        end = time.monotonic() + seconds
        plan = self.newest()
        while time.monotonic() < end:
            time.sleep(0.2)
            plan = self.newest()
        return plan

    def in_order(self) -> list[FleetPlan]:
        return [self.seen[epoch] for epoch in sorted(self.seen)]


def hedges_of(plan: FleetPlan, node: str) -> set[tuple[str, str]]:
    """(service, where) of each hedge of `node`'s placements in `plan`."""
    return {(p.service, p.node) for p in plan.placements if p.hedge == node}


def suspected_now(plan: FleetPlan, node: str) -> bool:
    state = plan.suspects.get(node)
    return state is not None and state.since is not None


def wait_quiet(fleet: Fleet, desired: DesiredState) -> FleetPlan:
    """A converged fleet the leader remembers no suspect of and no hedge in
    (a former scenario's memory over), every host active."""

    def quiet() -> FleetPlan | None:
        plan = converged(fleet, desired, HOSTS)
        if plan is None or plan.suspects or any(p.hedge is not None for p in plan.placements):
            return None
        if len(placed(plan).get(SERVICE, [])) != 1 or set(node_status(fleet).values()) != {"active"}:
            return None
        return plan

    return wait_for(quiet, timeout=QUIET_S + CONVERGE_S, what="a quiet fleet: converged, no suspect, no hedge", interval=0.5)


def serving_host(plan: FleetPlan) -> str:
    """The host of vaapi-encode, which the freezing scenarios pause: not the
    leader's (a frozen leader hedges nothing until its lease goes stale)."""
    (host,) = placed(plan)[SERVICE]
    assert host != plan.leader, f"{SERVICE} runs on the leader {host}: the freezing scenarios need it on a follower"
    return host


def test_a_node_paused_for_3_s_moves_nothing(fleet: Fleet, desired: DesiredState) -> None:
    before = wait_quiet(fleet, desired)
    victim = serving_host(before)
    units = {agent_unit(s): unit_invocation(fleet, victim, agent_unit(s)) for s, nodes in placed(before).items() if victim in nodes}
    plans = Plans(fleet)
    fleet.pause_host(victim)
    try:
        # The scenario's input: how long the machine stalls (not a wait for a condition).
        plans.watch(PAUSE_S)
    finally:
        fleet.resume_host(victim)
    # Long enough for a lapse to be seen: its record's TTL from the resume,
    # then the leader's step (a suspicion stays in the plan a whole window).
    after = plans.watch(FLEET_SETTINGS.liveness_ttl_s + LEADER_STEP_S)
    assert after is not None
    hedged = [(plan.epoch, hedges_of(plan, victim)) for plan in plans.in_order() if hedges_of(plan, victim)]
    assert not hedged, f"a 3 s pause of {victim} hedged its work: {hedged}"
    assert victim not in after.suspects, f"a 3 s pause made {victim} suspected: {after.suspects[victim]}"
    assert placed(after) == placed(before), "something moved"
    assert {u: unit_invocation(fleet, victim, u) for u in units} == units, f"a unit restarted on {victim}"
    print(f"{victim} paused {PAUSE_S:g} s: {len(plans.seen)} plan(s) seen, no suspicion, no hedge")


def test_a_node_back_within_the_timeout_loses_its_hedges_after_the_stable_window(fleet: Fleet, desired: DesiredState) -> None:
    before = wait_quiet(fleet, desired)
    victim = serving_host(before)
    unit = agent_unit(SERVICE)
    invocation = unit_invocation(fleet, victim, unit)
    assert invocation, f"{unit} is not running on {victim}"
    plans = Plans(fleet)
    fleet.pause_host(victim)
    try:
        hedged = plans.until(lambda p: bool(hedges_of(p, victim)), timeout=SUSPECT_S, what=f"a hedge of {victim}'s {SERVICE}")
    finally:
        fleet.resume_host(victim)
    assert suspected_now(hedged, victim) and (SERVICE, victim) in {(p.service, p.node) for p in hedged.placements if p.hedge is None}
    recovered = plans.until(
        lambda p: not suspected_now(p, victim), timeout=SUSPECT_S, what=f"{victim} recovered (its liveness record kept alive again)"
    )
    state = recovered.suspects[victim]
    assert state.cleared_at is not None and state.events[-1].kind == "recovery", state
    assert hedges_of(recovered, victim) == hedges_of(hedged, victim), "the hedge left at the recovery, not after the stable window"
    unhedged = plans.until(
        lambda p: not hedges_of(p, victim),
        timeout=deadline_for(FLEET_SETTINGS.flap_window_s + LEADER_STEP_S),
        what=f"{victim}'s hedges removed after the stable window",
    )
    kept_s = (utc(unhedged.created) - utc(state.cleared_at)).total_seconds()
    assert kept_s >= FLEET_SETTINGS.flap_window_s, f"the hedge left {kept_s:.1f} s after the recovery, within the stable window"
    assert placed(unhedged)[SERVICE] == [victim], placed(unhedged)
    assert unit_invocation(fleet, victim, unit) == invocation, f"{unit} restarted on {victim}"
    print(
        f"{victim} back: its hedge {sorted(hedges_of(hedged, victim))} removed {kept_s:.1f} s after the recovery (window {FLEET_SETTINGS.flap_window_s} s)"
    )


def test_a_blinking_node_is_held_off_by_flap_damping_not_churned(fleet: Fleet, desired: DesiredState) -> None:
    before = wait_quiet(fleet, desired)
    victim = serving_host(before)
    unit = agent_unit(SERVICE)
    invocation = unit_invocation(fleet, victim, unit)
    plans = Plans(fleet)
    toggles = FLEET_SETTINGS.flap_toggles
    for blink in range(1, toggles + 1):
        fleet.pause_host(victim)
        try:
            plans.until(
                lambda p, n=blink: suspected_now(p, victim) and len(p.suspects[victim].suspicions) >= n,
                timeout=SUSPECT_S,
                what=f"{victim}'s suspicion {blink}",
            )
        finally:
            fleet.resume_host(victim)
        if blink < toggles:
            plans.until(lambda p: not suspected_now(p, victim), timeout=SUSPECT_S, what=f"{victim} back after blink {blink}")
    held = plans.until(lambda p: p.suspects[victim].held_off_until is not None, timeout=SUSPECT_S, what=f"{victim} held off")
    state = held.suspects[victim]
    assert any("held off" in e.detail for e in state.events), state.events
    # Until its recovery from the last blink: the hedge stays while it is held off.
    settled = plans.until(lambda p: not suspected_now(p, victim), timeout=SUSPECT_S, what=f"{victim} back after the last blink")
    assert hedges_of(settled, victim), f"{victim} is held off but its hedge left"
    series = [frozenset(hedges_of(plan, victim)) for plan in plans.in_order()]
    changes = sum(1 for a, b in zip(series, series[1:], strict=False) if a != b)
    first = next(i for i, hedges in enumerate(series) if hedges)
    assert all(series[first:]), f"the hedge of {victim} was removed and added again while it blinked: {series}"
    assert changes == 1, f"the hedges of {victim} changed {changes} times over {len(series)} plans: {series}"
    assert victim in placed(settled)[SERVICE], placed(settled)
    assert unit_invocation(fleet, victim, unit) == invocation, f"{unit} restarted on {victim}"
    print(f"{victim} blinked {toggles} times: held off until {state.held_off_until}, {len(series)} plans, its hedge changed {changes} time(s)")


def test_a_singleton_service_is_not_hedged_and_moves_only_at_the_node_timeout(fleet: Fleet, desired: DesiredState) -> None:
    singleton = desired.service(SINGLETON)
    assert singleton is not None and singleton.singleton, SINGLETON
    before = wait_quiet(fleet, desired)
    (victim,) = placed(before)[SINGLETON]
    assert victim != fleet.edge, "braid on the edge: powering it off would take the routes with it"
    plans = Plans(fleet)
    fleet.stop_host(victim)
    try:
        suspect = plans.until(
            lambda p: suspected_now(p, victim), timeout=deadline_for(FLEET_SETTINGS.heartbeat_s + SUSPECT_S), what=f"{victim} suspected"
        )
        moved = plans.until(
            lambda p: victim not in placed(p).get(SINGLETON, [victim]),
            timeout=deadline_for(FLEET_SETTINGS.node_timeout_s),
            what=f"{SINGLETON} moved off {victim}",
        )
        with fleet.registry() as registry:
            state = next(s for s in registry.node_states() if s.node_id == victim)
        offline = [utc(t.at) for t in state.transitions if t.status == "offline" and utc(t.at) >= utc(suspect.created)]
        assert offline and offline[0] <= utc(moved.created), f"{SINGLETON} moved before {victim} went offline: {state.transitions}"
        for plan in plans.in_order():
            assert not [p for p in plan.placements if p.service == SINGLETON and p.hedge is not None], f"epoch {plan.epoch} hedged {SINGLETON}"
            if plan.epoch < moved.epoch:
                assert placed(plan).get(SINGLETON) == [victim], f"epoch {plan.epoch} moved {SINGLETON} before the node timeout"
        after_s = (offline[0] - utc(suspect.created)).total_seconds()
        print(
            f"{SINGLETON}: {victim} suspected, not hedged; moved to {placed(moved)[SINGLETON]} at the node timeout, {after_s:.1f} s after the suspicion"
        )
    finally:
        fleet.start_host(victim)
