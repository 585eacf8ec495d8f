"""One reconcile pass of this host, from typed options and ports to a report.

    report = run_pass(options, ports)       fabric reconcile
    report = preview_pass(options, ports)   fabric plan: what the pass would do; writes nothing
    report = roll_back(options, ports)      fabric rollback

A pass:

    1 load + validate the desired state   (bad input: outcome "bad-input", nothing written)
    2 probe this machine (ports.probe: live, or a replayed capture), damped across passes
    3 the fleet plan (plan_source: a file, this host alone, or the registry),
      through the one epoch fence; fail static when it must
    4 render -> plan -> new generation -> validate -> install -> activate (Applier)
    5 the heartbeat again, with the load measured after activation
    6 the registry's epoch again: moved past the plan of step 3 (a plan was
      published meanwhile), another round from step 3, with the inputs of
      steps 1-2 (at most PASS_ROUNDS rounds in all)
    7 the pass records (metrics, the edge's status page: the edge reads the
      fleet's view from the registry only now, so Caddy never waits for it)

The heartbeat: step 3 beats before anything is activated, because a leader
candidate's one-shot leader step must see this host's record, and a host
must stay alive however long its activation takes. Its load describes the
generation that runs as the pass starts. Step 5 measures again once
activation is over (units started or stopped, a rollback) and beats only if
that changed the record, so what the registry keeps, and what the memo
re-sends, is the host after this pass.

Everything outside the process goes through `PassPorts`; `reconciler.wiring`
builds the real ones and tests build fakes. The report is a value: what to
print on stdout and stderr, and the outcome the exit status follows from.
Notes (heartbeat, leader step, render notes) go out through `ports.note` as
they happen, so the log shows them in order with the audit records.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from reconciler.core.desired.confinement import DEFAULT_ALLOWED_PREFIXES, confinement_problems
from reconciler.core.desired.load import DesiredStateError
from reconciler.core.desired.model import DesiredState, FleetConfig, HostFacts
from reconciler.core.desired.problems import ProblemsError
from reconciler.core.install.nodeconfig import parse_node_config
from reconciler.core.live.fencing import AppliedFence
from reconciler.core.live.host_limits import effective_limits, lowered_note
from reconciler.core.live.host_load import service_units
from reconciler.core.live.watching import PLAN_TAKEN, plan_taken_record
from reconciler.core.pass_files import NODE_CONFIG_FILE
from reconciler.core.probe.damping import ProbeHistory
from reconciler.core.probe.identity import tailnet_name_note
from reconciler.core.render.artifacts import Layout, Rendered, RenderError, agent_unit, render
from reconciler.core.render.ray_units import closed_reason
from reconciler.core.scheduling.lifecycle import heartbeat_timeout
from reconciler.core.templating import PACKAGED, Templates
from reconciler.core.timestamps import from_epoch_seconds
from reconciler.engine.apply import CADDY_MAIN, STATE_DIR, Activators, Applier, ApplyResult, GenerationStore, Validators, no_checkpoint
from reconciler.engine.desired_load import LoadedDesired, host_files_read, load_for_pass, read_verdict, record_verdict, with_plan_hosts
from reconciler.engine.fleet_view import FleetView, read_fleet_view
from reconciler.engine.heartbeat import Measured, UnitsSeen, beat_after_activation, node_record
from reconciler.engine.member import MemberRegistry, NotAMember, as_member
from reconciler.engine.pass_memo import MemoSeed
from reconciler.engine.pass_options import PassOptions, PlanFromRegistry
from reconciler.engine.pass_records import PassFigures, damped_facts, save_probe_history, shows_fleet, write_pass_records
from reconciler.engine.pass_report import PassReport, Preview
from reconciler.engine.plan_fence import PassPlan
from reconciler.engine.plan_source import effective_facts, epoch_moved_past, fleet_plan_for
from reconciler.ports import (
    ActivationError,
    Audit,
    CaptureError,
    Clock,
    FileTree,
    LaneBroker,
    LaneBrokerError,
    LockBusy,
    PassLock,
    PassRegistry,
    PendingConnection,
    PlanSigner,
    RegistryError,
    RegistryUnavailable,
)

# The operator's main Caddyfile: Debian's package, then NixOS's services.caddy.
CADDY_MAIN_CANDIDATES = (CADDY_MAIN, "etc/caddy/caddy_config")

# --------------------------------------------------------------------------
# Options


@dataclass(frozen=True)
class RollbackOptions:
    """`fabric rollback`'s options: `to` None is the generation before the last good one."""

    root: Path = Path("/")
    state_dir: str = STATE_DIR
    to: int | None = None
    no_activate: bool = False
    caddy_main: str | None = None
    systemd_bus: str | None = None
    caddy_admin: str = "localhost:2019"
    startup_grace: float = 1.0


