"""Node loss, end to end: from the lost node's last heartbeat to the first request
the edge serves from the replacement.

Run (root): /tmp/venv/bin/python bench/convergence [--runs N] [--interval 1s] [--node-timeout 3]

Brings up the example fleet on this machine (tests/e2e/fleet.py: five systemd
containers on a bridge, etcd, a real Caddy on the edge, every host's own
fabric-reconcile.timer), waits until it has converged, then, per run:

  1. powers off the container of the host that serves vaapi-encode;
  2. polls https://encode.researchstack.info through the edge from the client
     namespace every 20 ms until the answer comes from another host;
  3. reads from the registry the lost node's last heartbeat, when the leader
     marked it offline and when the plan that moved the work was published;
  4. starts the host again and waits for the fleet to converge.

Then once: kills the leader's host (SIGKILL, no resignation) and prints how
long after the kill another candidate's term began, beside the lease TTL.

Prints per run, in seconds after the last heartbeat: offline (the leader's
transition), plan (the moving plan published), started (the service active on
the replacement host), edge (the edge's pass loaded Caddy), served (the first
good request through the edge), beside the configured node timeout and pass
interval; then the median. Wall-clock times from one clock (the
registry's timestamps are this machine's UTC clock, as are the client's).
"""

from __future__ import annotations

import argparse
import json
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
    HOST_OCTETS,
    FleetSettings,
    converged,
    placed,
    running_fleet,
    wait_for,
)

SERVICE = "vaapi-encode"
ROUTE = "encode.researchstack.info"


def one_run(fleet, desired, hosts) -> dict[str, float]:
    plan = wait_for(lambda: converged(fleet, desired, hosts), timeout=180, what="convergence", interval=0.5)
    (victim,) = placed(plan)[SERVICE]
    fleet.stop_host(victim)

    def replacement_answers() -> datetime | None:
        status, body = fleet.request(ROUTE, timeout=1.0)
        if status == 200 and body.strip().startswith(f"{SERVICE} on ") and not body.strip().endswith(f" on {victim}"):
            return datetime.now(UTC)
        return None

    served = wait_for(replacement_answers, timeout=180, what=f"{ROUTE} served by another host than {victim}", interval=0.02)
    with fleet.registry() as registry:
        state = {s.node_id: s for s in registry.node_states()}[victim]
        new_plan = registry.newest_plan()
    last_beat = utc(state.last_seen)
    (replacement,) = placed(new_plan)[SERVICE]
    started = _unit_active_since(fleet, replacement, f"fabric-agent-{SERVICE}.service")
    edge_loaded = _last_caddy_load(fleet, "racknerd")
    offline = next((utc(t.at) for t in reversed(state.transitions) if t.status == "offline"), None)
    figures = {
        "offline": (offline - last_beat).total_seconds() if offline else float("nan"),
        "plan": (utc(new_plan.created) - last_beat).total_seconds() if new_plan is not None else float("nan"),
        "started": (started - last_beat).total_seconds() if started else float("nan"),
        "edge": (edge_loaded - last_beat).total_seconds() if edge_loaded else float("nan"),
        "served": (served - last_beat).total_seconds(),
        "victim": victim,
    }
    fleet.start_host(victim)
    return figures


def _unit_active_since(fleet, host: str, unit: str) -> datetime | None:
    """When the unit last became active on `host` (systemd's ActiveEnterTimestamp)."""
    out = fleet.container(host).systemctl("show", "-p", "ActiveEnterTimestamp", "--timestamp=unix", unit).stdout.strip()
    value = out.split("=", 1)[-1].lstrip("@")
    return datetime.fromtimestamp(float(value), UTC) if value.replace(".", "").isdigit() else None


def _last_caddy_load(fleet, edge: str) -> datetime | None:
    """When the edge's pass last loaded Caddy (its caddy-load audit entry)."""
    lines = fleet.journal(edge, "-t", "fabric-reconcile", "-o", "json", "--output-fields=MESSAGE").splitlines()
    stamps = [json.loads(line) for line in lines]
    loads = [int(e["__REALTIME_TIMESTAMP"]) for e in stamps if str(e.get("MESSAGE", "")).startswith("caddy-load")]
    return datetime.fromtimestamp(loads[-1] / 1e6, UTC) if loads else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--interval", default=FleetSettings.pass_interval, help="fabric-reconcile.timer interval")
    parser.add_argument("--heartbeat", type=int, default=FleetSettings.heartbeat_s)
    parser.add_argument("--node-timeout", type=int, default=FleetSettings.node_timeout_s)
    args = parser.parse_args()
    settings = FleetSettings(pass_interval=args.interval, heartbeat_s=args.heartbeat, node_timeout_s=args.node_timeout)
    work = Path(tempfile.mkdtemp(prefix="fabric-bench-convergence-"))
    try:
        return _measure(work, settings, args.runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(work: Path, settings: FleetSettings, runs: int) -> int:
    hosts = tuple(HOST_OCTETS)
    results = []
    with running_fleet(work, settings, progress=lambda m: print(f"  [fleet] {m}", file=sys.stderr, flush=True)) as fleet:
        desired = load_desired(fleet.desired_dir)
        with fleet.registry() as registry:
            try:
                wait_for(lambda: registry.node_states(), timeout=60, what="a first heartbeat", interval=0.5)
            except AssertionError:
                print("cannot measure: no host sends heartbeats (fabric reconcile does not talk to the registry yet)")
                return 1
        print(
            f"node loss: configured node timeout {settings.node_timeout_s} s, heartbeat {settings.heartbeat_s} s, pass interval {settings.pass_interval}"
        )
        print(f"{'run':>3}  {'host lost':10} {'offline':>8} {'plan':>8} {'started':>8} {'edge':>8} {'served':>8}   (s after its last heartbeat)")
        for run in range(1, runs + 1):
            figures = one_run(fleet, desired, hosts)
            results.append(figures)
            print(
                f"{run:>3}  {figures['victim']:10} {figures['offline']:8.2f} {figures['plan']:8.2f} "
                f"{figures['started']:8.2f} {figures['edge']:8.2f} {figures['served']:8.2f}",
                flush=True,
            )
        served = [r["served"] for r in results]
        print(
            f"median: first request served by the replacement {statistics.median(served):.2f} s after the last heartbeat "
            f"(node timeout {settings.node_timeout_s} s)"
        )
        takeover, old, new, ttl = leader_failover(fleet, desired, hosts)
        print(f"leader failure: {old}'s host killed, {new} leads {takeover:.2f} s later (lease TTL {ttl:g} s)")
    return 0


def leader_failover(fleet, desired, hosts) -> tuple[float, str, str, float]:
    """Kill the leader's host (SIGKILL: no resignation); seconds until another candidate's term begins."""
    wait_for(lambda: converged(fleet, desired, hosts), timeout=180, what="convergence", interval=0.5)
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
