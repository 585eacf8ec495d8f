"""Render one host's artifacts from the desired state, its probe and the fleet plan.

Pure: `render()` takes models and returns `Artifact`s (a path relative to the
root, the text, a file mode and a kind); it writes nothing and runs nothing.
The Jinja2 templates of `reconciler/templates/` (loaded by `reconciler.core.templating`) (StrictUndefined: a missing value is an
error, never an empty string) are the only text; this module computes the
values and quotes every one of them for the language it lands in.

What a host gets:

- every host: `fabric-nftables.service` and the nftables file of the table
  `inet fabric` (ports of its services and port maps, tailnet only, the
  tailnet's range arriving on the host's tailnet interface, unless a port
  map's `allow_from` opens it further; the CachyOS/Arch forward fix), and
  the k3s node-label drop-in;
- one `fabric-socat-<name>.service` per port map declared on the host,
  listening on the host's tailnet address (`socat_listen`);
- one `fabric-agent-<id>.service` per compute lane pushed to it (several
  lanes may share a push_host: each agent has its own unit, queue, token file
  and scratch dir) and per service the plan places on it; the local lane is
  phaze's own processing on the file server, so no agent runs it;
- a host with the 'control' role: phaze's `/etc/phaze/backends.toml`, the
  declared lanes in phaze's field names, which restarts phaze's control-plane
  units (`[phaze] control_units`) when it changes;
- an edge host: the Caddy site snippet, one site per routed service, and
  the status page's (tailnet only unless `[fleet] status_access` is public);
- with a `[ray]` table: `fabric-ray-head.service` on its head and
  `fabric-ray-worker.service` on each of its workers (`ray_units`), the
  head's port (and dashboard's) tailnet only in its nftables.

The plan: render reads only this host's part of it (`plan_part`: the services
placed here and, on the edge, each routed service's nodes), the same part whose
change makes `fabric watch` start a pass.

Unit files are 0644, or 0640 when they carry environment (`unit_mode`).

Trust: the plan comes from the registry, which may be written by any host. A
placement naming a service or host the desired state does not know is ignored
and reported in `Rendered.notes`; the plan never supplies text, only names that
select text from the desired state.
"""

from __future__ import annotations

import fnmatch
import hashlib
import ipaddress
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from reconciler.core.desired.model import (
    _LABEL_KEY_RE,
    PHAZE_BACKEND_FIELDS,
    PHAZE_BACKENDS_FILE,
    DesiredState,
    HostConfig,
    HostFacts,
    Lane,
    PortMap,
    RunsOn,
    Service,
    agent_queue_name,
)
from reconciler.core.live.models import FleetPlan
from reconciler.core.render.edge_proxy import proxy_timings
from reconciler.core.render.plan_part import PlanPart, plan_part
from reconciler.core.render.ray_units import DEFAULT_RAY_COMMAND, RayUnit, ray_unit
from reconciler.core.render.status_site import caddy_site as status_caddy_site
from reconciler.core.render.tailnet import LOOPBACK, TAILNET, TAILNET6, tailnet_address, unknown_reason
from reconciler.core.scheduling.lanes import agent_unit  # one name for an agent's unit, lane health's too
from reconciler.core.templating import TEMPLATES_DIR as TEMPLATES_DIR  # for the tests that read the templates
from reconciler.core.templating import Templates

ArtifactKind = Literal["unit", "nft", "caddy", "dropin", "file"]

# A unit file that carries environment (Environment= lines: a service's or
# an agent's variables, which may name where its secrets are) is readable by
# root alone and its group; one without is world-readable like any unit.
UNIT_MODE = 0o644
UNIT_WITH_ENVIRONMENT_MODE = 0o640
_ENVIRONMENT_LINE = re.compile(r"^Environment=", re.MULTILINE)


class RenderError(ValueError):
    """The inputs cannot be rendered (unknown host, colliding unit names)."""


@dataclass(frozen=True)
class Layout:
    """Where artifacts go (relative to the root) and where programs live.

    A Debian or Arch host uses the defaults; a NixOS host points `unit_dir` at
    a writable unit directory (e.g. run/systemd/system) and the programs at
    their store paths.
    """

    unit_dir: str = "etc/systemd/system"
    nft_file: str = "etc/fabric/fabric.nft"
    caddy_file: str = "etc/caddy/fabric.caddy"
    k3s_dropin: str = "etc/rancher/k3s/config.yaml.d/50-fabric-labels.yaml"
    phaze_backends: str = PHAZE_BACKENDS_FILE.lstrip("/")
    socat: str = "/usr/bin/socat"
    podman: str = "/usr/bin/podman"
    nft: str = "/usr/sbin/nft"
    systemd_tmpfiles: str = "/usr/bin/systemd-tmpfiles"
    systemd_sysusers: str = "/usr/bin/systemd-sysusers"
    sysusers_dir: str = "etc/sysusers.d"
    # A POSIX shell at the one path every supported host has (NixOS too).
    shell: str = "/bin/sh"
    ray: str = DEFAULT_RAY_COMMAND

    def unit_path(self, unit: str) -> str:
        return f"{self.unit_dir.strip('/')}/{unit}"


@dataclass(frozen=True)
class Artifact:
    path: str  # relative to the root, no leading '/'
    content: str
    mode: int
    kind: ArtifactKind
    # Units the fabric does not render that read this file at startup only
    # (phaze's control plane and backends.toml): a change of the file restarts
    # those of them that run, as a changed unit file restarts its unit.
    restarts: tuple[str, ...] = ()

    @property
    def data(self) -> bytes:
        return self.content.encode("utf-8")

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def unit(self) -> str | None:
        """The unit name for a unit file, else None."""
        return self.path.rsplit("/", 1)[-1] if self.kind == "unit" else None