# --------------------------------------------------------------------------
# Ports


# This machine's facts for `host`, probed live or re-parsed from the capture
# directory `replay`. Raises CaptureError for an unreadable capture.
Probe = Callable[[str, str | None], HostFacts]


@dataclass(frozen=True)
class ProgramPaths:
    """The programs the rendered units run. The wiring finds them on PATH
    (on NixOS in the store); a missing one keeps the conventional path, so
    the unit names what would have to be installed."""

    socat: str = Layout().socat
    podman: str = Layout().podman
    nft: str = Layout().nft
    systemd_tmpfiles: str = Layout().systemd_tmpfiles
    systemd_sysusers: str = Layout().systemd_sysusers
    ray: str = Layout().ray


def _no_registry(fleet: FleetConfig) -> PassRegistry:
    raise RegistryUnavailable("no registry is wired into this pass")


def _no_pending(fleet: FleetConfig) -> PendingConnection:
    raise RegistryUnavailable("no registry is wired into this pass")


def _no_lane_broker(fleet: FleetConfig) -> LaneBroker | None:
    return None


def _ignore(note: str) -> None:
    pass


def _no_commit(directory: Path) -> str | None:
    return None


def _keep_nothing() -> None:
    pass


@dataclass
class PassPorts:
    """Everything a pass, `fabric plan` and `fabric rollback` reach outside the process."""

    tree: FileTree  # the files under the root
    lock: PassLock  # one pass at a time
    audit: Audit
    clock: Clock
    probe: Probe
    validators: Validators | None = None  # None: no real checks (--no-activate without --validate)
    activators: Activators | None = None  # None: write the files, activate nothing
    # Opens the registry fabric.toml's [registry] names (the pass closes it).
    open_registry: Callable[[FleetConfig], PassRegistry] = _no_registry
    # Opens the registry for a pending machine's report (a machine without a
    # host file): with etcd, as the joining identity when [registry] names one.
    open_pending: Callable[[FleetConfig], PendingConnection] = _no_pending
    # Opens phaze's broker as the lane queue (None: not configured or not
    # reachable, said in a note); the pass closes it.
    open_lane_broker: Callable[[FleetConfig], LaneBroker | None] = _no_lane_broker
    # Opens phaze's broker as the dispatcher, for a candidate's one-shot leader
    # step ([phaze] dispatcher_url_file; None: `open_lane_broker`).
    open_dispatch_broker: Callable[[FleetConfig], LaneBroker | None] | None = None
    # A leader candidate's plan key, for the pass's one-shot leader step (None: cannot sign).
    plan_signer: PlanSigner | None = None
    programs: ProgramPaths = field(default_factory=ProgramPaths)
    # Called before every step that changes something (the crash tests kill the pass there).
    checkpoint: Callable[[str], None] = no_checkpoint
    # A note for the log, as it happens (the command line prints `note: ...` on stderr).
    note: Callable[[str], None] = _ignore
    # The key of the commit a desired-state directory is checked out at (None:
    # not a git checkout); the whole tree is validated once per key
    # (reconciler.engine.desired_load), every pass without one.
    desired_commit: Callable[[Path], str | None] = _no_commit
    # The templates the pass renders with: the package's, kept compiled in the
    # state directory when the wiring hands a cache (core.templating.Templates).
    templates: Templates = PACKAGED
    # Keeps what the pass cached for the next one (the compiled templates);
    # called only once its inputs all checked out, so bad input leaves nothing.
    keep_caches: Callable[[], None] = _keep_nothing


