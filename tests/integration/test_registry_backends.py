"""The same registry behaviour on both backends: a sqlite file and a real etcd.

Every test runs twice (`backend` = sqlite, etcd). etcd is one real member
started by this module (tests/support/harness/etcd.py) on loopback; each test uses its
own key prefix, or its own sqlite file. Real time and short TTLs (1-2 s) here:
what is tested is what real processes and real leases do. The timing rules
themselves are tested with an injected clock in tests/unit/test_lifecycle.py
and tests/integration/test_registry_sqlite.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from reconciler.ports import NotLeader
from tests.conftest import REPO
from tests.support.clock import FakeClock
from tests.support.harness.waiting import deadline_for, wait_until
from tests.support.registry_store import a_plan, leader_name, record, status_of

pytestmark = pytest.mark.integration

PYTHON = sys.executable
# The TTL of a node record or a lease that a test needs to hold while it makes
# a few calls: long enough that a loaded machine does not lapse it mid-test.
SHORT_TTL_S = 2
# How long a real process may take to start and say something (Python start-up
# and imports on a loaded 2-core machine).
START_S = 30


# -- heartbeats and the lifecycle ------------------------------------------------


def test_a_nodes_record_expires_after_its_ttl_and_the_node_turns_offline(store):
    registry = store.open()
    stored = registry.heartbeat(record("qfox-1", "gpu_cuda"), ttl_s=SHORT_TTL_S)
    assert stored.timeout_s == SHORT_TTL_S and stored.beat_at is not None
    registry.wait_for_change(0)  # arm the watch
    assert status_of(registry, "qfox-1") == "active"
    assert registry.wait_for_change(deadline_for(SHORT_TTL_S)), "the expiry must wake a waiting leader"
    wait_until(lambda: status_of(registry, "qfox-1") == "offline", timeout=deadline_for(SHORT_TTL_S), what="qfox-1 offline")
    node = next(n for n in registry.snapshot().nodes if n.node_id == "qfox-1")
    assert node.status == "offline" and node.tier == "gpu_cuda", "an offline node keeps its facts"


def test_a_beat_whose_own_expiry_has_passed_is_lapsed_before_etcd_revokes_its_lease(store):
    """The leader reads a node as lapsed at its beat_at + TTL by the
    registry's clock, not when etcd's lessor gets round to revoking the lease
    (up to 500 ms later): here the clock is moved past the expiry of a beat
    whose real lease has a minute left, so only the record's own expiry can
    tell (sqlite judges by it anyway)."""
    clock = FakeClock(start=time.time())
    registry = store.open(clock=clock)
    registry.heartbeat(record("qfox-1", "gpu_cuda"), ttl_s=60)
    clock.advance(59.9)
    assert status_of(registry, "qfox-1") == "active"
    clock.advance(0.2)
    assert status_of(registry, "qfox-1") == "offline"


def test_the_leader_stores_the_lifecycle_with_reasons(store):
    registry = store.open()
    leadership = registry.campaign("lux", 30)
    registry.heartbeat(record("a1-arm64"), ttl_s=SHORT_TTL_S)
    events = registry.advance_lifecycle(leadership)
    assert [(e.node_id, e.transition.status) for e in events] == [("a1-arm64", "active")]
    assert registry.advance_lifecycle(leadership) == [], "nothing changed, nothing to store"
    wait_until(lambda: status_of(registry, "a1-arm64") == "offline", timeout=deadline_for(SHORT_TTL_S), what="a1-arm64 offline")
    events = registry.advance_lifecycle(leadership)
    assert [e.transition.status for e in events] == ["offline"]
    # Another client reads the stored history.
    other = store.open()
    state = next(s for s in other.node_states() if s.node_id == "a1-arm64")
    assert [t.status for t in state.transitions] == ["active", "offline"]
    assert "evacuate" in state.transitions[-1].reason
    registry.heartbeat(record("a1-arm64"), ttl_s=30)
    assert [e.transition.status for e in registry.advance_lifecycle(leadership)] == ["active"]


def test_the_leaders_step_reads_the_registry_once(store):
    """`lead` advances the lifecycle and takes the snapshot over one read: the
    snapshot shows the states just stored, and the newest plan comes with it."""
    registry = store.open()
    leadership = registry.campaign("lux", 30)
    registry.heartbeat(record("a1-arm64"), ttl_s=30)
    registry.heartbeat(record("qfox-1", "gpu_cuda"), ttl_s=30)
    published = registry.publish_plan(leadership, a_plan())
    reads = 0
    read = registry._read

    def counted():
        nonlocal reads
        reads += 1
        return read()

    registry._read = counted
    view = registry.lead(leadership, lanes=["gpu"])
    assert reads == 1
    assert sorted((e.node_id, e.transition.status) for e in view.events) == [("a1-arm64", "active"), ("qfox-1", "active")]
    assert view.plan is not None and view.plan.epoch == published.epoch
    assert [(n.node_id, n.status, n.tier) for n in view.snapshot.nodes] == [("a1-arm64", "active", "cpu_ffmpeg"), ("qfox-1", "active", "gpu_cuda")]
    assert [lane.id for lane in view.snapshot.lanes] == ["gpu"]
    registry._read = read
    assert view.snapshot.nodes == registry.snapshot().nodes, "what another reader sees of the stored states"
    assert registry.lead(leadership).events == [], "nothing changed, nothing to store"


def test_an_offline_node_shows_its_last_beat_and_a_beat_alone_rewrites_no_state(store):
    """Both backends store a state without what the node's record holds (the
    record, an up node's last_seen): a beat alone changes no stored state, and
    what it left out comes back from the record (an offline node was last
    seen at its last beat)."""
    registry = store.open()
    leadership = registry.campaign("lux", 30)
    registry.heartbeat(record("a1-arm64"), ttl_s=2)
    registry.advance_lifecycle(leadership)
    written: list[set[str]] = []
    store_lifecycle = registry._store_lifecycle

    def recorded(leadership, changed, dead, forgotten):
        written.append(set(changed))
        store_lifecycle(leadership, changed, dead, forgotten)

    registry._store_lifecycle = recorded
    last = registry.heartbeat(record("a1-arm64", in_flight=1), ttl_s=2)
    registry.advance_lifecycle(leadership)
    assert written == [set()], "a beat alone rewrites no state"
    node = next(n for n in registry.snapshot().nodes if n.node_id == "a1-arm64")
    assert node.in_flight == 1 and node.last_seen == last.beat_at, "the newest beat shows"
    wait_until(lambda: status_of(registry, "a1-arm64") == "offline", timeout=deadline_for(SHORT_TTL_S), what="a1-arm64 offline")
    registry.advance_lifecycle(leadership)
    state = next(s for s in store.open().node_states() if s.node_id == "a1-arm64")
    assert state.status == "offline" and state.last_seen == last.beat_at
    assert state.record is not None and state.record.in_flight == 1, "an offline node keeps its facts"


def test_several_processes_heart_beating_at_once(store):
    """Four real processes beat every 50 ms into the same store (a record
    lives SHORT_TTL_S); one is killed and turns offline while the others stay active."""
    script = (
        "import json, sys, time\n"
        "from reconciler.core.desired.model import FleetConfig\n"
        "from reconciler.wiring import open_registry\n"
        "from reconciler.core.live.records import NodeRecord\n"
        "cfg = json.loads(sys.argv[1])\n"
        "fleet = FleetConfig.model_validate({'fleet': {'domain': 't.example', 'leader_candidates': ['lux']}, 'registry': cfg['registry']})\n"
        "reg = open_registry(fleet, sqlite_path=cfg['sqlite_path'])\n"
        "n = 0\n"
        "while True:\n"
        "    reg.heartbeat(NodeRecord(node_id=sys.argv[2], tier='cpu_ffmpeg', in_flight=n % 3, max_concurrent_tasks=3), ttl_s=float(sys.argv[3]))\n"
        "    n += 1\n"
        "    time.sleep(0.05)\n"
    )
    nodes = ["node-a", "node-b", "node-c", "node-d"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {
        n: subprocess.Popen([PYTHON, "-c", script, store.as_json(), n, str(SHORT_TTL_S)], env=env, stderr=subprocess.PIPE, text=True) for n in nodes
    }
    try:
        registry = store.open()
        wait_until(
            lambda: {s.node_id for s in registry.node_states() if s.status == "active"} == set(nodes),
            timeout=START_S,
            what="every beating process is active",
        )
        victim = procs.pop("node-c")
        victim.kill()
        victim.wait(timeout=10)
        wait_until(lambda: status_of(registry, "node-c") == "offline", timeout=deadline_for(SHORT_TTL_S), what="the killed process's node offline")
        for n, proc in procs.items():
            assert proc.poll() is None, f"{n}'s beater died: {proc.stderr.read() if proc.stderr else ''}"
            assert status_of(registry, n) == "active"
    finally:
        for proc in [*procs.values()]:
            proc.kill()
            proc.wait(timeout=10)


def test_drain_and_undrain_through_the_registry(store):
    registry = store.open()
    registry.heartbeat(record("lux"), ttl_s=30)
    registry.set_drain("lux", grace_s=30)
    node = registry.snapshot().nodes[0]
    assert node.status == "draining" and not node.drained, "within the grace its work stays"
    registry.set_drain("lux", grace_s=0)
    node = registry.snapshot().nodes[0]
    assert node.status == "draining" and node.drained
    assert registry.clear_drain("lux")
    assert not registry.clear_drain("lux")
    node = registry.snapshot().nodes[0]
    assert node.status == "active" and not node.drained


def test_a_join_from_another_process_wakes_the_waiting_leader(store):
    leader_side = store.open()
    leader_side.wait_for_change(0)
    assert not leader_side.wait_for_change(0.3), "nothing happened yet"
    node_side = store.open()
    node_side.heartbeat(record("x86-spill"), ttl_s=30)
    assert leader_side.wait_for_change(5)
    node_side.heartbeat(record("x86-spill"), ttl_s=30)
    assert not leader_side.wait_for_change(0.5), "a routine beat of a known node is not a change"


# -- leadership, epochs and the plan ------------------------------------------------


def test_one_leader_at_a_time_and_a_stale_leaders_publish_is_refused(store):
    first, second = store.open(), store.open()
    old = first.campaign("lux", SHORT_TTL_S)
    assert old is not None and old.epoch >= 1
    assert second.campaign("qfox-1", SHORT_TTL_S) is None, "lux leads"
    assert second.leader().candidate == "lux"
    published = first.publish_plan(old, a_plan())
    assert published.epoch > old.epoch and published.leader == "lux"
    # lux stops renewing: its term lapses and qfox-1 takes over.
    new = None

    def takeover() -> bool:
        nonlocal new
        new = second.campaign("qfox-1", 10)
        return new is not None

    wait_until(takeover, timeout=deadline_for(SHORT_TTL_S), what="qfox-1 leads after lux's lease lapsed")
    assert new.epoch > published.epoch, "a new term is newer than anything the old one published"
    with pytest.raises(NotLeader):
        first.publish_plan(old, a_plan())
    with pytest.raises(NotLeader):
        first.advance_lifecycle(old)
    assert not first.renew(old)
    assert first.newest_plan().epoch == published.epoch, "the refused plan was not stored"
    epochs = [second.publish_plan(new, a_plan()).epoch for _ in range(3)]
    assert epochs == sorted(set(epochs)) and epochs[0] > new.epoch, "epochs strictly increase"
    assert second.epoch() == epochs[-1]
    assert second.newest_plan().leader == "qfox-1"


def test_renewal_keeps_the_term_and_resigning_frees_it(store):
    a, b = store.open(), store.open()
    ttl = 3.0
    term = a.campaign("lux", ttl)
    for _ in range(6):  # twice the TTL, kept alive by renewals three times per TTL (the leader's own rhythm)
        time.sleep(ttl / 3)
        assert a.renew(term)
    assert b.campaign("qfox-1", ttl) is None
    a.resign(term)
    assert a.leader() is None
    assert b.campaign("qfox-1", ttl) is not None


def test_killing_the_leader_process_elects_another_candidate_once_its_lease_lapses(store, tmp_path):
    """Two real `fabric leader run` processes; the leader is killed (no resign).

    A 3 s term renewed every TTL/3 (the leader's own rhythm): a live leader
    keeps it unless it stalls for two renewal periods."""
    ttl = 3.0
    desired = store.desired_dir(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("FABRIC_REGISTRY", None)

    def start(host: str) -> subprocess.Popen:
        return subprocess.Popen(
            [PYTHON, "-m", "reconciler", "leader", "run", "--host", host, "--lease-ttl", str(ttl), "--desired", str(desired)]
            + ["--plan-key-file", str(store.signed.key_file(host))],
            env=env,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )

    registry = store.open()
    lux = start("lux")
    qfox = None
    try:
        wait_until(lambda: leader_name(registry) == "lux", timeout=START_S, what="lux leads")
        wait_until(lambda: registry.newest_plan() is not None, timeout=START_S, what="lux published a plan")
        qfox = start("qfox-1")
        said: list[str] = []
        threading.Thread(target=lambda: said.extend(qfox.stderr), daemon=True).start()
        wait_until(lambda: any("qfox-1 campaigning" in line for line in said), timeout=START_S, what="qfox-1 campaigning")
        # For a whole lease TTL while qfox-1 campaigns and watches, the live leader keeps its term.
        watched_until = time.monotonic() + ttl
        while time.monotonic() < watched_until:
            assert leader_name(registry) == "lux", "a follower does not unseat a live leader"
            time.sleep(0.05)
        epoch_before = registry.epoch()
        lux.send_signal(signal.SIGKILL)
        lux.wait(timeout=10)
        # The lapsed lease ends lux's term one TTL after its last renewal (etcd
        # may end a lease up to about half a second late); the watch (etcd) or
        # the renewal period (sqlite, TTL/3) wakes qfox-1 then. The deadline
        # only bounds a broken run (a loaded machine is slow); bench/registry
        # measures the takeover itself.
        wait_until(lambda: leader_name(registry) == "qfox-1", timeout=deadline_for(ttl), what="qfox-1 leads")
        assert registry.epoch() > epoch_before
        assert registry.leader().epoch > epoch_before
        # A node joins: the new leader is woken, reschedules and publishes.
        registry.heartbeat(record("qfox-1", "gpu_cuda", max_concurrent_tasks=4), ttl_s=30)
        # (A new term publishes its own plan at once, before the join: wait for the one that places work on qfox-1.)
        wait_until(
            lambda: (p := registry.newest_plan()).leader == "qfox-1" and any(x.node == "qfox-1" for x in p.placements),
            timeout=START_S,
            what="qfox-1 published its plan with the node that joined",
        )
        plan = registry.newest_plan()
        assert plan.epoch > registry.leader().epoch and any(p.node == "qfox-1" for p in plan.placements)
    finally:
        for proc in (lux, qfox):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
    assert qfox.returncode == 0, qfox.stderr.read()
    assert registry.leader() is None, "SIGTERM resigns"


def test_snapshot_has_every_declared_lane_and_the_plan(store):
    registry = store.open()
    registry.heartbeat(record("qfox-1", "gpu_cuda", in_flight=1, units={"fabric-agent-lupine.service": "failed"}), ttl_s=30)
    term = registry.campaign("lux", 30)
    from reconciler.core.live.models import Placement

    plan = a_plan().model_copy(update={"placements": [Placement(service="lupine", replica=0, node="qfox-1", tier="gpu_cuda")]})
    registry.publish_plan(term, plan)
    snap = registry.snapshot(lanes=["a1-arm64", "x86-spill", "local"])
    # The declared lanes, with no load: that is the lane queue's (engine.lane_states).
    assert [(lane.id, lane.in_flight, lane.queue) for lane in snap.lanes] == [("a1-arm64", 0, None), ("local", 0, None), ("x86-spill", 0, None)]
    assert snap.leader == "lux" and snap.epoch == registry.epoch()
    assert [(p.service, p.node) for p in snap.placements] == [("lupine", "qfox-1")]
    (node,) = snap.nodes
    assert (node.node_id, node.in_flight, node.max_concurrent_tasks, node.utilization) == ("qfox-1", 1, 2, 0.5)
    # The units' states the host beat with reach the snapshot (lane health reads them).
    assert node.units == {"fabric-agent-lupine.service": "failed"}
    # The export format is what `fabric schedule --snapshot` reads back.
    from reconciler.core.live.models import Snapshot

    assert Snapshot.model_validate_json(snap.model_dump_json()) == snap
