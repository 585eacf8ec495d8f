"""fabric reconcile: one pass of this host (what fabric-reconcile.service runs).

    load + validate the desired state  (exit 2 on bad input, nothing written)
    probe this machine (or --replay a capture)
    read the fleet plan                (fleet_plan_for: the one seam to the registry)
    render -> plan -> new generation -> validate -> install -> activate
    audit every action (journal, or JSON lines on stderr)

`--root DIR` runs the whole pass against a sandbox root: every file, the state
directory and the lock live under DIR. `--no-activate` stops after installing
the files (and skips the real validation unless --validate), so a pass runs on
a machine without systemd, nft or Caddy.

`fabric plan` (reconciler.cli.plan) shares the options and the preparation
below and writes nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from reconciler.cli import EXIT_FAILED, EXIT_INVALID, EXIT_OK
from reconciler.cli.common import add_desired, load_or_report
from reconciler.core.desired.model import DesiredState, NodeFacts
from reconciler.core.live.models import FleetPlan
from reconciler.core.probe.damping import ProbeHistory
from reconciler.core.render.artifacts import Layout, Rendered, RenderError, render
from reconciler.engine.apply import CADDY_MAIN, STATE_DIR, Activators, Applier, GenerationStore, PassResult, Validators, stale_plan
from reconciler.engine.pass_records import PassOutcome, damped_facts, save_probe_history, write_pass_records
from reconciler.engine.plan_source import (
    PlanSource,
    add_plan_source_options,
    effective_facts,
    from_registry,
    plan_alone,
    plan_from_file,
    print_notes,
    registry_path,
)
from reconciler.ports import ActivationError, Audit, Clock, LockBusy

KILL_AT_STEP_ENV = "FABRIC_KILL_AT_STEP"


def add_pass_options(p: argparse.ArgumentParser) -> None:
    add_desired(p)
    p.add_argument("--host", metavar="NAME", help="which host of the desired state this machine is (default: its host name)")
    p.add_argument(
        "--root",
        metavar="DIR",
        type=Path,
        default=Path("/"),
        help="root the files and the state directory go under (default /); for a sandbox, add --no-activate "
        "unless the systemd you activate through reads its units from DIR",
    )
    p.add_argument("--replay", metavar="PROBEDIR", help="use a saved probe capture (fabric probe --capture) instead of probing")
    add_plan_source_options(p)
    p.add_argument(
        "--unit-dir",
        metavar="DIR",
        default=Layout().unit_dir,
        help=f"where units go, always under the root, given with or without a leading '/' "
        f"(default: {Layout().unit_dir}; a NixOS host: /run/systemd/system)",
    )
    p.add_argument("--state-dir", metavar="DIR", default=STATE_DIR, help=f"generations and lock, relative to the root (default: {STATE_DIR})")
    p.add_argument("--no-activate", action="store_true", help="write the files but activate nothing (and skip the real checks)")
    p.add_argument("--validate", action="store_true", help="with --no-activate: still run systemd-analyze, nft -c and caddy validate")
    p.add_argument(
        "--systemd-bus",
        metavar="ADDRESS",
        default=os.environ.get("FABRIC_SYSTEMD_BUS"),
        help="D-Bus address of the systemd to activate through (default: $FABRIC_SYSTEMD_BUS or the system bus)",
    )
    p.add_argument("--caddy-admin", metavar="HOST:PORT", default="localhost:2019", help="Caddy's admin API (edge hosts)")
    p.add_argument(
        "--caddy-main",
        metavar="FILE",
        help="the edge's main Caddyfile, which imports the fabric's snippet, relative to the root "
        f"(default: the first that exists of {', '.join(CADDY_MAIN_CANDIDATES)})",
    )
    p.add_argument(
        "--startup-grace",
        metavar="SECONDS",
        type=float,
        default=1.0,
        help="watch each started or restarted unit this long; one that fails meanwhile fails the pass (default 1)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reconcile", help="one pass: render, plan, write a generation, validate, activate")
    add_pass_options(p)
    p.set_defaults(func=run)


# --------------------------------------------------------------------------
# Seams: the probe and the fleet plan


def probe_host(host: str, replay: str | None) -> NodeFacts:
    """This machine's facts, probed live or re-parsed from a capture.
    Raises CaptureError for an unreadable capture directory."""
    from reconciler.adapters.commands import SubprocessRunner
    from reconciler.adapters.probe_io import CaptureDirectory, LocalFiles
    from reconciler.core.probe import RawCapture, facts_from_capture
    from reconciler.engine.probe import collect_live

    if replay:
        outputs, errors = CaptureDirectory().load(replay)
        capture = RawCapture(outputs, errors)
    else:
        capture = collect_live(SubprocessRunner(), LocalFiles())
    return facts_from_capture(capture, host=host)


# --------------------------------------------------------------------------
# Preparing a pass (shared with `fabric plan`)


@dataclass
class PassInputs:
    state: DesiredState
    host: str
    facts: NodeFacts
    source: PlanSource
    rendered: Rendered
    layout: Layout
    probe_history: ProbeHistory

    @property
    def fleet_plan(self) -> FleetPlan:
        return self.source.plan


def layout_for(args: argparse.Namespace) -> Layout:
    """Where files go, and the programs units run, found on PATH: on NixOS
    they live in the store (the module puts them on the pass's PATH), on
    Debian in /usr/bin. A missing one keeps the conventional path, so the
    unit names what would have to be installed."""
    default = Layout()
    return Layout(
        unit_dir=args.unit_dir.strip("/"),
        socat=shutil.which("socat") or default.socat,
        podman=shutil.which("podman") or default.podman,
        nft=shutil.which("nft") or default.nft,
    )


# The operator's main Caddyfile: Debian's package, then NixOS's services.caddy.
CADDY_MAIN_CANDIDATES = (CADDY_MAIN, "etc/caddy/caddy_config")


def caddy_main_for(args: argparse.Namespace) -> str:
    if args.caddy_main:
        return args.caddy_main.strip("/")
    root = Path(args.root)
    return next((c for c in CADDY_MAIN_CANDIDATES if (root / c).is_file()), CADDY_MAIN)


def _this_host_name() -> str:
    return socket.gethostname().split(".")[0].lower()


def plan_source_for(args: argparse.Namespace, state: DesiredState, host: str, facts: NodeFacts, *, write: bool) -> PlanSource:
    """The fleet plan: --plan-file, --no-registry, or the registry (see plan_source).
    Raises ValueError for an unreadable or invalid plan file."""
    from reconciler.adapters.files import LocalTree

    now = datetime.now(UTC)
    if args.plan_file is not None:
        return PlanSource(plan_from_file(args.plan_file))
    if args.no_registry:
        return PlanSource(plan_alone(state, host, facts, now))
    from reconciler.cli.wiring import open_registry

    store = GenerationStore(LocalTree(args.root), args.state_dir)
    current = store.current()
    manifest = store.manifest(current)
    return from_registry(
        lambda: open_registry(state.fleet, sqlite_path=registry_path(args, state)),
        state,
        host,
        facts,
        applied_epoch=manifest.epoch if manifest is not None else None,
        has_generation=current is not None,
        now=now,
        write=write,
    )


def prepare(
    args: argparse.Namespace,
    *,
    probe: Callable[[str, str | None], NodeFacts] = probe_host,
    write: bool = True,
) -> PassInputs | int:
    """Load, probe, read the plan and render; an exit status on bad input.

    `write=False` (fabric plan) reads the registry's plan but sends no
    heartbeat and takes no leader step."""
    state = load_or_report(args.desired)
    if state is None:
        return EXIT_INVALID
    host = args.host or _this_host_name()
    if host not in state.hosts:
        print(
            f"{state.fleet_file}: host {host!r} is not declared (hosts: {', '.join(sorted(state.hosts))}); use --host NAME",
            file=sys.stderr,
        )
        return EXIT_INVALID
    try:
        observed = probe(host, args.replay)
    except Exception as exc:  # CaptureError and friends: a bad --replay directory
        print(f"fabric: probe: {exc}", file=sys.stderr)
        return EXIT_INVALID
    from reconciler.adapters.files import LocalTree

    damped, probe_history = damped_facts(LocalTree(args.root), args.state_dir.strip("/"), state, observed, datetime.now(UTC))
    facts = effective_facts(state, host, damped)
    try:
        source = plan_source_for(args, state, host, facts, write=write)
    except ValueError as exc:
        print(f"fabric: plan: {exc}", file=sys.stderr)
        return EXIT_INVALID
    print_notes(source)
    layout = layout_for(args)
    try:
        rendered = render(state, host, facts, source.plan, layout=layout)
    except RenderError as exc:
        print(f"fabric: {exc}", file=sys.stderr)
        return EXIT_INVALID
    for note in rendered.notes:
        print(f"note: {note}", file=sys.stderr)
    return PassInputs(state, host, facts, source, rendered, layout, probe_history)


# --------------------------------------------------------------------------
# Wiring


@dataclass
class Wiring:
    """The ports a pass uses. `real_wiring` builds the real ones; tests build fakes."""

    audit: Audit
    clock: Clock
    validators: Validators | None
    activators: Activators | None
    # Releases what the real ports hold (the D-Bus connection); call it once
    # the pass is over, or its event loop dies with a task pending.
    close: Callable[[], None] = lambda: None


def kill_checkpoint_from_env() -> Callable[[str], None]:
    """FABRIC_KILL_AT_STEP=K: SIGKILL this process at the K-th step of the pass.

    For the crash-consistency tests, which kill a real pass at every step in
    turn and check that the next pass converges."""
    raw = os.environ.get(KILL_AT_STEP_ENV, "")
    if not raw.isdigit():
        return lambda step: None
    target = int(raw)
    count = 0

    def checkpoint(step: str) -> None:
        nonlocal count
        count += 1
        if count == target:
            os.kill(os.getpid(), signal.SIGKILL)

    return checkpoint


def real_wiring(args: argparse.Namespace) -> Wiring:
    from reconciler.adapters.clock import SystemClock
    from reconciler.adapters.commands import SubprocessRunner
    from reconciler.adapters.journal import JournalAudit

    runner = SubprocessRunner()
    validators = None
    activators = None
    if not args.no_activate or args.validate:
        from reconciler.adapters.caddy import CaddyAdmin
        from reconciler.adapters.nftables import NftCommand
        from reconciler.adapters.unit_verify import SystemdAnalyzeVerifier

        caddy = CaddyAdmin(runner, admin_address=args.caddy_admin)
        nft = NftCommand(runner)
        validators = Validators(SystemdAnalyzeVerifier(runner), nft, caddy)
        if not args.no_activate:
            from reconciler.adapters.systemd_dbus import SystemdDbus

            # A Type=exec service counts as started once exec'd: the grace
            # catches one that exits at once (a port already taken, say).
            systemd = SystemdDbus(args.systemd_bus, startup_grace=args.startup_grace)
            activators = Activators(systemd, nft, caddy)
            return Wiring(JournalAudit(), SystemClock(), validators, activators, close=systemd.close)
    return Wiring(JournalAudit(), SystemClock(), validators, activators)


def applier_for(args: argparse.Namespace, wiring: Wiring, checkpoint: Callable[[str], None] | None = None) -> Applier:
    from reconciler.adapters.files import FlockLock, LocalTree

    state_dir = args.state_dir.strip("/")
    return Applier(
        LocalTree(args.root),
        FlockLock(Path(args.root) / state_dir / "lock"),
        wiring.audit,
        wiring.clock,
        validators=wiring.validators,
        activators=wiring.activators,
        state_dir=state_dir,
        caddy_main=caddy_main_for(args),
        checkpoint=checkpoint or kill_checkpoint_from_env(),
    )


# --------------------------------------------------------------------------
# The pass


def report(result: PassResult) -> int:
    if result.outcome in ("applied", "written"):
        sys.stdout.write(result.plan.text(files_done=True, activation_done=result.outcome == "applied"))
    elif result.outcome in ("rolled-back", "failed"):
        sys.stdout.write(result.plan.text(files_done=True))
    for message in result.messages:
        print(message, file=sys.stderr)
    if result.outcome == "noop":
        print(f"nothing to do (generation {result.generation})" if result.generation else "nothing to do")
    elif result.outcome == "applied":
        print(f"generation {result.generation} is active")
    elif result.outcome == "written":
        print(f"generation {result.generation} written, not activated (--no-activate)")
    elif result.outcome == "invalid":
        print("pass stopped before installing anything", file=sys.stderr)
    elif result.outcome == "rolled-back":
        print(f"pass failed; generation {result.generation} is active again", file=sys.stderr)
    return EXIT_OK if result.ok else EXIT_FAILED


def execute(args: argparse.Namespace, wiring: Wiring | None = None, probe: Callable[[str, str | None], NodeFacts] = probe_host) -> int:
    started = time.monotonic()
    inputs = prepare(args, probe=probe)
    if isinstance(inputs, int):
        return inputs
    if wiring is None:
        wiring = real_wiring(args)
        try:
            return _execute(args, inputs, wiring, started)
        finally:
            wiring.close()
    return _execute(args, inputs, wiring, started)


def _execute(args: argparse.Namespace, inputs: PassInputs, wiring: Wiring, started: float) -> int:
    applier = applier_for(args, wiring)
    save_probe_history(applier.store.tree, applier.store.state_dir, inputs.probe_history)

    def records(succeeded: bool, rolled_back: bool, generation: int | None) -> None:
        outcome = PassOutcome(succeeded, rolled_back, generation, time.monotonic() - started)
        write_pass_records(applier.store.tree, applier.store.state_dir, inputs.state, inputs.host, inputs.source, outcome, datetime.now(UTC))

    static = inputs.source.static or stale_plan(applier.store, inputs.fleet_plan.epoch)
    if static is not None:
        # Fail static: keep what runs, say why.
        current = applier.store.current()
        wiring.audit.record("static", "ok", generation=str(current or ""), reason=static)
        print(f"{static}; generation {current} stays" if current else static)
        records(True, False, current)
        return EXIT_OK
    try:
        result = applier.run(inputs.rendered.artifacts, host=inputs.host, epoch=inputs.fleet_plan.epoch)
    except LockBusy as exc:
        print(f"fabric reconcile: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ActivationError as exc:
        print(f"fabric reconcile: {exc}", file=sys.stderr)
        records(False, False, applier.store.current())
        return EXIT_FAILED
    records(result.ok, result.outcome == "rolled-back", applier.store.current())
    return report(result)


def run(args: argparse.Namespace) -> int:
    return execute(args)