# --------------------------------------------------------------------------
# The report


class _BadInput(Exception):
    def __init__(self, *lines: str) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


class _Undeclared(_BadInput):
    """This host has no host file in a valid desired state: bad input for a
    pass from a plan file or alone, a pending machine's pass from the registry."""

    def __init__(self, desired: DesiredState, host: str) -> None:
        super().__init__(
            f"{desired.fleet_file}: host {host!r} is not declared (hosts: {', '.join(sorted(desired.hosts))}); use --host NAME, "
            f"or run the pass from the registry to report it pending (then `fabric admit {host}`)"
        )
        self.desired = desired


# --------------------------------------------------------------------------
# Preparing a pass (shared with fabric plan)


@dataclass(frozen=True)
class _PreparedPass:
    desired: DesiredState
    loaded: LoadedDesired  # how it was loaded (the verdict to record)
    host: str
    source: PassPlan
    rendered: Rendered
    probe_history: ProbeHistory
    facts: HostFacts  # effective


def _now(clock: Clock) -> datetime:
    return from_epoch_seconds(clock.now())


def _state_dir(state_dir: str) -> str:
    return state_dir.strip("/")


def _allowed_path_prefixes(tree: FileTree) -> list[str]:
    """The prefixes this host's node.toml allows its units' paths under
    (core.desired.confinement; its defaults without a node.toml). Raises
    _BadInput for a node.toml that does not parse."""
    raw = tree.read(NODE_CONFIG_FILE)
    if raw is None:
        return list(DEFAULT_ALLOWED_PREFIXES)
    try:
        return list(parse_node_config(raw.decode("utf-8", errors="replace"), f"/{NODE_CONFIG_FILE}").node.allowed_path_prefixes)
    except ProblemsError as exc:
        raise _BadInput(*(str(problem) for problem in exc.problems)) from None


def caddy_main_path(tree: FileTree, given: str | None) -> str:
    """The main Caddyfile, relative to the root: the one given, else the first candidate that exists."""
    if given:
        return given.strip("/")
    return next((c for c in CADDY_MAIN_CANDIDATES if tree.read(c) is not None), CADDY_MAIN)


def _prepare(options: PassOptions, ports: PassPorts, *, write: bool) -> _PreparedPass:
    """Load, probe, read the plan and render; raises _BadInput before anything is written.

    `write=False` (fabric plan) reads the registry's plan but sends no
    heartbeat and takes no leader step."""
    state_dir = _state_dir(options.state_dir)
    host = options.host
    desired_dir = Path(options.desired)
    try:
        loaded = load_for_pass(
            desired_dir,
            host,
            commit=ports.desired_commit(desired_dir),
            verdict=read_verdict(ports.tree, state_dir),
            may_lead=isinstance(options.plan, PlanFromRegistry),
        )
    except DesiredStateError as exc:
        raise _BadInput(*(str(problem) for problem in exc.problems)) from None
    desired = loaded.desired
    if host not in desired.hosts and options.member_of is not None:
        try:
            desired = as_member(desired, host, options.member_of, options.member_address)
        except NotAMember as exc:
            raise _BadInput(str(exc)) from None
        loaded = replace(loaded, desired=desired)
    if host not in desired.hosts:
        raise _Undeclared(desired, host)
    confined = confinement_problems(desired, _allowed_path_prefixes(ports.tree), host)
    if confined:
        raise _BadInput(*(str(problem) for problem in confined))
    try:
        observed = ports.probe(host, options.replay)
    except CaptureError as exc:  # a bad --replay directory
        raise _BadInput(f"fabric: probe: {exc}") from None
    damped, probe_history = damped_facts(ports.tree, state_dir, desired, observed, _now(ports.clock))
    facts = effective_facts(desired, host, damped)
    identity = tailnet_name_note(desired, host, facts)
    if identity is not None:
        ports.note(identity)
    lowered = lowered_note(effective_limits(desired.hosts[host], facts.limitations).lowered)
    if lowered is not None:
        ports.note(lowered)
    return _plan_and_render(options, ports, loaded, host, facts, probe_history, write=write)


