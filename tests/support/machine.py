"""FakeMachine: systemd (the Systemd port), nftables and Caddy as one model that
behaves like the real programs in the ways that matter to the applier; the
unit verifier's fake; and what "converged" means for a sandbox root.

systemd keeps the configuration of a unit it loaded until a daemon-reload,
loads a unit it has no file for from disk at its next start (systemd >= 246),
and a started or restarted unit runs what was loaded at that moment. So
"converged" means: every desired unit is active and runs the desired content,
nothing else the fabric wrote is active, nft and Caddy hold the desired texts.

FakeMachine keeps its state in a JSON file, so the crash tests
(tests/unit/test_apply_crash.py) can use it from a subprocess that is SIGKILLed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from reconciler.adapters.files import LocalTree
from reconciler.engine.apply import GenerationStore
from reconciler.ports import ActivationError, JobOutcome

UNIT_DIR = "etc/systemd/system"


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


NOT_FOUND = "not-found"  # FakeMachine.state["loaded"]: a stub systemd made for a unit it found no file for


class FakeMachine:
    """systemd (Systemd port), nftables (Nftables) and Caddy (Caddy) as one
    persisted model. `fail` maps "action" or "action unit" to a message:
    the next such call raises ActivationError (once).

    Its systemd loads units as the real one does (src/core/manager.c), at
    `version`: `loaded` holds what it has in memory, a unit's configuration
    as the sha256 of its file when it was loaded, or NOT_FOUND, a stub for a
    unit it found no file for. Reading a unit's state loads it (the adapter
    calls LoadUnit), and so does a start. A unit not in memory is read from
    disk, finding the files its last scan of the unit directory saw
    (`scanned`); the scan is redone at each load unless `frozen_scan`: the
    directory's mtime then still looks as at the last scan (the kernel's
    coarse clock: a file renamed into place in the same tick), so a file
    written since is not seen until a daemon-reload. A stub is loaded again
    like a unit not in memory (>= 246; an older systemd keeps it until a
    daemon-reload); a loaded unit is re-read only by a daemon-reload, which
    also drops the units whose files are gone and that do not run. A stopped
    unit is dropped from memory (garbage-collected: nothing refers to the
    fabric's units). A job made to fail (`fail`) changes nothing, as before
    this model loaded units; so a unit is never "failed" here (real systemd
    keeps a failed unit loaded: the adapter's LoadState reports it held).
    Drop-ins are not modelled: the fabric renders none."""

    def __init__(self, root: Path, state_file: Path, fail: dict[str, str] | None = None, *, version: int = 252) -> None:
        self.root = Path(root)
        self.state_file = Path(state_file)
        self.fail = dict(fail or {})
        if self.state_file.exists():
            self.state = json.loads(self.state_file.read_text())
        else:
            self.state = {
                "version": version,
                "loaded": {},
                "foreign": [],
                "scanned": None,
                "frozen_scan": False,
                "running": {},
                "active": [],
                "nft": None,
                "caddy": None,
                "calls": [],
                "batches": [],
            }

    def _save(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1, sort_keys=True))
        os.replace(tmp, self.state_file)

    def _call(self, action: str, arg: str = "") -> None:
        self.state["calls"].append([action, arg])
        self._save()
        # One-shot: a failing step fails once (the rollback's retry succeeds).
        message = self.fail.pop(f"{action} {arg}".strip(), None) or self.fail.pop(action, None)
        if message:
            raise ActivationError(message)

    @property
    def calls(self) -> list[tuple[str, str]]:
        return [tuple(c) for c in self.state["calls"]]  # type: ignore[misc]

    def forget_calls(self) -> None:
        self.state["calls"] = []
        self.state["batches"] = []
        self._save()

    # Systemd
    def _scan(self) -> list[str]:
        """The unit files systemd knows of: scanned now, unless the scan is frozen."""
        if self.state["scanned"] is None or not self.state["frozen_scan"]:
            unit_dir = self.root / UNIT_DIR
            self.state["scanned"] = sorted(p.name for p in unit_dir.iterdir() if not p.name.startswith(".")) if unit_dir.is_dir() else []
        return self.state["scanned"]

    def _from_disk(self, unit: str) -> str:
        path = self.root / UNIT_DIR / unit
        return sha(path.read_bytes()) if unit in self._scan() and path.is_file() else NOT_FOUND

    def _load(self, unit: str) -> str:
        """LoadUnit: what systemd holds for the unit once it looked."""
        loaded = self.state["loaded"]
        if unit not in loaded or (loaded[unit] == NOT_FOUND and self.state["version"] >= 246):
            loaded[unit] = self._from_disk(unit)
            self._save()
        return loaded[unit]

    def daemon_reload(self) -> None:
        self._call("daemon-reload")
        self.state["frozen_scan"] = False
        self.state["scanned"] = None
        loaded = self.state["loaded"]
        for unit in sorted(loaded):
            if unit in self.state["foreign"]:  # installed by others (phaze's, `install_foreign`): stays loaded
                continue
            loaded[unit] = self._from_disk(unit)
            if loaded[unit] == NOT_FOUND and unit not in self.state["active"]:
                del loaded[unit]
        self._save()

    def enqueue_start(self, unit: str) -> str:
        """A start queued, not waited for: only recorded (the unit's own run is not modelled)."""
        self._call("enqueue-start", unit)
        return f"/org/freedesktop/systemd1/job/{len(self.state['calls'])}"

    def units_held(self, units: list[str]) -> dict[str, bool]:
        return {unit: self._load(unit) != NOT_FOUND or self.state["version"] < 246 for unit in units}

    def install_foreign(self, unit: str, *, active: bool) -> None:
        """A unit the fabric does not render (phaze's control plane), loaded, running or not."""
        self.state["loaded"][unit] = f"foreign {unit}"
        self.state["foreign"].append(unit)
        if active:
            self.state["running"][unit] = self.state["loaded"][unit]
            self.state["active"].append(unit)
        self._save()

    def run_jobs(self, job: str, units: list[str]) -> list[JobOutcome]:
        """Every unit's job in one batch, as systemd would run them together:
        one unit's failure leaves the others' jobs done. As the port says, a
        start or restart systemd finds no file for gets one daemon-reload
        for the batch, then runs."""
        self.state["batches"].append([job, list(units)])
        retried: set[str] = set()
        if job in ("start", "restart"):
            missing = [unit for unit in units if self._load(unit) == NOT_FOUND]
            if missing:
                try:
                    self.daemon_reload()
                except ActivationError:
                    pass  # the starts fail as not found
                else:
                    retried = set(missing)
        run = {"start": self._run_unit, "restart": self._run_unit, "reload": self._reload, "stop": self._stop}[job]
        outcomes = []
        for unit in units:
            try:
                run(job, unit)
            except ActivationError as exc:
                outcomes.append(JobOutcome(unit, str(exc), retried_after_reload=unit in retried))
            else:
                outcomes.append(JobOutcome(unit, retried_after_reload=unit in retried))
        self._save()
        return outcomes

    @property
    def batches(self) -> list[tuple[str, list[str]]]:
        return [(job, units) for job, units in self.state["batches"]]

    def _run_unit(self, action: str, unit: str) -> None:
        found = self._load(unit) != NOT_FOUND
        self._call(action, unit)
        if not found:
            raise ActivationError(f"Unit {unit} not found.")
        self.state["running"][unit] = self.state["loaded"][unit]
        if unit not in self.state["active"]:
            self.state["active"].append(unit)
        self._save()

    def _reload(self, action: str, unit: str) -> None:
        self._call(action, unit)
        if unit not in self.state["active"]:
            raise ActivationError(f"{unit} is not active, cannot reload")

    def _stop(self, action: str, unit: str) -> None:
        self._call(action, unit)
        if unit in self.state["active"]:
            self.state["active"].remove(unit)
        self.state["running"].pop(unit, None)
        if unit not in self.state["foreign"]:
            self.state["loaded"].pop(unit, None)  # inactive, unreferenced: garbage-collected
        self._save()

    def active_state(self, unit: str) -> str:
        self._load(unit)
        if unit in self.state.get("failed", []):  # set by a test: a unit that ran and failed
            return "failed"
        return "active" if unit in self.state["active"] else "inactive"

    # Nftables
    def check(self, ruleset: str) -> None:
        self.state.setdefault("checked", []).append(["nft", sha(ruleset)])
        message = self.fail.get("nft-check")
        if message:
            raise ActivationError(message)

    def apply(self, ruleset: str) -> None:
        self._call("nft-load")
        self.state["nft"] = sha(ruleset)
        self._save()

    def table_loaded(self) -> bool:
        return self.state["nft"] is not None

    # Caddy
    def validate(self, caddyfile: str) -> None:
        self.state.setdefault("checked", []).append(["caddy", sha(caddyfile)])
        message = self.fail.get("caddy-validate")
        if message:
            raise ActivationError(message)

    def load(self, caddyfile: str) -> None:
        self._call("caddy-load")
        self.state["caddy"] = sha(caddyfile)
        self._save()

    def reboot(self) -> None:
        """Nothing runs and the kernel forgot the ruleset; systemd holds no
        unit of the fabric's: it loads them anew when asked."""
        foreign = {unit: self.state["loaded"][unit] for unit in self.state["foreign"]}
        self.state.update(running={}, active=[], nft=None, caddy=None, loaded=foreign, scanned=None, frozen_scan=False)
        self._save()


class FakeVerifier:
    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.verified: list[list[str]] = []

    def verify(self, unit_paths):  # noqa: ANN001
        self.verified.append(list(unit_paths))
        for p in unit_paths:
            assert Path(p).is_file(), f"verifier given a path that does not exist: {p}"
        if self.fail:
            raise ActivationError(self.fail)


def assert_converged(machine: FakeMachine, root: Path) -> None:
    """What runs is what the current generation says should run."""
    store = GenerationStore(LocalTree(root))
    current = store.current()
    assert current is not None
    assert store.good() == current, "activation finished, so current is also good"
    artifacts = store.artifacts(current)
    for a in artifacts:
        assert (root / a.path).read_bytes() == a.data, f"{a.path} on disk differs from generation {current}"
    units = {a.unit: a for a in artifacts if a.unit}
    assert sorted(machine.state["active"]) == sorted(units), "exactly the desired units are active"
    for unit, a in units.items():
        assert machine.state["running"][unit] == a.sha256, f"{unit} runs stale settings"
    nft = next(a for a in artifacts if a.kind == "nft")
    assert machine.state["nft"] == nft.sha256
    caddy = next((a for a in artifacts if a.kind == "caddy"), None)
    assert machine.state["caddy"] == (caddy.sha256 if caddy else None)
