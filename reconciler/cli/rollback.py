"""fabric rollback: go back to an earlier generation by hand.

    fabric rollback            the generation before the last good one
    fabric rollback --to N     generation N

Reinstalls that generation's files, removes the ones it did not have, and
activates the difference (daemon-reload, nft, stop, reload, restart, start,
caddy), exactly as a failed pass rolls back. The next `fabric reconcile`
renders the desired state again: fix the desired state (or stop the timer)
to stay on the old generation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reconciler.cli import EXIT_FAILED, EXIT_OK
from reconciler.cli.reconcile import Wiring, applier_for, real_wiring
from reconciler.engine.apply import STATE_DIR
from reconciler.ports import ActivationError, LockBusy


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rollback", help="reinstall and activate an earlier generation")
    p.add_argument("--to", metavar="N", type=int, help="the generation to go back to (default: the one before the last good one)")
    p.add_argument("--root", metavar="DIR", type=Path, default=Path("/"), help="root of the files (default /)")
    p.add_argument("--state-dir", metavar="DIR", default=STATE_DIR, help=f"relative to the root (default: {STATE_DIR})")
    p.add_argument("--no-activate", action="store_true", help="reinstall the files only")
    p.add_argument("--systemd-bus", metavar="ADDRESS", help="D-Bus address of systemd (default: the system bus)")
    p.add_argument("--caddy-admin", metavar="HOST:PORT", default="localhost:2019", help="Caddy's admin API")
    p.add_argument("--caddy-main", metavar="FILE", help="the edge's main Caddyfile, relative to the root (default: as for reconcile)")
    p.add_argument("--startup-grace", metavar="SECONDS", type=float, default=1.0, help="watch each started unit this long (default 1)")
    p.set_defaults(func=run, validate=False)


def run(args: argparse.Namespace) -> int:
    wiring = real_wiring(args)
    try:
        return roll_back(args, wiring)
    finally:
        wiring.close()


def roll_back(args: argparse.Namespace, wiring: Wiring) -> int:
    applier = applier_for(args, wiring)
    try:
        number, plan = applier.rollback(args.to)
    except (ActivationError, LockBusy) as exc:
        print(f"fabric rollback: {exc}", file=sys.stderr)
        return EXIT_FAILED
    sys.stdout.write(plan.text(files_done=True, activation_done=not args.no_activate))
    print(f"generation {number} is {'installed' if args.no_activate else 'active'} again")
    return EXIT_OK
