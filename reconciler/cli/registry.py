"""fabric registry: tools for the registry itself.

fabric registry export > snapshot.json
    the live registry as a snapshot (JSON on stdout): the
    `reconciler.core.live.models.Snapshot` format that `fabric schedule
    --snapshot FILE` and `fabric status --snapshot FILE` read: now, nodes
    (with drained, held_off_until, last_seen), every declared lane with its
    claimed slots, the newest plan's placements, leader and epoch.

fabric registry init-auth [--cert-file ROOT.crt --key-file ROOT.key] [--dry-run]
    per-host identities in etcd (reconciler.core.desired.registry_access):
    a role fabric-host-<host> and a user <host> for every declared host,
    fabric-leader for fleet.leader_candidates, the operator's fabric-admin,
    the root user, then etcd's auth switched on. Idempotent: it prints each
    change it makes ("created role ...", "granted ...") and "nothing to do"
    when etcd already holds the desired state's identities. Run it with
    root's client certificate (CN=root), and again after adding a host or
    changing the candidates. Exit 1 when etcd refuses or cannot be reached,
    2 for a bad desired state or a sqlite [registry].
"""

from __future__ import annotations

import argparse

from reconciler.cli import EXIT_OK, CommandError, InvalidInput
from reconciler.cli.common import add_desired, load_or_fail
from reconciler.cli.registry_options import add_identity_options, add_registry_options, desired_and_registry, live_snapshot, with_identity
from reconciler.core.desired.registry_access import auth_steps, registry_access
from reconciler.ports import RegistryError
from reconciler.wiring import registry_auth


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("registry", help="registry tools (export a snapshot, set up etcd's per-host identities)")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    export = actions.add_parser("export", help="print the live state as a snapshot (JSON)")
    add_registry_options(export)
    export.set_defaults(func=run_export)
    init_auth = actions.add_parser(
        "init-auth",
        help="create etcd's users and roles for every declared host (each writes only its own keys) and enable auth",
        description="Idempotent: prints what it changed, or 'nothing to do'. Needs root's client certificate (CN=root).",
    )
    add_desired(init_auth)
    add_identity_options(init_auth, default="[registry] cert_file/key_file; must be CN=root once auth is on")
    init_auth.add_argument("--dry-run", action="store_true", help="print the changes without making them")
    init_auth.set_defaults(func=run_init_auth)


def run_export(args: argparse.Namespace) -> int:
    with desired_and_registry(args) as (desired, registry):
        snapshot = live_snapshot(args, desired, registry)
    print(snapshot.model_dump_json(indent=2))
    return EXIT_OK


def run_init_auth(args: argparse.Namespace) -> int:
    desired = load_or_fail(args.desired)
    if desired.fleet.registry.backend != "etcd":
        raise InvalidInput(
            f"{args.desired / 'fabric.toml'}: registry.backend: init-auth sets up etcd's users and roles; "
            "the embedded sqlite registry has none (its file is root-only)"
        )
    fleet = with_identity(args, desired.fleet)
    try:
        auth = registry_auth(fleet)
        try:
            steps = auth_steps(registry_access(desired), auth.access_state())
            for step in steps:
                if not args.dry_run:
                    auth.apply_auth_step(step)
                print(f"{'would have ' if args.dry_run else ''}{step.describe()}", flush=True)
        finally:
            auth.close()
    except RegistryError as exc:
        raise CommandError(f"fabric registry init-auth: registry: {exc}") from None
    if not steps:
        print("nothing to do: etcd holds every identity the desired state declares, and auth is on")
    return EXIT_OK
