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

An unchanged pass stops early on the pass memo (it heart-beats, checks the
registry's epoch and audits, importing no model). The pass, memo included, is
`reconciler.engine.memoized_pass.run_memoized_pass`; this module parses the
options (shared with `fabric plan`, reconciler.cli.pass_options), takes the
real ports from reconciler.wiring and prints the outcome.
"""

from __future__ import annotations

import argparse
import functools
import gc

from reconciler.cli.pass_options import add_pass_options, finish, pass_options


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reconcile", help="one pass: render, plan, write a generation, validate, activate")
    add_pass_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # A pass is a short process: what it builds (the modules it imports, the
    # models, the rendered files) is freed by reference counts or by its
    # exit, and the cyclic collector only costs it CPU: a full pass of an
    # e2e host under the system python3 took 0.36-0.38 CPU-s without it,
    # 0.38-0.43 with it (the same 81 MiB at most), while every host a new
    # plan concerns passes at the same moment. Back on for an in-process
    # caller (tests) once the pass is over.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _run(args)
    finally:
        if collecting:
            gc.enable()


def _run(args: argparse.Namespace) -> int:
    from reconciler import wiring
    from reconciler.engine.memoized_pass import run_memoized_pass

    options = pass_options(args)
    # One registry client and one lane queue for the whole process: the
    # memo's side and the full pass that may follow it share them.
    with wiring.pass_connections() as connections:
        with wiring.memo_ports(options, connections) as memo_ports:
            report = run_memoized_pass(options, memo_ports, functools.partial(wiring.real_pass_ports, connections=connections))
    return finish(report)
