"""What a program printed and how it ended (`reconciler.ports.CommandRunner`'s answer).

Here, not in reconciler.ports, so that a memoized pass can probe this machine
live (adapters.commands) without importing the ports' models.
"""

from __future__ import annotations

from dataclasses import dataclass


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
