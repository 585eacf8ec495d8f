"""A burst on measured load: real lane jobs raise what the hosts' passes measure, and the leader scales on it.

Nothing feeds `in_flight` by hand (tests/integration/test_leader_scaling.py
does, to pin each rule): here every host of the example fleet runs its real
`fabric reconcile` pass (engine.memoized_pass.run_memoized_pass on the
command line's own ports, reconciler.wiring: files under a tmp root, its replayed
probe capture, --no-activate, so a host's services are its placements), the
lane jobs go through the real lane queue on phaze's broker (a real
PostgreSQL: `PostgresLaneBroker.enqueue`, the dispatcher's
engine.dispatch.dispatch_pass, and real SAQ workers on every lane's queue
that finish the jobs when the test says), and the real leader loop
(engine.leader.candidate_loop, as fabric-leader.service builds it) decides
on the node records the passes wrote. Both registry backends: a sqlite file
and a private prefix of a real etcd member.

Time is one injected clock, the registry's and the passes' (the one change
to the ports besides the audit and notes kept in lists): the [scaling] windows of a copy of the example desired state pass by
advancing it, never by more than the node timeout at once, and every host
beats (a pass) before every leader step, so no host lapses. The cloud hooks
of two tiers are a real script in tmp_path that appends its argv and the wall
time to a file.

    1 the fleet converges on the leader's plan: each host's load is its placements
    2 more lane jobs than the lanes can take: the lanes fill, each host's
      in_flight rises by the jobs on its lanes; the queue stays above
      queue_high for the burst window -> the idle lane host (lux) is activated
      first (racknerd, an idle relay with no lane, is no capacity for lane
      jobs); once lux runs a spilled job, each tier's hook runs, once per tier
      per group interval
    3 the jobs finish (the lanes' SAQ workers), the queue drains, the load falls;
      after the scale-down window the leader scales the idle groups down, and
      no scale_down was ever recorded while the queue was above queue_high
"""

from __future__ import annotations

import re
import stat
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from reconciler.adapters.lane_broker_pg import PostgresLaneBroker
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState, FleetConfig
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.dispatch import dispatch_pass
from reconciler.engine.leader import LeaderLoop, candidate_loop
from reconciler.engine.memoized_pass import run_memoized_pass
from reconciler.engine.pass_options import PlanFromRegistry
from reconciler.engine.reconcile import PassOptions
from reconciler.engine.scaling_step import queue_depth
from reconciler.ports import Registry
from reconciler.wiring import memo_ports, memo_registry_opener, open_registry, real_pass_ports
from tests.conftest import REPO
from tests.support.audit import RecordingAudit
from tests.support.clock import FakeClock
from tests.support.harness.own_lanes import OWN_A1, OWN_LOCAL, OWN_X86, own_lanes
from tests.support.harness.saq_workers import LaneWorkers
from tests.support.harness.waiting import deadline_for, wait_until
from tests.support.hooks import DirectHooks
from tests.support.plan_keys import SignedFleet, signed_example_fleet

pytestmark = pytest.mark.integration

HOSTS = ("lux", "qfox-1", "racknerd", "a1-arm64", "x86-spill")
PROBES = REPO / "tests" / "fixtures" / "probe"
LEASE_S = 10**6  # the leader's lease outlives the test
QUEUE_HIGH = 2
BURST_WINDOW_S = 20
GROUP_INTERVAL_S = 30
SCALE_DOWN_WINDOW_S = 60
# Longer than the burst window: the local lane (lux) takes a job only after
# the burst has found lux idle, so "idle capacity first" is seen before the hooks.
LOCAL_SPILL_AFTER_S = 25
SCALING = (
    "[scaling]\n"
    f"queue_high = {QUEUE_HIGH}\n"
    f"burst_window_s = {BURST_WINDOW_S}\n"
    f"group_interval_s = {GROUP_INTERVAL_S}\n"
    "scale_up_utilization = 0.8\n"
    # Out of the way: qfox-1 runs 4 of 4 throughout (vertical scaling has its own tests).
    "scale_up_window_s = 3600\n"
    "scale_down_utilization = 0.1\n"
    f"scale_down_window_s = {SCALE_DOWN_WINDOW_S}\n"
)
# The cloud hook: appends the wall time and its argv, one line a run.
HOOK_SCRIPT = '#!/bin/sh\nout="$1"; shift\nprintf \'%s %s\\n\' "$(date -u +%Y-%m-%dT%H:%M:%S.%N)" "$*" >> "$out"\n'


