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
from pathlib import Path

from reconciler.cli.pass_options import finish
from reconciler.engine.apply import STATE_DIR
from reconciler.engine.reconcile import RollbackOptions, roll_back
from reconciler.wiring import real_rollback_ports


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rollback", help="reinstall and activate an earlier generation")
    p.add_argument("--to", metavar="N", type=int, help="the generation to go back to (default: the one before the last good one)")
    p.add_argument("--root", metavar="DIR", type=Path, default=Path("/"), help="root of the files (default /)")
    p.add_argument("--state-dir", metavar="DIR", default=STATE_DIR, help=f"relative to the root (default: {STATE_DIR})")
    p.add_argument("--no-activate", action="store_true", help="reinstall the files only")
    p.add_argument("--systemd-bus", metavar="ADDRESS", help="D-Bus address of systemd (default: the system bus)")
    p.add_argument("--caddy-admin", metavar="HOST:PORT", default="localhost:2019", help="Caddy's admin API")
    p.add_argument("--caddy-main", metavar="FILE", help="the edge's main Caddyfile, relative to the root (default: as for reconcile)")
    p.add_argument(
        "--startup-grace", metavar="SECONDS", type=float, default=1.0, help="watch the started units of each batch, together, this long (default 1)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    options = RollbackOptions(
        root=args.root,
        state_dir=args.state_dir,
        to=args.to,
        no_activate=args.no_activate,
        caddy_main=args.caddy_main,
        systemd_bus=args.systemd_bus,
        caddy_admin=args.caddy_admin,
        startup_grace=args.startup_grace,
    )
    with real_rollback_ports(options) as ports:
        report = roll_back(options, ports)
    return finish(report)
