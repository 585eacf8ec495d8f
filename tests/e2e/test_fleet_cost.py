"""Work comes home from the paid host with no failed request (issue 32's fleet Done-when).

The harness of tests/e2e/conftest.py, this module's own fleet, with one timing
shortened: [flap] window_s, the come-home rule's stable window
(FLEET_SETTINGS.flap_window_s). The desired state changes as a `git pull`
brings it: every host's copy and this client's are rewritten, and the next
passes and the leader's next step read them. In order:

    spill      lux is made full: its host file's limit is lowered to what it
               runs plus `filler` (a service only lux's role label matches);
               then `web` (routed through the edge, and labelled so that only
               lux and x86-spill can run it) is added: the cheaper host has no
               room, so it is placed on x86-spill, and the edge answers from there
    come home  lux's limit is raised by one: lux has room. A stable window
               later (counted from the plan's `room_since` for lux) the
               leader's plan holds both placements (lux's with replaces =
               x86-spill), then lux's alone; x86-spill stops its unit and the
               edge answers from lux. A request loop through the edge's Caddy,
               from before lux had room until the edge answers from lux alone,
               sees only 200s: from x86-spill first, from lux last.

The `web` label keeps the scenario to those two hosts: qfox-1 (owned, a better
tier) and a1-arm64 (free) would be homes too, and what they run depends on the
order in which the hosts first beat.
"""

from __future__ import annotations

import threading
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan, Placement
from reconciler.core.timestamps import utc
from tests.e2e.fleet import (
    DESIRED_DIR,
    SERVICE_STUB,
    Fleet,
    FleetSettings,
    agent_unit,
    converged,
    first_after,
    in_container,
    placed,
    running_agents,
    toml_text,
    unit_active_since,
    unit_stops,
    wait_for,
)
from tests.support.e2e import HOSTS, wait_converged
from tests.support.harness.waiting import deadline_for

pytestmark = pytest.mark.e2e

# The stable window, shortened from the e2e default (120 s).
FLEET_SETTINGS = FleetSettings(flap_window_s=30)
HOME, PAID = "lux", "x86-spill"
WEB, FILLER = "web", "filler"
WEB_ROUTE = "web.researchstack.info"
WEB_PORT, FILLER_PORT = 8711, 8712
POOL = {"topology.researchstack.io/pool": "web"}
ROLE = "topology.researchstack.io/role"
# A changed host file shows in the host's next beat (one pass).
BEAT_S = deadline_for(FLEET_SETTINGS.heartbeat_s + 1.0)
# Converging on a changed desired state: a beat, a leader step, the passes
# that apply the plan, a beat that shows it (bounds of a broken run only).
REACT_S = deadline_for(3.0 * FLEET_SETTINGS.node_timeout_s)
# Lux's room is in the plan within a beat and a leader step; the move comes a
# window later and completes within a few beats (the new unit active in lux's
# beat, the old one stopped by x86-spill's pass, Caddy reloaded by the edge's).
MOVE_S = FLEET_SETTINGS.flap_window_s + REACT_S


# --------------------------------------------------------------------------
# The desired state, changed as a pull brings it


def copies(fleet: Fleet) -> tuple[Path, Path]:
    """The hosts' desired state (written into every running host too) and this client's."""
    return fleet.desired_dir, fleet.client_desired_dir


def change_desired(fleet: Fleet, name: str, change: Any) -> None:
    """`change(data)` applied to both copies of `name` (they differ in [registry]
    and [phaze]): this client's, and the hosts', in every running host."""
    for directory in copies(fleet):
        data = tomllib.loads((directory / name).read_text())
        change(data)
        text = toml_text(data)
        (directory / name).write_text(text)
        if directory == fleet.desired_dir:
            for host in HOSTS:
                if fleet.hosts[host].running:
                    fleet.container(host).write_file(f"{DESIRED_DIR}/{name}", text)