class LiveFleet:
    """The example fleet on one registry, with one clock for the registry, the passes and the leader."""

    def __init__(self, settings: dict, sqlite_path: Path | None, tmp: Path, broker_dsn: str) -> None:
        self.tmp = tmp
        self.settings = settings
        self.sqlite_path = sqlite_path
        self.clock = FakeClock(float(int(time.time())))  # whole seconds: registry times keep microseconds
        self.dsn = broker_dsn
        # A worker on every lane's queue, each taking more than its cap: the
        # caps and the hosts' accounts are the dispatcher's to keep.
        self.workers = LaneWorkers(broker_dsn)
        for queue in (OWN_A1, OWN_X86, OWN_LOCAL):
            self.workers.start(queue, concurrency=8)
        self.lane_queues: list[PostgresLaneBroker] = []
        self.lanes = self._open_lanes()
        self.hook_out = tmp / "hook-runs.txt"
        self.signed: SignedFleet = signed_example_fleet(tmp / "fleet")
        self.desired_dir = self.signed.desired
        self._configure()
        self.desired: DesiredState = load_desired(self.desired_dir)
        self.opened: list[Registry] = []
        self.registry = self.open()
        self.logs: list[str] = []
        self.notes: dict[str, list[str]] = {h: [] for h in HOSTS}
        # What each leader step saw: (time, queue depth, each host's in_flight).
        self.steps: list[tuple[float, int, dict[str, int]]] = []
        self.leader: LeaderLoop = candidate_loop(
            self.open(),
            "lux",
            lambda: self.desired,
            schedule,
            lease_ttl_s=LEASE_S,
            hooks=DirectHooks(),
            audit=RecordingAudit(),
            log=self.logs.append,
            signer=self.signed.signer("lux"),
            lane_broker=self._open_lanes(),
        )

    def _open_lanes(self, fleet: object = None) -> PostgresLaneBroker:
        """The lane queue on this fleet's clock (the passes' and the leader's)."""
        queue = PostgresLaneBroker(self.dsn, self.clock)
        self.lane_queues.append(queue)
        return queue

    def _configure(self) -> None:
        """[registry] -> this store, short [scaling] windows, both tiers' hooks -> the script."""
        hook = self.tmp / "cloud-hook"
        hook.write_text(HOOK_SCRIPT)
        hook.chmod(hook.stat().st_mode | stat.S_IXUSR)
        toml = self.desired_dir / "fabric.toml"
        text = toml.read_text()
        registry = re.search(r"(?ms)^\[registry\]\n.*?(?=^\[)", text)
        spill = re.search(r"(?m)^local_spill_after_s = \d+", text)
        scaling = re.search(r"(?ms)^\[scaling\]\n.*?(?=^# One more worker group)", text)
        assert registry is not None and scaling is not None and spill is not None
        if self.settings["backend"] == "etcd":
            endpoints = ", ".join(f'"{e}"' for e in self.settings["endpoints"])
            new_registry = f'[registry]\nbackend = "etcd"\nendpoints = [{endpoints}]\nprefix = "{self.settings["prefix"]}"\n\n'
        else:
            new_registry = f'[registry]\nbackend = "sqlite"\npath = "{self.sqlite_path}"\n\n'
        text = text.replace(registry.group(0), new_registry).replace(scaling.group(0), SCALING + "\n[scaling.cloud_hooks]\n")
        text = text.replace(spill.group(0), f"local_spill_after_s = {LOCAL_SPILL_AFTER_S}")
        # The example's hooks (gh, wrangler) become the recording script, run by sh (a PATH name:
        # a hook's program may not lie under /tmp, where the test keeps it).
        start, end = text.index("[scaling.cloud_hooks.batch]"), text.index("# The compute agent")
        tables = "".join(
            f'[scaling.cloud_hooks.{tier}]\ncommand = ["sh", "{hook}", "{self.hook_out}", "{tier}", "one group"]\n\n' for tier in ("batch", "wasm")
        )
        text = text[:start] + tables + text[end:]
        toml.write_text(own_lanes(text))  # the fabric's own lanes: the example fleet is phaze's

    def open(self) -> Registry:
        fleet = FleetConfig.model_validate({"fleet": {"domain": "t.example", "leader_candidates": ["lux", "qfox-1"]}, "registry": self.settings})
        registry = open_registry(fleet, clock=self.clock, sqlite_path=self.sqlite_path)
        self.opened.append(registry)
        return registry

    def _connect(self, fleet: FleetConfig) -> Registry:
        return open_registry(fleet, clock=self.clock, sqlite_path=self.sqlite_path)

    # -- the hosts' passes -------------------------------------------------------
    def run_pass(self, host: str) -> str:
        """`fabric reconcile --host HOST --replay ... --no-activate` on the command
        line's ports, with this fleet's clock; its outcome."""
        root = self.tmp / "roots" / host
        root.mkdir(parents=True, exist_ok=True)
        options = PassOptions(
            desired=self.desired_dir,
            host=host,
            root=root,
            replay=str(PROBES / host),
            plan=PlanFromRegistry(self.sqlite_path),
            no_activate=True,
            # Candidates hold no usable key here: only the leader loop leads.
            plan_key_file=self.tmp / "no-such.key",
        )
        notes = self.notes[host]

        @contextmanager
        def full_pass_ports(opts: PassOptions) -> Iterator:
            with real_pass_ports(opts) as ports:
                ports.clock = self.clock
                ports.open_registry = self._connect
                ports.open_lane_broker = self._open_lanes
                ports.audit = RecordingAudit()
                ports.note = notes.append
                yield ports

        with memo_ports(options) as memo:
            memo.clock = self.clock
            memo.open_registry = memo_registry_opener(options, clock=self.clock)
            memo.open_lane_broker = self._open_lanes
            memo.audit = RecordingAudit()
            memo.note = notes.append
            outcome = run_memoized_pass(options, memo, full_pass_ports)
        if outcome.memoized:
            return "memo"
        assert outcome.ok, (host, outcome)
        return outcome.outcome

    def tick(self, seconds: float = 0) -> None:
        """Time passes; the lane dispatcher makes a pass over the waiting jobs,
        every host runs its pass (its heartbeat), then the leader steps."""
        assert seconds < self.desired.fleet.timing.node_timeout_s, "no host may lapse between its beats"
        self.clock.advance(seconds)
        dispatch_pass(self.registry, self.lanes, self.desired)
        for host in HOSTS:
            self.run_pass(host)
        self.steps.append((self.clock.now(), self.depth(), self.in_flight()))
        self.leader.step()

    def idle_since(self, node: str, until: float) -> float:
        """Since which leader step `node` was measured idle (in_flight 0) at every step up to `until`."""
        since = until
        for at, _, load in reversed([step for step in self.steps if step[0] <= until]):
            if load[node] > 0:
                break
            since = at
        return since

    def finish_running(self) -> int:
        """Every dispatched job is done: its SAQ worker completes it (the next
        dispatch pass settles it); how many."""
        running = [job.job_id for job in self.lanes.jobs() if not job.waiting]
        wait_until(lambda: set(running) <= set(self.workers.ran), timeout=deadline_for(1), what=f"the workers took {running}")
        for job_id in running:
            self.workers.finish(job_id)
        wait_until(lambda: not self._unfinished(), timeout=deadline_for(1), what="SAQ completed them")
        return len(running)

    def _unfinished(self) -> int:
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute("SELECT count(*) FROM saq_jobs WHERE status IN ('new', 'deferred', 'queued', 'active')").fetchone()
        return int(row[0]) if row else 0

    # -- what the registry holds -------------------------------------------------
    def in_flight(self) -> dict[str, int]:
        return {s.record.node_id: s.record.in_flight for s in self.registry.node_states() if s.record is not None}

    def lane_jobs_on(self) -> dict[str, int]:
        """Dispatched lane jobs per host, from the lane queue."""
        host_of = {lane.id: host for host in HOSTS for lane in self.desired.lanes_on(host)}
        running = {h: 0 for h in HOSTS}
        for job in self.lanes.jobs():
            if job.lane is not None:
                running[host_of[job.lane]] += 1
        return running

    def depth(self) -> int:
        return queue_depth(self.lanes.jobs(), self.registry.newest_plan())

    def leader_said(self, fragment: str) -> list[str]:
        return [line for line in self.logs if fragment in line]

    def hook_runs(self) -> list[str]:
        return self.hook_out.read_text().splitlines() if self.hook_out.exists() else []

    def recent(self, kind: str) -> list[tuple[str | None, float]]:
        """The leader's carried-out actions of `kind`: (node or tier, when)."""
        return [(a.node or a.tier, a.at.timestamp()) for a in self.registry.scaling_record().recent if a.kind == kind]


