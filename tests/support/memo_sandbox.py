"""Whole `fabric reconcile --no-activate` passes through the command line into
a sandbox root: the example fleet's desired state, racknerd's recorded probe
(or another host's), the embedded (sqlite) registry under the root or a plan
file. A memoized pass writes one audit line with `memo: hit`; a full pass does not.

`audit_on_stderr` is an autouse fixture: a test module that imports it has
the audit lines as JSON on stderr, where these helpers read them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reconciler.engine.pass_memo import MEMO_FILE
from reconciler.ports import Registry
from tests.conftest import REPO

GOLDEN = REPO / "tests" / "golden"
STATE = "var/lib/fabric"


class Sandbox:
    """The example fleet's desired state, a root, and racknerd's passes into it."""

    def __init__(self, tmp_path: Path, host: str = "racknerd") -> None:
        self.desired = tmp_path / "desired"
        shutil.copytree(REPO / "hosts", self.desired)
        self.capture = tmp_path / "capture"
        shutil.copytree(GOLDEN / "probe" / "x86_64", self.capture)
        self.root = tmp_path / "root"
        self.host = host

    def argv(self, *extra: str) -> list[str]:
        return [
            "reconcile",
            "--desired",
            str(self.desired),
            "--host",
            self.host,
            "--root",
            str(self.root),
            "--replay",
            str(self.capture),
            "--no-activate",
            *extra,
        ]

    @property
    def memo_file(self) -> Path:
        return self.root / STATE / MEMO_FILE

    @property
    def registry_file(self) -> Path:
        return self.root / "var/lib/fabric/registry.sqlite"


def audit_lines(err: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in err.splitlines() if line.startswith("{")]


def memoized(err: str) -> bool:
    """The pass was the memo's: one audit line, noop, memo hit."""
    lines = audit_lines(err)
    return len(lines) == 1 and lines[0]["action"] == "noop" and lines[0].get("memo") == "hit"


def open_registry(s: Sandbox) -> Registry:
    from reconciler.core.desired.load import load_desired
    from reconciler.wiring import open_registry

    return open_registry(load_desired(s.desired).fleet, sqlite_path=s.registry_file)


@pytest.fixture(autouse=True)
def audit_on_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit lines as JSON on stderr, where these tests read them, even on a machine with journald."""
    from reconciler.adapters.journal import JournalAudit

    defaults = JournalAudit.__init__.__defaults__
    assert defaults is not None
    monkeypatch.setattr(JournalAudit.__init__, "__defaults__", ("/nonexistent/journal/socket", *defaults[1:]))


def reported_in_flight(s: Sandbox) -> int:
    registry = open_registry(s)
    try:
        (state,) = [state for state in registry.node_states() if state.record.node_id == s.host]
        return state.record.in_flight
    finally:
        registry.close()


def new_term_without_a_plan(registry: Registry, candidate: str = "lux") -> None:
    """A term won and given up before its leader published: the registry's epoch moves on, the plan stays."""
    term = registry.campaign(candidate, 30.0)
    assert term is not None
    registry.resign(term)


def new_registry_epoch(s: Sandbox) -> None:
    """A leader publishes a plan: the registry's epoch moves on."""
    from reconciler.core.live.models import FleetPlan

    registry = open_registry(s)
    try:
        leadership = registry.campaign("lux", 30.0)
        assert leadership is not None
        registry.publish_plan(leadership, FleetPlan.model_validate_json((GOLDEN / "fleet-plan.json").read_bytes()))
        registry.resign(leadership)
    finally:
        registry.close()


class MemoFilesInMemory:
    """The MemoStore port in memory (path -> bytes); the pass lock is always free."""

    def __init__(self, files: dict[Path, bytes]) -> None:
        self.files = files

    def read(self, path: Path) -> bytes | None:
        return self.files.get(path)

    def write(self, path: Path, data: bytes) -> None:
        self.files[path] = data

    def remove(self, path: Path) -> None:
        self.files.pop(path, None)

    def rewrite_head(self, path: Path, edit) -> bool:  # type: ignore[no-untyped-def]
        return False

    def lock(self, lock_file: Path):  # type: ignore[no-untyped-def]
        from contextlib import nullcontext

        return nullcontext(True)
