"""A pass with the pass memo in front (`fabric reconcile`).

    outcome = run_memoized_pass(options, memo_ports, full_pass_ports)

    1 the inputs key: options, this program's version, the programs on PATH,
      the desired state (git commit or stat), the main Caddyfile, the capture
      or plan file (stat), the live probe's parsed facts (MemoPorts.probe;
      core.probe.facts_key: no model, HostFacts are built by the full pass alone).
      A memo young enough to stand lends the probe what lspci, lsblk and
      ffmpeg printed, taken instead of running them while the stamp of
      their declared inputs is the one it kept (engine.probe.collect_live_reusing);
      a pass that goes on to a full one probes again, running every command
    2 the memo the last converged pass left (pass_memo.usable), under the pass
      lock: when it names a registry, the registry's epoch first (moved: a new
      plan, the full pass at once, which compares the world itself and beats;
      the drift check's unit states, table listing and file hashes would only
      delay the plan); then has the world drifted (pass_memo.drift)? A
      changed table only: a full pass that reloads it (PassOptions.nft_reload)
    3 a hit: re-send the memo's heartbeat on that registry connection, the
      record's JSON as the last full pass validated it (its in_flight with
      the lane jobs of the lanes whose jobs run here read afresh from the
      registry: they change without any drift; no NodeRecord is built), one
      audit line, this host's pass series refreshed
      (pass_memo.refreshed_metrics); the report says memoized
    4 otherwise the full pass (reconciler.engine.reconcile.run_pass, on the
      ports `full_pass_ports` gives), which drops the memo before its first
      change and leaves a new one when it converges; the outcome is its PassReport

Everything outside the process goes through MemoPorts (Protocols of
reconciler.ports, named for types only). This module imports, at run time,
only the standard library, reconciler.engine.pass_memo, the probe's
parsers (reconciler.core.probe: raw, facts, parsers), the standard-library
modules of reconciler.core.live (beat, host_load, host_limits) and, to beat,
reconciler.ports (its models are named for types only): the models,
templates and the rest of the engine are imported by the full pass alone
(tests/unit/test_pass_memo.py checks sys.modules after a memoized pass).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import reconciler
from reconciler.core.live.host_load import HostLoad, lane_jobs_running
from reconciler.core.pass_files import NODE_CONFIG_FILE, PASS_COUNTERS, PROGRAMS, TEXTFILE_PATH
from reconciler.core.probe.raw import facts_key, parse_capture
from reconciler.engine.pass_memo import MEMO_FILE, NFT_DRIFT, MemoSeed, PassMemo, drift, fresh, inputs_key, refreshed_metrics, sha256, usable
from reconciler.engine.pass_options import CADDY_MAIN_CANDIDATES, PassOptions, PlanAlone, PlanFile, PlanFromRegistry
from reconciler.engine.pass_report import PassReport

if TYPE_CHECKING:
    from reconciler.core.probe.raw import RawCapture
    from reconciler.engine.probe import LiveProbe
    from reconciler.engine.reconcile import PassPorts
    from reconciler.ports import Audit, BeatLaneBroker, BeatRegistry, Clock, MemoReader, MemoStore


def _ignore(note: str) -> None:
    pass


def _no_lane_broker(reach: Mapping[str, Any]) -> BeatLaneBroker | None:
    return None


@dataclass
class MemoPorts:
    """What the memo's side of a pass reaches outside the process."""

    store: MemoStore  # the memo, the pass counters, the textfile, the pass lock
    world: MemoReader  # what the memo is checked against; stat fingerprints, git commit, PATH
    audit: Audit  # the memoized pass's one audit line
    clock: Clock
    # This machine's raw probe outputs, collected live (a replay is
    # fingerprinted, not probed here), reusing the given memo's outputs of
    # commands whose inputs are unchanged (None: every command runs).
    probe: Callable[[Mapping[str, Mapping[str, Any]] | None], LiveProbe]
    # Opens the registry the memo names (PassMemo.registry: fabric.toml's
    # [registry], [timing], [flap] as the last full pass validated them), for
    # the memo's heartbeat (closed after).
    open_registry: Callable[[Mapping[str, Any]], BeatRegistry]
    # Opens phaze's broker (the lane queue) the memo names (PassMemo.lane_broker:
    # fabric.toml's [phaze] queue_url_file and job_function) for the lane jobs
    # of that heartbeat; None: not configured or unreachable (closed after).
    open_lane_broker: Callable[[Mapping[str, Any]], BeatLaneBroker | None] = _no_lane_broker
    note: Callable[[str], None] = _ignore