def _plan_and_render(
    options: PassOptions, ports: PassPorts, loaded: LoadedDesired, host: str, facts: HostFacts, probe_history: ProbeHistory, *, write: bool
) -> _PreparedPass:
    """The fleet plan (through the fence) and this host's artifacts from it,
    for the desired state and probe a pass loaded; a later round of the pass
    (`run_pass`) starts here again. Raises _BadInput."""
    desired = loaded.desired
    store = GenerationStore(ports.tree, _state_dir(options.state_dir))
    current = store.current()
    manifest = store.manifest(current)
    try:
        source = fleet_plan_for(
            options.plan,
            desired,
            host,
            facts,
            connect=lambda: ports.open_registry(desired.fleet),
            open_lanes=lambda: ports.open_lane_broker(desired.fleet),
            open_dispatcher=lambda: (ports.open_dispatch_broker or ports.open_lane_broker)(desired.fleet),
            applied_epoch=AppliedFence(manifest.epoch, manifest.term, manifest.key_id) if manifest is not None else None,
            has_generation=current is not None,
            now=_now(ports.clock),
            write=write,
            signer=ports.plan_signer,
            units_now=lambda: units_seen(ports, store, desired),
        )
    except ProblemsError as exc:
        raise _BadInput(*(f"fabric: plan: {problem}" for problem in exc.problems)) from None
    try:
        desired = with_plan_hosts(loaded, source.plan)
    except DesiredStateError as exc:
        raise _BadInput(*(str(problem) for problem in exc.problems)) from None
    for note in source.notes:
        ports.note(note)
    programs = ports.programs
    layout = Layout(
        unit_dir=options.unit_dir.strip("/"),
        socat=programs.socat,
        podman=programs.podman,
        nft=programs.nft,
        systemd_tmpfiles=programs.systemd_tmpfiles,
        systemd_sysusers=programs.systemd_sysusers,
        ray=programs.ray,
    )
    try:
        rendered = render(
            desired, host, facts, source.plan, layout=layout, templates=ports.templates, ray_closed=closed_reason(source.own_state, _now(ports.clock))
        )
    except RenderError as exc:
        raise _BadInput(f"fabric: {exc}") from None
    for note in rendered.notes:
        ports.note(note)
    return _PreparedPass(desired, loaded, host, source, rendered, probe_history, facts)


def units_seen(ports: PassPorts, store: GenerationStore, desired: DesiredState) -> UnitsSeen:
    """The units of the generation that runs now and, when the pass
    activates, their ActiveState as systemd reports it."""
    manifest = store.manifest(store.current())
    units = [e.path.rsplit("/", 1)[-1] for e in manifest.entries if e.kind == "unit"] if manifest is not None else []
    placed = service_units(units, (agent_unit(s.id) for s in desired.fleet.services))
    if ports.activators is None:
        return UnitsSeen(placed, None)
    systemd = ports.activators.systemd
    try:
        return UnitsSeen(placed, {unit: systemd.active_state(unit) for unit in units})
    except ActivationError as exc:
        # systemd cannot be asked: no unit is known to run (the activation
        # that follows fails and says why).
        ports.note(f"cannot read the units' states for the heartbeat ({exc})")
        return UnitsSeen(placed, {})


def _applier(ports: PassPorts, state_dir: str, caddy_main: str | None, *, nft_reload: bool = False) -> Applier:
    return Applier(
        ports.tree,
        ports.lock,
        ports.audit,
        ports.clock,
        validators=ports.validators,
        activators=ports.activators,
        state_dir=_state_dir(state_dir),
        caddy_main=caddy_main_path(ports.tree, caddy_main),
        checkpoint=ports.checkpoint,
        nft_reload=nft_reload,
    )


