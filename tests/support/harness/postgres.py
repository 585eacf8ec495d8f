"""A throwaway PostgreSQL 15 (Debian's) on a unix socket, for the lane queue tests.

Usage::

    from tests.support.harness.postgres import postgres_server

    @pytest.fixture(scope="module")
    def broker():
        with postgres_server() as pg:
            yield pg

    pg.dsn            postgresql://postgres@/postgres?host=<dir>
    pg.database(name) a fresh database on it (CREATE DATABASE), its DSN

    with postgres_server(listen_on="100.64.250.254", trusted_net="100.64.250.0/24") as pg:
        pg.tcp_dsn_of("phaze")   postgresql://postgres@100.64.250.254:5432/phaze

`listen_on` also serves clients in a network namespace (the e2e fleet's
containers): TCP on that one address, trusted from `trusted_net` only.

initdb and pg_ctl run as an unprivileged user: PostgreSQL refuses to run as
root, so as root they run as `postgres` (`runuser -u postgres`), which owns the
directory; otherwise as the caller. The server listens on no TCP port (`-h ''`),
only on its socket in the directory. It is stopped by its PID (the first line
of postmaster.pid: SIGINT, PostgreSQL's fast shutdown, then SIGKILL) in a
`finally`, so a failing test leaves nothing running.

A missing PostgreSQL fails the test (never skips); scripts/_env.sh installs
Debian's `postgresql` when run as root.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.harness.waiting import wait_until

BIN_DIRS = ("/usr/lib/postgresql/15/bin", "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/17/bin")


def postgres_bin() -> Path:
    for directory in BIN_DIRS:
        if (Path(directory) / "pg_ctl").exists():
            return Path(directory)
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    pytest.fail("real component missing: PostgreSQL (Debian's postgresql: scripts/test installs it when run as root)")


@dataclass
class PostgresServer:
    directory: Path
    pid: int
    as_user: list[str]
    listen_on: str | None = None

    def tcp_dsn_of(self, database: str) -> str:
        assert self.listen_on is not None, "postgres_server(listen_on=...) listens on TCP"
        return f"postgresql://postgres@{self.listen_on}:5432/{database}"

    @property
    def dsn(self) -> str:
        return self.dsn_of("postgres")

    def dsn_of(self, database: str) -> str:
        return f"postgresql://postgres@/{database}?host={self.directory}"

    def database(self, name: str) -> str:
        """Create the database `name` (fresh) and return its DSN."""
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.dsn_of(name)

    def log(self) -> str:
        path = self.directory / "log"
        return path.read_text(errors="replace") if path.exists() else ""


def _runas() -> tuple[list[str], int | None, int | None]:
    if os.geteuid() != 0:
        return [], None, None
    try:
        user = pwd.getpwnam("postgres")
    except KeyError:
        pytest.fail("running as root needs the user postgres (Debian's postgresql package creates it)")
    return ["runuser", "-u", "postgres", "--"], user.pw_uid, user.pw_gid


def stop_by_pid(pid: int, timeout: float = 30.0) -> None:
    """Fast shutdown (SIGINT) of the postmaster `pid`, then SIGKILL."""
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextmanager
def postgres_server(directory: Path | None = None, *, listen_on: str | None = None, trusted_net: str | None = None) -> Iterator[PostgresServer]:
    """Start PostgreSQL in `directory` (data in DIR/data, socket DIR/.s.PGSQL.5432);
    default a fresh directory under /tmp (short: a socket path has at most
    107 bytes), removed afterwards. The unprivileged user must be able to
    reach `directory`. With `listen_on` it listens on that address's port 5432
    too (initdb's pg_hba trusts loopback only: `trusted_net` is added)."""
    binaries = postgres_bin()
    runas, uid, gid = _runas()
    made = directory is None
    if directory is None:
        directory = Path(tempfile.mkdtemp(prefix="fabric-pg-"))
        directory.chmod(0o755)
    directory.mkdir(parents=True, exist_ok=True)
    if uid is not None and gid is not None:
        os.chown(directory, uid, gid)
    data = directory / "data"
    subprocess.run(
        [*runas, str(binaries / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"],
        check=True,
        capture_output=True,
        text=True,
    )
    if listen_on is not None:
        with open(data / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {trusted_net or listen_on + '/32'} trust\n")
    started = subprocess.run(
        [
            *runas,
            str(binaries / "pg_ctl"),
            "-D",
            str(data),
            "-o",
            f"-k {directory} -h '{listen_on or ''}' -c max_connections=300 -c fsync=off",
            "-l",
            str(directory / "log"),
            "-w",
            "start",
        ],
        capture_output=True,
        text=True,
    )
    pid_file = data / "postmaster.pid"
    pid = int(pid_file.read_text().split()[0]) if pid_file.exists() else None
    if started.returncode != 0 or pid is None:
        if pid is not None:
            stop_by_pid(pid)
        log = (directory / "log").read_text(errors="replace") if (directory / "log").exists() else ""
        raise AssertionError(f"PostgreSQL did not start: {started.stderr or started.stdout}\n{log}")
    server = PostgresServer(directory=directory, pid=pid, as_user=runas, listen_on=listen_on)
    try:
        wait_until(lambda: (directory / ".s.PGSQL.5432").exists(), timeout=30, what="PostgreSQL's socket")
        yield server
    finally:
        stop_by_pid(pid)
        if made:
            shutil.rmtree(directory, ignore_errors=True)


def broker_url_file(directory: Path, dsn: str) -> Path:
    """`dsn` in `directory`/queue_url, mode 0600: the file fabric.toml's
    [phaze] queue_url_file names on a host (`naming_broker`)."""
    url_file = directory / "queue_url"
    url_file.write_text(dsn)
    url_file.chmod(0o600)
    return url_file


def naming_broker(fabric_toml: str, url_file: Path) -> str:
    """fabric.toml's text with [phaze] queue_url_file set to `url_file`."""
    assert "[phaze]\n" in fabric_toml
    return fabric_toml.replace("[phaze]\n", f'[phaze]\nqueue_url_file = "{url_file}"\n', 1)
