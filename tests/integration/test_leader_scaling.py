"""The leader loop carries out bursts and scaling (seed, "Scaling Mechanisms").

A real LeaderLoop with the real scheduler, the hooks run directly (tests.support.hooks:
no systemd here; test_hook_sandbox runs them as units) and a
real registry (a sqlite file, and a real etcd member: every test runs on
both), over the example fleet. Time is an injected clock: the windows (30 s
burst, 60 s per group, 5 min hot, 15 min cold) pass by advancing it, nothing
sleeps. The cloud hooks are a tiny Python program that appends its argv to a
file, so a test sees that it ran, how often, and with exactly which argv
(arguments a shell would have split or expanded arrive untouched).
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.adapters.lane_broker_pg import PostgresLaneBroker
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import CloudHook, DesiredState, FleetConfig
from reconciler.core.live.records import NodeRecord
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.leader import LeaderLoop, candidate_loop
from reconciler.ports import NotLeader, Registry
from reconciler.wiring import open_registry
from tests.support.audit import RecordingAudit
from tests.support.clock import FakeClock
from tests.support.hooks import DirectHooks
from tests.support.plan_keys import signed_example_fleet

pytestmark = pytest.mark.integration

LONG = 6 * 86_400  # leases and heartbeats that outlive every window of a test (a beat lives a week at most: MAX_BEAT_TIMEOUT_S)
HOOK = "import json, sys; open(sys.argv[1], 'a').write(json.dumps(sys.argv[2:]) + '\\n')"
# Arguments a shell would split, expand or act on.
TRICKY = ["a b; touch /tmp/not-a-shell", "$HOME", "*"]


class Fleet:
    """A registry with the example fleet's nodes, a clock, hook output, and leader loops."""

    def __init__(self, settings: dict, sqlite_path: str | None, tmp: Path, broker_dsn: str) -> None:
        self.clock = FakeClock()
        # phaze's broker: the lane jobs waiting there count in the queue depth.
        self.lanes = PostgresLaneBroker(broker_dsn, self.clock)
        self.settings = settings
        self.sqlite_path = sqlite_path
        self.hook_out = tmp / "hooks.jsonl"
        self.opened: list[Registry] = []
        self.logs: list[str] = []
        self.audit = RecordingAudit()
        # The example fleet with throwaway plan keys: the leader signs what it publishes.
        self.signed = signed_example_fleet(tmp / "signed-fleet")
        base = load_desired(self.signed.desired)
        hooks = {tier: CloudHook(command=[sys.executable, "-c", HOOK, str(self.hook_out), tier, *TRICKY]) for tier in ("batch", "wasm")}
        scaling = base.fleet.scaling.model_copy(update={"cloud_hooks": hooks})
        self.desired: DesiredState = base.model_copy(update={"fleet": base.fleet.model_copy(update={"scaling": scaling})})
        self.registry = self.open()

    def open(self) -> Registry:
        fleet = FleetConfig.model_validate({"fleet": {"domain": "t.example", "leader_candidates": ["lux", "qfox-1"]}, "registry": self.settings})
        registry = open_registry(fleet, clock=self.clock, sqlite_path=self.sqlite_path)
        self.opened.append(registry)
        return registry

    def loop(self, host: str = "lux") -> LeaderLoop:
        """fabric-leader.service's loop, as `fabric leader run` builds it (engine.leader.candidate_loop)."""
        return candidate_loop(
            self.open(),
            host,
            lambda: self.desired,
            schedule,
            lease_ttl_s=LONG,
            hooks=DirectHooks(),
            audit=self.audit,
            log=self.logs.append,
            signer=self.signed.signer(host),
            lane_broker=self.lanes,
        )

    def beat(self, **in_flight: int) -> None:
        """Heartbeat every example host; `in_flight` per host (default 1)."""
        facts = {
            "qfox-1": ("gpu_cuda", "x86_64", 4, 6),
            "a1-arm64": ("cpu_ffmpeg", "aarch64", 2, 2),
            "x86-spill": ("cpu_ffmpeg", "x86_64", 4, 8),
            "lux": ("cpu_ffmpeg", "x86_64", 2, None),
            "racknerd": ("relay", "x86_64", 1, None),
        }
        for host, (tier, arch, limit, ceiling) in facts.items():
            self.registry.heartbeat(
                NodeRecord(
                    node_id=host,
                    tier=tier,
                    arch=arch,
                    max_concurrent_tasks=limit,
                    max_concurrent_ceiling=ceiling,
                    in_flight=in_flight.get(host.replace("-", "_"), 1),
                ),
                ttl_s=LONG,
            )

    def hook_runs(self) -> list[list[str]]:
        if not self.hook_out.exists():
            return []
        return [json.loads(line) for line in self.hook_out.read_text().splitlines()]

    def limit(self, node: str) -> int:
        return next(n.max_concurrent_tasks for n in self.open().snapshot().nodes if n.node_id == node)

    def said(self, fragment: str) -> list[str]:
        return [line for line in self.logs if fragment in line]