# --------------------------------------------------------------------------
# fabric reconcile


# A plan published while a pass runs is taken by another round of the same
# pass, at most this many rounds in all. Without it the new plan waited for
# the pass to end and the next to start (the watcher starts none while one
# runs): in a fleet whose timers tick together, as after every plan that
# moved work between them, a lost node's lapse falls on the others' ticks.
# A later round reads the registry and renders again from the inputs the
# first one loaded and probed; the bound keeps a leader that publishes
# without end from holding one pass forever (the watcher's next pass goes on).
PASS_ROUNDS = 3


def member_ports(ports: PassPorts, group: str, address: str) -> PassPorts:
    """A member's pass's ports: its beats are its member reports (engine.member)."""
    opener = ports.open_registry

    def open_as_member(fleet: FleetConfig) -> PassRegistry:
        return cast(PassRegistry, MemberRegistry(opener(fleet), fleet, group, address))

    return replace(ports, open_registry=open_as_member)


def run_pass(options: PassOptions, ports: PassPorts) -> PassReport:
    """One pass of this host; see the module docstring."""
    started = ports.clock.now()
    if options.member_of is not None and options.member_address is not None:
        ports = member_ports(ports, options.member_of, options.member_address)
    try:
        prepared = _prepare(options, ports, write=True)
    except _Undeclared as undeclared:
        if not isinstance(options.plan, PlanFromRegistry):
            return PassReport("bad-input", stderr=undeclared.lines)
        return _pending_pass(options, ports, undeclared.desired)
    except _BadInput as bad:
        return PassReport("bad-input", stderr=bad.lines)
    applier = _applier(ports, options.state_dir, options.caddy_main, nft_reload=options.nft_reload)
    store = applier.store
    # The inputs all checked out: keep the damping history and the whole
    # tree's verdict at this commit (bad input changes nothing).
    save_probe_history(store.tree, store.state_dir, prepared.probe_history)
    record_verdict(store.tree, store.state_dir, prepared.loaded)

    def records(succeeded: bool, rolled_back: bool) -> FleetView | None:
        # Once per pass, of its last round (`prepared` is that round's).
        outcome = PassFigures(succeeded, rolled_back, store.current(), max(0.0, ports.clock.now() - started))
        view, desired = _fleet_view(ports, prepared)
        note = write_pass_records(
            store.tree, store.state_dir, desired, prepared.host, prepared.source, outcome, _now(ports.clock), view=view, templates=ports.templates
        )
        if note is not None:
            ports.note(note)
        ports.keep_caches()  # after the status page: its template too
        return view

    rounds: list[PassReport] = []  # the rounds before this one
    while True:
        static = prepared.source.static
        if static is not None:
            # Fail static: keep what runs, say why.
            current = store.current()
            ports.audit.record("static", "ok", generation=str(current or ""), reason=static)
            records(True, False)
            return _after_rounds(rounds, PassReport("static", f"{static}; generation {current} stays\n" if current else f"{static}\n"))
        try:
            taken = prepared.source.plan
            result = applier.run(
                prepared.rendered.artifacts,
                host=prepared.host,
                epoch=taken.epoch,
                term=taken.term,
                key_id=taken.signature.key_id if taken.signature is not None else None,
                # k3s names its Node after the machine's host name, lower-cased (pkg/agent/config getHostnameAndIPs).
                k3s_node=prepared.facts.k3s_hostname.lower() if prepared.facts.k3s_hostname != "unknown" else None,
            )
        except LockBusy as exc:
            return _after_rounds(rounds, PassReport("busy", stderr=(f"fabric reconcile: {exc}",)))
        except ActivationError as exc:
            _beat_after_activation(ports, prepared, store)
            records(False, False)
            return _after_rounds(rounds, PassReport("failed", stderr=(f"fabric reconcile: {exc}",)))
        beat = _beat_after_activation(ports, prepared, store)
        report = _pass_report(result)
        converged = result.outcome in ("noop", "applied", "written")
        moved = None
        if converged and len(rounds) + 1 < PASS_ROUNDS:
            moved = epoch_moved_past(functools.partial(ports.open_registry, prepared.desired.fleet), prepared.source)
        if moved is None:
            retry = False
            if converged:
                _record_plan_taken(store, prepared.source)
                report, retry = _bootstrap_after_admission(options, ports, report)
            view = records(result.ok, result.outcome == "rolled-back")
            if converged and not retry:
                report = replace(report, memo_seed=_memo_seed(options, prepared, result.generation, beat, showed_fleet=view is not None))
            return _after_rounds(rounds, report)
        ports.note(another_round_note(moved, prepared.source.plan.epoch))
        rounds.append(report)
        try:
            prepared = _plan_and_render(options, ports, prepared.loaded, prepared.host, prepared.facts, prepared.probe_history, write=True)
        except _BadInput as bad:
            return _after_rounds(rounds, PassReport("bad-input", stderr=bad.lines))