@pytest.fixture(params=["sqlite", "etcd"])
def fleet(request, tmp_path, broker_dsn) -> Iterator[LiveFleet]:
    if request.param == "etcd":
        cluster = request.getfixturevalue("etcd")
        f = LiveFleet({"backend": "etcd", "endpoints": cluster.endpoints, "prefix": f"/t{uuid.uuid4().hex[:12]}"}, None, tmp_path, broker_dsn)
    else:
        path = tmp_path / "registry.sqlite"
        f = LiveFleet({"backend": "sqlite", "path": str(path)}, path, tmp_path, broker_dsn)
    try:
        yield f
    finally:
        for registry in f.opened:
            registry.close()
        f.workers.close()
        for queue in f.lane_queues:
            queue.close()


def test_a_burst_of_real_lane_jobs_scales_out_on_measured_load_and_the_idle_groups_down_after_it(fleet):
    # 1 The fleet converges on the leader's plan: each host's load is what it runs.
    for _ in range(3):
        fleet.tick()
    plan = fleet.registry.newest_plan()
    assert plan is not None and plan.deferred == []
    placed = {host: len(plan.services_on(host)) for host in HOSTS}
    assert fleet.in_flight() == placed, "under --no-activate a host's services are its placements"
    idle = {host for host, n in placed.items() if n == 0}
    assert idle == {"lux", "racknerd", "x86-spill"}, placed  # lux: the local lane's host; racknerd: a relay, no lane

    # 2 More lane jobs than the lanes can take. The dispatcher fills them:
    # x86-spill up to its host's limit, a1-arm64 not at all (its one slot
    # runs flac-fft: one account), local held by the spill gate.
    fleet.lanes.enqueue([(f"job-{i}", None) for i in range(12)])
    fleet.tick()
    on_lanes = fleet.lane_jobs_on()
    assert on_lanes == {"lux": 0, "qfox-1": 0, "racknerd": 0, "a1-arm64": 0, "x86-spill": 2}, on_lanes
    measured = fleet.in_flight()
    assert {h: measured[h] - placed[h] for h in HOSTS} == on_lanes, "each host's load rose by the jobs on its lanes"
    burst_from = fleet.clock.now()
    assert fleet.depth() == 10 > QUEUE_HIGH

    fleet.tick(BURST_WINDOW_S - 1)
    assert fleet.registry.scaling_record().recent == [] and fleet.hook_runs() == [], "not a burst yet"

    # The window has passed: idle capacity first. lux (an idle lane host) is
    # activated; racknerd is idle too, but no lane job can run there.
    fleet.tick(1)
    assert fleet.recent("activate_idle") == [("lux", burst_from + BURST_WINDOW_S)]
    assert fleet.hook_runs() == [], "idle capacity first: no cloud group while lux is idle"

    # The jobs have waited long enough to spill to local: lux takes one, its
    # pass measures it, no idle capacity is left -> each tier's hook runs.
    fleet.tick(LOCAL_SPILL_AFTER_S - BURST_WINDOW_S)
    on_lanes = fleet.lane_jobs_on()
    assert on_lanes["lux"] == 1 and on_lanes["x86-spill"] == 2
    measured = fleet.in_flight()
    assert {h: measured[h] - placed[h] for h in HOSTS} == on_lanes
    first_group = fleet.clock.now()
    runs = fleet.hook_runs()
    assert [line.split(" ", 1)[1] for line in runs] == ["batch one group", "wasm one group"], runs
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+", runs[0].split(" ", 1)[0]), "the script's own timestamp"
    assert fleet.recent("run_cloud_hook") == [("batch", first_group), ("wasm", first_group)]
    assert {tier: o.ok for tier, o in fleet.registry.scaling_record().hooks.items()} == {"batch": True, "wasm": True}

    # Once per tier per group interval, across two intervals. Meanwhile
    # racknerd is idle for more than a whole scale-down window: the queue
    # above queue_high keeps its group up.
    for advance, runs_after in ((GROUP_INTERVAL_S - 1, 2), (1, 4), (GROUP_INTERVAL_S - 1, 4), (1, 6)):
        fleet.tick(advance)
        assert fleet.recent("scale_down") == [], "no scale-down while the queue is above queue_high"
        assert len(fleet.hook_runs()) == runs_after, (fleet.clock.now() - first_group, fleet.hook_runs())
    assert fleet.leader_said("one batch group per 30s") and fleet.leader_said("one wasm group per 30s"), "held within the interval, saying why"
    assert [line.split(" ", 1)[1] for line in fleet.hook_runs()] == ["batch one group", "wasm one group"] * 3
    assert fleet.clock.now() - fleet.idle_since("racknerd", fleet.clock.now()) > SCALE_DOWN_WINDOW_S

    # 3 The jobs finish (their SAQ workers); the dispatcher starts the next
    # ones, which finish too, until the queue is empty.
    while fleet.lanes.jobs():
        assert fleet.finish_running() > 0
        fleet.tick(5)
    drained_at = fleet.clock.now()
    assert fleet.in_flight() == placed, "the load is back to the services"
    hooks_ran = len(fleet.hook_runs())
    burst_over = min(at for at, depth, _ in fleet.steps if at > burst_from and depth <= QUEUE_HIGH)

    fleet.tick(SCALE_DOWN_WINDOW_S - 1)
    fleet.tick(1)
    downs = fleet.recent("scale_down")
    assert sorted(node for node, _ in downs) == ["lux", "racknerd", "x86-spill"], fleet.logs
    record = fleet.registry.scaling_record()
    assert record.scaled_down == ["lux", "racknerd", "x86-spill"]
    assert record.concurrency == {"lux": 1, "x86-spill": 1}, "down to what they run (racknerd was at 1 already)"
    assert len(fleet.hook_runs()) == hooks_ran, "no cloud group after the burst"

    # Each group went down at the first step after a whole window measured
    # idle without a burst: racknerd, idle from the start, as soon as the
    # queue fell to the mark; lux and x86-spill a window after their last job.
    for node, at in downs:
        due = max(fleet.idle_since(node, at) + SCALE_DOWN_WINDOW_S, burst_over)
        assert at == min(t for t, _, _ in fleet.steps if t >= due), (node, at, due, burst_over)
    assert dict(downs)["racknerd"] == burst_over < drained_at + SCALE_DOWN_WINDOW_S

    # Never a scale-down at a step that saw the queue above queue_high.
    high = {at for at, depth, _ in fleet.steps if depth > QUEUE_HIGH}
    assert high and not [(node, at) for node, at in downs if at in high]
