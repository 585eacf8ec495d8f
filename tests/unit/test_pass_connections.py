"""One registry client and one lane queue per pass process (reconciler.adapters.pass_connections, wiring.py).

First the rule on fakes: a connection is opened once per key, every user's
close() leaves it open, the process's close() closes it once; a connection
a call failed through is closed by that user and never handed out again.
Then whole `fabric reconcile` processes (tests/support/memo_sandbox.py's
Sandbox: the edge racknerd, --no-activate, the sqlite registry under the
root), counting the connections opened to the registry's file. etcd and
phaze's broker: tests/integration/test_pass_connections.py.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from reconciler.adapters.pass_connections import PassConnections
from reconciler.adapters.registry_sqlite_file import SqliteFile
from reconciler.ports import RegistryUnavailable
from tests.support.cli import fabric
from tests.support.memo_sandbox import Sandbox, audit_on_stderr, memoized, new_term_without_a_plan, open_registry

__all__ = ["audit_on_stderr"]  # its autouse fixture applies here too


class Connection:
    """A registry client as far as the rule sees it: it answers until a call fails, then never again."""

    opened: list[Connection]

    def __init__(self, opened: list[Connection]) -> None:
        self.closes = 0
        self.broken = False
        self.fail_next = False
        opened.append(self)

    def epoch(self) -> int:
        if self.broken:
            raise RegistryUnavailable("this connection failed before")
        if self.fail_next:
            self.broken = True
            raise RegistryUnavailable("the registry stopped answering on this connection")
        return 7

    def close(self) -> None:
        self.closes += 1


def test_one_connection_per_key_serves_every_user_and_is_closed_once_at_the_end() -> None:
    opened: list[Connection] = []
    connections = PassConnections()
    for _ in range(3):  # the memo's side, the full pass's first beat, its beat after activation
        registry = connections.kept("registry", lambda kept: kept or Connection(opened))
        assert registry.epoch() == 7
        registry.close()
    lanes = connections.kept("lane queue", lambda kept: kept or Connection(opened))
    lanes.close()
    assert len(opened) == 2 and [c.closes for c in opened] == [0, 0], "a user's close leaves it open for the next"
    connections.close()
    assert [c.closes for c in opened] == [1, 1]
    connections.close()
    assert [c.closes for c in opened] == [1, 1], "closed once"


def test_a_connection_a_call_failed_through_is_closed_by_its_user_and_the_next_user_opens_a_new_one() -> None:
    opened: list[Connection] = []
    connections = PassConnections()
    first = connections.kept("registry", lambda kept: kept or Connection(opened))
    opened[0].fail_next = True
    with pytest.raises(RegistryUnavailable):
        first.epoch()
    first.close()
    assert opened[0].closes == 1, "the failed connection is closed when its user closes it, as before"
    later = connections.kept("registry", lambda kept: kept or Connection(opened))
    assert later.epoch() == 7, "the failed first use does not poison the later ones"
    assert len(opened) == 2
    later.close()
    connections.close()
    assert [c.closes for c in opened] == [1, 1]


def test_a_connection_that_cannot_be_opened_is_not_kept() -> None:
    connections = PassConnections()
    opened: list[Connection] = []

    def unreachable(kept: Connection | None) -> Connection:
        raise RegistryUnavailable("no etcd endpoint answers")

    with pytest.raises(RegistryUnavailable):
        connections.kept("registry", unreachable)
    assert connections.kept("registry", lambda kept: kept or Connection(opened)).epoch() == 7
    connections.close()
    assert [c.closes for c in opened] == [1]


# --------------------------------------------------------------------------
# Whole passes: the registry's sqlite file opened once per process.


def won_campaign(s: Sandbox) -> None:
    """A campaign won and resigned: the registry's epoch moves on, no plan is published."""
    with closing(open_registry(s)) as registry:
        new_term_without_a_plan(registry)


@pytest.fixture
def registry_connects(monkeypatch: pytest.MonkeyPatch, sandbox: Sandbox) -> list[str]:
    """Every sqlite connection opened to the sandbox's registry file (the test's own included: cleared before each pass)."""
    made: list[str] = []
    real = sqlite3.connect

    def connect(database: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if Path(database) == sandbox.registry_file:
            made.append(database)
        return real(database, *args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", connect)
    return made


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    return Sandbox(tmp_path)  # racknerd: the edge beats, and reads the fleet's view after activation


def test_a_pass_opens_the_registry_once_for_its_memo_check_its_beats_and_the_fleet_view(
    sandbox: Sandbox, capsys: pytest.CaptureFixture[str], registry_connects: list[str]
) -> None:
    code, _, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and not memoized(err), err
    assert len(registry_connects) == 1, "the first beat and plan read, the beat after activation and the fleet view share it"
    won_campaign(sandbox)
    registry_connects.clear()
    code, _, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and not memoized(err) and "full pass" in err, err
    assert len(registry_connects) == 1, "the memo's side opened it; the full pass after it works on that connection"
    registry_connects.clear()
    code, _, err = fabric(capsys, *sandbox.argv())
    assert code == 0 and memoized(err), err
    assert len(registry_connects) == 1


def test_a_registry_connection_that_failed_in_the_memo_check_is_not_the_full_pass_s(
    sandbox: Sandbox, capsys: pytest.CaptureFixture[str], registry_connects: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memo's side reads the epoch on a connection that then breaks: the
    full pass opens its own and converges instead of failing static."""
    fabric(capsys, *sandbox.argv())
    assert memoized(fabric(capsys, *sandbox.argv())[2])
    real_epoch = SqliteFile.epoch
    broken: list[SqliteFile] = []

    def epoch_breaking_once(self: SqliteFile) -> int:
        if not broken:
            broken.append(self)
            self._db.close()  # this connection is gone: every later use of it fails
            raise RegistryUnavailable("the test broke this connection")
        return real_epoch(self)

    monkeypatch.setattr(SqliteFile, "epoch", epoch_breaking_once)
    registry_connects.clear()
    code, out, err = fabric(capsys, *sandbox.argv())
    assert broken, "the memo's side read the epoch"
    assert code == 0 and not memoized(err), err
    assert "running static" not in out + err and out == "nothing to do (generation 1)\n", out + err
    assert f"note: heartbeat: {sandbox.host} tier" in err
    assert len(registry_connects) == 2, "a new connection for the full pass"