def _bootstrap_after_admission(options: PassOptions, ports: PassPorts, report: PassReport, *, dry_run: bool = False) -> tuple[PassReport, bool]:
    """A bootstrap this host's first boot left pending (no host file then),
    started now that it is declared (engine.bootstrap_start): the report with
    the line that says so, and whether the next pass must look again (a
    start systemd refused: no memo)."""
    from reconciler.engine.bootstrap_start import start_after_admission

    systemd = ports.activators.systemd if ports.activators is not None else None
    line, note, retry = start_after_admission(
        ports.tree, _state_dir(options.state_dir), systemd, ports.audit, declared=options.member_of is None, dry_run=dry_run
    )
    if note is not None:
        ports.note(note)
    if line is not None:
        report = replace(report, stdout=report.stdout + line)
    return report, retry


def _pending_pass(options: PassOptions, ports: PassPorts, desired: DesiredState) -> PassReport:
    """The restricted pass of a machine without a host file (engine.pending):
    probe, report pending, render and activate nothing."""
    from reconciler.engine.pending import pending_pass

    try:
        facts = ports.probe(options.host, options.replay)
    except CaptureError as exc:
        return PassReport("bad-input", stderr=(f"fabric: probe: {exc}",))
    return pending_pass(desired, options.host, facts, lambda: ports.open_pending(desired.fleet), ports.audit, ports.note)


def _record_plan_taken(store: GenerationStore, source: PassPlan) -> None:
    """Say which registry plan this pass took (core.live.watching.PLAN_TAKEN):
    the watcher then starts no pass for it, or for any plan before it, once
    this one has ended. Not for a plan file or a host alone (no registry)."""
    if source.epoch_read is not None:
        store.tree.write(f"{store.state_dir}/{PLAN_TAKEN}", plan_taken_record(source.epoch_read))


def another_round_note(epoch: int, read: int) -> str:
    """What a pass says when the registry's epoch moved past the plan it read."""
    return f"registry epoch {epoch} since this pass read plan epoch {read}: another round"


def _after_rounds(rounds: list[PassReport], last: PassReport) -> PassReport:
    """The report of a pass from its rounds: each round's text in order and
    the last round's outcome, but that an earlier round's "applied" stands
    when the last had nothing to do, and a last round that found the lock
    taken (another pass takes the new plan) leaves the one before it."""
    if not rounds:
        return last
    stdout = "".join(r.stdout for r in rounds) + last.stdout
    stderr = tuple(line for r in rounds for line in r.stderr) + last.stderr
    outcome = last.outcome
    if outcome == "busy":
        outcome = rounds[-1].outcome
    elif outcome == "noop" and any(r.outcome == "applied" for r in rounds):
        outcome = "applied"
    return replace(last, outcome=outcome, stdout=stdout, stderr=stderr)


