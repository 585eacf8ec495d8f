"""SystemdDbus's reading of what systemd holds (`units_held`) and its one
daemon-reload for a start systemd finds no file for, against a fake of
systemd's manager behind the adapter's D-Bus calls (`FakeManager`).

The fake loads units as systemd does (src/core/manager.c, unit.c): LoadUnit
and StartUnit load a unit that is not in memory from the files its last scan
of the unit directories saw, and so a not-found stub too on systemd >= 246
(an older one keeps the stub until a Reload); the scan is redone at each load
unless `frozen` (the directories' mtimes still look as at the last scan: the
kernel's coarse clock). StartUnit of a unit it finds no file for answers
NoSuchUnit "Unit X not found.", as bus_unit_validate_load_state does. The
real systemd is in tests/integration/test_systemd_dbus.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from dbus_fast import Message, MessageType, Variant

from reconciler.adapters.systemd_dbus import (
    MANAGER_INTERFACE,
    MANAGER_PATH,
    NO_SUCH_UNIT,
    PROPERTIES_INTERFACE,
    SERVICE_INTERFACE,
    UNIT_INTERFACE,
    SystemdDbus,
    _DbusCallError,
    systemd_major_version,
)
from reconciler.ports import JobOutcome

UNIT_PREFIX = "/org/freedesktop/systemd1/unit/"


class FakeManager:
    def __init__(self, version: str = "252.39-1~deb12u2") -> None:
        self.version = version
        self.files: set[str] = set()  # unit files on disk
        self.masked: set[str] = set()
        self.scanned: set[str] | None = None
        self.frozen = False
        self.loaded: dict[str, str] = {}  # unit -> LoadState
        self.active: set[str] = set()
        self.calls: list[str] = []
        self._jobs = 0

    def _retries_stubs(self) -> bool:
        major = systemd_major_version(self.version)
        return major is not None and major >= 246

    def _scan(self) -> set[str]:
        if self.scanned is None or not self.frozen:
            self.scanned = set(self.files)
        return self.scanned

    def load(self, unit: str) -> str:
        if unit not in self.loaded or (self.loaded[unit] == "not-found" and self._retries_stubs()):
            if unit in self.masked:
                self.loaded[unit] = "masked"
            else:
                self.loaded[unit] = "loaded" if unit in self._scan() and unit in self.files else "not-found"
        return self.loaded[unit]

    def reload(self) -> None:
        self.frozen, self.scanned = False, None
        for unit in list(self.loaded):
            self.loaded[unit] = "masked" if unit in self.masked else "loaded" if unit in self.files else "not-found"

    def call(self, adapter: SystemdDbus, path: str, interface: str, member: str, body: list[Any], what: str) -> Any:
        self.calls.append(member)
        if interface == PROPERTIES_INTERFACE:
            return SimpleNamespace(body=[self._property(path, body)] if member == "Get" else [self._properties(path, body[0])])
        if member == "Reload":
            self.reload()
            return SimpleNamespace(body=[])
        unit = body[0]
        state = self.load(unit)
        if member == "LoadUnit":
            return SimpleNamespace(body=[UNIT_PREFIX + unit])
        if member == "StopUnit":
            self.active.discard(unit)
        elif state != "loaded":
            raise _DbusCallError(NO_SUCH_UNIT if state == "not-found" else "org.freedesktop.systemd1.UnitMasked", f"Unit {unit} not found.", what)
        elif member in ("StartUnit", "RestartUnit"):
            self.active.add(unit)
        self._jobs += 1
        job = f"/org/freedesktop/systemd1/job/{self._jobs}"
        # systemd's JobRemoved can reach the client before the reply: the adapter keeps it.
        removed = Message(
            message_type=MessageType.SIGNAL,
            path=MANAGER_PATH,
            interface=MANAGER_INTERFACE,
            member="JobRemoved",
            signature="uoss",
            body=[self._jobs, job, unit, "done"],
        )
        adapter._on_message(removed)
        return SimpleNamespace(body=[job])

    def _property(self, path: str, body: list[Any]) -> Variant:
        interface, name = body
        if (interface, name) == (MANAGER_INTERFACE, "Version"):
            return Variant("s", self.version)
        assert (interface, name) == (UNIT_INTERFACE, "LoadState"), body
        return Variant("s", self.loaded[path.removeprefix(UNIT_PREFIX)])

    def _properties(self, path: str, interface: str) -> dict[str, Variant]:
        unit = path.removeprefix(UNIT_PREFIX)
        if interface == SERVICE_INTERFACE:
            return {"Result": Variant("s", "success"), "MainPID": Variant("u", 0), "ExecMainStatus": Variant("i", 0), "NRestarts": Variant("u", 0)}
        active = unit in self.active
        return {
            "ActiveState": Variant("s", "active" if active else "inactive"),
            "SubState": Variant("s", "running" if active else "dead"),
            "LoadState": Variant("s", self.loaded[unit]),
            "InvocationID": Variant("ay", b"\x01" * 16 if active else b""),
            "Job": Variant("(uo)", [0, "/"]),
        }


class FakeBusSystemd(SystemdDbus):
    """The adapter with its D-Bus calls answered by a FakeManager."""

    def __init__(self, manager: FakeManager) -> None:
        super().__init__("unix:path=/nonexistent/fake-manager")
        self.manager = manager

    async def _connected(self) -> Any:
        if self._disconnected is None:
            self._disconnected = asyncio.get_running_loop().create_future()
        return None

    async def _call(self, bus: Any, destination: str, path: str, interface: str, member: str, signature: str, body: list[Any], *, what: str) -> Any:
        return self.manager.call(self, path, interface, member, body, what)


@pytest.fixture
def manager() -> FakeManager:
    return FakeManager()


@pytest.fixture
def systemd(manager: FakeManager):  # noqa: ANN201
    with FakeBusSystemd(manager) as adapter:
        yield adapter


@pytest.mark.parametrize(
    ("text", "major"),
    [
        ("252.39-1~deb12u2", 252),
        ("256.8", 256),
        ("257", 257),
        ("245.4-4ubuntu3.24", 245),
        ("v255-stable", 255),
        (" 246\n", 246),
        ("", None),
        ("unknown", None),
    ],
)
def test_systemd_major_version(text: str, major: int | None) -> None:
    assert systemd_major_version(text) == major


def test_a_unit_with_no_file_is_not_held_and_a_loaded_or_masked_one_is(manager: FakeManager, systemd: FakeBusSystemd) -> None:
    manager.files |= {"fabric-a.service", "fabric-m.service"}
    manager.masked.add("fabric-m.service")
    held = systemd.units_held(["fabric-a.service", "fabric-new.service", "fabric-m.service", "fabric-a.service"])
    assert held == {"fabric-a.service": True, "fabric-new.service": False, "fabric-m.service": True}
    # Asking loaded each (LoadUnit), as reading a state does: the new one is a stub now.
    assert manager.loaded == {"fabric-a.service": "loaded", "fabric-new.service": "not-found", "fabric-m.service": "masked"}
    # The version is read once per connection.
    systemd.units_held(["fabric-new.service"])
    assert manager.calls.count("Get") == 1 + 3 + 1


@pytest.mark.parametrize("version", ["245.4-4ubuntu3.24", "unknown"])
def test_a_not_found_stub_counts_as_held_on_a_systemd_that_does_not_retry_it(version: str) -> None:
    manager = FakeManager(version)
    with FakeBusSystemd(manager) as systemd:
        assert systemd.units_held(["fabric-new.service"]) == {"fabric-new.service": True}
        # ...as it is: written now, its start still finds no file.
        manager.files.add("fabric-new.service")
        assert manager.load("fabric-new.service") == "not-found"


@pytest.mark.parametrize("job", ["start", "restart"])
def test_a_start_systemd_finds_no_file_for_is_queued_again_after_one_daemon_reload(manager: FakeManager, systemd: FakeBusSystemd, job: str) -> None:
    manager.files.add("fabric-old.service")
    assert systemd.units_held(["fabric-new.service", "fabric-other.service"]) == {"fabric-new.service": False, "fabric-other.service": False}
    # The pass writes both files within the tick of systemd's last scan.
    manager.frozen = True
    manager.files |= {"fabric-new.service", "fabric-other.service"}
    outcomes = systemd.run_jobs(job, ["fabric-old.service", "fabric-new.service", "fabric-other.service"])  # type: ignore[arg-type]
    assert outcomes == [
        JobOutcome("fabric-old.service"),
        JobOutcome("fabric-new.service", retried_after_reload=True),
        JobOutcome("fabric-other.service", retried_after_reload=True),
    ]
    assert manager.calls.count("Reload") == 1
    assert manager.active == {"fabric-old.service", "fabric-new.service", "fabric-other.service"}


def test_a_start_that_finds_its_file_needs_no_reload(manager: FakeManager, systemd: FakeBusSystemd) -> None:
    assert systemd.units_held(["fabric-new.service"]) == {"fabric-new.service": False}
    manager.files.add("fabric-new.service")  # a later tick: the directory's mtime moved
    assert systemd.run_jobs("start", ["fabric-new.service"]) == [JobOutcome("fabric-new.service")]
    assert "Reload" not in manager.calls


def test_a_unit_that_has_no_file_fails_its_start_after_the_one_retry(manager: FakeManager, systemd: FakeBusSystemd) -> None:
    [outcome] = systemd.run_jobs("start", ["fabric-absent.service"])
    assert outcome == JobOutcome("fabric-absent.service", "Unit fabric-absent.service not found.", retried_after_reload=True)
    assert manager.calls.count("Reload") == 1


def test_no_reload_for_a_stop_or_a_reload_job(manager: FakeManager, systemd: FakeBusSystemd) -> None:
    assert systemd.run_jobs("stop", ["fabric-absent.service"]) == [JobOutcome("fabric-absent.service")]
    [refused] = systemd.run_jobs("reload", ["fabric-absent.service"])
    assert refused.failure == "Unit fabric-absent.service not found." and not refused.retried_after_reload
    assert "Reload" not in manager.calls
