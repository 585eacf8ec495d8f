"""React in a second, not at the next timer tick (issue 14's fleet Done-when).

The harness of tests/e2e/conftest.py with this module's own settings: every
host's fabric-reconcile.timer at the production interval (30 s), heartbeats
at that pace (one per pass) and a node timeout of two of them, and every
host's fabric-watch.service on. In order:

    a plan between ticks   a drain moves vaapi-encode while every host's timer
                           is far from its next tick: the hosts it concerns
                           (the drained one, the replacement, the edge) start
                           their pass within 1 s of the plan's publication,
                           started by their watcher, and that pass applied
                           it (stopped, started, loaded Caddy) before their
                           timer's next tick; a host it does not concern
                           starts none before that tick
    node loss              the host serving vaapi-encode powers off: it is
                           offline at its lapse, the moving plan published at
                           once, and the replacement and the edge take it
                           (a pass started within 1 s, or a running one read
                           it or took it into another round), and the first answer
                           from the replacement through the edge comes within
                           1 s of the service up there and Caddy loaded
    the timer alone        every watcher stopped: a drain's plan is still
                           applied, by the timers' passes, within an interval
    the registry away      etcd stopped for an interval: every host's timer
                           keeps passing, each pass fails static and says so,
                           nothing is torn down, and each watcher says the
                           registry is unreachable and backs off; etcd back,
                           a drain at once (the watchers still backing off) is
                           applied by the hosts it concerns within an
                           interval, by their timers or their watchers

The figures of every phase are bench/convergence --interval 30s's. These
tests assert what the fabric decides: who acts, on what, and how soon it
starts (each affected host's pass within 1 s of the plan's publication; it
takes some 0.1 s). Two of issue 14's goals they print beside the goal but
do not assert: a plan between ticks applied within 1 s of its publication,
and a node loss served within node timeout + 2 s of the last beat. Both end
in CPU: the passes a plan starts (three to five, some 0.5 CPU-s each, most
of it Python's imports) share this machine's two cores with the rest of the
fleet, which has put the slowest host's move at 0.7-1.1 s and the first
answer 1.3-1.9 s after the timeout, margins that a busier machine takes
away (tests assert behaviour; benchmarks measure speed).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan
from reconciler.core.timestamps import utc
from tests.e2e.fleet import (
    ACTED_ON_S,
    FAR_S,
    HOST_OCTETS,
    SERVED_AFTER_TIMEOUT_S,
    Fleet,
    FleetSettings,
    agent_unit,
    align_timers,
    caddy_loads,
    converged,
    drain,
    edge_reaches,
    first_after,
    first_answer,
    last_timer_trigger,
    move_applied,
    newest_plan,
    pass_running,
    pass_starts,
    placed,
    plan_moving,
    plan_taken,
    routed_services,
    running_agents,
    span_seconds,
    static_passes,
    undrain,
    unit_active_since,
    unit_invocation,
    wait_for,
    watcher_says,
    watcher_starts,
)
from tests.support.harness.waiting import deadline_for

pytestmark = pytest.mark.e2e

# No fast liveness (issue 30): these scenarios are the node timeout's, as
# with every fast source off (test_fleet_liveness.py: with it on).
FLEET_SETTINGS = FleetSettings(pass_interval="30s", heartbeat_s=30, node_timeout_s=60, watcher=True, liveness_s=0)
INTERVAL_S = span_seconds(FLEET_SETTINGS.pass_interval)
HOSTS = tuple(HOST_OCTETS)
SERVICE = "vaapi-encode"
ROUTE = "encode.researchstack.info"
UNIT = agent_unit(SERVICE)
# The leader steps three times per lease TTL (timing.heartbeat_s) when
# nothing wakes it.
LEADER_STEP_S = FLEET_SETTINGS.heartbeat_s / 3
# A fleet of passes at 30 s converges within a few intervals (a restarted
# agent shows in the next beat; the edge in its next pass).
CONVERGE_S = deadline_for(3 * INTERVAL_S)


def wait_converged(fleet: Fleet, desired: DesiredState, hosts: tuple[str, ...] = HOSTS) -> FleetPlan:
    return wait_for(lambda: converged(fleet, desired, hosts), timeout=CONVERGE_S, what=f"convergence of {', '.join(hosts)}", interval=0.5)


def placed_on(plan: FleetPlan, host: str) -> set[str]:
    return {p.service for p in plan.placements if p.node == host}


def unconcerned_hosts(fleet: Fleet, before: FleetPlan, after: FleetPlan, drained: str) -> tuple[str, ...]:
    """The hosts whose services `after` leaves as `before` placed them, other
    than the drained one and the edge (whose upstreams moved)."""
    return tuple(host for host in HOSTS if host not in (drained, fleet.edge) and placed_on(before, host) == placed_on(after, host))


# --------------------------------------------------------------------------


def test_every_host_runs_its_watcher_beside_the_production_timer(fleet: Fleet, desired: DesiredState) -> None:
    wait_converged(fleet, desired)
    for host in HOSTS:
        container = fleet.container(host)
        assert container.systemctl("is-active", "fabric-watch.service").stdout.strip() == "active", host
        shown = container.systemctl("show", "-p", "TimersMonotonic", "fabric-reconcile.timer").stdout
        assert "OnUnitActiveUSec=30s" in shown, shown


def test_a_plan_published_far_from_every_tick_is_applied_by_the_passes_its_hosts_watchers_start_at_once(fleet: Fleet, desired: DesiredState) -> None:
    before = wait_converged(fleet, desired)
    (serving,) = placed(before)[SERVICE]
    ticks = align_timers(fleet, HOSTS, far_s=FAR_S, timeout=deadline_for(INTERVAL_S))

    drain(fleet, serving)
    try:
        plan = plan_moving(fleet, SERVICE, before, serving, timeout=deadline_for(INTERVAL_S))
        published = utc(plan.created)
        assert all(published + timedelta(seconds=FAR_S) <= tick for tick in ticks.values()), "every timer was still far from its tick"
        done = move_applied(fleet, SERVICE, plan, serving, within=deadline_for(INTERVAL_S))
        print(
            "plan between ticks applied "
            + ", ".join(f"by {host} {(applied_at - published).total_seconds():.2f} s" for host, applied_at in done.items())
            + f" after its publication (goal {ACTED_ON_S:g} s)"
        )
        for host, applied_at in done.items():
            started = first_after(pass_starts(fleet, host), published)
            by_watcher = first_after(watcher_starts(fleet, host), published)
            # The watcher logs its start once StartUnit has returned, so its
            # line may follow systemd's "Starting" by a moment.
            assert started is not None and by_watcher is not None, f"{host}: its watcher started a pass"
            assert by_watcher <= started + timedelta(seconds=ACTED_ON_S), f"{host}: its watcher started its pass"
            acted = (started - published).total_seconds()
            assert acted <= ACTED_ON_S, f"{host} started its pass {acted:.2f} s after the plan's publication (goal {ACTED_ON_S:g} s)"
            # Applied by that pass (no other started before the move was
            # done), before the timer's next tick could have. How long that
            # took is printed above; bench/convergence holds it against the
            # goal of 1 s (see the module docstring).
            later = [moment for moment in pass_starts(fleet, host) if started < moment <= applied_at]
            assert later == [], f"{host}: another pass started at {later}, before the move was applied at {applied_at}"
            assert applied_at < ticks[host], f"{host} applied the plan at {applied_at}, its timer's next tick was at {ticks[host]}"
        # A host the plan does not concern (no service moved onto or off it;
        # not the edge) starts no pass before its timer's tick: its watcher
        # read the plan and found its part as it was.
        unconcerned = unconcerned_hosts(fleet, before, plan, serving)
        assert unconcerned, f"every host was concerned by the move ({placed(before)} -> {placed(plan)}): nothing to check"
        wait_for(
            lambda: datetime.now(UTC) >= max(ticks[host] for host in unconcerned) or None,
            timeout=deadline_for(INTERVAL_S),
            what="the unconcerned hosts' timer ticks",
        )
        newest = newest_plan(fleet)
        assert newest is not None and all(placed_on(newest, host) == placed_on(plan, host) for host in unconcerned), "a later plan moved their work"
        for host in unconcerned:
            # The timer's own pass starts at its tick, not before.
            early = [moment for moment in (*pass_starts(fleet, host), *watcher_starts(fleet, host)) if published <= moment < ticks[host]]
            assert early == [], f"{host}, which the plan does not concern, started a pass at {early} (published {published}, tick {ticks[host]})"
    finally:
        undrain(fleet, serving)


def test_a_lost_node_is_offline_at_its_lapse_and_its_replacement_and_the_edge_act_at_once(fleet: Fleet, desired: DesiredState) -> None:
    """Node loss: offline when the node timeout has passed since its last
    beat (not at a later leader step), the moving plan published by that
    step, taken by the replacement and the edge (a pass started for it
    within ACTED_ON_S, or the one under way read it or took it into another
    round), and the first answer from the replacement through the edge within
    ACTED_ON_S (and Caddy's retry interval and fail memory) of the service
    up there and Caddy loaded. How long after the last beat it came is
    printed beside the goal, node timeout + SERVED_AFTER_TIMEOUT_S (each
    phase's figures: bench/convergence)."""
    plan = wait_converged(fleet, desired)
    (victim,) = placed(plan)[SERVICE]
    fleet.stop_host(victim)

    def from_the_replacement(status: int, body: str) -> bool:
        return status == 200 and body.strip().startswith(f"{SERVICE} on ") and not body.strip().endswith(f" on {victim}")

    goal = FLEET_SETTINGS.node_timeout_s + SERVED_AFTER_TIMEOUT_S
    served = first_answer(
        lambda: fleet.request(ROUTE, timeout=1.0),
        from_the_replacement,
        timeout=deadline_for(goal),
        what=f"{ROUTE} served by another host than {victim}",
    )
    with fleet.registry() as registry:
        state = next(s for s in registry.node_states() if s.node_id == victim)
        moving = registry.newest_plan()
    assert moving is not None
    last_beat = utc(state.last_seen)
    offline = next(utc(t.at) for t in reversed(state.transitions) if t.status == "offline")
    silent_for = (offline - last_beat).total_seconds()
    assert silent_for >= FLEET_SETTINGS.node_timeout_s, f"{victim} offline {silent_for:.2f} s after its last beat: before its timeout"
    # The leader's periodic step comes every LEADER_STEP_S; at the lapse is
    # well within half of one after the timeout.
    assert silent_for <= FLEET_SETTINGS.node_timeout_s + LEADER_STEP_S / 2, (
        f"{victim} offline {silent_for:.2f} s after its last beat: not at its lapse"
    )
    published = utc(moving.created)
    assert published >= offline and victim not in placed(moving).get(SERVICE, [])
    (replacement,) = placed(moving)[SERVICE]
    took: dict[str, float] = {}
    for host in (replacement, fleet.edge):
        # A pass started by its watcher, or the pass its timer started just
        # before: the lapse comes a node timeout after the lost node's last
        # pass, which the plan before aligned with the other hosts' timers,
        # so it often falls on their ticks. That pass was on its way to the
        # plan from its publication when it read it, or took it in another
        # round once it read the registry again (fleet.first_taking).
        taken = plan_taken(fleet, host, moving.epoch, published)
        assert taken is not None, f"{host}: no pass took the moving plan"
        took[host] = acted = (taken - published).total_seconds()
        if taken in pass_starts(fleet, host):
            # A pass started for it: at once.
            assert acted <= ACTED_ON_S, f"{host} started a pass for the moving plan {acted:.2f} s after its publication (goal {ACTED_ON_S:g} s)"
        # Otherwise the pass under way took it, when it read the registry or
        # in another round once it had activated: as soon as that pass's own
        # CPU let it (printed below).
    served_after = (served - last_beat).total_seconds()
    started, loaded = unit_active_since(fleet, replacement, UNIT), first_after(caddy_loads(fleet, fleet.edge), published)
    assert started is not None and loaded is not None, f"{replacement} started {SERVICE} at {started}, the edge loaded Caddy at {loaded}"
    print(
        f"node loss: {victim} offline {silent_for:.2f} s after its last beat, plan {(published - last_beat).total_seconds():.2f} s; "
        f"after the plan: {replacement} took it {took[replacement]:.2f} s, started {SERVICE} "
        f"{(started - published).total_seconds():.2f} s, the edge took it {took[fleet.edge]:.2f} s, "
        f"loaded Caddy {(loaded - published).total_seconds():.2f} s; "
        f"served by {replacement} {served_after:.2f} s after the last beat (goal {goal:g} s)"
    )
    # The edge takes the new upstream as soon as it is up: once the
    # replacement's unit is active and Caddy has its new config, a waiting
    # request is tried again every retry interval, and the upstream that just
    # appeared is not left out (fail memory); the service's process needs a
    # moment to listen. Within ACTED_ON_S of the later of the two, then; how
    # long after the last beat is printed above, not asserted (module
    # docstring: bench/convergence holds it against the goal).
    edge = desired.fleet.edge
    up = max(started, loaded)
    allowed = ACTED_ON_S + (edge.retry_interval_ms + edge.fail_memory_ms) / 1000
    # The pass logs Caddy's load once the admin API has answered: Caddy may
    # serve by its new config a moment before that line.
    assert served >= up - timedelta(seconds=edge.retry_interval_ms / 1000), (
        f"{ROUTE} served by {replacement} at {served}, before the move was applied ({up})"
    )
    after_up = (served - up).total_seconds()
    assert after_up <= allowed, (
        f"{ROUTE} first served by {replacement} {after_up:.2f} s after it was up and the edge loaded Caddy (allowed {allowed:g} s)"
    )


def test_with_every_watcher_stopped_the_hosts_converge_on_their_timers_alone(fleet: Fleet, desired: DesiredState) -> None:
    running = tuple(h for h in HOSTS if fleet.hosts[h].container is not None)
    before = wait_converged(fleet, desired, running)
    (serving,) = placed(before)[SERVICE]
    for host in running:
        fleet.container(host).systemctl("stop", "fabric-watch.service")
    try:
        drain(fleet, serving)
        plan = plan_moving(fleet, SERVICE, before, serving, timeout=deadline_for(INTERVAL_S))
        published = utc(plan.created)
        # Each host's next tick is at most an interval away (and its pass a
        # few seconds long on a loaded machine).
        done = move_applied(fleet, SERVICE, plan, serving, within=deadline_for(INTERVAL_S))
        for host in done:
            assert first_after(watcher_starts(fleet, host), published) is None, f"{host}'s watcher is stopped"
            assert first_after(pass_starts(fleet, host), published) is not None, f"{host}'s timer started a pass"
    finally:
        undrain(fleet, serving)
        for host in running:
            fleet.container(host).systemctl("start", "fabric-watch.service")


def test_with_the_registry_unreachable_the_hosts_fail_static_on_their_timers_and_converge_once_it_is_back(
    fleet: Fleet, desired: DesiredState
) -> None:
    """The registry outage (etcd stopped) for at least a timer interval: every
    running host's timer keeps passing, each pass keeps what runs and says
    so, and each watcher says the registry is unreachable and backs off (in
    its process: it neither exits nor starts a pass). Then etcd is back and
    at once a drain moves vaapi-encode, while the watchers still wait out
    their backoff: the hosts it concerns apply the move within an interval,
    by their timer or their reconnected watcher, whichever came first (which
    one depends on where each watcher's backoff stood: printed, not asserted)."""
    running = tuple(h for h in HOSTS if fleet.hosts[h].container is not None)
    before = wait_converged(fleet, desired, running)
    (serving,) = placed(before)[SERVICE]
    agents = {host: running_agents(fleet, host) for host in running}
    watchers = {host: unit_invocation(fleet, host, "fabric-watch.service") for host in running}

    stopping = datetime.now(UTC)
    fleet.stop_etcd()
    stopped = datetime.now(UTC)  # passes from here on cannot reach it
    try:
        # 1. Each host's timer starts a pass during the outage, and that
        # pass has ended; the outage lasts at least an interval.
        def timer_passes_ended() -> dict[str, datetime] | None:
            if datetime.now(UTC) < stopped + timedelta(seconds=INTERVAL_S):
                return None
            started = {host: first_after(pass_starts(fleet, host), stopped) for host in running}
            if any(moment is None for moment in started.values()) or any(pass_running(fleet, host) for host in running):
                return None
            return started  # type: ignore[return-value]

        outage_passes = wait_for(
            timer_passes_ended, timeout=deadline_for(INTERVAL_S), what="a timer's pass ended on every host during the outage", interval=0.5
        )
        # Nothing torn down: the agents that ran still run (not even
        # restarted), and the edge still serves every routed service, the
        # moved one from where it was.
        for host in running:
            assert running_agents(fleet, host) == agents[host], f"{host} changed its agents while the registry was unreachable"
        routed = {service for service in routed_services(desired) if service in placed(before)}
        assert set(edge_reaches(fleet, desired, before)) == routed, "the edge stopped serving a routed service"
        status, body = fleet.request(ROUTE)
        assert (status, body.strip()) == (200, f"{SERVICE} on {serving}"), f"the edge no longer serves {ROUTE} from {serving}: {status} {body!r}"
        now = datetime.now(UTC)
        for host in running:
            # Started by the timer: it elapsed during the outage, and the
            # watcher, which cannot see the registry, started nothing.
            triggered = last_timer_trigger(fleet, host)
            assert triggered is not None and triggered >= stopped, f"{host}'s timer did not elapse during the outage ({triggered})"
            assert first_after(watcher_starts(fleet, host), stopped) is None, f"{host}'s watcher started a pass during the outage"
            # Each such pass failed static and said why.
            said = [message for moment, message in static_passes(fleet, host) if outage_passes[host] <= moment <= now]
            assert any("registry unreachable" in message and "running static" in message for message in said), (
                f"{host}'s pass during the outage did not say it runs static: {said}"
            )
            # The watcher said so, and waits it out in its process (the
            # same invocation: it did not exit and get restarted).
            unreachable = [message for moment, message in watcher_says(fleet, host, "registry unreachable") if moment >= stopping]
            assert unreachable, f"{host}'s watcher did not say the registry is unreachable"
            assert "retrying" in unreachable[0], unreachable[0]
            assert unit_invocation(fleet, host, "fabric-watch.service") == watchers[host], f"{host}'s watcher restarted during the outage"
    finally:
        fleet.start_etcd()
    restarted = datetime.now(UTC)

    # 2. A drain at once, while the watchers are still backing off.
    drain(fleet, serving)
    try:
        plan = plan_moving(fleet, SERVICE, before, serving, timeout=deadline_for(INTERVAL_S))
        published = utc(plan.created)
        done = move_applied(fleet, SERVICE, plan, serving, within=deadline_for(INTERVAL_S))
        for host, applied_at in done.items():
            started = first_after(pass_starts(fleet, host), published)
            assert started is not None and started <= applied_at, f"{host}: no pass applied the move"
            by_watcher = first_after(watcher_starts(fleet, host), published)
            starter = "its watcher" if by_watcher is not None and by_watcher <= started + timedelta(seconds=ACTED_ON_S) else "its timer"
            back = [(moment, message) for moment, message in watcher_says(fleet, host, "working again after ") if moment >= restarted]
            watcher = f"{(back[0][0] - restarted).total_seconds():.1f} s after etcd, {back[0][1]}" if back else "not following yet"
            print(
                f"registry back: plan {(published - restarted).total_seconds():.2f} s after etcd, {host} applied it "
                f"{(applied_at - published).total_seconds():.2f} s later, in a pass started by {starter}; its watcher: {watcher}"
            )
    finally:
        undrain(fleet, serving)
    wait_converged(fleet, desired, running)
