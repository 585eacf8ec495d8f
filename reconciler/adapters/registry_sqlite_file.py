"""The embedded registry's sqlite file: opened safely, its schema, one transaction at a time,
and what a memoized pass asks of it, standard library only.

`SqliteFile` is the base of `reconciler.adapters.registry_sqlite.SqliteRegistry`
and, on its own, what a memoized pass (reconciler.engine.memoized_pass) opens:
its heartbeat as the JSON object the last full pass measured (`heartbeat_json`),
and the plan epoch. Nothing here imports a model, so a
memoized pass pays for no pydantic; the full registry's `heartbeat` stores its
record through the same `heartbeat_json`, so both beat by one rule.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reconciler.core.live.beat import stamped

if TYPE_CHECKING:
    from reconciler.ports import Clock

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY,
    record TEXT NOT NULL,          -- NodeRecord JSON (facts + beat_at + timeout_s)
    expires_at REAL NOT NULL       -- beat + timeout: silent past this = offline
);
-- NodeState JSON without what nodes.record holds (`stored_state`): a beat alone rewrites none
CREATE TABLE IF NOT EXISTS node_states (node_id TEXT PRIMARY KEY, state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS drains (node_id TEXT PRIMARY KEY, request TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leader (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    info TEXT NOT NULL,            -- LeaderInfo JSON
    token TEXT NOT NULL,
    expires_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS plan (id INTEGER PRIMARY KEY CHECK (id = 1), epoch INTEGER NOT NULL, plan TEXT NOT NULL);
-- The plan in parts (reconciler.core.live.plan_parts): the signed index (PlanIndex JSON)
-- and each part under the digest of its bytes (the table plan above: what versions before wrote)
CREATE TABLE IF NOT EXISTS plan_index (id INTEGER PRIMARY KEY CHECK (id = 1), epoch INTEGER NOT NULL, plan_index TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS plan_parts (digest TEXT PRIMARY KEY, part BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS scaling (id INTEGER PRIMARY KEY CHECK (id = 1), record TEXT NOT NULL);
-- fabric-watch's fast liveness record (issue 30): one cheap row write every couple of seconds
CREATE TABLE IF NOT EXISTS liveness (host TEXT PRIMARY KEY, expires_at REAL NOT NULL, ttl_s REAL NOT NULL);
-- A machine without a host file waiting for admission (PendingRecord JSON);
-- never read by the snapshot: it carries no authority. Expired past expires_at.
CREATE TABLE IF NOT EXISTS pending (node_id TEXT PRIMARY KEY, record TEXT NOT NULL, expires_at REAL NOT NULL);
-- A worker group's ephemeral member (MemberRecord JSON), under its group: the
-- leader admits it only for a group the desired state declares. Expired past expires_at.
CREATE TABLE IF NOT EXISTS members (group_name TEXT NOT NULL, node_id TEXT NOT NULL, record TEXT NOT NULL, expires_at REAL NOT NULL,
    PRIMARY KEY (group_name, node_id));
-- each edge's record of its Caddy's upstreams (issue 30), as the edge wrote it
CREATE TABLE IF NOT EXISTS edge_upstreams (edge TEXT PRIMARY KEY, record BLOB NOT NULL);
"""

# meta keys: the epoch counter, and a counter of membership changes (a node
# joined or came back, a drain or the leader changed) that wait_for_change polls.
EPOCH = "epoch"
CHANGES = "changes"
# The leader's term: raised by every campaign (a number no writer picks).
TERM = "term"


def untrusted_file(path: Path) -> str | None:
    """Why the registry file at `path` cannot be trusted, or None: writable by
    group or others, owned by another non-root user (the file and its -wal/-shm
    files), or in a directory group or others may write without the sticky bit."""
    me = os.geteuid()
    for candidate in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        try:
            st = candidate.stat()
        except FileNotFoundError:
            continue
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{candidate} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}; chmod 600 it)"
        if st.st_uid not in (0, me):
            return f"{candidate} is owned by another user (uid {st.st_uid}; chown it to root)"
    st = path.parent.stat()
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return f"its directory {path.parent} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _unavailable(message: str) -> Exception:
    # Imported here when raising, so opening the file costs a memoized pass no more.
    from reconciler.port_errors import RegistryUnavailable

    return RegistryUnavailable(message)


