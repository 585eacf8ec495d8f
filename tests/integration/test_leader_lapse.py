"""The leader marks a node offline when its liveness lapses, not at its next step.

fabric-leader.service's loop (`engine.leader.candidate_loop`, run in a thread
with its real `run()`), the real scheduler over the example fleet (signed
plans), and a real registry: a sqlite file and a real etcd member. The hosts
beat from a thread of their own with a short node timeout; the leader's lease
is long, so without a change it steps only every third of it. One host stops
beating: the leader must mark it offline once its timeout has passed since
its last beat and well before that periodic step (etcd: the heartbeat key's
lease lapses and the watch sees the deletion; sqlite: the loop's wait wakes at
the earliest stored deadline), and publish a plan that moves its work at once.
Each test runs again with the registry's wake taken away (a watch that died
without a word, as one did in the e2e fleet): the leader's own wake at the
first lapse it read (`LeaderView.next_lapse`) must do it alone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan
from reconciler.core.live.records import NodeRecord
from reconciler.core.scheduling.placement import schedule
from reconciler.core.timestamps import utc
from reconciler.engine.leader import LeaderLoop, candidate_loop
from reconciler.ports import Registry
from reconciler.wiring import system_clock
from tests.support.harness.waiting import deadline_for, wait_until
from tests.support.hooks import DirectHooks
from tests.support.plan_keys import SignedFleet, signed_example_fleet
from tests.support.registry_store import Store

pytestmark = pytest.mark.integration

# The node timeout of every beat here (the TTL of the heartbeat, etcd's lease),
# and how often the hosts beat: five beats a timeout, so a loaded machine that
# delays one beat by a few seconds does not lapse a live node.
NODE_TIMEOUT_S = 6.0
BEAT_EVERY_S = 1.0
# The leader's lease: without a change its loop steps every third of it
# (LeaderLoop.wait_s), far later than the lapse.
LEASE_TTL_S = 120.0

# The example fleet's hosts: (tier, arch, max_concurrent_tasks).
HOSTS = {
    "lux": ("cpu_ffmpeg", "x86_64", 2),
    "qfox-1": ("gpu_cuda", "x86_64", 4),
    "racknerd": ("relay", "x86_64", 1),
    "a1-arm64": ("cpu_ffmpeg", "aarch64", 2),
    "x86-spill": ("cpu_ffmpeg", "x86_64", 4),
}


class DeadWatch:
    """A registry whose `wait_for_change` never reports a change (it waits
    out its timeout): a watch that died silently, or a backend without one."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._stop = threading.Event()

    def wait_for_change(self, timeout_s: float) -> bool:
        self._stop.wait(timeout_s)
        return False

    def __getattr__(self, name: str):
        return getattr(self._registry, name)


