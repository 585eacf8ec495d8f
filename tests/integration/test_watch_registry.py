"""`fabric watch`'s loop over real registries (a sqlite file and a real etcd,
the `store` fixture), with a fake start port: a published plan starts one
pass within the configured timings, a plan that does not change this host's
part starts none, a leader's step starts one, a drain waits for the plan that
follows it, another host's entries start none, and an etcd that goes away is
retried until it is back."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from reconciler.adapters.clock import SystemClock
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState, FleetConfig
from reconciler.core.live.models import FleetPlan, Placement
from reconciler.core.live.records import Leadership
from reconciler.core.live.watching import WatchTimings
from reconciler.engine.watch import Watcher
from reconciler.ports import Clock, Registry, RegistryUnavailable
from reconciler.wiring import open_registry
from tests.conftest import EXAMPLE_FLEET, require
from tests.support.clock import FakeClock
from tests.support.harness.etcd import etcd_cluster
from tests.support.harness.waiting import deadline_for, wait_until
from tests.support.registry_store import Store, a_plan, record

pytestmark = pytest.mark.integration

HOST = "lux"
TIMINGS = WatchTimings(window_s=0.2, poll_s=0.25, retry_min_s=0.1, retry_max_s=0.5)


def example() -> DesiredState:
    """The example fleet: lux a compute host, racknerd the edge; lupine unrouted, braid routed."""
    return load_desired(EXAMPLE_FLEET)


class RecordingStarter:
    """The `PassStarter` port: records each start; no pass ever runs."""

    def __init__(self) -> None:
        self.starts: list[str] = []

    def pass_running(self) -> bool:
        return False

    def start_pass(self) -> None:
        self.starts.append("start")


@contextmanager
def running(registry: Registry, clock: Clock | None = None) -> Iterator[tuple[Watcher, RecordingStarter, list[str]]]:
    starter = RecordingStarter()
    log: list[str] = []
    desired = example()
    watcher = Watcher(registry, starter, clock or SystemClock(), HOST, lambda plan: desired, timings=TIMINGS, log=log.append)
    thread = threading.Thread(target=watcher.run, name="fabric-watch-test", daemon=True)
    thread.start()
    try:
        # The first answer is the baseline: nothing before it is a change.
        wait_until(lambda: watcher.state.seen, timeout=deadline_for(TIMINGS.poll_s), what="the watcher's baseline")
        yield watcher, starter, log
    finally:
        watcher.stop()
        thread.join(timeout=deadline_for(TIMINGS.poll_s))
        assert not thread.is_alive()


def test_a_published_plan_starts_a_pass(store: Store) -> None:
    registry = store.open()
    with running(store.open()) as (_, starter, log):
        term = registry.campaign("qfox-1", 30)
        assert term is not None
        registry.publish_plan(term, a_plan())
        wait_until(lambda: starter.starts, timeout=deadline_for(TIMINGS.window_s + TIMINGS.poll_s), what="a start after the plan")
        assert len(starter.starts) == 1
        assert log[-1].startswith("started a pass of lux: this host's part of the plan (")


def placed(*pairs: tuple[str, str]) -> FleetPlan:
    """A plan placing replica 0 of each (service, node)."""
    return a_plan().model_copy(update={"placements": [Placement(service=s, replica=0, node=n, tier="cpu_ffmpeg") for s, n in pairs]})


def test_a_plan_that_does_not_concern_this_host_starts_no_pass_one_that_does_starts_one(store: Store) -> None:
    """lux is a compute host of the example fleet: its part of a plan is the
    services placed on it. The watcher reads each new plan (the log says so)."""
    registry = store.open()
    term = registry.campaign("qfox-1", 30)
    assert term is not None
    registry.publish_plan(term, placed(("lupine", "qfox-1")))
    with running(store.open()) as (watcher, starter, log):
        elsewhere = registry.publish_plan(term, placed(("lupine", "x86-spill"), ("braid", "a1-arm64")))
        wait_until(
            lambda: f"plan epoch {elsewhere.epoch} leaves lux's part as it was: no pass" in log,
            timeout=deadline_for(TIMINGS.poll_s),
            what="the watcher reading the plan",
        )
        assert starter.starts == [] and watcher.state.pending == ()
        registry.publish_plan(term, placed(("lupine", "x86-spill"), ("braid", HOST)))
        wait_until(lambda: starter.starts, timeout=deadline_for(TIMINGS.window_s + TIMINGS.poll_s), what="a start after the plan")
        assert len(starter.starts) == 1
        assert log[-1].startswith("started a pass of lux: this host's part of the plan (")


def test_another_hosts_entries_start_nothing_this_hosts_drain_does(store: Store) -> None:
    registry = store.open()
    with running(store.open()) as (watcher, starter, log):
        registry.set_drain("qfox-1", reason="not lux")
        registry.set_drain(HOST, reason="maintenance")
        wait_until(lambda: starter.starts, timeout=deadline_for(TIMINGS.window_s + TIMINGS.poll_s), what="a start after lux's drain")
        assert len(log) == 2 and log[1].startswith("started a pass of lux: lux's drain request (") and "qfox-1" not in log[1]
        assert len(starter.starts) == 1


def test_a_leaders_step_starts_one_pass_and_a_drain_waits_the_window_for_the_plan_that_follows(store: Store) -> None:
    """The watcher's clock stands still (a FakeClock): however slow the
    machine, the window of a drain request or node state cannot end while a
    test writes; only a new part of the plan starts a pass before it ends."""
    registry = store.open()
    clock = FakeClock()
    with running(store.open(), clock) as (watcher, starter, log):
        registry.heartbeat(record(HOST))
        term = registry.campaign("qfox-1", 30)
        assert term is not None
        registry.advance_lifecycle(term)  # lux's node state, written by the leader's step ...
        registry.publish_plan(term, a_plan())  # ... which then publishes the plan
        wait_until(lambda: starter.starts, timeout=deadline_for(TIMINGS.poll_s), what="the step's start")
        assert log[-1].startswith("started a pass of lux: ") and "lux's node state (" in log[-1] and "this host's part of the plan (" in log[-1], log
        registry.set_drain(HOST)
        wait_until(
            lambda: [change.entry for change in watcher.state.pending] == ["drain"], timeout=deadline_for(TIMINGS.poll_s), what="lux's drain seen"
        )
        assert len(starter.starts) == 1  # waiting for the plan the leader publishes in answer
        registry.publish_plan(term, placed(("braid", HOST)))
        wait_until(lambda: len(starter.starts) == 2, timeout=deadline_for(TIMINGS.poll_s), what="the drain's and its plan's start")
        assert log[-1].startswith("started a pass of lux: ") and "lux's drain request (" in log[-1] and "this host's part of the plan (" in log[-1], (
            log
        )
        assert len([line for line in log if line.startswith("started a pass")]) == 2


def campaign_when_reachable(registry: Registry) -> Leadership | None:
    try:
        return registry.campaign("qfox-1", 30)
    except RegistryUnavailable:
        return None


def test_an_etcd_that_goes_away_is_retried_and_followed_again_when_back() -> None:
    require("etcd")
    with etcd_cluster(members=1) as cluster:
        fleet = FleetConfig.model_validate(
            {
                "fleet": {"domain": "t.example", "leader_candidates": ["qfox-1"]},
                "registry": {"backend": "etcd", "endpoints": cluster.endpoints, "prefix": f"/t{uuid.uuid4().hex[:12]}"},
            }
        )
        writer, followed = open_registry(fleet, op_timeout_s=1.0), open_registry(fleet, op_timeout_s=1.0)
        try:
            with running(followed) as (watcher, starter, log):
                cluster.stop("m0")
                wait_until(lambda: watcher.failures >= 2, timeout=deadline_for(TIMINGS.retry_max_s * 4), what="the watcher retrying")
                assert log[1].startswith("registry unreachable: etcd: ")
                assert starter.starts == []
                cluster.start("m0", state="existing")
                cluster.wait_healthy()
                # gRPC shares a connection per address between clients: the
                # writer's first calls may meet the one still backing off.
                term = wait_until(lambda: campaign_when_reachable(writer), timeout=deadline_for(2), what="the writer reaching etcd again")
                writer.publish_plan(term, a_plan())
                wait_until(
                    lambda: starter.starts,
                    timeout=deadline_for(TIMINGS.retry_max_s + TIMINGS.window_s + TIMINGS.poll_s),
                    what="a start after the plan",
                )
                assert len(starter.starts) == 1
                assert any(line.startswith("working again after") for line in log)
        finally:
            writer.close()
            followed.close()
