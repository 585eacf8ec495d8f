"""Node loss, end to end: from the lost node's last heartbeat to the first request
the edge serves from the replacement; and a plan published between timer ticks,
from its publication to its move applied by every host it concerns.

Run (root): .venv/bin/python bench/convergence [--runs 3] [--interval 30s]
            [--heartbeat S] [--node-timeout S] [--no-watcher]
            [--victim serving|leader] [--node-loss-only]

Brings up the example fleet on this machine (tests/e2e/fleet.py: five systemd
containers on a bridge, etcd, a real Caddy on the edge, every host's own
fabric-reconcile.timer every --interval and its fabric-watch.service, the two
candidates' fabric-leader.service), waits until it has converged, then, per run:

  1. powers off the container of the host that serves vaapi-encode;
  2. requests https://encode.researchstack.info through the edge from the
     client namespace every 100 ms, each on its own (one stuck on the lost
     host does not hold back the next: tests/e2e/fleet.first_answer), until
     an answer comes from another host;
  3. reads from the registry the lost node's last heartbeat, when the leader
     marked it offline and when the plan that moved the work was published,
     and from the replacement's and the edge's journals when their passes
     started, when the service became active and when Caddy was loaded;
  4. starts the host again and waits for the fleet to converge.

Then once: kills the leader's host (SIGKILL, no resignation) and prints how
long after the kill another candidate's term began, beside the lease TTL.

Before the node losses, --runs times: a plan between ticks. A pass on every
host (so every timer's next tick is an interval away), then a drain of the
host serving vaapi-encode while every tick is at least 10 s away; prints,
after the moving plan's publication, when each host it concerns took it
(tests/e2e/fleet.plan_taken) and applied it (the drained host stopped the
unit, the replacement started it, the edge loaded Caddy:
tests/e2e/fleet.move_applied), beside the goal (issue 14: applied within 1 s);
then lifts the drain and waits for the fleet to converge again.

Issue 30 (fabric-watch's fast liveness, suspicion and hedges): per run also
`served by the replacement N.N s after the power-off`, with the times from
the power-off to the suspicion, to the hedge's plan (both from the plan's
`suspects` events) and to the edge's reload, and their `median:` line (goal:
served within 10 s of the power-off).

Prints per run, in seconds after the last heartbeat, every phase: offline (the
leader's transition), plan (the moving plan published), pass (the
replacement took the plan: a pass started after it, or one running then read
it or took it into another round: tests/e2e/fleet.plan_taken), started (the
service active on the replacement), edge pass (the edge took the plan, the
same way), caddy (the edge's pass loaded Caddy), served (the first good
request through the edge); then the median of each, beside the goal (issue
14): served within node timeout + 2 s, and the plan acted on (taken by the
affected hosts) within 1 s of its publication.
Wall-clock times from one clock (the registry's timestamps and the containers'
journals are this machine's UTC clock, as are the client's).

--interval 30s is the production timer: heartbeats (one per pass) come every
30 s, so the node timeout defaults to two intervals (--node-timeout), and the
leader's lease TTL is the heartbeat (--heartbeat, default the interval).
--no-watcher leaves fabric-watch.service off: the timer alone.

--victim leader: before each node loss the host serving vaapi-encode (a
leader candidate) is made the leader (tests/e2e/fleet.lead_on: the leader's
fabric-leader.service stopped until it leads, then started again), so the
powered-off host is the leader's own: the other candidate takes the live
term over once that host's liveness record lapsed (issue 30), and its first
step suspects the host and places the hedge. Each run then also prints when
the successor's term began, after the power-off. --node-loss-only skips the
plan between ticks and the final leader kill.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO))

from reconciler.core.desired.load import load_desired  # noqa: E402
from reconciler.core.timestamps import utc  # noqa: E402
from tests.e2e.fleet import (  # noqa: E402
    ACTED_ON_S,
    FAR_S,
    HOST_OCTETS,
    SERVED_AFTER_TIMEOUT_S,
    FleetSettings,
    agent_unit,
    align_timers,
    caddy_loads,
    converged,
    drain,
    first_after,
    first_answer,
    lead_on,
    move_applied,
    placed,
    plan_moving,
    plan_taken,
    running_fleet,
    span_seconds,
    undrain,
    unit_active_since,
    wait_for,
)

SERVICE = "vaapi-encode"
ROUTE = "encode.researchstack.info"
PHASES = ("offline", "plan", "pass", "started", "edge pass", "caddy", "served")
# Issue 30: seconds after the power-off (nan: did not happen, e.g. no fast liveness).
OFF_PHASES = ("suspected", "hedge plan", "edge reload", "served")
SERVED_AFTER_POWER_OFF_S = 10.0


def _since(moment: datetime | None, origin: datetime) -> float:
    return (moment - origin).total_seconds() if moment is not None else float("nan")


def between_ticks(fleet, desired, hosts) -> dict[str, float | str]:
    """One drain between ticks: seconds from the moving plan's publication to
    each concerned host taking it and applying it."""
    before = wait_for(lambda: converged(fleet, desired, hosts), timeout=300, what="convergence", interval=0.5)
    (serving,) = placed(before)[SERVICE]
    align_timers(fleet, hosts, far_s=FAR_S, timeout=120)
    drain(fleet, serving, reason="bench: a plan between ticks")
    try:
        plan = plan_moving(fleet, SERVICE, before, serving, timeout=60)
        published = utc(plan.created)
        applied = move_applied(fleet, SERVICE, plan, serving, within=60)
        (replacement,) = placed(plan)[SERVICE]
        roles = {"drained": serving, "replacement": replacement, "edge": fleet.edge}
        figures: dict[str, float | str] = {"drained host": serving, "to": replacement}
        for role, host in roles.items():
            figures[f"{role} took"] = _since(plan_taken(fleet, host, plan.epoch, published), published)
            figures[f"{role} applied"] = _since(applied[host], published)
    finally:
        undrain(fleet, serving)
    return figures


DRAIN_PHASES = ("drained took", "drained applied", "replacement took", "replacement applied", "edge took", "edge applied")


def _unhedged(fleet, desired, hosts):
    """The converged plan once SERVICE has one placement again (a hedge of an
    earlier run leaves after the stable window, [flap] window_s)."""
    plan = converged(fleet, desired, hosts)
    return plan if plan is not None and len(placed(plan).get(SERVICE, [])) == 1 else None


def _suspect_event(plan, victim: str, kind: str, after: datetime) -> datetime | None:
    """When the leader's plan says `victim` was first suspected or hedged after `after` (issue 30)."""
    state = plan.suspects.get(victim) if plan is not None else None
    times = [utc(e.at) for e in (state.events if state is not None else []) if e.kind == kind and utc(e.at) >= after]
    return min(times, default=None)


