"""The pure half of the leader's scaling step: queue depth and what each action does to the record."""

from __future__ import annotations

from datetime import UTC, datetime

from reconciler.core.live.models import Deferred, FleetPlan, Placement, Snapshot, SnapshotNode
from reconciler.core.live.records import QueuedJob, ScalingRecord
from reconciler.core.scheduling.scaling import ScalingAction, ScalingState
from reconciler.engine.scaling_step import carry_out, queue_depth

NOW = datetime(2026, 6, 1, 4, 0, tzinfo=UTC)


def job(job_id: str, running: bool = False) -> QueuedJob:
    return QueuedJob(job_id=job_id, enqueued_at=NOW, lane="a1-arm64" if running else None, dispatched_at=NOW if running else None)


def plan(placements=(), deferred=()) -> FleetPlan:
    return FleetPlan(epoch=1, leader="lux", created=NOW, placements=list(placements), deferred=list(deferred))


def snapshot(*nodes: SnapshotNode) -> Snapshot:
    return Snapshot(now=NOW, nodes=list(nodes))


def node(node_id: str, limit: int = 4, ceiling: int | None = 6, in_flight: int = 0) -> SnapshotNode:
    return SnapshotNode(node_id=node_id, tier="cpu_ffmpeg", max_concurrent_tasks=limit, max_concurrent_ceiling=ceiling, in_flight=in_flight)


def run(actions, snap, fleet_plan=None, record=None):
    return carry_out(record or ScalingRecord(), actions, ScalingState(), snap, fleet_plan, leader="lux", now=NOW)


def test_queue_depth_counts_waiting_jobs_and_replicas_deferred_for_capacity_only():
    jobs = [job("a"), job("b"), job("c", running=True)]
    deferred = [
        Deferred(service="encode", replica=0, reason="every candidate full"),
        Deferred(service="lupine", replica=0, reason="inadmissible: no gpu_cuda node", inadmissible=True),
    ]
    assert queue_depth(jobs, plan(deferred=deferred)) == 3
    assert queue_depth(jobs, None) == 2
    assert queue_depth([], plan()) == 0


def test_raise_concurrency_sets_the_override_and_is_refused_above_the_ceiling():
    up = ScalingAction(kind="raise_concurrency", node="qfox-1", max_concurrent_tasks=5, reason="hot")
    done = run([up], snapshot(node("qfox-1")))
    assert done.record.concurrency == {"qfox-1": 5} and done.hooks == []
    too_far = ScalingAction(kind="raise_concurrency", node="qfox-1", max_concurrent_tasks=7, reason="hot")
    refused = run([too_far], snapshot(node("qfox-1")))
    assert refused.record.concurrency == {} and "refused" in refused.lines[0][1]


def test_scale_down_keeps_what_the_node_runs_and_activation_restores_its_own_limit():
    down = ScalingAction(kind="scale_down", node="x86-spill", reason="cold")
    running_two = plan(placements=[Placement(service="fft", replica=i, node="x86-spill", tier="cpu_ffmpeg") for i in range(2)])
    done = run([down], snapshot(node("x86-spill", in_flight=0)), running_two)
    assert done.record.concurrency == {"x86-spill": 2}, "two replicas run there: none has to move"
    assert done.record.scaled_down == ["x86-spill"]
    assert run([down], snapshot(node("x86-spill")), plan()).record.concurrency == {"x86-spill": 1}
    # Already at its minimum: nothing lowered, still remembered as scaled down.
    small = run([down.model_copy(update={"node": "racknerd"})], snapshot(node("racknerd", limit=1, ceiling=None)))
    assert small.record.concurrency == {} and small.record.scaled_down == ["racknerd"]

    up = ScalingAction(kind="activate_idle", node="x86-spill", reason="burst")
    back = run([up], snapshot(node("x86-spill", limit=1)), record=done.record)
    assert back.record.concurrency == {} and back.record.scaled_down == []


def test_hooks_are_returned_to_run_holds_are_only_logged_and_forgotten_nodes_lose_their_override():
    hook = ScalingAction(kind="run_cloud_hook", tier="batch", argv=["/bin/gh", "workflow", "run"], reason="burst")
    hold = ScalingAction(kind="hold", tier="wasm", reason="one wasm group per 60s")
    record = ScalingRecord(concurrency={"gone": 3, "lux": 1}, scaled_down=["gone", "lux"])
    done = run([hook, hold], snapshot(node("lux")), record=record)
    assert done.hooks == [hook]
    assert [(a.kind, text) for a, text in done.lines] == [("hold", "held")]
    assert done.record.recent == [], "neither a hook before it ran nor a hold is kept as done"
    assert done.record.concurrency == {"lux": 1} and done.record.scaled_down == ["lux"]
    assert done.record.state == ScalingState().model_dump(mode="json") and done.record.leader == "lux"


def test_work_deferred_for_capacity_brings_every_scaled_down_group_back_at_once():
    record = ScalingRecord(concurrency={"lux": 1, "x86-spill": 1, "qfox-1": 5}, scaled_down=["lux", "x86-spill"])
    lost_node = plan(deferred=[Deferred(service="encode", replica=0, reason="every candidate full")])
    done = run([], snapshot(node("lux"), node("x86-spill"), node("qfox-1")), lost_node, record=record)
    assert done.record.concurrency == {"qfox-1": 5}, "raised limits stay; scaled-down ones are lifted"
    assert done.record.scaled_down == []
    assert [(a.node, a.reason) for a, _ in done.lines] == [
        ("lux", "1 replica(s) deferred for capacity (encode)"),
        ("x86-spill", "1 replica(s) deferred for capacity (encode)"),
    ]
    only_inadmissible = plan(deferred=[Deferred(service="lupine", replica=0, reason="inadmissible: x", inadmissible=True)])
    kept = run([], snapshot(node("lux"), node("x86-spill")), only_inadmissible, record=record)
    assert kept.record.scaled_down == ["lux", "x86-spill"], "no capacity would place inadmissible work"
