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

from reconciler.cli import EXIT_OK, CommandError, InvalidInput
from reconciler.cli.registry_options import add_registry_options, desired_and_registry
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.records import check_node_id
from reconciler.core.timestamps import stamp
from reconciler.engine.dispatch import HOLD_MEANING, DispatchEvent, finish_job, lane_status, run_dispatcher
from reconciler.ports import Registry


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
                raise InvalidInput(f"fabric lane {args.action}: {job!r} is not a job id (lowercase letters, digits, '-', '_')") from None
    elif args.jobs:
        parser.error(f"lane {args.action} takes no job ids")
    with desired_and_registry(args) as (desired, registry):
        try:
            if args.action == "enqueue":
                _enqueue(registry, args.jobs, as_json=args.json)
            elif args.action in ("done", "fail"):
                _finish(registry, desired, args.jobs[0], failed=args.action == "fail", as_json=args.json)
            elif args.action == "status":
                _status(registry, desired, as_json=args.json)
            else:
                _dispatch(registry, desired, once=args.once, interval=args.interval, as_json=args.json)
        except ValidationError as exc:  # a job id checked above cannot get here; a corrupt record can
            raise CommandError(f"fabric lane {args.action}: registry holds an invalid record: {exc.errors()[0]['msg']}") from None
    return EXIT_OK


def _enqueue(registry: Registry, job_ids: list[str], *, as_json: bool) -> None:
    for job in registry.enqueue_jobs(job_ids):
        print(
            json.dumps({"job": job.job_id, "enqueued_at": job.enqueued_at.isoformat(), "attempts": job.attempts})
            if as_json
            else f"{job.job_id} enqueued {stamp(job.enqueued_at)}"
        )


def _dispatch(registry: Registry, desired: DesiredState, *, once: bool, interval: float, as_json: bool) -> None:
    stop = threading.Event()
    if not once:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        lanes = ", ".join(f"{lane.id} (rank {lane.rank}, cap {lane.cap})" for lane in desired.lanes)
        print(f"fabric lane dispatch: every {interval:g} s over {lanes}", file=sys.stderr, flush=True)

    def emit(event: DispatchEvent) -> None:
        print(json.dumps(event.as_json()) if as_json else event.text(), flush=True)

    def log(message: str) -> None:
        print(f"fabric lane dispatch: {message}", file=sys.stderr, flush=True)

    run_dispatcher(registry, desired, emit=emit, stop=stop, interval_s=interval, once=once, log=log)


def _finish(registry: Registry, desired: DesiredState, job_id: str, *, failed: bool, as_json: bool) -> None:
    finished = finish_job(registry, desired, job_id, failed=failed)
    if finished is None:
        raise CommandError(f"fabric lane {'fail' if failed else 'done'}: job {job_id} is not running")
    if as_json:
        print(json.dumps({"job": job_id, "lane": finished.lane, "requeued": failed, "attempts": finished.job.attempts}))
    elif failed:
        print(f"{job_id} failed in {finished.lane}: waiting again (attempts {finished.job.attempts})")
    else:
        print(f"{job_id} done in {finished.lane}: slot freed")


def _status(registry: Registry, desired: DesiredState, *, as_json: bool) -> None:
    status = lane_status(registry, desired)
    document = status.as_json()
    if as_json:
        print(json.dumps(document, indent=2))
        return
    now = status.now
    scaling = status.scaling
    print(f"queue depth {document['queue_depth']} (waiting lane jobs + replicas deferred for capacity)")
    for v in status.lanes:
        state = "" if v.available else f"  OFFLINE: {v.reason}"
        if v.available and v.full:
            state = f"  FULL: {'lane cap' if v.full == 'cap' else f'host {v.host} at capacity'}"
        print(f"lane {v.id:<12} {v.kind:<8} rank {v.rank:<3} {v.in_flight}/{v.cap}{state}")
    for j in status.running:
        if j.claim is not None:
            print(f"running {j.job_id} in {j.claim.lane} slot {j.claim.slot} since {stamp(j.claim.claimed_at, now)}")
    for j in status.waiting:
        event = status.predicted[j.job_id]
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
