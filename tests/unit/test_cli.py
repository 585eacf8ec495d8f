"""The command table: lazy loading must not lose or misroute a subcommand."""

from __future__ import annotations

import argparse
import ast
import importlib
import subprocess
import sys

from reconciler.cli import COMMANDS, build_parser


def registered_by(module: str) -> set[str]:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    importlib.import_module(f"reconciler.cli.{module}").register(sub)
    return set(sub.choices)


def test_every_module_registers_exactly_the_commands_the_table_routes_to_it() -> None:
    for module in set(COMMANDS.values()):
        assert registered_by(module) == {c for c, m in COMMANDS.items() if m == module}, module


def test_each_command_parses_with_only_its_own_module() -> None:
    for command in COMMANDS:
        parser = build_parser(command)
        assert command in parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]


def test_a_pass_imports_no_other_command() -> None:
    code = (
        "import sys; from reconciler.cli import build_parser; build_parser('validate'); "
        "print(sorted(m for m in sys.modules if m.startswith('reconciler.cli.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "reconciler.cli.status" not in out and "reconciler.cli.validate" in out


def test_reconcile_plan_and_rollback_import_no_other_command_module() -> None:
    """They share options (cli.pass_options) and wiring, and the pass itself is the engine's."""
    command_modules = {f"reconciler.cli.{m}" for m in COMMANDS.values()}
    for command in ("reconcile", "plan", "rollback"):
        code = f"import sys, reconciler.cli.{command}; print(sorted(m for m in sys.modules if m.startswith('reconciler.cli.')))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert set(ast.literal_eval(out)) & command_modules == {f"reconciler.cli.{command}"}, command
