"""fabric reconcile: one pass of this host (what fabric-reconcile.service runs).

    load + validate the desired state  (exit 2 on bad input, nothing written)
    probe this machine (or --replay a capture)
    read the fleet plan                (--plan-file, --no-registry, or the registry)
    render -> plan -> new generation -> validate -> install -> activate
    audit every action (journal, or JSON lines on stderr)

`--root DIR` runs the whole pass against a sandbox root: every file, the state
directory and the lock live under DIR. `--no-activate` stops after installing
the files (and skips the real validation unless --validate), so a pass runs on
a machine without systemd, nft or Caddy.

The pass itself is `reconciler.engine.reconcile.run_pass`; this module parses
the options (shared with `fabric plan`, reconciler.cli.pass_options), takes
the real ports from reconciler.cli.wiring and prints the report.
"""

from __future__ import annotations

import argparse

from reconciler.cli.pass_options import add_pass_options, finish, pass_options
from reconciler.cli.wiring import real_pass_ports
from reconciler.engine.reconcile import run_pass


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reconcile", help="one pass: render, plan, write a generation, validate, activate")
    add_pass_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    options = pass_options(args)
    with real_pass_ports(options) as ports:
        report = run_pass(options, ports)
    return finish(report)
