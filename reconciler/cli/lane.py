"""fabric lane: the lane job queue on phaze's broker, its dispatcher, and what it holds and why.

    fabric lane enqueue JOB... [--duration S]
                                             add jobs as waiting (ids, and the file's duration
                                             when known: below [scheduler] cloud_route_threshold_s
                                             a job goes local only; a known job is left alone)
    fabric lane dispatch [--once] [--interval S] [--json]
                                             settle finished jobs, then waiting jobs, oldest
                                             first, into lane queues (reconciler.engine.dispatch);
                                             prints every start, every hold with its reason, and
                                             every job that finished or failed
    fabric lane init-roles --admin-url-file FILE [--dry-run]
                                             phaze's broker's roles by what each component needs
                                             (reconciler.core.desired.broker_access): fabric-reader,
                                             fabric-dispatcher, fabric-agent-<lane> (row-level
                                             security: its own queue's rows); saq's and the
                                             fabric's tables made first. Idempotent: prints each
                                             change, or "nothing to do". FILE holds the DSN of
                                             the tables' owner (phaze's own)
    fabric lane status [--json]              per lane its kind, rank, cap, jobs in its queue,
                                             queue name, online and why not, and the hold a new
                                             job would get; waiting jobs with what would happen
                                             to each now, dispatched jobs, queue depth, and the
                                             leader's scaling decisions

In a phaze fleet (fabric.toml names [phaze] api_url) phaze's control plane
selects the lanes and dispatches into its phaze-agent-* queues: `enqueue`
and `dispatch` refuse (exit 2, the broker not opened) and `status` shows
each lane's real queue (phaze-agent-<agent_ref>-analyze), its jobs and its
workers. The rest of this text is about the fabric's own lanes.

There is no `done`/`fail`: the lane's SAQ workers (phaze's agents, the file
server's processing) finish the jobs on the broker, and the next dispatch
pass settles them (a failed job waits again, one more cloud attempt counted
when it ran in a compute lane).

A job is an id (lowercase letters, digits, '-', '_'), its enqueue time, its
attempts and its duration: what it runs stays with the job system. Lanes
(kind, rank, cap, queue) come from the desired state (`--desired DIR`), their
load and workers from phaze's broker (the DSN in the file `--queue-url-file`
names, else [phaze] dispatcher_url_file for enqueue and dispatch, else [phaze]
queue_url_file).

Exit status: 0 done; 1 the registry or the broker could not be reached, or a
newer dispatcher runs (the registry names another term than this one's); 2 bad input (an invalid
job id or duration, an invalid desired state, enqueue or dispatch in a phaze fleet).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from pydantic import ValidationError

from reconciler.cli import EXIT_OK, CommandError, InvalidInput
from reconciler.cli.common import load_or_fail
from reconciler.cli.registry_options import add_queue_url_option, add_registry_options, desired_and_registry, opened_lane_broker
from reconciler.core.desired.broker_access import broker_roles, role_steps
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.records import check_node_id
from reconciler.core.timestamps import stamp
from reconciler.engine.dispatch import HOLD_MEANING, DispatchEvent, PhazeDispatches, lane_status, refuse_phaze_lanes, run_dispatcher
from reconciler.ports import LaneBroker, LaneBrokerError, Registry, StaleDispatcher
from reconciler.wiring import broker_role_admin, system_clock


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0.05 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text} is outside 0.05..3600 seconds")
    return value


def _duration(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value <= 10 * 86_400:
        raise argparse.ArgumentTypeError(f"{text} is outside 0..864000 seconds")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lane", help="the lane job queue on phaze's broker: enqueue, dispatch into lane queues, status")
    add_registry_options(p)
    add_queue_url_option(p)
    p.add_argument("action", choices=["enqueue", "dispatch", "status", "init-roles"])
    p.add_argument("jobs", nargs="*", metavar="JOB", help="enqueue: job ids")
    p.add_argument("--duration", type=_duration, metavar="S", help="enqueue: the jobs' media duration in seconds (default: not known)")
    p.add_argument("--once", action="store_true", help="dispatch: one pass over the waiting jobs, then exit")
    p.add_argument("--interval", type=_interval, default=1.0, metavar="S", help="dispatch: seconds between passes (default 1)")
    p.add_argument("--json", action="store_true", help="JSON output (dispatch: one object per line)")
    p.add_argument("--admin-url-file", metavar="FILE", type=Path, help="init-roles: the file holding the DSN of the broker tables' owner")
    p.add_argument("--dry-run", action="store_true", help="init-roles: print the changes without making them")
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    if args.action == "enqueue":
        if not args.jobs:
            parser.error("lane enqueue: at least one job id expected")
        for job in args.jobs:
            try:
                check_node_id(job)
            except ValueError:
                raise InvalidInput(f"fabric lane {args.action}: {job!r} is not a job id (lowercase letters, digits, '-', '_')") from None
    elif args.jobs:
        parser.error(f"lane {args.action} takes no job ids")
    if args.duration is not None and args.action != "enqueue":
        parser.error("--duration goes with enqueue")
    if (args.admin_url_file is not None or args.dry_run) != (args.action == "init-roles"):
        parser.error("--admin-url-file (and --dry-run) go with init-roles, which needs --admin-url-file")
    if args.action == "init-roles":
        return _init_roles(args)
    with desired_and_registry(args) as (desired, registry):
        if args.action != "status":
            _refuse_phaze_lanes(args.action, desired)
        with opened_lane_broker(args, desired, dispatcher=args.action != "status") as lane_broker:
            _run_action(args, desired, registry, lane_broker)
    return EXIT_OK


def _init_roles(args: argparse.Namespace) -> int:
    """`fabric lane init-roles` (module docstring): exit 1 when the broker
    refuses or does not answer, 2 for a bad desired state."""
    desired = load_or_fail(args.desired)
    try:
        admin = broker_role_admin(args.admin_url_file)
        try:
            made = ["would have made saq's and the fabric's tables where missing"] if args.dry_run else admin.make_tables()
            for line in made:
                print(line, flush=True)
            steps = role_steps(broker_roles(desired), admin.role_state())
            for step in steps:
                if not args.dry_run:
                    admin.apply_role_step(step)
                print(f"{'would have ' if args.dry_run else ''}{step.describe()}", flush=True)
        finally:
            admin.close()
    except LaneBrokerError as exc:
        raise CommandError(f"fabric lane init-roles: {exc}") from None
    if not steps and not (made and not args.dry_run):
        print("nothing to do: the broker holds every role the desired state's lanes need")
    else:
        print(
            "the roles have no password: set one (ALTER ROLE ... PASSWORD) or authenticate them in pg_hba.conf, then write each "
            "role's DSN into its file ([phaze] queue_url_file: fabric-reader; dispatcher_url_file: fabric-dispatcher; "
            "each compute lane's queue_url_file: fabric-agent-<lane>)"
        )
    return EXIT_OK


def _refuse_phaze_lanes(action: str, desired: DesiredState) -> None:
    """enqueue and dispatch write jobs: never where phaze dispatches (exit 2, nothing opened)."""
    try:
        refuse_phaze_lanes(desired)
    except PhazeDispatches as exc:
        raise InvalidInput(f"fabric lane {action}: {exc}") from None


def _run_action(args: argparse.Namespace, desired: DesiredState, registry: Registry, lane_broker: LaneBroker) -> None:
    try:
        if args.action == "enqueue":
            _enqueue(lane_broker, args.jobs, args.duration, as_json=args.json)
        elif args.action == "status":
            _status(registry, lane_broker, desired, as_json=args.json)
        else:
            _dispatch(registry, lane_broker, desired, once=args.once, interval=args.interval, as_json=args.json)
    except StaleDispatcher as exc:
        raise CommandError(f"fabric lane {args.action}: {exc}") from None
    except ValidationError as exc:  # a job id checked above cannot get here; a corrupt record can
        raise CommandError(f"fabric lane {args.action}: the lane queue holds an invalid record: {exc.errors()[0]['msg']}") from None


def _enqueue(lane_broker: LaneBroker, job_ids: list[str], duration: float | None, *, as_json: bool) -> None:
    for job in lane_broker.enqueue([(job_id, duration) for job_id in job_ids]):
        seconds = f", {job.duration_s:g} s long" if job.duration_s is not None else ""
        print(
            json.dumps({"job": job.job_id, "enqueued_at": job.enqueued_at.isoformat(), "attempts": job.attempts, "duration_s": job.duration_s})
            if as_json
            else f"{job.job_id} enqueued {stamp(job.enqueued_at)}{seconds}"
        )


def _dispatch(registry: Registry, lane_broker: LaneBroker, desired: DesiredState, *, once: bool, interval: float, as_json: bool) -> None:
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

    run_dispatcher(registry, lane_broker, desired, emit=emit, stop=stop, interval_s=interval, once=once, log=log, clock=system_clock())


def _status(registry: Registry, lane_broker: LaneBroker, desired: DesiredState, *, as_json: bool) -> None:
    status = lane_status(registry, lane_broker, desired)
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
        workers = "" if v.workers is None else f" ({v.workers} worker{'' if v.workers == 1 else 's'})"
        print(f"lane {v.id:<12} {v.kind:<8} rank {v.rank:<3} {v.in_flight}/{v.cap}  {status.queues.get(v.id, '-')}{workers}{state}")
        if v.id in status.agents:
            print(f"     {'':<12} phaze cap {v.cap} · {status.agents[v.id].text()}")
    new = status.new_job
    print(f"a new job now: {f'-> {new.lane}' if new.lane else f'held: {new.hold}: {HOLD_MEANING[new.hold or str()]}'}")
    for j in status.running:
        since = stamp(j.dispatched_at, now) if j.dispatched_at else "?"
        print(f"dispatched {j.job_id} to {j.lane} ({status.queues.get(j.lane or '', '?')}) since {since}")
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
        how = "ok" if outcome.ok else "failed" + (f" ({outcome.end})" if outcome.end else "")
        unit = f"; journalctl _SYSTEMD_UNIT={outcome.unit}" if outcome.unit else ""
        last = f"; last line: {outcome.output[-1]}" if outcome.output else ""
        print(f"scaling: {tier} hook last at {stamp(outcome.at, now)}: {how}{unit}{last}")
    for entry in scaling.recent[-10:]:
        print(f"scaling {stamp(entry.at)} {entry.kind} {entry.node or entry.tier or ''}: {entry.outcome} ({entry.reason})")
