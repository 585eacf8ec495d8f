"""The one place the real adapters are built; only `reconciler.cli` calls this.

Commands parse their arguments, take their adapters from here, and hand them
(as the ports they implement) to the engine and the core.

    registry = open_registry(desired.fleet)                    # as configured
    registry = open_registry(desired.fleet, sqlite_path=PATH)   # --registry-path / $FABRIC_REGISTRY

`sqlite_path` forces the sqlite backend at that file whatever [registry]
says (tests and the demo run a fleet on one machine without etcd).

    lane_broker = open_lane_broker(desired.fleet)                 # phaze's broker, DSN from [phaze] queue_url_file (reads)
    lane_broker = open_lane_broker(desired.fleet, dispatcher=True)  # [phaze] dispatcher_url_file (dispatch; unset: queue_url_file)

A `fabric reconcile` process opens each of them once (`pass_connections`):
the memo's side, the full pass and the edge's fleet view share one registry
client and one lane queue (reconciler.adapters.pass_connections).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reconciler.adapters.bootstrap_io import NodeIO
    from reconciler.adapters.git_source import GitSource
    from reconciler.adapters.lane_broker_pg import PostgresLaneBroker
    from reconciler.adapters.pass_connections import PassConnections
    from reconciler.adapters.registry_etcd import EtcdRegistry

    # Types only: a memoized pass (cli/reconcile.py) must not pay for the models.
    from reconciler.core.desired.model import DesiredState, FlapSettings, FleetConfig, HostFacts, RegistrySettings, TimingSettings
    from reconciler.core.install.bootstrap import Programs
    from reconciler.core.install.nodeconfig import NodeConfig
    from reconciler.engine.memoized_pass import MemoPorts
    from reconciler.engine.pass_options import PassOptions
    from reconciler.engine.probe import LiveProbe
    from reconciler.engine.reconcile import PassPorts, ProgramPaths, RollbackOptions
    from reconciler.ports import (
        Audit,
        BeatLaneBroker,
        BeatRegistry,
        BrokerRoleAdmin,
        CaptureStore,
        Clock,
        CommandRunner,
        DesiredCheckout,
        FileReader,
        FileTree,
        HookRunner,
        LaneBroker,
        PassStarter,
        PlanSigner,
        RayState,
        Registry,
        RegistryAuth,
    )


def open_registry(
    fleet: FleetConfig,
    *,
    clock: Clock | None = None,
    sqlite_path: str | Path | None = None,
    op_timeout_s: float = 3.0,
) -> Registry:
    """The configured backend, connected lazily (etcd) or opened (sqlite).

    Raises `RegistryUnavailable` when a sqlite file cannot be opened; an etcd
    cluster is only contacted by the first call."""
    clock = clock or system_clock()
    settings = fleet.registry
    if sqlite_path is not None or settings.backend == "sqlite":
        from reconciler.adapters.registry_sqlite import SqliteRegistry

        return SqliteRegistry(sqlite_path or settings.path, timing=fleet.timing, flap=fleet.flap, clock=clock)

    return _etcd_registry(fleet, clock, op_timeout_s)


def registry_auth(fleet: FleetConfig) -> RegistryAuth:
    """etcd's users, roles and auth switch, reached with [registry]'s endpoints
    and certificates (give `fleet` a root identity's cert_file/key_file)."""
    return _etcd_registry(fleet, system_clock())


def _etcd_registry(fleet: FleetConfig, clock: Clock, op_timeout_s: float = 3.0) -> EtcdRegistry:
    """The etcd cluster of [registry]: its endpoints, prefix and TLS identity."""
    return _etcd_registry_of(fleet.registry, fleet.timing, fleet.flap, clock, op_timeout_s)


def _etcd_registry_of(
    settings: RegistrySettings, timing: TimingSettings, flap: FlapSettings, clock: Clock, op_timeout_s: float = 3.0
) -> EtcdRegistry:
    from reconciler.adapters.registry_etcd import EtcdRegistry

    return EtcdRegistry(
        list(settings.endpoints),
        prefix=settings.prefix,
        timing=timing,
        flap=flap,
        clock=clock,
        ca_file=settings.ca_file,
        cert_file=settings.cert_file,
        key_file=settings.key_file,
        op_timeout_s=op_timeout_s,
    )


def _etcd_key(settings: RegistrySettings, timing: TimingSettings, flap: FlapSettings, op_timeout_s: float = 3.0) -> str:
    """What an etcd client is built from, as the key it is kept under in a
    pass's connections: the memo's side (from the memo's copy of fabric.toml's
    sections) and the full pass (from fabric.toml) agree on it."""
    import json

    return "etcd " + json.dumps([*(part.model_dump(mode="json") for part in (settings, timing, flap)), op_timeout_s], sort_keys=True)


def open_existing_registry(fleet: FleetConfig, *, sqlite_path: str | Path | None = None) -> Registry:
    """`open_registry` for commands that only look: a sqlite registry that is not
    there raises `RegistryUnavailable` instead of being created."""
    from reconciler.ports import RegistryUnavailable

    if sqlite_path is not None or fleet.registry.backend == "sqlite":
        path = Path(sqlite_path or fleet.registry.path)
        if not path.is_file():
            raise RegistryUnavailable(f"{path}: no such registry (has any host joined?)")
    return open_registry(fleet, sqlite_path=sqlite_path)


def queue_url_file(fleet: FleetConfig, override: str | Path | None = None, *, dispatcher: bool = False) -> Path | None:
    """Where phaze's broker DSN is: `override` (--queue-url-file), else for a
    `dispatcher` [phaze] dispatcher_url_file, else [phaze] queue_url_file
    (the reader's); None when none says."""
    chosen = override or (fleet.phaze.dispatcher_url_file if dispatcher else None) or fleet.phaze.queue_url_file
    return Path(chosen) if chosen else None


def open_lane_broker(fleet: FleetConfig, *, dsn_file: str | Path | None = None, clock: Clock | None = None, dispatcher: bool = False) -> LaneBroker:
    """The lane queue on phaze's broker (SAQ on PostgreSQL), as a reader or
    (`dispatcher`) as the dispatcher (`queue_url_file`). The DSN is read
    from its file here and goes nowhere else. Raises LaneBrokerUnavailable
    (naming the file, never its content) when there is no file to read, it
    cannot be read, or the broker does not answer."""
    from reconciler.ports import LaneBrokerUnavailable

    path = queue_url_file(fleet, dsn_file, dispatcher=dispatcher)
    if path is None:
        raise LaneBrokerUnavailable("fabric.toml: phaze.queue_url_file: not set (the file holding phaze's PHAZE_QUEUE_URL)")
    return _lane_broker_at(path, fleet.phaze.job_function, clock)


def _dsn_at(path: Path) -> str:
    """The broker DSN in the file `path` (a secret: adapters.secret_files);
    raises LaneBrokerUnavailable naming the file, never its content."""
    from reconciler.adapters.secret_files import SecretFileRefused, read_secret_file
    from reconciler.ports import LaneBrokerUnavailable

    try:
        # A secret: only a file no one else may read (adapters.secret_files).
        dsn = read_secret_file(path, "phaze's queue URL").decode("utf-8").strip()
    except SecretFileRefused as exc:
        raise LaneBrokerUnavailable(str(exc)) from None
    except UnicodeDecodeError:
        raise LaneBrokerUnavailable(f"{path}: phaze's queue URL is not UTF-8 text") from None
    if not dsn.startswith(("postgresql://", "postgres://")):
        raise LaneBrokerUnavailable(f"{path}: not a postgresql:// URL (phaze's broker is SAQ on PostgreSQL)")
    # Imported once there is a broker to reach (psycopg is a large part of a pass's imports).
    from reconciler.adapters.lane_broker_pg import dsn_problem

    problem = dsn_problem(dsn)
    if problem is not None:
        raise LaneBrokerUnavailable(f"{path}: {problem}")
    return dsn


def _lane_broker_at(path: Path, job_function: str, clock: Clock | None = None) -> PostgresLaneBroker:
    dsn = _dsn_at(path)
    from reconciler.adapters.lane_broker_pg import PostgresLaneBroker

    return PostgresLaneBroker(dsn, clock or system_clock(), job_function=job_function)


def broker_role_admin(admin_url_file: Path) -> BrokerRoleAdmin:
    """phaze's broker's roles (`fabric lane init-roles`), with the DSN of the
    tables' owner in `admin_url_file`. Raises LaneBrokerUnavailable when the
    file cannot be used."""
    dsn = _dsn_at(admin_url_file)
    from reconciler.adapters.lane_broker_roles import PostgresBrokerRoles

    return PostgresBrokerRoles(dsn)


def lane_broker_if_configured(
    fleet: FleetConfig, *, note: Callable[[str], None], connections: PassConnections | None = None, dispatcher: bool = False
) -> LaneBroker | None:
    """`open_lane_broker` for users that carry on without it (a pass, the
    leader, `fabric status`): None, with a note, when the broker cannot be
    used; None silently when no queue URL file is configured at all.
    `connections`: the lane queue kept there for the same file (opened if
    there is none; one that could not be opened is tried again next time)."""
    path = queue_url_file(fleet, dispatcher=dispatcher)
    if path is None:
        return None
    return _lane_broker_noted(path, fleet.phaze.job_function, note, connections)


def memo_lane_broker_opener(connections: PassConnections | None = None) -> Callable[[Mapping[str, Any]], BeatLaneBroker | None]:
    """Opens the lane queue a pass memo names (PassMemo.lane_broker: fabric.toml's
    [phaze] queue_url_file and job_function) as `lane_broker_if_configured`
    opens it from fabric.toml (no model imported); kept in `connections`,
    when given, for the full pass that may follow."""

    def connect(reach: Mapping[str, Any]) -> BeatLaneBroker | None:
        if reach.get("queue_url_file") is None:
            return None
        return _lane_broker_noted(Path(reach["queue_url_file"]), reach["job_function"], print_note, connections)

    return connect


def _lane_broker_noted(path: Path, job_function: str, note: Callable[[str], None], connections: PassConnections | None) -> PostgresLaneBroker | None:
    from reconciler.ports import LaneBrokerError

    try:
        if connections is None:
            return _lane_broker_at(path, job_function)
        return connections.kept(f"lane queue {path} {job_function}", lambda kept: kept or _lane_broker_at(path, job_function))
    except LaneBrokerError as exc:
        note(f"lane queue: {exc}; lanes shown without their queues")
        return None


# --------------------------------------------------------------------------
# The other real adapters. Imported when asked for: a command pays only for
# the adapters it uses.


def local_tree(root: Path) -> FileTree:
    """The files under `root` (/ on a host, a sandbox in tests and the demo)."""
    from reconciler.adapters.files import LocalTree

    return LocalTree(root)


def system_clock() -> Clock:
    from reconciler.adapters.clock import SystemClock

    return SystemClock()


def command_runner() -> CommandRunner:
    """Programs run without a shell, with a timeout, in the C locale."""
    from reconciler.adapters.commands import SubprocessRunner

    return SubprocessRunner()


def local_files() -> FileReader:
    """This machine's /proc, /sys and /dev/dri, for the probe."""
    from reconciler.adapters.local_files import LocalFiles

    return LocalFiles()


def capture_store() -> CaptureStore:
    """Probe capture directories (`fabric probe --capture/--replay DIR`); they raise `CaptureError`."""
    from reconciler.adapters.probe_io import CaptureDirectory

    return CaptureDirectory()


def probe_facts(host: str | None, replay: str | None) -> HostFacts:
    """This machine's facts, probed live or re-parsed from the capture in `replay`.
    Raises `CaptureError` for an unreadable capture directory."""
    from reconciler.core.probe import RawCapture, facts_from_capture
    from reconciler.engine.probe import collect_live

    if replay:
        outputs, errors = capture_store().load(replay)
        capture = RawCapture(outputs, errors)
    else:
        capture = collect_live(command_runner(), local_files())
    return facts_from_capture(capture, host=host)


def probe_live(reuse: Mapping[str, Mapping[str, Any]] | None = None) -> LiveProbe:
    """This machine's raw probe outputs (the memoized pass's probe), reusing
    what `reuse` (the pass memo's) holds of commands whose inputs did not
    change: the adapters and parsers it needs import no model."""
    from reconciler.adapters.local_files import LocalFiles
    from reconciler.engine.probe import collect_live_reusing

    return collect_live_reusing(command_runner(), LocalFiles(), reuse)


@contextmanager
def leader_ports() -> Iterator[tuple[HookRunner, Audit | None]]:
    """fabric-leader's cloud hooks (each a transient unit of systemd's,
    never in the leader's process) and its audit: journal entries of their own
    when journald is there, else none (its stderr log, the unit's journal,
    says it all)."""
    from reconciler.adapters.hook_units import SystemdRunHooks
    from reconciler.adapters.journal import JournalAudit

    journal = JournalAudit(identifier="fabric-leader")
    try:
        yield SystemdRunHooks(command_runner()), journal if journal.to_journal else None
    finally:
        journal.close()


@contextmanager
def pass_starter(unit: str, systemd_bus: str | None) -> Iterator[PassStarter]:
    """`fabric watch`'s way to start a pass: `unit` over D-Bus (the system bus
    unless `systemd_bus`); the connection is closed on leaving."""
    from reconciler.adapters.systemd_dbus import UnitPassStarter

    starter = UnitPassStarter(unit, systemd_bus)
    try:
        yield starter
    finally:
        starter.close()


def plan_signer(key_file: Path) -> PlanSigner:
    """A leader candidate's plan signing key in `key_file`, read when first used
    (a host that never leads never opens it); raises `PlanSigningError` then."""
    from reconciler.adapters.plan_signing import KeyFileSigner

    return KeyFileSigner(key_file)


def ray_state(address: str) -> RayState:
    """Ray's state API at `address` (the leader's view of the fleet's Ray
    cluster). Raises ImportError when `ray` (the extra `ray`) is not installed."""
    from reconciler.adapters.ray_state import RayStateReader

    return RayStateReader(address)


def generate_plan_key(out: Path) -> bytes:
    """`fabric leader keygen`: a new private key in `out` (0600, never
    overwritten); returns the raw public key. Raises `PlanSigningError`."""
    from reconciler.adapters.plan_signing import generate_key_file

    return generate_key_file(out)


def desired_source(node: NodeConfig) -> GitSource:
    """The desired-state checkout node.toml's [source] names (`fabric pull`); node.source must be set."""
    from reconciler.adapters.git_source import GitSource

    assert node.source is not None
    return GitSource(
        command_runner(),
        node.source,
        checkout=Path(node.node.desired),
        known_hosts=Path(node.node.state_dir) / "known_hosts",
    )


def bootstrap_io(registry: Registry, root: Path) -> NodeIO:
    """What `fabric bootstrap` observes and does on this node, files under `root`; steps raise `BootstrapError`."""
    from reconciler.adapters.bootstrap_io import NodeIO
    from reconciler.adapters.k3s_node import KubeletNodeLabels
    from reconciler.core.render.k3s_node import KUBELET_KUBECONFIG

    # The kubelet's kubeconfig appears once k3s-agent has started: it is read when asked.
    return NodeIO(command_runner(), registry, root=root, node_api=KubeletNodeLabels(str(root / KUBELET_KUBECONFIG.lstrip("/"))))


def read_text_or_none(path: Path) -> str | None:
    """A small file of ours (node.toml), None when it is not there."""
    from reconciler.adapters.install_files import read_text_or_none

    return read_text_or_none(path)


def write_atomic(path: Path, text: str) -> bool:
    """Install one of our files (a unit) atomically; False when it already holds `text`."""
    from reconciler.adapters.install_files import write_atomic

    return write_atomic(path, text)


def bootstrap_programs() -> Programs:
    """nft and systemctl found on PATH, for the drop-in `fabric bootstrap` writes (they differ between distros)."""
    import shutil

    from reconciler.core.install.bootstrap import Programs

    return Programs(nft=shutil.which("nft") or Programs.nft, systemctl=shutil.which("systemctl") or Programs.systemctl)


def host_name() -> str:
    """This machine's short host name, lowercased as the desired state names
    hosts (the fabric host it is, unless told otherwise)."""
    import socket

    return socket.gethostname().split(".")[0].lower()


# --------------------------------------------------------------------------
# A reconcile pass, `fabric plan` and `fabric rollback`: the real PassPorts.


def registry_path(sqlite_path: Path | None, root: Path, fleet: FleetConfig) -> Path | None:
    """--registry-path, or the sqlite file of [registry] under a sandbox root."""
    return _registry_path(sqlite_path, root, fleet.registry.backend, fleet.registry.path)


def _registry_path(sqlite_path: Path | None, root: Path, backend: str, path: str) -> Path | None:
    if sqlite_path is not None:
        return sqlite_path
    if backend == "sqlite" and Path(root) != Path("/"):
        return Path(root) / path.lstrip("/")
    return None


def program_paths() -> ProgramPaths:
    """socat, podman, nft, systemd-tmpfiles, systemd-sysusers and ray found on PATH: on NixOS they live in the store
    (the module puts them on the pass's PATH), on Debian in /usr/bin."""
    import shutil

    from reconciler.core.pass_files import PROGRAMS
    from reconciler.engine.reconcile import ProgramPaths

    default = ProgramPaths()
    # [ray] command, when set, wins over `ray` here (reconciler.core.render.ray_units).
    fields = {program: program.replace("-", "_") for program in PROGRAMS}
    return ProgramPaths(**{field: shutil.which(program) or getattr(default, field) for program, field in fields.items()})


def print_note(note: str) -> None:
    import sys

    print(f"note: {note}", file=sys.stderr)


def registry_opener(options: PassOptions, connections: PassConnections | None = None) -> Callable[[FleetConfig], Registry]:
    """Opens the registry of a pass: [registry] as configured, or the sqlite
    file of --registry-path (or of [registry] under a sandbox root).
    `connections`: the one kept there for the same settings (opened if there
    is none; on the connection of the memo's side's sqlite file if it opened one)."""
    from reconciler.engine.pass_options import PlanFromRegistry

    sqlite_path = options.plan.sqlite_path if isinstance(options.plan, PlanFromRegistry) else None

    def connect(fleet: FleetConfig) -> Registry:
        path = registry_path(sqlite_path, options.root, fleet)
        if connections is None:
            return open_registry(fleet, sqlite_path=path)
        if path is not None or fleet.registry.backend == "sqlite":
            key = f"sqlite {Path(path or fleet.registry.path)}"
        else:
            key = _etcd_key(fleet.registry, fleet.timing, fleet.flap)
        return connections.kept(key, lambda kept: _full_registry(fleet, path, kept))

    return connect


def joining_fleet(fleet: FleetConfig) -> FleetConfig:
    """fabric.toml with the joining identity as [registry]'s client
    certificate, when it names one (a machine without a host file reports
    pending with it); else as it is."""
    settings = fleet.registry
    if settings.joining_cert_file is None:
        return fleet
    joining = settings.model_copy(update={"cert_file": settings.joining_cert_file, "key_file": settings.joining_key_file})
    return fleet.model_copy(update={"registry": joining})


def pending_opener(options: PassOptions, connections: PassConnections | None = None) -> Callable[[FleetConfig], Registry]:
    """Opens the registry a pending machine reports to: `registry_opener`'s, as the joining identity."""
    connect = registry_opener(options, connections)
    return lambda fleet: connect(joining_fleet(fleet))


def _full_registry(fleet: FleetConfig, sqlite_path: Path | None, kept: Any) -> Registry:
    """The registry a pass process keeps for fabric.toml's [registry]: `kept`,
    the one it opened already; opened when there is none; when the memo's side
    opened only the sqlite file's standard-library base, the full registry on
    that file's connection."""
    from reconciler.adapters.registry_sqlite_file import SqliteFile

    if kept is None:
        return open_registry(fleet, sqlite_path=sqlite_path)
    if type(kept) is SqliteFile:
        from reconciler.adapters.registry_sqlite import SqliteRegistry

        return SqliteRegistry(kept.path, timing=fleet.timing, flap=fleet.flap, clock=system_clock(), opened=kept)
    return kept


def memo_registry_opener(
    options: PassOptions, clock: Clock | None = None, connections: PassConnections | None = None
) -> Callable[[Mapping[str, Any]], BeatRegistry]:
    """Opens the registry a pass memo names (PassMemo.registry: fabric.toml's
    [registry], [timing], [flap]) as `registry_opener` opens it from
    fabric.toml: the sqlite file through its standard-library base (no model
    imported), an etcd cluster through the etcd adapter; kept in
    `connections`, when given, for the full pass that may follow."""
    from reconciler.engine.pass_options import PlanFromRegistry

    sqlite_path = options.plan.sqlite_path if isinstance(options.plan, PlanFromRegistry) else None

    def connect(reach: Mapping[str, Any]) -> BeatRegistry:
        beat_clock = clock or system_clock()
        settings = reach["registry"]
        backend, path = settings["backend"], settings["path"]
        if sqlite_path is not None or backend == "sqlite":
            from reconciler.adapters.registry_sqlite_file import SqliteFile

            file = Path(_registry_path(sqlite_path, options.root, backend, path) or path)
            if connections is None:
                return SqliteFile(file, clock=beat_clock)
            return connections.kept(f"sqlite {file}", lambda kept: kept or SqliteFile(file, clock=beat_clock))
        from reconciler.core.desired.model import FlapSettings, RegistrySettings, TimingSettings

        registry = RegistrySettings.model_validate(settings)
        timing, flap = TimingSettings.model_validate(reach["timing"]), FlapSettings.model_validate(reach["flap"])
        if connections is None:
            return _etcd_registry_of(registry, timing, flap, beat_clock)
        return connections.kept(_etcd_key(registry, timing, flap), lambda kept: kept or _etcd_registry_of(registry, timing, flap, beat_clock))

    return connect


@contextmanager
def pass_connections() -> Iterator[PassConnections]:
    """The connections of one pass process (`fabric reconcile`: the memo's
    side and the full pass), each closed once on leaving."""
    from reconciler.adapters.pass_connections import PassConnections

    connections = PassConnections()
    try:
        yield connections
    finally:
        connections.close()


@contextmanager
def real_pass_ports(options: PassOptions, connections: PassConnections | None = None) -> Iterator[PassPorts]:
    """The ports of `fabric reconcile` and `fabric plan`; the D-Bus connection is closed on leaving.
    The registry and the lane queue are opened once, in `connections` (when
    not given: connections of these ports alone, closed on leaving)."""
    if connections is None:
        with pass_connections() as own:
            with real_pass_ports(options, own) as ports:
                yield ports
        return
    with _pass_ports(
        options.root,
        options.state_dir,
        check=not options.no_activate or options.validate,
        activate=not options.no_activate,
        systemd_bus=options.systemd_bus,
        caddy_admin=options.caddy_admin,
        startup_grace=options.startup_grace,
    ) as ports:
        ports.open_registry = registry_opener(options, connections)
        ports.open_pending = pending_opener(options, connections)
        ports.open_lane_broker = lambda fleet: lane_broker_if_configured(fleet, note=print_note, connections=connections)
        ports.open_dispatch_broker = lambda fleet: lane_broker_if_configured(fleet, note=print_note, connections=connections, dispatcher=True)
        ports.plan_signer = plan_signer(options.plan_key_file)
        yield ports


@contextmanager
def real_rollback_ports(options: RollbackOptions) -> Iterator[PassPorts]:
    """The ports of `fabric rollback` (no registry); the D-Bus connection is closed on leaving."""
    with _pass_ports(
        options.root,
        options.state_dir,
        check=not options.no_activate,
        activate=not options.no_activate,
        systemd_bus=options.systemd_bus,
        caddy_admin=options.caddy_admin,
        startup_grace=options.startup_grace,
    ) as ports:
        yield ports


@contextmanager
def _pass_ports(
    root: Path,
    state_dir: str,
    *,
    check: bool,
    activate: bool,
    systemd_bus: str | None,
    caddy_admin: str,
    startup_grace: float,
) -> Iterator[PassPorts]:
    from reconciler.adapters.compiled_templates import CompiledTemplates, cache_directory
    from reconciler.adapters.files import FlockLock, LocalTree
    from reconciler.adapters.journal import JournalAudit
    from reconciler.adapters.memo_io import git_commit
    from reconciler.core.templating import Templates
    from reconciler.engine.apply import Activators, Validators
    from reconciler.engine.reconcile import PassPorts

    runner = command_runner()
    validators = activators = systemd = None
    if check:
        from reconciler.adapters.caddy import CaddyAdmin
        from reconciler.adapters.nftables import NftCommand
        from reconciler.adapters.unit_verify import SystemdAnalyzeVerifier

        caddy = CaddyAdmin(runner, admin_address=caddy_admin)
        nft = NftCommand(runner)
        validators = Validators(SystemdAnalyzeVerifier(runner), nft, caddy)
        if activate:
            from reconciler.adapters.systemd_dbus import SystemdDbus

            # A Type=exec service counts as started once exec'd: the grace
            # catches one that exits at once (a port already taken, say).
            systemd = SystemdDbus(systemd_bus, startup_grace=startup_grace)
            from reconciler.adapters.k3s_node import KubeletNodeLabels
            from reconciler.core.render.k3s_node import KUBELET_KUBECONFIG

            # A k3s agent ran here once: it left the kubelet's kubeconfig.
            kubeconfig = Path(root) / KUBELET_KUBECONFIG.lstrip("/")
            node_labels = KubeletNodeLabels(str(kubeconfig)) if kubeconfig.is_file() else None
            activators = Activators(systemd, nft, caddy, node_labels=node_labels)
    audit = JournalAudit()
    compiled = CompiledTemplates(cache_directory(root, state_dir))
    try:
        yield PassPorts(
            tree=LocalTree(root),
            lock=FlockLock(Path(root) / state_dir.strip("/") / "lock"),
            audit=audit,
            clock=system_clock(),
            probe=probe_facts,
            validators=validators,
            activators=activators,
            programs=program_paths(),
            note=print_note,
            desired_commit=git_commit,
            keep_caches=compiled.keep,
            templates=Templates(compiled=compiled),
        )
    finally:
        # The D-Bus connection's event loop dies with a task pending unless closed.
        if systemd is not None:
            systemd.close()
        audit.close()


# --------------------------------------------------------------------------
# The pass memo's ports (reconciler.engine.memoized_pass): standard library
# adapters, so that a memoized pass imports no model.


@contextmanager
def memo_ports(options: PassOptions, connections: PassConnections | None = None) -> Iterator[MemoPorts]:
    """The memo's ports of `fabric reconcile`; the D-Bus connection and the journal are closed on leaving.
    The registry and the lane queue are kept in `connections` for the full
    pass that may follow (when not given: opened anew for each use)."""
    from reconciler.adapters import memo_io
    from reconciler.engine.memoized_pass import MemoPorts

    world = memo_io.MemoWorld(options.root, activating=not options.no_activate, systemd_bus=options.systemd_bus)
    audit = memo_io.OneLineAudit()
    try:
        yield MemoPorts(
            store=memo_io.MemoFiles(),
            world=world,
            audit=audit,
            clock=system_clock(),
            probe=probe_live,
            open_registry=memo_registry_opener(options, connections=connections),
            open_lane_broker=memo_lane_broker_opener(connections),
            note=print_note,
        )
    finally:
        world.close()
        audit.close()


def desired_checkout(directory: Path, node_config: Path | None) -> DesiredCheckout:
    """The desired-state checkout `fabric admit` commits to: signed commits
    when its git config says so, or when `node_config` (this machine's
    node.toml, when it has one) requires them of the remote. Raises
    ProblemsError for a node.toml that does not parse."""
    from reconciler.adapters.desired_checkout import GitCheckout
    from reconciler.core.install.nodeconfig import parse_node_config

    reason = None
    if node_config is not None and node_config.is_file():
        config = parse_node_config(node_config.read_text(encoding="utf-8"), str(node_config))
        if config.source is not None and config.source.require_signed_commits:
            reason = f"{node_config}: source.require_signed_commits (hosts accept only signed commits)"
    return GitCheckout(command_runner(), directory, node_requires_signing=reason)


def caddy_upstreams_reader(admin_address: str) -> Callable[[], object]:
    """fabric-watch on an edge host: its Caddy's upstreams, read through the
    admin API at `admin_address` (issue 30's edge source of suspicion)."""
    from reconciler.adapters.caddy import CaddyAdmin

    admin = CaddyAdmin(command_runner(), admin_address=admin_address, timeout=5.0)
    return admin.upstreams


def leader_desired(directory: Path) -> Callable[[], DesiredState]:
    """The candidate's desired state: loaded again only when its directory
    changed (reconciler.adapters.desired_memo)."""
    from reconciler.adapters.desired_memo import DesiredMemo

    return DesiredMemo(directory)
