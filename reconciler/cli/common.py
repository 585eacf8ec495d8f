"""Options and helpers shared by several subcommands.

Adding an option imports nothing heavy: `fabric reconcile` parses its
arguments and may end in a memoized pass without ever loading a model."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from reconciler.cli import InvalidInput

if TYPE_CHECKING:
    from reconciler.core.desired.model import DesiredState
    from reconciler.core.install.nodeconfig import NodeConfig

DEFAULT_DESIRED = "/var/lib/fabric/desired"
# reconciler.core.install.nodeconfig.NODE_CONFIG_PATH (a test checks they agree), here for --config's help.
NODE_CONFIG_PATH = "/etc/fabric/node.toml"


def add_desired(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--desired",
        metavar="DIR",
        type=Path,
        default=Path(os.environ.get("FABRIC_DESIRED", DEFAULT_DESIRED)),
        help=f"desired-state directory holding fabric.toml and the host files (default: $FABRIC_DESIRED or {DEFAULT_DESIRED})",
    )


def load_or_fail(directory: Path) -> DesiredState:
    """The desired state; every problem (`FILE: key.path: reason`) ends the command with exit 2."""
    from reconciler.core.desired.load import DesiredStateError, load_desired

    try:
        return load_desired(directory)
    except DesiredStateError as exc:
        raise InvalidInput(*(str(problem) for problem in exc.problems)) from None


def add_node_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        type=Path,
        default=Path(NODE_CONFIG_PATH),
        help=f"the node's configuration (default: {NODE_CONFIG_PATH}; absent means all defaults)",
    )


def load_node_config(path: Path, *, must_exist: bool = False) -> NodeConfig:
    """node.toml, all defaults when absent; its problems end the command with exit 2."""
    from reconciler.core.install.nodeconfig import NodeConfig, NodeConfigError, parse_node_config
    from reconciler.wiring import read_text_or_none

    text = read_text_or_none(path)
    if text is None:
        if must_exist:
            raise InvalidInput(f"{path}: (file): not found")
        return NodeConfig()
    try:
        return parse_node_config(text, str(path))
    except NodeConfigError as exc:
        raise InvalidInput(*(str(problem) for problem in exc.problems)) from None


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
