"""The options of a pass, shared by `fabric reconcile` and `fabric plan`, and how a pass command ends.

add_pass_options(parser)     every option of a pass
options = pass_options(args)  -> reconciler.engine.reconcile.PassOptions
return finish(report)         print a PassReport; bad input raises InvalidInput (exit 2),
                              a failed pass CommandError (exit 1)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from reconciler.cli import EXIT_OK, CommandError, InvalidInput
from reconciler.cli.common import add_desired, add_registry_path

# The defaults live with PassOptions, in a module light enough that parsing
# the arguments of a pass imports no model or template (a memoized pass never does).
from reconciler.engine.pass_options import CADDY_MAIN_CANDIDATES, DEFAULT_PLAN_KEY_FILE, STATE_DIR, UNIT_DIR
from reconciler.wiring import host_name

if TYPE_CHECKING:
    from reconciler.engine.pass_options import PassOptions, PlanSource
    from reconciler.engine.reconcile import PassReport

# The environment variable naming a candidate's plan signing key file (a *_FILE path, never the key).
PLAN_KEY_ENV = "FABRIC_PLAN_KEY_FILE"


def add_plan_key_option(p: argparse.ArgumentParser, *, used: str) -> None:
    """--plan-key-file: a leader candidate's private plan signing key (`fabric leader keygen`)."""
    p.add_argument(
        "--plan-key-file",
        metavar="FILE",
        type=Path,
        default=Path(os.environ.get(PLAN_KEY_ENV) or DEFAULT_PLAN_KEY_FILE),
        help=f"the private ed25519 key this leader candidate signs fleet plans with, mode 0600, {used} "
        f"(default: ${PLAN_KEY_ENV} or {DEFAULT_PLAN_KEY_FILE})",
    )


def add_plan_source_options(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument("--plan-file", metavar="FILE", type=Path, help="render from this FleetPlan JSON; do not touch the registry")
    source.add_argument(
        "--no-registry",
        action="store_true",
        help="do not touch the registry: plan over this host alone (what it would run by itself)",
    )
    add_registry_path(p, otherwise="with --root and the sqlite backend, [registry].path under the root")


def add_pass_options(p: argparse.ArgumentParser) -> None:
    add_desired(p)
    p.add_argument("--host", metavar="NAME", help="which host of the desired state this machine is (default: its host name)")
    p.add_argument(
        "--root",
        metavar="DIR",
        type=Path,
        default=Path("/"),
        help="root the files and the state directory go under (default /); for a sandbox, add --no-activate "
        "unless the systemd you activate through reads its units from DIR",
    )
    p.add_argument("--replay", metavar="PROBEDIR", help="use a saved probe capture (fabric probe --capture) instead of probing")
    add_plan_source_options(p)
    add_plan_key_option(p, used="read only when this pass leads")
    p.add_argument(
        "--unit-dir",
        metavar="DIR",
        default=UNIT_DIR,
        help=f"where units go, always under the root, given with or without a leading '/' (default: {UNIT_DIR}; a NixOS host: /run/systemd/system)",
    )
    p.add_argument("--state-dir", metavar="DIR", default=STATE_DIR, help=f"generations and lock, relative to the root (default: {STATE_DIR})")
    p.add_argument("--no-activate", action="store_true", help="write the files but activate nothing (and skip the real checks)")
    p.add_argument("--validate", action="store_true", help="with --no-activate: still run systemd-analyze, nft -c and caddy validate")
    p.add_argument(
        "--systemd-bus",
        metavar="ADDRESS",
        default=os.environ.get("FABRIC_SYSTEMD_BUS"),
        help="D-Bus address of the systemd to activate through (default: $FABRIC_SYSTEMD_BUS or the system bus)",
    )
    p.add_argument("--caddy-admin", metavar="HOST:PORT", default="localhost:2019", help="Caddy's admin API (edge hosts)")
    p.add_argument(
        "--caddy-main",
        metavar="FILE",
        help="the edge's main Caddyfile, which imports the fabric's snippet, relative to the root "
        f"(default: the first that exists of {', '.join(CADDY_MAIN_CANDIDATES)})",
    )
    p.add_argument(
        "--member-of",
        metavar="GROUP",
        help="this machine has no host file: it joins worker group GROUP of fabric.toml ([groups.<GROUP>]) as an ephemeral member, "
        "with the group's settings as its host file (its registry identity: the group's)",
    )
    p.add_argument("--address", metavar="IP", help="with --member-of: the address the fleet reaches this member at (its tailnet IP)")
    p.add_argument(
        "--startup-grace",
        metavar="SECONDS",
        type=float,
        default=1.0,
        help="watch the started or restarted units of each batch, together, this long; one that fails meanwhile fails the pass (default 1)",
    )


def plan_source_from(args: argparse.Namespace) -> PlanSource:
    from reconciler.engine.pass_options import PlanAlone, PlanFile, PlanFromRegistry

    if args.plan_file is not None:
        return PlanFile(args.plan_file)
    if args.no_registry:
        return PlanAlone()
    return PlanFromRegistry(args.registry_path)


def pass_options(args: argparse.Namespace) -> PassOptions:
    from reconciler.engine.pass_options import PassOptions

    return PassOptions(
        desired=args.desired,
        host=args.host or host_name(),
        root=Path(args.root),
        state_dir=args.state_dir,
        unit_dir=args.unit_dir,
        replay=args.replay,
        plan=plan_source_from(args),
        no_activate=args.no_activate,
        validate=args.validate,
        caddy_main=args.caddy_main,
        systemd_bus=args.systemd_bus,
        caddy_admin=args.caddy_admin,
        startup_grace=args.startup_grace,
        plan_key_file=args.plan_key_file,
        member_of=args.member_of,
        member_address=args.address,
    )


def finish(report: PassReport) -> int:
    """Print what the pass reports and end the command with its status."""
    if report.outcome == "bad-input":
        raise InvalidInput(*report.stderr)
    sys.stdout.write(report.stdout)
    if not report.ok:
        raise CommandError(*report.stderr)
    for line in report.stderr:
        print(line, file=sys.stderr)
    return EXIT_OK
