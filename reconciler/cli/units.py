"""fabric units: print or install the fabric's own units (reconcile service and
timer, the leader service), derived from node.toml.

This is how `scripts/join.sh` installs them (`fabric units --write
/etc/systemd/system`), so a plain systemd host gets exactly what the NixOS
module declares (tests/unit/test_nix_module.py compares the two).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reconciler.adapters.install_files import read_text_or_none, write_atomic
from reconciler.cli import EXIT_INVALID, EXIT_OK
from reconciler.core.install.nodeconfig import NODE_CONFIG_PATH, NodeConfig, NodeConfigError, parse_node_config
from reconciler.core.install.units import Install, UnitsError, host_units, units_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("units", help="print or install fabric-reconcile.service/.timer (and fabric-leader.service)")
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


def add_node_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        type=Path,
        default=Path(NODE_CONFIG_PATH),
        help=f"the node's configuration (default: {NODE_CONFIG_PATH}; absent means all defaults)",
    )


def load_node_config(path: Path, *, must_exist: bool = False) -> NodeConfig | None:
    """node.toml, all defaults when absent, None after printing its problems."""
    text = read_text_or_none(path)
    if text is None:
        if must_exist:
            print(f"{path}: (file): not found", file=sys.stderr)
            return None
        return NodeConfig()
    try:
        return parse_node_config(text, str(path))
    except NodeConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return None


def run(args: argparse.Namespace) -> int:
    if args.fabric_bin is None:
        print("--fabric-bin PATH is required when not run as the `fabric` program", file=sys.stderr)
        return EXIT_INVALID
    if not args.fabric_bin.startswith("/"):
        print(f"--fabric-bin: {args.fabric_bin!r} must be an absolute path", file=sys.stderr)
        return EXIT_INVALID
    node = load_node_config(args.config)
    if node is None:
        return EXIT_INVALID
    install = Install(fabric_bin=args.fabric_bin, node=node, config_path=str(args.config), search_path=args.search_path)
    try:
        units = host_units(install, leader_candidate=args.leader_candidate)
    except UnitsError as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return EXIT_INVALID
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
