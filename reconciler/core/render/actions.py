"""Host actions of a pass: the rendered artifacts against what is on disk and what runs.

Pure: `host_actions()` compares contents it is given (read elsewhere through the
FileTree port) and returns a `HostActions`, the list of actions `reconciler.engine.apply`
executes; `HostActions.text()` is what `fabric plan` prints.

Two views of the old state go in, because they can differ:

- `installed`: the bytes on disk now. Decides which files to write; so do
  `installed_modes`: a file whose mode grants more than its artifact's (a
  unit with environment installed 0644 by an older version, now 0640) is
  written again, its bytes unchanged, which restarts nothing.
- `running`:   the contents systemd, nft and Caddy were last activated with.
  Decides what to restart, reload, start and stop. Normally the same as
  `installed`; after a pass was killed between installing files and finishing
  activation, `apply` passes the last good generation instead, so the next
  pass still restarts what the killed one did not get to.

The fabric touches only what it created: removals come only from `tracked`
(the paths in its own manifests), never from scanning a directory.

One kind of unit it restarts without rendering it: a unit an artifact names in
`restarts` (phaze's control plane, which reads backends.toml at startup only).
When that file differs from what ran (written, changed, or removed), those
units are restarted like a unit whose own file changed, and listed under
"restart" with the file as the reason; one known not to run
(`dependent_states`) is left alone, as it reads the file when it starts.

daemon-reload is planned only when it is needed for a change to take effect:
when systemd holds in memory the configuration of a unit whose file (or
drop-in) differs from what ran (`units_held`). A unit systemd has not loaded,
or holds only as a not-found stub that it retries (systemd >= 246 loads such a
unit from disk at its next start once the unit directories changed), reads
its new file when it starts; a unit that leaves the plan is stopped, and its
removed file needs no reload (systemd drops an inactive unit nobody refers
to; one that stays loaded, say failed, is held when a later pass writes it
again, and that pass reloads). When systemd cannot be asked (`units_held`
None, or a unit missing from it) the reload follows every change of a unit
file and every stop, as before systemd was asked.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from reconciler.core.render.artifacts import Artifact

# --------------------------------------------------------------------------
# compare_units, in the spirit of NixOS switch-to-configuration-ng


class UnitChange(enum.IntEnum):
    """How much a unit's running instance is affected by a new unit file.

    Ordered: a larger value includes the smaller ones.
    """

    NONE = 0  # same settings (at most comments or whitespace changed)
    METADATA = 1  # daemon-reload is enough: nothing the running process sees
    RELOAD = 2  # ExecReload= applies the change
    RESTART = 3  # the process must be restarted to see the change


# [Unit] keys that describe the unit to systemd and to people, but do not
# change the running process (NixOS's list of keys that need no restart).
UNIT_KEYS_WITHOUT_RESTART = frozenset(
    {
        "Description",
        "Documentation",
        "OnFailure",
        "OnSuccess",
        "OnFailureJobMode",
        "IgnoreOnIsolate",
        "StopWhenUnneeded",
        "RefuseManualStart",
        "RefuseManualStop",
        "AllowIsolate",
        "CollectMode",
        "SourcePath",
        "StartLimitIntervalSec",
        "StartLimitBurst",
    }
)
# NixOS's markers: a change of X-Reload-Triggers means "reload me"; a unit
# that says X-ReloadIfChanged=true is reloaded instead of restarted.
RELOAD_TRIGGERS = "X-Reload-Triggers"
RESTART_TRIGGERS = "X-Restart-Triggers"
RELOAD_IF_CHANGED = "X-ReloadIfChanged"

UnitSections = dict[str, dict[str, tuple[str, ...]]]


def parse_unit(text: str) -> UnitSections:
    """A unit file as {section: {key: (values in order)}}; comments and blank
    lines dropped, backslash continuations joined, as systemd reads it."""
    sections: UnitSections = {}
    current: dict[str, list[str]] | None = None
    raw: dict[str, dict[str, list[str]]] = {}
    pending = ""
    for line in text.split("\n"):  # systemd splits on \n only, unlike str.splitlines
        line = pending + line.strip() if pending else line.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            current = raw.setdefault(line[1:-1], {})
            continue
        if current is None:
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    for name, keys in raw.items():
        sections[name] = {k: tuple(v) for k, v in keys.items()}
    return sections


def _has(sections: UnitSections, section: str, key: str) -> bool:
    return any(v for v in sections.get(section, {}).get(key, ()))


def _true(sections: UnitSections, section: str, key: str) -> bool:
    values = sections.get(section, {}).get(key, ())
    return bool(values) and values[-1].lower() in {"1", "yes", "true", "on"}


def compare_units(old: str, new: str) -> UnitChange:
    """What a change from unit text `old` to `new` requires of the running unit.

    - identical settings: NONE;
    - only [Install] (enablement) or [Unit] keys that describe the unit
      (UNIT_KEYS_WITHOUT_RESTART, X-* other than the triggers): METADATA;
    - X-Reload-Triggers changed, and the unit can reload (ExecReload=): RELOAD;
    - anything else in [Unit], [Service] or another section: RESTART, unless
      the new unit says X-ReloadIfChanged=true and has ExecReload=, then RELOAD.
    """
    a, b = parse_unit(old), parse_unit(new)
    if a == b:
        return UnitChange.NONE
    can_reload = _has(b, "Service", "ExecReload")
    reload_instead = can_reload and _true(b, "Service", RELOAD_IF_CHANGED)
    change = UnitChange.METADATA
    for section in sorted(set(a) | set(b)):
        old_keys, new_keys = a.get(section, {}), b.get(section, {})
        if old_keys == new_keys or section == "Install":
            continue
        changed = {k for k in set(old_keys) | set(new_keys) if old_keys.get(k) != new_keys.get(k)}
        for key in sorted(changed):
            if section == "Unit" and (key in UNIT_KEYS_WITHOUT_RESTART or (key.startswith("X-") and key not in (RELOAD_TRIGGERS, RESTART_TRIGGERS))):
                continue
            if section == "Unit" and key == RELOAD_TRIGGERS and can_reload:
                change = max(change, UnitChange.RELOAD)
            elif reload_instead:
                change = max(change, UnitChange.RELOAD)
            else:
                return UnitChange.RESTART
    return change


# --------------------------------------------------------------------------
# The plan

ACTIVE_STATES = frozenset({"active", "activating", "reloading"})


@dataclass(frozen=True)
class HostActions:
    """What one pass does, in the order `apply` does it."""

    write: tuple[str, ...] = ()  # paths (relative to the root)
    remove: tuple[str, ...] = ()
    daemon_reload: bool = False
    nft_load: bool = False
    stop: tuple[str, ...] = ()  # unit names
    reload: tuple[str, ...] = ()
    restart: tuple[str, ...] = ()
    start: tuple[str, ...] = ()
    caddy_reload: bool = False
    node_labels: bool = False  # set the k3s Node's labels to the drop-in's
    # Why each unit is in its list, for the audit trail.
    reasons: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def empty(self) -> bool:
        return not (
            self.write
            or self.remove
            or self.daemon_reload
            or self.nft_load
            or self.stop
            or self.reload
            or self.restart
            or self.start
            or self.caddy_reload
            or self.node_labels
        )

    def to_json(self) -> dict[str, object]:
        return {
            "write": list(self.write),
            "remove": list(self.remove),
            "daemon_reload": self.daemon_reload,
            "nft_load": self.nft_load,
            "stop": list(self.stop),
            "reload": list(self.reload),
            "restart": list(self.restart),
            "start": list(self.start),
            "caddy_reload": self.caddy_reload,
            "node_labels": self.node_labels,
            "reasons": dict(sorted(self.reasons.items())),
        }

    def text(self, *, files_done: bool = False, activation_done: bool = False) -> str:
        """The plan as a person reads it (`fabric plan`: "would ..."; after a
        pass, what was done); golden-tested."""
        if self.empty:
            return "nothing to do\n"
        lines: list[str] = []

        def verb(would: str, did: str, done: bool) -> str:
            return did if done else f"would {would}"

        def listing(would: str, did: str, done: bool, what: str, items: Sequence[str]) -> None:
            if items:
                lines.append(f"{verb(would, did, done)} the following {what}:")
                lines.extend(f"  {item}" for item in items)

        f, a = files_done, activation_done
        listing("write", "wrote", f, "files", self.write)
        listing("remove", "removed", f, "files", self.remove)
        if self.daemon_reload:
            lines.append(f"{verb('reload', 'reloaded', a)} the systemd manager configuration (daemon-reload)")
        if self.nft_load:
            lines.append(f"{verb('load', 'loaded', a)} the nftables table inet fabric")
        listing("stop", "stopped", a, "units", self.stop)
        listing("reload", "reloaded", a, "units", self.reload)
        listing("restart", "restarted", a, "units", self.restart)
        listing("start", "started", a, "units", self.start)
        if self.caddy_reload:
            lines.append(f"{verb('reload', 'reloaded', a)} caddy")
        if self.node_labels:
            lines.append(f"{verb('set', 'set', a)} the k3s node's labels to the drop-in's (where a k3s agent runs)")
        return "\n".join(lines) + "\n"


def _unit_name(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def configured_unit(path: str) -> str:
    """The unit a unit file configures: NAME for a drop-in `NAME.d/x.conf`,
    else the file's own name. (The fabric renders no drop-in of kind "unit"
    today: only the daemon-reload looks through one to its unit; the job
    lists take every unit file for a unit of its own.)"""
    directory, _, name = path.rpartition("/")
    parent = directory.rpartition("/")[2]
    if parent.endswith(".d") and name.endswith(".conf"):
        return parent.removesuffix(".d")
    return name


def is_dropin(path: str) -> bool:
    """Whether a unit file is a drop-in (`NAME.d/x.conf`) of the unit NAME."""
    return configured_unit(path) != _unit_name(path)


@dataclass
class _UnitJobs:
    """The job lists of a pass, and why each unit is in its list."""

    stop: list[str] = field(default_factory=list)
    reload: list[str] = field(default_factory=list)
    restart: list[str] = field(default_factory=list)
    start: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)

    def add(self, jobs: list[str], unit: str, reason: str) -> None:
        jobs.append(unit)
        self.reasons[unit] = reason


def _unit_jobs(
    desired_by_path: Mapping[str, Artifact],
    gone: Sequence[str],
    installed: Mapping[str, bytes],
    tracked: Mapping[str, str],
    running: Mapping[str, bytes],
    unit_states: Mapping[str, str] | None,
) -> _UnitJobs:
    """Units: stop those that left the plan, start new ones (and desired ones
    not running), restart or reload those whose settings changed."""
    jobs = _UnitJobs()
    for path in gone:
        if tracked[path] == "unit" and (path in installed or path in running):
            jobs.add(jobs.stop, _unit_name(path), "left the plan")
    for path, artifact in sorted(desired_by_path.items()):
        if artifact.kind != "unit":
            continue
        unit = _unit_name(path)
        old = running.get(path)
        if old is None:
            jobs.add(jobs.start, unit, "new unit")
            continue
        change = compare_units(old.decode("utf-8", "replace"), artifact.content)
        if change == UnitChange.RESTART:
            jobs.add(jobs.restart, unit, "settings changed")
        elif change == UnitChange.RELOAD:
            jobs.add(jobs.reload, unit, "reload triggers changed")
        elif unit_states is not None and unit_states.get(unit, "inactive") not in ACTIVE_STATES:
            jobs.add(jobs.start, unit, f"not running ({unit_states.get(unit, 'inactive')})")
    return jobs


def _dependent_restarts(
    jobs: _UnitJobs,
    desired_by_path: Mapping[str, Artifact],
    gone: Sequence[str],
    running: Mapping[str, bytes],
    tracked_restarts: Mapping[str, Sequence[str]] | None,
    dependent_states: Mapping[str, str] | None,
) -> None:
    """Units the fabric does not render that read a file at startup: restart
    them when the file differs from what ran, unless known not to run."""
    dependents: dict[str, str] = {}
    for path, artifact in sorted(desired_by_path.items()):
        if artifact.restarts and running.get(path) != artifact.data:
            for unit in artifact.restarts:
                dependents.setdefault(unit, f"{path} changed")
    for path in gone:
        if path in running:
            for unit in (tracked_restarts or {}).get(path, ()):
                dependents.setdefault(unit, f"{path} removed")
    for unit, reason in dependents.items():
        if unit in jobs.restart or unit in jobs.start or unit in jobs.stop:
            continue
        if dependent_states is not None and dependent_states.get(unit, "inactive") not in ACTIVE_STATES:
            continue
        jobs.add(jobs.restart, unit, reason)


def _nft_load(
    desired_by_path: Mapping[str, Artifact],
    gone: Sequence[str],
    tracked: Mapping[str, str],
    running: Mapping[str, bytes],
    nft_table_loaded: bool | None,
) -> bool:
    """nftables: load when the text changed, or when the table is gone from the
    kernel though the text did not change (a distro flushed the ruleset)."""
    nft = next((a for a in desired_by_path.values() if a.kind == "nft"), None)
    if nft is not None:
        return running.get(nft.path) != nft.data or nft_table_loaded is False
    # The table left the plan (a rollback to nothing): load the empty table.
    return any(tracked[p] == "nft" and p in running for p in gone)


def _caddy_reload(desired_by_path: Mapping[str, Artifact], gone: Sequence[str], tracked: Mapping[str, str], running: Mapping[str, bytes]) -> bool:
    """Caddy: reload when its snippet differs from what ran, or left the plan."""
    caddy_paths = {a.path for a in desired_by_path.values() if a.kind == "caddy"}
    return any(running.get(p) != desired_by_path[p].data for p in caddy_paths) or any(tracked[p] == "caddy" and p in running for p in gone)


def host_actions(
    desired: Iterable[Artifact],
    installed: Mapping[str, bytes],
    tracked: Mapping[str, str],
    *,
    running: Mapping[str, bytes] | None = None,
    unit_states: Mapping[str, str] | None = None,
    nft_table_loaded: bool | None = None,
    tracked_restarts: Mapping[str, Sequence[str]] | None = None,
    dependent_states: Mapping[str, str] | None = None,
    units_held: Mapping[str, bool] | None = None,
    installed_modes: Mapping[str, int] | None = None,
) -> HostActions:
    """Compare `desired` with the old state; see the module docstring.

    installed:   path -> bytes on disk now (absent paths missing).
    tracked:     path -> kind of every file the fabric's manifests say it wrote.
    running:     path -> bytes last activated (default: `installed`).
    unit_states: unit -> ActiveState, when systemd can be asked; a desired unit
                 that is not running (after a reboot, or a failed start) is started.
    tracked_restarts: path -> `restarts` of a tracked file, for one that leaves
                 the plan.
    dependent_states: unit -> ActiveState of the units in `restarts`, when
                 systemd can be asked; one not running is not restarted.
    units_held:  unit -> whether systemd holds its configuration in memory
                 (`Systemd.units_held`), for the units of the desired unit
                 files and of the tracked drop-ins, when systemd can be asked;
                 decides the daemon-reload (see the module docstring).
    installed_modes: path -> permission bits on disk now, when read: a file
                 whose bits go beyond its artifact's mode is written again.
    """
    running = installed if running is None else running
    desired_by_path = {a.path: a for a in desired}
    # Files: write what differs from the disk, remove what the fabric wrote and no longer wants.
    write = sorted(p for p, a in desired_by_path.items() if installed.get(p) != a.data)
    # Same bytes, a looser mode on disk: written again (a tighter one is the operator's).
    loose = sorted(p for p, a in desired_by_path.items() if installed.get(p) == a.data and (installed_modes or {}).get(p, a.mode) & ~a.mode)
    gone = sorted(set(tracked) - set(desired_by_path))
    remove = [p for p in gone if p in installed or p in running]
    jobs = _unit_jobs(desired_by_path, gone, installed, tracked, running, unit_states)
    _dependent_restarts(jobs, desired_by_path, gone, running, tracked_restarts, dependent_states)
    return HostActions(
        write=tuple(sorted(write + loose)),
        remove=tuple(remove),
        daemon_reload=_daemon_reload(desired_by_path, write, remove, tracked, running, bool(jobs.stop), units_held),
        nft_load=_nft_load(desired_by_path, gone, tracked, running, nft_table_loaded),
        stop=tuple(sorted(jobs.stop)),
        reload=tuple(sorted(jobs.reload)),
        restart=tuple(sorted(jobs.restart)),
        start=tuple(sorted(jobs.start)),
        caddy_reload=_caddy_reload(desired_by_path, gone, tracked, running),
        # k3s reads its label drop-in only at its start, and never removes a
        # label: the Node's labels are set when the drop-in changes
        # (reconciler.core.render.k3s_node).
        node_labels=any(desired_by_path[p].kind == "dropin" for p in write) or any(tracked.get(p) == "dropin" for p in remove),
        reasons=jobs.reasons,
    )


def _daemon_reload(
    desired_by_path: Mapping[str, Artifact],
    write: Sequence[str],
    remove: Sequence[str],
    tracked: Mapping[str, str],
    running: Mapping[str, bytes],
    stops: bool,
    units_held: Mapping[str, bool] | None,
) -> bool:
    """Whether systemd must re-read its unit files for this pass's changes to
    take effect (see the module docstring)."""
    # The unit files that differ from what systemd was last activated with:
    # written now, or written by a killed pass that did not get to its
    # daemon-reload (then `running` differs, not the disk); and those removed now.
    changed = [p for p, a in desired_by_path.items() if a.kind == "unit" and (p in write or running.get(p) != a.data)]
    removed = [p for p in remove if tracked[p] == "unit"]
    # A unit whose own file is removed leaves the plan and is stopped: only
    # the drop-ins of a unit that stays are of a configuration still in use.
    leaving = {configured_unit(p) for p in removed if not is_dropin(p)}
    concerned = {configured_unit(p) for p in changed} | {configured_unit(p) for p in removed if configured_unit(p) not in leaving}
    if units_held is None or not concerned <= units_held.keys():
        # systemd cannot tell (not asked, or not about every unit): reload
        # whenever a unit file changed or a unit stops, as if each were held.
        return bool(changed or removed or stops)
    return any(units_held[unit] for unit in concerned)