Verdict = Literal["hit", "nft", "full"]


def run_memoized_pass(
    options: PassOptions,
    ports: MemoPorts,
    full_pass_ports: Callable[[PassOptions], AbstractContextManager[PassPorts]],
) -> PassReport:
    started = ports.clock.now()
    memo_file = options.root / options.state_dir.strip("/") / MEMO_FILE
    # Read before locking: with no memo (a first pass, or bad input) the pass
    # creates nothing here, not even the lock file.
    memo = _read_memo(ports, memo_file)
    # A memo young enough to stand for this pass lends its probe the outputs
    # of the commands whose inputs did not change (lspci, lsblk, ffmpeg).
    reuse = memo.probe_reuse if memo is not None and fresh(memo, started) else None
    live = None if options.replay else ports.probe(reuse)
    # A plain directory's key stats the files the last full pass depended on
    # (its memo names them): the full pass that follows keys them the same.
    listed = memo.seed.desired_files if memo is not None else ()
    inputs = pass_inputs(options, live.capture if live else None, ports.world, listed)
    verdict, memo = _memoized(options, ports, memo_file, memo, inputs_key(inputs), started)
    if verdict == "hit" and memo is not None:
        generation = memo.seed.generation
        return PassReport("noop", f"nothing to do (generation {generation})\n" if generation else "nothing to do\n", memoized=True)
    if live is not None and live.reused:
        # The full pass acts on this moment's machine: every command runs.
        live = ports.probe(None)
        inputs = pass_inputs(options, live.capture, ports.world, listed)
    return _full_pass(options, ports, full_pass_ports, memo_file, _Keyed(inputs, listed, started), live, nft_reload=verdict == "nft")


@dataclass(frozen=True)
class _Keyed:
    """The inputs a pass was keyed by as it started, the files its memo listed
    and when it started (the full pass's memo keys what it read then)."""

    inputs: dict[str, str | None]
    listed: Sequence[str]
    started: float

    def key_after(self, options: PassOptions, world: MemoReader, seed: MemoSeed) -> str:
        """The memo's key: the inputs as the pass started; for a directory
        that is not a git checkout whose pass depended on other files than
        the last memo listed, its stamp over those (`desired_digest`), unless
        one of them changed since the pass started (racy: it may have changed
        after the pass read it; the key stays, the next pass is full and keys
        them then). Linux stamps a change with a clock of a jiffy's precision
        (4 ms at HZ=250), so a change just after the start may carry a time
        just before it: harmless, the pass reads the desired state well after
        its start (the probe and the memo come first), and a change before
        that read is what the pass rendered."""
        if tuple(seed.desired_files) == tuple(self.listed) or not str(self.inputs.get("desired", "")).startswith("tree "):
            return inputs_key(self.inputs)
        stamp = world.tree_stamp(Path(options.desired), [*own_files(options.host), *seed.desired_files], since=self.started)
        return inputs_key(self.inputs if stamp is None else {**self.inputs, "desired": f"tree {stamp}"})


