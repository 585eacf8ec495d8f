"""fabric admit HOST: admit a pending machine, committing its host file.

    fabric admit HOST [--desired DIR] [--role ROLE ...] [--leader-candidate] [--push] [--dry-run]

Reads HOST's pending report from the registry (a machine with the fabric
installed and no host file reports itself pending at each pass), writes
hosts/HOST.toml from it (beside fabric.toml when the tree keeps its host
files there) with the probed values as comments and the limits no higher
than the probe, validates the whole desired state with it, prints the diff
and commits exactly that file (and fabric.toml with --leader-candidate) to
the checkout at --desired: signed when the checkout requires signed
commits (its git config commit.gpgsign, or --node-config's [source]
require_signed_commits). `--push` pushes the commit. When the hosts pull
it, the machine's next pass is a normal one.

Exit status: 0 admitted (or --dry-run shown); 2 refused, nothing written:
an unknown or expired pending report, a name that is not a valid host name
or collides with a declared host, a desired state that does not validate
with the new file; 1 the registry cannot be reached or git failed (nothing
written stays).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reconciler.cli import EXIT_OK, CommandError, InvalidInput
from reconciler.cli.common import NODE_CONFIG_PATH
from reconciler.cli.registry_options import add_registry_options, opened_registry
from reconciler.core.desired.model import DesiredState
from reconciler.core.desired.problems import ProblemsError
from reconciler.core.install.admission import ADMIT_ROLES, AdmissionRefused
from reconciler.core.timestamps import from_epoch_seconds
from reconciler.engine.admit import AdmitRequest, admit
from reconciler.ports import CheckoutError
from reconciler.wiring import desired_checkout, system_clock


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "admit",
        help="admit a pending machine: write, validate and commit its host file from its pending report",
        description="Exit 2 (nothing written): unknown or expired pending report, bad or colliding name, a tree that does not validate.",
    )
    p.add_argument("host", metavar="HOST", help="the pending machine's host name (`fabric nodes` lists them)")
    add_registry_options(p)
    p.add_argument("--role", action="append", choices=ADMIT_ROLES, help="a role of the new host (repeat; default: compute)")
    p.add_argument("--leader-candidate", action="store_true", help="also add it to fabric.toml's [fleet] leader_candidates")
    p.add_argument("--push", action="store_true", help="push the commit to the checkout's upstream")
    p.add_argument("--dry-run", action="store_true", help="show the diff, write and commit nothing")
    p.add_argument(
        "--node-config",
        metavar="FILE",
        type=Path,
        default=Path(NODE_CONFIG_PATH),
        help=f"this machine's node.toml: its [source] require_signed_commits makes the commit signed (default {NODE_CONFIG_PATH})",
    )
    p.set_defaults(func=run)


def _loaded(directory: Path) -> DesiredState:
    """The desired state for the registry's settings; a tree that does not
    validate is refused by `admit` itself (with its reason)."""
    from reconciler.core.desired.load import DesiredStateError, load_desired

    try:
        return load_desired(directory)
    except DesiredStateError as exc:
        raise InvalidInput(*(f"fabric admit: refused: {problem}" for problem in exc.problems)) from None


def run(args: argparse.Namespace) -> int:
    desired = _loaded(args.desired)
    try:
        checkout = desired_checkout(args.desired, args.node_config)
    except ProblemsError as exc:
        raise InvalidInput(*(str(problem) for problem in exc.problems)) from None
    request = AdmitRequest(
        host=args.host,
        directory=args.desired,
        host_dir="hosts/" if (args.desired / "hosts").is_dir() or len(desired.hosts) == 0 else "",
        roles=tuple(dict.fromkeys(args.role or ["compute"])),
        leader_candidate=args.leader_candidate,
        push=args.push,
        dry_run=args.dry_run,
    )
    with opened_registry(args, desired, existing=True) as registry:
        try:
            result = admit(request, registry, checkout, from_epoch_seconds(system_clock().now()))
        except AdmissionRefused as exc:
            raise InvalidInput(f"fabric admit {args.host}: refused, nothing written: {exc}") from None
        except CheckoutError as exc:
            raise CommandError(f"fabric admit {args.host}: {exc}") from None
    sys.stdout.write(result.diff)
    if result.commit is None:
        print(f"dry run: {args.host} not admitted, nothing written")
        return EXIT_OK
    print(f"committed {result.commit[:12]}{' (signed)' if result.signed else ''}: {args.host} admitted")
    if result.pushed is not None:
        print("pushed: the hosts take it at their next pull; its next pass is a normal one")
    else:
        print("push it (or rerun with --push): the hosts take it at their next pull")
    if desired.fleet.registry.backend == "etcd":
        print(f"with etcd's auth on: run `fabric registry init-auth` (as root) and give {args.host} its client certificate (CN={args.host})")
    return EXIT_OK
