"""`fabric` command line: argument parsing, and the one place real adapters are wired in.

Each subcommand lives in its own module under `reconciler.cli` and exposes
`register(subparsers)`, which adds its parser and sets `func` to a function
taking the parsed arguments and returning the exit status.

Exit status: 0 success; 1 the action failed (a rolled-back pass, an unreachable
peer); 2 bad input (invalid desired state, bad arguments) and nothing changed.
"""

from __future__ import annotations

import argparse
import importlib
import sys

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID = 2

# Subcommand modules, in the order `fabric --help` lists them.
COMMAND_MODULES = [
    "validate",
    "probe",
    "units",
    "pull",
    "bootstrap",
    "status",
    "reconcile",
    "plan",
    "generations",
    "rollback",
    "nodes",
    "leader",
    "drain",
    "registry",
    "schedule",
    "dispatch",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fabric",
        description="Reconcile this host with the fleet's desired state.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"reconciler.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `fabric ... | head`: not an error of ours.
        sys.stderr.close()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