def one_run(fleet, desired, hosts, *, leader_victim: bool = False) -> dict[str, float | str]:
    plan = wait_for(lambda: _unhedged(fleet, desired, hosts), timeout=600, what="convergence without hedges", interval=0.5)
    (victim,) = placed(plan)[SERVICE]
    if leader_victim:
        if victim not in desired.fleet.fleet.leader_candidates:
            raise SystemExit(f"--victim leader: {SERVICE} runs on {victim}, not a leader candidate")
        lead_on(fleet, victim, timeout=120)
    powered_off = datetime.now(UTC)
    fleet.stop_host(victim)

    def from_the_replacement(status: int, body: str) -> bool:
        return status == 200 and body.strip().startswith(f"{SERVICE} on ") and not body.strip().endswith(f" on {victim}")

    served = first_answer(
        lambda: fleet.request(ROUTE, timeout=1.0), from_the_replacement, timeout=600, what=f"{ROUTE} served by another host than {victim}"
    )
    with fleet.registry() as registry:
        state = {s.node_id: s for s in registry.node_states()}[victim]
        new_plan = registry.newest_plan()
    assert new_plan is not None
    last_beat = utc(state.last_seen)
    # The plan that first served from elsewhere: the hedge's (issue 30) or, with
    # no fast liveness, the one that moved the work at the node timeout.
    hedged = _suspect_event(new_plan, victim, "hedge", powered_off)
    published = hedged or utc(new_plan.created)
    (replacement,) = [n for n in placed(new_plan)[SERVICE] if n != victim]
    offline = next((utc(t.at) for t in reversed(state.transitions) if t.status == "offline"), None)
    moments = {
        "offline": offline,
        "plan": published,
        "pass": plan_taken(fleet, replacement, new_plan.epoch, published),
        "started": unit_active_since(fleet, replacement, agent_unit(SERVICE)),
        "edge pass": plan_taken(fleet, fleet.edge, new_plan.epoch, published),
        "caddy": first_after(caddy_loads(fleet, fleet.edge), published),
        "served": served,
    }
    figures: dict[str, float | str] = {phase: _since(moments[phase], last_beat) for phase in PHASES}
    figures["victim"], figures["replacement"] = victim, replacement
    # From the power-off (issue 30): suspicion, the hedge's plan, the edge's reload, served.
    after_off = {
        "suspected": _suspect_event(new_plan, victim, "suspicion", powered_off),
        "hedge plan": hedged,
        "edge reload": moments["caddy"],
        "served": served,
    }
    for phase, moment in after_off.items():
        figures[f"off {phase}"] = _since(moment, powered_off)
    with fleet.registry() as registry:
        leader = registry.leader()
    figures["off new term"] = _since(utc(leader.since), powered_off) if leader_victim and leader is not None else float("nan")
    fleet.start_host(victim)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--interval", default=FleetSettings.pass_interval, help="fabric-reconcile.timer interval (a systemd time span)")
    parser.add_argument(
        "--heartbeat", type=int, default=None, help=f"timing.heartbeat_s (default: the interval, at least {FleetSettings.heartbeat_s})"
    )
    parser.add_argument(
        "--node-timeout", type=int, default=None, help=f"timing.node_timeout_s (default: two heartbeats, at least {FleetSettings.node_timeout_s})"
    )
    parser.add_argument("--no-watcher", action="store_true", help="leave fabric-watch.service off (the timer alone)")
    parser.add_argument(
        "--victim",
        choices=("serving", "leader"),
        default="serving",
        help="serving: power off the host serving vaapi-encode; leader: make that host the leader first (the dead host is the leader's)",
    )
    parser.add_argument("--node-loss-only", action="store_true", help="skip the plan between ticks and the final leader kill")
    args = parser.parse_args()
    try:
        interval_s = span_seconds(args.interval)
    except ValueError as exc:
        print(f"--interval: {exc}", file=sys.stderr)
        return 2
    heartbeat = args.heartbeat if args.heartbeat is not None else max(FleetSettings.heartbeat_s, math.ceil(interval_s))
    node_timeout = args.node_timeout if args.node_timeout is not None else max(FleetSettings.node_timeout_s, 2 * heartbeat)
    settings = FleetSettings(pass_interval=args.interval, heartbeat_s=heartbeat, node_timeout_s=node_timeout, watcher=not args.no_watcher)
    work = Path(tempfile.mkdtemp(prefix="fabric-bench-convergence-"))
    try:
        return _measure(work, settings, args.runs, leader_victim=args.victim == "leader", node_loss_only=args.node_loss_only)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(work: Path, settings: FleetSettings, runs: int, *, leader_victim: bool = False, node_loss_only: bool = False) -> int:
    hosts = tuple(HOST_OCTETS)
    results = []
    with running_fleet(work, settings, progress=lambda m: print(f"  [fleet] {m}", file=sys.stderr, flush=True)) as fleet:
        desired = load_desired(fleet.desired_dir)
        with fleet.registry() as registry:
            try:
                wait_for(lambda: registry.node_states(), timeout=120, what="a first heartbeat", interval=0.5)
            except AssertionError:
                print("cannot measure: no host sends heartbeats (fabric reconcile does not talk to the registry yet)")
                return 1
        if not node_loss_only:
            _between_ticks_runs(fleet, desired, hosts, runs)
        goal = settings.node_timeout_s + SERVED_AFTER_TIMEOUT_S
        print(
            f"node loss: node timeout {settings.node_timeout_s} s, heartbeat {settings.heartbeat_s} s, pass interval {settings.pass_interval}, "
            f"fabric-watch.service {'on' if settings.watcher else 'off'}"
        )
        print(f"goal: served <= node timeout + {SERVED_AFTER_TIMEOUT_S:g} s = {goal:g} s; each affected host's pass <= plan + {ACTED_ON_S:g} s")
        header = "".join(f" {phase:>9}" for phase in PHASES)
        print(f"{'run':>3}  {'lost':9} {'to':9}{header}   (s after the lost node's last heartbeat)")
        for run in range(1, runs + 1):
            figures = one_run(fleet, desired, hosts, leader_victim=leader_victim)
            results.append(figures)
            row = "".join(f" {figures[phase]:9.2f}" for phase in PHASES)
            print(f"{run:>3}  {figures['victim']:9} {figures['replacement']:9}{row}", flush=True)
            term = f", the successor's term at {figures['off new term']:.1f} s" if leader_victim else ""
            print(
                f"     served by the replacement {figures['off served']:.1f} s after the power-off{' of the leader' if leader_victim else ''} "
                f"(suspected {figures['off suspected']:.1f} s, hedge plan {figures['off hedge plan']:.1f} s, edge reload {figures['off edge reload']:.1f} s{term})",
                flush=True,
            )
        medians = {phase: statistics.median(float(r[phase]) for r in results) for phase in PHASES}
        print(f"{'median':>5}{'':20}" + "".join(f" {medians[phase]:9.2f}" for phase in PHASES))
        acted = max(medians["pass"], medians["edge pass"]) - medians["plan"]
        print(
            f"median: offline {medians['offline'] - settings.node_timeout_s:+.2f} s after the node timeout; "
            f"plan acted on {medians['pass'] - medians['plan']:.2f} s (replacement) / {medians['edge pass'] - medians['plan']:.2f} s (edge) "
            f"after its publication (goal {ACTED_ON_S:g} s: {'met' if acted <= ACTED_ON_S else 'MISSED'}); "
            f"first request served by the replacement {medians['served']:.2f} s after the last heartbeat "
            f"(goal {goal:g} s: {'met' if medians['served'] <= goal else 'MISSED'})"
        )
        off = {phase: statistics.median(float(r[f"off {phase}"]) for r in results) for phase in OFF_PHASES}
        print(
            f"median: served by the replacement {off['served']:.1f} s after the power-off "
            f"(goal {SERVED_AFTER_POWER_OFF_S:g} s: {'met' if off['served'] <= SERVED_AFTER_POWER_OFF_S else 'MISSED'}); "
            f"suspected {off['suspected']:.1f} s, hedge plan {off['hedge plan']:.1f} s, edge reload {off['edge reload']:.1f} s after it"
        )
        if leader_victim:
            term = statistics.median(float(r["off new term"]) for r in results)
            print(f"median: the power-off of the leader's host: the successor's term began {term:.1f} s after it")
        if not node_loss_only:
            takeover, old, new, ttl = leader_failover(fleet, desired, hosts)
            print(f"leader failure: {old}'s host killed, {new} leads {takeover:.2f} s later (lease TTL {ttl:g} s)")
    return 0


