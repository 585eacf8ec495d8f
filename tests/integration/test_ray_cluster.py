"""reconciler.ray on a real multi-node Ray cluster (issue 13).

Ray's own `ray.cluster_utils.Cluster` on this machine, started once for the
module (tests/support/harness/ray_fleet.py): one Ray node per replayed probe of
qfox-1, a1-arm64 and lux with the resources and labels the fabric renders,
the hosts' heartbeats in a real sqlite registry, which the driver opens the
way `fabric` does (`Dispatcher.connect(path)`); the real leader loop reads
Ray's state API through `reconciler.adapters.ray_state.RayStateReader`. The tests
run in file order: the ones after `without_qfox` run without qfox-1's node.

The tasks ask for no CPU (`num_cpus=0`): their concurrency is the tier
resource each node offers as many times as its max_concurrent_tasks, which
is the fabric's. Waits are wait_until with deadlines (Ray's task events
reach the state API about a second late); nothing asserts wall time.

`ray` comes with the optional extra `ray` (`pip install -e .[test,ray]`):
without it every test here fails, under CI=true as anywhere.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import ray
except ImportError:  # pragma: no cover - the message is the point
    pytest.fail("real component missing: ray (pip install -e '.[test,ray]'; scripts/test installs the extra)", pytrace=False)

from reconciler.adapters.ray_state import RayStateReader
from reconciler.cli import main
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import TIER_SCORE, DesiredState
from reconciler.core.live.models import Snapshot
from reconciler.core.render.ray_node import RAY_WORKER_UNIT
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.heartbeat import node_record
from reconciler.engine.leader import LeaderLoop
from reconciler.ray import CapacityError, Dispatcher, Requirement
from reconciler.wiring import open_registry
from tests.support.harness.ray_fleet import RayFleet, ray_fleet, replayed
from tests.support.harness.waiting import wait_until

pytestmark = pytest.mark.integration

# Ray's nodes start in seconds, its task events reach the state API about a
# second late; on a loaded 2-core machine several times that.
RAY_WAIT_S = 120.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayFleet]:
    with ray_fleet(tmp_path_factory.mktemp("ray")) as started:
        yield started


@pytest.fixture
def released(tmp_path: Path) -> Path:
    """The file whose appearance ends the `held` tasks."""
    return tmp_path / "released"


@pytest.fixture(scope="module")
def stale_dispatcher(fleet: RayFleet) -> Dispatcher:
    """A driver whose node table was read while qfox-1's Ray node lived, and is kept for an hour."""
    fabric = Dispatcher.connect(fleet.registry_path, node_table_max_age_s=3600.0)
    assert "qfox-1" in fabric.ray_nodes()
    return fabric


@pytest.fixture(scope="module")
def without_qfox(fleet: RayFleet, stale_dispatcher: Dispatcher, tmp_path_factory: pytest.TempPathFactory) -> RayFleet:
    """qfox-1's Ray node taken out of the cluster while a task runs on it (the
    tests after this one run without it)."""
    node = fleet.nodes.get("qfox-1")
    if node is not None:
        never = tmp_path_factory.mktemp("never") / "released"
        fabric = dispatcher(fleet)
        fabric.adaptive_remote(held, min_tier="gpu_cuda").remote(str(never), RAY_WAIT_S)
        reader = RayStateReader(fleet.cluster.address)
        wait_until(lambda: reader.observe().running.get("qfox-1") == 1, timeout=RAY_WAIT_S, interval=0.5, what="the task running on qfox-1")
        fleet.cluster.remove_node(node)
        del fleet.nodes["qfox-1"]
        wait_until(
            lambda: not any(n["Alive"] and n["NodeID"] == node.node_id for n in ray.nodes()), timeout=RAY_WAIT_S, what="qfox-1's Ray node gone"
        )
    return fleet


@ray.remote(num_cpus=0)
def where(payload: bytes) -> str:
    """The Ray node the task ran on."""
    return ray.get_runtime_context().get_node_id()