def pass_inputs(options: PassOptions, capture: RawCapture | None, world: MemoReader, desired_files: Sequence[str] = ()) -> dict[str, str | None]:
    """What a pass's outcome depends on, each as a digest or a plain value.
    The desired-state tree is fingerprinted from stat alone (its size must not
    make every host's pass slower); the live probe by its parsed facts, what
    HostFacts are built from (the raw outputs hold counters that change every
    second; building HostFacts would import the models)."""
    root = options.root
    plan = options.plan
    plan_file = plan.path if isinstance(plan, PlanFile) else None
    registry_path = plan.sqlite_path if isinstance(plan, PlanFromRegistry) else None
    described = {
        "desired": str(Path(options.desired).absolute()),
        "host": options.host,
        "root": str(root.absolute()),
        "state_dir": options.state_dir.strip("/"),
        "unit_dir": options.unit_dir.strip("/"),
        "replay": options.replay,
        "plan_file": str(plan_file) if plan_file else None,
        "no_registry": isinstance(plan, PlanAlone),
        "registry_path": str(registry_path) if registry_path else None,
        "no_activate": options.no_activate,
        "validate": options.validate,
        "caddy_main": options.caddy_main,
        "caddy_admin": options.caddy_admin,
        "systemd_bus": options.systemd_bus,
    }
    caddy_mains = [options.caddy_main] if options.caddy_main else list(CADDY_MAIN_CANDIDATES)
    return {
        "version": reconciler.__version__,
        "options": json.dumps(described, sort_keys=True),
        "programs": json.dumps([world.which(p) for p in PROGRAMS]),
        "desired": desired_digest(Path(options.desired), options.host, world, desired_files),
        "caddy_main": world.fingerprint([root / c.strip("/") for c in caddy_mains]),
        # The host's own node.toml: the prefixes its units' paths may lie under.
        "node_config": world.fingerprint([root / NODE_CONFIG_FILE]),
        "replay": world.fingerprint([options.replay]) if options.replay else None,
        "plan_file": world.fingerprint([plan_file]) if plan_file else None,
        "probe": sha256(facts_key(parse_capture(capture)).encode()) if capture is not None else None,
    }


def own_files(host: str) -> list[str]:
    """fabric.toml and where this host's file may be, relative to the desired state."""
    return ["fabric.toml", f"{host}.toml", f"hosts/{host}.toml"]


def desired_digest(desired: Path, host: str, world: MemoReader, desired_files: Sequence[str] = ()) -> str:
    """The desired state's identity, from a few stats whatever the fleet's size.
    A git checkout (what `fabric pull` keeps): its commit, plus fabric.toml and
    this host's file by stat; an uncommitted edit of another host's file is
    seen by the next full pass (at the latest after pass_memo.MAX_AGE_S).
    Any other directory (`MemoReader.tree_stamp`): a Nix store path is its
    own identity (immutable); a plain directory, the stat of the directory
    and its hosts/ (a file added, removed or renamed), of fabric.toml and this
    host's file, and of `desired_files`, the files the last full pass's
    artifacts depended on (its memo's), so an edit of any of them is seen."""
    commit = world.git_commit(desired)
    if commit is not None:
        return f"git {commit} {world.fingerprint([desired / name for name in own_files(host)])}"
    return f"tree {world.tree_stamp(desired, [*own_files(host), *desired_files])}"


def _read_memo(ports: MemoPorts, memo_file: Path) -> PassMemo | None:
    raw = ports.store.read(memo_file)
    try:
        return PassMemo.from_json(raw) if raw is not None else None
    except ValueError:
        return None  # corrupt: a full pass writes a good one


def _memoized(
    options: PassOptions, ports: MemoPorts, memo_file: Path, memo: PassMemo | None, key: str, started: float
) -> tuple[Verdict, PassMemo | None]:
    """'hit' (the pass is done, and the memo that stood for it), 'nft' (a full
    pass that must reload the table) or 'full'."""
    if memo is None or usable(memo, key, ports.clock.now()) is not None:
        return "full", None
    with ports.store.lock(memo_file.parent / "lock") as free:
        if not free:
            return "full", None  # another pass runs: the full pass reports it busy
        registry = None
        try:
            if memo.seed.node_record is not None:
                registry = _registry_at_memo_epoch(ports, memo)
                if registry is None:
                    return "full", None
            world = ports.world
            try:
                drifted = drift(memo, world.read, world.unit_state(), world.nft_digest())
            except Exception as exc:  # systemd cannot be asked: the full pass says why
                ports.note(f"pass memo: cannot check the world ({exc}); full pass")
                return "full", None
            if drifted is not None:
                ports.note(f"drift since the last pass: {drifted}; full pass")
                return ("nft" if drifted == NFT_DRIFT else "full"), None
            if registry is not None and not _heartbeat(options, ports, memo, registry):
                return "full", None
        finally:
            if registry is not None:
                registry.close()
        ports.audit.record("noop", "ok", generation=str(memo.seed.generation or ""), memo="hit")
        _refresh_records(options, ports, memo_file.parent, started)
    return "hit", memo


