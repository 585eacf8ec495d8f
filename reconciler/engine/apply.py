"""Apply a pass: generations on disk, validation, activation in phases, rollback.

Everything goes through the ports (FileTree, PassLock, Systemd, Nftables, Caddy,
UnitVerifier, Audit); `reconciler.cli` chooses the real adapters, tests give
fakes. Only one pass runs at a time (PassLock).

On-disk protocol (under the state directory, default <root>/var/lib/fabric):

    generations/<n>/manifest.json   number, time, host, epoch, every artifact's
                                    path, kind, mode and sha256 (and the units
                                    it restarts, `Artifact.restarts`)
    generations/<n>/files/<path>    the artifact's bytes
    current                         the generation the host is converging to
    good                            the last generation that was fully activated
    lock                            the pass lock (flock)

A pass that changes files:

    1. stages generations/.new-<n>/ (every file, then the manifest; each write
       atomic and fsynced) and validates the staged units, ruleset and Caddy
       config with the real checks (those the last good generation does not
       have as they are: it passed them). A failure deletes the staging
       directory: nothing else was touched.
    2. publishes it: rename .new-<n> -> <n>, then points `current` at <n>.
       This is the commit point.
    3. installs the files (atomic writes, removals of what left the plan).
    4. activates (daemon-reload, nft, stop, reload, restart, start, caddy); each
       kind of unit job is queued for all its units at once, then waited for.
       The daemon-reload only when systemd holds a unit whose file changed
       (`Systemd.units_held`; see reconciler.core.render.actions).
    5. points `good` at <n>.

A SIGKILL at any instant leaves `current` on the old generation (before 2:
the staging directory is swept by the next pass) or on the new one (after 2).
While `current` != `good`, the next pass knows activation is unfinished: it
plans against the files of `good` (what last ran), not against the disk, so it
still restarts and starts what the killed pass did not reach. Every step is
idempotent, so doing one twice is harmless.

`--no-activate` stops after step 3 and leaves `good` where it was: the first
activating pass afterwards activates everything that changed since.

If any activation step fails, the pass rolls back to `good`: it reinstalls
good's files, removes the new ones, and activates the difference, then points
`current` back at `good`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from reconciler.core.render.actions import HostActions, configured_unit, host_actions, is_dropin
from reconciler.core.render.artifacts import Artifact, complete_caddy_config
from reconciler.core.render.k3s_node import command_line_labels, dropin_labels, label_patch, overridden
from reconciler.ports import (
    ActivationError,
    Audit,
    Caddy,
    Clock,
    FileTree,
    JobOutcome,
    Nftables,
    NodeLabels,
    NodeLabelsUnavailable,
    PassLock,
    Systemd,
    UnitJob,
    UnitVerifier,
)

STATE_DIR = "var/lib/fabric"
# The operator's main Caddyfile on an edge host (see complete_caddy_config).
CADDY_MAIN = "etc/caddy/Caddyfile"
KEEP_GENERATIONS = 10
# Loading this removes the table inet fabric (and nothing else) in one transaction.
EMPTY_RULESET = "table inet fabric\ndelete table inet fabric\n"


def no_checkpoint(step: str) -> None:
    """The pass's steps pass unobserved (the crash tests pass one that kills the pass)."""


# --------------------------------------------------------------------------
# Generations