def _fleet_view(ports: PassPorts, prepared: _PreparedPass) -> tuple[FleetView | None, DesiredState]:
    """The fleet's view for an edge's status page and fleet metrics, read
    once activation is over (fleet_view.read_fleet_view), and the desired
    state with the files of the nodes it shows; (None, the pass's desired
    state) for any other host, or when the view cannot be read now (a note
    says why: the page keeps its last version)."""
    desired = prepared.desired
    if not shows_fleet(desired, prepared.host, prepared.source):
        return None, desired
    try:
        # The lanes of the plan this pass took (the leader's, signed): the edge reads no broker.
        view = read_fleet_view(lambda: ports.open_registry(desired.fleet), desired, prepared.source.plan)
        # From the pass's desired state: the plan's hosts are loaded already, only the snapshot's nodes may be new.
        page_desired = with_plan_hosts(replace(prepared.loaded, desired=desired), prepared.source.plan, view.snapshot)
    except RegistryError as exc:
        ports.note(f"status page not rewritten: the registry's view of the fleet cannot be read ({exc})")
        return None, desired
    except DesiredStateError as exc:
        ports.note(f"status page not rewritten: {'; '.join(str(problem) for problem in exc.problems)}")
        return None, desired
    for note in view.notes:
        ports.note(note)
    return view, page_desired


def _beat_after_activation(ports: PassPorts, prepared: _PreparedPass, store: GenerationStore) -> tuple[Measured, str] | None:
    """Beat again with the load after activation (see the module docstring):
    what was measured and the record's JSON, or None when this pass sent no
    heartbeat or the registry is gone now (the next pass beats)."""
    first = prepared.source.heartbeat
    if first is None:
        return None
    desired = prepared.desired
    try:
        measured, record, note = beat_after_activation(
            lambda: ports.open_registry(desired.fleet),
            desired,
            prepared.host,
            prepared.facts,
            units_seen(ports, store, desired),
            first,
            open_lanes=lambda: ports.open_lane_broker(desired.fleet),
        )
    except (RegistryError, LaneBrokerError) as exc:
        ports.note(
            f"heartbeat after activation: {'registry' if isinstance(exc, RegistryError) else 'lane queue'} unreachable ({exc}); the next pass beats"
        )
        return None
    if note is not None:
        ports.note(note)
    return measured, record.model_dump_json()


def _memo_seed(
    options: PassOptions, prepared: _PreparedPass, generation: int | None, beat: tuple[Measured, str] | None, *, showed_fleet: bool
) -> MemoSeed:
    artifacts = prepared.rendered.artifacts
    source = prepared.source
    uses_registry = isinstance(options.plan, PlanFromRegistry)
    measured, record = beat if beat is not None else (None, None)
    fleet = prepared.desired.fleet
    lanes = measured.lanes if measured is not None else ()
    if record is None and uses_registry:
        # No beat after activation (the registry could not be reached): the
        # memo keeps the first beat's record, or the unmeasured one, with no
        # epoch, so once the registry answers the memoized pass turns into a
        # full one, which measures again.
        first = source.heartbeat or node_record(prepared.desired, prepared.host, prepared.facts)
        record = first.model_dump_json()
    return MemoSeed(
        generation=generation,
        files=tuple(a.path for a in artifacts),
        units=tuple(a.unit for a in artifacts if a.unit),
        node_record=record if uses_registry else None,
        registry_epoch=source.registry_epoch if beat is not None else None,
        may_lead=uses_registry and prepared.host in prepared.desired.fleet.fleet.leader_candidates,
        fleet_view_max_age_s=float(prepared.desired.fleet.timing.node_timeout_s) if showed_fleet else None,
        load_services=measured.load.services if measured is not None else 0,
        lanes_here=lanes,
        lane_queues={lane.id: queue for lane in prepared.desired.lanes if lane.id in lanes and (queue := prepared.desired.queue_for(lane))},
        lane_broker=lane_broker_settings(fleet) if lanes else None,
        registry=registry_settings(fleet) if uses_registry else None,
        beat_ttl_s=float(heartbeat_timeout(fleet.timing, bool(prepared.facts.tailscale_relayed))) if uses_registry else None,
        desired_files=host_files_read(prepared.desired, prepared.host, source.plan),
    )


