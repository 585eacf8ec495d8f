"""fabric validate: check the desired state, report every problem at once."""

from __future__ import annotations

import argparse

from reconciler.cli import EXIT_OK
from reconciler.cli.common import add_desired, load_or_fail
from reconciler.core.desired.load import summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check the desired state (exit 2 on any problem)")
    add_desired(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(summary(load_or_fail(args.desired)))
    return EXIT_OK