@ray.remote(num_cpus=0)
def held(released: str, deadline_s: float) -> str:
    """Runs until the test releases it (a file appears), at most `deadline_s`."""
    end = time.monotonic() + deadline_s
    while not os.path.exists(released) and time.monotonic() < end:
        time.sleep(0.05)
    return ray.get_runtime_context().get_node_id()


def dispatcher(fleet: RayFleet) -> Dispatcher:
    # The node table re-read at every call: a test removes a node.
    return Dispatcher.connect(fleet.registry_path, node_table_max_age_s=0.0)


def leader(fleet: RayFleet, seen: list[Snapshot], logs: list[str]) -> LeaderLoop:
    """The real leader loop (lux, signing its plans) on the fleet's registry, reading Ray's state API."""

    def recording(snapshot: Snapshot, desired: DesiredState, **kw: object):
        seen.append(snapshot)
        return schedule(snapshot, desired, **kw)  # type: ignore[arg-type]

    signed = fleet.signed
    return LeaderLoop(
        registry=open_registry(fleet.desired.fleet, sqlite_path=fleet.registry_path),
        host="lux",
        load_desired=lambda: load_desired(signed.desired),
        schedule=recording,
        lease_ttl_s=60,
        log=logs.append,
        signer=signed.signer("lux"),
        ray_state=RayStateReader(fleet.cluster.address),
    )


def node_in(snapshot: Snapshot, host: str):
    return next(n for n in snapshot.nodes if n.node_id == host)


# -- with qfox-1 -----------------------------------------------------------------


def test_tasks_land_on_the_highest_satisfying_tier(fleet: RayFleet):
    fabric = dispatcher(fleet)
    for min_tier in ("gpu_cuda", "gpu_apu", "cpu_ffmpeg"):
        assignment = fabric.select_worker(Requirement(min_tier=min_tier))
        assert (assignment.host, assignment.tier, assignment.fallback) == ("qfox-1", "gpu_cuda", False)
        ran_on = ray.get(fabric.adaptive_compute(where, b"frame", min_tier=min_tier), timeout=RAY_WAIT_S)
        assert ran_on == fleet.ray_node_id("qfox-1")
    assert fabric.fallbacks.fallbacks == 0


def test_tasks_running_on_a_node_show_in_its_load_in_the_leaders_snapshot(fleet: RayFleet, released: Path):
    fabric = dispatcher(fleet)
    blocked = [fabric.adaptive_remote(held, min_tier="gpu_cuda").remote(str(released), RAY_WAIT_S) for _ in range(3)]
    # The driver counts what it sent: qfox-1 (limit 4) has one slot left, then lux and a1-arm64 take fallback work.
    assert fabric.own_in_flight() == {"qfox-1": 3}
    seen: list[Snapshot] = []
    logs: list[str] = []
    loop = leader(fleet, seen, logs)
    try:

        def qfox_load() -> tuple[int, int] | None:
            loop.step()
            qfox = node_in(seen[-1], "qfox-1")
            return (qfox.engine_tasks, qfox.in_flight) if qfox.engine_tasks == 3 else None

        assert wait_until(qfox_load, timeout=RAY_WAIT_S, interval=0.5, what="qfox-1's three Ray tasks in the leader's snapshot") == (3, 3)
        assert node_in(seen[-1], "lux").engine_tasks == 0
        released.touch()
        assert set(ray.get(blocked, timeout=RAY_WAIT_S)) == {fleet.ray_node_id("qfox-1")}

        def drained() -> bool:
            loop.step()
            return node_in(seen[-1], "qfox-1").in_flight == 0

        wait_until(drained, timeout=RAY_WAIT_S, interval=0.5, what="qfox-1's load back to 0 once its tasks ended")
        assert fabric.own_in_flight() == {}
    finally:
        released.touch()  # nothing stays held past the test
        if loop.leadership is not None:
            loop.registry.resign(loop.leadership)
        loop.registry.close()


