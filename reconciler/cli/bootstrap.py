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

A machine whose host name has no host file is not refused: it reports itself
pending (reconciler.engine.pending; with etcd, as [registry]'s joining
identity), enables the reconcile timer, whose passes keep reporting it, and
says the command that admits it (`fabric admit HOST`); exit 0.

`--first-boot` is how fabric-bootstrap.service runs it, once per machine
(reconciler.core.install.units.bootstrap_service): the same steps, each
logged as it starts and ends, the k3s labels written before the join, the
first pass queued rather than waited for (the unit is ordered before the
pass's), and last the stamp that keeps the unit from running again
(/var/lib/fabric/bootstrap.stamp). A failed step or bad input leaves no
stamp, so the next boot tries again. A pending machine gets the tailnet, its
report, the timer and a stamp that says "pending" (reconciler.core.install.bootstrap.pending_boot_steps);
once `fabric admit` has reached it, its first pass starts this unit again
(reconciler.engine.bootstrap_start), which then runs a declared host's steps
(the k3s join with its labels) and writes the "complete" stamp.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from reconciler.cli import EXIT_OK, CommandError, InvalidInput
from reconciler.cli.common import add_node_config, load_node_config, load_or_fail
from reconciler.cli.registry_options import add_registry_path, opened_registry
from reconciler.core.desired.model import DesiredState, HostFacts, is_name
from reconciler.core.install.bootstrap import (
    BOOTSTRAP_SERVICE,
    RECONCILE_TIMER,
    BootstrapSteps,
    Step,
    bootstrap_files,
    k3s_node_name,
    pending_boot_steps,
    plan_bootstrap,
    socat_units,
)
from reconciler.core.live.pending import waits_note
from reconciler.engine.pending import report
from reconciler.ports import BootstrapError, CaptureError, RegistryError
from reconciler.wiring import bootstrap_io, bootstrap_programs, host_name, joining_fleet, open_registry, probe_facts


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bootstrap", help="once on a new node: tailnet, register, k3s join, nftables fix, first pass")
    add_node_config(p)
    p.add_argument("--desired", metavar="DIR", type=Path, help="desired-state directory (default: node.toml's node.desired)")
    p.add_argument("--host", metavar="NAME", help="which host of the desired state this is (default: node.toml's, else the hostname)")
    p.add_argument("--root", metavar="DIR", type=Path, default=Path("/"), help="read and write files under DIR (default /)")
    p.add_argument("--dry-run", action="store_true", help="print the steps, change nothing")
    p.add_argument(
        "--first-boot",
        action="store_true",
        help="as fabric-bootstrap.service runs it: queue the first pass, write the stamp that keeps the unit from running again",
    )
    p.add_argument("--replay", metavar="PROBEDIR", help="use a saved probe capture instead of probing")
    add_registry_path(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    node = load_node_config(args.config)
    desired = load_or_fail(args.desired or Path(node.node.desired))
    host = args.host or node.node.host or host_name()
    if host not in desired.hosts:
        return _pending(args, desired, host)
    try:
        facts = probe_facts(host, args.replay)
    except (CaptureError, OSError) as exc:  # an unreadable capture directory: bad input
        raise InvalidInput(f"bootstrap: probe: {exc}") from None

    with opened_registry(args, desired, who="bootstrap") as registry:
        io = bootstrap_io(registry, args.root)
        ports = socat_units(desired, host)
        programs = bootstrap_programs()
        observed = io.observe(host, bootstrap_files(node), ports, k3s_node_name(facts))
        plan = plan_bootstrap(node=node, desired=desired, host=host, facts=facts, observed=observed, programs=programs, first_boot=args.first_boot)
        if plan.nothing_to_do:
            _notes(plan)
            print(f"nothing to do: {host} is ready (tier {facts.tier})")
            return EXIT_OK
        _carry_out(args, plan, io.execute)
        if args.dry_run:
            return EXIT_OK
        if not args.first_boot:
            after = io.observe(host, bootstrap_files(node), ports)
            down = sorted(unit for unit, active in after.socat_active.items() if not active)
            if down:
                raise CommandError(f"bootstrap: port maps still not running after the pass: {', '.join(down)} (journalctl -t fabric-reconcile)")
        print(f"ready: {host} (tier {facts.tier}){'; its first pass is queued' if args.first_boot else ''}")
        return EXIT_OK


def _notes(plan: BootstrapSteps) -> None:
    for note in plan.notes:
        print(f"note: {note}")
    if plan.problems:
        raise InvalidInput(*(f"bootstrap: {problem}" for problem in plan.problems))


def _carry_out(args: argparse.Namespace, plan: BootstrapSteps, execute: Callable[[Step], None]) -> None:
    """Each step in order, logged as it starts (and, at first boot, as it
    ends); the first that fails stops the rest (exit 1)."""
    _notes(plan)
    for step in plan.steps:
        print(f"{'would ' if args.dry_run else ''}{step.describe()}", flush=True)
        if args.dry_run:
            continue
        try:
            execute(step)
        except BootstrapError as exc:
            again = f" (no stamp written: {BOOTSTRAP_SERVICE} runs again at the next boot)" if args.first_boot else ""
            raise CommandError(f"bootstrap: {step.kind} failed: {exc}{again}") from None
        if args.first_boot:
            print(f"done: {step.kind}", flush=True)


def _pending(args: argparse.Namespace, desired: DesiredState, host: str) -> int:
    """A machine without a host file: report it pending, keep its timer reporting, say what to run."""
    if not is_name(host):
        raise InvalidInput(
            f"bootstrap: host {host!r} is not in the desired state and cannot be a fabric host's name (lowercase letters, digits, '-', '_')"
        )
    try:
        facts = probe_facts(host, args.replay)
    except (CaptureError, OSError) as exc:
        raise InvalidInput(f"bootstrap: probe: {exc}") from None
    if args.first_boot:
        return _pending_first_boot(args, desired, host, facts)
    if args.dry_run:
        print(f"would report {host} pending (probed tier {facts.tier}): it has no host file in the desired state")
        print(f"would enable {RECONCILE_TIMER}: its passes keep reporting it pending until it is admitted (`fabric admit {host}`)")
        return EXIT_OK
    try:
        registry = open_registry(joining_fleet(desired.fleet), sqlite_path=args.registry_path)
        try:
            stored = report(registry, desired, host, facts)
            bootstrap_io(registry, args.root).execute(Step("enable_timer", f"{RECONCILE_TIMER} keeps reporting it pending"))
        finally:
            registry.close()
    except ValueError as exc:
        raise InvalidInput(f"bootstrap: host {host!r} is not in the desired state and {exc}") from None
    except RegistryError as exc:
        raise CommandError(f"bootstrap: registry: the pending report of {host}: {exc}") from None
    except BootstrapError as exc:
        raise CommandError(f"bootstrap: {exc}") from None
    print(f"pending: {waits_note(host, stored.facts.tier)}")
    return EXIT_OK


def _pending_first_boot(args: argparse.Namespace, desired: DesiredState, host: str, facts: HostFacts) -> int:
    """fabric-bootstrap.service on a machine without a host file: the steps
    that apply to a pending machine, the stamp last."""
    node = load_node_config(args.config)
    try:
        registry = open_registry(joining_fleet(desired.fleet), sqlite_path=args.registry_path)
    except ValueError as exc:
        raise InvalidInput(f"bootstrap: host {host!r} is not in the desired state and {exc}") from None
    except RegistryError as exc:
        raise CommandError(f"bootstrap: registry: the pending report of {host}: {exc}") from None
    try:
        io = bootstrap_io(registry, args.root)
        plan = pending_boot_steps(node, host, io.observe(host, [], []))

        def execute(step: Step) -> None:
            if step.kind != "report_pending":
                io.execute(step)
                return
            try:
                report(registry, desired, host, facts)
            except ValueError as exc:
                raise InvalidInput(f"bootstrap: host {host!r} is not in the desired state and {exc}") from None
            except RegistryError as exc:
                raise BootstrapError(f"registry: the pending report of {host}: {exc}") from None

        _carry_out(args, plan, execute)
    finally:
        registry.close()
    if not args.dry_run:
        print(f"pending: {waits_note(host, facts.tier)}")
    return EXIT_OK
