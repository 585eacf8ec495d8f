"""fabric leader: who leads and the epoch; `fabric leader run --host NAME` is fabric-leader.service.

`fabric leader [--json]` prints the current leader, the epoch and the newest
plan's epoch, and the leader's problem when its steps keep failing (exit 0
also when nobody leads).

`fabric leader run --host NAME [--lease-ttl S] [--once]` is the long-running
loop of a leader candidate (`reconciler.engine.leader`): campaign, keep
the lease alive, watch the registry, advance the node lifecycle and publish
the scheduler's plan when it changes, then carry out the burst and scaling
decisions (each cloud hook a transient systemd unit of its own, never in this
process, its paths within `--config`'s [node] allowed_path_prefixes;
concurrency overrides, scaled-down groups; reconciler.engine.scaling_step). NAME must be in fleet.leader_candidates
(exit 2 otherwise). The lease TTL defaults to timing.heartbeat_s: when the
leader dies another candidate leads within one TTL. SIGTERM/SIGINT resign; nothing else ends the loop: a
registry error of any kind is said and retried with backoff, the term and the
last good plan kept (`fabric status` shows it as the leader's problem).
`--once` does one step, resigns and exits (a reconcile pass on a single host).
When fabric.toml lists [[plan_keys]], the loop signs every plan with the
private key in `--plan-key-file` (default $FABRIC_PLAN_KEY_FILE or
/etc/fabric/plan-signing.key); a key that is missing, readable by others or
not listed for NAME ends the command (exit 1) before it campaigns.

`fabric leader keygen --out FILE [--host NAME] [--id ID]` makes a new plan
signing key: the private key goes to FILE (mode 0600; an existing FILE is
never overwritten), and the [[plan_keys]] lines to add to fabric.toml are
printed (host default: this machine's name; id default: HOST-YYYY-MM).
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from reconciler.cli import EXIT_OK, CommandError, InvalidInput
from reconciler.cli.common import add_node_config, load_node_config
from reconciler.cli.pass_options import add_plan_key_option
from reconciler.cli.registry_options import add_registry_options, desired_and_registry
from reconciler.core.desired.model import ED25519_PUBLIC_KEY_BYTES, DesiredState, PlanKey
from reconciler.core.render.ray_units import ray_state_source
from reconciler.core.scheduling.placement import schedule
from reconciler.core.timestamps import stamp, utc_now
from reconciler.engine.leader import candidate_loop, signing_key
from reconciler.ports import (
    Audit,
    CommandRunner,
    HookRunner,
    LaneBroker,
    PlanSigner,
    PlanSigningError,
    RayState,
    Registry,
    RegistryError,
    RegistryUnavailable,
)
from reconciler.wiring import (
    command_runner,
    generate_plan_key,
    host_name,
    lane_broker_if_configured,
    leader_desired,
    leader_ports,
    plan_signer,
    ray_state,
    system_clock,
)


def _ttl(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text} is outside 1..3600 seconds")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("leader", help="show the leader and epoch; 'leader run --host NAME' campaigns and leads")
    add_registry_options(p)
    p.add_argument(
        "action",
        nargs="?",
        choices=["show", "run", "keygen"],
        default="show",
        help="show (default), run the leader loop, or keygen a plan signing key",
    )
    p.add_argument("--json", action="store_true", help="show: machine-readable output")
    p.add_argument("--host", metavar="NAME", help="run: this host's name (a leader candidate); keygen: the key's host (default: this machine)")
    p.add_argument("--lease-ttl", type=_ttl, metavar="S", help="run: leader lease TTL in seconds (default timing.heartbeat_s)")
    p.add_argument("--once", action="store_true", help="run: one step, then exit")
    add_node_config(p)  # run: the prefixes a cloud hook's credentials and working directory must lie under
    p.add_argument(
        "--ray-address",
        metavar="HOST:PORT",
        help="run: the fleet's Ray cluster (its GCS address): Ray's tasks join each host's load, a dead Ray node fails its worker unit",
    )
    p.add_argument(
        "--tailscale",
        choices=("auto", "off"),
        default="auto",
        help="run: read `tailscale status --json` as a source of suspicion (a peer offline), when tailscale is on PATH (auto, the default) or never (off)",
    )
    add_plan_key_option(p, used="run: needed when fabric.toml lists plan keys")
    p.add_argument("--out", metavar="FILE", type=Path, help="keygen: where the new private key goes (0600, never overwritten)")
    p.add_argument("--id", metavar="ID", help="keygen: the key's id in fabric.toml (default HOST-YYYY-MM)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "run":
        return _run_loop(args)
    if args.action == "keygen":
        return _keygen(args)
    with desired_and_registry(args) as (_, registry):
        info = registry.leader()
        held = registry.leader_term()
        epoch = registry.epoch()
        plan = registry.newest_plan()
    if args.json:
        print(
            json.dumps(
                {
                    "leader": info.candidate if info else None,
                    "since": info.since.isoformat() if info else None,
                    "term_epoch": info.epoch if info else None,
                    # The registry's current term (also a resigned or stale leader's, until the next campaign).
                    "term": held.term if held else None,
                    "epoch": epoch,
                    "plan_epoch": plan.epoch if plan else None,
                    "plan_term": plan.term if plan else None,
                    # Why the leader's steps keep failing (None: they do not).
                    "problem": info.problem.model_dump(mode="json") if info and info.problem else None,
                },
                indent=2,
            )
        )
        return EXIT_OK
    if info is None:
        print(f"no leader; epoch {epoch}")
    else:
        print(f"{info.candidate} leads since {stamp(info.since)} (term {info.term}, began at epoch {info.epoch}); epoch {epoch}")
    print(f"newest plan: epoch {plan.epoch} of term {plan.term} by {plan.leader}" if plan else "newest plan: none published")
    if info is not None and info.problem is not None:
        print(f"leader problem: {info.problem.text()}")
    return EXIT_OK


def _ray_state(address: str | None, desired: DesiredState) -> RayState | None:
    """Ray's state API: `--ray-address`, else the `[ray]` head's dashboard. A
    default that cannot be read (no dashboard, no ray extra) is said and the
    leader runs without Ray's tasks; an address given that cannot be is an error."""
    if address is not None:
        try:
            return ray_state(address)
        except ImportError:
            raise InvalidInput("fabric leader run: --ray-address needs ray (install the extra: pip install 'fabric-reconciler[ray]')") from None
    source = ray_state_source(desired)
    if source.address is None:
        if source.note:
            _log(source.note)
        return None
    try:
        reader = ray_state(source.address)
    except ImportError:
        _log(
            f"Ray's tasks are not counted in the hosts' load: reading Ray's state at {source.address} needs the ray extra (pip install 'fabric-reconciler[ray]')"
        )
        return None
    _log(f"Ray's state from {source.address} ([ray] head's dashboard)")
    return reader


