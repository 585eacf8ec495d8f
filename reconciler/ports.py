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
