"""Load and validate the desired state: fabric.toml plus one file per host.

Pure apart from reading the files it is given (through `read_text`, so tests and
the replay path can hand it anything). The files come from a commit anyone
with push access wrote, and the pass reads them as root, so the reader
(`read_desired_file`) takes regular files only (no symbolic link, FIFO or
device: a link could point at /etc/shadow, a FIFO would hang the pass), of at
most MAX_FILE_BYTES, as UTF-8; and the parser turns every way a file can be
broken (syntax, nesting too deep for the parser, numbers too long) into a
problem, never a traceback. Every problem becomes a `Problem`
(file, key path, reason); all of them are collected before anything is
reported, so an operator fixes a broken push in one round.

Layout of a desired-state directory DIR:
    DIR/fabric.toml           fleet settings, lanes, services, port maps
    DIR/<host>.toml           one file per host (the example fleet: hosts/)
    DIR/hosts/<host>.toml     ...or in a hosts/ subfolder (a fleet git repo)
"""

from __future__ import annotations

import difflib
import stat
import tomllib
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from reconciler.core.desired.lane_rules import compute_lane_rules, lane_rules
from reconciler.core.desired.model import DesiredState, FleetConfig, HostConfig, is_name
from reconciler.core.desired.problems import Problem, ProblemsError, problem_from_toml_error, problems_from_validation

Model = TypeVar("Model", bound=BaseModel)

FLEET_FILE = "fabric.toml"
# No desired-state file comes near this; a larger one is refused unread
# (/dev/zero behind a link, a generated monster), before it can take memory.
MAX_FILE_BYTES = 1024 * 1024


class DesiredStateError(ProblemsError):
    """The desired state is invalid; `problems` lists every reason."""


# --------------------------------------------------------------------------
# Loading


class UnreadableFile(OSError):
    """A desired-state file the loader will not read (the reason says why)."""


def _parse_toml(file: str, text: str) -> tuple[dict[str, Any] | None, list[Problem]]:
    try:
        return tomllib.loads(text), []
    except tomllib.TOMLDecodeError as exc:
        return None, [problem_from_toml_error(file, exc)]
    except RecursionError:  # thousands of '[' or '{': deeper than the parser goes
        return None, [Problem(file, "(syntax)", "TOML nested too deeply to parse")]
    except ValueError as exc:  # an integer of more digits than Python converts
        return None, [Problem(file, "(syntax)", f"TOML value out of range: {str(exc)[:120]}")]


def _validate(file: str, model: type[Model], data: dict[str, Any]) -> tuple[Model | None, list[Problem]]:
    try:
        return model.model_validate(data), []
    except ValidationError as exc:
        return None, problems_from_validation(file, exc, model)
    except RecursionError:
        return None, [Problem(file, "(file)", "nested too deeply to validate")]


def host_files(directory: Path) -> list[Path]:
    """Every host file of DIR: DIR/*.toml and DIR/hosts/*.toml (a hosts/ that
    is a link is not followed: it could lead anywhere on the host)."""
    files = [p for p in directory.glob("*.toml") if p.name != FLEET_FILE]
    sub = directory / "hosts"
    if sub.is_dir() and not sub.is_symlink():
        files += list(sub.glob("*.toml"))
    return sorted(files)


def _read_fleet(fleet_path: Path, read_text: Callable[[Path], str]) -> tuple[FleetConfig | None, list[Problem]]:
    """fabric.toml, validated on its own; raises DesiredStateError when it cannot be read at all."""
    fleet_name = str(fleet_path)
    try:
        fleet_text = read_text(fleet_path)
    except FileNotFoundError:
        raise DesiredStateError([Problem(fleet_name, "(file)", "not found: a desired-state directory needs fabric.toml")]) from None
    except UnreadableFile as exc:
        raise DesiredStateError([Problem(fleet_name, "(file)", str(exc))]) from None
    except OSError as exc:
        raise DesiredStateError([Problem(fleet_name, "(file)", f"cannot read: {exc.strerror or exc}")]) from None
    data, problems = _parse_toml(fleet_name, fleet_text)
    if data is None:
        return None, problems
    return _validate(fleet_name, FleetConfig, data)


