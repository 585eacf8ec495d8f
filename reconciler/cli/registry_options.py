"""Registry options shared by the commands that read or write the registry
(`nodes`, `leader`, `drain`, `undrain`, `registry`, `lane`, `schedule`, `dispatch`).

The registry comes from fabric.toml's [registry] in `--desired DIR`;
`--registry-path FILE` (or $FABRIC_REGISTRY) forces a sqlite file instead, for
tests and the demo. `--snapshot FILE` (`schedule`, `dispatch`) replaces the
live registry by a saved snapshot. `--cert-file FILE --key-file FILE` act with
another etcd identity than [registry]'s (this host's own): an operator's
`fabric-admin` certificate for `fabric drain`, root's for `fabric registry
init-auth`; the CA stays [registry] ca_file.

A registry that cannot be opened or answer ends the command with exit 1
(`fabric COMMAND: registry: REASON`); a bad desired state or snapshot file with
exit 2 (`FILE: key.path: reason`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, ValidationError

from reconciler.cli import CommandError, InvalidInput
from reconciler.cli.common import add_desired, add_registry_path, load_or_fail
from reconciler.core.desired.model import DesiredState, FleetConfig
from reconciler.core.desired.problems import key_path, problem_from_json_error
from reconciler.core.live.models import Placement, Snapshot, SnapshotLane, SnapshotNode
from reconciler.engine.lane_states import with_lane_states
from reconciler.ports import LaneBroker, LaneBrokerError, Registry, RegistryError
from reconciler.wiring import lane_broker_if_configured, open_existing_registry, open_lane_broker, open_registry


def add_registry_options(parser: argparse.ArgumentParser) -> None:
    add_desired(parser)
    add_registry_path(parser)
    add_identity_options(parser)


def add_identity_options(parser: argparse.ArgumentParser, *, default: str = "[registry] cert_file/key_file: this host's own") -> None:
    """--cert-file/--key-file: the etcd client identity (its CN is the etcd user)."""
    parser.add_argument("--cert-file", metavar="FILE", type=Path, help=f"etcd client certificate to act with (default: {default})")
    parser.add_argument("--key-file", metavar="FILE", type=Path, help="its private key (given with --cert-file)")


def with_identity(args: argparse.Namespace, fleet: FleetConfig) -> FleetConfig:
    """`fleet` with --cert-file/--key-file in place of [registry]'s; exit 2 when only one is given."""
    cert, key = getattr(args, "cert_file", None), getattr(args, "key_file", None)
    if cert is None and key is None:
        return fleet
    if cert is None or key is None:
        raise InvalidInput(f"fabric {args.command}: --cert-file and --key-file go together")
    if fleet.registry.backend != "etcd":
        return fleet  # the sqlite registry has no identities: file permissions guard it
    registry = fleet.registry.model_copy(update={"cert_file": str(cert.absolute()), "key_file": str(key.absolute())})
    return fleet.model_copy(update={"registry": registry})


@contextmanager
def opened_registry(
    args: argparse.Namespace,
    desired: DesiredState,
    *,
    existing: bool = False,
    who: str = "",
    hint: str = "",
) -> Iterator[Registry]:
    """The registry of `desired` (or --registry-path), closed afterwards;
    `existing`: a sqlite registry that is not there is an error, not created.
    A RegistryError, opening it or inside, ends the command with exit 1:
    `WHO: registry: REASON HINT`, WHO `fabric COMMAND` unless given."""
    fleet = with_identity(args, desired.fleet)
    try:
        if existing:
            registry = open_existing_registry(fleet, sqlite_path=args.registry_path)
        else:
            registry = open_registry(fleet, sqlite_path=args.registry_path)
        try:
            yield registry
        finally:
            registry.close()
    except RegistryError as exc:
        raise CommandError(f"{who or f'fabric {args.command}'}: registry: {exc}{hint}") from None


