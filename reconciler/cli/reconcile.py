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

The pass memo (reconciler.engine.pass_memo): before the full pass, the digest
of the pass's inputs is compared with the memo the last converged pass left;
when they agree and nothing drifted, the pass only heart-beats, checks the
registry's epoch and writes its one audit line, importing no model and
rendering nothing. Otherwise the full pass runs (with the table reloaded if
the memo saw it changed) and, when it converges, leaves a new memo.

The pass itself is `reconciler.engine.reconcile.run_pass`; this module parses
the options (shared with `fabric plan`, reconciler.cli.pass_options), takes
the real ports from reconciler.cli.wiring and prints the report.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from reconciler.cli.pass_options import CADDY_MAIN_CANDIDATES, add_pass_options, finish, pass_options
from reconciler.cli.wiring import MemoWorld, fingerprint, git_commit, host_name, memo_audit, memo_files, print_note
from reconciler.engine.pass_memo import MAX_AGE_S, MEMO_FILE, NFT_DRIFT, PassMemo, drift, inputs_key, refreshed_metrics, sha256, usable

# reconciler.engine.pass_records.PASS_COUNTERS and reconciler.core.views.metrics.TEXTFILE_PATH
# (tests/unit/test_pass_memo.py checks), spelled here so that a memoized pass imports neither.
PASS_COUNTERS = "pass-counters.json"
TEXTFILE_PATH = "var/lib/node_exporter/textfile/fabric.prom"

if TYPE_CHECKING:
    from reconciler.core.desired.model import NodeFacts
    from reconciler.engine.reconcile import Converged


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reconcile", help="one pass: render, plan, write a generation, validate, activate")
    add_pass_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    started = time.time()
    host = args.host or host_name()
    args.host = host
    root = Path(args.root)
    state = root / args.state_dir.strip("/")
    memo_file = state / MEMO_FILE
    facts = None if args.replay else _live_probe(host)
    key = inputs_key(_inputs(args, facts))
    world = MemoWorld(root, activating=not args.no_activate, systemd_bus=args.systemd_bus)
    try:
        verdict = _memoized_pass(args, memo_file, key, world, started)
        if verdict == "hit":
            return 0
        options = pass_options(args, nft_reload=verdict == "nft")
        from reconciler.cli.wiring import real_pass_ports
        from reconciler.engine.reconcile import run_pass

        with real_pass_ports(options) as ports:
            if facts is not None:
                probed = facts
                ports.probe = lambda _host, _replay: probed  # probed once, above
            step = ports.checkpoint

            def checkpoint(name: str) -> None:
                # Before the pass's first change: a pass killed from here on
                # must leave no memo, or the next could vouch for a half-done world.
                memo_files.remove(memo_file)
                step(name)

            ports.checkpoint = checkpoint
            report = run_pass(options, ports)
        if report.converged is not None and not report.converged.may_lead:
            memo = _memo_after(report.converged, key, root, world)
            if memo is not None:
                memo_files.write(memo_file, memo.to_json().encode())
            else:
                memo_files.remove(memo_file)
        elif report.outcome not in ("bad-input", "busy"):
            # Not converged (failed, rolled back, static): the next pass is full.
            memo_files.remove(memo_file)
        return finish(report)
    finally:
        world.close()


def _live_probe(host: str) -> NodeFacts:
    from reconciler.cli.wiring import probe_facts

    return probe_facts(host, None)


def _inputs(args: argparse.Namespace, facts: NodeFacts | None) -> dict[str, str | None]:
    """What a pass's outcome depends on, each as a digest or a plain value.
    The desired-state tree is fingerprinted from stat alone (its size must not
    make every host's pass slower); the live probe by its parsed facts (the
    raw outputs hold counters that change every second)."""
    import reconciler

    root = Path(args.root)
    options = {
        "desired": str(Path(args.desired).absolute()),
        "host": args.host,
        "root": str(root.absolute()),
        "state_dir": args.state_dir.strip("/"),
        "unit_dir": args.unit_dir.strip("/"),
        "replay": args.replay,
        "plan_file": str(args.plan_file) if args.plan_file else None,
        "no_registry": args.no_registry,
        "registry_path": str(args.registry_path) if args.registry_path else None,
        "no_activate": args.no_activate,
        "validate": args.validate,
        "caddy_main": args.caddy_main,
        "caddy_admin": args.caddy_admin,
        "systemd_bus": args.systemd_bus,
    }
    caddy_mains = [args.caddy_main] if args.caddy_main else list(CADDY_MAIN_CANDIDATES)
    return {
        "version": reconciler.__version__,
        "options": json.dumps(options, sort_keys=True),
        "programs": json.dumps([shutil.which(p) for p in ("socat", "podman", "nft")]),
        "desired": _desired_digest(Path(args.desired), args.host),
        "caddy_main": fingerprint([root / c.strip("/") for c in caddy_mains]),
        "replay": fingerprint([args.replay]) if args.replay else None,
        "plan_file": fingerprint([args.plan_file]) if args.plan_file else None,
        "probe": sha256(facts.model_dump_json().encode()) if facts is not None else None,
    }


