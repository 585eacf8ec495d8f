"""fabric dispatch: where one more piece of work would go right now (a what-if).

    fabric dispatch --min-tier T [--floor F] [--arch A]... [--label K=V]... [--snapshot FILE] [--json]
    fabric dispatch --lane [--waited-s S] [--attempts N] [--snapshot FILE] [--json]

`--min-tier`: a task for a node. The desired state's services are scheduled
over the snapshot first (they hold their slots), then the task is placed by
the same rules (reconciler.core.scheduling.placement), cost as `[scheduler] cost_order`
says. The floor defaults to relay: like the
seed's `select_worker`, fall back as far as there is anything. Prints
`{"node": ID, "tier": TIER, "fallback": BOOL}` or
`{"node": null, "status": "deferred", "reason": TEXT}` (the reason starts with
"inadmissible:" when no node of the fleet could ever take it).

`--lane`: a job for a lane (reconciler.core.scheduling.lanes), given how long it has
waited and how many cloud attempts failed. Prints `{"lane": ID, "hold": null}`
or `{"lane": null, "hold": REASON}`.

Exit status: 0 a decision was made (a deferral or a hold is a decision); 1 the
registry could not be read; 2 bad input.
"""

from __future__ import annotations

import argparse
import json

from reconciler.cli import EXIT_OK
from reconciler.cli.registry_options import add_snapshot_options, desired_and_snapshot
from reconciler.core.desired.model import ARCHES, TIER_ORDER, TIER_SCORE
from reconciler.core.scheduling.lanes import LaneJob, choose_lane, lane_views
from reconciler.core.scheduling.placement import Choice, Request, schedule_with_placer


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dispatch", help="where one task (--min-tier) or lane job (--lane) would go now")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--min-tier", choices=TIER_ORDER, metavar="TIER", help=f"a node task needing TIER ({', '.join(TIER_ORDER)})")
    what.add_argument("--lane", action="store_true", help="a job for a lane")
    p.add_argument("--floor", choices=TIER_ORDER, metavar="TIER", help="with --min-tier: lowest tier to fall back to (default relay)")
    p.add_argument("--arch", action="append", choices=ARCHES, default=[], help="with --min-tier: allowed architecture (repeatable)")
    p.add_argument("--label", action="append", type=_label, default=[], metavar="KEY=VALUE", help="with --min-tier: required node label (repeatable)")
    p.add_argument("--waited-s", type=_non_negative(float), metavar="S", help="with --lane: seconds the job has waited (default 0)")
    p.add_argument("--attempts", type=_non_negative(int), metavar="N", help="with --lane: cloud attempts already failed (default 0)")
    add_snapshot_options(p)
    p.add_argument("--json", action="store_true", help="print the decision as JSON")
    p.set_defaults(func=run, parser=p)


def _non_negative(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
        return value

    return parse


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    if args.lane:
        misplaced = [flag for flag, value in (("--floor", args.floor), ("--arch", args.arch), ("--label", args.label)) if value]
        if misplaced:
            parser.error(f"{', '.join(misplaced)}: only with --min-tier")
    else:
        misplaced = [flag for flag, value in (("--waited-s", args.waited_s), ("--attempts", args.attempts)) if value is not None]
        if misplaced:
            parser.error(f"{', '.join(misplaced)}: only with --lane")
        floor = args.floor or TIER_ORDER[-1]
        if TIER_SCORE[floor] > TIER_SCORE[args.min_tier]:
            parser.error(f"--floor {floor} is above --min-tier {args.min_tier}")

    desired, snapshot = desired_and_snapshot(args)

    if args.lane:
        views = lane_views(desired, snapshot)
        job = LaneJob(waited_s=args.waited_s or 0.0, attempts=args.attempts or 0)
        decision = choose_lane(views, job, desired.fleet.scheduler)
        if args.json:
            print(json.dumps(decision.as_json()))
        else:
            print(decision.lane if decision.lane else f"hold: {decision.hold}")
        return EXIT_OK

    request = Request(
        min_tier=args.min_tier,
        floor=floor,
        arch=frozenset(args.arch),
        labels=tuple(sorted(dict(args.label).items())),
        cost_first=desired.fleet.scheduler.cost_order == "before_tier",
    )
    placer, _ = schedule_with_placer(snapshot, desired)
    outcome = placer.place(request)
    if isinstance(outcome, Choice):
        document = {"node": outcome.node, "tier": outcome.tier, "fallback": outcome.fallback}
        text = f"{outcome.node} ({outcome.tier}{', fallback' if outcome.fallback else ''})"
    else:
        # An inadmissible request says so at the start of its reason.
        document = {"node": None, "status": "deferred", "reason": outcome.reason}
        text = f"deferred: {outcome.reason}"
    print(json.dumps(document) if args.json else text)
    return EXIT_OK
