"""fabric pull: bring the desired-state checkout up to date (fabric-reconcile's ExecStartPre).

Exit 0 when the checkout is usable afterwards, at the newest acceptable commit
or, if the remote is unreachable or its newest commit is refused (unsigned),
at the last good one: the pass then runs on what the host already had (fail
static) and stderr says why. Exit 1 only when there is no checkout at all; 2 on
a bad node.toml or one without [source].

A pass fabric-watch asked for (its ask in node.state_dir) reacts to the
registry, not to git: while the last fetch tried is recent it is not fetched
first (`reconciler.core.install.fetching`), and the pass renders from the
checkout the host has. Every other start (the timer's, an operator's) fetches.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reconciler.cli import EXIT_OK, CommandError, InvalidInput
from reconciler.cli.common import add_node_config, load_node_config
from reconciler.core.install.fetching import FETCHED, fetch_choice
from reconciler.core.install.nodeconfig import timespan_seconds
from reconciler.core.live.watching import PASS_ASKED, moment_record, recorded_moment
from reconciler.ports import FileTree
from reconciler.wiring import desired_source, local_tree, system_clock


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="fetch the desired state from its git remote (node.toml [source])")
    add_node_config(p)
    p.add_argument(
        "--accept-rewind",
        action="store_true",
        help="take the branch's newest commit even when it does not descend from the current one (a force-push back); it must still be signed",
    )
    p.set_defaults(func=run)


def _warn(message: str) -> None:
    print(f"pull: {message}", file=sys.stderr)


def _take_ask(records: FileTree) -> float | None:
    """fabric-watch's ask for this pass, removed so that it counts for one pass only."""
    try:
        asked = recorded_moment(records.read(PASS_ASKED))
        if asked is not None:
            records.remove(PASS_ASKED)
    except OSError as exc:
        _warn(f"cannot read or remove {PASS_ASKED}: {exc}; fetching")
        return None
    return asked


def _last_fetch(records: FileTree) -> float | None:
    try:
        return recorded_moment(records.read(FETCHED))
    except OSError:
        return None


def run(args: argparse.Namespace) -> int:
    node = load_node_config(args.config, must_exist=True)
    if node.source is None:
        raise InvalidInput(f"{args.config}: source: not set (the desired state is the local directory {node.node.desired})")
    source = desired_source(node)
    records = local_tree(Path(node.node.state_dir))
    now = system_clock().now()
    choice = fetch_choice(asked_at=_take_ask(records), fetched_at=_last_fetch(records), now=now, interval_s=timespan_seconds(node.timer.interval))
    head = None if choice.fetch or args.accept_rewind else source.head()
    if head is not None:
        print(f"pull: not fetching: {choice.reason}; staying at {head[:12]}")
        return EXIT_OK
    outcome = source.update(accept_rewind=args.accept_rewind)
    try:
        records.write(FETCHED, moment_record(now))
    except OSError as exc:
        _warn(f"cannot record the fetch in {FETCHED}: {exc}")
    if outcome.problem:
        _warn(outcome.problem)
    if not node.source.require_signed_commits:
        _warn("unsigned commits are accepted (node.toml [source] require_signed_commits = false): anyone who can push runs anything here")
    if outcome.commit is None:
        raise CommandError("pull: no desired state checked out yet")
    if outcome.problem:
        _warn(f"keeping the last good commit {outcome.commit[:12]}")
    else:
        print(f"pull: {'now at' if outcome.changed else 'up to date at'} {outcome.commit[:12]}")
    return EXIT_OK
