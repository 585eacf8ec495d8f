"""CommandRunner over subprocess: no shell, a timeout, never raises for a failing program."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

from reconciler.core.command_result import CommandResult


class SubprocessRunner:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        # A fixed locale so parsers see the output they were written for.
        self._env = {**os.environ, "LC_ALL": "C", **(env or {})}

    def run(self, argv: Sequence[str], *, timeout: float = 10.0, stdin: str | None = None) -> CommandResult:
        argv = tuple(argv)
        try:
            proc = subprocess.run(
                argv,
                input=stdin,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=timeout,
                env=self._env,
                check=False,
            )
        except FileNotFoundError:
            return CommandResult(argv, None, missing=True)
        except PermissionError as exc:
            return CommandResult(argv, None, stderr=str(exc), missing=True)
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            return CommandResult(argv, None, stdout=out, timed_out=True)
        return CommandResult(argv, proc.returncode, proc.stdout, proc.stderr)
