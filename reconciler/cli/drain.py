"""fabric drain HOST [--grace S] / fabric undrain HOST.

Drain: the host takes no new work at once; its existing work stays for the
grace (seconds, default 0) and then moves off (the leader re-places it). The
request is stored in the registry; the leader applies it on its next step.
HOST must be a host of the desired state (exit 2 otherwise, nothing written).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

from reconciler.cli import EXIT_OK, InvalidInput
from reconciler.cli.registry_options import add_registry_options, desired_and_registry
from reconciler.ports import Registry


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


@contextmanager
def _host_registry(args: argparse.Namespace) -> Iterator[Registry]:
    """The registry, once HOST is known to be a host of the desired state."""
    with desired_and_registry(args) as (desired, registry):
        if args.host not in desired.hosts:
            raise InvalidInput(f"fabric {args.command}: {args.host!r} is not a host of the desired state ({', '.join(sorted(desired.hosts))})")
        yield registry


def run_drain(args: argparse.Namespace) -> int:
    with _host_registry(args) as registry:
        request = registry.set_drain(args.host, grace_s=args.grace, reason="fabric drain")
    print(f"{args.host}: drained (no new work); existing work moves off after {request.grace_s:g} s")
    return EXIT_OK


def run_undrain(args: argparse.Namespace) -> int:
    with _host_registry(args) as registry:
        lifted = registry.clear_drain(args.host)
    print(f"{args.host}: {'undrained' if lifted else 'was not drained'}")
    return EXIT_OK
