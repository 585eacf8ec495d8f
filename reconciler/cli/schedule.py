"""fabric schedule: the plan the scheduler makes, as a what-if tool.

    fabric schedule [--desired DIR] [--snapshot FILE | --registry-path FILE] [--json]

Schedules the desired state's services over a snapshot and prints the plan:
placements (with fallbacks), deferred replicas with their reasons, the lanes
in dispatch order and any snapshot node that is not a declared host. With
`--snapshot FILE` the snapshot is a saved one (`fabric registry export`, or
hand-written: `{"now", "nodes": [{"node_id", "tier", "status", "in_flight",
"max_concurrent_tasks", "arch", "labels"}], "lanes": [{"id", "available",
"in_flight"}]}`); without it, the live registry's. Nothing is published: the
leader does that. `--json` prints the FleetPlan JSON.

Exit status: 0 a plan was made (deferred work included); 1 the registry could
not be read; 2 bad input (desired state, snapshot file), with file, key path
and reason.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import BaseModel, ValidationError

from reconciler.cli import EXIT_FAILED, EXIT_INVALID, EXIT_OK
from reconciler.cli.common import load_or_report
from reconciler.cli.registry_options import add_registry_options
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan, Placement, Snapshot, SnapshotLane, SnapshotNode
from reconciler.core.scheduling.placement import schedule


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schedule", help="print the plan the scheduler makes for a snapshot (a what-if)")
    add_snapshot_options(p)
    p.add_argument("--json", action="store_true", help="print the plan as FleetPlan JSON")
    p.set_defaults(func=run)


def add_snapshot_options(parser: argparse.ArgumentParser) -> None:
    """--desired, --registry-path and --snapshot (shared with `fabric dispatch`)."""
    add_registry_options(parser)
    parser.add_argument(
        "--snapshot",
        metavar="FILE",
        type=Path,
        help="a saved snapshot (JSON, as `fabric registry export` writes) instead of the live registry",
    )


# --------------------------------------------------------------------------
# Reading a snapshot


class SnapshotFileError(Exception):
    """A snapshot file is unreadable or invalid; `problems` are `FILE: key.path: reason` lines."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


def _key_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


# Each list of the snapshot and the model of its entries, for unknown-key notes.
_ENTRY_MODELS: dict[str, type[BaseModel]] = {"nodes": SnapshotNode, "lanes": SnapshotLane, "placements": Placement}


def unknown_keys(data: dict) -> list[str]:
    """Key paths the snapshot models do not know (ignored for compatibility
    with newer writers, but most likely a typo in a hand-written file)."""
    found = [key for key in data if key not in Snapshot.model_fields]
    for section, model in _ENTRY_MODELS.items():
        entries = data.get(section)
        if not isinstance(entries, list):
            continue
        for index, entry in enumerate(entries):
            if isinstance(entry, dict):
                found += [f"{section}[{index}].{key}" for key in entry if key not in model.model_fields]
    return found


def read_snapshot(path: Path, warn=lambda line: print(line, file=sys.stderr)) -> Snapshot:
    """The snapshot in `path`; raises SnapshotFileError naming file, key path and reason."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SnapshotFileError([f"{path}: (file): not found"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SnapshotFileError([f"{path}: (file): cannot read: {getattr(exc, 'strerror', None) or exc}"]) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SnapshotFileError([f"{path}: line {exc.lineno} column {exc.colno}: JSON syntax error: {exc.msg}"]) from None
    if not isinstance(data, dict):
        raise SnapshotFileError([f"{path}: (top level): a snapshot is a JSON object, not {type(data).__name__}"])
    try:
        snapshot = Snapshot.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            reason = err["msg"].removeprefix("Value error, ")
            if err["type"] != "missing" and "input" in err:
                reason += f" (got {json.dumps(err['input'])[:80]})"
            problems.append(f"{path}: {_key_path(tuple(err['loc']))}: {reason}")
        raise SnapshotFileError(problems) from None
    for key in unknown_keys(data):
        warn(f"{path}: {key}: unknown key, ignored")
    return snapshot


def obtain_snapshot(args: argparse.Namespace, desired: DesiredState) -> Snapshot | int:
    """The snapshot to work on, or the exit status after saying why on stderr."""
    if args.snapshot is not None:
        try:
            return read_snapshot(args.snapshot)
        except SnapshotFileError as exc:
            for line in exc.problems:
                print(line, file=sys.stderr)
            return EXIT_INVALID
    # The live registry: the same snapshot `fabric registry export` prints.
    from reconciler.cli.wiring import open_registry
    from reconciler.ports import RegistryError

    try:
        registry = open_registry(desired.fleet, sqlite_path=args.registry_path)
    except RegistryError as exc:
        print(f"fabric {args.command}: registry: {exc} (give --snapshot FILE for a what-if)", file=sys.stderr)
        return EXIT_FAILED
    try:
        return registry.snapshot(lanes=[lane.id for lane in desired.lanes])
    except RegistryError as exc:
        print(f"fabric {args.command}: registry: {exc} (give --snapshot FILE for a what-if)", file=sys.stderr)
        return EXIT_FAILED
    finally:
        registry.close()


def load_inputs(args: argparse.Namespace) -> tuple[DesiredState, Snapshot] | int:
    desired = load_or_report(args.desired)
    if desired is None:
        return EXIT_INVALID
    snapshot = obtain_snapshot(args, desired)
    if isinstance(snapshot, int):
        return snapshot
    return desired, snapshot


# --------------------------------------------------------------------------
# Output


def render_plan(plan: FleetPlan, desired: DesiredState) -> str:
    """The plan as text for a person."""
    services = {s.id: s for s in desired.fleet.services}
    lines = [
        f"plan at {plan.created.strftime('%Y-%m-%dT%H:%M:%SZ')}, epoch {plan.epoch}, leader {plan.leader}, "
        f"strategy {desired.fleet.scheduler.strategy}"
    ]
    lines.append(f"placements ({len(plan.placements)}):")
    width = max([len(f"{p.service}[{p.replica}]") for p in plan.placements] + [0])
    node_width = max([len(p.node) for p in plan.placements] + [0])
    tier_width = max([len(p.tier) for p in plan.placements] + [0])
    for p in plan.placements:
        note = ""
        if p.fallback and p.service in services:
            note = f"  fallback from {services[p.service].min_tier}"
        lines.append(f"  {f'{p.service}[{p.replica}]':<{width}}  {p.node:<{node_width}}  {p.tier:<{tier_width}}{note}".rstrip())
    if not plan.placements:
        lines.append("  none")
    lines.append(f"deferred ({len(plan.deferred)}):")
    for d in plan.deferred:
        lines.append(f"  {d.service}[{d.replica}]: {d.reason}")
    if not plan.deferred:
        lines.append("  none")
    lines.append("lanes (dispatch order):")
    for lane in plan.lanes:
        state = "online" if lane.available else "offline"
        lines.append(f"  {lane.kind:<7}  {lane.id:<{max(len(x.id) for x in plan.lanes)}}  rank {lane.rank:<3}  {lane.in_flight}/{lane.cap}  {state}")
    if plan.ignored_nodes:
        lines.append(f"ignored nodes (not declared hosts): {', '.join(plan.ignored_nodes)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    inputs = load_inputs(args)
    if isinstance(inputs, int):
        return inputs
    desired, snapshot = inputs
    plan = schedule(snapshot, desired)
    print(plan.model_dump_json(indent=2) if args.json else render_plan(plan, desired))
    return EXIT_OK