class Beating:
    """The hosts' heartbeats, from a thread, each `BEAT_EVERY_S` under a TTL of
    `NODE_TIMEOUT_S`; `silence(host)` stops one host's beats and returns the
    record of its last one."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.silent: set[str] = set()
        self.last: dict[str, NodeRecord] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeats", daemon=True)

    def beat_all(self) -> None:
        for host, (tier, arch, limit) in HOSTS.items():
            with self._lock:
                if host in self.silent:
                    continue
                record = NodeRecord(node_id=host, tier=tier, arch=arch, max_concurrent_tasks=limit)
                self.last[host] = self.registry.heartbeat(record, ttl_s=NODE_TIMEOUT_S)

    def _run(self) -> None:
        while not self._stop.wait(BEAT_EVERY_S):
            self.beat_all()

    def start(self) -> None:
        self.beat_all()
        self._thread.start()

    def silence(self, host: str) -> NodeRecord:
        with self._lock:  # not mid-beat: the record kept is the last one stored
            self.silent.add(host)
            return self.last[host]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def example_desired(tmp: Path) -> tuple[DesiredState, SignedFleet]:
    signed = signed_example_fleet(tmp / "signed")
    base = load_desired(signed.desired)
    # No cloud hooks: this test is about the plan, not bursts (the example's
    # hooks call gh and wrangler).
    scaling = base.fleet.scaling.model_copy(update={"cloud_hooks": {}})
    return base.model_copy(update={"fleet": base.fleet.model_copy(update={"scaling": scaling})}), signed


@pytest.fixture(params=["registry-wake", "dead-watch"])
def leading(
    request: pytest.FixtureRequest, store: Store, tmp_path: Path
) -> Iterator[tuple[LeaderLoop, Beating, Registry, list[tuple[datetime, str]]]]:
    desired, signed = example_desired(tmp_path)
    # What the leader said, with when it said it.
    logs: list[tuple[datetime, str]] = []
    registry = store.open()
    loop = candidate_loop(
        DeadWatch(registry) if request.param == "dead-watch" else registry,  # type: ignore[arg-type]
        "lux",
        lambda: desired,
        schedule,
        lease_ttl_s=LEASE_TTL_S,
        hooks=DirectHooks(),
        audit=None,
        log=lambda message: logs.append((datetime.now(UTC), message)),
        signer=signed.signer("lux"),
        clock=system_clock(),
    )
    beating = Beating(store.open())
    beating.start()
    runner = threading.Thread(target=loop.run, name="leader", daemon=True)
    runner.start()
    try:
        yield loop, beating, store.open(), logs
    finally:
        loop.stop()
        runner.join(timeout=30)
        beating.stop()


def _placed_on(plan: FleetPlan | None, node: str) -> list[str]:
    return [p.service for p in plan.placements if p.node == node] if plan is not None else []


def test_a_silent_node_goes_offline_when_its_timeout_lapses_and_its_work_moves_at_once(leading):
    loop, beating, registry, logs = leading
    # Every host active and a plan over all five, from the steps their joins woke.
    first = wait_until(
        lambda: (plan := registry.newest_plan()) is not None and {p.node for p in plan.placements} >= {"qfox-1"} and plan,
        timeout=deadline_for(NODE_TIMEOUT_S),
        what="a first plan placing work on qfox-1",
    )
    assert all(s.status == "active" for s in registry.node_states())
    moved = _placed_on(first, "qfox-1")

    last = beating.silence("qfox-1")
    assert last.beat_at is not None
    last_beat = utc(last.beat_at)

    # The leader's own word (a reader of the registry would see the node
    # offline by itself once its beat expired: node_states observes too).
    said = wait_until(
        lambda: next((at for at, line in list(logs) if "qfox-1: offline" in line), None),
        timeout=deadline_for(LEASE_TTL_S / 3),
        what="the leader marking qfox-1 offline",
    )
    # The transition the leader stored, at its step's time.
    state = next(s for s in registry.node_states() if s.node_id == "qfox-1")
    went = next(utc(t.at) for t in reversed(state.transitions) if t.status == "offline")
    assert went <= said
    silent_for = (went - last_beat).total_seconds()
    assert silent_for >= NODE_TIMEOUT_S, f"qfox-1 marked offline {silent_for:.2f} s after its last beat, before its timeout ({NODE_TIMEOUT_S:g} s)"
    # The leader's periodic step comes a third of its lease after the last
    # step, which the joins woke before qfox-1 went silent: being offline
    # this close to the lapse means the lapse itself woke the leader.
    said_after = (said - last_beat).total_seconds()
    assert said_after <= NODE_TIMEOUT_S + loop.wait_s() / 2, (
        f"qfox-1 marked offline {said_after:.2f} s after its last beat: not at its lapse ({NODE_TIMEOUT_S:g} s) "
        f"but at a later step of the leader (every {loop.wait_s():g} s)"
    )

    # The same step publishes the plan that moves its work (the lifecycle is
    # stored first, so the plan may land a moment after the state shows).
    plan = wait_until(
        lambda: (newest := registry.newest_plan()) is not None and newest.epoch > first.epoch and newest,
        timeout=deadline_for(NODE_TIMEOUT_S),
        what="a plan after qfox-1 went offline",
    )
    assert utc(plan.created) >= went, "the plan that moved qfox-1's work is the offline step's"
    assert _placed_on(plan, "qfox-1") == []
    placed_elsewhere = {p.service for p in plan.placements} | {d.service for d in plan.deferred}
    assert set(moved) <= placed_elsewhere, "every service qfox-1 ran is placed elsewhere or deferred"

    # The hosts that kept beating never lapsed.
    others = {s.node_id: s for s in registry.node_states() if s.node_id != "qfox-1"}
    assert {n: s.status for n, s in others.items()} == dict.fromkeys(others, "active")
    assert not [t for s in others.values() for t in s.transitions if t.status == "offline"]


def test_a_node_that_beats_again_before_its_timeout_is_never_marked_offline(leading):
    """The wake at the earliest deadline must not act on a deadline a later beat moved."""
    loop, beating, registry, logs = leading
    wait_until(lambda: registry.newest_plan() is not None, timeout=deadline_for(NODE_TIMEOUT_S), what="a first plan")
    stop_at = datetime.now(UTC) + timedelta(seconds=3 * NODE_TIMEOUT_S)
    # Three timeouts of beats: every deadline the leader woke at had moved on.
    wait_until(lambda: datetime.now(UTC) >= stop_at, timeout=deadline_for(3 * NODE_TIMEOUT_S), interval=0.5, what="three node timeouts")
    states = registry.node_states()
    assert {s.node_id for s in states} == set(HOSTS)
    assert not [t for s in states for t in s.transitions if t.status == "offline"], [line for _, line in logs]
