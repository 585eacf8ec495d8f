"""The fabric's own systemd units, defined once for both install paths.

Pure. `fabric-reconcile.service` (one pass, then exit), `fabric-reconcile.timer`
(on boot, then every interval), `fabric-watch.service` (starts a pass as soon
as the registry changes for this host), `fabric-bootstrap.service` (the
bootstrap agent, once at first boot) and, on leader candidates,
`fabric-leader.service`.
`scripts/join.sh` installs exactly what `fabric units --write DIR` renders from
here; the NixOS module (modules/fabric.nix) declares the same values in Nix,
and tests/unit/test_nix_module.py evaluates the module and compares its command,
timer and hardening with these definitions, so the two paths cannot drift.

The values are systemd's own spelling ("true", "30s"); a list is a setting
given several times.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from reconciler.core.install.nodeconfig import NodeConfig

RECONCILE_SERVICE = "fabric-reconcile.service"
RECONCILE_TIMER = "fabric-reconcile.timer"
LEADER_SERVICE = "fabric-leader.service"
WATCH_SERVICE = "fabric-watch.service"
BOOTSTRAP_SERVICE = "fabric-bootstrap.service"

# The first-boot bootstrap runs once: its last step writes this stamp
# (reconciler.core.install.bootstrap.BOOTSTRAP_STAMP, under the root), and
# the unit's condition skips it while the stamp is there. A failed step
# leaves no stamp: the next boot runs it again.
BOOTSTRAP_STAMP_PATH = "/var/lib/fabric/bootstrap.stamp"
BOOTSTRAP_CONDITION = f"!{BOOTSTRAP_STAMP_PATH}"
# tailscale up, a k3s agent's join (it waits for the Node to be Ready, up to
# five minutes), the first pass only queued.
BOOTSTRAP_TIMEOUT = "15min"
# Ordering: after the network and tailscaled (the tailnet step needs the
# daemon; After= on a unit that is not installed orders nothing), before the
# pass, so the timer's first pass at boot runs on the bootstrapped machine.
BOOTSTRAP_AFTER = ("network-online.target", "tailscaled.service")
BOOTSTRAP_BEFORE = ("fabric-reconcile.service",)

# The journal identifier of every pass: `journalctl -t fabric-reconcile` shows
# the pass's output and the audit entries together.
SYSLOG_IDENTIFIER = "fabric-reconcile"

# First pass this long after boot (the timer then counts from each pass).
ON_BOOT_SEC = "15s"
# The default AccuracySec is one minute: a 30 s interval would drift to a minute.
ACCURACY_SEC = "1s"
# A pass that hangs must not hold the timer forever (the timer never starts a
# unit that is still running).
PASS_TIMEOUT = "10min"
# No start rate limit on the pass. The timer, the watcher (one start per new
# plan concerning this host, each once the last pass has ended) and an
# operator start it. systemd's default limit (5 starts in 10 s, counted while
# the timer keeps the unit loaded) refuses the next start, while StartUnit
# still returns a job: the watcher would log a start, nothing would run, and
# that plan would wait for the timer's tick (seen in the e2e fleet: a few
# passes in a row, then a drain's plan left for 27 s). The pass's own lock
# keeps passes one at a time, and the watcher never starts one while one runs.
PASS_START_LIMIT_INTERVAL = "0"

# The leader campaigns for as long as it runs; systemd brings it back.
LEADER_SUBCOMMAND = ("leader", "run")
LEADER_RESTART_SEC = "5s"

# The watcher follows the registry for as long as it runs; it exits only on
# a failure a retry would not mend (the registry refused its identity), and
# systemd brings it back after a pause; the timer's passes go on meanwhile.
WATCH_SUBCOMMAND = ("watch",)
WATCH_RESTART_SEC = "5s"

# Hardening shared by the reconcile pass, the leader and the watcher. A pass runs as root
# because it manages units (D-Bus to systemd), loads nft tables
# (CAP_NET_ADMIN) and probes hardware, so the limits are on what it can reach:
# - ProtectSystem=strict: the whole tree read-only except what a pass
#   writes: the unit directories, /etc/fabric (the nft file), /etc/caddy (the
#   site snippet), the k3s drop-in directory, /etc/phaze (phaze's
#   backends.toml on the control host), /etc/sysusers.d (a podman
#   workload's user, made by its account unit), node_exporter's textfile
#   directory (the pass's metrics) and its state directory. The '-' prefix
#   makes a missing directory (no k3s here) not an error.
# - no PrivateDevices: the probe must see /dev/dri and /dev/nvidia* or a GPU
#   host would report itself a CPU box.
# - UMask=0022: the Caddy snippet and rendered units must stay readable by
#   Caddy's own user and by systemd; secrets never pass through the fabric's
#   files (they are referenced by path).
# - no MemoryDenyWriteExecute: Python's ctypes/libffi closures need it off.
# - AF_NETLINK: nft talks netlink; AF_UNIX: D-Bus and the journal.
HARDENING: dict[str, str | tuple[str, ...]] = {
    "ProtectSystem": "strict",
    "ReadWritePaths": (
        "-/etc/systemd/system",
        "-/run/systemd/system",
        "-/etc/fabric",
        "-/etc/caddy",
        "-/etc/rancher/k3s",
        "-/etc/phaze",
        "-/etc/sysusers.d",
        "-/var/lib/node_exporter/textfile",
    ),
    "StateDirectory": "fabric",
    "StateDirectoryMode": "0755",
    "ProtectHome": "true",
    "PrivateTmp": "true",
    "NoNewPrivileges": "true",
    "ProtectKernelModules": "true",
    "ProtectKernelLogs": "true",
    "ProtectKernelTunables": "true",
    "ProtectControlGroups": "true",
    "ProtectClock": "true",
    "ProtectHostname": "true",
    "RestrictNamespaces": "true",
    "RestrictRealtime": "true",
    "RestrictSUIDSGID": "true",
    "LockPersonality": "true",
    "SystemCallArchitectures": "native",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK",
    "UMask": "0022",
}


# The trust anchors in /etc/fabric: read-only inside every fabric unit, the
# pass's too (it writes the nft file beside them). A unit that could rewrite
# node.toml, the allowed signers or a key would outlive any check of them.
TRUST_ANCHORS = (
    "-/etc/fabric/node.toml",
    "-/etc/fabric/allowed_signers",
    "-/etc/fabric/plan-signing.key",
    "-/etc/fabric/deploy-key",
    "-/etc/fabric/etcd",
)
# The pass keeps what activation needs and no more: root (systemd's bus,
# files in root's directories), CAP_NET_ADMIN (nft loads its table),
# CAP_NET_BIND_SERVICE (before loading Caddy, the pass checks that the edge's
# ports, 80 and 443, can be bound), the file capabilities a root process needs in directories and files it does not
# own (a Caddy snippet directory owned by caddy, a scratch dir's parent), the
# devices (the probe must see /dev/dri and /dev/nvidia*) and netlink (nft):
# what keeps its exposure above the watcher's and the leader's.
PASS_HARDENING: dict[str, str | tuple[str, ...]] = {
    **HARDENING,
    "ReadOnlyPaths": TRUST_ANCHORS,
    "CapabilityBoundingSet": "CAP_NET_ADMIN CAP_NET_BIND_SERVICE CAP_DAC_OVERRIDE CAP_DAC_READ_SEARCH CAP_FOWNER CAP_CHOWN",
    "KeyringMode": "private",
    "ProtectProc": "invisible",
    "SystemCallFilter": ("@system-service",),
    "SystemCallErrorNumber": "EPERM",
}

# The watcher and the leader write nothing but their state directory and
# need no capability: they talk to the registry (TCP or the sqlite file in
# the state directory), phaze's broker and systemd's bus (as uid 0, which
# needs no capability), and read the desired state. So on top of the shared
# settings: no capabilities at all, no write access outside StateDirectory,
# no devices, other processes invisible, and the system calls of an ordinary
# service only. (`systemd-analyze security`: tests/integration/test_unit_exposure.py.)
DAEMON_HARDENING: dict[str, str | tuple[str, ...]] = {
    **{key: value for key, value in HARDENING.items() if key != "ReadWritePaths"},
    "CapabilityBoundingSet": "",
    "AmbientCapabilities": "",
    "PrivateDevices": "true",
    "DevicePolicy": "closed",
    "ProtectProc": "invisible",
    "ProcSubset": "pid",
    "PrivateIPC": "true",
    "RemoveIPC": "true",
    "KeyringMode": "private",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    "SystemCallFilter": ("@system-service", "~@privileged @resources"),
    "SystemCallErrorNumber": "EPERM",
}


# Directories a pass writes into that must exist before it runs (under
# ProtectSystem=strict a missing one cannot be created): the nft file, the k3s
# label drop-in, phaze's backends.toml (control host), the podman workloads'
# sysusers.d snippets, the metrics textfile.
# Both installers create them (the module with tmpfiles rules, join.sh with
# mkdir); /etc/caddy comes with Caddy.
PASS_DIRECTORIES = ("/etc/fabric", "/etc/rancher/k3s/config.yaml.d", "/etc/phaze", "/etc/sysusers.d", "/var/lib/node_exporter/textfile")

# The pass's HOME: `caddy validate` needs one to find its own CA (local_certs,
# internal names), and a service gets none from systemd.
PASS_HOME = "/var/lib/fabric"


@dataclass(frozen=True)
class UnitFile:
    """One unit: its name and its sections, each a list of (key, value)."""

    name: str
    sections: dict[str, list[tuple[str, str]]] = field(default_factory=dict)

    def values(self, section: str) -> dict[str, str | tuple[str, ...]]:
        """The section as key -> value, a repeated key as a tuple of its values."""
        out: dict[str, str | tuple[str, ...]] = {}
        for key, value in self.sections.get(section, []):
            if key in out:
                prev = out[key]
                out[key] = (*prev, value) if isinstance(prev, tuple) else (prev, value)
            elif key in _LIST_KEYS:
                out[key] = (value,)
            else:
                out[key] = value
        return out

    def text(self) -> str:
        parts = [f"# Written by the fabric ({self.name}); `fabric units` prints it.\n"]
        for section, entries in self.sections.items():
            parts.append(f"\n[{section}]\n")
            parts.extend(f"{key}={value}\n" for key, value in entries)
        return "".join(parts)


# Keys that may be given several times; values() always returns them as tuples.
_LIST_KEYS = {"ReadWritePaths", "ReadOnlyPaths", "SystemCallFilter", "ExecStartPre", "Wants", "After", "Before", "Environment"}


@dataclass(frozen=True)
class Install:
    """Where the fabric is installed on this host."""

    # Absolute path of the `fabric` program (/opt/fabric/bin/fabric, or the
    # Nix store path on NixOS).
    fabric_bin: str
    node: NodeConfig
    # Where node.toml is; `fabric pull` and `fabric bootstrap` read it.
    config_path: str = "/etc/fabric/node.toml"
    # PATH for the pass on a plain systemd host (NixOS sets it through the
    # service's `path`). None leaves systemd's default.
    search_path: str | None = None


def reconcile_argv(install: Install) -> list[str]:
    """The pass: `fabric reconcile --desired DIR --unit-dir DIR [--host NAME]`."""
    node = install.node.node
    argv = [install.fabric_bin, "reconcile", "--desired", node.desired, "--unit-dir", node.unit_dir]
    if node.host is not None:
        argv += ["--host", node.host]
    return argv


def pull_argv(install: Install) -> list[str] | None:
    """Fetch the desired state before the pass, when it comes from git."""
    if install.node.source is None:
        return None
    return [install.fabric_bin, "pull", "--config", install.config_path]


class UnitsError(ValueError):
    """The node configuration cannot give this unit (the message says why)."""


def leader_argv(install: Install) -> list[str]:
    """`fabric leader run --desired DIR --host NAME` (the leader must know its name)."""
    node = install.node.node
    if node.host is None:
        raise UnitsError("node.host: required for fabric-leader.service (the candidate campaigns under its host name)")
    return [install.fabric_bin, *LEADER_SUBCOMMAND, "--desired", node.desired, "--host", node.host]


def watch_argv(install: Install) -> list[str]:
    """`fabric watch --desired DIR [--host NAME]` (its registry is the pass's)."""
    node = install.node.node
    argv = [install.fabric_bin, *WATCH_SUBCOMMAND, "--desired", node.desired]
    if node.host is not None:
        argv += ["--host", node.host]
    return argv


def _environment(install: Install) -> list[tuple[str, str]]:
    env = [("Environment", f"PATH={install.search_path}")] if install.search_path else []
    if install.node.node.registry_path is not None:
        env.append(("Environment", f"FABRIC_REGISTRY={install.node.node.registry_path}"))
    env.append(("Environment", f"HOME={PASS_HOME}"))
    return env


def reconcile_service(install: Install) -> UnitFile:
    service: list[tuple[str, str]] = [
        ("Type", "oneshot"),
        ("SyslogIdentifier", SYSLOG_IDENTIFIER),
        ("TimeoutStartSec", PASS_TIMEOUT),
        *_environment(install),
    ]
    pull = pull_argv(install)
    if pull is not None:
        service.append(("ExecStartPre", " ".join(pull)))
    service.append(("ExecStart", " ".join(reconcile_argv(install))))
    service += _hardening(PASS_HARDENING)
    return UnitFile(
        RECONCILE_SERVICE,
        {
            "Unit": [
                ("Description", "fabric: one reconcile pass of this host"),
                ("Wants", "network-online.target"),
                ("After", "network-online.target"),
                ("StartLimitIntervalSec", PASS_START_LIMIT_INTERVAL),
            ],
            "Service": service,
        },
    )


def reconcile_timer(install: Install) -> UnitFile:
    timer = install.node.timer
    return UnitFile(
        RECONCILE_TIMER,
        {
            "Unit": [("Description", "fabric: reconcile this host every interval")],
            "Timer": [
                ("OnBootSec", ON_BOOT_SEC),
                ("OnUnitActiveSec", timer.interval),
                ("RandomizedDelaySec", timer.randomized_delay),
                ("AccuracySec", ACCURACY_SEC),
                # Only OnCalendar= triggers catch up from persisted state; with
                # these monotonic triggers OnBootSec is what runs a pass after
                # downtime. Kept so a calendar trigger added by an operator
                # catches up too.
                ("Persistent", "true"),
            ],
            "Install": [("WantedBy", "timers.target")],
        },
    )


def leader_service(install: Install) -> UnitFile:
    service: list[tuple[str, str]] = [
        ("Type", "simple"),
        ("SyslogIdentifier", "fabric-leader"),
        ("Restart", "always"),
        ("RestartSec", LEADER_RESTART_SEC),
        *_environment(install),
        ("ExecStart", " ".join(leader_argv(install))),
    ]
    service += _hardening(DAEMON_HARDENING)
    return UnitFile(
        LEADER_SERVICE,
        {
            "Unit": [
                ("Description", "fabric: campaign for leadership and publish the plan"),
                ("Wants", "network-online.target"),
                ("After", "network-online.target"),
            ],
            "Service": service,
            "Install": [("WantedBy", "multi-user.target")],
        },
    )


def watch_service(install: Install) -> UnitFile:
    service: list[tuple[str, str]] = [
        ("Type", "simple"),
        ("SyslogIdentifier", "fabric-watch"),
        ("Restart", "on-failure"),
        ("RestartSec", WATCH_RESTART_SEC),
        *_environment(install),
        ("ExecStart", " ".join(watch_argv(install))),
    ]
    service += _hardening(DAEMON_HARDENING)
    return UnitFile(
        WATCH_SERVICE,
        {
            "Unit": [
                ("Description", "fabric: start a reconcile pass as soon as the registry changes for this host"),
                ("Wants", "network-online.target"),
                ("After", "network-online.target"),
            ],
            "Service": service,
            "Install": [("WantedBy", "multi-user.target")],
        },
    )


def bootstrap_argv(install: Install) -> list[str]:
    """`fabric bootstrap --config node.toml --first-boot` (node.toml names the host)."""
    return [install.fabric_bin, "bootstrap", "--config", install.config_path, "--first-boot"]


def bootstrap_service(install: Install) -> UnitFile:
    """The seed's bootstrap agent: at first boot, once (its stamp), then exit.
    It runs as an operator's `fabric bootstrap` would (tailscale up, a k3s
    agent restart, nft, daemon-reload): no sandbox beyond a private /tmp. With
    a git [source] it first pulls the desired state, as the pass does."""
    service: list[tuple[str, str]] = [
        ("Type", "oneshot"),
        ("SyslogIdentifier", "fabric-bootstrap"),
        ("TimeoutStartSec", BOOTSTRAP_TIMEOUT),
        *_environment(install),
    ]
    pull = pull_argv(install)
    if pull is not None:
        service.append(("ExecStartPre", " ".join(pull)))
    service += [("ExecStart", " ".join(bootstrap_argv(install))), ("PrivateTmp", "true"), ("UMask", "0022")]
    return UnitFile(
        BOOTSTRAP_SERVICE,
        {
            "Unit": [
                ("Description", "fabric: bootstrap this machine at its first boot (once), then exit"),
                ("Wants", "network-online.target"),
                *(("After", unit) for unit in BOOTSTRAP_AFTER),
                *(("Before", unit) for unit in BOOTSTRAP_BEFORE),
                ("ConditionPathExists", BOOTSTRAP_CONDITION),
            ],
            "Service": service,
            "Install": [("WantedBy", "multi-user.target")],
        },
    )


def _hardening(settings: dict[str, str | tuple[str, ...]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for key, value in settings.items():
        if isinstance(value, tuple):
            out += [(key, v) for v in value]
        else:
            out.append((key, value))
    return out


def host_units(install: Install, *, leader_candidate: bool) -> list[UnitFile]:
    """Every unit this host needs from the fabric itself (not the rendered ones)."""
    units = [reconcile_service(install), reconcile_timer(install), watch_service(install), bootstrap_service(install)]
    if leader_candidate:
        units.append(leader_service(install))
    return units


def units_json(units: list[UnitFile]) -> str:
    """The units as JSON: {name: {section: {key: value or [values]}}}."""
    payload = {
        unit.name: {section: {k: list(v) if isinstance(v, tuple) else v for k, v in unit.values(section).items()} for section in unit.sections}
        for unit in units
    }
    return json.dumps(payload, indent=2, sort_keys=True)
