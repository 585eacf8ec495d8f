"""fabric drain HOST [--grace S] / fabric undrain HOST.

Drain: the host takes no new work at once; its existing work stays for the
grace (seconds, default 0) and then moves off (the leader re-places it). The
request is stored in the registry; the leader applies it on its next step.
HOST must be a host of the desired state (exit 2 otherwise, nothing written).
"""

from __future__ import annotations

import argparse
import sys

from reconciler.cli import EXIT_INVALID, EXIT_OK
from reconciler.cli.registry_options import add_registry_options, failure_status, open_from_args, registry_failed
from reconciler.ports import RegistryError


def _grace(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value <= 86_400:
        raise argparse.ArgumentTypeError(f"{text} is outside 0..86400 seconds")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drain", help="take a host out of new placements; move its work off after --grace")
    add_registry_options(p)
    p.add_argument("host", metavar="HOST", help="a host of the desired state")
    p.add_argument("--grace", type=_grace, default=0.0, metavar="S", help="seconds its existing work may stay (default 0)")
    p.set_defaults(func=run_drain)

    u = sub.add_parser("undrain", help="lift a drain: the host takes new work again")
    add_registry_options(u)
    u.add_argument("host", metavar="HOST", help="a host of the desired state")
    u.set_defaults(func=run_undrain)


def _open(args: argparse.Namespace):
    opened = open_from_args(args)
    if opened is None:
        return None, failure_status(args)
    desired, registry = opened
    if args.host not in desired.hosts:
        registry.close()
        print(
            f"fabric {args.command}: {args.host!r} is not a host of the desired state ({', '.join(sorted(desired.hosts))})",
            file=sys.stderr,
        )
        return None, EXIT_INVALID
    return registry, EXIT_OK


def run_drain(args: argparse.Namespace) -> int:
    registry, status = _open(args)
    if registry is None:
        return status
    try:
        request = registry.set_drain(args.host, grace_s=args.grace, reason="fabric drain")
    except RegistryError as exc:
        return registry_failed(args, exc)
    finally:
        registry.close()
    print(f"{args.host}: drained (no new work); existing work moves off after {request.grace_s:g} s")
    return EXIT_OK


def run_undrain(args: argparse.Namespace) -> int:
    registry, status = _open(args)
    if registry is None:
        return status
    try:
        lifted = registry.clear_drain(args.host)
    except RegistryError as exc:
        return registry_failed(args, exc)
    finally:
        registry.close()
    print(f"{args.host}: {'undrained' if lifted else 'was not drained'}")
    return EXIT_OK