def stub_service(service_id: str, port: int, **rest: Any) -> dict[str, Any]:
    """A service whose program is tests/e2e/service_stub.py (as every service of the e2e fleet)."""
    argv = ["/usr/bin/python3", in_container(SERVICE_STUB), service_id, str(port)]
    return {"id": service_id, "min_tier": "cpu_ffmpeg", "floor": "cpu_ffmpeg", "port": port, "command": {"any": argv}, **rest}


def add_service(fleet: Fleet, service: dict[str, Any]) -> None:
    change_desired(fleet, "fabric.toml", lambda data: data["services"].append(dict(service)))


def set_host(fleet: Fleet, host: str, *, labels: dict[str, str], tasks: int | None = None) -> None:
    """`host`'s host file with `labels` added and, given `tasks`, that limit."""

    def change(data: dict[str, Any]) -> None:
        if tasks is not None:
            data.setdefault("limits", {})["max_concurrent_tasks"] = tasks
        data.setdefault("labels", {}).update(labels)

    change_desired(fleet, f"{host}.toml", change)


def reported_limit(fleet: Fleet, host: str) -> int | None:
    with fleet.registry() as registry:
        states = {s.node_id: s for s in registry.node_states()}
    record = states[host].record if host in states else None
    return None if record is None else record.max_concurrent_tasks


def wait_limit(fleet: Fleet, host: str, tasks: int) -> None:
    wait_for(lambda: reported_limit(fleet, host) == tasks, timeout=BEAT_S, what=f"{host} to report limit {tasks}", interval=0.5)


def reloaded(fleet: Fleet) -> DesiredState:
    return load_desired(fleet.desired_dir)


# --------------------------------------------------------------------------
# What the tests read


def on(plan: FleetPlan, service: str) -> list[tuple[str, str | None]]:
    """`service`'s placements in `plan`: (node, replaces), in the plan's order."""
    return [(p.node, p.replaces) for p in plan.placements if p.service == service]


def load_on(plan: FleetPlan, host: str) -> int:
    return sum(1 for p in plan.placements if p.node == host)


def body_of(service: str, host: str) -> str:
    """What service_stub.py answers on `host`."""
    return f"{service} on {host}"


def edge_answer(fleet: Fleet) -> str | None:
    status, body = fleet.request(WEB_ROUTE)
    return body.strip() if status == 200 else None


