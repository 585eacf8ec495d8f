"""fabric units: print or install the fabric's own units (reconcile service and
timer, the watcher, the first-boot bootstrap, the leader service), derived
from node.toml.

This is how `scripts/join.sh` installs them (`fabric units --write
/etc/systemd/system`), so a plain systemd host gets exactly what the NixOS
module declares (tests/unit/test_nix_module.py compares the two).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reconciler.cli import EXIT_OK, InvalidInput
from reconciler.cli.common import add_node_config, load_node_config
from reconciler.core.install.units import Install, UnitsError, host_units, units_json
from reconciler.wiring import write_atomic


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "units", help="print or install fabric-reconcile.service/.timer, fabric-watch.service, fabric-bootstrap.service (and fabric-leader.service)"
    )
    add_node_config(p)
    p.add_argument(
        "--fabric-bin",
        metavar="PATH",
        default=_this_program(),
        help="absolute path of the fabric program the units run (default: this one, when run as `fabric`)",
    )
    p.add_argument("--search-path", metavar="PATH", help="PATH the units run with (Environment=PATH=...)")
    p.add_argument("--leader-candidate", action="store_true", help="also fabric-leader.service")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="the units as JSON (section -> key -> value)")
    out.add_argument("--write", metavar="DIR", type=Path, help="write the unit files into DIR (atomically)")
    p.set_defaults(func=run)


def _this_program() -> str | None:
    """The running `fabric` program's absolute path (None under `python -m reconciler`)."""
    program = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if program is None or program.name != "fabric":
        return None
    return str(program.absolute())


def run(args: argparse.Namespace) -> int:
    if args.fabric_bin is None:
        raise InvalidInput("--fabric-bin PATH is required when not run as the `fabric` program")
    if not args.fabric_bin.startswith("/"):
        raise InvalidInput(f"--fabric-bin: {args.fabric_bin!r} must be an absolute path")
    node = load_node_config(args.config)
    install = Install(fabric_bin=args.fabric_bin, node=node, config_path=str(args.config), search_path=args.search_path)
    try:
        units = host_units(install, leader_candidate=args.leader_candidate)
    except UnitsError as exc:
        raise InvalidInput(f"{args.config}: {exc}") from None
    if args.json:
        print(units_json(units))
    elif args.write is not None:
        for unit in units:
            changed = write_atomic(args.write / unit.name, unit.text())
            print(f"{'wrote' if changed else 'unchanged'} {args.write / unit.name}")
    else:
        for unit in units:
            print(f"# {unit.name}")
            print(unit.text())
    return EXIT_OK