def _registry_at_memo_epoch(ports: MemoPorts, memo: PassMemo) -> BeatRegistry | None:
    """The registry the memo names, open, when its epoch is still the memo's;
    None (a full pass) when the memo cannot say how to reach it, the registry
    cannot be read, or its epoch moved on: a new plan, whose full pass beats
    itself (a beat here would only delay the plan's pass). The caller closes it."""
    from reconciler.port_errors import RegistryError

    if memo.seed.registry is None or memo.seed.beat_ttl_s is None:
        return None  # a memo the full pass wrote without them: measure again
    try:
        registry = ports.open_registry(memo.seed.registry)
    except RegistryError:
        return None
    try:
        epoch = registry.epoch()
    except RegistryError:
        registry.close()
        return None
    except BaseException:
        registry.close()
        raise
    if epoch != memo.seed.registry_epoch:
        ports.note(f"registry epoch {epoch} (the last pass saw {memo.seed.registry_epoch}); full pass")
        registry.close()
        return None
    return registry


def _heartbeat(options: PassOptions, ports: MemoPorts, memo: PassMemo, registry: BeatRegistry) -> bool:
    """Re-send the memo's heartbeat to `registry` (its epoch checked); False
    (a full pass) when the record cannot be sent as it is or the registry
    cannot take it.

    The record is the JSON the last full pass validated and sent, re-sent as
    it is but for what changes without drift: the lane jobs in `in_flight`
    (the units, and so the services running, are the memo's: no drift) and
    the beat's time, which the registry stamps. No model is built or
    imported (a lane host's memo keeps its lanes' queues: `_in_flight`)."""
    from reconciler.core.live.beat import heartbeat_note
    from reconciler.core.live.host_limits import lowered_note
    from reconciler.port_errors import LaneBrokerError, RegistryError

    assert memo.seed.node_record is not None and memo.seed.beat_ttl_s is not None
    try:
        record = json.loads(memo.seed.node_record)
    except ValueError:
        return False
    if not isinstance(record, dict):
        return False
    lowered = lowered_note(record.get("lowered_limits") or [])
    if lowered is not None:
        ports.note(lowered)
    try:
        if memo.seed.lanes_here:
            in_flight = _in_flight(ports, memo)
            if in_flight is None:
                return False  # the lane queue configured but unusable: the full pass says why
            record = {**record, "in_flight": in_flight}
        stored = registry.heartbeat_json(record, memo.seed.beat_ttl_s)
        ports.note(heartbeat_note(stored["node_id"], stored["tier"], stored["in_flight"], stored.get("timeout_s")))
    except (RegistryError, LaneBrokerError):
        return False
    return True


def _in_flight(ports: MemoPorts, memo: PassMemo) -> int | None:
    """The heartbeat's in_flight now: the memo's services running (no drift)
    and the lane jobs of the lanes whose jobs run here, read afresh from their
    queues (the memo names them and the broker: fabric.toml's, part of its
    key); None: a lane queue configured but unusable (the full pass says why).
    Raises LaneBrokerError."""
    reach = memo.seed.lane_broker or {"queue_url_file": None}
    in_flight: dict[str, int] = {}
    lane_broker = ports.open_lane_broker(reach)
    if lane_broker is None and reach.get("queue_url_file") is not None:
        return None  # configured but unusable
    if lane_broker is not None:
        try:
            jobs = lane_broker.in_flight(list(memo.seed.lane_queues.values()))
        finally:
            lane_broker.close()
        in_flight = {lane: jobs.get(queue, 0) for lane, queue in memo.seed.lane_queues.items()}
    return HostLoad(memo.seed.load_services, lane_jobs_running(memo.seed.lanes_here, in_flight)).in_flight


