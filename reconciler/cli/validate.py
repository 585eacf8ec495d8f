"""fabric validate: check the desired state, report every problem at once."""

from __future__ import annotations

import argparse
from pathlib import Path

from reconciler.cli import EXIT_OK, InvalidInput
from reconciler.cli.common import add_desired, load_node_config, load_or_fail
from reconciler.core.desired.confinement import DEFAULT_ALLOWED_PREFIXES, confinement_problems
from reconciler.core.desired.load import summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check the desired state (exit 2 on any problem)")
    add_desired(p)
    p.add_argument(
        "--config",
        metavar="FILE",
        type=Path,
        help="check the paths handed to units against this node.toml's [node] allowed_path_prefixes "
        f"(default: the built-in prefixes {', '.join(DEFAULT_ALLOWED_PREFIXES)})",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    desired = load_or_fail(args.desired)
    prefixes = list(DEFAULT_ALLOWED_PREFIXES) if args.config is None else load_node_config(args.config, must_exist=True).node.allowed_path_prefixes
    problems = confinement_problems(desired, prefixes)
    if problems:
        raise InvalidInput(*(str(problem) for problem in problems))
    print(summary(desired))
    return EXIT_OK
