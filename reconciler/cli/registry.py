"""fabric registry export: the live registry as a snapshot (JSON on stdout).

The output is the `reconciler.core.live.models.Snapshot` format that `fabric schedule
--snapshot FILE` and `fabric status --snapshot FILE` read: now, nodes (with
drained, held_off_until, last_seen), every declared lane with its claimed
slots, the newest plan's placements, leader and epoch.
"""

from __future__ import annotations

import argparse

from reconciler.cli import EXIT_OK
from reconciler.cli.registry_options import add_registry_options, desired_and_registry


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("registry", help="registry tools (export a snapshot)")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    export = actions.add_parser("export", help="print the live state as a snapshot (JSON)")
    add_registry_options(export)
    export.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    with desired_and_registry(args) as (desired, registry):
        snapshot = registry.snapshot(lanes=[lane.id for lane in desired.lanes])
    print(snapshot.model_dump_json(indent=2))
    return EXIT_OK
