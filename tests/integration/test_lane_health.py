"""Lane health from the hosts' heartbeats, end to end on both registry backends.

The example fleet on a real registry (`store`: a sqlite file, or a private
prefix of a real etcd member) with a small node timeout; every host beats,
the real leader loop (engine.leader.LeaderLoop, signing its plans as lux)
advances the lifecycle, and the real commands read it: `fabric dispatch
--lane`, `fabric lane status` and `fabric lane dispatch --once` (the lane
dispatcher) over phaze's broker (a real PostgreSQL, named by the desired
state's [phaze] queue_url_file) with a real SAQ worker on every lane's queue. a1-arm64's host stops beating -> once the leader marks it
offline, the next job goes to x86-spill and `fabric lane status` shows
a1-arm64 offline with the reason; x86-spill's host silent too -> the next job
goes to local at once; the hosts beat again -> the lanes are back.

Real time (the heartbeat TTL is an etcd lease): every wait is a wait_until
with a deadline from the configured timings (tests/support/harness/waiting.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.leader import LeaderLoop
from tests.support.cli import fabric
from tests.support.harness.own_lanes import OWN_A1, OWN_LOCAL, OWN_X86, own_lanes
from tests.support.harness.postgres import broker_url_file, naming_broker
from tests.support.harness.saq_workers import LaneWorkers
from tests.support.harness.waiting import deadline_for, wait_until
from tests.support.registry_store import EXAMPLE_HOSTS, beat_example_fleet, status_of

pytestmark = pytest.mark.integration

HEARTBEAT_S = 1
NODE_TIMEOUT_S = 2
TIMING = {"heartbeat_s": HEARTBEAT_S, "node_timeout_s": NODE_TIMEOUT_S, "relayed_heartbeat_s": HEARTBEAT_S, "missed_beats": 2}
# A host goes offline within its node timeout, and the leader marks it at its next step.
OFFLINE_WITHIN_S = deadline_for(NODE_TIMEOUT_S + HEARTBEAT_S)


class Fleet:
    """The example fleet's desired state on `store`, its hosts' beats, the leader, and the commands."""

    def __init__(self, store, tmp_path, capsys, broker_dsn) -> None:
        store.config = {"timing": TIMING}
        self.dsn = broker_dsn
        url_file = broker_url_file(tmp_path, broker_dsn)
        self.workers = LaneWorkers(broker_dsn)
        for queue in (OWN_A1, OWN_X86, OWN_LOCAL):
            self.workers.start(queue)
        self.capsys = capsys
        self.desired_dir = store.desired_dir(tmp_path)
        toml = self.desired_dir / "fabric.toml"
        text = toml.read_text()
        timing = re.search(r"(?ms)^\[timing\]\n.*?(?=^\[)", text)
        assert timing is not None
        text = text.replace(timing.group(0), "[timing]\n" + "".join(f"{k} = {v}\n" for k, v in TIMING.items()) + "\n")
        # The fabric's own lanes: the example fleet is phaze's, where phaze dispatches.
        toml.write_text(naming_broker(own_lanes(text), url_file))
        self.desired = load_desired(self.desired_dir)
        assert self.desired.fleet.timing.node_timeout_s == NODE_TIMEOUT_S
        self.registry = store.open()
        self.logs: list[str] = []
        self.leader = LeaderLoop(
            registry=store.open(),
            host="lux",
            load_desired=lambda: self.desired,
            schedule=schedule,
            lease_ttl_s=60,
            log=self.logs.append,
            signer=store.signed.signer("lux"),
        )
        self.silent: set[str] = set()

    def beat(self) -> None:
        """One beat of every host not silenced, with the fleet's node timeout."""
        beat_example_fleet(self.registry, ttl_s=None, hosts=[h for h in EXAMPLE_HOSTS if h not in self.silent])

    def step(self) -> None:
        """The hosts beat, then the leader steps."""
        self.beat()
        self.leader.step()

    def leader_marks(self, host: str, status: str) -> None:
        def marked() -> bool:
            self.step()
            return status_of(self.registry, host) == status

        wait_until(marked, timeout=OFFLINE_WITHIN_S, interval=0.2, what=f"the leader marking {host} {status}")

    def fabric(self, *argv: str) -> str:
        code, out, err = fabric(self.capsys, *argv, "--desired", str(self.desired_dir))
        assert code == 0, err
        return out

    def next_lane(self) -> str | None:
        return json.loads(self.fabric("dispatch", "--lane", "--json"))["lane"]

    def lanes(self) -> dict[str, dict]:
        return {lane["id"]: lane for lane in json.loads(self.fabric("lane", "status", "--json"))["lanes"]}

    def dispatch_one(self, job: str) -> str | None:
        """The lane dispatcher takes `job` into its lane's queue; its SAQ
        worker finishes it and the next dispatch pass settles it (the slot free again)."""
        self.fabric("lane", "enqueue", job)
        (event,) = [json.loads(line) for line in self.fabric("lane", "dispatch", "--once", "--json").splitlines()]
        if event["lane"] is not None:
            wait_until(lambda: job in self.workers.ran, timeout=deadline_for(HEARTBEAT_S), what=f"a worker taking {job}")
            self.workers.finish(job)
            settled = wait_until(
                lambda: [e for e in map(json.loads, self.fabric("lane", "dispatch", "--once", "--json").splitlines()) if e["job"] == job],
                timeout=deadline_for(HEARTBEAT_S),
                what=f"{job} settled",
            )
            assert settled[0]["outcome"] == "complete", settled
        return event["lane"]