def test_the_burst_check_dispatches_100_tasks_and_prints_its_fallback_count(fleet: RayFleet, capsys: pytest.CaptureFixture[str]):
    """The seed's burst check, on the cluster: 100 calls needing gpu_apu or
    better. A call the fleet has no slot for raises CapacityError (the fleet
    has 8 slots, qfox-1's 4 at gpu_cuda); the burst then waits for one of its
    tasks to end and calls again (the seed's "enqueue for retry")."""
    fabric = dispatcher(fleet)
    refs: list = []
    deferred: list[CapacityError] = []
    for i in range(100):
        if i == 50:
            print("50/100 — mid-burst health check")
        while True:
            try:
                refs.append(fabric.adaptive_compute(where, b"x" * 1024, min_tier="gpu_apu"))
                break
            except CapacityError as exc:
                deferred.append(exc)
                ray.wait(refs, num_returns=len(refs) - sum(fabric.own_in_flight().values()) + 1, timeout=RAY_WAIT_S, fetch_local=False)
    print(fabric.fallbacks.line())
    ran_on = ray.get(refs, timeout=RAY_WAIT_S)
    hosts = fleet.host_of_node()
    tiers = {host: fleet.specs[host].tier for host in fleet.specs}
    below = sum(1 for node_id in ran_on if TIER_SCORE[tiers[hosts[node_id]]] < TIER_SCORE["gpu_apu"])
    assert fabric.fallbacks.dispatched == len(refs) == 100
    # Every fallback the dispatcher counted ran below gpu_apu, and every task that did was counted.
    assert fabric.fallbacks.fallbacks == below
    assert all("full" in exc.reason and not exc.inadmissible for exc in deferred)
    out = capsys.readouterr().out
    assert f"100 tasks dispatched, fallback tiers used: {below}" in out
    with capsys.disabled():
        print(f"\nburst check: {fabric.fallbacks.line()} ({len(deferred)} calls deferred for capacity and retried)")


# -- without qfox-1 ----------------------------------------------------------------


def test_with_qfox1s_node_removed_tasks_fall_back_to_the_next_tier(without_qfox: RayFleet):
    fleet = without_qfox
    fabric = dispatcher(fleet)
    assignment = fabric.select_worker(Requirement(min_tier="gpu_apu"))
    assert (assignment.status, assignment.tier, assignment.fallback) == ("assigned", "cpu_ffmpeg", True)
    ran_on = ray.get(fabric.adaptive_compute(where, b"frame", min_tier="gpu_apu"), timeout=RAY_WAIT_S)
    assert fleet.host_of_node()[ran_on] in ("a1-arm64", "lux")
    # select_worker counts, as the seed's does: the call above and the one inside adaptive_compute.
    assert fabric.fallbacks.line() == "2 tasks dispatched, fallback tiers used: 2"


def test_a_call_runs_on_the_node_the_fabric_chose_not_where_ray_would_put_it(without_qfox: RayFleet):
    """a1-arm64 reports its one slot taken (a service Ray does not know of): the
    fabric sends gpu_apu work to lux, and the pin keeps Ray from using the
    tier_cpu_ffmpeg slot a1-arm64 still offers."""
    fleet = without_qfox
    registry = open_registry(fleet.desired.fleet, sqlite_path=fleet.registry_path)
    facts = replayed(fleet.desired, "a1-arm64")
    busy = node_record(fleet.desired, "a1-arm64", facts).model_copy(update={"in_flight": 1})
    try:
        registry.heartbeat(busy, ttl_s=86_400)
        fabric = dispatcher(fleet)
        hosts = fleet.host_of_node()
        ran_on = [hosts[ray.get(fabric.adaptive_compute(where, b"frame", min_tier="gpu_apu"), timeout=RAY_WAIT_S)] for _ in range(6)]
        assert ran_on == ["lux"] * 6
    finally:
        registry.heartbeat(node_record(fleet.desired, "a1-arm64", facts), ttl_s=86_400)
        registry.close()


