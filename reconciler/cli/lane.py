"""fabric lane: the lane job queue the job system feeds, its dispatcher, and what it holds and why.

    fabric lane enqueue JOB...               add jobs as waiting (ids only; a known job is left alone)
    fabric lane dispatch [--once] [--interval S] [--json]
                                             waiting jobs, oldest first, into lane slots
                                             (reconciler.engine.dispatch); prints every
                                             start and every hold with its reason
    fabric lane done JOB                     the job finished: its slot is free, the job gone
    fabric lane fail JOB                     the job failed: its slot is free and it waits again
                                             (one more cloud attempt if it ran in a compute lane)
    fabric lane status [--json]              lanes, waiting jobs with what would happen to
                                             each now, running jobs, queue depth, and the
                                             leader's scaling decisions

A job is an id (lowercase letters, digits, '-', '_'), its enqueue time and its
attempts: what it runs stays with the job system. Lanes (kind, rank, cap) come
from the desired state (`--desired DIR`), the slots from the registry.

Exit status: 0 done; 1 the registry could not be reached, or `done`/`fail` of
a job that is not running; 2 bad input (an invalid job id, an invalid desired state).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from pydantic import ValidationError

from reconciler.cli import EXIT_FAILED, EXIT_INVALID, EXIT_OK
from reconciler.cli.registry_options import add_registry_options, failure_status, open_from_args, registry_failed, stamp
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.records import check_node_id
from reconciler.engine.dispatch import HOLD_MEANING, current_lanes, dispatch_pass, predicted_holds
from reconciler.engine.scaling_step import queue_depth
from reconciler.ports import Registry, RegistryError, RegistryUnavailable


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0.05 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text} is outside 0.05..3600 seconds")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lane", help="the lane job queue: enqueue, dispatch into lane slots, done/fail, status")
    add_registry_options(p)
    p.add_argument("action", choices=["enqueue", "dispatch", "done", "fail", "status"])
    p.add_argument("jobs", nargs="*", metavar="JOB", help="enqueue: job ids; done/fail: one job id")
    p.add_argument("--once", action="store_true", help="dispatch: one pass over the waiting jobs, then exit")
    p.add_argument("--interval", type=_interval, default=1.0, metavar="S", help="dispatch: seconds between passes (default 1)")
    p.add_argument("--json", action="store_true", help="JSON output (dispatch: one object per line)")
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    if args.action in ("enqueue", "done", "fail"):
        if not args.jobs or (args.action != "enqueue" and len(args.jobs) != 1):
            parser.error(f"lane {args.action}: {'one job id' if args.action != 'enqueue' else 'at least one job id'} expected")
        for job in args.jobs:
            try:
                check_node_id(job)
            except ValueError:
                print(f"fabric lane {args.action}: {job!r} is not a job id (lowercase letters, digits, '-', '_')", file=sys.stderr)
                return EXIT_INVALID
    elif args.jobs:
        parser.error(f"lane {args.action} takes no job ids")
    opened = open_from_args(args)
    if opened is None:
        return failure_status(args)
    desired, registry = opened
    try:
        if args.action == "enqueue":
            for job in registry.enqueue_jobs(args.jobs):
                print(
                    json.dumps({"job": job.job_id, "enqueued_at": job.enqueued_at.isoformat(), "attempts": job.attempts})
                    if args.json
                    else f"{job.job_id} enqueued {stamp(job.enqueued_at)}"
                )
            return EXIT_OK
        if args.action in ("done", "fail"):
            return _finish(registry, desired, args.jobs[0], failed=args.action == "fail", as_json=args.json)
        if args.action == "status":
            return _status(registry, desired, as_json=args.json)
        return _dispatch(registry, desired, once=args.once, interval=args.interval, as_json=args.json)
    except RegistryError as exc:
        return registry_failed(args, exc)
    except ValidationError as exc:  # a job id checked above cannot get here; a corrupt record can
        print(f"fabric lane {args.action}: registry holds an invalid record: {exc.errors()[0]['msg']}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        registry.close()


def _dispatch(registry: Registry, desired: DesiredState, *, once: bool, interval: float, as_json: bool) -> int:
    stop = threading.Event()
    if not once:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        lanes = ", ".join(f"{lane.id} (rank {lane.rank}, cap {lane.cap})" for lane in desired.lanes)
        print(f"fabric lane dispatch: every {interval:g} s over {lanes}", file=sys.stderr, flush=True)
    while True:
        try:
            for event in dispatch_pass(registry, desired):
                print(json.dumps(event.as_json()) if as_json else event.text(), flush=True)
        except RegistryUnavailable as exc:
            if once:
                raise
            # A long-running dispatcher outlives a registry outage: jobs wait meanwhile.
            print(f"fabric lane dispatch: registry unreachable, retrying: {exc}", file=sys.stderr, flush=True)
        if once or stop.wait(interval):
            return EXIT_OK


def _finish(registry: Registry, desired: DesiredState, job_id: str, *, failed: bool, as_json: bool) -> int:
    running = next((j for j in registry.lane_jobs() if j.job_id == job_id), None)
    kinds = {lane.id: lane.kind for lane in desired.lanes}
    cloud = running is not None and running.claim is not None and kinds.get(running.claim.lane) == "compute"
    finished = registry.finish_job(job_id, requeue=failed, count_attempt=failed and cloud)
    if finished is None:
        print(f"fabric lane {'fail' if failed else 'done'}: job {job_id} is not running", file=sys.stderr)
        return EXIT_FAILED
    lane = running.claim.lane if running is not None and running.claim is not None else "?"
    if as_json:
        print(json.dumps({"job": job_id, "lane": lane, "requeued": failed, "attempts": finished.attempts}))
    elif failed:
        print(f"{job_id} failed in {lane}: waiting again (attempts {finished.attempts})")
    else:
        print(f"{job_id} done in {lane}: slot freed")
    return EXIT_OK


def _status(registry: Registry, desired: DesiredState, *, as_json: bool) -> int:
    views, now = current_lanes(registry, desired)
    jobs = registry.lane_jobs()
    plan = registry.newest_plan()
    scaling = registry.scaling_record()
    predicted = predicted_holds(jobs, views, desired, now)
    lanes = sorted(views.values(), key=lambda v: (v.rank, v.id))
    document = {
        "now": now.isoformat(),
        "queue_depth": queue_depth(jobs, plan),
        "lanes": [v.model_dump() for v in lanes],
        "waiting": [{**predicted[j.job_id].as_json(), "enqueued_at": j.enqueued_at.isoformat()} for j in jobs if j.waiting],
        "running": [
            {"job": j.job_id, "lane": j.claim.lane, "slot": j.claim.slot, "since": j.claim.claimed_at.isoformat(), "attempts": j.attempts}
            for j in jobs
            if j.claim is not None
        ],
        "deferred": [d.model_dump() for d in plan.deferred if not d.inadmissible] if plan else [],
        "scaling": scaling.model_dump(mode="json", exclude={"state"}),
    }
    if as_json:
        print(json.dumps(document, indent=2))
        return EXIT_OK
    print(f"queue depth {document['queue_depth']} (waiting lane jobs + replicas deferred for capacity)")
    for v in lanes:
        print(f"lane {v.id:<12} {v.kind:<8} rank {v.rank:<3} {v.in_flight}/{v.cap}{'' if v.available else '  OFFLINE'}")
    for j in jobs:
        if j.claim is not None:
            print(f"running {j.job_id} in {j.claim.lane} slot {j.claim.slot} since {stamp(j.claim.claimed_at, now)}")
    for j in jobs:
        if j.waiting:
            event = predicted[j.job_id]
            nxt = f"next: {event.lane}" if event.lane else f"held: {event.hold}: {HOLD_MEANING[event.hold or '']}"
            print(f"waiting {j.job_id} since {stamp(j.enqueued_at, now)}, attempts {j.attempts}; {nxt}")
    for d in document["deferred"]:
        print(f"deferred {d['service']}#{d['replica']}: {d['reason']}")
    for node, limit in scaling.concurrency.items():
        down = " (scaled down)" if node in scaling.scaled_down else ""
        print(f"scaling: {node} max_concurrent_tasks {limit}{down}")
    for tier, outcome in scaling.hooks.items():
        print(f"scaling: {tier} hook last at {stamp(outcome.at, now)}: {'ok' if outcome.ok else 'failed'}")
    for entry in scaling.recent[-10:]:
        print(f"scaling {stamp(entry.at)} {entry.kind} {entry.node or entry.tier or ''}: {entry.outcome} ({entry.reason})")
    return EXIT_OK
