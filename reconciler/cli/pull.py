"""fabric pull: bring the desired-state checkout up to date (fabric-reconcile's ExecStartPre).

Exit 0 when the checkout is usable afterwards, at the newest acceptable commit
or, if the remote is unreachable or its newest commit is refused (unsigned),
at the last good one: the pass then runs on what the host already had (fail
static) and stderr says why. Exit 1 only when there is no checkout at all; 2 on
a bad node.toml or one without [source].
"""

from __future__ import annotations

import argparse
import sys

from reconciler.cli import EXIT_OK, CommandError, InvalidInput
from reconciler.cli.common import add_node_config, load_node_config
from reconciler.cli.wiring import desired_source


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="fetch the desired state from its git remote (node.toml [source])")
    add_node_config(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    node = load_node_config(args.config, must_exist=True)
    if node.source is None:
        raise InvalidInput(f"{args.config}: source: not set (the desired state is the local directory {node.node.desired})")
    source = desired_source(node)
    outcome = source.update()
    if outcome.problem:
        print(f"pull: {outcome.problem}", file=sys.stderr)
    if outcome.commit is None:
        raise CommandError("pull: no desired state checked out yet")
    if outcome.problem:
        print(f"pull: keeping the last good commit {outcome.commit[:12]}", file=sys.stderr)
    else:
        print(f"pull: {'now at' if outcome.changed else 'up to date at'} {outcome.commit[:12]}")
    return EXIT_OK
