"""`fabric` command line: argument parsing, and the one place real adapters are wired in.

Each subcommand lives in its own module under `reconciler.cli` and exposes
`register(subparsers)`, which adds its parser and sets `func` to a function
taking the parsed arguments and returning the exit status. Real adapters are
built in one module, `reconciler.wiring`; the work itself is in
`reconciler.engine` and the pure core.

Exit status: 0 success; 1 the action failed (a rolled-back pass, an unreachable
peer); 2 bad input (invalid desired state, bad arguments) and nothing changed.
A command that cannot go on raises `CommandError` (or `InvalidInput`, exit 2);
`main` prints its lines to stderr and exits with its status: that is the one
way a command fails.
"""

from __future__ import annotations

import argparse
import importlib
import sys

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID = 2


class CommandError(Exception):
    """The command stops: `lines` go to stderr, the process exits with `exit_status`."""

    exit_status = EXIT_FAILED

    def __init__(self, *lines: str) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


class InvalidInput(CommandError):
    """Bad input (desired state, arguments, a plan or capture file): exit 2, nothing changed."""

    exit_status = EXIT_INVALID


# Subcommand -> the module that registers it, in the order `fabric --help`
# lists them. Only the module of the command being run is imported: a pass
# from the timer does not pay for importing every other command.
COMMANDS = {
    "validate": "validate",
    "schema": "schema",
    "probe": "probe",
    "units": "units",
    "pull": "pull",
    "bootstrap": "bootstrap",
    "status": "status",
    "reconcile": "reconcile",
    "plan": "plan",
    "generations": "generations",
    "rollback": "rollback",
    "nodes": "nodes",
    "admit": "admit",
    "leader": "leader",
    "drain": "drain",
    "undrain": "drain",
    "registry": "registry",
    "schedule": "schedule",
    "dispatch": "dispatch",
    "lane": "lane",
    "watch": "watch",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser for `command` alone, or (None, for help and usage errors) all of them."""
    parser = argparse.ArgumentParser(
        prog="fabric",
        description="Reconcile this host with the fleet's desired state.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        importlib.import_module(f"reconciler.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except CommandError as exc:
        for line in exc.lines:
            print(line, file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `fabric ... | head`: not an error of ours.
        sys.stderr.close()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
