"""Registry options shared by `fabric nodes`, `leader`, `drain`, `undrain` and `registry`.

The registry comes from fabric.toml's [registry] in `--desired DIR`;
`--registry-path FILE` (or $FABRIC_REGISTRY) forces a sqlite file instead, for
tests and the demo.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime
from pathlib import Path

from reconciler.cli.common import add_desired, load_or_report
from reconciler.cli.wiring import open_registry
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.records import utc
from reconciler.ports import Registry, RegistryError


def add_registry_options(parser: argparse.ArgumentParser) -> None:
    add_desired(parser)
    add_registry_path(parser)


def add_registry_path(parser: argparse.ArgumentParser | argparse._ActionsContainer, *, otherwise: str = "[registry]") -> None:
    """--registry-path FILE: a sqlite registry file whatever [registry] says."""
    env = os.environ.get("FABRIC_REGISTRY")
    parser.add_argument(
        "--registry-path",
        metavar="FILE",
        type=Path,
        default=Path(env) if env else None,
        help=f"use this sqlite registry file whatever [registry] says (default: $FABRIC_REGISTRY, else {otherwise})",
    )


def open_from_args(args: argparse.Namespace) -> tuple[DesiredState, Registry] | None:
    """The desired state and its registry, or None after saying why on stderr
    (`report_failure` tells which exit status)."""
    state = load_or_report(args.desired)
    if state is None:
        args._failure = "invalid"
        return None
    try:
        return state, open_registry(state.fleet, sqlite_path=args.registry_path)
    except RegistryError as exc:
        print(f"fabric {args.command}: registry: {exc}", file=sys.stderr)
        args._failure = "registry"
        return None


def failure_status(args: argparse.Namespace) -> int:
    from reconciler.cli import EXIT_FAILED, EXIT_INVALID

    return EXIT_INVALID if getattr(args, "_failure", None) == "invalid" else EXIT_FAILED


def registry_failed(args: argparse.Namespace, exc: RegistryError) -> int:
    from reconciler.cli import EXIT_FAILED

    print(f"fabric {args.command}: registry: {exc}", file=sys.stderr)
    return EXIT_FAILED


def stamp(moment: datetime | None, now: datetime | None = None) -> str:
    """`2026-11-29T18:26:48Z (12 s ago)`, or '-'."""
    if moment is None:
        return "-"
    text = utc(moment).strftime("%Y-%m-%dT%H:%M:%SZ")
    if now is not None:
        delta = (utc(now) - utc(moment)).total_seconds()
        text += f" ({abs(delta):.0f} s {'ago' if delta >= 0 else 'from now'})"
    return text