class SqliteFile:
    """The registry file, opened (created 0600 with its schema if it is not there)."""

    def __init__(self, path: str | Path, *, clock: Clock, busy_timeout_s: float = 10.0, opened: SqliteFile | None = None) -> None:
        """`opened`: the same file, opened already in this process (a memoized
        pass's file, for the full pass that follows it): its connection is
        shared, not opened again (reconciler.adapters.pass_connections)."""
        self.path = Path(path)
        self._clock = clock
        if opened is not None:
            if opened.path != self.path:
                raise ValueError(f"sqlite registry {self.path}: cannot share the connection of {opened.path}")
            self._lock, self._db = opened._lock, opened._db
            return
        self._lock = threading.Lock()
        try:
            self._create_private()
            refused = untrusted_file(self.path)
            if refused:
                raise _unavailable(f"sqlite registry {self.path}: refused: {refused}")
            self._db = sqlite3.connect(str(self.path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
            self._db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
        except (OSError, sqlite3.Error) as exc:
            raise _unavailable(f"sqlite registry {self.path}: {exc}") from exc
        with self._tx() as db:
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)

    # -- plumbing -------------------------------------------------------------

    def _create_private(self) -> None:
        """The directory (0700) and the file (0600), if they are not there yet,
        created before sqlite opens it (sqlite's own would follow the umask);
        its -wal and -shm files take the file's mode."""
        missing = [d for d in (self.path.parent, *self.path.parent.parents) if not d.exists()]
        for directory in reversed(missing):  # mkdir(parents=True) would give the parents the umask's mode
            directory.mkdir(mode=0o700, exist_ok=True)
        try:
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            pass

    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[sqlite3.Connection]:
        """One transaction. A write takes the write lock up front (BEGIN
        IMMEDIATE), so read-then-write sequences cannot interleave with another
        process; a read sees one consistent WAL snapshot."""
        with self._lock:
            db = self._db
            try:
                db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                yield db
                db.execute("COMMIT")
            except sqlite3.Error as exc:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise _unavailable(f"sqlite registry {self.path}: {exc}") from exc
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    def _now(self) -> float:
        return self._clock.now()

    @staticmethod
    def _meta(db: sqlite3.Connection, key: str) -> int:
        row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        if row is None:
            return 0
        if isinstance(row[0], int) and 0 <= row[0] < 2**63:
            return row[0]
        # Never trusted: a counter that is not one is the registry's error, not a crash.
        from reconciler.port_errors import RegistryError

        raise RegistryError(f"sqlite registry: unreadable {key} counter (not a number)")

    @staticmethod
    def _bump(db: sqlite3.Connection, key: str) -> int:
        db.execute(
            "INSERT INTO meta (key, value) VALUES (?, 1) ON CONFLICT(key) DO UPDATE SET value = value + 1",
            (key,),
        )
        return SqliteFile._meta(db, key)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- what a memoized pass asks ------------------------------------------------

    def heartbeat_json(self, record: dict[str, Any], ttl_s: float) -> dict[str, Any]:
        """Store `record` (a NodeRecord's JSON object, validated when it was
        measured) as the node's newest beat, alive for `ttl_s` seconds; the
        record as stored (beat_at, timeout_s set)."""
        now = self._now()
        stored = stamped(record, now=now, ttl_s=ttl_s)
        node_id = stored["node_id"]
        with self._tx() as db:
            row = db.execute("SELECT expires_at FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
            db.execute(
                "INSERT INTO nodes (node_id, record, expires_at) VALUES (?, ?, ?) "
                "ON CONFLICT(node_id) DO UPDATE SET record = excluded.record, expires_at = excluded.expires_at",
                (node_id, json.dumps(stored, separators=(",", ":"), ensure_ascii=False), now + ttl_s),
            )
            if row is None or row[0] <= now:
                self._bump(db, CHANGES)  # joined, or back after going silent
        return stored

    def epoch(self) -> int:
        with self._tx(write=False) as db:
            return self._meta(db, EPOCH)
