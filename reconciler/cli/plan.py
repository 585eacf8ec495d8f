"""fabric plan: what `fabric reconcile` would do with the same options; writes nothing.

    fabric plan --host racknerd --root sandbox     the plan as text a person reads
    fabric plan ... --json                         the same as JSON

It reads the disk and the generations under the root (and, unless
--no-activate, asks systemd which units are running) but takes no lock and
changes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys

from reconciler.cli import EXIT_FAILED, EXIT_OK
from reconciler.cli.reconcile import PassInputs, Wiring, add_pass_options, applier_for, prepare, real_wiring
from reconciler.engine.apply import stale_plan
from reconciler.ports import ActivationError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="show what a reconcile pass would write, restart, start and stop")
    add_pass_options(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    inputs = prepare(args, write=False)
    if isinstance(inputs, int):
        return inputs
    wiring = real_wiring(args)
    try:
        return show(args, inputs, wiring)
    finally:
        wiring.close()


def show(args: argparse.Namespace, inputs: PassInputs, wiring: Wiring) -> int:
    applier = applier_for(args, wiring)
    static = inputs.source.static or stale_plan(applier.store, inputs.fleet_plan.epoch)
    if static is not None:
        print(static)
        return EXIT_OK
    try:
        plan, unfinished = applier.compute_plan(inputs.rendered.artifacts)
    except ActivationError as exc:
        if applier.activators is None:
            print(f"fabric plan: {exc}", file=sys.stderr)
            return EXIT_FAILED
        # systemd cannot be asked (no D-Bus here): plan from the files alone.
        print(f"note: cannot ask systemd which units run ({exc}); planning from the files alone", file=sys.stderr)
        applier.activators = None
        plan, unfinished = applier.compute_plan(inputs.rendered.artifacts)
    if args.json:
        body = plan.to_json()
        body["host"] = inputs.host
        body["unfinished_activation"] = unfinished
        body["notes"] = list(inputs.rendered.notes)
        print(json.dumps(body, indent=2))
    else:
        if unfinished:
            print("the last pass did not finish activating; this pass completes it")
        sys.stdout.write(plan.text())
    return EXIT_OK
