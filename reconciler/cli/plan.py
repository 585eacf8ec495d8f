"""fabric plan: what `fabric reconcile` would do with the same options; writes nothing.

    fabric plan --host racknerd --root sandbox     the plan as text a person reads
    fabric plan ... --json                         the same as JSON

It reads the disk and the generations under the root (and, unless
--no-activate, asks systemd which units are running) but takes no lock and
changes nothing (`reconciler.engine.reconcile.preview_pass`).
"""

from __future__ import annotations

import argparse
import json

from reconciler.cli import EXIT_OK
from reconciler.cli.pass_options import add_pass_options, finish, pass_options
from reconciler.engine.reconcile import Preview, preview_pass
from reconciler.wiring import real_pass_ports


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="show what a reconcile pass would write, restart, start and stop")
    add_pass_options(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    options = pass_options(args)
    with real_pass_ports(options) as ports:
        report = preview_pass(options, ports)
    if args.json and report.preview is not None:
        print(json.dumps(preview_json(report.preview), indent=2))
        return EXIT_OK
    return finish(report)


def preview_json(preview: Preview) -> dict:
    body = preview.actions.to_json()
    body["host"] = preview.host
    body["unfinished_activation"] = preview.unfinished
    body["notes"] = list(preview.render_notes)
    return body
