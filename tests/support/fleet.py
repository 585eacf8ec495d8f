"""One host's sandbox driven through the engine: a copy of the example fleet's
desired state, a root under tmp_path, FakeMachine for systemd, nft and Caddy,
the golden probe capture and fleet plan (`Fleet`); and the same pass as
`fabric reconcile` / `fabric plan` arguments (`cli_pass`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from reconciler.adapters.files import FlockLock, LocalTree
from reconciler.adapters.probe_io import CaptureDirectory
from reconciler.core.desired.model import HostFacts
from reconciler.core.probe import RawCapture, facts_from_capture
from reconciler.engine.apply import Activators, GenerationStore, Validators
from reconciler.engine.pass_options import PlanFile
from reconciler.engine.reconcile import PassOptions, PassPorts, PassReport, preview_pass, run_pass
from tests.conftest import REPO
from tests.support.audit import RecordingAudit
from tests.support.clock import T_PASS, FakeClock
from tests.support.machine import FakeMachine, FakeVerifier

GOLDEN = REPO / "tests" / "golden"


def copy_fleet(tmp_path: Path) -> Path:
    desired = tmp_path / "desired"
    desired.mkdir()
    for f in (REPO / "hosts").glob("*.toml"):
        (desired / f.name).write_text(f.read_text())
    return desired


def replayed_probe(host: str, replay: str | None) -> HostFacts:
    """The probe port over a saved capture (every pass here replays one)."""
    assert replay is not None, "a test pass never probes the machine it runs on"
    outputs, errors = CaptureDirectory().load(replay)
    return facts_from_capture(RawCapture(outputs, errors), host=host)


def pass_options(desired: Path, root: Path, host: str, /, **changes: object) -> PassOptions:
    """A pass of `host` into the sandbox `root`: its golden probe capture, the golden fleet plan."""
    arch = "aarch64" if host == "a1-arm64" else "x86_64"
    options = PassOptions(desired=desired, host=host, root=root, replay=str(GOLDEN / "probe" / arch), plan=PlanFile(GOLDEN / "fleet-plan.json"))
    return dataclasses.replace(options, **changes)  # type: ignore[arg-type]


def fake_pass_ports(
    root: Path, machine: FakeMachine, verifier: FakeVerifier, audit: RecordingAudit, *, activate: bool = True, notes: list[str] | None = None
) -> PassPorts:
    """The pass's ports: real files under `root`, FakeMachine for systemd, nft and Caddy."""
    return PassPorts(
        tree=LocalTree(root),
        lock=FlockLock(root / "var/lib/fabric/lock"),
        audit=audit,
        clock=FakeClock(T_PASS),
        probe=replayed_probe,
        validators=Validators(verifier, machine, machine),
        activators=Activators(machine, machine, machine) if activate else None,
        note=notes.append if notes is not None else lambda note: None,
    )


class Fleet:
    """One host's sandbox: desired state copy, root, FakeMachine."""

    def __init__(self, tmp_path: Path, host: str = "racknerd") -> None:
        self.desired = copy_fleet(tmp_path)
        self.root = tmp_path / "root"
        self.root.mkdir()
        self.host = host
        self.machine = FakeMachine(self.root, tmp_path / "machine.json")
        self.verifier = FakeVerifier()
        self.audit = RecordingAudit()
        self.notes: list[str] = []

    def ports(self, *, activate: bool = True) -> PassPorts:
        return fake_pass_ports(self.root, self.machine, self.verifier, self.audit, activate=activate, notes=self.notes)

    def options(self, **changes: object) -> PassOptions:
        return pass_options(self.desired, self.root, self.host, **changes)

    def reconcile(self, **changes: object) -> PassReport:
        """One pass (`changes`: PassOptions fields); --no-activate wires no activators, as the command line does."""
        options = self.options(**changes)
        return run_pass(options, self.ports(activate=not options.no_activate))

    def preview(self, **changes: object) -> PassReport:
        """`fabric plan` with the same options."""
        options = self.options(**changes)
        return preview_pass(options, self.ports(activate=not options.no_activate))

    def edit_fleet(self, old: str, new: str) -> None:
        path = self.desired / "fabric.toml"
        text = path.read_text()
        assert old in text
        path.write_text(text.replace(old, new))

    @property
    def store(self) -> GenerationStore:
        return GenerationStore(LocalTree(self.root))


def cli_pass(fleet: Fleet, *extra: str, command: str = "reconcile") -> list[str]:
    arch = "aarch64" if fleet.host == "a1-arm64" else "x86_64"
    return [
        command,
        "--desired",
        str(fleet.desired),
        "--host",
        fleet.host,
        "--root",
        str(fleet.root),
        "--replay",
        str(GOLDEN / "probe" / arch),
        "--no-activate",
        *extra,
    ]


def fabric_plan(fleet: Fleet, **changes: object) -> str:
    report = fleet.preview(no_activate=True, **changes)
    assert report.outcome == "planned", report.stderr
    return report.stdout