@dataclass(frozen=True)
class Rendered:
    artifacts: tuple[Artifact, ...]
    # Things the operator should know: ignored plan entries, missing images.
    notes: tuple[str, ...] = field(default=())


# --------------------------------------------------------------------------
# Quoting. Each function makes one value safe for one context.


def systemd_text(value: str) -> str:
    """Free text in a unit (Description=): specifiers escaped, and no trailing
    backslash, which would continue the line into the next setting."""
    return value.rstrip("\\ \t").replace("%", "%%")


def systemd_quote(arg: str) -> str:
    """One argv element for ExecStart=: double-quoted, C escapes, no specifier
    or variable expansion (systemd.service(5) "Command lines")."""
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


def systemd_env(name: str, value: str) -> str:
    """One Environment= assignment, quoted (systemd.exec(5) Environment=)."""
    escaped = f"{name}={value}".replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return f'"{escaped}"'


def toml_string(value: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's (backslash, quote, \\uXXXX)."""
    return json.dumps(value)


def caddy_address(address: str, port: int) -> str:
    ip = ipaddress.ip_address(address)
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def unit_mode(text: str) -> int:
    """A unit file's mode: 0640 when it carries environment, else 0644."""
    return UNIT_WITH_ENVIRONMENT_MODE if _ENVIRONMENT_LINE.search(text) else UNIT_MODE


def unit_artifact(path: str, text: str) -> Artifact:
    """A unit file, with the mode its text calls for (`unit_mode`)."""
    return Artifact(path, text, unit_mode(text), "unit")


def credential_env_name(name: str) -> str:
    return re.sub(r"[^A-Z0-9_]", "_", name.upper()) + "_FILE"


# --------------------------------------------------------------------------
# Templates


def _template(template_name: str, templates: Templates, /, **values: object) -> str:
    # Unit files, nft, Caddyfile: nothing is escaped, quoting is done per value above.
    text = templates.get("text", template_name).render(**values)
    return text.rstrip("\n") + "\n"


# --------------------------------------------------------------------------
# Facts


_ARCH_ALIASES = {"amd64": "x86_64", "x86_64": "x86_64", "arm64": "aarch64", "aarch64": "aarch64"}


def host_arch(host: HostConfig, facts: HostFacts) -> str | None:
    """The architecture the host runs: the operator's override, else the probe's."""
    if host.overrides.arch is not None:
        return host.overrides.arch
    return _ARCH_ALIASES.get((facts.hardware.arch or "").lower())


@dataclass(frozen=True)
class NftOpening:
    """A port map's `allow_from` as the nft template renders it: one accept
    rule per CIDR, `ip` or `ip6` by the CIDR's family, before the drop."""

    name: str
    protocol: str
    port: str
    everyone: bool
    sources: tuple[tuple[str, str], ...]  # (nft family keyword, CIDR)


def nft_opening(pm: PortMap) -> NftOpening:
    sources = tuple(("ip6" if ipaddress.ip_network(cidr).version == 6 else "ip", cidr) for cidr in pm.allow_from)
    return NftOpening(pm.name, pm.protocol, str(pm.listen_port), pm.open_to_everyone, sources)


def exposure_note(pm: PortMap) -> str:
    """What `fabric plan` and `fabric reconcile` say of a port map open beyond the tailnet."""
    where = f"port map {pm.name}: {pm.protocol} {pm.listen_port} on {pm.host}"
    cidrs = ", ".join(pm.allow_from)
    if pm.open_to_everyone:
        return f"{where} is open to everyone (allow_from {cidrs}), not only the tailnet"
    return f"{where} is open beyond the tailnet to {cidrs} (allow_from)"


def needs_nftables_fix(host: HostConfig, facts: HostFacts) -> bool:
    """The CachyOS/Arch nftables fix: the host file decides, else the probe's os-release."""
    if host.host.nftables_fix is not None:
        return host.host.nftables_fix
    return facts.os is not None and (facts.os.arch_based or facts.os.id == "cachyos")


# --------------------------------------------------------------------------
# What runs here


@dataclass(frozen=True)
class _Workload:
    """One fabric-agent-<id>.service: a lane's agent or a placed service."""

    id: str
    what: str  # "lane" or "service"
    source: str
    description: str
    gpu: bool
    image: str | None
    command: tuple[str, ...]
    environment: tuple[tuple[str, str], ...]
    credentials: tuple[tuple[str, str], ...]
    bind_paths: tuple[str, ...]  # host paths a container gets read-only (the *_FILE secrets)
    # A lane's scratch_dir and its lane's ssh_user (who pushes into it); the
    # only host path a container gets read-write. None for a service.
    scratch: tuple[str, str] | None
    # A phaze agent's models: the host directory and where the container sees
    # it (MODELS_PATH), read-only. None otherwise.
    models: tuple[str, str] | None = None
    # A GPU workload's way into /dev/dri: this host's render nodes ("renderD128")
    # and the groups owning them (stat, probed), given as SupplementaryGroups=.
    render_nodes: tuple[str, ...] = ()
    render_groups: tuple[str, ...] = ()


def render_devices(facts: HostFacts) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """This host's GPU render nodes and the groups that may open them (sorted, unique).
    A dynamic user reaches /dev/dri/renderDN (0660 root:render) only as a member of
    its group; a node whose group the probe did not see adds no group."""
    nodes = sorted({g.render_node for g in facts.hardware.gpus if g.render_node}, key=lambda n: (len(n), n))
    groups = sorted({g.render_group for g in facts.hardware.gpus if g.render_node and g.render_group})
    return tuple(nodes), tuple(groups)


def _with_render_devices(w: _Workload, facts: HostFacts, notes: list[str]) -> _Workload:
    if not w.gpu:
        return w
    nodes, groups = render_devices(facts)
    if nodes and not groups:
        notes.append(f"{w.what} {w.id}: the probe saw no group owning {', '.join(nodes)}; its unit gets no group to open them")
    return replace(w, render_nodes=nodes, render_groups=groups)


def _fleet_file_name(desired: DesiredState) -> str:
    # The base name only: the text must not depend on how --desired was spelled.
    return Path(desired.fleet_file).name


def _lanes_here(desired: DesiredState, host_name: str) -> list[Lane]:
    """The compute lanes whose agents run here. The local lane is phaze's own
    processing on the file server: no agent of the fabric's runs it."""
    return [lane for lane in desired.lanes if lane.kind == "compute" and lane.push_host == host_name]


def phaze_agent_environment(desired: DesiredState, lane: Lane) -> dict[str, str]:
    """What phaze's agent_worker and its AgentSettings read (phaze 2026.8.5,
    tasks/agent_worker.py and config.py; docs/_incoming/phaze-lanes.md),
    set from the lane, [phaze] and [agent]: the role and kind, the base queue
    (phaze-agent-<agent_ref>: the worker checks it against its token's agent
    id) and the lane it consumes with that lane's concurrency (the lane's
    cap; WORKER_MAX_JOBS is its ceiling), the agent API, the token, broker
    DSN and CA as files, the scratch dir and the models' path."""
    fleet = desired.fleet
    agent = fleet.agent
    queue = agent_queue_name(fleet, lane)
    token_file = desired.token_file_for(lane)
    assert agent is not None and fleet.phaze.api_url is not None and queue is not None and token_file is not None and lane.scratch_dir is not None
    env = {
        "PHAZE_ROLE": "agent",
        "PHAZE_AGENT_KIND": "compute",
        "PHAZE_AGENT_QUEUE": queue,
        "PHAZE_AGENT_API_URL": fleet.phaze.api_url,
        "PHAZE_AGENT_TOKEN_FILE": token_file,
        "PHAZE_QUEUE_URL_FILE": desired.agent_queue_url_file(lane) or agent.queue_url_file,
        "PHAZE_CLOUD_SCRATCH_DIR": lane.scratch_dir,
        "MODELS_PATH": fleet.phaze.models_path,
        "WORKER_MAX_JOBS": str(lane.cap),
    }
    if fleet.phaze.agent_lane:
        env["PHAZE_AGENT_LANE"] = fleet.phaze.agent_lane
        env[f"PHAZE_LANE_{fleet.phaze.agent_lane.upper()}_CONCURRENCY"] = str(lane.cap)
    if agent.ca_file is not None:
        env["PHAZE_AGENT_CA_FILE"] = agent.ca_file
    return env


def _own_agent_environment(desired: DesiredState, lane: Lane) -> dict[str, str]:
    """A worker of the fabric's own lane: its queue, token file and scratch dir."""
    queue = agent_queue_name(desired.fleet, lane)
    token_file = desired.token_file_for(lane)
    assert queue is not None and token_file is not None and lane.scratch_dir is not None
    return {"PHAZE_AGENT_QUEUE": queue, "PHAZE_AGENT_TOKEN_FILE": token_file, "PHAZE_CLOUD_SCRATCH_DIR": lane.scratch_dir}


def _lane_workload(desired: DesiredState, lane: Lane, arch: str | None, notes: list[str]) -> _Workload | None:
    agent = desired.fleet.agent
    if agent is None:
        notes.append(f"lane {lane.id}: no [agent] table in {desired.fleet_file}, so no agent runs it here")
        return None
    if arch is None or arch not in agent.arch:
        notes.append(f"lane {lane.id}: no agent image for architecture {arch or 'unknown'} (agent.arch has {', '.join(sorted(agent.arch))})")
        return None
    spec = agent.arch[arch]
    # The per-agent variables are the lane's own (the model refuses them in
    # agent.environment): queue, token file and scratch dir differ per agent.
    phaze = desired.fleet.phaze_dispatches
    own = phaze_agent_environment(desired, lane) if phaze else _own_agent_environment(desired, lane)
    env = {**agent.environment, **own}
    # A compute lane, [agent] present; ssh_user has a fleet-wide default.
    ssh_user = desired.ssh_user_for(lane)
    assert lane.scratch_dir is not None and ssh_user is not None
    return _Workload(
        id=lane.id,
        what="lane",
        source=f"{_fleet_file_name(desired)} backends[{lane.id}] + agent.arch.{arch}",
        description=f"compute agent {lane.agent_ref}, rank {lane.rank}, cap {lane.cap}",
        gpu=False,
        image=spec.image,
        command=tuple(spec.command),
        environment=tuple(sorted(env.items())),
        credentials=(),
        bind_paths=tuple(sorted(v for k, v in env.items() if k.endswith("_FILE"))),
        scratch=(lane.scratch_dir, ssh_user),
        models=(agent.models_dir, desired.fleet.phaze.models_path) if phaze else None,
    )


def _service_workload(desired: DesiredState, service: Service, arch: str | None, notes: list[str]) -> _Workload | None:
    runs: Mapping[RunsOn, list[str] | str] = service.command or service.image
    chosen = next((value for key, value in runs.items() if key == arch), None) or runs.get("any")
    if chosen is None:
        notes.append(f"service {service.id}: placed here but has no command or image for architecture {arch or 'unknown'}; not run")
        return None
    env = dict(service.environment)
    return _Workload(
        id=service.id,
        what="service",
        source=f"{_fleet_file_name(desired)} services[{service.id}]",
        description=service.description,
        gpu=service.min_tier.startswith("gpu_"),
        image=chosen if isinstance(chosen, str) else None,
        command=tuple(chosen) if isinstance(chosen, list) else (),
        environment=tuple(sorted(env.items())),
        credentials=tuple(sorted(service.credentials.items())),
        bind_paths=tuple(sorted(v for k, v in env.items() if k.endswith("_FILE"))),
        scratch=None,
    )


CONTAINER_CREDENTIALS = "/run/credentials/fabric"


@dataclass
class _UnitParts:
    """What `agent.service.j2` takes, gathered by the helpers of `_agent_unit`."""

    environment: list[str]
    credentials: list[str]
    args: list[str] = field(default_factory=list)
    exec_extra: list[str] = field(default_factory=list)
    rootless: dict[str, object] = field(default_factory=dict)  # the podman unit's own paths
    scratch: dict[str, str] | None = None  # a lane's scratch_dir, for the template


def _podman_start(unit: str, podman_cmd: str, runtime_dir: str) -> list[str]:
    """`podman run` up to its --env flags: the container beside the unit's own processes."""
    return [
        podman_cmd,
        "run",
        f"--cidfile={runtime_dir}/ctr-id",
        f"--conmon-pidfile={runtime_dir}/conmon.pid",
        # conmon and the container in sub-cgroups of the unit's (Delegate=yes).
        "--cgroups=split",
        "--rm",
        "--replace",
        "--detach",
        systemd_quote(f"--name={unit.removesuffix('.service')}"),
        "--network=host",
        # The unit's sandbox overmounts parts of /proc (ProtectKernelTunables=
        # and friends) and forbids sethostname(), so the kernel refuses a
        # fresh proc mount and a hostname: the container shares the unit's
        # PID and UTS namespaces (it sees only its own user's processes).
        "--pid=host",
        "--uts=host",
    ]


def _secret_volumes(w: _Workload, parts: _UnitParts) -> None:
    """Each *_FILE secret: systemd copies it into %d (the unit's credentials
    directory, readable by the unit's user only) and the container sees it at
    its own path, so the variable keeps its value. Unquoted, as %d must stay a
    specifier: `name` is a lower-cased variable name and an AbsPath has no
    blank, quote, '$' or backslash (model.py)."""
    for path in w.bind_paths:
        name = next(k.lower() for k, v in w.environment if v == path and k.endswith("_FILE"))
        parts.credentials.append(f"{name}:{path}")
        parts.args.append(f"--volume=%d/{name}:{path.replace('%', '%%')}:ro")


def _scratch_volume(w: _Workload, layout: Layout, parts: _UnitParts) -> None:
    """A lane's scratch_dir, at its real path on the host: phaze's rsync logs
    in as the lane's ssh_user and writes there, and the container sees the
    same directory at the same path. It is not a StateDirectory= of this
    unit: that would be the agent's (a DynamicUser= unit's even in
    /var/lib/private, 0700 root, where no login user reaches it), and a path
    outside /var/lib cannot be one at all (systemd.exec). So the directory is
    the pusher's, 2770 with the pusher's group (the setgid bit gives pushed
    files and the agent's outputs that group even when rsync keeps none),
    created or set right before every start by systemd-tmpfiles from a rule
    this unit carries (StandardInputText=, read as "-"; "+": it runs as root,
    outside the sandbox). The agent's static user gets in as a member of that
    group (SupplementaryGroups=; the container keeps it: podman, with no
    subgid range, writes its single-ID gid_map itself, so the kernel denies
    setgroups() in that namespace, user_namespaces(7)) and writes only there:
    ReadWritePaths= lifts ProtectSystem=strict for this directory alone. The
    user is static (workload_user), so the agent's outputs keep a real owner."""
    if w.scratch is None:
        return
    path, pusher = w.scratch
    parts.scratch = {
        "path": path.replace("%", "%%"),
        "group": pusher,
        # StandardInputText= resolves specifiers and C escapes; a Name
        # and an AbsPath have no blank or '\\' (model.py), only '%' to double.
        "tmpfiles_rule": f"d {path} 2770 {pusher} {pusher} -".replace("%", "%%"),
        "tmpfiles": systemd_quote(layout.systemd_tmpfiles),
    }
    parts.args.append(systemd_quote(f"--volume={path}:{path}"))


def _models_volume(w: _Workload, parts: _UnitParts) -> None:
    """A phaze agent's models, read-only at MODELS_PATH (ProtectSystem=strict
    keeps the host directory read-only for the unit too)."""
    if w.models is not None:
        host_dir, container_path = w.models
        parts.args.append(systemd_quote(f"--volume={host_dir}:{container_path}:ro"))


# systemd-sysusers and shadow take user names of at most 31 characters (utmp).
_USER_NAME_MAX = 31


def workload_user(workload_id: str) -> str:
    """The static system user a podman workload runs as: its unit's name
    (fabric-agent-<id>) when that fits a user name, else a prefix of it and
    8 hex digits of the id's sha256 (ids are unique per host, so are these)."""
    name = agent_unit(workload_id).removesuffix(".service")
    if len(name) <= _USER_NAME_MAX:
        return name
    digest = hashlib.sha256(workload_id.encode()).hexdigest()[:8]
    return f"{name[: _USER_NAME_MAX - 9]}-{digest}"


def account_unit(workload_id: str) -> str:
    """The oneshot unit that creates a podman workload's user before its agent starts."""
    return f"fabric-account-{workload_id}.service"


def sysusers_line(workload_id: str) -> str:
    """The sysusers.d(5) line of a podman workload's user: a system user with
    a group of its own name, an id systemd-sysusers picks (kept for good once
    made), its state directory as home, no login shell."""
    user = workload_user(workload_id)
    return f'u {user} - "fabric {workload_id}" /var/lib/{agent_unit(workload_id).removesuffix(".service")} -'


# The files where podman looks up a user's range of subordinate IDs.
SUBID_FILES = ("/etc/subuid", "/etc/subgid")
# Run by the account unit with the user as $1: fails, naming the file and the
# line, when either file has a line for the user (by name, by UID or "ALL", as
# podman's lookup matches: containers/storage idtools.parseSubidFile). With a
# range in both, podman maps the user through the setuid newuidmap/newgidmap,
# which the agent's NoNewPrivileges= (implied by its sandbox) stops, so the
# agent exits 125; without one it maps the one ID itself. A line in one file
# only is inert today but refused too: the fabric's users have no range.
# Shell builtins only: no other program has one path on every host.
SUBID_CHECK = " ".join(
    (
        'uid=; while IFS=: read -r name _ id _; do [ "$name" = "$1" ] && uid=$id; done < /etc/passwd; found=0;',
        'for file in FILES; do [ -r "$file" ] || continue;',
        "while IFS= read -r line; do owner=${line%%:*};",
        'if [ "$owner" = "$1" ] || [ "$owner" = ALL ] || { [ -n "$uid" ] && [ "$owner" = "$uid" ]; }; then',
        'echo "$file: $1 has a subordinate ID range ($line): podman would map it through newuidmap/newgidmap,'
        " which the agent's NoNewPrivileges= stops; the fabric runs $1 with one ID: remove that line\" >&2; found=1;",
        'fi; done < "$file"; done; exit $found',
    )
).replace("FILES", " ".join(SUBID_FILES))


def subid_check_command(layout: Layout, workload_id: str) -> str:
    """The account unit's check that its user has no subordinate ID range
    (SUBID_CHECK), quoted for ExecStart=."""
    argv = [layout.shell, "-c", SUBID_CHECK, account_unit(workload_id).removesuffix(".service"), workload_user(workload_id)]
    return " ".join(systemd_quote(a) for a in argv)


def _podman_parts(w: _Workload, unit: str, layout: Layout) -> _UnitParts:
    """Rootless podman as the workload's own static system user (made by
    its account unit from a sysusers.d snippet): its home (image storage)
    and runtime directory belong to that user, and it can read nothing of
    root's, so every host path the container gets comes through systemd
    (credentials, state directories, the scratch dir's group)."""
    assert w.image is not None
    parts = _UnitParts(environment=[systemd_env(k, v) for k, v in w.environment], credentials=[f"{n}:{p}" for n, p in w.credentials])
    home = f"/var/lib/{unit.removesuffix('.service')}"
    runtime_dir = f"/run/{unit.removesuffix('.service')}"
    podman_cmd = f"{systemd_quote(layout.podman)} --cgroup-manager=cgroupfs"
    cidfile = f"--cidfile={runtime_dir}/ctr-id"
    # Values travel as the unit's Environment= and are handed on by name
    # (--env=NAME), so they never appear in the container's argv.
    for name, _ in w.credentials:
        parts.environment.append(systemd_env(credential_env_name(name), f"{CONTAINER_CREDENTIALS}/{name}"))
    parts.args = _podman_start(unit, podman_cmd, runtime_dir)
    names = [k for k, _ in w.environment] + [credential_env_name(n) for n, _ in w.credentials]
    parts.args += [systemd_quote(f"--env={name}") for name in sorted(names)]
    _secret_volumes(w, parts)
    _scratch_volume(w, layout, parts)
    _models_volume(w, parts)
    # The render nodes as devices of the container; the unit's render group
    # (SupplementaryGroups=) stays with its processes, as the scratch group does.
    parts.args += [f"--device=/dev/dri/{node}" for node in w.render_nodes]
    if w.credentials:
        # %d is the unit's credentials directory (LoadCredential=).
        parts.args.append(f"--volume=%d:{CONTAINER_CREDENTIALS}:ro")
    parts.args.append(systemd_quote(w.image))
    parts.args += [systemd_quote(a) for a in w.command]
    parts.exec_extra = [
        f"ExecStop={podman_cmd} stop --ignore --time=20 {cidfile}",
        f"ExecStopPost={podman_cmd} rm --force --ignore {cidfile}",
    ]
    parts.rootless = {
        "user": workload_user(w.id),
        "account_unit": account_unit(w.id),
        "home": home,
        "runtime_dir": runtime_dir,
        "runtime_directory": runtime_dir.removeprefix("/run/"),
        "state_directories": [home.removeprefix("/var/lib/").replace("%", "%%")],
    }
    return parts


def _command_parts(w: _Workload) -> _UnitParts:
    """The service runs as a dynamic user, who cannot read root's secret
    files: every *_FILE path is handed over as a credential instead (systemd
    copies it into %d, the unit's credentials directory, readable by that user
    only), and the variable points there."""
    parts = _UnitParts(environment=[], credentials=[f"{n}:{p}" for n, p in w.credentials])
    for key, value in w.environment:
        if key.endswith("_FILE"):
            parts.credentials.append(f"{key.lower()}:{value}")
            parts.environment.append(f'"{key}=%d/{key.lower()}"')
        else:
            parts.environment.append(systemd_env(key, value))
    for name, _ in w.credentials:
        # `name` is a safe Name (model.py), so it needs no quoting.
        parts.environment.append(f'"{credential_env_name(name)}=%d/{name}"')
    parts.args = [systemd_quote(a) for a in w.command]
    return parts


def _agent_unit(w: _Workload, layout: Layout, templates: Templates, notes: list[str]) -> str:
    unit = agent_unit(w.id)
    parts = _podman_parts(w, unit, layout) if w.image is not None else _command_parts(w)
    return _template(
        "agent.service.j2",
        templates,
        id=w.id,
        what=w.what,
        source=w.source,
        description=systemd_text(w.description),
        podman=w.image is not None,
        user=parts.rootless.get("user"),
        account_unit=parts.rootless.get("account_unit"),
        home=parts.rootless.get("home"),
        runtime_dir=parts.rootless.get("runtime_dir"),
        runtime_directory=parts.rootless.get("runtime_directory"),
        state_directories=parts.rootless.get("state_directories"),
        scratch=parts.scratch,
        gpu=w.gpu,
        render_groups=w.render_groups,
        environment=parts.environment,
        credentials=parts.credentials,
        exec_start=" ".join(parts.args),
        exec_extra=parts.exec_extra,
    )


def _ray_unit_text(ray: RayUnit, desired: DesiredState, facts: HostFacts, templates: Templates) -> str:
    # A worker on a GPU host (CUDA, VA-API or an APU) runs tasks of its GPU
    # tiers: its devices stay visible and it may open the render nodes.
    _, render_groups = render_devices(facts)
    gpu = ray.spec.num_gpus > 0 or ray.spec.tier.startswith("gpu_")
    return _template(
        "ray.service.j2",
        templates,
        role=ray.role,
        host=ray.spec.host,
        tier=ray.spec.tier,
        closed=systemd_text(ray.closed) if ray.closed is not None else None,
        source=f"{_fleet_file_name(desired)} ray",
        gpu=gpu,
        render_groups=render_groups if gpu else (),
        state_directory=ray.state_directory,
        exec_start=" ".join(systemd_quote(a) for a in ray.argv),
    )


def phaze_backends(desired: DesiredState, layout: Layout, templates: Templates | Path | None, left_out: tuple[str, ...] = ()) -> Artifact:
    """/etc/phaze/backends.toml: the declared [[backends]] but the compute
    lanes the leader left out (`left_out`: dead for the steering window,
    core.scheduling.lane_steering), with the keys phaze knows that are set
    (not the fabric's own `queue`, `token_file`). No secrets are in it;
    phaze's control-plane units read it at startup."""
    backends = []
    for lane in desired.fleet.lanes:
        if lane.id in left_out:
            continue
        fields = []
        for key in PHAZE_BACKEND_FIELDS:
            # ssh_user: the lane's or the fleet-wide push_ssh_user, written out
            # so phaze pushes as the user the scratch dir belongs to.
            value = desired.ssh_user_for(lane) if key == "ssh_user" else getattr(lane, key)
            if value is not None:
                fields.append((key, str(value) if isinstance(value, int) else toml_string(value)))
        backends.append(fields)
    text = _template(
        "backends.toml.j2", Templates.of(templates), source=f"{_fleet_file_name(desired)} backends", backends=backends, left_out=list(left_out)
    )
    return Artifact(layout.phaze_backends, text, 0o644, "file", restarts=tuple(desired.fleet.phaze.control_units))


_K8S_LABEL_VALUE_RE = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?$")


def k8s_label_value(value: str) -> str:
    """Kubernetes label values allow no ':' (the seed's "auto:foxtop",
    "nvidia:rtx4070"); k3s refuses to start with one, so it becomes '-'."""
    return value.replace(":", "-")


def _labels(host: HostConfig, facts: HostFacts, notes: list[str]) -> list[tuple[str, str]]:
    """The probe's labels, then the host file's (the operator wins), as k3s takes them."""
    labels: dict[str, str] = {}
    for key, value in {**facts.labels, **host.labels}.items():
        value = k8s_label_value(value)
        if not _LABEL_KEY_RE.match(key) or not _K8S_LABEL_VALUE_RE.match(value):
            notes.append(f"label {key!r}={value!r} is not a valid k3s label; left out")
            continue
        labels[key] = value
    return sorted(labels.items())


@dataclass
class _HostRender:
    """What the per-artifact renderers share: the inputs, this host's part of
    the plan, its workloads, the notes, and the ports the renderers before
    nftables opened."""

    desired: DesiredState
    host_name: str
    host: HostConfig
    facts: HostFacts
    layout: Layout
    templates: Templates
    ray_closed: str | None
    notes: list[str]
    part: PlanPart
    arch: str | None
    workloads: list[_Workload] = field(default_factory=list)
    tcp_ports: set[int] = field(default_factory=set)
    udp_ports: set[int] = field(default_factory=set)
    openings: list[NftOpening] = field(default_factory=list)


def _workloads_here(r: _HostRender) -> list[_Workload]:
    """Lanes first, then the services placed here, each a fabric-agent-<id>.service."""
    workloads: list[_Workload] = []
    for lane in _lanes_here(r.desired, r.host_name):
        w = _lane_workload(r.desired, lane, r.arch, r.notes)
        if w is not None:
            workloads.append(w)
    for service_id in r.part.services_here:
        service = r.desired.service(service_id)
        assert service is not None
        w = _service_workload(r.desired, service, r.arch, r.notes)
        if w is not None:
            workloads.append(_with_render_devices(w, r.facts, r.notes))
    return workloads


def _render_agents(r: _HostRender) -> list[Artifact]:
    """One agent unit per workload of this host; two workloads of one id are an error."""
    artifacts = []
    seen: dict[str, str] = {}
    for w in r.workloads:
        if w.id in seen:
            raise RenderError(f"{agent_unit(w.id)} would run both {seen[w.id]} {w.id!r} and {w.what} {w.id!r}: rename one in {r.desired.fleet_file}")
        seen[w.id] = w.what
        artifacts.append(unit_artifact(r.layout.unit_path(agent_unit(w.id)), _agent_unit(w, r.layout, r.templates, r.notes)))
        if w.image is not None:
            artifacts += _account_artifacts(w, r)
    return artifacts


def _account_artifacts(w: _Workload, r: _HostRender) -> list[Artifact]:
    """A podman workload's user, declared as files: the sysusers.d snippet
    (systemd-sysusers.service applies it at boot too) and the oneshot unit
    that applies it, as root, before the agent starts (systemd resolves User=
    before any ExecStartPre=, even a "+" one, so the agent cannot make it)."""
    line = sysusers_line(w.id)
    snippet = f"{r.layout.sysusers_dir.strip('/')}/{agent_unit(w.id).removesuffix('.service')}.conf"
    text = _template(
        "account.service.j2",
        r.templates,
        id=w.id,
        source=f"{w.source}",
        user=workload_user(w.id),
        sysusers_line=line,
        exec_start=f"{systemd_quote(r.layout.systemd_sysusers)} {systemd_quote('/' + snippet)}",
        subid_check=subid_check_command(r.layout, w.id),
    )
    header = f"# Written by fabric-reconcile: do not edit. Source: {w.source}.\n"
    return [Artifact(snippet, header + line + "\n", 0o644, "file"), unit_artifact(r.layout.unit_path(account_unit(w.id)), text)]


@dataclass(frozen=True)
class SocatListen:
    """Where a port map's socat listens, and why (the unit's comment)."""

    address: str | None  # None: every address
    why: tuple[str, ...]


def socat_listen(pm: PortMap, facts: HostFacts) -> SocatListen:
    """The tailnet address of this host unless `allow_from` opens the port
    map beyond the tailnet; loopback while the probe knows no tailnet address
    (nothing but this host reaches it then, and the pass says why)."""
    if pm.allow_from:
        return SocatListen(
            None,
            (
                f"Every address: allow_from opens this port map beyond the tailnet ({', '.join(pm.allow_from)}),",
                "whose clients reach the host's other addresses; the table inet fabric admits",
                "the tailnet and those networks only.",
            ),
        )
    address = tailnet_address(facts)
    if address is None:
        return SocatListen(
            LOOPBACK,
            (
                f"Loopback only: this host's tailnet address is unknown ({unknown_reason(facts)});",
                "the next pass that finds it listens there.",
            ),
        )
    return SocatListen(
        address,
        (
            "This host's tailnet address only (the probe's): no other interface reaches it,",
            "whatever the firewall says. ip-freebind: a boot that starts it before Tailscale is up",
            "binds all the same.",
        ),
    )


def socat_listen_argument(pm: PortMap, listen: SocatListen) -> str:
    """socat's first address: `TCP-LISTEN:<port>[,bind=<address>,ip-freebind=1],fork,reuseaddr`."""
    proto = pm.protocol.upper()
    if listen.address is None:
        return f"{proto}-LISTEN:{pm.listen_port},fork,reuseaddr"
    ip = ipaddress.ip_address(listen.address)
    if ip.version == 6:
        return f"{proto}6-LISTEN:{pm.listen_port},bind=[{ip}],ip-freebind=1,fork,reuseaddr"
    return f"{proto}4-LISTEN:{pm.listen_port},bind={ip},ip-freebind=1,fork,reuseaddr"


def _render_port_maps(r: _HostRender) -> list[Artifact]:
    """Port maps of this host: one socat unit each, its port opened in nftables."""
    artifacts = []
    for pm in sorted((m for m in r.desired.fleet.port_maps if m.host == r.host_name), key=lambda m: m.name):
        target = r.desired.hosts[pm.target_host].host.address
        six = ipaddress.ip_address(target).version == 6
        proto = pm.protocol.upper()
        where = socat_listen(pm, r.facts)
        if where.address == LOOPBACK:
            r.notes.append(f"port map {pm.name}: listens on {LOOPBACK} only: this host's tailnet address is unknown ({unknown_reason(r.facts)})")
        listen = socat_listen_argument(pm, where)
        connect = f"{proto}6:[{target}]:{pm.target_port}" if six else f"{proto}4:{target}:{pm.target_port}"
        exec_start = " ".join(systemd_quote(a) for a in (r.layout.socat, listen, connect))
        text = _template(
            "socat.service.j2",
            r.templates,
            source=f"{_fleet_file_name(r.desired)} port_maps[{pm.name}]",
            name=pm.name,
            protocol=pm.protocol,
            listen_port=pm.listen_port,
            target_host=pm.target_host,
            target_address=target,
            target_port=pm.target_port,
            listen_address=where.address or "every address",
            listen_why=where.why,
            exec_start=exec_start,
        )
        artifacts.append(unit_artifact(r.layout.unit_path(f"fabric-socat-{pm.name}.service"), text))
        (r.tcp_ports if pm.protocol == "tcp" else r.udp_ports).add(pm.listen_port)
        if pm.allow_from:
            r.openings.append(nft_opening(pm))
            r.notes.append(exposure_note(pm))
    return artifacts


def _render_ray(r: _HostRender) -> list[Artifact]:
    """The Ray node of this host, if [ray] names it; the head's ports tailnet only."""
    ray = ray_unit(r.desired, r.host_name, r.facts, r.layout.ray, r.ray_closed)
    if ray is None:
        return []
    if ray.closed is not None:
        r.notes.append(f"{ray.unit}: closed to new Ray tasks ({ray.closed}): no CPUs, GPUs or tiers offered")
    if ray.role == "head" and r.desired.fleet.ray is not None:
        # Ray's GCS and dashboard have no authentication: tailnet only.
        r.tcp_ports.add(r.desired.fleet.ray.port)
        if r.desired.fleet.ray.dashboard:
            r.tcp_ports.add(r.desired.fleet.ray.dashboard_port)
    return [unit_artifact(r.layout.unit_path(ray.unit), _ray_unit_text(ray, r.desired, r.facts, r.templates))]


def _render_nftables(r: _HostRender) -> list[Artifact]:
    """The table inet fabric (the ports of the services running here and of the
    renderers before: port maps, Ray's head) and the unit that loads it."""
    for service_id in r.part.services_here:
        service = r.desired.service(service_id)
        if service is not None and service.port is not None and any(w.id == service_id and w.what == "service" for w in r.workloads):
            r.tcp_ports.add(service.port)
    nft_text = _template(
        "fabric.nft.j2",
        r.templates,
        host=r.host_name,
        tailnet=TAILNET,
        tailnet6=TAILNET6,
        tailnet_interface=r.host.host.tailnet_interface,
        tcp_ports=[str(p) for p in sorted(r.tcp_ports)],
        udp_ports=[str(p) for p in sorted(r.udp_ports)],
        openings=r.openings,
        nftables_fix=needs_nftables_fix(r.host, r.facts),
    )
    nft_load = " ".join(systemd_quote(a) for a in (r.layout.nft, "-f", "/" + r.layout.nft_file))
    return [
        Artifact(r.layout.nft_file, nft_text, 0o644, "nft"),
        unit_artifact(r.layout.unit_path("fabric-nftables.service"), _template("nftables-load.service.j2", r.templates, exec_start=nft_load)),
    ]


def _render_edge(r: _HostRender) -> list[Artifact]:
    """The edge: one Caddy site per routed service, and the fleet's status page
    (a static file each pass rewrites; see reconciler.core.views.page)."""
    if "edge" not in r.host.host.roles:
        return []
    sites = []
    for service in sorted((s for s in r.desired.fleet.services if s.route), key=lambda s: s.route.host if s.route else ""):
        assert service.route is not None and service.port is not None
        upstreams = [caddy_address(r.desired.hosts[n].host.address, service.port) for n in r.part.nodes_of(service.id)]
        sites.append({"service": service.id, "host": service.route.host, "path": service.route.path, "upstreams": upstreams})
    text = _template(
        "fabric.caddy.j2",
        r.templates,
        host=r.host_name,
        sites=sites,
        proxy=proxy_timings(r.desired.fleet.edge),
        status_site=status_caddy_site(r.desired),
    )
    return [Artifact(r.layout.caddy_file, text, 0o644, "caddy")]


def _render_phaze(r: _HostRender) -> list[Artifact]:
    """phaze's control plane reads its lanes from backends.toml."""
    if "control" in r.host.host.roles and r.desired.fleet.lanes:
        return [phaze_backends(r.desired, r.layout, r.templates, r.part.lanes_out)]
    return []


def k3s_labels_dropin(host_name: str, host: HostConfig, facts: HostFacts, templates: Templates | Path | None = None) -> str | None:
    """The k3s label drop-in's text (None: no label to give), as every pass
    renders it; the first-boot bootstrap writes the same text before the k3s
    agent joins (reconciler.core.install.bootstrap)."""
    labels = _labels(host, facts, [])
    if not labels:
        return None
    return _template("k3s-labels.yaml.j2", Templates.of(templates), host=host_name, labels=labels)


def _render_k3s_labels(r: _HostRender) -> list[Artifact]:
    """k3s node labels from the probe (and the host file)."""
    labels = _labels(r.host, r.facts, r.notes)
    if not labels:
        return []
    return [Artifact(r.layout.k3s_dropin, _template("k3s-labels.yaml.j2", r.templates, host=r.host_name, labels=labels), 0o644, "dropin")]


# The per-artifact renderers, in the order they run: the notes come in this
# order, and nftables comes after every renderer that opens a port.
_RENDERERS: tuple[Callable[[_HostRender], list[Artifact]], ...] = (
    _render_agents,
    _render_port_maps,
    _render_ray,
    _render_nftables,
    _render_edge,
    _render_phaze,
    _render_k3s_labels,
)


def render(
    desired: DesiredState,
    host_name: str,
    facts: HostFacts,
    plan: FleetPlan,
    *,
    layout: Layout = Layout(),
    templates: Templates | Path | None = None,
    ray_closed: str | None = None,
) -> Rendered:
    """Every artifact of `host_name`; raise RenderError if it cannot be done.

    The templates come from the package (`templates`: kept compiled where the
    caller says, core.templating.Templates); a directory renders from there
    instead (tests render edited copies). `ray_closed`: why this
    host takes no new work (drained, held off; `ray_units.closed_reason`),
    so its Ray node offers nothing new."""
    host = desired.hosts.get(host_name)
    if host is None:
        known = ", ".join(sorted(desired.hosts)) or "none"
        raise RenderError(f"host {host_name!r} is not declared in the desired state (hosts: {known})")
    notes: list[str] = []
    arch = host_arch(host, facts)
    # All that is read from the fleet plan is this host's part of it (checked
    # against the desired state there): `fabric watch` starts a pass when it changes.
    part = plan_part(desired, plan, host_name, notes)
    r = _HostRender(desired, host_name, host, facts, layout, Templates.of(templates), ray_closed, notes, part, arch)
    r.workloads = _workloads_here(r)
    artifacts = [artifact for renderer in _RENDERERS for artifact in renderer(r)]
    artifacts.sort(key=lambda a: a.path)
    return Rendered(tuple(artifacts), tuple(notes))


def complete_caddy_config(main: str | None, snippet_path: str, snippet: str) -> str:
    """The whole config Caddy validates and loads on an edge host.

    The fabric owns only its snippet. When the operator's main Caddyfile
    imports it (a line `import /etc/caddy/fabric.caddy`, or a glob matching
    it such as NixOS's `import /etc/caddy/fabric*.caddy`), the complete config
    is that Caddyfile with the import line replaced by the snippet's text, so
    what is validated before installing is exactly what is loaded, and the
    operator's own sites and global options stay. Without such a main file the
    snippet alone is the config (it is a valid Caddyfile by itself).
    """
    if main is None:
        return snippet
    target = "/" + snippet_path.lstrip("/")
    lines = main.splitlines(keepends=True)
    out = []
    found = False
    for line in lines:
        words = line.split("#", 1)[0].split()
        if len(words) == 2 and words[0] == "import" and fnmatch.fnmatchcase(target, words[1]):
            out.append(snippet if snippet.endswith("\n") else snippet + "\n")
            found = True
        else:
            out.append(line)
    return "".join(out) if found else snippet