@pytest.fixture(params=["sqlite", "etcd"])
def fleet(request, tmp_path, broker_dsn) -> Iterator[Fleet]:
    if request.param == "etcd":
        cluster = request.getfixturevalue("etcd")
        f = Fleet({"backend": "etcd", "endpoints": cluster.endpoints, "prefix": f"/t{uuid.uuid4().hex[:12]}"}, None, tmp_path, broker_dsn)
    else:
        path = str(tmp_path / "registry.sqlite")
        f = Fleet({"backend": "sqlite", "path": path}, path, tmp_path, broker_dsn)
    try:
        yield f
    finally:
        for registry in f.opened:
            registry.close()
        f.lanes.close()


def test_a_burst_activates_idle_capacity_first_then_runs_each_tiers_hook_once_per_interval(fleet):
    # Everything busy except lux; eleven lane jobs wait (queue_high is 10).
    fleet.beat(lux=0)
    fleet.lanes.enqueue([(f"burst-{i}", None) for i in range(11)])
    leader = fleet.loop()
    leader.step()
    fleet.clock.advance(29)
    leader.step()
    assert not fleet.said("scaling "), "29 s over the high mark is not a burst yet"

    fleet.clock.advance(1)
    leader.step()
    activated = fleet.said("scaling activate_idle lux")
    assert len(activated) == 1 and "for 30s" in activated[0], fleet.logs
    assert fleet.hook_runs() == [], "idle capacity first: no cloud group while lux is idle"

    # lux takes work; no idle capacity is left: one group per configured tier, best tier first.
    fleet.beat()
    fleet.clock.advance(1)
    leader.step()
    expected = [["batch", *TRICKY], ["wasm", *TRICKY]]
    assert fleet.hook_runs() == expected, "each hook ran once, with exactly its argv (no shell)"
    record = fleet.registry.scaling_record()
    assert {tier: outcome.ok for tier, outcome in record.hooks.items()} == {"batch": True, "wasm": True}
    assert [(a.kind, a.tier, a.outcome.split(" (fabric-hook-")[0]) for a in record.recent if a.kind == "run_cloud_hook"] == [
        ("run_cloud_hook", "batch", "ran, exit 0"),
        ("run_cloud_hook", "wasm", "ran, exit 0"),
    ]

    # Still bursting 59 s after the groups: held, with the reason; not run again.
    fleet.clock.advance(59)
    leader.step()
    assert fleet.hook_runs() == expected
    assert len(fleet.said("one batch group per 60s")) == 1 and len(fleet.said("one wasm group per 60s")) == 1

    fleet.clock.advance(1)
    leader.step()
    assert fleet.hook_runs() == expected * 2, "60 s later: one more group per tier"


def test_a_one_shot_step_resigns_and_the_next_one_campaigns_anew_and_audits_what_it_scales(fleet):
    fleet.beat(lux=0)
    fleet.lanes.enqueue([(f"burst-{i}", None) for i in range(11)])
    leader = fleet.loop()
    assert leader.scaling is not None and leader.scaling.hook_budget_s == LONG / 2, "hooks leave half the lease to renew it"

    leader.step_and_resign()
    assert fleet.registry.leader() is None and leader.leadership is None, "resigned: the next one need not wait for the lease"
    assert fleet.registry.newest_plan() is not None

    fleet.clock.advance(30)
    leader.step_and_resign()
    assert fleet.registry.leader() is None
    entries = [(r["action"], r["outcome"], r.get("unit")) for r in fleet.audit.records]
    assert ("scaling-activate_idle", "ok", "lux") in entries, "the burst window outlived the first term"


def test_sustained_high_utilization_raises_concurrency_within_the_ceiling_and_the_next_plan_uses_it(fleet):
    # qfox-1 (the only gpu_cuda node) runs 4 of its 4 tasks: hot. The others
    # are neither hot nor cold, racknerd idle and small (no headroom anyway).
    fleet.beat(qfox_1=4, racknerd=0)
    leader = fleet.loop()
    leader.step()
    plan = fleet.registry.newest_plan()
    assert "lupine" in {d.service for d in plan.deferred}, "CUDA-only work waits while qfox-1 is full"

    fleet.clock.advance(299)
    leader.step()
    assert fleet.limit("qfox-1") == 4 and not fleet.said("raise_concurrency")
    fleet.clock.advance(1)
    leader.step()
    assert fleet.limit("qfox-1") == 5, "5 min over 80 %: one more, below the ceiling 6"
    assert fleet.said("scaling raise_concurrency qfox-1: qfox-1 max_concurrent_tasks 4 -> 5")

    leader.step()  # the next pass schedules over the raised limit
    plan = fleet.registry.newest_plan()
    assert [p.node for p in plan.placements if p.service == "lupine"] == ["qfox-1"]

    # Busier still (5/5: over 80 % again from this pass on): up to the
    # ceiling after another full window, and no further.
    fleet.beat(qfox_1=5, racknerd=0)
    leader.step()
    fleet.clock.advance(300)
    leader.step()
    assert fleet.limit("qfox-1") == 6
    fleet.beat(qfox_1=6, racknerd=0)
    leader.step()
    fleet.clock.advance(300)
    leader.step()
    assert fleet.limit("qfox-1") == 6, "never above the ceiling"
    at_ceiling = fleet.said("and at its ceiling 6")
    # No headroom: scale out instead. racknerd is idle, but a relay with no
    # lane and at its own limit is no capacity to bring up: the cloud groups.
    assert [line.split(":")[0] for line in at_ceiling] == ["scaling run_cloud_hook batch", "scaling run_cloud_hook wasm"], at_ceiling