def registry_settings(fleet: FleetConfig) -> dict[str, Any]:
    """What opening the registry needs of fabric.toml, as JSON (PassMemo.registry)."""
    return {section: getattr(fleet, section).model_dump(mode="json") for section in ("registry", "timing", "flap")}


def lane_broker_settings(fleet: FleetConfig) -> dict[str, Any]:
    """What opening the lane queue needs of fabric.toml, as JSON (PassMemo.lane_broker;
    queue_url_file None: not configured)."""
    phaze = fleet.phaze
    return {"queue_url_file": None if phaze.queue_url_file is None else str(phaze.queue_url_file), "job_function": phaze.job_function}


def _pass_report(result: ApplyResult) -> PassReport:
    stdout, stderr = "", list(result.messages)
    if result.outcome == "noop":
        stdout = f"nothing to do (generation {result.generation})\n" if result.generation else "nothing to do\n"
    elif result.outcome == "applied":
        stdout = result.actions.text(files_done=True, activation_done=True) + f"generation {result.generation} is active\n"
    elif result.outcome == "written":
        stdout = (
            result.actions.text(files_done=True, activation_done=False) + f"generation {result.generation} written, not activated (--no-activate)\n"
        )
    elif result.outcome == "invalid":
        stderr.append("pass stopped before installing anything")
    elif result.outcome == "rolled-back":
        stdout = result.actions.text(files_done=True)
        stderr.append(f"pass failed; generation {result.generation} is active again")
    elif result.outcome == "failed":
        stdout = result.actions.text(files_done=True)
    return PassReport(result.outcome, stdout, tuple(stderr))  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# fabric plan


def preview_pass(options: PassOptions, ports: PassPorts) -> PassReport:
    """What `run_pass` would do with the same options. Reads the disk, the
    generations and (with activators) which units run; takes no lock and
    changes nothing."""
    try:
        prepared = _prepare(options, ports, write=False)
    except _BadInput as bad:
        return PassReport("bad-input", stderr=bad.lines)
    applier = _applier(ports, options.state_dir, options.caddy_main)
    static = prepared.source.static
    if static is not None:
        return PassReport("static", f"{static}\n")
    artifacts = prepared.rendered.artifacts
    try:
        actions, unfinished = applier.compute_actions(artifacts)
    except ActivationError as exc:
        if applier.activators is None:
            return PassReport("failed", stderr=(f"fabric plan: {exc}",))
        # systemd cannot be asked (no D-Bus here): plan from the files alone.
        ports.note(f"cannot ask systemd which units run ({exc}); planning from the files alone")
        applier.activators = None
        actions, unfinished = applier.compute_actions(artifacts)
    text = ("the last pass did not finish activating; this pass completes it\n" if unfinished else "") + actions.text()
    report = PassReport("planned", text, preview=Preview(prepared.host, actions, unfinished, tuple(prepared.rendered.notes)))
    return _bootstrap_after_admission(options, ports, report, dry_run=True)[0]


# --------------------------------------------------------------------------
# fabric rollback


def roll_back(options: RollbackOptions, ports: PassPorts) -> PassReport:
    """Reinstall generation `options.to` (default: the one before the last
    good one) and activate the difference, as a failed pass rolls back."""
    applier = _applier(ports, options.state_dir, options.caddy_main)
    try:
        number, actions = applier.rollback(options.to)
    except (ActivationError, LockBusy) as exc:
        return PassReport("failed", stderr=(f"fabric rollback: {exc}",))
    activated = applier.activators is not None
    closing = f"generation {number} is {'active' if activated else 'installed'} again\n"
    return PassReport("restored", actions.text(files_done=True, activation_done=activated) + closing)