@contextmanager
def desired_and_registry(args: argparse.Namespace) -> Iterator[tuple[DesiredState, Registry]]:
    """--desired's state (exit 2 when invalid) and its registry (exit 1 when unreachable)."""
    desired = load_or_fail(args.desired)
    with opened_registry(args, desired) as registry:
        yield desired, registry


def add_queue_url_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--queue-url-file",
        metavar="FILE",
        type=Path,
        help="the file holding phaze's broker URL (default: fabric.toml [phaze] dispatcher_url_file for enqueue and dispatch, else queue_url_file)",
    )


@contextmanager
def opened_lane_broker(args: argparse.Namespace, desired: DesiredState, *, dispatcher: bool = False) -> Iterator[LaneBroker]:
    """phaze's broker as the lane queue (`dispatcher`: with [phaze]
    dispatcher_url_file's DSN), closed afterwards; a LaneBrokerError, opening
    it or inside, ends the command with exit 1: `fabric COMMAND: lane queue: REASON`."""
    try:
        lane_broker = open_lane_broker(desired.fleet, dsn_file=getattr(args, "queue_url_file", None), dispatcher=dispatcher)
        try:
            yield lane_broker
        finally:
            lane_broker.close()
    except LaneBrokerError as exc:
        raise CommandError(f"fabric {args.command}: lane queue: {exc}") from None


# --------------------------------------------------------------------------
# A saved snapshot instead of the live registry (`fabric schedule`, `fabric dispatch`)


def add_snapshot_options(parser: argparse.ArgumentParser) -> None:
    """--desired, --registry-path and --snapshot."""
    add_registry_options(parser)
    parser.add_argument(
        "--snapshot",
        metavar="FILE",
        type=Path,
        help="a saved snapshot (JSON, as `fabric registry export` writes) instead of the live registry",
    )


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


def read_snapshot(path: Path, warn: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> Snapshot:
    """The snapshot in `path`; raises InvalidInput naming file, key path and reason."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidInput(f"{path}: (file): not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{path}: (file): cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(str(problem_from_json_error(str(path), exc))) from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}: (top level): a snapshot is a JSON object, not {type(data).__name__}")
    try:
        snapshot = Snapshot.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            reason = err["msg"].removeprefix("Value error, ")
            if err["type"] != "missing" and "input" in err:
                reason += f" (got {json.dumps(err['input'])[:80]})"
            problems.append(f"{path}: {key_path(err['loc'])}: {reason}")
        raise InvalidInput(*problems) from None
    for key in unknown_keys(data):
        warn(f"{path}: {key}: unknown key, ignored")
    return snapshot


def desired_and_snapshot(args: argparse.Namespace) -> tuple[DesiredState, Snapshot]:
    """--desired's state and the snapshot to work on: --snapshot's, else the live
    registry's (the same one `fabric registry export` prints)."""
    desired = load_or_fail(args.desired)
    if args.snapshot is not None:
        return desired, read_snapshot(args.snapshot)
    with opened_registry(args, desired, hint=" (give --snapshot FILE for a what-if)") as registry:
        return desired, live_snapshot(args, desired, registry)


def live_snapshot(args: argparse.Namespace, desired: DesiredState, registry: Registry) -> Snapshot:
    """The registry's snapshot now with the lanes' jobs and workers from
    phaze's broker when [phaze] queue_url_file names it (a note on stderr
    when it cannot be read: the lanes then carry no load)."""
    snapshot = registry.snapshot(lanes=[lane.id for lane in desired.lanes])
    lane_broker = lane_broker_if_configured(desired.fleet, note=lambda line: print(f"note: {line}", file=sys.stderr))
    if lane_broker is None:
        return snapshot
    try:
        return with_lane_states(snapshot, lane_broker, desired)
    except LaneBrokerError as exc:
        raise CommandError(f"fabric {args.command}: lane queue: {exc}") from None
    finally:
        lane_broker.close()
