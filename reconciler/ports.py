"""The small interfaces between the pure core and the world.

Each port is a `typing.Protocol`; `reconciler.adapters` holds the real
implementations and the tests hold fakes. The pure core depends on these
Protocols only, never on an adapter. `reconciler.cli` is the one place where
real adapters are chosen and wired in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch (wall clock; injected so tests never sleep)."""
        ...


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int | None  # None when the command could not run or timed out
    stdout: str = ""
    stderr: str = ""
    missing: bool = False  # the program is not installed
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.missing and not self.timed_out

    def failure(self) -> str | None:
        """Why the command gave no usable output, or None if it did."""
        if self.missing:
            return f"{self.argv[0]}: not installed"
        if self.timed_out:
            return f"{self.argv[0]}: timed out"
        if self.returncode != 0:
            detail = (self.stderr or self.stdout).strip().splitlines()
            return f"{self.argv[0]}: exit {self.returncode}" + (f": {detail[0][:200]}" if detail else "")
        return None


class CommandRunner(Protocol):
    def run(self, argv: Sequence[str], *, timeout: float = 10.0, stdin: str | None = None) -> CommandResult:
        """Run argv (never through a shell); never raises for a failing command."""
        ...


# --------------------------------------------------------------------------
# Activation (render, plan and apply). Each method raises ActivationError on
# failure, with the program's own words; `apply` turns that into a rollback.


class ActivationError(Exception):
    """An activation or validation step failed; the message says which and why."""


class Systemd(Protocol):
    """systemd's Manager over D-Bus. Unit names are full (`fabric-agent-x.service`)."""

    def daemon_reload(self) -> None: ...

    def start(self, unit: str) -> None:
        """Start and wait for the job to finish and the unit to settle."""
        ...

    def stop(self, unit: str) -> None: ...

    def restart(self, unit: str) -> None: ...

    def reload(self, unit: str) -> None: ...

    def active_state(self, unit: str) -> str:
        """'active', 'inactive', 'failed', ... ('inactive' for an unknown unit)."""
        ...


class Nftables(Protocol):
    """The table `inet fabric` only; never the whole ruleset."""

    def check(self, ruleset: str) -> None:
        """`nft -c -f`: raise ActivationError if the ruleset would not load."""
        ...

    def apply(self, ruleset: str) -> None:
        """Load the ruleset as one atomic transaction (`nft -f`)."""
        ...

    def table_loaded(self) -> bool:
        """Whether `table inet fabric` is in the kernel now: a distro's
        ruleset reload (flush ruleset) can drop it behind the fabric's back."""
        ...


class Caddy(Protocol):
    def validate(self, caddyfile: str) -> None:
        """`caddy validate` of the complete config that will be loaded."""
        ...

    def load(self, caddyfile: str) -> None:
        """Hand the config to the running Caddy (admin API); keep the old one on rejection."""
        ...


class UnitVerifier(Protocol):
    def verify(self, unit_paths: Sequence[str]) -> None:
        """`systemd-analyze verify` the rendered units; raise ActivationError on a problem."""
        ...


class Audit(Protocol):
    def record(self, action: str, outcome: str, **fields: str) -> None:
        """One audit entry: the journal (SYSLOG_IDENTIFIER=fabric-reconcile) or JSON on stderr."""
        ...


# --------------------------------------------------------------------------
# Registry (live state): see reconciler.registry for the Protocol and backends.


# --------------------------------------------------------------------------
# Probe: reading the machine's own files (/proc, /sys, /dev/dri) and keeping
# raw captures. The live adapters are in reconciler.adapters.probe_io.


class FileReader(Protocol):
    """Read-only access to the machine's files. Each method raises OSError
    (with its strerror) when the path cannot be read."""

    def read_text(self, path: str) -> str: ...

    def list_dir(self, path: str) -> list[str]:
        """Names in a directory, sorted."""
        ...

    def read_link(self, path: str) -> str:
        """The target of a symbolic link, as stored (often relative)."""
        ...


class CaptureStore(Protocol):
    """Raw probe outputs kept under fixed file names in one directory."""

    def save(self, directory: str, outputs: dict[str, str], errors: dict[str, str]) -> None:
        """Write every output as DIRECTORY/<name> at once (all or nothing)."""
        ...

    def load(self, directory: str) -> tuple[dict[str, str], dict[str, str]]:
        """(outputs, errors) as saved; a file that is not there is not in outputs."""
        ...


# --------------------------------------------------------------------------
# Files of a pass (render, plan and apply): the root the artifacts go to (the
# host's / or a sandbox) and the generations under its state directory. The
# adapter is reconciler.adapters.files.LocalTree.


class FileTree(Protocol):
    """Files under one root. Paths are relative to the root, '/'-separated,
    never absolute and never containing '..'."""

    def read(self, path: str) -> bytes | None:
        """The file's bytes, or None if there is no such file."""
        ...

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Atomically: temp file in the same directory, fsync, rename, fsync the directory."""
        ...

    def remove(self, path: str) -> None:
        """Remove a file (absent is fine) and fsync its directory."""
        ...

    def list_dir(self, path: str) -> list[str]:
        """Names in a directory, sorted; [] if there is no such directory."""
        ...

    def rename(self, source: str, target: str) -> None:
        """Atomic rename (a file or a whole directory), then fsync the directory."""
        ...

    def remove_tree(self, path: str) -> None:
        """Remove a directory and everything in it (absent is fine)."""
        ...

    def real_path(self, path: str) -> str:
        """The absolute path of `path` on this machine (for programs like systemd-analyze)."""
        ...


class PassLock(Protocol):
    """One pass at a time per host (flock on a lock file in the state directory)."""

    def acquire(self) -> None:
        """Take the lock or raise LockBusy at once."""
        ...

    def release(self) -> None: ...


class LockBusy(Exception):
    """Another pass holds the lock; the message names it."""