def test_a_dead_ray_node_marks_its_hosts_ray_worker_failed_and_a_start_is_decided(without_qfox: RayFleet):
    seen: list[Snapshot] = []
    logs: list[str] = []
    loop = leader(without_qfox, seen, logs)
    try:
        loop.step_and_resign()
    finally:
        loop.registry.close()
    qfox = node_in(seen[-1], "qfox-1")
    assert qfox.units.get(RAY_WORKER_UNIT) == "failed"
    # The task that ran there when it died is still RUNNING in Ray's task events: a dead node runs nothing.
    assert (qfox.engine_tasks, qfox.in_flight) == (0, 0)
    assert node_in(seen[-1], "lux").units.get(RAY_WORKER_UNIT) is None
    assert any(line.startswith("ray worker start qfox-1: its Ray node died while it has idle capacity") for line in logs), logs


def test_a_call_pinned_to_a_node_that_died_fails_and_never_runs_elsewhere(without_qfox: RayFleet, stale_dispatcher: Dispatcher):
    """The registry still has qfox-1 active and the driver's node table still
    has its Ray node: the call is pinned there, and Ray fails it (soft=False)
    instead of running it anywhere else."""
    ref = stale_dispatcher.adaptive_compute(where, b"frame", min_tier="gpu_apu")
    with pytest.raises(ray.exceptions.TaskUnschedulableError, match="soft=False"):
        ray.get(ref, timeout=RAY_WAIT_S)


def test_cuda_only_work_raises_capacity_error_with_its_reason(without_qfox: RayFleet):
    fabric = dispatcher(without_qfox)
    with pytest.raises(CapacityError) as raised:
        fabric.adaptive_compute(where, b"lupine", min_tier="gpu_cuda", floor="gpu_cuda")
    reason = raised.value.reason
    assert "tier gpu_cuda or better" in reason and "no live Ray node on qfox-1" in reason, reason
    assert not raised.value.inadmissible  # qfox-1's host still beats: its Ray worker may come back
    assert fabric.fallbacks.dispatched == 0


def leader_run_once(fleet: RayFleet, desired: Path, *options: str) -> int:
    """`fabric leader run --once` as lux over the Ray fleet's registry."""
    argv = ["leader", "run", "--once", "--host", "lux", *options, "--desired", str(desired), "--registry-path", str(fleet.registry_path)]
    return main([*argv, "--plan-key-file", str(fleet.signed.key_file("lux"))])


def test_fabric_leader_run_with_the_ray_address_says_which_ray_worker_to_start(without_qfox: RayFleet, capsys: pytest.CaptureFixture[str]):
    fleet = without_qfox
    code = leader_run_once(fleet, fleet.signed.desired, "--ray-address", fleet.cluster.address)
    err = capsys.readouterr().err
    assert code == 0, err
    assert "fabric-leader: ray worker start qfox-1: its Ray node died while it has idle capacity (0/4, tier gpu_cuda)" in err


def test_fabric_leader_run_reads_ray_from_the_ray_heads_dashboard_without_being_told(
    without_qfox: RayFleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    # In production fabric-leader.service is given no --ray-address: it reads
    # Ray's state API from the [ray] head's dashboard. Here the head (lux) is
    # the test cluster's, whose dashboard listens on this machine.
    fleet = without_qfox
    dashboard = ray._private.worker.get_dashboard_url()
    address, port = dashboard.removeprefix("http://").rsplit(":", 1)
    desired = tmp_path / "desired"
    shutil.copytree(fleet.signed.desired, desired)
    lux = desired / "lux.toml"
    lux.write_text(re.sub(r'(?m)^address = ".*"$', f'address = "{address}"', lux.read_text(), count=1))
    fabric_toml = desired / "fabric.toml"
    fabric_toml.write_text(re.sub(r"(?m)^dashboard = (true|false)$", f"dashboard = true\ndashboard_port = {port}", fabric_toml.read_text(), count=1))
    assert f"dashboard_port = {port}" in fabric_toml.read_text()
    code = leader_run_once(fleet, desired)
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"fabric-leader: Ray's state from http://{address}:{port} ([ray] head's dashboard)" in err
    assert "fabric-leader: ray worker start qfox-1: its Ray node died while it has idle capacity" in err
