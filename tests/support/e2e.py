"""What the e2e scenarios (tests/e2e/test_fleet*.py) read from the running
fleet (tests/e2e/fleet.py): the fleet converged on its hosts, and `fabric lane`
against its registry and phaze's broker."""

from __future__ import annotations

import json

import pytest

from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan
from tests.e2e.fleet import Fleet, converged, wait_for
from tests.support.harness.saq_workers import LaneWorkers

HOSTS = ("lux", "qfox-1", "racknerd", "a1-arm64", "x86-spill")
# Bounds of the polls (a broken run fails after these; a working one is far faster).
CONVERGE_S = 120.0
HEARTBEAT_GRACE_S = 30.0
# Asked once per run: did any heartbeat ever arrive (see heartbeats_arrive)?
_NO_HEARTBEAT = "no heartbeat"
_seen: dict[str, bool] = {}


def heartbeats_arrive(fleet: Fleet) -> None:
    """Fail the calling scenario at once when no host has ever sent a heartbeat.

    The fleet's passes run (test_topology checks that); a registry with no
    node after they ran means `fabric reconcile` does not reach the registry
    (reconciler/engine/plan_source.py), so no scenario can converge. Said once,
    precisely, instead of every scenario timing out."""

    def someone_beat() -> bool:
        with fleet.registry() as registry:
            return bool(registry.node_states())

    if _NO_HEARTBEAT not in _seen:
        try:
            wait_for(someone_beat, timeout=HEARTBEAT_GRACE_S, what="a first heartbeat", interval=0.5)
            _seen[_NO_HEARTBEAT] = False
        except AssertionError:
            _seen[_NO_HEARTBEAT] = True
    if _seen[_NO_HEARTBEAT]:
        pytest.fail(f"no host sent a heartbeat within {HEARTBEAT_GRACE_S:.0f} s of the fleet's first passes: the passes do not reach the registry")


def wait_converged(fleet: Fleet, desired: DesiredState, hosts: tuple[str, ...] = HOSTS, timeout: float = CONVERGE_S) -> FleetPlan:
    heartbeats_arrive(fleet)
    return wait_for(lambda: converged(fleet, desired, hosts), timeout=timeout, what=f"the fleet to converge on {', '.join(hosts)}", interval=0.5)


def lane(fleet: Fleet, *args: str) -> list[dict]:
    """`fabric lane ARGS --json` against the fleet's registry: one object per
    line (`status`: one indented document). As lux: only leader candidates
    may write lane slots and jobs. The lane queue is phaze's broker, the
    fleet's PostgreSQL ([phaze] queue_url_file of the client's desired state)."""
    done = fleet.fabric("lane", *args, "--json", identity="lux")
    assert done.returncode == 0, done.stderr
    if args[0] == "status":
        return [json.loads(done.stdout)]
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def dispatched(fleet: Fleet) -> list[dict]:
    """One `fabric lane dispatch --once`: its decisions on waiting jobs (the
    jobs it settled first, whose SAQ worker finished them, left out)."""
    return [e for e in lane(fleet, "dispatch", "--once") if e["outcome"] is None]


def drain_lanes(fleet: Fleet, workers: LaneWorkers, timeout: float) -> None:
    """Let every running lane job finish on its SAQ worker and dispatch (and
    so settle) until the lane queue is empty."""

    def drained() -> bool:
        status = lane(fleet, "status")[0]
        for running in status["running"]:
            workers.finish(running["job"])
        if status["running"] or status["waiting"]:
            lane(fleet, "dispatch", "--once")
        return not status["running"] and not status["waiting"]

    wait_for(drained, timeout=timeout, what="the lane queue to drain", interval=0.2)