@dataclass
class RequestLoop:
    """Requests through the edge's Caddy, one after another, until stopped
    (or `limit` of them): each answer's status and body. A request may wait
    out Caddy's retry window, so its timeout is longer than that."""

    fleet: Fleet
    timeout_s: float
    every_s: float = 0.2
    limit: int = 5000
    answers: list[tuple[int, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _run(self) -> None:
        while not self._stop.is_set() and len(self.answers) < self.limit:
            try:
                status, body = self.fleet.request(WEB_ROUTE, timeout=self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - a request that did not complete is a failed one
                status, body = 0, repr(exc)
            self.answers.append((status, body.strip()))
            self._stop.wait(self.every_s)  # a client's pace, not a wait for a condition

    @contextmanager
    def running(self) -> Iterator[RequestLoop]:
        thread = threading.Thread(target=self._run, name="edge-requests", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(timeout=self.timeout_s + 30)

    def failed(self) -> list[tuple[int, str]]:
        return [(status, body) for status, body in self.answers if status != 200]

    def sources(self) -> list[str]:
        """The bodies in the order they came, repeats folded."""
        out: list[str] = []
        for _, body in self.answers:
            if not out or out[-1] != body:
                out.append(body)
        return out


def sources_text(loop: RequestLoop) -> str:
    counts: dict[str, int] = {}
    for status, body in loop.answers:
        counts[f"{status} {body}"] = counts.get(f"{status} {body}", 0) + 1
    return ", ".join(f"{n} x {what!r}" for what, n in counts.items())


@dataclass
class PlanWatch:
    """The distinct plans the registry held, polled while a move is awaited."""

    seen: list[FleetPlan] = field(default_factory=list)

    def look(self, registry: Any) -> FleetPlan | None:
        plan = registry.newest_plan()
        if plan is not None and (not self.seen or plan.epoch != self.seen[-1].epoch):
            self.seen.append(plan)
        return plan


# --------------------------------------------------------------------------
# 1. Spill: lux full, web goes to x86-spill


@dataclass
class Scenario:
    full_limit: int = 0


SCENARIO = Scenario()


def test_a_replica_spills_to_the_paid_host_while_lux_is_full(fleet: Fleet) -> None:
    desired = reloaded(fleet)
    wait_converged(fleet, desired)

    # Nothing of the example's own services on x86-spill: a replica that
    # spilled there while the hosts first beat comes home within a window.
    def nothing_paid() -> FleetPlan | None:
        plan = converged(fleet, desired, HOSTS)
        return plan if plan is not None and not any(p.node == PAID for p in plan.placements) else None

    plan = wait_for(nothing_paid, timeout=MOVE_S, what=f"the fleet converged with nothing placed on {PAID}", interval=0.5)
    assert not on(plan, WEB), plan.placements
    # Lux full: its limit is what it runs plus the filler (only lux carries the
    # control role label), and the filler takes that slot.
    SCENARIO.full_limit = load_on(plan, HOME) + 1
    set_host(fleet, HOME, tasks=SCENARIO.full_limit, labels=POOL)
    set_host(fleet, PAID, labels=POOL)
    add_service(fleet, stub_service(FILLER, FILLER_PORT, labels={ROLE: "control"}))
    wait_limit(fleet, HOME, SCENARIO.full_limit)
    desired = reloaded(fleet)

    def filled() -> FleetPlan | None:
        plan = converged(fleet, desired, HOSTS)
        return plan if plan is not None and on(plan, FILLER) == [(HOME, None)] else None

    plan = wait_for(filled, timeout=REACT_S, what=f"{FILLER} placed on {HOME} and running", interval=0.5)
    assert load_on(plan, HOME) == SCENARIO.full_limit, plan.placements

    # web can run on lux (owned) or x86-spill (paid); lux is full.
    add_service(fleet, stub_service(WEB, WEB_PORT, labels=POOL, route={"host": WEB_ROUTE}))
    desired = reloaded(fleet)

    def spilled() -> FleetPlan | None:
        plan = converged(fleet, desired, HOSTS)
        return plan if plan is not None and WEB in placed(plan) else None

    plan = wait_for(spilled, timeout=REACT_S, what=f"{WEB} placed and served", interval=0.5)
    (placement,) = [p for p in plan.placements if p.service == WEB]
    assert (placement.node, placement.replaces, placement.tier) == (PAID, None, "cpu_ffmpeg"), placement
    assert desired.hosts[PAID].host.cost == "paid" and desired.hosts[HOME].host.cost == "owned"
    # Lux has no room, so the plan remembers no room to come home to.
    assert HOME not in plan.room_since, plan.room_since
    # The edge routes to it: the answer comes from x86-spill.
    assert edge_answer(fleet) == body_of(WEB, PAID)


# --------------------------------------------------------------------------
# 2. Come home: lux frees up, web moves back, no request fails


def test_the_replica_comes_home_after_the_stable_window_with_no_failed_request(fleet: Fleet) -> None:
    assert SCENARIO.full_limit, "runs after test_a_replica_spills_to_the_paid_host_while_lux_is_full"
    desired = reloaded(fleet)
    before = wait_converged(fleet, desired)
    assert on(before, WEB) == [(PAID, None)], before.placements
    window = desired.fleet.flap.window_s
    retry_s = desired.fleet.edge.retry_window_ms / 1000.0
    loop = RequestLoop(fleet, timeout_s=retry_s + 5.0)
    watch = PlanWatch()

    with loop.running():
        wait_for(lambda: loop.answers, timeout=REACT_S, what="the first answer of the request loop", interval=0.2)
        # Lux frees up: one more slot than it runs.
        set_host(fleet, HOME, tasks=SCENARIO.full_limit + 1, labels=POOL)
        wait_limit(fleet, HOME, SCENARIO.full_limit + 1)

        with fleet.registry() as registry:

            def home() -> FleetPlan | None:
                plan = watch.look(registry)
                return plan if plan is not None and plan.epoch > before.epoch and on(plan, WEB) == [(HOME, None)] else None

            done = wait_for(home, timeout=MOVE_S, what=f"{WEB} to come home to {HOME}", interval=0.25)

        def served_from_home() -> bool:
            return converged(fleet, desired, HOSTS) is not None and edge_answer(fleet) == body_of(WEB, HOME)

        wait_for(served_from_home, timeout=REACT_S, what=f"the edge to answer from {HOME} alone", interval=0.5)
        # A few more answers from lux after x86-spill stopped its unit.
        answered = len(loop.answers)
        wait_for(lambda: len(loop.answers) >= answered + 5, timeout=REACT_S, what="answers after the move", interval=0.2)

    # The plans on the way: lux's room remembered, then both placements (the
    # new one replacing x86-spill's), then lux's alone.
    webs = [on(plan, WEB) for plan in watch.seen]
    both = [(HOME, PAID), (PAID, None)]
    pairs = [plan for plan in watch.seen if sorted(on(plan, WEB), key=str) == sorted(both, key=str)]
    assert pairs, f"no plan held both placements of {WEB}: {webs}"
    first_pair = pairs[0]
    assert watch.seen.index(first_pair) < watch.seen.index(done), webs
    # The move waited for the stable window: lux had room since `room_since`
    # (remembered by the plans before the move), at least window_s before it.
    remembered = [utc(plan.room_since[HOME]) for plan in watch.seen[: watch.seen.index(first_pair)] if HOME in plan.room_since]
    assert remembered, f"no plan remembered {HOME}'s room before the move: {[p.room_since for p in watch.seen]}"
    since: datetime = min(remembered)
    waited = (utc(first_pair.created) - since).total_seconds()
    assert waited >= window, f"moved {waited:.1f} s after {HOME} had room, before the {window} s window"
    # Nothing else moved: the move is web's alone, one replica.
    new: list[Placement] = [p for p in first_pair.placements if p.replaces is not None]
    assert [(p.service, p.replica, p.node, p.replaces) for p in new] == [(WEB, 0, HOME, PAID)], new
    assert on(done, WEB) == [(HOME, None)] and on(done, FILLER) == [(HOME, None)], done.placements
    # Make before break, on the machines: lux's unit was active before the
    # plan let x86-spill's placement go, and x86-spill stopped its unit only
    # after that (Caddy's retry window would hide a gap from the requests).
    unit = agent_unit(WEB)
    started = unit_active_since(fleet, HOME, unit)
    stopped = first_after(unit_stops(fleet, PAID, unit), utc(first_pair.created))
    assert started is not None and stopped is not None, (started, stopped)
    order = f"move planned {first_pair.created}, {HOME} active {started}, {PAID} released {done.created}, stopped {stopped}"
    assert utc(first_pair.created) <= started < utc(done.created) <= stopped, order
    assert unit not in running_agents(fleet, PAID)

    print(
        f"[cost] {WEB} came home {waited:.1f} s after {HOME} had room (window {window} s); "
        f"plans seen: {webs}; {len(loop.answers)} requests, answered by {sources_text(loop)}",
        flush=True,
    )
    # The edge's Caddy never failed a request: every answer a 200, from
    # x86-spill first and lux last.
    assert not loop.failed(), f"{len(loop.failed())} of {len(loop.answers)} requests failed: {loop.failed()[:10]}"
    sources = loop.sources()
    assert sources[0] == body_of(WEB, PAID) and sources[-1] == body_of(WEB, HOME), sources
    assert set(sources) == {body_of(WEB, PAID), body_of(WEB, HOME)}, sources
