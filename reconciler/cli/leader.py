"""fabric leader: who leads and the epoch; `fabric leader run --host NAME` is fabric-leader.service.

`fabric leader [--json]` prints the current leader, the epoch and the newest
plan's epoch (exit 0 also when nobody leads).

`fabric leader run --host NAME [--lease-ttl S] [--once]` is the long-running
loop of a leader candidate (`reconciler.engine.leader`): campaign, keep
the lease alive, watch the registry, advance the node lifecycle and publish
the scheduler's plan when it changes, then carry out the burst and scaling
decisions (cloud hooks run without a shell, concurrency overrides, scaled-down
groups; reconciler.engine.scaling_step). NAME must be in fleet.leader_candidates
(exit 2 otherwise). The lease TTL defaults to timing.heartbeat_s: when the
leader dies another candidate leads within one TTL. SIGTERM/SIGINT resign.
`--once` does one step, resigns and exits (a reconcile pass on a single host).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from reconciler.cli import EXIT_OK, CommandError, InvalidInput
from reconciler.cli.registry_options import add_registry_options, desired_and_registry
from reconciler.cli.wiring import leader_ports
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from reconciler.core.scheduling.placement import schedule
from reconciler.core.timestamps import stamp
from reconciler.engine.leader import candidate_loop
from reconciler.ports import Audit, CommandRunner, Registry, RegistryUnavailable


def _ttl(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text} is outside 1..3600 seconds")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("leader", help="show the leader and epoch; 'leader run --host NAME' campaigns and leads")
    add_registry_options(p)
    p.add_argument("action", nargs="?", choices=["show", "run"], default="show", help="show (default) or run the leader loop")
    p.add_argument("--json", action="store_true", help="show: machine-readable output")
    p.add_argument("--host", metavar="NAME", help="run: this host's name (a leader candidate)")
    p.add_argument("--lease-ttl", type=_ttl, metavar="S", help="run: leader lease TTL in seconds (default timing.heartbeat_s)")
    p.add_argument("--once", action="store_true", help="run: one step, then exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "run":
        return _run_loop(args)
    with desired_and_registry(args) as (_, registry):
        info = registry.leader()
        epoch = registry.epoch()
        plan = registry.newest_plan()
    if args.json:
        print(
            json.dumps(
                {
                    "leader": info.candidate if info else None,
                    "since": info.since.isoformat() if info else None,
                    "term_epoch": info.epoch if info else None,
                    "epoch": epoch,
                    "plan_epoch": plan.epoch if plan else None,
                },
                indent=2,
            )
        )
        return EXIT_OK
    if info is None:
        print(f"no leader; epoch {epoch}")
    else:
        print(f"{info.candidate} leads since {stamp(info.since)} (term began at epoch {info.epoch}); epoch {epoch}")
    print(f"newest plan: epoch {plan.epoch} by {plan.leader}" if plan else "newest plan: none published")
    return EXIT_OK


def _log(message: str) -> None:
    print(f"fabric-leader: {message}", file=sys.stderr, flush=True)


def _run_loop(args: argparse.Namespace) -> int:
    if not args.host:
        raise InvalidInput("fabric leader run: --host NAME is required")
    with desired_and_registry(args) as (desired, registry):
        candidates = desired.fleet.fleet.leader_candidates
        if args.host not in candidates:
            raise InvalidInput(f"fabric leader run: {args.host!r} is not in fleet.leader_candidates ({', '.join(candidates)})")
        with leader_ports() as (runner, audit):
            return _lead(args, desired, registry, runner, audit)


def _lead(args: argparse.Namespace, desired: DesiredState, registry: Registry, runner: CommandRunner, audit: Audit | None) -> int:
    loop = candidate_loop(
        registry,
        args.host,
        lambda: load_desired(args.desired),
        schedule,
        lease_ttl_s=args.lease_ttl or float(desired.fleet.timing.heartbeat_s),
        runner=runner,
        audit=audit,
        log=_log,
    )
    if args.once:
        try:
            loop.step_and_resign()
        except RegistryUnavailable as exc:
            raise CommandError(f"fabric-leader: registry unreachable: {exc}") from None
        return EXIT_OK
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: loop.stop())
    _log(f"{args.host} campaigning (lease TTL {loop.lease_ttl_s:g} s)")
    loop.run()
    return EXIT_OK
