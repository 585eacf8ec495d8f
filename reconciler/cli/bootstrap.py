"""fabric bootstrap: once on a new node, bring it into the fleet, then exit.

Joins the tailnet (auth key from a file), probes, registers, writes the k3s
join settings, installs the nftables fix where the OS needs it, enables the
reconcile timer and runs a first pass (which starts the socat redirects), and
reports ready. Every step is planned from what the node already has
(reconciler.core.install.bootstrap), so a second run prints "nothing to do".

`--dry-run` prints the steps and changes nothing. `--root DIR` reads and
writes the files under DIR (a sandbox); commands still run unless --dry-run.
Exit 0 ready (or nothing to do); 1 a step failed (rerun to continue); 2 bad
input or a node that cannot be bootstrapped as configured (nothing changed).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
from pathlib import Path

from reconciler.cli import EXIT_FAILED, EXIT_INVALID, EXIT_OK
from reconciler.cli.common import load_or_report
from reconciler.cli.registry_options import add_registry_path
from reconciler.cli.units import add_node_config, load_node_config
from reconciler.core.install.bootstrap import Programs, bootstrap_files, plan_bootstrap, socat_units


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bootstrap", help="once on a new node: tailnet, register, k3s join, nftables fix, first pass")
    add_node_config(p)
    p.add_argument("--desired", metavar="DIR", type=Path, help="desired-state directory (default: node.toml's node.desired)")
    p.add_argument("--host", metavar="NAME", help="which host of the desired state this is (default: node.toml's, else the hostname)")
    p.add_argument("--root", metavar="DIR", type=Path, default=Path("/"), help="read and write files under DIR (default /)")
    p.add_argument("--dry-run", action="store_true", help="print the steps, change nothing")
    p.add_argument("--replay", metavar="PROBEDIR", help="use a saved probe capture instead of probing")
    add_registry_path(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from reconciler.adapters.bootstrap_io import BootstrapError, NodeIO
    from reconciler.adapters.commands import SubprocessRunner
    from reconciler.cli.reconcile import probe_host
    from reconciler.cli.wiring import open_registry
    from reconciler.ports import RegistryError

    node = load_node_config(args.config)
    if node is None:
        return EXIT_INVALID
    state = load_or_report(args.desired or Path(node.node.desired))
    if state is None:
        return EXIT_INVALID
    host = args.host or node.node.host or socket.gethostname().split(".")[0]
    if host not in state.hosts:
        print(f"bootstrap: host {host!r} is not in the desired state (hosts: {', '.join(sorted(state.hosts))})", file=sys.stderr)
        return EXIT_INVALID
    try:
        facts = probe_host(host, args.replay)
    except Exception as exc:  # an unreadable capture directory: bad input
        print(f"bootstrap: probe: {exc}", file=sys.stderr)
        return EXIT_INVALID
    try:
        registry = open_registry(state.fleet, sqlite_path=args.registry_path)
    except RegistryError as exc:
        print(f"bootstrap: registry: {exc}", file=sys.stderr)
        return EXIT_FAILED

    try:
        io = NodeIO(SubprocessRunner(), registry, root=args.root)
        ports = socat_units(state, host)
        programs = Programs(nft=shutil.which("nft") or Programs.nft, systemctl=shutil.which("systemctl") or Programs.systemctl)
        observed = io.observe(host, bootstrap_files(node), ports)
        plan = plan_bootstrap(node=node, state=state, host=host, facts=facts, observed=observed, programs=programs)
        for note in plan.notes:
            print(f"note: {note}")
        if plan.problems:
            for problem in plan.problems:
                print(f"bootstrap: {problem}", file=sys.stderr)
            return EXIT_INVALID
        if plan.nothing_to_do:
            print(f"nothing to do: {host} is ready (tier {facts.tier})")
            return EXIT_OK
        for step in plan.steps:
            print(f"{'would ' if args.dry_run else ''}{step.describe()}")
            if args.dry_run:
                continue
            try:
                io.execute(step)
            except BootstrapError as exc:
                print(f"bootstrap: {exc}", file=sys.stderr)
                return EXIT_FAILED
        if args.dry_run:
            return EXIT_OK
        after = io.observe(host, bootstrap_files(node), ports)
        down = sorted(unit for unit, active in after.socat_active.items() if not active)
        if down:
            print(f"bootstrap: port maps still not running after the pass: {', '.join(down)} (journalctl -t fabric-reconcile)", file=sys.stderr)
            return EXIT_FAILED
        print(f"ready: {host} (tier {facts.tier})")
        return EXIT_OK
    finally:
        registry.close()
