"""Node bootstrap (the seed's Node Bootstrap Agent): what a new node still needs.

Pure. `plan_bootstrap` compares what a node should have with what it has
(`Observed`, gathered by reconciler.adapters.bootstrap_io) and returns the
steps still missing, each with its reason. An empty plan is a node that is
ready: running `fabric bootstrap` a second time finds nothing to do.

The seed's order, and where each part lives:

1. tailscale_up       `tailscale up --auth-key=file:PATH` when the node is not
                      on the tailnet (the key is read by tailscale from the
                      file; it never appears on a command line or in a log)
2. detect_hardware    the probe (reconciler.core.probe), done by the caller: its
   build_labels       HostFacts and labels are an input here
3. register           a first heartbeat into the registry, unless the
                      registry already knows the node
4. join_k3s           the k3s join settings as a config.yaml.d drop-in:
                      `server` and `token-file` (a path, never the token),
                      for the k3s agent only: on a host where k3s runs as a
                      server (k3s.service) a `server:` key would make it join
                      as another server, so that is refused, as is a host
                      without k3s-agent.service (the fabric does not install
                      k3s). The agent is restarted to read the settings and
                      the bootstrap waits until its Node is Ready. The node
                      labels come from the reconcile pass's own drop-in
                      (50-fabric-labels.yaml) and its API call, so they have
                      one owner
5. nftables fix       CachyOS/Arch: their stock ruleset drops tailnet traffic
                      in `table inet filter`, and no accept in another table
                      can override a drop. The fix inserts accepts for the
                      Tailscale interface into that table, now and (through a
                      drop-in for nftables.service) after every reload of it,
                      which also reloads the fabric's own table the reload
                      flushed
6. socat redirects    the reconcile timer enabled and a first pass run, which
                      renders and starts this host's port maps
7. report_ready       the caller prints the outcome

First boot (`fabric bootstrap --first-boot`, run by fabric-bootstrap.service
once per machine: reconciler.core.install.units.bootstrap_service) plans the
same steps with three differences. The k3s labels are written before the
join (the pass's own drop-in, rendered by the pass's renderer, so the Node
registers with them and the file keeps one owner and one content). The
first pass is queued, not waited for: the unit is ordered before
fabric-reconcile.service, so a pass started from inside it would wait for
it. And the last step writes the stamp (BOOTSTRAP_STAMP) that keeps the
unit from running again; a step that fails stops the bootstrap before it,
so the next boot tries again. A machine without a host file (pending) gets
only what applies to it (`pending_boot_steps`): the tailnet, its pending
report (the caller's), the timer whose passes keep reporting it, the stamp;
no k3s join, no nftables fix and no port maps: a pending machine is given
no work, and k3s would schedule pods on a Node that joined.

The stamp's first word says what the bootstrap did: "pending" or
"complete" (`stamp_state`). Once `fabric admit` has reached a machine whose
stamp says pending, its first normal pass starts the unit again
(`after_admission`, carried out by reconciler.engine.bootstrap_start: the
stamp removed, the start queued, not waited for), which now runs the
declared host's steps (the k3s join with the labels) and writes the complete
stamp. Passes start it once: one that fails leaves no stamp and the next
boot runs it; one that leaves the stamp pending again is only reported.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from reconciler.core.desired.model import DesiredState, HostFacts
from reconciler.core.install.nodeconfig import NodeConfig
from reconciler.core.install.units import BOOTSTRAP_SERVICE, BOOTSTRAP_STAMP_PATH
from reconciler.core.live.host_limits import effective_limits
from reconciler.core.live.records import NodeRecord
from reconciler.core.render.artifacts import Layout, k3s_labels_dropin, needs_nftables_fix

# File names, relative to the root.
K3S_JOIN_DROPIN = "10-fabric-join.yaml"  # before the pass's 50-fabric-labels.yaml
K3S_LABELS_FILE = Layout().k3s_dropin  # the pass's own drop-in (at first boot, written before the join)
NFT_FIX_FILE = "etc/fabric/tailscale-fix.nft"
NFT_FIX_DROPIN = "etc/systemd/system/nftables.service.d/50-fabric-tailscale-fix.conf"
NFT_FIX_COMMENT = "fabric-tailscale-fix"
# The distro ruleset's table and chains the fix opens (Arch's and CachyOS's
# stock /etc/nftables.conf).
DISTRO_TABLE = ("inet", "filter")

# Written by the last step of a first-boot bootstrap (relative to the root);
# fabric-bootstrap.service runs only while it is absent.
BOOTSTRAP_STAMP = BOOTSTRAP_STAMP_PATH.lstrip("/")

RECONCILE_TIMER = "fabric-reconcile.timer"
RECONCILE_SERVICE = "fabric-reconcile.service"
NFT_TABLE_UNIT = "fabric-nftables.service"


@dataclass(frozen=True)
class Observed:
    """What the node has now (gathered by the adapters; fakes in tests)."""

    # None: tailscale is not installed.
    tailscale_running: bool | None
    registered: bool
    # Content of each file the bootstrap writes (relative path -> text or None).
    files: dict[str, str | None]
    # Whether the distro table exists, and whether the fix's rules are in it.
    distro_table_present: bool
    nft_fix_loaded: bool
    timer_active: bool
    # Active state of the socat unit of each of this host's port maps.
    socat_active: dict[str, bool]
    # k3s: whether it runs (or is enabled) here as a server (k3s.service),
    # whether k3s-agent.service is installed and active, and whether this
    # host's Node is Ready (None: the API could not be asked).
    k3s_server: bool = False
    k3s_agent_installed: bool = False
    k3s_agent_active: bool = False
    k3s_node_ready: bool | None = None


@dataclass(frozen=True)
class Programs:
    """Absolute paths the written drop-in calls (they differ between distros)."""

    nft: str = "/usr/sbin/nft"
    systemctl: str = "/usr/bin/systemctl"


StepKind = Literal[
    "tailscale_up",
    "report_pending",
    "register",
    "write_file",
    "restart_k3s_agent",
    "wait_k3s_node",
    "load_nft_fix",
    "daemon_reload",
    "enable_timer",
    "run_pass",
    "queue_pass",
    "write_stamp",
]
K3S_SERVER_UNIT = "k3s.service"
K3S_AGENT_UNIT = "k3s-agent.service"


@dataclass(frozen=True)
class Step:
    kind: StepKind
    reason: str
    path: str | None = None  # write_file: relative to the root
    content: str | None = None
    mode: int = 0o644
    argv: tuple[str, ...] = ()  # tailscale_up
    record: NodeRecord | None = None  # register
    node: str | None = None  # wait_k3s_node: the k3s Node's name

    def describe(self) -> str:
        target = f" {self.path}" if self.path else ""
        return f"{self.kind}{target}: {self.reason}"


@dataclass(frozen=True)
class BootstrapSteps:
    steps: tuple[Step, ...]
    # Things that stop the bootstrap (bad configuration for this node).
    problems: tuple[str, ...] = ()
    # Things the operator should know that are not failures.
    notes: tuple[str, ...] = field(default=())

    @property
    def nothing_to_do(self) -> bool:
        return not self.steps and not self.problems


def socat_units(desired: DesiredState, host: str) -> list[str]:
    """The port-map units the pass runs on this host (render names them so)."""
    return sorted(f"fabric-socat-{m.name}.service" for m in desired.fleet.port_maps if m.host == host)


def k3s_join_dropin(host: str, server: str, token_file: str) -> str:
    # JSON strings are valid YAML scalars: the values are quoted safely.
    return (
        f"# Written by fabric bootstrap for host {host}: do not edit.\n"
        "# Join settings only; the node labels are the reconcile pass's drop-in\n"
        "# (50-fabric-labels.yaml). The token stays in its file.\n"
        f"server: {json.dumps(server)}\n"
        f"token-file: {json.dumps(token_file)}\n"
    )


def nft_fix_ruleset(interface: str = "tailscale0") -> str:
    family, table = DISTRO_TABLE
    rules = [
        f'insert rule {family} {table} input iifname "{interface}" accept comment "{NFT_FIX_COMMENT}"',
        f'insert rule {family} {table} forward iifname "{interface}" accept comment "{NFT_FIX_COMMENT}"',
        f'insert rule {family} {table} forward oifname "{interface}" ct state established,related accept comment "{NFT_FIX_COMMENT}"',
    ]
    return (
        "# Written by fabric bootstrap: let the tailnet through the distro's ruleset\n"
        "# (CachyOS/Arch drop it in table inet filter; an accept in another table\n"
        "# cannot override that). Loaded after every start or reload of nftables.service.\n" + "\n".join(rules) + "\n"
    )


def nft_fix_dropin(programs: Programs) -> str:
    fix = f"-{programs.nft} -f /{NFT_FIX_FILE}"
    # The distro's reload flushes the whole ruleset, the fabric's table too:
    # reload the unit that loads it.
    table = f"-{programs.systemctl} --no-block try-reload-or-restart {NFT_TABLE_UNIT}"
    return (
        f"# Written by fabric bootstrap: do not edit.\n[Service]\nExecStartPost={fix}\nExecStartPost={table}\nExecReload={fix}\nExecReload={table}\n"
    )


def plan_bootstrap(
    *,
    node: NodeConfig,
    desired: DesiredState,
    host: str,
    facts: HostFacts,
    observed: Observed,
    programs: Programs = Programs(),
    first_boot: bool = False,
) -> BootstrapSteps:
    """The steps this node still needs, in the seed's order (`first_boot`:
    as fabric-bootstrap.service runs them, ending with the stamp)."""
    steps: list[Step] = []
    problems: list[str] = []
    notes: list[str] = []
    boot = node.bootstrap
    if host not in desired.hosts:
        return BootstrapSteps((), (f"host {host!r} is not in the desired state (hosts: {', '.join(sorted(desired.hosts))})",))
    host_config = desired.hosts[host]

    # 1. Tailscale
    _tailscale(node, host, observed, steps, problems, notes)

    # 3. Register
    if not observed.registered:
        limits = effective_limits(host_config, facts.limitations)
        record = NodeRecord.from_facts(
            host,
            facts,
            max_concurrent_tasks=limits.max_concurrent_tasks,
            max_concurrent_ceiling=limits.max_concurrent_ceiling,
            lowered_limits=list(limits.lowered),
        )
        steps.append(Step("register", "the registry does not know this node", record=record))

    def want_file(path: str, content: str, reason: str) -> bool:
        if observed.files.get(path) == content:
            return False
        steps.append(Step("write_file", reason if observed.files.get(path) is None else f"{reason} (changed)", path=path, content=content))
        return True

    # 4. k3s join settings, for an agent (at first boot, its labels first)
    if boot.k3s_server is not None and boot.k3s_token_file is not None:
        labels = k3s_labels_dropin(host, host_config, facts) if first_boot else None
        problems += _k3s_join(host, boot.k3s_server, boot.k3s_token_file, boot.k3s_config_dir, facts, observed, want_file, steps, labels)

    # 5. nftables fix (CachyOS/Arch, or as the host file says)
    if needs_nftables_fix(host_config, facts):
        want_file(NFT_FIX_FILE, nft_fix_ruleset(), "tailnet accepts for the distro ruleset")
        if want_file(NFT_FIX_DROPIN, nft_fix_dropin(programs), "re-apply the fix after nftables.service reloads"):
            steps.append(Step("daemon_reload", "a drop-in changed"))
        if not observed.distro_table_present:
            notes.append("no table inet filter loaded: nothing to open now (the drop-in applies the fix when nftables.service loads it)")
        elif not observed.nft_fix_loaded:
            steps.append(Step("load_nft_fix", "the distro ruleset does not let the tailnet through yet"))

    # 6. The reconcile timer and a first pass (starts the socat redirects)
    steps += _timer_and_pass(observed, first_boot)
    return BootstrapSteps(tuple(steps), tuple(problems), tuple(notes))


def _tailscale(node: NodeConfig, host: str, observed: Observed, steps: list[Step], problems: list[str], notes: list[str]) -> None:
    """Step 1: `tailscale up` with the auth-key file, when the node is not on the tailnet."""
    key_file = node.bootstrap.tailscale_auth_key_file
    if observed.tailscale_running is None:
        if key_file:
            problems.append("tailscale is not installed, but [bootstrap] tailscale_auth_key_file is set")
        else:
            notes.append("tailscale is not installed: the node is reached on its declared address only")
    elif not observed.tailscale_running:
        if key_file is None:
            problems.append("tailscale is not up and [bootstrap] tailscale_auth_key_file is not set")
        else:
            steps.append(Step("tailscale_up", "not on the tailnet", argv=("tailscale", "up", f"--auth-key=file:{key_file}", f"--hostname={host}")))


def _timer_and_pass(observed: Observed, first_boot: bool) -> list[Step]:
    """Step 6: the timer, and a pass that starts the port maps (queued at
    first boot: the bootstrap unit is ordered before the pass's); at first
    boot the stamp last."""
    steps: list[Step] = []
    if not observed.timer_active:
        steps.append(Step("enable_timer", f"{RECONCILE_TIMER} is not active"))
    inactive = sorted(unit for unit, active in observed.socat_active.items() if not active)
    kind: StepKind = "queue_pass" if first_boot else "run_pass"
    if inactive:
        steps.append(Step(kind, f"port maps not running: {', '.join(inactive)}"))
    elif not observed.timer_active:
        steps.append(Step(kind, "no pass has run on this node yet"))
    if first_boot:
        steps.append(stamp_step("the first-boot bootstrap is done", STAMP_COMPLETE))
    return steps


StampState = Literal["pending", "complete"]
STAMP_PENDING: StampState = "pending"
STAMP_COMPLETE: StampState = "complete"


def stamp_step(outcome: str, state: StampState) -> Step:
    """The first-boot bootstrap's last step: the stamp that keeps its unit
    from running again at boot, its first word what the bootstrap did
    (`stamp_state`): "pending" (no host file yet: the first pass after
    admission starts the unit again, `after_admission`) or "complete"."""
    again = "at boot until its first pass after `fabric admit`" if state == STAMP_PENDING else "again"
    return Step("write_stamp", f"{outcome}: {BOOTSTRAP_SERVICE} does not run {again}", path=BOOTSTRAP_STAMP, content=f"{state}: {outcome}\n")


def stamp_state(text: str | None) -> StampState | None:
    """What a stamp says the first-boot bootstrap did (None: no stamp). A
    stamp written before stamps named it ("HOST reported pending", "the
    first-boot bootstrap is done") reads by its words."""
    if text is None:
        return None
    first = text.strip().splitlines()[0] if text.strip() else ""
    return STAMP_PENDING if first.startswith(f"{STAMP_PENDING}:") or first.endswith("reported pending") else STAMP_COMPLETE


# In the pass's state directory: the pass started the bootstrap after
# admission (`after_admission`); it does not start it again while a stamp
# still says pending.
BOOTSTRAP_ASKED = "bootstrap-after-admission.json"
LEFT_PENDING = "bootstrap left pending at first boot"


@dataclass(frozen=True)
class AfterAdmission:
    """What a declared host's pass does about a bootstrap its first boot left
    pending: `start` the unit (the stamp removed first: the unit's condition
    skips it while the stamp is there), or only say `note`."""

    start: bool
    line: str


def after_admission(*, stamp: str | None, declared: bool, asked: bool, unit_failed: bool) -> AfterAdmission | None:
    """The pure decision of a host's pass about fabric-bootstrap.service.

    `stamp`: the stamp's text (None: none: the unit never ran to its end, and
    runs by itself at the next boot); `declared`: the host has a host file
    (not a group's member); `asked`: a pass started it after admission
    already (BOOTSTRAP_ASKED); `unit_failed`: the unit's ActiveState is
    "failed". A pending stamp of a declared host starts the unit once, without
    waiting for it (it is ordered before the pass, and queues a pass itself).
    It is never started twice by passes: one that failed left no stamp, and
    the next boot runs it (once per boot); one that left the stamp pending
    again is only reported."""
    state = stamp_state(stamp)
    if state is None:
        if asked and unit_failed:
            return AfterAdmission(
                False,
                f"{BOOTSTRAP_SERVICE} failed after admission ({LEFT_PENDING}); not started again by a pass: it runs again at the next boot, "
                f"or now with `systemctl start {BOOTSTRAP_SERVICE}` (journalctl -u {BOOTSTRAP_SERVICE})",
            )
        return None
    if state == STAMP_COMPLETE or not declared:
        return None
    if asked:
        return AfterAdmission(
            False,
            f"{BOOTSTRAP_SERVICE} ran after admission and left the bootstrap pending again: not started again "
            f"(journalctl -u {BOOTSTRAP_SERVICE}; to retry: rm {BOOTSTRAP_STAMP_PATH} && systemctl start {BOOTSTRAP_SERVICE})",
        )
    return AfterAdmission(True, f"start {BOOTSTRAP_SERVICE} ({LEFT_PENDING})")


def pending_boot_steps(node: NodeConfig, host: str, observed: Observed) -> BootstrapSteps:
    """First boot of a machine without a host file: the tailnet, its pending
    report, the timer whose passes keep reporting it, the stamp. Nothing that
    gives it work: no k3s join (k3s would schedule pods on its Node), no port
    maps, no nftables fix; those come with its host file (`fabric admit`)."""
    steps: list[Step] = []
    problems: list[str] = []
    notes: list[str] = []
    _tailscale(node, host, observed, steps, problems, notes)
    steps.append(Step("report_pending", "it has no host file in the desired state"))
    if node.bootstrap.k3s_server is not None:
        notes.append(
            f"k3s join skipped: {host} is pending (a pending machine is given no work); "
            f"its first pass after `fabric admit {host}` starts {BOOTSTRAP_SERVICE} again, which joins"
        )
    if not observed.timer_active:
        steps.append(Step("enable_timer", f"{RECONCILE_TIMER} keeps reporting it pending until it is admitted"))
    steps.append(stamp_step(f"{host} reported pending", STAMP_PENDING))
    return BootstrapSteps(tuple(steps), tuple(problems), tuple(notes))


def k3s_node_name(facts: HostFacts) -> str:
    """The Node k3s registers: the machine's host name, lower-cased (k3s's
    pkg/agent/config getHostnameAndIPs), unless node-name says otherwise."""
    return facts.k3s_hostname.lower()


def _k3s_join(
    host: str,
    server: str,
    token_file: str,
    config_dir: str,
    facts: HostFacts,
    observed: Observed,
    want_file: Callable[[str, str, str], bool],
    steps: list[Step],
    labels: str | None = None,
) -> list[str]:
    """The join's steps (appended to `steps`), or the problems that stop it;
    `labels`: the k3s label drop-in to write first (at first boot)."""
    if observed.k3s_server:
        return [
            f"k3s runs here as a server ({K3S_SERVER_UNIT}): its join settings would make it join {server} as another server; "
            "leave [bootstrap] k3s_server unset on this host"
        ]
    if not observed.k3s_agent_installed:
        return [
            f"the k3s agent is not installed ({K3S_AGENT_UNIT} not found): install it without starting it "
            "(curl -sfL https://get.k3s.io | INSTALL_K3S_EXEC=agent INSTALL_K3S_SKIP_START=true sh -), then run fabric bootstrap again"
        ]
    labelled = labels is not None and want_file(K3S_LABELS_FILE, labels, "k3s node labels, before the join")
    changed = want_file(f"{config_dir.strip('/')}/{K3S_JOIN_DROPIN}", k3s_join_dropin(host, server, token_file), "k3s join settings") or labelled
    if changed or not observed.k3s_agent_active:
        steps.append(Step("restart_k3s_agent", "to read the join settings" if changed else f"{K3S_AGENT_UNIT} is not running"))
    if changed or not observed.k3s_agent_active or not observed.k3s_node_ready:
        node = k3s_node_name(facts)
        steps.append(Step("wait_k3s_node", f"until the Node {node} is Ready", node=node))
    return []


def bootstrap_files(node: NodeConfig) -> list[str]:
    """Every file `plan_bootstrap` may write (relative to the root): what to observe."""
    files = [NFT_FIX_FILE, NFT_FIX_DROPIN]
    if node.bootstrap.k3s_server is not None:
        config_dir = node.bootstrap.k3s_config_dir.strip("/")
        files += [f"{config_dir}/{K3S_JOIN_DROPIN}", K3S_LABELS_FILE]
    return files