def _between_ticks_runs(fleet, desired, hosts, runs: int) -> None:
    print(f"a plan between ticks (every timer at least {FAR_S:g} s from its tick): seconds after its publication; goal: applied <= {ACTED_ON_S:g} s")
    print(f"{'run':>3}  {'drained':9} {'to':9}" + "".join(f" {phase:>19}" for phase in DRAIN_PHASES))
    drains = []
    for run in range(1, runs + 1):
        figures = between_ticks(fleet, desired, hosts)
        drains.append(figures)
        print(f"{run:>3}  {figures['drained host']:9} {figures['to']:9}" + "".join(f" {figures[phase]:19.2f}" for phase in DRAIN_PHASES), flush=True)
    drain_medians = {phase: statistics.median(float(r[phase]) for r in drains) for phase in DRAIN_PHASES}
    print(f"{'median':>5}{'':20}" + "".join(f" {drain_medians[phase]:19.2f}" for phase in DRAIN_PHASES))
    slowest = max(float(r[phase]) for r in drains for phase in DRAIN_PHASES if phase.endswith("applied"))
    print(
        f"median: applied by every concerned host {max(drain_medians[p] for p in DRAIN_PHASES if p.endswith('applied')):.2f} s after "
        f"its publication, slowest of all runs {slowest:.2f} s (goal {ACTED_ON_S:g} s: {'met' if slowest <= ACTED_ON_S else 'MISSED'})"
    )


def leader_failover(fleet, desired, hosts) -> tuple[float, str, str, float]:
    """Kill the leader's host (SIGKILL: no resignation); seconds until another candidate's term begins."""
    wait_for(lambda: converged(fleet, desired, hosts), timeout=300, what="convergence", interval=0.5)
    with fleet.registry() as registry:
        old = registry.leader()
    killed = datetime.now(UTC)
    fleet.kill_host(old.candidate)

    def successor():
        with fleet.registry() as registry:
            info = registry.leader()
        return info if info is not None and info.candidate != old.candidate else None

    new = wait_for(successor, timeout=120, what="a new leader", interval=0.05)
    fleet.start_host(old.candidate)
    # fabric-leader.service campaigns with the default lease TTL: timing.heartbeat_s.
    return (utc(new.since) - killed).total_seconds(), old.candidate, new.candidate, float(desired.fleet.timing.heartbeat_s)


if __name__ == "__main__":
    sys.exit(main())