def _desired_digest(desired: Path, host: str) -> str:
    """The desired state's identity. A git checkout (what `fabric pull` keeps):
    its commit, plus fabric.toml and this host's file by stat, so a host's
    pass costs the same in a fleet of five or ten thousand; an uncommitted
    edit of another host's file is seen by the next full pass (at the latest
    after pass_memo.MAX_AGE_S). Any other directory: every file by stat."""
    commit = git_commit(desired)
    own = [desired / "fabric.toml", desired / f"{host}.toml", desired / "hosts" / f"{host}.toml"]
    if commit is not None:
        return f"git {commit} {fingerprint(own)}"
    return f"tree {fingerprint([desired])}"


def _memoized_pass(args: argparse.Namespace, memo_file: Path, key: str, world: MemoWorld, started: float) -> str:
    """'hit' (the pass is done), 'nft' (a full pass that must reload the table) or 'full'."""
    # Read before locking: with no memo (a first pass, or bad input) the pass
    # creates nothing here, not even the lock file.
    raw = memo_files.read(memo_file)
    try:
        memo = PassMemo.from_json(raw) if raw is not None else None
    except ValueError:
        memo = None  # corrupt: a full pass writes a good one
    if memo is None or usable(memo, key, time.time()) is not None:
        return "full"
    with memo_files.lock(memo_file.parent / "lock") as free:
        if not free:
            return "full"  # another pass runs: the full pass reports it busy
        try:
            drifted = drift(memo, world.read, world.unit_state(), world.nft_digest())
        except Exception as exc:  # systemd cannot be asked: the full pass says why
            print_note(f"pass memo: cannot check the world ({exc}); full pass")
            return "full"
        if drifted is not None:
            print_note(f"drift since the last pass: {drifted}; full pass")
            return "nft" if drifted == NFT_DRIFT else "full"
        if memo.node_record is not None and not _heartbeat(args, memo):
            return "full"
        memo_audit("noop", "ok", generation=str(memo.generation or ""), memo="hit")
        _refresh_records(Path(args.root), memo_file.parent, started)
    sys.stdout.write(f"nothing to do (generation {memo.generation})\n" if memo.generation else "nothing to do\n")
    return "hit"


def _refresh_records(root: Path, state: Path, started: float) -> None:
    """This host's pass series (duration, success, last success) and the pass
    counters, as a full pass would leave them; the fleet's series and the
    status page wait for the next full pass (PassMemo.max_age_s)."""
    now = time.time()
    counters_file = state / PASS_COUNTERS
    textfile = root / TEXTFILE_PATH
    try:
        raw = memo_files.read(counters_file)
        counters = json.loads(raw) if raw else {}
        if not isinstance(counters, dict):
            counters = {}
        counters["last_success"] = datetime.fromtimestamp(now, UTC).isoformat()
        memo_files.write(counters_file, json.dumps(counters).encode())
        # This host's pass series come first; the fleet's below them are copied as they are.
        memo_files.rewrite_head(textfile, lambda head: refreshed_metrics(head, duration_s=now - started, now=now))
    except (OSError, ValueError) as exc:
        print_note(f"could not write metrics: {exc}")


def _heartbeat(args: argparse.Namespace, memo: PassMemo) -> bool:
    """Re-send the memo's heartbeat; False (a full pass) when the registry
    cannot take it or its plan epoch moved on."""
    import tomllib

    from reconciler.cli.wiring import open_registry, registry_path
    from reconciler.core.desired.model import FleetConfig
    from reconciler.core.live.records import NodeRecord
    from reconciler.ports import RegistryError

    assert memo.node_record is not None
    try:
        fleet = FleetConfig.model_validate(tomllib.loads((Path(args.desired) / "fabric.toml").read_text(encoding="utf-8")))
        record = NodeRecord.model_validate_json(memo.node_record)
    except (OSError, ValueError):
        return False
    try:
        registry = open_registry(fleet, sqlite_path=registry_path(args.registry_path, Path(args.root), fleet))
        try:
            stored = registry.heartbeat(record)
            print_note(f"heartbeat: {record.node_id} tier {stored.tier}, alive for {stored.timeout_s:g} s")
            epoch = registry.epoch()
        finally:
            registry.close()
    except RegistryError:
        return False
    if epoch != memo.epoch:
        print_note(f"registry epoch {epoch} (the last pass saw {memo.epoch}); full pass")
        return False
    return True


def _memo_after(converged: Converged, key: str, root: Path, world: MemoWorld) -> PassMemo | None:
    """The memo of a pass that converged: the world as it left it."""
    files = {}
    for path in converged.files:
        data = world.read(path)
        if data is None:
            return None
        files[path] = sha256(data)
    units: dict[str, str] = {}
    nft = None
    unit_state, nft_digest = world.unit_state(), world.nft_digest()
    try:
        if unit_state is not None:
            units = {unit: unit_state(unit) for unit in converged.units}
        if nft_digest is not None:
            nft = nft_digest()
    except Exception:  # systemd cannot be asked now: no memo, the next pass is full
        return None
    return PassMemo(
        key=key,
        generation=converged.generation,
        written_at=time.time(),
        files=files,
        units=units,
        nft=nft,
        node_record=converged.node_record,
        epoch=converged.registry_epoch,
        max_age_s=min(MAX_AGE_S, converged.fleet_view_max_age_s or MAX_AGE_S),
    )