@pytest.fixture
def fleet(store, tmp_path, capsys, broker_dsn) -> Iterator[Fleet]:
    fleet = Fleet(store, tmp_path, capsys, broker_dsn)
    try:
        yield fleet
    finally:
        fleet.workers.close()


def test_a_silent_host_takes_its_lane_offline_with_the_reason_and_back(fleet):
    fleet.step()
    assert {k: v["online"] for k, v in fleet.lanes().items()} == {"a1-arm64": True, "x86-spill": True, "local": True}
    assert fleet.next_lane() == "a1-arm64"
    assert fleet.dispatch_one("first") == "a1-arm64"

    # a1-arm64's host stops beating: once the leader marks it offline, its lane is.
    fleet.silent.add("a1-arm64")
    fleet.leader_marks("a1-arm64", "offline")
    assert fleet.next_lane() == "x86-spill"
    assert fleet.dispatch_one("second") == "x86-spill"
    a1 = fleet.lanes()["a1-arm64"]
    assert a1["online"] is False
    assert re.fullmatch(r"host a1-arm64 offline since \d\d:\d\d:\d\d", a1["reason"]), a1["reason"]
    text = fleet.fabric("lane", "status")
    assert f"OFFLINE: {a1['reason']}" in text
    status = json.loads(fleet.fabric("status", "--json"))
    assert next(lane for lane in status["lanes"] if lane["id"] == "a1-arm64")["reason"] == a1["reason"]

    # x86-spill silent as well: every compute lane offline, local at once (no spill wait).
    fleet.silent.add("x86-spill")
    fleet.leader_marks("x86-spill", "offline")
    assert fleet.next_lane() == "local"
    assert fleet.dispatch_one("third") == "local"
    assert {k: v["online"] for k, v in fleet.lanes().items()} == {"a1-arm64": False, "x86-spill": False, "local": True}

    # The hosts beat again: the lanes are back, the cheapest first.
    fleet.silent.clear()
    fleet.leader_marks("a1-arm64", "active")
    fleet.leader_marks("x86-spill", "active")
    assert {k: (v["online"], v["reason"]) for k, v in fleet.lanes().items()} == {
        "a1-arm64": (True, None),
        "x86-spill": (True, None),
        "local": (True, None),
    }
    assert fleet.next_lane() == "a1-arm64"
    assert fleet.dispatch_one("fourth") == "a1-arm64"


def test_services_and_lane_jobs_share_each_hosts_limit(fleet):
    """The leader's plan places services; the dispatcher then fills the lanes
    only as far as each push host's limit has room left beside them."""
    fleet.step()
    plan = fleet.registry.newest_plan()
    assert plan is not None and plan.placements
    services = {host: sum(p.node == host for p in plan.placements) for host in EXAMPLE_HOSTS}
    jobs = [f"job-{i}" for i in range(10)]
    fleet.fabric("lane", "enqueue", *jobs)
    events = [json.loads(line) for line in fleet.fabric("lane", "dispatch", "--once", "--json").splitlines()]
    started: dict[str, int] = {}
    for event in events:
        if event["lane"] is not None:
            started[event["lane"]] = started.get(event["lane"], 0) + 1
    lanes = fleet.lanes()
    for lane in fleet.desired.lanes:
        host = lanes[lane.id]["host"]
        limit = EXAMPLE_HOSTS[host][2]
        taken = started.get(lane.id, 0)
        assert taken <= lane.cap
        assert services[host] + taken <= limit, (lane.id, host, services[host], taken)
        # A compute lane stopped taking jobs when its cap or its host's room
        # ran out, and the view says which (the local lane waits for its spill gate).
        if lane.kind == "local":
            continue
        if taken < lane.cap:
            assert lanes[lane.id]["full"] == "host" and services[host] + taken == limit
        else:
            assert lanes[lane.id]["full"] == "cap"
    # The example fleet's plan puts one service on a1-arm64 (limit 2): its lane
    # gets one job, not its cap of 2; x86-spill (limit 4, no service) its cap.
    assert (services["a1-arm64"], started.get("a1-arm64"), lanes["a1-arm64"]["full"]) == (1, 1, "host")
    assert (started.get("x86-spill"), lanes["x86-spill"]["full"]) == (4, "cap")