def _read_host(path: Path, read_text: Callable[[Path], str]) -> tuple[HostConfig | None, list[Problem]]:
    """One host file, validated on its own (None: it is broken)."""
    name = str(path)
    try:
        text = read_text(path)
    except UnreadableFile as exc:
        return None, [Problem(name, "(file)", str(exc))]
    except OSError as exc:
        return None, [Problem(name, "(file)", f"cannot read: {exc.strerror or exc}")]
    data, problems = _parse_toml(name, text)
    if data is None:
        return None, problems
    return _validate(name, HostConfig, data)


def _misnamed(path: Path, host: HostConfig) -> Problem | None:
    if host.host.name == path.stem:
        return None
    return Problem(str(path), "host.name", f"{host.host.name!r} does not match the file name {path.stem!r}")


def read_desired_file(path: Path) -> str:
    """A desired-state file's text; raises UnreadableFile (why, never what it
    holds) for anything but a regular UTF-8 file of at most MAX_FILE_BYTES,
    and OSError (FileNotFoundError) when it cannot be read."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        raise UnreadableFile(f"is a symbolic link (to {path.readlink()}): desired-state files must be regular files inside the tree")
    if not stat.S_ISREG(info.st_mode):
        raise UnreadableFile("is not a regular file")
    if info.st_size > MAX_FILE_BYTES:
        raise UnreadableFile(f"is {info.st_size} bytes, over the {MAX_FILE_BYTES} bytes a desired-state file may have")
    with path.open("rb") as file:
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:  # it grew since: still refused
        raise UnreadableFile(f"is over the {MAX_FILE_BYTES} bytes a desired-state file may have")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableFile(f"is not UTF-8 text (byte {exc.start})") from None


def load_desired(
    directory: Path | str, read_text: Callable[[Path], str] = read_desired_file, *, overlay: Mapping[Path, str] | None = None
) -> DesiredState:
    """Load and validate DIR; raise DesiredStateError with every problem.
    `overlay`: files (their paths under DIR) read as these texts instead,
    a host file among them as if it were there (`fabric admit` validates
    the tree with the file it would write, before writing it)."""
    directory = Path(directory)
    if overlay:
        added = dict(overlay)
        read_text = _overlaid(read_text, added)
        return _load_desired(directory, read_text, sorted(set(host_files(directory)) | {p for p in added if p.name != FLEET_FILE}))
    return _load_desired(directory, read_text, host_files(directory))


def _overlaid(read_text: Callable[[Path], str], overlay: dict[Path, str]) -> Callable[[Path], str]:
    def read(path: Path) -> str:
        return overlay[path] if path in overlay else read_text(path)

    return read


def _load_desired(directory: Path, read_text: Callable[[Path], str], files: list[Path]) -> DesiredState:
    fleet_path = directory / FLEET_FILE
    fleet_name = str(fleet_path)
    fleet, problems = _read_fleet(fleet_path, read_text)

    hosts: dict[str, HostConfig] = {}
    host_sources: dict[str, str] = {}
    # Hosts whose file is broken still count as declared, so one bad host file
    # does not also produce "not a declared host" for every reference to it.
    broken_hosts: set[str] = set()
    for path in files:
        name = str(path)
        host, errs = _read_host(path, read_text)
        problems += errs
        if host is None:
            broken_hosts.add(path.stem)
            continue
        misnamed = _misnamed(path, host)
        if misnamed is not None:
            problems.append(misnamed)
            continue
        if host.host.name in hosts:
            problems.append(Problem(name, "host.name", f"duplicate host {host.host.name!r} (also in {host_sources[host.host.name]})"))
            continue
        hosts[host.host.name] = host
        host_sources[host.host.name] = name

    if fleet is not None:
        problems += fleet_rules(fleet_name, fleet, hosts, host_sources, broken_hosts)
    if problems:
        raise DesiredStateError(problems)
    assert fleet is not None
    return DesiredState(fleet=fleet, hosts=hosts, fleet_file=fleet_name)


def host_file(directory: Path, name: str, exists: Callable[[Path], bool] = Path.is_file) -> Path | None:
    """Where host `name`'s file is (DIR/<name>.toml, else DIR/hosts/<name>.toml); None: not declared.
    A name that is not a host name (it comes from a plan or the registry:
    `../../etc/shadow`) names no file: no path is built from it."""
    if name == Path(FLEET_FILE).stem or not is_name(name):
        return None
    for path in (directory / f"{name}.toml", directory / "hosts" / f"{name}.toml"):
        if exists(path):
            return path
    return None


def load_hosts_of(
    directory: Path | str,
    names: Collection[str],
    read_text: Callable[[Path], str] = read_desired_file,
    exists: Callable[[Path], bool] = Path.is_file,
    *,
    fleet: FleetConfig | None = None,
    loaded: dict[str, HostConfig] | None = None,
) -> DesiredState:
    """fabric.toml and the files of the hosts `names`, each validated on its
    own; a name without a file is not declared and left out. For a tree whose
    whole was validated (load_desired) at the same commit: the rules that span
    files are not checked again, so a host's pass reads a few files however
    large the fleet. `fleet` and `loaded` (already validated) are not read again.
    Raises DesiredStateError with every problem of the files it reads."""
    directory = Path(directory)
    fleet_name = str(directory / FLEET_FILE)
    problems: list[Problem] = []
    if fleet is None:
        fleet, problems = _read_fleet(directory / FLEET_FILE, read_text)
    hosts = dict(loaded or {})
    for name in sorted(set(names) - set(hosts)):
        path = host_file(directory, name, exists)
        if path is None:
            continue
        host, errs = _read_host(path, read_text)
        problems += errs
        misnamed = _misnamed(path, host) if host is not None else None
        if misnamed is not None:
            problems.append(misnamed)
        elif host is not None:
            hosts[name] = host
    if problems:
        raise DesiredStateError(problems)
    assert fleet is not None
    return DesiredState(fleet=fleet, hosts=hosts, fleet_file=fleet_name)


# --------------------------------------------------------------------------
# Rules that span entries or files


def _duplicates(file: str, section: str, key: str, values: list[Any]) -> list[Problem]:
    counts = Counter(v for v in values if v is not None)
    problems = []
    seen: set[Any] = set()
    for index, value in enumerate(values):
        if value is None or counts[value] < 2:
            continue
        if value in seen:
            first = values.index(value)
            problems.append(Problem(file, f"{section}[{index}].{key}", f"duplicate {key} {value!r} (first at {section}[{first}])"))
        seen.add(value)
    return problems


@dataclass
class _Rules:
    """What the rules that span entries or files read, and the problems they find."""

    file: str
    fleet: FleetConfig
    hosts: dict[str, HostConfig]
    host_sources: dict[str, str]
    broken_hosts: Collection[str]
    problems: list[Problem] = field(default_factory=list)

    @property
    def all_hosts_loaded(self) -> bool:
        """Rules about roles need every host file; with a broken one they would guess."""
        return not self.broken_hosts

    def add(self, path: str, reason: str) -> None:
        self.problems.append(Problem(self.file, path, reason))

    def known_host(self, path: str, name: str) -> None:
        """A problem at `path` when `name` is not a declared host (a broken host file's name is)."""
        if name in self.hosts or name in self.broken_hosts:
            return
        known_hosts = sorted(self.hosts)
        close = difflib.get_close_matches(name, known_hosts, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f" (hosts: {', '.join(known_hosts) or 'none'})"
        self.add(path, f"{name!r} is not a declared host{hint}")


def _leader_rules(r: _Rules) -> None:
    """Leader candidates and plan keys: only a candidate signs plans; one key,
    one id, one host (a key listed for two hosts would let either sign as the other)."""
    candidates = r.fleet.fleet.leader_candidates
    for i, name in enumerate(candidates):
        r.known_host(f"fleet.leader_candidates[{i}]", name)
    if len(set(candidates)) != len(candidates):
        r.add("fleet.leader_candidates", "lists a host more than once")
    keys = r.fleet.plan_keys
    r.problems += _duplicates(r.file, "plan_keys", "id", [k.id for k in keys])
    first_listed: dict[str, int] = {}
    for i, key in enumerate(keys):
        first = first_listed.setdefault(key.public_key, i)
        if first != i:
            r.add(f"plan_keys[{i}].public_key", f"the same key as plan_keys[{first}] ({keys[first].id!r}): each key signs for one host under one id")
    for i, key in enumerate(keys):
        if key.host not in candidates:
            r.add(f"plan_keys[{i}].host", f"{key.host!r} is not a leader candidate ({', '.join(candidates)})")


def _lane_rules(r: _Rules) -> None:
    """Lanes (multi-compute.md's startup validators)."""
    fleet, backends = r.fleet, r.fleet.lanes
    r.problems += _duplicates(r.file, "backends", "id", [b.id for b in backends])
    r.problems += _duplicates(r.file, "backends", "agent_ref", [b.agent_ref for b in backends])
    r.problems += lane_rules(r.file, fleet)
    r.problems += compute_lane_rules(r.file, fleet)
    for i, b in enumerate(backends):
        if b.kind != "compute":
            continue
        if b.push_host not in r.hosts:
            r.known_host(f"backends[{i}].push_host", b.push_host or "")
        if fleet.agent is None:
            r.add(f"backends[{i}]", "a compute lane needs the [agent] table (image and command per architecture)")
        elif b.queue is not None and not fleet.phaze_dispatches and b.queue != f"{fleet.agent.queue_prefix}{b.agent_ref}":
            r.add(f"backends[{i}].queue", f"{b.queue!r} must equal {fleet.agent.queue_prefix}{b.agent_ref} (the agent derives its queue from its id)")
    if any(b.kind == "local" for b in backends) or not backends:
        if r.all_hosts_loaded and r.hosts and not any("control" in h.host.roles for h in r.hosts.values()):
            r.add("backends", "the local lane runs on the control host, and no host has the 'control' role")


def _service_rules(r: _Rules) -> None:
    """Services: unique ids, ports and routes; the status page's host reserved; an edge for routes."""
    services = r.fleet.services
    r.problems += _duplicates(r.file, "services", "id", [s.id for s in services])
    r.problems += _duplicates(r.file, "services", "port", [s.port for s in services])
    routes = [s.route.host if s.route else None for s in services]
    r.problems += [Problem(p.file, p.path.replace(".route", ".route.host"), p.reason) for p in _duplicates(r.file, "services", "route", routes)]
    status_host = f"{r.fleet.fleet.status_subdomain}.{r.fleet.fleet.domain}"
    for i, s in enumerate(services):
        if s.route is not None and s.route.host == status_host:
            r.add(f"services[{i}].route.host", f"{status_host!r} is reserved for the fabric's status page")
    if r.all_hosts_loaded and r.hosts and any(s.route for s in services) and not any("edge" in h.host.roles for h in r.hosts.values()):
        r.add("services", "services have routes but no host has the 'edge' role")


def _port_map_rules(r: _Rules) -> None:
    """Port maps: unique names and listeners, declared hosts, no service's port, no loop."""
    port_maps = r.fleet.port_maps
    r.problems += _duplicates(r.file, "port_maps", "name", [m.name for m in port_maps])
    listen = [f"{m.host}/{m.protocol}/{m.listen_port}" for m in port_maps]
    for p in _duplicates(r.file, "port_maps", "listen_port", listen):
        r.problems.append(Problem(p.file, p.path, "another port map already listens on this host, protocol and port"))
    service_ports = {s.port for s in r.fleet.services if s.port}
    for i, m in enumerate(port_maps):
        r.known_host(f"port_maps[{i}].host", m.host)
        r.known_host(f"port_maps[{i}].target_host", m.target_host)
        if m.listen_port in service_ports:
            r.add(f"port_maps[{i}].listen_port", f"{m.listen_port} is a service's port")
        if m.target_host == m.host and m.target_port == m.listen_port:
            r.add(f"port_maps[{i}].target_port", "a port map onto itself would loop")


def _ray_rules(r: _Rules) -> None:
    """The Ray cluster: declared hosts, and a head port no other listener of the head takes."""
    ray = r.fleet.ray
    if ray is None:
        return
    r.known_host("ray.head", ray.head)
    for i, name in enumerate(ray.workers):
        r.known_host(f"ray.workers[{i}]", name)
    head_ports = {s.port: f"service {s.id}'s port" for s in r.fleet.services if s.port}
    head_ports.update({m.listen_port: f"port map {m.name}'s listen_port" for m in r.fleet.port_maps if m.host == ray.head and m.protocol == "tcp"})
    ray_ports = {"port": ray.port, **({"dashboard_port": ray.dashboard_port} if ray.dashboard else {})}
    for ray_key, port in ray_ports.items():
        if port in head_ports:
            r.add(f"ray.{ray_key}", f"{port} is {head_ports[port]} (on the head {ray.head!r})")


def _group_rules(r: _Rules) -> None:
    """Worker groups: a hook names a declared group of its own tier."""
    groups = r.fleet.groups
    for tier, hook in r.fleet.scaling.cloud_hooks.items():
        if hook.group is None:
            continue
        key = f"scaling.cloud_hooks.{tier}.group"
        group = groups.get(hook.group)
        if group is None:
            known = ", ".join(sorted(groups)) or "none"
            r.add(key, f"{hook.group!r} is not a declared group ([groups.<name>]; declared: {known})")
        elif group.tier != tier:
            r.add(key, f"group {hook.group!r} has tier {group.tier!r}, not this hook's {tier!r}")


def _address_rules(r: _Rules) -> None:
    """Hosts: addresses are unique."""
    addresses: dict[str, str] = {}
    for name in sorted(r.hosts):
        addr = r.hosts[name].host.address
        if addr in addresses:
            r.problems.append(Problem(r.host_sources[name], "host.address", f"{addr} is also the address of {addresses[addr]!r}"))
        else:
            addresses[addr] = name


def fleet_rules(
    file: str,
    fleet: FleetConfig,
    hosts: dict[str, HostConfig],
    host_sources: dict[str, str],
    broken_hosts: Collection[str] = (),
) -> list[Problem]:
    """Every problem of the rules that span entries or files, in the order of fabric.toml's sections."""
    r = _Rules(file, fleet, hosts, host_sources, broken_hosts)
    for rules in (_leader_rules, _lane_rules, _service_rules, _port_map_rules, _ray_rules, _group_rules, _address_rules):
        rules(r)
    return r.problems


def summary(desired: DesiredState) -> str:
    """The one line `fabric validate` prints for a valid desired state."""
    lanes = desired.lanes
    implicit = "" if desired.fleet.lanes else " (implicit)"
    return (
        f"{desired.fleet_file}: valid: fleet {desired.fleet.fleet.name!r}, {len(desired.hosts)} hosts, "
        f"{len(lanes)} lanes{implicit}, {len(desired.fleet.services)} services, "
        f"{len(desired.fleet.port_maps)} port maps, registry {desired.fleet.registry.backend}"
    )
