"""fabric status: lane cards, nodes, leader and epoch, deferred work.

    fabric status [--desired DIR] [--registry-path FILE | --snapshot FILE [--plan FILE]]
                  [--json] [--watch [SECONDS]]

Without `--snapshot` it reads the live registry fabric.toml's [registry] names
(or the sqlite file `--registry-path` / $FABRIC_REGISTRY): its snapshot now and
the newest published plan. With `--snapshot FILE` it shows a saved snapshot
(`fabric registry export`) as of the instant it was taken, and the plan the
scheduler makes for it (a what-if), or the saved plan given with `--plan FILE`.

Exit status: 0 shown; 1 the registry cannot be reached; 2 bad input.

`--watch` redraws in place every SECONDS (default 2), re-reading every input
each time; Ctrl-C ends it with status 0. With `--json` each refresh is one JSON
document on its own line, for scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TypeVar

from pydantic import BaseModel, ValidationError

from reconciler.cli import EXIT_OK, CommandError, InvalidInput
from reconciler.cli.common import NODE_CONFIG_PATH, add_desired, load_or_fail
from reconciler.cli.registry_options import add_registry_path, opened_registry
from reconciler.core.desired.problems import key_path
from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.live.pending import undeclared_note
from reconciler.core.views.capabilities import pending_lines, pending_rows
from reconciler.core.views.cards import fleet_status, render_text, status_document
from reconciler.engine.status import StatusInputs, live_status, saved_status
from reconciler.ports import LaneBrokerError
from reconciler.wiring import lane_broker_if_configured

DEFAULT_WATCH_S = 2.0
# Home the cursor and clear the screen: one redraw per refresh, no scrollback spam.
CLEAR_SCREEN = "\x1b[H\x1b[2J"

Model = TypeVar("Model", bound=BaseModel)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="lane cards, nodes, leader and deferred work")
    add_desired(p)
    source = p.add_mutually_exclusive_group()
    add_registry_path(source)
    source.add_argument("--snapshot", metavar="FILE", type=Path, help="show this saved snapshot instead of the live registry")
    p.add_argument(
        "--plan",
        metavar="FILE",
        type=Path,
        help="with --snapshot: show this saved plan instead of scheduling the snapshot",
    )
    p.add_argument("--json", action="store_true", help="print a JSON document (one per refresh with --watch)")
    p.add_argument(
        "--watch",
        metavar="SECONDS",
        nargs="?",
        type=_positive_seconds,
        const=DEFAULT_WATCH_S,
        help=f"refresh in place every SECONDS (default {DEFAULT_WATCH_S:g}); Ctrl-C to stop",
    )
    p.set_defaults(func=run)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: give between 0.1 and 3600 seconds")
    return value


def run(args: argparse.Namespace) -> int:
    if args.plan is not None and args.snapshot is None:
        raise InvalidInput("fabric status: --plan needs --snapshot (the live registry has its own plan)")
    first = gather(args)
    color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    if args.watch is None:
        sys.stdout.write(frame(first, as_json=args.json, color=color))
        return EXIT_OK
    return watch(
        lambda: draw(args, color),
        interval=args.watch,
        out=sys.stdout,
        sleep=time.sleep,
        # Clearing makes sense only on a terminal; JSON lines are never cleared.
        clear=sys.stdout.isatty() and not args.json,
        first=frame(first, as_json=args.json, color=color),
        between="" if args.json else "\n",
    )


def gather(args: argparse.Namespace) -> StatusInputs:
    """Everything one frame shows, read afresh; bad input raises InvalidInput
    (exit 2), an unreachable registry CommandError (exit 1)."""
    desired = load_or_fail(args.desired)
    if args.snapshot is None:
        # Looking must not create a sqlite registry that is not there.
        this = this_host()
        # A pending machine's own identity may write its pending report and read nothing: say what it waits for.
        hint = f"; {undeclared_note(this)}" if runs_undeclared(this, desired.hosts) else ""
        with opened_registry(args, desired, existing=True, hint=hint) as registry:
            lane_broker = lane_broker_if_configured(desired.fleet, note=lambda line: print(f"note: {line}", file=sys.stderr))
            try:
                return live_status(desired, registry, lane_broker)
            except LaneBrokerError as exc:
                raise CommandError(f"fabric status: lane queue: {exc}") from None
            finally:
                if lane_broker is not None:
                    lane_broker.close()
    snapshot = load_json_model(args.snapshot, Snapshot)
    plan = load_json_model(args.plan, FleetPlan) if args.plan is not None else None
    return saved_status(desired, snapshot, plan)


def load_json_model(path: Path, model: type[Model]) -> Model:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidInput(f"{path}: (file): {exc.strerror or exc}") from None
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        raise InvalidInput(*(f"{path}: {key_path(error['loc'])}: {error['msg']}" for error in exc.errors())) from None


def frame(inputs: StatusInputs, *, as_json: bool, color: bool) -> str:
    status = fleet_status(inputs.desired, inputs.snapshot, inputs.plan, inputs.now, plan_refused=inputs.plan_refused, history=inputs.history)
    if as_json:
        document = status_document(status)
        document["pending"] = [
            {"node_id": node, "tier": tier, "hardware": hardware, "waited": waited, "admit": admit}
            for node, tier, hardware, waited, admit in pending_rows(inputs.pending, inputs.now)
        ]
        return json.dumps(document, ensure_ascii=False) + "\n"
    text = render_text(status, color=color)
    this = this_host()
    lines = pending_lines(inputs.pending, inputs.now, this)
    if runs_undeclared(this, inputs.desired.hosts) and this not in {r.node_id for r in inputs.pending}:
        lines += ["", undeclared_note(this)]
    return text + "".join(f"{line}\n" for line in lines)


def runs_undeclared(host: str, declared: Mapping[str, object]) -> bool:
    """This machine runs the fabric (it has a node.toml) and has no host file:
    a pending machine (an operator's laptop has no node.toml)."""
    return host not in declared and Path(NODE_CONFIG_PATH).is_file()


def this_host() -> str:
    """This machine's host name (short), as its pass names it by default."""
    return socket.gethostname().split(".", 1)[0]


def draw(args: argparse.Namespace, color: bool) -> str:
    """One refresh; bad input mid-watch is shown in the frame, not fatal."""
    try:
        return frame(gather(args), as_json=args.json, color=color)
    except CommandError as exc:
        if args.json:
            return json.dumps({"error": list(exc.lines)}) + "\n"
        return "\n".join(["fabric status: cannot read the inputs:", *exc.lines]) + "\n"


def watch(
    draw: Callable[[], str],
    *,
    interval: float,
    out: IO[str],
    sleep: Callable[[float], None],
    clear: bool,
    first: str | None = None,
    between: str = "",
) -> int:
    """Redraw every `interval` seconds until Ctrl-C, which is a normal end (0).

    `clear` redraws in place (a terminal); otherwise frames follow one another,
    `between` apart.
    """
    try:
        text = first if first is not None else draw()
        drawn = False
        while True:
            if clear:
                out.write(CLEAR_SCREEN)
            elif drawn:
                out.write(between)
            out.write(text)
            drawn = True
            out.flush()
            sleep(interval)
            text = draw()
    except KeyboardInterrupt:
        if clear:
            out.write("\n")
            out.flush()
        return EXIT_OK