def _refresh_records(options: PassOptions, ports: MemoPorts, state: Path, started: float) -> None:
    """This host's pass series (duration, success, last success) and the pass
    counters, as a full pass would leave them; the fleet's series and the
    status page wait for the next full pass (PassMemo.max_age_s)."""
    now = ports.clock.now()
    counters_file = state / PASS_COUNTERS
    try:
        raw = ports.store.read(counters_file)
        counters = json.loads(raw) if raw else {}
        if not isinstance(counters, dict):
            counters = {}
        counters["last_success"] = datetime.fromtimestamp(now, UTC).isoformat()
        ports.store.write(counters_file, json.dumps(counters).encode())
        # This host's pass series come first; the fleet's below them are copied as they are.
        ports.store.rewrite_head(options.root / TEXTFILE_PATH, lambda head: refreshed_metrics(head, duration_s=now - started, now=now))
    except (OSError, ValueError) as exc:
        ports.note(f"could not write metrics: {exc}")


def _full_pass(
    options: PassOptions,
    ports: MemoPorts,
    full_pass_ports: Callable[[PassOptions], AbstractContextManager[PassPorts]],
    memo_file: Path,
    keyed: _Keyed,
    live: LiveProbe | None,
    *,
    nft_reload: bool,
) -> PassReport:
    """The whole pass; the memo is dropped before its first change and written anew when it converges."""
    from dataclasses import replace

    from reconciler.core.probe import facts_from_capture
    from reconciler.engine.reconcile import run_pass

    options = replace(options, nft_reload=nft_reload)
    with full_pass_ports(options) as pass_ports:
        if live is not None:
            # Probed once, for the key; the facts of what the key was made of.
            probed = facts_from_capture(live.capture, host=options.host)
            pass_ports.probe = lambda _host, _replay: probed
        step = pass_ports.checkpoint

        def checkpoint(name: str) -> None:
            # Before the pass's first change: a pass killed from here on
            # must leave no memo, or the next could vouch for a half-done world.
            ports.store.remove(memo_file)
            step(name)

        pass_ports.checkpoint = checkpoint
        report = run_pass(options, pass_ports)
    # A group member's pass keeps no memo: the memo's early stop beats as a host (engine.member).
    if report.memo_seed is not None and not report.memo_seed.may_lead and options.member_of is None:
        key = keyed.key_after(options, ports.world, report.memo_seed)
        memo = memo_after(report.memo_seed, key, ports.world, ports.clock.now(), live.reusable() if live else {})
        if memo is not None:
            ports.store.write(memo_file, memo.to_json().encode())
        else:
            ports.store.remove(memo_file)
    elif report.outcome not in ("bad-input", "busy"):
        # Not converged (failed, rolled back, static): the next pass is full.
        ports.store.remove(memo_file)
    return report


def memo_after(
    seed: MemoSeed, key: str, world: MemoReader, now: float, probe_reuse: Mapping[str, Mapping[str, str | None]] | None = None
) -> PassMemo | None:
    """The memo of a pass that converged: its seed, the world as it left it
    (None: it cannot be read now) and what its probe's stamped commands
    printed (`probe_reuse`: engine.probe.LiveProbe.reusable)."""
    files = {}
    for path in seed.files:
        data = world.read(path)
        if data is None:
            return None
        files[path] = sha256(data)
    units: dict[str, str] = {}
    nft = None
    unit_state, nft_digest = world.unit_state(), world.nft_digest()
    try:
        if unit_state is not None:
            units = {unit: unit_state(unit) for unit in seed.units}
        if nft_digest is not None:
            nft = nft_digest()
    except Exception:  # systemd cannot be asked now: no memo, the next pass is full
        return None
    return PassMemo(key=key, written_at=now, seed=seed, file_digests=files, unit_states=units, nft=nft, probe_reuse=dict(probe_reuse or {}))