@dataclass(frozen=True)
class ManifestEntry:
    path: str
    kind: str
    mode: int
    sha256: str
    # Artifact.restarts: kept so a rollback or a removal restarts them too.
    restarts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Manifest:
    number: int
    created: str  # ISO 8601, UTC
    host: str
    epoch: int | None
    entries: tuple[ManifestEntry, ...]
    # The applied plan's term and signing key id (the host's fence is
    # (term, epoch); None: a generation from before terms, or unsigned).
    term: int | None = None
    key_id: str | None = None

    @property
    def digest(self) -> str:
        """One hash over every path and content hash: equal digests, equal generations."""
        h = hashlib.sha256()
        for e in sorted(self.entries, key=lambda e: e.path):
            # Entries without restarts hash as before they existed.
            restarts = "".join(f"\0{unit}" for unit in e.restarts)
            h.update(f"{e.path}\0{e.kind}\0{e.mode:o}\0{e.sha256}{restarts}\n".encode())
        return h.hexdigest()

    def kinds(self) -> dict[str, str]:
        return {e.path: e.kind for e in self.entries}

    def restarts(self) -> dict[str, tuple[str, ...]]:
        return {e.path: e.restarts for e in self.entries if e.restarts}

    def to_json(self) -> str:
        return (
            json.dumps(
                {
                    "number": self.number,
                    "created": self.created,
                    "host": self.host,
                    "epoch": self.epoch,
                    **({"term": self.term} if self.term is not None else {}),
                    **({"key_id": self.key_id} if self.key_id is not None else {}),
                    "digest": self.digest,
                    "artifacts": [
                        {
                            "path": e.path,
                            "kind": e.kind,
                            "mode": f"{e.mode:04o}",
                            "sha256": e.sha256,
                            **({"restarts": list(e.restarts)} if e.restarts else {}),
                        }
                        for e in sorted(self.entries, key=lambda e: e.path)
                    ],
                },
                indent=2,
            )
            + "\n"
        )

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        return cls(
            number=int(data["number"]),
            created=str(data["created"]),
            host=str(data["host"]),
            epoch=data.get("epoch"),
            term=data.get("term"),
            key_id=data.get("key_id"),
            entries=tuple(
                ManifestEntry(a["path"], a["kind"], int(a["mode"], 8), a["sha256"], tuple(a.get("restarts", ()))) for a in data["artifacts"]
            ),
        )


def manifest_for(
    number: int, created: str, host: str, epoch: int | None, artifacts: Iterable[Artifact], *, term: int | None = None, key_id: str | None = None
) -> Manifest:
    entries = tuple(ManifestEntry(a.path, a.kind, a.mode, a.sha256, a.restarts) for a in artifacts)
    return Manifest(number, created, host, epoch, entries, term=term, key_id=key_id)


class GenerationStore:
    """The generations directory and the `current` / `good` pointers."""

    def __init__(self, tree: FileTree, state_dir: str = STATE_DIR) -> None:
        self.tree = tree
        self.state_dir = state_dir.strip("/")
        self.dir = f"{self.state_dir}/generations"

    # pointers
    def _pointer(self, name: str) -> int | None:
        raw = self.tree.read(f"{self.state_dir}/{name}")
        if raw is None:
            return None
        text = raw.decode().strip()
        return int(text) if text.isdigit() else None

    def current(self) -> int | None:
        return self._pointer("current")

    def good(self) -> int | None:
        return self._pointer("good")

    def set_current(self, number: int | None) -> None:
        self._set("current", number)

    def set_good(self, number: int | None) -> None:
        self._set("good", number)

    def _set(self, name: str, number: int | None) -> None:
        if number is None:
            self.tree.remove(f"{self.state_dir}/{name}")
        else:
            self.tree.write(f"{self.state_dir}/{name}", f"{number}\n".encode())

    # generations
    def numbers(self) -> list[int]:
        return sorted(int(n) for n in self.tree.list_dir(self.dir) if n.isdigit())

    def next_number(self) -> int:
        numbers = self.numbers()
        staged = [int(n.removeprefix(".new-")) for n in self.tree.list_dir(self.dir) if n.startswith(".new-") and n[5:].isdigit()]
        return max([0, *numbers, *staged]) + 1

    def manifest(self, number: int | None) -> Manifest | None:
        if number is None:
            return None
        raw = self.tree.read(f"{self.dir}/{number}/manifest.json")
        return Manifest.from_json(raw.decode()) if raw is not None else None

    def artifacts(self, number: int | None) -> list[Artifact]:
        manifest = self.manifest(number)
        if manifest is None:
            return []
        out = []
        for e in manifest.entries:
            data = self.tree.read(f"{self.dir}/{number}/files/{e.path}")
            if data is None:
                raise ActivationError(f"generation {number}: {e.path} is missing from {self.dir}/{number}/files")
            out.append(Artifact(e.path, data.decode("utf-8"), e.mode, e.kind, e.restarts))  # type: ignore[arg-type]
        return out

    def sweep_staging(self) -> list[str]:
        """Remove staging directories a killed pass left behind."""
        swept = []
        for name in self.tree.list_dir(self.dir):
            if name.startswith("."):
                self.tree.remove_tree(f"{self.dir}/{name}")
                swept.append(name)
        return swept

    def stage(self, manifest: Manifest, artifacts: Sequence[Artifact], checkpoint: Callable[[str], None]) -> str:
        staging = f"{self.dir}/.new-{manifest.number}"
        self.tree.remove_tree(staging)
        for a in artifacts:
            checkpoint(f"stage {a.path}")
            self.tree.write(f"{staging}/files/{a.path}", a.data, a.mode)
        checkpoint("stage manifest.json")
        self.tree.write(f"{staging}/manifest.json", manifest.to_json().encode())
        return staging

    def publish(self, staging: str, number: int) -> None:
        self.tree.rename(staging, f"{self.dir}/{number}")

    def prune(self, keep: int = KEEP_GENERATIONS) -> list[int]:
        protected = {self.current(), self.good()}
        numbers = self.numbers()
        doomed = [n for n in numbers[: max(0, len(numbers) - keep)] if n not in protected]
        for n in doomed:
            self.tree.remove_tree(f"{self.dir}/{n}")
        return doomed


