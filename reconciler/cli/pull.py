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
from pathlib import Path

from reconciler.adapters.commands import SubprocessRunner
from reconciler.adapters.git_source import GitSource
from reconciler.cli import EXIT_FAILED, EXIT_INVALID, EXIT_OK
from reconciler.cli.units import add_node_config, load_node_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="fetch the desired state from its git remote (node.toml [source])")
    add_node_config(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    node = load_node_config(args.config, must_exist=True)
    if node is None:
        return EXIT_INVALID
    if node.source is None:
        print(f"{args.config}: source: not set (the desired state is the local directory {node.node.desired})", file=sys.stderr)
        return EXIT_INVALID
    source = GitSource(
        SubprocessRunner(),
        node.source,
        checkout=Path(node.node.desired),
        known_hosts=Path(node.node.state_dir) / "known_hosts",
    )
    outcome = source.update()
    if outcome.problem:
        print(f"pull: {outcome.problem}", file=sys.stderr)
    if outcome.commit is None:
        print("pull: no desired state checked out yet", file=sys.stderr)
        return EXIT_FAILED
    if outcome.problem:
        print(f"pull: keeping the last good commit {outcome.commit[:12]}", file=sys.stderr)
    else:
        print(f"pull: {'now at' if outcome.changed else 'up to date at'} {outcome.commit[:12]}")
    return EXIT_OK