def test_a_group_idle_for_fifteen_minutes_is_scaled_down_and_a_burst_brings_it_back(fleet):
    # x86-spill idle; the rest half busy (racknerd, 1/1 at its ceiling, idle
    # too: busy it would be a hot node without headroom, i.e. a scale-out).
    fleet.beat(x86_spill=0, racknerd=0)
    leader = fleet.loop()
    leader.step()
    fleet.clock.advance(899)
    leader.step()
    assert fleet.limit("x86-spill") == 4
    fleet.clock.advance(1)
    leader.step()
    runs_there = len(fleet.registry.newest_plan().services_on("x86-spill"))
    floor = max(1, runs_there)
    assert floor < 4
    assert fleet.limit("x86-spill") == floor, "down to what it runs, so nothing has to move"
    assert "x86-spill" in fleet.registry.scaling_record().scaled_down
    assert len(fleet.said("scaling scale_down x86-spill")) == 1

    fleet.clock.advance(60)
    leader.step()
    assert len(fleet.said("scaling scale_down x86-spill")) == 1, "scaled down once, not every pass"

    # A burst: the scaled-down group is the idle capacity activated first.
    fleet.lanes.enqueue([(f"burst-{i}", None) for i in range(11)])
    leader.step()
    fleet.clock.advance(30)
    leader.step()
    assert fleet.said("scaling activate_idle x86-spill: x86-spill scaled-down group back to its own limit")
    assert fleet.limit("x86-spill") == 4
    assert "x86-spill" not in fleet.registry.scaling_record().scaled_down


def test_a_leader_that_lost_its_fence_writes_no_scaling_state_and_runs_no_hook(fleet):
    fleet.beat()
    fleet.lanes.enqueue([(f"burst-{i}", None) for i in range(11)])
    old = fleet.loop("lux")
    old.step()
    assert old.leadership is not None
    stale = old.leadership
    before = fleet.registry.scaling_record()
    assert before.state.get("queue_high_since"), "the burst window is remembered in the registry"

    # Its term ends (resigned here; a lapsed lease is the same); qfox-1 leads.
    fleet.registry.resign(stale)
    new = fleet.loop("qfox-1")
    new.scaling = None  # the successor only schedules, so the record stays the old leader's
    new.step()
    assert new.leadership is not None

    fleet.clock.advance(31)
    snapshot = old.registry.snapshot()
    with pytest.raises(NotLeader):
        old.scaling.run(stale, fleet.desired, snapshot, fleet.registry.newest_plan())
    assert fleet.hook_runs() == [], "the decided hook was not run"
    assert fleet.registry.scaling_record() == before, "nothing written"

    # The loop itself notices at its renewal and does nothing else.
    old.step()
    assert old.leadership is None and fleet.hook_runs() == []
    assert fleet.registry.scaling_record() == before


def test_a_failing_or_hanging_hook_is_recorded_without_its_command_and_paces_like_one_that_ran(fleet):
    hooks = {
        "batch": CloudHook(command=[sys.executable, "-c", "import sys; sys.exit(3)"]),
        "wasm": CloudHook(command=[sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=1),  # its own budget cuts it off
    }
    scaling = fleet.desired.fleet.scaling.model_copy(update={"cloud_hooks": hooks})
    fleet.desired = fleet.desired.model_copy(update={"fleet": fleet.desired.fleet.model_copy(update={"scaling": scaling})})
    fleet.beat()
    fleet.lanes.enqueue([(f"burst-{i}", None) for i in range(11)])
    leader = fleet.loop()
    leader.step()
    fleet.clock.advance(30)
    leader.step()
    record = fleet.registry.scaling_record()
    assert {t: (o.ok, o.returncode, o.timed_out) for t, o in record.hooks.items()} == {
        "batch": (False, 3, False),
        "wasm": (False, None, True),
    }
    assert [a.outcome.split(" (fabric-hook-")[0] for a in record.recent if a.kind == "run_cloud_hook"] == [
        "failed: exit 3",
        "failed: timed out (its own budget)",
    ]
    assert sys.executable not in record.model_dump_json(), "the registry holds no command"
    assert fleet.said("scaling run_cloud_hook batch: failed:") and fleet.said("scaling run_cloud_hook wasm: failed:")
    fleet.clock.advance(30)
    leader.step()
    assert fleet.said("one batch group per 60s"), "a failed group still counts for the interval"