def _log(message: str) -> None:
    print(f"fabric-leader: {message}", file=sys.stderr, flush=True)


def _keygen(args: argparse.Namespace) -> int:
    if args.out is None:
        raise InvalidInput("fabric leader keygen: --out FILE is required (where the private key goes)")
    host = args.host or host_name()
    key_id = args.id or f"{host}-{utc_now():%Y-%m}"
    try:
        # Host and id checked as fabric.toml will check them, before a key exists.
        PlanKey(host=host, id=key_id, public_key=base64.b64encode(bytes(ED25519_PUBLIC_KEY_BYTES)).decode())
    except ValidationError as exc:
        raise InvalidInput(*(f"fabric leader keygen: --{e['loc'][0]}: {e['msg']}" for e in exc.errors())) from None
    try:
        public = generate_plan_key(args.out)
    except PlanSigningError as exc:
        raise CommandError(f"fabric leader keygen: {exc}") from None
    print(f"# {host}'s plan signing key; the private key is in {args.out} (keep it there, mode 0600)")
    print("[[plan_keys]]")
    print(f'host = "{host}"')
    print(f'id = "{key_id}"')
    print(f'public_key = "{base64.b64encode(public).decode()}"')
    print(f"add these lines to fabric.toml; the host leads with --plan-key-file {args.out}", file=sys.stderr)
    return EXIT_OK


def _run_loop(args: argparse.Namespace) -> int:
    if not args.host:
        raise InvalidInput("fabric leader run: --host NAME is required")
    with desired_and_registry(args) as (desired, registry):
        candidates = desired.fleet.fleet.leader_candidates
        if args.host not in candidates:
            raise InvalidInput(f"fabric leader run: {args.host!r} is not in fleet.leader_candidates ({', '.join(candidates)})")
        signer = plan_signer(args.plan_key_file)
        if desired.fleet.plan_keys:
            try:
                signing_key(signer, desired.fleet.plan_keys, args.host)
            except PlanSigningError as exc:
                raise CommandError(f"fabric leader run: {args.host} cannot sign plans: {exc}") from None
        with leader_ports() as (hooks, audit):
            return _lead(args, desired, registry, hooks, audit, signer)


def _lead(args: argparse.Namespace, desired: DesiredState, registry: Registry, hooks: HookRunner, audit: Audit | None, signer: PlanSigner) -> int:
    lane_broker = lane_broker_if_configured(desired.fleet, note=_log, dispatcher=True)
    try:
        return _candidate(args, desired, registry, hooks, audit, signer, lane_broker)
    finally:
        if lane_broker is not None:
            lane_broker.close()


def _tailscale_status(mode: str, runner: CommandRunner) -> Callable[[], str] | None:
    """`tailscale status --json` through `runner`, when asked for and on PATH."""
    if mode == "off" or shutil.which("tailscale") is None:
        return None

    def status() -> str:
        result = runner.run(["tailscale", "status", "--json"], timeout=5.0)
        if not result.ok:
            raise OSError(f"tailscale status exited {result.returncode}: {result.stderr.strip()[:200]}")
        return result.stdout

    return status


def _candidate(
    args: argparse.Namespace,
    desired: DesiredState,
    registry: Registry,
    hooks: HookRunner,
    audit: Audit | None,
    signer: PlanSigner,
    lane_broker: LaneBroker | None,
) -> int:
    loop = candidate_loop(
        registry,
        args.host,
        leader_desired(Path(args.desired)),
        schedule,
        lease_ttl_s=args.lease_ttl or float(desired.fleet.timing.heartbeat_s),
        hooks=hooks,
        audit=audit,
        log=_log,
        signer=signer,
        ray_state=_ray_state(args.ray_address, desired),
        lane_broker=lane_broker,
        clock=system_clock(),
        allowed_prefixes=tuple(load_node_config(args.config).node.allowed_path_prefixes),
    )
    loop.tailscale_status = _tailscale_status(args.tailscale, command_runner())
    if args.once:
        try:
            loop.step_and_resign()
        except RegistryUnavailable as exc:
            raise CommandError(f"fabric-leader: registry unreachable: {exc}") from None
        except RegistryError as exc:
            raise CommandError(f"fabric-leader: registry error ({type(exc).__name__}): {exc}") from None
        return EXIT_OK
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: loop.stop())
    _log(f"{args.host} campaigning (lease TTL {loop.lease_ttl_s:g} s)")
    loop.run()
    return EXIT_OK
