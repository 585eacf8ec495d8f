"""Paths a commit hands to units, confined by the host, not by the commit.

Every path the desired state hands to a unit (a lane's scratch dir, an
agent's token, queue URL and CA files and models directory, every NAME_FILE
value, a service's credentials, a cloud hook's credentials and working
directory: its transient unit runs on a leader candidate) must lie under a prefix the host allows:
its own /etc/fabric/node.toml's `[node] allowed_path_prefixes`, else
DEFAULT_ALLOWED_PREFIXES. The system directories are refused by the model
itself, whatever a host allows (model.SYSTEM_DIRECTORIES). A pass checks the
paths of the units it may render (its lanes' agents, every service: any may
be placed on it) against its own node.toml; `fabric validate` checks every
host's against the defaults, or against the node.toml it is given.

Pure: the desired state and the prefixes in, the problems out.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from reconciler.core.desired.model import CloudHook, DesiredState, lies_in
from reconciler.core.desired.problems import Problem

# Where secrets and working directories for units live on a host by default.
DEFAULT_ALLOWED_PREFIXES = ("/run/secrets", "/run/credentials", "/var/lib/phaze", "/srv")


def _file_values(environment: dict[str, str], key: str) -> Iterator[tuple[str, str]]:
    for name, value in environment.items():
        if name.endswith("_FILE"):
            yield f"{key}.{name}", value


def unit_paths(desired: DesiredState, host: str | None = None) -> list[tuple[str, str]]:
    """(key path, path) of every path the desired state hands to a unit on
    `host` (None: on any host): its compute lanes' agents and every service."""
    fleet = desired.fleet
    paths: list[tuple[str, str]] = []
    agent_lanes = [(i, lane) for i, lane in enumerate(fleet.lanes) if lane.kind == "compute" and (host is None or lane.push_host == host)]
    if agent_lanes and fleet.agent is not None:
        agent = fleet.agent
        paths += [("agent.queue_url_file", agent.queue_url_file), ("agent.models_dir", agent.models_dir)]
        if agent.ca_file is not None:
            paths.append(("agent.ca_file", agent.ca_file))
        paths += _file_values(dict(agent.environment), "agent.environment")
    for i, lane in agent_lanes:
        if lane.scratch_dir is not None:
            paths.append((f"backends[{i}].scratch_dir", lane.scratch_dir))
        if lane.queue_url_file is not None:
            paths.append((f"backends[{i}].queue_url_file", lane.queue_url_file))
        token = desired.token_file_for(lane)
        if token is not None:
            paths.append((f"backends[{i}].token_file" if lane.token_file else "agent.token_dir", token))
    for i, service in enumerate(fleet.services):
        paths += _file_values(dict(service.environment), f"services[{i}].environment")
        paths += [(f"services[{i}].credentials.{name}", path) for name, path in service.credentials.items()]
    if host is None or host in fleet.fleet.leader_candidates:
        paths += hook_paths(desired)
    return paths


def hook_paths(desired: DesiredState) -> list[tuple[str, str]]:
    """(key path, path) of what the cloud hooks hand their transient units (on a leader candidate)."""
    paths = [item for tier, hook in desired.fleet.scaling.cloud_hooks.items() for item in tier_hook_paths(tier, hook)]
    for name, group in desired.fleet.groups.items():
        if group.stop_hook is not None:
            paths += tier_hook_paths(name, group.stop_hook, key=f"groups.{name}.stop_hook")
    return paths


def tier_hook_paths(tier: str, hook: CloudHook, key: str = "") -> list[tuple[str, str]]:
    """(key path, path) of what one tier's hook (or a group's stop hook, at `key`) hands its transient unit."""
    key = key or f"scaling.cloud_hooks.{tier}"
    paths = [(f"{key}.credentials.{name}", path) for name, path in hook.credentials.items()]
    if hook.working_directory is not None:
        paths.append((f"{key}.working_directory", hook.working_directory))
    return paths


def allowed(path: str, prefixes: Sequence[str]) -> bool:
    return any(lies_in(path, prefix) for prefix in prefixes)


def confinement_problems(desired: DesiredState, prefixes: Sequence[str], host: str | None = None, *, why: str = "") -> list[Problem]:
    """A problem for each path handed to a unit (on `host`) outside `prefixes`."""
    where = why or "the prefixes a host allows ([node] allowed_path_prefixes in /etc/fabric/node.toml)"
    return [
        Problem(desired.fleet_file, key, f"{path!r} is outside {where}: {', '.join(prefixes)}")
        for key, path in unit_paths(desired, host)
        if not allowed(path, prefixes)
    ]