# --------------------------------------------------------------------------
# The pass


@dataclass(frozen=True)
class Activators:
    """The ports that change what runs."""

    systemd: Systemd
    nftables: Nftables
    caddy: Caddy
    # This host's k3s Node (None: the fabric leaves the Node's labels to k3s's next start).
    node_labels: NodeLabels | None = None


@dataclass(frozen=True)
class Validators:
    """The real checks of what would be activated."""

    units: UnitVerifier
    nftables: Nftables
    caddy: Caddy


@dataclass
class ApplyResult:
    outcome: str  # "noop", "applied", "written" (no activation), "invalid", "rolled-back", "failed"
    actions: HostActions
    generation: int | None = None
    messages: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.outcome in ("noop", "applied", "written")


def _sha(data: bytes | None) -> str:
    return hashlib.sha256(data).hexdigest() if data is not None else ""


class Applier:
    def __init__(
        self,
        tree: FileTree,
        lock: PassLock,
        audit: Audit,
        clock: Clock,
        *,
        validators: Validators | None,
        activators: Activators | None,
        state_dir: str = STATE_DIR,
        checkpoint: Callable[[str], None] = no_checkpoint,
        caddy_main: str = CADDY_MAIN,
        nft_reload: bool = False,
    ) -> None:
        self.tree = tree
        self.lock = lock
        self.audit = audit
        self.clock = clock
        self.validators = validators
        self.activators = activators
        self.store = GenerationStore(tree, state_dir)
        self.checkpoint = checkpoint
        self.caddy_main = caddy_main
        # The table is loaded but not as the last pass left it (flushed,
        # edited by hand): plan as if it were not loaded, so it is loaded again.
        self.nft_reload = nft_reload
        # This pass's k3s Node name (Applier.run), for its labels.
        self.k3s_node: str | None = None

    # ---- reading the old state

    def _caddy_config(self, snippet: Artifact | None) -> str:
        """The complete config for Caddy: the main Caddyfile with the snippet inlined."""
        if snippet is None:
            return ""
        main = self.tree.read(self.caddy_main)
        return complete_caddy_config(main.decode("utf-8", "replace") if main is not None else None, snippet.path, snippet.content)

    def _sweep_temp_files(self, paths: Iterable[str]) -> list[str]:
        """Remove the temp files of atomic writes a killed pass left beside
        the fabric's files (named .<file>.fabric-tmp-<pid>)."""
        swept = []
        directories = {p.rpartition("/")[0] for p in [*paths, *self._tracked()] if "/" in p}
        for directory in sorted(directories):
            for name in self.tree.list_dir(directory):
                if name.startswith(".") and ".fabric-tmp-" in name:
                    self.tree.remove(f"{directory}/{name}")
                    swept.append(f"{directory}/{name}")
        return swept

    def _installed(self, paths: Iterable[str]) -> dict[str, bytes]:
        out = {}
        for p in sorted(set(paths)):
            data = self.tree.read(p)
            if data is not None:
                out[p] = data
        return out

    def _tracked(self) -> dict[str, str]:
        tracked: dict[str, str] = {}
        for number in (self.store.good(), self.store.current()):
            manifest = self.store.manifest(number)
            if manifest is not None:
                tracked.update(manifest.kinds())
        return tracked

    def _tracked_restarts(self) -> dict[str, tuple[str, ...]]:
        restarts: dict[str, tuple[str, ...]] = {}
        for number in (self.store.good(), self.store.current()):
            manifest = self.store.manifest(number)
            if manifest is not None:
                restarts.update(manifest.restarts())
        return restarts

    def _unit_states(self, artifacts: Iterable[Artifact]) -> dict[str, str] | None:
        if self.activators is None:
            return None
        return {a.unit: self.activators.systemd.active_state(a.unit) for a in artifacts if a.unit}

    def _dependent_states(self, artifacts: Iterable[Artifact], tracked_restarts: Mapping[str, Sequence[str]]) -> dict[str, str] | None:
        """ActiveState of the units files name in `restarts` (not rendered here)."""
        if self.activators is None:
            return None
        units = {u for a in artifacts for u in a.restarts} | {u for us in tracked_restarts.values() for u in us}
        return {u: self.activators.systemd.active_state(u) for u in sorted(units)}

    def _units_held(self, artifacts: Iterable[Artifact], tracked: Mapping[str, str]) -> dict[str, bool] | None:
        """Which of the units whose files the pass may change systemd holds in
        memory (the desired units, the units of tracked drop-ins); None when
        it cannot be asked: every change of a unit file then reloads.

        Asking loads each unit (LoadUnit): one whose old file is on disk is
        held from then on, one with no file stays a stub until the pass
        writes it, so the answer holds for the rest of the pass."""
        if self.activators is None:
            return None
        units = {configured_unit(a.path) for a in artifacts if a.kind == "unit"}
        units |= {configured_unit(p) for p, kind in tracked.items() if kind == "unit" and is_dropin(p)}
        try:
            return self.activators.systemd.units_held(sorted(units))
        except ActivationError:
            return None

    def compute_actions(self, artifacts: Sequence[Artifact]) -> tuple[HostActions, bool]:
        """The actions of a pass over `artifacts`, and whether the last activation
        is unfinished (current != good). Reads only."""
        current, good = self.store.current(), self.store.good()
        tracked = self._tracked()
        installed = self._installed([*(a.path for a in artifacts), *tracked])
        unfinished = self.activators is not None and current is not None and current != good
        running: Mapping[str, bytes] | None = None
        if unfinished:
            running = {a.path: a.data for a in self.store.artifacts(good)}
        tracked_restarts = self._tracked_restarts()
        modes = {a.path: mode for a in artifacts if a.path in installed and (mode := self.tree.mode(a.path)) is not None}
        actions = host_actions(
            artifacts,
            installed,
            tracked,
            running=running,
            unit_states=self._unit_states(artifacts),
            nft_table_loaded=(not self.nft_reload and self.activators.nftables.table_loaded()) if self.activators is not None else None,
            tracked_restarts=tracked_restarts,
            dependent_states=self._dependent_states(artifacts, tracked_restarts),
            units_held=self._units_held(artifacts, tracked),
            installed_modes=modes,
        )
        return actions, unfinished

    # ---- the pass

    def run(
        self,
        artifacts: Sequence[Artifact],
        *,
        host: str,
        epoch: int | None,
        term: int | None = None,
        key_id: str | None = None,
        k3s_node: str | None = None,
    ) -> ApplyResult:
        self.lock.acquire()
        try:
            self.k3s_node = k3s_node
            return self._run(list(artifacts), host, epoch, term, key_id)
        finally:
            self.lock.release()

    def _run(self, artifacts: list[Artifact], host: str, epoch: int | None, term: int | None = None, key_id: str | None = None) -> ApplyResult:
        self._sweep([a.path for a in artifacts])
        actions, unfinished = self.compute_actions(artifacts)
        current = self.store.current()
        if actions.empty:
            if unfinished:
                # Killed after activating everything but before marking it good.
                self.store.set_good(current)
            self.audit.record("noop", "ok", generation=str(current or ""))
            return ApplyResult("noop", actions, current)
        number, refused = self._generation(artifacts, actions, host, epoch, term=term, key_id=key_id)
        if refused is not None:
            return refused
        return self._install_and_activate(artifacts, actions, number)

    def _sweep(self, paths: list[str]) -> None:
        """Phase 1: what a killed pass left (staging directories, temp files)."""
        for name in self.store.sweep_staging():
            self.audit.record("sweep", "ok", file=f"{self.store.dir}/{name}", reason="left by a killed pass")
        for path in self._sweep_temp_files(paths):
            self.audit.record("sweep", "ok", file=path, reason="temp file left by a killed pass")

    def _generation(
        self, artifacts: list[Artifact], actions: HostActions, host: str, epoch: int | None, *, term: int | None, key_id: str | None
    ) -> tuple[int | None, ApplyResult | None]:
        """Phase 2: the generation to activate, checked: `current` when it has
        these files already, else a new one staged, validated, published and
        made current. Its number, or the result when it cannot be had."""
        current = self.store.current()
        current_manifest = self.store.manifest(current)
        proposed = manifest_for(0, "", host, epoch, artifacts)
        if current_manifest is None or current_manifest.digest != proposed.digest:
            return self._new_generation(artifacts, actions, host, epoch, term=term, key_id=key_id)
        # The files are those of `current` already (a pass killed after
        # publishing it, or one run with --no-activate): activate it.
        number = current
        assert number is not None
        if current != self.store.good() and self.validators is not None:
            # A --no-activate pass may have written it without the real checks.
            problem = self._validate(f"{self.store.dir}/{number}", artifacts)
            if problem is not None:
                self.audit.record("validate", "failed", generation=str(number), reason=problem)
                return number, ApplyResult("invalid", actions, current, [problem])
        return number, None

    def _new_generation(
        self, artifacts: list[Artifact], actions: HostActions, host: str, epoch: int | None, *, term: int | None, key_id: str | None
    ) -> tuple[int | None, ApplyResult | None]:
        current = self.store.current()
        number = self.store.next_number()
        created = datetime.fromtimestamp(self.clock.now(), UTC).isoformat(timespec="seconds")
        manifest = manifest_for(number, created, host, epoch, artifacts, term=term, key_id=key_id)
        try:
            staging = self.store.stage(manifest, artifacts, self.checkpoint)
        except OSError as exc:
            # The state directory cannot be written: nothing was installed
            # (the next pass sweeps the partial staging directory).
            message = f"cannot write generation {number} under {self.store.dir}: {exc}"
            self.audit.record("generation", "failed", generation=str(number), reason=message)
            return number, ApplyResult("failed", actions, current, [message])
        problem = self._validate(staging, self._not_checked(artifacts))
        if problem is not None:
            self.tree.remove_tree(staging)
            self.audit.record("validate", "failed", generation=str(number), reason=problem)
            return number, ApplyResult("invalid", actions, current, [problem])
        self.audit.record("validate", "ok" if self.validators else "skipped", generation=str(number), hash=manifest.digest)
        self.checkpoint("publish generation")
        self.store.publish(staging, number)
        self.checkpoint("switch current")
        self.store.set_current(number)
        self.audit.record("generation", "ok", generation=str(number), hash=manifest.digest)
        return number, None

    def _install_and_activate(self, artifacts: list[Artifact], actions: HostActions, number: int | None) -> ApplyResult:
        """Phase 3: install the files and activate them; mark the generation
        good, or roll back to the good one when the activation fails."""
        by_path = {a.path: a for a in artifacts}
        # The drop-in's labels before this pass: the labels the fabric set last.
        tracked = self._tracked() if actions.node_labels else {}
        previous_dropin = self._installed(
            p for p in (*actions.write, *actions.remove) if (by_path[p].kind if p in by_path else tracked.get(p)) == "dropin"
        )
        try:
            try:
                self._install(actions, by_path, number)
            except OSError as exc:
                # A directory that cannot be written (read-only, a file in
                # the way): undo the files this pass installed, like a failed
                # activation.
                raise ActivationError(f"installing the files failed: {exc}") from exc
            if self.activators is None:
                return ApplyResult("written", actions, number)
            self._activate(actions, by_path, number, self.activators)
        except ActivationError as exc:
            return self._activation_failed(actions, number, exc)
        self.checkpoint("mark good")
        self.store.set_good(number)
        self.audit.record("activate", "ok", generation=str(number))
        for n in self.store.prune():
            self.audit.record("prune", "ok", generation=str(n))
        messages = self._set_node_labels(actions, by_path, previous_dropin) if actions.node_labels else []
        return ApplyResult("applied", actions, number, messages)

    def _set_node_labels(self, actions: HostActions, by_path: Mapping[str, Artifact], previous: Mapping[str, bytes]) -> list[str]:
        """The k3s Node's labels made the drop-in's, through the API as its
        kubelet. Best effort, after the generation is good: k3s being down or
        absent never fails or rolls back a pass; the pass says what it did."""
        port = self.activators.node_labels if self.activators is not None else None
        node = self.k3s_node
        new = next((a.content for a in by_path.values() if a.kind == "dropin"), None)
        wanted = dropin_labels(new)
        before = {k: v for data in previous.values() for k, v in dropin_labels(data.decode(errors="replace")).items()}
        if port is None or not node:
            return []  # no k3s agent here: the drop-in waits for one
        messages = []
        try:
            patch = label_patch(port.labels(node), wanted, before)
            if patch:
                port.patch(node, patch)
            set_ = sorted(k for k, v in patch.items() if v is not None)
            removed = sorted(k for k, v in patch.items() if v is None)
            self.audit.record("k3s-labels", "ok", node=node, set=",".join(set_), removed=",".join(removed))
            messages.append(f"k3s node {node}: labels set {len(set_)}, removed {len(removed)}" + (f" ({', '.join(removed)})" if removed else ""))
        except NodeLabelsUnavailable as exc:
            self.audit.record("k3s-labels", "failed", node=node, reason=str(exc))
            messages.append(f"k3s node {node}: labels not set now ({exc}); k3s applies the drop-in at its next start and removes none")
        beaten = overridden(command_line_labels(port.command_line()), wanted)
        if beaten:
            self.audit.record("k3s-labels", "overridden", node=node, labels=";".join(beaten))
            messages.append(f"k3s node {node}: k3s's command line --node-label overrides the drop-in at each start: {'; '.join(beaten)}")
        return messages

    def _activation_failed(self, actions: HostActions, number: int | None, exc: ActivationError) -> ApplyResult:
        """Roll back to the good generation after a failed activation."""
        message = f"activation of generation {number} failed: {exc}"
        self.audit.record("activate", "failed", generation=str(number), reason=str(exc))
        messages = [message]
        good = self.store.good()
        try:
            self.rollback_to(good, reason=message)
            messages.append(f"rolled back to generation {good}" if good is not None else "rolled back to no generation (nothing was ever activated)")
            return ApplyResult("rolled-back", actions, good, messages)
        except (ActivationError, OSError) as again:  # OSError: the rollback's own writes (a full disk)
            messages.append(f"rollback to generation {good} failed too: {again}")
            self.audit.record("rollback", "failed", generation=str(good or ""), reason=str(again))
            return ApplyResult("failed", actions, number, messages)

    def _not_checked(self, artifacts: Sequence[Artifact]) -> list[Artifact]:
        """The artifacts whose content has not passed the checks here: all but
        those the last good generation has as they are (a pass marks one good
        only after the checks and its activation; `fabric rollback` may mark
        one good that --no-activate wrote unchecked, the operator's choice).
        A pass that moves one service checks its new unit, not every unit of
        the host again: each check is a program run (systemd-analyze loads
        every unit it is given), and every affected host pays for them at
        the same moment."""
        good = self.store.manifest(self.store.good())
        if good is None:
            return list(artifacts)
        checked = {(e.path, e.sha256) for e in good.entries}
        return [a for a in artifacts if (a.path, a.sha256) not in checked]

    def _validate(self, staging: str, artifacts: Sequence[Artifact]) -> str | None:
        if self.validators is None:
            return None
        units = [self.tree.real_path(f"{staging}/files/{a.path}") for a in artifacts if a.kind == "unit"]
        try:
            if units:
                self.validators.units.verify(units)
            for a in artifacts:
                if a.kind == "nft":
                    self.validators.nftables.check(a.content)
                elif a.kind == "caddy":
                    self.validators.caddy.validate(self._caddy_config(a))
        except ActivationError as exc:
            return f"validation failed, nothing installed: {exc}"
        return None

    def _install(self, actions: HostActions, by_path: Mapping[str, Artifact], number: int | None) -> None:
        for path in actions.write:
            a = by_path[path]
            self.checkpoint(f"write {path}")
            self.tree.write(path, a.data, a.mode)
            self.audit.record("write", "ok", file=path, generation=str(number or ""), hash=a.sha256)
        for path in actions.remove:
            self.checkpoint(f"remove {path}")
            self.tree.remove(path)
            self.audit.record("remove", "ok", file=path, generation=str(number or ""))

    def _activate(self, actions: HostActions, by_path: Mapping[str, Artifact], number: int | None, ports: Activators) -> None:
        gen = str(number or "")

        def step(action: str, call: Callable[[], None], **fields: str) -> None:
            self.checkpoint(f"{action} {fields.get('unit') or fields.get('file') or ''}".strip())
            try:
                call()
            except ActivationError as exc:
                self.audit.record(action, "failed", **{**fields, "generation": gen, "reason": str(exc)})
                raise ActivationError(f"{action} {fields.get('unit') or fields.get('file') or ''}: {exc}".strip()) from exc
            self.audit.record(action, "ok", generation=gen, **fields)

        if actions.daemon_reload:
            step("daemon-reload", ports.systemd.daemon_reload)
        nft = next((a for a in by_path.values() if a.kind == "nft"), None)
        if actions.nft_load:
            ruleset = nft.content if nft is not None else EMPTY_RULESET
            step("nft-load", lambda: ports.nftables.apply(ruleset), file=nft.path if nft else "", hash=_sha(ruleset.encode()))
        unit_hashes = {a.unit: a.sha256 for a in by_path.values() if a.unit}
        jobs: tuple[tuple[UnitJob, Sequence[str]], ...] = (
            ("stop", actions.stop),
            ("reload", actions.reload),
            ("restart", actions.restart),
            ("start", actions.start),
        )
        for job, units in jobs:
            if units:
                self._unit_jobs(ports.systemd, job, units, gen, unit_hashes, actions.reasons)
        if actions.caddy_reload:
            caddy = next((a for a in by_path.values() if a.kind == "caddy"), None)
            config = self._caddy_config(caddy)
            step("caddy-load", lambda: ports.caddy.load(config), file=caddy.path if caddy else "", hash=_sha(config.encode()))

    def _unit_jobs(
        self, systemd: Systemd, job: UnitJob, units: Sequence[str], gen: str, unit_hashes: Mapping[str, str], reasons: Mapping[str, str]
    ) -> None:
        """One kind of job for all its units at once (systemd runs them
        together), one audit record per unit in the plan's order; any failure
        fails the activation, naming every unit that failed."""
        self.checkpoint(f"{job} {' '.join(units)}")
        try:
            outcomes = {o.unit: o for o in systemd.run_jobs(job, units)}
        except ActivationError as exc:
            # No job was queued: each unit failed for the same reason.
            outcomes = {unit: JobOutcome(unit, str(exc)) for unit in units}
        retried = [unit for unit in units if unit in outcomes and outcomes[unit].retried_after_reload]
        if retried:
            # Not planned: systemd had not seen the files the pass wrote (see Systemd.run_jobs).
            self.audit.record(
                "daemon-reload", "ok", generation=gen, reason=f"systemd found no file for {', '.join(retried)} at its {job}; {job} queued again"
            )
        failed = []
        for unit in units:
            outcome = outcomes.get(unit, JobOutcome(unit, "systemd reported no outcome for it"))
            fields = {"generation": gen, "unit": unit, "hash": unit_hashes.get(unit, "")}
            retry = outcome.retried_after_reload
            if outcome.ok:
                again = " (after a daemon-reload: systemd had not seen its file)" if retry else ""
                self.audit.record(job, "ok", **fields, reason=reasons.get(unit, "") + again)
            else:
                again = " (again after a daemon-reload)" if retry else ""
                self.audit.record(job, "failed", **fields, reason=(outcome.failure or "") + again)
                failed.append(f"{job} {unit}: {outcome.failure}")
        if failed:
            raise ActivationError(" | ".join(failed))

    # ---- rollback

    def rollback_to(self, target: int | None, *, reason: str) -> HostActions:
        """Reinstall generation `target` (None: nothing) and activate the
        difference from what the current generation left running."""
        current = self.store.current()
        old = self.store.artifacts(target)
        failed = {a.path: a.data for a in self.store.artifacts(current)}
        tracked = self._tracked()
        installed = self._installed([*(a.path for a in old), *tracked])
        # What runs now is (at most) the failed generation: plan from it.
        running = {**installed, **failed}
        tracked_restarts = self._tracked_restarts()
        actions = host_actions(
            old,
            installed,
            tracked,
            running=running,
            tracked_restarts=tracked_restarts,
            dependent_states=self._dependent_states(old, tracked_restarts),
            units_held=self._units_held(old, tracked),
        )
        self.audit.record("rollback", "started", generation=str(target or ""), reason=reason)
        by_path = {a.path: a for a in old}
        self._install(actions, by_path, target)
        if self.activators is not None:
            self._activate(actions, by_path, target, self.activators)
        self.store.set_current(target)
        self.store.set_good(target)
        self.audit.record("rollback", "ok", generation=str(target or ""))
        return actions

    def rollback(self, target: int | None = None) -> tuple[int, HostActions]:
        """`fabric rollback`: back to `target`, by default the generation
        before the last good one."""
        self.lock.acquire()
        try:
            numbers = self.store.numbers()
            if target is None:
                good = self.store.good() or self.store.current()
                earlier = [n for n in numbers if good is None or n < good]
                if not earlier:
                    raise ActivationError("no earlier generation to roll back to")
                target = earlier[-1]
            elif target not in numbers:
                raise ActivationError(f"no generation {target} (have: {', '.join(map(str, numbers)) or 'none'})")
            actions = self.rollback_to(target, reason="fabric rollback")
            return target, actions
        finally:
            self.lock.release()


# --------------------------------------------------------------------------
# `fabric generations`


@dataclass(frozen=True)
class GenerationInfo:
    number: int
    created: str
    digest: str
    artifacts: int
    current: bool
    good: bool


def list_generations(store: GenerationStore) -> list[GenerationInfo]:
    current, good = store.current(), store.good()
    out = []
    for n in store.numbers():
        m = store.manifest(n)
        if m is None:
            continue
        out.append(GenerationInfo(n, m.created, m.digest, len(m.entries), n == current, n == good))
    return out
